// Internal: the cuda engine. Each rank's symmetric region is cudaMalloc'd and mapped by every peer of
// the node through CUDA IPC; kernels write rows straight into the peers' receive slots (NVLink between
// GPUs, plain stores when ranks share one) and signal with release/acquire flags (kernels/kernels.hpp).
// cuda_engine.cpp holds the engine and its multi-rank calls, one_rank.cpp the one-rank fast path.
//
// Streams and synchronisation. Work goes on cuda::current_stream() (stream.hpp; default: the legacy
// stream 0). Normal dispatch without a reused handle queues the layout kernel (which writes the counts
// straight into pinned host memory), an event and the data kernels, then waits for that event only,
// since the caller must learn R; the data kernels need nothing from the host. By default every call
// also synchronises at its end, fills the host vectors of the handle and reports device errors at
// once; Config.async drops those end-of-call synchronisations and every device-to-host copy not needed
// to learn the counts (host vectors other than the counts then stay empty, send_pos too; errors
// surface at the next call). Device code that records an error also writes a host-mapped mirror of the
// error word, so no call copies it on the stream.
//
// Work per call with Config.async (W = 1 with aligned outputs / y in brackets): dispatch 3 kernels and
// one event wait [1 kernel and a spin on a word it writes to mapped memory once the counts are known,
// before its copy ends: no event, no driver call while the spin is short], 2 [1] with a reused handle;
// combine 2 kernels [1]; low-latency dispatch 3 kernels, combine 2. No memcpy or memset on the stream
// outside error paths, and no allocation: the device state of a released handle serves the next
// dispatch on its stream (NormalStateCache). With one rank and aligned outputs nothing crosses a slot:
// a fresh dispatch is one kernel (counts, rows and the permute; it also writes the handle's host
// vectors into mapped memory when the call synchronises), a dispatch with a reused handle is the send
// kernel without signals, and combine is one gather kernel (kernels/solo.cu).
//
// Rows a rank sends to itself skip its slot: normal dispatch writes them straight into the outputs and
// normal combine reads them straight from y, so the one-rank case is a single permute pass. While the
// stream is being captured nothing synchronises, so these pairs can be captured in a CUDA graph (host
// vectors empty, device state used):
//   - low_latency_dispatch + low_latency_combine (fixed shapes, counts travel with the data);
//   - dispatch(..., &reused_handle) + combine: the static layout of an earlier eager dispatch.
// A LowLatencyHandle is valid until the next low_latency_dispatch (its state lives in fixed buffers).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine.hpp"
#include "engine_common.hpp"

namespace moerl::ep::cuda {

// Byte offsets in the symmetric region: flags, then per channel W receive slots.
struct SymmetricLayout {
    size_t flags_bytes = 0;
    size_t slot_bytes[kNumDeviceChannels] = {};
    size_t recv_base[kNumDeviceChannels] = {};
    size_t ll_header_bytes = 0;
    size_t total = 0;
    explicit SymmetricLayout(const Config& c);
};

class CudaEngine final : public Engine {
  public:
    CudaEngine(const Config& config, Store* store);
    ~CudaEngine() override;

    std::string name() const override { return "cuda"; }
    bool on_device() const override { return true; }
    void destroy() override;
    Handle dispatch(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                    const DispatchOutput& out, const Handle* reuse) override;
    void combine(View<const void> y, const Handle& h, View<void> out) override;
    LowLatencyHandle low_latency_dispatch(View<const void> x, View<const int64_t> topk_idx,
                                          const LowLatencyOutput& out) override;
    void low_latency_combine(View<const void> y, View<const int64_t> topk_idx, View<const float> topk_weights,
                             const LowLatencyHandle& h, View<void> out) override;

  private:
    // --- one rank (one_rank.cpp) ---
    // One rank, a fresh layout, recv_x 16-byte aligned: one kernel counts, finds the rows and permutes.
    Handle dispatch_solo(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                         const DispatchOutput& out, cudaStream_t stream);
    // One rank, y aligned to its elements: one gather kernel by send_pos.
    void combine_solo(View<const void> y, const Handle& h, const NormalState& st, View<void> out,
                      cudaStream_t stream);
    // Spins until the one-rank dispatch kernel of call `seq` has published its counts.
    void wait_solo_counts(unsigned int seq, cudaStream_t stream);

    // --- shared by both paths (cuda_engine.cpp) ---
    // The handle's counts from the summaries in mapped memory (the layout kernel's or the one-rank
    // dispatch kernel's, once they are final).
    void fill_counts(int num_tokens, Handle& h) const;
    size_t ll_stage_offset(int i) const;
    size_t staging_bytes() const;
    void stage_low_latency_handle(const int64_t* topk_idx, int num_tokens, cudaStream_t stream);
    void fill_low_latency_handle(int num_tokens, LowLatencyHandle& h) const;
    std::chrono::milliseconds timeout_ms() const;
    // Common start of every call: the stream, and any error an earlier asynchronous call left behind.
    cudaStream_t begin(const char* what);
    // The host-mapped mirror of the error word, as of now (the device may be writing it: field by field).
    DeviceError read_error() const;
    DeviceError sync_error(cudaStream_t stream);
    // After the host reported bad input: the device word is cleared in stream order, the mirror now (no
    // kernel that could report is running: the caller has synchronised with the layout).
    void clear_bad_input(cudaStream_t stream);
    // The end of a call: a synchronisation and the device's errors, unless Config.async or a capture.
    void finish(cudaStream_t stream);

    Config c_;
    Store* store_;
    SymmetricLayout sym_;
    RowLayout row_;
    Routing rt_;
    int device_ = 0;
    int blocks_ = 1;  // of every kernel, the one-rank ones included (tiles: solo_tiles)
    bool destroyed_ = false;
    DeviceMemory region_;              // the symmetric region (IPC-exported)
    DeviceMemory ctrl_;                // epoch[kNumDeviceChannels], done[kNumDeviceChannels], DeviceError
    DeviceMemory tables_;              // peers [W], then dst pointers of the 4 data channels [W] each
    PinnedMemory host_summaries_;      // send then receive summaries [W, 1+L], written by the layout kernel
    PinnedMemory host_error_;          // mirror of the device error word, written by the device
    HostMappedSizes mapped_{c_};       // sizes of host_summaries_ and host_solo_
    PinnedMemory host_solo_;           // one rank: written by the dispatch kernel (mapped_.solo_offset)
    int* device_summaries_ = nullptr;  // host_summaries_ as the device sees it
    uint8_t* device_solo_ = nullptr;   // host_solo_ as the device sees it
    cudaEvent_t counts_ready_ = nullptr;  // after the layout of the running dispatch
    std::unique_ptr<LayoutState> layout_;
    PinnedMemory stage_;            // device-to-host copies of handle vectors (staging_bytes())
    cudaMemPool_t pool_ = nullptr;  // NormalState blocks; keeps its memory across synchronisations
    std::shared_ptr<NormalStateCache> states_;  // NormalStates of released handles, for the next dispatch
    std::unique_ptr<LowLatencyState> ll_;
    std::unique_ptr<LowLatencyKernels> ll_kernels_;  // over ll_ and the peers' low-latency slots
    std::vector<uint8_t*> peers_;
    uint8_t* const* dst_dispatch_ = nullptr;
    uint8_t* const* dst_combine_ = nullptr;
    Signals sig_;
    Signals unsignalled_;  // sig_ without peers: one rank, nothing crossing a slot
};

// Blocks (tiles) of the one-rank kernels: `blocks` (one tile_state word each), or one per token when
// there are fewer tokens; the tokens are split evenly (kernels.hpp), so no block idles while another
// copies a tile one token longer than the rest.
inline int solo_tiles(int num_tokens, int blocks) { return std::max(1, std::min(num_tokens, blocks)); }

// Whether p is a non-null 16-byte aligned device address.
inline bool aligned16(const void* p) { return p != nullptr && (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Whether the calling thread's capture of `stream` into a CUDA graph is under way.
bool capturing(cudaStream_t stream);

}  // namespace moerl::ep::cuda
