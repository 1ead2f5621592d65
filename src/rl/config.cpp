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
    section(
        "model", source,
        [&](Section& s) {
            s.string("path", c.model_path);
            s.integer("vocab_size", Tokenizer::get().vocab_size(), 1 << 24, m.vocab_size);
            s.integer("hidden_size", 8, 65536, m.hidden_size);
            s.integer("num_layers", 1, 256, m.num_hidden_layers);
            s.integer("num_heads", 1, 1024, m.num_attention_heads);
            s.integer("num_kv_heads", 1, 1024, m.num_key_value_heads);
            s.integer("head_dim", 2, 1024, m.head_dim);
            s.integer("moe_intermediate_size", 1, 1 << 20, m.moe_intermediate_size);
            s.integer("intermediate_size", 1, 1 << 20, m.intermediate_size);
            s.integer("max_position_embeddings", 1, 1 << 24, m.max_position_embeddings);
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
            s.choice("dtype", {"fp32", "bf16"}, c.rollout_dtype);
            s.integer("max_seq_len", 2, 1 << 20, c.rollout_max_seq_len);
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
            s.integer("micro_batch_tokens", 0, INT64_C(1) << 40, c.micro_batch_tokens);
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
        },
        top);
    section(
        "ranks", source, [&](Section& s) { s.integer("ep", 1, 64, c.ep_ranks); }, top);
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
        MOERL_CHECK(m.num_experts % ep_ranks == 0, s, ": ranks.ep: ", ep_ranks,
                    " does not divide model.num_experts = ", m.num_experts);
    }
    MOERL_CHECK(int64_t{prompts_per_step} * group_size >= ep_ranks, s, ": ranks.ep: ", ep_ranks,
                " ranks need at least one sample each, but train.prompts_per_step x train.group_size = ",
                int64_t{prompts_per_step} * group_size);
    MOERL_CHECK(train_device != "cuda" || ep_ranks == 1, s,
                ": train.device: cuda trains on one GPU, so ranks.ep must be 1 (got ", ep_ranks, ")");
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
    auto gen = make_task_generator(task);
    const int64_t longest = gen->max_prompt_tokens() + 1 + max_new_tokens();
    MOERL_CHECK(longest <= m.max_position_embeddings || !model_path.empty(), s, ": the longest sequence (",
                longest, " tokens) exceeds the model's max_position_embeddings (", m.max_position_embeddings,
                ")");
    MOERL_CHECK(rollout_device != "cuda" || longest <= rollout_max_seq_len, s,
                ": rollout.max_seq_len: ", rollout_max_seq_len, " is below the longest sequence (", longest,
                " tokens: the task's longest prompt + rollout.max_new_tokens)");
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
    return make_task_generator(task)->max_answer_tokens() + 1;
}

std::string RunConfig::store_uri() const {
    if (!store.empty()) return store;
    return "file://" + std::filesystem::absolute(std::filesystem::path(output_dir) / "checkpoints").string();
}

}  // namespace moerl::rl
