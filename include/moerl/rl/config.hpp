// The run configuration of `moerl run CONFIG.yaml`: every field with its default and limits,
// parsed strictly (unknown keys, wrong types and impossible sizes name the key).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moerl/model/config.hpp"
#include "moerl/rl/env.hpp"
#include "moerl/rl/grpo.hpp"

namespace moerl::rl {

struct SamplingParams {
    double temperature = 1.0;            // > 0
    double top_p = 1.0;                  // (0, 1]
    int top_k = 0;                       // 0 = off, else >= 1
    int max_new_tokens = 0;              // 0 = the task's longest answer + 1
    std::vector<int> stop_tokens = {2};  // eos
};

struct RunConfig {
    std::string source = "config";  // file name used in error messages
    // run
    std::string name = "run";
    uint64_t seed = 1;
    int64_t steps = 100;  // training steps (policy versions 1..steps), >= 1
    std::string output_dir = "runs/run";
    int64_t checkpoint_every = 0;  // 0 = only at the end
    int keep_checkpoints = 2;      // >= 1
    double stop_at_reward = 0;     // > 0: stop once the mean reward of the last 10 steps reaches it
    int threads = 1;               // LibTorch intra-op threads per rank
    // model: built from these unless model_path names an HF checkpoint to start from
    model::ModelConfig model;
    std::string model_path;
    // task
    TaskSpec task;
    // rollout
    SamplingParams sampling;
    int rollout_max_batch = 64;  // sequences decoded together, >= 1
    bool record_routing = true;
    // Where the rollout worker's model lives: cpu, or cuda (the first GPU, where sequences decode
    // through model::Generator, the fused CUDA engine, routing records included), in fp32 or bf16.
    std::string rollout_device = "cpu";
    std::string rollout_dtype = "fp32";
    int rollout_max_seq_len = 1024;  // prompt + response a sequence may hold on cuda (its KV cache)
    // train
    int group_size = 8;        // G, >= 2
    int prompts_per_step = 8;  // >= 1
    double lr = 1e-3;          // peak learning rate
    // Learning-rate schedule over the training steps: linear warmup from 0 over lr_warmup_steps,
    // then constant, or a cosine decay to lr_min_ratio x lr at run.steps.
    std::string lr_schedule = "constant";  // constant | cosine
    int64_t lr_warmup_steps = 0;           // >= 0
    double lr_min_ratio = 0.0;             // cosine floor, in [0, 1]
    double weight_decay = 0.0;
    double beta1 = 0.9, beta2 = 0.99, adam_eps = 1e-8;
    double grad_clip = 1.0;  // 0 = off
    int ppo_epochs = 1;      // updates per batch, >= 1
    int max_staleness = 0;   // policy versions a sample may lag, >= 0 (0 = on-policy)
    bool routing_replay = false;
    GrpoParams grpo;
    // Where the trainer runs: cpu, or cuda (the first GPU; ranks.ep must be 1 there, one rank per GPU).
    std::string train_device = "cpu";
    // fp32, or bf16: forward and backward in bf16 with fp32 master weights and AdamW moments.
    std::string train_dtype = "fp32";
    // Tokens (prompt + response) a micro-batch may hold, > 0: a rank packs its samples into rows of
    // at most this many tokens (several samples per row, no padding), runs forward and backward per
    // row and steps the optimizer once (gradient accumulation). 0 (default): one padded batch.
    int64_t micro_batch_tokens = 0;
    // reward
    double verifier_weight = 1.0;
    std::string reward_model_path;  // HF checkpoint + scalar head, optional
    double reward_model_weight = 0.0;
    // reward_model_weight is > 0 exactly when reward_model_path is set. The reward model's
    // settings (reward_worker.hpp). label: the row of score.weight that is the
    // reward (-1: the head must have one row); batch_size: sequences per forward, >= 1 (larger
    // batches use the device better, smaller ones pass experiences on sooner).
    int reward_label = -1;
    int reward_batch_size = 16;
    std::string reward_device = "cpu";  // cpu | cuda (the first GPU)
    std::string reward_dtype = "fp32";  // fp32 | bf16
    // ranks
    int ep_ranks = 2;  // training EP group size (threads, host transport), divides num_experts
    // control plane
    std::string queue = "embedded";
    std::string buffer = "embedded";
    std::string registry = "embedded";
    std::string store;  // default: file://<output_dir>/checkpoints
    int64_t lease_timeout_ms = 30000;

    // Parse YAML text; `source` names the file in errors ("quickstart.yaml: train.group_size: ...").
    static RunConfig from_yaml_text(const std::string& text, const std::string& source);
    static RunConfig load(const std::string& path);
    // Cross-field checks (sizes that cannot work together); throws naming the key.
    void validate() const;
    int max_new_tokens() const;
    // The learning rate of training step `step` (0-based) under the schedule.
    double lr_at(int64_t step) const;
    std::string store_uri() const;
};

}  // namespace moerl::rl
