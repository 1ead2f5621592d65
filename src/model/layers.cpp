// Dense building blocks, the router and the local expert computation.
#include "moerl/model/layers.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include <atomic>
#include <cmath>

#include "moerl/core/error.hpp"
#include "moerl/core/log.hpp"
#include "train_rows.hpp"

// Grouped GEMM (one kernel per projection for all experts, no host sync) from LibTorch 2.8 on.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define MOERL_HAVE_GROUPED_MM 1
#endif

namespace moerl::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The (token, slot) pairs of a routing, T tokens x K slots, in expert order: position j holds slot
// order[j], whose token is rows[j] = order[j] / K; inverse[s] is the position of slot s. The two
// moves between token rows and expert-ordered slot rows are each other's backward, and both are
// gathers: no atomic scatter-add (index_add) in either direction.
// keys[j] is slot order[j]'s sort key: its expert id, L for a slot without one (-1), L + 1 for an
// id out of range (the callers check for it).
struct SlotOrder {
    at::Tensor keys, order, rows, inverse;
    int64_t K = 1;
};

// The slots of idx [T, K] (ids of L local experts or -1) sorted by expert, stable.
SlotOrder sort_slots(const at::Tensor& idx, int64_t L) {
    at::Tensor flat = idx.reshape({-1});
    at::Tensor key = at::where(flat >= L, at::full({}, L + 1, flat.options()), flat);
    key = at::where(flat < 0, at::full({}, L, flat.options()), key);
    auto sorted = at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    SlotOrder o;
    o.keys = std::get<0>(sorted);
    o.order = std::get<1>(sorted);
    o.rows = at::div(o.order, idx.size(1), "floor");
    o.inverse = at::empty_like(o.order).scatter_(0, o.order, at::arange(o.order.numel(), o.order.options()));
    o.K = idx.size(1);
    return o;
}

// Each token's K rows of slot_rows [T*K, H] (in expert order) summed, and those of `also` (the
// same shape, optional) with them.
at::Tensor sum_over_slots(const at::Tensor& slot_rows, const SlotOrder& o, const at::Tensor& also = {}) {
    // On CUDA one kernel gathers and sums each token's K rows; elsewhere (or for shapes it does
    // not take) the gather and the sum run as two operators.
    at::Tensor fused = cuda_slot_sum(slot_rows, o.inverse, o.K, also);
    if (fused.defined()) return fused;
    const int64_t H = slot_rows.size(1);
    const at::Tensor rows = also.defined() ? slot_rows + also : slot_rows;
    return rows.index_select(0, o.inverse).view({-1, o.K, H}).sum(1);
}

void save(AutogradContext* ctx, const SlotOrder& o) {
    ctx->saved_data["rows"] = o.rows;
    ctx->saved_data["inverse"] = o.inverse;
    ctx->saved_data["K"] = o.K;
}

SlotOrder saved_order(AutogradContext* ctx) {
    SlotOrder o;
    o.rows = ctx->saved_data["rows"].toTensor();
    o.inverse = ctx->saved_data["inverse"].toTensor();
    o.K = ctx->saved_data["K"].toInt();
    return o;
}

// x [T, H] -> [T*K, H]: each slot's token row, in expert order.
struct ToSlots : torch::autograd::Function<ToSlots> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const SlotOrder& o) {
        save(ctx, o);
        return x.index_select(0, o.rows);
    }
    static variable_list backward(AutogradContext* ctx, variable_list grad) {
        return {sum_over_slots(grad[0], saved_order(ctx)), at::Tensor()};
    }
};

// [T*K, H] in expert order -> [T, H]: each token's K slot rows summed.
struct FromSlots : torch::autograd::Function<FromSlots> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& slot_rows, const SlotOrder& o) {
        save(ctx, o);
        return sum_over_slots(slot_rows, o);
    }
    static variable_list backward(AutogradContext* ctx, variable_list grad) {
        return {grad[0].index_select(0, saved_order(ctx).rows), at::Tensor()};
    }
};

// y[t] = sum over t's slots s of w[s] * out[s], for the expert outputs `out` [T*K, H] in expert
// order and the routing weights w [T, K] fp32.
at::Tensor combine_slots(const at::Tensor& out, const at::Tensor& w, const SlotOrder& o) {
    at::Tensor weights = w.reshape({-1}).index_select(0, o.order).to(out.scalar_type()).unsqueeze(1);
    return FromSlots::apply(out * weights, o);
}

#ifdef MOERL_HAVE_GROUPED_MM
// y = x W_e^T for the rows of each expert e (rows [offsets[e-1], offsets[e]) of x, weights [L, out,
// in]). The backward gives W's gradient in W's own layout: differentiating the grouped GEMM of a
// transposed view gave it transposed, and every micro-batch then copied it into place.
struct GroupedLinear : torch::autograd::Function<GroupedLinear> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& offsets) {
        ctx->save_for_backward({x, weight, offsets});
        return at::_grouped_mm(x, weight.transpose(-2, -1), offsets);
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &weight = saved[1], &offsets = saved[2];
        at::Tensor dy = grads[0].contiguous();
        at::Tensor dx, dw;
        if (ctx->needs_input_grad(0)) dx = at::_grouped_mm(dy, weight, offsets);
        // [out, rows] x [rows, in] with the rows split by expert: one [out, in] block per expert.
        if (ctx->needs_input_grad(1)) dw = at::_grouped_mm(dy.t(), x, offsets);
        return {dx, dw, at::Tensor()};
    }
};

std::atomic<bool> grouped_mm_failed{false};

// Whether this LibTorch differentiates the grouped GEMM (asked once, on a tiny problem).
bool grouped_mm_has_backward(const at::Device& device) {
    static const bool ok = [&] {
        try {
            c10::AutoGradMode grad(true);
            auto opts = at::TensorOptions().device(device).dtype(at::kBFloat16);
            // The real call's layout: weights stored [groups, out, in]; the middle group gets no
            // rows, and its weight gradient must come out zero.
            at::Tensor a = at::ones({32, 16}, opts).requires_grad_(true);
            at::Tensor b = at::ones({3, 16, 16}, opts).requires_grad_(true);
            at::Tensor offsets = at::tensor({16, 16, 32}, at::TensorOptions().device(device).dtype(at::kInt));
            // A dense output gradient, as the real backward gets (sum()'s is a zero-stride view
            // the grouped kernel rejects).
            at::Tensor out = GroupedLinear::apply(a, b, offsets);
            (out * at::ones_like(out)).sum().backward();
            if (!a.grad().defined() || !b.grad().defined()) return false;
            const bool empty_is_zero = b.grad()[1].abs().max().item<float>() == 0.0f;
            const bool full_is_right = b.grad()[0].sub(16.0f).abs().max().item<float>() == 0.0f;
            if (!empty_is_zero || !full_is_right)
                log_line(
                    "the grouped GEMM's weight gradient is wrong here, training uses the per-expert loop");
            return empty_is_zero && full_is_right;
        } catch (const c10::Error& e) {
            log_line(
                std::string("the grouped GEMM has no backward here, training uses the per-expert loop: ") +
                e.what_without_backtrace());
            return false;
        }
    }();
    return ok;
}

// CUDA in bf16 with 16-byte aligned rows; under autograd where the grouped GEMM has a backward.
bool use_grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& gate) {
    if (grouped_mm_failed.load() || !x.is_cuda() || x.scalar_type() != at::kBFloat16 || x.size(1) % 8 != 0 ||
        gate.size(1) % 8 != 0)
        return false;
    const bool needs_grad =
        c10::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() || gate.requires_grad());
    return !needs_grad || grouped_mm_has_backward(x.device());
}

// (g, u) = (xs gate_e^T, xs up_e^T) for xs = each slot's token row of x in expert order (rows
// without an expert zeroed where `with_expert` is given): the experts' two input projections in one
// autograd node. Its backward sums both projections' input gradients into x's gradient in one
// gather-and-sum pass over the slots; as separate nodes they were first added as [T K, H] tensors
// (4.2 of 255 ms in a traced 32k-token update).
struct SlotGateUp : torch::autograd::Function<SlotGateUp> {
    static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gate,
                                 const at::Tensor& up, const at::Tensor& offsets, const SlotOrder& o,
                                 const at::Tensor* with_expert) {
        at::Tensor xs = x.index_select(0, o.rows);
        const bool masked = with_expert != nullptr && with_expert->defined();
        if (masked) xs = at::where(*with_expert, xs, at::zeros({}, xs.options()));
        ctx->save_for_backward({xs, gate, up, offsets, masked ? *with_expert : at::Tensor()});
        save(ctx, o);
        return {at::_grouped_mm(xs, gate.transpose(-2, -1), offsets),
                at::_grouped_mm(xs, up.transpose(-2, -1), offsets)};
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto saved = ctx->get_saved_variables();
        const at::Tensor &xs = saved[0], &gate = saved[1], &up = saved[2], &offsets = saved[3],
                         &with_expert = saved[4];
        auto or_zero = [&](const at::Tensor& d, const at::Tensor& w) {
            return d.defined() ? d.contiguous() : at::zeros({xs.size(0), w.size(1)}, xs.options());
        };
        const at::Tensor dg = or_zero(grads[0], gate), du = or_zero(grads[1], up);
        at::Tensor dx, dgate, dup;
        if (ctx->needs_input_grad(0)) {
            at::Tensor a = at::_grouped_mm(dg, gate, offsets), b = at::_grouped_mm(du, up, offsets);
            if (with_expert.defined()) {  // rows past the last offset are left unwritten
                const at::Tensor zero = at::zeros({}, a.options());
                a = at::where(with_expert, a, zero);
                b = at::where(with_expert, b, zero);
            }
            dx = sum_over_slots(a, saved_order(ctx), b);
        }
        // [out, rows] x [rows, in] with the rows split by expert: one [out, in] block per expert.
        if (ctx->needs_input_grad(1)) dgate = at::_grouped_mm(dg.t(), xs, offsets);
        if (ctx->needs_input_grad(2)) dup = at::_grouped_mm(du.t(), xs, offsets);
        return {dx, dgate, dup, at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

// Slots sorted by expert (slots without one last, past the final offset); all experts in one
// grouped GEMM per projection. The routing weights scale the rows of silu(g) * u, which the down
// projection maps linearly: a third of the bytes of scaling its output.
at::Tensor experts_grouped(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                           const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                           bool every_slot_routed) {
    const int64_t L = gate.size(0);
    const SlotOrder slots = sort_slots(idx, L);
    const at::Tensor& keys = slots.keys;
    // Expert e's rows end where the sorted keys pass e (CUDA's bincount reads the keys' range back).
    at::Tensor offsets =
        at::searchsorted(keys, at::arange(L, keys.options()), /*out_int32=*/true, /*right=*/true);
    // Whether every slot has an expert here (sorted: the last key is the largest). Otherwise the
    // grouped GEMM leaves the rows past the last offset unwritten, in its output and in its
    // backward's input gradient, and where()s keep them out of y and of x's gradient.
    const int64_t last_key =
        keys.numel() == 0 || every_slot_routed ? 0 : keys[keys.numel() - 1].item<int64_t>();
    MOERL_CHECK(last_key <= L, "experts_forward: an expert id is >= the ", L, " local experts");
    const bool all_routed = last_key < L;
    at::Tensor with_expert, zero;
    if (!all_routed) with_expert = (keys < L).unsqueeze(1), zero = at::zeros({}, x.options());
    const variable_list gu = SlotGateUp::apply(x, gate, up, offsets, slots, &with_expert);
    const at::Tensor &g = gu[0], &u = gu[1];
    at::Tensor weights = w.reshape({-1}).index_select(0, slots.order);
    at::Tensor h = cuda_rows_serve(g) && weights.scalar_type() == at::kFloat
                       ? cuda_weighted_swiglu(g, u, weights)
                       : at::silu(g) * u * weights.to(x.scalar_type()).unsqueeze(1);
    at::Tensor o = GroupedLinear::apply(h, down, offsets);
    if (!all_routed) o = at::where(with_expert, o, zero);
    return FromSlots::apply(o, slots);
}
#endif

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    if (cuda_rows_serve(x) && x.size(-1) > 0)
        if (at::Tensor y = cuda_rms_norm(x, weight, eps); y.defined()) return y;
    at::Tensor x32 = x.to(at::kFloat);
    at::Tensor inv = at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return weight * (x32 * inv).to(x.scalar_type());
}

std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, int64_t head_dim, double theta,
                                              at::ScalarType dtype) {
    auto f32 = positions.options().dtype(at::kFloat);
    // inv_freq[i] = theta^(-2i/D), computed in fp32 as HF does.
    at::Tensor exponent = at::arange(0, head_dim, 2, f32) / static_cast<double>(head_dim);
    at::Tensor inv_freq = at::pow(at::scalar_tensor(theta, f32), exponent).reciprocal();
    at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [B, S, D/2]
    at::Tensor emb = at::cat({freqs, freqs}, -1);
    return {emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)};
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t half = x.size(-1) / 2;
    at::Tensor rotated = at::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
    return x * cos + rotated * sin;
}

at::Tensor rms_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                         const at::Tensor& sin, double eps) {
    at::Tensor fused = cuda_rms_norm_rope(x, weight, cos, sin, eps);
    if (fused.defined()) return fused;
    return apply_rope(rms_norm(x, weight, eps), cos, sin);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& allowed) {
    const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3);
    const int64_t Hkv = k.size(1), L = k.size(2);
    MOERL_CHECK(Hq % Hkv == 0, "attention: ", Hq, " query heads are not a multiple of ", Hkv,
                " key/value heads");
    const int64_t group = Hq / Hkv;
#if TORCH_VERSION_MAJOR >= 2
    if (q.is_cuda()) {
        // Fused kernels on the GPU; key/value heads repeated for the query groups.
        at::Tensor kr = k.unsqueeze(2).expand({B, Hkv, group, L, D}).reshape({B, Hq, L, D});
        at::Tensor vr = v.unsqueeze(2).expand({B, Hkv, group, L, D}).reshape({B, Hq, L, D});
        at::Tensor out = at::scaled_dot_product_attention(q, kr, vr, allowed.unsqueeze(1), 0.0, false);
        return out.transpose(1, 2).reshape({B, S, Hq * D});
    }
#endif
    // Query heads grouped per key/value head: [B, Hkv, group, S, D] against [B, Hkv, 1, L, D].
    at::Tensor qg = q.reshape({B, Hkv, group, S, D});
    at::Tensor scores = at::matmul(qg, k.unsqueeze(2).transpose(-1, -2)).to(at::kFloat);
    scores = scores * (1.0 / std::sqrt(static_cast<double>(D)));
    scores = scores.masked_fill(allowed.logical_not().view({B, 1, 1, S, L}), -INFINITY);
    at::Tensor probs = at::softmax(scores, -1).to(q.scalar_type());
    at::Tensor out = at::matmul(probs, v.unsqueeze(2));  // [B, Hkv, group, S, D]
    return out.reshape({B, Hq, S, D}).transpose(1, 2).reshape({B, S, Hq * D});
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
    at::Tensor h = at::silu(at::matmul(x, gate.t())) * at::matmul(x, up.t());
    return at::matmul(h, down.t());
}

void check_replay_ids(const at::Tensor& replay, int64_t num_experts) {
    if (replay.numel() == 0) return;
    const at::Tensor range = at::stack({replay.min(), replay.max()}).to(at::kCPU, at::kLong);
    const int64_t lo = range[0].item<int64_t>(), hi = range[1].item<int64_t>();
    MOERL_CHECK(hi < num_experts, "routing replay names expert ", hi, ", but num_experts = ", num_experts);
    MOERL_CHECK(lo >= -1, "routing replay holds expert id ", lo, ", expected -1 or an id in [0, ",
                num_experts, ")");
}

Routing route(const at::Tensor& x, const at::Tensor& router_weight, int64_t top_k, bool norm_topk_prob,
              const at::Tensor& token_valid, const at::Tensor& replay) {
    const int64_t T = x.size(0), E = router_weight.size(0);
    MOERL_CHECK(top_k >= 1 && top_k <= E, "route: top_k = ", top_k, ", but there are ", E, " experts");
    Routing r;
    r.probs = at::softmax(at::matmul(x, router_weight.t()), -1, at::kFloat);
    auto top = r.probs.topk(top_k, -1);
    at::Tensor idx = std::get<1>(top);
    if (replay.defined()) {
        MOERL_CHECK(replay.dim() == 2 && replay.size(0) == T && replay.size(1) == top_k,
                    "routing replay has shape ", replay.sizes(), ", expected [", T, ", ", top_k, "]");
        // Checked here when on the host; a device replay was checked by its caller (forward checks
        // all layers' at once), so the layers cost no synchronisation each.
        if (!replay.is_cuda()) check_replay_ids(replay, E);
        at::Tensor rep = replay.to(idx.device(), at::kLong);
        at::Tensor complete = (rep >= 0).all(1, /*keepdim=*/true);
        idx = at::where(complete, rep, idx);
    }
    at::Tensor w = r.probs.gather(1, idx);
    if (norm_topk_prob) w = w / w.sum(-1, /*keepdim=*/true);
    if (token_valid.defined()) {
        at::Tensor invalid = token_valid.to(idx.device(), at::kBool).logical_not().unsqueeze(1);
        idx = idx.masked_fill(invalid, -1);
        w = w.masked_fill(invalid, 0.0);
    }
    r.topk_idx = idx;
    r.topk_weights = w;
    // top-k over all E, and a replay's ids checked to lie in [-1, E) with -1 rows left to the router.
    r.every_slot_routed = !token_valid.defined();
    return r;
}

at::Tensor experts_forward(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                           const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                           bool every_slot_routed) {
    const int64_t N = x.size(0), K = idx.size(1), L = gate.size(0);
    if (N == 0 || L == 0) return at::zeros_like(x);
#ifdef MOERL_HAVE_GROUPED_MM
    if (use_grouped_mm(x, w, gate)) {
        try {
            return experts_grouped(x, idx, w, gate, up, down, every_slot_routed);
        } catch (const c10::Error& e) {
            grouped_mm_failed = true;  // e.g. an architecture the kernel does not support
            log_line(std::string("grouped GEMM unavailable, using the per-expert loop: ") +
                     e.what_without_backtrace());
        }
    }
#endif
    // Every (token, slot) grouped by expert, slots without one last; counts go to the host.
    const SlotOrder slots = sort_slots(idx, L);
    at::Tensor counts = at::bincount(slots.keys, {}, L + 2).cpu();
    std::vector<int64_t> sizes(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + L + 2);
    MOERL_CHECK(sizes[L + 1] == 0, "experts_forward: an expert id is >= the ", L, " local experts");
    sizes.pop_back();
    if (sizes[L] == N * K) return at::zeros_like(x);
    // One split (its backward is one cat): a narrow per expert would give each a backward that
    // writes a zero gradient the size of all slots, L times over.
    std::vector<at::Tensor> parts = at::split_with_sizes(ToSlots::apply(x, slots), sizes, 0);
    std::vector<at::Tensor> gates = gate.unbind(0), ups = up.unbind(0), downs = down.unbind(0);
    std::vector<at::Tensor> outs;
    for (int64_t e = 0; e < L; ++e)
        if (sizes[e] > 0) outs.push_back(swiglu(parts[e], gates[e], ups[e], downs[e]));
    if (sizes[L] > 0) outs.push_back(at::zeros({sizes[L], x.size(1)}, x.options()));  // no expert
    return combine_slots(at::cat(outs, 0), w, slots);
}

LoadBalanceLoss::LayerSums LoadBalanceLoss::layer_sums(const Routing& routing) {
    const int64_t E = routing.probs.size(1);
    at::Tensor valid = (routing.topk_idx.select(1, 0) >= 0).to(at::kFloat);  // masked tokens have all -1
    at::Tensor flat = routing.topk_idx.reshape({-1});
    LayerSums s;
    s.counts = at::zeros({E}, routing.probs.options().requires_grad(false));
    // Slots without an expert add 0 (to expert 0): no masked_select, whose size the host would wait for.
    s.counts.index_add_(0, flat.clamp_min(0), (flat >= 0).to(s.counts.scalar_type()));
    s.prob_sum = (routing.probs * valid.unsqueeze(1)).sum(0);
    s.num_tokens = valid.sum();
    return s;
}

void LoadBalanceLoss::add(const LayerSums& s) {
    if (!counts_.defined()) {
        counts_ = s.counts;
        prob_sum_ = s.prob_sum;
        num_tokens_ = s.num_tokens;
    } else {
        counts_ = counts_ + s.counts;
        prob_sum_ = prob_sum_ + s.prob_sum;
        num_tokens_ = num_tokens_ + s.num_tokens;
    }
}

at::Tensor LoadBalanceLoss::value() const {
    if (!counts_.defined()) return at::zeros({}, at::kFloat);
    const double E = static_cast<double>(counts_.size(0));
    at::Tensor n = num_tokens_.clamp_min(1.0);
    return (counts_ * prob_sum_).sum() / (n * n) * E;
}

}  // namespace moerl::model
