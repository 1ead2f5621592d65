// Greedy token choice on the device, so a decode step needs no logits on the host.
#include <cfloat>

#include "common.cuh"

namespace moerl::model::cuda {
namespace {

constexpr int kArgmaxThreads = 512;

template <typename T>
__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const T* logits, int V, int64_t* out) {
    __shared__ float best_s[32];
    __shared__ int idx_s[32];
    const int b = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const T* row = logits + static_cast<size_t>(b) * V;  // logits [B, V]
    float best = -FLT_MAX;
    int best_i = V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = to_float(row[i]);
        if (v > best) best = v, best_i = i;  // strided scan: the first hit is the lowest index
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(kFullMask, best, o);
        const int oi = __shfl_xor_sync(kFullMask, best_i, o);
        if (ob > best || (ob == best && oi < best_i)) best = ob, best_i = oi;
    }
    if (lane == 0) best_s[warp] = best, idx_s[warp] = best_i;
    __syncthreads();
    if (warp == 0) {
        best = lane < (kArgmaxThreads >> 5) ? best_s[lane] : -FLT_MAX;
        best_i = lane < (kArgmaxThreads >> 5) ? idx_s[lane] : V;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(kFullMask, best, o);
            const int oi = __shfl_xor_sync(kFullMask, best_i, o);
            if (ob > best || (ob == best && oi < best_i)) best = ob, best_i = oi;
        }
        if (lane == 0) out[b] = best_i < V ? best_i : 0;
    }
}

}  // namespace

void launch_argmax(int dtype, const void* logits, int B, int V, int64_t* out, cudaStream_t stream) {
    if (B == 0) return;
    if (dtype == 0)
        argmax_kernel<float><<<B, kArgmaxThreads, 0, stream>>>(static_cast<const float*>(logits), V, out);
    else
        argmax_kernel<__nv_bfloat16>
            <<<B, kArgmaxThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(logits), V, out);
}

}  // namespace moerl::model::cuda
