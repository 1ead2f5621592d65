#include "moerl/rl/experience.hpp"

#include <openssl/evp.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>
#include <type_traits>

#include "moerl/core/error.hpp"

namespace moerl::rl {

namespace {
using nlohmann::json;

// A dataset example's line travels as "fields" (with "where"); the built-in tasks have neither.
json payload_json(const TaskPayload& p) {
    json j = {{"step", p.step},
              {"prompt_idx", p.prompt_idx},
              {"sample_idx", p.sample_idx},
              {"seed", p.seed},
              {"kind", p.problem.kind},
              {"prompt", p.problem.prompt},
              {"answer", p.problem.answer},
              {"prompt_tokens", p.prompt_tokens}};
    if (!p.problem.where.empty()) j["where"] = p.problem.where;
    if (!p.problem.fields.is_null()) j["fields"] = p.problem.fields;
    return j;
}
TaskPayload payload_from(const json& j) {
    TaskPayload p;
    p.step = j.at("step").get<int64_t>();
    p.prompt_idx = j.at("prompt_idx").get<int>();
    p.sample_idx = j.at("sample_idx").get<int>();
    p.seed = j.at("seed").get<uint64_t>();
    p.problem = {j.at("kind").get<std::string>(), j.at("prompt").get<std::string>(),
                 j.at("answer").get<std::string>()};
    p.prompt_tokens = j.at("prompt_tokens").get<std::vector<int>>();
    p.problem.where = j.value("where", std::string());
    if (j.contains("fields")) p.problem.fields = j.at("fields");
    return p;
}
// A trajectory's per-token arrays travel as base64 of their little-endian bytes, in an "arrays"
// object written last in the record ({..., "arrays": {"tokens": "...", ...}}): still JSON, but
// written and found without a JSON library's per-character work, which cost ~10x the base64
// itself (a routing record is [positions, layers, top_k] ids: ~1.5 MiB a 2k-token sample of a
// 48-layer model). Records of earlier versions (the arrays as JSON numbers inside "trajectory")
// are still read.
static_assert(std::endian::native == std::endian::little, "packed trajectory arrays are little-endian");
constexpr const char* kArraysKey = ",\"arrays\":{";

template <typename T>
void append_packed(std::string& out, const char* key, const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const size_t bytes = v.size() * sizeof(T);
    MOERL_CHECK(bytes < (size_t{1} << 30), "trajectory: ", key, ": ", bytes,
                " bytes in one array, more than a record holds");
    out += '"';
    out += key;
    out += "\":\"";
    const size_t at = out.size();
    out.resize(at + 4 * ((bytes + 2) / 3) + 1);
    const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data() + at),
                                  reinterpret_cast<const unsigned char*>(v.data()), static_cast<int>(bytes));
    out.resize(at + static_cast<size_t>(n));
    out += '"';
}

// `header` (a JSON object) with the trajectory's arrays appended as its last member.
std::string with_arrays(const json& header, const Trajectory& t) {
    std::string out = header.dump();
    out.pop_back();  // the object's '}'
    out += out.size() > 1 ? kArraysKey : kArraysKey + 1;
    append_packed(out, "tokens", t.tokens);
    out += ',';
    append_packed(out, "logprobs", t.logprobs);
    out += ',';
    append_packed(out, "versions", t.versions);
    out += ',';
    append_packed(out, "routing", t.routing);
    out += "}}";
    return out;
}

// The base64 texts of an "arrays" member, by key.
using PackedArrays = std::map<std::string, std::string_view, std::less<>>;

// Splits what with_arrays wrote into the header's text and the arrays; false (nothing changed) for
// any other text, which then goes to the JSON parser whole. The key cannot occur inside a JSON
// string (its quotes would be escaped) nor inside base64, so the last occurrence is the member
// written last, when the text ends with it.
bool split_arrays(const std::string& text, std::string& header, PackedArrays& arrays) {
    const size_t at = text.rfind(kArraysKey + 1);  // '"arrays":{', with or without the comma
    if (at == std::string::npos || text.size() < 2 || text.compare(text.size() - 2, 2, "}}") != 0)
        return false;
    PackedArrays found;
    size_t i = at + std::strlen(kArraysKey + 1);
    const size_t stop = text.size() - 2;
    while (i < stop) {
        if (text[i] != '"') return false;
        const size_t key_end = text.find('"', i + 1);
        if (key_end == std::string::npos || key_end + 2 >= stop || text.compare(key_end + 1, 2, ":\"") != 0)
            return false;
        const size_t value_end = text.find('"', key_end + 3);
        if (value_end == std::string::npos || value_end > stop) return false;
        found.emplace(text.substr(i + 1, key_end - i - 1),
                      std::string_view(text).substr(key_end + 3, value_end - key_end - 3));
        i = value_end + 1;
        if (i < stop && text[i++] != ',') return false;
    }
    const bool first = at > 0 && text[at - 1] == '{';
    if (!first && (at == 0 || text[at - 1] != ',')) return false;
    header = text.substr(0, first ? at : at - 1) + "}";
    arrays = std::move(found);
    return true;
}

template <typename T>
std::vector<T> unpack(std::string_view text, const char* key) {
    MOERL_CHECK(text.size() % 4 == 0 && text.size() < (size_t{1} << 31), "trajectory: ", key,
                " is not base64 (", text.size(), " characters)");
    std::vector<unsigned char> raw(text.size() / 4 * 3 + 1);
    const int n = EVP_DecodeBlock(raw.data(), reinterpret_cast<const unsigned char*>(text.data()),
                                  static_cast<int>(text.size()));
    MOERL_CHECK(n >= 0, "trajectory: ", key, " is not base64");
    // EVP_DecodeBlock counts the bytes of the padding too.
    size_t bytes = static_cast<size_t>(n);
    for (size_t i = text.size(); i > 0 && text[i - 1] == '='; --i) --bytes;
    MOERL_CHECK(bytes % sizeof(T) == 0, "trajectory: ", key, " holds ", bytes,
                " bytes, not a whole number of ", sizeof(T), "-byte values");
    std::vector<T> out(bytes / sizeof(T));
    if (bytes > 0) std::memcpy(out.data(), raw.data(), bytes);
    return out;
}

// An array from `arrays`, else from the trajectory's own member: base64 or (earlier records) JSON numbers.
template <typename T>
std::vector<T> array_of(const json& j, const PackedArrays& arrays, const char* key) {
    if (auto it = arrays.find(key); it != arrays.end()) return unpack<T>(it->second, key);
    const json& v = j.at(key);
    if (v.is_string()) return unpack<T>(v.get_ref<const std::string&>(), key);
    return v.get<std::vector<T>>();
}

json trajectory_header(const Trajectory& t) {
    return {{"num_moe_layers", t.num_moe_layers},
            {"top_k", t.top_k},
            {"terminated", t.terminated},
            {"rng_draws", t.rng_draws}};
}
Trajectory trajectory_from(const json& j, const PackedArrays& arrays) {
    Trajectory t;
    t.tokens = array_of<int>(j, arrays, "tokens");
    t.logprobs = array_of<float>(j, arrays, "logprobs");
    t.versions = array_of<int64_t>(j, arrays, "versions");
    t.routing = array_of<int16_t>(j, arrays, "routing");
    t.num_moe_layers = j.at("num_moe_layers").get<int>();
    t.top_k = j.at("top_k").get<int>();
    t.terminated = j.at("terminated").get<bool>();
    t.rng_draws = j.at("rng_draws").get<uint64_t>();
    MOERL_CHECK(t.logprobs.size() == t.tokens.size() && t.versions.size() == t.tokens.size(),
                "trajectory: ", t.tokens.size(), " tokens but ", t.logprobs.size(), " log-probs and ",
                t.versions.size(), " versions");
    return t;
}

// Parses `text` (a header and its arrays, or any JSON object) and hands both to f.
template <typename F>
auto parse(const std::string& text, const char* what, F f) {
    try {
        std::string header;
        PackedArrays arrays;
        if (split_arrays(text, header, arrays)) return f(json::parse(header), arrays);
        const json j = json::parse(text);
        if (j.is_object() && j.contains("arrays") && j.at("arrays").is_object()) {
            for (auto it = j.at("arrays").begin(); it != j.at("arrays").end(); ++it) {
                const json& value = it.value();
                if (value.is_string()) arrays.emplace(it.key(), value.get_ref<const std::string&>());
            }
        }
        return f(j, arrays);
    } catch (const json::exception& e) {
        MOERL_FAIL("malformed ", what, " record: ", e.what());
    }
}
}  // namespace

int64_t ExperienceRecord::oldest_version() const {
    if (trajectory.versions.empty()) return 0;
    return *std::min_element(trajectory.versions.begin(), trajectory.versions.end());
}

std::string to_json(const TaskPayload& p) { return payload_json(p).dump(); }
std::string to_json(const Trajectory& t) { return with_arrays(trajectory_header(t), t); }
std::string to_json(const ExperienceRecord& e) {
    return with_arrays(json{{"task_id", e.task_id},
                            {"attempt", e.attempt},
                            {"task", payload_json(e.task)},
                            {"trajectory", trajectory_header(e.trajectory)},
                            {"reward", e.reward},
                            {"correct", e.correct}},
                       e.trajectory);
}

TaskPayload task_payload_from_json(const std::string& text) {
    return parse(text, "task payload", [](const json& j, const PackedArrays&) { return payload_from(j); });
}
Trajectory trajectory_from_json(const std::string& text) {
    return parse(text, "trajectory",
                 [](const json& j, const PackedArrays& a) { return trajectory_from(j, a); });
}
ExperienceRecord experience_from_json(const std::string& text) {
    return parse(text, "experience", [](const json& j, const PackedArrays& a) {
        ExperienceRecord e;
        e.task_id = j.at("task_id").get<std::string>();
        e.attempt = j.at("attempt").get<int>();
        e.task = payload_from(j.at("task"));
        e.trajectory = trajectory_from(j.at("trajectory"), a);
        e.reward = j.at("reward").get<double>();
        e.correct = j.contains("correct") ? j.at("correct").get<bool>() : e.reward >= 1.0;
        return e;
    });
}

std::string task_id(int64_t step, int prompt_idx, int sample_idx) {
    return "s" + std::to_string(step) + "-p" + std::to_string(prompt_idx) + "-g" + std::to_string(sample_idx);
}

}  // namespace moerl::rl
