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
    const size_t x_row_bytes = row_bytes_of(rt);
    const unsigned long long epoch = current_epoch(a.sig, kChLLDispatch);
    if (!block_wait_slots_free(a.sig, kChLLDispatch, epoch)) return;
    if (blockIdx.x == 0)  // slot header: int32 counts[L] of the experts of rank r
        for (int i = threadIdx.x; i < W * L; i += blockDim.x)
            reinterpret_cast<int*>(a.dst[i / L])[i % L] = a.expert_count[i];
    for (int t = global_warp(); t < a.num_tokens; t += num_warps()) {
        // Lane k: entry k's row, dst[owner]: header, then rows ordered by (expert, token); an id repeated
        // in the token's top-k is written by the lane of its first entry only.
        const int e = lane < K ? a.topk32[static_cast<size_t>(t) * K + lane] : -1;
        const unsigned same = __match_any_sync(kFullMask, e);
        uint8_t* row = nullptr;
        if (e >= 0 && lane == __ffs(same) - 1) {
            const int pos = a.expert_offset[e] + a.pos_in_expert[static_cast<size_t>(t) * K + lane];
            row = a.dst[e / L] + a.header_bytes + static_cast<size_t>(pos) * rl.row_bytes;
            *reinterpret_cast<int*>(row + rl.token_off) = t;
        }
        const uint8_t* x_row = static_cast<const uint8_t*>(a.x) + static_cast<size_t>(t) * x_row_bytes;
        if (!rt.fp8)
            warp_copy_fanout(row, x_row, static_cast<int>(x_row_bytes), lane);
        else
            warp_quantize_fanout(row,
                                 row != nullptr ? reinterpret_cast<float*>(row + rl.scales_off) : nullptr,
                                 reinterpret_cast<const __nv_bfloat16*>(x_row), rt.hidden, lane);
    }
    block_signal_data(a.sig, kChLLDispatch);
}

// Dynamic shared memory: flat[L*W + 1], the exclusive scan of the slot headers' counts in slot order
// q = s * L + l (where the rows of source s for expert l start among all rows received), then
// first[L*W] (index l * W + s: first row of source s in expert l's output).
__global__ void __launch_bounds__(kDataThreads) ll_recv_kernel(LLRecvArgs a) {
    const Routing rt = a.rt;
    const RowLayout rl = a.row;
    const int W = rt.world, L = rt.num_local_experts, N = W * L, lane = threadIdx.x & 31;
    extern __shared__ int tables[];
    int* flat = tables;
    int* first = tables + N + 1;
    const unsigned long long epoch = current_epoch(a.sig, kChLLDispatch);
    if (!block_wait_data(a.sig, kChLLDispatch, epoch, a.send_blocks)) return;
    for (int q = threadIdx.x; q < N; q += blockDim.x) {
        const int s = q / L, l = q % L;
        flat[q] = reinterpret_cast<const volatile int*>(a.src + s * a.src_stride)[l];
    }
    __syncthreads();
    block_exclusive_scan(flat, N);
    auto count = [&](int l, int s) { return flat[s * L + l + 1] - flat[s * L + l]; };
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
        int run = 0;
        for (int s = 0; s < W; ++s) {
            first[l * W + s] = run;
            run += count(l, s);
        }
        if (blockIdx.x == 0) {
            a.recv_count[l] = run;
            if (a.out_recv_count != nullptr) a.out_recv_count[l] = run;
        }
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < N; i += blockDim.x) {
            const int l = i / W, s = i % W;
            a.recv_range[2 * i] = first[i];
            a.recv_range[2 * i + 1] = count(l, s);
            a.slot_base[i] = flat[s * L + l] - flat[s * L];
        }
    }
    // Received row g (all sources, slot order): segment q = (s, l), row g - flat[s * L] of s's slot.
    const int num_scales = rt.hidden / kFp8Cols;
    for (int g = global_warp(); g < flat[N]; g += num_warps()) {
        const int q = scan_segment(flat, N, g);
        const int s = q / L, l = q % L;
        // src + s * src_stride: slot of source s (header, then rows by expert)
        const uint8_t* row =
            a.src + s * a.src_stride + a.header_bytes + static_cast<size_t>(g - flat[s * L]) * rl.row_bytes;
        const size_t out_row = static_cast<size_t>(l) * a.rows_per_expert + first[l * W + s] + (g - flat[q]);
        warp_copy(static_cast<uint8_t*>(a.recv_x) + out_row * rl.data_bytes, row, rl.data_bytes, lane);
        if (rt.fp8 && a.recv_x_scales != nullptr)
            for (int b = lane; b < num_scales; b += 32)
                a.recv_x_scales[out_row * num_scales + b] =
                    reinterpret_cast<const float*>(row + rl.scales_off)[b];
        if (lane == 0) a.recv_src_token[out_row] = *reinterpret_cast<const int*>(row + rl.token_off);
    }
    // Rows past each expert's count: source token -1.
    const int total_rows = L * a.rows_per_expert;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total_rows; i += gridDim.x * blockDim.x) {
        const int l = i / a.rows_per_expert, j = i % a.rows_per_expert;
        if (j >= first[l * W + W - 1] + count(l, W - 1)) a.recv_src_token[i] = -1;
    }
    block_finish_recv(a.sig, kChLLDispatch, epoch);
}

// Dynamic shared memory: flat[L*W + 1], the exclusive scan of the received counts in the order the
// rows go back, q = s * L + l (as in ll_recv_kernel).
__global__ void __launch_bounds__(kDataThreads) ll_combine_send_kernel(LLCombineSendArgs a) {
    const Routing rt = a.rt;
    const int W = rt.world, L = rt.num_local_experts, N = W * L, lane = threadIdx.x & 31;
    const int row_bytes = rt.hidden * (rt.dtype == 0 ? 4 : 2);
    extern __shared__ int flat_counts[];
    int* flat = flat_counts;
    const unsigned long long epoch = current_epoch(a.sig, kChLLCombine);
    if (!block_wait_slots_free(a.sig, kChLLCombine, epoch)) return;
    // recv_range [L, W, 2]: first row in expert l's output and count, per source s
    for (int q = threadIdx.x; q < N; q += blockDim.x) {
        const int s = q / L, l = q % L;
        flat[q] = a.recv_range[2 * (l * W + s) + 1];
    }
    __syncthreads();
    block_exclusive_scan(flat, N);
    for (int g = global_warp(); g < flat[N]; g += num_warps()) {
        const int q = scan_segment(flat, N, g);
        const int s = q / L, l = q % L;
        const int j = a.recv_range[2 * (l * W + s)] + (g - flat[q]);  // row of expert l's output
        const uint8_t* src =
            static_cast<const uint8_t*>(a.y) + (static_cast<size_t>(l) * a.rows_per_expert + j) * row_bytes;
        // dst[s]: this rank's slot at s; rows in the order s sent them (expert, then its order)
        warp_copy(a.dst[s] + static_cast<size_t>(g - flat[s * L]) * a.row_stride, src, row_bytes, lane);
    }
    block_signal_data(a.sig, kChLLCombine);
}

// One warp (or a few, for few tokens) per token; the entries are summed in (expert id, k) order, like
// the host reference.
template <int kDType, bool kVec>
__global__ void __launch_bounds__(kDataThreads) ll_combine_recv_kernel(LLCombineRecvArgs a) {
    const Routing rt = a.rt;
    const int L = rt.num_local_experts, K = rt.top_k, H = rt.hidden, lane = threadIdx.x & 31;
    const int elem = kDType == 0 ? 4 : 2;
    const unsigned long long epoch = current_epoch(a.sig, kChLLCombine);
    if (!block_wait_data(a.sig, kChLLCombine, epoch, a.send_blocks)) return;
    constexpr int kElems = kDType == 0 ? 4 : 8;
    const int n_cols = kVec ? H / kElems : H;
    const int parts = warps_per_token(a.num_tokens, kVec ? (n_cols + 127) / 128 : (n_cols + 31) / 32);
    for (int item = global_warp(); item < a.num_tokens * parts; item += num_warps()) {
        const int t = item / parts, part = item % parts;
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
        // lane r: row and weight of the r-th entry
        const auto row_r = __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), by_order);
        const float w_r = __shfl_sync(kFullMask, w, by_order);
        auto row_of = [&](int r, float& wk) -> const uint8_t* {
            wk = __shfl_sync(kFullMask, w_r, r);
            return reinterpret_cast<const uint8_t*>(__shfl_sync(kFullMask, row_r, r));
        };
        uint8_t* out = static_cast<uint8_t*>(a.out) + static_cast<size_t>(t) * H * elem;
        warp_sum_rows<kDType, kVec>(out, n, row_of, H, part, parts, lane);
    }
    block_finish_recv(a.sig, kChLLCombine, epoch);
}

}  // namespace

void launch_ll_send(const LLSendArgs& a, int blocks, cudaStream_t stream) {
    ll_send_kernel<<<blocks, kDataThreads, 0, stream>>>(a);
}

void launch_ll_recv(const LLRecvArgs& a, int blocks, cudaStream_t stream) {
    const size_t shared = sizeof(int) * (2 * static_cast<size_t>(a.rt.world) * a.rt.num_local_experts + 1);
    ll_recv_kernel<<<blocks, kDataThreads, shared, stream>>>(a);
}

void launch_ll_combine_send(const LLCombineSendArgs& a, int blocks, cudaStream_t stream) {
    const size_t shared = sizeof(int) * (static_cast<size_t>(a.rt.world) * a.rt.num_local_experts + 1);
    ll_combine_send_kernel<<<blocks, kDataThreads, shared, stream>>>(a);
}

void launch_ll_combine_recv(const LLCombineRecvArgs& a, int blocks, cudaStream_t stream) {
    const size_t row_bytes = row_bytes_of(a.rt);
    const bool vec = ((row_bytes | a.row_stride | a.src_stride | reinterpret_cast<uintptr_t>(a.src) |
                       reinterpret_cast<uintptr_t>(a.out)) &
                      15) == 0;
    with_dtype_and_vec(a.rt.dtype, vec, [&](auto dtype, auto vec_tag) {
        ll_combine_recv_kernel<decltype(dtype)::value, decltype(vec_tag)::value>
            <<<blocks, kDataThreads, 0, stream>>>(a);
    });
}

}  // namespace moerl::ep::cuda
