// End to end: the roles against the embedded control plane, and short local runs.
#include "moerl/rl/run.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "moerl/control/run_lock.hpp"
#include "moerl/core/error.hpp"
#include "rl_test_util.hpp"

using namespace moerl::rl;
using namespace moerl::rl::test;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {}  // namespace

TEST(RlRun, RewardRises) {
    // Threshold: from random weights (~0.07), the mean reward of the last 10 of 80 steps reaches
    // >= 0.5 and exceeds that of the first 10 steps by >= 0.3 (measured: 0.07 -> 0.77, ~10 s).
    TempDir t("rise");
    RunConfig c = small_config(t.path);
    c.steps = 80;
    c.group_size = 8;
    c.prompts_per_step = 16;
    c.lr = 0.003;
    c.rollout_max_batch = 128;
    RunOptions o;
    o.progress = false;
    RunSummary s = run_local(c, o);
    EXPECT_EQ(s.steps_done, 80);
    EXPECT_GE(s.final_reward, 0.5) << "first " << s.first_reward << " final " << s.final_reward;
    EXPECT_GE(s.final_reward, s.first_reward + 0.3)
        << "first " << s.first_reward << " final " << s.final_reward;
    EXPECT_TRUE(fs::exists(s.svg_path));
    EXPECT_EQ(read_metrics(s.metrics_path).size(), 80u);
    // Every task prefilled once (staleness 0, nothing redone); the CPU engine shares no blocks.
    int64_t prefilled = 0;
    for (const auto& row : read_metrics(s.metrics_path, /*drop_timing=*/false)) {
        prefilled += row.at("prompt_tokens").get<int64_t>();
        EXPECT_EQ(row.at("prompt_tokens_shared").get<int64_t>(), 0);
        EXPECT_EQ(row.at("rollout_released_bytes").get<int64_t>(), 0);
    }
    const int64_t prompt_len = static_cast<int64_t>(make_task_payload(c, 0, 0, 0).prompt_tokens.size());
    EXPECT_EQ(prefilled, int64_t{80} * 16 * 8 * prompt_len);
}

TEST(RlRun, SameSeedSameMetrics) {
    TempDir a("seed-a"), b("seed-b");
    RunOptions o;
    o.progress = false;
    run_local(small_config(a.path), o);
    run_local(small_config(b.path), o);
    auto ma = read_metrics((a.path / "metrics.jsonl").string());
    auto mb = read_metrics((b.path / "metrics.jsonl").string());
    ASSERT_EQ(ma.size(), 6u);
    EXPECT_EQ(ma, mb);
}

TEST(RlRun, ResumeContinuesExactly) {
    for (int staleness : {0, 2}) {
        TempDir full("full"), part("part");
        RunConfig c = small_config(full.path);
        c.max_staleness = staleness;
        RunOptions o;
        o.progress = false;
        run_local(c, o);
        c.output_dir = part.path.string();
        RunOptions first = o;
        first.stop_after = 3;
        RunSummary s1 = run_local(c, first);
        EXPECT_EQ(s1.steps_done, 3);
        RunOptions again = o;
        again.resume = true;
        RunSummary s2 = run_local(c, again);
        EXPECT_EQ(s2.steps_done, 6);
        auto mf = read_metrics((full.path / "metrics.jsonl").string());
        auto mp = read_metrics((part.path / "metrics.jsonl").string());
        ASSERT_EQ(mf.size(), 6u);
        EXPECT_EQ(mf, mp) << "staleness " << staleness;
        if (staleness > 0) {
            EXPECT_GT(mf.back()["staleness"].get<double>(), 0.0);
        }
    }
}

TEST(RlRun, TrainerStateKeepsConsumedIdsCompact) {
    // The consumed task ids as a watermark: trainer_state.json does not grow with the run.
    TempDir t("compact");
    RunConfig c = small_config(t.path);
    c.checkpoint_every = 2;
    RunOptions o;
    o.progress = false;
    o.stop_after = 4;
    run_local(c, o);
    std::ifstream in(t.path / "checkpoints" / "ckpt-00000004" / "trainer_state.json");
    ASSERT_TRUE(in) << "no checkpoint at step 4";
    auto st = nlohmann::json::parse(in);
    EXPECT_EQ(st.value("consumed_below_step", int64_t{-1}), 4);
    EXPECT_EQ(st.at("consumed").size(), 0u);
    RunOptions again;
    again.progress = false;
    again.resume = true;
    EXPECT_EQ(run_local(c, again).steps_done, 6);  // and it resumes from it
}

TEST(RlRun, ResumingAFinishedRunTrainsNoMoreSteps) {
    TempDir t("reached");
    RunConfig c = small_config(t.path);
    c.steps = 40;
    c.stop_at_reward = 0.01;  // reached as soon as there are 10 steps
    RunOptions o;
    o.progress = false;
    RunSummary s = run_local(c, o);
    ASSERT_TRUE(s.reached_reward);
    EXPECT_EQ(s.steps_done, 10);
    RunOptions again = o;
    again.resume = true;
    RunSummary r = run_local(c, again);
    EXPECT_TRUE(r.reached_reward);
    EXPECT_EQ(r.steps_done, 10);
    EXPECT_EQ(read_metrics(r.metrics_path).size(), 10u);
}

TEST(RlRun, ASecondRunOnOneOutputDirectoryIsRefused) {
    TempDir t("dirlock");
    RunConfig c = small_config(t.path);
    auto held = moerl::control::lock_run_directory(t.path.string());
    RunOptions o;
    o.progress = false;
    try {
        run_local(c, o);
        ADD_FAILURE() << "a run on a locked output directory started";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("in use by another moerl process (pid " + std::to_string(::getpid())),
                  std::string::npos)
            << e.message();
    }
    EXPECT_FALSE(fs::exists(t.path / "metrics.jsonl"));
}

TEST(RlRoles, StoppedWorkerTasksAreRedoneExactlyOnce) {
    StepZero z("stop");
    const RunConfig& c = z.c;
    ControlPlane& cp = *z.cp;
    const size_t n = z.num_tasks;
    ASSERT_EQ(cp.tasks->outstanding(), n);

    RolloutWorker a(c, cp, "a", z.dir("a"));
    a.work(0ms, nullptr, /*max_engine_steps=*/1);  // mid-task: one decode step
    const size_t released = a.release_all();       // termination notice
    EXPECT_GT(released, 0u);
    EXPECT_EQ(static_cast<size_t>(a.stats().pushed) + released, n);

    // Check the partial trajectories travel with the tasks.
    auto peek = cp.tasks->lease("peek", 0ms);
    ASSERT_TRUE(peek);
    EXPECT_EQ(peek->task.attempt, 1);
    EXPECT_FALSE(peek->task.partial.empty());
    Trajectory partial = trajectory_from_json(peek->task.partial);
    EXPECT_GE(partial.tokens.size(), 1u);
    cp.tasks->release(*peek, peek->task.partial);

    RolloutWorker b(c, cp, "b", z.dir("b"));
    b.work(0ms);
    EXPECT_EQ(static_cast<size_t>(a.stats().pushed + b.stats().pushed), n);
    EXPECT_EQ(cp.experience->size(), n);
    EXPECT_EQ(cp.tasks->outstanding(), 0u);
    auto r = z.trainer->train_step(0, 1000ms);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->version, 1);
    EXPECT_EQ(cp.experience->size(), 0u);
}

TEST(RlRoles, DeadWorkerLeasesExpireAndDuplicatesAreDropped) {
    StepZero z("dead", 300);
    const RunConfig& c = z.c;
    ControlPlane& cp = *z.cp;
    const size_t n = z.num_tasks;
    RolloutWorker dead(c, cp, "dead", z.dir("dead"));
    dead.work(0ms, nullptr, 1);  // leases everything, then stops answering
    const int64_t dead_pushed = dead.stats().pushed;
    RolloutWorker alive(c, cp, "alive", z.dir("alive"));
    alive.work(2000ms);  // waits for the leases to expire, then redoes them (attempt 1)
    EXPECT_EQ(static_cast<size_t>(dead_pushed + alive.stats().pushed), n);
    // The "dead" worker wakes up and finishes its stale copies: all rejected as duplicates.
    dead.work(0ms);
    EXPECT_EQ(dead.stats().pushed, dead_pushed);
    EXPECT_EQ(static_cast<size_t>(dead.stats().duplicates), n - static_cast<size_t>(dead_pushed));
    EXPECT_EQ(cp.experience->size(), n);
    auto r = z.trainer->train_step(0, 1000ms);
    ASSERT_TRUE(r);
}
