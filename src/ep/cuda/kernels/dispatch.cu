// Normal-mode dispatch: send (rows written into every destination's slot, in send_pos order) and
// receive (slot rows unpacked into the caller's outputs in source-rank order).
#include "common.cuh"

namespace moerl::ep::cuda {

namespace {

__global__ void __launch_bounds__(kDataThreads) dispatch_send_kernel(DispatchSendArgs a) {
    const Routing rt = a.rt;
    const RowLayout rl = a.row;
    const int W = rt.world, K = rt.top_k, L = rt.num_local_experts, lane = threadIdx.x & 31;
    const size_t x_row_bytes = row_bytes_of(rt);
    const int num_scales = rt.hidden / kFp8Cols;
    const int self = a.self_recv_x != nullptr ? a.rank : -1;
    const int self_first = self >= 0 ? a.recv_src_offset[self] : 0;
    const unsigned long long epoch = current_epoch(a.sig, kChDispatch);
    if (!block_wait_slots_free(a.sig, kChDispatch, epoch)) return;
    for (int t = global_warp(); t < a.num_tokens; t += num_warps()) {
        // Lane k holds entry k: the global expert id (-1 when none or out of range) and its weight.
        int id = -1;
        float w = 0.0f;
        if (lane < K) {
            if (a.topk_idx != nullptr) {
                const long long e = a.topk_idx[static_cast<size_t>(t) * K + lane];
                id = e >= 0 && e < rt.num_experts ? static_cast<int>(e) : -1;
            }
            if (a.topk_weights != nullptr) w = a.topk_weights[static_cast<size_t>(t) * K + lane];
        }
        const uint8_t* x_row = static_cast<const uint8_t*>(a.x) + static_cast<size_t>(t) * x_row_bytes;
        for (int base = 0; base < W; base += 32) {
            // Lane j: destination rank base + j, the token's row p there, and where its data goes:
            // dst[r] + p * row_bytes (the slot of this rank at r), or output row self_first + p.
            const int r = base + lane;
            const int pos = r < W ? a.send_pos[static_cast<size_t>(t) * W + r] : -1;
            uint8_t* data = nullptr;
            if (pos >= 0) {
                if (r == self) {
                    const int i = self_first + pos;
                    if (i < a.self_max_rows)  // rows past it are dropped; the host reports the short output
                        data = static_cast<uint8_t*>(a.self_recv_x) + static_cast<size_t>(i) * rl.data_bytes;
                } else {
                    data = a.dst[r] + static_cast<size_t>(pos) * rl.row_bytes;
                }
            }
            if (!rt.fp8) {
                warp_copy_fanout(data, x_row, static_cast<int>(x_row_bytes), lane);
            } else {
                // Scales: beside the row in a peer's slot, or the caller's scale output for this rank.
                float* scales = nullptr;
                if (data != nullptr && r != self)
                    scales = reinterpret_cast<float*>(data + rl.scales_off);
                else if (data != nullptr && a.self_recv_x_scales != nullptr)
                    scales = a.self_recv_x_scales + static_cast<size_t>(self_first + pos) * num_scales;
                warp_quantize_fanout(data, scales, reinterpret_cast<const __nv_bfloat16*>(x_row), rt.hidden,
                                     lane);
            }
            for (unsigned dests = __ballot_sync(kFullMask, data != nullptr); dests != 0; dests &= dests - 1) {
                const int j = __ffs(dests) - 1;
                const int p = __shfl_sync(kFullMask, pos, j);
                auto* d = reinterpret_cast<uint8_t*>(
                    __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(data), j));
                if (base + j == self) {
                    const int i = self_first + p;
                    if (lane < K) {
                        const int local = id - self * L;
                        const bool mine = id >= 0 && local >= 0 && local < L;
                        if (a.self_recv_topk_idx != nullptr)
                            a.self_recv_topk_idx[static_cast<size_t>(i) * K + lane] = mine ? local : -1;
                        if (a.self_recv_topk_weights != nullptr)
                            a.self_recv_topk_weights[static_cast<size_t>(i) * K + lane] = mine ? w : 0.0f;
                    }
                    if (lane == 0) a.self_recv_src_token[i] = t;
                } else {
                    // d: row p of this rank's slot at rank base + j
                    if (lane < K) {
                        reinterpret_cast<int*>(d + rl.ids_off)[lane] = id;
                        reinterpret_cast<float*>(d + rl.weights_off)[lane] = w;
                    }
                    if (lane == 0) *reinterpret_cast<int*>(d + rl.token_off) = t;
                }
            }
        }
    }
    block_signal_data(a.sig, kChDispatch);
}

__global__ void __launch_bounds__(kDataThreads) dispatch_recv_kernel(DispatchRecvArgs a) {
    const Routing rt = a.rt;
    const RowLayout rl = a.row;
    const int W = rt.world, K = rt.top_k, L = rt.num_local_experts, lane = threadIdx.x & 31;
    const unsigned long long epoch = current_epoch(a.sig, kChDispatch);
    if (!block_wait_data(a.sig, kChDispatch, epoch, a.send_blocks)) return;
    const int first_local = a.rank * L;
    const int R = a.recv_src_offset[W];
    // Rows [self_lo, self_hi) came from this rank and are already in place (skip_self).
    const int self_lo = a.skip_self ? a.recv_src_offset[a.rank] : 0;
    const int self_hi = a.skip_self ? a.recv_src_offset[a.rank + 1] : 0;
    const int num_rows = R - (self_hi - self_lo);
    const int num_scales = rt.hidden / kFp8Cols;
    for (int j = global_warp(); j < num_rows; j += num_warps()) {
        const int i = j < self_lo ? j : j + (self_hi - self_lo);
        const int s = warp_find_source(a.recv_src_offset, W, i, lane);
        if (i >= a.max_rows) continue;  // the host reports the short output
        // src + s * src_stride: slot of source s; its rows in send order
        const uint8_t* row =
            a.src + s * a.src_stride + static_cast<size_t>(i - a.recv_src_offset[s]) * rl.row_bytes;
        warp_copy(static_cast<uint8_t*>(a.recv_x) + static_cast<size_t>(i) * rl.data_bytes, row,
                  rl.data_bytes, lane);
        if (rt.fp8 && a.recv_x_scales != nullptr)
            for (int b = lane; b < num_scales; b += 32)
                a.recv_x_scales[static_cast<size_t>(i) * num_scales + b] =
                    reinterpret_cast<const float*>(row + rl.scales_off)[b];
        if (lane < K) {
            const int id = reinterpret_cast<const int*>(row + rl.ids_off)[lane];
            const int local = id - first_local;
            const bool mine = id >= 0 && local >= 0 && local < L;
            if (a.recv_topk_idx != nullptr)
                a.recv_topk_idx[static_cast<size_t>(i) * K + lane] = mine ? local : -1;
            if (a.recv_topk_weights != nullptr)
                a.recv_topk_weights[static_cast<size_t>(i) * K + lane] =
                    mine ? reinterpret_cast<const float*>(row + rl.weights_off)[lane] : 0.0f;
        }
        if (lane == 0) a.recv_src_token[i] = *reinterpret_cast<const int*>(row + rl.token_off);
    }
    block_finish_recv(a.sig, kChDispatch, epoch);
}

}  // namespace

void launch_dispatch_send(const DispatchSendArgs& a, int blocks, cudaStream_t stream) {
    dispatch_send_kernel<<<blocks, kDataThreads, 0, stream>>>(a);
}

void launch_dispatch_recv(const DispatchRecvArgs& a, int blocks, cudaStream_t stream) {
    dispatch_recv_kernel<<<blocks, kDataThreads, 0, stream>>>(a);
}

}  // namespace moerl::ep::cuda
