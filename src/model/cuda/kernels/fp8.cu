// FP8 rollout's kernels. The quantiser: block-scaled e4m3 from the trainer's fp32 or bf16 weights, at
// each weight sync; one block of 256 threads a 128 x 128 tile (the tile's largest magnitude, then every
// element divided by the tile's scale and rounded to e4m3; the tile is read twice, the second time
// from L1 or L2: this runs once a sync, bound by the weight bytes read). The dense GEMV over e4m3
// weights: what decode reads drops to a byte a weight.
#include <cuda_fp8.h>

#include "routing.cuh"

namespace moerl::model::cuda {
namespace {

constexpr int kQuantThreads = 256;

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
    const float scale = e4m3_row_scale(amax);
    if (threadIdx.x == 0) {
        const int64_t block_cols = (cols + kFp8BlockCols - 1) / kFp8BlockCols;
        const int64_t block_rows = (rows + kFp8BlockRows - 1) / kFp8BlockRows;
        scales[(matrix * block_rows + block_row) * block_cols + block_col] = scale;
    }
    for (int i = threadIdx.x; i < tile_rows * kFp8BlockCols; i += kQuantThreads) {
        const int r = i / kFp8BlockCols, c = i % kFp8BlockCols;
        if (c >= tile_cols) continue;
        const int64_t at = (row0 + r) * cols + col0 + c;
        dst[at] = to_e4m3(to_float(src[at]), scale);
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

namespace moerl::model::cuda {
namespace {

// The current device's SM count (asked once).
inline int device_sms() {
    static const int sms = [] {
        int device = 0, count = 0;
        MOERL_CUDA_CHECK(cudaGetDevice(&device));
        MOERL_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
        return count;
    }();
    return sms;
}

// Two e4m3 bytes (the low 16 bits) to an fp16 pair, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// 8 bf16 to 8 fp16, saturating at fp16's largest finite magnitude.
__device__ __forceinline__ uint4 bf16x8_to_f16x8(const uint4& raw) {
    const auto* in = reinterpret_cast<const __nv_bfloat162*>(&raw);
    uint4 out;
    auto* o = reinterpret_cast<__half2*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(in[i]);
        o[i] =
            __floats2half2_rn(fminf(fmaxf(f.x, -65504.0f), 65504.0f), fminf(fmaxf(f.y, -65504.0f), 65504.0f));
    }
    return out;
}

// Halves after each fp16 token row of the FP8 products' tiles: the rows a quarter warp reads start 16
// bytes apart modulo 128.
constexpr int kFp8TokenPad = 8;

// The products of FP8 rollout on the tensor cores, for any number of tokens: a block takes 64 /
// kSplit output rows of one weight matrix (the dense projection's, or one routed expert's: gate and
// up rows alike for the gated experts) and every token of that matrix, in passes of 8 * kNTiles
// tokens held in shared memory as fp16. Warp w takes 16 of the rows (group w / kSplit) and every
// kSplit-th 128-column scale block from w % kSplit on; the kSplit warps of a row group sum their
// results in shared memory at the end of a pass. Each lane loads 16 e4m3 bytes of its two weight rows
// (g and g + 8) per 64-column chunk, widens them to fp16 pairs (exactly) and feeds 4 mma.m16n8k16
// steps: logical k = 2t + u of step j is column 16t + 4j + u and k = 2t + 8 + u is column 16t + 4j + 2
// + u, in the weights and the tokens alike, so the fragments need no shuffles. A scale block's
// products sum in fp32 and take the block's scale once.
constexpr int kF8Warps = 4;
// Scale blocks ahead of the products whose weights a warp has asked of L2: 2 against none took the
// experts from 2.9 to 3.0-3.1 TB/s (H200, batch 16 and 64); 4 lost (2.5-2.7).
constexpr int kF8L2Ahead = 2;

enum class Fp8Product { kDense, kGated, kDown };

// A lane's 16 bytes of its two rows (w[m][0], w[m][1]) in both 64-column chunks of the scale block at
// column base, for every matrix; a chunk past the last column is left as it was.
template <int kMats>
__device__ __forceinline__ void load_fp8_block(const uint8_t* const (&w)[kMats][2], int base, int cols,
                                               uint4 (&wq)[2][kMats][2]) {
#pragma unroll
    for (int ch = 0; ch < 2; ++ch)
        if (base + 64 * ch < cols)
#pragma unroll
            for (int m = 0; m < kMats; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    wq[ch][m][h] = *reinterpret_cast<const uint4*>(w[m][h] + base + 64 * ch);
}

// kDense: out[b] = in[b] (q0 * s0)^T for b < B (bf16 out). kGated: act[s] = silu(in[s / row_div] gate^T)
// * (in[s / row_div] up^T) for every slot s routed to the block's expert (q0, s0 gate; q1, s1 up; each
// product rounded to bf16 before the activation, as the bf16 kernels round). kDown: y[s] = in[s] w^T
// (fp32 out). Weights [groups, out_rows, cols] e4m3 with scales [groups, ceil(out_rows / 128),
// ceil(cols / 128)]; cols a multiple of 64.
template <Fp8Product kP, int kNTiles, int kSplit>
__global__ void __launch_bounds__(kF8Warps * 32)
    fp8_rows_mma_kernel(const __nv_bfloat16* in, const uint8_t* q0, const float* s0, const uint8_t* q1,
                        const float* s1, MoeRouting r, int B, int row_div, int cols, int out_rows,
                        __nv_bfloat16* out, float* y) {
    constexpr bool kDense = kP == Fp8Product::kDense;
    constexpr int kMats = kP == Fp8Product::kGated ? 2 : 1;
    constexpr int kTokens = 8 * kNTiles;
    constexpr int kRowGroups = kF8Warps / kSplit;
    extern __shared__ __align__(16) unsigned char f8_smem[];
    auto* tile = reinterpret_cast<__half*>(f8_smem);    // [kTokens, cols + kFp8TokenPad] during the products
    auto* partial = reinterpret_cast<float*>(f8_smem);  // [kF8Warps, kMats, kNTiles, 32, 4] after them
    const int stride = cols + kFp8TokenPad;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int split = warp % kSplit;
    const int row0 = (blockIdx.x * kRowGroups + warp / kSplit) * 16;
    const int block_cols = (cols + kFp8BlockCols - 1) / kFp8BlockCols;
    const int block_rows = (out_rows + kFp8BlockRows - 1) / kFp8BlockRows;
    const uint8_t* w[kMats]
                    [2];     // rows row0 + g and row0 + g + 8 (the last row past the end), lane's 16 bytes
    const float* sc[kMats];  // the scale blocks of row0's 128 rows
    const uint8_t* l2_row = nullptr;  // the row whose lines this lane asks L2 for (ask_l2)
    auto point_at = [&](int e) {
        const size_t matrix = static_cast<size_t>(e) * out_rows * cols;
        const int rb = min(row0, out_rows - 1) / kFp8BlockRows;
#pragma unroll
        for (int m = 0; m < kMats; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = min(row0 + g + 8 * h, out_rows - 1);
                w[m][h] = (m == 0 ? q0 : q1) + matrix + static_cast<size_t>(row) * cols + 16 * t;
            }
            sc[m] = (m == 0 ? s0 : s1) + (static_cast<size_t>(e) * block_rows + rb) * block_cols;
        }
        const bool second = kMats == 2 && (t & 2) != 0;
        l2_row = (t & 1) == 0 ? (second ? w[kMats - 1][0] : w[0][0]) : (second ? w[kMats - 1][1] : w[0][1]);
    };
    int first = 0, n = B;
    if constexpr (kDense) {
        point_at(0);
        // The weights come from no kernel before this one: L2 gets this warp's first block now.
        if (split < block_cols)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                for (int ch = 0; ch < 2 && split * kFp8BlockCols + 64 * ch < cols; ++ch)
                    prefetch_l2(w[0][h] + split * kFp8BlockCols + 64 * ch);
        griddep_wait();
        griddep_launch_dependents();
    } else {
        griddep_wait();
        griddep_launch_dependents();
        if (static_cast<int>(blockIdx.y) >= *r.num_active) return;
        const int e = r.active_experts[blockIdx.y];
        first = r.expert_offset[e];
        n = r.expert_offset[e + 1] - first;
        point_at(e);
    }
    // This warp's weights of scale block kb (two 64-column chunks, the second absent past the end)
    // and its scales: loaded one block ahead of the products.
    auto load = [&](int kb, uint4(&wq)[2][kMats][2], float(&scale)[kMats]) {
        load_fp8_block<kMats>(w, kb * kFp8BlockCols, cols, wq);
#pragma unroll
        for (int m = 0; m < kMats; ++m) scale[m] = sc[m][kb];
    };
    // Scale block kb's 128 columns of one row are one 128-byte line: lane t < 2 kMats asks L2 for the
    // line of row g + 8 (t & 1) of matrix t / 2 up to kF8L2Ahead blocks past the one in registers, so
    // more of the weights are on their way than the registers hold.
    auto ask_l2 = [&](int kb) {
        if (t < 2 * kMats && kb < block_cols) prefetch_l2(l2_row + kb * kFp8BlockCols);
    };
    const bool has_rows = row0 < out_rows;
    for (int c0 = 0; c0 < n; c0 += kTokens) {
        const int nt = min(kTokens, n - c0);
        uint4 cur[2][kMats][2];
        float cur_scale[kMats];
        if (has_rows && split < block_cols) load(split, cur, cur_scale);  // in flight while the tile loads
        if (has_rows && c0 == 0)
            for (int j = 2; j <= kF8L2Ahead; ++j) ask_l2(split + j * kSplit);
        __syncthreads();  // the previous pass's partial sums have been read
        for (int i = threadIdx.x * 8; i < kTokens * cols; i += kF8Warps * 32 * 8) {
            const int j = i / cols, c = i - j * cols;
            uint4 v = make_uint4(0, 0, 0, 0);  // rows past the tokens multiply as zeros
            if (j < nt) {
                const int src = kDense ? c0 + j : r.expert_slots[first + c0 + j] / row_div;
                v = bf16x8_to_f16x8(
                    *reinterpret_cast<const uint4*>(in + static_cast<size_t>(src) * cols + c));
            }
            *reinterpret_cast<uint4*>(tile + j * stride + c) = v;
        }
        __syncthreads();
        float acc[kMats][kNTiles][4] = {};
        for (int kb = split; has_rows && kb < block_cols; kb += kSplit) {
            uint4 next[2][kMats][2];
            float next_scale[kMats];
            if (kb + kSplit < block_cols) load(kb + kSplit, next, next_scale);
            if (c0 == 0) ask_l2(kb + (kF8L2Ahead + 1) * kSplit);
            const int base = kb * kFp8BlockCols;
            float part[kMats][kNTiles][4] = {};
#pragma unroll
            for (int ch = 0; ch < 2; ++ch) {
                if (base + 64 * ch >= cols) break;
                uint32_t a[kMats][4][4];  // [matrix][mma step][fragment register]
#pragma unroll
                for (int m = 0; m < kMats; ++m) {
                    const auto* lo = reinterpret_cast<const uint32_t*>(&cur[ch][m][0]);  // row g
                    const auto* hi = reinterpret_cast<const uint32_t*>(&cur[ch][m][1]);  // row g + 8
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        a[m][j][0] = e4m3x2_to_f16x2(lo[j]);
                        a[m][j][1] = e4m3x2_to_f16x2(hi[j]);
                        a[m][j][2] = e4m3x2_to_f16x2(lo[j] >> 16);
                        a[m][j][3] = e4m3x2_to_f16x2(hi[j] >> 16);
                    }
                }
#pragma unroll
                for (int q = 0; q < kNTiles; ++q) {
                    const __half* tp = tile + (q * 8 + g) * stride + base + 64 * ch + 16 * t;
                    const uint4 b0 = *reinterpret_cast<const uint4*>(tp);
                    const uint4 b1 = *reinterpret_cast<const uint4*>(tp + 8);
                    const uint32_t b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                    for (int m = 0; m < kMats; ++m)
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            mma_f16(part[m][q], a[m][j][0], a[m][j][1], a[m][j][2], a[m][j][3], b[2 * j],
                                    b[2 * j + 1]);
                }
            }
#pragma unroll
            for (int m = 0; m < kMats; ++m) {
#pragma unroll
                for (int q = 0; q < kNTiles; ++q)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[m][q][i] += cur_scale[m] * part[m][q][i];
                cur_scale[m] = next_scale[m];
#pragma unroll
                for (int ch = 0; ch < 2; ++ch) cur[ch][m][0] = next[ch][m][0], cur[ch][m][1] = next[ch][m][1];
            }
        }
        __syncthreads();  // every warp is done with the tile: its memory takes the partial sums
        float* mine = partial + static_cast<size_t>(warp) * kMats * kNTiles * 128;
#pragma unroll
        for (int m = 0; m < kMats; ++m)
#pragma unroll
            for (int q = 0; q < kNTiles; ++q)
#pragma unroll
                for (int i = 0; i < 4; ++i) mine[((m * kNTiles + q) * 32 + lane) * 4 + i] = acc[m][q][i];
        __syncthreads();
        // Item (row group, tile q, lane l, register i): row g + 8 (i / 2), token 2t + i % 2 of lane l's
        // fragment, summed over the group's kSplit warps in their order.
        for (int idx = threadIdx.x; idx < kRowGroups * kNTiles * 128; idx += kF8Warps * 32) {
            const int group = idx / (kNTiles * 128), q = idx / 128 % kNTiles, l = idx / 4 % 32, i = idx % 4;
            const int row = (blockIdx.x * kRowGroups + group) * 16 + l / 4 + 8 * (i / 2);
            const int token = q * 8 + 2 * (l % 4) + i % 2;
            if (token >= nt || row >= out_rows) continue;
            float v[kMats];
#pragma unroll
            for (int m = 0; m < kMats; ++m) {
                float s = 0.0f;
                for (int k = 0; k < kSplit; ++k)
                    s += partial[(((group * kSplit + k) * kMats + m) * kNTiles + q) * 128 + l * 4 + i];
                v[m] = s;
            }
            if constexpr (kDense) {
                out[static_cast<size_t>(c0 + token) * out_rows + row] = __float2bfloat16(v[0]);
            } else {
                const size_t at = static_cast<size_t>(r.expert_slots[first + c0 + token]) * out_rows + row;
                if constexpr (kP == Fp8Product::kGated) {
                    const float gv = round_to<__nv_bfloat16>(v[0]),
                                uv = round_to<__nv_bfloat16>(v[kMats - 1]);
                    out[at] = __float2bfloat16(round_to<__nv_bfloat16>(silu(gv)) * uv);
                } else {
                    y[at] = v[0];
                }
            }
        }
    }
}

template <Fp8Product kP, int kNTiles>
size_t fp8_mma_smem(int cols) {
    const size_t tile = sizeof(__half) * 8 * kNTiles * (cols + kFp8TokenPad);
    const size_t sums = sizeof(float) * kF8Warps * (kP == Fp8Product::kGated ? 2 : 1) * kNTiles * 128;
    return tile > sums ? tile : sums;
}

// B rows of in; the experts' slots are B * row_div (each row of in feeds row_div of them).
struct Fp8Operands {
    const void* in;
    const uint8_t* q0;
    const float* s0;
    const uint8_t* q1;
    const float* s1;
    int B, row_div, cols, out_rows, groups;
    void* out;
    float* y;
};

template <Fp8Product kP, int kNTiles, int kSplit>
void launch_fp8_mma(const Fp8Operands& o, const MoeRouting& r, const Launch& launch) {
    const size_t smem = fp8_mma_smem<kP, kNTiles>(o.cols);
    auto kernel = fp8_rows_mma_kernel<kP, kNTiles, kSplit>;
    ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    const int rows_per_block = 16 * kF8Warps / kSplit;
    launch_kernel(kernel, dim3((o.out_rows + rows_per_block - 1) / rows_per_block, o.groups), kF8Warps * 32,
                  smem, launch, static_cast<const __nv_bfloat16*>(o.in), o.q0, o.s0, o.q1, o.s1, r, o.B,
                  o.row_div, o.cols, o.out_rows, static_cast<__nv_bfloat16*>(o.out), o.y);
}

constexpr int kPassRows = 16 * kF8Warps;

// The dense and gate/up products in passes, for grids of two blocks an SM or more (the LM head; the
// experts from a few tokens a step on): a block takes 64 rows of one matrix (4 warps of 16, every
// column) and one pass of up to 8 * kNTiles of its tokens; a popular expert's passes are blocks of
// their own (find_pass, as the bf16 expert kernels), the dense projection's passes go along
// blockIdx.x. kUnroll scale blocks of weights are loaded at once, as many bytes in flight a warp as
// the bf16 expert kernel's: gate and up 2 blocks of both, one matrix 4. The fragments and the scales
// as in fp8_rows_mma_kernel.
template <Fp8Product kP, int kNTiles>
__global__ void __launch_bounds__(kF8Warps * 32)
    fp8_passes_mma_kernel(const __nv_bfloat16* in, const uint8_t* q0, const float* s0, const uint8_t* q1,
                          const float* s1, MoeRouting r, int B, int row_div, int cols, int out_rows,
                          __nv_bfloat16* out) {
    static_assert(kP != Fp8Product::kDown, "the down experts run fp8_rows_mma_kernel");
    constexpr bool kDense = kP == Fp8Product::kDense, kGated = kP == Fp8Product::kGated;
    constexpr int kMats = kGated ? 2 : 1;
    constexpr int kUnroll = kGated ? 2 : 4;
    constexpr int kTokens = 8 * kNTiles;
    griddep_wait();
    griddep_launch_dependents();
    extern __shared__ __align__(16) unsigned char mma_smem[];
    auto* tile = reinterpret_cast<__half*>(mma_smem);  // [kTokens, cols + kFp8TokenPad]
    const int stride = cols + kFp8TokenPad;
    // The dense projection's passes go along x, so a row block's passes run side by side (its weights
    // read once from memory, then from L2); an expert's rows go along x.
    const int row_block = kDense ? blockIdx.y : blockIdx.x;
    int e = 0, first = blockIdx.x * kTokens, nt = min(kTokens, B - first);
    if constexpr (!kDense) {
        const ExpertPass pass = find_pass(r, kTokens);
        if (pass.expert < 0) return;
        e = pass.expert, first = pass.first, nt = pass.count;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = (row_block * kF8Warps + warp) * 16;
    const int block_cols = cols / kFp8BlockCols + (cols % kFp8BlockCols != 0);
    const int block_rows = (out_rows + kFp8BlockRows - 1) / kFp8BlockRows;
    // Rows row0 + g and row0 + g + 8 (the last row past the end) at the lane's 16 bytes; the scale
    // blocks of row0's 128 rows.
    const uint8_t* wr[kMats][2];
    const float* sc[kMats];
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = min(row0 + g + 8 * h, out_rows - 1);
            wr[m][h] = (m == 0 ? q0 : q1) + (static_cast<size_t>(e) * out_rows + row) * cols + 16 * t;
        }
        const int rb = min(row0, out_rows - 1) / kFp8BlockRows;
        sc[m] = (m == 0 ? s0 : s1) + (static_cast<size_t>(e) * block_rows + rb) * block_cols;
    }
    for (int i = threadIdx.x * 8; i < kTokens * cols; i += blockDim.x * 8) {
        const int j = i / cols, c = i % cols;
        uint4 v = make_uint4(0, 0, 0, 0);  // rows past the pass's tokens multiply as zeros
        if (j < nt) {
            const int src = kDense ? first + j : r.expert_slots[first + j] / row_div;
            v = bf16x8_to_f16x8(*reinterpret_cast<const uint4*>(in + static_cast<size_t>(src) * cols + c));
        }
        *reinterpret_cast<uint4*>(tile + j * stride + c) = v;
    }
    __syncthreads();
    if (row0 >= out_rows) return;
    float acc[kMats][kNTiles][4] = {};
    for (int kb0 = 0; kb0 < block_cols; kb0 += kUnroll) {
        uint4 wq[kUnroll][2][kMats][2];  // [block][64-column chunk][matrix][row g, row g + 8]
        float scale[kUnroll][kMats];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            load_fp8_block<kMats>(wr, (kb0 + u) * kFp8BlockCols, cols, wq[u]);
#pragma unroll
            for (int m = 0; m < kMats; ++m) scale[u][m] = kb0 + u < block_cols ? sc[m][kb0 + u] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int base = (kb0 + u) * kFp8BlockCols;
            if (base >= cols) break;
            float part[kMats][kNTiles][4] = {};
#pragma unroll
            for (int ch = 0; ch < 2; ++ch) {
                if (base + 64 * ch >= cols) break;
                uint32_t b[kNTiles][8];
#pragma unroll
                for (int q = 0; q < kNTiles; ++q) {
                    const __half* tp = tile + (q * 8 + g) * stride + base + 64 * ch + 16 * t;
                    const uint4 b0 = *reinterpret_cast<const uint4*>(tp);
                    const uint4 b1 = *reinterpret_cast<const uint4*>(tp + 8);
                    b[q][0] = b0.x, b[q][1] = b0.y, b[q][2] = b0.z, b[q][3] = b0.w;
                    b[q][4] = b1.x, b[q][5] = b1.y, b[q][6] = b1.z, b[q][7] = b1.w;
                }
#pragma unroll
                for (int m = 0; m < kMats; ++m) {
                    const auto* lo = reinterpret_cast<const uint32_t*>(&wq[u][ch][m][0]);  // row g
                    const auto* hi = reinterpret_cast<const uint32_t*>(&wq[u][ch][m][1]);  // row g + 8
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const uint32_t a0 = e4m3x2_to_f16x2(lo[j]), a1 = e4m3x2_to_f16x2(hi[j]),
                                       a2 = e4m3x2_to_f16x2(lo[j] >> 16), a3 = e4m3x2_to_f16x2(hi[j] >> 16);
#pragma unroll
                        for (int q = 0; q < kNTiles; ++q)
                            mma_f16(part[m][q], a0, a1, a2, a3, b[q][2 * j], b[q][2 * j + 1]);
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < kMats; ++m)
#pragma unroll
                for (int q = 0; q < kNTiles; ++q)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[m][q][i] += scale[u][m] * part[m][q][i];
        }
    }
    for_each_mma_output<kNTiles>(row0, nt, out_rows, [&](int q, int i, int token, int row) {
        if constexpr (kDense) {
            out[static_cast<size_t>(first + token) * out_rows + row] = __float2bfloat16(acc[0][q][i]);
        } else {
            const size_t at = static_cast<size_t>(r.expert_slots[first + token]) * out_rows + row;
            const float gv = round_to<__nv_bfloat16>(acc[0][q][i]),
                        uv = round_to<__nv_bfloat16>(acc[kMats - 1][q][i]);
            out[at] = __float2bfloat16(round_to<__nv_bfloat16>(silu(gv)) * uv);
        }
    });
}

template <Fp8Product kP, int kNTiles>
void launch_fp8_passes(const Fp8Operands& o, const MoeRouting& r, const Launch& launch) {
    constexpr int kTokens = 8 * kNTiles;
    const size_t smem = sizeof(__half) * kTokens * (o.cols + kFp8TokenPad);
    auto kernel = fp8_passes_mma_kernel<kP, kNTiles>;
    ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    const int passes = kP == Fp8Product::kDense ? (o.B + kTokens - 1) / kTokens
                                                : pass_blocks(o.B * o.row_div, o.groups, kTokens);
    const int row_blocks = (o.out_rows + kPassRows - 1) / kPassRows;
    const dim3 grid = kP == Fp8Product::kDense ? dim3(passes, row_blocks) : dim3(row_blocks, passes);
    launch_kernel(kernel, grid, kF8Warps * 32, smem, launch, static_cast<const __nv_bfloat16*>(o.in), o.q0,
                  o.s0, o.q1, o.s1, r, o.B, o.row_div, o.cols, o.out_rows,
                  static_cast<__nv_bfloat16*>(o.out));
}

// The split of the columns: the fewest warps a row group (the most rows a block, so the token tile
// is loaded for more weights) that still gives every SM two blocks or more.
template <Fp8Product kP, int kNTiles>
void launch_fp8_split(const Fp8Operands& o, const MoeRouting& r, const Launch& launch) {
    const int sms = device_sms();
    auto blocks = [&](int split) { return int64_t{(o.out_rows + 64 / split - 1) / (64 / split)} * o.groups; };
    if (blocks(1) >= 2 * sms) return launch_fp8_mma<kP, kNTiles, 1>(o, r, launch);
    if (blocks(2) >= 2 * sms) return launch_fp8_mma<kP, kNTiles, 2>(o, r, launch);
    launch_fp8_mma<kP, kNTiles, 4>(o, r, launch);
}

// One token tile a pass (8 tokens), or two (16) once a matrix gets more than 8 tokens (on average,
// for the experts).
template <Fp8Product kP>
void launch_fp8_tiles(const Fp8Operands& o, int tokens, const MoeRouting& r, const Launch& launch) {
    if (o.B == 0 || o.groups == 0 || o.out_rows == 0) return;
    MOERL_CHECK(fp8_products_supported(o.cols), "FP8 products: ", o.cols,
                " columns, expected a multiple of 64 up to ", kMaxHidden);
    const int64_t blocks = int64_t{(o.out_rows + kPassRows - 1) / kPassRows} * o.groups;
    // The down experts keep the split kernel: in passes they took 84.7 us against 81.5 at batch 64
    // and the same at 16 (H100), where gate + up went from 160.5 to 146.0 and 103.9 to 97.4.
    if constexpr (kP != Fp8Product::kDown) {
        if (blocks >= 2 * device_sms()) {
            if (tokens > 8) return launch_fp8_passes<kP, 2>(o, r, launch);
            return launch_fp8_passes<kP, 1>(o, r, launch);
        }
    }
    if (tokens > 8)
        launch_fp8_split<kP, 2>(o, r, launch);
    else
        launch_fp8_split<kP, 1>(o, r, launch);
}

}  // namespace

bool fp8_products_supported(int cols) { return cols > 0 && cols % 64 == 0 && cols <= kMaxHidden; }

void launch_dense_fp8(const void* in, const uint8_t* q, const float* scales, int B, int cols, int out_rows,
                      void* out, const Launch& launch) {
    launch_fp8_tiles<Fp8Product::kDense>(
        {in, q, scales, nullptr, nullptr, B, 1, cols, out_rows, 1, out, nullptr}, B, MoeRouting{}, launch);
}

void launch_moe_gate_up_fp8(const void* h, const uint8_t* gate_q, const float* gate_scales,
                            const uint8_t* up_q, const float* up_scales, const MoeRouting& r, int B, int K,
                            int H, int I, int max_active, void* act, const Launch& launch) {
    const int per_expert = max_active > 0 ? (B * K + max_active - 1) / max_active : 0;
    launch_fp8_tiles<Fp8Product::kGated>(
        {h, gate_q, gate_scales, up_q, up_scales, B, K, H, I, max_active, act, nullptr}, per_expert, r,
        launch);
}

void launch_moe_down_fp8(const void* act, const uint8_t* down_q, const float* down_scales,
                         const MoeRouting& r, int B, int K, int H, int I, int max_active, float* y,
                         const Launch& launch) {
    const int per_expert = max_active > 0 ? (B * K + max_active - 1) / max_active : 0;
    launch_fp8_tiles<Fp8Product::kDown>(
        {act, down_q, down_scales, nullptr, nullptr, B * K, 1, I, H, max_active, nullptr, y}, per_expert, r,
        launch);
}

}  // namespace moerl::model::cuda
