// The log-probability of chosen tokens under the output projection, without an fp32 [N, V] logit
// tensor: what the trainer needs per response token at a 151k vocabulary.
//
// Forward, per chunk of rows: logits = hidden . weight^T written into one [N, V] buffer of the
// compute dtype, log_softmax in fp32 (a chunk-sized temporary; on CUDA one row kernel instead), the
// chosen entry read, then the buffer overwritten with softmax - onehot (the target entry as expm1 of its
// log-probability, so it keeps its precision when near 0). Backward needs nothing else: with s = -grad /
// temperature per row, grad_hidden = s * (buffer . weight) and grad_weight = buffer^T . (s * hidden), two
// GEMMs over the whole batch.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "moerl/core/error.hpp"
#include "moerl/model/device_memory.hpp"
#include "moerl/model/layers.hpp"
#include "train_rows.hpp"

namespace moerl::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t rows_per_chunk(int64_t V, int64_t chunk_bytes) {
    return std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(1, V * 4));
}

// fp32 log_softmax of one chunk of logits (compute dtype) after temperature and bias.
at::Tensor chunk_log_softmax(const at::Tensor& logits, double temperature, const at::Tensor& bias) {
    if (temperature == 1.0 && !bias.defined()) return at::log_softmax(logits, 1, at::kFloat);
    at::Tensor z = logits.to(at::kFloat);
    if (temperature != 1.0) z.div_(temperature);
    if (bias.defined()) z.add_(bias);
    return at::log_softmax(z, 1);
}

// Fills lp [N] and, when `keep` is defined ([N, V]), leaves softmax - onehot in it.
void chunked_forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                     double temperature, const at::Tensor& bias, int64_t chunk_bytes, at::Tensor& lp,
                     const at::Tensor& keep) {
    const int64_t N = hidden.size(0), V = weight.size(0);
    const int64_t step = rows_per_chunk(V, chunk_bytes);
    at::Tensor wt = weight.t();
    at::Tensor scratch;
    for (int64_t r0 = 0; r0 < N; r0 += step) {
        const int64_t n = std::min(step, N - r0);
        at::Tensor logits;
        if (keep.defined()) {
            logits = keep.narrow(0, r0, n);
            at::mm_out(logits, hidden.narrow(0, r0, n), wt);
        } else {
            if (!scratch.defined()) scratch = at::empty({std::min(step, N), V}, hidden.options());
            logits = scratch.narrow(0, 0, n);
            at::mm_out(logits, hidden.narrow(0, r0, n), wt);
        }
        if (cuda_rows_serve(logits)) {  // one kernel: log-probabilities, then softmax - onehot in place
            cuda_selected_logprob_rows(logits, targets.narrow(0, r0, n), bias, temperature, keep.defined(),
                                       lp.narrow(0, r0, n));
            continue;
        }
        at::Tensor ls = chunk_log_softmax(logits, temperature, bias);
        at::Tensor tgt = targets.narrow(0, r0, n).unsqueeze(1);
        at::Tensor chosen = ls.gather(1, tgt).squeeze(1);
        lp.narrow(0, r0, n).copy_(chosen);
        if (!keep.defined()) continue;
        at::exp_out(logits, ls);  // softmax, rounded once into the compute dtype
        logits.scatter_(1, tgt, at::expm1(chosen).unsqueeze(1).to(logits.scalar_type()));
    }
}

struct SelectedLogprobs : torch::autograd::Function<SelectedLogprobs> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, double temperature, const at::Tensor* bias,
                              int64_t chunk_bytes) {
        at::Tensor lp = at::empty({hidden.size(0)}, hidden.options().dtype(at::kFloat));
        at::Tensor keep = at::empty({hidden.size(0), weight.size(0)}, hidden.options());
        chunked_forward(hidden, weight, targets, temperature, *bias, chunk_bytes, lp, keep);
        ctx->save_for_backward({keep, hidden, weight});
        ctx->saved_data["temperature"] = temperature;
        return lp;
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const at::Tensor &keep = saved[0], &hidden = saved[1], &weight = saved[2];
        const double temperature = ctx->saved_data["temperature"].toDouble();
        at::Tensor s = (grads[0].to(at::kFloat) * (-1.0 / temperature)).unsqueeze(1);  // [N, 1]
        at::Tensor grad_hidden, grad_weight;
        if (ctx->needs_input_grad(0))
            grad_hidden = (at::mm(keep, weight).to(at::kFloat) * s).to(hidden.scalar_type());
        if (ctx->needs_input_grad(1))
            grad_weight = at::mm(keep.t(), (hidden.to(at::kFloat) * s).to(hidden.scalar_type()));
        return {grad_hidden, grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

}  // namespace

at::Tensor selected_logprobs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                             double temperature, const at::Tensor& bias, int64_t chunk_bytes) {
    MOERL_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
                "selected_logprobs: hidden ", hidden.sizes(), " and weight ", weight.sizes(),
                " must be [N, H] and [V, H]");
    MOERL_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), "selected_logprobs: targets ",
                targets.sizes(), " must be [", hidden.size(0), "]");
    MOERL_CHECK(temperature > 0, "selected_logprobs: temperature ", temperature, " must be positive");
    const int64_t V = weight.size(0);
    MOERL_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == V), "selected_logprobs: bias ",
                bias.sizes(), " must be [", V, "]");
    at::Tensor h = hidden.contiguous();
    if (h.size(0) > 0) {
        // Checked where the targets are (a sync when that is a GPU); a wrong id would otherwise
        // index out of the logits.
        const bool bad = targets.lt(0).logical_or(targets.ge(V)).any().item<bool>();
        MOERL_CHECK(!bad, "selected_logprobs: target ids outside [0, ", V, ")");
    }
    at::Tensor tgt = to_device_async(targets, hidden.device(), at::kLong);  // no wait from the host
    at::Tensor b = bias.defined() ? bias.to(hidden.device(), at::kFloat).contiguous() : bias;
    const bool needs_grad = c10::GradMode::is_enabled() && (h.requires_grad() || weight.requires_grad());
    if (!needs_grad) {
        c10::NoGradGuard no_grad;
        at::Tensor lp = at::empty({h.size(0)}, h.options().dtype(at::kFloat));
        chunked_forward(h, weight, tgt, temperature, b, chunk_bytes, lp, at::Tensor());
        return lp;
    }
    // The bias goes by pointer: it is no input of the graph (and may be undefined).
    return SelectedLogprobs::apply(h, weight, tgt, temperature, &b, chunk_bytes);
}

}  // namespace moerl::model
