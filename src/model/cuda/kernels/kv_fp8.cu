// The FP8 KV cache's row moves outside the decode step: a prefill's keys and values into the pools as
// e4m3 rows with their scales, and cached rows back to bf16 for a prefill that continues a sequence.
// One warp a (row, key-value head), the same rounding as the decode step's store.
#include "common.cuh"

namespace moerl::model::cuda {
namespace {

constexpr int kRowWarps = 8;

__global__ void __launch_bounds__(kRowWarps * 32)
    kv_rows_to_fp8_kernel(const __nv_bfloat16* src, const int64_t* rows, int64_t n, int Hkv, int D,
                          uint8_t* pool, float* scales) {
    griddep_wait();
    griddep_launch_dependents();
    const int64_t task = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
    if (task >= n * Hkv) return;
    const int64_t i = task / Hkv, h = task % Hkv;
    const int64_t row = rows[i] * Hkv + h;  // (pool token, head)
    store_row_e4m3(src + task * D, D, pool + row * D, scales + row);
}

__global__ void __launch_bounds__(kRowWarps * 32)
    kv_rows_from_fp8_kernel(const uint8_t* pool, const float* scales, const int64_t* rows, int64_t n, int Hkv,
                            int D, __nv_bfloat16* out) {
    griddep_wait();
    griddep_launch_dependents();
    const int64_t task = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
    if (task >= n * Hkv) return;
    const int64_t i = task / Hkv, h = task % Hkv;
    const int64_t row = rows[i] * Hkv + h;
    const float scale = scales[row];
    const uint8_t* q = pool + row * D;
    __nv_bfloat16* dst = out + task * D;
    for (int c = threadIdx.x & 31; c < D; c += 32) dst[c] = __float2bfloat16(e4m3_to_float(q[c]) * scale);
}

int row_blocks(int64_t n, int Hkv, const char* what) {
    const int64_t blocks = (n * Hkv + kRowWarps - 1) / kRowWarps;
    MOERL_CHECK(blocks < (int64_t{1} << 31), what, ": ", n, " rows of ", Hkv,
                " heads exceed the launch grid");
    return static_cast<int>(blocks);
}

}  // namespace

void launch_kv_rows_to_fp8(const void* src, const int64_t* rows, int64_t n, int Hkv, int D, uint8_t* pool,
                           float* scales, const Launch& launch) {
    if (n == 0) return;
    MOERL_CHECK(D >= 1 && D <= kMaxHeadDim, "kv_rows_to_fp8: head_dim ", D, " above ", kMaxHeadDim);
    launch_kernel(kv_rows_to_fp8_kernel, row_blocks(n, Hkv, "kv_rows_to_fp8"), kRowWarps * 32, 0, launch,
                  static_cast<const __nv_bfloat16*>(src), rows, n, Hkv, D, pool, scales);
}

void launch_kv_rows_from_fp8(const uint8_t* pool, const float* scales, const int64_t* rows, int64_t n,
                             int Hkv, int D, void* out, const Launch& launch) {
    if (n == 0) return;
    launch_kernel(kv_rows_from_fp8_kernel, row_blocks(n, Hkv, "kv_rows_from_fp8"), kRowWarps * 32, 0, launch,
                  pool, scales, rows, n, Hkv, D, static_cast<__nv_bfloat16*>(out));
}

}  // namespace moerl::model::cuda
