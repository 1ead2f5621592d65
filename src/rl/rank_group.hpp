// How the ranks of one role (the trainer, a rollout engine) combine what each computed. Threads of
// one process meet in shared slots; processes (torchrun's environment) meet through c10d's Gloo
// process group (or the rendezvous store), which also carries rank 0's calls to the others; sums of
// CUDA tensors go through NCCL where every rank has a GPU of its own.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "moerl/rl/role_processes.hpp"

namespace moerl::rl::detail {

class RankGroup {
  public:
    virtual ~RankGroup() = default;
    // Sums `t` (fp32 or fp64, any device) over every rank, in place. `local` is the calling
    // thread's rank within this process (0 for processes).
    virtual void sum(int local, at::Tensor& t) = 0;
    // Returns when every rank has called it.
    virtual void barrier(int local) = 0;
    // Rank 0's `bytes` on every rank (processes only).
    virtual void broadcast(std::string& bytes) = 0;
    // Every rank's `mine`, by rank, on rank 0 (empty elsewhere; processes only).
    virtual std::vector<std::string> gather(const std::string& mine) = 0;

    // Rank 0's calls (processes only). A call is announced by a store key, which the others wait
    // for without a time limit (rank 0 may be waiting for work), then its bytes are broadcast:
    // the time limit applies from there on.
    virtual void send_call(std::string bytes) = 0;
    virtual std::string receive_call() = 0;
};

// `world_size` threads of this process.
std::unique_ptr<RankGroup> make_thread_group(int world_size);

// This process among `p.world_size` (Gloo over the store; the address to bind is 127.0.0.1 when
// MASTER_ADDR is a loopback address, GLOO_SOCKET_IFNAME's interface when set, else the hostname's).
// `role` ("trainer", "rollout") names the group's keys in the store and the ranks in errors.
std::unique_ptr<RankGroup> make_process_group(const RoleProcesses& p, const std::string& role);

}  // namespace moerl::rl::detail
