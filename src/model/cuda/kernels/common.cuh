// Internal: element access and reductions shared by the decode kernels.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "../decode_kernels.hpp"

namespace moerl::model::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// Raises a kernel's dynamic shared memory limit once (before a graph capture, by the eager warm-up
// step), so launches inside a capture make no attribute calls.
inline void ensure_dynamic_smem(const void* kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return;
    static std::mutex mu;
    static std::unordered_map<const void*, size_t> granted;
    std::lock_guard<std::mutex> lock(mu);
    size_t& g = granted[kernel];
    if (g >= bytes) return;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    g = bytes;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
    return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}

// Rounds through T (what storing in the model dtype does).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
    return to_float(from_float<T>(v));
}

// Eight consecutive elements at p (16-byte aligned for bf16, 32-byte for fp32) as floats.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const auto* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(v[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void load8(const float* p, float* out) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// Eight consecutive elements, streamed (read once, kept out of L1).
__device__ __forceinline__ void load8_stream(const __nv_bfloat16* p, float* out) {
    const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
    const auto* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(v[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void load8_stream(const float* p, float* out) {
    const float4 a = __ldcs(reinterpret_cast<const float4*>(p));
    const float4 b = __ldcs(reinterpret_cast<const float4*>(p) + 1);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch /* [32] shared */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by an earlier call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = lane < num_warps ? scratch[lane] : 0.0f;
    return warp_sum(total);
}

// h = round(w * round(x * inv_rms)) over one row already in x (global), one block per row.
template <typename T>
__device__ __forceinline__ void row_rmsnorm(const T* x, const T* w, float eps, int H, T* h, float sum_sq,
                                            float* scratch) {
    const float total = block_sum(sum_sq, scratch);
    const float inv = rsqrtf(total / static_cast<float>(H) + eps);
    for (int c = threadIdx.x; c < H; c += blockDim.x)
        h[c] = from_float<T>(to_float(w[c]) * round_to<T>(to_float(x[c]) * inv));
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

}  // namespace moerl::model::cuda
