// The routing of a decode step's rows in one block: softmax top-k of the router logits, then the
// (row, k) slots grouped by expert for the expert kernels.
#include "routing.cuh"

namespace moerl::model::cuda {
namespace {

constexpr int kRouteWarps = 32;

template <typename T, int kPerLane>
__global__ void __launch_bounds__(kRouteWarps * 32)
    route_kernel(const T* logits, const int* position, int B, int E, int K, bool norm_topk_prob,
                 MoeRouting r) {
    griddep_wait();
    griddep_launch_dependents();
    extern __shared__ int smem_counts[];
    route_rows<T, kPerLane>(logits, position, B, E, K, norm_topk_prob, r, smem_counts);
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

}  // namespace

void launch_route(int dtype, const void* router_logits, const int* position, int B, int E, int K,
                  bool norm_topk_prob, const MoeRouting& r, const Launch& launch) {
    if (dtype == 0)
        launch_route_typed<float, 1>(router_logits, position, B, E, K, norm_topk_prob, r, launch);
    else
        launch_route_typed<__nv_bfloat16, 1>(router_logits, position, B, E, K, norm_topk_prob, r, launch);
}

}  // namespace moerl::model::cuda
