// The trainer's CUDA row kernels under LibTorch: an autograd function for RMSNorm and the
// log-probability rows of selected_logprobs.
#include "train_rows.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <vector>

#include "cuda/train_kernels.hpp"
#include "moerl/core/error.hpp"
#include "moerl/model/adamw.hpp"

namespace moerl::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int dtype_code(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 1 : 0; }

cudaStream_t stream_of(const at::Tensor& t) {
    return at::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

struct RmsNormRows : torch::autograd::Function<RmsNormRows> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                              double eps) {
        c10::cuda::CUDAGuard guard(x.device());
        at::Tensor xc = x.contiguous(), w = weight.contiguous();
        const int width = static_cast<int>(x.size(-1));
        const int64_t rows = width == 0 ? 0 : xc.numel() / width;
        at::Tensor y = at::empty_like(xc);
        at::Tensor rstd = at::empty({rows}, xc.options().dtype(at::kFloat));
        cuda::launch_rms_norm_forward(dtype_code(xc), xc.data_ptr(), w.data_ptr(), static_cast<float>(eps),
                                      rows, width, y.data_ptr(), rstd.data_ptr<float>(), stream_of(xc));
        ctx->save_for_backward({xc, w, rstd});
        return y;
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
        c10::cuda::CUDAGuard guard(x.device());
        at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
        const int width = static_cast<int>(x.size(-1));
        const int64_t rows = rstd.size(0);
        at::Tensor dx = at::empty_like(x);
        const int blocks = cuda::rms_norm_backward_blocks(rows);
        at::Tensor partial = at::empty({blocks, width}, x.options().dtype(at::kFloat));
        cuda::launch_rms_norm_backward(dtype_code(x), dy.data_ptr(), x.data_ptr(), w.data_ptr(),
                                       rstd.data_ptr<float>(), rows, width, dx.data_ptr(),
                                       partial.data_ptr<float>(), blocks, stream_of(x));
        at::Tensor dw = rows == 0 ? at::zeros_like(w) : partial.sum(0).to(w.scalar_type());
        return {dx, dw, at::Tensor()};
    }
};

struct NormRopeRows : torch::autograd::Function<NormRopeRows> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& cos, const at::Tensor& sin, double eps) {
        c10::cuda::CUDAGuard guard(x.device());
        at::Tensor xc = x.contiguous(), w = weight.contiguous(), c = cos.contiguous(), s = sin.contiguous();
        const int width = static_cast<int>(x.size(-1));
        const int heads = static_cast<int>(x.size(-2));
        const int64_t rows = xc.numel() / width;
        at::Tensor y = at::empty_like(xc);
        at::Tensor rstd = at::empty({rows}, xc.options().dtype(at::kFloat));
        cuda::launch_norm_rope_forward(dtype_code(xc), xc.data_ptr(), w.data_ptr(), c.data_ptr(),
                                       s.data_ptr(), static_cast<float>(eps), rows, heads, width,
                                       y.data_ptr(), rstd.data_ptr<float>(), stream_of(xc));
        ctx->save_for_backward({xc, w, c, s, rstd});
        return y;
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &w = saved[1], &c = saved[2], &s = saved[3], &rstd = saved[4];
        c10::cuda::CUDAGuard guard(x.device());
        at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
        const int width = static_cast<int>(x.size(-1));
        const int heads = static_cast<int>(x.size(-2));
        const int64_t rows = rstd.size(0);
        at::Tensor dx = at::empty_like(x);
        const int blocks = cuda::norm_rope_backward_blocks(rows, width);
        at::Tensor partial = at::empty({blocks, width}, x.options().dtype(at::kFloat));
        cuda::launch_norm_rope_backward(dtype_code(x), dy.data_ptr(), x.data_ptr(), w.data_ptr(),
                                        c.data_ptr(), s.data_ptr(), rstd.data_ptr<float>(), rows, heads,
                                        width, dx.data_ptr(), partial.data_ptr<float>(), blocks,
                                        stream_of(x));
        at::Tensor dw = rows == 0 ? at::zeros_like(w) : partial.sum(0).to(w.scalar_type());
        return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

struct WeightedSwigluRows : torch::autograd::Function<WeightedSwigluRows> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u,
                              const at::Tensor& w) {
        c10::cuda::CUDAGuard guard(g.device());
        at::Tensor gc = g.contiguous(), uc = u.contiguous(), wc = w.contiguous();
        at::Tensor h = at::empty_like(gc);
        cuda::launch_weighted_swiglu_forward(dtype_code(gc), gc.data_ptr(), uc.data_ptr(),
                                             wc.data_ptr<float>(), gc.size(0), static_cast<int>(gc.size(1)),
                                             h.data_ptr(), stream_of(gc));
        ctx->save_for_backward({gc, uc, wc});
        return h;
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const at::Tensor &g = saved[0], &u = saved[1], &w = saved[2];
        c10::cuda::CUDAGuard guard(g.device());
        at::Tensor dh = grads[0].to(g.scalar_type()).contiguous();
        at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
        at::Tensor dw = at::empty({g.size(0)}, w.options());
        cuda::launch_weighted_swiglu_backward(
            dtype_code(g), dh.data_ptr(), g.data_ptr(), u.data_ptr(), w.data_ptr<float>(), g.size(0),
            static_cast<int>(g.size(1)), dg.data_ptr(), du.data_ptr(), dw.data_ptr<float>(), stream_of(g));
        return {dg, du, dw};
    }
};

}  // namespace

at::Tensor cuda_weighted_swiglu(const at::Tensor& g, const at::Tensor& u, const at::Tensor& w) {
    MOERL_CHECK(g.dim() == 2 && u.sizes() == g.sizes() && u.scalar_type() == g.scalar_type() &&
                    w.dim() == 1 && w.size(0) == g.size(0) && w.scalar_type() == at::kFloat &&
                    u.device() == g.device() && w.device() == g.device(),
                "weighted_swiglu: g ", g.sizes(), ", u ", u.sizes(), " and w ", w.sizes(), " (",
                w.scalar_type(), ") are not [rows, width] twice and [rows] fp32 on one device");
    return WeightedSwigluRows::apply(g, u, w);
}

bool adamw_master_available() { return true; }

void adamw_master_step(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& m,
                       const at::Tensor& v, const at::Tensor& weight, const AdamwStep& s) {
    auto fits = [&](const at::Tensor& t, at::ScalarType type) {
        return t.defined() && t.is_cuda() && t.device() == master.device() && t.is_contiguous() &&
               t.scalar_type() == type && t.sizes() == master.sizes();
    };
    const bool moments_fit =
        (fits(m, at::kFloat) && fits(v, at::kFloat)) || (fits(m, at::kBFloat16) && fits(v, at::kBFloat16));
    MOERL_CHECK(
        fits(master, at::kFloat) && moments_fit && (fits(grad, at::kBFloat16) || fits(grad, at::kFloat)) &&
            (!weight.defined() || fits(weight, at::kBFloat16)),
        "adamw_master_step: master ", master.sizes(), " ", master.scalar_type(), ", grad ", grad.sizes(), " ",
        grad.scalar_type(), ", moments ", m.defined() ? m.scalar_type() : at::kFloat,
        " and weight must be contiguous on one CUDA device (fp32 master, both moments fp32 or "
        "both bf16, bf16 or fp32 gradient, bf16 weight)");
    MOERL_CHECK(s.step >= 1, "adamw_master_step: step ", s.step, ", expected >= 1");
    const at::Tensor& scale = s.grad_scale_on_device;
    MOERL_CHECK(
        !scale.defined() || (scale.numel() == 1 && scale.is_cuda() && scale.device() == master.device() &&
                             scale.scalar_type() == at::kFloat),
        "adamw_master_step: the gradient scale on the device must be one fp32 on the master's device");
    c10::cuda::CUDAGuard guard(master.device());
    cuda::AdamwArgs a;
    a.lr = static_cast<float>(s.lr);
    a.beta1 = static_cast<float>(s.beta1);
    a.beta2 = static_cast<float>(s.beta2);
    a.weight_decay = static_cast<float>(s.weight_decay);
    a.eps = static_cast<float>(s.eps);
    a.step_size = static_cast<float>(s.lr / (1.0 - std::pow(s.beta1, static_cast<double>(s.step))));
    a.bias_correction2_sqrt =
        static_cast<float>(std::sqrt(1.0 - std::pow(s.beta2, static_cast<double>(s.step))));
    a.grad_scale = static_cast<float>(s.grad_scale);
    a.seed = s.rounding_seed;
    cuda::launch_adamw_master(master.data_ptr<float>(), dtype_code(grad), grad.data_ptr(), dtype_code(m),
                              m.data_ptr(), v.data_ptr(), weight.defined() ? weight.data_ptr() : nullptr,
                              master.numel(), a, scale.defined() ? scale.data_ptr<float>() : nullptr,
                              stream_of(master));
}

bool cuda_rows_serve(const at::Tensor& t) {
    return t.defined() && t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat);
}

at::Tensor cuda_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    MOERL_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: input ",
                x.sizes(), " and weight ", weight.sizes(), " do not match");
    MOERL_CHECK(weight.scalar_type() == x.scalar_type() && weight.device() == x.device(),
                "rms_norm: the weight's dtype and device differ from the input's");
    if (!cuda::rms_norm_fits(static_cast<int>(x.size(-1)))) return at::Tensor();
    return RmsNormRows::apply(x, weight, eps);
}

at::Tensor cuda_rms_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                              const at::Tensor& sin, double eps) {
    if (!cuda_rows_serve(x) || x.dim() < 2 || !cuda::norm_rope_fits(static_cast<int>(x.size(-1))) ||
        weight.scalar_type() != x.scalar_type() || cos.scalar_type() != x.scalar_type() ||
        sin.scalar_type() != x.scalar_type() || weight.dim() != 1 || weight.size(0) != x.size(-1))
        return at::Tensor();
    // cos and sin: one row per token (a size-1 head dimension), the token dimensions of x.
    std::vector<int64_t> table(x.sizes().begin(), x.sizes().end());
    table[table.size() - 2] = 1;
    if (cos.sizes() != at::IntArrayRef(table) || sin.sizes() != at::IntArrayRef(table)) return at::Tensor();
    return NormRopeRows::apply(x, weight, cos, sin, eps);
}

at::Tensor cuda_slot_sum(const at::Tensor& slot_rows, const at::Tensor& inverse, int64_t K,
                         const at::Tensor& also) {
    if (!cuda_rows_serve(slot_rows) || slot_rows.dim() != 2 || K < 1 || K > 32 ||
        !slot_rows.is_contiguous() || inverse.scalar_type() != at::kLong || !inverse.is_contiguous() ||
        inverse.numel() != slot_rows.size(0) || slot_rows.size(0) % K != 0 ||
        inverse.device() != slot_rows.device())
        return at::Tensor();
    if (also.defined() &&
        (also.sizes() != slot_rows.sizes() || also.scalar_type() != slot_rows.scalar_type() ||
         also.device() != slot_rows.device() || !also.is_contiguous()))
        return at::Tensor();
    c10::cuda::CUDAGuard guard(slot_rows.device());
    const int64_t tokens = slot_rows.size(0) / K;
    at::Tensor out = at::empty({tokens, slot_rows.size(1)}, slot_rows.options());
    cuda::launch_slot_sum(dtype_code(slot_rows), slot_rows.data_ptr(),
                          also.defined() ? also.data_ptr() : nullptr, inverse.data_ptr<int64_t>(), tokens,
                          static_cast<int>(K), static_cast<int>(slot_rows.size(1)), out.data_ptr(),
                          stream_of(slot_rows));
    return out;
}

void cuda_selected_logprob_rows(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& bias,
                                double temperature, bool write_softmax, const at::Tensor& lp) {
    MOERL_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && targets.scalar_type() == at::kLong &&
                    targets.is_contiguous() && lp.scalar_type() == at::kFloat && lp.is_contiguous() &&
                    lp.size(0) == logits.size(0) && targets.size(0) == logits.size(0),
                "selected_logprobs: logits ", logits.sizes(), ", targets ", targets.sizes(), " and lp ",
                lp.sizes(), " are not rows the kernel takes");
    MOERL_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.is_contiguous()),
                "selected_logprobs: the bias must be contiguous fp32");
    c10::cuda::CUDAGuard guard(logits.device());
    cuda::launch_selected_logprob_rows(
        dtype_code(logits), logits.data_ptr(), logits.stride(0), targets.data_ptr<int64_t>(),
        bias.defined() ? bias.data_ptr<float>() : nullptr, static_cast<float>(temperature), logits.size(0),
        static_cast<int>(logits.size(1)), write_softmax, lp.data_ptr<float>(), stream_of(logits));
}

}  // namespace moerl::model
