// The calls shared by the engines that move whole packs of rows (packed_engine.hpp).
#include "packed_engine.hpp"

#include <algorithm>
#include <thread>

#include "moerl/core/error.hpp"
#include "stream.hpp"

namespace moerl::ep::cuda {

PackedEngine::PackedEngine(const Config& config, Store* store, const char* engine)
    : c_(config), store_(store), engine_(engine), row_(make_row_layout(config)), rt_(make_routing(config)) {
    check_device_limits(c_, engine_);
    const int W = c_.world_size, L = c_.num_local_experts();
    MOERL_CHECK(W == 1 || store_ != nullptr, "the ", engine_,
                " EP engine needs a bootstrap store for world_size ", W);
    device_ = select_device(c_, engine_);
    int sms = 0;
    MOERL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
    blocks_ = std::max(1, std::min(c_.num_sms, sms));
    const size_t maxT = c_.max_tokens_per_rank, K = c_.top_k;
    dispatch_slot_ = align256(maxT * row_.row_bytes);
    combine_slot_ = align256(maxT * c_.hidden * c_.element_bytes());
    ll_header_ = align16(L * sizeof(int));
    ll_slot_ = align256(ll_header_ + maxT * K * row_.row_bytes);
    llc_slot_ = align256(maxT * K * c_.hidden * c_.element_bytes());
    slot_ = std::max({dispatch_slot_, combine_slot_, ll_slot_, llc_slot_});
}

void PackedEngine::set_packing_memory(uint8_t* send, uint8_t* recv, int* summaries) {
    const int W = c_.world_size;
    send_ = send;
    recv_ = recv;
    messages_.resize(W);
    summaries_ = summaries;
    host_summaries_ = PinnedMemory(summary_bytes());
    error_ = DeviceMemory(sizeof(DeviceError));
    host_error_ = PinnedMemory(sizeof(DeviceError));
    ll_ = std::make_unique<LowLatencyState>(c_);
    layout_ = std::make_unique<LayoutState>(c_);
    // dst tables: packed rows for rank r at send + r * slot (dispatch, low-latency dispatch,
    // low-latency combine).
    tables_ = DeviceMemory(3 * W * sizeof(uint8_t*));
    std::vector<uint8_t*> t(3 * W);
    for (int r = 0; r < W; ++r) {
        t[r] = send_ + r * dispatch_slot_;
        t[W + r] = send_ + r * ll_slot_;
        t[2 * W + r] = send_ + r * llc_slot_;
    }
    MOERL_CUDA_CHECK(
        cudaMemcpy(tables_.get(), t.data(), t.size() * sizeof(uint8_t*), cudaMemcpyHostToDevice));
    sig_.error = error_.get<DeviceError>();
    sig_.rank = c_.rank;
    sig_.world = W;
    LowLatencySlots slots;
    slots.dispatch_dst = tables_.get<uint8_t*>() + W;
    slots.dispatch_src = recv_;
    slots.dispatch_stride = ll_slot_;
    slots.header_bytes = ll_header_;
    slots.combine_dst = tables_.get<uint8_t*>() + 2 * W;
    slots.combine_src = recv_;
    slots.combine_stride = llc_slot_;
    slots.combine_row_bytes = static_cast<size_t>(c_.hidden) * c_.element_bytes();
    ll_kernels_ = std::make_unique<LowLatencyKernels>(c_, *ll_, slots, sig_, blocks_);
}

cudaStream_t PackedEngine::begin(const char* what) {
    check_live(what);
    MOERL_CUDA_CHECK(cudaSetDevice(device_));
    return current_stream();
}

Handle PackedEngine::dispatch(View<const void> x, View<const int64_t> topk_idx,
                              View<const float> topk_weights, const DispatchOutput& out,
                              const Handle* reuse) {
    const cudaStream_t stream = begin("dispatch");
    const int W = c_.world_size, L = c_.num_local_experts();
    const int T = static_cast<int>(x.rows);
    Handle h;
    std::string bad_input;
    if (reuse != nullptr) {
        MOERL_CHECK(reuse->num_tokens == T, "dispatch: the reused handle was made for ", reuse->num_tokens,
                    " tokens, but x has ", T, " rows");
        normal_state(*reuse, this, "dispatch");
        h = *reuse;
    } else {
        auto state = std::make_shared<NormalState>(this, stream, T, W, c_.max_recv_tokens());
        const size_t summary = summary_ints();
        int* send_summary = summaries_;
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
        exchange_ints(send_summary, recv_summary, 1 + L, stream, "dispatch/notify");
        h.send_pos.resize(static_cast<size_t>(T) * W);
        if (T > 0)
            MOERL_CUDA_CHECK(cudaMemcpyAsync(h.send_pos.data(), state->send_pos,
                                             h.send_pos.size() * sizeof(int), cudaMemcpyDeviceToHost,
                                             stream));
        MOERL_CUDA_CHECK(cudaMemcpyAsync(host_summaries_.get(), send_summary, summary_bytes(),
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
    const DispatchSendArgs s = dispatch_send_args(rt_, row_, x.data, topk_idx.data, topk_weights.data, T, st,
                                                  tables_.get<uint8_t*>(), sig_);
    launch_dispatch_send(s, blocks_, stream);
    std::vector<Messages>& m = messages_;
    for (int r = 0; r < W; ++r)
        m[r] = {send_ + r * dispatch_slot_, static_cast<size_t>(h.num_send_per_rank[r]) * row_.row_bytes,
                recv_, dispatch_slot_, static_cast<size_t>(h.num_recv_per_src[r]) * row_.row_bytes};
    exchange(m, stream, "dispatch/data");
    const int max_rows = static_cast<int>(std::min<int64_t>(out.recv_x.rows, c_.max_recv_tokens()));
    const DispatchRecvArgs r =
        dispatch_recv_args(rt_, row_, c_.rank, recv_, dispatch_slot_, st, out, max_rows, blocks_, sig_);
    launch_dispatch_recv(r, blocks_, stream);
    MOERL_CUDA_CHECK(cudaGetLastError());
    if (reuse == nullptr) {
        h.recv_src_token.assign(R, -1);
        if (R > 0)
            MOERL_CUDA_CHECK(cudaMemcpyAsync(h.recv_src_token.data(), st.recv_src_token, R * sizeof(int),
                                             cudaMemcpyDeviceToHost, stream));
    }
    sync_error(stream, "dispatch/data");
    MOERL_CHECK(out.recv_x.rows >= R, "dispatch: recv_x has ", out.recv_x.rows, " rows, but ", R, " arrive");
    if (!bad_input.empty()) MOERL_FAIL("dispatch: ", bad_input);
    return h;
}

void PackedEngine::combine(View<const void> y, const Handle& h, View<void> out) {
    const cudaStream_t stream = begin("combine");
    NormalState& st = normal_state(h, this, "combine");
    const size_t row = static_cast<size_t>(c_.hidden) * c_.element_bytes();
    MOERL_CHECK(y.rows >= h.num_recv_tokens(), "combine: y has ", y.rows, " rows, but the handle received ",
                h.num_recv_tokens());
    MOERL_CHECK(out.rows >= h.num_tokens, "combine: out has ", out.rows, " rows, but the handle dispatched ",
                h.num_tokens, " tokens");
    // y rows are already grouped by source: send each group back as it is.
    std::vector<Messages>& m = messages_;
    for (int r = 0; r < c_.world_size; ++r)
        m[r] = {static_cast<const uint8_t*>(y.data) + h.recv_src_offset[r] * row, h.num_recv_per_src[r] * row,
                recv_, combine_slot_, h.num_send_per_rank[r] * row};
    exchange(m, stream, "combine/data");
    const CombineRecvArgs a{.rt = rt_,
                            .src = recv_,
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

LowLatencyHandle PackedEngine::low_latency_dispatch(View<const void> x, View<const int64_t> topk_idx,
                                                    const LowLatencyOutput& out) {
    const cudaStream_t stream = begin("low_latency_dispatch");
    const int W = c_.world_size;
    const int T = static_cast<int>(x.rows);
    ll_kernels_->dispatch_send(x.data, topk_idx.data, T, stream);
    // Counts first (the receiver must size its receives), then exactly the rows.
    int* send_summary = summaries_;
    int* recv_summary = send_summary + summary_ints();
    MOERL_CUDA_CHECK(
        cudaMemcpyAsync(send_summary, ll_->send_rows, W * sizeof(int), cudaMemcpyDeviceToDevice, stream));
    exchange_ints(send_summary, recv_summary, 1, stream, "low_latency_dispatch/notify");
    MOERL_CUDA_CHECK(cudaMemcpyAsync(host_summaries_.get(), send_summary, summary_bytes(),
                                     cudaMemcpyDeviceToHost, stream));
    const DeviceError err = sync_error(stream, "low_latency_dispatch/notify");
    if (has_bad_input(err)) clear_bad_input(stream);
    const int* sent = host_summaries_.get<int>();
    const int* got = sent + summary_ints();
    ll_send_rows_.assign(sent, sent + W);
    ll_recv_rows_.assign(got, got + W);
    std::vector<Messages>& m = messages_;
    for (int r = 0; r < W; ++r)
        m[r] = {send_ + r * ll_slot_, ll_header_ + sent[r] * row_.row_bytes, recv_, ll_slot_,
                ll_header_ + got[r] * row_.row_bytes};
    exchange(m, stream, "low_latency_dispatch/data");
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

void PackedEngine::low_latency_combine(View<const void> y, View<const int64_t> /*topk_idx*/,
                                       View<const float> topk_weights, const LowLatencyHandle& h,
                                       View<void> out) {
    const cudaStream_t stream = begin("low_latency_combine");
    MOERL_CHECK(h.device_state.get() == ll_.get(),
                "low_latency_combine: the handle is not from a low_latency_dispatch of this buffer");
    const size_t row = static_cast<size_t>(c_.hidden) * c_.element_bytes();
    ll_kernels_->combine_send(y.data, stream);
    std::vector<Messages>& m = messages_;
    for (int r = 0; r < c_.world_size; ++r)
        m[r] = {send_ + r * llc_slot_, ll_recv_rows_[r] * row, recv_, llc_slot_, ll_send_rows_[r] * row};
    exchange(m, stream, "low_latency_combine/data");
    ll_kernels_->combine_recv(topk_weights.data, h.num_tokens, out.data, stream);
    MOERL_CUDA_CHECK(cudaGetLastError());
    sync_error(stream, "low_latency_combine/data");
}

void PackedEngine::exchange_ints(const int* send, int* recv, int n, cudaStream_t stream, const char* phase) {
    const size_t bytes = n * sizeof(int);
    std::vector<Messages>& m = messages_;
    for (int r = 0; r < c_.world_size; ++r)
        m[r] = {send + r * n, bytes, reinterpret_cast<uint8_t*>(recv), bytes, bytes};
    exchange(m, stream, phase);
}

void PackedEngine::wait_stream(cudaStream_t stream, const char* phase) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_ms();
    while (true) {
        const cudaError_t q = cudaStreamQuery(stream);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) MOERL_CUDA_CHECK(q);
        check_progress(phase);
        if (std::chrono::steady_clock::now() > deadline) {
            const std::string after = on_stream_timeout();
            throw TimeoutError(detail::concat("rank ", c_.rank, ": timed out in ", phase, " after ",
                                              c_.timeout_s, " s (", engine_, ")", after),
                               __FILE__, __LINE__);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(10));
    }
    stream_finished(phase);
}

DeviceError PackedEngine::sync_error(cudaStream_t stream, const char* phase) {
    MOERL_CUDA_CHECK(cudaMemcpyAsync(host_error_.get(), error_.get(), sizeof(DeviceError),
                                     cudaMemcpyDeviceToHost, stream));
    wait_stream(stream, phase);
    const DeviceError e = *host_error_.get<DeviceError>();
    throw_if_error(e, c_, engine_);
    return e;
}

void PackedEngine::clear_bad_input(cudaStream_t stream) {
    MOERL_CUDA_CHECK(cudaMemsetAsync(&error_.get<DeviceError>()->bad_input, 0, sizeof(int), stream));
}

}  // namespace moerl::ep::cuda
