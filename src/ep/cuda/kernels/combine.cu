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
    // Rows [self_lo, self_hi) belong to this rank: the receive kernel reads them in y (skip_self).
    const int self_lo = a.skip_self ? a.recv_src_offset[a.rank] : 0;
    const int self_hi = a.skip_self ? a.recv_src_offset[a.rank + 1] : 0;
    const int num_rows = R - (self_hi - self_lo);
    for (int j = global_warp(); j < num_rows; j += num_warps()) {
        const int i = j < self_lo ? j : j + (self_hi - self_lo);
        const int s = warp_find_source(a.recv_src_offset, W, i, lane);
        // dst[s]: this rank's slot at rank s; row (i - first row of s) at + that * row_stride
        uint8_t* dst = a.dst[s] + static_cast<size_t>(i - a.recv_src_offset[s]) * a.row_stride;
        warp_copy(dst, static_cast<const uint8_t*>(a.y) + static_cast<size_t>(i) * row_bytes, row_bytes,
                  lane);
    }
    block_signal_data(a.sig, kChCombine);
}

// One warp (or a few, for few tokens) per token; kVec: 16-byte accesses (rows and strides 16-byte
// aligned), else one element.
template <int kDType, bool kVec>
__global__ void __launch_bounds__(kDataThreads) combine_recv_kernel(CombineRecvArgs a) {
    const Routing rt = a.rt;
    const int W = rt.world, H = rt.hidden, lane = threadIdx.x & 31;
    const int elem = kDType == 0 ? 4 : 2;
    const unsigned long long epoch = current_epoch(a.sig, kChCombine);
    if (!block_wait_data(a.sig, kChCombine, epoch, a.send_blocks)) return;
    const int self = a.self_y != nullptr ? a.rank : -1;
    const int self_first = self >= 0 ? a.recv_src_offset[self] : 0;
    const size_t y_row_bytes = static_cast<size_t>(H) * elem;
    constexpr int kElems = kDType == 0 ? 4 : 8;
    const int n = kVec ? H / kElems : H;
    const int parts = warps_per_token(a.num_tokens, kVec ? (n + 127) / 128 : (n + 31) / 32);
    for (int item = global_warp(); item < a.num_tokens * parts; item += num_warps()) {
        const int t = item / parts, part = item % parts;
        // send_pos [T, W]: row of token t in the list of rank s, or -1
        const int* pos_row = a.send_pos + static_cast<size_t>(t) * W;
        const bool in_lo = lane < W && pos_row[lane] >= 0;
        const bool in_hi = lane + 32 < W && pos_row[lane + 32] >= 0;
        const unsigned long long srcs =
            __ballot_sync(kFullMask, in_lo) |
            (static_cast<unsigned long long>(__ballot_sync(kFullMask, in_hi)) << 32);
        const int num_src = __popcll(srcs);
        // Source s's row: in y for this rank, else row p of the slot of rank s.
        auto source_row = [&](int s) -> const uint8_t* {
            const int p = pos_row[s];
            if (s == self) return static_cast<const uint8_t*>(a.self_y) + (self_first + p) * y_row_bytes;
            return a.src + s * a.src_stride + static_cast<size_t>(p) * a.row_stride;
        };
        // Lane r: the rows of the r-th and the (r+32)-th source in rank order.
        const uint8_t* row_a = nullptr;
        const uint8_t* row_b = nullptr;
        {
            unsigned long long m = srcs;
            for (int i = 0; i < lane && m != 0; ++i) m &= m - 1;
            if (m != 0) row_a = source_row(__ffsll(m) - 1);
            for (int i = 0; i < 32 && m != 0; ++i) m &= m - 1;
            if (m != 0) row_b = source_row(__ffsll(m) - 1);
        }
        auto row_of = [&](int r, float& w) -> const uint8_t* {
            w = 1.0f;
            const auto a_r = __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row_a), r & 31);
            const auto b_r = __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row_b), r & 31);
            return reinterpret_cast<const uint8_t*>(r < 32 ? a_r : b_r);
        };
        uint8_t* out = static_cast<uint8_t*>(a.out) + static_cast<size_t>(t) * y_row_bytes;
        warp_sum_rows<kDType, kVec>(out, num_src, row_of, H, part, parts, lane);
    }
    block_finish_recv(a.sig, kChCombine, epoch);
}

}  // namespace

void launch_combine_send(const CombineSendArgs& a, int blocks, cudaStream_t stream) {
    combine_send_kernel<<<blocks, kDataThreads, 0, stream>>>(a);
}

void launch_combine_recv(const CombineRecvArgs& a, int blocks, cudaStream_t stream) {
    const size_t row_bytes = row_bytes_of(a.rt);
    const bool vec = ((row_bytes | a.row_stride | a.src_stride | reinterpret_cast<uintptr_t>(a.src) |
                       reinterpret_cast<uintptr_t>(a.out) | reinterpret_cast<uintptr_t>(a.self_y)) &
                      15) == 0;
    with_dtype_and_vec(a.rt.dtype, vec, [&](auto dtype, auto vec_tag) {
        combine_recv_kernel<decltype(dtype)::value, decltype(vec_tag)::value>
            <<<blocks, kDataThreads, 0, stream>>>(a);
    });
}

}  // namespace moerl::ep::cuda
