// FP8 weights for rollout: block-scaled e4m3 from the trainer's fp32 or bf16 weights, at each weight
// sync. One block of 256 threads a 128 x 128 tile: the tile's largest magnitude, then every element
// divided by the tile's scale and rounded to e4m3. The tile is read twice (the second time from L1
// or L2): this runs once a sync, bound by the weight bytes read.
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
