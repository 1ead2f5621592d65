// Architecture of a Qwen3-MoE model, read from and written to a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moerl::model {

struct ModelConfig {
    int vocab_size = 0;                    // required, > 0
    int hidden_size = 0;                   // required, > 0
    int num_hidden_layers = 0;             // required, > 0
    int num_attention_heads = 0;           // required, a multiple of num_key_value_heads
    int num_key_value_heads = 0;           // default num_attention_heads
    int head_dim = 0;                      // default hidden_size / num_attention_heads; even (RoPE)
    int intermediate_size = 0;             // dense MLP width; > 0 when a layer is dense
    int moe_intermediate_size = 0;         // expert MLP width; > 0 when a layer is MoE
    int num_experts = 0;                   // 0: every layer dense
    int num_experts_per_tok = 0;           // top-k, 1..num_experts
    bool norm_topk_prob = false;           // renormalise the top-k router probabilities to sum 1
    int decoder_sparse_step = 1;           // layer i is MoE when (i + 1) % step == 0 ...
    std::vector<int> mlp_only_layers;      // ... and i is not listed here
    double rms_norm_eps = 1e-6;            // > 0
    double rope_theta = 10000.0;           // > 0
    int max_position_embeddings = 32768;   // > 0
    bool tie_word_embeddings = false;      // lm_head shares model.embed_tokens.weight
    double router_aux_loss_coef = 0.001;   // weight of the load-balancing loss, >= 0
    double initializer_range = 0.02;       // std of the random initialisation
    std::string torch_dtype = "bfloat16";  // dtype of the stored weights
    std::string extra_json = "{}";         // fields moerl does not use, kept for write-back

    // Parses config.json text; `source` names the file in error messages. Validates.
    static ModelConfig from_json_text(const std::string& text, const std::string& source = "config.json");
    // `path` is a config.json file or a directory holding one.
    static ModelConfig load(const std::string& path);
    std::string to_json_text() const;
    // Writes config.json into the directory `dir` (atomically).
    void save(const std::string& dir) const;

    // Throws moerl::Error naming the first inconsistent field and what was expected.
    void validate() const;

    bool is_moe_layer(int layer) const;
    int num_moe_layers() const;
    // Index among MoE layers of `layer`, or -1 when it is dense.
    int moe_layer_index(int layer) const;

    // Every weight of the HF layout with its shape, in checkpoint order.
    std::vector<std::pair<std::string, std::vector<int64_t>>> tensor_shapes() const;
    int64_t num_parameters() const;
    // Parameters touched by one token: all but the experts it does not use.
    int64_t num_active_parameters() const;
    // Parameters of one expert (gate, up and down projections).
    int64_t expert_parameters() const { return 3LL * hidden_size * moe_intermediate_size; }
};

// HF tensor names.
std::string layer_prefix(int layer);                                      // "model.layers.N."
std::string expert_tensor_name(int layer, int expert, const char* proj);  // proj: gate_proj|up_proj|down_proj

}  // namespace moerl::model
