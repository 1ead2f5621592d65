// The cuda engine: each rank's symmetric region is cudaMalloc'd and mapped by every peer of the node
// through CUDA IPC; kernels write rows straight into the peers' receive slots (NVLink between GPUs,
// plain stores when ranks share one) and signal with release/acquire flags (kernels/kernels.hpp).
//
// Streams and synchronisation. Work goes on cuda::current_stream() (stream.hpp; default: the legacy
// stream 0). Normal dispatch without a reused handle queues the layout kernel (which writes the counts
// straight into pinned host memory), an event and the data kernels, then waits for that event only,
// since the caller must learn R; the data kernels need nothing from the host. By default every call
// also synchronises at its end, fills the host vectors of the handle and reports device errors at
// once; MOERL_EP_CUDA_ASYNC=1 drops those end-of-call synchronisations and every device-to-host copy
// not needed to learn the counts (host vectors other than the counts then stay empty, send_pos too;
// errors surface at the next call). Device code that records an error also writes a host-mapped
// mirror of the error word, so no call copies it on the stream.
//
// Work per call with MOERL_EP_CUDA_ASYNC=1 (W = 1 with aligned outputs / y in brackets): dispatch 3
// kernels and one event wait [1 kernel and a spin on a word it writes to mapped memory once the counts
// are known, before its copy ends: no event, no driver call while the spin is short], 2 [1] with a
// reused handle; combine 2 kernels [1]; low-latency dispatch 3 kernels, combine 2. No memcpy or memset
// on the stream outside error paths, and no allocation: the device state of a released handle serves
// the next dispatch on its stream (NormalStateCache). With one rank and aligned outputs nothing
// crosses a slot: a fresh dispatch is one kernel (counts, rows and the permute; it also writes the
// handle's host vectors into mapped memory when the call synchronises), a dispatch with a reused
// handle is the send kernel without signals, and combine is one gather kernel (kernels/solo.cu).
//
// Rows a rank sends to itself skip its slot: normal dispatch writes them straight into the outputs and
// normal combine reads them straight from y, so the one-rank case is a single permute pass. While the stream
// is being captured nothing synchronises, so these pairs can be captured in a CUDA graph (host vectors empty,
// device state used):
//   - low_latency_dispatch + low_latency_combine (fixed shapes, counts travel with the data);
//   - dispatch(..., &reused_handle) + combine: the static layout of an earlier eager dispatch.
// A LowLatencyHandle is valid until the next low_latency_dispatch (its state lives in fixed buffers).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "builtin.hpp"
#include "engine_common.hpp"
#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"
#include "stream.hpp"

namespace moerl::ep {

namespace {

using namespace cuda;

// Byte offsets in the symmetric region: flags, then per channel W receive slots.
struct SymmetricLayout {
    size_t flags_bytes = 0;
    size_t slot_bytes[kNumDeviceChannels] = {};
    size_t recv_base[kNumDeviceChannels] = {};
    size_t ll_header_bytes = 0;
    size_t total = 0;

    explicit SymmetricLayout(const Config& c) {
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
};

class CudaEngine final : public Engine {
  public:
    CudaEngine(const Config& config, Store* store)
        : c_(config), store_(store), sym_(config), row_(make_row_layout(config)), rt_(make_routing(config)) {
        check_device_limits(c_, "cuda");
        const int W = c_.world_size;
        MOERL_CHECK(W == 1 || store_ != nullptr, "the cuda EP engine needs a bootstrap store for world_size ",
                    W);
        device_ = select_device(c_, "cuda");
        int sms = 0;
        MOERL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
        blocks_ = std::max(1, std::min(c_.num_sms, sms));
        async_ = env::get_int("MOERL_EP_CUDA_ASYNC", 0) != 0;
        read_solo_knobs();

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
        MOERL_CUDA_CHECK(
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_mirror), host_error_.get(), 0));
        MOERL_CUDA_CHECK(cudaEventCreateWithFlags(&counts_ready_, cudaEventDisableTiming));
        ll_ = std::make_unique<LowLatencyState>(c_);
        layout_ = std::make_unique<LayoutState>(c_, W == 1 ? std::max(blocks_, solo_blocks_) : 1);
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
                    sharing +=
                        std::memcmp(all[q].data() + kUuid, all[r].data() + kUuid, sizeof(prop.uuid)) == 0;
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
        MOERL_CUDA_CHECK(cudaMemcpy(tables_.get(), tables.data(), tables.size() * sizeof(uint8_t*),
                                    cudaMemcpyHostToDevice));
        auto* tbl = tables_.get<uint8_t*>();
        dst_dispatch_ = tbl + W;
        dst_combine_ = tbl + 2 * W;
        dst_ll_ = tbl + 3 * W;
        dst_llc_ = tbl + 4 * W;

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
    }

    ~CudaEngine() override {
        try {
            destroy();
        } catch (...) {
        }
    }

    std::string name() const override { return "cuda"; }
    bool on_device() const override { return true; }

    void destroy() override {
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

    Handle dispatch(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                    const DispatchOutput& out, const Handle* reuse) override {
        const cudaStream_t stream = begin("dispatch");
        const int W = c_.world_size;
        const int T = static_cast<int>(x.rows);
        check_alignment(x.data, "dispatch: x");
        Handle h;
        std::shared_ptr<NormalState> fresh;  // set while the counts of a new layout are on their way
        bool copy_pos = false;
        if (reuse != nullptr) {
            MOERL_CHECK(reuse->num_tokens == T, "dispatch: the reused handle was made for ",
                        reuse->num_tokens, " tokens, but x has ", T, " rows");
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
            copy_pos = !async_ && num_pos > 0;  // MOERL_EP_CUDA_ASYNC: device copy only
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

        DispatchSendArgs s{};
        s.rt = rt_;
        s.row = row_;
        s.x = x.data;
        s.topk_idx = topk_idx.data;
        s.topk_weights = topk_weights.data;
        s.send_pos = st.send_pos;
        s.num_tokens = T;
        s.dst = dst_dispatch_;
        s.sig = solo ? unsignalled_ : sig_;
        s.rank = c_.rank;
        s.recv_src_offset = st.recv_src_offset;
        if (self_direct) {
            s.self_recv_x = out.recv_x.data;
            s.self_recv_x_scales = out.recv_x_scales.data;
            s.self_recv_topk_idx = out.recv_topk_idx.data;
            s.self_recv_topk_weights = out.recv_topk_weights.data;
            s.self_recv_src_token = st.recv_src_token;
            s.self_max_rows = max_rows;
        }
        launch_dispatch_send(s, blocks_, stream);
        if (!solo) {
            DispatchRecvArgs r{};
            r.rt = rt_;
            r.row = row_;
            r.rank = c_.rank;
            r.src = region_.get<uint8_t>() + sym_.recv_base[kChDispatch];
            r.src_stride = sym_.slot_bytes[kChDispatch];
            r.recv_src_offset = st.recv_src_offset;
            r.recv_x = out.recv_x.data;
            r.recv_x_scales = out.recv_x_scales.data;
            r.recv_topk_idx = out.recv_topk_idx.data;
            r.recv_topk_weights = out.recv_topk_weights.data;
            r.recv_src_token = st.recv_src_token;
            r.max_rows = max_rows;
            r.send_blocks = blocks_;
            r.sig = sig_;
            r.skip_self = self_direct;
            launch_dispatch_recv(r, blocks_, stream);
        }
        MOERL_CUDA_CHECK(cudaGetLastError());

        std::string bad_input;
        if (fresh != nullptr) {
            MOERL_CUDA_CHECK(cudaEventSynchronize(counts_ready_));  // the layout and the send_pos copy
            const DeviceError err = read_error();
            if (copy_pos)
                h.send_pos.assign(stage_.get<int>(), stage_.get<int>() + static_cast<size_t>(T) * W);
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
        if (!async_ && !capturing(stream)) {
            const bool copy_tokens = reuse == nullptr && R > 0;
            if (copy_tokens)
                MOERL_CUDA_CHECK(cudaMemcpyAsync(stage_.get(), st.recv_src_token, R * sizeof(int),
                                                 cudaMemcpyDeviceToHost, stream));
            const DeviceError err = sync_error(stream);
            if (copy_tokens) std::memcpy(h.recv_src_token.data(), stage_.get(), R * sizeof(int));
            throw_if_error(err, c_, "cuda");
        } else if (reuse == nullptr) {
            h.recv_src_token.clear();  // device copy only (MOERL_EP_CUDA_ASYNC)
        }
        MOERL_CHECK(out.recv_x.rows >= R, "dispatch: recv_x has ", out.recv_x.rows, " rows, but ", R,
                    " arrive");
        if (!bad_input.empty()) MOERL_FAIL("dispatch: ", bad_input);
        return h;
    }

    void combine(View<const void> y, const Handle& h, View<void> out) override {
        const cudaStream_t stream = begin("combine");
        NormalState& st = normal_state(h, this, "combine");
        MOERL_CHECK(y.rows >= h.num_recv_tokens(), "combine: y has ", y.rows,
                    " rows, but the handle received ", h.num_recv_tokens());
        MOERL_CHECK(out.rows >= h.num_tokens, "combine: out has ", out.rows,
                    " rows, but the handle dispatched ", h.num_tokens, " tokens");
        // This rank's rows stay in y; the receive kernel reads them there. With one rank that is all
        // of them: one gather kernel, no signals.
        const bool self_direct =
            y.data != nullptr && (reinterpret_cast<uintptr_t>(y.data) & (c_.element_bytes() - 1)) == 0;
        if (c_.world_size == 1 && self_direct) {  // a gather by send_pos in one kernel (kernels/solo.cu)
            SoloCombineArgs a{};
            a.rt = rt_;
            a.y = y.data;
            a.send_pos = st.send_pos;
            a.num_tokens = h.num_tokens;
            a.tiles = solo_tiles(h.num_tokens, blocks_);
            a.out = out.data;
            launch_solo_combine(a, stream);
            MOERL_CUDA_CHECK(cudaGetLastError());
            finish(stream);
            return;
        }
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

    LowLatencyHandle low_latency_dispatch(View<const void> x, View<const int64_t> topk_idx,
                                          const LowLatencyOutput& out) override {
        const cudaStream_t stream = begin("low_latency_dispatch");
        check_alignment(x.data, "low_latency_dispatch: x");
        const int T = static_cast<int>(x.rows);
        LowLatencyHandle h;
        h.num_tokens = T;
        LLLayoutArgs a{};
        a.rt = rt_;
        a.topk_idx = topk_idx.data;
        a.num_tokens = T;
        a.topk32 = ll_->topk32;
        a.pos_in_expert = ll_->pos_in_expert;
        a.expert_count = ll_->expert_count;
        a.expert_offset = ll_->expert_offset;
        a.send_rows = ll_->send_rows;
        a.error = sig_.error;
        a.error_mirror = sig_.error_mirror;
        launch_ll_layout(a, stream);
        LLSendArgs s{};
        s.rt = rt_;
        s.row = row_;
        s.x = x.data;
        s.num_tokens = T;
        s.topk32 = ll_->topk32;
        s.pos_in_expert = ll_->pos_in_expert;
        s.expert_count = ll_->expert_count;
        s.expert_offset = ll_->expert_offset;
        s.dst = dst_ll_;
        s.header_bytes = sym_.ll_header_bytes;
        s.sig = sig_;
        launch_ll_send(s, blocks_, stream);
        LLRecvArgs r{};
        r.rt = rt_;
        r.row = row_;
        r.src = region_.get<uint8_t>() + sym_.recv_base[kChLLDispatch];
        r.src_stride = sym_.slot_bytes[kChLLDispatch];
        r.header_bytes = sym_.ll_header_bytes;
        r.rows_per_expert = c_.low_latency_rows_per_expert();
        r.recv_x = out.recv_x.data;
        r.recv_x_scales = out.recv_x_scales.data;
        r.out_recv_count = out.recv_count;
        r.recv_count = ll_->recv_count;
        r.recv_range = ll_->recv_range;
        r.slot_base = ll_->slot_base;
        r.recv_src_token = ll_->recv_src_token;
        r.send_blocks = blocks_;
        r.sig = sig_;
        launch_ll_recv(r, blocks_, stream);
        MOERL_CUDA_CHECK(cudaGetLastError());
        h.device_state = std::shared_ptr<void>(ll_.get(), [](void*) {});
        if (!async_ && !capturing(stream)) {
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

    void low_latency_combine(View<const void> y, View<const int64_t> /*topk_idx*/,
                             View<const float> topk_weights, const LowLatencyHandle& h,
                             View<void> out) override {
        const cudaStream_t stream = begin("low_latency_combine");
        MOERL_CHECK(h.device_state.get() == ll_.get(),
                    "low_latency_combine: the handle is not from a low_latency_dispatch of this buffer");
        LLCombineSendArgs s{};
        s.rt = rt_;
        s.y = y.data;
        s.rows_per_expert = c_.low_latency_rows_per_expert();
        s.recv_count = ll_->recv_count;
        s.recv_range = ll_->recv_range;
        s.slot_base = ll_->slot_base;
        s.dst = dst_llc_;
        s.row_stride = c_.combine_row_bytes();
        s.sig = sig_;
        launch_ll_combine_send(s, blocks_, stream);
        LLCombineRecvArgs r{};
        r.rt = rt_;
        r.src = region_.get<uint8_t>() + sym_.recv_base[kChLLCombine];
        r.src_stride = sym_.slot_bytes[kChLLCombine];
        r.row_stride = c_.combine_row_bytes();
        r.topk32 = ll_->topk32;
        r.topk_weights = topk_weights.data;
        r.pos_in_expert = ll_->pos_in_expert;
        r.expert_offset = ll_->expert_offset;
        r.num_tokens = h.num_tokens;
        r.out = out.data;
        r.send_blocks = blocks_;
        r.sig = sig_;
        launch_ll_combine_recv(r, blocks_, stream);
        MOERL_CUDA_CHECK(cudaGetLastError());
        finish(stream);
    }

  private:
    // One rank, a fresh layout, recv_x 16-byte aligned: one kernel counts, finds the rows and permutes
    // (kernels/solo.cu). The host learns the counts from mapped memory: after the whole call
    // (the default, which also takes send_pos and recv_src_token from mapped copies the kernel wrote), or
    // with MOERL_EP_CUDA_ASYNC as soon as the kernel published them, while it still copies rows.
    Handle dispatch_solo(View<const void> x, View<const int64_t> topk_idx, View<const float> topk_weights,
                         const DispatchOutput& out, cudaStream_t stream) {
        const int T = static_cast<int>(x.rows);
        const std::shared_ptr<NormalState> fresh = states_->take(stream);
        SoloDispatchArgs a{};
        a.rt = rt_;
        a.row = row_;
        a.x = x.data;
        a.topk_idx = topk_idx.data;
        a.topk_weights = topk_weights.data;
        a.num_tokens = T;
        a.tiles = solo_tiles(T, solo_blocks_);  // at most solo_blocks_: one tile_state word each
        // The kernel writes send_pos [T] and recv_src_token [R <= T] into the mapped copies.
        MOERL_CHECK(static_cast<size_t>(T) <= mapped_.solo_tokens, "dispatch: ", T,
                    " tokens, but the one-rank buffers hold ", mapped_.solo_tokens);
        a.seq = layout_->next(a.scratch, stream);
        a.send_pos = fresh->send_pos;
        a.recv_src_offset = fresh->recv_src_offset;
        a.recv_src_token = fresh->recv_src_token;
        if (!async_) {
            a.host_send_pos = reinterpret_cast<int*>(device_solo_ + mapped_.solo_offset[1]);
            a.host_recv_src_token = reinterpret_cast<int*>(device_solo_ + mapped_.solo_offset[2]);
        }
        a.summary = device_summaries_;
        a.counts_ready = reinterpret_cast<unsigned int*>(device_solo_ + mapped_.solo_offset[0]);
        a.recv_x = out.recv_x.data;
        a.recv_x_scales = out.recv_x_scales.data;
        a.recv_topk_idx = out.recv_topk_idx.data;
        a.recv_topk_weights = out.recv_topk_weights.data;
        a.max_rows = static_cast<int>(std::min<int64_t>(out.recv_x.rows, c_.max_recv_tokens()));
        a.error = sig_.error;
        a.error_mirror = sig_.error_mirror;
        a.tuning = solo_tuning_;
        a.trace = solo_trace_.get<unsigned long long>();
        launch_solo_dispatch(a, stream);
        if (a.trace != nullptr && !capturing(stream)) report_solo_trace(a.tiles, stream);
        if (async_) {
            wait_solo_counts(a.seq, stream);
        } else {
            MOERL_CUDA_CHECK(cudaGetLastError());
            MOERL_CUDA_CHECK(cudaStreamSynchronize(stream));
        }
        const DeviceError err = read_error();
        throw_if_error(err, c_, "cuda");
        std::string bad_input;
        if (has_bad_input(err)) {
            bad_input = bad_input_message(err, c_);
            clear_bad_input(stream);
            if (!async_) MOERL_CUDA_CHECK(cudaStreamSynchronize(stream));
        }
        Handle h;
        fill_counts(T, h);
        h.device_state = fresh;
        const int R = h.num_recv_tokens();
        MOERL_CHECK(R >= 0 && R <= T && h.num_send_per_rank[0] == R,
                    "dispatch: the one-rank kernel reported ", R, " rows (sent ", h.num_send_per_rank[0],
                    ") for ", T, " tokens");
        if (!async_) {
            const auto* base = host_solo_.get<uint8_t>();
            const auto* pos = reinterpret_cast<const int*>(base + mapped_.solo_offset[1]);
            const auto* tokens = reinterpret_cast<const int*>(base + mapped_.solo_offset[2]);
            h.send_pos.assign(pos, pos + T);
            h.recv_src_token.assign(tokens, tokens + R);
        }
        MOERL_CHECK(out.recv_x.rows >= R, "dispatch: recv_x has ", out.recv_x.rows, " rows, but ", R,
                    " arrive");
        if (!bad_input.empty()) MOERL_FAIL("dispatch: ", bad_input);
        return h;
    }

    // MOERL_EP_SOLO_TRACE=1: after each one-rank dispatch (waiting for it), one line on stderr with the
    // kernel's phases per tile, in microseconds from the first block's start: median and latest over
    // the tiles of the block start, the count published, the row offset known (look-back), the arrival
    // counted (the last block: summaries written), the last row written.
    void report_solo_trace(int tiles, cudaStream_t stream) {
        std::vector<unsigned long long> t(static_cast<size_t>(tiles) * kSoloTracePhases);
        MOERL_CUDA_CHECK(cudaMemcpyAsync(t.data(), solo_trace_.get(), t.size() * sizeof(t[0]),
                                         cudaMemcpyDeviceToHost, stream));
        MOERL_CUDA_CHECK(cudaStreamSynchronize(stream));
        unsigned long long first = ~0ull;
        for (int i = 0; i < tiles; ++i) first = std::min(first, t[static_cast<size_t>(i) * kSoloTracePhases]);
        std::string line = "moerl: one-rank dispatch, " + std::to_string(tiles) +
                           " tiles, us from the first start (median / latest):";
        const char* names[kSoloTracePhases] = {"start", "published", "offset", "arrived", "rows done"};
        for (int p = 0; p < kSoloTracePhases; ++p) {
            std::vector<double> v(tiles);
            for (int i = 0; i < tiles; ++i)
                v[i] = 1e-3 * static_cast<double>(t[static_cast<size_t>(i) * kSoloTracePhases + p] - first);
            std::sort(v.begin(), v.end());
            char part[96];
            std::snprintf(part, sizeof(part), " %s %.2f / %.2f%s", names[p], v[v.size() / 2], v.back(),
                          p + 1 < kSoloTracePhases ? "," : "");
            line += part;
        }
        std::fprintf(stderr, "%s\n", line.c_str());
    }

    // Spins on the mapped word until the one-rank dispatch kernel of call `seq` has published its
    // counts. Only a wait of more than kSpinsPerQuery reads asks the driver anything: whether the launch
    // failed, and whether the stream ran dry (the kernel failed or ended without publishing).
    void wait_solo_counts(unsigned int seq, cudaStream_t stream) {
        constexpr unsigned kSpinsPerQuery = 4096;
        std::atomic_ref<unsigned int> ready(*reinterpret_cast<unsigned int*>(host_solo_.get<uint8_t>()));
        for (unsigned spins = 1; ready.load(std::memory_order_acquire) != seq; ++spins) {
            if (spins % kSpinsPerQuery != 0) continue;
            MOERL_CUDA_CHECK(cudaGetLastError());
            const cudaError_t done = cudaStreamQuery(stream);
            if (done == cudaErrorNotReady) continue;
            MOERL_CUDA_CHECK(done);
            MOERL_CHECK(ready.load(std::memory_order_acquire) == seq,
                        "dispatch: the one-rank dispatch kernel ended without publishing its counts");
        }
    }

    // The handle's counts from the summaries in mapped memory (the layout kernel's or the one-rank
    // dispatch kernel's, once they are final).
    void fill_counts(int num_tokens, Handle& h) const {
        const int W = c_.world_size, L = c_.num_local_experts();
        const int* sent = host_summaries_.get<int>();
        fill_handle_counts(sent, sent + mapped_.summary_ints, W, L, num_tokens, h);
    }

    // Blocks (tiles) of the one-rank kernels: `blocks` (one tile_state word each), or one per token when
    // there are fewer tokens; the tokens are split evenly (kernels.hpp), so no block idles while another
    // copies a tile one token longer than the rest.
    static int solo_tiles(int num_tokens, int blocks) { return std::max(1, std::min(num_tokens, blocks)); }

    // Knobs of the one-rank dispatch, for finding its fastest variant on a GPU (scripts/ep_solo_sweep.sh).
    // Every accepted value gives the same result; a value out of range keeps the default, with a warning.
    // - MOERL_EP_SOLO_BLOCKS: blocks (tiles), 1..kMaxSoloBlocks; 0 (default): blocks_ as every kernel. Blocks
    //   need not be resident at once: a block waits a bounded time for an earlier tile's count, then
    //   counts that tile itself.
    // - MOERL_EP_SOLO_PREFETCH: rows of each tile asked into L2 while its block counts, >= 0 (default 16).
    // - MOERL_EP_SOLO_WARPS_PER_ROW: warps that share a row, 1..16; 0 (default): one, or more while a tile
    //   has fewer rows than the block has warps.
    // - MOERL_EP_SOLO_UNROLL: 16-byte loads in flight per lane, 4, 8 or 16 (default; 32 spilled registers
    //   and was slower: 55.3 against 50.0 us, 4096 tokens on an H200).
    // - MOERL_EP_SOLO_CACHE: bit 0 loads of x, bit 1 stores to recv_x evict first, 0..3 (default 0).
    // - MOERL_EP_SOLO_LOOKBACK_NS: how long a block waits for an earlier tile's count before it counts
    //   that tile itself, 0..1e9 (default 20000).
    // - MOERL_EP_SOLO_TRACE: 1 = time the kernel's phases and print them after each call (waits for the
    //   kernel; report_solo_trace), 0 (default) = off.
    void read_solo_knobs() {
        auto knob = [](const char* name, int fallback, long lo, long hi) {
            const long v = env::get_int(name, fallback);
            if (v >= lo && v <= hi) return static_cast<int>(v);
            std::fprintf(stderr, "moerl: %s = %ld is outside [%ld, %ld]; using %d\n", name, v, lo, hi,
                         fallback);
            return fallback;
        };
        const int blocks = knob("MOERL_EP_SOLO_BLOCKS", 0, 0, kMaxSoloBlocks);
        solo_blocks_ = blocks > 0 ? blocks : blocks_;
        solo_tuning_.prefetch_rows = knob("MOERL_EP_SOLO_PREFETCH", solo_tuning_.prefetch_rows, 0, 1 << 30);
        solo_tuning_.warps_per_row =
            knob("MOERL_EP_SOLO_WARPS_PER_ROW", solo_tuning_.warps_per_row, 0, kDataThreads / 32);
        const int unroll = knob("MOERL_EP_SOLO_UNROLL", solo_tuning_.unroll, 4, 16);
        if (unroll == 4 || unroll == 8 || unroll == 16)
            solo_tuning_.unroll = unroll;
        else
            std::fprintf(stderr, "moerl: MOERL_EP_SOLO_UNROLL = %d is not 4, 8 or 16; using %d\n", unroll,
                         solo_tuning_.unroll);
        solo_tuning_.cache = knob("MOERL_EP_SOLO_CACHE", solo_tuning_.cache, 0, 3);
        solo_tuning_.lookback_ns = knob("MOERL_EP_SOLO_LOOKBACK_NS", solo_tuning_.lookback_ns, 0, 1000000000);
        if (knob("MOERL_EP_SOLO_TRACE", 0, 0, 1) == 1)
            solo_trace_ = DeviceMemory(sizeof(unsigned long long) * kMaxSoloBlocks * kSoloTracePhases);
    }

    static bool aligned16(const void* p) {
        return p != nullptr && (reinterpret_cast<uintptr_t>(p) & 15) == 0;
    }

    // Pinned staging of the handles' host vectors, LL layout: recv_count [L], recv_range [L, W, 2],
    // recv_src_token [L, rows_per_expert], topk_idx [T, K] int64 (each 16-byte aligned). Normal mode
    // uses it for send_pos [T, W] and recv_src_token [R], one at a time.
    size_t ll_stage_offset(int i) const {
        const size_t W = c_.world_size, L = c_.num_local_experts();
        const size_t sizes[4] = {L * sizeof(int), L * W * 2 * sizeof(int),
                                 L * c_.low_latency_rows_per_expert() * sizeof(int),
                                 static_cast<size_t>(c_.max_tokens_per_rank) * c_.top_k * sizeof(int64_t)};
        size_t off = 0;
        for (int j = 0; j < i; ++j) off += align16(sizes[j]);
        return off;
    }
    size_t staging_bytes() const {
        const size_t normal = std::max(static_cast<size_t>(c_.max_tokens_per_rank) * c_.world_size,
                                       static_cast<size_t>(c_.max_recv_tokens())) *
                              sizeof(int);
        return std::max(normal, ll_stage_offset(4));
    }

    // Queues the device-to-host copies of a low-latency handle; fill_low_latency_handle after a sync.
    void stage_low_latency_handle(const int64_t* topk_idx, int num_tokens, cudaStream_t stream) {
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

    void fill_low_latency_handle(int num_tokens, LowLatencyHandle& h) const {
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

    std::chrono::milliseconds timeout_ms() const {
        return std::chrono::milliseconds(static_cast<long>(c_.timeout_s * 1000));
    }

    // Common start of every call: the stream, and any error an earlier asynchronous call left behind.
    cudaStream_t begin(const char* what) {
        MOERL_CHECK(!destroyed_, what, ": EP buffer used after destroy()");
        MOERL_CUDA_CHECK(cudaSetDevice(device_));
        const cudaStream_t stream = current_stream();
        throw_if_error(read_error(), c_, "cuda");
        return stream;
    }

    static bool capturing(cudaStream_t stream) {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        MOERL_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
        return status != cudaStreamCaptureStatusNone;
    }

    static void check_alignment(const void* p, const char* what) {
        MOERL_CHECK((reinterpret_cast<uintptr_t>(p) & 15) == 0, what,
                    " must be 16-byte aligned on the device");
    }

    // The host-mapped mirror of the error word, as of now (the device may be writing it: field by field).
    DeviceError read_error() const {
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

    DeviceError sync_error(cudaStream_t stream) {
        MOERL_CUDA_CHECK(cudaStreamSynchronize(stream));
        return read_error();
    }

    // After the host reported bad input: the device word is cleared in stream order, the mirror now (no
    // kernel that could report is running: the caller has synchronised with the layout).
    void clear_bad_input(cudaStream_t stream) {
        MOERL_CUDA_CHECK(cudaMemsetAsync(&sig_.error->bad_input, 0, sizeof(int), stream));
        host_error_.get<DeviceError>()->bad_input = 0;
    }

    void finish(cudaStream_t stream) {
        if (async_ || capturing(stream)) return;  // errors surface through the mirror at the next call
        throw_if_error(sync_error(stream), c_, "cuda");
    }

    Config c_;
    Store* store_;
    SymmetricLayout sym_;
    RowLayout row_;
    Routing rt_;
    int device_ = 0;
    int blocks_ = 1;
    bool async_ = false;
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
    static constexpr int kMaxSoloBlocks = 4096;
    int solo_blocks_ = 1;                 // blocks of the one-rank dispatch kernel (read_solo_knobs())
    SoloTuning solo_tuning_;              // how it copies rows (read_solo_knobs())
    DeviceMemory solo_trace_;             // phase times [kMaxSoloBlocks, kSoloTracePhases] when traced
    cudaEvent_t counts_ready_ = nullptr;  // after the layout of the running dispatch
    std::unique_ptr<LayoutState> layout_;
    PinnedMemory stage_;            // device-to-host copies of handle vectors (staging_bytes())
    cudaMemPool_t pool_ = nullptr;  // NormalState blocks; keeps its memory across synchronisations
    std::shared_ptr<NormalStateCache> states_;  // NormalStates of released handles, for the next dispatch
    std::unique_ptr<LowLatencyState> ll_;
    std::vector<uint8_t*> peers_;
    uint8_t* const* dst_dispatch_ = nullptr;
    uint8_t* const* dst_combine_ = nullptr;
    uint8_t* const* dst_ll_ = nullptr;
    uint8_t* const* dst_llc_ = nullptr;
    Signals sig_;
    Signals unsignalled_;  // sig_ without peers: one rank, nothing crossing a slot
};

}  // namespace

std::unique_ptr<Engine> make_cuda_engine(const Config& config, Store* store) {
    return std::make_unique<CudaEngine>(config, store);
}

}  // namespace moerl::ep
