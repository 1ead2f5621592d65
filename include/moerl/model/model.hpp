// A Qwen3-MoE causal language model on LibTorch: training forward/backward through autograd,
// batched prefill and decode with a KV cache, routing record and replay, expert parallelism.
//
// Padding convention. forward() takes any attention_mask (left or right padding, 1 = token):
// positions are cumsum(mask) - 1, padded keys are masked, padded tokens use no expert. For
// generation, prompts are LEFT-padded so every sequence's last prompt token sits in the last
// column; prefill() returns the logits of that column and decode() appends one column for all.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moerl/ep/config.hpp"
#include "moerl/model/config.hpp"

namespace moerl::ep {
class Buffer;
}

namespace moerl::model {

class Generator;

// The EP group's shape for this model: rank `rank` of `world_size`, its experts, hidden size and
// top-k, `dtype` (fp32 or bf16) on the wire, calls of up to max_tokens_per_rank rows. The transport
// and the other settings stay at their defaults for the caller to set.
ep::Config ep_config_for(const ModelConfig& config, at::ScalarType dtype, int world_size, int rank,
                         int max_tokens_per_rank);

struct ModelOptions {
    at::Device device = at::kCPU;
    at::ScalarType dtype = at::kFloat;  // compute and parameter dtype: fp32, bf16 or fp16
    // Expert parallelism: this rank holds experts [rank*L, rank*L + L) of the buffer's group and
    // every MoE layer dispatches through it (collective). nullptr: every expert lives here.
    ep::Buffer* ep = nullptr;
    // false: the backbone only, as an HF *ForSequenceClassification checkpoint holds it (no
    // lm_head.weight allocated, loaded or saved); forward() can then return hidden states only.
    bool lm_head = true;
};

struct ForwardOptions {
    bool return_logits = true;  // [B, S, V] in the model dtype
    bool compute_logprobs = true;
    bool return_hidden = false;  // [B, S, H] after the final norm (what a scalar head reads)
    bool record_routing = false;
    // Routing replay [B, S, num_moe_layers, K] (any integer dtype): rows without -1 force those
    // experts; rows with a -1 are routed by the router. Router weights stay differentiable.
    at::Tensor replay_routing;
    // Packed rows [B, S] (any integer dtype) in place of attention_mask: several sequences share a
    // row, each a run of one id > 0 (0 = padding). A token attends only to the earlier tokens of
    // its own run and its position restarts at 0 there, so a packed row computes exactly what the
    // sequences would alone.
    at::Tensor segment_ids;
    // token_logprobs under softmax(logits / temperature + bias): what a sampler with that
    // temperature and an allowed-token mask (bias [V] fp32, -1e9 = never drawn) draws from.
    double logprob_temperature = 1.0;
    at::Tensor logprob_bias;
    // [B, S] bool: token_logprobs only where true (0 elsewhere, column 0 always 0), computed in
    // chunks from the hidden states without a [B, S, V] logit tensor. The trainer's path at a large
    // vocabulary: it asks for the response tokens only.
    at::Tensor logprob_mask;
    // Activation checkpointing (when a backward follows): each decoder layer keeps only its input,
    // and the backward runs it again. Memory for activations drops from all layers' to about one
    // layer's plus a hidden state a layer, for one more forward of compute; gradients are the same.
    bool activation_checkpointing = false;
};

struct ForwardOutput {
    at::Tensor logits;          // [B, S, V] model dtype (when return_logits)
    at::Tensor token_logprobs;  // [B, S] fp32: [b, t] = log p(ids[b, t] | ids[b, <t]); column 0 is 0
    at::Tensor aux_loss;        // fp32 scalar, HF load-balancing loss before router_aux_loss_coef
    at::Tensor routing;         // [B, S, num_moe_layers, K] int16 experts used, -1 for padding
    at::Tensor hidden;          // [B, S, H] model dtype, final-normed (when return_hidden)
};

struct KvCache {
    std::vector<at::Tensor> keys, values;  // per layer [B, num_key_value_heads, capacity, head_dim]
    at::Tensor key_valid;                  // [B, capacity] bool: column holds a real token
    at::Tensor next_position;              // [B] int64 RoPE position of each sequence's next token
    int64_t length = 0;                    // columns written
    int64_t capacity = 0;

    int64_t batch_size() const { return key_valid.defined() ? key_valid.size(0) : 0; }
    // Keeps the sequences listed in batch_idx (int64), e.g. to drop finished ones.
    void select(const at::Tensor& batch_idx);
};

struct StepOutput {
    at::Tensor logits;   // [B, V] fp32 logits of the last column
    at::Tensor routing;  // [B, S, num_moe_layers, K] int16 when asked
};

struct NamedParameter {
    std::string name;
    at::Tensor tensor;
    bool expert = false;  // sharded over the EP group (not to be all-reduced across it)
};

class MoeModel {
  public:
    // Allocates zero weights; call init_random() or load_weights().
    MoeModel(const ModelConfig& config, const ModelOptions& options);
    // config.json + safetensors of an HF checkpoint directory; this rank's experts only.
    static MoeModel from_pretrained(const std::string& dir, const ModelOptions& options);
    MoeModel(MoeModel&&) noexcept;
    MoeModel& operator=(MoeModel&&) noexcept;
    ~MoeModel();

    const ModelConfig& config() const;
    const ModelOptions& options() const;
    int first_local_expert() const;
    int num_local_experts() const;

    // N(0, initializer_range) for matrices, 1 for norms; each tensor from its own generator seeded
    // by (seed, HF name), so an expert gets the same values on any EP layout.
    void init_random(uint64_t seed);
    // Copies weights from a checkpoint directory; checks every expected tensor's presence and shape.
    void load_weights(const std::string& dir);
    // Writes config.json and safetensors (HF layout). dtype: "" = config.torch_dtype, or
    // "float32" | "bfloat16" | "float16". Without EP: model.safetensors, or shards of at most
    // max_shard_bytes with an index. With EP: every rank calls it; rank r writes shard r of W (its
    // experts; rank 0 also the dense weights), rank 0 writes config.json and the index. Readers
    // must wait for all ranks (the caller's barrier).
    void save_pretrained(const std::string& dir, uint64_t max_shard_bytes = 0,
                         const std::string& dtype = "") const;

    // Trainable tensors (leaves, requires_grad = true by default). Experts are stacked per layer:
    // "model.layers.N.mlp.experts.{gate,up}_proj" [L, I, H] and ".down_proj" [L, H, I].
    std::vector<NamedParameter> named_parameters() const;
    std::vector<at::Tensor> parameters() const;
    // HF names and shapes (experts as views into the stacks), this rank's experts only.
    std::vector<std::pair<std::string, at::Tensor>> state_dict() const;
    void set_requires_grad(bool requires_grad);
    void zero_grad();
    // Bytes of the weights this rank holds.
    int64_t weight_bytes() const;

    // Training/scoring forward. input_ids [B, S] int64, attention_mask [B, S] (undefined = all 1).
    // Runs under the caller's grad mode; with EP it is collective (and so is backward). Inputs
    // (ids, mask, segment_ids, logprob_mask, replay_routing) may live on the host or on the model's
    // device: on the host they are checked and laid out there and copied without waiting, so a GPU
    // step never stops to read them back; on the device each check is a synchronisation.
    ForwardOutput forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                          const ForwardOptions& options = {}) const;

    // Generation (no autograd). A cache for `batch` sequences of up to `capacity` columns.
    KvCache new_cache(int64_t batch, int64_t capacity) const;
    // Appends input_ids [B, S] (left-padded; attention_mask [B, S], undefined = all 1) to the cache.
    // A second prefill call continues the sequences (chunked prefill) and must have no padding.
    StepOutput prefill(KvCache& cache, const at::Tensor& input_ids, const at::Tensor& attention_mask,
                       bool record_routing = false) const;
    // Appends one token per sequence, tokens [B] int64.
    StepOutput decode(KvCache& cache, const at::Tensor& tokens, bool record_routing = false) const;
    // With EP: takes part in the dispatch and combine of every MoE layer with no tokens, as a rank
    // with nothing to compute does while the others run a forward (collective; a no-op without EP).
    void idle_pass() const;

  private:
    friend class Generator;  // reads the weights in place
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// Per-token log-probabilities: [b, t] = log_softmax(logits[b, t-1] / temperature + bias)[ids[b, t]],
// column 0 = 0.
at::Tensor token_logprobs(const at::Tensor& logits, const at::Tensor& input_ids, double temperature = 1.0,
                          const at::Tensor& bias = {});

}  // namespace moerl::model
