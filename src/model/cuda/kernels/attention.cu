// Decode attention over the paged KV cache, split over the sequence (flash-decoding): block
// (head group, row, split) serves G query heads of one key-value head over one chunk of the cached
// tokens. With many rows a group is all the query heads of a key-value head, so every key and value
// is read once per step; with few rows a block serves one query head: the blocks of a key-value head
// read the same keys (from L2) but each does a share of the arithmetic and the merging, which is what
// bounds a step when the GPU holds only a few dozen warps.
//
// Each warp takes 32 / kLanes tokens at a time: the kLanes lanes of a token score it against the G
// queries (each a share of the key row, read with 16-byte loads; the queries broadcast from shared
// memory) and add their parts, an online softmax keeps (max, sum) per query head, then the warp
// accumulates the values with lane i holding dims i, i + 32, ... More lanes per token shorten each
// warp's dependent chains (a quarter of the key row and of the tokens per lane with four), which is
// what bounds the kernel when a step has only a few rows and the GPU holds a few warps per SM.
// The warps' states are merged in shared memory; with one split the block writes the output,
// otherwise a partial (max, sum, unnormalised output) that the last block of the row merges.
//
// With many rows in bf16 a second kernel (paged_attention_mma_kernel, below) takes a whole head group
// a block on the tensor cores: at 4 query heads per key-value head and more, the CUDA cores' eight
// FMAs and the shared-memory reads of q per cached byte bound the kernel above at about a quarter of
// the memory bandwidth, while the tensor cores keep it near the copy bandwidth at RL lengths
// (bench/RESULTS.md, "Rollout at RL lengths").
#include <cfloat>
#include <type_traits>

#include "../kv_fp8_bits.hpp"
#include "common.cuh"

namespace moerl::model::cuda {
namespace {

// (row, key-value head) pairs from which a block serves all of a key-value head's query heads.
constexpr int kAttentionRowsForFullGroups = 32;

// Partial of split s of (row b, head group x): ml [B, X, splits, G, 2] (max, sum), acc [B, X, splits,
// G, D], X = Hq / G groups.
struct Partials {
    float* ml = nullptr;
    float* acc = nullptr;
    int* done = nullptr;  // [B, X] splits finished in the running step (0 between steps)
    int splits = 0;       // allocated splits per (row, group)
};

// QkvInput with typed pointers (qkv == nullptr: q and the pools are ready).
template <typename T>
struct QkvTyped {
    const T* qkv = nullptr;
    const T* q_norm = nullptr;
    const T* k_norm = nullptr;
    float eps = 0.0f;
    float rope_theta = 0.0f;
};

// The end of a block of either kernel: merges the warps' (max, sum, unnormalised output) of G query
// heads from shared memory (m_s, l_s [warps, G], acc_s [warps, G, D]) and writes the output (one
// split) or the split's partial, the last split of (row, group) to finish merging all of them (and
// returning the counter to 0 for the next step), so no second kernel is launched.
template <typename T, int G, int kWarps>
__device__ __forceinline__ void finish_split(const float* m_s, const float* l_s, const float* acc_s, int D,
                                             int num_tokens, int chunk, const Partials& part, T* out_row) {
    const int group = blockIdx.x, b = blockIdx.y, split = blockIdx.z;
    const bool direct = gridDim.z == 1;
    const size_t pidx = (static_cast<size_t>(b) * gridDim.x + group) * part.splits + split;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D;
        float mx = -FLT_MAX;
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_s[w * G + g]);
        float sum = 0.0f, value = 0.0f;
        for (int w = 0; w < kWarps; ++w) {
            if (l_s[w * G + g] == 0.0f) continue;  // a warp that saw no token
            const float f = __expf(m_s[w * G + g] - mx);
            sum += l_s[w * G + g] * f;
            value += acc_s[(w * G + g) * D + (i % D)] * f;
        }
        if (direct) {
            out_row[i] = from_float<T>(value / sum);
        } else {
            part.acc[pidx * G * D + i] = value;
            if (i % D == 0) {
                part.ml[(pidx * G + g) * 2] = mx;
                part.ml[(pidx * G + g) * 2 + 1] = sum;
            }
        }
    }
    if (direct) return;
    const int used = (num_tokens + chunk - 1) / chunk;
    if (!last_block_of(part.done + static_cast<size_t>(b) * gridDim.x + group, used)) return;
    const size_t base = (static_cast<size_t>(b) * gridDim.x + group) * part.splits;
    for (int i = threadIdx.x * 4; i < G * D; i += blockDim.x * 4) {  // D % 4 == 0: one head per float4
        const int g = i / D;
        float mx = -FLT_MAX;
#pragma unroll 4
        for (int s = 0; s < used; ++s) mx = fmaxf(mx, __ldcg(part.ml + ((base + s) * G + g) * 2));
        float sum = 0.0f;
        float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
        for (int s = 0; s < used; ++s) {
            const float f = __expf(__ldcg(part.ml + ((base + s) * G + g) * 2) - mx);
            sum += __ldcg(part.ml + ((base + s) * G + g) * 2 + 1) * f;
            const float4 a = __ldcg(reinterpret_cast<const float4*>(part.acc + (base + s) * G * D + i));
            value.x += a.x * f, value.y += a.y * f, value.z += a.z * f, value.w += a.w * f;
        }
        const float inv = 1.0f / sum;
        out_row[i] = from_float<T>(value.x * inv);
        out_row[i + 1] = from_float<T>(value.y * inv);
        out_row[i + 2] = from_float<T>(value.z * inv);
        out_row[i + 3] = from_float<T>(value.w * inv);
    }
}

// G query heads per block (a group of one key-value head's heads); kDimsPerLane = ceil(D / 32);
// kAttnWarps warps per block, each taking 32 / kLanes tokens of the block's chunk at a time. The
// 4-lane shape keeps two blocks an SM (at most 128 registers; uncapped, the eight-head shape with the
// q/k step inside spills past that and runs slower).
template <typename T, int G, int kDimsPerLane, int kAttnWarps, int kLanes>
__global__ void __launch_bounds__(kAttnWarps * 32, kLanes == 4 ? 2 : 1)
    paged_attention_kernel(const T* q, T* k_pool, T* v_pool, const int* position, const int* slot,
                           const int* block_table, int max_blocks, int block_size, int Hq, int Hkv, int D,
                           int chunk, Partials part, QkvTyped<T> fused, T* out) {
    // Before the wait: the row's position and block table, and L2 requests for the keys and values
    // of this block's chunk up to (not including) the token the previous kernel stores.
    {
        const int b = blockIdx.y, pos = position[b];
        const int first = blockIdx.z * chunk, last = min(pos, first + chunk);
        const int kv_head = blockIdx.x * G / (Hq / Hkv);
        const int* table = block_table + static_cast<size_t>(slot[b]) * max_blocks;
        const int lines = (D * static_cast<int>(sizeof(T)) + 127) / 128;  // per token and tensor
        for (int i = threadIdx.x; i < (last - first) * 2 * lines; i += blockDim.x) {
            const int t = first + i / (2 * lines), r = i % (2 * lines);
            const size_t row = (static_cast<size_t>(table[t / block_size]) * block_size + t % block_size) *
                                   static_cast<size_t>(Hkv) * D +
                               static_cast<size_t>(kv_head) * D;
            const T* base = (r < lines ? k_pool : v_pool) + row;
            prefetch_l2(reinterpret_cast<const char*>(base) + (r % lines) * 128);
        }
    }
    griddep_wait();
    griddep_launch_dependents();
    extern __shared__ __align__(16) float smem[];
    float* q_s = smem;                    // [G, D]
    float* m_s = q_s + G * D;             // [warps, G]
    float* l_s = m_s + kAttnWarps * G;    // [warps, G]
    float* acc_s = l_s + kAttnWarps * G;  // [warps, G, D]
    const int group = blockIdx.x, b = blockIdx.y, split = blockIdx.z;
    const int kv_head = group * G / (Hq / Hkv);  // the groups of a key-value head are adjacent
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pos = position[b];
    T* out_row = out + (static_cast<size_t>(b) * Hq + group * G) * D;  // out [B, Hq, D]
    if (pos < 0) {
        if (split == 0)
            for (int i = threadIdx.x; i < G * D; i += blockDim.x) out_row[i] = from_float<T>(0.0f);
        return;
    }
    const int num_tokens = pos + 1;
    const int first = split * chunk, last = min(num_tokens, first + chunk);
    if (first >= last) return;  // past the sequence: not counted among the splits to merge
    const float scale = rsqrtf(static_cast<float>(D));
    const int* table = block_table + static_cast<size_t>(slot[b]) * max_blocks;
    const size_t head_stride = static_cast<size_t>(Hkv) * D;  // one token's row in the pools
    if (fused.qkv != nullptr) {
        // A warp a query head, normalised and rotated from the projection; the chunk holding the new
        // token has its key (last warp) and value (the one before) stored into the pools first.
        const T* qkv_row = fused.qkv + static_cast<size_t>(b) * (Hq + 2 * Hkv) * D;  // [Hq + 2 Hkv, D]
        for (int g = warp; g < G; g += kAttnWarps)
            norm_rope_head(qkv_row + static_cast<size_t>(group * G + g) * D, fused.q_norm, fused.eps,
                           fused.rope_theta, pos, D, [&](int j, T lo, T hi) {
                               q_s[g * D + j] = to_float(lo) * scale;
                               q_s[g * D + j + D / 2] = to_float(hi) * scale;
                           });
        if (pos < last) {
            const size_t row =
                (static_cast<size_t>(table[pos / block_size]) * block_size + pos % block_size) * head_stride +
                static_cast<size_t>(kv_head) * D;
            if (warp == kAttnWarps - 1) {
                norm_rope_head_to(qkv_row + static_cast<size_t>(Hq + kv_head) * D, fused.k_norm, fused.eps,
                                  fused.rope_theta, pos, D, k_pool + row);
            } else if (warp == kAttnWarps - 2) {
                const T* v_src = qkv_row + static_cast<size_t>(Hq + Hkv + kv_head) * D;
                for (int c = lane * 8; c < D; c += 256) {
                    float v[8];
                    load8(v_src + c, v);
                    store8(v_pool + row + c, v);  // exact: T to float and back
                }
            }
        }
    } else {
        const T* q_row = q + (static_cast<size_t>(b) * Hq + group * G) * D;  // q [B, Hq, D]
        for (int i = threadIdx.x * 8; i < G * D; i += blockDim.x * 8) {      // D % 8 == 0
            float v[8];
            load8(q_row + i, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) q_s[i + k] = v[k] * scale;
        }
    }
    __syncthreads();  // q_s, and the new token's key and value, visible to every warp

    float m[G], l[G], acc[G][kDimsPerLane];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < kDimsPerLane; ++i) acc[g][i] = 0.0f;
    }
    constexpr int kTokens = 32 / kLanes;  // tokens of a warp pass
    const int share = lane % kLanes;      // the lane's share of its token's key row
    for (int base = first + warp * kTokens; base < last; base += kAttnWarps * kTokens) {
        const int t = base + lane / kLanes;
        const bool valid = t < last;
        size_t row = 0;  // element offset of token t's (kv_head) row in the pools
        float s[G];
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] = 0.0f;
        if (valid) {
            row = (static_cast<size_t>(table[t / block_size]) * block_size + t % block_size) * head_stride +
                  static_cast<size_t>(kv_head) * D;
            const T* k_row = k_pool + row;
            // The lane's chunks of 8 (every kLanes-th of the D / 8) are requested before any
            // arithmetic: one memory latency per pass instead of one per chunk.
            constexpr int kMine = kDimsPerLane * 4 / kLanes;
            Raw8<T> kraw[kMine];
#pragma unroll
            for (int c = 0; c < kMine; ++c)
                if ((share + c * kLanes) * 8 < D) kraw[c] = load_raw8(k_row + (share + c * kLanes) * 8);
#pragma unroll
            for (int c = 0; c < kMine; ++c) {
                const int d = (share + c * kLanes) * 8;
                if (d >= D) break;
                float kv[8];
                raw8_to_float(kraw[c], kv);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float4 qa = *reinterpret_cast<const float4*>(q_s + g * D + d);
                    const float4 qb = *reinterpret_cast<const float4*>(q_s + g * D + d + 4);
                    s[g] += qa.x * kv[0] + qa.y * kv[1] + qa.z * kv[2] + qa.w * kv[3] + qb.x * kv[4] +
                            qb.y * kv[5] + qb.z * kv[6] + qb.w * kv[7];
                }
            }
        }
        // The lanes of a token (kLanes adjacent lanes) add their parts: every one holds the score.
#pragma unroll
        for (int o = 1; o < kLanes; o <<= 1)
#pragma unroll
            for (int g = 0; g < G; ++g) s[g] += __shfl_xor_sync(kFullMask, s[g], o);
        float p[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float tile_max = warp_max(valid ? s[g] : -FLT_MAX);
            const float m_new = fmaxf(m[g], tile_max);
            const float correction = __expf(m[g] - m_new);
            p[g] = valid ? __expf(s[g] - m_new) : 0.0f;
            l[g] = l[g] * correction + warp_sum(share == 0 ? p[g] : 0.0f);
            m[g] = m_new;
#pragma unroll
            for (int i = 0; i < kDimsPerLane; ++i) acc[g][i] *= correction;
        }
        // Values kVGroup tokens at a time, their loads issued together; token j's row and weights
        // come from its first lane, j * kLanes.
        constexpr int kVGroup = kTokens < 16 ? kTokens : 16;
        const int count = min(kTokens, last - base);
        for (int j0 = 0; j0 < count; j0 += kVGroup) {
            float v[kVGroup][kDimsPerLane];
#pragma unroll
            for (int jj = 0; jj < kVGroup; ++jj) {
                const size_t vrow = __shfl_sync(kFullMask, row, ((j0 + jj) * kLanes) & 31);
                const T* v_row = v_pool + vrow;
#pragma unroll
                for (int i = 0; i < kDimsPerLane; ++i) {
                    const int d = lane + 32 * i;
                    v[jj][i] = j0 + jj < count && d < D ? to_float(v_row[d]) : 0.0f;
                }
            }
#pragma unroll
            for (int jj = 0; jj < kVGroup; ++jj) {
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float pj = __shfl_sync(kFullMask, p[g], ((j0 + jj) * kLanes) & 31);
#pragma unroll
                    for (int i = 0; i < kDimsPerLane; ++i) acc[g][i] += pj * v[jj][i];
                }
            }
        }
    }
    // Merge the warps' (max, sum, acc).
    if (lane == 0)
        for (int g = 0; g < G; ++g) {
            m_s[warp * G + g] = m[g];
            l_s[warp * G + g] = l[g];
        }
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < kDimsPerLane; ++i) {
            const int d = lane + 32 * i;
            if (d < D) acc_s[(warp * G + g) * D + d] = acc[g][i];
        }
    __syncthreads();
    finish_split<T, G, kAttnWarps>(m_s, l_s, acc_s, D, num_tokens, chunk, part, out_row);
}

// ---- the tensor-core kernel (bf16, a block per key-value head) ----------------------------------
//
// Block (key-value head, row, split) serves all G query heads of the key-value head over one chunk;
// each of its kMmaAttnWarps warps takes 16 tokens at a time. Scores and outputs come transposed,
// tokens and dims on the rows of mma.m16n8k16 and the heads on its 8 columns (G = 16 takes two
// column tiles), so a group of 8 wastes none of the tensor cores' work and a lane holds a quarter of
// the registers an untransposed output would:
//   S^T [16 tokens, heads] = K [16 tokens, D] Q^T:  A = the keys, each lane loading 16-byte pieces of
//       rows g and g + 8 straight from the pool (the k order of a dot product is free: logical k
//       2t, 2t + 1 of a 16-wide step are dims 8t + {0, 1} of a 32-dim block, 2t + 8, 2t + 9 are
//       8t + {2, 3}, the next step the other four, as in the expert kernels); B = q from shared memory.
//   O^T [D, heads] += V^T [D, 16 tokens] P^T:  B = P^T, the probabilities packed to bf16 and moved from
//       the score layout (lane g: a token, t: two heads) to the operand layout (g: a head, t: two
//       tokens) by movmatrix.trans; A = V^T, whose rows may be any dims: lane g takes dims
//       16g .. 16g + 15 of its four tokens (2t, 2t + 1, 2t + 8, 2t + 9), loaded as 16-byte pieces and
//       paired across tokens with byte permutes, so that row g of m-tile i is dim 16g + 2i and row
//       g + 8 is dim 16g + 2i + 1 (D = 128; D / 8 dims a lane in general).
// The probabilities are rounded to bf16 for the second product, as flash attention does; scores,
// softmax state and outputs stay fp32. The online softmax is per warp; the warps merge as in the
// CUDA-core kernel (finish_split).
constexpr int kMmaAttnWarps = 4;  // x 16 tokens = kAttentionMinChunk a pass of the block

__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// FP8 KV cache: 8 e4m3 bytes to 8 bf16 in the same order, each value x 2^-120 (kv_fp8_bits.hpp).
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8_scaled(const uint2 raw) {
    uint32_t w[4];
    widen_e4m3x8(raw.x, raw.y, w);
    return make_uint4(w[0], w[1], w[2], w[3]);
}
// The power of two split between the fp8 kernel's bf16 operands (the queries and the value-scaled
// probabilities, x 2^64) and its fp32 results (x 2^56), so no operand leaves bf16's normal range.
constexpr float kFp8OperandScale = 0x1p64f;
constexpr float kFp8ResultScale = kE4m3InBf16 / kFp8OperandScale;

//
// KV = uint8_t: an FP8 KV cache (KvScales). Each lane widens its e4m3 keys and values to bf16 as value
// x 2^-120 (e4m3x8_to_bf16x8_scaled); the queries enter x 2^64, so a score comes out x 2^-56 and is
// multiplied back with its key's scale; the probabilities are multiplied by their value's scale
// (x 2^64) before they are rounded to bf16 (the softmax sum takes them unscaled), and the output x 2^56.
template <int G, int D, typename KV>
__global__ void __launch_bounds__(kMmaAttnWarps * 32)
    paged_attention_mma_kernel(const __nv_bfloat16* q, KV* k_pool, KV* v_pool, KvScales fp8,
                               const int* position, const int* slot, const int* block_table, int max_blocks,
                               int block_size, int Hkv, int chunk, Partials part,
                               QkvTyped<__nv_bfloat16> fused, __nv_bfloat16* out) {
    using T = __nv_bfloat16;
    constexpr bool kFp8 = std::is_same_v<KV, uint8_t>;
    constexpr int kNT = (G + 7) / 8;   // column tiles of heads
    constexpr int kBlocks32 = D / 32;  // 32-dim blocks of a key row
    constexpr int kLaneDims = D / 8;   // dims of a lane in the value product
    constexpr int kMTiles = D / 16;    // row tiles of O^T
    const int kv_head = blockIdx.x, b = blockIdx.y, split = blockIdx.z;
    const int Hq = Hkv * G;
    const size_t head_stride = static_cast<size_t>(Hkv) * D;  // one token's row in the pools
    // Before the wait: L2 requests for the first pass of this block's chunk (up to the token the
    // previous kernel stores); more would only push lines out of L2 before they are read.
    {
        const int pos = position[b];
        const int first = split * chunk, last = min(min(pos, first + chunk), first + kAttentionMinChunk);
        const int* table = block_table + static_cast<size_t>(slot[b]) * max_blocks;
        constexpr int lines = (D * static_cast<int>(sizeof(KV)) + 127) / 128;
        for (int i = threadIdx.x; i < (last - first) * 2 * lines; i += blockDim.x) {
            const int t = first + i / (2 * lines), r = i % (2 * lines);
            const size_t row =
                (static_cast<size_t>(table[t / block_size]) * block_size + t % block_size) * head_stride +
                static_cast<size_t>(kv_head) * D;
            const KV* base = (r < lines ? k_pool : v_pool) + row;
            prefetch_l2(reinterpret_cast<const char*>(base) + (r % lines) * 128);
        }
    }
    griddep_wait();
    griddep_launch_dependents();
    extern __shared__ __align__(16) float smem[];
    float* m_s = smem;                                             // [warps, G]
    float* l_s = m_s + kMmaAttnWarps * G;                          // [warps, G]
    float* acc_s = l_s + kMmaAttnWarps * G;                        // [warps, G, D]
    T* q_s = reinterpret_cast<T*>(acc_s + kMmaAttnWarps * G * D);  // [8 kNT, D], heads past G zero
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int pos = position[b];
    T* out_row = out + (static_cast<size_t>(b) * Hq + kv_head * G) * D;  // out [B, Hq, D]
    if (pos < 0) {
        if (split == 0)
            for (int i = threadIdx.x; i < G * D; i += blockDim.x) out_row[i] = from_float<T>(0.0f);
        return;
    }
    const int num_tokens = pos + 1;
    const int first = split * chunk, last = min(num_tokens, first + chunk);
    if (first >= last) return;  // past the sequence: not counted among the splits to merge
    const int* table = block_table + static_cast<size_t>(slot[b]) * max_blocks;
    auto row_of = [&](int token) {  // element offset of the token's (kv_head) row in the pools
        return (static_cast<size_t>(table[token / block_size]) * block_size + token % block_size) *
                   head_stride +
               static_cast<size_t>(kv_head) * D;
    };
    for (int i = threadIdx.x * 8; i < (8 * kNT - G) * D; i += blockDim.x * 8)
        *reinterpret_cast<uint4*>(q_s + G * D + i) = make_uint4(0, 0, 0, 0);
    // The queries enter an FP8 cache's products x 2^64 (a power of two: exact).
    auto as_query = [](T v) {
        if constexpr (kFp8)
            return __float2bfloat16(__bfloat162float(v) * kFp8OperandScale);
        else
            return v;
    };
    if (fused.qkv != nullptr) {
        // As in the CUDA-core kernel: a warp a query head, normalised and rotated from the
        // projection (rounded to bf16 as launch_qk_norm_rope_store rounds it); the chunk holding the
        // new token stores its key (last warp) and value (the one before) first, as e4m3 rows and
        // their scales in an FP8 cache (as launch_qk_norm_rope_store stores them).
        const T* qkv_row = fused.qkv + static_cast<size_t>(b) * (Hq + 2 * Hkv) * D;
        for (int h = warp; h < G; h += kMmaAttnWarps)
            norm_rope_head(qkv_row + static_cast<size_t>(kv_head * G + h) * D, fused.q_norm, fused.eps,
                           fused.rope_theta, pos, D, [&](int j, T lo, T hi) {
                               q_s[h * D + j] = as_query(lo);
                               q_s[h * D + j + D / 2] = as_query(hi);
                           });
        if (pos < last) {
            const size_t row = row_of(pos);
            const T* k_src = qkv_row + static_cast<size_t>(Hq + kv_head) * D;
            const T* v_src = qkv_row + static_cast<size_t>(Hq + Hkv + kv_head) * D;
            if (warp == kMmaAttnWarps - 1) {
                if constexpr (kFp8)
                    norm_rope_head_to_e4m3(k_src, fused.k_norm, fused.eps, fused.rope_theta, pos, D,
                                           k_pool + row, fp8.k + row / D);
                else
                    norm_rope_head_to(k_src, fused.k_norm, fused.eps, fused.rope_theta, pos, D, k_pool + row);
            } else if (warp == kMmaAttnWarps - 2) {
                if constexpr (kFp8) {
                    store_row_e4m3(v_src, D, v_pool + row, fp8.v + row / D);
                } else {
                    for (int c = lane * 8; c < D; c += 256)
                        *reinterpret_cast<uint4*>(v_pool + row + c) =
                            *reinterpret_cast<const uint4*>(v_src + c);
                }
            }
        }
    } else if constexpr (kFp8) {
        const T* q_row = q + (static_cast<size_t>(b) * Hq + kv_head * G) * D;  // q [B, Hq, D]
        for (int i = threadIdx.x; i < G * D; i += blockDim.x) q_s[i] = as_query(q_row[i]);
    } else {
        const T* q_row = q + (static_cast<size_t>(b) * Hq + kv_head * G) * D;  // q [B, Hq, D]
        for (int i = threadIdx.x * 8; i < G * D; i += blockDim.x * 8)
            *reinterpret_cast<uint4*>(q_s + i) = *reinterpret_cast<const uint4*>(q_row + i);
    }
    __syncthreads();  // q_s, and the new token's key and value, visible to every warp

    // q as the B operand of the scores: column (head) g of tile n, dims 32s + 8t .. 8t + 7.
    uint4 qf[kNT][kBlocks32];
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int s = 0; s < kBlocks32; ++s)
            qf[n][s] = *reinterpret_cast<const uint4*>(q_s + (8 * n + g) * D + 32 * s + 8 * t);
    // Softmax state of the lane's heads 8n + 2t + c (max in log2 units, the lane's share of the sum),
    // and O^T: o[n][i] rows dims 16g + 2i (0, 1) and 16g + 2i + 1 (2, 3), columns heads 2t, 2t + 1.
    float m[kNT][2], l[kNT][2], o[kNT][kMTiles][4];
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
        m[n][0] = m[n][1] = -FLT_MAX;
        l[n][0] = l[n][1] = 0.0f;
#pragma unroll
        for (int i = 0; i < kMTiles; ++i) o[n][i][0] = o[n][i][1] = o[n][i][2] = o[n][i][3] = 0.0f;
    }
    const float scale = rsqrtf(static_cast<float>(D)) * 1.4426950408889634f;  // log2(e) / sqrt(D)
    // A tile's rows: keys of tokens base + g + 8h, values of tokens value_token(base, j) (a token past
    // the chunk reads the chunk's first).
    auto key_row = [&](int base, int h) {
        const int token = base + g + 8 * h;
        return row_of(token < last ? token : first);
    };
    auto value_token = [&](int base, int j) { return base + 2 * t + (j & 1) + 8 * (j >> 1); };
    auto value_row = [&](int base, int j) {
        const int token = value_token(base, j);
        return v_pool + row_of(token < last ? token : first) + kLaneDims * g;
    };
    // FP8: a tile's e4m3 bytes and scales are loaded one tile ahead of its products. An e4m3 tile is
    // half a bf16 one and the kernel holds more registers (3 blocks an SM against 4): loading a tile
    // only when its products started left an SM a third of bf16's bytes in flight (8k context, batch
    // 64, H100: 0.93x the bf16 cache's decode on half its KV bytes).
    struct Fp8Tile {
        uint2 k[2][kBlocks32], v[4][kLaneDims / 8];
        // Tokens base + g and base + g + 8: the keys' scales x 2^56, the values' x 2^64.
        float k_scale[2], v_scale[2];
    };
    auto load_fp8_tile = [&](int base, Fp8Tile& f) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const size_t row = key_row(base, h);
#pragma unroll
            for (int s = 0; s < kBlocks32; ++s)
                f.k[h][s] = *reinterpret_cast<const uint2*>(k_pool + row + 32 * s + 8 * t);
            f.k_scale[h] = fp8.k[row / D] * kFp8ResultScale;
            f.v_scale[h] = fp8.v[row / D] * kFp8OperandScale;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const KV* v_row = value_row(base, j);
#pragma unroll
            for (int w = 0; w < kLaneDims / 8; ++w)
                f.v[j][w] = *reinterpret_cast<const uint2*>(v_row + 8 * w);
        }
    };
    constexpr int kStride = kMmaAttnWarps * 16;
    Fp8Tile ahead;
    if constexpr (kFp8)
        if (first + warp * 16 < last) load_fp8_tile(first + warp * 16, ahead);
    for (int base = first + warp * 16; base < last; base += kStride) {
        // Keys of tokens base + g and base + g + 8; values of tokens base + 2t, + 1, + 8, + 9 (a token
        // past the chunk reads the chunk's first and is masked: its probability and value are zero).
        uint4 kf[2][kBlocks32], vf[4][kLaneDims / 8];
        float k_scale[2] = {1.0f, 1.0f}, v_scale[2] = {1.0f, 1.0f};
        if constexpr (kFp8) {
            const Fp8Tile cur = ahead;
            if (base + kStride < last) load_fp8_tile(base + kStride, ahead);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int s = 0; s < kBlocks32; ++s) kf[h][s] = e4m3x8_to_bf16x8_scaled(cur.k[h][s]);
                k_scale[h] = cur.k_scale[h];
                v_scale[h] = cur.v_scale[h];
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bool valid = value_token(base, j) < last;
#pragma unroll
                for (int w = 0; w < kLaneDims / 8; ++w)
                    vf[j][w] = valid ? e4m3x8_to_bf16x8_scaled(cur.v[j][w]) : make_uint4(0, 0, 0, 0);
            }
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const KV* k_row = k_pool + key_row(base, h);
#pragma unroll
                for (int s = 0; s < kBlocks32; ++s)
                    kf[h][s] = *reinterpret_cast<const uint4*>(k_row + 32 * s + 8 * t);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bool valid = value_token(base, j) < last;
                const KV* v_row = value_row(base, j);
#pragma unroll
                for (int w = 0; w < kLaneDims / 8; ++w)
                    vf[j][w] =
                        valid ? *reinterpret_cast<const uint4*>(v_row + 8 * w) : make_uint4(0, 0, 0, 0);
            }
        }
        const bool valid_lo = base + g < last, valid_hi = base + g + 8 < last;
#pragma unroll
        for (int n = 0; n < kNT; ++n) {
            // S^T: c0, c1 token base + g, heads 2t, 2t + 1; c2, c3 token base + g + 8.
            float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int s = 0; s < kBlocks32; ++s) {
                mma_bf16(sc, kf[0][s].x, kf[1][s].x, kf[0][s].y, kf[1][s].y, qf[n][s].x, qf[n][s].y);
                mma_bf16(sc, kf[0][s].z, kf[1][s].z, kf[0][s].w, kf[1][s].w, qf[n][s].z, qf[n][s].w);
            }
            float p[4];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float lo = valid_lo ? sc[c] * (scale * k_scale[0]) : -FLT_MAX,
                            hi = valid_hi ? sc[2 + c] * (scale * k_scale[1]) : -FLT_MAX;
                float tile_max = fmaxf(lo, hi);
#pragma unroll
                for (int off = 4; off < 32; off <<= 1)
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, off));
                const float m_new = fmaxf(m[n][c], tile_max);
                const float correction = exp2f(m[n][c] - m_new);
                p[c] = valid_lo ? exp2f(lo - m_new) : 0.0f;
                p[2 + c] = valid_hi ? exp2f(hi - m_new) : 0.0f;
                l[n][c] = l[n][c] * correction + p[c] + p[2 + c];
                m[n][c] = m_new;
#pragma unroll
                for (int i = 0; i < kMTiles; ++i) {
                    o[n][i][c] *= correction;
                    o[n][i][2 + c] *= correction;
                }
            }
            // P^T as the B operand: column (head) g, tokens 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1).
            const uint32_t b0 = transpose_8x8(pack_bf16(p[0] * v_scale[0], p[1] * v_scale[0]));
            const uint32_t b1 = transpose_8x8(pack_bf16(p[2] * v_scale[1], p[3] * v_scale[1]));
#pragma unroll
            for (int i = 0; i < kMTiles; ++i) {
                // Dims 16g + 2i (low halves) and 16g + 2i + 1 (high halves) of the lane's four tokens.
                const int w = i / 4, e = i % 4;  // the 16-byte piece and its 32-bit word
                auto word = [&](int j) {
                    const uint4& v = vf[j][w];
                    return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
                };
                const uint32_t a0 = __byte_perm(word(0), word(1), 0x5410);
                const uint32_t a1 = __byte_perm(word(0), word(1), 0x7632);
                const uint32_t a2 = __byte_perm(word(2), word(3), 0x5410);
                const uint32_t a3 = __byte_perm(word(2), word(3), 0x7632);
                mma_bf16(o[n][i], a0, a1, a2, a3, b0, b1);
            }
        }
    }
    // The warp's state into shared memory: lanes of one t hold the same heads; their sums add up.
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            float sum = l[n][c];
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) sum += __shfl_xor_sync(kFullMask, sum, off);
            const int head = 8 * n + 2 * t + c;
            if (head >= G) continue;
            if (g == 0) {
                m_s[warp * G + head] = m[n][c] * 0.6931471805599453f;  // natural log units, as finish_split
                l_s[warp * G + head] = sum;
            }
            constexpr float out_scale = kFp8 ? kFp8ResultScale : 1.0f;
#pragma unroll
            for (int i = 0; i < kMTiles; ++i) {
                float* acc = acc_s + (warp * G + head) * D + kLaneDims * g + 2 * i;
                acc[0] = o[n][i][c] * out_scale;
                acc[1] = o[n][i][2 + c] * out_scale;
            }
        }
    __syncthreads();
    finish_split<T, G, kMmaAttnWarps>(m_s, l_s, acc_s, D, num_tokens, chunk, part, out_row);
}

// What one launch needs, passed down the template dispatch.
struct AttnLaunch {
    const void* q;
    void *k_pool, *v_pool;
    const int *position, *slot, *block_table;
    int max_blocks, block_size, B, Hq, Hkv, D, chunk, splits;
    int heads;  // query heads per block (heads_per_block)
    Partials part;
    void* out;
    Launch launch;
    QkvInput fused;
    KvScales fp8;
};

template <typename T, int G, int kDimsPerLane, int kWarps, int kLanes>
void launch_group(const AttnLaunch& l) {
    const size_t smem = sizeof(float) * (G * l.D + 2 * kWarps * G + kWarps * G * l.D);
    auto kernel = paged_attention_kernel<T, G, kDimsPerLane, kWarps, kLanes>;
    ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    launch_kernel(kernel, dim3(l.Hq / G, l.B, l.splits), kWarps * 32, smem, l.launch,
                  static_cast<const T*>(l.q), static_cast<T*>(l.k_pool), static_cast<T*>(l.v_pool),
                  l.position, l.slot, l.block_table, l.max_blocks, l.block_size, l.Hq, l.Hkv, l.D, l.chunk,
                  l.part,
                  QkvTyped<T>{static_cast<const T*>(l.fused.qkv), static_cast<const T*>(l.fused.q_norm),
                              static_cast<const T*>(l.fused.k_norm), l.fused.eps, l.fused.rope_theta},
                  static_cast<T*>(l.out));
}

template <typename T, int G, int kWarps, int kLanes>
void launch_dims(const AttnLaunch& l) {
    if (l.D <= 32) {
        launch_group<T, G, 1, kWarps, kLanes>(l);
    } else if (l.D <= 64) {
        launch_group<T, G, 2, kWarps, kLanes>(l);
    } else if (l.D <= 128) {
        launch_group<T, G, 4, kWarps, kLanes>(l);
    } else {
        if constexpr (kLanes == 1) launch_group<T, G, 8, kWarps, 1>(l);
    }
}

// Four lanes a token in blocks of 8 warps (the measured best at 1-64 rows, bench/RESULTS.md) up to 8
// heads a block and 128 dims; one lane a token in blocks of 2 warps otherwise. Both take 64 tokens
// (kAttentionMinChunk) a pass of the block's warps.
template <typename T, int G>
void launch_shape(const AttnLaunch& l) {
    if constexpr (G <= 8) {
        if (l.D <= 128) return launch_dims<T, G, 8, 4>(l);
    }
    launch_dims<T, G, 2, 1>(l);
}

// Query heads per block: all of a key-value head's when rows alone give enough blocks, else one.
int heads_per_block(int B, int Hq, int Hkv) {
    if (B * Hkv >= kAttentionRowsForFullGroups) return Hq / Hkv;
    return 1;
}

template <int G, int D, typename KV>
void launch_mma_shape(const AttnLaunch& l) {
    const size_t smem = sizeof(float) * (2 * kMmaAttnWarps * G + kMmaAttnWarps * G * D) +
                        sizeof(__nv_bfloat16) * 8 * ((G + 7) / 8) * D;
    auto kernel = paged_attention_mma_kernel<G, D, KV>;
    ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    using T = __nv_bfloat16;
    launch_kernel(kernel, dim3(l.Hkv, l.B, l.splits), kMmaAttnWarps * 32, smem, l.launch,
                  static_cast<const T*>(l.q), static_cast<KV*>(l.k_pool), static_cast<KV*>(l.v_pool), l.fp8,
                  l.position, l.slot, l.block_table, l.max_blocks, l.block_size, l.Hkv, l.chunk, l.part,
                  QkvTyped<T>{static_cast<const T*>(l.fused.qkv), static_cast<const T*>(l.fused.q_norm),
                              static_cast<const T*>(l.fused.k_norm), l.fused.eps, l.fused.rope_theta},
                  static_cast<T*>(l.out));
}

// The tensor-core kernel serves bf16 blocks of a whole group of 4, 8 or 16 heads of 64 or 128 dims.
bool mma_supported(int dtype, int heads, int Hq, int Hkv, int D) {
    return dtype == 1 && heads == Hq / Hkv && (heads == 4 || heads == 8 || heads == 16) &&
           (D == 64 || D == 128);
}

template <int G, typename KV>
void launch_mma_dims(const AttnLaunch& l) {
    if (l.D == 64) return launch_mma_shape<G, 64, KV>(l);
    launch_mma_shape<G, 128, KV>(l);
}

template <typename KV>
void launch_mma(const AttnLaunch& l) {
    switch (l.heads) {
        case 4:
            return launch_mma_dims<4, KV>(l);
        case 8:
            return launch_mma_dims<8, KV>(l);
        default:
            return launch_mma_dims<16, KV>(l);
    }
}

template <typename T>
void launch_typed(const AttnLaunch& l) {
    switch (l.heads) {
        case 1:
            return launch_shape<T, 1>(l);
        case 2:
            return launch_shape<T, 2>(l);
        case 4:
            return launch_shape<T, 4>(l);
        case 8:
            return launch_shape<T, 8>(l);
        case 16:
            return launch_shape<T, 16>(l);
        default:
            return;  // refused by the generator before any launch
    }
}

}  // namespace

bool attention_group_supported(int group) {
    return group == 1 || group == 2 || group == 4 || group == 8 || group == 16;
}

bool attention_fp8_kv_supported(int Hq, int Hkv, int D) {
    return Hkv > 0 && Hq % Hkv == 0 && mma_supported(1, Hq / Hkv, Hq, Hkv, D);
}

int attention_partial_splits(int max_seq_len) {
    return (max_seq_len + kAttentionMinChunk - 1) / kAttentionMinChunk;
}

void launch_paged_attention(int dtype, const void* q, void* k_pool, void* v_pool, const int* position,
                            const int* slot, const int* block_table, int max_blocks, int block_size, int B,
                            int Hq, int Hkv, int D, float* partial, int* split_done, void* out,
                            const Launch& launch, const QkvInput& qkv, const KvScales& fp8) {
    if (B == 0) return;
    MOERL_CHECK(!fp8.fp8() || (dtype == 1 && attention_fp8_kv_supported(Hq, Hkv, D)),
                "paged_attention: an FP8 KV cache needs bf16 queries in groups of 4, 8 or 16 heads of 64 or "
                "128 dims (got dtype ",
                dtype, ", ", Hq, " query heads per ", Hkv, " key-value heads of ", D, " dims)");
    // Chunks of the sequence per block: one pass of the block's warps (kAttentionMinChunk tokens),
    // longer while there would be more than 1024 blocks (one split, no merge, once rows alone give
    // that many).
    const int max_seq_len = max_blocks * block_size;
    const int heads = fp8.fp8() ? Hq / Hkv : heads_per_block(B, Hq, Hkv);
    const int blocks_without_split = B * (Hq / heads);
    int chunk = kAttentionMinChunk;
    while (chunk < max_seq_len && blocks_without_split * ((max_seq_len + chunk - 1) / chunk) > 1024)
        chunk *= 2;
    AttnLaunch l{q,          k_pool, v_pool, position, slot, block_table, max_blocks,
                 block_size, B,      Hq,     Hkv,      D,    chunk,       (max_seq_len + chunk - 1) / chunk,
                 heads,      {},     out,    launch,   qkv,  fp8};
    l.part.splits = attention_partial_splits(max_seq_len);
    l.part.done = split_done;
    l.part.ml = partial;
    l.part.acc = partial + static_cast<size_t>(B) * Hq * l.part.splits * 2;  // after ml [B, Hq, splits, 2]
    if (fp8.fp8())
        launch_mma<uint8_t>(l);
    else if (mma_supported(dtype, heads, Hq, Hkv, D))
        launch_mma<__nv_bfloat16>(l);
    else if (dtype == 0)
        launch_typed<float>(l);
    else
        launch_typed<__nv_bfloat16>(l);
}

}  // namespace moerl::model::cuda
