#include "engine_common.hpp"

#include <algorithm>

#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"

namespace moerl::ep::cuda {

void check_device_limits(const Config& c, const char* engine) {
    const int slots = c.world_size * c.num_local_experts();
    MOERL_CHECK(c.world_size <= kMaxRanks, "the ", engine, " EP engine supports at most ", kMaxRanks,
                " ranks, Config.world_size = ", c.world_size);
    MOERL_CHECK(slots <= kMaxExperts, "the ", engine, " EP engine supports at most ", kMaxExperts,
                " experts (world_size x local experts), got ", slots);
    MOERL_CHECK(c.max_tokens_per_rank < (1 << 30), "the ", engine,
                " EP engine supports max_tokens_per_rank < 2^30, got ", c.max_tokens_per_rank);
    MOERL_CHECK(slots <= kMaxExpertSlots, "the ", engine,
                " EP engine supports world_size x local experts <= ", kMaxExpertSlots,
                " in low-latency mode, got ", slots);
}

int select_device(const Config& c, const char* engine) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    MOERL_CHECK(err == cudaSuccess && count > 0, "the ", engine, " EP engine needs a CUDA device, but ",
                err == cudaSuccess ? std::string("none is visible") : std::string(cudaGetErrorString(err)));
    long dev = c.device;
    if (dev < 0) dev = env::get_int("MOERL_EP_DEVICE", -1);
    if (dev < 0) dev = env::get_int("LOCAL_RANK", c.rank);
    const int device = static_cast<int>(dev % count);
    MOERL_CUDA_CHECK(cudaSetDevice(device));
    return device;
}

NormalState::NormalState(const void* o, cudaStream_t s, int num_tokens, int world, int max_recv,
                         cudaMemPool_t pool)
    : owner(o), stream(s) {
    const size_t pos_bytes = align256(static_cast<size_t>(std::max(num_tokens, 1)) * world * sizeof(int));
    const size_t off_bytes = align256((world + 1) * sizeof(int));
    const size_t tok_bytes = align256(static_cast<size_t>(std::max(max_recv, 1)) * sizeof(int));
    if (pool != nullptr)
        MOERL_CUDA_CHECK(cudaMallocFromPoolAsync(&block_, pos_bytes + off_bytes + tok_bytes, pool, stream));
    else
        MOERL_CUDA_CHECK(cudaMallocAsync(&block_, pos_bytes + off_bytes + tok_bytes, stream));
    auto* base = static_cast<uint8_t*>(block_);
    send_pos = reinterpret_cast<int*>(base);
    recv_src_offset = reinterpret_cast<int*>(base + pos_bytes);
    recv_src_token = reinterpret_cast<int*>(base + pos_bytes + off_bytes);
}

NormalState::~NormalState() {
    if (block_ != nullptr) cudaFreeAsync(block_, stream);  // after the work queued on its stream
}

std::shared_ptr<NormalState> NormalStateCache::take(cudaStream_t stream) {
    std::unique_ptr<NormalState> s;
    {
        std::lock_guard lock(mu_);
        for (size_t i = kept_.size(); i-- > 0;) {
            if (kept_[i]->stream != stream) continue;
            s = std::move(kept_[i]);
            kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(i));
            break;
        }
    }
    if (s == nullptr)
        s = std::make_unique<NormalState>(owner_, stream, max_tokens_, world_, max_recv_, pool_);
    auto self = shared_from_this();
    return std::shared_ptr<NormalState>(s.release(), [self](NormalState* p) { self->give_back(p); });
}

void NormalStateCache::give_back(NormalState* p) {
    std::unique_ptr<NormalState> s(p), dropped;
    std::lock_guard lock(mu_);
    if (closed_) return;             // s frees its block
    if (kept_.size() == kMaxKept) {  // the oldest goes
        dropped = std::move(kept_.front());
        kept_.erase(kept_.begin());
    }
    kept_.push_back(std::move(s));
}

void NormalStateCache::close() {
    std::vector<std::unique_ptr<NormalState>> kept;
    std::lock_guard lock(mu_);
    closed_ = true;
    kept.swap(kept_);
}

NormalState& normal_state(const Handle& h, const void* owner, const char* what) {
    auto* s = static_cast<NormalState*>(h.device_state.get());
    MOERL_CHECK(s != nullptr && s->owner == owner, what,
                ": the handle was not made by a dispatch of this buffer");
    return *s;
}

void fill_handle_counts(const int* sent, const int* got, int W, int L, int num_tokens, Handle& h) {
    h.num_tokens = num_tokens;
    h.num_send_per_rank.resize(W);
    h.num_recv_per_src.resize(W);
    h.num_recv_tokens_per_expert.assign(L, 0);
    h.recv_src_offset.assign(W + 1, 0);
    for (int r = 0; r < W; ++r) {
        h.num_send_per_rank[r] = sent[r * (1 + L)];
        h.num_recv_per_src[r] = got[r * (1 + L)];
        h.recv_src_offset[r + 1] = h.recv_src_offset[r] + h.num_recv_per_src[r];
        for (int l = 0; l < L; ++l) h.num_recv_tokens_per_expert[l] += got[r * (1 + L) + 1 + l];
    }
}

LayoutState::LayoutState(const Config& c, int min_tiles) {
    const size_t W = c.world_size, L = c.num_local_experts();
    const size_t tiles = (static_cast<size_t>(c.max_tokens_per_rank) + kLayoutTile - 1) / kLayoutTile;
    const size_t words =
        std::max(std::max<size_t>(tiles, 1) * W, static_cast<size_t>(std::max(min_tiles, 1)));
    tile_state_bytes_ = align256(words * sizeof(unsigned long long));
    const size_t total_bytes = align256(W * L * sizeof(int));
    const size_t rank_bytes = align256(W * sizeof(int));
    memory_ = DeviceMemory(tile_state_bytes_ + total_bytes + rank_bytes + align256(2 * sizeof(unsigned)));
    auto* base = memory_.get<uint8_t>();
    scratch_.tile_state = reinterpret_cast<unsigned long long*>(base);
    scratch_.expert_total = reinterpret_cast<int*>(base + tile_state_bytes_);
    scratch_.rank_total = reinterpret_cast<int*>(base + tile_state_bytes_ + total_bytes);
    scratch_.counters = reinterpret_cast<unsigned*>(base + tile_state_bytes_ + total_bytes + rank_bytes);
}

unsigned int LayoutState::next(LayoutScratch& scratch, cudaStream_t stream) {
    if (++seq_ == 0) {  // after 2^32 calls: clear the tags so that no stale word can match seq 1 again
        MOERL_CUDA_CHECK(cudaMemsetAsync(scratch_.tile_state, 0, tile_state_bytes_, stream));
        seq_ = 1;
    }
    scratch = scratch_;
    return seq_;
}

LowLatencyState::LowLatencyState(const Config& c) {
    const size_t W = c.world_size, L = c.num_local_experts(),
                 TK = static_cast<size_t>(c.max_tokens_per_rank) * c.top_k;
    const size_t rows = L * c.low_latency_rows_per_expert();
    const size_t sizes[] = {TK, TK, W * L, W * L, W, L, L * W * 2, L * W, rows};
    size_t total = 0;
    for (size_t n : sizes) total += align256(n * sizeof(int));
    memory = DeviceMemory(total);
    int** fields[] = {&topk32,     &pos_in_expert, &expert_count, &expert_offset, &send_rows,
                      &recv_count, &recv_range,    &slot_base,    &recv_src_token};
    auto* base = memory.get<uint8_t>();
    for (int i = 0; i < 9; ++i) {
        *fields[i] = reinterpret_cast<int*>(base);
        base += align256(sizes[i] * sizeof(int));
    }
}

DispatchSendArgs dispatch_send_args(const Routing& rt, const RowLayout& row, const void* x,
                                    const int64_t* topk_idx, const float* topk_weights, int num_tokens,
                                    const NormalState& st, uint8_t* const* dst, const Signals& sig) {
    return DispatchSendArgs{.rt = rt,
                            .row = row,
                            .x = x,
                            .topk_idx = topk_idx,
                            .topk_weights = topk_weights,
                            .send_pos = st.send_pos,
                            .num_tokens = num_tokens,
                            .dst = dst,
                            .sig = sig};
}

DispatchRecvArgs dispatch_recv_args(const Routing& rt, const RowLayout& row, int rank, const uint8_t* src,
                                    size_t src_stride, const NormalState& st, const DispatchOutput& out,
                                    int max_rows, int send_blocks, const Signals& sig) {
    return DispatchRecvArgs{.rt = rt,
                            .row = row,
                            .rank = rank,
                            .src = src,
                            .src_stride = src_stride,
                            .recv_src_offset = st.recv_src_offset,
                            .recv_x = out.recv_x.data,
                            .recv_x_scales = out.recv_x_scales.data,
                            .recv_topk_idx = out.recv_topk_idx.data,
                            .recv_topk_weights = out.recv_topk_weights.data,
                            .recv_src_token = st.recv_src_token,
                            .max_rows = max_rows,
                            .send_blocks = send_blocks,
                            .sig = sig};
}

void LowLatencyKernels::dispatch_send(const void* x, const int64_t* topk_idx, int num_tokens,
                                      cudaStream_t stream) const {
    const LLLayoutArgs a{.rt = rt_,
                         .topk_idx = topk_idx,
                         .num_tokens = num_tokens,
                         .topk32 = state_.topk32,
                         .pos_in_expert = state_.pos_in_expert,
                         .expert_count = state_.expert_count,
                         .expert_offset = state_.expert_offset,
                         .send_rows = state_.send_rows,
                         .error = sig_.error,
                         .error_mirror = sig_.error_mirror};
    launch_ll_layout(a, stream);
    const LLSendArgs s{.rt = rt_,
                       .row = row_,
                       .x = x,
                       .num_tokens = num_tokens,
                       .topk32 = state_.topk32,
                       .pos_in_expert = state_.pos_in_expert,
                       .expert_count = state_.expert_count,
                       .expert_offset = state_.expert_offset,
                       .dst = slots_.dispatch_dst,
                       .header_bytes = slots_.header_bytes,
                       .sig = sig_};
    launch_ll_send(s, blocks_, stream);
}

void LowLatencyKernels::dispatch_recv(const LowLatencyOutput& out, cudaStream_t stream) const {
    const LLRecvArgs r{.rt = rt_,
                       .row = row_,
                       .src = slots_.dispatch_src,
                       .src_stride = slots_.dispatch_stride,
                       .header_bytes = slots_.header_bytes,
                       .rows_per_expert = rows_per_expert_,
                       .recv_x = out.recv_x.data,
                       .recv_x_scales = out.recv_x_scales.data,
                       .out_recv_count = out.recv_count,
                       .recv_count = state_.recv_count,
                       .recv_range = state_.recv_range,
                       .slot_base = state_.slot_base,
                       .recv_src_token = state_.recv_src_token,
                       .send_blocks = blocks_,
                       .sig = sig_};
    launch_ll_recv(r, blocks_, stream);
}

void LowLatencyKernels::combine_send(const void* y, cudaStream_t stream) const {
    const LLCombineSendArgs s{.rt = rt_,
                              .y = y,
                              .rows_per_expert = rows_per_expert_,
                              .recv_count = state_.recv_count,
                              .recv_range = state_.recv_range,
                              .slot_base = state_.slot_base,
                              .dst = slots_.combine_dst,
                              .row_stride = slots_.combine_row_bytes,
                              .sig = sig_};
    launch_ll_combine_send(s, blocks_, stream);
}

void LowLatencyKernels::combine_recv(const float* topk_weights, int num_tokens, void* out,
                                     cudaStream_t stream) const {
    const LLCombineRecvArgs r{.rt = rt_,
                              .src = slots_.combine_src,
                              .src_stride = slots_.combine_stride,
                              .row_stride = slots_.combine_row_bytes,
                              .topk32 = state_.topk32,
                              .topk_weights = topk_weights,
                              .pos_in_expert = state_.pos_in_expert,
                              .expert_offset = state_.expert_offset,
                              .num_tokens = num_tokens,
                              .out = out,
                              .send_blocks = blocks_,
                              .sig = sig_};
    launch_ll_combine_recv(r, blocks_, stream);
}

void copy_low_latency_handle(const Config& c, const LowLatencyState& s, const int64_t* topk_idx,
                             int num_tokens, LowLatencyHandle& h, cudaStream_t stream) {
    const int W = c.world_size, L = c.num_local_experts(), K = c.top_k;
    h.recv_count.resize(L);
    h.recv_range.resize(static_cast<size_t>(L) * W * 2);
    h.recv_src_token.resize(static_cast<size_t>(L) * c.low_latency_rows_per_expert());
    h.topk_idx.resize(static_cast<size_t>(num_tokens) * K);
    MOERL_CUDA_CHECK(
        cudaMemcpyAsync(h.recv_count.data(), s.recv_count, L * sizeof(int), cudaMemcpyDeviceToHost, stream));
    MOERL_CUDA_CHECK(cudaMemcpyAsync(h.recv_range.data(), s.recv_range, h.recv_range.size() * sizeof(int),
                                     cudaMemcpyDeviceToHost, stream));
    MOERL_CUDA_CHECK(cudaMemcpyAsync(h.recv_src_token.data(), s.recv_src_token,
                                     h.recv_src_token.size() * sizeof(int), cudaMemcpyDeviceToHost, stream));
    if (num_tokens > 0)
        MOERL_CUDA_CHECK(cudaMemcpyAsync(h.topk_idx.data(), topk_idx, h.topk_idx.size() * sizeof(int64_t),
                                         cudaMemcpyDeviceToHost, stream));
}

namespace {
const char* channel_name(int ch) {
    switch (ch) {
        case kChCount:
            return "dispatch/notify";
        case kChDispatch:
            return "dispatch/data";
        case kChCombine:
            return "combine/data";
        case kChLLDispatch:
            return "low_latency_dispatch/data";
        case kChLLCombine:
            return "low_latency_combine/data";
    }
    return "?";
}
}  // namespace

bool has_bad_input(const DeviceError& e) { return e.bad_input != 0; }

std::string bad_input_message(const DeviceError& e, const Config& c) {
    return detail::concat("topk_idx[", e.bad_token, ",", e.bad_k, "] = ", e.bad_value,
                          ", but num_experts = ", c.num_experts, " (valid: -1..", c.num_experts - 1,
                          "); the entry was dropped on the device");
}

void throw_if_error(const DeviceError& e, const Config& c, const char* engine) {
    if (e.code == kErrTimeout) {
        const int ch = e.phase / 2;
        const bool slot = e.phase % 2 == 1;
        throw TimeoutError(
            detail::concat("rank ", c.rank, ": timed out in ", channel_name(ch), " after ", c.timeout_s,
                           " s ", slot ? "waiting for rank " : "waiting for data from rank ", e.peer,
                           slot ? " to release its receive slot" : "", " (", engine, ", signal ", e.observed,
                           " of ", e.target, "); this buffer is unusable now, destroy it"),
            __FILE__, __LINE__);
    }
    if (e.code != 0) MOERL_FAIL("rank ", c.rank, ": ", engine, " engine device error code ", e.code);
}

}  // namespace moerl::ep::cuda
