// MoeModel construction, the transformer trunk, training forward, prefill and decode.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>

#include "model_impl.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/model/device_memory.hpp"
#include "moerl/model/layers.hpp"

namespace moerl::model {
namespace {

// [B, S, L] bool: query column col0 + i may see key column j when j <= col0 + i and the key is a
// real token. A query always sees itself, so padded rows never divide by zero.
at::Tensor allowed_keys(const at::Tensor& key_valid, int64_t S, int64_t col0) {
    const int64_t L = key_valid.size(1);
    auto opts = key_valid.options().dtype(at::kLong);
    at::Tensor qcol = at::arange(col0, col0 + S, opts).unsqueeze(1);
    at::Tensor kcol = at::arange(0, L, opts).unsqueeze(0);
    at::Tensor causal = (kcol <= qcol).unsqueeze(0);
    at::Tensor self = (kcol == qcol).unsqueeze(0);
    return causal.logical_and(key_valid.unsqueeze(1).logical_or(self));
}

void check_token_ids(const at::Tensor& ids, int vocab_size, const char* what) {
    if (ids.numel() == 0) return;
    if (!ids.lt(0).logical_or(ids.ge(vocab_size)).any().item<bool>()) return;  // one sync when all is well
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    MOERL_CHECK(lo >= 0 && hi < vocab_size, what, " holds token ids in [", lo, ", ", hi,
                "], but vocab_size = ", vocab_size);
}

// valid [B, S] cut into sequences: every run of real tokens (with segment ids, every run of one
// id), and every padding position alone. A mask with a hole in a row starts a new sequence after
// it (forward's mask rows are left- or right-padded). Two small host syncs (starts, longest).
VarlenLayout varlen_layout(const at::Tensor& valid, const at::Tensor& segments) {
    const int64_t B = valid.size(0), S = valid.size(1);
    at::Tensor starts = valid.logical_not();
    starts.select(1, 0).fill_(true);
    if (S > 1) {
        at::Tensor rest = starts.narrow(1, 1, S - 1);
        rest.logical_or_(valid.narrow(1, 0, S - 1).logical_not());
        if (segments.defined())
            rest.logical_or_(segments.narrow(1, 1, S - 1) != segments.narrow(1, 0, S - 1));
    }
    at::Tensor first = starts.reshape({B * S}).nonzero().squeeze(1);
    at::Tensor cu = at::cat({first, at::full({1}, B * S, first.options())});
    VarlenLayout layout;
    layout.max_len =
        (cu.narrow(0, 1, cu.size(0) - 1) - cu.narrow(0, 0, cu.size(0) - 1)).max().item<int64_t>();
    layout.cu_seqlens = cu.to(at::kInt).contiguous();
    return layout;
}

at::Tensor make_param(at::IntArrayRef shape, const ModelOptions& o) {
    return at::zeros(shape, at::TensorOptions().device(o.device).dtype(o.dtype)).requires_grad_(true);
}

}  // namespace

at::Tensor token_logprobs(const at::Tensor& logits, const at::Tensor& input_ids, double temperature,
                          const at::Tensor& bias) {
    const int64_t B = logits.size(0), S = logits.size(1);
    at::Tensor zero = at::zeros({B, 1}, logits.options().dtype(at::kFloat));
    if (S <= 1) return zero.narrow(1, 0, S);
    at::Tensor z = logits.narrow(1, 0, S - 1).to(at::kFloat);
    if (temperature != 1.0) z = z / temperature;
    if (bias.defined()) z = z + bias.to(z.device(), at::kFloat);
    at::Tensor lp = at::log_softmax(z, -1);
    at::Tensor next = input_ids.narrow(1, 1, S - 1).to(logits.device(), at::kLong).unsqueeze(-1);
    return at::cat({zero, lp.gather(2, next).squeeze(-1)}, 1);
}

MoeModel::MoeModel(const ModelConfig& config, const ModelOptions& options) : impl_(std::make_unique<Impl>()) {
    config.validate();
    MOERL_CHECK(options.dtype == at::kFloat || options.dtype == at::kBFloat16 || options.dtype == at::kHalf,
                "model dtype ", options.dtype, " is not supported, expected Float, BFloat16 or Half");
    Impl& m = *impl_;
    m.config = config;
    m.options = options;
    m.num_local = config.num_experts;
    if (options.ep != nullptr) {
        const auto& ec = options.ep->config();
        MOERL_CHECK(ec.num_experts == config.num_experts, "EP buffer has num_experts = ", ec.num_experts,
                    ", but the model config has ", config.num_experts);
        m.first_expert = ec.rank * ec.num_local_experts();
        m.num_local = std::max(0, std::min(ec.num_local_experts(), config.num_experts - m.first_expert));
    }
    const ModelConfig& c = config;
    const int64_t H = c.hidden_size, D = c.head_dim;
    const int64_t q = int64_t{c.num_attention_heads} * D, kv = int64_t{c.num_key_value_heads} * D;
    auto add = [&](const std::string& name, at::Tensor& slot, at::IntArrayRef shape, bool expert = false) {
        slot = make_param(shape, options);
        m.params.push_back({name, slot, expert});
    };
    add("model.embed_tokens.weight", m.embed, {c.vocab_size, H});
    m.layers.resize(c.num_hidden_layers);
    for (int l = 0; l < c.num_hidden_layers; ++l) {
        LayerWeights& w = m.layers[l];
        const std::string p = layer_prefix(l);
        add(p + "input_layernorm.weight", w.input_norm, {H});
        add(p + "self_attn.q_proj.weight", w.q_proj, {q, H});
        add(p + "self_attn.k_proj.weight", w.k_proj, {kv, H});
        add(p + "self_attn.v_proj.weight", w.v_proj, {kv, H});
        add(p + "self_attn.o_proj.weight", w.o_proj, {H, q});
        add(p + "self_attn.q_norm.weight", w.q_norm, {D});
        add(p + "self_attn.k_norm.weight", w.k_norm, {D});
        add(p + "post_attention_layernorm.weight", w.post_norm, {H});
        w.moe_index = c.moe_layer_index(l);
        if (w.moe_index >= 0) {
            const int64_t I = c.moe_intermediate_size, L = m.num_local;
            add(p + "mlp.gate.weight", w.router, {c.num_experts, H});
            add(p + "mlp.experts.gate_proj", w.experts_gate, {L, I, H}, true);
            add(p + "mlp.experts.up_proj", w.experts_up, {L, I, H}, true);
            add(p + "mlp.experts.down_proj", w.experts_down, {L, H, I}, true);
        } else {
            const int64_t I = c.intermediate_size;
            add(p + "mlp.gate_proj.weight", w.gate_proj, {I, H});
            add(p + "mlp.up_proj.weight", w.up_proj, {I, H});
            add(p + "mlp.down_proj.weight", w.down_proj, {H, I});
        }
    }
    add("model.norm.weight", m.final_norm, {H});
    if (!c.tie_word_embeddings && options.lm_head) add("lm_head.weight", m.lm_head, {c.vocab_size, H});
}

MoeModel::MoeModel(MoeModel&&) noexcept = default;
MoeModel& MoeModel::operator=(MoeModel&&) noexcept = default;
MoeModel::~MoeModel() = default;

const ModelConfig& MoeModel::config() const { return impl_->config; }
const ModelOptions& MoeModel::options() const { return impl_->options; }
int MoeModel::first_local_expert() const { return impl_->first_expert; }
int MoeModel::num_local_experts() const { return impl_->num_local; }

std::vector<NamedParameter> MoeModel::named_parameters() const { return impl_->params; }

std::vector<at::Tensor> MoeModel::parameters() const {
    std::vector<at::Tensor> out;
    for (const auto& p : impl_->params) out.push_back(p.tensor);
    return out;
}

void MoeModel::set_requires_grad(bool requires_grad) {
    for (auto& p : impl_->params) p.tensor.requires_grad_(requires_grad);
}

void MoeModel::zero_grad() {
    for (auto& p : impl_->params) {
        if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
    }
}

int64_t MoeModel::weight_bytes() const {
    int64_t n = 0;
    for (const auto& p : impl_->params) n += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
    return n;
}

MoeModel::Impl::LayerOutput MoeModel::Impl::layer(size_t l, const at::Tensor& x_in, const LayerInputs& in,
                                                  const at::Tensor& replay, bool want_aux) const {
    const ModelConfig& c = config;
    const int64_t B = in.B, S = in.S, H = c.hidden_size, D = c.head_dim;
    const double eps = c.rms_norm_eps;
    const LayerWeights& w = layers[l];
    LayerOutput out;
    at::Tensor x = x_in;
    at::Tensor h = rms_norm(x, w.input_norm, eps);
    at::Tensor q = at::matmul(h, w.q_proj.t()).view({B, S, -1, D});
    at::Tensor k = at::matmul(h, w.k_proj.t()).view({B, S, -1, D});
    at::Tensor v = at::matmul(h, w.v_proj.t()).view({B, S, -1, D});
    if (in.varlen != nullptr) {
        q = rms_norm_rope(q, w.q_norm, in.cos_bshd, in.sin_bshd, eps);
        k = rms_norm_rope(k, w.k_norm, in.cos_bshd, in.sin_bshd, eps);
        x = x + at::matmul(varlen_attention(q, k, v, *in.varlen), w.o_proj.t());
    } else {
        q = rms_norm(q, w.q_norm, eps);
        k = rms_norm(k, w.k_norm, eps);
        q = apply_rope(q.transpose(1, 2), in.cos, in.sin);
        k = apply_rope(k.transpose(1, 2), in.cos, in.sin);
        v = v.transpose(1, 2);
        if (in.cache != nullptr) {
            in.cache->keys[l].narrow(2, in.col0, S).copy_(k);
            in.cache->values[l].narrow(2, in.col0, S).copy_(v);
            k = in.cache->keys[l].narrow(2, 0, in.col0 + S);
            v = in.cache->values[l].narrow(2, 0, in.col0 + S);
        }
        x = x + at::matmul(attention(q, k, v, in.allowed), w.o_proj.t());
    }
    h = rms_norm(x, w.post_norm, eps);
    if (w.moe_index >= 0) {
        at::Tensor flat = h.reshape({B * S, H});
        Routing r = route(flat, w.router, c.num_experts_per_tok, c.norm_topk_prob, in.valid_flat, replay);
        if (want_aux) out.balance = LoadBalanceLoss::layer_sums(r);
        out.topk_idx = r.topk_idx;
        at::Tensor y = moe_forward(flat, r, w.experts_gate, w.experts_up, w.experts_down, options.ep);
        x = x + y.view({B, S, H});
    } else {
        x = x + swiglu(h, w.gate_proj, w.up_proj, w.down_proj);
    }
    out.x = x;
    return out;
}

// Activation checkpointing of one decoder layer. The forward keeps only the layer's input and the
// experts it chose; the backward runs the layer again, with its graph, on those same experts and
// backpropagates through it. Parameter gradients accumulate into .grad there, as in a plain
// backward; with EP every rank recomputes the same layers in the same order, so the dispatches
// still pair up. Outputs: {x, prob_sum, counts, num_tokens, topk_idx} for an MoE layer, {x} for a
// dense one. The model must outlive the backward (the trainer's does).
struct MoeModel::Impl::CheckpointedLayer : torch::autograd::Function<CheckpointedLayer> {
    using AutogradContext = torch::autograd::AutogradContext;
    using variable_list = torch::autograd::variable_list;

    static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const Impl* model, int64_t l,
                                 const LayerInputs* in, const at::Tensor* replay, bool want_aux) {
        // `replay` by pointer: an undefined tensor cannot be an input of an autograd function.
        LayerOutput o = model->layer(static_cast<size_t>(l), x, *in, *replay, want_aux);
        ctx->save_for_backward({x});
        auto& d = ctx->saved_data;
        d["model"] = reinterpret_cast<int64_t>(model);
        d["layer"] = l;
        d["want_aux"] = want_aux;
        d["B"] = in->B;
        d["S"] = in->S;
        d["cos"] = in->cos;
        d["sin"] = in->sin;
        d["cos_bshd"] = in->cos_bshd;
        d["sin_bshd"] = in->sin_bshd;
        d["allowed"] = in->allowed;
        d["valid_flat"] = in->valid_flat;
        d["varlen"] = in->varlen != nullptr;
        if (in->varlen != nullptr) {
            d["cu_seqlens"] = in->varlen->cu_seqlens;
            d["max_len"] = in->varlen->max_len;
        }
        if (!o.topk_idx.defined()) return {o.x};
        d["topk_idx"] = o.topk_idx;
        // Without the loss three distinct placeholders: one tensor returned twice would share its
        // autograd edge.
        const auto f32 = o.x.options().dtype(at::kFloat);
        at::Tensor prob_sum = want_aux ? o.balance.prob_sum : at::zeros({0}, f32);
        at::Tensor counts = want_aux ? o.balance.counts : at::zeros({0}, f32);
        at::Tensor num_tokens = want_aux ? o.balance.num_tokens : at::zeros({}, f32);
        ctx->mark_non_differentiable({counts, num_tokens, o.topk_idx});
        return {o.x, prob_sum, counts, num_tokens, o.topk_idx};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const at::Tensor x = ctx->get_saved_variables()[0];
        auto& d = ctx->saved_data;
        const auto* model = reinterpret_cast<const Impl*>(d["model"].toInt());
        const bool want_aux = d["want_aux"].toBool();
        LayerInputs in;
        in.B = d["B"].toInt();
        in.S = d["S"].toInt();
        in.cos = d["cos"].toTensor();
        in.sin = d["sin"].toTensor();
        in.cos_bshd = d["cos_bshd"].toTensor();
        in.sin_bshd = d["sin_bshd"].toTensor();
        in.allowed = d["allowed"].toTensor();
        in.valid_flat = d["valid_flat"].toTensor();
        VarlenLayout varlen;
        if (d["varlen"].toBool()) {
            varlen.cu_seqlens = d["cu_seqlens"].toTensor();
            varlen.max_len = d["max_len"].toInt();
            in.varlen = &varlen;
        }
        const at::Tensor experts = d.count("topk_idx") ? d["topk_idx"].toTensor() : at::Tensor();

        at::Tensor x_again = x.detach().requires_grad_(x.requires_grad());
        at::AutoGradMode grad_on(true);
        Impl::LayerOutput o =
            model->layer(static_cast<size_t>(d["layer"].toInt()), x_again, in, experts, want_aux);
        std::vector<at::Tensor> outputs{o.x};
        std::vector<at::Tensor> output_grads{grads[0].defined() ? grads[0] : at::zeros_like(o.x)};
        if (want_aux && grads.size() > 1 && grads[1].defined() && o.balance.prob_sum.requires_grad()) {
            outputs.push_back(o.balance.prob_sum);
            output_grads.push_back(grads[1]);
        }
        torch::autograd::backward(outputs, output_grads);
        return {x_again.requires_grad() ? x_again.grad() : at::Tensor(),
                at::Tensor(),
                at::Tensor(),
                at::Tensor(),
                at::Tensor(),
                at::Tensor()};
    }
};

MoeModel::Impl::Trunk MoeModel::Impl::run(const at::Tensor& ids, const at::Tensor& positions,
                                          const at::Tensor& allowed, const at::Tensor& token_valid,
                                          KvCache* cache, int64_t col0, const at::Tensor& replay,
                                          bool record_routing, bool want_aux, const VarlenLayout* varlen,
                                          bool checkpoint_layers) const {
    const ModelConfig& c = config;
    const int64_t B = ids.size(0), S = ids.size(1), D = c.head_dim;
    const int64_t K = c.num_experts_per_tok, M = c.num_moe_layers();
    LayerInputs in;
    in.B = B;
    in.S = S;
    std::tie(in.cos, in.sin) = rope_tables(positions, D, c.rope_theta, options.dtype);
    // The varlen path keeps q/k/v as [B, S, heads, D]: the tables broadcast over heads there.
    if (varlen != nullptr) {
        in.cos_bshd = in.cos.transpose(1, 2);
        in.sin_bshd = in.sin.transpose(1, 2);
    }
    in.allowed = allowed;
    if (token_valid.defined()) in.valid_flat = token_valid.reshape({B * S});
    in.varlen = varlen;
    in.cache = cache;
    in.col0 = col0;
    // Checkpointing pays off only where a backward follows: never for prefill.
    const bool checkpoint = checkpoint_layers && cache == nullptr && at::GradMode::is_enabled();

    at::Tensor x = at::embedding(embed, ids);
    LoadBalanceLoss balance;
    std::vector<at::Tensor> records;
    for (size_t l = 0; l < layers.size(); ++l) {
        const LayerWeights& w = layers[l];
        at::Tensor rep;
        if (w.moe_index >= 0 && replay.defined()) rep = replay.select(2, w.moe_index).reshape({B * S, K});
        LayerOutput o;
        // The layer's input must carry the graph: the function's backward is what reaches the
        // layer's weights, and autograd calls it only for inputs that need a gradient.
        if (checkpoint && x.requires_grad()) {
            torch::autograd::variable_list outs =
                CheckpointedLayer::apply(x, this, static_cast<int64_t>(l), &in, &rep, want_aux);
            o.x = outs[0];
            if (outs.size() > 1) {
                o.balance = {outs[2], outs[1], outs[3]};
                o.topk_idx = outs[4];
            }
        } else {
            o = layer(l, x, in, rep, want_aux);
        }
        x = o.x;
        if (w.moe_index >= 0) {
            if (want_aux) balance.add(o.balance);
            if (record_routing) records.push_back(o.topk_idx.to(at::kShort));
        }
    }
    Trunk out;
    out.hidden = rms_norm(x, final_norm, c.rms_norm_eps);
    if (want_aux) out.aux_loss = balance.value().to(embed.device());
    if (record_routing) {
        out.routing = M == 0 ? at::empty({B, S, 0, K}, ids.options().dtype(at::kShort))
                             : at::stack(records, 1).view({B, S, M, K});
    }
    return out;
}

ForwardOutput MoeModel::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                const ForwardOptions& options) const {
    const Impl& m = *impl_;
    MOERL_CHECK(input_ids.dim() == 2, "input_ids must be [batch, seq], got shape ", input_ids.sizes());
    const int64_t B = input_ids.size(0), S = input_ids.size(1);
    // Inputs given on the host are checked and laid out there, then copied without waiting: a
    // training step then never stops the GPU to read its own inputs back. Inputs given on the
    // device are checked there (a synchronisation each).
    const at::Device device = m.options.device;
    auto to_device = [&](const at::Tensor& t, at::ScalarType type) {
        return to_device_async(t, device, type);
    };
    const at::Tensor ids_in = input_ids.to(at::kLong);
    check_token_ids(ids_in, m.config.vocab_size, "input_ids");
    const at::Tensor ids = to_device(ids_in, at::kLong);
    at::Tensor valid_in, segments_in;  // on the inputs' device
    if (options.segment_ids.defined()) {
        MOERL_CHECK(!attention_mask.defined(), "forward: give attention_mask or segment_ids, not both");
        MOERL_CHECK(options.segment_ids.sizes() == input_ids.sizes(), "segment_ids has shape ",
                    options.segment_ids.sizes(), ", expected the shape of input_ids ", input_ids.sizes());
        segments_in = options.segment_ids.to(at::kLong);
        valid_in = segments_in > 0;
    } else if (attention_mask.defined()) {
        MOERL_CHECK(attention_mask.sizes() == input_ids.sizes(), "attention_mask has shape ",
                    attention_mask.sizes(), ", expected the shape of input_ids ", input_ids.sizes());
        valid_in = attention_mask.to(at::kBool);
    }
    // Whether every token is real, where that is known without a device read.
    const bool every_token_valid =
        !valid_in.defined() || (!valid_in.is_cuda() && valid_in.all().item<bool>());
    const at::Tensor valid = valid_in.defined() ? to_device(valid_in, at::kBool)
                                                : at::ones({B, S}, ids.options().dtype(at::kBool));
    const at::Tensor segments = segments_in.defined() ? to_device(segments_in, at::kLong) : at::Tensor();
    at::Tensor replay;
    if (options.replay_routing.defined()) {
        const int64_t M = m.config.num_moe_layers(), K = m.config.num_experts_per_tok;
        MOERL_CHECK(options.replay_routing.dim() == 4 && options.replay_routing.size(0) == B &&
                        options.replay_routing.size(1) == S && options.replay_routing.size(2) == M &&
                        options.replay_routing.size(3) == K,
                    "replay_routing has shape ", options.replay_routing.sizes(), ", expected [", B, ", ", S,
                    ", ", M, ", ", K, "] (batch, seq, MoE layers, top-k)");
        check_replay_ids(options.replay_routing, m.config.num_experts);  // every layer's at once
        replay = to_device(options.replay_routing, at::kLong);
    }
    const ModelConfig& c = m.config;
    std::optional<VarlenLayout> varlen;
    if (B * S > 0 && varlen_attention_available(m.embed.options(), c.num_attention_heads,
                                                c.num_key_value_heads, c.head_dim)) {
        varlen = varlen_layout(valid_in.defined() ? valid_in : at::ones({B, S}, at::kBool), segments_in);
        varlen->cu_seqlens = to_device(varlen->cu_seqlens, at::kInt);
    }
    at::Tensor positions, allowed;
    if (segments.defined()) {
        // Each column's distance from the first column of its run.
        at::Tensor col = at::arange(S, segments.options()).unsqueeze(0).expand({B, S});
        at::Tensor starts = at::ones({B, S}, segments.options().dtype(at::kBool));
        if (S > 1)
            starts.narrow(1, 1, S - 1).copy_(segments.narrow(1, 1, S - 1) != segments.narrow(1, 0, S - 1));
        at::Tensor first = std::get<0>(at::where(starts, col, at::zeros_like(col)).cummax(1));
        positions = col - first;
        if (!varlen) {
            at::Tensor same = segments.unsqueeze(2) == segments.unsqueeze(1);
            allowed =
                allowed_keys(valid, S, 0).logical_and(same.logical_or(valid.logical_not().unsqueeze(2)));
        }
    } else {
        positions = (valid.to(at::kLong).cumsum(1) - 1).clamp_min(0);
        if (!varlen) allowed = allowed_keys(valid, S, 0);
    }
    Impl::Trunk t = m.run(ids, positions, allowed, every_token_valid ? at::Tensor() : valid, nullptr, 0,
                          replay, options.record_routing, /*want_aux=*/true, varlen ? &*varlen : nullptr,
                          options.activation_checkpointing);
    ForwardOutput out;
    const bool selected = options.compute_logprobs && options.logprob_mask.defined();
    if (options.return_logits || options.compute_logprobs) {
        MOERL_CHECK(m.output_weight().defined(),
                    "forward: this model was built without lm_head (ModelOptions::lm_head = false); "
                    "ask for return_hidden only");
    }
    if (selected) {
        MOERL_CHECK(options.logprob_mask.sizes() == input_ids.sizes(), "logprob_mask has shape ",
                    options.logprob_mask.sizes(), ", expected the shape of input_ids ", input_ids.sizes());
        // The chosen positions and their targets where the mask is (the host: no read back).
        at::Tensor mask = options.logprob_mask.to(at::kBool).clone();
        mask.select(1, 0).fill_(false);  // column 0 has no predecessor
        const at::Tensor where_in = mask.reshape({B * S}).nonzero().squeeze(1);
        const at::Tensor targets = ids_in.reshape({B * S}).index_select(0, where_in.to(ids_in.device()));
        const at::Tensor where = to_device(where_in, at::kLong);
        at::Tensor h = t.hidden.reshape({B * S, t.hidden.size(2)}).index_select(0, where - 1);
        at::Tensor lp = selected_logprobs(h, m.output_weight(), targets, options.logprob_temperature,
                                          options.logprob_bias);
        out.token_logprobs = at::zeros({B * S}, lp.options()).index_copy(0, where, lp).view({B, S});
    }
    if (options.return_logits || (options.compute_logprobs && !selected)) {
        at::Tensor logits = at::matmul(t.hidden, m.output_weight().t());
        if (options.compute_logprobs && !selected)
            out.token_logprobs =
                token_logprobs(logits, ids, options.logprob_temperature, options.logprob_bias);
        if (options.return_logits) out.logits = logits;
    }
    if (options.return_hidden) out.hidden = t.hidden;
    out.aux_loss = t.aux_loss;
    out.routing = t.routing;
    return out;
}

KvCache MoeModel::new_cache(int64_t batch, int64_t capacity) const {
    const Impl& m = *impl_;
    MOERL_CHECK(batch >= 0 && capacity > 0, "KV cache needs batch >= 0 and capacity > 0, got ", batch,
                " and ", capacity);
    KvCache cache;
    auto opts = at::TensorOptions().device(m.options.device).dtype(m.options.dtype);
    for (int l = 0; l < m.config.num_hidden_layers; ++l) {
        cache.keys.push_back(
            at::zeros({batch, m.config.num_key_value_heads, capacity, m.config.head_dim}, opts));
        cache.values.push_back(at::zeros_like(cache.keys.back()));
    }
    cache.key_valid = at::zeros({batch, capacity}, opts.dtype(at::kBool));
    cache.next_position = at::zeros({batch}, opts.dtype(at::kLong));
    cache.capacity = capacity;
    return cache;
}

void KvCache::select(const at::Tensor& batch_idx) {
    at::Tensor idx = batch_idx.to(key_valid.device(), at::kLong);
    for (auto& k : keys) k = k.index_select(0, idx);
    for (auto& v : values) v = v.index_select(0, idx);
    key_valid = key_valid.index_select(0, idx);
    next_position = next_position.index_select(0, idx);
}

StepOutput MoeModel::prefill(KvCache& cache, const at::Tensor& input_ids, const at::Tensor& attention_mask,
                             bool record_routing) const {
    const Impl& m = *impl_;
    c10::NoGradGuard no_grad;
    MOERL_CHECK(input_ids.dim() == 2, "input_ids must be [batch, seq], got shape ", input_ids.sizes());
    const int64_t B = input_ids.size(0), S = input_ids.size(1), col0 = cache.length;
    MOERL_CHECK(B == cache.batch_size(), "input_ids has batch ", B, ", but the KV cache holds ",
                cache.batch_size(), " sequences");
    MOERL_CHECK(S >= 1, "prefill needs at least one column");
    MOERL_CHECK(m.output_weight().defined(), "prefill: a model without lm_head cannot generate");
    MOERL_CHECK(col0 + S <= cache.capacity, "KV cache capacity ", cache.capacity, " exceeded: ", col0,
                " columns used + ", S, " new");
    at::Tensor ids = input_ids.to(m.options.device, at::kLong);
    check_token_ids(ids, m.config.vocab_size, "input_ids");
    at::Tensor valid = attention_mask.defined() ? attention_mask.to(m.options.device).to(at::kBool)
                                                : at::ones({B, S}, ids.options().dtype(at::kBool));
    MOERL_CHECK(valid.sizes() == ids.sizes(), "attention_mask has shape ", valid.sizes(), ", expected ",
                ids.sizes());
    cache.key_valid.narrow(1, col0, S).copy_(valid);
    at::Tensor positions =
        cache.next_position.unsqueeze(1) + (valid.to(at::kLong).cumsum(1) - 1).clamp_min(0);
    at::Tensor allowed = allowed_keys(cache.key_valid.narrow(1, 0, col0 + S), S, col0);
    Impl::Trunk t = m.run(ids, positions, allowed, valid, &cache, col0, at::Tensor(), record_routing, false);
    cache.next_position.add_(valid.to(at::kLong).sum(1));
    cache.length += S;
    StepOutput out;
    out.logits = at::matmul(t.hidden.select(1, S - 1), m.output_weight().t()).to(at::kFloat);
    out.routing = t.routing;
    return out;
}

StepOutput MoeModel::decode(KvCache& cache, const at::Tensor& tokens, bool record_routing) const {
    MOERL_CHECK(tokens.dim() == 1, "decode takes one token per sequence [batch], got shape ", tokens.sizes());
    return prefill(cache, tokens.reshape({tokens.size(0), 1}), at::Tensor(), record_routing);
}

void MoeModel::idle_pass() const {
    const Impl& m = *impl_;
    if (m.options.ep == nullptr) return;
    c10::NoGradGuard no_grad;
    const at::Tensor none = at::empty({0, m.config.hidden_size}, m.embed.options());
    for (const LayerWeights& w : m.layers) {
        if (w.moe_index < 0) continue;
        const Routing r = route(none, w.router, m.config.num_experts_per_tok, m.config.norm_topk_prob);
        moe_forward(none, r, w.experts_gate, w.experts_up, w.experts_down, m.options.ep);
    }
}

}  // namespace moerl::model
