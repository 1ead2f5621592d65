// The MoE layer of a decode step: routing, expert grouping, the two expert projections and the
// weighted combine. The expert kernels read each routed expert's weights once per step and apply
// them to all tokens routed to it (gathered on the fly, no permuted copy of the activations): at
// decode batch sizes the weights, not the tokens, are the traffic.
#include <cfloat>
#include <type_traits>

#include "common.cuh"

namespace moerl::model::cuda {
namespace {

constexpr int kRouteWarps = 32;
constexpr int kMoeWarps = 8;

// One row's logits as a lane holds them for topk_of_row (experts lane, lane + 32, ...), read past L1.
template <typename T, int kPerLane>
__device__ __forceinline__ void load_logits_row(const T* row, int E, float (&p)[kPerLane]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        // The address is clamped into the row: the compiler may issue __ldcg (an inline asm without
        // side effects) before the bound selects, so an unclamped one reads past a row of E.
        const float v = to_float(__ldcg(row + min(i * 32 + lane, E - 1)));
        p[i] = i * 32 + lane < E ? v : -FLT_MAX;
    }
}

// The softmax top-k of one row by one warp (p: load_logits_row's, overwritten): lane k < K gets the
// k-th choice (lowest index on ties) and its probability, renormalised over the K when norm_topk_prob.
template <int kPerLane>
__device__ __forceinline__ void topk_of_row(float (&p)[kPerLane], int E, int K, bool norm_topk_prob,
                                            int& my_idx, float& my_w) {
    const int lane = threadIdx.x & 31;
    float mx = -FLT_MAX;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) mx = fmaxf(mx, p[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        p[i] = i * 32 + lane < E ? __expf(p[i] - mx) : -1.0f;  // -1: below every probability
        sum += p[i] > 0.0f ? p[i] : 0.0f;
    }
    const float inv_sum = 1.0f / warp_sum(sum);
    // K rounds of a warp argmax (lowest index on ties); lane k keeps the k-th choice. A lane's best
    // becomes an unsigned key (the bits of a non-negative float order as the float; +1 keeps 0.0
    // above "none left"), so each round is two warp reductions instead of ten shuffles.
    my_idx = -1;
    my_w = 0.0f;
    for (int k = 0; k < K; ++k) {
        float best = -1.0f;
        int best_e = E;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i)
            if (p[i] > best) best = p[i], best_e = i * 32 + lane;
        const unsigned key = best >= 0.0f ? __float_as_uint(best) + 1u : 0u;
        const unsigned top = __reduce_max_sync(kFullMask, key);
        const int chosen = top == 0u ? E : __reduce_min_sync(kFullMask, key == top ? best_e : E);
        if (lane == k) my_idx = chosen, my_w = (top == 0u ? -1.0f : __uint_as_float(top - 1u)) * inv_sum;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i)
            if (i * 32 + lane == chosen) p[i] = -2.0f;  // taken
    }
    const float total = warp_sum(lane < K ? my_w : 0.0f);
    if (norm_topk_prob) my_w /= total;
}

// The routing of B rows of logits [B, E] by the whole block (any number of warps): top-k per row,
// counts, offsets and slot lists into r. smem: 3 E + 1 ints. Logits are read past L1 (the fused
// router's last block reads what other blocks wrote). kPerLane: ceil(E / 32) rounded up to a power
// of two (the row's probabilities each lane holds).
template <typename T, int kPerLane>
__device__ __forceinline__ void route_rows(const T* logits, const int* position, int B, int E, int K,
                                           bool norm_topk_prob, const MoeRouting& r, int* smem) {
    int* count = smem;         // [E]
    int* cursor = count + E;   // [E]
    int* offset = cursor + E;  // [E + 1]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = cursor[e] = 0;
    __syncthreads();

    // One warp a row, its probabilities in registers: lane l holds experts l, l + 32, ...
    for (int b = warp; b < B; b += num_warps) {
        // The row's logits are requested together with its position (a padding row's are there too).
        const int pos = position[b];
        float p[kPerLane];
        load_logits_row(logits + static_cast<size_t>(b) * E, E, p);  // logits [B, E]
        if (pos < 0) {
            if (lane < K) {
                r.topk_idx[b * K + lane] = -1;
                r.topk_weights[b * K + lane] = 0.0f;
            }
            continue;
        }
        int my_idx;
        float my_w;
        topk_of_row<kPerLane>(p, E, K, norm_topk_prob, my_idx, my_w);
        if (lane < K) {
            r.topk_idx[b * K + lane] = my_idx;
            r.topk_weights[b * K + lane] = my_w;
            atomicAdd(&count[my_idx], 1);
        }
    }
    __syncthreads();
    if (warp == 0) {
        // Exclusive scans of the counts and of the active flags; lane i owns experts [i*chunk, ...).
        const int chunk = (E + 31) / 32, lo = min(E, lane * chunk), hi = min(E, lo + chunk);
        int slots = 0, active = 0;
        for (int e = lo; e < hi; ++e) slots += count[e], active += count[e] > 0;
        int slots_before = slots, active_before = active;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int s = __shfl_up_sync(kFullMask, slots_before, o);
            const int a = __shfl_up_sync(kFullMask, active_before, o);
            if (lane >= o) slots_before += s, active_before += a;
        }
        slots_before -= slots;
        active_before -= active;
        for (int e = lo; e < hi; ++e) {
            offset[e] = slots_before;
            r.expert_offset[e] = slots_before;
            slots_before += count[e];
            if (count[e] > 0) r.active_experts[active_before++] = e;
        }
        if (lane == 31) {
            offset[E] = slots_before;
            r.expert_offset[E] = slots_before;
            *r.num_active = active_before;
            if (r.experts_read != nullptr)
                atomicAdd(r.experts_read, static_cast<unsigned long long>(active_before));
        }
    }
    __syncthreads();
    for (int s = threadIdx.x; s < B * K; s += blockDim.x) {
        const int e = r.topk_idx[s];
        if (e >= 0) r.expert_slots[offset[e] + atomicAdd(&cursor[e], 1)] = s;
    }
}

template <typename T, int kPerLane>
__global__ void __launch_bounds__(kRouteWarps * 32)
    route_kernel(const T* logits, const int* position, int B, int E, int K, bool norm_topk_prob,
                 MoeRouting r) {
    griddep_wait();
    griddep_launch_dependents();
    extern __shared__ int smem_counts[];
    route_rows<T, kPerLane>(logits, position, B, E, K, norm_topk_prob, r, smem_counts);
}

// Rows [begin, begin + n) of the tile: the activations of the slots expert_slots[first + j]
// (row slot / row_div of src [*, cols]) copied into tile [n, cols]. With `async` the copies are
// cp.async (all in flight at once; the caller waits with cp_async_wait_all before its barrier);
// plain loads and stores wait a round trip per 16 bytes a thread.
template <typename T>
__device__ __forceinline__ void load_tile(const T* src, const int* expert_slots, int first, int n,
                                          int row_div, int cols, T* tile, bool async) {
    constexpr int kVec = 16 / sizeof(T);
    const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(tile));
    for (int i = threadIdx.x * kVec; i < n * cols; i += blockDim.x * kVec) {
        const int j = i / cols, c = i % cols;
        const int src_row = expert_slots != nullptr ? expert_slots[first + j] / row_div : first + j;
        const T* from = src + static_cast<size_t>(src_row) * cols + c;
        if (async)
            asm volatile(
                "cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + i * static_cast<int>(sizeof(T))),
                "l"(from)
                : "memory");
        else
            *reinterpret_cast<uint4*>(tile + i) = *reinterpret_cast<const uint4*>(from);
    }
    if (async) asm volatile("cp.async.commit_group;" ::: "memory");
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
    bool route = true;          // kAddNormRoute: false = stop after the logits (Launch::route_in_experts)
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
        asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off));
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
// A dense block asks L2 for its weight rows before waiting for the previous kernel (they do not
// depend on it), or with `preload` copies them into shared memory after the tile; so do the down
// experts' blocks with `preload` (their routing is known by then).
template <typename T, int kMode, int kRows, int kTile, int kFuse = kFuseNone, int kPerLane = 1>
__global__ void __launch_bounds__(kMoeWarps * 32)
    expert_rows_kernel(const T* in, const T* w0, const T* w1, MoeRouting r, int row_div, int cols,
                       int out_rows, int num_rows, bool preload, bool early, bool async_tile, T* act,
                       float* y, Fusion<T> f) {
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
    // `early` with one row: block y takes slot y, its expert read from the top-k (the row's K experts
    // differ) instead of through the active list, the offsets and the slot list (three dependent loads).
    const bool by_slot = kGated && (early || kFuse == kRouteIn) && num_rows == 1;
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
    // kUnroll * kMats * kRows 16-byte loads in flight. With `early` (gate/up: Launch::early_expert_loads)
    // the first chunks are requested as soon as the expert is known, while the tokens are gathered.
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
    const bool requested_early = kGated && (early || kFuse == kRouteIn) && row0 < out_rows && n > 0;
    if (requested_early) request(lane * 8);
    for (int c0 = 0; c0 < n; c0 += kTile) {
        const int nt = min(kTile, n - c0);
        __syncthreads();
        if constexpr (kFuse == kNormIn || kFuse == kAddNormRoute)
            norm_tile(f.x, kFuse == kAddNormRoute ? f.delta : nullptr, f.norm_w, f.eps, c0, nt, cols, tile,
                      kFuse == kAddNormRoute && blockIdx.x == 0 ? f.h : nullptr);
        else
            load_tile(in, slots, by_slot ? 0 : first + c0, nt, row_div, cols, tile, async_tile);
        if ((!kGated && preload && c0 == 0) || async_tile)
            cp_async_wait_all();  // own copies; the barrier: all
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

// The down experts and the combine of a few rows by output column: block c takes columns
// [c * kMoeWarps, +kMoeWarps) of the expert of every slot (one column a warp) and adds the routed
// slots, weighted, into x itself: no fp32 y, no counters, no last block. The weights (kMoeWarps rows
// of each slot's expert, contiguous) are copied into shared memory before the kernel waits for
// gate/up, the routing being complete two kernels back. A slot's weights are copied even when
// another slot has the same expert (made for one row, whose top-k experts differ). The dot products
// and the combine sum in the order of expert_rows_kernel and its kCombine tail: the same bits.
// kPerLane > 0 (one row, Launch::route_in_experts): warp 0 ranks the router logits itself (written
// two kernels back, like the routing) instead of reading the routing.
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kMoeWarps * 32)
    down_combine_columns_kernel(const T* act, const T* down, MoeRouting r, int B, int K, int H, int I,
                                const T* logits, int E, bool norm_topk_prob, const int* position, T* x,
                                const T* delta, bool async_tile) {
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    const int S = B * K;
    T* wts = reinterpret_cast<T*>(smem_bytes);                                // [S, kMoeWarps, I]
    T* tile = wts + static_cast<size_t>(S) * kMoeWarps * I;                   // [S, I]
    int* expert = reinterpret_cast<int*>(tile + static_cast<size_t>(S) * I);  // [S]
    float* weight = reinterpret_cast<float*>(expert + S);                     // [S]
    const int col0 = blockIdx.x * kMoeWarps, cols = min(kMoeWarps, H - col0);
    if constexpr (kPerLane == 0) {
        for (int s = threadIdx.x; s < S; s += blockDim.x) {
            expert[s] = __ldcg(r.topk_idx + s);
            weight[s] = __ldcg(r.topk_weights + s);
        }
    } else if (threadIdx.x < 32) {  // S = K
        float p[kPerLane];
        load_logits_row(logits, E, p);
        int idx;
        float w;
        topk_of_row<kPerLane>(p, E, K, norm_topk_prob, idx, w);
        if (threadIdx.x < K) {
            expert[threadIdx.x] = position[0] < 0 ? -1 : idx;
            weight[threadIdx.x] = w;
        }
    }
    __syncthreads();
    for (int s = 0; s < S; ++s)
        if (expert[s] >= 0)
            preload_rows(down + static_cast<size_t>(expert[s]) * H * I, col0, kMoeWarps, H, I,
                         wts + static_cast<size_t>(s) * kMoeWarps * I);
    griddep_wait();
    griddep_launch_dependents();
    load_tile(act, nullptr, 0, S, 1, I, tile, async_tile);  // act [S, I]: slot s's row
    cp_async_wait_all();
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp >= cols) return;
    const int c = col0 + warp;
    for (int b = 0; b < B; ++b) {
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) {
            const int s = b * K + k;
            if (expert[s] < 0) continue;
            const T* wr = wts + (static_cast<size_t>(s) * kMoeWarps + warp) * I;
            const T* ar = tile + static_cast<size_t>(s) * I;
            float dot = 0.0f;
            for (int cc = lane * 8; cc < I; cc += 256) {
                float wv[8], av[8];
                load8(wr + cc, wv);
                load8(ar + cc, av);
#pragma unroll
                for (int i = 0; i < 8; ++i) dot += wv[i] * av[i];
            }
            acc += weight[s] * round_to<T>(warp_sum(dot));
        }
        if (lane == 0 && position[b] >= 0) add_combined(x, delta, static_cast<size_t>(b) * H + c, acc);
    }
}

template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    combine_rmsnorm_kernel(T* x, const float* y, MoeRouting r, const T* w, float eps, const int* position,
                           int K, int H, T* h) {
    griddep_wait();
    griddep_launch_dependents();
    const int b = blockIdx.x;
    if (position[b] < 0) return;
    T* xr = x + static_cast<size_t>(b) * H;
    const float* yr = y + static_cast<size_t>(b) * K * H;  // y [B, K, H]
    residual_rmsnorm_row(H, w, eps, h + static_cast<size_t>(b) * H, [&](int c, float(&v)[8]) {
        float acc[8] = {};
        for (int k = 0; k < K; ++k) {
            if (r.topk_idx[b * K + k] < 0) continue;
            const float wk = r.topk_weights[b * K + k];
            const float4 lo = *reinterpret_cast<const float4*>(yr + static_cast<size_t>(k) * H + c);
            const float4 hi = *reinterpret_cast<const float4*>(yr + static_cast<size_t>(k) * H + c + 4);
            acc[0] += wk * lo.x, acc[1] += wk * lo.y, acc[2] += wk * lo.z, acc[3] += wk * lo.w;
            acc[4] += wk * hi.x, acc[5] += wk * hi.y, acc[6] += wk * hi.z, acc[7] += wk * hi.w;
        }
        load8(xr + c, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = round_to<T>(v[k] + round_to<T>(acc[k]));
        store8(xr + c, v);
    });
}

template <typename T, int kMode, int kRows, int kTile, int kFuse = kFuseNone, int kPerLane = 1>
void launch_rows(const void* in, const void* w0, const void* w1, const MoeRouting& r, int row_div, int cols,
                 int out_rows, int num_rows, int max_active, void* act, float* y, const Launch& launch,
                 const Fusion<T>& f = {}) {
    const size_t weight_bytes = sizeof(T) * kMoeWarps * kRows * cols;
    const bool preload = kMode != kGatedExperts && launch.preload && weight_bytes <= kMaxPreloadBytes;
    const size_t smem = sizeof(T) * kTile * cols + (preload ? weight_bytes : 0);
    auto kernel = expert_rows_kernel<T, kMode, kRows, kTile, kFuse, kPerLane>;
    ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    constexpr int kRowsPerBlock = kMoeWarps * kRows;
    launch_kernel(kernel, dim3((out_rows + kRowsPerBlock - 1) / kRowsPerBlock, max_active), kMoeWarps * 32,
                  smem, launch, static_cast<const T*>(in), static_cast<const T*>(w0),
                  static_cast<const T*>(w1), r, row_div, cols, out_rows, num_rows, preload,
                  kMode == kGatedExperts && launch.early_expert_loads, launch.async_tiles,
                  static_cast<T*>(act), y, f);
}

// Slots per pass from the batch (a bound on the tokens of one expert); weight rows per warp from
// the caller (0 = default: 1 for gate/up, which reads two matrices, else 2).
template <typename T, int kMode>
void launch_expert_rows(const void* in, const void* w0, const void* w1, const MoeRouting& r, int B,
                        int row_div, int cols, int out_rows, int max_active, int rows_per_warp, void* act,
                        float* y, const Launch& launch) {
    if (max_active == 0 || B == 0) return;
    if (rows_per_warp != 1 && rows_per_warp != 2 && rows_per_warp != 4)
        rows_per_warp = kMode == kGatedExperts ? 1 : 2;
    const int tile = B <= 1 ? 1 : (B <= 16 ? 4 : kMoeTokenTile);
#define MOERL_ROWS_CASE(rows, t)                                                                             \
    if (rows_per_warp == rows && tile == t)                                                                  \
        return launch_rows<T, kMode, rows, t>(in, w0, w1, r, row_div, cols, out_rows, B, max_active, act, y, \
                                              launch);
    MOERL_ROWS_CASE(1, 1)
    MOERL_ROWS_CASE(1, 4)
    MOERL_ROWS_CASE(1, kMoeTokenTile)
    MOERL_ROWS_CASE(2, 1)
    MOERL_ROWS_CASE(2, 4)
    MOERL_ROWS_CASE(2, kMoeTokenTile)
    MOERL_ROWS_CASE(4, 1)
    MOERL_ROWS_CASE(4, 4)
    MOERL_ROWS_CASE(4, kMoeTokenTile)
#undef MOERL_ROWS_CASE
}

// The fused GEMVs take one token a pass (kTile 1: made for one-row steps; B rows take B passes) and
// one or two weight rows a warp (rows_per_warp; anything else is two).
template <typename T, int kMode, int kFuse, int kPerLane = 1>
void launch_fused(int rows_per_warp, const void* in, const void* w0, const MoeRouting& r, int cols,
                  int out_rows, int B, int max_active, void* act, float* y, const Fusion<T>& f,
                  const Launch& launch) {
    if (rows_per_warp == 1)
        launch_rows<T, kMode, 1, 1, kFuse, kPerLane>(in, w0, nullptr, r, 1, cols, out_rows, B, max_active,
                                                     act, y, launch, f);
    else
        launch_rows<T, kMode, 2, 1, kFuse, kPerLane>(in, w0, nullptr, r, 1, cols, out_rows, B, max_active,
                                                     act, y, launch, f);
}

template <typename T, int kPerLane>
void launch_add_norm_router_typed(int rows_per_warp, const Fusion<T>& f, const void* router, int B, int H,
                                  void* logits, const MoeRouting& r, const Launch& launch) {
    if constexpr (kPerLane < kMaxExperts / 32) {
        if (f.E > 32 * kPerLane)
            return launch_add_norm_router_typed<T, kPerLane * 2>(rows_per_warp, f, router, B, H, logits, r,
                                                                 launch);
    }
    launch_fused<T, kDense, kAddNormRoute, kPerLane>(rows_per_warp, nullptr, router, r, H, f.E, B, 1, logits,
                                                     nullptr, f, launch);
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

}  // namespace

int fused_rows_done_counters(int H) { return 1 + (H + kMoeWarps - 1) / kMoeWarps; }

void launch_norm_dense_rows(int dtype, const void* x, const void* norm_weight, float eps, const void* weight,
                            int B, int cols, int out_rows, int rows_per_warp, void* out,
                            const Launch& launch) {
    if (B == 0) return;
    if (dtype == 0)
        launch_fused<float, kDense, kNormIn>(
            rows_per_warp, nullptr, weight, MoeRouting{}, cols, out_rows, B, 1, out, nullptr,
            fusion_of<float>(x, nullptr, norm_weight, eps, nullptr, nullptr, nullptr, 0, 0, false), launch);
    else
        launch_fused<__nv_bfloat16, kDense, kNormIn>(
            rows_per_warp, nullptr, weight, MoeRouting{}, cols, out_rows, B, 1, out, nullptr,
            fusion_of<__nv_bfloat16>(x, nullptr, norm_weight, eps, nullptr, nullptr, nullptr, 0, 0, false),
            launch);
}

void launch_add_norm_router_route(int dtype, const void* x, const void* delta, const void* norm_weight,
                                  float eps, const int* position, const void* router, int B, int H, int E,
                                  int K, bool norm_topk_prob, int rows_per_warp, void* h, void* logits,
                                  const MoeRouting& r, int* done, const Launch& launch) {
    if (B == 0) return;
    const bool route = !(launch.route_in_experts && B == 1);  // else the expert kernels rank the logits
    if (dtype == 0) {
        Fusion<float> f =
            fusion_of<float>(x, delta, norm_weight, eps, h, position, done, E, K, norm_topk_prob);
        f.route = route;
        launch_add_norm_router_typed<float, 1>(rows_per_warp, f, router, B, H, logits, r, launch);
    } else {
        Fusion<__nv_bfloat16> f =
            fusion_of<__nv_bfloat16>(x, delta, norm_weight, eps, h, position, done, E, K, norm_topk_prob);
        f.route = route;
        launch_add_norm_router_typed<__nv_bfloat16, 1>(rows_per_warp, f, router, B, H, logits, r, launch);
    }
}

size_t down_columns_smem(int dtype, int B, int K, int I) {
    const size_t S = static_cast<size_t>(B) * K, elem = dtype == 0 ? sizeof(float) : sizeof(__nv_bfloat16);
    return elem * S * (kMoeWarps + 1) * I + 2 * sizeof(int) * S;
}

bool down_combine_by_column(int dtype, int B, int K, int I) {
    const size_t weights =
        (dtype == 0 ? sizeof(float) : sizeof(__nv_bfloat16)) * size_t{kMoeWarps} * B * K * I;
    return I % 8 == 0 && weights <= kMaxPreloadBytes && down_columns_smem(dtype, B, K, I) <= kMaxColumnsSmem;
}

// The by-column kernel; kPerLane 0: routing from r, else from the logits (one row; kPerLane grown to E).
template <typename T, int kPerLane>
void launch_down_columns(const void* act, const void* down, const MoeRouting& r, int B, int K, int H, int I,
                         const void* logits, int E, bool norm_topk_prob, const int* position, void* x,
                         const void* delta, const Launch& launch) {
    if constexpr (kPerLane > 0 && kPerLane < kMaxExperts / 32) {
        if (E > 32 * kPerLane)
            return launch_down_columns<T, kPerLane * 2>(act, down, r, B, K, H, I, logits, E, norm_topk_prob,
                                                        position, x, delta, launch);
    }
    const size_t smem = down_columns_smem(std::is_same_v<T, float> ? 0 : 1, B, K, I);
    auto kernel = down_combine_columns_kernel<T, kPerLane>;
    ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    launch_kernel(kernel, dim3((H + kMoeWarps - 1) / kMoeWarps), kMoeWarps * 32, smem, launch,
                  static_cast<const T*>(act), static_cast<const T*>(down), r, B, K, H, I,
                  static_cast<const T*>(logits), E, norm_topk_prob, position, static_cast<T*>(x),
                  static_cast<const T*>(delta), launch.async_tiles);
}

template <typename T, int kPerLane>
void launch_gate_up_routed(const void* h, const void* gate, const void* up, const MoeRouting& r, int K, int H,
                           int I, void* act, const Fusion<T>& f, const Launch& launch) {
    if constexpr (kPerLane < kMaxExperts / 32) {
        if (f.E > 32 * kPerLane)
            return launch_gate_up_routed<T, kPerLane * 2>(h, gate, up, r, K, H, I, act, f, launch);
    }
    launch_rows<T, kGatedExperts, 1, 1, kRouteIn, kPerLane>(h, gate, up, r, K, H, I, 1, K, act, nullptr,
                                                            launch, f);
}

void launch_moe_gate_up_routed(int dtype, const void* h, const void* gate, const void* up, const void* logits,
                               const int* position, const MoeRouting& r, int E, int K, bool norm_topk_prob,
                               int H, int I, void* act, const Launch& launch) {
    if (dtype == 0) {
        Fusion<float> f = fusion_of<float>(nullptr, nullptr, nullptr, 0.0f, nullptr, position, nullptr, E, K,
                                           norm_topk_prob);
        f.logits = static_cast<const float*>(logits);
        launch_gate_up_routed<float, 1>(h, gate, up, r, K, H, I, act, f, launch);
    } else {
        Fusion<__nv_bfloat16> f = fusion_of<__nv_bfloat16>(nullptr, nullptr, nullptr, 0.0f, nullptr, position,
                                                           nullptr, E, K, norm_topk_prob);
        f.logits = static_cast<const __nv_bfloat16*>(logits);
        launch_gate_up_routed<__nv_bfloat16, 1>(h, gate, up, r, K, H, I, act, f, launch);
    }
}

void launch_moe_down_combine_routed(int dtype, const void* act, const void* down, const void* logits,
                                    const int* position, int E, int K, bool norm_topk_prob, int H, int I,
                                    void* x, const void* delta, const Launch& launch) {
    if (dtype == 0)
        launch_down_columns<float, 1>(act, down, MoeRouting{}, 1, K, H, I, logits, E, norm_topk_prob,
                                      position, x, delta, launch);
    else
        launch_down_columns<__nv_bfloat16, 1>(act, down, MoeRouting{}, 1, K, H, I, logits, E, norm_topk_prob,
                                              position, x, delta, launch);
}

void launch_moe_down_combine(int dtype, const void* act, const void* down, const MoeRouting& r, int B, int K,
                             int H, int I, int max_active, int rows_per_warp, float* y, void* x,
                             const void* delta, const int* position, int* done, const Launch& launch) {
    if (B == 0 || max_active == 0) return;
    if (launch.down_by_column && down_combine_by_column(dtype, B, K, I)) {
        if (dtype == 0)
            launch_down_columns<float, 0>(act, down, r, B, K, H, I, nullptr, 0, false, position, x, delta,
                                          launch);
        else
            launch_down_columns<__nv_bfloat16, 0>(act, down, r, B, K, H, I, nullptr, 0, false, position, x,
                                                  delta, launch);
        return;
    }
    // done[0] is the router's; chunk c of the output columns counts on done[1 + c].
    if (dtype == 0)
        launch_fused<float, kExperts, kCombine>(
            rows_per_warp, act, down, r, I, H, B, max_active, nullptr, y,
            fusion_of<float>(x, delta, nullptr, 0.0f, nullptr, position, done + 1, 0, K, false), launch);
    else
        launch_fused<__nv_bfloat16, kExperts, kCombine>(
            rows_per_warp, act, down, r, I, H, B, max_active, nullptr, y,
            fusion_of<__nv_bfloat16>(x, delta, nullptr, 0.0f, nullptr, position, done + 1, 0, K, false),
            launch);
}

template <typename T, int kPerLane>
void launch_route_typed(const void* router_logits, const int* position, int B, int E, int K,
                        bool norm_topk_prob, const MoeRouting& r, const Launch& launch) {
    if constexpr (kPerLane < kMaxExperts / 32) {
        if (E > 32 * kPerLane)
            return launch_route_typed<T, kPerLane * 2>(router_logits, position, B, E, K, norm_topk_prob, r,
                                                       launch);
    }
    const size_t smem = sizeof(int) * (3 * E + 1);
    launch_kernel(route_kernel<T, kPerLane>, 1, kRouteWarps * 32, smem, launch,
                  static_cast<const T*>(router_logits), position, B, E, K, norm_topk_prob, r);
}

void launch_route(int dtype, const void* router_logits, const int* position, int B, int E, int K,
                  bool norm_topk_prob, const MoeRouting& r, const Launch& launch) {
    if (dtype == 0)
        launch_route_typed<float, 1>(router_logits, position, B, E, K, norm_topk_prob, r, launch);
    else
        launch_route_typed<__nv_bfloat16, 1>(router_logits, position, B, E, K, norm_topk_prob, r, launch);
}

void launch_moe_gate_up(int dtype, const void* h, const void* gate, const void* up, const MoeRouting& r,
                        int B, int K, int H, int I, int max_active, int rows_per_warp, void* act,
                        const Launch& launch) {
    if (dtype == 0)
        launch_expert_rows<float, kGatedExperts>(h, gate, up, r, B, K, H, I, max_active, rows_per_warp, act,
                                                 nullptr, launch);
    else
        launch_expert_rows<__nv_bfloat16, kGatedExperts>(h, gate, up, r, B, K, H, I, max_active,
                                                         rows_per_warp, act, nullptr, launch);
}

void launch_moe_down(int dtype, const void* act, const void* down, const MoeRouting& r, int B, int K, int H,
                     int I, int max_active, int rows_per_warp, float* y, const Launch& launch) {
    (void)K;
    if (dtype == 0)
        launch_expert_rows<float, kExperts>(act, down, nullptr, r, B, 1, I, H, max_active, rows_per_warp,
                                            nullptr, y, launch);
    else
        launch_expert_rows<__nv_bfloat16, kExperts>(act, down, nullptr, r, B, 1, I, H, max_active,
                                                    rows_per_warp, nullptr, y, launch);
}

void launch_dense_rows(int dtype, const void* in, const void* weight, int B, int cols, int out_rows,
                       int rows_per_warp, void* out, const Launch& launch) {
    if (dtype == 0)
        launch_expert_rows<float, kDense>(in, weight, nullptr, MoeRouting{}, B, 1, cols, out_rows, 1,
                                          rows_per_warp, out, nullptr, launch);
    else
        launch_expert_rows<__nv_bfloat16, kDense>(in, weight, nullptr, MoeRouting{}, B, 1, cols, out_rows, 1,
                                                  rows_per_warp, out, nullptr, launch);
}

void launch_moe_combine_rmsnorm(int dtype, void* x, const float* y, const MoeRouting& r,
                                const void* norm_weight, float eps, const int* position, int B, int K, int H,
                                void* h, const Launch& launch) {
    if (B == 0) return;
    if (dtype == 0)
        launch_kernel(combine_rmsnorm_kernel<float>, B, kNormThreads, 0, launch, static_cast<float*>(x), y, r,
                      static_cast<const float*>(norm_weight), eps, position, K, H, static_cast<float*>(h));
    else
        launch_kernel(combine_rmsnorm_kernel<__nv_bfloat16>, B, kNormThreads, 0, launch,
                      static_cast<__nv_bfloat16*>(x), y, r, static_cast<const __nv_bfloat16*>(norm_weight),
                      eps, position, K, H, static_cast<__nv_bfloat16*>(h));
}

}  // namespace moerl::model::cuda
