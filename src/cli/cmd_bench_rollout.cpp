// `moerl bench rollout`: generation throughput. On CUDA the generation engine (model/generator.hpp)
// on a Qwen3-MoE-shaped model with random weights, per batch size: prefill, decode step time,
// tokens/s and the bandwidth the decode steps draw against the device copy bandwidth of the same
// run; optionally the same model, batch and lengths through Hugging Face transformers' generate.
// On the CPU the RL rollout engine of a run configuration (needs the rl layer).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/cuda.h>
#if defined(MOERL_HAVE_CUDA)
#include <cuda_profiler_api.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "bench_util.hpp"
#include "commands.hpp"
#include "launch.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/ep/c10d_store.hpp"
#include "moerl/model/config.hpp"
#include "moerl/model/generator.hpp"
#include "moerl/model/model.hpp"

#ifdef MOERL_HAVE_CMD_RUN
#include "moerl/rl/config.hpp"
#include "moerl/rl/prompt_source.hpp"
#include "moerl/rl/roles.hpp"
#endif

namespace moerl::cli {
namespace {

struct RolloutArgs {
    std::string device = "cpu";
    std::string config;     // cpu: run configuration (YAML); cuda: model config.json
    std::string model_dir;  // cuda: a Hugging Face checkpoint whose weights decode (random otherwise)
    int layers = 8;         // built-in CUDA model: layers of the Qwen3-30B-A3B shape
    std::vector<int> batches{1, 16, 64, 256};
    int prompt = 128;  // the case being run (the first of the sweeps elsewhere)
    int new_tokens = 128;
    std::vector<int> prompts{128}, news{128};  // cuda: --prompt / --new sweeps
    int group = 1;  // cuda: samples per prompt (a GRPO group), run with and without shared prompt blocks
    // cuda: a run configuration whose prompts (task or dataset, through its tokenizer and chat
    // template) the batches decode instead of random ones, so that they route as that run's rollout
    // does; run_prompts holds them once loaded, prompt i of the run's steps in order.
    std::string prompts_from;
    std::vector<std::vector<int64_t>> run_prompts;
    std::vector<std::string> weights{"bf16"};    // cuda: what decode reads: bf16, fp8 (e4m3 copies)
    std::vector<std::string> kv_caches{"bf16"};  // cuda: the KV cache: bf16, fp8 (e4m3 rows, scales)
    int sequences = 512;                         // cpu
    bool no_graphs = false;
    bool profile = false;        // per-kernel times of eager steps
    bool profile_range = false;  // cudaProfilerStart/Stop around the first batch's timed steps
    std::string hf_dir;          // write the checkpoint here and run the transformers reference
    std::string hf_script = "bench/hf_generate.py";
    uint64_t seed = 1;
    // cuda: > 0 draws each token on the device from softmax(logits / temperature), the next step queued
    // before the host reads the draws, as the RL rollout engine decodes (0: greedy, a step at a time).
    double temperature = 0;
    bool record_routing = false;  // cuda: every step also copies the experts each row used to the host
    int ep_ranks = 0;             // > 0: expert parallelism over this many GPUs (one process each)
    // cuda: prompts joining running sequences, prefilled in parts of this many tokens a step (0 =
    // whole): the decode pauses they cause (bench_join).
    std::vector<int64_t> join_chunks;
    std::vector<std::string> transports{"cuda", "nccl"};
};

// Qwen3-30B-A3B's shape (hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of width
// 768, top-8, vocabulary 151936) with fewer layers so a checkpoint fits one GPU and one disk.
model::ModelConfig qwen3_30b_a3b_shape(int layers) {
    model::ModelConfig c = bench_config(2048, layers, 32, 4, 128, 768, 128, 8, 151936);
    c.max_position_embeddings = 40960;
    return c;
}

// N(0, initializer_range) drawn on the device (seconds, not minutes, for billions of weights).
void init_on_device(model::MoeModel& m, uint64_t seed) {
    c10::NoGradGuard no_grad;
    at::manual_seed(seed);
    const double stddev = m.config().initializer_range;
    for (auto& [name, t] : m.state_dict()) {
        if (name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0)
            t.fill_(1.0);
        else
            t.normal_(0.0, stddev);
    }
}

struct Row {
    int prompt = 0, new_tokens = 0, batch = 0;
    bool shared = false;  // --group: the group's samples share their prompt's cache blocks
    std::string weights = "bf16", kv_cache = "bf16";
    double prefill_s = 0, step_s = 0, e2e_tok_s = 0, bytes_per_step = 0, experts_per_layer = 0;
    int64_t prefill_tokens = 0;  // prompt tokens run through the model
    double prompt_kv_bytes = 0;  // cache blocks the prompts hold after the prefill
    double kv_bytes = 0;         // cache blocks in use at the end of the decode
    double hf_tok_s = 0;
};

constexpr int kBlockSize = 16;  // tokens per cache block

// B sequences of a.prompt random tokens (or the run's prompts, --prompts-from), a.group samples of
// each prompt one after another.
Row bench_batch(model::Generator& gen, const model::ModelConfig& c, const RolloutArgs& a, int B) {
    Row row;
    row.prompt = a.prompt;
    row.new_tokens = a.new_tokens;
    row.batch = B;
    std::vector<std::vector<int64_t>> ps(B);
    if (!a.run_prompts.empty()) {
        int64_t tokens = 0;
        for (int b = 0; b < B; ++b) {
            ps[b] = a.run_prompts[static_cast<size_t>(b / a.group)];
            tokens += static_cast<int64_t>(ps[b].size());
        }
        row.prompt = static_cast<int>((tokens + B / 2) / B);  // the mean length
    } else {
        at::Tensor prompts = at::randint(1, c.vocab_size, {B / a.group, a.prompt}, at::kLong);
        for (int b = 0; b < B; ++b) {
            const int64_t* p = prompts[b / a.group].data_ptr<int64_t>();
            ps[b].assign(p, p + a.prompt);
        }
    }
    const model::GeneratorStats before = gen.stats();
    const int64_t free_before = gen.free_blocks();
    std::vector<int> slots;
    for (int b = 0; b < B; ++b) slots.push_back(gen.acquire());
    torch::cuda::synchronize();
    const auto t0 = Clock::now();
    model::GenerationStep r = gen.prefill(slots, ps);
    at::Tensor next = r.greedy;
    torch::cuda::synchronize();
    row.prefill_s = seconds_since(t0);
    row.prefill_tokens = gen.stats().prefill_tokens - before.prefill_tokens;
    row.prompt_kv_bytes = static_cast<double>(free_before - gen.free_blocks()) * kBlockSize *
                          static_cast<double>(gen.kv_bytes_per_token());
    // n decode steps from `next`, which ends as the last step's tokens. Sampled: each step is queued
    // on the previous one's draws on the device and the oldest step's draws are read while the next
    // runs (Generator::queue_step, as rl::RolloutEngine decodes).
    std::mt19937_64 rng(a.seed * 7919 + static_cast<uint64_t>(B));
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    std::vector<double> uniforms(B);
    auto decode_steps = [&](int n) {
        if (a.temperature <= 0) {
            for (int s = 0; s < n; ++s) next = gen.decode(slots, next).greedy;
            return;
        }
        for (int s = 0; s < n; ++s) {
            for (double& u : uniforms) u = uniform(rng);
            gen.queue_step(slots, gen.queued_steps() > 0 ? gen.queued_tokens() : next, uniforms,
                           a.temperature);
            if (gen.queued_steps() == 2) gen.collect_step();
        }
        next = gen.queued_tokens().clone();
        while (gen.queued_steps() > 0) gen.collect_step();
    };
    // The first two steps capture this bucket's graphs (the prefill's tokens copied in, then the
    // step's own tokens read in place); the timed steps replay the second.
    const auto t1 = Clock::now();
    decode_steps(2);
    torch::cuda::synchronize();
    const double first_steps = seconds_since(t1);
    gen.reset_stats();
    const int timed = a.new_tokens - 3;
    // --profile-range: a profiler started with its collection off (ncu --profile-from-start off) sees
    // only the timed decode steps of the first batch size.
    static bool range_done = false;
    const bool range = !range_done && a.profile_range;
#if defined(MOERL_HAVE_CUDA)
    if (range) cudaProfilerStart();
#endif
    const auto t2 = Clock::now();
    decode_steps(timed);
    torch::cuda::synchronize();
    const double decode_s = seconds_since(t2);
#if defined(MOERL_HAVE_CUDA)
    if (range) cudaProfilerStop();
#endif
    range_done = range_done || range;
    row.step_s = decode_s / timed;
    row.e2e_tok_s = static_cast<double>(B) * a.new_tokens / (row.prefill_s + first_steps + decode_s);
    const model::GeneratorStats st = gen.stats();
    const int moe_layers = std::max(1, c.num_moe_layers());
    row.experts_per_layer = static_cast<double>(st.expert_weight_reads) / timed / moe_layers;
    row.bytes_per_step =
        static_cast<double>(gen.dense_bytes_per_step(B)) +
        static_cast<double>(st.expert_weight_reads) / timed * static_cast<double>(gen.expert_bytes()) +
        static_cast<double>(st.kv_tokens_read) / timed * static_cast<double>(gen.kv_bytes_per_token());
    for (const auto& [kind, ms] : gen.profile())
        std::printf("  profile batch %d: %-20s %8.3f ms/step\n", B, kind.c_str(), ms / timed);
    row.kv_bytes = static_cast<double>(free_before - gen.free_blocks()) * kBlockSize *
                   static_cast<double>(gen.kv_bytes_per_token());
    for (int s : slots) gen.release(s);
    return row;
}

// Half of B sequences decode while the other half joins with prompts of a.prompt tokens, prefilled
// `chunk` tokens a step (0: all in one step) before each decode step of the running half, as the
// RL rollout engine schedules them (rollout.prefill_chunk_tokens). What the running sequences see:
// the time between two of their tokens, against a decode step with nobody joining.
struct JoinRow {
    int prompt = 0, running = 0, joining = 0;
    int64_t chunk = 0;
    int steps = 0;                       // decode steps until every joiner was prefilled
    double join_s = 0;                   // from the first part to the last joiner's first token
    double steady_ms = 0;                // a decode step of the running half alone
    double longest_ms = 0, mean_ms = 0;  // between two tokens of the running half while others join
};

JoinRow bench_join(model::Generator& gen, const model::ModelConfig& c, const RolloutArgs& a, int B,
                   int64_t chunk) {
    JoinRow row;
    row.prompt = a.prompt;
    row.running = B - B / 2;
    row.joining = B / 2;
    row.chunk = chunk;
    auto random_prompts = [&](int n) {
        at::Tensor ids = at::randint(1, c.vocab_size, {n, a.prompt}, at::kLong);
        std::vector<std::vector<int64_t>> out(n);
        for (int i = 0; i < n; ++i)
            out[i].assign(ids[i].data_ptr<int64_t>(), ids[i].data_ptr<int64_t>() + a.prompt);
        return out;
    };
    std::vector<int> running, joining;
    for (int i = 0; i < row.running; ++i) running.push_back(gen.acquire());
    for (int i = 0; i < row.joining; ++i) joining.push_back(gen.acquire());
    at::Tensor next = gen.prefill(running, random_prompts(row.running)).greedy;
    for (int s = 0; s < 3; ++s) next = gen.decode(running, next).greedy;  // graphs captured
    torch::cuda::synchronize();
    const int steady_steps = 8;
    auto t = Clock::now();
    for (int s = 0; s < steady_steps; ++s) next = gen.decode(running, next).greedy;
    torch::cuda::synchronize();
    row.steady_ms = seconds_since(t) * 1e3 / steady_steps;
    const std::vector<std::vector<int64_t>> prompts = random_prompts(row.joining);
    std::vector<int64_t> done(row.joining, 0);
    const auto start = Clock::now();
    auto last = start;
    double total_ms = 0;
    for (size_t first = 0; first < prompts.size();) {
        std::vector<int> slots;
        std::vector<std::vector<int64_t>> parts;
        int64_t budget = chunk > 0 ? chunk : std::numeric_limits<int64_t>::max();
        for (size_t j = first; j < prompts.size() && budget > 0; ++j) {
            const int64_t take = std::min<int64_t>(budget, a.prompt - done[j]);
            slots.push_back(joining[j]);
            parts.emplace_back(prompts[j].begin() + done[j], prompts[j].begin() + done[j] + take);
            done[j] += take;
            budget -= take;
        }
        gen.prefill(slots, parts);
        while (first < prompts.size() && done[first] == a.prompt) ++first;
        next = gen.decode(running, next).greedy;
        torch::cuda::synchronize();
        const auto now = Clock::now();
        const double gap = std::chrono::duration<double, std::milli>(now - last).count();
        row.longest_ms = std::max(row.longest_ms, gap);
        total_ms += gap;
        last = now;
        ++row.steps;
    }
    row.join_s = seconds_since(start);
    row.mean_ms = total_ms / row.steps;
    for (int s : running) gen.release(s);
    for (int s : joining) gen.release(s);
    return row;
}

// Runs the transformers reference; it prints one JSON object per batch: {"batch": B, "tokens_per_s": x}.
std::map<int, double> run_hf_reference(const RolloutArgs& a) {
    std::ostringstream batches;
    for (size_t i = 0; i < a.batches.size(); ++i) batches << (i ? "," : "") << a.batches[i];
    const std::string cmd = "python3 " + a.hf_script + " --model " + a.hf_dir + " --batch " + batches.str() +
                            " --prompt " + std::to_string(a.prompt) + " --new " +
                            std::to_string(a.new_tokens) + " --seed " + std::to_string(a.seed);
    std::printf("reference: %s\n", cmd.c_str());
    std::fflush(stdout);
    std::map<int, double> out;
    FILE* p = popen(cmd.c_str(), "r");
    MOERL_CHECK(p != nullptr, "cannot run the transformers reference: ", cmd);
    char line[4096];
    while (std::fgets(line, sizeof line, p) != nullptr) {
        std::fputs(line, stdout);
        int batch = 0;
        double tps = 0;
        if (std::sscanf(line, "{\"batch\": %d, \"tokens_per_s\": %lf", &batch, &tps) == 2) out[batch] = tps;
    }
    const int rc = pclose(p);
    if (rc != 0) std::printf("reference exited with status %d\n", rc);
    return out;
}

// FP8 decode (weights, KV cache or both) against bf16 on the same weights and prompts, teacher-forced:
// each step both engines take bf16's greedy tokens. Prints the share of rows whose fp8 argmax is
// bf16's and |log p_bf16(t) - log p_fp8(t)| for bf16's token t (mean and largest).
void fp8_agreement(const model::MoeModel& m, const model::ModelConfig& c, const RolloutArgs& a,
                   bool fp8_weights, bool fp8_kv_cache) {
    c10::NoGradGuard no_grad;
    const int B = std::min(16, *std::max_element(a.batches.begin(), a.batches.end()));
    const int steps = std::min(64, a.news.front());
    const int prompt = a.prompts.front();
    at::Tensor ids = at::randint(1, c.vocab_size, {B, prompt}, at::kLong);
    std::vector<std::vector<int64_t>> ps(B);
    for (int b = 0; b < B; ++b) ps[b].assign(ids[b].data_ptr<int64_t>(), ids[b].data_ptr<int64_t>() + prompt);
    model::GeneratorOptions o;
    o.max_batch = B;
    o.max_seq_len = prompt + steps + 1;
    o.block_size = kBlockSize;
    model::Generator bf16(m, o);
    o.fp8_weights = fp8_weights;
    o.fp8_kv_cache = fp8_kv_cache;
    model::Generator fp8(m, o);
    std::vector<int> s16, s8;
    for (int b = 0; b < B; ++b) s16.push_back(bf16.acquire()), s8.push_back(fp8.acquire());
    at::Tensor tok = bf16.prefill(s16, ps).greedy.clone();
    fp8.prefill(s8, ps);  // prefill computes in bf16 in both (the fp8 cache stores it quantised)
    int64_t agree = 0;
    double sum = 0, largest = 0;
    for (int i = 0; i < steps; ++i) {
        const model::GenerationStep r8 = fp8.decode(s8, tok);
        const at::Tensor lp8 = at::log_softmax(r8.logits.to(at::kFloat), -1);
        const at::Tensor g8 = r8.greedy.clone();
        const model::GenerationStep r16 = bf16.decode(s16, tok);
        const at::Tensor lp16 = at::log_softmax(r16.logits.to(at::kFloat), -1);
        const at::Tensor t = r16.greedy.unsqueeze(1);
        const at::Tensor diff = (lp16.gather(1, t) - lp8.gather(1, t)).abs();
        agree += g8.eq(r16.greedy).sum().item<int64_t>();
        sum += diff.sum().item<double>();
        largest = std::max(largest, diff.max().item<double>());
        tok = r16.greedy.clone();
    }
    const double n = static_cast<double>(B) * steps;
    std::printf(
        "%s weights, %s KV cache against bf16 (batch %d, prompt %d, %d decode steps teacher-forced on bf16's "
        "greedy tokens): greedy agreement %.1f%% (%lld of %.0f), mean |log-prob difference| %.4f, largest "
        "%.4f\n",
        fp8_weights ? "fp8" : "bf16", fp8_kv_cache ? "fp8" : "bf16", B, prompt, steps,
        100.0 * static_cast<double>(agree) / n, static_cast<long long>(agree), n, sum / n, largest);
    std::fflush(stdout);
}

// --join-chunk: bench_join for every prompt, batch and chunk, then a table.
void bench_joins(const model::MoeModel& m, const model::ModelConfig& c, const RolloutArgs& args) {
    const int max_batch = *std::max_element(args.batches.begin(), args.batches.end());
    std::vector<JoinRow> rows;
    for (int prompt : args.prompts) {
        RolloutArgs a = args;
        a.prompt = prompt;
        int64_t longest_join = 0;  // decode steps the running half may take: one a part at most
        for (int B : a.batches)
            for (int64_t chunk : a.join_chunks)
                longest_join = std::max<int64_t>(
                    longest_join, chunk > 0 ? (int64_t{B / 2} * prompt + chunk - 1) / chunk : 1);
        model::Generator gen(m, {.max_batch = max_batch,
                                 .max_seq_len = static_cast<int>(prompt + longest_join + 16),
                                 .block_size = kBlockSize,
                                 .cuda_graphs = !a.no_graphs});
        {
            const int s = gen.acquire();
            gen.decode({s}, gen.prefill({s}, {std::vector<int64_t>(prompt, 1)}).greedy);
            torch::cuda::synchronize();
            gen.release(s);
        }
        for (int B : a.batches)
            for (int64_t chunk : a.join_chunks) {
                rows.push_back(bench_join(gen, c, a, B, chunk));
                const JoinRow& r = rows.back();
                std::printf(
                    "prompt %d, %d decoding while %d join, parts of %s: %d steps, longest %.2f ms "
                    "between tokens (%.2f alone)\n",
                    r.prompt, r.running, r.joining,
                    r.chunk > 0 ? std::to_string(r.chunk).c_str() : "whole prompts", r.steps, r.longest_ms,
                    r.steady_ms);
                std::fflush(stdout);
            }
    }
    std::printf(
        "\n| prompt | decoding | joining | prefill a step | steps to join | join s | decode step alone ms | "
        "longest between tokens ms | mean between tokens ms |\n|---|---|---|---|---|---|---|---|---|\n");
    for (const JoinRow& r : rows)
        std::printf("| %d | %d | %d | %s | %d | %.3f | %.2f | %.2f | %.2f |\n", r.prompt, r.running,
                    r.joining, r.chunk > 0 ? std::to_string(r.chunk).c_str() : "whole", r.steps, r.join_s,
                    r.steady_ms, r.longest_ms, r.mean_ms);
}

// One case of a.prompt + a.new_tokens at every batch size, with the decode reading `weights` and
// `kv_cache` (bf16 or fp8), the group's prompt blocks shared or not: its rows appended to `rows`.
void bench_format(const model::MoeModel& m, const model::ModelConfig& c, const RolloutArgs& a,
                  const std::string& weights, const std::string& kv_cache, bool share, double copy_bw,
                  std::vector<Row>& rows) {
    model::Generator gen(m, {.max_batch = *std::max_element(a.batches.begin(), a.batches.end()),
                             .max_seq_len = a.prompt + a.new_tokens + 1,
                             .block_size = kBlockSize,
                             .num_blocks = 0,
                             .share_prompts = share,
                             .cuda_graphs = !a.no_graphs && !a.profile,
                             .profile = a.profile,
                             .record_routing = a.record_routing,
                             .fp8_weights = weights == "fp8",
                             .fp8_kv_cache = kv_cache == "fp8"});
    {
        // Warm-up: the first prefill and decode pay for library initialisation.
        const int s = gen.acquire();
        model::GenerationStep w = gen.prefill({s}, {std::vector<int64_t>(a.prompt, 1)});
        gen.decode({s}, w.greedy);
        torch::cuda::synchronize();
        gen.release(s);
    }
    for (int B : a.batches) {
        rows.push_back(bench_batch(gen, c, a, B));
        Row& r = rows.back();
        r.shared = share && a.group > 1;
        r.weights = weights;
        r.kv_cache = kv_cache;
        std::printf(
            "prompt %d + %d new, batch %d, %s weights, %s KV cache%s: step %.3f ms, %.0f tok/s decode, "
            "%.1f%% "
            "of copy bandwidth, prefill %.3f s\n",
            a.prompt, a.new_tokens, B, weights.c_str(), kv_cache.c_str(),
            a.group > 1 ? (share ? ", shared prompts" : ", unshared") : "", r.step_s * 1e3, B / r.step_s,
            100.0 * r.bytes_per_step / r.step_s / copy_bw, r.prefill_s);
        std::fflush(stdout);
    }
}

// --prompts-from: the first n prompts of the run configuration at `path` (train.prompts_per_step a
// step, the steps in order, as its rollout takes them), each checked against the model's vocabulary.
std::vector<std::vector<int64_t>> load_run_prompts(const std::string& path, int n, int64_t vocab_size) {
#ifdef MOERL_HAVE_CMD_RUN
    const rl::RunConfig rc = rl::RunConfig::load(path);
    const std::unique_ptr<rl::PromptSource> source = rl::make_prompt_source(rc);
    std::vector<std::vector<int64_t>> prompts;
    for (int i = 0; i < n; ++i) {
        const rl::Prompt p = source->train(i / rc.prompts_per_step, i % rc.prompts_per_step);
        MOERL_CHECK(!p.tokens.empty(), "--prompts-from ", path, ": prompt ", i, " has no tokens");
        for (int t : p.tokens)
            MOERL_CHECK(t >= 0 && t < vocab_size, "--prompts-from ", path, ": prompt ", i, " has token id ",
                        t, ", outside the model's vocabulary of ", vocab_size);
        prompts.emplace_back(p.tokens.begin(), p.tokens.end());
    }
    return prompts;
#else
    (void)path, (void)n, (void)vocab_size;
    MOERL_FAIL("--prompts-from reads a run configuration's prompts; this build has no rl layer");
#endif
}

void bench_cuda(RolloutArgs args) {
    const model::ModelConfig c = !args.model_dir.empty() ? model::ModelConfig::load(args.model_dir)
                                 : args.config.empty()   ? qwen3_30b_a3b_shape(args.layers)
                                                         : model::ModelConfig::load(args.config);
    for (int B : args.batches)
        MOERL_CHECK(B % args.group == 0, "--batch ", B, " is not a multiple of --group ", args.group);
    std::string prompts = "random prompts";
    if (!args.prompts_from.empty()) {
        const int groups = *std::max_element(args.batches.begin(), args.batches.end()) / args.group;
        args.run_prompts = load_run_prompts(args.prompts_from, groups, c.vocab_size);
        size_t longest = 0, tokens = 0;
        for (const auto& p : args.run_prompts) longest = std::max(longest, p.size()), tokens += p.size();
        args.prompts = {static_cast<int>(longest)};  // sizes the cache; the rows report the mean
        prompts = "the prompts of " + args.prompts_from + " (" + std::to_string(args.run_prompts.size()) +
                  ", mean " +
                  std::to_string((tokens + args.run_prompts.size() / 2) / args.run_prompts.size()) +
                  " tokens, longest " + std::to_string(longest) + ")";
    }
    MOERL_CHECK(args.hf_dir.empty() || (args.prompts.size() == 1 && args.news.size() == 1 && args.group == 1),
                "--hf-dir compares one case: one --prompt, one --new, no --group");
    MOERL_CHECK(torch::cuda::is_available(), "bench rollout --device cuda: no CUDA device is available");
    MOERL_CHECK(model::Generator::available(),
                "bench rollout --device cuda: this build has no CUDA generation engine");
    const at::Device device(at::kCUDA, 0);
    const double copy_bw = copy_bandwidth(device);
    model::MoeModel m = args.model_dir.empty()
                            ? model::MoeModel(c, {device, at::kBFloat16})
                            : model::MoeModel::from_pretrained(args.model_dir, {device, at::kBFloat16});
    m.set_requires_grad(false);
    if (args.model_dir.empty()) init_on_device(m, args.seed);
    char sampled[96];
    std::snprintf(sampled, sizeof sampled, "sampled at temperature %g on the device, a step queued ahead",
                  args.temperature);
    const std::string decoding = args.temperature > 0 ? sampled : "greedy";
    std::printf(
        "moerl bench rollout: CUDA bf16, %s params (%s active per token), %d layers, hidden %d, %d experts "
        "top-%d, vocab %d, %s; %s%s, %s%s, %s\n",
        human_count(static_cast<double>(c.num_parameters())).c_str(),
        human_count(static_cast<double>(c.num_active_parameters())).c_str(), c.num_hidden_layers,
        c.hidden_size, c.num_experts, c.num_experts_per_tok, c.vocab_size,
        args.model_dir.empty() ? "random weights" : ("weights of " + args.model_dir).c_str(), prompts.c_str(),
        args.group > 1 ? (", " + std::to_string(args.group) + " samples a prompt").c_str() : "",
        decoding.c_str(), args.record_routing ? ", routing recorded" : "",
        args.profile     ? "eager launches, profiled"
        : args.no_graphs ? "eager launches"
                         : "CUDA graphs");
    std::printf(
        "device copy bandwidth (read + write): %.0f GB/s; decode bandwidth = bytes a step reads (non-expert "
        "weights but the embedding, the distinct experts routed to, the KV cache attended) / step time\n",
        copy_bw / 1e9);
    if (!args.join_chunks.empty()) return bench_joins(m, c, args);
    std::vector<Row> rows;
    for (int prompt : args.prompts)
        for (int new_tokens : args.news)
            for (const std::string& weights : args.weights)
                for (const std::string& kv_cache : args.kv_caches)
                    for (const bool share :
                         args.group > 1 ? std::vector<bool>{true, false} : std::vector<bool>{true}) {
                        RolloutArgs a = args;
                        a.prompt = prompt;
                        a.new_tokens = new_tokens;
                        bench_format(m, c, a, weights, kv_cache, share, copy_bw, rows);
                    }
    if (!args.hf_dir.empty()) {
        m.save_pretrained(args.hf_dir);
        RolloutArgs a = args;
        a.prompt = args.prompts[0];
        a.new_tokens = args.news[0];
        std::map<int, double> hf = run_hf_reference(a);
        for (Row& r : rows)
            if (hf.count(r.batch)) r.hf_tok_s = hf[r.batch];
    }
    for (const std::string& weights : args.weights)
        for (const std::string& kv_cache : args.kv_caches)
            if (weights == "fp8" || kv_cache == "fp8")
                fp8_agreement(m, c, args, weights == "fp8", kv_cache == "fp8");
    // fp8 rows: decode tok/s against the bf16 row (weights and cache) of the same case.
    auto bf16_row = [&](const Row& r) -> const Row* {
        for (const Row& o : rows)
            if (o.weights == "bf16" && o.kv_cache == "bf16" && o.prompt == r.prompt &&
                o.new_tokens == r.new_tokens && o.batch == r.batch && o.shared == r.shared)
                return &o;
        return nullptr;
    };
    const bool several = args.weights.size() > 1 || args.kv_caches.size() > 1;
    std::printf(
        "\n| prompt | new | batch |%s%s prefill s | prefill tokens | step ms | decode tok/s | e2e tok/s | "
        "experts/layer | bytes/step | GB/s | util | prompt KV | KV cache | HF e2e tok/s | ratio |\n"
        "|---|---|---|%s%s---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        args.group > 1 ? " prompt blocks |" : "", several ? " weights | KV cache | x bf16 |" : "",
        args.group > 1 ? "---|" : "", several ? "---|---|---|" : "");
    for (const Row& r : rows) {
        const double bw = r.bytes_per_step / r.step_s;
        std::printf("| %d | %d | %d |", r.prompt, r.new_tokens, r.batch);
        if (args.group > 1) std::printf(" %s |", r.shared ? "shared" : "own");
        if (several) {
            const Row* base = bf16_row(r);
            if (base != nullptr && base != &r)
                std::printf(" %s | %s | %.2fx |", r.weights.c_str(), r.kv_cache.c_str(),
                            base->step_s / r.step_s);
            else
                std::printf(" %s | %s | - |", r.weights.c_str(), r.kv_cache.c_str());
        }
        std::printf(" %.3f | %lld | %.3f | %.0f | %.0f | %.1f | %s | %.0f | %.1f%% | %s | %s |", r.prefill_s,
                    static_cast<long long>(r.prefill_tokens), r.step_s * 1e3, r.batch / r.step_s, r.e2e_tok_s,
                    r.experts_per_layer, human_bytes(r.bytes_per_step).c_str(), bw / 1e9,
                    100.0 * bw / copy_bw, human_bytes(r.prompt_kv_bytes).c_str(),
                    human_bytes(r.kv_bytes).c_str());
        if (r.hf_tok_s > 0)
            std::printf(" %.0f | %.1fx |\n", r.hf_tok_s, r.e2e_tok_s / r.hf_tok_s);
        else
            std::printf(" - | - |\n");
    }
}

// One rank of the expert-parallel rollout: its own batch of sequences (attention is data parallel),
// the experts of every MoE layer split over the ranks and reached through the EP buffer, eager
// model steps. Returns per batch size: prefill seconds and decode seconds.
nlohmann::json ep_rollout_rank(const RolloutArgs& a, const model::ModelConfig& c,
                               const std::string& transport, int world, int rank, int port) {
    auto tcp = connect_local_store(port, world, std::chrono::seconds(300));
    ep::C10dStore store(c10::make_intrusive<c10d::PrefixStore>("ep-rollout", tcp));
    const int max_batch = *std::max_element(a.batches.begin(), a.batches.end());
    // On CUDA: bf16, rank r on GPU r mod count. On the CPU (host or fabric transport): fp32.
    const bool on_gpu = a.device.rfind("cuda", 0) == 0;
    int dev = 0;
    if (on_gpu) {
        const int gpus = static_cast<int>(torch::cuda::device_count());
        MOERL_CHECK(gpus > 0, "bench rollout --ep: no CUDA device is available");
        dev = rank % gpus;
        setenv("MOERL_EP_DEVICE", std::to_string(dev).c_str(), 1);
    }
    const at::ScalarType dtype = on_gpu ? at::kBFloat16 : at::kFloat;
    const at::Device device = on_gpu ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(dev)) : at::kCPU;
    auto sync = [&] {
        if (on_gpu) torch::cuda::synchronize(dev);
    };
    // "fused": the cuda transport under the fused decode engine (model::Generator, CUDA graphs),
    // each decode step's MoE layers through a low-latency buffer of their own; the others run the
    // model's eager steps.
    const bool fused = transport == "fused";
    MOERL_CHECK(!fused || on_gpu, "bench rollout --ep: transport fused needs --device cuda");
    // Calls of up to the prefill of the largest batch.
    ep::Config ec = model::ep_config_for(c, dtype, world, rank, max_batch * a.prompt);
    ec.timeout_s = 300;
    ec.job_id = "bench-rollout";
    ec.set_transport(fused ? "cuda" : transport);
    ec.low_latency = !fused;  // the fused engine's decode buffer has them
    ep::Buffer buffer(ec, &store);
    model::MoeModel m(c, {device, dtype, &buffer});
    m.set_requires_grad(false);
    init_on_device(m, a.seed);
    std::unique_ptr<ep::C10dStore> decode_store;
    std::unique_ptr<ep::Buffer> decode_buffer;
    std::unique_ptr<model::Generator> gen;
    if (fused) {
        ep::Config d = ec;
        d.max_tokens_per_rank = max_batch;
        d.low_latency = true;
        d.job_id = "bench-rollout-decode";
        decode_store =
            std::make_unique<ep::C10dStore>(c10::make_intrusive<c10d::PrefixStore>("ep-rollout-decode", tcp));
        decode_buffer = std::make_unique<ep::Buffer>(d, decode_store.get());
        model::GeneratorOptions o;
        o.max_batch = max_batch;
        o.max_seq_len = a.prompt + a.new_tokens + 1;
        o.ep = decode_buffer.get();
        gen = std::make_unique<model::Generator>(m, o);
    }
    c10::NoGradGuard no_grad;
    nlohmann::json out = nlohmann::json::array();
    at::manual_seed(a.seed * 1000 + rank);
    for (int B : a.batches) {
        // Two passes: the first pays for kernel and communicator set-up (and graph capture), the
        // second is reported.
        nlohmann::json row;
        for (int pass = 0; pass < 2; ++pass) {
            at::Tensor ids = at::randint(0, c.vocab_size, {B, a.prompt},
                                         at::TensorOptions().device(device).dtype(at::kLong));
            double prefill_s = 0;
            sync();
            if (gen) {
                std::vector<int> slots;
                std::vector<std::vector<int64_t>> prompts;
                const at::Tensor host = ids.cpu();
                for (int b = 0; b < B; ++b) {
                    slots.push_back(gen->acquire());
                    prompts.emplace_back(host[b].data_ptr<int64_t>(), host[b].data_ptr<int64_t>() + a.prompt);
                }
                auto t0 = Clock::now();
                model::GenerationStep r = gen->prefill(slots, prompts);
                sync();
                prefill_s = seconds_since(t0);
                auto t1 = Clock::now();
                for (int i = 1; i < a.new_tokens; ++i) r = gen->decode(slots, r.greedy);
                sync();
                row = {{"batch", B}, {"prefill_s", prefill_s}, {"decode_s", seconds_since(t1)}};
                for (int s : slots) gen->release(s);
                continue;
            }
            model::KvCache cache = m.new_cache(B, a.prompt + a.new_tokens + 1);
            auto t0 = Clock::now();
            at::Tensor tok = m.prefill(cache, ids, {}).logits.argmax(-1);
            sync();
            prefill_s = seconds_since(t0);
            auto t1 = Clock::now();
            for (int i = 1; i < a.new_tokens; ++i) tok = m.decode(cache, tok).logits.argmax(-1);
            sync();
            row = {{"batch", B}, {"prefill_s", prefill_s}, {"decode_s", seconds_since(t1)}};
        }
        out.push_back(row);
    }
    gen.reset();
    if (decode_buffer) decode_buffer->destroy();
    buffer.destroy();
    return out;
}

// Expert-parallel rollout over --ep GPUs per transport: aggregate tokens/s, then each transport
// against nccl (the stack without accelerated EP).
void bench_ep_rollout(const RolloutArgs& a) {
    const model::ModelConfig c =
        a.config.empty() ? qwen3_30b_a3b_shape(a.layers) : model::ModelConfig::load(a.config);
    MOERL_CHECK(c.num_experts % a.ep_ranks == 0, "--ep ", a.ep_ranks, " does not divide the ", c.num_experts,
                " experts");
    std::printf(
        "moerl bench rollout --ep %d: %s, %s params, %d layers, hidden %d, %d experts top-%d (%d per "
        "rank); each rank decodes its own batch (eager model steps; fused: the fused decode engine), every "
        "MoE layer dispatches and combines through the EP transport; prompt %d, %d new tokens, greedy\n\n",
        a.ep_ranks, a.device == "cpu" ? "CPU fp32" : "CUDA bf16",
        human_count(static_cast<double>(c.num_parameters())).c_str(), c.num_hidden_layers, c.hidden_size,
        c.num_experts, c.num_experts_per_tok, c.num_experts / a.ep_ranks, a.prompt, a.new_tokens);
    std::printf(
        "| transport | ranks | batch/rank | prefill s | step ms | decode tok/s (all ranks) | e2e tok/s (all "
        "ranks) |\n|---|---|---|---|---|---|---|\n");
    std::map<std::string, std::map<int, std::pair<double, double>>>
        tok_s;  // transport -> batch -> decode, e2e
    for (const auto& transport : a.transports) {
        const int W = a.ep_ranks;
        const std::vector<nlohmann::json> ranks = run_forked_ranks(
            W, [&](int r, int port) { return ep_rollout_rank(a, c, transport, W, r, port); });
        std::string error;
        for (int r = 0; r < W && error.empty(); ++r)
            if (ranks[r].is_object() && ranks[r].contains("error"))
                error = "rank " + std::to_string(r) + ": " + ranks[r]["error"].get<std::string>();
        if (!error.empty()) {
            std::printf("| %s | %d | error: %s |\n", transport.c_str(), W, error.c_str());
            continue;
        }
        for (size_t i = 0; i < a.batches.size(); ++i) {
            const int B = a.batches[i];
            double prefill = 0, decode = 0, dec_tok = 0, e2e_tok = 0;
            for (const auto& rj : ranks) {
                const double p = rj[i]["prefill_s"].get<double>(), d = rj[i]["decode_s"].get<double>();
                prefill = std::max(prefill, p), decode = std::max(decode, d);
                dec_tok += B * (a.new_tokens - 1) / d;
                e2e_tok += B * static_cast<double>(a.new_tokens) / (p + d);
            }
            tok_s[transport][B] = {dec_tok, e2e_tok};
            std::printf("| %s | %d | %d | %.3f | %.2f | %.0f | %.0f |\n", transport.c_str(), W, B, prefill,
                        1e3 * decode / (a.new_tokens - 1), dec_tok, e2e_tok);
            std::fflush(stdout);
        }
    }
    if (!tok_s.count("nccl")) return;
    std::printf("\n| transport | batch/rank | decode x nccl | e2e x nccl |\n|---|---|---|---|\n");
    for (const auto& [t, rows] : tok_s) {
        if (t == "nccl") continue;
        for (const auto& [B, v] : rows)
            if (tok_s["nccl"].count(B))
                std::printf("| %s | %d | %.2f | %.2f |\n", t.c_str(), B, v.first / tok_s["nccl"][B].first,
                            v.second / tok_s["nccl"][B].second);
    }
}

void bench_cpu(const RolloutArgs& a) {
#ifdef MOERL_HAVE_CMD_RUN
    rl::RunConfig cfg =
        a.config.empty() ? rl::RunConfig::from_yaml_text("{}", "defaults") : rl::RunConfig::load(a.config);
    std::printf("%10s %10s %10s %10s %12s\n", "max_batch", "sequences", "tokens", "seconds", "tokens/s");
    for (int mb : a.batches) {
        rl::RolloutBench r = rl::bench_rollout(cfg, a.sequences, mb);
        std::printf("%10d %10lld %10lld %10.3f %12.0f\n", r.max_batch, static_cast<long long>(r.sequences),
                    static_cast<long long>(r.tokens), r.seconds, r.tokens / std::max(1e-9, r.seconds));
    }
    std::printf("(threads: %d; model hidden %d, %d layers, %d experts top-%d)\n", at::get_num_threads(),
                cfg.model.hidden_size, cfg.model.num_hidden_layers, cfg.model.num_experts,
                cfg.model.num_experts_per_tok);
#else
    (void)a;
    MOERL_FAIL("bench rollout --device cpu runs the RL rollout engine; this build has no rl layer");
#endif
}

}  // namespace

void register_bench_rollout(CLI::App& bench) {
    auto a = std::make_shared<RolloutArgs>();
    CLI::App* b =
        bench.add_subcommand("rollout", "Generation throughput (random weights): CUDA engine or CPU rollout");
    b->add_option("--device", a->device, "cpu (RL rollout engine) or cuda (generation engine)");
    b->add_option("--config", a->config,
                  "cpu: run configuration (YAML, default built-in); cuda: model config.json (default: the "
                  "Qwen3-30B-A3B shape with --layers layers)");
    b->add_option("--model", a->model_dir,
                  "cuda: a Hugging Face checkpoint directory (config.json + safetensors) to decode with its "
                  "own weights, and so its own routing (default: random weights)");
    b->add_option("--layers", a->layers, "cuda, built-in model: layers")->check(CLI::Range(1, 1 << 24));
    b->add_option("--batch", a->batches, "Batch sizes, e.g. 1,16,64,256 (cpu: max_batch values)")
        ->delimiter(',')
        ->check(CLI::Range(1, 1 << 24));
    CLI::Option* prompt = b->add_option("--prompt", a->prompts,
                                        "cuda: prompt tokens per sequence; a list sweeps, e.g. 2048,8192")
                              ->delimiter(',')
                              ->check(CLI::Range(1, 1 << 24));
    b->add_option("--new", a->news, "cuda: generated tokens per sequence (>= 4); a list sweeps")
        ->delimiter(',')
        ->check(CLI::Range(1, 1 << 24));
    b->add_option("--group", a->group,
                  "cuda: samples per prompt (a GRPO group; divides every batch); each case runs with the "
                  "group's prompt blocks shared and with a copy each")
        ->check(CLI::Range(1, 1 << 16));
    CLI::Option* from = b->add_option(
        "--prompts-from", a->prompts_from,
        "cuda: decode the prompts of this run configuration (its task or dataset, tokenizer and chat "
        "template; --group samples each) instead of random ones, so the batch routes as the run's rollout "
        "does");
    from->excludes(prompt);
    b->add_option("--weights", a->weights,
                  "cuda: what decode steps read, a list compares: bf16, fp8 (e4m3 copies with 128 x 128 "
                  "block scales; with fp8 also the greedy agreement and log-prob difference against bf16)")
        ->delimiter(',')
        ->check(CLI::IsMember({"bf16", "fp8"}));
    b->add_option("--kv-cache", a->kv_caches,
                  "cuda: the KV cache's format, a list compares: bf16, fp8 (e4m3 rows with a scale each; "
                  "with fp8 also the greedy agreement and log-prob difference against bf16)")
        ->delimiter(',')
        ->check(CLI::IsMember({"bf16", "fp8"}));
    b->add_option("--sequences", a->sequences, "cpu: sequences generated per row");
    b->add_flag("--no-graphs", a->no_graphs, "cuda: launch every decode step eagerly");
    b->add_flag("--profile", a->profile,
                "cuda: time per kernel kind of eager decode steps (implies --no-graphs; plain stream order)");
    b->add_flag("--profile-range", a->profile_range,
                "cuda: start and stop the CUDA profiler around the first batch's timed steps "
                "(ncu --profile-from-start off)");
    b->add_option("--hf-dir", a->hf_dir,
                  "cuda: write the checkpoint here and run Hugging Face transformers' generate on it");
    b->add_option("--hf-script", a->hf_script, "cuda: the reference script");
    b->add_option("--join-chunk", a->join_chunks,
                  "cuda: half of each batch decodes while the other half joins, its prompts prefilled "
                  "in parts of these many tokens a step (0 = whole), e.g. 0,2048,8192")
        ->delimiter(',')
        ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
    b->add_option("--seed", a->seed, "Weight and prompt seed");
    b->add_option("--temperature", a->temperature,
                  "cuda: draw each token on the device from softmax(logits / T), the next step queued before "
                  "the host reads the draws, as RL rollout decodes (0, the default: greedy)")
        ->check(CLI::Range(0.0, 1e6));
    b->add_flag("--record-routing", a->record_routing,
                "cuda: every decode step also copies the experts each row used to the host (RL's routing "
                "records)");
    b->add_option("--ep", a->ep_ranks,
                  "expert parallelism over this many ranks (processes; on cuda one GPU each; the eager model "
                  "path)")
        ->check(CLI::Range(0, 1024));
    b->add_option("--transport", a->transports,
                  "--ep: EP transports to compare (cuda, nccl: the baseline, both under the model's eager "
                  "steps; fused: cuda under the fused decode engine; on the CPU host or fabric/tcp)")
        ->delimiter(',');
    b->callback([a] {
        a->prompt = a->prompts.front();
        a->new_tokens = a->news.front();
        MOERL_CHECK(a->model_dir.empty() || (a->device.rfind("cuda", 0) == 0 && a->ep_ranks == 0),
                    "--model decodes a checkpoint in the CUDA engine: it needs --device cuda and no --ep");
        MOERL_CHECK(a->model_dir.empty() || a->config.empty(),
                    "--model and --config both name the model: give one");
        // The CUDA engine's decode cases (bench_format): what sampling, routing records and a run's
        // prompts apply to.
        const bool decode_cases = a->device.rfind("cuda", 0) == 0 && a->ep_ranks == 0 && a->hf_dir.empty() &&
                                  a->join_chunks.empty();
        MOERL_CHECK((a->temperature == 0 && !a->record_routing) || decode_cases,
                    "--temperature and --record-routing apply to the CUDA engine's decode cases: they need "
                    "--device cuda and none of --ep, --hf-dir, --join-chunk");
        MOERL_CHECK(
            a->prompts_from.empty() || decode_cases,
            "--prompts-from applies to the CUDA engine's decode cases: it needs --device cuda and none "
            "of --ep, --hf-dir, --join-chunk");
        if (a->ep_ranks > 0) {
            MOERL_CHECK(
                a->prompts.size() == 1 && a->news.size() == 1 && a->group == 1 &&
                    a->weights == std::vector<std::string>{"bf16"} &&
                    a->kv_caches == std::vector<std::string>{"bf16"},
                "--ep runs one case: one --prompt, one --new, no --group, bf16 --weights and --kv-cache");
            MOERL_CHECK(a->device == "cpu" || a->device.rfind("cuda", 0) == 0, "--device ", a->device,
                        " is not supported, expected cpu or cuda");
            MOERL_CHECK(a->new_tokens >= 2, "--new must be >= 2 with --ep, got ", a->new_tokens);
            return bench_ep_rollout(*a);
        }
        if (a->device == "cpu") return bench_cpu(*a);
        MOERL_CHECK(a->device.rfind("cuda", 0) == 0, "--device ", a->device,
                    " is not supported, expected cpu or cuda");
        for (int n : a->news) MOERL_CHECK(n >= 4, "--new must be >= 4, got ", n);
        bench_cuda(*a);
    });
}

}  // namespace moerl::cli
