// Internal: element access and reductions shared by the decode kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "../decode_kernels.hpp"
#include "moerl/core/cuda_check.hpp"

namespace moerl::model::cuda {

constexpr unsigned kFullMask = 0xffffffffu;
// Shared memory a block may fill with weights copied ahead (dense GEMV, down experts), and the most
// the one-row down experts by output column take in all.
constexpr int kMaxPreloadBytes = 160 * 1024;
constexpr int kMaxColumnsSmem = 200 * 1024;

// Programmatic dependent launch, device side. Every decode kernel calls griddep_wait() before its
// first access to memory the previous kernels of the stream write or read, then
// griddep_launch_dependents() so the next kernel may be scheduled; both are no-ops in a kernel
// launched without overlap.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks L2 for the 128-byte line at p (no registers wait for it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// kernel<<<grid, block, smem, launch.stream>>>(args...), with programmatic stream serialisation
// when launch.overlap (the kernel may start before the previous one on the stream has finished).
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, const Launch& launch,
                   Args&&... args) {
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = launch.stream;
    cudaLaunchAttribute attribute = {};
    if (launch.overlap) {
        attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attribute.val.programmaticStreamSerializationAllowed = 1;
        config.attrs = &attribute;
        config.numAttrs = 1;
    }
    MOERL_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Raises a kernel's dynamic shared memory limit once (before a graph capture, by the eager warm-up
// step), so launches inside a capture make no attribute calls.
inline void ensure_dynamic_smem(const void* kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return;
    static std::mutex mu;
    static std::unordered_map<const void*, size_t> granted;
    std::lock_guard<std::mutex> lock(mu);
    size_t& g = granted[kernel];
    if (g >= bytes) return;
    MOERL_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    g = bytes;
}

// c += a b on the tensor cores: m16n8k16 with fp32 accumulation, bf16 operands (mma_bf16) or fp16
// (mma_f16: FP8 weights widen to fp16 exactly). a0..a3 and b0, b1 hold pairs in the PTX fragment
// layout (lane = 4 g + t: a0 row g, a1 row g + 8, a2 and a3 the same rows eight k on; b0 column g,
// b1 eight k on; c0, c1 row g and c2, c3 row g + 8, columns 2t and 2t + 1).
#define MOERL_DEFINE_MMA(name, type)                                                                       \
    __device__ __forceinline__ void name(float(&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, \
                                         uint32_t b0, uint32_t b1) {                                       \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." type "." type                                \
                     ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                \
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                      \
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                              \
    }
MOERL_DEFINE_MMA(mma_bf16, "bf16")
MOERL_DEFINE_MMA(mma_f16, "f16")
#undef MOERL_DEFINE_MMA

// The outputs a lane holds after kNTiles such products of 16 weight rows from row0 with 8 tokens
// each: c[q][i] (i = 2h + v) is row row0 + g + 8h, token q * 8 + 2t + v. f(q, i, token, row) for
// those among the nt tokens and out_rows rows.
template <int kNTiles, typename F>
__device__ __forceinline__ void for_each_mma_output(int row0, int nt, int out_rows, F&& f) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int q = 0; q < kNTiles; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int v = 0; v < 2; ++v) {
                const int token = q * 8 + 2 * t + v, row = row0 + g + 8 * h;
                if (token < nt && row < out_rows) f(q, 2 * h + v, token, row);
            }
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

// Eight consecutive elements as loaded (16-byte aligned), converted to floats when used: loads can
// be issued well ahead of the arithmetic.
template <typename T>
struct Raw8;
template <>
struct Raw8<__nv_bfloat16> {
    uint4 v;
};
template <>
struct Raw8<float> {
    float4 a, b;
};
__device__ __forceinline__ Raw8<__nv_bfloat16> load_raw8(const __nv_bfloat16* p) {
    return {*reinterpret_cast<const uint4*>(p)};
}
__device__ __forceinline__ Raw8<float> load_raw8(const float* p) {
    return {reinterpret_cast<const float4*>(p)[0], reinterpret_cast<const float4*>(p)[1]};
}
__device__ __forceinline__ void raw8_to_float(const Raw8<__nv_bfloat16>& r, float* out) {
    const auto* v = reinterpret_cast<const __nv_bfloat162*>(&r.v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(v[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void raw8_to_float(const Raw8<float>& r, float* out) {
    out[0] = r.a.x, out[1] = r.a.y, out[2] = r.a.z, out[3] = r.a.w;
    out[4] = r.b.x, out[5] = r.b.y, out[6] = r.b.z, out[7] = r.b.w;
}

// Eight consecutive elements at p (16-byte aligned) as floats.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* out) {
    raw8_to_float(load_raw8(p), out);
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

// Eight consecutive elements stored from floats (16-byte aligned for bf16, 32-byte for fp32).
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float* v) {
    uint4 raw;
    auto* out = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void store8(float* p, const float* v) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Row kernels (residual add + RMSNorm): one block of kNormThreads per row, thread t owns the
// 8-element chunks at columns (t + i * kNormThreads) * 8, kept in registers between the two passes.
constexpr int kNormThreads = 256;
constexpr int kNormChunks = 4;
static_assert(kNormThreads * 8 * kNormChunks == kMaxHidden);

// One row of a fused residual update + RMSNorm: `next(c, v)` puts the new residual's eight elements
// at column c into v (storing them as it sees fit); they stay in registers for the norm
// h = round(w * round(x * inv_rms)).
template <typename T, typename Next>
__device__ __forceinline__ void residual_rmsnorm_row(int H, const T* w, float eps, T* h, Next&& next) {
    __shared__ float scratch[32];
    float xv[kNormChunks][8];
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kNormChunks; ++i) {
        const int c = (threadIdx.x + i * kNormThreads) * 8;
        if (c >= H) break;
        next(c, xv[i]);
#pragma unroll
        for (int k = 0; k < 8; ++k) sum_sq += xv[i][k] * xv[i][k];
    }
    const float inv = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(H) + eps);
#pragma unroll
    for (int i = 0; i < kNormChunks; ++i) {
        const int c = (threadIdx.x + i * kNormThreads) * 8;
        if (c >= H) break;
        float wv[8], out[8];
        load8(w + c, wv);
#pragma unroll
        for (int k = 0; k < 8; ++k) out[k] = wv[k] * round_to<T>(xv[i][k] * inv);
        store8(h + c, out);
    }
}

// One head of D dims at src, RMS-normalised with w [D] and rotated at pos, by one warp: lane i takes
// the RoPE pairs (j, j + D/2) for j = i, i + 32, ... and hands each to emit(j, out_j, out_j+D/2),
// rounded to T as a stored value would be (the model's eager path rounds the normalised value, the
// weight product and the rotated pair).
template <typename T, typename Emit>
__device__ __forceinline__ void norm_rope_head(const T* src, const T* w, float eps, float rope_theta, int pos,
                                               int D, Emit&& emit) {
    const int lane = threadIdx.x & 31, half = D / 2;
    constexpr int kPairs = kMaxHeadDim / 64;
    float lo[kPairs], hi[kPairs];
    float sum_sq = 0.0f;
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
        const int j = lane + 32 * p;
        lo[p] = hi[p] = 0.0f;
        if (j < half) {
            lo[p] = to_float(src[j]);
            hi[p] = to_float(src[j + half]);
            sum_sq += lo[p] * lo[p] + hi[p] * hi[p];
        }
    }
    const float inv = rsqrtf(warp_sum(sum_sq) / static_cast<float>(D) + eps);
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
        const int j = lane + 32 * p;
        if (j >= half) continue;
        const float a = round_to<T>(to_float(w[j]) * round_to<T>(lo[p] * inv));
        const float c = round_to<T>(to_float(w[j + half]) * round_to<T>(hi[p] * inv));
        // inv_freq = 1 / theta^(2j / D) and the angle in fp32, cos/sin rounded to the model dtype.
        const float inv_freq = 1.0f / powf(rope_theta, static_cast<float>(2 * j) / static_cast<float>(D));
        const float angle = static_cast<float>(pos) * inv_freq;
        const float cs = round_to<T>(cosf(angle)), sn = round_to<T>(sinf(angle));
        emit(j, from_float<T>(a * cs - c * sn), from_float<T>(c * cs + a * sn));
    }
}

// norm_rope_head stored to dst [D].
template <typename T>
__device__ __forceinline__ void norm_rope_head_to(const T* src, const T* w, float eps, float rope_theta,
                                                  int pos, int D, T* dst) {
    norm_rope_head(src, w, eps, rope_theta, pos, D, [&](int j, T lo, T hi) {
        dst[j] = lo;
        dst[j + D / 2] = hi;
    });
}

// e4m3 with a scale, as FP8 weights (a 128 x 128 block a scale) and the FP8 KV cache (a row a scale)
// store values: e4m3(value / scale), scale = max|values| / 448 (1 when all are zero), rounded to
// nearest even and saturating.
constexpr float kE4m3Max = 448.0f;
__device__ __forceinline__ float e4m3_row_scale(float amax) { return amax > 0.0f ? amax / kE4m3Max : 1.0f; }
__device__ __forceinline__ uint8_t to_e4m3(float v, float scale) {
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v / scale, __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
}

// One warp stores the D values at src as an FP8 KV-cache row: dst [D] e4m3, *scale_out its scale.
template <typename T>
__device__ __forceinline__ void store_row_e4m3(const T* src, int D, uint8_t* dst, float* scale_out) {
    constexpr int kPerLane = kMaxHeadDim / 32;
    const int lane = threadIdx.x & 31;
    float v[kPerLane];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        v[i] = c < D ? to_float(src[c]) : 0.0f;
        amax = fmaxf(amax, fabsf(v[i]));
    }
    const float scale = e4m3_row_scale(warp_max(amax));
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i < D) dst[lane + 32 * i] = to_e4m3(v[i], scale);
    if (lane == 0) *scale_out = scale;
}

// norm_rope_head stored as an FP8 KV-cache row (the key of a new token), from the values rounded
// to T as norm_rope_head_to stores them.
template <typename T>
__device__ __forceinline__ void norm_rope_head_to_e4m3(const T* src, const T* w, float eps, float rope_theta,
                                                       int pos, int D, uint8_t* dst, float* scale_out) {
    constexpr int kPairs = kMaxHeadDim / 64;
    const int lane = threadIdx.x & 31;
    float lo[kPairs], hi[kPairs];
#pragma unroll
    for (int p = 0; p < kPairs; ++p) lo[p] = hi[p] = 0.0f;
    norm_rope_head(src, w, eps, rope_theta, pos, D, [&](int j, T a, T b) {
#pragma unroll
        for (int p = 0; p < kPairs; ++p)  // j = lane + 32 p: a constant index keeps the arrays in registers
            if (j == lane + 32 * p) {
                lo[p] = to_float(a);
                hi[p] = to_float(b);
            }
    });
    float amax = 0.0f;
#pragma unroll
    for (int p = 0; p < kPairs; ++p) amax = fmaxf(amax, fmaxf(fabsf(lo[p]), fabsf(hi[p])));
    const float scale = e4m3_row_scale(warp_max(amax));
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
        const int j = lane + 32 * p;
        if (j >= D / 2) continue;
        dst[j] = to_e4m3(lo[p], scale);
        dst[j + D / 2] = to_e4m3(hi[p], scale);
    }
    if (lane == 0) *scale_out = scale;
}

// True in the one block that finishes last of `expected` blocks counting on *done (which it returns to
// zero for the next call); every write of the counted blocks is then visible to it.
__device__ __forceinline__ bool last_block_of(int* done, int expected) {
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        is_last = atomicAdd(done, 1) == expected - 1;
        if (is_last) *done = 0;
    }
    __syncthreads();
    if (is_last) __threadfence();
    return is_last;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

}  // namespace moerl::model::cuda
