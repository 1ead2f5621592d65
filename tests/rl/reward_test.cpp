// The reward stage: rollout -> scoring stage -> reward worker -> buffer, the verifier/model mix,
// a killed reward worker, config errors and a local run whose metrics carry the mix.
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>

#include "../model/model_test_util.hpp"
#include "moerl/core/error.hpp"
#include "moerl/model/reward_model.hpp"
#include "moerl/rl/reward_worker.hpp"
#include "moerl/rl/run.hpp"
#include "rl_test_util.hpp"

using namespace moerl::rl;
using namespace moerl::rl::test;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
using moerl::model::RewardModel;
using moerl::model::test::error_of;

namespace {

// A one-layer backbone with the policy's vocabulary; weights far from 0, so scores differ.
moerl::model::ModelConfig reward_backbone(int vocab_size) {
    moerl::model::ModelConfig m = moerl::model::test::tiny_config(1);
    m.vocab_size = vocab_size;
    m.initializer_range = 0.5;
    m.torch_dtype = "float32";
    return m;
}

// A random reward model with the policy's vocabulary, written to `dir`.
std::string write_reward_model(const RunConfig& c, const fs::path& dir) {
    RewardModel rm(reward_backbone(c.model.vocab_size), 1, 0, Tokenizer::kPad, {});
    rm.init_random(21);
    rm.save_pretrained(dir.string());
    return dir.string();
}

// A reward model whose score is the same for every sequence: every weight 0 but the embedding
// (0.5 everywhere), the final norm and the head, so the final hidden state never changes.
double write_constant_reward_model(const RunConfig& c, const fs::path& dir) {
    RewardModel rm(reward_backbone(c.model.vocab_size), 1, 0, Tokenizer::kPad, {});
    {
        c10::NoGradGuard no_grad;
        for (auto& p : rm.backbone().named_parameters()) {
            if (p.name == "model.embed_tokens.weight") p.tensor.fill_(0.5);
            if (p.name == "model.norm.weight") p.tensor.fill_(1.0);
        }
        rm.score_weight().fill_(0.1);
    }
    rm.save_pretrained(dir.string());
    return rm.score({{1, 5, 7}})[0];
}

// Step 0 with a random reward model scoring in batches of 5, mixed 2 x verifier + 0.5 x model.
struct Staged : StepZero {
    explicit Staged(const char* tag, int64_t lease_timeout_ms = 0)
        : StepZero(tag, lease_timeout_ms, [](RunConfig& c, const fs::path& dir) {
              c.reward_model_path = write_reward_model(c, dir / "rm");
              c.verifier_weight = 2.0;
              c.reward_model_weight = 0.5;
              c.reward_batch_size = 5;
          }) {}

    // What the mix must give: verifier_weight x verifier + model_weight x the model's own score.
    double expected_reward(const ExperienceRecord& e, const RewardModel& rm) const {
        std::vector<int> seq = e.task.prompt_tokens;
        seq.insert(seq.end(), e.trajectory.tokens.begin(), e.trajectory.tokens.end());
        const double verified = make_verifier_rewarder(c.task)->score(
            {{e.task.problem, e.task.prompt_tokens, e.trajectory.tokens, e.trajectory.terminated}})[0];
        return c.verifier_weight * verified + c.reward_model_weight * rm.score({seq})[0];
    }
};

}  // namespace

TEST(RlReward, StageMixesVerifierAndModelScores) {
    Staged z("rm-mix");
    ControlPlane& cp = *z.cp;
    const size_t n = z.num_tasks;
    RolloutWorker rollout(z.c, cp, "rollout", z.dir("rollout"));
    rollout.work(0ms);
    // Nothing reaches the trainer before the reward model scored it.
    EXPECT_EQ(cp.experience->size(), 0u);
    EXPECT_EQ(cp.scoring->outstanding(), n);

    RewardWorker reward(z.c, cp, "reward");
    EXPECT_EQ(reward.work(0ms), n);
    EXPECT_EQ(reward.stats().scored, static_cast<int64_t>(n));
    EXPECT_EQ(reward.stats().batches, static_cast<int64_t>((n + 4) / 5));
    EXPECT_EQ(cp.scoring->outstanding(), 0u);
    ASSERT_EQ(cp.experience->size(), n);

    const RewardModel rm = RewardModel::from_pretrained(z.c.reward_model_path, {});
    int wrong = 0;
    double lo = 1e9, hi = -1e9;
    for (const auto& d : cp.experience->take("check", n, 0ms)) {
        ExperienceRecord e = experience_from_json(d.experience.payload);
        const double want = z.expected_reward(e, rm);
        wrong += std::abs(e.reward - want) > 1e-5;
        lo = std::min(lo, e.reward);
        hi = std::max(hi, e.reward);
    }
    EXPECT_EQ(wrong, 0);
    EXPECT_GT(hi - lo, 1e-3);  // the rewards really differ between samples
}

TEST(RlReward, KilledWorkerLosesNothingAndPassesEachOnOnce) {
    Staged z("rm-kill", 300);
    ControlPlane& cp = *z.cp;
    const size_t n = z.num_tasks;
    RolloutWorker rollout(z.c, cp, "rollout", z.dir("rollout"));
    rollout.work(0ms);
    ASSERT_EQ(cp.scoring->outstanding(), n);
    const RewardModel rm = RewardModel::from_pretrained(z.c.reward_model_path, {});
    // Killed before its push: three leases that are never acknowledged.
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(cp.scoring->lease("dead-before-push", 0ms));
    // Killed after its push, before the acknowledgement: two experiences already in the buffer.
    for (int i = 0; i < 2; ++i) {
        auto l = cp.scoring->lease("dead-after-push", 0ms);
        ASSERT_TRUE(l);
        ExperienceRecord e = experience_from_json(l->task.payload);
        e.reward = z.expected_reward(e, rm);
        ASSERT_TRUE(cp.experience->push({e.task_id, e.attempt, e.oldest_version(), to_json(e)}));
    }
    RewardWorker alive(z.c, cp, "alive");
    alive.work(1500ms);  // the fresh ones, then the five leases once they expire
    EXPECT_EQ(alive.stats().scored, static_cast<int64_t>(n - 5) + 5);
    EXPECT_EQ(alive.stats().redone, 5);
    EXPECT_EQ(alive.stats().duplicates, 2);
    EXPECT_EQ(cp.scoring->outstanding(), 0u);
    EXPECT_EQ(cp.experience->size(), n);  // each once
    auto r = z.trainer->train_step(0, 1000ms);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->task_ids.size(), n);
}

TEST(RlReward, TerminationNoticeReleasesAnUnscoredBatch) {
    Staged z("rm-stop");
    ControlPlane& cp = *z.cp;
    RolloutWorker rollout(z.c, cp, "rollout", z.dir("rollout"));
    rollout.work(0ms);
    std::atomic<bool> stop{true};
    RewardWorker reward(z.c, cp, "reward");
    EXPECT_EQ(reward.work(0ms, &stop), 0u);
    EXPECT_EQ(cp.scoring->outstanding(), z.num_tasks);
    EXPECT_EQ(cp.experience->size(), 0u);
    RewardWorker next(z.c, cp, "next");
    EXPECT_EQ(next.work(0ms), z.num_tasks);
}

TEST(RlReward, ConfigErrorsNameTheKey) {
    TempDir t("rm-config");
    const std::string base = "run: {steps: 2}\ntask: {kind: sort, length: 2, max_value: 4}\n";
    EXPECT_NE(error_of([&] {
                  RunConfig::from_yaml_text(base + "reward: {model_weight: 1}\n", "x.yaml");
              }).find("x.yaml: reward.model_weight: 1, but no reward.model_path names a reward model"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  RunConfig::from_yaml_text(base + "reward: {model_path: /rm}\n", "x.yaml");
              }).find("reward.model_weight: 0 with reward.model_path set"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  RunConfig::from_yaml_text(
                      base + "reward: {model_path: /rm, model_weight: 1, batch_size: 0}\n", "x.yaml");
              }).find("x.yaml: reward.batch_size: expected an integer in [1, 65536], got 0"),
              std::string::npos);

    // A reward worker on a run without a reward model.
    RunConfig c = small_config(t.path / "run");
    ControlPlane plain = ControlPlane::connect(c, unique("rm-none"));
    EXPECT_NE(error_of([&] {
                  RewardWorker(c, plain, "r");
              }).find("reward worker r: test.yaml has no reward.model_path, so nothing is scored"),
              std::string::npos);

    // A causal LM as the reward model: refused before any work, naming what it is.
    moerl::model::MoeModel lm(reward_backbone(c.model.vocab_size), {});
    lm.save_pretrained((t.path / "lm").string(), 0, "float32");
    c.reward_model_path = (t.path / "lm").string();
    c.reward_model_weight = 1;
    RunOptions o;
    o.progress = false;
    EXPECT_NE(error_of([&] { run_local(c, o); }).find("is a causal language model (lm_head.weight)"),
              std::string::npos);
    // A vocabulary smaller than the policy's.
    RewardModel small(reward_backbone(c.model.vocab_size - 3), 1, 0, std::nullopt, {});
    small.save_pretrained((t.path / "small").string());
    c.reward_model_path = (t.path / "small").string();
    c.output_dir = (t.path / "run2").string();
    EXPECT_NE(error_of([&] { run_local(c, o); }).find("smaller than the policy's"), std::string::npos);
}

TEST(RlReward, LocalRunMetricsCarryTheMix) {
    // A reward model scoring every sequence the same (c) shifts each group's rewards equally, so
    // GRPO's advantages, and with them the whole run, are those of the run without it; the
    // metrics' reward must be the verifier's plus model_weight x c at every step.
    TempDir plain("rm-plain"), mixed("rm-mixed"), weighted("rm-weighted");
    RunConfig a = small_config(plain.path);
    a.steps = 3;
    RunConfig b = small_config(mixed.path);
    b.steps = 3;
    const double score = write_constant_reward_model(b, mixed.path / "rm");
    ASSERT_GT(std::abs(score), 0.5);
    b.reward_model_path = (mixed.path / "rm").string();
    b.reward_model_weight = 0.25;
    b.reward_batch_size = 7;
    RunConfig w = b;
    w.output_dir = weighted.path.string();
    w.verifier_weight = 0.5;
    w.reward_model_weight = 1.0;
    w.steps = 1;
    RunOptions o;
    o.progress = false;
    run_local(a, o);
    run_local(b, o);
    run_local(w, o);
    const auto ma = read_metrics((plain.path / "metrics.jsonl").string());
    const auto mb = read_metrics((mixed.path / "metrics.jsonl").string());
    const auto mw = read_metrics((weighted.path / "metrics.jsonl").string());
    ASSERT_EQ(ma.size(), 3u);
    ASSERT_EQ(mb.size(), 3u);
    ASSERT_EQ(mw.size(), 1u);
    // Every step: the same samples and the same update, the reward shifted by model_weight x c.
    for (size_t s = 0; s < ma.size(); ++s) {
        EXPECT_NEAR(mb[s]["reward"].get<double>(), ma[s]["reward"].get<double>() + 0.25 * score, 1e-6) << s;
        EXPECT_NEAR(mb[s]["reward_std"].get<double>(), ma[s]["reward_std"].get<double>(), 1e-6) << s;
        for (const auto& [key, value] : ma[s].items()) {
            // exact is the verifier's call, which the reward model's shift leaves alone.
            if (key == "reward" || key == "reward_std") continue;
            EXPECT_EQ(mb[s][key], value) << "step " << s << ": " << key;
        }
    }
    EXPECT_NEAR(mw[0]["reward"].get<double>(), 0.5 * ma[0]["reward"].get<double>() + score, 1e-6);
}
