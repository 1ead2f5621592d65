#include "moerl/rl/experience.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

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
json trajectory_json(const Trajectory& t) {
    return {{"tokens", t.tokens},
            {"logprobs", t.logprobs},
            {"versions", t.versions},
            {"routing", t.routing},
            {"num_moe_layers", t.num_moe_layers},
            {"top_k", t.top_k},
            {"terminated", t.terminated},
            {"rng_draws", t.rng_draws}};
}
Trajectory trajectory_from(const json& j) {
    Trajectory t;
    t.tokens = j.at("tokens").get<std::vector<int>>();
    t.logprobs = j.at("logprobs").get<std::vector<float>>();
    t.versions = j.at("versions").get<std::vector<int64_t>>();
    t.routing = j.at("routing").get<std::vector<int16_t>>();
    t.num_moe_layers = j.at("num_moe_layers").get<int>();
    t.top_k = j.at("top_k").get<int>();
    t.terminated = j.at("terminated").get<bool>();
    t.rng_draws = j.at("rng_draws").get<uint64_t>();
    MOERL_CHECK(t.logprobs.size() == t.tokens.size() && t.versions.size() == t.tokens.size(),
                "trajectory: ", t.tokens.size(), " tokens but ", t.logprobs.size(), " log-probs and ",
                t.versions.size(), " versions");
    return t;
}

template <typename F>
auto parse(const std::string& text, const char* what, F f) {
    try {
        return f(json::parse(text));
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
std::string to_json(const Trajectory& t) { return trajectory_json(t).dump(); }
std::string to_json(const ExperienceRecord& e) {
    return json{{"task_id", e.task_id},
                {"attempt", e.attempt},
                {"task", payload_json(e.task)},
                {"trajectory", trajectory_json(e.trajectory)},
                {"reward", e.reward}}
        .dump();
}

TaskPayload task_payload_from_json(const std::string& text) {
    return parse(text, "task payload", [](const json& j) { return payload_from(j); });
}
Trajectory trajectory_from_json(const std::string& text) {
    return parse(text, "trajectory", [](const json& j) { return trajectory_from(j); });
}
ExperienceRecord experience_from_json(const std::string& text) {
    return parse(text, "experience", [](const json& j) {
        ExperienceRecord e;
        e.task_id = j.at("task_id").get<std::string>();
        e.attempt = j.at("attempt").get<int>();
        e.task = payload_from(j.at("task"));
        e.trajectory = trajectory_from(j.at("trajectory"));
        e.reward = j.at("reward").get<double>();
        return e;
    });
}

std::string task_id(int64_t step, int prompt_idx, int sample_idx) {
    return "s" + std::to_string(step) + "-p" + std::to_string(prompt_idx) + "-g" + std::to_string(sample_idx);
}

}  // namespace moerl::rl
