// A rollout engine over processes (each rank holding its share of the experts and its own
// sequences, the MoE layers' tokens over the EP library) generates what one process holding every
// expert does: the same greedy tokens, log-probs and routing, over 2 and 4 processes, with a weight
// reload, resumed and preempted requests. A rank that dies leaves the engine unusable and says so.
// Weights reach rollout processes from trainer processes by CUDA IPC on a GPU, exactly, and as
// files where CUDA IPC is not to be had, saying why.
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "../control/temp_dir.hpp"
#include "moerl/model/model.hpp"
#include "moerl/rl/config.hpp"
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

// On the GPU machine: two and four processes sharing one GPU, tokens over the cuda transport (CUDA
// IPC), each decoding through the fused engine, its steps replayed from CUDA graphs (the
// low-latency dispatch and combine captured in them) and launched kernel by kernel.
TEST(RolloutProcesses, TwoAndFourProcessesSharingOneGpuEqualOne) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    TempDir t("rollout-procs-gpu");
    const Ranks one = run_ranks(1, t.path / "one", "cuda", {"MOERL_TEST_DEVICE=cuda"});
    ASSERT_EQ(one.codes, std::vector<int>{0}) << one.log;
    for (const bool graphs : {true, false}) {
        for (const int world : {2, 4}) {
            const std::string name = std::to_string(world) + (graphs ? "-graphs" : "-eager");
            const fs::path out = t.path / name;
            const Ranks r =
                run_ranks(world, out, "cuda",
                          {"MOERL_TEST_DEVICE=cuda", graphs ? "MOERL_TEST_GRAPHS=1" : "MOERL_TEST_GRAPHS=0"});
            ASSERT_EQ(r.codes, std::vector<int>(world, 0)) << name << "\n" << r.log;
            expect_same_generation(t.path / "one", out,
                                   std::to_string(world) + " processes on one GPU, " +
                                       (graphs ? "CUDA graphs" : "kernels launched one by one"),
                                   1e-3);
        }
    }
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

// Two processes sharing one GPU: a trainer exports its bf16 weights by CUDA IPC, a rollout model in
// the other process copies them (ipc_rank.cpp). Its weights equal the trainer's bit for bit and a
// model's loaded from the trainer's checkpoint, both decode alike, a second copy opens no handle
// again, and once the trainer has exited a copy names it.
TEST(RolloutProcesses, CudaIpcSyncFromATrainerProcessEqualsItsWeightsBitForBit) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    TempDir t("rollout-ipc");
    const Ranks r = moerl::rl::test::run_ranks(MOERL_IPC_RANK, 2, t.path, {t.path.string()});
    ASSERT_EQ(r.codes, std::vector<int>(2, 0)) << r.log;
    const nlohmann::json j = read_json(t.path / "results.json");
    EXPECT_EQ(j.at("bytes"), j.at("weight_bytes")) << j.dump();
    EXPECT_EQ(j.at("bytes_again"), j.at("weight_bytes"));
    EXPECT_GT(j.at("allocations").get<int>(), 0);
    EXPECT_EQ(j.at("open"), j.at("allocations")) << "each of the trainer's allocations opened once";
    EXPECT_GT(j.at("compared").get<int>(), 10);
    EXPECT_EQ(j.at("differ_from_trainer").get<int>(), 0);
    EXPECT_EQ(j.at("differ_from_checkpoint").get<int>(), 0);
    if (j.contains("decode_equal")) {
        EXPECT_TRUE(j.at("decode_equal").get<bool>());
    }
    const std::string dead = j.value("dead_error", "");
    EXPECT_NE(dead.find("trainer rank 0 (pid "), std::string::npos) << dead;
    EXPECT_NE(dead.find("has exited"), std::string::npos) << dead;
}

#if defined(MOERL_BIN)
namespace {
struct MoerlRun {
    int code = -1;
    std::string log;
    std::vector<nlohmann::json> rows;           // metrics.jsonl
    int64_t dense_bytes = 0, expert_bytes = 0;  // of the config's model in the rollout's dtype
};

// `moerl run` of the example with ranks {ep: 2, train: 2, rollout: 2}: 3 processes, trainer rank 0
// and rollout rank 0 in the first.
MoerlRun run_example_over_processes(const fs::path& dir, const std::string& example, int steps,
                                    const std::string& env = "") {
    std::ifstream in(std::string(MOERL_SOURCE_DIR) + "/examples/" + example);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string yaml = ss.str();
    yaml = yaml.substr(0, yaml.find("\nranks:")) + "\nranks:\n  ep: 2\n  train: 2\n  rollout: 2\n";
    const fs::path config = dir / "config.yaml", log = dir / "run.log", out = dir / "run";
    std::ofstream(config) << yaml;
    const std::string cmd = "env OPENBLAS_NUM_THREADS=1 " + env + " " + MOERL_BIN + " run " +
                            config.string() + " --steps " + std::to_string(steps) + " --out " + out.string() +
                            " --quiet >" + log.string() + " 2>&1";
    MoerlRun r;
    const int status = std::system(cmd.c_str());
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::stringstream text;
    text << std::ifstream(log).rdbuf();
    r.log = text.str();
    std::ifstream metrics(out / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) r.rows.push_back(nlohmann::json::parse(line));
    const moerl::rl::RunConfig c = moerl::rl::RunConfig::load(config.string());
    moerl::model::ModelOptions o;
    o.dtype = c.rollout_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
    const moerl::model::MoeModel m(c.model, o);
    for (const auto& w : m.named_parameters())
        (w.expert ? r.expert_bytes : r.dense_bytes) +=
            w.tensor.numel() * static_cast<int64_t>(w.tensor.element_size());
    return r;
}

size_t count(const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
}
}  // namespace

// The GPU quickstart with the trainer and the rollout engine over 2 processes each, on one GPU:
// every step's new weights go by CUDA IPC, each rollout rank copying the dense weights and its half
// of the experts.
TEST(RolloutProcesses, GpuQuickstartOverProcessesSyncsByCudaIpc) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    TempDir t("rollout-ipc-quickstart");
    const MoerlRun r = run_example_over_processes(t.path, "gpu-quickstart.yaml", 4);
    ASSERT_EQ(r.code, 0) << r.log;
    ASSERT_EQ(r.rows.size(), 4u) << r.log;
    for (const auto& row : r.rows) {
        EXPECT_EQ(row.at("sync_path"), "cuda-ipc") << row.dump();
        EXPECT_EQ(row.at("sync_bytes").get<int64_t>(), 2 * r.dense_bytes + r.expert_bytes) << row.dump();
    }
    EXPECT_EQ(count(r.log, "by CUDA IPC"), 1u) << r.log;
    EXPECT_EQ(count(r.log, "as files"), 0u) << r.log;
}

// Where the trainer's allocations cannot be exported (PyTorch's expandable segments are CUDA
// virtual memory, which legacy CUDA IPC does not take) the run goes on with files, saying why once.
TEST(RolloutProcesses, CudaIpcFailingFallsBackToFilesSayingWhy) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    TempDir t("rollout-ipc-fallback");
    const MoerlRun r = run_example_over_processes(
        t.path, "gpu-quickstart.yaml", 3,
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTORCH_ALLOC_CONF=expandable_segments:True");
    ASSERT_EQ(r.code, 0) << r.log;
    ASSERT_EQ(r.rows.size(), 3u) << r.log;
    for (const auto& row : r.rows) EXPECT_EQ(row.at("sync_path"), "file") << row.dump();
    EXPECT_EQ(
        count(r.log, "policies go between the processes as files from v0 on: the CUDA IPC export failed"), 1u)
        << r.log;
    EXPECT_NE(r.log.find("cudaIpcGetMemHandle"), std::string::npos) << r.log;
}

// CPU weights between processes: files, as before, and one line saying why not CUDA IPC.
TEST(RolloutProcesses, CpuWeightsGoBetweenTheProcessesAsFilesSayingWhy) {
    TempDir t("rollout-ipc-cpu");
    const MoerlRun r = run_example_over_processes(t.path, "quickstart.yaml", 2);
    ASSERT_EQ(r.code, 0) << r.log;
    ASSERT_EQ(r.rows.size(), 2u) << r.log;
    for (const auto& row : r.rows) {
        EXPECT_EQ(row.at("sync_path"), "file") << row.dump();
        EXPECT_EQ(row.at("sync_bytes").get<int64_t>(), 0) << row.dump();
    }
    EXPECT_EQ(count(r.log,
                    "policies go between the processes as files: CUDA IPC needs train.device and "
                    "rollout.device cuda (here cpu and cpu)"),
              1u)
        << r.log;
}
#endif
