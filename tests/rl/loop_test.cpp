// The one training loop (train_loop.hpp): the logged gradient norm, the acknowledgement at
// checkpoints, and the same metrics in local and distributed mode.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "moerl/model/safetensors.hpp"
#include "moerl/rl/grpo.hpp"
#include "moerl/rl/run.hpp"
#include "moerl/rl/trainer.hpp"
#include "rl_test_util.hpp"

using namespace moerl::rl;
using namespace moerl::rl::test;
namespace fs = std::filesystem;

namespace {

// A batch of one step: each prompt answered by a few tokens of the prompt itself, varied rewards.
std::vector<ExperienceRecord> fake_batch(const RunConfig& c) {
    return synthetic_batch(
        c, [](int, int g) { return 1 + g % 3; },
        [](const ExperienceRecord& e, int, int, int j) {
            return e.task.prompt_tokens[1 + (j % (e.task.prompt_tokens.size() - 1))];
        },
        [](int) { return -1.5f; }, [](int p, int g) { return ((p + g) % 4) / 3.0; });
}

// The norm of the first update's gradient, from the AdamW first moments the trainer saved:
// after one step without clipping, exp_avg = (1 - beta1) * gradient. Dense parameters are the
// same on every rank (their gradients are summed); experts are each on one rank.
double norm_from_moments(const fs::path& dir, int ranks, double beta1) {
    double sq = 0;
    for (int r = 0; r < ranks; ++r) {
        moerl::model::SafetensorsFile f(
            (dir / ("optimizer-rank" + std::to_string(r) + ".safetensors")).string());
        for (const auto& info : f.tensors()) {
            // Each rank's file: its experts' moments and its share of the dense weights' (the
            // optimizer state is sharded), every weight's in one file.
            if (info.name.rfind("exp_avg.", 0) != 0) continue;
            const float* m = reinterpret_cast<const float*>(f.data(info));
            for (int64_t i = 0; i < info.numel(); ++i) {
                const double g = m[i] / (1 - beta1);
                sq += g * g;
            }
        }
    }
    return std::sqrt(sq);
}

std::vector<std::string> keys_of(const nlohmann::json& row) {
    std::vector<std::string> keys;
    for (auto it = row.begin(); it != row.end(); ++it) keys.push_back(it.key());
    return keys;
}

// The env and one rollout worker of this process, as run_local's.
class Producer final : public ExperienceProducer {
  public:
    Producer(const RunConfig& c, ControlPlane& cp, const fs::path& dir, int64_t stop_at,
             std::atomic<bool>* stop)
        : c_(c), cp_(cp), dir_(dir), stop_at_(stop_at), stop_(stop) {}
    void start(int64_t env_next_step) override {
        env_next_ = env_next_step;
        worker_ = std::make_unique<RolloutWorker>(c_, cp_, "rollout", (dir_ / "rollout").string());
    }
    ProducedStep produce(int64_t step) override {
        while (env_next_ <= step + c_.max_staleness && env_next_ < c_.steps)
            put_step_tasks(c_, *cp_.tasks, env_next_++);
        worker_->work(moerl::control::Millis(0));
        if (step == stop_at_) stop_->store(true);  // a termination notice while this step waits
        return {};
    }

  private:
    const RunConfig& c_;
    ControlPlane& cp_;
    fs::path dir_;
    int64_t stop_at_;
    std::atomic<bool>* stop_;
    int64_t env_next_ = 0;
    std::unique_ptr<RolloutWorker> worker_;
};

}  // namespace

TEST(TrainerStats, LoggedGradNormIsTheNormOfTheGradients) {
    for (int ranks : {1, 2}) {
        TempDir t("gradnorm");
        RunConfig c = small_config(t.path);
        c.ep_ranks = ranks;
        c.grad_clip = 0;  // the moments then hold the gradient itself
        auto batch = fake_batch(c);
        std::vector<double> rewards;
        for (const auto& e : batch) rewards.push_back(e.reward);
        PolicyTrainer trainer(c, (t.path / "work").string());
        TrainStats st = trainer.update(batch, group_advantages(rewards, c.group_size));
        trainer.save_optimizer((t.path / "opt").string());
        const double expected = norm_from_moments(t.path / "opt", ranks, c.beta1);
        EXPECT_GT(expected, 0.0) << ranks << " ranks";
        EXPECT_NEAR(st.grad_norm, expected, 1e-4 * expected) << ranks << " ranks";
    }
}

TEST(TrainLoop, StepsAfterTheLastCheckpointStayUnacknowledged) {
    const size_t per_step = 8 * 4;  // small_config: prompts_per_step x group_size
    for (int every : {1, 2}) {
        TempDir t("unacked");
        RunConfig c = small_config(t.path);
        c.checkpoint_every = every;
        const std::string run = unique("unacked");
        ControlPlane cp = ControlPlane::connect(c, run);
        std::atomic<bool> stop{false};
        Producer producer(c, cp, t.path, /*stop_at=*/1, &stop);
        TrainLoopOptions o;
        o.progress = false;
        o.stop = &stop;
        RunSummary s = train_loop(c, cp, o, &producer);
        EXPECT_TRUE(s.stopped);
        EXPECT_EQ(s.steps_done, 1);
        // Step 0 was trained; with every = 2 its checkpoint never came, so it stays in the buffer
        // with step 1's (generated, never trained).
        EXPECT_EQ(cp.experience->size(), every == 1 ? per_step : 2 * per_step)
            << "checkpoint_every " << every;
        if (every != 1) continue;
        // A successor resumes from the checkpoint of step 1 and finishes: everything acknowledged.
        ControlPlane next = ControlPlane::connect(c, run);
        std::atomic<bool> never{false};
        Producer more(c, next, t.path / "next", -1, &never);
        TrainLoopOptions r = o;
        r.resume = true;
        r.stop = nullptr;
        RunSummary done = train_loop(c, next, r, &more);
        EXPECT_EQ(done.steps_done, c.steps);
        EXPECT_EQ(next.experience->size(), 0u);
        EXPECT_EQ(read_metrics(done.metrics_path).size(), static_cast<size_t>(c.steps));
    }
}

TEST(TrainLoop, DistributedRolesWriteWhatTheLocalRunWrites) {
    TempDir local("local"), dist("dist");
    RunConfig c = small_config(local.path);
    c.max_staleness = 0;
    RunOptions o;
    o.progress = false;
    RunSummary ls = run_local(c, o);

    // The three distributed roles, each with its own handles on one control plane.
    RunConfig d = c;
    d.output_dir = dist.path.string();
    d.store = "file://" + (dist.path / "store").string();
    d.checkpoint_every = 1;
    const std::string run = unique("dist");
    ControlPlane env_cp = ControlPlane::connect(d, run), rollout_cp = ControlPlane::connect(d, run);
    ControlPlane train_cp = ControlPlane::connect(d, run);
    std::thread env([&] { run_env_worker(d, env_cp, {run, "env", nullptr, {}}); });
    std::thread rollout([&] {
        run_rollout_worker(d, rollout_cp, {run, "rollout", nullptr, {}}, (dist.path / "rollout").string());
    });
    TrainWorkerOptions to;
    to.audit_path = (dist.path / "audit.jsonl").string();
    WorkerContext w{run, "train", nullptr, {}};
    RunSummary ds = run_train_worker(d, train_cp, w, to);
    env.join();
    rollout.join();  // both saw the run-done marker

    EXPECT_EQ(ds.steps_done, c.steps);
    EXPECT_TRUE(fs::exists(ds.svg_path));
    EXPECT_TRUE(fs::exists(ls.svg_path));
    auto lm = read_metrics(ls.metrics_path, false), dm = read_metrics(ds.metrics_path, false);
    ASSERT_EQ(lm.size(), static_cast<size_t>(c.steps));
    ASSERT_EQ(dm.size(), lm.size());
    for (size_t i = 0; i < lm.size(); ++i) {
        EXPECT_EQ(keys_of(dm[i]), keys_of(lm[i])) << "step " << i;
        EXPECT_EQ(dm[i]["step"], lm[i]["step"]);
        EXPECT_GT(lm[i]["grad_norm"].get<double>(), 0.0) << "step " << i;
        EXPECT_GT(dm[i]["grad_norm"].get<double>(), 0.0) << "step " << i;
        // max_staleness 0 holds exactly in both modes: no sample from an older policy.
        EXPECT_EQ(lm[i]["staleness_max"].get<int64_t>(), 0) << "local, step " << i;
        EXPECT_EQ(dm[i]["staleness_max"].get<int64_t>(), 0) << "distributed, step " << i;
    }
    EXPECT_EQ(train_cp.experience->size(), 0u);  // every experience acknowledged after its checkpoint
    EXPECT_EQ(read_metrics(to.audit_path).size(), static_cast<size_t>(c.steps) + 2);  // start, steps, done
}
