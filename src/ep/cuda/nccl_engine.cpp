// The nccl engine: the same contract over grouped ncclSend/ncclRecv, the baseline "stack without
// accelerated EP". Rows are packed per destination by the same kernels as the cuda engine (signalling
// off), moved by NCCL, and unpacked; counts travel in a first grouped exchange, so every call
// synchronises with the host once (nothing here is graph-safe). One GPU per rank.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "builtin.hpp"
#include "engine_common.hpp"
#include "moerl/core/error.hpp"
#include "stream.hpp"

#if __has_include(<nccl.h>)
#include <nccl.h>
#define MOERL_NCCL_AVAILABLE 1
#endif

namespace moerl::ep {

#ifdef MOERL_NCCL_AVAILABLE

// MOERL_NCCL_CHECK(ncclSend(...)): throws moerl::Error with the call and NCCL's error string.
#define MOERL_NCCL_CHECK(call)                                                                              \
    do {                                                                                                    \
        const ncclResult_t moerl_nccl_res_ = (call);                                                        \
        if (moerl_nccl_res_ != ncclSuccess && moerl_nccl_res_ != ncclInProgress)                            \
            throw ::moerl::Error(                                                                           \
                ::moerl::detail::concat(#call, " failed: ", ncclGetErrorString(moerl_nccl_res_)), __FILE__, \
                __LINE__);                                                                                  \
    } while (0)

namespace {

using namespace cuda;

class NcclEngine final : public Engine {
  public:
    NcclEngine(const Config& config, Store* store)
        : c_(config), store_(store), row_(make_row_layout(config)), rt_(make_routing(config)) {
        check_device_limits(c_, "nccl");
        const int W = c_.world_size, L = c_.num_local_experts();
        MOERL_CHECK(W == 1 || store_ != nullptr, "the nccl EP engine needs a bootstrap store for world_size ",
                    W);
        device_ = select_device(c_, "nccl");
        int sms = 0;
        MOERL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
        blocks_ = std::max(1, std::min(c_.num_sms, sms));

        // One GPU per rank: NCCL refuses two ranks on one device, so say so before it does.
        char bus[64] = {};
        MOERL_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), device_));
        char host[256] = {};
        gethostname(host, sizeof(host) - 1);
        const std::string me = std::string(host) + "/" + bus;
        if (W > 1) {
            auto all = all_gather(*store_, c_.job_id + "/nccl/devices", c_.rank, W,
                                  std::vector<uint8_t>(me.begin(), me.end()), timeout_ms());
            for (int r = 0; r < W; ++r)
                MOERL_CHECK(r == c_.rank || std::string(all[r].begin(), all[r].end()) != me,
                            "the nccl EP engine needs one GPU per rank, but ranks ", std::min(r, c_.rank),
                            " and ", std::max(r, c_.rank), " both use GPU ", bus, " on ", host,
                            " (use the cuda transport to share a GPU)");
        }
        ncclUniqueId id;
        if (c_.rank == 0) MOERL_NCCL_CHECK(ncclGetUniqueId(&id));
        if (W > 1) {
            const std::string key = c_.job_id + "/nccl/id";
            if (c_.rank == 0) {
                store_->set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                                      reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
            } else {
                auto v = store_->get(key, timeout_ms());
                MOERL_CHECK(v.size() == sizeof(id), "nccl engine: bad unique id in the store");
                std::memcpy(&id, v.data(), sizeof(id));
            }
        }
        MOERL_NCCL_CHECK(ncclCommInitRank(&comm_, W, id, c_.rank));

        const size_t maxT = c_.max_tokens_per_rank, K = c_.top_k;
        dispatch_slot_ = align256(maxT * row_.row_bytes);
        combine_slot_ = align256(maxT * c_.hidden * c_.element_bytes());
        ll_header_ = align16(L * sizeof(int));
        ll_slot_ = align256(ll_header_ + maxT * K * row_.row_bytes);
        llc_slot_ = align256(maxT * K * c_.hidden * c_.element_bytes());
        const size_t slot = std::max({dispatch_slot_, combine_slot_, ll_slot_, llc_slot_});
        send_ = DeviceMemory(slot * W);
        recv_ = DeviceMemory(slot * W);
        const size_t summary = static_cast<size_t>(W) * (1 + L);
        summaries_ = DeviceMemory(2 * summary * sizeof(int));
        host_summaries_ = PinnedMemory(2 * summary * sizeof(int));
        error_ = DeviceMemory(sizeof(DeviceError));
        host_error_ = PinnedMemory(sizeof(DeviceError));
        ll_ = std::make_unique<LowLatencyState>(c_);
        layout_ = std::make_unique<LayoutState>(c_);
        // dst tables: packed rows for rank r at send + r * slot (dispatch, low-latency dispatch,
        // low-latency combine).
        tables_ = DeviceMemory(3 * W * sizeof(uint8_t*));
        std::vector<uint8_t*> t(3 * W);
        for (int r = 0; r < W; ++r) {
            t[r] = send_.get<uint8_t>() + r * dispatch_slot_;
            t[W + r] = send_.get<uint8_t>() + r * ll_slot_;
            t[2 * W + r] = send_.get<uint8_t>() + r * llc_slot_;
        }
        MOERL_CUDA_CHECK(
            cudaMemcpy(tables_.get(), t.data(), t.size() * sizeof(uint8_t*), cudaMemcpyHostToDevice));
        sig_.error = error_.get<DeviceError>();
        sig_.rank = c_.rank;
        sig_.world = W;
        LowLatencySlots slots;
        slots.dispatch_dst = tables_.get<uint8_t*>() + W;
        slots.dispatch_src = recv_.get<uint8_t>();
        slots.dispatch_stride = ll_slot_;
        slots.header_bytes = ll_header_;
        slots.combine_dst = tables_.get<uint8_t*>() + 2 * W;
        slots.combine_src = recv_.get<uint8_t>();
        slots.combine_stride = llc_slot_;
        slots.combine_row_bytes = static_cast<size_t>(c_.hidden) * c_.element_bytes();
        ll_kernels_ = std::make_unique<LowLatencyKernels>(c_, *ll_, slots, sig_, blocks_);
    }

    ~NcclEngine() override {
        try {
            destroy();
        } catch (...) {
        }
    }

    std::string name() const override { return "nccl"; }
    bool on_device() const override { return true; }

    void destroy() override {
        if (comm_ == nullptr) return;
        cudaSetDevice(device_);
        cudaDeviceSynchronize();
        ncclCommDestroy(comm_);
        comm_ = nullptr;
    }

    Handle dispatch(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                    const DispatchOutput& out, const Handle* reuse) override {
        const cudaStream_t stream = begin("dispatch");
        const int W = c_.world_size, L = c_.num_local_experts();
        const int T = static_cast<int>(x.rows);
        Handle h;
        std::string bad_input;
        if (reuse != nullptr) {
            MOERL_CHECK(reuse->num_tokens == T, "dispatch: the reused handle was made for ",
                        reuse->num_tokens, " tokens, but x has ", T, " rows");
            normal_state(*reuse, this, "dispatch");
            h = *reuse;
        } else {
            auto state = std::make_shared<NormalState>(this, stream, T, W, c_.max_recv_tokens());
            const size_t summary = static_cast<size_t>(W) * (1 + L);
            int* send_summary = summaries_.get<int>();
            int* recv_summary = send_summary + summary;
            LayoutArgs a{};
            a.rt = rt_;
            a.topk_idx = topk_idx.data;
            a.num_tokens = T;
            a.send_pos = state->send_pos;
            a.send_summary = send_summary;
            a.recv_summary = recv_summary;
            a.recv_src_offset = state->recv_src_offset;
            a.sig = sig_;  // no peers: layout only
            layout_->next(a, stream);
            launch_layout(a, stream);
            MOERL_CUDA_CHECK(cudaGetLastError());
            exchange(send_summary, recv_summary, 1 + L, stream);
            h.send_pos.resize(static_cast<size_t>(T) * W);
            if (T > 0)
                MOERL_CUDA_CHECK(cudaMemcpyAsync(h.send_pos.data(), state->send_pos,
                                                 h.send_pos.size() * sizeof(int), cudaMemcpyDeviceToHost,
                                                 stream));
            MOERL_CUDA_CHECK(cudaMemcpyAsync(host_summaries_.get(), send_summary, 2 * summary * sizeof(int),
                                             cudaMemcpyDeviceToHost, stream));
            const DeviceError err = sync_error(stream, "dispatch/notify");
            if (has_bad_input(err)) {
                bad_input = bad_input_message(err, c_);
                clear_bad_input(stream);
            }
            const int* sent = host_summaries_.get<int>();
            fill_handle_counts(sent, sent + summary, W, L, T, h);
            MOERL_CUDA_CHECK(cudaMemcpyAsync(state->recv_src_offset, h.recv_src_offset.data(),
                                             (W + 1) * sizeof(int), cudaMemcpyHostToDevice, stream));
            h.device_state = state;
        }
        NormalState& st = normal_state(h, this, "dispatch");
        const int R = h.num_recv_tokens();
        const DispatchSendArgs s = dispatch_send_args(rt_, row_, x.data, topk_idx.data, topk_weights.data, T,
                                                      st, tables_.get<uint8_t*>(), sig_);
        launch_dispatch_send(s, blocks_, stream);
        exchange(
            [&](int r) {
                return Messages{send_.get<uint8_t>() + r * dispatch_slot_,
                                static_cast<size_t>(h.num_send_per_rank[r]) * row_.row_bytes,
                                recv_.get<uint8_t>() + r * dispatch_slot_,
                                static_cast<size_t>(h.num_recv_per_src[r]) * row_.row_bytes};
            },
            stream);
        const int max_rows = static_cast<int>(std::min<int64_t>(out.recv_x.rows, c_.max_recv_tokens()));
        const DispatchRecvArgs r = dispatch_recv_args(rt_, row_, c_.rank, recv_.get<uint8_t>(),
                                                      dispatch_slot_, st, out, max_rows, blocks_, sig_);
        launch_dispatch_recv(r, blocks_, stream);
        MOERL_CUDA_CHECK(cudaGetLastError());
        if (reuse == nullptr) {
            h.recv_src_token.assign(R, -1);
            if (R > 0)
                MOERL_CUDA_CHECK(cudaMemcpyAsync(h.recv_src_token.data(), st.recv_src_token, R * sizeof(int),
                                                 cudaMemcpyDeviceToHost, stream));
        }
        sync_error(stream, "dispatch/data");
        MOERL_CHECK(out.recv_x.rows >= R, "dispatch: recv_x has ", out.recv_x.rows, " rows, but ", R,
                    " arrive");
        if (!bad_input.empty()) MOERL_FAIL("dispatch: ", bad_input);
        return h;
    }

    void combine(View<const void> y, const Handle& h, View<void> out) override {
        const cudaStream_t stream = begin("combine");
        NormalState& st = normal_state(h, this, "combine");
        const size_t row = static_cast<size_t>(c_.hidden) * c_.element_bytes();
        MOERL_CHECK(y.rows >= h.num_recv_tokens(), "combine: y has ", y.rows,
                    " rows, but the handle received ", h.num_recv_tokens());
        MOERL_CHECK(out.rows >= h.num_tokens, "combine: out has ", out.rows,
                    " rows, but the handle dispatched ", h.num_tokens, " tokens");
        // y rows are already grouped by source: send each group back as it is.
        exchange(
            [&](int r) {
                return Messages{static_cast<const uint8_t*>(y.data) + h.recv_src_offset[r] * row,
                                h.num_recv_per_src[r] * row, recv_.get<uint8_t>() + r * combine_slot_,
                                h.num_send_per_rank[r] * row};
            },
            stream);
        const CombineRecvArgs a{.rt = rt_,
                                .src = recv_.get<uint8_t>(),
                                .src_stride = combine_slot_,
                                .row_stride = row,
                                .send_pos = st.send_pos,
                                .num_tokens = h.num_tokens,
                                .out = out.data,
                                .sig = sig_};
        launch_combine_recv(a, blocks_, stream);
        MOERL_CUDA_CHECK(cudaGetLastError());
        sync_error(stream, "combine/data");
    }

    LowLatencyHandle low_latency_dispatch(View<const void> x, View<const int64_t> topk_idx,
                                          const LowLatencyOutput& out) override {
        const cudaStream_t stream = begin("low_latency_dispatch");
        const int W = c_.world_size, L = c_.num_local_experts();
        const int T = static_cast<int>(x.rows);
        ll_kernels_->dispatch_send(x.data, topk_idx.data, T, stream);
        // Counts first (the receiver must size its receives), then exactly the rows.
        int* send_summary = summaries_.get<int>();
        int* recv_summary = send_summary + static_cast<size_t>(W) * (1 + L);
        MOERL_CUDA_CHECK(
            cudaMemcpyAsync(send_summary, ll_->send_rows, W * sizeof(int), cudaMemcpyDeviceToDevice, stream));
        exchange(send_summary, recv_summary, 1, stream);
        MOERL_CUDA_CHECK(cudaMemcpyAsync(host_summaries_.get(), send_summary, 2 * W * (1 + L) * sizeof(int),
                                         cudaMemcpyDeviceToHost, stream));
        const DeviceError err = sync_error(stream, "low_latency_dispatch/notify");
        if (has_bad_input(err)) clear_bad_input(stream);
        const int* sent = host_summaries_.get<int>();
        const int* got = sent + static_cast<size_t>(W) * (1 + L);
        ll_send_rows_.assign(sent, sent + W);
        ll_recv_rows_.assign(got, got + W);
        exchange(
            [&](int r) {
                return Messages{send_.get<uint8_t>() + r * ll_slot_, ll_header_ + sent[r] * row_.row_bytes,
                                recv_.get<uint8_t>() + r * ll_slot_, ll_header_ + got[r] * row_.row_bytes};
            },
            stream);
        ll_kernels_->dispatch_recv(out, stream);
        MOERL_CUDA_CHECK(cudaGetLastError());
        LowLatencyHandle h;
        h.num_tokens = T;
        h.device_state = std::shared_ptr<void>(ll_.get(), [](void*) {});
        copy_low_latency_handle(c_, *ll_, topk_idx.data, T, h, stream);
        sync_error(stream, "low_latency_dispatch/data");
        if (has_bad_input(err)) MOERL_FAIL("low_latency_dispatch: ", bad_input_message(err, c_));
        return h;
    }

    void low_latency_combine(View<const void> y, View<const int64_t> /*topk_idx*/,
                             View<const float> topk_weights, const LowLatencyHandle& h,
                             View<void> out) override {
        const cudaStream_t stream = begin("low_latency_combine");
        MOERL_CHECK(h.device_state.get() == ll_.get(),
                    "low_latency_combine: the handle is not from a low_latency_dispatch of this buffer");
        const size_t row = static_cast<size_t>(c_.hidden) * c_.element_bytes();
        ll_kernels_->combine_send(y.data, stream);
        exchange(
            [&](int r) {
                return Messages{send_.get<uint8_t>() + r * llc_slot_, ll_recv_rows_[r] * row,
                                recv_.get<uint8_t>() + r * llc_slot_, ll_send_rows_[r] * row};
            },
            stream);
        ll_kernels_->combine_recv(topk_weights.data, h.num_tokens, out.data, stream);
        MOERL_CUDA_CHECK(cudaGetLastError());
        sync_error(stream, "low_latency_combine/data");
    }

  private:
    std::chrono::milliseconds timeout_ms() const {
        return std::chrono::milliseconds(static_cast<long>(c_.timeout_s * 1000));
    }

    cudaStream_t begin(const char* what) {
        MOERL_CHECK(comm_ != nullptr, what, ": EP buffer used after destroy()");
        MOERL_CUDA_CHECK(cudaSetDevice(device_));
        return current_stream();
    }

    // What one grouped exchange sends to a rank and receives from it.
    struct Messages {
        const void* send;
        size_t send_bytes;
        void* recv;
        size_t recv_bytes;
    };

    // One grouped ncclSend/ncclRecv with every rank; messages(r) gives rank r's Messages.
    template <typename F>
    void exchange(F&& messages, cudaStream_t stream) {
        MOERL_NCCL_CHECK(ncclGroupStart());
        for (int r = 0; r < c_.world_size; ++r) {
            const Messages m = messages(r);
            MOERL_NCCL_CHECK(ncclSend(m.send, m.send_bytes, ncclUint8, r, comm_, stream));
            MOERL_NCCL_CHECK(ncclRecv(m.recv, m.recv_bytes, ncclUint8, r, comm_, stream));
        }
        MOERL_NCCL_CHECK(ncclGroupEnd());
    }

    // Grouped exchange of n ints per peer: send[r*n..] to r, recv[s*n..] from s.
    void exchange(const int* send, int* recv, int n, cudaStream_t stream) {
        const size_t bytes = n * sizeof(int);
        exchange([&](int r) { return Messages{send + r * n, bytes, recv + r * n, bytes}; }, stream);
    }

    // Waits for the stream with the configured timeout (a dead peer leaves NCCL kernels spinning), then
    // reads the error word.
    DeviceError sync_error(cudaStream_t stream, const char* phase) {
        MOERL_CUDA_CHECK(cudaMemcpyAsync(host_error_.get(), error_.get(), sizeof(DeviceError),
                                         cudaMemcpyDeviceToHost, stream));
        const auto deadline = std::chrono::steady_clock::now() + timeout_ms();
        while (true) {
            const cudaError_t q = cudaStreamQuery(stream);
            if (q == cudaSuccess) break;
            if (q != cudaErrorNotReady) MOERL_CUDA_CHECK(q);
            ncclResult_t async_err = ncclSuccess;
            MOERL_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async_err));
            MOERL_NCCL_CHECK(async_err);
            if (std::chrono::steady_clock::now() > deadline) {
                ncclCommAbort(comm_);
                comm_ = nullptr;
                throw TimeoutError(detail::concat("rank ", c_.rank, ": timed out in ", phase, " after ",
                                                  c_.timeout_s, " s (nccl); the communicator was aborted"),
                                   __FILE__, __LINE__);
            }
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
        const DeviceError e = *host_error_.get<DeviceError>();
        throw_if_error(e, c_, "nccl");
        return e;
    }

    void clear_bad_input(cudaStream_t stream) {
        MOERL_CUDA_CHECK(cudaMemsetAsync(&error_.get<DeviceError>()->bad_input, 0, sizeof(int), stream));
    }

    Config c_;
    Store* store_;
    RowLayout row_;
    Routing rt_;
    int device_ = 0;
    int blocks_ = 1;
    ncclComm_t comm_ = nullptr;
    size_t dispatch_slot_ = 0, combine_slot_ = 0, ll_header_ = 0, ll_slot_ = 0, llc_slot_ = 0;
    DeviceMemory send_, recv_;  // [W] slots of the largest channel
    DeviceMemory summaries_;    // send then receive [W, 1+L]
    DeviceMemory error_;
    DeviceMemory tables_;
    PinnedMemory host_summaries_;
    PinnedMemory host_error_;
    std::unique_ptr<LowLatencyState> ll_;
    std::unique_ptr<LowLatencyKernels> ll_kernels_;  // over ll_ and the packing buffers
    std::unique_ptr<LayoutState> layout_;
    std::vector<int> ll_send_rows_, ll_recv_rows_;  // rows of the last low-latency dispatch per rank
    Signals sig_;                                   // signalling off; error word only
};

}  // namespace

std::unique_ptr<Engine> make_nccl_engine(const Config& config, Store* store) {
    return std::make_unique<NcclEngine>(config, store);
}

#else  // no nccl.h at build time

std::unique_ptr<Engine> make_nccl_engine(const Config&, Store*) {
    MOERL_FAIL("the nccl EP transport was built without NCCL (nccl.h not found); pass its include directory");
}

#endif

}  // namespace moerl::ep
