// The cuda engine's one-rank fast path (cuda_engine.hpp): with one rank and aligned outputs nothing
// crosses a slot, so a fresh dispatch is one kernel and combine one gather (kernels/solo.cu).
#include <algorithm>
#include <atomic>
#include <string>

#include "cuda_engine.hpp"
#include "moerl/core/error.hpp"

namespace moerl::ep::cuda {

// The host learns the counts from mapped memory: after the whole call (the default, which also takes
// send_pos and recv_src_token from mapped copies the kernel wrote), or with Config.async as soon as the
// kernel published them, while it still copies rows.
Handle CudaEngine::dispatch_solo(View<const void> x, View<const int64_t> topk_idx,
                                 View<const float> topk_weights, const DispatchOutput& out,
                                 cudaStream_t stream) {
    const int T = static_cast<int>(x.rows);
    const std::shared_ptr<NormalState> fresh = states_->take(stream);
    // The kernel writes send_pos [T] and recv_src_token [R <= T] into the mapped copies.
    MOERL_CHECK(static_cast<size_t>(T) <= mapped_.solo_tokens, "dispatch: ", T,
                " tokens, but the one-rank buffers hold ", mapped_.solo_tokens);
    auto* host_send_pos = reinterpret_cast<int*>(device_solo_ + mapped_.solo_offset[1]);
    auto* host_recv_src_token = reinterpret_cast<int*>(device_solo_ + mapped_.solo_offset[2]);
    SoloDispatchArgs a{.rt = rt_,
                       .row = row_,
                       .x = x.data,
                       .topk_idx = topk_idx.data,
                       .topk_weights = topk_weights.data,
                       .num_tokens = T,
                       .tiles = solo_tiles(T, blocks_),  // at most blocks_: one tile_state word each
                       .send_pos = fresh->send_pos,
                       .recv_src_offset = fresh->recv_src_offset,
                       .recv_src_token = fresh->recv_src_token,
                       .host_send_pos = c_.async ? nullptr : host_send_pos,
                       .host_recv_src_token = c_.async ? nullptr : host_recv_src_token,
                       .summary = device_summaries_,
                       .counts_ready = reinterpret_cast<unsigned int*>(device_solo_ + mapped_.solo_offset[0]),
                       .recv_x = out.recv_x.data,
                       .recv_x_scales = out.recv_x_scales.data,
                       .recv_topk_idx = out.recv_topk_idx.data,
                       .recv_topk_weights = out.recv_topk_weights.data,
                       .max_rows = static_cast<int>(std::min<int64_t>(out.recv_x.rows, c_.max_recv_tokens())),
                       .error = sig_.error,
                       .error_mirror = sig_.error_mirror};
    a.seq = layout_->next(a.scratch, stream);
    launch_solo_dispatch(a, stream);
    if (c_.async) {
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
        if (!c_.async) MOERL_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    Handle h;
    fill_counts(T, h);
    h.device_state = fresh;
    const int R = h.num_recv_tokens();
    MOERL_CHECK(R >= 0 && R <= T && h.num_send_per_rank[0] == R, "dispatch: the one-rank kernel reported ", R,
                " rows (sent ", h.num_send_per_rank[0], ") for ", T, " tokens");
    if (!c_.async) {
        const auto* base = host_solo_.get<uint8_t>();
        const auto* pos = reinterpret_cast<const int*>(base + mapped_.solo_offset[1]);
        const auto* tokens = reinterpret_cast<const int*>(base + mapped_.solo_offset[2]);
        h.send_pos.assign(pos, pos + T);
        h.recv_src_token.assign(tokens, tokens + R);
    }
    MOERL_CHECK(out.recv_x.rows >= R, "dispatch: recv_x has ", out.recv_x.rows, " rows, but ", R, " arrive");
    if (!bad_input.empty()) MOERL_FAIL("dispatch: ", bad_input);
    return h;
}

// Spins on the mapped word until the one-rank dispatch kernel of call `seq` has published its
// counts. Only a wait of more than kSpinsPerQuery reads asks the driver anything: whether the launch
// failed, and whether the stream ran dry (the kernel failed or ended without publishing).
void CudaEngine::wait_solo_counts(unsigned int seq, cudaStream_t stream) {
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

void CudaEngine::combine_solo(View<const void> y, const Handle& h, const NormalState& st, View<void> out,
                              cudaStream_t stream) {
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
}

}  // namespace moerl::ep::cuda
