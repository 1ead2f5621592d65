// Low-latency mode: no count exchange (each slot starts with its per-expert counts), expert-major
// receive rows, and a combine that does the top-k weighted sum. Every launch has a fixed shape, so a
// dispatch/combine pair can be captured in a CUDA graph.
#include "common.cuh"

namespace moerl::ep::cuda {

namespace {

__global__ void __launch_bounds__(kDataThreads) ll_send_kernel(LLSendArgs a) {
    const Routing rt = a.rt;
    const RowLayout rl = a.row;
    const int W = rt.world, L = rt.num_local_experts, K = rt.top_k, lane = threadIdx.x & 31;
    const unsigned long long epoch = current_epoch(a.sig, kChLLDispatch);
    if (!block_wait_slots_free(a.sig, kChLLDispatch, epoch)) return;
    if (blockIdx.x == 0)  // slot header: int32 counts[L] of the experts of rank r
        for (int i = threadIdx.x; i < W * L; i += blockDim.x)
            reinterpret_cast<int*>(a.dst[i / L])[i % L] = a.expert_count[i];
    for (int t = global_warp(); t < a.num_tokens; t += num_warps()) {
        int e = -1, pos = 0;
        if (lane < K) {
            e = a.topk32[static_cast<size_t>(t) * K + lane];
            if (e >= 0) pos = a.expert_offset[e] + a.pos_in_expert[static_cast<size_t>(t) * K + lane];
        }
        unsigned entries = __ballot_sync(kFullMask, e >= 0);
        while (entries != 0) {
            const int k = __ffs(entries) - 1;
            entries &= entries - 1;
            const int ek = __shfl_sync(kFullMask, e, k);
            const int pk = __shfl_sync(kFullMask, pos, k);
            // dst[r]: header, then rows ordered by (expert, token, k); row pk at + pk * row_bytes
            uint8_t* row = a.dst[ek / L] + a.header_bytes + static_cast<size_t>(pk) * rl.row_bytes;
            warp_write_row_data(row, rl, rt, a.x, t, lane);
            if (lane == 0) *reinterpret_cast<int*>(row + rl.token_off) = t;
        }
    }
    block_signal_data(a.sig, kChLLDispatch);
}

// Dynamic shared memory: count[L*W] and first[L*W] (index l * W + s).
__global__ void __launch_bounds__(kDataThreads) ll_recv_kernel(LLRecvArgs a) {
    const Routing rt = a.rt;
    const RowLayout rl = a.row;
    const int W = rt.world, L = rt.num_local_experts, lane = threadIdx.x & 31;
    extern __shared__ int tables[];
    int* count = tables;
    int* first = tables + L * W;
    const unsigned long long epoch = current_epoch(a.sig, kChLLDispatch);
    if (!block_wait_data(a.sig, kChLLDispatch, epoch, a.send_blocks)) return;
    for (int i = threadIdx.x; i < L * W; i += blockDim.x) {
        const int l = i / W, s = i % W;
        count[i] = reinterpret_cast<const volatile int*>(a.src + s * a.src_stride)[l];
    }
    __syncthreads();
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
        int run = 0;
        for (int s = 0; s < W; ++s) {
            first[l * W + s] = run;
            run += count[l * W + s];
        }
        if (blockIdx.x == 0) {
            a.recv_count[l] = run;
            if (a.out_recv_count != nullptr) a.out_recv_count[l] = run;
        }
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < L * W; i += blockDim.x) {
            a.recv_range[2 * i] = first[i];
            a.recv_range[2 * i + 1] = count[i];
        }
        for (int s = threadIdx.x; s < W; s += blockDim.x) {
            int run = 0;
            for (int l = 0; l < L; ++l) {
                a.slot_base[l * W + s] = run;
                run += count[l * W + s];
            }
        }
    }
    const int num_scales = rt.hidden / kFp8Cols;
    for (int s = 0; s < W; ++s) {
        // src + s * src_stride: slot of source s (header, then rows by expert)
        const uint8_t* rows = a.src + s * a.src_stride + a.header_bytes;
        int slot_row = 0;
        for (int l = 0; l < L; ++l) {
            const int n = count[l * W + s];
            for (int i = global_warp(); i < n; i += num_warps()) {
                const uint8_t* row = rows + static_cast<size_t>(slot_row + i) * rl.row_bytes;
                const size_t out_row = static_cast<size_t>(l) * a.rows_per_expert + first[l * W + s] + i;
                warp_copy(static_cast<uint8_t*>(a.recv_x) + out_row * rl.data_bytes, row, rl.data_bytes,
                          lane);
                if (rt.fp8 && a.recv_x_scales != nullptr)
                    for (int b = lane; b < num_scales; b += 32)
                        a.recv_x_scales[out_row * num_scales + b] =
                            reinterpret_cast<const float*>(row + rl.scales_off)[b];
                if (lane == 0) a.recv_src_token[out_row] = *reinterpret_cast<const int*>(row + rl.token_off);
            }
            slot_row += n;
        }
    }
    // Rows past each expert's count: source token -1.
    const int total_rows = L * a.rows_per_expert;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total_rows; i += gridDim.x * blockDim.x) {
        const int l = i / a.rows_per_expert, j = i % a.rows_per_expert;
        if (j >= first[l * W + W - 1] + count[l * W + W - 1]) a.recv_src_token[i] = -1;
    }
    block_finish_recv(a.sig, kChLLDispatch, epoch);
}

__global__ void __launch_bounds__(kDataThreads) ll_combine_send_kernel(LLCombineSendArgs a) {
    const Routing rt = a.rt;
    const int W = rt.world, L = rt.num_local_experts, lane = threadIdx.x & 31;
    const int row_bytes = rt.hidden * (rt.dtype == 0 ? 4 : 2);
    const unsigned long long epoch = current_epoch(a.sig, kChLLCombine);
    if (!block_wait_slots_free(a.sig, kChLLCombine, epoch)) return;
    for (int l = 0; l < L; ++l) {
        const int n = a.recv_count[l];
        for (int j = global_warp(); j < n; j += num_warps()) {
            // recv_range [L, W, 2]: the source whose range holds row j
            int s = 0;
            while (s + 1 < W && j >= a.recv_range[2 * (l * W + s + 1)]) ++s;
            const int slot_row = a.slot_base[l * W + s] + j - a.recv_range[2 * (l * W + s)];
            const uint8_t* src = static_cast<const uint8_t*>(a.y) +
                                 (static_cast<size_t>(l) * a.rows_per_expert + j) * row_bytes;
            warp_copy(a.dst[s] + static_cast<size_t>(slot_row) * a.row_stride, src, row_bytes, lane);
        }
    }
    block_signal_data(a.sig, kChLLCombine);
}

// One warp per token; the entries are summed in (expert id, k) order, like the host reference.
template <int kDType, bool kVec>
__global__ void __launch_bounds__(kDataThreads) ll_combine_recv_kernel(LLCombineRecvArgs a) {
    const Routing rt = a.rt;
    const int L = rt.num_local_experts, K = rt.top_k, H = rt.hidden, lane = threadIdx.x & 31;
    const int elem = kDType == 0 ? 4 : 2;
    const unsigned long long epoch = current_epoch(a.sig, kChLLCombine);
    if (!block_wait_data(a.sig, kChLLCombine, epoch, a.send_blocks)) return;
    for (int t = global_warp(); t < a.num_tokens; t += num_warps()) {
        int e = -1;
        float w = 0.0f;
        const uint8_t* row = nullptr;
        if (lane < K) {
            e = a.topk32[static_cast<size_t>(t) * K + lane];
            if (e >= 0) {
                w = a.topk_weights != nullptr ? a.topk_weights[static_cast<size_t>(t) * K + lane] : 1.0f;
                const int slot_row = a.expert_offset[e] + a.pos_in_expert[static_cast<size_t>(t) * K + lane];
                // src + owner * src_stride: slot of the expert's rank; rows in the order they were sent
                row = a.src + (e / L) * a.src_stride + static_cast<size_t>(slot_row) * a.row_stride;
            }
        }
        // order: number of valid entries before this one in (expert id, k) order
        int order = 0;
        for (int j = 0; j < K; ++j) {
            const int ej = __shfl_sync(kFullMask, e, j);
            if (ej >= 0 && e >= 0 && (ej < e || (ej == e && j < lane))) ++order;
        }
        const unsigned valid = __ballot_sync(kFullMask, e >= 0);
        const int n = __popc(valid);
        // lane r of `by_order` holds the lane of the r-th entry
        int by_order = 0;
        for (int j = 0; j < K; ++j) {
            const int oj = __shfl_sync(kFullMask, order, j);
            if (((valid >> j) & 1) && oj == lane) by_order = j;
        }
        uint8_t* out = static_cast<uint8_t*>(a.out) + static_cast<size_t>(t) * H * elem;
        if constexpr (kVec) {
            using V = Vec16<kDType>;
            const int nc = H / V::kElems;
            for (int c0 = 0; c0 < nc; c0 += 32) {
                const int c = c0 + lane;
                float acc[V::kElems];
#pragma unroll
                for (int j = 0; j < V::kElems; ++j) acc[j] = 0.0f;
                for (int r = 0; r < n; ++r) {
                    const int k = __shfl_sync(kFullMask, by_order, r);
                    const float wk = __shfl_sync(kFullMask, w, k);
                    const auto* rk = reinterpret_cast<const uint8_t*>(
                        __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), k));
                    if (c < nc) V::add(acc, reinterpret_cast<const int4*>(rk)[c], wk);
                }
                if (c < nc) reinterpret_cast<int4*>(out)[c] = V::pack(acc);
            }
        } else {
            for (int c0 = 0; c0 < H; c0 += 32) {
                const int c = c0 + lane;
                float acc = 0.0f;
                for (int r = 0; r < n; ++r) {
                    const int k = __shfl_sync(kFullMask, by_order, r);
                    const float wk = __shfl_sync(kFullMask, w, k);
                    const auto* rk = reinterpret_cast<const uint8_t*>(
                        __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), k));
                    if (c < H) acc += wk * load_elem(rk, c, kDType);
                }
                if (c < H) store_elem(out, c, acc, kDType);
            }
        }
    }
    block_finish_recv(a.sig, kChLLCombine, epoch);
}

}  // namespace

void launch_ll_send(const LLSendArgs& a, int blocks, cudaStream_t stream) {
    ll_send_kernel<<<blocks, kDataThreads, 0, stream>>>(a);
}

void launch_ll_recv(const LLRecvArgs& a, int blocks, cudaStream_t stream) {
    const size_t shared = 2 * sizeof(int) * static_cast<size_t>(a.rt.world) * a.rt.num_local_experts;
    ll_recv_kernel<<<blocks, kDataThreads, shared, stream>>>(a);
}

void launch_ll_combine_send(const LLCombineSendArgs& a, int blocks, cudaStream_t stream) {
    ll_combine_send_kernel<<<blocks, kDataThreads, 0, stream>>>(a);
}

void launch_ll_combine_recv(const LLCombineRecvArgs& a, int blocks, cudaStream_t stream) {
    const size_t row_bytes = static_cast<size_t>(a.rt.hidden) * (a.rt.dtype == 0 ? 4 : 2);
    const bool vec = ((row_bytes | a.row_stride | a.src_stride | reinterpret_cast<uintptr_t>(a.src) |
                       reinterpret_cast<uintptr_t>(a.out)) &
                      15) == 0;
    if (a.rt.dtype == 0) {
        if (vec)
            ll_combine_recv_kernel<0, true><<<blocks, kDataThreads, 0, stream>>>(a);
        else
            ll_combine_recv_kernel<0, false><<<blocks, kDataThreads, 0, stream>>>(a);
    } else {
        if (vec)
            ll_combine_recv_kernel<1, true><<<blocks, kDataThreads, 0, stream>>>(a);
        else
            ll_combine_recv_kernel<1, false><<<blocks, kDataThreads, 0, stream>>>(a);
    }
}

}  // namespace moerl::ep::cuda
