// `moerl run --distributed`: the options it shares with `moerl cluster`, and the cluster it
// starts (both in cmd_worker.cpp).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace moerl::cli {

struct DistributedRunArgs {
    bool enabled = false;
    std::string redis, store;
    int rollout_workers = 3;
};
void add_distributed_run_options(CLI::App* run, DistributedRunArgs& args);
void run_distributed(const std::string& config, const std::string& out, const DistributedRunArgs& args);

}  // namespace moerl::cli
