// The building blocks of the Qwen3-MoE forward pass as plain functions on ATen tensors. The model
// (model.hpp) composes them; tests and the RL layer may call them directly. Every function is
// differentiable through autograd and runs on any device and floating dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace moerl::ep {
class Buffer;
}

namespace moerl::model {

// HF Qwen3RMSNorm: normalise in fp32 over the last dim, cast back, scale by weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// cos and sin for rotary embeddings at `positions` [B, S] (int64): each [B, 1, S, head_dim] of dtype.
std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, int64_t head_dim, double theta,
                                              at::ScalarType dtype);
// x [B, heads, S, head_dim] rotated by the half-split (rotate_half) convention of HF.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// apply_rope(rms_norm(x, weight, eps), cos, sin) for x [..., heads, D] and cos, sin [..., 1, D]: the
// norm of q and k over each head, then the rotation; one kernel each way on a GPU.
at::Tensor rms_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                         const at::Tensor& sin, double eps);

// Grouped-query attention. q [B, Hq, S, D], k and v [B, Hkv, L, D] with Hq a multiple of Hkv,
// allowed [B, S, L] bool (true = query may attend to key). Softmax in fp32. Returns [B, S, Hq*D].
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& allowed);

// The positions of a [B, S] batch, flattened row-major, cut into sequences by cumulative lengths
// (what FlashAttention's varlen kernel reads): each run of real tokens is a sequence, each padding
// position a sequence of its own (it sees itself, as under the dense mask with left padding). No
// [B, S, L] mask exists and no attention crosses sequences.
struct VarlenLayout {
    at::Tensor cu_seqlens;  // [n + 1] int32 on the device: sequence i is positions [cu[i], cu[i+1])
    int64_t max_len = 0;    // the longest sequence
};

// Whether varlen_attention() runs for q/k/v of these options and shapes (CUDA, bf16 or fp16, a
// LibTorch with the flash kernel, head_dim a multiple of 8 up to 256): tried once on a tiny problem
// per device, dtype and shape, with gradients, against the dense reference.
bool varlen_attention_available(const at::TensorOptions& options, int64_t q_heads, int64_t kv_heads,
                                int64_t head_dim);

// Causal attention inside each sequence of `layout`. q [B, S, Hq, D], k and v [B, S, Hkv, D] with
// Hq a multiple of Hkv. Returns [B, S, Hq * D]. Differentiable. Call only where varlen_attention_available().
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const VarlenLayout& layout);

// log softmax(hidden[n] . weight^T / temperature + bias)[targets[n]] for hidden [N, H], weight
// [V, H], targets [N] int64 (in [0, V)), bias [V] fp32 (optional, -inf = never sampled). Returns
// [N] fp32, differentiable w.r.t. hidden and weight. The [N, V] logits never exist in fp32:
// they are made in chunks of at most `chunk_bytes` of fp32 work space, and the softmax is kept
// in the compute dtype for backward (two GEMMs, no recomputation of the logits).
at::Tensor selected_logprobs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                             double temperature = 1.0, const at::Tensor& bias = {},
                             int64_t chunk_bytes = int64_t{1} << 30);

// down(silu(gate(x)) * up(x)) with HF weight layouts gate/up [I, H], down [H, I].
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down);

struct Routing {
    at::Tensor probs;                // [T, E] fp32 softmax of the router logits
    at::Tensor topk_idx;             // [T, K] int64 global expert ids; -1 = no expert (masked token)
    at::Tensor topk_weights;         // [T, K] fp32, differentiable w.r.t. the router and x
    bool every_slot_routed = false;  // known without reading topk_idx: no -1 in it
};

// Softmax top-k router (HF Qwen3MoeSparseMoeBlock). x [T, H], router_weight [E, H].
// token_valid [T] bool (optional): tokens marked false get topk_idx -1 and weight 0, so they are
// neither sent to an expert nor counted by the load-balancing loss.
// Throws naming the id unless every expert id of a routing replay lies in [-1, num_experts) (one
// device synchronisation for a device tensor).
void check_replay_ids(const at::Tensor& replay, int64_t num_experts);

// replay [T, K] (optional): routing replay. Rows without a -1 use exactly these experts; rows
// with any -1 use the router's own top-k. Weights always come from the current router
// probabilities (renormalised when norm_topk_prob), so gradients flow to it. A replay on the host
// is checked here; one on a CUDA device must have passed check_replay_ids.
Routing route(const at::Tensor& x, const at::Tensor& router_weight, int64_t top_k, bool norm_topk_prob,
              const at::Tensor& token_valid = {}, const at::Tensor& replay = {});

// y[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]). idx [N, K] holds local expert ids in [0, L) or -1,
// w [N, K] fp32; stacked expert weights gate/up [L, I, H], down [L, H, I]. `every_slot_routed`:
// the caller knows idx holds no -1 and no id past L (the router's own choice over all experts);
// otherwise the grouped GEMM path reads that from the device, one synchronisation.
at::Tensor experts_forward(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                           const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                           bool every_slot_routed = false);

// The routed experts of one MoE layer for tokens x [T, H]. Without a buffer this process holds
// every expert (gate/up/down stacked over all E). With one, this rank holds experts
// [rank*L, rank*L + local) and tokens travel through the buffer's dispatch and combine, wrapped as
// autograd functions (dispatch's backward is a combine, combine's backward a dispatch reusing the
// handle). Collective: every rank of the group calls it in the same order, and backward runs the
// same collectives on every rank. T must not exceed the buffer's max_tokens_per_rank.
at::Tensor moe_forward(const at::Tensor& x, const Routing& routing, const at::Tensor& gate,
                       const at::Tensor& up, const at::Tensor& down, ep::Buffer* buffer);

// Accumulates the Switch-style load-balancing statistics of HF Qwen3-MoE over the MoE layers of
// one forward (HF concatenates all layers' router logits before averaging; so does this).
class LoadBalanceLoss {
  public:
    // One layer's share: expert counts [E] and token count (no gradient), router probabilities
    // summed over its valid tokens [E] (differentiable).
    struct LayerSums {
        at::Tensor counts, prob_sum, num_tokens;
    };
    // probs and topk_idx from route(); tokens with topk_idx -1 are skipped.
    static LayerSums layer_sums(const Routing& routing);
    void add(const LayerSums& sums);
    void add_layer(const Routing& routing) { add(layer_sums(routing)); }
    // E * sum_e f_e * P_e with f_e the fraction of (token, slot) choices naming expert e and P_e
    // the mean router probability of e, both over all (layer, valid token) pairs. The experts
    // counted are the ones actually used (the replayed ones under routing replay). A zero scalar
    // when nothing was added.
    at::Tensor value() const;

  private:
    at::Tensor counts_;      // [E] fp32
    at::Tensor prob_sum_;    // [E] fp32, differentiable
    at::Tensor num_tokens_;  // fp32 scalar: valid (layer, token) pairs
};

}  // namespace moerl::model
