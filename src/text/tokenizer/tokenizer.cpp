// Loading tokenizer.json / tokenizer_config.json and the encode / decode pipeline.
#include "moerl/text/tokenizer.hpp"

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "added_tokens.hpp"
#include "bpe.hpp"
#include "internal.hpp"
#include "processors.hpp"

namespace moerl::text {

namespace detail {

struct TokenizerImpl {
    uint64_t uid;  // tells this tokenizer's per-thread caches from another's
    std::vector<AddedToken> added;
    TokenMatcher raw_matcher, normalized_matcher;
    std::unique_ptr<Normalizer> normalizer;
    std::unique_ptr<PreTokenizer> pre_tokenizer;
    bool byte_level_deferred = false;
    std::unique_ptr<Bpe> model;
    PostProcessor post;
    std::unique_ptr<Decoder> decoder;
    StringMap<int32_t> added_by_content;
    std::vector<int32_t> added_by_id;  // id -> index into added, or -1
    int32_t vocab_size = 0;
    TokenizerConfig config;
    std::optional<int32_t> bos, eos, pad;
};

namespace {

std::atomic<uint64_t> next_uid{1};

// Per-thread state of the encode pipeline.
struct Scratch {
    uint64_t owner = 0;
    Arena arena;
    std::vector<Piece> raw_split, normalized_split, pre_tokens;
    WordCache cache;
    MergeScratch merge;
};
Scratch& scratch_for(const TokenizerImpl& t) {
    thread_local Scratch s;
    if (s.owner != t.uid) {
        s.cache = WordCache{};
        s.owner = t.uid;
    }
    return s;
}

json parse_json(std::string_view text, const std::string& name) {
    try {
        return json::parse(text.begin(), text.end());
    } catch (const json::parse_error& e) {
        MOERL_FAIL(name, ": not valid JSON at byte ", e.byte, ": ", e.what());
    } catch (const json::out_of_range& e) {  // a number past a double's range, such as 1e400
        MOERL_FAIL(name, ": not valid JSON: ", e.what());
    }
}

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    MOERL_CHECK(in, "cannot read ", path);
    std::ostringstream os;
    os << in.rdbuf();
    return os.str();
}

// A special token in tokenizer_config.json: a string or {"content": ...}.
std::optional<std::string> config_token(const JsonNode& cfg, const char* key) {
    if (!cfg.has(key)) return std::nullopt;
    JsonNode n = cfg.at(key);
    if (n.raw().is_string()) return n.str();
    if (n.raw().is_object()) return n.at("content").str();
    n.fail("is neither a string nor {\"content\": ...}");
}

void load_config(TokenizerImpl& t, const json& j, const std::string& name) {
    JsonNode cfg(j, name);
    if (!j.is_object()) cfg.fail("is not an object");
    t.config.bos_token = config_token(cfg, "bos_token");
    t.config.eos_token = config_token(cfg, "eos_token");
    t.config.pad_token = config_token(cfg, "pad_token");
    t.config.unk_token = config_token(cfg, "unk_token");
    t.config.add_bos_token = cfg.bool_or("add_bos_token", false);
    t.config.add_eos_token = cfg.bool_or("add_eos_token", false);
    if (cfg.has("chat_template")) {
        JsonNode ct = cfg.at("chat_template");
        if (ct.raw().is_string()) {
            t.config.chat_template = ct.str();
        } else {  // a list of named templates: the one called "default"
            for (size_t i = 0; i < ct.size(); ++i)
                if (ct.at(i).at("name").str() == "default")
                    t.config.chat_template = ct.at(i).at("template").str();
        }
    }
}

std::optional<int32_t> lookup(const TokenizerImpl& t, std::string_view token) {
    auto a = t.added_by_content.find(token);
    if (a != t.added_by_content.end()) return a->second;
    auto m = t.model->vocab().find(token);
    if (m != t.model->vocab().end()) return m->second;
    return std::nullopt;
}

void load_tokenizer(TokenizerImpl& t, const json& j, const std::string& name) {
    JsonNode root(j, name);
    if (!j.is_object()) root.fail("is not an object");
    JsonNode model = root.at("model");
    std::string type = model.str_or("type", "BPE");
    if (type != "BPE") model.at("type").fail("'" + type + "' is not supported (only BPE)");
    t.model = std::make_unique<Bpe>(model);

    if (root.has("normalizer")) t.normalizer = make_normalizer(root.at("normalizer"));
    if (root.has("pre_tokenizer")) {
        // Subword affixes need the characters, so the model maps bytes itself only without them.
        t.pre_tokenizer = make_pre_tokenizer(root.at("pre_tokenizer"), t.model->supports_raw_bytes(),
                                             t.byte_level_deferred);
    }
    if (root.has("post_processor")) t.post = make_post_processor(root.at("post_processor"));
    if (root.has("decoder")) t.decoder = make_decoder(root.at("decoder"));

    int32_t max_id = static_cast<int32_t>(t.model->id_to_token().size()) - 1;
    if (root.has("added_tokens")) {
        // Ids as Hugging Face assigns them (the file's ids only confirm them): a token already in
        // the model's vocabulary takes that id, a new one the next id after the vocabulary and the
        // added tokens so far.
        const auto model_size = static_cast<int32_t>(t.model->vocab().size());
        int32_t max_added = -1;
        JsonNode list = root.at("added_tokens");
        for (size_t i = 0; i < list.size(); ++i) {
            JsonNode a = list.at(i);
            AddedToken tok{a.at("content").str(),
                           static_cast<int32_t>(a.at("id").integer()),
                           a.bool_or("special", false),
                           a.bool_or("lstrip", false),
                           a.bool_or("rstrip", false),
                           a.bool_or("single_word", false),
                           a.bool_or("normalized", !a.bool_or("special", false))};
            if (tok.content.empty()) continue;
            bool seen = false;
            for (const AddedToken& b : t.added) seen = seen || b.content == tok.content;
            if (seen) continue;
            auto in_model = t.model->vocab().find(tok.content);
            if (in_model != t.model->vocab().end())
                tok.id = in_model->second;
            else
                tok.id = max_added < 0 ? model_size : (max_added >= model_size ? max_added + 1 : model_size);
            max_added = std::max(max_added, tok.id);
            max_id = std::max(max_id, tok.id);
            t.added.push_back(std::move(tok));
        }
    }
    t.vocab_size = max_id + 1;
    // An id the post-processor adds past the vocabulary would index past the embedding rows.
    for (const std::vector<int32_t>* ids : {&t.post.before, &t.post.after})
        for (int32_t id : *ids)
            if (id >= t.vocab_size)
                root.at("post_processor")
                    .fail("adds token id " + std::to_string(id) + ", but the vocabulary has " +
                          std::to_string(t.vocab_size) + " ids");
    t.added_by_id.assign(t.vocab_size, -1);
    std::vector<const AddedToken*> raw, norm;
    std::vector<std::string> raw_patterns, norm_patterns;
    Arena arena;
    for (size_t k = 0; k < t.added.size(); ++k) {
        const AddedToken& a = t.added[k];
        t.added_by_content.emplace(a.content, a.id);
        t.added_by_id[a.id] = static_cast<int32_t>(k);
        if (a.normalized) {
            norm.push_back(&a);
            norm_patterns.emplace_back(t.normalizer ? t.normalizer->normalize(a.content, arena) : a.content);
        } else {
            raw.push_back(&a);
            raw_patterns.push_back(a.content);
        }
    }
    t.raw_matcher.build(raw, raw_patterns);
    t.normalized_matcher.build(norm, norm_patterns);
}

void encode_impl(const TokenizerImpl& t, std::string_view text, bool add_special, std::vector<int32_t>& ids) {
    size_t bad = find_invalid_utf8(text);
    MOERL_CHECK(bad == std::string_view::npos, "encode: the text is not valid UTF-8 at byte ", bad);
    Scratch& s = scratch_for(t);
    s.arena.reset();
    if (add_special) ids.insert(ids.end(), t.post.before.begin(), t.post.before.end());

    s.raw_split.clear();
    t.raw_matcher.split(text, s.raw_split);
    s.normalized_split.clear();
    for (const Piece& p : s.raw_split) {
        if (p.token >= 0) {
            s.normalized_split.push_back(p);
            continue;
        }
        std::string_view normalized = t.normalizer ? t.normalizer->normalize(p.view(), s.arena) : p.view();
        t.normalized_matcher.split(normalized, s.normalized_split);
    }
    const std::vector<Piece>* words = &s.normalized_split;
    if (t.pre_tokenizer) {
        s.pre_tokens.clear();
        t.pre_tokenizer->split(s.normalized_split, s.pre_tokens, s.arena);
        words = &s.pre_tokens;
    }
    for (const Piece& w : *words) {
        if (w.token >= 0)
            ids.push_back(w.token);
        else
            t.model->tokenize(w.view(), t.byte_level_deferred, ids, s.cache, s.merge);
    }
    if (add_special) ids.insert(ids.end(), t.post.after.begin(), t.post.after.end());
}

}  // namespace
}  // namespace detail

using detail::TokenizerImpl;

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               const std::string& name) {
    auto impl = std::make_unique<TokenizerImpl>();
    impl->uid = detail::next_uid++;
    detail::load_tokenizer(*impl, detail::parse_json(tokenizer_json, name), name);
    if (!config_json.empty()) {
        std::string cfg_name = (std::filesystem::path(name).parent_path() / "tokenizer_config.json").string();
        detail::load_config(*impl, detail::parse_json(config_json, cfg_name), cfg_name);
    }
    auto id_of = [&](const std::optional<std::string>& tok) -> std::optional<int32_t> {
        return tok ? detail::lookup(*impl, *tok) : std::nullopt;
    };
    impl->bos = id_of(impl->config.bos_token);
    impl->eos = id_of(impl->config.eos_token);
    impl->pad = id_of(impl->config.pad_token);
    return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::load(const std::string& path) {
    namespace fs = std::filesystem;
    fs::path file = path;
    if (fs::is_directory(file)) file /= "tokenizer.json";
    MOERL_CHECK(fs::is_regular_file(file), "tokenizer: ", file.string(), " does not exist");
    fs::path cfg = file.parent_path() / "tokenizer_config.json";
    std::string cfg_text = fs::is_regular_file(cfg) ? detail::read_file(cfg.string()) : std::string();
    return from_json(detail::read_file(file.string()), cfg_text, file.string());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    detail::encode_impl(*impl_, text, add_special_tokens, ids);
    return ids;
}

void Tokenizer::encode_into(std::string_view text, bool add_special_tokens, std::vector<int32_t>& ids) const {
    detail::encode_impl(*impl_, text, add_special_tokens, ids);
}

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(std::span<const std::string> texts,
                                                          bool add_special_tokens, int num_threads) const {
    std::vector<std::vector<int32_t>> out(texts.size());
    if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    num_threads = static_cast<int>(std::min<size_t>(num_threads, std::max<size_t>(texts.size(), 1)));
    std::atomic<size_t> next{0};
    std::exception_ptr error;
    std::mutex error_mutex;
    auto work = [&] {
        constexpr size_t kChunk = 16;
        for (;;) {
            size_t b = next.fetch_add(kChunk);
            if (b >= texts.size()) return;
            for (size_t i = b; i < std::min(b + kChunk, texts.size()); ++i) {
                try {
                    out[i] = encode(texts[i], add_special_tokens);
                } catch (...) {
                    std::lock_guard<std::mutex> lock(error_mutex);
                    if (!error) error = std::current_exception();
                }
            }
        }
    };
    std::vector<std::thread> threads;
    for (int k = 1; k < num_threads; ++k) threads.emplace_back(work);
    work();
    for (auto& th : threads) th.join();
    if (error) std::rethrow_exception(error);
    return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
        if (id < 0 || id >= impl_->vocab_size) continue;
        int32_t k = impl_->added_by_id[id];
        if (k >= 0) {
            const detail::AddedToken& a = impl_->added[k];
            if (!(skip_special_tokens && a.special)) tokens.push_back(a.content);
            continue;
        }
        if (static_cast<size_t>(id) < impl_->model->id_to_token().size()) {
            const std::string& t = impl_->model->id_to_token()[id];
            if (!t.empty()) tokens.push_back(t);
        }
    }
    if (!impl_->decoder) {
        std::string out;
        for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
        return out;
    }
    impl_->decoder->decode_chain(tokens);
    std::string out;
    for (const std::string& t : tokens) out += t;
    return out;
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
    if (id < 0 || id >= impl_->vocab_size) return std::nullopt;
    if (int32_t k = impl_->added_by_id[id]; k >= 0) return impl_->added[k].content;
    const auto& v = impl_->model->id_to_token();
    if (static_cast<size_t>(id) < v.size() && !v[id].empty()) return v[id];
    return std::nullopt;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
    return detail::lookup(*impl_, token);
}
int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
bool Tokenizer::is_special(int32_t id) const {
    if (id < 0 || id >= impl_->vocab_size) return false;
    int32_t k = impl_->added_by_id[id];
    return k >= 0 && impl_->added[k].special;
}
const TokenizerConfig& Tokenizer::config() const { return impl_->config; }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<int32_t> Tokenizer::pad_id() const { return impl_->pad; }

}  // namespace moerl::text
