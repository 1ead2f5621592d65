// Strict YAML parsing of the run configuration.
#include "moerl/rl/config.hpp"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include "moerl/core/error.hpp"
#include "moerl/rl/prompt_source.hpp"

namespace moerl::rl {

namespace {

// Reads one mapping, remembering which keys were used, and fails on the rest.
class Section {
  public:
    Section(const YAML::Node& node, std::string path, const std::string& source)
        : node_(node), path_(std::move(path)), source_(source) {
        MOERL_CHECK(!node || node.IsNull() || node.IsMap(), source_, ": ",
                    path_.empty() ? "top level" : path_, ": expected a mapping");
    }

    std::string where(const std::string& key) const {
        return source_ + ": " + (path_.empty() ? "" : path_ + ".") + key;
    }

    std::string scalar(const std::string& key, const char* expected) {
        const YAML::Node v = node_[key];
        MOERL_CHECK(v.IsScalar(), where(key), ": expected ", expected, ", got a ",
                    v.IsMap() ? "mapping" : "sequence");
        return v.Scalar();
    }

    void integer(const std::string& key, int64_t lo, int64_t hi, int64_t& out) {
        if (!take(key)) return;
        std::string expected = "an integer " + range(lo, hi);
        std::string s = scalar(key, expected.c_str());
        size_t used = 0;
        int64_t v = 0;
        try {
            v = std::stoll(s, &used);
        } catch (...) {
            used = 0;
        }
        MOERL_CHECK(used == s.size() && !s.empty(), where(key), ": expected ", expected, ", got '", s, "'");
        MOERL_CHECK(v >= lo && v <= hi, where(key), ": expected ", expected, ", got ", v);
        out = v;
    }
    void integer(const std::string& key, int64_t lo, int64_t hi, int& out) {
        int64_t v = out;
        integer(key, lo, hi, v);
        out = static_cast<int>(v);
    }
    void unsigned_integer(const std::string& key, uint64_t& out) {
        int64_t v = static_cast<int64_t>(out);
        integer(key, 0, INT64_MAX, v);
        out = static_cast<uint64_t>(v);
    }
    void number(const std::string& key, double lo, double hi, double& out, bool lo_open = false) {
        if (!take(key)) return;
        std::string expected = std::string("a number ") + (lo_open ? "> " : ">= ") + fmt(lo) +
                               (hi < 1e300 ? " and <= " + fmt(hi) : "");
        std::string s = scalar(key, expected.c_str());
        size_t used = 0;
        double v = 0;
        try {
            v = std::stod(s, &used);
        } catch (...) {
            used = 0;
        }
        MOERL_CHECK(used == s.size() && !s.empty(), where(key), ": expected ", expected, ", got '", s, "'");
        MOERL_CHECK((lo_open ? v > lo : v >= lo) && v <= hi, where(key), ": expected ", expected, ", got ",
                    s);
        out = v;
    }
    void boolean(const std::string& key, bool& out) {
        if (!take(key)) return;
        std::string s = scalar(key, "true or false");
        if (s == "true" || s == "yes" || s == "on")
            out = true;
        else if (s == "false" || s == "no" || s == "off")
            out = false;
        else
            MOERL_FAIL(where(key), ": expected true or false, got '", s, "'");
    }
    void string(const std::string& key, std::string& out) {
        if (!take(key)) return;
        out = scalar(key, "a string");
    }
    void choice(const std::string& key, const std::set<std::string>& allowed, std::string& out) {
        if (!take(key)) return;
        std::string s = scalar(key, "a string");
        std::string list;
        for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
        MOERL_CHECK(allowed.count(s) > 0, where(key), ": expected one of ", list, ", got '", s, "'");
        out = s;
    }
    YAML::Node child(const std::string& key) {
        take(key);
        return node_[key];
    }
    // Whether the key is present (and not null), without marking it read.
    bool given(const std::string& key) const {
        return node_ && node_.IsMap() && node_[key] && !node_[key].IsNull();
    }
    void finish() const {
        if (!node_ || !node_.IsMap()) return;
        std::string known;
        for (const auto& k : used_) known += (known.empty() ? "" : ", ") + k;
        for (const auto& kv : node_) {
            const std::string k = kv.first.Scalar();
            MOERL_CHECK(used_.count(k) > 0, where(k), ": unknown key (known keys here: ", known, ")");
        }
    }

  private:
    bool take(const std::string& key) {
        used_.insert(key);
        return node_ && node_.IsMap() && node_[key] && !node_[key].IsNull();
    }
    static std::string fmt(double v) {
        std::ostringstream os;
        os << v;
        return os.str();
    }
    static std::string range(int64_t lo, int64_t hi) {
        if (hi == INT64_MAX || hi == INT32_MAX) return ">= " + std::to_string(lo);
        return "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    }

    YAML::Node node_;
    std::string path_;
    const std::string& source_;
    std::set<std::string> used_;
};

// A YAML value as JSON (template variables): scalars become booleans, integers, numbers or strings.
nlohmann::json to_json(const YAML::Node& n) {
    if (!n || n.IsNull()) return nullptr;
    if (n.IsSequence()) {
        nlohmann::json a = nlohmann::json::array();
        for (const auto& e : n) a.push_back(to_json(e));
        return a;
    }
    if (n.IsMap()) {
        nlohmann::json o = nlohmann::json::object();
        for (const auto& kv : n) o[kv.first.Scalar()] = to_json(kv.second);
        return o;
    }
    const std::string& v = n.Scalar();
    if (n.Tag() == "!") return v;  // quoted
    if (v == "true" || v == "True") return true;
    if (v == "false" || v == "False") return false;
    size_t used = 0;
    try {
        const long long i = std::stoll(v, &used);
        if (used == v.size()) return i;
        const double d = std::stod(v, &used);
        if (used == v.size()) return d;
    } catch (...) {
    }
    return v;
}

// One entry of reward.verifiers: kind and weight, then the options of that kind only.
text::VerifierSpec parse_verifier(const YAML::Node& node, const std::string& path,
                                  const std::string& source) {
    MOERL_CHECK(node.IsMap(), source, ": ", path, ": expected a mapping like {kind: math, weight: 1.0}");
    Section s(node, path, source);
    text::VerifierSpec v;
    MOERL_CHECK(s.given("kind"), s.where("kind"), ": required (math, countdown, exact, format or external)");
    s.choice("kind", {"math", "countdown", "exact", "format", "external"}, v.kind);
    s.number("weight", 0, 1e300, v.weight);
    if (v.kind == "math") {
        s.number("relative_tolerance", 0, 0.999999, v.math.relative_tolerance);
    } else if (v.kind == "countdown") {
        s.string("numbers_field", v.countdown.numbers_field);
        s.string("target_field", v.countdown.target_field);
        s.boolean("use_all", v.countdown.use_all);
        s.boolean("integer_only", v.countdown.integer_only);
    } else if (v.kind == "exact") {
        s.string("extract", v.exact.extract);
        s.boolean("ignore_case", v.exact.ignore_case);
        s.boolean("normalize_whitespace", v.exact.normalize_whitespace);
    } else if (v.kind == "format") {
        s.string("pattern", v.format.pattern);
        s.boolean("dotall", v.format.dotall);
    } else {
        const YAML::Node cmd = s.child("command");
        MOERL_CHECK(cmd && !cmd.IsNull(), s.where("command"),
                    ": required (a command line, or a list of program and arguments)");
        if (cmd.IsScalar()) {
            v.external.command = {cmd.Scalar()};
        } else {
            MOERL_CHECK(cmd.IsSequence() && cmd.size() > 0, s.where("command"),
                        ": expected a string or a list of strings");
            for (const auto& a : cmd) {
                MOERL_CHECK(a.IsScalar(), s.where("command"), ": expected a list of strings");
                v.external.command.push_back(a.Scalar());
            }
        }
        int64_t timeout_ms = 30000, startup_ms = 60000;
        s.integer("timeout_ms", 1, INT64_MAX, timeout_ms);
        s.integer("startup_timeout_ms", 0, INT64_MAX, startup_ms);
        v.external.timeout_s = static_cast<double>(timeout_ms) / 1000.0;
        v.external.startup_timeout_s = static_cast<double>(startup_ms) / 1000.0;
        s.integer("max_restarts", 0, 1000, v.external.max_restarts);
        s.string("working_dir", v.external.working_dir);
    }
    s.finish();
    return v;
}

// Every key of a section must be read, even when the section is absent.
void section(const std::string& name, const std::string& source, const std::function<void(Section&)>& body,
             Section& top) {
    Section s(top.child(name), name, source);
    body(s);
    s.finish();
}

// yaml-cpp keeps both entries of a key given twice in one mapping, and lookups see the first
// only: a second `run:` block would be ignored without a word.
void check_unique_keys(const YAML::Node& node, const std::string& source, const std::string& path) {
    if (node.IsSequence()) {
        for (size_t i = 0; i < node.size(); ++i)
            check_unique_keys(node[i], source, path + "[" + std::to_string(i) + "]");
        return;
    }
    if (!node.IsMap()) return;
    std::map<std::string, int> first_line;
    for (const auto& kv : node) {
        const std::string key = kv.first.IsScalar() ? kv.first.Scalar() : "?";
        const int line = kv.first.Mark().line + 1;
        auto [it, fresh] = first_line.emplace(key, line);
        MOERL_CHECK(fresh, source, ":", line, ": ", path.empty() ? "" : path + ".", key,
                    ": duplicate key (first given on line ", it->second, ")");
        check_unique_keys(kv.second, source, path.empty() ? key : path + "." + key);
    }
}

constexpr size_t kMaxConfigBytes = 1 << 20;  // far above any real config; refused before parsing

}  // namespace

RunConfig RunConfig::from_yaml_text(const std::string& text, const std::string& source) {
    RunConfig c;
    c.source = source;
    // Defaults of the tiny quickstart model.
    model::ModelConfig& m = c.model;
    m.vocab_size = Tokenizer::get().vocab_size();
    m.hidden_size = 64;
    m.num_hidden_layers = 2;
    m.num_attention_heads = 4;
    m.num_key_value_heads = 2;
    m.head_dim = 16;
    m.moe_intermediate_size = 64;
    m.intermediate_size = 128;
    m.num_experts = 8;
    m.num_experts_per_tok = 2;
    m.norm_topk_prob = true;
    m.max_position_embeddings = 64;
    m.router_aux_loss_coef = 0.01;
    m.torch_dtype = "float32";
    m.tie_word_embeddings = false;

    MOERL_CHECK(text.size() <= kMaxConfigBytes, source, ": ", text.size(), " bytes; a config is at most ",
                kMaxConfigBytes, " bytes");
    std::vector<std::string> stop_token_names, allowed_token_names;
    YAML::Node root;
    try {
        root = YAML::Load(text);
    } catch (const YAML::Exception& e) {
        MOERL_FAIL(source, ": not valid YAML: ", e.what());
    }
    check_unique_keys(root, source, "");
    MOERL_CHECK(root.IsMap() || root.IsNull(), source, ": expected a mapping of sections at the top level");
    Section top(root, "", source);
    int64_t steps = c.steps;
    section(
        "run", source,
        [&](Section& s) {
            s.string("name", c.name);
            s.unsigned_integer("seed", c.seed);
            s.integer("steps", 1, 10'000'000, steps);
            s.string("output_dir", c.output_dir);
            s.integer("checkpoint_every", 0, INT64_MAX, c.checkpoint_every);
            s.integer("keep_checkpoints", 1, 1000, c.keep_checkpoints);
            s.number("stop_at_reward", 0, 1, c.stop_at_reward);
            s.integer("threads", 1, 256, c.threads);
        },
        top);
    c.steps = steps;
    bool vocab_size_given = false, max_positions_given = false;
    section(
        "model", source,
        [&](Section& s) {
            s.string("path", c.model_path);
            if (!c.model_path.empty()) {
                // The checkpoint's config.json gives the shape: a shape key here would be ignored.
                for (const auto& kv : root["model"]) {
                    const std::string k = kv.first.Scalar();
                    MOERL_CHECK(k == "path", s.where(k), ": not with model.path (the shape comes from ",
                                c.model_path, "/config.json)");
                }
                MOERL_CHECK(std::filesystem::exists(std::filesystem::path(c.model_path) / "config.json"),
                            s.where("path"), ": ", c.model_path,
                            " is not a Hugging Face checkpoint directory (no config.json)");
                try {
                    m = model::ModelConfig::load(c.model_path);
                } catch (const Error& e) {
                    MOERL_FAIL(s.where("path"), ": ", e.message());
                }
            }
            vocab_size_given = s.given("vocab_size");
            max_positions_given = s.given("max_position_embeddings");
            s.integer("vocab_size", 1, 1 << 24, m.vocab_size);
            s.integer("max_position_embeddings", 1, 1 << 24, m.max_position_embeddings);
            s.integer("hidden_size", 8, 65536, m.hidden_size);
            s.integer("num_layers", 1, 256, m.num_hidden_layers);
            s.integer("num_heads", 1, 1024, m.num_attention_heads);
            s.integer("num_kv_heads", 1, 1024, m.num_key_value_heads);
            s.integer("head_dim", 2, 1024, m.head_dim);
            s.integer("moe_intermediate_size", 1, 1 << 20, m.moe_intermediate_size);
            s.integer("intermediate_size", 1, 1 << 20, m.intermediate_size);
            s.integer("num_experts", 1, 1024, m.num_experts);
            s.integer("top_k", 1, 32, m.num_experts_per_tok);
            s.integer("decoder_sparse_step", 1, 256, m.decoder_sparse_step);
            s.boolean("norm_topk_prob", m.norm_topk_prob);
            s.number("router_aux_loss_coef", 0, 1e300, m.router_aux_loss_coef);
            s.number("init_std", 0, 10, m.initializer_range, true);
            s.number("rope_theta", 0, 1e300, m.rope_theta, true);
            s.boolean("tie_word_embeddings", m.tie_word_embeddings);
        },
        top);
    c.use_data = root["data"] && !root["data"].IsNull();
    MOERL_CHECK(
        !c.use_data || !root["task"] || root["task"].IsNull(), source,
        ": task and data: give one of them (task: a built-in digit task, data: a JSONL file of prompts)");
    section(
        "tokenizer", source, [&](Section& s) { s.string("path", c.tokenizer_path); }, top);
    bool data_seed_given = false;
    section(
        "data", source,
        [&](Section& s) {
            text::DatasetOptions& d = c.data.dataset;
            MOERL_CHECK(!c.use_data || s.given("path"), s.where("path"),
                        ": required (a JSONL file of prompts)");
            s.string("path", d.path);
            s.string("eval_path", d.eval_path);
            s.number("eval_fraction", 0, 0.999999, d.eval_fraction);
            s.string("prompt_field", d.format.prompt_field);
            s.string("messages_field", d.format.messages_field);
            s.string("answer_field", d.format.answer_field);
            s.string("id_field", d.format.id_field);
            s.boolean("require_answer", d.format.require_answer);
            data_seed_given = s.given("seed");
            s.unsigned_integer("seed", d.seed);
            s.boolean("shuffle", d.shuffle);
            s.unsigned_integer("epochs", d.epochs);
            s.boolean("validate", d.validate);
            if (s.given("chat_template")) {
                bool on = true;
                s.boolean("chat_template", on);
                c.data.chat_template = on ? 1 : 0;
            } else {
                s.child("chat_template");
            }
            s.string("system_prompt", c.data.system_prompt);
            const YAML::Node vars = s.child("template_vars");
            if (vars && !vars.IsNull()) {
                MOERL_CHECK(vars.IsMap(), s.where("template_vars"),
                            ": expected a mapping of template variables");
                c.data.template_vars = to_json(vars);
            }
            if (s.given("enable_thinking")) {
                bool on = false;
                s.boolean("enable_thinking", on);
                c.data.template_vars["enable_thinking"] = on;
            } else {
                s.child("enable_thinking");
            }
            s.integer("max_prompt_tokens", 1, 65536, c.data.max_prompt_tokens);
        },
        top);
    section(
        "eval", source,
        [&](Section& s) {
            s.integer("every", 0, INT64_MAX, c.eval.every);
            s.integer("prompts", 1, 1 << 20, c.eval.prompts);
        },
        top);
    section(
        "task", source,
        [&](Section& s) {
            s.choice("kind", {"add", "sort"}, c.task.kind);
            s.integer("digits", 1, 6, c.task.digits);
            s.integer("length", 2, 8, c.task.length);
            s.integer("max_value", 1, 9, c.task.max_value);
            s.boolean("partial_credit", c.task.partial_credit);
        },
        top);
    section(
        "rollout", source,
        [&](Section& s) {
            s.number("temperature", 0, 100, c.sampling.temperature, true);
            s.number("top_p", 0, 1, c.sampling.top_p, true);
            s.integer("top_k", 0, 1 << 20, c.sampling.top_k);
            s.integer("max_new_tokens", 0, 4096, c.sampling.max_new_tokens);
            s.integer("max_batch", 1, 1 << 16, c.rollout_max_batch);
            s.boolean("record_routing", c.record_routing);
            s.choice("device", {"cpu", "cuda"}, c.rollout_device);
            s.choice("dtype", {"fp32", "bf16", "fp8"}, c.rollout_dtype);
            s.integer("max_seq_len", 2, 1 << 20, c.rollout_max_seq_len);
            s.integer("prefill_chunk_tokens", 0, int64_t{1} << 30, c.rollout_prefill_chunk_tokens);
            s.choice("kv_cache_dtype", {"auto", "fp8"}, c.rollout_kv_cache_dtype);
            const YAML::Node allowed = s.child("allowed_tokens");
            if (allowed && !allowed.IsNull()) {
                MOERL_CHECK(allowed.IsSequence() && allowed.size() > 0, s.where("allowed_tokens"),
                            ": expected a list of token ids or token strings, e.g. [\"0\", \"1\"]");
                for (const auto& t : allowed) {
                    MOERL_CHECK(t.IsScalar(), s.where("allowed_tokens"), ": expected token ids or strings");
                    const nlohmann::json v = to_json(t);
                    if (v.is_number_integer() && t.Tag() != "!") {
                        c.sampling.allowed_tokens.push_back(v.get<int>());
                    } else {
                        allowed_token_names.push_back(t.Scalar());
                    }
                }
            }
            const YAML::Node stops = s.child("stop_tokens");
            if (stops && !stops.IsNull()) {
                MOERL_CHECK(stops.IsSequence() && stops.size() > 0, s.where("stop_tokens"),
                            ": expected a list of token ids or token strings, e.g. [\"<|im_end|>\"]");
                c.sampling.stop_tokens.clear();
                c.stop_tokens_given = true;
                for (const auto& t : stops) {
                    MOERL_CHECK(t.IsScalar(), s.where("stop_tokens"), ": expected token ids or strings");
                    const nlohmann::json v = to_json(t);
                    if (v.is_number_integer()) {
                        MOERL_CHECK(v.get<int64_t>() >= 0 && v.get<int64_t>() < (1 << 24),
                                    s.where("stop_tokens"), ": token id ", v.dump(), " is out of range");
                        c.sampling.stop_tokens.push_back(v.get<int>());
                    } else {
                        stop_token_names.push_back(t.Scalar());
                    }
                }
            }
        },
        top);
    section(
        "train", source,
        [&](Section& s) {
            s.integer("group_size", 2, INT32_MAX, c.group_size);
            s.integer("prompts_per_step", 1, 1 << 16, c.prompts_per_step);
            s.number("lr", 0, 10, c.lr, true);
            s.choice("lr_schedule", {"constant", "cosine"}, c.lr_schedule);
            s.integer("lr_warmup_steps", 0, 10'000'000, c.lr_warmup_steps);
            s.number("lr_min_ratio", 0, 1, c.lr_min_ratio);
            s.number("weight_decay", 0, 10, c.weight_decay);
            s.number("beta1", 0, 0.999999, c.beta1);
            s.number("beta2", 0, 0.999999, c.beta2);
            s.number("adam_eps", 0, 1, c.adam_eps, true);
            s.number("grad_clip", 0, 1e300, c.grad_clip);
            s.integer("ppo_epochs", 1, 100, c.ppo_epochs);
            s.integer("max_staleness", 0, 1000, c.max_staleness);
            s.boolean("routing_replay", c.routing_replay);
            s.number("clip_low", 0, 0.999, c.grpo.clip_low);
            s.number("clip_high", 0, 100, c.grpo.clip_high, true);
            s.number("kl_coef", 0, 1e300, c.grpo.kl_coef);
            s.number("tis_cap", 1, 1e300, c.grpo.tis_cap);
            s.choice("device", {"cpu", "cuda"}, c.train_device);
            s.choice("dtype", {"fp32", "bf16"}, c.train_dtype);
            s.choice("moments_dtype", {"fp32", "bf16"}, c.moments_dtype);
            s.integer("micro_batch_tokens", 0, INT64_C(1) << 40, c.micro_batch_tokens);
            s.boolean("activation_checkpointing", c.activation_checkpointing);
        },
        top);
    section(
        "reward", source,
        [&](Section& s) {
            s.number("verifier_weight", 0, 1e300, c.verifier_weight);
            s.string("model_path", c.reward_model_path);
            s.number("model_weight", 0, 1e300, c.reward_model_weight);
            s.integer("label", 0, 1 << 20, c.reward_label);
            s.integer("batch_size", 1, 1 << 16, c.reward_batch_size);
            s.choice("device", {"cpu", "cuda"}, c.reward_device);
            s.choice("dtype", {"fp32", "bf16"}, c.reward_dtype);
            s.number("truncated_scale", 0, 1, c.truncated_scale);
            const YAML::Node list = s.child("verifiers");
            if (list && !list.IsNull()) {
                MOERL_CHECK(
                    list.IsSequence() && list.size() > 0, s.where("verifiers"),
                    ": expected a list like [{kind: math, weight: 1.0}, {kind: format, weight: 0.2}]");
                for (size_t i = 0; i < list.size(); ++i)
                    c.verifiers.push_back(
                        parse_verifier(list[i], "reward.verifiers[" + std::to_string(i) + "]", source));
            }
        },
        top);
    section(
        "ranks", source,
        [&](Section& s) {
            s.integer("ep", 1, 64, c.ep_ranks);
            s.integer("train", 1, 64, c.train_ranks);
            s.integer("rollout", 1, 64, c.rollout_ranks);
            s.string("transport", c.train_ep_transport);
        },
        top);
    section(
        "sync", source,
        [&](Section& s) {
            s.choice("transfer", {"store", "broadcast"}, c.sync_transfer);
            s.string("address", c.sync_address);
            s.integer("port", 0, 65535, c.sync_port);
            s.number("timeout_s", 0, 1e6, c.sync_timeout_s, true);
            s.number("join_timeout_s", 0, 1e6, c.sync_join_timeout_s, true);
        },
        top);
    section(
        "control", source,
        [&](Section& s) {
            s.string("queue", c.queue);
            s.string("buffer", c.buffer);
            s.string("registry", c.registry);
            s.string("store", c.store);
            s.integer("lease_timeout_ms", 1, INT64_MAX, c.lease_timeout_ms);
        },
        top);
    top.finish();
    MOERL_CHECK(c.use_data || c.verifiers.empty(), source,
                ": reward.verifiers: only with data: (a built-in task scores with its own rule)");
    if (c.use_data) {
        if (!data_seed_given) c.data.dataset.seed = c.seed;
        c.data.dataset.eval_every = static_cast<uint64_t>(c.eval.every);
        if (c.sampling.max_new_tokens == 0) c.sampling.max_new_tokens = 256;
    }
    resolve_text_config(c, stop_token_names, vocab_size_given);
    for (const auto& name : allowed_token_names)
        c.sampling.allowed_tokens.push_back(token_id(c, name, "rollout.allowed_tokens"));
    if (c.model_path.empty() && !max_positions_given)
        m.max_position_embeddings = std::max<int64_t>(m.max_position_embeddings, c.max_sequence_tokens());
    c.validate();
    return c;
}

RunConfig RunConfig::load(const std::string& path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const auto status = fs::status(path, ec);
    MOERL_CHECK(fs::exists(status), "config file ", path, " does not exist");
    MOERL_CHECK(!fs::is_directory(status), "config file ", path, " is a directory; expected a YAML file");
    MOERL_CHECK(fs::is_regular_file(status), "config file ", path, " is not a regular file");
    const auto size = fs::file_size(path, ec);
    MOERL_CHECK(!ec && size <= kMaxConfigBytes, "config file ", path, ": ", size,
                " bytes; a config is at most ", kMaxConfigBytes, " bytes");
    std::ifstream in(path);
    MOERL_CHECK(in, "cannot read config file ", path);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    const std::string source = fs::path(path).filename().string();
    bool empty = true;
    try {
        empty = YAML::Load(text).IsNull();
    } catch (const YAML::Exception&) {
        empty = false;  // from_yaml_text says what is wrong
    }
    MOERL_CHECK(!empty, path, ":1: the config file is empty; expected sections such as run:, model:, task:");
    return from_yaml_text(text, source);
}

void RunConfig::validate() const {
    const std::string& s = source;
    MOERL_CHECK(sync_transfer != "broadcast" || (train_ranks == 1 && rollout_ranks == 1), s,
                ": sync.transfer: broadcast sends from one trainer process to rollout workers of one process "
                "each (here ranks.train ",
                train_ranks, ", ranks.rollout ", rollout_ranks, "); use sync.transfer: store");
    // The name becomes a directory name and the namespace of the run's Redis keys.
    MOERL_CHECK(!name.empty() && name.size() <= 64, s, ": run.name: expected 1 to 64 characters, got ",
                name.size());
    for (char ch : name) {
        MOERL_CHECK(std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-', s,
                    ": run.name: '", name, "' has the character '", std::string(1, ch),
                    "'; expected letters, digits, '.', '_' and '-' only");
    }
    MOERL_CHECK(name.find_first_not_of('.') != std::string::npos, s, ": run.name: '", name,
                "' is not a usable name");
    const model::ModelConfig& m = model;
    if (model_path.empty()) {
        MOERL_CHECK(m.num_attention_heads % m.num_key_value_heads == 0, s,
                    ": model.num_heads: ", m.num_attention_heads,
                    " is not a multiple of model.num_kv_heads = ", m.num_key_value_heads);
        MOERL_CHECK(m.head_dim % 2 == 0, s, ": model.head_dim: expected an even number (RoPE), got ",
                    m.head_dim);
        MOERL_CHECK(m.num_experts_per_tok <= m.num_experts, s, ": model.top_k: ", m.num_experts_per_tok,
                    " exceeds model.num_experts = ", m.num_experts);
    }
    MOERL_CHECK(m.num_experts > 0 || ep_ranks == 1, s, ": ranks.ep: ", ep_ranks,
                " expert-parallel ranks, but the model is dense (no experts): set ranks.ep: 1");
    MOERL_CHECK(m.num_experts % ep_ranks == 0, s, ": ranks.ep: ", ep_ranks,
                " does not divide model.num_experts = ", m.num_experts);
    MOERL_CHECK(int64_t{prompts_per_step} * group_size >= ep_ranks, s, ": ranks.ep: ", ep_ranks,
                " ranks need at least one sample each, but train.prompts_per_step x train.group_size = ",
                int64_t{prompts_per_step} * group_size);
    MOERL_CHECK(train_ranks == 1 || ep_ranks == train_ranks, s, ": ranks.train: ", train_ranks,
                " processes hold one expert-parallel rank each, so ranks.ep must be ", train_ranks,
                " too (got ", ep_ranks, ")");
    MOERL_CHECK(train_device != "cuda" || ep_ranks == 1 || train_ranks > 1, s,
                ": train.device: cuda runs one rank per process, so ranks.ep must be 1 (got ", ep_ranks,
                "), or set ranks.train to ", ep_ranks, " processes");
    MOERL_CHECK(moments_dtype == "fp32" || (train_device == "cuda" && train_dtype == "bf16"), s,
                ": train.moments_dtype: bf16 moments are kept by the GPU trainer's bf16 update: set "
                "train.device: cuda and train.dtype: bf16 (got ",
                train_device, " and ", train_dtype, "), or moments_dtype: fp32");
    MOERL_CHECK(rollout_ranks == 1 || (m.num_moe_layers() > 0 && m.num_experts % rollout_ranks == 0), s,
                ": ranks.rollout: ", rollout_ranks,
                " processes each hold an equal share of the experts, but ", "the model has ", m.num_experts,
                " experts in ", m.num_moe_layers(), " MoE layers");
    if (!train_ep_transport.empty()) {
        MOERL_CHECK(train_ranks > 1 || rollout_ranks > 1, s, ": ranks.transport: ", train_ep_transport,
                    " moves tokens between the processes of the trainer or of a rollout engine, but ",
                    "ranks.train and ranks.rollout are 1");
        const std::string& t = train_ep_transport;
        const bool known = t == "host" || t.rfind("fabric/", 0) == 0 || is_device_transport(t);
        MOERL_CHECK(known && t != "fabric/" && t != "cuda-fabric/", s,
                    ": ranks.transport: expected host, cuda, fabric/<provider> (fabric/tcp) or "
                    "cuda-fabric/<provider> (cuda-fabric/efa), got '",
                    t, "'");
        MOERL_CHECK(train_ranks == 1 || is_device_transport(t) == (train_device == "cuda"), s,
                    ": ranks.transport: ", t,
                    train_device == "cuda"
                        ? " cannot move the GPU trainer's tokens: use cuda or cuda-fabric/<provider>"
                        : " needs train.device: cuda; the CPU trainer uses host or fabric/<provider>");
    }
    MOERL_CHECK(sampling.top_k <= m.vocab_size, s, ": rollout.top_k: ", sampling.top_k,
                " exceeds the vocabulary (", m.vocab_size, ")");
    MOERL_CHECK(lr_schedule == "constant" || lr_schedule == "cosine", s,
                ": train.lr_schedule: expected one of constant, cosine, got '", lr_schedule, "'");
    MOERL_CHECK(lr_warmup_steps >= 0, s, ": train.lr_warmup_steps: expected an integer >= 0, got ",
                lr_warmup_steps);
    MOERL_CHECK(lr_min_ratio >= 0 && lr_min_ratio <= 1, s,
                ": train.lr_min_ratio: expected a number >= 0 and <= 1, got ", lr_min_ratio);
    if (reward_model_path.empty()) {
        MOERL_CHECK(reward_model_weight == 0, s, ": reward.model_weight: ", reward_model_weight,
                    ", but no reward.model_path names a reward model");
    } else {
        MOERL_CHECK(reward_model_weight > 0, s, ": reward.model_weight: 0 with reward.model_path set; the ",
                    "model's score would be ignored: give it a weight > 0");
    }
    task.validate();
    MOERL_CHECK(!use_data || !data.dataset.path.empty(), s,
                ": data.path: required (a JSONL file of prompts)");
    MOERL_CHECK(!use_data || !tokenizer_path.empty(), s, ": tokenizer.path: data needs a tokenizer");
    MOERL_CHECK(
        eval.every == 0 || !use_data || !data.dataset.eval_path.empty() || data.dataset.eval_fraction > 0, s,
        ": eval.every: ", eval.every,
        " but there is no eval split: set data.eval_path or data.eval_fraction");
    for (int id : sampling.stop_tokens) {
        MOERL_CHECK(id >= 0 && id < m.vocab_size, s, ": rollout.stop_tokens: ", id,
                    " is outside the vocabulary (", m.vocab_size, ")");
    }
    for (int id : sampling.allowed_tokens) {
        MOERL_CHECK(id >= 0 && id < m.vocab_size, s, ": rollout.allowed_tokens: ", id,
                    " is outside the vocabulary (", m.vocab_size, ")");
    }
    const int64_t longest = max_sequence_tokens();
    MOERL_CHECK(
        longest <= m.max_position_embeddings, s, ": the longest sequence (", longest,
        " tokens: the longest prompt + rollout.max_new_tokens) exceeds the model's max_position_embeddings (",
        m.max_position_embeddings, ")");
    MOERL_CHECK(rollout_dtype != "fp8" || rollout_device == "cuda", s,
                ": rollout.dtype: fp8 decodes from e4m3 weights in the CUDA engine; it needs rollout.device: "
                "cuda (the CPU rollout computes in fp32 or bf16)");
    MOERL_CHECK(rollout_dtype != "fp8" || rollout_ranks == 1, s,
                ": rollout.dtype: fp8 needs every expert in one "
                "engine; ranks.rollout is ",
                rollout_ranks, " (use bf16 over several ranks)");
    if (rollout_kv_cache_dtype == "fp8") {
        MOERL_CHECK(
            rollout_device == "cuda" && (rollout_dtype == "bf16" || rollout_dtype == "fp8"), s,
            ": rollout.kv_cache_dtype: fp8 caches keys and values as e4m3 in the CUDA engine; it needs "
            "rollout.device: cuda and rollout.dtype bf16 or fp8 (got ",
            rollout_device, ", ", rollout_dtype, ")");
        // The tensor-core attention's shapes (model::GeneratorOptions::fp8_kv_cache).
        const int64_t group = m.num_key_value_heads > 0 ? m.num_attention_heads / m.num_key_value_heads : 0;
        MOERL_CHECK(
            (group == 4 || group == 8 || group == 16) && (m.head_dim == 64 || m.head_dim == 128), s,
            ": rollout.kv_cache_dtype: fp8 needs 4, 8 or 16 query heads per key-value head of 64 or 128 "
            "dims; the model has ",
            m.num_attention_heads, " query heads per ", m.num_key_value_heads, " key-value heads of ",
            m.head_dim, " dims");
    }
    MOERL_CHECK(rollout_device != "cuda" || longest <= rollout_max_seq_len, s,
                ": rollout.max_seq_len: ", rollout_max_seq_len, " is below the longest sequence (", longest,
                " tokens: the longest prompt + rollout.max_new_tokens)");
}

double RunConfig::lr_at(int64_t step) const {
    const double s = static_cast<double>(std::max<int64_t>(0, step));
    if (lr_warmup_steps > 0 && step < lr_warmup_steps)
        return lr * (s + 1) / static_cast<double>(lr_warmup_steps);
    if (lr_schedule != "cosine") return lr;
    const double span = static_cast<double>(std::max<int64_t>(1, steps - lr_warmup_steps));
    const double progress = std::min(1.0, (s - static_cast<double>(lr_warmup_steps)) / span);
    const double cosine = 0.5 * (1 + std::cos(M_PI * progress));
    return lr * (lr_min_ratio + (1 - lr_min_ratio) * cosine);
}

int RunConfig::max_new_tokens() const {
    if (sampling.max_new_tokens > 0) return sampling.max_new_tokens;
    if (use_data) return 256;
    return make_task_generator(task)->max_answer_tokens() + 1;
}

int RunConfig::max_prompt_tokens() const {
    if (use_data) return data.max_prompt_tokens;
    return make_task_generator(task)->max_prompt_tokens() + 1;  // bos
}

int64_t RunConfig::max_sequence_tokens() const { return int64_t{max_prompt_tokens()} + max_new_tokens(); }

std::string RunConfig::store_uri() const {
    if (!store.empty()) return store;
    return "file://" + std::filesystem::absolute(std::filesystem::path(output_dir) / "checkpoints").string();
}

}  // namespace moerl::rl
