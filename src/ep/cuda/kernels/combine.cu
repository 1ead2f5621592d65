// Normal-mode combine: send (each received row back into its source's slot, at the position it was
// sent from) and receive (out[t] = sum over ranks in rank order, fp32 accumulation).
#include "common.cuh"

namespace moerl::ep::cuda {

namespace {

__global__ void __launch_bounds__(kDataThreads) combine_send_kernel(CombineSendArgs a) {
    const Routing rt = a.rt;
    const int W = rt.world, lane = threadIdx.x & 31;
    const int row_bytes = rt.hidden * (rt.dtype == 0 ? 4 : 2);
    const unsigned long long epoch = current_epoch(a.sig, kChCombine);
    if (!block_wait_slots_free(a.sig, kChCombine, epoch)) return;
    const int R = a.recv_src_offset[W];
    for (int i = global_warp(); i < R; i += num_warps()) {
        const int s = warp_find_source(a.recv_src_offset, W, i, lane);
        // dst[s]: this rank's slot at rank s; row (i - first row of s) at + that * row_stride
        uint8_t* dst = a.dst[s] + static_cast<size_t>(i - a.recv_src_offset[s]) * a.row_stride;
        warp_copy(dst, static_cast<const uint8_t*>(a.y) + static_cast<size_t>(i) * row_bytes, row_bytes,
                  lane);
    }
    block_signal_data(a.sig, kChCombine);
}

// One warp per token; kVec: 16-byte accesses (rows and strides 16-byte aligned), else one element.
template <int kDType, bool kVec>
__global__ void __launch_bounds__(kDataThreads) combine_recv_kernel(CombineRecvArgs a) {
    const Routing rt = a.rt;
    const int W = rt.world, H = rt.hidden, lane = threadIdx.x & 31;
    const int elem = kDType == 0 ? 4 : 2;
    const unsigned long long epoch = current_epoch(a.sig, kChCombine);
    if (!block_wait_data(a.sig, kChCombine, epoch, a.send_blocks)) return;
    for (int t = global_warp(); t < a.num_tokens; t += num_warps()) {
        // send_pos [T, W]: row of token t in the slot of rank s, or -1 (uniform loads, no shuffles, so
        // lanes may leave the column loops independently)
        const int* pos_row = a.send_pos + static_cast<size_t>(t) * W;
        uint8_t* out = static_cast<uint8_t*>(a.out) + static_cast<size_t>(t) * H * elem;
        if constexpr (kVec) {
            using V = Vec16<kDType>;
            const int n = H / V::kElems;
            for (int c = lane; c < n; c += 32) {
                float acc[V::kElems];
#pragma unroll
                for (int j = 0; j < V::kElems; ++j) acc[j] = 0.0f;
                for (int s = 0; s < W; ++s) {
                    const int p = pos_row[s];
                    if (p < 0) continue;
                    // src + s * src_stride: slot of rank s; row p of it
                    const uint8_t* row = a.src + s * a.src_stride + static_cast<size_t>(p) * a.row_stride;
                    V::add(acc, reinterpret_cast<const int4*>(row)[c], 1.0f);
                }
                reinterpret_cast<int4*>(out)[c] = V::pack(acc);
            }
        } else {
            for (int c = lane; c < H; c += 32) {
                float acc = 0.0f;
                for (int s = 0; s < W; ++s) {
                    const int p = pos_row[s];
                    if (p < 0) continue;
                    const uint8_t* row = a.src + s * a.src_stride + static_cast<size_t>(p) * a.row_stride;
                    acc += load_elem(row, c, kDType);
                }
                store_elem(out, c, acc, kDType);
            }
        }
    }
    block_finish_recv(a.sig, kChCombine, epoch);
}

}  // namespace

void launch_combine_send(const CombineSendArgs& a, int blocks, cudaStream_t stream) {
    combine_send_kernel<<<blocks, kDataThreads, 0, stream>>>(a);
}

void launch_combine_recv(const CombineRecvArgs& a, int blocks, cudaStream_t stream) {
    const size_t row_bytes = static_cast<size_t>(a.rt.hidden) * (a.rt.dtype == 0 ? 4 : 2);
    const bool vec = ((row_bytes | a.row_stride | a.src_stride | reinterpret_cast<uintptr_t>(a.src) |
                       reinterpret_cast<uintptr_t>(a.out)) &
                      15) == 0;
    if (a.rt.dtype == 0) {
        if (vec)
            combine_recv_kernel<0, true><<<blocks, kDataThreads, 0, stream>>>(a);
        else
            combine_recv_kernel<0, false><<<blocks, kDataThreads, 0, stream>>>(a);
    } else {
        if (vec)
            combine_recv_kernel<1, true><<<blocks, kDataThreads, 0, stream>>>(a);
        else
            combine_recv_kernel<1, false><<<blocks, kDataThreads, 0, stream>>>(a);
    }
}

}  // namespace moerl::ep::cuda
