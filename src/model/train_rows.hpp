// Internal: the trainer's CUDA row kernels (src/model/cuda/train_kernels.hpp) on LibTorch tensors.
// In a build without the CUDA kernels cuda_rows_serve() is false and the callers keep their
// LibTorch compositions.
#pragma once

#include <ATen/ATen.h>

namespace moerl::model {

// Whether the row kernels take `t`: a CUDA tensor of fp32 or bf16 in a build that has them.
bool cuda_rows_serve(const at::Tensor& t);

// weight * round(x * rsqrt(mean(x^2) + eps)) over the last dimension, differentiable in x and
// weight: one pass forward, one backward, instead of the composition's eight; an undefined tensor
// for rows wider than the kernels take (the caller composes then).
at::Tensor cuda_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// rms_norm then apply_rope of layers.hpp in one pass each way for x [tokens..., heads, D] and
// cos, sin [tokens..., 1, D] (the model dtype), differentiable in x and weight; an undefined tensor
// where the kernel does not take these shapes (the caller composes the two then).
at::Tensor cuda_rms_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                              const at::Tensor& sin, double eps);

// [T, H] <- each token's K rows of slot_rows [T*K, H] (at positions inverse[t K + k]) summed, and
// those of `also` (its shape, optional) with them: one gather-and-sum pass for K <= 32; an
// undefined tensor where the kernel does not take the inputs.
at::Tensor cuda_slot_sum(const at::Tensor& slot_rows, const at::Tensor& inverse, int64_t K,
                         const at::Tensor& also = {});

// silu(g) * u * w[:, None] for g, u [rows, width] (model dtype) and routing weights w [rows] fp32,
// differentiable in all three: one pass forward and one backward, instead of the composition's three
// and about eight.
at::Tensor cuda_weighted_swiglu(const at::Tensor& g, const at::Tensor& u, const at::Tensor& w);

// lp [rows] fp32 <- the targets' log-probabilities under logits [rows, V] / temperature + bias; with
// write_softmax the logits become softmax - onehot (see launch_selected_logprob_rows).
void cuda_selected_logprob_rows(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& bias,
                                double temperature, bool write_softmax, const at::Tensor& lp);

}  // namespace moerl::model
