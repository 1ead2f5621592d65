// The cuda engine (cuda_engine.hpp): construction over CUDA IPC, the multi-rank dispatch and combine,
// low-latency mode and the helpers both paths share. The one-rank fast path is in one_rank.cpp.
#include "cuda_engine.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "builtin.hpp"
#include "moerl/core/error.hpp"
#include "stream.hpp"

namespace moerl::ep::cuda {

namespace {

void check_alignment(const void* p, const char* what) {
    MOERL_CHECK((reinterpret_cast<uintptr_t>(p) & 15) == 0, what, " must be 16-byte aligned on the device");
}

}  // namespace

SymmetricLayout::SymmetricLayout(const Config& c) {
    const size_t W = c.world_size;
    const size_t ll_rows = static_cast<size_t>(c.max_tokens_per_rank) * c.top_k;
    ll_header_bytes = align16(c.num_local_experts() * sizeof(int32_t));
    flags_bytes = align256(2 * kNumDeviceChannels * W * sizeof(uint64_t));
    slot_bytes[kChCount] = align16((1 + c.num_local_experts()) * sizeof(int32_t));
    slot_bytes[kChDispatch] = align256(c.max_tokens_per_rank * c.dispatch_row_bytes());
    slot_bytes[kChCombine] = align256(c.max_tokens_per_rank * c.combine_row_bytes());
    slot_bytes[kChLLDispatch] = align256(ll_header_bytes + ll_rows * c.dispatch_row_bytes());
    slot_bytes[kChLLCombine] = align256(ll_rows * c.combine_row_bytes());
    total = flags_bytes;
    for (int ch = 0; ch < kNumDeviceChannels; ++ch) {
        recv_base[ch] = total;
        total += align256(slot_bytes[ch] * W);
    }
}

CudaEngine::CudaEngine(const Config& config, Store* store)
    : c_(config), store_(store), sym_(config), row_(make_row_layout(config)), rt_(make_routing(config)) {
    check_device_limits(c_, "cuda");
    const int W = c_.world_size;
    MOERL_CHECK(W == 1 || store_ != nullptr, "the cuda EP engine needs a bootstrap store for world_size ", W);
    device_ = select_device(c_, "cuda");
    int sms = 0;
    MOERL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
    blocks_ = std::max(1, std::min(c_.num_sms, sms));

    region_ = DeviceMemory(sym_.total);
    ctrl_ = DeviceMemory(align256(kNumDeviceChannels * 8) + align256(kNumDeviceChannels * 4) +
                         sizeof(DeviceError));
    // Written by the device (mapped pinned memory): the layout kernel's summaries, the error mirror,
    // and with one rank the dispatch kernel's ready word and handle vectors.
    host_summaries_ = PinnedMemory(mapped_.summary_bytes(), cudaHostAllocMapped);
    host_error_ = PinnedMemory(sizeof(DeviceError), cudaHostAllocMapped);
    MOERL_CUDA_CHECK(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_summaries_), host_summaries_.get(), 0));
    if (W == 1) {
        host_solo_ = PinnedMemory(mapped_.solo_offset[3], cudaHostAllocMapped);
        MOERL_CUDA_CHECK(
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_solo_), host_solo_.get(), 0));
    }
    DeviceError* error_mirror = nullptr;
    MOERL_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_mirror), host_error_.get(), 0));
    MOERL_CUDA_CHECK(cudaEventCreateWithFlags(&counts_ready_, cudaEventDisableTiming));
    ll_ = std::make_unique<LowLatencyState>(c_);
    layout_ = std::make_unique<LayoutState>(c_, W == 1 ? blocks_ : 1);  // one tile_state word a solo block
    stage_ = PinnedMemory(staging_bytes());
    // Handle state comes from an engine-owned pool that keeps its memory across synchronisations
    // (the default pool returns it at each one, so every dispatch would map fresh memory).
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device_;
    MOERL_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
    uint64_t keep = UINT64_MAX;
    MOERL_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep));
    states_ =
        std::make_shared<NormalStateCache>(this, c_.max_tokens_per_rank, W, c_.max_recv_tokens(), pool_);
    tables_ = DeviceMemory((1 + 4) * W * sizeof(uint8_t*));

    // Exchange IPC handles; a rank publishes its handle only after its region was zeroed.
    peers_.assign(W, nullptr);
    peers_[c_.rank] = region_.get<uint8_t>();
    MOERL_CUDA_CHECK(cudaDeviceSynchronize());
    if (W > 1) {
        // Each rank publishes its region's IPC handle, its GPU's UUID and SM count.
        cudaIpcMemHandle_t mine;
        MOERL_CUDA_CHECK(cudaIpcGetMemHandle(&mine, region_.get()));
        cudaDeviceProp prop{};
        MOERL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
        constexpr size_t kUuid = sizeof(mine), kSms = kUuid + sizeof(prop.uuid);
        std::vector<uint8_t> bytes(kSms + sizeof(int));
        std::memcpy(bytes.data(), &mine, sizeof(mine));
        std::memcpy(bytes.data() + kUuid, &prop.uuid, sizeof(prop.uuid));
        std::memcpy(bytes.data() + kSms, &sms, sizeof(int));
        auto all = all_gather(*store_, c_.job_id + "/cuda/ipc", c_.rank, W, bytes, timeout_ms());
        for (int r = 0; r < W; ++r)
            MOERL_CHECK(all[r].size() == bytes.size(), "cuda engine: rank ", r,
                        " published a bad IPC handle");
        // Ranks sharing a GPU split its SMs: one rank's kernels wait on another's, so all of them
        // must fit on it at once. Every rank takes the same count (the receive kernels expect as
        // many signals from each peer as they have blocks themselves).
        for (int r = 0; r < W; ++r) {
            int sharing = 0, sms_r = 0;
            for (int q = 0; q < W; ++q)
                sharing += std::memcmp(all[q].data() + kUuid, all[r].data() + kUuid, sizeof(prop.uuid)) == 0;
            std::memcpy(&sms_r, all[r].data() + kSms, sizeof(int));
            blocks_ = std::max(1, std::min(blocks_, sms_r / sharing));
        }
        for (int r = 0; r < W; ++r) {
            if (r == c_.rank) continue;
            cudaIpcMemHandle_t h;
            std::memcpy(&h, all[r].data(), sizeof(h));
            void* p = nullptr;
            MOERL_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
            peers_[r] = static_cast<uint8_t*>(p);
        }
    }
    // Pointer tables: peers, then per data channel where this rank's rows for rank r start.
    std::vector<uint8_t*> tables((1 + 4) * W);
    const int channels[4] = {kChDispatch, kChCombine, kChLLDispatch, kChLLCombine};
    for (int r = 0; r < W; ++r) {
        tables[r] = peers_[r];
        for (int i = 0; i < 4; ++i) {
            const int ch = channels[i];
            tables[(1 + i) * W + r] = peers_[r] + sym_.recv_base[ch] + c_.rank * sym_.slot_bytes[ch];
        }
    }
    MOERL_CUDA_CHECK(
        cudaMemcpy(tables_.get(), tables.data(), tables.size() * sizeof(uint8_t*), cudaMemcpyHostToDevice));
    auto* tbl = tables_.get<uint8_t*>();
    dst_dispatch_ = tbl + W;
    dst_combine_ = tbl + 2 * W;

    auto* ctrl = ctrl_.get<uint8_t>();
    sig_.peers = tbl;
    sig_.epoch = reinterpret_cast<unsigned long long*>(ctrl);
    sig_.done = reinterpret_cast<unsigned int*>(ctrl + align256(kNumDeviceChannels * 8));
    sig_.error = reinterpret_cast<DeviceError*>(ctrl + align256(kNumDeviceChannels * 8) +
                                                align256(kNumDeviceChannels * 4));
    sig_.error_mirror = error_mirror;
    sig_.flags_offset = 0;
    sig_.rank = c_.rank;
    sig_.world = W;
    sig_.timeout_ns = static_cast<unsigned long long>(c_.timeout_s * 1e9);
    unsignalled_ = sig_;
    unsignalled_.peers = nullptr;

    LowLatencySlots slots;
    slots.dispatch_dst = tbl + 3 * W;
    slots.dispatch_src = region_.get<uint8_t>() + sym_.recv_base[kChLLDispatch];
    slots.dispatch_stride = sym_.slot_bytes[kChLLDispatch];
    slots.header_bytes = sym_.ll_header_bytes;
    slots.combine_dst = tbl + 4 * W;
    slots.combine_src = region_.get<uint8_t>() + sym_.recv_base[kChLLCombine];
    slots.combine_stride = sym_.slot_bytes[kChLLCombine];
    slots.combine_row_bytes = c_.combine_row_bytes();
    ll_kernels_ = std::make_unique<LowLatencyKernels>(c_, *ll_, slots, sig_, blocks_);
}

CudaEngine::~CudaEngine() {
    try {
        destroy();
    } catch (...) {
    }
}

void CudaEngine::destroy() {
    if (destroyed_) return;
    destroyed_ = true;
    cudaSetDevice(device_);
    const cudaError_t sync = cudaDeviceSynchronize();
    const int W = c_.world_size;
    if (W > 1) {
        // Nobody writes into a region after the first barrier; nobody maps one after the second.
        all_gather(*store_, c_.job_id + "/cuda/destroy1", c_.rank, W, {1}, timeout_ms());
        for (int r = 0; r < W; ++r)
            if (r != c_.rank && peers_[r] != nullptr) cudaIpcCloseMemHandle(peers_[r]);
        all_gather(*store_, c_.job_id + "/cuda/destroy2", c_.rank, W, {1}, timeout_ms());
    }
    ll_kernels_.reset();
    ll_.reset();
    layout_.reset();
    if (counts_ready_ != nullptr) cudaEventDestroy(counts_ready_);
    counts_ready_ = nullptr;
    // Handles still alive free their blocks later; the pool goes once they have.
    if (states_ != nullptr) states_->close();
    if (pool_ != nullptr) cudaMemPoolDestroy(pool_);
    pool_ = nullptr;
    region_ = DeviceMemory();
    ctrl_ = DeviceMemory();
    MOERL_CUDA_CHECK(sync);
}

Handle CudaEngine::dispatch(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                            const DispatchOutput& out, const Handle* reuse) {
    const cudaStream_t stream = begin("dispatch");
    const int W = c_.world_size;
    const int T = static_cast<int>(x.rows);
    check_alignment(x.data, "dispatch: x");
    Handle h;
    std::shared_ptr<NormalState> fresh;  // set while the counts of a new layout are on their way
    bool copy_pos = false;
    if (reuse != nullptr) {
        MOERL_CHECK(reuse->num_tokens == T, "dispatch: the reused handle was made for ", reuse->num_tokens,
                    " tokens, but x has ", T, " rows");
        normal_state(*reuse, this, "dispatch");
        h = *reuse;
    } else {
        MOERL_CHECK(!capturing(stream),
                    "dispatch without a handle to reuse synchronises with the host and "
                    "cannot be captured in a CUDA graph; capture low_latency_dispatch or reuse a handle");
        if (W == 1 && aligned16(out.recv_x.data))
            return dispatch_solo(x, topk_idx, topk_weights, out, stream);
        fresh = states_->take(stream);
        const size_t summary = mapped_.summary_ints;
        LayoutArgs a{};
        a.rt = rt_;
        a.topk_idx = topk_idx.data;
        a.num_tokens = T;
        a.send_pos = fresh->send_pos;
        a.send_summary = device_summaries_;  // host-mapped: no copy after the kernel
        a.self_only = W == 1;
        a.count_offset = sym_.recv_base[kChCount];
        a.count_slot_bytes = sym_.slot_bytes[kChCount];
        a.recv_summary = device_summaries_ + summary;
        a.recv_src_offset = fresh->recv_src_offset;
        a.sig = sig_;
        layout_->next(a, stream);
        launch_layout(a, stream);
        MOERL_CUDA_CHECK(cudaGetLastError());
        const size_t num_pos = static_cast<size_t>(T) * W;
        copy_pos = !c_.async && num_pos > 0;  // Config.async: device copy only
        if (copy_pos)
            MOERL_CUDA_CHECK(cudaMemcpyAsync(stage_.get(), fresh->send_pos, num_pos * sizeof(int),
                                             cudaMemcpyDeviceToHost, stream));
        MOERL_CUDA_CHECK(cudaEventRecord(counts_ready_, stream));
    }
    NormalState& st = fresh != nullptr ? *fresh : normal_state(h, this, "dispatch");
    // Rows past the outputs are dropped on the device (the host reports the short output below), so
    // the data kernels need nothing the host learns from the counts and are queued before it waits.
    const int max_rows = static_cast<int>(std::min<int64_t>(out.recv_x.rows, c_.max_recv_tokens()));
    // This rank's rows go straight into the outputs (fp8 rows are quantized there: 16-byte aligned).
    const bool self_direct = aligned16(out.recv_x.data);
    // One rank writing its outputs directly: the receive kernel would have nothing to do, and the
    // send kernel needs no signals (nothing crosses a slot).
    const bool solo = W == 1 && self_direct;

    DispatchSendArgs s = dispatch_send_args(rt_, row_, x.data, topk_idx.data, topk_weights.data, T, st,
                                            dst_dispatch_, solo ? unsignalled_ : sig_);
    s.rank = c_.rank;
    s.recv_src_offset = st.recv_src_offset;
    if (self_direct) {  // DispatchSendArgs: self rows straight into the outputs
        s.self_recv_x = out.recv_x.data;
        s.self_recv_x_scales = out.recv_x_scales.data;
        s.self_recv_topk_idx = out.recv_topk_idx.data;
        s.self_recv_topk_weights = out.recv_topk_weights.data;
        s.self_recv_src_token = st.recv_src_token;
        s.self_max_rows = max_rows;
    }
    launch_dispatch_send(s, blocks_, stream);
    if (!solo) {
        DispatchRecvArgs r =
            dispatch_recv_args(rt_, row_, c_.rank, region_.get<uint8_t>() + sym_.recv_base[kChDispatch],
                               sym_.slot_bytes[kChDispatch], st, out, max_rows, blocks_, sig_);
        r.skip_self = self_direct;
        launch_dispatch_recv(r, blocks_, stream);
    }
    MOERL_CUDA_CHECK(cudaGetLastError());

    std::string bad_input;
    if (fresh != nullptr) {
        MOERL_CUDA_CHECK(cudaEventSynchronize(counts_ready_));  // the layout and the send_pos copy
        const DeviceError err = read_error();
        if (copy_pos) h.send_pos.assign(stage_.get<int>(), stage_.get<int>() + static_cast<size_t>(T) * W);
        throw_if_error(err, c_, "cuda");
        if (has_bad_input(err)) {
            bad_input = bad_input_message(err, c_);
            clear_bad_input(stream);
        }
        fill_counts(T, h);
        h.device_state = fresh;
    }
    const int R = h.num_recv_tokens();
    if (reuse == nullptr) h.recv_src_token.assign(R, -1);
    if (!c_.async && !capturing(stream)) {
        const bool copy_tokens = reuse == nullptr && R > 0;
        if (copy_tokens)
            MOERL_CUDA_CHECK(cudaMemcpyAsync(stage_.get(), st.recv_src_token, R * sizeof(int),
                                             cudaMemcpyDeviceToHost, stream));
        const DeviceError err = sync_error(stream);
        if (copy_tokens) std::memcpy(h.recv_src_token.data(), stage_.get(), R * sizeof(int));
        throw_if_error(err, c_, "cuda");
    } else if (reuse == nullptr) {
        h.recv_src_token.clear();  // device copy only (Config.async)
    }
    MOERL_CHECK(out.recv_x.rows >= R, "dispatch: recv_x has ", out.recv_x.rows, " rows, but ", R, " arrive");
    if (!bad_input.empty()) MOERL_FAIL("dispatch: ", bad_input);
    return h;
}

void CudaEngine::combine(View<const void> y, const Handle& h, View<void> out) {
    const cudaStream_t stream = begin("combine");
    NormalState& st = normal_state(h, this, "combine");
    MOERL_CHECK(y.rows >= h.num_recv_tokens(), "combine: y has ", y.rows, " rows, but the handle received ",
                h.num_recv_tokens());
    MOERL_CHECK(out.rows >= h.num_tokens, "combine: out has ", out.rows, " rows, but the handle dispatched ",
                h.num_tokens, " tokens");
    // This rank's rows stay in y; the receive kernel reads them there. With one rank that is all
    // of them: one gather kernel, no signals.
    const bool self_direct =
        y.data != nullptr && (reinterpret_cast<uintptr_t>(y.data) & (c_.element_bytes() - 1)) == 0;
    if (c_.world_size == 1 && self_direct) return combine_solo(y, h, st, out, stream);
    {
        CombineSendArgs s{};
        s.rt = rt_;
        s.y = y.data;
        s.recv_src_offset = st.recv_src_offset;
        s.dst = dst_combine_;
        s.row_stride = c_.combine_row_bytes();
        s.sig = sig_;
        s.skip_self = self_direct;
        s.rank = c_.rank;
        launch_combine_send(s, blocks_, stream);
    }
    CombineRecvArgs r{};
    r.rt = rt_;
    r.src = region_.get<uint8_t>() + sym_.recv_base[kChCombine];
    r.src_stride = sym_.slot_bytes[kChCombine];
    r.row_stride = c_.combine_row_bytes();
    r.send_pos = st.send_pos;
    r.num_tokens = h.num_tokens;
    r.out = out.data;
    r.send_blocks = blocks_;
    r.sig = sig_;
    if (self_direct) {
        r.self_y = y.data;
        r.recv_src_offset = st.recv_src_offset;
        r.rank = c_.rank;
    }
    launch_combine_recv(r, blocks_, stream);
    MOERL_CUDA_CHECK(cudaGetLastError());
    finish(stream);
}

LowLatencyHandle CudaEngine::low_latency_dispatch(View<const void> x, View<const int64_t> topk_idx,
                                                  const LowLatencyOutput& out) {
    const cudaStream_t stream = begin("low_latency_dispatch");
    check_alignment(x.data, "low_latency_dispatch: x");
    const int T = static_cast<int>(x.rows);
    LowLatencyHandle h;
    h.num_tokens = T;
    ll_kernels_->dispatch_send(x.data, topk_idx.data, T, stream);
    ll_kernels_->dispatch_recv(out, stream);
    MOERL_CUDA_CHECK(cudaGetLastError());
    h.device_state = std::shared_ptr<void>(ll_.get(), [](void*) {});
    if (!c_.async && !capturing(stream)) {
        stage_low_latency_handle(topk_idx.data, T, stream);
        const DeviceError err = sync_error(stream);
        fill_low_latency_handle(T, h);
        throw_if_error(err, c_, "cuda");
        if (has_bad_input(err)) {
            clear_bad_input(stream);
            MOERL_FAIL("low_latency_dispatch: ", bad_input_message(err, c_));
        }
    }
    return h;
}

void CudaEngine::low_latency_combine(View<const void> y, View<const int64_t> /*topk_idx*/,
                                     View<const float> topk_weights, const LowLatencyHandle& h,
                                     View<void> out) {
    const cudaStream_t stream = begin("low_latency_combine");
    MOERL_CHECK(h.device_state.get() == ll_.get(),
                "low_latency_combine: the handle is not from a low_latency_dispatch of this buffer");
    ll_kernels_->combine_send(y.data, stream);
    ll_kernels_->combine_recv(topk_weights.data, h.num_tokens, out.data, stream);
    MOERL_CUDA_CHECK(cudaGetLastError());
    finish(stream);
}

void CudaEngine::fill_counts(int num_tokens, Handle& h) const {
    const int W = c_.world_size, L = c_.num_local_experts();
    const int* sent = host_summaries_.get<int>();
    fill_handle_counts(sent, sent + mapped_.summary_ints, W, L, num_tokens, h);
}

// Pinned staging of the handles' host vectors, LL layout: recv_count [L], recv_range [L, W, 2],
// recv_src_token [L, rows_per_expert], topk_idx [T, K] int64 (each 16-byte aligned). Normal mode
// uses it for send_pos [T, W] and recv_src_token [R], one at a time.
size_t CudaEngine::ll_stage_offset(int i) const {
    const size_t W = c_.world_size, L = c_.num_local_experts();
    const size_t sizes[4] = {L * sizeof(int), L * W * 2 * sizeof(int),
                             L * c_.low_latency_rows_per_expert() * sizeof(int),
                             static_cast<size_t>(c_.max_tokens_per_rank) * c_.top_k * sizeof(int64_t)};
    size_t off = 0;
    for (int j = 0; j < i; ++j) off += align16(sizes[j]);
    return off;
}
size_t CudaEngine::staging_bytes() const {
    const size_t normal = std::max(static_cast<size_t>(c_.max_tokens_per_rank) * c_.world_size,
                                   static_cast<size_t>(c_.max_recv_tokens())) *
                          sizeof(int);
    return std::max(normal, ll_stage_offset(4));
}

// Queues the device-to-host copies of a low-latency handle; fill_low_latency_handle after a sync.
void CudaEngine::stage_low_latency_handle(const int64_t* topk_idx, int num_tokens, cudaStream_t stream) {
    const size_t W = c_.world_size, L = c_.num_local_experts();
    auto* base = stage_.get<uint8_t>();
    MOERL_CUDA_CHECK(cudaMemcpyAsync(base + ll_stage_offset(0), ll_->recv_count, L * sizeof(int),
                                     cudaMemcpyDeviceToHost, stream));
    MOERL_CUDA_CHECK(cudaMemcpyAsync(base + ll_stage_offset(1), ll_->recv_range, L * W * 2 * sizeof(int),
                                     cudaMemcpyDeviceToHost, stream));
    MOERL_CUDA_CHECK(cudaMemcpyAsync(base + ll_stage_offset(2), ll_->recv_src_token,
                                     L * c_.low_latency_rows_per_expert() * sizeof(int),
                                     cudaMemcpyDeviceToHost, stream));
    if (num_tokens > 0)
        MOERL_CUDA_CHECK(cudaMemcpyAsync(base + ll_stage_offset(3), topk_idx,
                                         static_cast<size_t>(num_tokens) * c_.top_k * sizeof(int64_t),
                                         cudaMemcpyDeviceToHost, stream));
}

void CudaEngine::fill_low_latency_handle(int num_tokens, LowLatencyHandle& h) const {
    const size_t W = c_.world_size, L = c_.num_local_experts();
    const auto* base = stage_.get<uint8_t>();
    const auto* count = reinterpret_cast<const int*>(base + ll_stage_offset(0));
    const auto* range = reinterpret_cast<const int*>(base + ll_stage_offset(1));
    const auto* token = reinterpret_cast<const int*>(base + ll_stage_offset(2));
    const auto* ids = reinterpret_cast<const int64_t*>(base + ll_stage_offset(3));
    h.recv_count.assign(count, count + L);
    h.recv_range.assign(range, range + L * W * 2);
    h.recv_src_token.assign(token, token + L * c_.low_latency_rows_per_expert());
    h.topk_idx.assign(ids, ids + static_cast<size_t>(num_tokens) * c_.top_k);
}

std::chrono::milliseconds CudaEngine::timeout_ms() const {
    return std::chrono::milliseconds(static_cast<long>(c_.timeout_s * 1000));
}

cudaStream_t CudaEngine::begin(const char* what) {
    MOERL_CHECK(!destroyed_, what, ": EP buffer used after destroy()");
    MOERL_CUDA_CHECK(cudaSetDevice(device_));
    const cudaStream_t stream = current_stream();
    throw_if_error(read_error(), c_, "cuda");
    return stream;
}

bool capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    MOERL_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    return status != cudaStreamCaptureStatusNone;
}

DeviceError CudaEngine::read_error() const {
    const volatile DeviceError* m = host_error_.get<DeviceError>();
    DeviceError e{};
    e.code = m->code;
    e.phase = m->phase;
    e.peer = m->peer;
    e.observed = m->observed;
    e.target = m->target;
    e.bad_input = m->bad_input;
    e.bad_token = m->bad_token;
    e.bad_k = m->bad_k;
    e.bad_value = m->bad_value;
    return e;
}

DeviceError CudaEngine::sync_error(cudaStream_t stream) {
    MOERL_CUDA_CHECK(cudaStreamSynchronize(stream));
    return read_error();
}

void CudaEngine::clear_bad_input(cudaStream_t stream) {
    MOERL_CUDA_CHECK(cudaMemsetAsync(&sig_.error->bad_input, 0, sizeof(int), stream));
    host_error_.get<DeviceError>()->bad_input = 0;
}

void CudaEngine::finish(cudaStream_t stream) {
    if (c_.async || capturing(stream)) return;  // errors surface through the mirror at the next call
    throw_if_error(sync_error(stream), c_, "cuda");
}

}  // namespace moerl::ep::cuda

namespace moerl::ep {

std::unique_ptr<Engine> make_cuda_engine(const Config& config, Store* store) {
    return std::make_unique<cuda::CudaEngine>(config, store);
}

}  // namespace moerl::ep
