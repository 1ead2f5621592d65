// The rl layer on a GPU (label gpu; each test skips without a CUDA device): the CUDA trainer
// against the CPU's, routing records of the fast decode path against the eager path's, sampling on
// the device, a generator that took new weights in place against one built with them, and the CUDA
// IPC export read in the trainer's own process.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include "cuda_ipc.hpp"
#include "moerl/model/generator.hpp"
#include "moerl/model/model.hpp"
#include "moerl/model/safetensors.hpp"
#include "moerl/rl/grpo.hpp"
#include "moerl/rl/roles.hpp"
#include "moerl/rl/rollout.hpp"
#include "moerl/rl/trainer.hpp"
#include "rl_test_util.hpp"
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)  // LibTorch built with CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#define MOERL_TEST_CUDA_ALLOCATOR 1
#endif

using namespace moerl::rl;
using namespace moerl::rl::test;
namespace fs = std::filesystem;

namespace {

#define SKIP_WITHOUT_CUDA()                                   \
    do {                                                      \
        if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device"; \
    } while (0)

std::vector<ExperienceRecord> batch_of(const RunConfig& c) {
    return synthetic_batch(
        c, [](int p, int g) { return 1 + (p + g) % 4; },
        [](const ExperienceRecord&, int p, int g, int j) { return 3 + (p * 5 + g + j) % 12; },
        [](int) { return -1.2f; }, [](int p, int g) { return ((p * 3 + g) % 4) / 3.0; });
}

std::map<std::string, std::vector<float>> moments(const fs::path& dir) {
    std::map<std::string, std::vector<float>> out;
    moerl::model::SafetensorsFile f((dir / "optimizer-rank0.safetensors").string());
    for (const auto& info : f.tensors()) {
        if (info.name.rfind("exp_avg.", 0) != 0) continue;
        const float* p = reinterpret_cast<const float*>(f.data(info));
        out[info.name].assign(p, p + info.numel());
    }
    return out;
}

// The small config on one rank, without the load-balancing loss (not a sum over tokens: how a
// batch is split into micro-batches changes it).
RunConfig one_rank_config(const fs::path& dir) {
    RunConfig c = small_config(dir);
    c.ep_ranks = 1;
    c.model.router_aux_loss_coef = 0;
    return c;
}

// GRPO advantages of a batch's rewards.
std::vector<double> advantages_of(const std::vector<ExperienceRecord>& batch, int group_size) {
    std::vector<double> rewards;
    for (const auto& e : batch) rewards.push_back(e.reward);
    return group_advantages(rewards, group_size);
}

// The fp32 weights a trainer saves into `dir`, by tensor name.
std::map<std::string, std::vector<float>> saved_weights(const PolicyTrainer& trainer, const fs::path& dir) {
    trainer.save_weights(dir.string());
    std::map<std::string, std::vector<float>> out;
    for (const auto& entry : fs::directory_iterator(dir)) {
        if (entry.path().extension() != ".safetensors") continue;
        moerl::model::SafetensorsFile f(entry.path().string());
        for (const auto& info : f.tensors()) {
            const float* p = reinterpret_cast<const float*>(f.data(info));
            out[info.name].assign(p, p + info.numel());
        }
    }
    return out;
}

// One random model, on the CPU and on the first GPU.
struct CpuAndGpuModels {
    moerl::model::MoeModel cpu, gpu;
    static moerl::model::ModelOptions on_gpu() {
        moerl::model::ModelOptions o;
        o.device = at::Device(at::kCUDA, 0);
        return o;
    }
    CpuAndGpuModels(const moerl::model::ModelConfig& c, uint64_t seed)
        : cpu(c, moerl::model::ModelOptions{}), gpu(c, on_gpu()) {
        cpu.init_random(seed);
        gpu.init_random(seed);
    }
};

std::vector<GenResult> by_id(std::vector<GenResult> v) {
    std::sort(v.begin(), v.end(), [](const GenResult& x, const GenResult& y) { return x.id < y.id; });
    return v;
}

}  // namespace

// fp32 on both: the same loss and gradients (the first moments) up to reduction order.
TEST(RlGpu, CudaTrainerMatchesTheCpuTrainer) {
    SKIP_WITHOUT_CUDA();
    TempDir t("gputrain");
    RunConfig c = one_rank_config(t.path);
    c.grad_clip = 0;
    const auto batch = batch_of(c);
    const auto adv = advantages_of(batch, c.group_size);
    // 0: CPU; 1: CUDA; 2: CUDA with activation checkpointing.
    TrainStats st[3];
    for (int v = 0; v < 3; ++v) {
        RunConfig run = c;
        run.train_device = v > 0 ? "cuda" : "cpu";
        run.micro_batch_tokens = v > 0 ? 16 : 0;  // packed on the GPU, one padded batch on the CPU
        run.activation_checkpointing = v == 2;
        PolicyTrainer trainer(run, (t.path / ("w" + std::to_string(v))).string());
        st[v] = trainer.update(batch, adv);
        trainer.save_optimizer((t.path / ("o" + std::to_string(v))).string());
    }
    const auto cpu = moments(t.path / "o0");
    for (int v = 1; v < 3; ++v) {
        SCOPED_TRACE(v == 2 ? "CUDA, activation checkpointing" : "CUDA");
        EXPECT_NEAR(st[v].loss, st[0].loss, 1e-4 * std::abs(st[0].loss) + 1e-6);
        EXPECT_NEAR(st[v].grad_norm, st[0].grad_norm, 1e-3 * st[0].grad_norm);
        const auto gpu = moments(t.path / ("o" + std::to_string(v)));
        ASSERT_EQ(cpu.size(), gpu.size());
        double diff = 0, scale = 0;
        for (const auto& [name, a] : cpu) {
            const auto& b = gpu.at(name);
            ASSERT_EQ(a.size(), b.size()) << name;
            for (size_t i = 0; i < a.size(); ++i) {
                diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
                scale = std::max(scale, std::abs(static_cast<double>(a[i])));
            }
        }
        EXPECT_GT(scale, 0.0);
        EXPECT_LT(diff, 1e-3 * scale);
    }
}

// A GPU that runs out of memory in training: the error names the batch and the settings to lower,
// not only LibTorch's allocator message. (LibTorch's allocator is held to a sliver of the GPU.)
TEST(RlGpu, OutOfMemoryInTrainingNamesWhatToLower) {
    SKIP_WITHOUT_CUDA();
#if !defined(MOERL_TEST_CUDA_ALLOCATOR)
    GTEST_SKIP() << "LibTorch without CUDA headers";
#else
    TempDir t("gpuoom");
    RunConfig c = small_config(t.path);
    c.ep_ranks = 1;
    c.train_device = "cuda";
    const auto batch = batch_of(c);
    const auto adv = advantages_of(batch, c.group_size);
    PolicyTrainer trainer(c, (t.path / "w").string());
    c10::cuda::CUDACachingAllocator::emptyCache();
    c10::cuda::CUDACachingAllocator::setMemoryFraction(1e-6, 0);
    std::string what;
    try {
        trainer.update(batch, adv);
    } catch (const std::exception& e) {
        what = e.what();
    }
    c10::cuda::CUDACachingAllocator::setMemoryFraction(1.0, 0);
    EXPECT_NE(what.find("train: the GPU ran out of memory in the update of " + std::to_string(batch.size()) +
                        " samples"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("lower train.micro_batch_tokens"), std::string::npos) << what;
    // With the memory back, the same trainer trains.
    const TrainStats st = trainer.update(batch, adv);
    EXPECT_TRUE(std::isfinite(st.loss));
#endif
}

// The optimizer step on the GPU (LibTorch's fused AdamW where it has one) against the CPU's loop:
// three updates with clipping and weight decay leave the same fp32 weights.
TEST(RlGpu, CudaOptimizerStepsMatchTheCpuSteps) {
    SKIP_WITHOUT_CUDA();
    TempDir t("gpuadam");
    RunConfig c = one_rank_config(t.path);
    c.grad_clip = 0.05;  // small enough that every update is clipped
    c.weight_decay = 0.1;
    const auto batch = batch_of(c);
    const auto adv = advantages_of(batch, c.group_size);
    std::map<std::string, std::vector<float>> weights[2];
    double norms[2] = {0, 0};
    for (int gpu = 0; gpu < 2; ++gpu) {
        RunConfig run = c;
        run.train_device = gpu ? "cuda" : "cpu";
        PolicyTrainer trainer(run, (t.path / ("w" + std::to_string(gpu))).string());
        for (int s = 0; s < 3; ++s) norms[gpu] = trainer.update(batch, adv).grad_norm;
        weights[gpu] = saved_weights(trainer, t.path / ("s" + std::to_string(gpu)));
    }
    EXPECT_GT(norms[0], c.grad_clip);
    EXPECT_NEAR(norms[1], norms[0], 1e-3 * norms[0]);
    ASSERT_EQ(weights[0].size(), weights[1].size());
    ASSERT_GT(weights[0].size(), 0u);
    // Each step moves a weight by up to lr: a wrong step size, decay or clip puts most weights off
    // by a fraction of lr. Adam's division lets reduction-order noise move the few weights whose
    // gradient is a near-cancellation, so a small share may differ.
    int64_t total = 0, off = 0;
    for (const auto& [name, a] : weights[0]) {
        const auto& b = weights[1].at(name);
        ASSERT_EQ(a.size(), b.size()) << name;
        for (size_t i = 0; i < a.size(); ++i, ++total)
            off += std::abs(static_cast<double>(a[i]) - b[i]) > 0.1 * c.lr;
    }
    EXPECT_LT(off, total / 200) << off << " of " << total << " weights differ by more than lr/10";
}

// bf16 training on the GPU (fp32 masters, the one-pass AdamW whose clipping scale is computed on the
// device, fp32 or bf16 moments): the gradient norm it reports is the CPU fp32 trainer's, and the clip
// reaches the update. Adam's first step moves a weight by about lr whatever the gradient's scale,
// unless the gradient is clipped so small that eps dominates: clipped to 1e-10 no weight moves by
// lr / 20.
TEST(RlGpu, Bf16UpdateTakesItsClipFromTheDevice) {
    SKIP_WITHOUT_CUDA();
    TempDir t("gpuclip");
    RunConfig c = one_rank_config(t.path);
    c.weight_decay = 0;
    const auto batch = batch_of(c);
    const auto adv = advantages_of(batch, c.group_size);
    RunConfig cpu = c;
    cpu.grad_clip = 0;
    const double cpu_norm = PolicyTrainer(cpu, (t.path / "cpu").string()).update(batch, adv).grad_norm;
    ASSERT_GT(cpu_norm, 0.0);
    int run_index = 0;
    for (const char* moments : {"fp32", "bf16"}) {
        for (const double clip : {0.0, 1e-10}) {
            SCOPED_TRACE(std::string(moments) + " moments, clip " + std::to_string(clip));
            RunConfig run = c;
            run.train_device = "cuda";
            run.train_dtype = "bf16";
            run.moments_dtype = moments;
            run.grad_clip = clip;
            const std::string name = "g" + std::to_string(run_index++);
            PolicyTrainer trainer(run, (t.path / name).string());
            const auto before = saved_weights(trainer, t.path / (name + "-before"));
            const TrainStats st = trainer.update(batch, adv);
            EXPECT_NEAR(st.grad_norm, cpu_norm, 0.1 * cpu_norm);
            const auto after = saved_weights(trainer, t.path / (name + "-after"));
            int64_t total = 0, moved = 0;
            double largest = 0;
            for (const auto& [key, a] : before) {
                const auto& b = after.at(key);
                ASSERT_EQ(a.size(), b.size()) << key;
                for (size_t i = 0; i < a.size(); ++i, ++total) {
                    const double d = std::abs(static_cast<double>(b[i]) - a[i]);
                    largest = std::max(largest, d);
                    moved += d > 0.5 * c.lr;
                }
            }
            if (clip == 0) {
                EXPECT_GT(moved, total / 20) << moved << " of " << total << " weights moved by lr / 2";
            } else {
                EXPECT_LT(largest, c.lr / 20) << "a weight moved by " << largest << " under a clip of 1e-10";
            }
        }
    }
}

// Rollouts with routing records, greedy and sampled: on the GPU (the fused engine) the tokens,
// their log-probabilities and versions, and the experts recorded for every position and MoE layer
// are the CPU eager path's (as sets: the order of a position's K experts is free), with contexts
// prefilled whole and in parts of 3 tokens a step.
TEST(RlGpu, RoutingRecordsOfTheFastPathEqualTheEagerPath) {
    SKIP_WITHOUT_CUDA();
    if (!moerl::model::Generator::available()) GTEST_SKIP() << "no CUDA generation engine in this build";
    // top_k 1: each step drawn on the host. Untruncated: steps queued one ahead of the host, drawn
    // on the device, with sequences stopping (token 2) at different steps and requests joining as
    // slots free up.
    for (const char* rollout :
         {"rollout: {top_k: 1, max_new_tokens: 6}\n", "rollout: {max_new_tokens: 6}\n"}) {
        SCOPED_TRACE(rollout);
        RunConfig c = RunConfig::from_yaml_text(rollout, "gpu.yaml");
        CpuAndGpuModels models(c.model, 11);
        auto generate = [&](const moerl::model::MoeModel& m, int64_t chunk) {
            RolloutEngine e(m, c.sampling,
                            {.max_batch = 4,
                             .record_routing = true,
                             .max_seq_len = c.rollout_max_seq_len,
                             .prefill_chunk_tokens = chunk});
            for (int i = 0; i < 9; ++i) {
                const TaskPayload p = make_task_payload(c, 0, i, 0);
                e.add({static_cast<uint64_t>(i), p.prompt_tokens, {}, p.seed, 2 + i % 5});
            }
            auto out = by_id(e.run_to_completion(7));
            EXPECT_TRUE(e.idle());
            return out;
        };
        const auto want = generate(models.cpu, 0);
        int stopped = 0;
        for (const GenResult& r : want) stopped += r.trajectory.terminated;
        for (const int64_t chunk : {int64_t{0}, int64_t{3}}) {
            SCOPED_TRACE("prefill_chunk_tokens " + std::to_string(chunk));
            const auto got = generate(models.gpu, chunk);
            ASSERT_EQ(got.size(), want.size());
            const int K = c.model.num_experts_per_tok;
            int64_t same = 0, total = 0;
            for (size_t i = 0; i < want.size(); ++i) {
                const Trajectory &tw = want[i].trajectory, &tg = got[i].trajectory;
                ASSERT_EQ(tg.tokens, tw.tokens) << "request " << want[i].id;
                EXPECT_EQ(tg.terminated, tw.terminated) << "request " << want[i].id;
                EXPECT_EQ(tg.rng_draws, tw.rng_draws) << "request " << want[i].id;
                ASSERT_EQ(tg.logprobs.size(), tw.logprobs.size());
                for (size_t j = 0; j < tw.logprobs.size(); ++j)
                    EXPECT_NEAR(tg.logprobs[j], tw.logprobs[j], 1e-4)
                        << "request " << want[i].id << " token " << j;
                EXPECT_EQ(tg.versions, std::vector<int64_t>(tw.tokens.size(), 7));
                const auto& rw = tw.routing;
                const auto& rg = tg.routing;
                ASSERT_EQ(rg.size(), rw.size()) << "request " << want[i].id;
                for (size_t at0 = 0; at0 + K <= rw.size(); at0 += K) {
                    std::vector<int16_t> x(rw.begin() + at0, rw.begin() + at0 + K),
                        y(rg.begin() + at0, rg.begin() + at0 + K);
                    std::sort(x.begin(), x.end());
                    std::sort(y.begin(), y.end());
                    same += x == y;
                    ++total;
                }
            }
            ASSERT_GT(total, 50);
            // fp32 on both sides: only a near-tie of two router logits may flip (none expected here).
            EXPECT_GE(static_cast<double>(same), 0.995 * static_cast<double>(total))
                << same << " of " << total;
        }
        if (c.sampling.top_k == 0) {
            EXPECT_GT(stopped, 0) << "no sequence stopped early: the case is not covered";
        }
    }
}

// A GRPO group's samples on the CUDA engine share their prompt's cache blocks: joined in one
// prefill, or, with the context prefilled in parts of 3 tokens a step, forked from the sample that
// took them. Each still samples what it samples on the CPU eager path (fp32 on both, its own seed),
// also when a group arrives while the engine has too few free slots for all of it.
TEST(RlGpu, AGroupsSamplesSharePromptBlocksAndSampleAsOnTheCpu) {
    SKIP_WITHOUT_CUDA();
    if (!moerl::model::Generator::available()) GTEST_SKIP() << "no CUDA generation engine in this build";
    RunConfig c = RunConfig::from_yaml_text("rollout: {max_new_tokens: 6}\n", "gpu.yaml");
    CpuAndGpuModels models(c.model, 13);
    const moerl::model::MoeModel &cpu = models.cpu, &gpu = models.gpu;
    const int kGroups = 3, kSamples = 4;
    int64_t prompt_len = 0;
    auto fill = [&](RolloutEngine& e) {
        for (int p = 0; p < kGroups; ++p)
            for (int g = 0; g < kSamples; ++g) {
                const TaskPayload t = make_task_payload(c, 0, p, g);
                prompt_len = static_cast<int64_t>(t.prompt_tokens.size());
                e.add({static_cast<uint64_t>(p * kSamples + g), t.prompt_tokens, {}, t.seed, 3 + g});
            }
    };
    RolloutEngine a(cpu, c.sampling, {.max_batch = 6, .max_seq_len = c.rollout_max_seq_len});
    fill(a);
    const auto want = by_id(a.run_to_completion(0));
    EXPECT_EQ(a.prompt_tokens_shared(), 0);
    for (const int64_t chunk : {int64_t{0}, int64_t{3}}) {
        SCOPED_TRACE("prefill_chunk_tokens " + std::to_string(chunk));
        RolloutEngine b(
            gpu, c.sampling,
            {.max_batch = 6, .max_seq_len = c.rollout_max_seq_len, .prefill_chunk_tokens = chunk});
        ASSERT_TRUE(b.uses_generator());
        fill(b);
        const auto got = by_id(b.run_to_completion(0));
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < want.size(); ++i)
            EXPECT_EQ(got[i].trajectory.tokens, want[i].trajectory.tokens) << "request " << want[i].id;
        // Six slots: the first group joins, the second waits for four free slots rather than split,
        // and so does the third: every group prefilled once.
        EXPECT_EQ(b.prompt_tokens(), kGroups * kSamples * prompt_len);
        EXPECT_EQ(b.prompt_tokens_shared(), kGroups * (kSamples - 1) * prompt_len);
    }
}

// A drain (preemption) while a decode step is queued ahead of the host: the queued draws are
// dropped, and the drained sequences, resumed from their partial trajectories in a fresh engine,
// end with the tokens, log-probabilities and draw counts of an uninterrupted run.
TEST(RlGpu, ADrainWithAStepQueuedResumesToTheSameTokens) {
    SKIP_WITHOUT_CUDA();
    if (!moerl::model::Generator::available()) GTEST_SKIP() << "no CUDA generation engine in this build";
    RunConfig c = RunConfig::from_yaml_text("rollout: {max_new_tokens: 8}\n", "gpu.yaml");
    CpuAndGpuModels models(c.model, 17);
    auto engine = [&] {
        return std::make_unique<RolloutEngine>(
            models.gpu, c.sampling,
            RolloutEngineOptions{.max_batch = 4, .max_seq_len = c.rollout_max_seq_len});
    };
    std::vector<GenRequest> requests;
    for (int i = 0; i < 6; ++i) {
        const TaskPayload p = make_task_payload(c, 0, i, 0);
        requests.push_back({static_cast<uint64_t>(i), p.prompt_tokens, {}, p.seed, 4 + i % 5});
    }
    auto whole = engine();
    for (const GenRequest& r : requests) whole->add(r);
    const auto want = by_id(whole->run_to_completion(0));
    auto first = engine();
    for (const GenRequest& r : requests) first->add(r);
    std::vector<GenResult> got;
    for (int s = 0; s < 3; ++s)
        for (GenResult& d : first->step(0)) got.push_back(std::move(d));
    std::vector<GenResult> drained = first->drain();
    EXPECT_TRUE(first->idle());
    ASSERT_FALSE(drained.empty());
    bool partial = false;
    auto second = engine();
    for (GenResult& d : drained) {
        const GenRequest& r = requests[d.id];
        partial = partial || !d.trajectory.tokens.empty();
        second->add({r.id, r.prompt, std::move(d.trajectory), r.seed, r.max_new_tokens});
    }
    EXPECT_TRUE(partial) << "no drained sequence had begun: the case is not covered";
    for (GenResult& d : second->run_to_completion(0)) got.push_back(std::move(d));
    got = by_id(std::move(got));
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
        const Trajectory &tw = want[i].trajectory, &tg = got[i].trajectory;
        EXPECT_EQ(tg.tokens, tw.tokens) << "request " << want[i].id;
        EXPECT_EQ(tg.rng_draws, tw.rng_draws) << "request " << want[i].id;
        ASSERT_EQ(tg.logprobs.size(), tw.logprobs.size());
        for (size_t j = 0; j < tw.logprobs.size(); ++j)
            EXPECT_NEAR(tg.logprobs[j], tw.logprobs[j], 1e-4) << "request " << want[i].id << " token " << j;
    }
}

// On the device: the draws follow softmax(logits / T) (chi-square, 5 degrees of freedom, 0.1%
// critical value 20.5), the same uniforms give the same tokens as on the CPU (a 6-token vocabulary
// and Qwen3's 151936), top-k keeps k.
TEST(RlGpu, SamplingOnTheDeviceDrawsFromTheDistribution) {
    SKIP_WITHOUT_CUDA();
    const std::vector<float> row = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f, -1.0f};
    const int V = static_cast<int>(row.size()), N = 20000;
    SamplingParams p;
    p.temperature = 0.8;
    at::Tensor logits = at::tensor(row).unsqueeze(0).expand({N, V}).contiguous();
    std::vector<double> u(N);
    for (int i = 0; i < N; ++i) u[i] = uniform_draw(42, static_cast<uint64_t>(i));
    const auto on_gpu = sample_tokens(logits.to(at::kCUDA), p, u);
    const auto on_cpu = sample_tokens(logits, p, u);
    std::vector<double> counts(V, 0), prob(V);
    double z = 0;
    for (int v = 0; v < V; ++v) z += std::exp(row[v] / p.temperature);
    for (int v = 0; v < V; ++v) prob[v] = std::exp(row[v] / p.temperature) / z;
    for (int i = 0; i < N; ++i) {
        ASSERT_EQ(on_gpu[i].first, on_cpu[i].first) << "draw " << i;
        counts[on_gpu[i].first] += 1;
    }
    double chi2 = 0;
    for (int v = 0; v < V; ++v) chi2 += (counts[v] - N * prob[v]) * (counts[v] - N * prob[v]) / (N * prob[v]);
    EXPECT_LT(chi2, 20.5);
    p.top_k = 2;
    for (const auto& [tok, lp] : sample_tokens(logits.to(at::kCUDA).narrow(0, 0, 500), p,
                                               std::vector<double>(u.begin(), u.begin() + 500)))
        EXPECT_TRUE(tok == 3 || tok == 0) << tok;
    // A real vocabulary in bf16 (the rollout engine's logits): the device kernel's chunks and scan
    // give the CPU's draws and log-probabilities.
    p = SamplingParams{};
    p.temperature = 1.0;
    const int B = 64, kVocab = 151936;
    at::manual_seed(5);
    const at::Tensor big = (at::randn({B, kVocab}) * 3).to(at::kBFloat16);
    std::vector<double> ub(B);
    for (int i = 0; i < B; ++i) ub[i] = uniform_draw(7, static_cast<uint64_t>(i));
    const auto dev = sample_tokens(big.to(at::kCUDA), p, ub), host = sample_tokens(big, p, ub);
    for (int i = 0; i < B; ++i) {
        EXPECT_EQ(dev[i].first, host[i].first) << "row " << i;
        EXPECT_NEAR(dev[i].second, host[i].second, 1e-5) << "row " << i;
    }
}

// After an update on the GPU, a bf16 generator that lent its memory to the update and copied the
// trainer's weights in place decodes exactly what a generator built on a model loaded from the saved
// checkpoint decodes.
TEST(RlGpu, GeneratorAfterAnInPlaceSyncEqualsAFreshOne) {
    SKIP_WITHOUT_CUDA();
    if (!moerl::model::Generator::available()) GTEST_SKIP() << "no CUDA generation engine in this build";
    TempDir t("gpusync");
    RunConfig c = small_config(t.path);
    c.ep_ranks = 1;
    c.train_device = "cuda";
    c.train_dtype = "bf16";
    PolicyTrainer trainer(c, (t.path / "work").string());
    const auto batch = batch_of(c);
    moerl::model::ModelOptions o;
    o.device = at::Device(at::kCUDA, 0);
    o.dtype = at::kBFloat16;
    moerl::model::MoeModel synced(c.model, o);
    synced.init_random(99);  // other weights to start from
    moerl::model::Generator gen_synced(synced, {.max_batch = 4, .max_seq_len = 64});
    // Colocated: the engine lends its KV cache and weight copies to the update; the sync and the
    // prefill take them back.
    const int64_t own = gen_synced.cache_memory_bytes() + gen_synced.weight_copy_bytes();
    EXPECT_GT(gen_synced.weight_copy_bytes(), 0);
    EXPECT_EQ(gen_synced.release_memory(), own);
    trainer.update(batch, advantages_of(batch, c.group_size));
    {
        c10::NoGradGuard g;
        std::map<std::string, at::Tensor> dst;
        for (auto& [name, tensor] : synced.state_dict()) dst.emplace(name, tensor);
        for (const auto& [name, src] : trainer.weights()) dst.at(name).copy_(src);
    }
    gen_synced.refresh_weights();
    EXPECT_GT(gen_synced.weight_copy_bytes(), 0);
    trainer.save_weights((t.path / "saved").string());
    moerl::model::MoeModel fresh(c.model, o);
    fresh.load_weights((t.path / "saved").string());
    moerl::model::Generator gen_fresh(fresh, {.max_batch = 4, .max_seq_len = 64});
    std::vector<std::vector<int64_t>> prompts;
    for (int i = 0; i < 3; ++i) {
        const TaskPayload p = make_task_payload(c, 1, i, 0);
        prompts.emplace_back(p.prompt_tokens.begin(), p.prompt_tokens.end());
    }
    std::vector<int> sa, sb;
    for (int i = 0; i < 3; ++i) sa.push_back(gen_synced.acquire()), sb.push_back(gen_fresh.acquire());
    at::Tensor ta = gen_synced.prefill(sa, prompts).greedy, tb = gen_fresh.prefill(sb, prompts).greedy;
    for (int step = 0; step < 8; ++step) {
        ASSERT_TRUE(at::equal(ta.cpu(), tb.cpu())) << "step " << step;
        auto ra = gen_synced.decode(sa, ta), rb = gen_fresh.decode(sb, tb);
        ASSERT_TRUE(at::equal(ra.logits.cpu(), rb.logits.cpu())) << "logits differ at step " << step;
        ta = ra.greedy;
        tb = rb.greedy;
    }
}

namespace {
// Bit for bit: bf16 weights as 16-bit integers (NaN and -0 compare as themselves).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
    if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
    return at::equal(a.contiguous().view(at::kShort).cpu(), b.contiguous().view(at::kShort).cpu());
}
}  // namespace

// The CUDA IPC export read in the trainer's own process, as the rollout's rank 0 reads trainer rank 0
// (the other processes open its handles: rollout_processes_test): the rollout model's bf16 weights
// equal the trainer's bit for bit, in one copy of their bytes; a second export takes no new handles,
// and each update counts as a write.
TEST(RlGpu, CudaIpcExportReadInTheTrainersProcessEqualsItsWeights) {
    SKIP_WITHOUT_CUDA();
    using namespace moerl::rl::detail;
    TempDir t("gpuipc");
    RunConfig c = small_config(t.path);
    c.ep_ranks = 1;
    c.train_device = "cuda";
    c.train_dtype = "bf16";
    PolicyTrainer trainer(c, (t.path / "work").string());
    const auto batch = batch_of(c);
    const auto adv = advantages_of(batch, c.group_size);
    trainer.update(batch, adv);
    std::string why;
    const std::vector<std::string> parts = trainer.export_weights_ipc(why);
    ASSERT_EQ(parts.size(), 1u) << why;
    IpcPolicy p;
    p.version = 1;
    p.publisher = "test";
    p.writes = trainer.weight_writes();
    p.processes.push_back(ipc_process_from_json(parts[0]));
    EXPECT_EQ(p.writes, 1);
    EXPECT_GT(p.processes[0].allocations.size(), 0u);
    moerl::model::ModelOptions o;
    o.device = at::Device(at::kCUDA, 0);
    o.dtype = at::kBFloat16;
    moerl::model::MoeModel rollout(c.model, o);
    rollout.init_random(99);  // other weights to start from
    IpcImporter reader(rollout);
    EXPECT_EQ(reader.copy(p), rollout.weight_bytes());
    EXPECT_EQ(reader.num_open(), 0u) << "this process's own allocations are read where they are";
    std::map<std::string, at::Tensor> mine;
    for (auto& [name, tensor] : trainer.weights()) mine.emplace(name, tensor);
    size_t compared = 0;
    for (const auto& [name, tensor] : rollout.state_dict()) {
        ASSERT_TRUE(mine.count(name)) << name;
        EXPECT_TRUE(same_bits(tensor, mine.at(name))) << name;
        ++compared;
    }
    EXPECT_EQ(compared, mine.size());
    EXPECT_EQ(trainer.export_weights_ipc(why), parts) << "nothing moved: the same handles";
    trainer.update(batch, adv);
    EXPECT_EQ(trainer.weight_writes(), 2);
}
