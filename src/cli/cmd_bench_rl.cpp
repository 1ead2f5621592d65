// `moerl bench rl`: the whole RL loop of a run configuration, every role in this process (as
// `moerl run`), and per step where the time goes: rollout (decoding), reward, weight sync into
// the rollout model, training, publishing the new version, and the rest (the env, batching,
// bookkeeping); generated and trained tokens per second; on a GPU the training MFU, the decode
// steps' share of the copy bandwidth and each phase's peak GPU memory.
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <sys/resource.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "commands.hpp"
#include "distributed_run.hpp"
#include "launch.hpp"
#include "moerl/core/error.hpp"
#include "moerl/model/device_memory.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/experience.hpp"
#include "moerl/rl/prompt_source.hpp"
#include "moerl/rl/run.hpp"
#include "moerl/rl/trainer.hpp"

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
    std::string save_policy;   // set: the last policy's weights written here (bench rollout --model)
};

// Parameters a token passes through in training (6 x this x tokens = forward + backward FLOPs;
// attention's scores and values are counted apart): the layers, top_k of the experts. The output projection
// is counted apart: the trainer computes it for response tokens only (output_parameters).
double trunk_parameters(const model::ModelConfig& c) {
    const double H = c.hidden_size, D = c.head_dim;
    const double attention = H * D * (2.0 * c.num_attention_heads + 2.0 * c.num_key_value_heads);
    double total = 0;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        total += attention;
        if (c.is_moe_layer(l))
            total += c.num_experts * H + 3.0 * H * c.moe_intermediate_size * c.num_experts_per_tok;
        else
            total += 3.0 * H * c.intermediate_size;
    }
    return total;
}

double output_parameters(const model::ModelConfig& c) { return double{1} * c.vocab_size * c.hidden_size; }

// Training FLOPs of a step: every token through the layers, response tokens through the head, and
// per layer the causal attention's two products (q.k and p.v, 2 x 2 x D FLOPs a query head and
// query-key pair forward, three times that with the backward; the recomputation inside flash
// attention's backward is not counted).
double training_flops(const model::ModelConfig& c, double all_tokens, double response_tokens,
                      double attention_pairs) {
    const double attention =
        12.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * attention_pairs;
    return 6 * (trunk_parameters(c) * all_tokens + output_parameters(c) * response_tokens) + attention;
}

double number(const nlohmann::json& row, const char* key) {
    auto it = row.find(key);
    return it == row.end() || !it->is_number() ? 0.0 : it->get<double>();
}

// Median seconds of one device-to-device copy of `bytes` on the first GPU.
double device_copy_seconds(int64_t bytes) {
    const auto opts = at::TensorOptions().device(at::kCUDA, 0).dtype(at::kByte);
    at::Tensor src = at::ones({bytes}, opts), dst = at::empty({bytes}, opts);
    std::vector<double> times;
    for (int i = 0; i < 6; ++i) {
        torch::cuda::synchronize();  // each copy timed alone
        const auto t0 = Clock::now();
        dst.copy_(src);
        torch::cuda::synchronize();
        if (i > 0) times.push_back(seconds_since(t0));
    }
    return median(times);
}

void bench_rl(const RlBenchArgs& a) {
    rl::RunConfig cfg = rl::RunConfig::load(a.config);
    if (!a.device.empty()) cfg.rollout_device = cfg.train_device = a.device;
    if (!a.dtype.empty()) cfg.rollout_dtype = cfg.train_dtype = a.dtype;
    // The trainer and rollout engine over ranks.train / ranks.rollout processes as `moerl run` starts
    // them; one trainer process on a GPU holds one rank.
    if (cfg.train_device == "cuda" && cfg.train_ranks == 1) cfg.ep_ranks = 1;
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
    opt.final_weights_dir = a.save_policy;
    std::vector<std::string> argv{self_executable(),
                                  "bench",
                                  "rl",
                                  a.config,
                                  "--steps",
                                  std::to_string(a.steps),
                                  "--warmup",
                                  std::to_string(a.warmup),
                                  "--out",
                                  out.string(),
                                  "--peak-tflops",
                                  std::to_string(a.peak_tflops)};
    if (!a.device.empty()) argv.insert(argv.end(), {"--device", a.device});
    if (!a.dtype.empty()) argv.insert(argv.end(), {"--dtype", a.dtype});
    if (!a.save_policy.empty()) argv.insert(argv.end(), {"--save-policy", a.save_policy});
    const LocalRanks ranks = launch_or_join_local_ranks(cfg, a.config, argv);
    MOERL_CHECK(ranks.exit_code <= 0, "bench rl: a rank exited with ", ranks.exit_code);
    if (ranks.exit_code == 0) return;
    opt.trainer_processes = ranks.trainer.get();
    opt.rollout_processes = ranks.rollout.get();
    rl::RunSummary s = rl::run_local(cfg, opt);

    std::vector<nlohmann::json> rows;
    std::ifstream in(s.metrics_path);
    for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
    const bool gpu = cfg.train_device == "cuda";
    std::printf("bench rl: %s, rollout %s %s%s, train %s %s, %lld prompts x %d samples a step, ep %d\n",
                a.config.c_str(), cfg.rollout_device.c_str(), cfg.rollout_dtype.c_str(),
                cfg.rollout_kv_cache_dtype == "fp8" ? " (fp8 KV cache)" : "", cfg.train_device.c_str(),
                cfg.train_dtype.c_str(), static_cast<long long>(cfg.prompts_per_step), cfg.group_size,
                cfg.ep_ranks);
    const int processes = cfg.train_ranks + cfg.rollout_ranks - 1;
    if (processes > 1) {
        const bool one_gpu = gpu && at::detail::getCUDAHooks().getNumGPUs() == 1;
        std::printf("ranks: trainer %d, rollout %d processes (%d in all)%s\n", cfg.train_ranks,
                    cfg.rollout_ranks, processes,
                    one_gpu ? "; they share one GPU: functional figures, not speed" : "");
    }
    std::printf(
        "active parameters %s in the layers + %s in the output projection (training FLOPs: 6 x "
        "layers x all tokens + 6 x output x response tokens + 12 x layers x heads x head_dim x causal "
        "query-key pairs)\n\n",
        human_count(trunk_parameters(cfg.model)).c_str(), human_count(output_parameters(cfg.model)).c_str());
    std::printf("%5s %9s %9s %9s %9s %9s %9s %9s %11s %11s %7s\n", "step", "rollout_s", "reward_s", "sync_s",
                "train_s", "publish_s", "other_s", "step_s", "gen_tok/s", "train_tok/s", "mfu");
    std::vector<double> share_other, rollout, train, sync, step_s, gen_rate, train_rate, mfu;
    double decode_s = 0, decode_bytes = 0, decode_steps = 0, rollout_peak = 0, train_peak = 0, lent = 0,
           kept = 0;
    for (const auto& r : rows) {
        const double ro = number(r, "rollout_s"), rw = number(r, "reward_s"), sy = number(r, "sync_s"),
                     tr = number(r, "train_s"), pu = number(r, "publish_s"), st = number(r, "step_seconds");
        const double other = std::max(0.0, st - ro - rw - sy - tr - pu);
        const double gen = ro > 0 ? number(r, "response_tokens") / ro : 0;
        const double trained = tr > 0 ? number(r, "train_tokens") / tr : 0;
        const double flops = training_flops(cfg.model, number(r, "train_tokens"),
                                            number(r, "response_tokens"), number(r, "attention_pairs"));
        const double util = gpu && tr > 0 ? flops / tr / (a.peak_tflops * 1e12) : 0;
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
        decode_s += number(r, "decode_s");
        decode_bytes += number(r, "decode_bytes");
        decode_steps += number(r, "decode_steps");
        rollout_peak = std::max(rollout_peak, number(r, "rollout_peak_bytes"));
        train_peak = std::max(train_peak, number(r, "train_peak_bytes"));
        lent = std::max(lent, number(r, "rollout_released_bytes"));
        kept = std::max(kept, number(r, "rollout_kept_bytes"));
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
    if (decode_s > 0) {
        // The decode steps inside the loop (sampling and routing records included) against the
        // device's copy bandwidth, bytes counted as `moerl bench rollout` counts them.
        const double bw = decode_bytes / decode_s, copy = copy_bandwidth(at::Device(at::kCUDA, 0));
        std::printf(
            "decode steps: %.0f in %.3f s (%.3f ms and %s a step: dense weights, distinct experts, KV "
            "cache attended): %.0f GB/s, %.1f%% of the device copy bandwidth (%.0f GB/s)%s\n",
            decode_steps, decode_s, 1e3 * decode_s / std::max(1.0, decode_steps),
            human_bytes(decode_bytes / std::max(1.0, decode_steps)).c_str(), bw / 1e9, 100 * bw / copy,
            copy / 1e9, cfg.rollout_ranks > 1 ? "; rank 0 of the rollout engine" : "");
    }
    if (rollout_peak > 0 || train_peak > 0)
        std::printf("peak GPU memory: rollout %s, training %s%s\n", human_bytes(rollout_peak).c_str(),
                    human_bytes(train_peak).c_str(),
                    lent > 0 ? ("; the rollout engine lends training " + human_bytes(lent) +
                                " (its KV cache and weight copies) and keeps " + human_bytes(kept) +
                                " (step buffers, graph pools)")
                                   .c_str()
                             : "");
    if (cfg.rollout_device == "cuda" && cfg.train_device == "cuda") {
        // The in-memory sync copies the trainer's weights into the rollout model (bf16 for FP8
        // rollout too, which then quantises its e4m3 copies): its floor is a device copy of the same
        // bytes, timed here in the same process.
        const double bytes =
            static_cast<double>(cfg.model.num_parameters()) * (cfg.rollout_dtype == "fp32" ? 4 : 2);
        const double copy = device_copy_seconds(static_cast<int64_t>(bytes));
        std::printf("weight sync %.2f ms against a device copy of the same %s: %.2f ms (%.2fx)\n",
                    1e3 * median(sync), human_bytes(bytes).c_str(), 1e3 * copy, median(sync) / copy);
    }
    std::printf("metrics: %s\n", s.metrics_path.c_str());
}

struct TrainBenchArgs {
    std::string config;
    int64_t samples = 16;  // sequences a step
    int64_t prompt = 1024;
    int64_t response = 1024;
    int64_t steps = 6;
    int64_t warmup = 2;
    int64_t micro_batch_tokens = -1;        // -1: the config's train.micro_batch_tokens
    bool activation_checkpointing = false;  // true: on whatever the config says
    int layers = 0;                         // 0: the config's model.num_layers
    std::string device, dtype;
    std::string moments_dtype;  // empty: the config's train.moments_dtype
    double peak_tflops = 989;
    std::string trace;  // a Chrome trace of the last step (LibTorch's profiler)
};

// Runs fn under LibTorch's profiler (operators, and the kernels on a GPU) and writes what it
// recorded to `path` as a Chrome trace (chrome://tracing, Perfetto; bench/trace_kernels.py sums
// the kernels by kind).
void write_trace(const std::string& path, bool gpu, const std::function<void()>& fn) {
    namespace prof = torch::autograd::profiler;
    using torch::profiler::impl::ActivityType;
    std::set<ActivityType> activities{ActivityType::CPU};
    if (gpu) activities.insert(ActivityType::CUDA);
    const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO,
                                                       /*report_input_shapes=*/true);
    auto fail = [](const c10::Error& e) {
        MOERL_FAIL("bench train: --trace needs LibTorch built with Kineto (PyTorch's are; Debian's is not): ",
                   e.what_without_backtrace());
    };
    try {
        prof::prepareProfiler(config, activities);
        prof::enableProfiler(config, activities);
    } catch (const c10::Error& e) {
        fail(e);
    }
    fn();
    std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
    MOERL_CHECK(result != nullptr, "bench train: the profiler returned no result");
    try {
        result->save(path);
    } catch (const c10::Error& e) {
        fail(e);
    }
}

// `moerl bench train`: the trainer alone on synthetic samples of a chosen length (random tokens,
// behaviour log-probs equal to the uniform policy's, advantages of alternating sign), so training
// speed is measured at RL lengths without a rollout.
void bench_train(const TrainBenchArgs& a) {
    rl::RunConfig cfg = rl::RunConfig::load(a.config);
    if (!a.device.empty()) cfg.train_device = a.device;
    if (!a.dtype.empty()) cfg.train_dtype = a.dtype;
    if (!a.moments_dtype.empty()) cfg.moments_dtype = a.moments_dtype;
    cfg.ep_ranks = 1;  // one rank: the figure of one device
    cfg.train_ranks = 1;
    cfg.train_ep_transport.clear();
    if (a.layers > 0) {
        cfg.model.num_hidden_layers = a.layers;
        cfg.model.validate();
    }
    if (a.micro_batch_tokens >= 0) cfg.micro_batch_tokens = a.micro_batch_tokens;
    if (a.activation_checkpointing) cfg.activation_checkpointing = true;
    MOERL_CHECK(a.samples >= 1 && a.prompt >= 1 && a.response >= 1,
                "bench train: --samples, --prompt and "
                "--response must be at least 1");
    MOERL_CHECK(a.warmup >= 0 && a.warmup < a.steps, "bench train: --warmup ", a.warmup,
                " must be below --steps ", a.steps);
    cfg.group_size = 1;
    cfg.prompts_per_step = a.samples;
    cfg.sampling.max_new_tokens = static_cast<int>(a.response);
    const at::Device device = cfg.train_device == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    const bool gpu = device.is_cuda();
    const fs::path work = fs::temp_directory_path() / ("moerl-bench-train-" + std::to_string(::getpid()));
    fs::create_directories(work);
    model::reset_peak_allocated_bytes(device);
    rl::PolicyTrainer trainer(cfg, work.string());
    const int64_t setup_peak = model::peak_allocated_bytes(device);

    std::vector<rl::ExperienceRecord> batch(a.samples);
    std::vector<double> adv(a.samples);
    uint64_t state = 0x9e3779b97f4a7c15ull;
    auto next_token = [&] {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        return static_cast<int>((state >> 33) % static_cast<uint64_t>(cfg.model.vocab_size));
    };
    const float uniform_lp = -static_cast<float>(std::log(static_cast<double>(cfg.model.vocab_size)));
    for (int64_t i = 0; i < a.samples; ++i) {
        auto& r = batch[i];
        r.task_id = "bench-" + std::to_string(i);
        r.task.prompt_idx = static_cast<int>(i);
        for (int64_t j = 0; j < a.prompt; ++j) r.task.prompt_tokens.push_back(next_token());
        for (int64_t j = 0; j < a.response; ++j) {
            r.trajectory.tokens.push_back(next_token());
            r.trajectory.logprobs.push_back(uniform_lp);
            r.trajectory.versions.push_back(0);
        }
        adv[i] = i % 2 == 0 ? 1.0 : -1.0;
    }
    const double all_tokens = static_cast<double>(a.samples * (a.prompt + a.response));
    const double response_tokens = static_cast<double>(a.samples * a.response);
    const double length = static_cast<double>(a.prompt + a.response);
    const double pairs = static_cast<double>(a.samples) * length * (length + 1) / 2;
    const double flops = training_flops(cfg.model, all_tokens, response_tokens, pairs);
    const std::string micro =
        cfg.micro_batch_tokens > 0
            ? "packed micro-batches of " + std::to_string(cfg.micro_batch_tokens) + " tokens"
            : std::string("one padded batch");
    std::printf(
        "bench train: %s, %s %s, %d layers, %lld samples x (%lld prompt + %lld response) = %.0f tokens "
        "a step, %s, %d ppo epoch(s), %s AdamW moments%s\n",
        a.config.c_str(), cfg.train_device.c_str(), cfg.train_dtype.c_str(), cfg.model.num_hidden_layers,
        static_cast<long long>(a.samples), static_cast<long long>(a.prompt),
        static_cast<long long>(a.response), all_tokens, micro.c_str(), cfg.ppo_epochs,
        cfg.moments_dtype.c_str(), cfg.activation_checkpointing ? ", activation checkpointing" : "");
    std::printf("active parameters: layers %s + output %s; %.2f TFLOP a step (%.2f of them attention's)",
                human_count(trunk_parameters(cfg.model)).c_str(),
                human_count(output_parameters(cfg.model)).c_str(), flops / 1e12,
                (flops - training_flops(cfg.model, all_tokens, response_tokens, 0)) / 1e12);
    if (gpu)
        std::printf("; weights, masters and moments %s",
                    human_bytes(static_cast<double>(setup_peak)).c_str());
    std::printf("\n\n");
    std::printf("%5s %9s %11s %7s %12s %9s\n", "step", "train_s", "tok/s", "mfu", "peak_mem", "loss");
    std::vector<double> times, rates, mfus;
    int64_t peak = 0;
    at::Tensor fence = at::zeros({1}, at::TensorOptions().device(device));
    for (int64_t step = 0; step < a.steps; ++step) {
        model::reset_peak_allocated_bytes(device);
        fence.item<float>();
        const auto t0 = Clock::now();
        rl::TrainStats st = trainer.update(batch, adv);  // returns when its device work has run
        const double t = seconds_since(t0);
        const int64_t step_peak = model::peak_allocated_bytes(device);
        const double util = gpu ? flops / t / (a.peak_tflops * 1e12) : 0;
        char mfu_text[16] = "-";
        if (gpu) std::snprintf(mfu_text, sizeof mfu_text, "%.1f%%", 100 * util);
        std::printf("%5lld %9.4f %11.0f %7s %12s %9.4f\n", static_cast<long long>(step), t, all_tokens / t,
                    mfu_text, gpu ? human_bytes(static_cast<double>(step_peak)).c_str() : "-", st.loss);
        if (step < a.warmup) continue;
        times.push_back(t);
        rates.push_back(all_tokens / t);
        mfus.push_back(util);
        peak = std::max(peak, step_peak);
    }
    std::printf("\nmedian over steps %lld..%lld: %.4f s a step, %.0f trained tok/s",
                static_cast<long long>(a.warmup), static_cast<long long>(a.steps - 1), median(times),
                median(rates));
    if (gpu) {
        std::printf(", training MFU %.1f%% of %.0f TFLOP/s, peak GPU memory %s", 100 * median(mfus),
                    a.peak_tflops, human_bytes(static_cast<double>(peak)).c_str());
    } else {
        // The CPU allocator keeps no statistics: the process's high-water mark stands in (weights,
        // optimizer state and the largest step's activations, as the GPU figure counts them).
        rusage usage{};
        getrusage(RUSAGE_SELF, &usage);
        std::printf(", peak host memory (RSS) %s",
                    human_bytes(static_cast<double>(usage.ru_maxrss) * 1024).c_str());
    }
    std::printf("\n");
    if (!a.trace.empty()) {
        // One more update, outside the figures above (the profiler slows it down).
        write_trace(a.trace, gpu, [&] { trainer.update(batch, adv); });
        std::printf("trace of one more update: %s\n", a.trace.c_str());
    }
    std::error_code ec;
    fs::remove_all(work, ec);
}

struct ExperienceBenchArgs {
    std::string config;
    int64_t samples = 64;  // records a step
    int64_t prompt = 1024;
    int64_t response = 1024;
    int repeats = 3;
    int layers = 0;  // 0: the config's model.num_layers
};

// Fixed pseudo-random numbers for the synthetic records and responses (the same every run).
struct XorShift {
    uint64_t state = 88172645463325252ull;
    uint64_t operator()() {
        state ^= state << 13, state ^= state >> 7, state ^= state << 17;
        return state;
    }
};

// A step's experience records at a model's shape (routing recorded over every position), encoded
// and parsed as the rollout workers and the trainer do, against the same records with the per-token
// arrays as JSON numbers (the format before they were packed; still read).
void bench_experience(const ExperienceBenchArgs& a) {
    rl::RunConfig cfg = rl::RunConfig::load(a.config);
    if (a.layers > 0) cfg.model.num_hidden_layers = a.layers;
    const int layers = cfg.model.num_moe_layers(), K = cfg.model.num_experts_per_tok;
    std::vector<rl::ExperienceRecord> records(static_cast<size_t>(a.samples));
    XorShift next;
    for (size_t i = 0; i < records.size(); ++i) {
        rl::ExperienceRecord& e = records[i];
        e.task_id = rl::task_id(0, static_cast<int>(i / 8), static_cast<int>(i % 8));
        e.task.problem = {"bench", "", ""};
        for (int64_t t = 0; t < a.prompt; ++t)
            e.task.prompt_tokens.push_back(static_cast<int>(next() % 151000));
        rl::Trajectory& tr = e.trajectory;
        for (int64_t t = 0; t < a.response; ++t) {
            tr.tokens.push_back(static_cast<int>(next() % 151000));
            tr.logprobs.push_back(-static_cast<float>(next() % 100000) / 7919.0f);
            tr.versions.push_back(12);
        }
        tr.num_moe_layers = layers;
        tr.top_k = K;
        tr.routing.resize(static_cast<size_t>((a.prompt + a.response) * layers * K));
        for (auto& r : tr.routing) r = static_cast<int16_t>(next() % std::max(1, cfg.model.num_experts));
    }
    auto as_arrays = [](const rl::ExperienceRecord& e) {  // the earlier format of the same record
        nlohmann::json j = nlohmann::json::parse(rl::to_json(e));
        j.erase("arrays");
        nlohmann::json& o = j["trajectory"];
        o["tokens"] = e.trajectory.tokens;
        o["logprobs"] = e.trajectory.logprobs;
        o["versions"] = e.trajectory.versions;
        o["routing"] = e.trajectory.routing;
        return j;
    };
    using Clock = std::chrono::steady_clock;
    auto seconds = [](Clock::time_point t0) {
        return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    std::printf(
        "bench experience: %s, %lld records of %lld prompt + %lld response tokens, routing over %d MoE "
        "layers x top-%d, median of %d\n\n",
        a.config.c_str(), static_cast<long long>(a.samples), static_cast<long long>(a.prompt),
        static_cast<long long>(a.response), layers, K, a.repeats);
    std::printf(
        "| per-token arrays | bytes a step | encode ms a step | decode ms a step |\n|---|---|---|---|\n");
    std::vector<nlohmann::json> old_objects;
    for (const auto& e : records) old_objects.push_back(as_arrays(e));
    for (const bool packed : {false, true}) {
        std::vector<double> enc, dec;
        double bytes = 0;
        for (int r = 0; r < a.repeats; ++r) {
            std::vector<std::string> texts(records.size());
            auto t0 = Clock::now();
            for (size_t i = 0; i < records.size(); ++i)
                texts[i] = packed ? rl::to_json(records[i]) : old_objects[i].dump();
            enc.push_back(seconds(t0));
            bytes = 0;
            for (const auto& t : texts) bytes += static_cast<double>(t.size());
            t0 = Clock::now();
            size_t check = 0;
            for (const auto& t : texts) check += rl::experience_from_json(t).trajectory.routing.size();
            dec.push_back(seconds(t0));
            MOERL_CHECK(check == records.size() * records[0].trajectory.routing.size(),
                        "bench experience: a record lost its routing");
        }
        std::printf("| %s | %s | %.1f | %.1f |\n",
                    packed ? "base64 of their bytes (now)" : "JSON numbers (before)",
                    human_bytes(bytes).c_str(), 1e3 * median(enc), 1e3 * median(dec));
    }
}

struct RewardBenchArgs {
    std::string config;
    int64_t samples = 0;     // 0: a step's (train.prompts_per_step x train.group_size)
    int64_t response = 128;  // tokens of a random response
    int repeats = 5;
};

// What scoring a step's responses costs on the host: the run's prompts, its tokenizer and its
// verifier mix (or its task's verifier), as the rollout workers score them when sequences finish.
// Two kinds of response: random tokens (what a policy with random weights writes: much text, many
// numbers for the math verifier to look through) and each prompt's reference answer (short, right).
void bench_reward(const RewardBenchArgs& a) {
    const rl::RunConfig cfg = rl::RunConfig::load(a.config);
    MOERL_CHECK(a.response > 0 && a.repeats > 0 && a.samples >= 0,
                "bench reward: --response and --repeats must be positive, --samples not negative");
    const int per_step = cfg.prompts_per_step * cfg.group_size;
    const int64_t n = a.samples > 0 ? a.samples : per_step;
    std::unique_ptr<rl::PromptSource> source = rl::make_prompt_source(cfg);
    std::unique_ptr<rl::Rewarder> rewarder = rl::make_prompt_rewarder(cfg);
    const int vocab = rl::response_vocab_size(cfg);
    std::vector<rl::Scored> random_batch, answer_batch;
    XorShift next;
    for (int64_t i = 0; i < n; ++i) {
        // Sample i of the run's step i / per_step: prompt (i % per_step) / group_size of it.
        const rl::Prompt p = source->train(i / per_step, static_cast<int>(i % per_step / cfg.group_size));
        rl::Scored r{p.problem, p.tokens, {}, true};
        for (int64_t t = 0; t < a.response; ++t)
            r.response_tokens.push_back(static_cast<int>(next() % vocab));
        random_batch.push_back(r);
        r.response_tokens = rl::encode_response(cfg, p.problem.answer);
        answer_batch.push_back(std::move(r));
    }
    using Clock = std::chrono::steady_clock;
    std::printf("bench reward: %s, %lld responses a step (%s), median of %d\n\n", a.config.c_str(),
                static_cast<long long>(n),
                cfg.use_data ? "reward.verifiers over the decoded text" : "the task's verifier", a.repeats);
    std::printf(
        "| responses | tokens each | reward mean | ms a step | us a response |\n|---|---|---|---|---|\n");
    for (const bool random : {true, false}) {
        const std::vector<rl::Scored>& batch = random ? random_batch : answer_batch;
        std::vector<double> times;
        double mean = 0;
        for (int r = 0; r < a.repeats; ++r) {
            const auto t0 = Clock::now();
            const std::vector<double> rewards = rewarder->score(batch);
            times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
            mean = 0;
            for (double x : rewards) mean += x / static_cast<double>(rewards.size());
        }
        double tokens = 0;
        for (const auto& s : batch) tokens += static_cast<double>(s.response_tokens.size());
        std::printf("| %s | %.0f | %.3f | %.2f | %.1f |\n", random ? "random tokens" : "reference answers",
                    tokens / static_cast<double>(batch.size()), mean, 1e3 * median(times),
                    1e6 * median(times) / static_cast<double>(batch.size()));
    }
}

}  // namespace

void register_bench_rl(CLI::App& bench) {
    {
        auto a = std::make_shared<RewardBenchArgs>();
        CLI::App* cmd = bench.add_subcommand(
            "reward", "Scoring a step's responses with the run's verifiers: host time a step and a response");
        cmd->add_option("config", a->config, "Run configuration (YAML): its task or data, tokenizer, reward")
            ->required();
        cmd->add_option("--samples", a->samples,
                        "Responses a step (default train.prompts_per_step x train.group_size)");
        cmd->add_option("--response", a->response, "Tokens of a random response (default 128)");
        cmd->add_option("--repeats", a->repeats, "Timed repeats, the median printed (default 5)");
        cmd->callback([a] { bench_reward(*a); });
    }
    {
        auto a = std::make_shared<ExperienceBenchArgs>();
        CLI::App* cmd = bench.add_subcommand(
            "experience",
            "A step's experience records at a model's shape: their size, encoding and parsing time");
        cmd->add_option("config", a->config, "Run configuration (YAML): its model section")->required();
        cmd->add_option("--samples", a->samples, "Records a step (default 64)");
        cmd->add_option("--prompt", a->prompt, "Prompt tokens a record (default 1024)");
        cmd->add_option("--response", a->response, "Response tokens a record (default 1024)");
        cmd->add_option("--repeats", a->repeats, "Timed repeats, the median printed (default 3)");
        cmd->add_option("--layers", a->layers, "Overrides model.num_layers");
        cmd->callback([a] { bench_experience(*a); });
    }
    {
        auto a = std::make_shared<TrainBenchArgs>();
        CLI::App* cmd = bench.add_subcommand(
            "train", "The GRPO trainer alone on synthetic samples: time, tokens/s, MFU and memory a step");
        cmd->add_option("config", a->config, "Run configuration (YAML): model and train sections")
            ->required();
        cmd->add_option("--samples", a->samples, "Sequences a step (default 16)");
        cmd->add_option("--prompt", a->prompt, "Prompt tokens a sequence (default 1024)");
        cmd->add_option("--response", a->response, "Response tokens a sequence (default 1024)");
        cmd->add_option("--steps", a->steps, "Updates to run (default 6)");
        cmd->add_option("--warmup", a->warmup, "First updates left out of the summary (default 2)");
        cmd->add_option("--micro-batch-tokens", a->micro_batch_tokens,
                        "Overrides train.micro_batch_tokens (0 = one padded batch)");
        cmd->add_option("--layers", a->layers, "Overrides model.num_layers");
        cmd->add_flag("--activation-checkpointing", a->activation_checkpointing,
                      "Sets train.activation_checkpointing (layers recomputed in the backward)");
        cmd->add_option("--device", a->device, "cpu or cuda: overrides train.device");
        cmd->add_option("--dtype", a->dtype, "fp32 or bf16: overrides train.dtype");
        cmd->add_option("--moments-dtype", a->moments_dtype,
                        "fp32 or bf16: overrides train.moments_dtype (AdamW's moments)")
            ->check(CLI::IsMember({"fp32", "bf16"}));
        cmd->add_option("--peak-tflops", a->peak_tflops,
                        "The GPU's dense bf16 peak for MFU (default 989, H200)");
        cmd->add_option(
            "--trace", a->trace,
            "After the steps, one more update traced by LibTorch's profiler into this Chrome trace");
        cmd->callback([a] { bench_train(*a); });
    }
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
    cmd->add_option(
        "--save-policy", a->save_policy,
        "Write the last policy's weights here (Hugging Face layout, fp32): `bench rollout --model` "
        "then decodes with the routing the run trained, outside the loop");
    cmd->callback([a] { bench_rl(*a); });
}

}  // namespace moerl::cli
