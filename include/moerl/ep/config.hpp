// The EP group's configuration: validated in one place, with buffer-size hints.
#pragma once

#include <cstddef>
#include <string>

#include "moerl/ep/dtype.hpp"

namespace moerl::ep {

struct Config {
    int world_size = 1;              // ranks in the EP group, 1..1024
    int rank = 0;                    // this rank, 0..world_size-1
    int num_experts = 0;             // E, >= world_size; experts are split contiguously, ceil(E/W) per rank
    int hidden = 0;                  // H, columns of x; a multiple of 128 when fp8_dispatch is set
    int top_k = 0;                   // K, 1..32
    int max_tokens_per_rank = 0;     // T upper bound per call, >= 1; sizes every receive region
    DType dtype = DType::kBFloat16;  // element type of x and y: fp32 or bf16
    bool fp8_dispatch = false;       // dispatch sends e4m3 with one fp32 scale per 128 columns (x is bf16)
    bool low_latency = true;         // reserve the low-latency regions (max_tokens x top_k rows per peer)
    double timeout_s = 60.0;         // longest wait on any peer before failing, > 0
    int num_sms = 64;                // SMs for the cuda kernels (knee of the H200 sweep, bench/RESULTS.md)
    std::string transport = "host";  // host | fabric | cuda | nccl
    std::string fabric_provider = "tcp";  // libfabric provider for the fabric transport
    std::string job_id = "moerl";         // namespaces shared resources (shm names, store keys)

    // Throws moerl::Error naming the first field that is out of range.
    void validate() const;
    // Sets transport (and fabric_provider) from "host", "cuda", "fabric/tcp", "fabric/efa", ...
    void set_transport(const std::string& spec);

    // Experts owned by each rank: ceil(num_experts / world_size); the last rank may own fewer.
    int num_local_experts() const { return (num_experts + world_size - 1) / world_size; }
    int expert_owner(int expert) const { return expert / num_local_experts(); }
    int first_local_expert(int r) const { return r * num_local_experts(); }
    // Most rows a rank can receive in one normal-mode dispatch.
    int max_recv_tokens() const { return world_size * max_tokens_per_rank; }
    // Rows of the expert-major low-latency receive tensor per local expert.
    int low_latency_rows_per_expert() const { return world_size * max_tokens_per_rank; }

    size_t element_bytes() const { return dtype_size(dtype); }
    size_t dispatch_row_bytes()
        const;                         // bytes of one dispatched row (data, scales, ids, weights, source idx)
    size_t combine_row_bytes() const;  // bytes of one combined row
    // Symmetric memory each rank registers for normal mode and for low-latency mode.
    size_t normal_bytes_hint() const;
    size_t low_latency_bytes_hint() const;
};

}  // namespace moerl::ep
