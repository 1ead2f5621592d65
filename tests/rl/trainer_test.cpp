// The trainer's micro-batches and mixed precision: packed micro-batches with gradient accumulation
// give the full batch's loss and gradients; in bf16 the fp32 master weights take AdamW's exact step.
#include "moerl/rl/trainer.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <string>

#include "moerl/core/error.hpp"
#include "moerl/model/model.hpp"
#include "moerl/model/safetensors.hpp"
#include "moerl/rl/grpo.hpp"
#include "moerl/rl/roles.hpp"
#include "rl_test_util.hpp"

using namespace moerl::rl;
using namespace moerl::rl::test;
namespace fs = std::filesystem;

namespace {

// One step's samples with responses of 1 to 5 tokens and varied rewards.
std::vector<ExperienceRecord> varied_batch(const RunConfig& c) {
    return synthetic_batch(
        c, [](int p, int g) { return 1 + (p + 2 * g) % 5; },
        [](const ExperienceRecord&, int p, int g, int j) { return 3 + (p * 7 + g * 3 + j) % 12; },
        [](int j) { return -1.0f - 0.1f * static_cast<float>(j); },
        [](int p, int g) { return ((p + g) % 4) / 3.0; });
}

std::vector<double> advantages_of(const std::vector<ExperienceRecord>& batch, int group_size) {
    std::vector<double> rewards;
    for (const auto& e : batch) rewards.push_back(e.reward);
    return group_advantages(rewards, group_size);
}

// Every fp32 tensor of the safetensors files in `dir` whose name starts with `prefix`, by name and
// file (EP ranks write one file each).
std::map<std::string, std::vector<float>> read_tensors(const fs::path& dir, const std::string& prefix) {
    std::map<std::string, std::vector<float>> out;
    for (const auto& entry : fs::directory_iterator(dir)) {
        if (entry.path().extension() != ".safetensors") continue;
        moerl::model::SafetensorsFile f(entry.path().string());
        for (const auto& info : f.tensors()) {
            if (info.name.rfind(prefix, 0) != 0) continue;
            const float* p = reinterpret_cast<const float*>(f.data(info));
            out[entry.path().filename().string() + ":" + info.name].assign(p, p + info.numel());
        }
    }
    return out;
}

// Largest |a - b| over all tensors, and the largest |a|.
std::pair<double, double> max_difference(const std::map<std::string, std::vector<float>>& a,
                                         const std::map<std::string, std::vector<float>>& b) {
    EXPECT_EQ(a.size(), b.size());
    double diff = 0, scale = 0;
    for (const auto& [name, x] : a) {
        auto it = b.find(name);
        if (it == b.end()) {
            ADD_FAILURE() << name << " missing";
            continue;
        }
        EXPECT_EQ(x.size(), it->second.size()) << name;
        for (size_t i = 0; i < x.size() && i < it->second.size(); ++i) {
            diff = std::max(diff, std::abs(static_cast<double>(x[i]) - it->second[i]));
            scale = std::max(scale, std::abs(static_cast<double>(x[i])));
        }
    }
    return {diff, scale};
}

}  // namespace

TEST(TrainerMicroBatches, PackedEqualsTheFullBatch) {
    for (int ranks : {1, 2}) {
        TempDir t("packed");
        RunConfig c = small_config(t.path);
        c.ep_ranks = ranks;
        c.grad_clip = 0;
        c.model.router_aux_loss_coef = 0;  // the load-balancing loss is not a sum over tokens
        const auto batch = varied_batch(c);
        const auto adv = advantages_of(batch, c.group_size);
        TrainStats full_stats, packed_stats;
        for (int64_t budget : {int64_t{0}, int64_t{12}}) {
            RunConfig run = c;
            run.micro_batch_tokens = budget;
            PolicyTrainer trainer(run, (t.path / ("work" + std::to_string(budget))).string());
            (budget == 0 ? full_stats : packed_stats) = trainer.update(batch, adv);
            trainer.save_optimizer((t.path / ("opt" + std::to_string(budget))).string());
        }
        EXPECT_NE(full_stats.loss, 0.0);
        EXPECT_NEAR(packed_stats.loss, full_stats.loss, 1e-5 * std::abs(full_stats.loss) + 1e-7)
            << ranks << " ranks";
        EXPECT_NEAR(packed_stats.grad_norm, full_stats.grad_norm, 1e-4 * full_stats.grad_norm);
        EXPECT_EQ(packed_stats.num_tokens, full_stats.num_tokens);
        // The gradients, from the first moments: exp_avg = (1 - beta1) * gradient after one step.
        auto [diff, scale] = max_difference(read_tensors(t.path / "opt0", "exp_avg."),
                                            read_tensors(t.path / "opt12", "exp_avg."));
        EXPECT_GT(scale, 0.0);
        EXPECT_LT(diff, 1e-5 * scale) << ranks << " ranks";
    }
}

namespace {

// name -> values of read_tensors' "file:name" entries. unique: a name in two files is a failure (the
// moments of one weight kept twice); else the first file's copy is kept (weights every rank holds).
std::map<std::string, std::vector<float>> by_name(const std::map<std::string, std::vector<float>>& files,
                                                  bool unique) {
    std::map<std::string, std::vector<float>> out;
    for (const auto& [key, v] : files) {
        const std::string name = key.substr(key.find(':') + 1);
        if (unique) {
            EXPECT_EQ(out.count(name), 0u) << name << " is kept by two ranks";
        }
        out.emplace(name, v);
    }
    return out;
}

// The entries that are not experts' (every rank holds experts of the same names).
std::map<std::string, std::vector<float>> dense_only(const std::map<std::string, std::vector<float>>& m) {
    std::map<std::string, std::vector<float>> out;
    for (const auto& [name, v] : m)
        if (name.find(".experts.") == std::string::npos) out.emplace(name, v);
    return out;
}

}  // namespace

// The optimizer state is sharded over the EP ranks: each dense weight's AdamW moments live on one
// rank (every rank's file holds its experts' and its share of the dense weights', no name twice, the
// shares within one weight of even), and two clipped, decayed updates over 2 and 4 ranks leave the
// dense weights and their moments equal to one rank's.
TEST(TrainerShardedOptimizer, EachDenseMomentLivesOnOneRankAndUpdatesEqualOneRank) {
    TempDir t("sharded");
    RunConfig c = small_config(t.path);
    c.grad_clip = 0.5;
    c.weight_decay = 0.01;
    c.model.router_aux_loss_coef = 0;  // each rank's load-balancing loss counts its own tokens
    const auto batch = varied_batch(c);
    const auto adv = advantages_of(batch, c.group_size);
    std::map<int, fs::path> opt, weights;
    for (int ranks : {1, 2, 4}) {
        RunConfig run = c;
        run.ep_ranks = ranks;
        PolicyTrainer trainer(run, (t.path / ("work" + std::to_string(ranks))).string());
        trainer.update(batch, adv);
        trainer.update(batch, adv);
        opt[ranks] = t.path / ("opt" + std::to_string(ranks));
        weights[ranks] = t.path / ("weights" + std::to_string(ranks));
        trainer.save_optimizer(opt[ranks].string());
        trainer.save_weights(weights[ranks].string());
    }
    const auto moments_one = by_name(dense_only(read_tensors(opt[1], "exp_")), true);
    const auto weights_one = by_name(dense_only(read_tensors(weights[1], "")), false);
    ASSERT_FALSE(moments_one.empty());
    for (int ranks : {2, 4}) {
        SCOPED_TRACE(std::to_string(ranks) + " ranks");
        std::map<std::string, int64_t> dense_elements;  // per rank's file
        for (const auto& [key, v] : read_tensors(opt[ranks], "exp_avg."))
            if (key.find(".experts.") == std::string::npos)
                dense_elements[key.substr(0, key.find(':'))] += static_cast<int64_t>(v.size());
        ASSERT_EQ(dense_elements.size(), static_cast<size_t>(ranks)) << "every rank keeps a share";
        int64_t least = std::numeric_limits<int64_t>::max(), most = 0;
        for (const auto& [file, n] : dense_elements) least = std::min(least, n), most = std::max(most, n);
        EXPECT_LE(most - least, int64_t{c.model.vocab_size} * c.model.hidden_size)
            << "the dense shares differ by more than the largest weight";
        const auto [mdiff, mscale] =
            max_difference(moments_one, by_name(dense_only(read_tensors(opt[ranks], "exp_")), true));
        EXPECT_GT(mscale, 0.0);
        EXPECT_LT(mdiff, 1e-5 * mscale) << "dense moments";
        const auto [wdiff, wscale] =
            max_difference(weights_one, by_name(dense_only(read_tensors(weights[ranks], "")), false));
        EXPECT_LT(wdiff, 1e-5 * wscale) << "dense weights";
    }
}

// train.activation_checkpointing: the same update (loss, gradient norm, gradients, load-balancing
// loss included) with each layer recomputed in the backward, on one rank and over EP ranks, padded
// and packed.
TEST(TrainerMicroBatches, ActivationCheckpointingTrainsTheSame) {
    for (int ranks : {1, 2}) {
        for (int64_t budget : {int64_t{0}, int64_t{12}}) {
            TempDir t("checkpointed");
            RunConfig c = small_config(t.path);
            c.ep_ranks = ranks;
            c.micro_batch_tokens = budget;
            const auto batch = varied_batch(c);
            const auto adv = advantages_of(batch, c.group_size);
            TrainStats stats[2];
            for (bool checkpoint : {false, true}) {
                RunConfig run = c;
                run.activation_checkpointing = checkpoint;
                const std::string name = checkpoint ? "checkpointed" : "plain";
                PolicyTrainer trainer(run, (t.path / ("work-" + name)).string());
                stats[checkpoint] = trainer.update(batch, adv);
                trainer.save_optimizer((t.path / ("opt-" + name)).string());
            }
            SCOPED_TRACE(std::to_string(ranks) + " ranks, micro_batch_tokens " + std::to_string(budget));
            EXPECT_NE(stats[0].loss, 0.0);
            EXPECT_NEAR(stats[1].loss, stats[0].loss, 1e-6 * std::abs(stats[0].loss) + 1e-8);
            EXPECT_NEAR(stats[1].aux_loss, stats[0].aux_loss, 1e-6);
            EXPECT_NEAR(stats[1].grad_norm, stats[0].grad_norm, 1e-5 * stats[0].grad_norm);
            auto [diff, scale] = max_difference(read_tensors(t.path / "opt-plain", "exp_avg."),
                                                read_tensors(t.path / "opt-checkpointed", "exp_avg."));
            EXPECT_GT(scale, 0.0);
            EXPECT_LT(diff, 1e-5 * scale);
        }
    }
}

TEST(TrainerMicroBatches, MismatchIsZeroWhenBehaviourIsTheTrainersOwn) {
    TempDir t("mismatch");
    RunConfig c = small_config(t.path);
    c.ep_ranks = 1;
    auto batch = varied_batch(c);
    // Behaviour log-probs from the trainer's own forward: what an exact rollout would record.
    PolicyTrainer trainer(c, (t.path / "work").string());
    auto weights = trainer.weights();
    moerl::model::MoeModel m(c.model, moerl::model::ModelOptions{});
    {
        c10::NoGradGuard g;
        auto dst = m.state_dict();
        ASSERT_EQ(dst.size(), weights.size());
        for (size_t i = 0; i < dst.size(); ++i) dst[i].second.copy_(weights[i].second);
    }
    for (auto& e : batch) {
        std::vector<int64_t> ids(e.task.prompt_tokens.begin(), e.task.prompt_tokens.end());
        ids.insert(ids.end(), e.trajectory.tokens.begin(), e.trajectory.tokens.end());
        at::Tensor x = at::tensor(ids, at::kLong).unsqueeze(0);
        c10::NoGradGuard g;
        at::Tensor lp = moerl::model::token_logprobs(m.forward(x, at::Tensor()).logits, x);
        const size_t P = e.task.prompt_tokens.size();
        for (size_t j = 0; j < e.trajectory.tokens.size(); ++j)
            e.trajectory.logprobs[j] = lp[0][static_cast<int64_t>(P + j)].item<float>();
    }
    TrainStats st = trainer.update(batch, advantages_of(batch, c.group_size));
    EXPECT_LT(st.logprob_diff, 1e-5);
    EXPECT_LT(st.behaviour_ratio_std, 1e-5);
    EXPECT_NEAR(st.mean_ratio, 1.0, 1e-5);
    // And a recorded log-prob off by 0.5 on every token shows as such.
    for (auto& e : batch)
        for (auto& lp : e.trajectory.logprobs) lp -= 0.5f;
    PolicyTrainer fresh(c, (t.path / "work2").string());
    TrainStats off = fresh.update(batch, advantages_of(batch, c.group_size));
    EXPECT_NEAR(off.logprob_diff, 0.5, 1e-4);
}

TEST(TrainerMixedPrecision, Bf16MasterWeightsTakeTheExactAdamWStep) {
    TempDir t("bf16");
    RunConfig c = small_config(t.path);
    c.ep_ranks = 1;
    c.grad_clip = 0;
    c.weight_decay = 0;
    c.train_dtype = "bf16";
    const auto batch = varied_batch(c);
    PolicyTrainer trainer(c, (t.path / "work").string());
    trainer.save_weights((t.path / "w0").string());
    trainer.update(batch, advantages_of(batch, c.group_size));
    trainer.save_weights((t.path / "w1").string());
    trainer.save_optimizer((t.path / "opt").string());
    auto w0 = read_tensors(t.path / "w0", "");
    auto w1 = read_tensors(t.path / "w1", "");
    auto mom = read_tensors(t.path / "opt", "");
    // After one step: w1 = w0 - lr * m_hat / (sqrt(v_hat) + eps), in fp32 on the master weights.
    const double bc1 = 1 - c.beta1, bc2 = 1 - c.beta2;
    int checked = 0, moved = 0;
    for (const auto& [key, before] : w0) {
        const std::string name = key.substr(key.find(':') + 1);
        // Experts are one stacked tensor in the optimizer state and one per expert in the weights:
        // the dense weights are compared.
        auto mi = mom.find("optimizer-rank0.safetensors:exp_avg." + name);
        if (mi == mom.end()) continue;
        const auto& after = w1.at(key);
        const auto& m = mi->second;
        const auto& v = mom.at("optimizer-rank0.safetensors:exp_avg_sq." + name);
        ASSERT_EQ(after.size(), before.size());
        for (size_t i = 0; i < before.size(); ++i) {
            const double step = c.lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + c.adam_eps);
            const double expected = static_cast<double>(before[i]) - step;
            ASSERT_NEAR(after[i], expected, 1e-6 * std::max(1.0, std::abs(expected)))
                << name << "[" << i << "]";
            moved += after[i] != before[i];
            ++checked;
        }
    }
    EXPECT_GT(checked, 1000);
    EXPECT_GT(moved, checked / 2);
    // The steps are smaller than bf16's resolution for most weights: only fp32 masters keep them.
    // What forward runs on is the master rounded to bf16.
    for (const auto& [name, w] : trainer.weights()) {
        EXPECT_EQ(w.scalar_type(), at::kBFloat16) << name;
    }
}

TEST(TrainerConfig, CudaNeedsOneRankAndADevice) {
    TempDir t("cudacfg");
    RunConfig c = small_config(t.path);
    c.train_device = "cuda";
    c.ep_ranks = 2;
    try {
        c.validate();
        FAIL() << "ranks.ep 2 on cuda accepted";
    } catch (const moerl::Error& e) {
        EXPECT_NE(std::string(e.what()).find("ranks.ep must be 1"), std::string::npos) << e.what();
    }
    if (!at::hasCUDA()) {
        c.ep_ranks = 1;
        try {
            PolicyTrainer trainer(c, (t.path / "work").string());
            FAIL() << "a CUDA trainer without a device";
        } catch (const moerl::Error& e) {
            EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
        }
    }
}

// bf16 AdamW moments live in the GPU update's pass only: elsewhere the config is refused, naming
// what to set; an unknown value is refused by the parser.
TEST(TrainerConfig, Bf16MomentsNeedTheGpuBf16Trainer) {
    TempDir t("momentscfg");
    RunConfig c = small_config(t.path);
    c.ep_ranks = 1;
    c.moments_dtype = "bf16";
    for (const auto& [device, dtype] : {std::pair{"cpu", "bf16"}, {"cuda", "fp32"}, {"cpu", "fp32"}}) {
        c.train_device = device;
        c.train_dtype = dtype;
        try {
            c.validate();
            FAIL() << "bf16 moments accepted on " << device << " / " << dtype;
        } catch (const moerl::Error& e) {
            EXPECT_NE(std::string(e.what()).find("train.moments_dtype: bf16 moments are kept by the GPU "
                                                 "trainer's bf16 update: set train.device: cuda and "
                                                 "train.dtype: bf16 (got " +
                                                 std::string(device) + " and " + dtype + ")"),
                      std::string::npos)
                << e.what();
        }
    }
    c.train_device = "cuda";
    c.train_dtype = "bf16";
    EXPECT_NO_THROW(c.validate());
    const std::string base = "run: {steps: 2}\ntask: {kind: sort, length: 2, max_value: 4}\n";
    const RunConfig parsed = RunConfig::from_yaml_text(
        base + "train: {device: cuda, dtype: bf16, moments_dtype: bf16}\nranks: {ep: 1}\n", "m.yaml");
    EXPECT_EQ(parsed.moments_dtype, "bf16");
    EXPECT_EQ(RunConfig::from_yaml_text(base, "m.yaml").moments_dtype, "fp32");
    try {
        RunConfig::from_yaml_text(base + "train: {moments_dtype: fp8}\n", "m.yaml");
        FAIL() << "moments_dtype fp8 accepted";
    } catch (const moerl::Error& e) {
        EXPECT_NE(std::string(e.what()).find("moments_dtype"), std::string::npos) << e.what();
    }
}

TEST(TrainerConfig, ProcessRanksAreCheckedAtValidation) {
    TempDir t("rankscfg");
    auto error_of = [&](const std::function<void(RunConfig&)>& change) -> std::string {
        RunConfig c = small_config(t.path);
        change(c);
        try {
            c.validate();
        } catch (const moerl::Error& e) {
            return e.what();
        }
        return "";
    };
    EXPECT_EQ(error_of([](RunConfig& c) { c.train_ranks = 2; }), "");  // ranks.ep is 2 already
    EXPECT_NE(error_of([](RunConfig& c) { c.train_ranks = 4; }).find("so ranks.ep must be 4 too (got 2)"),
              std::string::npos);
    EXPECT_NE(error_of([](RunConfig& c) {
                  c.train_ranks = 2;
                  c.train_ep_transport = "carrier-pigeon";
              })
                  .find("ranks.transport: expected host, cuda, fabric/<provider> (fabric/tcp) or "
                        "cuda-fabric/<provider>"),
              std::string::npos);
    EXPECT_NE(error_of([](RunConfig& c) {
                  c.train_ranks = 2;
                  c.train_ep_transport = "cuda";
              }).find("needs train.device: cuda"),
              std::string::npos);
    EXPECT_NE(error_of([](RunConfig& c) {
                  c.train_ep_transport = "host";
              }).find("but ranks.train and ranks.rollout are 1"),
              std::string::npos);
    // A rollout engine over processes: the experts split evenly, the transport follows its device.
    EXPECT_EQ(error_of([](RunConfig& c) { c.rollout_ranks = 4; }), "");
    EXPECT_NE(error_of([](RunConfig& c) {
                  c.rollout_ranks = 3;
              }).find("ranks.rollout: 3 processes each hold an equal share of the experts"),
              std::string::npos);
    {
        RunConfig c = small_config(t.path);
        c.rollout_ranks = 2;
        EXPECT_EQ(c.rollout_ep_transport(), "host");
        c.train_ep_transport = "fabric/tcp";
        EXPECT_EQ(c.rollout_ep_transport(), "fabric/tcp");
        c.rollout_device = "cuda";
        EXPECT_EQ(c.rollout_ep_transport(), "cuda");
    }
    EXPECT_EQ(error_of([](RunConfig& c) {
                  c.train_ranks = 2;
                  c.train_ep_transport = "fabric/tcp";
              }),
              "");
    // Between nodes on GPUs: cuda-fabric/<provider> suits the GPU trainer and GPU rollout only.
    EXPECT_EQ(error_of([](RunConfig& c) {
                  c.train_ranks = 2;
                  c.train_device = "cuda";
                  c.train_ep_transport = "cuda-fabric/efa";
              }),
              "");
    EXPECT_NE(error_of([](RunConfig& c) {
                  c.train_ranks = 2;
                  c.train_ep_transport = "cuda-fabric/tcp";
              }).find("cuda-fabric/tcp needs train.device: cuda"),
              std::string::npos);
    EXPECT_NE(error_of([](RunConfig& c) {
                  c.train_ranks = 2;
                  c.train_device = "cuda";
                  c.train_ep_transport = "fabric/tcp";
              }).find("cannot move the GPU trainer's tokens: use cuda or cuda-fabric/<provider>"),
              std::string::npos);
    EXPECT_NE(error_of([](RunConfig& c) {
                  c.train_ranks = 2;
                  c.train_ep_transport = "cuda-fabric/";
              }).find("ranks.transport: expected host"),
              std::string::npos);
    {
        RunConfig c = small_config(t.path);
        c.rollout_ranks = 2;
        c.rollout_device = "cuda";
        c.train_ep_transport = "cuda-fabric/efa";
        EXPECT_EQ(c.rollout_ep_transport(), "cuda-fabric/efa");
        c.rollout_device = "cpu";
        EXPECT_EQ(c.rollout_ep_transport(), "host");
    }
}
