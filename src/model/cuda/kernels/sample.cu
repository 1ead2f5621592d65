// Greedy token choice on the device, so a decode step needs no logits on the host. Many blocks per
// row (a vocabulary of 150k is too long for one block to scan quickly): each folds its range into
// one 64-bit key (orderable value bits, then the inverted index so ties go to the lowest index), the
// row's maximum key is kept with one atomicMax, and the row's last block to finish writes its index.
#include <cfloat>

#include "common.cuh"

namespace moerl::model::cuda {
namespace {

constexpr int kArgmaxThreads = 256;
// Logits a thread reads: all of its loads in flight at once (bench/RESULTS.md).
constexpr int kArgmaxPerThread = 8;

__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
    const unsigned u = __float_as_uint(v);
    const unsigned ordered = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
    return (static_cast<unsigned long long>(ordered) << 32) | (0xffffffffu - static_cast<unsigned>(i));
}

template <typename T>
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const T* logits, int V, unsigned long long* best_key, int* blocks_done, int64_t* out,
                  int* advance_position) {
    griddep_wait();
    griddep_launch_dependents();
    __shared__ unsigned long long warp_best[kArgmaxThreads / 32];
    const int b = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const T* row = logits + static_cast<size_t>(b) * V;  // logits [B, V]
    const int first = blockIdx.x * kArgmaxThreads * kArgmaxPerThread;
    unsigned long long best = 0;
#pragma unroll 8
    for (int j = 0; j < kArgmaxPerThread; ++j) {
        const int i = first + j * kArgmaxThreads + threadIdx.x;
        if (i < V) best = max(best, argmax_key(to_float(row[i]), i));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(kFullMask, best, o));
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < kArgmaxThreads / 32; ++w) best = max(best, warp_best[w]);
        atomicMax(best_key + b, best);
    }
    // The row's last block reads the winner and leaves the key zero for the next call.
    if (!last_block_of(blocks_done + b, gridDim.x) || threadIdx.x != 0) return;
    const unsigned long long key = atomicExch(best_key + b, 0ull);
    out[b] = static_cast<int64_t>(0xffffffffu - static_cast<unsigned>(key & 0xffffffffu));
    if (advance_position != nullptr && advance_position[b] >= 0) advance_position[b] += 1;
}

}  // namespace

void launch_argmax(int dtype, const void* logits, int B, int V, unsigned long long* keys, int* blocks_done,
                   int64_t* out, int* advance_position, const Launch& launch) {
    if (B == 0) return;
    constexpr int kPerBlock = kArgmaxThreads * kArgmaxPerThread;
    const dim3 grid((V + kPerBlock - 1) / kPerBlock, B);
    if (dtype == 0)
        launch_kernel(argmax_kernel<float>, grid, kArgmaxThreads, 0, launch,
                      static_cast<const float*>(logits), V, keys, blocks_done, out, advance_position);
    else
        launch_kernel(argmax_kernel<__nv_bfloat16>, grid, kArgmaxThreads, 0, launch,
                      static_cast<const __nv_bfloat16*>(logits), V, keys, blocks_done, out, advance_position);
}

}  // namespace moerl::model::cuda
