// Internal: the softmax top-k routing of router logits, device side: one row by one warp, and the
// grouping of a block's rows by expert (used by the route kernel and by the fused kernels that route
// inside them).
#pragma once

#include <cfloat>

#include "common.cuh"

namespace moerl::model::cuda {

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

// The pass a block makes: blockIdx.y counts the passes of every active expert in order (an expert
// with n tokens has ceil(n / tokens_per_pass) of them), so a popular expert's passes run on as many
// blocks at once rather than one after another on one (a skewed routing's tail). Blocks past the
// last pass get expert -1. Warp 0 scans the active experts' pass counts, 32 at a time.
struct ExpertPass {
    int expert, first, count;  // the expert, its first token slot of this pass, tokens in the pass
};

__device__ __forceinline__ ExpertPass find_pass(const MoeRouting& r, int tokens_per_pass) {
    __shared__ ExpertPass pass;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x, want = static_cast<int>(blockIdx.y), active = *r.num_active;
        ExpertPass found{-1, 0, 0};
        for (int i0 = 0, base = 0; i0 < active; i0 += 32) {
            const int i = i0 + lane;
            int e = -1, lo = 0, n = 0, passes = 0;
            if (i < active) {
                e = r.active_experts[i];
                lo = r.expert_offset[e];
                n = r.expert_offset[e + 1] - lo;
                passes = (n + tokens_per_pass - 1) / tokens_per_pass;
            }
            int upto = passes;  // inclusive prefix sum over the lanes
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(kFullMask, upto, o);
                if (lane >= o) upto += v;
            }
            const int mine = want - (base + upto - passes);  // this lane's pass index, if in range
            const unsigned hit = __ballot_sync(kFullMask, passes > 0 && mine >= 0 && mine < passes);
            if (hit != 0) {
                const int src = __ffs(hit) - 1;
                const int pe = __shfl_sync(kFullMask, e, src), plo = __shfl_sync(kFullMask, lo, src),
                          pn = __shfl_sync(kFullMask, n, src), pm = __shfl_sync(kFullMask, mine, src);
                found = {pe, plo + pm * tokens_per_pass, min(tokens_per_pass, pn - pm * tokens_per_pass)};
                break;
            }
            base += __shfl_sync(kFullMask, upto, 31);
        }
        if (lane == 0) pass = found;
    }
    __syncthreads();
    return pass;
}

// Blocks along y for up to B * K slots in passes of `tokens_per_pass`: sum over active experts of
// ceil(n_e / t) <= active + floor(B K / t).
inline int pass_blocks(int slots, int max_active, int tokens_per_pass) {
    return max_active + slots / tokens_per_pass;
}

}  // namespace moerl::model::cuda
