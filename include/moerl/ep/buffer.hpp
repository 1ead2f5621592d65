// Expert-parallel dispatch and combine (docs/architecture.md, "The contract").
//
// A Buffer owns one rank's registered symmetric memory for a group of ranks. Its operations are
// collective: every rank of the group calls the same sequence of them. Pointers are host memory
// for the host and fabric transports and device memory for the cuda and nccl transports
// (Buffer::on_device() tells which).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moerl/ep/config.hpp"
#include "moerl/ep/store.hpp"

namespace moerl::ep {

// A row-major matrix view: rows x cols elements of the type the call documents.
template <typename T>
struct View {
    T* data = nullptr;
    int64_t rows = 0;
    int64_t cols = 0;
};

struct Layout {
    std::vector<int> num_tokens_per_rank;    // [W] tokens that go to each rank
    std::vector<int> num_tokens_per_expert;  // [E] top-k entries that name each expert
    std::vector<uint8_t> is_token_in_rank;   // [T, W]
};

// Where each dispatched row came from, so combine can send it back. Reusable for a second
// dispatch with the same routing (the count exchange is skipped).
struct Handle {
    int num_tokens = 0;                           // T on this rank when the handle was made
    std::vector<int> num_recv_per_src;            // [W] rows received from each source rank
    std::vector<int> recv_src_offset;             // [W+1] first received row of each source
    std::vector<int> num_send_per_rank;           // [W] rows this rank sent to each rank
    std::vector<int> send_pos;                    // [T, W] row of token t in the list sent to r, or -1
    std::vector<int> recv_src_token;              // [R] token index at the source of each row
    std::vector<int> num_recv_tokens_per_expert;  // [local experts]
    std::shared_ptr<void> device_state;           // engine-owned copy on the device, if any
    int num_recv_tokens() const { return recv_src_offset.empty() ? 0 : recv_src_offset.back(); }
};

struct DispatchOutput {
    View<void> recv_x;              // [>= max_recv_tokens, H], dtype (fp8_dispatch: e4m3 bytes)
    View<float> recv_x_scales;      // [>= max_recv_tokens, H/128], fp8_dispatch only
    View<int64_t> recv_topk_idx;    // [>= max_recv_tokens, K] local expert ids or -1; optional
    View<float> recv_topk_weights;  // [>= max_recv_tokens, K]; optional
};

struct LowLatencyHandle {
    int num_tokens = 0;
    std::vector<int> recv_count;      // [L] rows per local expert
    std::vector<int> recv_range;      // [L, W, 2] (first row, count) per local expert and source
    std::vector<int> recv_src_token;  // [L, W*maxT] source token of each row, -1 past the count
    std::vector<int64_t> topk_idx;    // [T, K] the routing this rank dispatched (for combine)
    std::shared_ptr<void> device_state;
};

struct LowLatencyOutput {
    View<void> recv_x;          // [L * W*maxT, H] expert-major (row l*W*maxT + i)
    View<float> recv_x_scales;  // [L * W*maxT, H/128], fp8_dispatch only
    int* recv_count = nullptr;  // [L] optional copy of the per-expert counts
};

class Engine;

class Buffer {
  public:
    // Collective: every rank of config.world_size constructs its Buffer with the same config
    // (but its own rank). store is needed when world_size > 1.
    Buffer(const Config& config, Store* store);
    ~Buffer();
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;

    const Config& config() const { return config_; }
    bool on_device() const;
    std::string transport_name() const;

    // Counts and membership per rank and expert; validates every id. Host memory always.
    Layout layout(View<const int64_t> topk_idx) const;

    // Normal mode. x [T, H] of config.dtype, topk_idx [T, K], topk_weights [T, K] (optional).
    // Returns the handle; received rows are ordered by source rank, then by source token.
    Handle dispatch(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                    const DispatchOutput& out, const Handle* reuse = nullptr);
    // y [R, H] of config.dtype; out [T, H] = sum over ranks of the rows sent back (fp32 accumulate).
    void combine(View<const void> y, const Handle& handle, View<void> out);

    // Low-latency mode: fixed buffers, no count exchange; expert-major output. A token goes once to each
    // expert it names, so an expert receives at most W*maxT rows; an id repeated in a token's top-k
    // shares that row, and combine adds it once per entry with the entry's weight.
    LowLatencyHandle low_latency_dispatch(View<const void> x, View<const int64_t> topk_idx,
                                          const LowLatencyOutput& out);
    // y [L * W*maxT, H] expert outputs; out [T, H] = sum_k weight[t,k] * y[row of (t,k)].
    void low_latency_combine(View<const void> y, View<const int64_t> topk_idx, View<const float> topk_weights,
                             const LowLatencyHandle& handle, View<void> out);

    // Collective teardown; the destructor calls it if needed.
    void destroy();

  private:
    Config config_;
    std::unique_ptr<Engine> engine_;
};

// Device transports (cuda, nccl): the calling thread's calls enqueue on `stream` (a cudaStream_t;
// nullptr = the legacy default stream) while the scope lasts, e.g. the stream a CUDA graph is
// captured on. Without CUDA in the build it does nothing.
class DeviceStreamScope {
  public:
    explicit DeviceStreamScope(void* stream);
    ~DeviceStreamScope();
    DeviceStreamScope(const DeviceStreamScope&) = delete;
    DeviceStreamScope& operator=(const DeviceStreamScope&) = delete;

  private:
    void* previous_ = nullptr;
};

// The layout of topk_idx under config (world_size, num_experts, top_k, max_tokens_per_rank), without a
// Buffer: what Buffer::layout returns. Host memory; validates every id.
Layout compute_layout(const Config& config, View<const int64_t> topk_idx);

// Reference checks shared by every engine; throw moerl::Error naming the bad value.
void check_topk(const Config& config, View<const int64_t> topk_idx);
void check_rows(const Config& config, const char* what, int64_t rows, int64_t cols, int64_t max_rows,
                int64_t expect_cols);

}  // namespace moerl::ep
