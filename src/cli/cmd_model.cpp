// `moerl model init`, `moerl model score`, `moerl ckpt inspect` and `moerl bench model`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "bench_util.hpp"
#include "commands.hpp"
#include "moerl/control/control.hpp"
#include "moerl/core/error.hpp"
#include "moerl/model/config.hpp"
#include "moerl/model/model.hpp"
#include "moerl/model/reward_model.hpp"
#include "moerl/model/safetensors.hpp"

namespace moerl::cli {
namespace {

// A subcommand other layers may also extend (e.g. `ckpt`).
CLI::App* subcommand(CLI::App& parent, const std::string& name, const std::string& description) {
    for (CLI::App* sub : parent.get_subcommands([](CLI::App*) { return true; })) {
        if (sub->get_name() == name) return sub;
    }
    CLI::App* sub = parent.add_subcommand(name, description);
    sub->require_subcommand(1);
    return sub;
}

std::string dtype_name(at::ScalarType t) {
    return t == at::kFloat ? "float32" : (t == at::kBFloat16 ? "bfloat16" : "float16");
}

// A reward checkpoint (`model init --reward`): the backbone of config.json plus a score head.
struct RewardInit {
    bool enabled = false;
    int num_labels = 1;
    int64_t pad_token_id = -2;  // -2: config.json's pad_token_id (none when absent); -1: none
};

std::optional<int64_t> pad_token_of(const model::ModelConfig& config, int64_t requested) {
    if (requested >= 0) return requested;
    if (requested == -1) return std::nullopt;
    const auto extra = nlohmann::json::parse(config.extra_json.empty() ? "{}" : config.extra_json);
    if (extra.contains("pad_token_id") && extra["pad_token_id"].is_number_integer())
        return extra["pad_token_id"].get<int64_t>();
    return std::nullopt;
}

// Writes a random checkpoint into a staging directory beside `out`, then renames it into place, so
// `out` never holds a mix of old and new files (an old shard or index next to a new model).
void model_init(const std::string& config_path, const std::string& out, uint64_t seed, int shard_mb,
                const std::string& dtype, bool force, const RewardInit& reward) {
    namespace fs = std::filesystem;
    model::ModelConfig config = model::ModelConfig::load(config_path);
    const std::string stored = dtype_name(dtype_of(dtype.empty() ? config.torch_dtype : dtype));
    MOERL_CHECK(shard_mb >= 0, "--shard-mb ", shard_mb, " must be >= 0");
    const fs::path target = fs::absolute(out).lexically_normal();
    const bool occupied = fs::exists(target) && !(fs::is_directory(target) && fs::is_empty(target));
    MOERL_CHECK(!occupied || force, "model init: --out ", target.string(),
                " already exists and is not empty; pass --force to replace it");
    MOERL_CHECK(!fs::exists(target) || fs::is_directory(target), "model init: --out ", target.string(),
                " is a file, not a directory");
    fs::create_directories(target.parent_path());
    const fs::path staging =
        target.parent_path() / ("." + target.filename().string() + ".init-" + std::to_string(::getpid()));
    fs::remove_all(staging);
    MOERL_CHECK(!reward.enabled || shard_mb == 0,
                "model init --reward writes one model.safetensors; drop --shard-mb");
    std::optional<model::MoeModel> lm;
    std::optional<model::RewardModel> rm;
    if (reward.enabled) {
        rm.emplace(config, reward.num_labels, 0, pad_token_of(config, reward.pad_token_id),
                   model::ModelOptions{at::kCPU, dtype_of(stored)});
        rm->init_random(seed);
    } else {
        lm.emplace(config, model::ModelOptions{at::kCPU, dtype_of(stored)});
        lm->init_random(seed);
    }
    const model::MoeModel& m = rm ? rm->backbone() : *lm;
    try {
        if (rm) {
            rm->save_pretrained(staging.string(), stored);
        } else {
            m.save_pretrained(staging.string(), static_cast<uint64_t>(shard_mb) << 20, stored);
        }
        fs::remove_all(target);
        fs::rename(staging, target);
    } catch (...) {
        std::error_code ec;
        fs::remove_all(staging, ec);
        throw;
    }
    // A reward model has score.weight instead of an untied lm_head.
    const int64_t head_change =
        rm ? int64_t{reward.num_labels} * config.hidden_size -
                 (config.tie_word_embeddings ? 0 : int64_t{config.vocab_size} * config.hidden_size)
           : 0;
    std::printf("wrote %s%s: %s parameters (%s active per token), %s, %s\n", out.c_str(),
                rm ? " (reward model: score head, no lm_head)" : "",
                human_count(static_cast<double>(config.num_parameters() + head_change)).c_str(),
                human_count(static_cast<double>(config.num_active_parameters() + head_change)).c_str(),
                stored.c_str(), human_bytes(static_cast<double>(m.weight_bytes())).c_str());
}

// `moerl model score`: JSONL {"ids": [...]} on stdin, {"score": x} on stdout, one line each.
void model_score(const std::string& dir, int label, int batch, const std::string& device_name) {
    const at::Device device(device_name);
    MOERL_CHECK(device.is_cpu() || at::hasCUDA(), "--device ", device_name, ": no CUDA device is available");
    const model::RewardModel rm = model::RewardModel::from_pretrained(dir, {device, at::kFloat}, label);
    std::vector<std::vector<int>> pending;
    auto flush = [&] {
        for (double s : rm.score(pending, batch)) std::cout << nlohmann::json{{"score", s}}.dump() << "\n";
        std::cout.flush();
        pending.clear();
    };
    std::string line;
    for (int64_t number = 1; std::getline(std::cin, line); ++number) {
        if (line.empty()) continue;
        const auto j = nlohmann::json::parse(line, nullptr, false);
        MOERL_CHECK(!j.is_discarded() && j.is_object() && j.contains("ids") && j["ids"].is_array(),
                    "stdin line ", number, ": expected {\"ids\": [token ids]}");
        std::vector<int> ids;
        for (const auto& v : j["ids"]) {
            MOERL_CHECK(v.is_number_integer(), "stdin line ", number, ": ids must be integers, got ",
                        v.dump());
            ids.push_back(v.get<int>());
        }
        MOERL_CHECK(!ids.empty(), "stdin line ", number, ": ids is empty; expected at least one token");
        pending.push_back(std::move(ids));
        if (static_cast<int>(pending.size()) >= batch) flush();
    }
    if (!pending.empty()) flush();
}

void ckpt_inspect(const std::string& dir) {
    // The manifest first: a damaged or mixed checkpoint fails before anything is read from it.
    const std::optional<control::Manifest> manifest = control::verify_checkpoint_dir(dir);
    model::ModelConfig c = model::ModelConfig::load(dir);
    model::CheckpointReader reader(dir);
    std::printf("checkpoint %s\n", dir.c_str());
    if (manifest) {
        std::printf("  manifest      version %lld, step %lld: %zu files, sizes and sha256 verified\n",
                    static_cast<long long>(manifest->version), static_cast<long long>(manifest->step),
                    manifest->files.size());
    } else {
        std::printf("  manifest      none (not published by moerl): file contents are not verified\n");
    }
    std::printf("  architecture  Qwen3-MoE: %d layers (%d MoE), hidden %d, vocab %d\n", c.num_hidden_layers,
                c.num_moe_layers(), c.hidden_size, c.vocab_size);
    std::printf("  attention     %d query heads, %d key/value heads, head_dim %d, rope_theta %g\n",
                c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope_theta);
    std::printf("  experts       %d per MoE layer, top-%d%s, expert width %d; dense MLP width %d\n",
                c.num_experts, c.num_experts_per_tok, c.norm_topk_prob ? " (renormalised)" : "",
                c.moe_intermediate_size, c.intermediate_size);
    std::printf("  parameters    %s total, %s active per token (%lld / %lld)\n",
                human_count(static_cast<double>(c.num_parameters())).c_str(),
                human_count(static_cast<double>(c.num_active_parameters())).c_str(),
                static_cast<long long>(c.num_parameters()),
                static_cast<long long>(c.num_active_parameters()));

    std::map<std::string, std::pair<int64_t, uint64_t>> by_dtype;  // dtype -> (tensors, bytes)
    uint64_t total = 0;
    std::vector<std::string> problems;
    std::set<std::string> expected;
    for (const auto& [name, shape] : c.tensor_shapes()) {
        expected.insert(name);
        if (!reader.contains(name)) {
            problems.push_back("missing " + name);
            continue;
        }
        const model::TensorInfo& t = reader.info(name);
        if (t.shape != shape) problems.push_back("shape of " + name + " does not match config.json");
    }
    int64_t unexpected = 0;
    for (const auto& name : reader.names()) {
        const model::TensorInfo& t = reader.info(name);
        auto& entry = by_dtype[model::st_dtype_name(t.dtype)];
        entry.first += 1;
        entry.second += t.nbytes;
        total += t.nbytes;
        unexpected += expected.count(name) == 0;
    }
    std::printf("  files         %zu:", reader.files().size());
    for (const auto& f : reader.files()) std::printf(" %s", f.c_str());
    std::printf("\n  tensors       %zu, %s", reader.names().size(),
                human_bytes(static_cast<double>(total)).c_str());
    for (const auto& [dt, e] : by_dtype)
        std::printf("; %s: %lld (%s)", dt.c_str(), static_cast<long long>(e.first),
                    human_bytes(static_cast<double>(e.second)).c_str());
    std::printf("\n");
    if (unexpected > 0)
        std::printf("  note          %lld tensors not used by the model\n",
                    static_cast<long long>(unexpected));
    if (problems.empty()) {
        std::printf("  check         every tensor config.json implies is present with its shape\n");
        return;
    }
    for (size_t i = 0; i < problems.size() && i < 20; ++i)
        std::printf("  problem       %s\n", problems[i].c_str());
    MOERL_FAIL("checkpoint ", dir, ": ", problems.size(), " problem(s), first: ", problems.front());
}

struct BenchArgs {
    std::string device = "cpu";
    std::string dtype;
    std::vector<std::string> configs;
    int batch = 8;
    int prompt = 128;
    int decode = 32;
    int reps = 3;
    uint64_t seed = 1;
};

void bench_one(const std::string& name, const model::ModelConfig& c, const BenchArgs& a,
               const at::Device& device, at::ScalarType dtype, double copy_bw) {
    model::MoeModel m(c, {device, dtype});
    m.set_requires_grad(false);
    m.init_random(a.seed);
    c10::NoGradGuard no_grad;
    const int64_t B = a.batch, P = a.prompt, D = a.decode;
    at::Tensor prompt = at::randint(1, c.vocab_size, {B, P}, at::TensorOptions().dtype(at::kLong)).to(device);
    std::vector<double> prefill_s, decode_s;
    double bytes_per_step = 0;
    const double elem = static_cast<double>(at::elementSize(dtype));
    const double expert_bytes = static_cast<double>(c.expert_parameters()) * elem;
    const double all_expert_bytes = static_cast<double>(c.num_moe_layers()) * c.num_experts * expert_bytes;
    // Weights every decode step reads besides the routed experts: all but the embedding table
    // (only B rows of it are read).
    const double dense_bytes =
        static_cast<double>(m.weight_bytes()) - all_expert_bytes -
        static_cast<double>(c.vocab_size) * c.hidden_size * elem * (c.tie_word_embeddings ? 0 : 1);
    for (int rep = 0; rep <= a.reps; ++rep) {  // rep 0 warms up
        model::KvCache cache = m.new_cache(B, P + D + 1);
        auto t0 = Clock::now();
        at::Tensor logits = m.prefill(cache, prompt, at::Tensor()).logits;
        at::Tensor next = logits.argmax(-1);
        (void)next[0].item<int64_t>();
        const double tp = seconds_since(t0);
        double experts_read = 0;
        t0 = Clock::now();
        for (int64_t s = 0; s < D; ++s) {
            model::StepOutput o = m.decode(cache, next, /*record_routing=*/s == 0);
            if (s == 0 && o.routing.defined() && o.routing.numel() > 0) {
                // Distinct experts per MoE layer in one step = expert weights read.
                at::Tensor r = o.routing.to(at::kCPU)
                                   .to(at::kLong)
                                   .permute({2, 0, 1, 3})
                                   .reshape({c.num_moe_layers(), -1});
                for (int64_t l = 0; l < r.size(0); ++l)
                    experts_read += at::bincount(r[l], {}, c.num_experts).gt(0).sum().item<int64_t>();
            }
            next = o.logits.argmax(-1);
        }
        (void)next[0].item<int64_t>();
        const double td = seconds_since(t0);
        if (rep == 0) continue;
        prefill_s.push_back(tp);
        decode_s.push_back(td / static_cast<double>(D));
        bytes_per_step = dense_bytes + experts_read * expert_bytes;
    }
    const double tp = median(prefill_s), td = median(decode_s);
    std::printf("| %-8s | %8s | %8s | %5lld | %6lld | %6lld | %12.0f | %10.2f | %11.0f |", name.c_str(),
                human_count(static_cast<double>(c.num_parameters())).c_str(),
                human_count(static_cast<double>(c.num_active_parameters())).c_str(),
                static_cast<long long>(B), static_cast<long long>(P), static_cast<long long>(D), B * P / tp,
                td * 1e3, B / td);
    if (copy_bw > 0) {
        const double bw = bytes_per_step / td;
        std::printf(" %9s | %8.1f | %5.1f%% |", human_bytes(bytes_per_step).c_str(), bw / 1e9,
                    100.0 * bw / copy_bw);
    }
    std::printf("\n");
    std::fflush(stdout);
}

void bench_model(const BenchArgs& a) {
    const at::Device device(a.device);
    MOERL_CHECK(device.is_cpu() || device.is_cuda(), "--device ", a.device,
                " is not supported, expected cpu or cuda");
    MOERL_CHECK(device.is_cpu() || at::hasCUDA(), "--device cuda: no CUDA device is available");
    const at::ScalarType dtype =
        a.dtype.empty() ? (device.is_cuda() ? at::kBFloat16 : at::kFloat) : dtype_of(a.dtype);
    std::vector<std::pair<std::string, model::ModelConfig>> configs;
    if (a.configs.empty()) {
        // The same shapes as examples/models/small.json and medium.json.
        configs.push_back({"small", bench_config(256, 4, 8, 2, 32, 128, 16, 4, 8192)});
        configs.push_back({"medium", bench_config(768, 8, 12, 4, 64, 384, 32, 4, 32000)});
    } else {
        for (const auto& path : a.configs) {
            std::string base = path.substr(path.find_last_of('/') + 1);
            configs.push_back({base.substr(0, base.find('.')), model::ModelConfig::load(path)});
        }
    }
    const double copy_bw = device.is_cuda() ? copy_bandwidth(device) : 0.0;
    std::printf(
        "moerl bench model: device %s, dtype %s, intra-op threads %d, median of %d runs after 1 warm-up\n",
        a.device.c_str(), c10::toString(dtype), at::get_num_threads(), a.reps);
    if (copy_bw > 0)
        std::printf(
            "device copy bandwidth (read + write): %.0f GB/s; decode bandwidth = weight bytes read per step "
            "(all non-expert weights but the embedding, plus the distinct experts routed to) / step time\n",
            copy_bw / 1e9);
    std::printf(
        "\n| config   |   params |   active | batch | prompt | decode | prefill tok/s | step ms    | decode "
        "tok/s |");
    if (copy_bw > 0) std::printf(" bytes/step | GB/s     | util   |");
    std::printf("\n|---|---|---|---|---|---|---|---|---|%s\n", copy_bw > 0 ? "---|---|---|" : "");
    for (const auto& [name, c] : configs) bench_one(name, c, a, device, dtype, copy_bw);
}

}  // namespace

void register_model_commands(CLI::App& app, CLI::App& bench) {
    CLI::App* model_cmd = subcommand(app, "model", "Model checkpoints (Qwen3-MoE, Hugging Face layout)");
    struct InitArgs {
        std::string config, out, dtype;
        uint64_t seed = 0;
        int shard_mb = 0;
        bool force = false;
    };
    auto init = std::make_shared<InitArgs>();
    auto reward = std::make_shared<RewardInit>();
    CLI::App* init_cmd = model_cmd->add_subcommand("init", "Write a randomly initialised checkpoint");
    init_cmd->add_option("--config", init->config, "config.json (file or directory)")->required();
    init_cmd->add_option("--out", init->out, "Output directory")->required();
    init_cmd->add_option("--seed", init->seed, "Random seed");
    init_cmd->add_option("--shard-mb", init->shard_mb, "Largest shard in MiB (0: one model.safetensors)");
    init_cmd->add_flag("--force", init->force, "Replace a non-empty --out directory");
    init_cmd->add_option("--dtype", init->dtype,
                         "Stored dtype: bfloat16, float16, float32 (default: torch_dtype)");
    init_cmd->add_flag(
        "--reward", reward->enabled,
        "A reward model: the backbone without lm_head plus score.weight (sequence classification)");
    init_cmd->add_option("--num-labels", reward->num_labels, "With --reward: rows of score.weight")
        ->check(CLI::PositiveNumber);
    init_cmd->add_option(
        "--pad-token-id", reward->pad_token_id,
        "With --reward: pad_token_id written to config.json (-1: none; default: config.json's)");
    init_cmd->callback([init, reward] {
        model_init(init->config, init->out, init->seed, init->shard_mb, init->dtype, init->force, *reward);
    });

    struct ScoreArgs {
        std::string dir, device = "cpu";
        int label = -1;
        int batch = 16;
    };
    auto score = std::make_shared<ScoreArgs>();
    CLI::App* score_cmd = model_cmd->add_subcommand(
        "score",
        "Score token sequences with a reward model: {\"ids\": [...]} lines in, {\"score\": x} lines out");
    score_cmd->add_option("--reward", score->dir, "Reward checkpoint (*ForSequenceClassification)")
        ->required();
    score_cmd->add_option("--label", score->label, "Row of score.weight (required when it has several)");
    score_cmd->add_option("--batch", score->batch, "Sequences per forward")->check(CLI::PositiveNumber);
    score_cmd->add_option("--device", score->device, "cpu or cuda (cuda:N); fp32 either way");
    score_cmd->callback([score] { model_score(score->dir, score->label, score->batch, score->device); });

    CLI::App* ckpt = subcommand(app, "ckpt", "Checkpoint tools");
    auto dir = std::make_shared<std::string>();
    CLI::App* inspect =
        ckpt->add_subcommand("inspect", "Summarise a checkpoint and check it against config.json");
    inspect->add_option("dir", *dir, "Checkpoint directory")->required();
    inspect->callback([dir] { ckpt_inspect(*dir); });

    auto args = std::make_shared<BenchArgs>();
    CLI::App* b =
        bench.add_subcommand("model", "Prefill and decode throughput of the model runtime (random weights)");
    b->add_option("--device", args->device, "cpu or cuda (cuda:N)");
    b->add_option("--dtype", args->dtype,
                  "float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)");
    b->add_option("--config", args->configs, "config.json files (default: built-in small and medium)");
    b->add_option("--batch", args->batch, "Sequences per batch");
    b->add_option("--prompt", args->prompt, "Prompt tokens per sequence");
    b->add_option("--decode", args->decode, "Decode steps");
    b->add_option("--reps", args->reps, "Timed repetitions (median reported)");
    b->add_option("--seed", args->seed, "Weight seed");
    b->callback([args] { bench_model(*args); });
}

}  // namespace moerl::cli
