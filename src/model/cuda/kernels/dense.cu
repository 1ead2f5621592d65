// The dense GEMVs of a decode step (q/k/v, o, router, LM head at a few rows), and the one-row
// forms with the norm before them or the add + norm and routing around the router folded in.
#include "weight_rows.cuh"

namespace moerl::model::cuda {
namespace {

template <typename T, int kPerLane>
void launch_add_norm_router_typed(const Fusion<T>& f, const void* router, int B, int H, void* logits,
                                  const MoeRouting& r, const Launch& launch) {
    if constexpr (kPerLane < kMaxExperts / 32) {
        if (f.E > 32 * kPerLane)
            return launch_add_norm_router_typed<T, kPerLane * 2>(f, router, B, H, logits, r, launch);
    }
    launch_fused<T, kDense, kAddNormRoute, kPerLane>(nullptr, router, r, H, f.E, B, 1, logits, nullptr, f,
                                                     launch);
}

template <typename T>
void launch_add_norm_router(const void* x, const void* delta, const void* norm_weight, float eps,
                            const int* position, const void* router, int B, int H, int E, int K,
                            bool norm_topk_prob, bool route, void* h, void* logits, const MoeRouting& r,
                            int* done, const Launch& launch) {
    Fusion<T> f = fusion_of<T>(x, delta, norm_weight, eps, h, position, done, E, K, norm_topk_prob);
    f.route = route;
    launch_add_norm_router_typed<T, 1>(f, router, B, H, logits, r, launch);
}

}  // namespace

int fused_rows_done_counters(int H) { return 1 + (H + kMoeWarps - 1) / kMoeWarps; }

void launch_dense_rows(int dtype, const void* in, const void* weight, int B, int cols, int out_rows,
                       void* out, const Launch& launch) {
    if (dtype == 0)
        launch_expert_rows<float, kDense>(in, weight, nullptr, MoeRouting{}, B, 1, cols, out_rows, 1, out,
                                          nullptr, launch);
    else
        launch_expert_rows<__nv_bfloat16, kDense>(in, weight, nullptr, MoeRouting{}, B, 1, cols, out_rows, 1,
                                                  out, nullptr, launch);
}

void launch_norm_dense_rows(int dtype, const void* x, const void* norm_weight, float eps, const void* weight,
                            int B, int cols, int out_rows, void* out, const Launch& launch) {
    if (B == 0) return;
    if (dtype == 0)
        launch_fused<float, kDense, kNormIn>(
            nullptr, weight, MoeRouting{}, cols, out_rows, B, 1, out, nullptr,
            fusion_of<float>(x, nullptr, norm_weight, eps, nullptr, nullptr, nullptr, 0, 0, false), launch);
    else
        launch_fused<__nv_bfloat16, kDense, kNormIn>(
            nullptr, weight, MoeRouting{}, cols, out_rows, B, 1, out, nullptr,
            fusion_of<__nv_bfloat16>(x, nullptr, norm_weight, eps, nullptr, nullptr, nullptr, 0, 0, false),
            launch);
}

void launch_add_norm_router_route(int dtype, const void* x, const void* delta, const void* norm_weight,
                                  float eps, const int* position, const void* router, int B, int H, int E,
                                  int K, bool norm_topk_prob, bool route, void* h, void* logits,
                                  const MoeRouting& r, int* done, const Launch& launch) {
    if (B == 0) return;
    if (dtype == 0)
        launch_add_norm_router<float>(x, delta, norm_weight, eps, position, router, B, H, E, K,
                                      norm_topk_prob, route, h, logits, r, done, launch);
    else
        launch_add_norm_router<__nv_bfloat16>(x, delta, norm_weight, eps, position, router, B, H, E, K,
                                              norm_topk_prob, route, h, logits, r, done, launch);
}

}  // namespace moerl::model::cuda
