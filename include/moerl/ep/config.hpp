// The EP group's configuration: validated in one place (validate()), with buffer-size hints.
//
// The shape fields (world_size .. max_tokens_per_rank, dtype, fp8_dispatch) describe the model and the
// group and have no useful default. The rest are settings: most callers leave them alone; each says
// when a change is worth it.
#pragma once

#include <cstddef>
#include <string>

#include "moerl/ep/dtype.hpp"

namespace moerl::ep {

struct Config {
    // --- the group and the tensors --------------------------------------------------------------
    int world_size = 1;              // ranks in the EP group, 1..1024
    int rank = 0;                    // this rank, 0..world_size-1
    int num_experts = 0;             // E, >= world_size; experts are split contiguously, ceil(E/W) per rank
    int hidden = 0;                  // H, columns of x; a multiple of 128 when fp8_dispatch is set
    int top_k = 0;                   // K, 1..32
    int max_tokens_per_rank = 0;     // T upper bound per call, >= 1; sizes every receive region
    DType dtype = DType::kBFloat16;  // element type of x and y: fp32 or bf16
    bool fp8_dispatch = false;       // dispatch sends e4m3 with one fp32 scale per 128 columns (x is bf16)

    // --- settings ---------------------------------------------------------------------------------
    // Which transport moves the rows: host | fabric | cuda | nccl (set_transport also takes
    // "fabric/PROVIDER"). Default "host".
    std::string transport = "host";

    // Reserve the low-latency regions (max_tokens_per_rank x top_k rows per peer). Default on. Turn it
    // off to save that memory when only the normal dispatch/combine is called.
    bool low_latency = true;

    // Longest wait on any peer before a call fails with TimeoutError, seconds, > 0. Default 60. Raise it
    // when ranks legitimately stall (a debugger, a slow first CUDA context); lower it in tests.
    double timeout_s = 60.0;

    // Namespaces the shared resources of one group (shm names, store keys), non-empty. Default "moerl".
    // Give every group that shares a machine or a store its own.
    std::string job_id = "moerl";

    // cuda and nccl transports: SMs (thread blocks) each kernel uses, 1..1024, capped at the device's SM
    // count (ranks sharing one GPU split it). Default 64, the knee of the two-GPU sweep in
    // bench/RESULTS.md ("EP between two H200s"). More SMs buy a little bandwidth and take them from
    // the compute that overlaps with EP; one rank alone on a GPU may take all of them.
    int num_sms = 64;

    // cuda and nccl transports: the CUDA device of this rank, -1..1023. Default -1: the environment
    // variable MOERL_EP_DEVICE, else LOCAL_RANK, else the rank; always modulo the visible devices. Set
    // it when the launcher does not set LOCAL_RANK or to put several ranks on one GPU.
    int device = -1;

    // cuda transport: calls return without synchronising at their end. Default off: every call ends
    // with a stream synchronisation, reports device errors at once and fills every host vector of the
    // handle. With it on, a dispatch waits only until the counts are known, the handle's host vectors
    // other than the counts (send_pos, recv_src_token) stay empty, and a device error surfaces at the
    // next call. Turn it on where the caller synchronises itself and reads only the counts (benchmarks,
    // a decode loop). Calls captured in a CUDA graph never synchronise, whatever this says.
    bool async = false;

    // fabric transport: the libfabric provider ("tcp", "shm", "efa", "verbs", ...). Default "tcp".
    std::string fabric_provider = "tcp";
    // fabric transport: the domain (NIC) to open, by libfabric's name ("rdmap0s6-rdm"), passed to
    // fi_getinfo as a hint (some providers, tcp among them, ignore it). Default empty: the provider's
    // first. Set it on a machine with several NICs to pin each rank to its own.
    std::string fabric_domain;
    // fabric transport: the largest single RMA write, bytes, >= 8 (a signal's write); a longer message
    // is split into chunks of this size, none above the provider's max_msg_size. Default 8 MiB. Leave it;
    // tests shrink it to exercise multi-chunk messages with small buffers.
    size_t fabric_chunk_bytes = size_t{8} << 20;

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
