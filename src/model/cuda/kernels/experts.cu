// The MoE experts of a decode step on the CUDA cores: gate/up and down products over the routed
// experts' weights (each read once per step, applied to all tokens routed to it, gathered on the fly
// with no permuted copy of the activations), the weighted combine into the residual, and the one-row
// forms that rank the router logits themselves and combine by output column. Also the row moves
// around the grouped-GEMM experts of large batches (gather to expert order, activation, scatter).
#include <type_traits>

#include "weight_rows.cuh"

namespace moerl::model::cuda {
namespace {

// The down experts and the combine of one row by output column: block c takes columns
// [c * kMoeWarps, +kMoeWarps) of the expert of every top-k slot (one column a warp) and adds the
// slots, weighted, into x itself: no fp32 y, no counters, no last block. Warp 0 first ranks the router
// logits (written two kernels back), then the weights (kMoeWarps rows of each slot's expert,
// contiguous) are copied into shared memory before the kernel waits for gate/up. The dot products
// and the combine sum in the order of expert_rows_kernel and its kCombine tail: the same bits.
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kMoeWarps * 32)
    down_combine_columns_kernel(const T* act, const T* down, int K, int H, int I, const T* logits, int E,
                                bool norm_topk_prob, const int* position, T* x, const T* delta) {
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    T* wts = reinterpret_cast<T*>(smem_bytes);                                // [K, kMoeWarps, I]
    T* tile = wts + static_cast<size_t>(K) * kMoeWarps * I;                   // [K, I]
    int* expert = reinterpret_cast<int*>(tile + static_cast<size_t>(K) * I);  // [K]
    float* weight = reinterpret_cast<float*>(expert + K);                     // [K]
    const int col0 = blockIdx.x * kMoeWarps, cols = min(kMoeWarps, H - col0);
    if (threadIdx.x < 32) {
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
    for (int s = 0; s < K; ++s)
        if (expert[s] >= 0)
            preload_rows(down + static_cast<size_t>(expert[s]) * H * I, col0, kMoeWarps, H, I,
                         wts + static_cast<size_t>(s) * kMoeWarps * I);
    griddep_wait();
    griddep_launch_dependents();
    load_tile(act, nullptr, 0, K, 1, I, tile);  // act [K, I]: slot s's row
    cp_async_wait_all();
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp >= cols) return;
    const int c = col0 + warp;
    float acc = 0.0f;
    for (int s = 0; s < K; ++s) {
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
    if (lane == 0 && position[0] >= 0) add_combined(x, delta, c, acc);
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

size_t down_columns_smem(int dtype, int K, int I) {
    const size_t elem = dtype == 0 ? sizeof(float) : sizeof(__nv_bfloat16);
    return elem * K * (kMoeWarps + 1) * I + 2 * sizeof(int) * K;
}

// kPerLane grown to E (the row's probabilities a lane holds).
template <typename T, int kPerLane>
void launch_down_columns(const void* act, const void* down, int K, int H, int I, const void* logits, int E,
                         bool norm_topk_prob, const int* position, void* x, const void* delta,
                         const Launch& launch) {
    if constexpr (kPerLane < kMaxExperts / 32) {
        if (E > 32 * kPerLane)
            return launch_down_columns<T, kPerLane * 2>(act, down, K, H, I, logits, E, norm_topk_prob,
                                                        position, x, delta, launch);
    }
    const size_t smem = down_columns_smem(std::is_same_v<T, float> ? 0 : 1, K, I);
    auto kernel = down_combine_columns_kernel<T, kPerLane>;
    ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    launch_kernel(kernel, dim3((H + kMoeWarps - 1) / kMoeWarps), kMoeWarps * 32, smem, launch,
                  static_cast<const T*>(act), static_cast<const T*>(down), K, H, I,
                  static_cast<const T*>(logits), E, norm_topk_prob, position, static_cast<T*>(x),
                  static_cast<const T*>(delta));
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

}  // namespace

void launch_moe_gate_up(int dtype, const void* h, const void* gate, const void* up, const MoeRouting& r,
                        int B, int K, int H, int I, int max_active, void* act, const Launch& launch) {
    if (dtype == 0)
        launch_expert_rows<float, kGatedExperts>(h, gate, up, r, B, K, H, I, max_active, act, nullptr,
                                                 launch);
    else
        launch_expert_rows<__nv_bfloat16, kGatedExperts>(h, gate, up, r, B, K, H, I, max_active, act, nullptr,
                                                         launch);
}

void launch_moe_down(int dtype, const void* act, const void* down, const MoeRouting& r, int B, int K, int H,
                     int I, int max_active, float* y, const Launch& launch) {
    (void)K;
    if (dtype == 0)
        launch_expert_rows<float, kExperts>(act, down, nullptr, r, B, 1, I, H, max_active, nullptr, y,
                                            launch);
    else
        launch_expert_rows<__nv_bfloat16, kExperts>(act, down, nullptr, r, B, 1, I, H, max_active, nullptr, y,
                                                    launch);
}

void launch_moe_down_combine(int dtype, const void* act, const void* down, const MoeRouting& r, int B, int K,
                             int H, int I, int max_active, float* y, void* x, const void* delta,
                             const int* position, int* done, const Launch& launch) {
    if (B == 0 || max_active == 0) return;
    // done[0] is the router's; chunk c of the output columns counts on done[1 + c].
    if (dtype == 0)
        launch_fused<float, kExperts, kCombine>(
            act, down, r, I, H, B, max_active, nullptr, y,
            fusion_of<float>(x, delta, nullptr, 0.0f, nullptr, position, done + 1, 0, K, false), launch);
    else
        launch_fused<__nv_bfloat16, kExperts, kCombine>(
            act, down, r, I, H, B, max_active, nullptr, y,
            fusion_of<__nv_bfloat16>(x, delta, nullptr, 0.0f, nullptr, position, done + 1, 0, K, false),
            launch);
}

bool moe_routed_one_row_supported(int dtype, int K, int I) {
    const size_t weights = (dtype == 0 ? sizeof(float) : sizeof(__nv_bfloat16)) * size_t{kMoeWarps} * K * I;
    return I % 8 == 0 && weights <= kMaxPreloadBytes && down_columns_smem(dtype, K, I) <= kMaxColumnsSmem;
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
        launch_down_columns<float, 1>(act, down, K, H, I, logits, E, norm_topk_prob, position, x, delta,
                                      launch);
    else
        launch_down_columns<__nv_bfloat16, 1>(act, down, K, H, I, logits, E, norm_topk_prob, position, x,
                                              delta, launch);
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

namespace {

// The grouped-GEMM path's moves, bf16 rows with H a multiple of 8, one block of kSlotRowThreads a
// slot row. gather: xs[i] = h[slots[i] / K] for the S slots in the routing's expert order.
constexpr int kSlotRowThreads = 128;

__global__ void __launch_bounds__(kSlotRowThreads)
    gather_slot_rows_kernel(const __nv_bfloat16* h, const int* slots, int K, int H, __nv_bfloat16* xs) {
    griddep_wait();
    griddep_launch_dependents();
    const int i = blockIdx.x;
    const auto* src = reinterpret_cast<const uint4*>(h + static_cast<size_t>(slots[i] / K) * H);
    auto* dst = reinterpret_cast<uint4*>(xs + static_cast<size_t>(i) * H);
    for (int c = threadIdx.x; c < H / 8; c += kSlotRowThreads) dst[c] = src[c];
}

// act = round(silu(g)) * u over n elements (n a multiple of 8), rounded as the expert kernels round.
__global__ void __launch_bounds__(kSlotRowThreads)
    silu_mul_kernel(const __nv_bfloat16* g, const __nv_bfloat16* u, int64_t n, __nv_bfloat16* act) {
    griddep_wait();
    griddep_launch_dependents();
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * kSlotRowThreads + threadIdx.x) * 8; i < n;
         i += static_cast<int64_t>(gridDim.x) * kSlotRowThreads * 8) {
        float gv[8], uv[8], out[8];
        load8(g + i, gv);
        load8(u + i, uv);
#pragma unroll
        for (int k = 0; k < 8; ++k) out[k] = round_to<__nv_bfloat16>(silu(gv[k])) * uv[k];
        store8(act + i, out);
    }
}

// scatter: y[slots[i]] = o[i] in fp32 for the routed slots (i < expert_offset[E]).
__global__ void __launch_bounds__(kSlotRowThreads)
    scatter_slot_rows_kernel(const __nv_bfloat16* o, const int* slots, const int* routed, int H, float* y) {
    griddep_wait();
    griddep_launch_dependents();
    const int i = blockIdx.x;
    if (i >= *routed) return;
    const __nv_bfloat16* src = o + static_cast<size_t>(i) * H;
    float* dst = y + static_cast<size_t>(slots[i]) * H;
    for (int c = threadIdx.x * 8; c < H; c += kSlotRowThreads * 8) {
        float v[8];
        load8(src + c, v);
        store8(dst + c, v);
    }
}

}  // namespace

void launch_gather_slot_rows(const void* h, const MoeRouting& r, int S, int K, int H, void* xs,
                             const Launch& launch) {
    MOERL_CHECK(H % 8 == 0, "gather_slot_rows: width ", H, " is not a multiple of 8");
    if (S == 0) return;
    launch_kernel(gather_slot_rows_kernel, S, kSlotRowThreads, 0, launch,
                  static_cast<const __nv_bfloat16*>(h), static_cast<const int*>(r.expert_slots), K, H,
                  static_cast<__nv_bfloat16*>(xs));
}

void launch_silu_mul(const void* g, const void* u, int64_t n, void* act, const Launch& launch) {
    MOERL_CHECK(n % 8 == 0, "silu_mul: ", n, " elements, not a multiple of 8");
    if (n == 0) return;
    const int64_t want = (n / 8 + kSlotRowThreads - 1) / kSlotRowThreads;
    launch_kernel(silu_mul_kernel, static_cast<unsigned>(want < 4096 ? want : 4096), kSlotRowThreads, 0,
                  launch, static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u), n,
                  static_cast<__nv_bfloat16*>(act));
}

void launch_scatter_slot_rows(const void* o, const MoeRouting& r, int S, int E, int H, float* y,
                              const Launch& launch) {
    MOERL_CHECK(H % 8 == 0, "scatter_slot_rows: width ", H, " is not a multiple of 8");
    if (S == 0) return;
    launch_kernel(scatter_slot_rows_kernel, S, kSlotRowThreads, 0, launch,
                  static_cast<const __nv_bfloat16*>(o), static_cast<const int*>(r.expert_slots),
                  static_cast<const int*>(r.expert_offset + E), H, y);
}

}  // namespace moerl::model::cuda
