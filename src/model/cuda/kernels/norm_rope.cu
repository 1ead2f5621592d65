// Embedding, residual add + RMSNorm, and the per-head q/k RMSNorm + RoPE + KV-cache store.
// Rounding follows the model's eager path: the residual stream, normalised values and the weight
// product are each rounded to the model dtype.
#include <type_traits>

#include "common.cuh"

namespace moerl::model::cuda {
namespace {

template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    embed_rmsnorm_kernel(const int64_t* tokens, const T* embed, const T* w, float eps, int V, int H, T* x,
                         T* h) {
    griddep_wait();
    griddep_launch_dependents();
    const int b = blockIdx.x;
    const int64_t token = min(max(tokens[b], int64_t{0}), static_cast<int64_t>(V - 1));
    const T* src = embed + token * H;  // embed [V, H]
    T* xr = x + static_cast<size_t>(b) * H;
    residual_rmsnorm_row(H, w, eps, h + static_cast<size_t>(b) * H, [&](int c, float(&v)[8]) {
        load8(src + c, v);
        store8(xr + c, v);
    });
}

template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    add_rmsnorm_kernel(T* x, const T* delta, const T* w, float eps, const int* position, int H, T* h) {
    griddep_wait();
    griddep_launch_dependents();
    const int b = blockIdx.x;
    if (position != nullptr && position[b] < 0) return;
    T* xr = x + static_cast<size_t>(b) * H;
    const T* dr = delta != nullptr ? delta + static_cast<size_t>(b) * H : nullptr;
    residual_rmsnorm_row(H, w, eps, h + static_cast<size_t>(b) * H, [&](int c, float(&v)[8]) {
        load8(xr + c, v);
        if (dr == nullptr) return;
        float dv[8];
        load8(dr + c, dv);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = round_to<T>(v[k] + dv[k]);
        store8(xr + c, v);
    });
}

// One warp per (row, head) over the Hq query, Hkv key and Hkv value heads of the fused projection.
// KV = uint8_t: the pools are an FP8 KV cache (KvScales).
template <typename T, typename KV>
__global__ void qk_norm_rope_store_kernel(const T* qkv, const T* q_norm, const T* k_norm, float eps,
                                          float rope_theta, const int* position, const int* slot,
                                          const int* block_table, int max_blocks, int block_size, int B,
                                          int Hq, int Hkv, int D, T* q_out, KV* k_pool, KV* v_pool,
                                          KvScales fp8) {
    constexpr bool kFp8 = std::is_same_v<KV, uint8_t>;
    griddep_wait();
    griddep_launch_dependents();
    const int lane = threadIdx.x & 31;
    const int heads = Hq + 2 * Hkv;
    const int task = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (task >= B * heads) return;
    const int b = task / heads, head = task % heads;
    const int pos = position[b];
    if (pos < 0) return;
    const T* src = qkv + (static_cast<size_t>(b) * heads + head) * D;  // qkv [B, heads, D]
    // Cache row of this token: pool [num_blocks, block_size, Hkv, D].
    const int block = block_table[static_cast<size_t>(slot[b]) * max_blocks + pos / block_size];
    const size_t cache_row = (static_cast<size_t>(block) * block_size + pos % block_size) * Hkv;
    if (head >= Hq + Hkv) {  // value head: stored as is
        const size_t row = cache_row + (head - Hq - Hkv);
        if constexpr (kFp8) {
            store_row_e4m3(src, D, v_pool + row * D, fp8.v + row);
        } else {
            KV* dst = v_pool + row * D;
            for (int c = lane; c < D; c += 32) dst[c] = src[c];
        }
        return;
    }
    if (head < Hq) {
        norm_rope_head_to(src, q_norm, eps, rope_theta, pos, D,
                          q_out + (static_cast<size_t>(b) * Hq + head) * D);
        return;
    }
    const size_t row = cache_row + (head - Hq);
    if constexpr (kFp8)
        norm_rope_head_to_e4m3(src, k_norm, eps, rope_theta, pos, D, k_pool + row * D, fp8.k + row);
    else
        norm_rope_head_to(src, k_norm, eps, rope_theta, pos, D, k_pool + row * D);
}

}  // namespace

void launch_embed_rmsnorm(int dtype, const int64_t* tokens, const void* embed, const void* norm_weight,
                          float eps, int B, int V, int H, void* x, void* h, const Launch& launch) {
    if (B == 0) return;
    if (dtype == 0)
        launch_kernel(embed_rmsnorm_kernel<float>, B, kNormThreads, 0, launch, tokens,
                      static_cast<const float*>(embed), static_cast<const float*>(norm_weight), eps, V, H,
                      static_cast<float*>(x), static_cast<float*>(h));
    else
        launch_kernel(embed_rmsnorm_kernel<__nv_bfloat16>, B, kNormThreads, 0, launch, tokens,
                      static_cast<const __nv_bfloat16*>(embed),
                      static_cast<const __nv_bfloat16*>(norm_weight), eps, V, H,
                      static_cast<__nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(h));
}

void launch_add_rmsnorm(int dtype, void* x, const void* delta, const void* norm_weight, float eps,
                        const int* position, int B, int H, void* h, const Launch& launch) {
    if (B == 0) return;
    if (dtype == 0)
        launch_kernel(add_rmsnorm_kernel<float>, B, kNormThreads, 0, launch, static_cast<float*>(x),
                      static_cast<const float*>(delta), static_cast<const float*>(norm_weight), eps, position,
                      H, static_cast<float*>(h));
    else
        launch_kernel(add_rmsnorm_kernel<__nv_bfloat16>, B, kNormThreads, 0, launch,
                      static_cast<__nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(delta),
                      static_cast<const __nv_bfloat16*>(norm_weight), eps, position, H,
                      static_cast<__nv_bfloat16*>(h));
}

void launch_qk_norm_rope_store(int dtype, const void* qkv, const void* q_norm, const void* k_norm, float eps,
                               float rope_theta, const int* position, const int* slot, const int* block_table,
                               int max_blocks, int block_size, int B, int Hq, int Hkv, int D, void* q_out,
                               void* k_pool, void* v_pool, const Launch& launch, const KvScales& fp8) {
    const int tasks = B * (Hq + 2 * Hkv);
    if (tasks == 0) return;
    constexpr int kWarps = 8;
    const int blocks = (tasks + kWarps - 1) / kWarps;
    using bf16 = __nv_bfloat16;
    MOERL_CHECK(!fp8.fp8() || dtype == 1, "qk_norm_rope_store: an FP8 KV cache needs bf16 inputs");
    if (fp8.fp8())
        launch_kernel(qk_norm_rope_store_kernel<bf16, uint8_t>, blocks, kWarps * 32, 0, launch,
                      static_cast<const bf16*>(qkv), static_cast<const bf16*>(q_norm),
                      static_cast<const bf16*>(k_norm), eps, rope_theta, position, slot, block_table,
                      max_blocks, block_size, B, Hq, Hkv, D, static_cast<bf16*>(q_out),
                      static_cast<uint8_t*>(k_pool), static_cast<uint8_t*>(v_pool), fp8);
    else if (dtype == 0)
        launch_kernel(qk_norm_rope_store_kernel<float, float>, blocks, kWarps * 32, 0, launch,
                      static_cast<const float*>(qkv), static_cast<const float*>(q_norm),
                      static_cast<const float*>(k_norm), eps, rope_theta, position, slot, block_table,
                      max_blocks, block_size, B, Hq, Hkv, D, static_cast<float*>(q_out),
                      static_cast<float*>(k_pool), static_cast<float*>(v_pool), fp8);
    else
        launch_kernel(qk_norm_rope_store_kernel<bf16, bf16>, blocks, kWarps * 32, 0, launch,
                      static_cast<const bf16*>(qkv), static_cast<const bf16*>(q_norm),
                      static_cast<const bf16*>(k_norm), eps, rope_theta, position, slot, block_table,
                      max_blocks, block_size, B, Hq, Hkv, D, static_cast<bf16*>(q_out),
                      static_cast<bf16*>(k_pool), static_cast<bf16*>(v_pool), fp8);
}

}  // namespace moerl::model::cuda
