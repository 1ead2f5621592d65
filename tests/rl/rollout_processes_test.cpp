// A rollout engine over processes (each rank holding its share of the experts and its own
// sequences, the MoE layers' tokens over the EP library) generates what one process holding every
// expert does: the same greedy tokens, log-probs and routing, over 2 and 4 processes, with a weight
// reload, resumed and preempted requests. A rank that dies leaves the engine unusable and says so.
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../control/temp_dir.hpp"
#include "rank_launcher.hpp"

namespace {
namespace fs = std::filesystem;
using moerl::control::test::TempDir;
using moerl::rl::test::Ranks;

Ranks run_ranks(int W, const fs::path& out, const std::string& transport,
                const std::vector<std::string>& extra_env = {}) {
    return moerl::rl::test::run_ranks(MOERL_ROLLOUT_RANK, W, out, {out.string(), transport}, extra_env);
}

nlohmann::json read_json(const fs::path& file) {
    std::ifstream in(file);
    EXPECT_TRUE(in.good()) << file;
    return in.good() ? nlohmann::json::parse(in) : nlohmann::json::object();
}

void expect_same_generation(const fs::path& one, const fs::path& many, const std::string& what,
                            double tolerance) {
    const nlohmann::json a = read_json(one / "results.json"), b = read_json(many / "results.json");
    ASSERT_TRUE(a.contains("results") && b.contains("results")) << what;
    EXPECT_EQ(a["capacity"], b["capacity"]) << what;
    EXPECT_EQ(a["tokens"], b["tokens"]) << what;
    EXPECT_GT(a["tokens"].get<int>(), 40);
    const auto& ra = a["results"];
    const auto& rb = b["results"];
    // 7 requests, then 3 preempted ones under new ids (a preempted request that had finished
    // before the drain keeps its id).
    ASSERT_GE(ra.size(), 10u);
    ASSERT_EQ(ra.size(), rb.size()) << what;
    int reloaded = 0;
    for (const auto& [id, x] : ra.items()) {
        ASSERT_TRUE(rb.contains(id)) << what << ": request " << id;
        const auto& y = rb[id];
        EXPECT_EQ(x["tokens"], y["tokens"]) << what << ": request " << id;
        EXPECT_EQ(x["versions"], y["versions"]) << what << ": request " << id;
        EXPECT_EQ(x["routing"], y["routing"]) << what << ": request " << id;
        EXPECT_EQ(x["terminated"], y["terminated"]) << what << ": request " << id;
        ASSERT_EQ(x["logprobs"].size(), y["logprobs"].size());
        for (size_t i = 0; i < x["logprobs"].size(); ++i)
            EXPECT_NEAR(x["logprobs"][i].get<double>(), y["logprobs"][i].get<double>(), tolerance)
                << what << ": request " << id << ", token " << i;
        for (const auto& v : x["versions"]) reloaded += v.get<int>() == 1;
        EXPECT_FALSE(x["routing"].empty());
    }
    EXPECT_GT(reloaded, 0) << "no token came from the reloaded weights";
}

}  // namespace

TEST(RolloutProcesses, SameGreedyGenerationAsOneProcess) {
    TempDir t("rollout-procs");
    const Ranks one = run_ranks(1, t.path / "one", "host");
    ASSERT_EQ(one.codes, std::vector<int>{0}) << one.log;
    struct Case {
        int W;
        const char* transport;
    };
    for (const Case& c : {Case{2, "host"}, Case{4, "host"}, Case{2, "fabric/tcp"}}) {
        const std::string what = std::to_string(c.W) + " processes, " + c.transport;
        const fs::path out = t.path / (std::to_string(c.W) + (c.transport[0] == 'h' ? "-host" : "-fabric"));
        const Ranks many = run_ranks(c.W, out, c.transport);
        if (many.log.find("unknown EP transport 'fabric'") != std::string::npos) {
            std::cout << "skip " << what << ": this build has no fabric transport\n";
            continue;
        }
        ASSERT_EQ(many.codes, std::vector<int>(c.W, 0)) << what << "\n" << many.log;
        expect_same_generation(t.path / "one", out, what, 1e-4);
    }
}

// On the GPU machine: two processes sharing one GPU, tokens over the cuda transport (CUDA IPC).
TEST(RolloutProcesses, TwoProcessesSharingOneGpuEqualOne) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    TempDir t("rollout-procs-gpu");
    const Ranks one = run_ranks(1, t.path / "one", "cuda", {"MOERL_TEST_DEVICE=cuda"});
    ASSERT_EQ(one.codes, std::vector<int>{0}) << one.log;
    const Ranks two = run_ranks(2, t.path / "two", "cuda", {"MOERL_TEST_DEVICE=cuda"});
    ASSERT_EQ(two.codes, std::vector<int>(2, 0)) << two.log;
    expect_same_generation(t.path / "one", t.path / "two", "2 processes on one GPU", 1e-3);
}

TEST(RolloutProcesses, ADeadRankLeavesTheEngineUnusableAndSaysWhy) {
    TempDir t("rollout-procs-dead");
    // Over Gloo (where built) and over the rendezvous store (PyTorch's wheels): both name the rank.
    for (const char* collectives : {"auto", "store"}) {
        const fs::path out = t.path / collectives;
        const Ranks r = run_ranks(2, out, "host",
                                  {"MOERL_TEST_DIE=1", std::string("MOERL_TEST_COLLECTIVES=") + collectives});
        ASSERT_EQ(r.codes.size(), 2u);
        EXPECT_EQ(r.codes[1], 9) << r.log;
        EXPECT_EQ(r.codes[0], 0) << r.log;
        const nlohmann::json f = read_json(out / "failure.json");
        const std::string refresh = f.value("refresh_error", "");
        EXPECT_NE(refresh.find("rollout rank 0 of 2"), std::string::npos) << collectives << ": " << refresh;
        EXPECT_NE(refresh.find("rank 1 (pid "), std::string::npos) << collectives << ": " << refresh;
        EXPECT_NE(refresh.find("has exited"), std::string::npos) << collectives << ": " << refresh;
        EXPECT_EQ(f.value("healthy", true), false);
        EXPECT_NE(f.value("step_error", "").find("cannot go on after"), std::string::npos) << f.dump();
        EXPECT_EQ(f.value("drained", -1), 1) << "only the request never handed out comes back";
    }
}
