// `moerl run --distributed`: the options it shares with `moerl cluster`, and the cluster it
// starts (both in cmd_worker.cpp).
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "moerl/rl/config.hpp"
#include "moerl/rl/trainer.hpp"

namespace moerl::cli {

struct DistributedRunArgs {
    bool enabled = false;
    std::string redis, store;
    int rollout_workers = 3;
};
void add_distributed_run_options(CLI::App* run, DistributedRunArgs& args);
void run_distributed(const std::string& config, const std::string& out, const DistributedRunArgs& args);

// This process's place among the processes of `role` ("train": config.train_ranks, "rollout":
// config.rollout_ranks), from torchrun's environment (WORLD_SIZE must equal that count); joins the
// rendezvous store (in cmd_run.cpp).
std::unique_ptr<rl::RoleProcesses> join_role_processes(const rl::RunConfig& cfg, const std::string& config,
                                                       const std::string& role);

// A local run whose trainer (ranks.train) or rollout engine (ranks.rollout) spans processes: this
// command re-runs itself (`argv`) as train + rollout - 1 processes under the local launcher
// (torchrun's environment). Rank 0 runs every role and leads both groups; ranks 1..train-1 follow
// the trainer, the rest the rollout engine. In cmd_run.cpp.
struct LocalRanks {
    int exit_code = -1;  // >= 0: this process launched or followed and is done, with this status
    std::unique_ptr<rl::RoleProcesses> trainer, rollout;  // rank 0's place in each group, or none
};
LocalRanks launch_or_join_local_ranks(const rl::RunConfig& cfg, const std::string& config,
                                      const std::vector<std::string>& argv);

}  // namespace moerl::cli
