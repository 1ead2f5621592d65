// One role spread over processes, one expert-parallel rank each (torchrun's environment): the
// trainer (PolicyTrainer) and a rollout engine (RolloutEngine). This process is `rank` of
// `world_size`, meeting the others through `store` (c10d's TCPStore). Rank 0 is the object its
// caller sees; the others carry out its calls (follow()). What every rank computed is combined
// through c10d's Gloo (or the store), the experts' tokens move through the EP library over
// `ep_transport`.
#pragma once

#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace moerl::rl {

struct RoleProcesses {
    int rank = 0;
    int world_size = 1;
    int local_rank = 0;  // on this machine: picks the GPU (local_rank modulo the GPUs here)
    c10::intrusive_ptr<c10d::Store> store;
    std::string ep_transport = "host";  // host | fabric/<provider> | cuda
    double timeout_s = 300;             // a rank that does not answer for this long fails the others
    // Where rank 0's store is: a loopback address keeps Gloo on loopback too (GLOO_SOCKET_IFNAME
    // names the interface otherwise).
    std::string master_addr = "127.0.0.1";
    // How the sums travel: auto (CUDA tensors through NCCL where the build has it and every rank
    // has a GPU of its own; the rest through Gloo where LibTorch has its headers, else the store),
    // nccl (as auto, but ranks sharing a GPU are an error), gloo, or store (through the rendezvous
    // store: every rank posts its part; for tests and small models).
    std::string collectives = "auto";
};

}  // namespace moerl::rl
