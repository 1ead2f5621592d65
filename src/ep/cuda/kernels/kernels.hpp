// Internal: argument structs and host launchers of the EP kernels shared by the cuda and nccl engines.
//
// Symmetric region of the cuda engine (one per rank, CUDA IPC-mapped by every peer):
//   [flags: u64 data[kNumDeviceChannels][W], u64 ready[kNumDeviceChannels][W]] then, per channel, W receive
//   slots (slot s is written only by source rank s). data[ch][s] counts the sender blocks of rank s
//   that finished writing this rank's slot; ready[ch][d] counts the calls for which rank d finished
//   reading the slot this rank writes there. Both are monotonic, so a slot is reused without resets:
//   call e (1-based per channel) waits ready >= e-1 before writing and data >= e * send_blocks
//   before reading. The nccl engine runs the same kernels with signalling disabled (peers == null).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moerl::ep::cuda {

constexpr int kMaxRanks = 64;          // rank masks are 64-bit
constexpr int kMaxExperts = 8192;      // per-expert counters live in shared memory (32 KB)
constexpr int kMaxExpertSlots = 4096;  // W * local experts for the low-latency receive tables
constexpr int kDataThreads = 512;      // threads per block of the data kernels (16 warps)
constexpr int kLayoutThreads = 1024;   // the single-block low-latency layout kernel: one thread per entry
constexpr int kLayoutTile = 256;       // tokens per block of the normal layout kernel (one per thread)

enum Channel : int { kChCount = 0, kChDispatch, kChCombine, kChLLDispatch, kChLLCombine, kNumDeviceChannels };

// Device error state; the host reads it after a synchronisation.
struct DeviceError {
    int code;   // 0, or kErrTimeout: sticky, the buffer must be destroyed
    int phase;  // channel * 2 + (1 when waiting for a free slot, 0 when waiting for data)
    int peer;
    int pad0;
    unsigned long long observed;
    unsigned long long target;
    int bad_input;  // 1 once an expert id was out of range (cleared by the host after reporting)
    int bad_token;
    int bad_k;
    int pad1;
    long long bad_value;
};
constexpr int kErrTimeout = 1;

struct Signals {
    uint8_t* const* peers = nullptr;  // [W] symmetric base per rank (device array); nullptr: no signalling
    unsigned long long* epoch = nullptr;  // local [kNumDeviceChannels]: completed calls per channel
    unsigned int* done =
        nullptr;  // local [kNumDeviceChannels]: finished blocks of the running receive kernel
    DeviceError* error = nullptr;
    // Host-mapped pinned copy of *error, or null. Device code that changes the error word writes it
    // too, so the host reads errors without a copy on the stream.
    DeviceError* error_mirror = nullptr;
    size_t flags_offset = 0;  // offset of the flags in the symmetric region
    int rank = 0;
    int world = 1;
    unsigned long long timeout_ns = 0;
};

// Field offsets inside one dispatched row: data | scales | K int32 ids | K fp32 weights | int32 token.
struct RowLayout {
    int data_bytes;
    int scales_off;
    int ids_off;
    int weights_off;
    int token_off;
    int row_bytes;  // 16-byte aligned stride
};

struct Routing {
    int world;
    int num_experts;
    int num_local_experts;
    int top_k;
    int hidden;
    int dtype;  // 0 fp32, 1 bf16 (moerl::ep::DType values)
    bool fp8;   // dispatch rows carry e4m3 + fp32 scales per 128 columns
};

// --- normal mode ---------------------------------------------------------------------------------
// Scratch of the multi-block layout kernel, kept across calls. The counters are zero between calls
// (the last block of each call resets them); tile_state words carry the call's seq, so they need no reset.
struct LayoutScratch {
    unsigned long long* tile_state;  // [ceil(max_tokens / kLayoutTile), W]: seq << 32 | kind << 30 | count
    int* expert_total;               // [W*L] entries per expert, summed over tiles
    int* rank_total;                 // [W] rows per rank, summed over tiles
    unsigned int* counters;          // [2]: tile tickets taken, tiles finished
};

// A grid of ceil(T / kLayoutTile) blocks (at least one); the last block to finish writes the summaries
// and runs the notify phase.
struct LayoutArgs {
    Routing rt;
    const int64_t* topk_idx;  // [T, K]
    int num_tokens;
    LayoutScratch scratch;
    unsigned int seq;   // nonzero, different from the previous call's (tags tile_state)
    int* send_pos;      // out [T, W]: row of token t in the list sent to rank r, or -1
    int* send_summary;  // out [W, 1+L]: rows for rank r, then entries per local expert of r (may be
                        // host-mapped)
    // world_size 1 without signalling: recv_summary = send_summary and recv_src_offset = {0, rows}.
    bool self_only;
    // Notify (only with signalling): summaries land in every peer's count slot.
    size_t count_offset;  // offset of the count channel's receive slots in the symmetric region
    size_t count_slot_bytes;
    int* recv_summary;     // out [W, 1+L]: what each source sends here (may be host-mapped)
    int* recv_src_offset;  // out [W+1]
    Signals sig;
};
void launch_layout(const LayoutArgs& a, cudaStream_t stream);

struct DispatchSendArgs {
    Routing rt;
    RowLayout row;
    const void* x;              // [T, H]
    const int64_t* topk_idx;    // [T, K] or null (ids sent as -1)
    const float* topk_weights;  // [T, K] or null (weights sent as 0)
    const int* send_pos;        // [T, W]
    int num_tokens;
    uint8_t* const* dst;  // [W] device array: where this rank's rows for rank r start
    Signals sig;
    // Self rows (when self_recv_x is set): row p for this rank goes straight to output row
    // recv_src_offset[rank] + p, no slot and no second copy; DispatchRecvArgs.skip_self must be set.
    int rank;
    const int* recv_src_offset;  // [W+1]
    void* self_recv_x;
    float* self_recv_x_scales;
    int64_t* self_recv_topk_idx;
    float* self_recv_topk_weights;
    int* self_recv_src_token;
    int self_max_rows;
};
void launch_dispatch_send(const DispatchSendArgs& a, int blocks, cudaStream_t stream);

struct DispatchRecvArgs {
    Routing rt;
    RowLayout row;
    int rank;
    const uint8_t* src;  // rows from source s start at src + s * src_stride
    size_t src_stride;
    const int* recv_src_offset;  // [W+1]
    void* recv_x;                // [R, H] (fp8: bytes)
    float* recv_x_scales;        // [R, H/128] or null
    int64_t* recv_topk_idx;      // [R, K] or null
    float* recv_topk_weights;    // [R, K] or null
    int* recv_src_token;         // [R]
    int max_rows;                // rows of the outputs; rows past it are consumed but not stored
    int send_blocks;             // data signals per source per call
    Signals sig;
    bool skip_self;  // the send kernel wrote this rank's own rows into the outputs already
};
void launch_dispatch_recv(const DispatchRecvArgs& a, int blocks, cudaStream_t stream);

struct CombineSendArgs {
    Routing rt;
    const void* y;               // [R, H]
    const int* recv_src_offset;  // [W+1]
    uint8_t* const* dst;         // [W] where the rows for source s start
    size_t row_stride;           // bytes between rows at dst
    Signals sig;
    bool skip_self;  // rows of this rank stay in y; CombineRecvArgs.self_y reads them there
    int rank;
};
void launch_combine_send(const CombineSendArgs& a, int blocks, cudaStream_t stream);

struct CombineRecvArgs {
    Routing rt;
    const uint8_t* src;  // rows from rank s start at src + s * src_stride
    size_t src_stride;
    size_t row_stride;
    const int* send_pos;  // [T, W]
    int num_tokens;
    void* out;  // [T, H]
    int send_blocks;
    Signals sig;
    const void* self_y;          // y [R, H] when this rank's rows are read there (not from the slot), or null
    const int* recv_src_offset;  // [W+1], with self_y
    int rank;                    // with self_y
};
void launch_combine_recv(const CombineRecvArgs& a, int blocks, cudaStream_t stream);

// Normal dispatch of one rank in one kernel (a permute): counts, rows and the copy, no layout kernel
// and no signals. A grid of `tiles` blocks; tile j holds tokens [j * T / tiles, (j+1) * T / tiles)
// (sizes differ by at most one, so every block has work). Token t gets row = number of earlier tokens that
// name a valid expert (prefix over the tiles' counts in scratch.tile_state, or counted again from topk_idx
// where a count is late), or none. The last block to add its counts to the totals writes the summaries, then
// counts_ready = seq.
struct SoloDispatchArgs {
    Routing rt;
    RowLayout row;
    const void* x;              // [T, H]
    const int64_t* topk_idx;    // [T, K]
    const float* topk_weights;  // [T, K] or null (weights sent as 0)
    int num_tokens;
    int tiles;  // in [1, max(T, 1)]
    // tile_state [>= tiles], expert_total [L], rank_total [1], counters [2] (arrivals in [1])
    LayoutScratch scratch;
    unsigned int seq;      // nonzero, different from the previous call's (tags tile_state)
    int* send_pos;         // out [T]: row of token t, or -1
    int* recv_src_offset;  // out [2]: {0, R}
    int* recv_src_token;   // out [R]: token of each row
    int* host_send_pos;    // host-mapped copies of send_pos [T] and recv_src_token [R], or null
    int* host_recv_src_token;
    int* summary;                // out [2, 1+L] (host-mapped): {R, entries per expert}, sent then received
    unsigned int* counts_ready;  // host-mapped: seq once summary and the error mirror are final
    void* recv_x;                // [R, H] (fp8: bytes)
    float* recv_x_scales;        // [R, H/128] or null
    int64_t* recv_topk_idx;      // [R, K] or null
    float* recv_topk_weights;    // [R, K] or null
    int max_rows;                // rows of the outputs; rows past it are not stored
    DeviceError* error;
    DeviceError* error_mirror;  // host-mapped copy of *error, or null
};
void launch_solo_dispatch(const SoloDispatchArgs& a, cudaStream_t stream);

// Normal combine of one rank: out[t] = y[send_pos[t]], or zeros where send_pos[t] = -1. A grid of
// `tiles` blocks, split as in dispatch. No scratch, no signals.
struct SoloCombineArgs {
    Routing rt;
    const void* y;        // [R, H]
    const int* send_pos;  // [T]
    int num_tokens;
    int tiles;  // in [1, max(T, 1)]
    void* out;  // [T, H]
};
void launch_solo_combine(const SoloCombineArgs& a, cudaStream_t stream);

// --- the layout a caller asks for before dispatching (DeepEP's get_dispatch_layout) ----------------
constexpr int kTopkLayoutThreads = 256;  // one thread per token
constexpr int kTopkLayoutNoBadEntry = 0x7f7f7f7f;
struct TopkLayoutArgs {
    const int64_t* topk_idx;  // [T, K]; expert e lives on rank e / ceil(E / W)
    int num_tokens, top_k, num_experts, world;
    int* counts;    // out [W + E + 1]: tokens per rank, entries per expert, then the first entry t * K + k
                    // whose id is out of range (kTopkLayoutNoBadEntry: none)
    bool* in_rank;  // out [T, W]
};
// Clears the counts, then counts: two memsets and one kernel on `stream`.
void launch_topk_layout(const TopkLayoutArgs& a, cudaStream_t stream);

// --- low-latency mode -----------------------------------------------------------------------------
struct LLLayoutArgs {
    Routing rt;
    const int64_t* topk_idx;  // [T, K]
    int num_tokens;
    int* topk32;         // out [T, K]: validated ids (-1 for none or out of range)
    int* pos_in_expert;  // out [T, K]: row of entry (t, k) among its expert's (a repeat: its first's)
    int* expert_count;   // out [W*L]
    int* expert_offset;  // out [W*L]: first row of expert e in the rows sent to its rank
    int* send_rows;      // out [W]: rows sent to each rank
    DeviceError* error;
    DeviceError* error_mirror;  // host-mapped copy of *error, or null
};
void launch_ll_layout(const LLLayoutArgs& a, cudaStream_t stream);

// A low-latency slot: int32 counts[L] padded to header_bytes, then rows ordered by (expert, token).
struct LLSendArgs {
    Routing rt;
    RowLayout row;
    const void* x;
    int num_tokens;
    const int* topk32;
    const int* pos_in_expert;
    const int* expert_count;
    const int* expert_offset;
    uint8_t* const* dst;  // [W] slot of this rank at rank r
    size_t header_bytes;
    Signals sig;
};
void launch_ll_send(const LLSendArgs& a, int blocks, cudaStream_t stream);

struct LLRecvArgs {
    Routing rt;
    RowLayout row;
    const uint8_t* src;
    size_t src_stride;
    size_t header_bytes;
    int rows_per_expert;
    void* recv_x;          // [L * rows_per_expert, H]
    float* recv_x_scales;  // or null
    int* out_recv_count;   // [L] or null (user copy)
    int* recv_count;       // [L] state
    int* recv_range;       // [L, W, 2] state: first row, count
    int* slot_base;        // [L, W] state: first row of (expert, source) in the source's slot
    int* recv_src_token;   // [L * rows_per_expert] state
    int send_blocks;
    Signals sig;
};
void launch_ll_recv(const LLRecvArgs& a, int blocks, cudaStream_t stream);

struct LLCombineSendArgs {
    Routing rt;
    const void* y;  // [L * rows_per_expert, H]
    int rows_per_expert;
    const int* recv_count;
    const int* recv_range;
    const int* slot_base;
    uint8_t* const* dst;  // [W] slot of this rank at rank s (rows only, no header)
    size_t row_stride;
    Signals sig;
};
void launch_ll_combine_send(const LLCombineSendArgs& a, int blocks, cudaStream_t stream);

struct LLCombineRecvArgs {
    Routing rt;
    const uint8_t* src;  // rows from rank s at src + s * src_stride, in the order they were sent
    size_t src_stride;
    size_t row_stride;
    const int* topk32;
    const float* topk_weights;  // [T, K] or null (weight 1)
    const int* pos_in_expert;
    const int* expert_offset;
    int num_tokens;
    void* out;
    int send_blocks;
    Signals sig;
};
void launch_ll_combine_recv(const LLCombineRecvArgs& a, int blocks, cudaStream_t stream);

}  // namespace moerl::ep::cuda
