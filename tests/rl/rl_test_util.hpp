// Helpers of the rl tests: temporary directories (the control tests'), the small configuration,
// metrics files.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../control/temp_dir.hpp"
#include "moerl/rl/config.hpp"

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
            for (const char* timing :
                 {"tokens_per_s", "step_seconds", "rollout_s", "reward_s", "sync_s", "train_s", "publish_s"})
                j.erase(timing);
        }
        out.push_back(j);
    }
    return out;
}

// A run id no other test of this process uses.
inline std::string unique(const char* tag) {
    return std::string(tag) + "-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand());
}

}  // namespace moerl::rl::test
