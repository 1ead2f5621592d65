// Internal: host-side pieces shared by the cuda and nccl engines: RAII device and pinned memory,
// row layouts, device selection, and the device state behind Handle / LowLatencyHandle.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "check.hpp"
#include "kernels/kernels.hpp"
#include "moerl/ep/buffer.hpp"

namespace moerl::ep::cuda {

inline size_t align16(size_t n) { return (n + 15) & ~size_t{15}; }
inline size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }

// cudaMalloc'd bytes, zeroed; freed with the owner.
class DeviceMemory {
  public:
    DeviceMemory() = default;
    explicit DeviceMemory(size_t bytes) : bytes_(bytes) {
        MOERL_CUDA_CHECK(cudaMalloc(&ptr_, bytes == 0 ? 16 : bytes));
        MOERL_CUDA_CHECK(cudaMemset(ptr_, 0, bytes == 0 ? 16 : bytes));
    }
    ~DeviceMemory() {
        if (ptr_ != nullptr) cudaFree(ptr_);
    }
    DeviceMemory(DeviceMemory&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
    DeviceMemory& operator=(DeviceMemory&& o) noexcept {
        std::swap(ptr_, o.ptr_);
        std::swap(bytes_, o.bytes_);
        return *this;
    }
    template <typename T = void>
    T* get() const {
        return static_cast<T*>(ptr_);
    }
    size_t bytes() const { return bytes_; }

  private:
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
};

// Page-locked host memory for device-to-host copies of counts and the error word.
class PinnedMemory {
  public:
    PinnedMemory() = default;
    // flags: cudaHostAlloc's (cudaHostAllocMapped for memory the device writes through a pointer).
    explicit PinnedMemory(size_t bytes, unsigned int flags = cudaHostAllocDefault) {
        MOERL_CUDA_CHECK(cudaHostAlloc(&ptr_, bytes == 0 ? 16 : bytes, flags));
        std::memset(ptr_, 0, bytes == 0 ? 16 : bytes);
    }
    ~PinnedMemory() {
        if (ptr_ != nullptr) cudaFreeHost(ptr_);
    }
    PinnedMemory(PinnedMemory&& o) noexcept : ptr_(o.ptr_) { o.ptr_ = nullptr; }
    PinnedMemory& operator=(PinnedMemory&& o) noexcept {
        std::swap(ptr_, o.ptr_);
        return *this;
    }
    template <typename T = void>
    T* get() const {
        return static_cast<T*>(ptr_);
    }

  private:
    void* ptr_ = nullptr;
};

inline RowLayout make_row_layout(const Config& c) {
    RowLayout r{};
    r.data_bytes = static_cast<int>(c.fp8_dispatch ? c.hidden : c.hidden * c.element_bytes());
    r.scales_off = r.data_bytes;
    r.ids_off = r.scales_off + (c.fp8_dispatch ? (c.hidden / kFp8BlockCols) * 4 : 0);
    r.weights_off = r.ids_off + c.top_k * 4;
    r.token_off = r.weights_off + c.top_k * 4;
    r.row_bytes = static_cast<int>(c.dispatch_row_bytes());
    return r;
}

inline Routing make_routing(const Config& c) {
    Routing r{};
    r.world = c.world_size;
    r.num_experts = c.num_experts;
    r.num_local_experts = c.num_local_experts();
    r.top_k = c.top_k;
    r.hidden = c.hidden;
    r.dtype = c.dtype == DType::kFloat32 ? 0 : 1;
    r.fp8 = c.fp8_dispatch;
    return r;
}

// Sizes of the host-mapped memory the device writes, all from the config: the summaries [2, W, 1+L]
// (what each rank sends, then what it receives) and, with one rank, the dispatch kernel's ready word,
// send_pos [max_tokens_per_rank] and recv_src_token [max_tokens_per_rank] (each 16-byte aligned).
struct HostMappedSizes {
    size_t summary_ints = 0;     // one of the two halves: W * (1 + L)
    size_t solo_tokens = 0;      // entries of the one-rank send_pos and recv_src_token copies
    size_t solo_offset[4] = {};  // ready word, send_pos, recv_src_token, total bytes
    explicit HostMappedSizes(const Config& c) {
        summary_ints = static_cast<size_t>(c.world_size) * (1 + c.num_local_experts());
        solo_tokens = static_cast<size_t>(c.max_tokens_per_rank);
        const size_t sizes[3] = {sizeof(unsigned int), solo_tokens * sizeof(int), solo_tokens * sizeof(int)};
        for (int j = 0; j < 3; ++j) solo_offset[j + 1] = solo_offset[j] + align16(sizes[j]);
    }
    size_t summary_bytes() const { return 2 * summary_ints * sizeof(int); }
};

// Limits of the device kernels; throws naming the field.
void check_device_limits(const Config& c, const char* engine);

// The device this rank uses: Config.device, else MOERL_EP_DEVICE, else LOCAL_RANK, else the rank, modulo
// the device count.
int select_device(const Config& c, const char* engine);

// Device state of a normal-mode Handle (owned by the handle; freed stream-ordered).
struct NormalState {
    const void* owner = nullptr;  // the engine that made it
    cudaStream_t stream = nullptr;
    int* send_pos = nullptr;         // [T, W]
    int* recv_src_offset = nullptr;  // [W+1]
    int* recv_src_token = nullptr;   // [W * max_tokens_per_rank]
    // pool: where the block comes from (null: the device's default pool).
    NormalState(const void* owner, cudaStream_t stream, int num_tokens, int world, int max_recv,
                cudaMemPool_t pool = nullptr);
    ~NormalState();
    NormalState(const NormalState&) = delete;
    NormalState& operator=(const NormalState&) = delete;

  private:
    void* block_ = nullptr;
};

// NormalStates of one engine, each sized for max_tokens_per_rank. A released handle gives its state
// back for the next fresh dispatch on the same stream, so that a dispatch neither allocates nor frees:
// stream order covers the reuse, as it covers cudaFreeAsync and cudaMallocFromPoolAsync on one stream.
// Thread-safe (handles may be released on any thread).
class NormalStateCache : public std::enable_shared_from_this<NormalStateCache> {
  public:
    NormalStateCache(const void* owner, int max_tokens, int world, int max_recv, cudaMemPool_t pool)
        : owner_(owner), max_tokens_(max_tokens), world_(world), max_recv_(max_recv), pool_(pool) {}
    // A state for a dispatch on `stream`: one given back on that stream, or a new one.
    std::shared_ptr<NormalState> take(cudaStream_t stream);
    // Frees the states given back; states released later are freed at once.
    void close();

  private:
    static constexpr size_t kMaxKept = 64;
    void give_back(NormalState* s);

    const void* owner_;
    int max_tokens_, world_, max_recv_;
    cudaMemPool_t pool_;
    std::mutex mu_;
    std::vector<std::unique_ptr<NormalState>> kept_;  // GUARDED_BY(mu_)
    bool closed_ = false;                             // GUARDED_BY(mu_)
};

// The arguments of the normal dispatch kernels as both engines fill them: rows of x sent by the layout
// in st to dst[r] (send), rows from src + s * src_stride into out (receive, at most max_rows). The
// cuda engine adds its self-row and skip fields.
DispatchSendArgs dispatch_send_args(const Routing& rt, const RowLayout& row, const void* x,
                                    const int64_t* topk_idx, const float* topk_weights, int num_tokens,
                                    const NormalState& st, uint8_t* const* dst, const Signals& sig);
DispatchRecvArgs dispatch_recv_args(const Routing& rt, const RowLayout& row, int rank, const uint8_t* src,
                                    size_t src_stride, const NormalState& st, const DispatchOutput& out,
                                    int max_rows, int send_blocks, const Signals& sig);

// Looks up the NormalState of a handle made by `owner`; throws when it is not one.
NormalState& normal_state(const Handle& h, const void* owner, const char* what);

// The handle's counts from the layout summaries: `sent` and `got` [W, 1 + L] (per rank: rows, then
// rows per local expert), as the layout kernel writes them.
void fill_handle_counts(const int* sent, const int* got, int W, int L, int num_tokens, Handle& h);

// The scratch of the normal layout kernel (and of the one-rank dispatch kernel) and the seq of its
// calls (one layout at a time: every caller synchronises with the host, or waits for the counts, before
// the next dispatch).
class LayoutState {
  public:
    // min_tiles: tile_state words the one-rank dispatch kernel needs (one per block).
    explicit LayoutState(const Config& c, int min_tiles = 1);
    // Sets a.scratch and a.seq for a new call on `stream`.
    void next(LayoutArgs& a, cudaStream_t stream) { a.seq = next(a.scratch, stream); }
    // The scratch and the seq of a new call on `stream`.
    unsigned int next(LayoutScratch& scratch, cudaStream_t stream);

  private:
    DeviceMemory memory_;
    LayoutScratch scratch_{};
    size_t tile_state_bytes_ = 0;
    unsigned int seq_ = 0;
};

// Routing state of the last low-latency dispatch, in engine-owned fixed buffers so a captured graph
// replays with the same pointers. A LowLatencyHandle is valid until the next low_latency_dispatch.
struct LowLatencyState {
    DeviceMemory memory;
    int* topk32 = nullptr;          // [maxT, K]
    int* pos_in_expert = nullptr;   // [maxT, K]
    int* expert_count = nullptr;    // [W*L]
    int* expert_offset = nullptr;   // [W*L]
    int* send_rows = nullptr;       // [W]
    int* recv_count = nullptr;      // [L]
    int* recv_range = nullptr;      // [L, W, 2]
    int* slot_base = nullptr;       // [L, W]
    int* recv_src_token = nullptr;  // [L, W*maxT]
    explicit LowLatencyState(const Config& c);
};

// Where an engine's low-latency rows go and come from (device pointers; the cuda engine's peers' slots,
// the nccl engine's packing buffers).
struct LowLatencySlots {
    uint8_t* const* dispatch_dst = nullptr;  // [W] device array: this rank's dispatch slot at rank r
    const uint8_t* dispatch_src = nullptr;  // dispatch rows from rank s at dispatch_src + s * dispatch_stride
    size_t dispatch_stride = 0;
    size_t header_bytes = 0;                // a dispatch slot starts with int32 counts [L], padded to this
    uint8_t* const* combine_dst = nullptr;  // [W] device array: this rank's combine slot at rank s
    const uint8_t* combine_src = nullptr;   // combined rows from rank s at combine_src + s * combine_stride
    size_t combine_stride = 0;
    size_t combine_row_bytes = 0;  // bytes between rows in a combine slot
};

// The four kernels of a low-latency dispatch and combine over a LowLatencyState and an engine's slots,
// with their arguments filled in one place for both engines.
class LowLatencyKernels {
  public:
    LowLatencyKernels(const Config& c, const LowLatencyState& state, const LowLatencySlots& slots,
                      const Signals& sig, int blocks)
        : rt_(make_routing(c)),
          row_(make_row_layout(c)),
          rows_per_expert_(c.low_latency_rows_per_expert()),
          state_(state),
          slots_(slots),
          sig_(sig),
          blocks_(blocks) {}
    // The layout kernel, then the send kernel (rows into the dispatch slots).
    void dispatch_send(const void* x, const int64_t* topk_idx, int num_tokens, cudaStream_t stream) const;
    // The receive kernel: rows from the dispatch slots into out, expert-major.
    void dispatch_recv(const LowLatencyOutput& out, cudaStream_t stream) const;
    // Rows of y [L * rows_per_expert, H] back into the combine slots of their sources.
    void combine_send(const void* y, cudaStream_t stream) const;
    // out[t] = the top-k weighted sum of token t's rows from the combine slots.
    void combine_recv(const float* topk_weights, int num_tokens, void* out, cudaStream_t stream) const;

  private:
    Routing rt_;
    RowLayout row_;
    int rows_per_expert_;
    const LowLatencyState& state_;
    LowLatencySlots slots_;
    Signals sig_;
    int blocks_;
};

// Fills the host vectors of a handle from the device state (one synchronisation by the caller).
void copy_low_latency_handle(const Config& c, const LowLatencyState& s, const int64_t* topk_idx,
                             int num_tokens, LowLatencyHandle& h, cudaStream_t stream);

// Turns a fatal device error (a timeout) into TimeoutError naming phase and peer. Bad input is not
// fatal: the caller reports it with bad_input_message() after finishing the collective call.
void throw_if_error(const DeviceError& e, const Config& c, const char* engine);
bool has_bad_input(const DeviceError& e);
std::string bad_input_message(const DeviceError& e, const Config& c);

}  // namespace moerl::ep::cuda
