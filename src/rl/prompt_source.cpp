// Prompt sources (the digit tasks, a JSONL dataset), the dataset's rewarder, and what the tokenizer
// decides in a run configuration.
#include "moerl/rl/prompt_source.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "moerl/core/error.hpp"

#if MOERL_HAVE_TEXT
#include "moerl/text/chat_template.hpp"
#include "moerl/text/dataset.hpp"
#include "moerl/text/tokenizer.hpp"
#include "moerl/text/verifier.hpp"
#endif

namespace moerl::rl {

namespace {
namespace fs = std::filesystem;

class TaskSource final : public PromptSource {
  public:
    explicit TaskSource(const RunConfig& c) : cfg_(c), gen_(make_task_generator(c.task)) {}
    Prompt train(int64_t step, int prompt_idx) const override {
        return make(
            mix_seed(mix_seed(cfg_.seed, static_cast<uint64_t>(step)), static_cast<uint64_t>(prompt_idx)));
    }
    int64_t eval_size() const override { return cfg_.eval.prompts; }
    // Seeds of their own: a training seed hits one of them only by a 64-bit collision.
    Prompt eval(int64_t i) const override {
        return make(mix_seed(mix_seed(cfg_.seed, 0xE7A1ULL), static_cast<uint64_t>(i)));
    }
    nlohmann::json state(int64_t) const override { return nullptr; }
    void check_state(const nlohmann::json&) const override {}

  private:
    Prompt make(uint64_t seed) const {
        Prompt p;
        p.problem = gen_->make(seed);
        p.tokens = {Tokenizer::kBos};
        auto ids = Tokenizer::get().encode(p.problem.prompt);
        p.tokens.insert(p.tokens.end(), ids.begin(), ids.end());
        return p;
    }
    const RunConfig cfg_;
    std::unique_ptr<TaskGenerator> gen_;
};

}  // namespace

uint64_t mix_seed(uint64_t a, uint64_t b) {
    uint64_t x = a * 0x9E3779B97F4A7C15ULL ^ (b + 0x632BE59BD9B4E019ULL + (a << 6) + (a >> 2));
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

#if MOERL_HAVE_TEXT

namespace {

// The directory of a tokenizer path (tokenizer.json or a directory holding one).
fs::path tokenizer_dir(const std::string& path) {
    return fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
}

// Tokenizers are immutable and thread-safe: one per path for the whole process.
std::shared_ptr<const text::Tokenizer> shared_tokenizer(const std::string& path) {
    static std::mutex mu;
    static std::map<std::string, std::shared_ptr<const text::Tokenizer>> cache;
    std::lock_guard<std::mutex> lock(mu);
    auto& t = cache[fs::absolute(path).lexically_normal().string()];
    if (!t) t = std::make_shared<const text::Tokenizer>(text::Tokenizer::load(path));
    return t;
}

std::optional<text::ChatTemplate> load_chat_template(const std::string& tokenizer_path) {
    const fs::path dir = tokenizer_dir(tokenizer_path);
    if (!fs::exists(dir / "tokenizer_config.json")) return std::nullopt;
    if (fs::exists(dir / "chat_template.jinja")) return text::ChatTemplate::load(dir);
    auto cfg = nlohmann::json::parse(std::ifstream(dir / "tokenizer_config.json"), nullptr, false);
    if (cfg.is_discarded() || !cfg.contains("chat_template") || cfg["chat_template"].is_null())
        return std::nullopt;
    return text::ChatTemplate::load(dir);
}

text::Example example_of(const Problem& p, const text::JsonlFormat& f) {
    text::Example e;
    e.where = p.where;
    e.prompt = p.prompt;
    e.answer = p.answer;
    e.fields = p.fields;
    if (p.fields.is_object()) {
        if (p.fields.contains(f.messages_field)) e.messages = p.fields[f.messages_field];
        const auto id = p.fields.find(f.id_field);
        e.id = id == p.fields.end() ? p.where : id->is_string() ? id->get<std::string>() : id->dump();
    }
    return e;
}

class DataSource final : public PromptSource {
  public:
    explicit DataSource(const RunConfig& c)
        : cfg_(c), tok_(shared_tokenizer(c.tokenizer_path)), dataset_(dataset_options(c)) {
        if (c.data.chat_template != 0) {
            tmpl_ = load_chat_template(c.tokenizer_path);
            MOERL_CHECK(tmpl_ || c.data.chat_template < 0, c.source, ": data.chat_template: true, but ",
                        (tokenizer_dir(c.tokenizer_path) / "tokenizer_config.json").string(),
                        " has no chat_template");
        }
        const auto& d = c.data.dataset;
        if (d.epochs > 0) {
            const uint64_t have = d.epochs * dataset_.train_size();
            const uint64_t need = static_cast<uint64_t>(c.steps) * static_cast<uint64_t>(c.prompts_per_step);
            MOERL_CHECK(need <= have, c.source, ": data.epochs: ", d.epochs, " epoch(s) of ", d.path,
                        " give ", have, " prompts, but run.steps x train.prompts_per_step = ", need,
                        ": set run.steps <= ", have / static_cast<uint64_t>(c.prompts_per_step),
                        " or raise data.epochs");
        }
    }

    Prompt train(int64_t step, int prompt_idx) const override {
        const uint64_t n = static_cast<uint64_t>(step) * static_cast<uint64_t>(cfg_.prompts_per_step) +
                           static_cast<uint64_t>(prompt_idx);
        return make(dataset_.train(dataset_.advance({}, n)));
    }
    int64_t eval_size() const override {
        return static_cast<int64_t>(
            std::min<uint64_t>(dataset_.eval_size(), static_cast<uint64_t>(cfg_.eval.prompts)));
    }
    Prompt eval(int64_t i) const override { return make(dataset_.eval(static_cast<uint64_t>(i))); }
    nlohmann::json state(int64_t env_next_step) const override {
        return dataset_.state(dataset_.advance(
            {}, static_cast<uint64_t>(env_next_step) * static_cast<uint64_t>(cfg_.prompts_per_step)));
    }
    void check_state(const nlohmann::json& state) const override {
        if (!state.is_null()) dataset_.restore(state);
    }

  private:
    static text::DatasetOptions dataset_options(const RunConfig& c) {
        text::DatasetOptions o = c.data.dataset;
        o.eval_limit = static_cast<uint64_t>(c.eval.prompts);
        o.eval_every = static_cast<uint64_t>(c.eval.every);
        return o;
    }

    Prompt make(const text::Example& e) const {
        Prompt p;
        p.problem.kind = "data";
        p.problem.answer = e.answer;
        p.problem.where = e.where;
        p.problem.fields = e.fields;
        std::string rendered;
        if (tmpl_) {
            nlohmann::ordered_json messages = nlohmann::ordered_json::array();
            if (!e.messages.is_null()) {
                messages = nlohmann::ordered_json::parse(e.messages.dump());
            } else {
                messages.push_back({{"role", "user"}, {"content", e.prompt}});
            }
            if (!cfg_.data.system_prompt.empty() &&
                (messages.empty() || messages[0].value("role", "") != "system"))
                messages.insert(messages.begin(), {{"role", "system"}, {"content", cfg_.data.system_prompt}});
            text::ChatTemplateOptions o;
            o.add_generation_prompt = true;
            o.variables = nlohmann::ordered_json::parse(cfg_.data.template_vars.dump());
            rendered = tmpl_->apply(messages, o);
        } else {
            if (!cfg_.data.system_prompt.empty()) rendered = cfg_.data.system_prompt + "\n";
            if (e.messages.is_null()) {
                rendered += e.prompt;
            } else {
                for (const auto& m : e.messages) {
                    if (m.contains("content") && m["content"].is_string())
                        rendered += m["content"].get<std::string>() + "\n";
                }
            }
        }
        p.problem.prompt = e.messages.is_null() ? e.prompt : rendered;
        // A template writes its own bos where the model wants one; raw text gets the tokenizer's.
        const std::vector<int32_t> ids = tok_->encode(rendered, /*add_special_tokens=*/!tmpl_);
        MOERL_CHECK(!ids.empty(), e.where, ": the prompt encodes to no tokens");
        MOERL_CHECK(static_cast<int>(ids.size()) <= cfg_.data.max_prompt_tokens, e.where, ": the prompt is ",
                    ids.size(), " tokens (after the chat template), above data.max_prompt_tokens = ",
                    cfg_.data.max_prompt_tokens, ": raise it or shorten the prompt");
        p.tokens.assign(ids.begin(), ids.end());
        return p;
    }

    const RunConfig cfg_;
    std::shared_ptr<const text::Tokenizer> tok_;
    text::Dataset dataset_;
    std::optional<text::ChatTemplate> tmpl_;
};

// The verifier mix over responses decoded by the run's tokenizer (the stop token left out).
class TextRewarder final : public Rewarder {
  public:
    explicit TextRewarder(const RunConfig& c)
        : tok_(shared_tokenizer(c.tokenizer_path)),
          format_(c.data.dataset.format),
          stop_(c.sampling.stop_tokens.begin(), c.sampling.stop_tokens.end()),
          truncated_scale_(c.truncated_scale) {
        for (const auto& spec : c.verifiers) {
            parts_.push_back(text::make_verifier(spec));
            weights_.push_back(spec.weight);
        }
    }
    std::vector<double> score(const std::vector<Scored>& batch) override {
        std::vector<bool> correct;
        return score_and_check(batch, correct);
    }
    std::vector<double> score_and_check(const std::vector<Scored>& batch,
                                        std::vector<bool>& correct) override {
        std::vector<std::string> responses;
        std::vector<text::Example> examples;
        responses.reserve(batch.size());
        examples.reserve(batch.size());
        for (const auto& s : batch) {
            std::vector<int32_t> ids(s.response_tokens.begin(), s.response_tokens.end());
            if (!ids.empty() && stop_.count(ids.back())) ids.pop_back();
            responses.push_back(tok_->decode(ids));
            examples.push_back(example_of(s.problem, format_));
        }
        std::vector<text::Scoring> items;
        for (size_t i = 0; i < batch.size(); ++i) items.push_back({responses[i], &examples[i]});
        std::vector<double> total(batch.size(), 0.0);
        correct.assign(batch.size(), false);
        for (size_t p = 0; p < parts_.size(); ++p) {
            const std::vector<text::Verdict> v = parts_[p]->score_batch(items);
            for (size_t i = 0; i < batch.size(); ++i) {
                total[i] += weights_[p] * v[i].reward;
                if (p == 0) correct[i] = v[i].reward >= 1.0;
            }
        }
        for (size_t i = 0; i < batch.size(); ++i) {
            if (!batch[i].terminated) total[i] *= truncated_scale_;
        }
        return total;
    }

  private:
    std::shared_ptr<const text::Tokenizer> tok_;
    text::JsonlFormat format_;
    std::set<int> stop_;
    double truncated_scale_;
    std::vector<std::unique_ptr<text::Verifier>> parts_;
    std::vector<double> weights_;
};

// End-of-turn tokens of the chat formats moerl knows, stopped at besides the eos token.
constexpr const char* kEndOfTurn[] = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>",
                                      "<|end|>",    "<|return|>",    "<|eom_id|>"};

}  // namespace

std::unique_ptr<PromptSource> make_prompt_source(const RunConfig& c) {
    if (!c.use_data) return std::make_unique<TaskSource>(c);
    return std::make_unique<DataSource>(c);
}

std::unique_ptr<Rewarder> make_prompt_rewarder(const RunConfig& c) {
    if (!c.use_data) return make_verifier_rewarder(c.task);
    return std::make_unique<TextRewarder>(c);
}

int token_id(const RunConfig& c, const std::string& name, const std::string& key) {
    MOERL_CHECK(!c.tokenizer_path.empty(), c.source, ": ", key,
                ": token names need a tokenizer (tokenizer.path)");
    auto id = shared_tokenizer(c.tokenizer_path)->token_to_id(name);
    MOERL_CHECK(id.has_value(), c.source, ": ", key, ": '", name, "' is not a token of ", c.tokenizer_path);
    return *id;
}

std::string decode_response(const RunConfig& c, const std::vector<int>& tokens) {
    if (!c.use_data) return Tokenizer::get().decode(tokens);
    const std::vector<int32_t> ids(tokens.begin(), tokens.end());
    return shared_tokenizer(c.tokenizer_path)->decode(ids);
}

std::vector<int> encode_response(const RunConfig& c, const std::string& text) {
    if (!c.use_data) return Tokenizer::get().encode(text);
    const std::vector<int32_t> ids = shared_tokenizer(c.tokenizer_path)->encode(text, false);
    return {ids.begin(), ids.end()};
}

int response_vocab_size(const RunConfig& c) {
    if (!c.use_data) return Tokenizer::get().vocab_size();
    return shared_tokenizer(c.tokenizer_path)->vocab_size();
}

void resolve_text_config(RunConfig& c, const std::vector<std::string>& stop_token_names,
                         bool vocab_size_given) {
    const std::string& s = c.source;
    if (c.tokenizer_path.empty() && c.use_data && !c.model_path.empty() &&
        fs::exists(fs::path(c.model_path) / "tokenizer.json"))
        c.tokenizer_path = c.model_path;
    MOERL_CHECK(!c.use_data || !c.tokenizer_path.empty(), s,
                ": tokenizer.path: data needs a tokenizer (tokenizer.json, or a model.path holding one)");
    MOERL_CHECK(stop_token_names.empty() || !c.tokenizer_path.empty(), s,
                ": rollout.stop_tokens: token names need a tokenizer (tokenizer.path)");
    if (c.tokenizer_path.empty()) return;
    MOERL_CHECK(c.use_data, s,
                ": tokenizer.path: only with data: (the built-in tasks of task: have their own ",
                Tokenizer::get().vocab_size(), "-symbol vocabulary)");
    MOERL_CHECK(fs::exists(c.tokenizer_path), s, ": tokenizer.path: ", c.tokenizer_path, " does not exist");
    std::shared_ptr<const text::Tokenizer> tok;
    try {
        tok = shared_tokenizer(c.tokenizer_path);
    } catch (const Error& e) {
        MOERL_FAIL(s, ": tokenizer.path: ", e.message());
    }
    const int vocab = tok->vocab_size();
    if (c.model_path.empty()) {
        if (!vocab_size_given) c.model.vocab_size = vocab;
        MOERL_CHECK(c.model.vocab_size >= vocab, s, ": model.vocab_size: ", c.model.vocab_size,
                    " is below the tokenizer's vocabulary (", vocab, " tokens, ", c.tokenizer_path, ")");
    } else {
        MOERL_CHECK(c.model.vocab_size >= vocab, s, ": tokenizer.path: the tokenizer ", c.tokenizer_path,
                    " has ", vocab, " tokens, but the checkpoint ", c.model_path,
                    " embeds only vocab_size = ", c.model.vocab_size, ": they do not belong together");
    }
    if (!stop_token_names.empty()) {
        for (const auto& name : stop_token_names) {
            auto id = tok->token_to_id(name);
            MOERL_CHECK(id.has_value(), s, ": rollout.stop_tokens: '", name, "' is not a token of ",
                        c.tokenizer_path);
            c.sampling.stop_tokens.push_back(*id);
        }
    } else if (!c.stop_tokens_given) {
        std::vector<int> stops;
        if (auto eos = tok->eos_id()) stops.push_back(*eos);
        for (const char* t : kEndOfTurn) {
            if (auto id = tok->token_to_id(t);
                id && std::find(stops.begin(), stops.end(), *id) == stops.end())
                stops.push_back(*id);
        }
        MOERL_CHECK(!stops.empty(), s, ": rollout.stop_tokens: the tokenizer ", c.tokenizer_path,
                    " names no eos token and has no known end-of-turn token: list the stop tokens");
        c.sampling.stop_tokens = stops;
    }
    for (int id : c.sampling.stop_tokens) {
        MOERL_CHECK(id >= 0 && id < c.model.vocab_size, s, ": rollout.stop_tokens: ", id,
                    " is outside the vocabulary (", c.model.vocab_size, ")");
    }
    if (c.data.chat_template > 0) {
        MOERL_CHECK(load_chat_template(c.tokenizer_path).has_value(), s,
                    ": data.chat_template: true, but the tokenizer at ", c.tokenizer_path,
                    " has no chat_template");
    }
    if (c.verifiers.empty()) c.verifiers.push_back(text::VerifierSpec{.kind = "math"});
    for (size_t i = 0; i < c.verifiers.size(); ++i) {
        try {
            c.verifiers[i].validate();
            if (c.verifiers[i].kind != "external") text::make_verifier(c.verifiers[i]);  // compiles patterns
        } catch (const Error& e) {
            MOERL_FAIL(s, ": reward.verifiers[", i, "]: ", e.message());
        }
    }
    try {
        c.data.dataset.validate_options();
    } catch (const Error& e) {
        MOERL_FAIL(s, ": ", e.message());
    }
}

void copy_tokenizer_files(const RunConfig& c, const std::string& dir) {
    if (c.tokenizer_path.empty()) return;
    const fs::path from = tokenizer_dir(c.tokenizer_path);
    fs::create_directories(dir);
    const fs::path json_file =
        fs::is_directory(c.tokenizer_path) ? from / "tokenizer.json" : fs::path(c.tokenizer_path);
    fs::copy_file(json_file, fs::path(dir) / "tokenizer.json", fs::copy_options::overwrite_existing);
    for (const char* name : {"tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                             "generation_config.json"}) {
        if (fs::exists(from / name) && !fs::equivalent(from, dir))
            fs::copy_file(from / name, fs::path(dir) / name, fs::copy_options::overwrite_existing);
    }
}

#else  // no text layer

std::unique_ptr<PromptSource> make_prompt_source(const RunConfig& c) {
    MOERL_CHECK(!c.use_data, c.source, ": data: this build has no text layer");
    return std::make_unique<TaskSource>(c);
}

std::unique_ptr<Rewarder> make_prompt_rewarder(const RunConfig& c) {
    MOERL_CHECK(!c.use_data, c.source, ": data: this build has no text layer");
    return make_verifier_rewarder(c.task);
}

void resolve_text_config(RunConfig& c, const std::vector<std::string>& stop_token_names, bool) {
    const char* why =
        ": this build of moerl has no text layer (Hugging Face tokenizers, datasets, verifiers): "
        "install libpcre2-dev and libutf8proc-dev and configure again";
    MOERL_CHECK(!c.use_data, c.source, ": data", why);
    MOERL_CHECK(c.tokenizer_path.empty(), c.source, ": tokenizer.path", why);
    MOERL_CHECK(stop_token_names.empty(), c.source, ": rollout.stop_tokens (token names)", why);
    MOERL_CHECK(c.verifiers.empty(), c.source, ": reward.verifiers", why);
}

void copy_tokenizer_files(const RunConfig&, const std::string&) {}

std::string decode_response(const RunConfig&, const std::vector<int>& tokens) {
    return Tokenizer::get().decode(tokens);
}

std::vector<int> encode_response(const RunConfig&, const std::string& text) {
    return Tokenizer::get().encode(text);
}

int response_vocab_size(const RunConfig&) { return Tokenizer::get().vocab_size(); }

int token_id(const RunConfig& c, const std::string&, const std::string& key) {
    MOERL_FAIL(c.source, ": ", key, ": token names need the text layer, which this build lacks");
}

#endif

}  // namespace moerl::rl
