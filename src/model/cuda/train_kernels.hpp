// Internal: row kernels of the trainer (no LibTorch inside), plain launchers taking pointers, sizes
// and a stream. `dtype` 0 = fp32, 1 = bf16 for every element pointer but rstd, bias, lp and the
// partial sums (fp32); math is in fp32. Rows are contiguous, `width` (or `ld`) elements apart.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moerl::model::cuda {

// y[r] = w * round(x[r] * rstd[r]), rstd[r] = rsqrt(mean(x[r]^2) + eps).
void launch_rms_norm_forward(int dtype, const void* x, const void* w, float eps, int64_t rows, int width,
                             void* y, float* rstd, cudaStream_t stream);

// Widths the two kernels below take (1 to kMaxHidden).
bool rms_norm_fits(int width);

// Blocks of the backward for `rows` rows: dw_partial holds that many rows of `width` floats.
int rms_norm_backward_blocks(int64_t rows);

// dx of the forward above for output gradient dy, and per block the sum over its rows of
// dy * round(x rstd) in dw_partial [blocks, width] (their sum is the weight's gradient).
void launch_rms_norm_backward(int dtype, const void* dy, const void* x, const void* w, const float* rstd,
                              int64_t rows, int width, void* dx, float* dw_partial, int blocks,
                              cudaStream_t stream);

// out[t] = sum over k < K of in[inverse[t K + k]] (+ also[inverse[t K + k]] where `also` is not
// null; rows of `width`, K <= 32, fp32 sums): each token's K slot rows, gathered from expert order
// and summed in one pass.
void launch_slot_sum(int dtype, const void* in, const void* also, const int64_t* inverse, int64_t tokens,
                     int K, int width, void* out, cudaStream_t stream);

// RMSNorm then RoPE per head row (q and k of attention): y[r] = rope(w * round(x[r] rstd[r])) with
// the cos and sin rows [width] of token r / heads (the model dtype). width: a power of two in
// [16, 256]; 16-byte aligned rows.
bool norm_rope_fits(int width);
void launch_norm_rope_forward(int dtype, const void* x, const void* w, const void* cos, const void* sin,
                              float eps, int64_t rows, int heads, int width, void* y, float* rstd,
                              cudaStream_t stream);
// Blocks of the backward below for `rows` head rows of `width`.
int norm_rope_backward_blocks(int64_t rows, int width);
// dx and the weight's per-block partial gradients, as launch_rms_norm_backward.
void launch_norm_rope_backward(int dtype, const void* dy, const void* x, const void* w, const void* cos,
                               const void* sin, const float* rstd, int64_t rows, int heads, int width,
                               void* dx, float* dw_partial, int blocks, cudaStream_t stream);

// h[r] = silu(g[r]) * u[r] * w[r] for rows of `width` (g, u, h [rows, width]; w [rows] fp32): the
// experts' activation with the routing weight of each (token, expert) row.
void launch_weighted_swiglu_forward(int dtype, const void* g, const void* u, const float* w, int64_t rows,
                                    int width, void* h, cudaStream_t stream);
// Its gradients for dh: dg, du [rows, width] and dw [rows] (fp32).
void launch_weighted_swiglu_backward(int dtype, const void* dh, const void* g, const void* u, const float* w,
                                     int64_t rows, int width, void* dg, void* du, float* dw,
                                     cudaStream_t stream);

// One AdamW step (decoupled weight decay) over n elements: grad = g * grad_scale, m and v updated,
// p = p (1 - lr weight_decay) - step_size m / (sqrt(v) / bias_correction2_sqrt + eps).
struct AdamwArgs {
    float lr, beta1, beta2, weight_decay, eps;
    float step_size;              // lr / (1 - beta1^t)
    float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
    float grad_scale;             // clipping, 1 = none (when no scale on the device is given)
    uint32_t seed;                // of the stochastic rounding of bf16 moments
};
// p fp32; g of grad_dtype and m, v of moment_dtype (1 = bf16, else fp32; bf16 moments are rounded
// stochastically); w_bf16: the model's bf16 copy of p, written in the same pass (null = none).
// scale_on_device: one fp32 on the device that replaces a.grad_scale (null = none).
void launch_adamw_master(float* p, int grad_dtype, const void* g, int moment_dtype, void* m, void* v,
                         void* w_bf16, int64_t n, const AdamwArgs& a, const float* scale_on_device,
                         cudaStream_t stream);

// Per row r of logits [rows, vocab] (row stride ld): z = logits / temperature + bias (bias [vocab]
// or null), lp[r] = z[t] - logsumexp(z) for t = targets[r] (in [0, vocab), checked by the caller).
// With write_softmax the row is overwritten with softmax(z) - onehot(t): exp(z - lse) rounded to the
// dtype, and expm1(lp[r]) at t.
void launch_selected_logprob_rows(int dtype, void* logits, int64_t ld, const int64_t* targets,
                                  const float* bias, float temperature, int64_t rows, int vocab,
                                  bool write_softmax, float* lp, cudaStream_t stream);

}  // namespace moerl::model::cuda
