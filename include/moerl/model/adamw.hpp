// AdamW for parameters trained in bf16 with fp32 master weights, on the device: one pass reads the
// gradient as the backward left it (bf16 or fp32), updates the master and both moments, and writes
// the bf16 weight the model computes with. The separate passes it replaces (the gradient cast to
// fp32, the fused AdamW, the master's copy back to bf16) read and wrote 40 bytes a parameter; this
// one 28 (bf16 gradients) or 30, and 20 with bf16 moments (rounded stochastically, so that their
// small per-step changes are kept on average: the split DeepSeek-V3 trained with).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace moerl::model {

struct AdamwStep {
    double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, weight_decay = 0.0, eps = 1e-8;
    int64_t step = 1;         // the step count after this step (torch.optim's), >= 1
    double grad_scale = 1.0;  // the gradient is multiplied by it first (clipping)
    // Where defined (one fp32 on the master's device), the clipping scale is read from it instead:
    // the update is queued before the gradient norm reaches the host.
    at::Tensor grad_scale_on_device;
    uint32_t rounding_seed = 0;  // bf16 moments: the stochastic rounding's bits (vary it by step and tensor)
};

// Whether adamw_master_step runs here: a CUDA build with the trainer's kernels.
bool adamw_master_available();

// master: fp32 on one CUDA device, contiguous; m, v: that shape, both fp32 or both bf16; grad: that
// shape, bf16 or fp32, contiguous; weight: bf16 of that shape (overwritten with the new master), or
// undefined. Throws naming what does not fit.
void adamw_master_step(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& m,
                       const at::Tensor& v, const at::Tensor& weight, const AdamwStep& step);

}  // namespace moerl::model
