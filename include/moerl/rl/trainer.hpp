// The GRPO policy trainer: W expert-parallel ranks, each holding the dense weights and 1/W of the
// experts, as threads of this process (host EP transport) or as W processes (RoleProcesses). Dense
// gradients are summed across ranks, expert gradients stay local (they already hold every rank's tokens
// through the combine's backward). AdamW with decoupled weight decay and global-norm gradient clipping. On
// the CPU or one GPU (train.device), in fp32 or in bf16 with fp32 master weights (train.dtype), the batch in
// packed micro-batches of a token budget with gradient accumulation (train.micro_batch_tokens).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moerl/model/model.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/experience.hpp"
#include "moerl/rl/role_processes.hpp"

namespace moerl::rl {

struct TrainStats {
    double loss = 0;
    double aux_loss = 0;
    double clip_fraction = 0;
    double mean_ratio = 0;
    double mean_is_weight = 0;
    double truncated_fraction = 0;
    double kl = 0;
    double grad_norm = 0;        // before clipping
    double lr = 0;               // learning rate of the update
    int64_t num_tokens = 0;      // response tokens
    int64_t total_tokens = 0;    // prompt + response tokens through forward and backward
    double attention_pairs = 0;  // causal query-key pairs: L (L + 1) / 2 summed over the sequences
    // Training-inference mismatch over response tokens, on the trainer's weights at the start of
    // the update (the sampling weights when on-policy): mean |behaviour - trainer| log-prob and the
    // standard deviation of the ratio exp(trainer - behaviour).
    double logprob_diff = 0;
    double behaviour_ratio_std = 0;
};

// One trainer rank's weights forward runs on, as its model holds them: dense weights and expert
// stacks whose rows are experts first_expert, first_expert + 1, ...
struct TrainerRankWeights {
    int first_expert = 0;
    std::vector<model::NamedParameter> weights;
};

class PolicyTrainer {
  public:
    // Random initialisation from config.seed (or config.model_path). work_dir holds the EP
    // bootstrap files. With `processes`, this process is one rank of them (config.ep_ranks must be
    // their number); the trainer's calls are made on rank 0 only.
    PolicyTrainer(const RunConfig& config, const std::string& work_dir,
                  const RoleProcesses* processes = nullptr);
    ~PolicyTrainer();

    // One GRPO update (ppo_epochs passes) on `batch` with per-sample advantages.
    TrainStats update(const std::vector<ExperienceRecord>& batch, const std::vector<double>& advantages);

    // HF layout, fp32 (exact), every rank's experts.
    void save_weights(const std::string& dir) const;
    // The weights forward runs on (train.dtype, train.device), HF names, every rank's experts;
    // they change in place with each update. What in-process weight sync copies from.
    std::vector<std::pair<std::string, at::Tensor>> weights() const;
    // The same weights by rank, experts as stacks: what in-process weight sync copies from (a few
    // copies a layer rather than three an expert).
    std::vector<TrainerRankWeights> rank_weights() const;
    // CUDA IPC handles on the weights forward runs on (those weights() returns), every rank's: one
    // description per process (JSON, src/rl/cuda_ipc.hpp's IpcProcess), taken after each process's
    // device work finished. Empty, with `why_not` naming the rank and the reason, where a rank cannot
    // export them (weights on the CPU, a build without CUDA, cudaIpcGetMemHandle failing); a rank
    // that is gone makes it throw, naming it.
    std::vector<std::string> export_weights_ipc(std::string& why_not);
    // How often the weights forward runs on were changed in place (updates, loads): a reader of
    // exported weights compares it before and after its copy.
    int64_t weight_writes() const;
    // optimizer-rank{r}.safetensors (AdamW moments) and optimizer.json (step count).
    void save_optimizer(const std::string& dir) const;
    // Restores weights and (when present) optimizer state written by the two above.
    void load(const std::string& dir);

    // Ranks 1.. of processes: carries out rank 0's updates, saves and loads until rank 0's trainer
    // is destroyed (then returns) or a rank fails (then throws).
    void follow();

    int64_t optimizer_steps() const;
    int num_ranks() const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace moerl::rl
