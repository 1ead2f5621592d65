// Internal: the EP engines that pack rows per destination and move whole packs between ranks, the
// nccl baseline (grouped ncclSend/ncclRecv) and cuda-fabric (writes over libfabric that a kernel
// queues on a write proxy, for EP between nodes). The cuda engine's kernels do the packing and the
// unpacking with their signalling off; counts travel in a first exchange, and every call ends with a
// host synchronisation (nothing here is graph-safe).
//
// Memory: [W] send slots and [W] receive slots, each as large as the largest channel needs, and the
// layout summaries (what this rank sends, then what it receives, [W, 1+L] ints each). Where they live
// is the subclass's choice (the fabric engine's are in its registered region).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "engine.hpp"
#include "engine_common.hpp"

namespace moerl::ep::cuda {

class PackedEngine : public Engine {
  public:
    bool on_device() const override { return true; }

    Handle dispatch(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                    const DispatchOutput& out, const Handle* reuse) override;
    void combine(View<const void> y, const Handle& h, View<void> out) override;
    LowLatencyHandle low_latency_dispatch(View<const void> x, View<const int64_t> topk_idx,
                                          const LowLatencyOutput& out) override;
    void low_latency_combine(View<const void> y, View<const int64_t> topk_idx, View<const float> topk_weights,
                             const LowLatencyHandle& h, View<void> out) override;

  protected:
    // What one exchange sends to rank r and receives from it. The receive side is a slot array:
    // rank s's bytes land at recv + s * recv_stride on every rank, so each sender knows where its
    // own go.
    struct Messages {
        const void* send;
        size_t send_bytes;
        uint8_t* recv;  // this rank's slot array (the same offsets on every rank)
        size_t recv_stride;
        size_t recv_bytes;  // what rank r sends here
    };

    // Sizes every slot from the config and picks the device (cudaSetDevice). `engine` names the
    // engine in errors.
    PackedEngine(const Config& config, Store* store, const char* engine);

    // Bytes of the packing memory the subclass provides: W send and W receive slots of slot_bytes(),
    // and summary_bytes() of summaries.
    size_t slot_bytes() const { return slot_; }
    size_t summary_bytes() const { return 2 * summary_ints() * sizeof(int); }
    // Called once by the subclass's constructor with that memory (device addresses).
    void set_packing_memory(uint8_t* send, uint8_t* recv, int* summaries);

    // One collective exchange: messages[r] with every rank r, in stream order on `stream`; `phase`
    // names the call and its step in errors ("dispatch/data").
    virtual void exchange(const std::vector<Messages>& messages, cudaStream_t stream, const char* phase) = 0;
    // While the stream runs: throws what the engine has seen go wrong (a peer's or the transport's
    // error); `phase` names the call's step.
    virtual void check_progress(const char* phase) = 0;
    // At the deadline, before the TimeoutError: tears down what a dead peer would leave hanging and
    // returns what the message adds ("; the communicator was aborted"), or "".
    virtual std::string on_stream_timeout() { return ""; }
    // After the stream finished.
    virtual void stream_finished(const char* /*phase*/) {}
    // Throws when the engine was destroyed.
    virtual void check_live(const char* what) const = 0;

    std::chrono::milliseconds timeout_ms() const {
        return std::chrono::milliseconds(static_cast<long>(c_.timeout_s * 1000));
    }

    const Config c_;
    Store* const store_;
    const char* const engine_;
    int device_ = 0;
    int blocks_ = 1;

  private:
    size_t summary_ints() const { return static_cast<size_t>(c_.world_size) * (1 + c_.num_local_experts()); }
    cudaStream_t begin(const char* what);
    // Grouped exchange of n ints per peer: send[r*n..] to r, recv[s*n..] from s.
    void exchange_ints(const int* send, int* recv, int n, cudaStream_t stream, const char* phase);
    // Waits for the stream with the configured timeout (a dead peer becomes an error at the
    // deadline, not a hang).
    void wait_stream(cudaStream_t stream, const char* phase);
    // Waits for the stream, then reads the error word (throws on a fatal one).
    DeviceError sync_error(cudaStream_t stream, const char* phase);
    void clear_bad_input(cudaStream_t stream);

    RowLayout row_;
    Routing rt_;
    size_t dispatch_slot_ = 0, combine_slot_ = 0, ll_header_ = 0, ll_slot_ = 0, llc_slot_ = 0, slot_ = 0;
    uint8_t* send_ = nullptr;  // [W] slots of the largest channel
    uint8_t* recv_ = nullptr;
    int* summaries_ = nullptr;  // send then receive [W, 1+L]
    DeviceMemory error_;
    DeviceMemory tables_;
    PinnedMemory host_summaries_;
    PinnedMemory host_error_;
    std::unique_ptr<LowLatencyState> ll_;
    std::unique_ptr<LowLatencyKernels> ll_kernels_;  // over ll_ and the packing buffers
    std::unique_ptr<LayoutState> layout_;
    std::vector<int> ll_send_rows_, ll_recv_rows_;  // rows of the last low-latency dispatch per rank
    std::vector<Messages> messages_;                // [W], refilled by each exchange
    Signals sig_;                                   // signalling off; error word only
};

}  // namespace moerl::ep::cuda
