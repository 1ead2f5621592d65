// Internal: the weights of MoeModel and the transformer trunk shared by forward, prefill and decode.
#pragma once

#include <vector>

#include "moerl/model/layers.hpp"
#include "moerl/model/model.hpp"

namespace moerl::model {

struct LayerWeights {
    at::Tensor input_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_norm;
    at::Tensor gate_proj, up_proj, down_proj;                   // dense layers
    at::Tensor router, experts_gate, experts_up, experts_down;  // MoE layers: local experts stacked
    int moe_index = -1;                                         // index among MoE layers, -1 if dense
};

struct MoeModel::Impl {
    ModelConfig config;
    ModelOptions options;
    int first_expert = 0;
    int num_local = 0;
    at::Tensor embed, final_norm, lm_head;  // lm_head undefined when tied to embed
    std::vector<LayerWeights> layers;
    std::vector<NamedParameter> params;

    const at::Tensor& output_weight() const { return config.tie_word_embeddings ? embed : lm_head; }

    // What every layer of one trunk pass reads besides its input.
    struct LayerInputs {
        int64_t B = 0, S = 0;
        at::Tensor cos, sin;            // rope tables [B, 1, S, D]
        at::Tensor cos_bshd, sin_bshd;  // the same as [B, S, 1, D] (varlen path)
        at::Tensor allowed;             // [B, S, L] bool (dense attention path)
        at::Tensor valid_flat;          // [B * S] bool
        const VarlenLayout* varlen = nullptr;
        KvCache* cache = nullptr;
        int64_t col0 = 0;
    };
    // One decoder layer's output: the new hidden state [B, S, H] and, for an MoE layer, the experts
    // it chose [B * S, K] int64 and its share of the load-balancing loss (when want_aux).
    struct LayerOutput {
        at::Tensor x;
        at::Tensor topk_idx;
        LoadBalanceLoss::LayerSums balance;
    };
    // Layer l on x. `replay` [B * S, K] (optional) forces this layer's experts where it has no -1.
    LayerOutput layer(size_t l, const at::Tensor& x, const LayerInputs& in, const at::Tensor& replay,
                      bool want_aux) const;

    struct CheckpointedLayer;  // activation checkpointing of layer() (model.cpp)

    struct Trunk {
        at::Tensor hidden;  // [B, S, H] after the final norm
        at::Tensor aux_loss;
        at::Tensor routing;  // [B, S, M, K] int16
    };
    // ids/positions [B, S]; allowed [B, S, L]; token_valid [B, S] bool, undefined where every token
    // is (the experts then need not read the routing back to learn that). With a cache the new keys
    // and values are written at columns [col0, col0 + S) and attention reads columns [0, col0 + S).
    // With `varlen` (no cache) attention runs over its sequences and `allowed` is not read.
    Trunk run(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& allowed,
              const at::Tensor& token_valid, KvCache* cache, int64_t col0, const at::Tensor& replay,
              bool record_routing, bool want_aux, const VarlenLayout* varlen = nullptr,
              bool checkpoint_layers = false) const;
};

}  // namespace moerl::model
