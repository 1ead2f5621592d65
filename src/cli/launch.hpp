// Local launcher and rendezvous: torchrun's environment, c10d's TCPStore.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "moerl/ep/store.hpp"

namespace moerl::cli {

struct RankEnv {
    int rank = 0;
    int world_size = 1;
    int local_rank = 0;
    int local_world_size = 1;
    std::string master_addr = "127.0.0.1";
    int master_port = 29500;
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (defaults: one rank).
RankEnv rank_env_from_environment();

// A bootstrap store on c10d's TCPStore at MASTER_ADDR:MASTER_PORT. Under `moerl launch` (or torchrun's
// agent) the launcher hosts the server; otherwise rank 0 does, as with init_process_group("env://").
std::unique_ptr<ep::Store> make_tcp_store(const RankEnv& env, double timeout_s);
// The same store as c10d sees it (what c10d's process groups take).
c10::intrusive_ptr<c10d::Store> connect_rank_store(const RankEnv& env, double timeout_s);
// This program's path (/proc/self/exe): what a command re-runs as its own ranks.
std::string self_executable();
// Hosts a TCPStore server on a free port of 127.0.0.1 (or `port` when non-zero); returns its port.
std::shared_ptr<void> host_tcp_store(int& port, int world_size);

// A client of the TCPStore that host_tcp_store serves on 127.0.0.1:port.
c10::intrusive_ptr<c10d::TCPStore> connect_local_store(int port, int world_size,
                                                       std::chrono::seconds timeout);

// Runs fn(rank, port) in `world_size` forked processes around a TCPStore this process hosts on a free
// port, and returns each rank's result ({"error": "..."} for a rank that threw or died). This
// process must not have initialised CUDA: a forked child could not use it.
std::vector<nlohmann::json> run_forked_ranks(int world_size,
                                             const std::function<nlohmann::json(int rank, int port)>& fn);

// Runs `argv` as `num_ranks` local ranks with torchrun's environment. If one rank fails, the others
// are stopped (SIGTERM, then SIGKILL after grace_s) and its exit status is returned.
int launch_local(int num_ranks, const std::vector<std::string>& argv, int master_port, double grace_s);

}  // namespace moerl::cli
