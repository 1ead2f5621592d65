// `moerl bench rl`: the whole RL loop of a run configuration, every role in this process (as
// `moerl run`), and per step where the time goes: rollout (decoding), reward, weight sync into
// the rollout model, training, publishing the new version, and the rest (the env, batching,
// bookkeeping); generated and trained tokens per second; training MFU on a GPU.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "commands.hpp"
#include "moerl/core/error.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/run.hpp"

namespace moerl::cli {
namespace {

namespace fs = std::filesystem;

struct RlBenchArgs {
    std::string config;
    int64_t steps = 8;
    int64_t warmup = 2;        // steps left out of the summary (graph capture, allocator growth)
    std::string out;           // default: a fresh directory under the system's temporary directory
    std::string device;        // overrides rollout.device and train.device
    std::string dtype;         // overrides rollout.dtype and train.dtype
    double peak_tflops = 989;  // dense bf16 peak of the GPU (H100/H200 SXM)
};

// Parameters a token passes through in training (6 x this x tokens = forward + backward FLOPs,
// attention scores left out): everything but the input embedding lookup, top_k of the experts.
double active_parameters(const model::ModelConfig& c) {
    const double H = c.hidden_size, D = c.head_dim, V = c.vocab_size;
    const double attention = H * D * (2.0 * c.num_attention_heads + 2.0 * c.num_key_value_heads);
    double total = V * H;  // the output projection
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        total += attention;
        if (c.is_moe_layer(l))
            total += c.num_experts * H + 3.0 * H * c.moe_intermediate_size * c.num_experts_per_tok;
        else
            total += 3.0 * H * c.intermediate_size;
    }
    return total;
}

double number(const nlohmann::json& row, const char* key) {
    auto it = row.find(key);
    return it == row.end() || !it->is_number() ? 0.0 : it->get<double>();
}

void bench_rl(const RlBenchArgs& a) {
    rl::RunConfig cfg = rl::RunConfig::load(a.config);
    if (!a.device.empty()) cfg.rollout_device = cfg.train_device = a.device;
    if (!a.dtype.empty()) cfg.rollout_dtype = cfg.train_dtype = a.dtype;
    if (cfg.train_device == "cuda") cfg.ep_ranks = 1;
    cfg.steps = a.steps;
    cfg.stop_at_reward = 0;
    cfg.checkpoint_every = 0;
    MOERL_CHECK(a.warmup >= 0 && a.warmup < a.steps, "bench rl: --warmup ", a.warmup,
                " must be below --steps ", a.steps);
    const fs::path out = a.out.empty()
                             ? fs::temp_directory_path() / ("moerl-bench-rl-" + std::to_string(::getpid()))
                             : fs::path(a.out);
    MOERL_CHECK(!fs::exists(out / "checkpoints") || fs::is_empty(out / "checkpoints"),
                "bench rl: ", out.string(), " holds a run already: give an empty --out");
    rl::RunOptions opt;
    opt.output_dir = out.string();
    opt.progress = false;
    opt.final_checkpoint = false;  // a real-size model's weights and moments are tens of GB
    rl::RunSummary s = rl::run_local(cfg, opt);

    std::vector<nlohmann::json> rows;
    std::ifstream in(s.metrics_path);
    for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
    const bool gpu = cfg.train_device == "cuda";
    const double flops_per_token = 6 * active_parameters(cfg.model);
    std::printf("bench rl: %s, rollout %s %s, train %s %s, %lld prompts x %d samples a step, ep %d\n",
                a.config.c_str(), cfg.rollout_device.c_str(), cfg.rollout_dtype.c_str(),
                cfg.train_device.c_str(), cfg.train_dtype.c_str(),
                static_cast<long long>(cfg.prompts_per_step), cfg.group_size, cfg.ep_ranks);
    std::printf("active parameters %s (6 x that x trained tokens = training FLOPs)\n\n",
                human_count(flops_per_token / 6).c_str());
    std::printf("%5s %9s %9s %9s %9s %9s %9s %9s %11s %11s %7s\n", "step", "rollout_s", "reward_s", "sync_s",
                "train_s", "publish_s", "other_s", "step_s", "gen_tok/s", "train_tok/s", "mfu");
    std::vector<double> share_other, rollout, train, sync, step_s, gen_rate, train_rate, mfu;
    for (const auto& r : rows) {
        const double ro = number(r, "rollout_s"), rw = number(r, "reward_s"), sy = number(r, "sync_s"),
                     tr = number(r, "train_s"), pu = number(r, "publish_s"), st = number(r, "step_seconds");
        const double other = std::max(0.0, st - ro - rw - sy - tr - pu);
        const double gen = ro > 0 ? number(r, "response_tokens") / ro : 0;
        const double trained = tr > 0 ? number(r, "train_tokens") / tr : 0;
        const double util = gpu ? trained * flops_per_token / (a.peak_tflops * 1e12) : 0;
        char mfu_text[16] = "-";
        if (gpu) std::snprintf(mfu_text, sizeof mfu_text, "%.1f%%", 100 * util);
        std::printf("%5lld %9.4f %9.4f %9.4f %9.4f %9.4f %9.4f %9.4f %11.0f %11.0f %7s\n",
                    static_cast<long long>(r.value("step", 0)), ro, rw, sy, tr, pu, other, st, gen, trained,
                    mfu_text);
        if (r.value("step", 0) < a.warmup) continue;
        share_other.push_back(st > 0 ? (rw + sy + pu + other) / st : 0);
        rollout.push_back(ro);
        train.push_back(tr);
        sync.push_back(sy);
        step_s.push_back(st);
        gen_rate.push_back(gen);
        train_rate.push_back(trained);
        mfu.push_back(util);
    }
    MOERL_CHECK(!step_s.empty(), "bench rl: no steps after the warmup");
    std::printf(
        "\nmedian over steps %lld..%lld: step %.4f s = rollout %.4f + train %.4f + sync %.4f + rest; "
        "neither rollout nor training: %.1f%% of a step\n",
        static_cast<long long>(a.warmup), static_cast<long long>(a.steps - 1), median(step_s),
        median(rollout), median(train), median(sync), 100 * median(share_other));
    std::printf("generated %.0f tok/s, trained %.0f tok/s%s\n", median(gen_rate), median(train_rate),
                gpu ? (", training MFU " + std::to_string(100 * median(mfu)).substr(0, 5) + "% of " +
                       std::to_string(static_cast<int>(a.peak_tflops)) + " TFLOP/s")
                          .c_str()
                    : "");
    std::printf("metrics: %s\n", s.metrics_path.c_str());
}

}  // namespace

void register_bench_rl(CLI::App& bench) {
    auto a = std::make_shared<RlBenchArgs>();
    CLI::App* cmd =
        bench.add_subcommand("rl", "The whole RL loop of a run configuration: time per phase a step");
    cmd->add_option("config", a->config, "Run configuration (YAML), e.g. examples/gpu-quickstart.yaml")
        ->required();
    cmd->add_option("--steps", a->steps, "Training steps to run (default 8)");
    cmd->add_option("--warmup", a->warmup, "First steps left out of the summary (default 2)");
    cmd->add_option("--out", a->out, "Output directory of the run (default: a temporary one)");
    cmd->add_option("--device", a->device, "cpu or cuda: overrides rollout.device and train.device");
    cmd->add_option("--dtype", a->dtype, "fp32 or bf16: overrides rollout.dtype and train.dtype");
    cmd->add_option("--peak-tflops", a->peak_tflops, "The GPU's dense bf16 peak for MFU (default 989, H200)");
    cmd->callback([a] { bench_rl(*a); });
}

}  // namespace moerl::cli
