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
#include <cfloat>

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
            asm volatile(
                "prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(base) + (r % lines) * 128));
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
    const bool direct = gridDim.z == 1;
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
    const size_t pidx = (static_cast<size_t>(b) * gridDim.x + group) * part.splits + split;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D;
        float mx = -FLT_MAX;
        for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, m_s[w * G + g]);
        float sum = 0.0f, value = 0.0f;
        for (int w = 0; w < kAttnWarps; ++w) {
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
    // The last split of (row, kv head) to finish merges all of them (and returns the counter to 0
    // for the next step), so no second kernel is launched.
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

int attention_partial_splits(int max_seq_len) {
    return (max_seq_len + kAttentionMinChunk - 1) / kAttentionMinChunk;
}

void launch_paged_attention(int dtype, const void* q, void* k_pool, void* v_pool, const int* position,
                            const int* slot, const int* block_table, int max_blocks, int block_size, int B,
                            int Hq, int Hkv, int D, float* partial, int* split_done, void* out,
                            const Launch& launch, const QkvInput& qkv) {
    if (B == 0) return;
    // Chunks of the sequence per block: one pass of the block's warps (kAttentionMinChunk tokens),
    // longer while there would be more than 1024 blocks (one split, no merge, once rows alone give
    // that many).
    const int max_seq_len = max_blocks * block_size;
    const int heads = heads_per_block(B, Hq, Hkv);
    const int blocks_without_split = B * (Hq / heads);
    int chunk = kAttentionMinChunk;
    while (chunk < max_seq_len && blocks_without_split * ((max_seq_len + chunk - 1) / chunk) > 1024)
        chunk *= 2;
    AttnLaunch l{q,          k_pool, v_pool, position, slot, block_table, max_blocks,
                 block_size, B,      Hq,     Hkv,      D,    chunk,       (max_seq_len + chunk - 1) / chunk,
                 heads,      {},     out,    launch,   qkv};
    l.part.splits = attention_partial_splits(max_seq_len);
    l.part.done = split_done;
    l.part.ml = partial;
    l.part.acc = partial + static_cast<size_t>(B) * Hq * l.part.splits * 2;  // after ml [B, Hq, splits, 2]
    if (dtype == 0)
        launch_typed<float>(l);
    else
        launch_typed<__nv_bfloat16>(l);
}

}  // namespace moerl::model::cuda
