// Helpers of the rl tests: temporary directories (the control tests'), the small configuration,
// metrics files, step 0 on the embedded control plane.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../control/temp_dir.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/experience.hpp"
#include "moerl/rl/roles.hpp"

namespace moerl::rl::test {

using control::test::TempDir;

// A small, fast configuration: sort two digits in [0, 4].
inline RunConfig small_config(const std::filesystem::path& out) {
    RunConfig c = RunConfig::from_yaml_text(R"(
run: {name: test, seed: 7, steps: 6}
model: {hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 2, head_dim: 16, num_experts: 4, top_k: 2,
        moe_intermediate_size: 32}
task: {kind: sort, length: 2, max_value: 4}
rollout: {max_batch: 64}
train: {group_size: 4, prompts_per_step: 8, lr: 0.005}
ranks: {ep: 2}
)",
                                            "test.yaml");
    c.output_dir = out.string();
    return c;
}

// The rows of a metrics.jsonl (or an audit log), by default without the timing fields.
inline std::vector<nlohmann::json> read_metrics(const std::string& path, bool drop_timing = true) {
    std::vector<nlohmann::json> out;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
        auto j = nlohmann::json::parse(line);
        if (drop_timing) {
            for (const char* timing : {"tokens_per_s", "step_seconds", "rollout_s", "reward_s", "sync_s",
                                       "train_s", "publish_s", "decode_s"})
                j.erase(timing);
            // What the producer's call before the step did (a resumed run regenerates the steps
            // ahead that the stopped one had generated).
            for (const char* work : {"prompt_tokens", "prompt_tokens_shared", "rollout_released_bytes",
                                     "rollout_kept_bytes", "sync_bytes", "sync_path", "decode_bytes",
                                     "decode_steps", "rollout_peak_bytes", "train_peak_bytes"})
                j.erase(work);
        }
        out.push_back(j);
    }
    return out;
}

// One step's samples as the rollout workers would deliver them: sample g of prompt p answers with
// length(p, g) tokens token(p, g, j) of log-prob logprob(j), sampled by version 0, and gets reward(p, g).
template <class Length, class Token, class Logprob, class Reward>
std::vector<ExperienceRecord> synthetic_batch(const RunConfig& c, Length length, Token token, Logprob logprob,
                                              Reward reward) {
    std::vector<ExperienceRecord> batch;
    for (int p = 0; p < c.prompts_per_step; ++p) {
        for (int g = 0; g < c.group_size; ++g) {
            ExperienceRecord e;
            e.task_id = task_id(0, p, g);
            e.task = make_task_payload(c, 0, p, g);
            for (int j = 0; j < length(p, g); ++j) {
                e.trajectory.tokens.push_back(token(e, p, g, j));
                e.trajectory.logprobs.push_back(logprob(j));
                e.trajectory.versions.push_back(0);
            }
            e.reward = reward(p, g);
            batch.push_back(std::move(e));
        }
    }
    return batch;
}

// A run id no other test of this process uses.
inline std::string unique(const char* tag) {
    return std::string(tag) + "-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand());
}

// Step 0 on the embedded control plane: a started trainer and the step's tasks in the queue.
// `setup` may change the small configuration first (it gets the test's directory).
struct StepZero {
    TempDir t;
    RunConfig c;
    std::unique_ptr<ControlPlane> cp;
    std::unique_ptr<TrainerRole> trainer;
    size_t num_tasks = 0;

    StepZero(const char* tag, int64_t lease_timeout_ms = 0,
             const std::function<void(RunConfig&, const std::filesystem::path&)>& setup = {})
        : t(tag), c(small_config(t.path)) {
        if (lease_timeout_ms > 0) c.lease_timeout_ms = lease_timeout_ms;
        if (setup) setup(c, t.path);
        c.validate();
        cp = std::make_unique<ControlPlane>(ControlPlane::connect(c, unique(tag)));
        trainer = std::make_unique<TrainerRole>(c, *cp, (t.path / "trainer").string());
        EXPECT_EQ(trainer->start(false), 0);
        put_step_tasks(c, *cp->tasks, 0);
        num_tasks = static_cast<size_t>(c.prompts_per_step) * c.group_size;
    }
    std::string dir(const char* name) const { return (t.path / name).string(); }
};

}  // namespace moerl::rl::test
