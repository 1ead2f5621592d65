// The records that travel through the control plane, serialized as JSON: the task payload, a
// (possibly partial) trajectory and the experience record (docs/architecture.md, "One RL step").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moerl/rl/env.hpp"

namespace moerl::rl {

struct TaskPayload {
    int64_t step = 0;    // training step whose batch this sample belongs to
    int prompt_idx = 0;  // prompt within the step; a GRPO group is (step, prompt_idx)
    int sample_idx = 0;  // 0..G-1 within the group
    uint64_t seed = 0;   // sampling seed of this sample
    Problem problem;
    std::vector<int> prompt_tokens;  // bos + prompt
};

// Response tokens generated so far, with what the trainer needs about each.
struct Trajectory {
    std::vector<int> tokens;        // response tokens (eos included when terminated)
    std::vector<float> logprobs;    // behaviour log-prob of each response token
    std::vector<int64_t> versions;  // policy version that sampled each token
    // Routing record [prompt + response tokens, num_moe_layers, top_k] (experts each position used
    // when generating, -1 = unknown); empty when not recorded.
    std::vector<int16_t> routing;
    int num_moe_layers = 0;
    int top_k = 0;
    bool terminated = false;  // ended with a stop token (not by the length limit)
    uint64_t rng_draws = 0;   // sampler draws so far, so a resumed sample continues the same stream
};

struct ExperienceRecord {
    std::string task_id;
    int attempt = 0;
    TaskPayload task;
    Trajectory trajectory;
    double reward = 0.0;
    // The task's verifier called the response correct (metrics' `exact`), whatever a reward model
    // or the verifier's weight make of the reward. Records without it: reward >= 1.
    bool correct = false;
    int64_t oldest_version() const;
};

std::string to_json(const TaskPayload& p);
std::string to_json(const Trajectory& t);
std::string to_json(const ExperienceRecord& e);
// Throw moerl::Error naming what is missing or malformed.
TaskPayload task_payload_from_json(const std::string& text);
Trajectory trajectory_from_json(const std::string& text);
ExperienceRecord experience_from_json(const std::string& text);

// "s{step}-p{prompt}-g{sample}"
std::string task_id(int64_t step, int prompt_idx, int sample_idx);

}  // namespace moerl::rl
