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

}  // namespace moerl::cli
