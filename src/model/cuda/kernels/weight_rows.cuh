// Internal: the weight-streaming kernel behind the dense GEMVs and the CUDA-core expert products
// (one template, a mode each), with the small kernels a one-row step folds into it (norm before,
// routing or combine after). At decode batch sizes the weights, not the tokens, are the traffic:
// each block streams a few weight rows once and applies them to every token of its expert.
#pragma once

#include "routing.cuh"

namespace moerl::model::cuda {

constexpr int kMoeWarps = 8;

// Rows [begin, begin + n) of the tile: the activations of the slots expert_slots[first + j]
// (row slot / row_div of src [*, cols]) copied into tile [n, cols] with cp.async, all in flight at
// once (the caller waits with cp_async_wait_all before its barrier).
template <typename T>
__device__ __forceinline__ void load_tile(const T* src, const int* expert_slots, int first, int n,
                                          int row_div, int cols, T* tile) {
    constexpr int kVec = 16 / sizeof(T);
    const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(tile));
    for (int i = threadIdx.x * kVec; i < n * cols; i += blockDim.x * kVec) {
        const int j = i / cols, c = i % cols;
        const int src_row = expert_slots != nullptr ? expert_slots[first + j] / row_div : first + j;
        const T* from = src + static_cast<size_t>(src_row) * cols + c;
        asm volatile(
            "cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + i * static_cast<int>(sizeof(T))),
            "l"(from)
            : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

enum RowsMode { kGatedExperts, kExperts, kDense };

// What a batch-1 GEMV does besides its product, instead of a kernel of its own before or after it:
// kNormIn: the dense GEMV's input is rms_norm(x) * norm_w, computed by every block;
// kAddNormRoute: the dense router's input is rms_norm(x + delta) * norm_w (block 0 stores it in h;
// x is not written) and the last block to finish routes the logits;
// kCombine: the down experts' last block over each chunk of output columns combines the routed
// slots into x (after adding delta), leaving the norm to the next kernel;
// kRouteIn: the one-row gate/up experts take their slot's expert from the router logits (f.logits,
// top-k as route_rows) instead of the routing, which block (0, 0) writes once its rows are done.
enum Fuse { kFuseNone, kNormIn, kAddNormRoute, kCombine, kRouteIn };

template <typename T>
struct Fusion {
    T* x = nullptr;  // residual [B, H]
    const T* delta = nullptr;
    const T* norm_w = nullptr;
    float eps = 0.0f;
    T* h = nullptr;
    const int* position = nullptr;
    int* done = nullptr;  // finished blocks (kAddNormRoute: one counter; kCombine: one a column chunk)
    int E = 0, K = 0;     // routing
    bool norm_topk_prob = false;
    bool route = true;          // kAddNormRoute: false = stop after the logits (the experts rank them)
    const T* logits = nullptr;  // kRouteIn: the router logits [1, E]
};

// Rows [first, first + n) of tile = round(w * round(v * inv_rms(v))) for v = x (+ delta, rounded):
// what residual_rmsnorm_row computes, with the same thread-to-column map and sum order for a block
// of kNormThreads. h (when set) gets the rows too. Not residual_rmsnorm_row itself: it keeps the
// row in registers across the block sum, which takes the one-row q/k/v GEMV from 47 to 71 registers
// (5 blocks an SM to 3); these values wait in the tile instead.
template <typename T>
__device__ __forceinline__ void norm_tile(const T* x, const T* delta, const T* w, float eps, int first, int n,
                                          int cols, T* tile, T* h) {
    __shared__ float scratch[32];
    for (int j = 0; j < n; ++j) {
        const size_t row = static_cast<size_t>(first + j) * cols;
        T* out = tile + static_cast<size_t>(j) * cols;
        float sum_sq = 0.0f;
        for (int c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
            float v[8];
            load8(x + row + c, v);
            if (delta != nullptr) {
                float d[8];
                load8(delta + row + c, d);
#pragma unroll
                for (int k = 0; k < 8; ++k) v[k] = round_to<T>(v[k] + d[k]);
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) sum_sq += v[k] * v[k];
            store8(out + c, v);  // exact: v is a T value
        }
        const float inv = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(cols) + eps);
        for (int c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {  // this thread's own columns
            float v[8], wv[8], o[8];
            load8(out + c, v);
            load8(w + c, wv);
#pragma unroll
            for (int k = 0; k < 8; ++k) o[k] = wv[k] * round_to<T>(v[k] * inv);
            store8(out + c, o);
            if (h != nullptr) store8(h + row + c, o);
        }
    }
}

// Asks L2 for rows [row0, row0 + rows) of w [out_rows, cols] (the rows one block reads), a 128-byte
// line per thread and step. Issued before griddep_wait(): the weights do not depend on the previous
// kernel, so a GEMV that starts early finds them in L2 instead of DRAM.
template <typename T>
__device__ __forceinline__ void prefetch_rows_l2(const T* w, int row0, int rows, int out_rows, int cols) {
    const size_t row_bytes = static_cast<size_t>(cols) * sizeof(T);
    const int first = min(row0, out_rows), last = min(row0 + rows, out_rows);
    const char* base = reinterpret_cast<const char*>(w) + first * row_bytes;
    const size_t bytes = (last - first) * row_bytes;
    for (size_t off = threadIdx.x * size_t{128}; off < bytes; off += blockDim.x * size_t{128})
        prefetch_l2(base + off);
}

// Copies rows [row0, row0 + rows) of w [out_rows, cols] (16-byte aligned rows) into dst, asynchronously
// (cp.async, completed by cp_async_wait_all): the weights of a dense block, copied while it waits.
template <typename T>
__device__ __forceinline__ void preload_rows(const T* w, int row0, int rows, int out_rows, int cols, T* dst) {
    const int first = min(row0, out_rows), last = min(row0 + rows, out_rows);
    const char* src = reinterpret_cast<const char*>(w + static_cast<size_t>(first) * cols);
    const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    const int bytes = (last - first) * cols * static_cast<int>(sizeof(T));
    for (int off = threadIdx.x * 16; off < bytes; off += blockDim.x * 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + off), "l"(src + off)
                     : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// x[at] = round(round(x[at] + delta[at]) + round(combined)) (delta optional): the residual add and the
// routed experts' weighted sum, rounded as add_rmsnorm and combine_rmsnorm_kernel round them.
template <typename T>
__device__ __forceinline__ void add_combined(T* x, const T* delta, size_t at, float combined) {
    float v = to_float(x[at]);
    if (delta != nullptr) v = round_to<T>(v + to_float(delta[at]));
    x[at] = from_float<T>(v + round_to<T>(combined));
}

// Rows [row0, row0 + kRows) of expert e's weights applied to every slot routed to e, kTile
// slots per pass over the weights. kGatedExperts: act[s] = silu(in[s / K] gate^T) * (in[s / K] up^T)
// (gate/up [E, out_rows, cols]); kExperts: y[s] = in[s] w0^T (w0 [E, out_rows, cols], fp32 out);
// kDense: act[b] = in[b] w0^T for the num_rows rows of in (w0 [out_rows, cols], one "expert").
// Before waiting for the previous kernel (the weights do not depend on it), a dense block copies its
// weight rows into shared memory with `preload`, else asks L2 for them; so do the down experts'
// blocks with `preload` (their routing is known by then). The gate/up blocks request their first
// weight chunks as soon as they know their expert, before they gather the tokens.
template <typename T, int kMode, int kRows, int kTile, int kFuse = kFuseNone, int kPerLane = 1>
__global__ void __launch_bounds__(kMoeWarps * 32)
    expert_rows_kernel(const T* in, const T* w0, const T* w1, MoeRouting r, int row_div, int cols,
                       int out_rows, int num_rows, bool preload, T* act, float* y, Fusion<T> f) {
    static_assert(
        kFuse == kFuseNone || (kFuse == kCombine   ? kMode == kExperts
                               : kFuse == kRouteIn ? kMode == kGatedExperts && kRows == 1 && kTile == 1
                                                   : kMode == kDense),
        "kNormIn and kAddNormRoute fuse into the dense GEMV, kCombine into the down experts, kRouteIn "
        "into the one-row gate/up experts");
    static_assert(kFuse == kFuseNone || kMoeWarps * 32 == kNormThreads, "norm_tile's sum order");
    extern __shared__ __align__(16) unsigned char tile_bytes[];
    T* tile = reinterpret_cast<T*>(tile_bytes);             // [kTile, cols]
    T* block_w = tile + static_cast<size_t>(kTile) * cols;  // preload: [kMoeWarps * kRows, cols]
    const int block_row0 = blockIdx.x * kMoeWarps * kRows;
    if constexpr (kMode == kDense) {
        if (preload)
            preload_rows(w0, block_row0, kMoeWarps * kRows, out_rows, cols, block_w);
        else
            prefetch_rows_l2(w0, block_row0, kMoeWarps * kRows, out_rows, cols);
    } else if constexpr (kMode == kExperts) {
        // The routing comes from two kernels back (the router), complete before this kernel could start:
        // every kernel waits for its predecessor before it lets the next one start. Read past L1.
        if (preload && static_cast<int>(blockIdx.y) < __ldcg(r.num_active))
            preload_rows(w0 + static_cast<size_t>(__ldcg(r.active_experts + blockIdx.y)) * out_rows * cols,
                         block_row0, kMoeWarps * kRows, out_rows, cols, block_w);
    }
    griddep_wait();
    griddep_launch_dependents();
    constexpr bool kGated = kMode == kGatedExperts;
    int e = 0, first = 0, n = num_rows;
    // Gate/up with one row: block y takes slot y, its expert read from the top-k (the row's K experts
    // differ) instead of through the active list, the offsets and the slot list (three dependent loads).
    const bool by_slot = kGated && num_rows == 1;
    if constexpr (kFuse == kRouteIn) {
        // Warp 0 ranks the row's experts; slot y's goes to every warp (-1 for a padding row). Block
        // (0, 0) stays to the end either way: it writes the routing.
        __shared__ int slot_expert;
        if (threadIdx.x < 32) {
            float p[kPerLane];
            load_logits_row(f.logits, f.E, p);
            int idx;
            float weight;
            topk_of_row<kPerLane>(p, f.E, f.K, f.norm_topk_prob, idx, weight);
            idx = __shfl_sync(kFullMask, idx, blockIdx.y);
            if (threadIdx.x == 0) slot_expert = f.position[0] < 0 ? -1 : idx;
        }
        __syncthreads();
        const bool writes_routing = blockIdx.x == 0 && blockIdx.y == 0;
        if (slot_expert < 0 && !writes_routing) return;
        e = max(slot_expert, 0);
        first = static_cast<int>(blockIdx.y);
        n = slot_expert < 0 ? 0 : 1;
    } else if constexpr (kMode != kDense) {
        if (by_slot) {
            e = r.topk_idx[blockIdx.y];
            if (e < 0) return;  // a padding row
            first = static_cast<int>(blockIdx.y);
            n = 1;
        } else {
            if (static_cast<int>(blockIdx.y) >= *r.num_active) return;
            e = r.active_experts[blockIdx.y];
            first = r.expert_offset[e];
            n = r.expert_offset[e + 1] - first;
        }
    }
    const int* slots = kMode == kDense || by_slot ? nullptr : r.expert_slots;
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * kMoeWarps + (threadIdx.x >> 5)) * kRows;
    constexpr int kMats = kGated ? 2 : 1;
    const T* w[kMats][kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const int row = min(row0 + i, out_rows - 1);  // rows past the end repeat the last (not stored)
        w[0][i] = !kGated && preload ? block_w + static_cast<size_t>(row - block_row0) * cols
                                     : w0 + (static_cast<size_t>(e) * out_rows + row) * cols;
        if constexpr (kGated) w[kMats - 1][i] = w1 + (static_cast<size_t>(e) * out_rows + row) * cols;
    }
    // kUnroll chunks of every weight row are requested before their arithmetic, so each lane keeps
    // kUnroll * kMats * kRows 16-byte loads in flight. Gate/up requests the first chunks as soon as
    // the expert is known, while the tokens are gathered.
    constexpr int kUnroll = 4;
    Raw8<T> raw[kUnroll][kMats][kRows];
    auto request = [&](int cb) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (cb + u * 256 < cols)
#pragma unroll
                for (int m = 0; m < kMats; ++m)
#pragma unroll
                    for (int i = 0; i < kRows; ++i) raw[u][m][i] = load_raw8(w[m][i] + cb + u * 256);
    };
    const bool requested_early = kGated && row0 < out_rows && n > 0;
    if (requested_early) request(lane * 8);
    for (int c0 = 0; c0 < n; c0 += kTile) {
        const int nt = min(kTile, n - c0);
        __syncthreads();
        if constexpr (kFuse == kNormIn || kFuse == kAddNormRoute)
            norm_tile(f.x, kFuse == kAddNormRoute ? f.delta : nullptr, f.norm_w, f.eps, c0, nt, cols, tile,
                      kFuse == kAddNormRoute && blockIdx.x == 0 ? f.h : nullptr);
        else
            load_tile(in, slots, by_slot ? 0 : first + c0, nt, row_div, cols, tile);
        cp_async_wait_all();  // own copies (tile, preloaded weights); the barrier: all
        __syncthreads();
        if (row0 >= out_rows) continue;
        float acc[kMats][kRows][kTile];
#pragma unroll
        for (int m = 0; m < kMats; ++m)
#pragma unroll
            for (int i = 0; i < kRows; ++i)
#pragma unroll
                for (int j = 0; j < kTile; ++j) acc[m][i][j] = 0.0f;
        bool in_flight = requested_early && c0 == 0;
        for (int cb = lane * 8; cb < cols; cb += 256 * kUnroll) {
            if (!in_flight) request(cb);
            in_flight = false;
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int c = cb + u * 256;
                if (c >= cols) break;
                float wv[kMats][kRows][8];
#pragma unroll
                for (int m = 0; m < kMats; ++m)
#pragma unroll
                    for (int i = 0; i < kRows; ++i) raw8_to_float(raw[u][m][i], wv[m][i]);
#pragma unroll
                for (int j = 0; j < kTile; ++j) {
                    if (j >= nt) break;
                    float xv[8];
                    load8(tile + j * cols + c, xv);
#pragma unroll
                    for (int m = 0; m < kMats; ++m)
#pragma unroll
                        for (int i = 0; i < kRows; ++i)
#pragma unroll
                            for (int k = 0; k < 8; ++k) acc[m][i][j] += wv[m][i][k] * xv[k];
                }
            }
        }
#pragma unroll
        for (int j = 0; j < kTile; ++j) {
            if (j >= nt) break;
            const int s = kMode == kDense ? c0 + j : by_slot ? first : r.expert_slots[first + c0 + j];
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                // Both sums before any lane leaves: the shuffles need the whole warp.
                const float v0 = round_to<T>(warp_sum(acc[0][i][j]));
                const float v1 = kGated ? round_to<T>(warp_sum(acc[kMats - 1][i][j])) : 0.0f;
                if (lane != i || row0 + i >= out_rows) continue;
                const size_t at = static_cast<size_t>(s) * out_rows + row0 + i;
                if constexpr (kGated) {
                    act[at] = from_float<T>(round_to<T>(silu(v0)) * v1);
                } else if constexpr (kMode == kDense) {
                    act[at] = from_float<T>(v0);
                } else {
                    y[at] = v0;
                }
            }
        }
    }
    if constexpr (kFuse == kRouteIn) {
        if (blockIdx.x != 0 || blockIdx.y != 0) return;
        __shared__ int route_smem[3 * kMaxExperts + 1];
        route_rows<T, kPerLane>(f.logits, f.position, 1, f.E, f.K, f.norm_topk_prob, r, route_smem);
    } else if constexpr (kFuse == kAddNormRoute) {
        if (!f.route || !last_block_of(f.done, gridDim.x)) return;
        __shared__ int route_smem[3 * kMaxExperts + 1];
        route_rows<T, kPerLane>(act, f.position, num_rows, f.E, f.K, f.norm_topk_prob, r, route_smem);
    } else if constexpr (kFuse == kCombine) {
        // Blocks of the active experts count per chunk of output columns; the chunk's last block adds
        // its columns of every routed slot, weighted, to x in the order combine_rmsnorm_kernel does.
        if (!last_block_of(f.done + blockIdx.x, *r.num_active)) return;
        constexpr int kChunk = kMoeWarps * kRows;
        for (int i = threadIdx.x; i < num_rows * kChunk; i += blockDim.x) {
            const int b = i / kChunk, c = blockIdx.x * kChunk + i % kChunk;
            if (c >= out_rows || f.position[b] < 0) continue;
            float acc = 0.0f;
            for (int k = 0; k < f.K; ++k) {
                const int s = b * f.K + k;
                if (r.topk_idx[s] < 0) continue;
                acc += r.topk_weights[s] * __ldcg(y + static_cast<size_t>(s) * out_rows + c);
            }
            add_combined(f.x, f.delta, static_cast<size_t>(b) * out_rows + c, acc);
        }
    }
}

template <typename T, int kMode, int kRows, int kTile, int kFuse = kFuseNone, int kPerLane = 1>
void launch_rows(const void* in, const void* w0, const void* w1, const MoeRouting& r, int row_div, int cols,
                 int out_rows, int num_rows, int max_active, void* act, float* y, const Launch& launch,
                 const Fusion<T>& f = {}) {
    const size_t weight_bytes = sizeof(T) * kMoeWarps * kRows * cols;
    const bool preload = kMode != kGatedExperts && weight_bytes <= kMaxPreloadBytes;
    const size_t smem = sizeof(T) * kTile * cols + (preload ? weight_bytes : 0);
    auto kernel = expert_rows_kernel<T, kMode, kRows, kTile, kFuse, kPerLane>;
    ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    constexpr int kRowsPerBlock = kMoeWarps * kRows;
    launch_kernel(kernel, dim3((out_rows + kRowsPerBlock - 1) / kRowsPerBlock, max_active), kMoeWarps * 32,
                  smem, launch, static_cast<const T*>(in), static_cast<const T*>(w0),
                  static_cast<const T*>(w1), r, row_div, cols, out_rows, num_rows, preload,
                  static_cast<T*>(act), y, f);
}

// Weight rows a warp: one for gate/up (two matrices) and for the dense GEMVs (more blocks spread
// the rows evenly over the SMs), two for the down experts (bench/RESULTS.md).
template <int kMode>
constexpr int kRowsPerWarp = kMode == kExperts ? 2 : 1;

// Slots per pass from the batch (a bound on the tokens of one expert).
template <typename T, int kMode>
void launch_expert_rows(const void* in, const void* w0, const void* w1, const MoeRouting& r, int B,
                        int row_div, int cols, int out_rows, int max_active, void* act, float* y,
                        const Launch& launch) {
    if (max_active == 0 || B == 0) return;
    constexpr int kRows = kRowsPerWarp<kMode>;
    if (B <= 1)
        return launch_rows<T, kMode, kRows, 1>(in, w0, w1, r, row_div, cols, out_rows, B, max_active, act, y,
                                               launch);
    if (B <= 16)
        return launch_rows<T, kMode, kRows, 4>(in, w0, w1, r, row_div, cols, out_rows, B, max_active, act, y,
                                               launch);
    launch_rows<T, kMode, kRows, kMoeTokenTile>(in, w0, w1, r, row_div, cols, out_rows, B, max_active, act, y,
                                                launch);
}

// The fused GEMVs take one token a pass (kTile 1: made for one-row steps; B rows take B passes).
template <typename T, int kMode, int kFuse, int kPerLane = 1>
void launch_fused(const void* in, const void* w0, const MoeRouting& r, int cols, int out_rows, int B,
                  int max_active, void* act, float* y, const Fusion<T>& f, const Launch& launch) {
    launch_rows<T, kMode, kRowsPerWarp<kMode>, 1, kFuse, kPerLane>(in, w0, nullptr, r, 1, cols, out_rows, B,
                                                                   max_active, act, y, launch, f);
}

template <typename T>
Fusion<T> fusion_of(const void* x, const void* delta, const void* norm_weight, float eps, void* h,
                    const int* position, int* done, int E, int K, bool norm_topk_prob) {
    Fusion<T> f;
    f.x = static_cast<T*>(const_cast<void*>(x));  // written by kCombine only
    f.delta = static_cast<const T*>(delta);
    f.norm_w = static_cast<const T*>(norm_weight);
    f.eps = eps;
    f.h = static_cast<T*>(h);
    f.position = position;
    f.done = done;
    f.E = E;
    f.K = K;
    f.norm_topk_prob = norm_topk_prob;
    return f;
}

}  // namespace moerl::model::cuda
