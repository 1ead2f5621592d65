// FP8 rollout's kernels. The quantiser: block-scaled e4m3 from the trainer's fp32 or bf16 weights, at
// each weight sync; one block of 256 threads a 128 x 128 tile (the tile's largest magnitude, then every
// element divided by the tile's scale and rounded to e4m3; the tile is read twice, the second time
// from L1 or L2: this runs once a sync, bound by the weight bytes read). The dense GEMV over e4m3
// weights: what decode reads drops to a byte a weight.
#include <cuda_fp8.h>

#include "common.cuh"

namespace moerl::model::cuda {
namespace {

constexpr int kQuantThreads = 256;
constexpr float kFp8Max = 448.0f;

template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_fp8_blocks_kernel(const T* w, int64_t rows, int64_t cols, uint8_t* q, float* scales) {
    const int64_t block_row = blockIdx.y, block_col = blockIdx.x, matrix = blockIdx.z;
    const int64_t row0 = block_row * kFp8BlockRows, col0 = block_col * kFp8BlockCols;
    const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kFp8BlockRows), rows - row0));
    const int tile_cols = static_cast<int>(min(static_cast<int64_t>(kFp8BlockCols), cols - col0));
    const T* src = w + matrix * rows * cols;
    uint8_t* dst = q + matrix * rows * cols;
    griddep_wait();  // the weights may come from the previous kernel (the optimizer's step)
    // Consecutive threads take consecutive columns of a row: coalesced reads and writes.
    float amax = 0.0f;
    for (int i = threadIdx.x; i < tile_rows * kFp8BlockCols; i += kQuantThreads) {
        const int r = i / kFp8BlockCols, c = i % kFp8BlockCols;
        if (c < tile_cols) amax = fmaxf(amax, fabsf(to_float(src[(row0 + r) * cols + col0 + c])));
    }
    __shared__ float scratch[32];
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = warp_max((threadIdx.x & 31) < kQuantThreads / 32 ? scratch[threadIdx.x & 31] : 0.0f);
    const float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
    if (threadIdx.x == 0) {
        const int64_t block_cols = (cols + kFp8BlockCols - 1) / kFp8BlockCols;
        const int64_t block_rows = (rows + kFp8BlockRows - 1) / kFp8BlockRows;
        scales[(matrix * block_rows + block_row) * block_cols + block_col] = scale;
    }
    for (int i = threadIdx.x; i < tile_rows * kFp8BlockCols; i += kQuantThreads) {
        const int r = i / kFp8BlockCols, c = i % kFp8BlockCols;
        if (c >= tile_cols) continue;
        const int64_t at = (row0 + r) * cols + col0 + c;
        dst[at] =
            static_cast<uint8_t>(__nv_cvt_float_to_fp8(to_float(src[at]) / scale, __NV_SATFINITE, __NV_E4M3));
    }
}

}  // namespace

void launch_quantize_fp8_blocks(int dtype, const void* w, int64_t batch, int64_t rows, int64_t cols,
                                uint8_t* q, float* scales, const Launch& launch) {
    if (batch == 0 || rows == 0 || cols == 0) return;
    MOERL_CHECK(batch <= 65535 && (rows + kFp8BlockRows - 1) / kFp8BlockRows <= 65535,
                "quantize_fp8_blocks: ", batch, " matrices of ", rows, " rows exceed the launch grid");
    const dim3 grid(static_cast<unsigned>((cols + kFp8BlockCols - 1) / kFp8BlockCols),
                    static_cast<unsigned>((rows + kFp8BlockRows - 1) / kFp8BlockRows),
                    static_cast<unsigned>(batch));
    if (dtype == 0)
        launch_kernel(quantize_fp8_blocks_kernel<float>, grid, dim3(kQuantThreads), 0, launch,
                      static_cast<const float*>(w), rows, cols, q, scales);
    else
        launch_kernel(quantize_fp8_blocks_kernel<__nv_bfloat16>, grid, dim3(kQuantThreads), 0, launch,
                      static_cast<const __nv_bfloat16*>(w), rows, cols, q, scales);
}

}  // namespace moerl::model::cuda

namespace moerl::model::cuda {
namespace {

constexpr int kFp8GemvWarps = 8;   // output rows a block, one a warp
constexpr int kFp8GemvTokens = 8;  // tokens a pass over the weights
constexpr int kFp8GemvUnroll = 4;  // 16-byte weight loads a lane keeps in flight

// 16 e4m3 bytes (one 16-byte load) to floats.
__device__ __forceinline__ void e4m3x16_to_float(const uint4& raw, float* out) {
    const auto* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// Warp w of block b takes output row b * 8 + w; lane l reads columns l * 16 + 512 k. A 16-column
// chunk lies inside one 128-column block, so its partial dot takes that block's scale once.
__global__ void __launch_bounds__(kFp8GemvWarps * 32)
    dense_rows_fp8_kernel(const __nv_bfloat16* in, const uint8_t* q, const float* scales, int B, int cols,
                          int out_rows, __nv_bfloat16* out) {
    extern __shared__ __align__(16) unsigned char tile_bytes[];
    auto* tile = reinterpret_cast<__nv_bfloat16*>(tile_bytes);  // [kFp8GemvTokens, cols]
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * kFp8GemvWarps + (threadIdx.x >> 5);
    const int block_cols = (cols + kFp8BlockCols - 1) / kFp8BlockCols;
    const uint8_t* w = q + static_cast<size_t>(min(row, out_rows - 1)) * cols;
    const float* row_scales =
        scales + static_cast<size_t>(min(row, out_rows - 1) / kFp8BlockRows) * block_cols;
    griddep_wait();
    griddep_launch_dependents();
    for (int t0 = 0; t0 < B; t0 += kFp8GemvTokens) {
        const int nt = min(kFp8GemvTokens, B - t0);
        __syncthreads();
        for (int i = threadIdx.x * 8; i < nt * cols; i += blockDim.x * 8)
            *reinterpret_cast<uint4*>(tile + i) =
                *reinterpret_cast<const uint4*>(in + static_cast<size_t>(t0) * cols + i);
        __syncthreads();
        if (row >= out_rows) continue;
        float acc[kFp8GemvTokens] = {};
        for (int c0 = lane * 16; c0 < cols; c0 += 512 * kFp8GemvUnroll) {
            uint4 raw[kFp8GemvUnroll];
#pragma unroll
            for (int u = 0; u < kFp8GemvUnroll; ++u)
                if (c0 + u * 512 < cols) raw[u] = *reinterpret_cast<const uint4*>(w + c0 + u * 512);
#pragma unroll
            for (int u = 0; u < kFp8GemvUnroll; ++u) {
                const int c = c0 + u * 512;
                if (c >= cols) break;
                float wv[16];
                e4m3x16_to_float(raw[u], wv);
                const float scale = row_scales[c / kFp8BlockCols];
#pragma unroll
                for (int j = 0; j < kFp8GemvTokens; ++j) {
                    if (j >= nt) break;
                    float xv[16];
                    load8(tile + j * cols + c, xv);
                    load8(tile + j * cols + c + 8, xv + 8);
                    float dot = 0.0f;
#pragma unroll
                    for (int k = 0; k < 16; ++k) dot += wv[k] * xv[k];
                    acc[j] += scale * dot;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < kFp8GemvTokens; ++j) {
            if (j >= nt) break;
            const float v = warp_sum(acc[j]);
            if (lane == 0) out[static_cast<size_t>(t0 + j) * out_rows + row] = __float2bfloat16(v);
        }
    }
}

}  // namespace

void launch_dense_rows_fp8(const void* in, const uint8_t* q, const float* scales, int B, int cols,
                           int out_rows, void* out, const Launch& launch) {
    if (B == 0 || out_rows == 0) return;
    MOERL_CHECK(cols > 0 && cols % 16 == 0 && cols <= kMaxHidden, "dense_rows_fp8: cols = ", cols,
                ", expected a multiple of 16 up to ", kMaxHidden);
    const size_t smem = sizeof(__nv_bfloat16) * kFp8GemvTokens * cols;
    ensure_dynamic_smem(reinterpret_cast<const void*>(dense_rows_fp8_kernel), smem);
    launch_kernel(dense_rows_fp8_kernel, dim3((out_rows + kFp8GemvWarps - 1) / kFp8GemvWarps),
                  dim3(kFp8GemvWarps * 32), smem, launch, static_cast<const __nv_bfloat16*>(in), q, scales, B,
                  cols, out_rows, static_cast<__nv_bfloat16*>(out));
}

}  // namespace moerl::model::cuda
