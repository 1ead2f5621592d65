// The trainer over processes (one EP rank each, gradients summed through c10d's Gloo) equals the
// trainer in one process: three updates' losses and gradient norms and the weights after them, over
// 2 and 4 processes, with the host (shared memory) and fabric (libfabric tcp) transports. A rank
// that dies fails the others with an error naming what they waited for.
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../control/temp_dir.hpp"
#include "moerl/model/safetensors.hpp"
#include "rank_launcher.hpp"

namespace {
namespace fs = std::filesystem;
using moerl::control::test::TempDir;
using moerl::rl::test::can_unshare;
using moerl::rl::test::Ranks;

// Runs W ranks of rl_trainer_rank (rank_launcher.hpp).
Ranks run_ranks(int W, const fs::path& out, const std::string& transport,
                const std::vector<std::string>& extra_env = {}, bool private_out = false) {
    return moerl::rl::test::run_ranks(MOERL_TRAINER_RANK, W, out, {out.string(), transport}, extra_env,
                                      private_out);
}

nlohmann::json read_stats(const fs::path& out) {
    std::ifstream in(out / "stats.json");
    EXPECT_TRUE(in.good()) << out;
    return in.good() ? nlohmann::json::parse(in) : nlohmann::json::array();
}

// Every weight of the checkpoint by name, whichever rank's file holds it (optimizer files aside).
std::map<std::string, std::vector<float>> read_weights(const fs::path& dir) {
    std::map<std::string, std::vector<float>> out;
    for (const auto& entry : fs::directory_iterator(dir)) {
        const std::string file = entry.path().filename().string();
        if (entry.path().extension() != ".safetensors" || file.rfind("model", 0) != 0) continue;
        moerl::model::SafetensorsFile f(entry.path().string());
        for (const auto& info : f.tensors()) {
            const float* p = reinterpret_cast<const float*>(f.data(info));
            EXPECT_EQ(out.count(info.name), 0u) << info.name << " in two files";
            out[info.name].assign(p, p + info.numel());
        }
    }
    return out;
}

void expect_same_training(const fs::path& one, const fs::path& many, const std::string& what,
                          double tolerance = 1e-5) {
    const auto a = read_stats(one), b = read_stats(many);
    ASSERT_EQ(a.size(), 4u);
    ASSERT_EQ(b.size(), 4u) << what;
    for (size_t s = 0; s < a.size(); ++s) {
        for (const char* key : {"loss", "grad_norm", "kl"}) {
            const double x = a[s][key].get<double>(), y = b[s][key].get<double>();
            EXPECT_NEAR(y, x, tolerance * std::abs(x) + 1e-7) << what << ", update " << s << ": " << key;
        }
        EXPECT_EQ(a[s]["num_tokens"], b[s]["num_tokens"]) << what;
        EXPECT_EQ(a[s]["total_tokens"], b[s]["total_tokens"]) << what;
    }
    EXPECT_NE(a[0]["loss"].get<double>(), a[2]["loss"].get<double>()) << "the updates changed nothing";
    const auto wa = read_weights(one / "weights"), wb = read_weights(many / "weights");
    ASSERT_EQ(wa.size(), wb.size()) << what;
    double diff = 0, scale = 0;
    size_t experts = 0;
    for (const auto& [name, x] : wa) {
        auto it = wb.find(name);
        ASSERT_NE(it, wb.end()) << what << ": " << name;
        ASSERT_EQ(x.size(), it->second.size()) << name;
        experts += name.find(".mlp.experts.") != std::string::npos;
        for (size_t i = 0; i < x.size(); ++i) {
            diff = std::max(diff, std::abs(static_cast<double>(x[i]) - it->second[i]));
            scale = std::max(scale, std::abs(static_cast<double>(x[i])));
        }
    }
    EXPECT_GT(experts, 0u);
    EXPECT_GT(scale, 0.0);
    EXPECT_LT(diff, tolerance * scale) << what;
}

}  // namespace

TEST(TrainerProcesses, EqualTrainingInOneProcess) {
    TempDir t("trainer-procs");
    const Ranks one = run_ranks(1, t.path / "one", "host");
    ASSERT_EQ(one.codes, std::vector<int>{0}) << one.log;
    struct Case {
        int W;
        const char* transport;
        const char* collectives;  // auto: Gloo where built; store: the rendezvous store (PyTorch's wheels)
    };
    for (const Case& c : {Case{2, "host", "auto"}, Case{4, "host", "auto"}, Case{2, "fabric/tcp", "auto"},
                          Case{2, "host", "store"}}) {
        const std::string what = std::to_string(c.W) + " processes, " + c.transport + ", " + c.collectives;
        const fs::path out =
            t.path / (std::to_string(c.W) + (c.transport[0] == 'h' ? "-host-" : "-fabric-") + c.collectives);
        const Ranks many =
            run_ranks(c.W, out, c.transport, {std::string("MOERL_TEST_COLLECTIVES=") + c.collectives});
        if (many.log.find("unknown EP transport 'fabric'") != std::string::npos) {
            std::cout << "skip " << what << ": this build has no fabric transport\n";
            continue;
        }
        ASSERT_EQ(many.codes, std::vector<int>(c.W, 0)) << what << "\n" << many.log;
        expect_same_training(t.path / "one", out, what);
    }
}

// One process, then two, with the same transport and environment: both succeed and train alike.
void expect_two_processes_equal_one(const char* tag, const std::string& transport,
                                    const std::vector<std::string>& env, const std::string& what,
                                    double tolerance) {
    TempDir t(tag);
    const Ranks one = run_ranks(1, t.path / "one", transport, env);
    ASSERT_EQ(one.codes, std::vector<int>{0}) << one.log;
    const Ranks two = run_ranks(2, t.path / "two", transport, env);
    ASSERT_EQ(two.codes, std::vector<int>(2, 0)) << two.log;
    expect_same_training(t.path / "one", t.path / "two", what, tolerance);
}

TEST(TrainerProcesses, PackedMicroBatchesOverProcessesEqualOneProcess) {
    expect_two_processes_equal_one("trainer-procs-packed", "host", {"MOERL_TEST_MICRO_TOKENS=12"},
                                   "2 processes, packed", 1e-5);
}

// Sums through the rendezvous store of more than its server takes in one value (8 MiB): the dense
// gradients travel in parts and sum exactly as Gloo sums them. (The wider model's fp32 reductions,
// split over two processes, part from one process's by ~1e-4.)
TEST(TrainerProcesses, StoreSumsLargerThanAStoreValueEqualGloo) {
    TempDir t("trainer-procs-wide");
    const std::vector<std::string> wide = {"MOERL_TEST_WIDE=1"};
    const Ranks one = run_ranks(1, t.path / "one", "host", wide);
    ASSERT_EQ(one.codes, std::vector<int>{0}) << one.log;
    const Ranks store =
        run_ranks(2, t.path / "store", "host", {"MOERL_TEST_WIDE=1", "MOERL_TEST_COLLECTIVES=store"});
    ASSERT_EQ(store.codes, std::vector<int>(2, 0)) << store.log;
    expect_same_training(t.path / "one", t.path / "store", "2 processes, store sums of ~9 MB", 5e-4);
    const Ranks gloo =
        run_ranks(2, t.path / "gloo", "host", {"MOERL_TEST_WIDE=1", "MOERL_TEST_COLLECTIVES=gloo"});
    if (gloo.log.find("Gloo") != std::string::npos && !gloo.codes.empty() && gloo.codes[0] != 0)
        GTEST_SKIP() << "this LibTorch has no Gloo: " << gloo.log;
    ASSERT_EQ(gloo.codes, std::vector<int>(2, 0)) << gloo.log;
    expect_same_training(t.path / "gloo", t.path / "store", "store sums against Gloo's", 1e-9);
}

// Ranks 1.. without rank 0's filesystem: their checkpoint shards reach rank 0 through the process
// group, and rank 0's checkpoint reaches them when they load it.
TEST(TrainerProcesses, RanksWithoutASharedFilesystemCheckpointAndResume) {
    if (!can_unshare()) GTEST_SKIP() << "no mount namespaces here (unshare --mount failed)";
    TempDir t("trainer-procs-private");
    const Ranks one = run_ranks(1, t.path / "one", "host");
    ASSERT_EQ(one.codes, std::vector<int>{0}) << one.log;
    for (const char* collectives : {"auto", "store"}) {
        const fs::path out = t.path / collectives;
        const Ranks two =
            run_ranks(2, out, "host", {std::string("MOERL_TEST_COLLECTIVES=") + collectives}, true);
        ASSERT_EQ(two.codes, std::vector<int>(2, 0)) << two.log;
        EXPECT_FALSE(fs::exists(out / "work1")) << "rank 1 wrote into rank 0's filesystem";
        EXPECT_TRUE(fs::exists(out / "weights" / "optimizer-rank1.safetensors"));
        expect_same_training(t.path / "one", out,
                             std::string("2 processes, no shared filesystem, ") + collectives);
    }
}

// On the GPU machine: two processes sharing one GPU, tokens over the cuda transport (CUDA IPC).
TEST(TrainerProcesses, TwoProcessesSharingOneGpuEqualOne) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    expect_two_processes_equal_one("trainer-procs-gpu", "cuda", {"MOERL_TEST_DEVICE=cuda"},
                                   "2 processes on one GPU", 1e-4);
}

// The same over cuda-fabric, the engine for EP between nodes (kernels queue the writes for libfabric;
// tcp stands in for EFA here): the trainer's experts trade tokens through it and train as one.
TEST(TrainerProcesses, TwoProcessesOverCudaFabricEqualOne) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    TempDir probe("trainer-procs-fabric-probe");
    const Ranks r = run_ranks(1, probe.path / "one", "cuda-fabric/tcp", {"MOERL_TEST_DEVICE=cuda"});
    if (r.log.find("unknown EP transport 'cuda-fabric'") != std::string::npos)
        GTEST_SKIP() << "this build has no fabric transport";
    expect_two_processes_equal_one("trainer-procs-gpu-fabric", "cuda-fabric/tcp", {"MOERL_TEST_DEVICE=cuda"},
                                   "2 processes on one GPU over cuda-fabric/tcp", 1e-4);
}

// NCCL needs a GPU a rank: with collectives 'nccl' two processes sharing one GPU are refused by
// name (auto, above, sums through the host instead). On a machine with a GPU a rank the same
// two processes sum over NCCL and train as one.
TEST(TrainerProcesses, NcclSumsNeedAGpuARank) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    if (at::getNumGPUs() >= 2) {
        expect_two_processes_equal_one("trainer-procs-nccl", "cuda",
                                       {"MOERL_TEST_DEVICE=cuda", "MOERL_TEST_COLLECTIVES=nccl"},
                                       "2 processes on 2 GPUs, sums over NCCL", 1e-4);
        return;
    }
    TempDir t("trainer-procs-nccl-shared");
    const Ranks r =
        run_ranks(2, t.path / "shared", "cuda",
                  {"MOERL_TEST_DEVICE=cuda", "MOERL_TEST_COLLECTIVES=nccl", "MOERL_TEST_TIMEOUT_S=20"});
    ASSERT_EQ(r.codes.size(), 2u);
    EXPECT_NE(r.codes[0], 0) << r.log;
    EXPECT_NE(r.log.find("share one GPU (NCCL needs a GPU a rank"), std::string::npos) << r.log;
}

TEST(TrainerProcesses, ADeadRankFailsTheOthersWithAClearError) {
    TempDir t("trainer-procs-dead");
    const Ranks r =
        run_ranks(2, t.path / "dead", "host", {"MOERL_TEST_DIE_RANK=1", "MOERL_TEST_TIMEOUT_S=5"});
    ASSERT_EQ(r.codes.size(), 2u);
    EXPECT_EQ(r.codes[1], 9) << r.log;
    EXPECT_EQ(r.codes[0], 1) << r.log;
    // Rank 0 names the phase and the rank that is gone: Gloo's broadcast fails at once, naming
    // the exited rank; over the store (no Gloo here) the EP exchange that follows times out
    // naming the rank it waited for.
    const bool gloo_said = r.log.find("trainer rank 0 of 2: sending rank 0's call") != std::string::npos &&
                           r.log.find("rank 1 (pid ") != std::string::npos &&
                           r.log.find("has exited") != std::string::npos;
    const bool ep_said = r.log.find("waiting for rank 1") != std::string::npos;
    EXPECT_TRUE(gloo_said || ep_said) << r.log;
    EXPECT_FALSE(fs::exists(t.path / "dead" / "stats.json"));
}
