// The MoE layer over expert parallelism: dispatch and combine of moerl::ep::Buffer as autograd
// functions around the local expert computation.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/model/layers.hpp"
#include "moerl/model/model.hpp"

namespace moerl::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Shared by the dispatch and combine of one MoE layer call: the routing and the handle that
// records where each received row came from.
struct EpCall : torch::CustomClassHolder {
    ep::Buffer* buffer = nullptr;
    at::Device device = at::kCPU;  // where the model's tensors live
    at::Tensor topk_idx;           // [T, K] int64 on the buffer's side
    at::Tensor recv_topk_idx;      // [R, K] local expert ids or -1, on `device`
    ep::Handle handle;
    bool weights_need_grad = false;

    // The buffer reads host memory unless it runs on the device.
    at::Tensor to_buffer_side(const at::Tensor& t) const {
        if (buffer->on_device()) {
            MOERL_CHECK(t.is_cuda(), "the ", buffer->transport_name(),
                        " EP transport needs CUDA tensors, got a tensor on ", t.device());
            return t.contiguous();
        }
        return t.to(at::kCPU).contiguous();
    }
    at::Device buffer_device() const { return buffer->on_device() ? device : at::Device(at::kCPU); }

    // Dispatches x [T, H] (and weights when given); fills recv_x [R, H] and, when asked, ids/weights.
    void dispatch(const at::Tensor& x, const at::Tensor& weights, at::Tensor& recv_x, at::Tensor* recv_idx,
                  at::Tensor* recv_w, bool reuse) {
        const auto& cfg = buffer->config();
        const int64_t T = x.size(0), H = x.size(1), K = topk_idx.size(1);
        const int64_t max_recv = cfg.max_recv_tokens();
        auto opts = x.options().device(buffer_device());
        recv_x = at::empty({max_recv, H}, opts);
        ep::DispatchOutput out;
        out.recv_x = {recv_x.data_ptr(), max_recv, H};
        if (recv_idx) {
            *recv_idx = at::empty({max_recv, K}, opts.dtype(at::kLong));
            out.recv_topk_idx = {recv_idx->data_ptr<int64_t>(), max_recv, K};
        }
        if (recv_w) {
            *recv_w = at::empty({max_recv, K}, opts.dtype(at::kFloat));
            out.recv_topk_weights = {recv_w->data_ptr<float>(), max_recv, K};
        }
        ep::View<const float> w_view;
        if (weights.defined()) w_view = {weights.data_ptr<float>(), T, K};
        ep::Handle h = buffer->dispatch({x.data_ptr(), T, H}, {topk_idx.data_ptr<int64_t>(), T, K}, w_view,
                                        out, reuse ? &handle : nullptr);
        if (!reuse) handle = std::move(h);
        const int64_t R = handle.num_recv_tokens();
        // Shrinking keeps the storage and yields plain (non-view) tensors of R rows.
        recv_x.resize_({R, H});
        if (recv_idx) recv_idx->resize_({R, K});
        if (recv_w) recv_w->resize_({R, K});
    }

    // Combines y [R, H] back to the source tokens: [T, H].
    at::Tensor combine(const at::Tensor& y) {
        const int64_t R = y.size(0), H = y.size(1), T = handle.num_tokens;
        at::Tensor out = at::empty({T, H}, y.options());
        buffer->combine({y.data_ptr(), R, H}, handle, {out.data_ptr(), T, H});
        return out;
    }
};

class DispatchFn : public torch::autograd::Function<DispatchFn> {
  public:
    // Returns {recv_x [R, H], recv_topk_weights [R, K]}; recv ids are left in call->recv_topk_idx.
    static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& topk_weights,
                                 c10::intrusive_ptr<EpCall> call) {
        at::Tensor recv_x, recv_idx, recv_w;
        call->dispatch(call->to_buffer_side(x), call->to_buffer_side(topk_weights.to(at::kFloat)), recv_x,
                       &recv_idx, &recv_w, /*reuse=*/false);
        call->recv_topk_idx = recv_idx.to(call->device);
        ctx->saved_data["call"] = at::IValue::make_capsule(call);
        return {recv_x.to(call->device), recv_w.to(call->device)};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto call = c10::static_intrusive_pointer_cast<EpCall>(ctx->saved_data["call"].toCapsule());
        const int64_t K = call->topk_idx.size(1);
        at::Tensor grad_recv_x = call->to_buffer_side(grads[0]);
        at::Tensor grad_x = call->combine(grad_recv_x).to(call->device);
        at::Tensor grad_w;
        if (call->weights_need_grad) {
            // Buffer::combine moves rows of H columns only: the weight gradients of the local
            // slots (zero elsewhere) travel in the first K columns and sum over ranks at the source.
            MOERL_CHECK(grad_recv_x.size(1) >= K, "EP weight gradient needs hidden >= top_k");
            at::Tensor g = grads[1].masked_fill(call->recv_topk_idx < 0, 0.0);
            at::Tensor packed = at::zeros_like(grad_recv_x);
            packed.narrow(1, 0, K).copy_(g);
            grad_w = call->combine(packed).narrow(1, 0, K).to(at::kFloat).to(call->device);
        }
        return {grad_x, grad_w, at::Tensor()};
    }
};

class CombineFn : public torch::autograd::Function<CombineFn> {
  public:
    // `anchor` (the dispatched rows) ties the combine into the graph even when no local expert got
    // a row, so every rank runs the backward collectives.
    static variable_list forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& anchor,
                                 c10::intrusive_ptr<EpCall> call) {
        (void)anchor;
        ctx->saved_data["call"] = at::IValue::make_capsule(call);
        return {call->combine(call->to_buffer_side(y)).to(call->device)};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        auto call = c10::static_intrusive_pointer_cast<EpCall>(ctx->saved_data["call"].toCapsule());
        at::Tensor grad_y;
        call->dispatch(call->to_buffer_side(grads[0]), at::Tensor(), grad_y, nullptr, nullptr,
                       /*reuse=*/true);
        return {grad_y.to(call->device), at::Tensor(), at::Tensor()};
    }
};

}  // namespace

ep::Config ep_config_for(const ModelConfig& c, at::ScalarType dtype, int world_size, int rank,
                         int max_tokens_per_rank) {
    ep::Config e;
    e.world_size = world_size;
    e.rank = rank;
    e.num_experts = c.num_experts;
    e.hidden = c.hidden_size;
    e.top_k = c.num_experts_per_tok;
    e.max_tokens_per_rank = max_tokens_per_rank;
    e.dtype = dtype == at::kBFloat16 ? ep::DType::kBFloat16 : ep::DType::kFloat32;
    return e;
}

at::Tensor moe_forward(const at::Tensor& x, const Routing& routing, const at::Tensor& gate,
                       const at::Tensor& up, const at::Tensor& down, ep::Buffer* buffer) {
    if (buffer == nullptr) {
        MOERL_CHECK(gate.size(0) == routing.probs.size(1), "moe_forward without EP needs all ",
                    routing.probs.size(1), " experts, but holds ", gate.size(0));
        return experts_forward(x, routing.topk_idx, routing.topk_weights, gate, up, down,
                               routing.every_slot_routed);
    }
    const auto& cfg = buffer->config();
    const int64_t T = x.size(0), H = x.size(1), E = routing.probs.size(1), K = routing.topk_idx.size(1);
    MOERL_CHECK(cfg.num_experts == E, "EP buffer has num_experts = ", cfg.num_experts, ", but the model has ",
                E);
    MOERL_CHECK(cfg.hidden == H, "EP buffer has hidden = ", cfg.hidden, ", but the model has hidden_size ",
                H);
    MOERL_CHECK(cfg.top_k == K, "EP buffer has top_k = ", cfg.top_k, ", but the model routes to ", K,
                " experts");
    const at::ScalarType want = cfg.dtype == ep::DType::kFloat32 ? at::kFloat : at::kBFloat16;
    MOERL_CHECK(x.scalar_type() == want, "EP buffer moves ", ep::dtype_name(cfg.dtype),
                ", but the model computes in ", x.scalar_type());
    MOERL_CHECK(T <= cfg.max_tokens_per_rank, "MoE layer got ", T,
                " tokens, but the EP buffer holds at most ", cfg.max_tokens_per_rank,
                " per rank (max_tokens_per_rank)");
    const int64_t first = int64_t{cfg.rank} * cfg.num_local_experts();
    const int64_t local = std::max<int64_t>(0, std::min<int64_t>(cfg.num_local_experts(), E - first));
    MOERL_CHECK(gate.size(0) == local, "rank ", cfg.rank, " should hold ", local, " experts, but holds ",
                gate.size(0));

    auto call = c10::make_intrusive<EpCall>();
    call->buffer = buffer;
    call->device = x.device();
    call->topk_idx = call->to_buffer_side(routing.topk_idx.to(at::kLong));
    call->weights_need_grad = c10::GradMode::is_enabled() && routing.topk_weights.requires_grad();
    variable_list recv = DispatchFn::apply(x, routing.topk_weights, call);
    at::Tensor y = experts_forward(recv[0], call->recv_topk_idx, recv[1], gate, up, down);
    return CombineFn::apply(y, recv[0], call)[0];
}

}  // namespace moerl::model
