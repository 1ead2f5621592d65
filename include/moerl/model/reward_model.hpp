// A reward model with a scalar head: the checkpoint layout Hugging Face transformers writes for
// Qwen3MoeForSequenceClassification. The backbone is MoeModel's (the causal LM's tensors without
// lm_head.weight); `score.weight` [num_labels, hidden] (no bias) is applied to the final-normed
// hidden state of each sequence's last non-padding token.
//
// Which token is "last", as transformers decides it: with a pad_token_id in config.json, the
// rightmost token whose id is not pad_token_id (0 when every token is padding); so a sequence that
// itself ends in pad-id tokens (pad = eos in some tokenizers) is scored at the token before them.
// Without a pad_token_id transformers takes the last column and refuses batches > 1; here the
// attention mask says where each sequence ends, so batches of any padding work and give the score
// each sequence would get alone.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moerl/model/model.hpp"

namespace moerl::model {

// What config.json and the safetensors headers of a reward checkpoint say, checked without loading
// any weight: model_type qwen3_moe, score.weight [num_labels, hidden] present, no lm_head.weight.
struct RewardCheckpointInfo {
    ModelConfig backbone;
    int num_labels = 1;  // rows of score.weight (= id2label's size in config.json)
    int label = 0;       // the row that is the reward
    std::optional<int64_t> pad_token_id;
};

// Throws naming the problem: no score.weight (e.g. a causal LM checkpoint: lm_head.weight or a
// *ForCausalLM architecture), a score.weight whose shape does not fit, or num_labels != 1 without a
// label chosen (label = -1), or a label out of range.
RewardCheckpointInfo inspect_reward_checkpoint(const std::string& dir, int label = -1);

// Index [B] (int64) of the token each row is scored at, by the rule above. input_ids and
// attention_mask (undefined = all 1) are [B, S].
at::Tensor last_token_index(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                            std::optional<int64_t> pad_token_id);

class RewardModel {
  public:
    // Zero weights (init_random() or a load follows). options.lm_head is ignored (always false).
    RewardModel(const ModelConfig& backbone, int num_labels, int label, std::optional<int64_t> pad_token_id,
                const ModelOptions& options);
    // label: the row of score.weight that is the reward; -1 requires num_labels = 1.
    static RewardModel from_pretrained(const std::string& dir, const ModelOptions& options, int label = -1);

    const ModelConfig& config() const { return backbone_.config(); }
    int num_labels() const { return num_labels_; }
    int label() const { return label_; }
    std::optional<int64_t> pad_token_id() const { return pad_token_id_; }
    MoeModel& backbone() { return backbone_; }
    const MoeModel& backbone() const { return backbone_; }
    const at::Tensor& score_weight() const { return score_; }  // [num_labels, hidden]

    // N(0, initializer_range) for the backbone (as MoeModel) and the head.
    void init_random(uint64_t seed);
    // config.json (architectures Qwen3MoeForSequenceClassification, id2label, pad_token_id) and
    // model.safetensors. dtype: "" = config.torch_dtype, or float32 | bfloat16 | float16.
    void save_pretrained(const std::string& dir, const std::string& dtype = "") const;

    // [B, num_labels] fp32 head outputs at each row's last token. No autograd.
    at::Tensor logits(const at::Tensor& input_ids, const at::Tensor& attention_mask) const;
    // The reward (label's logit) of each token sequence, in batches of at most max_batch
    // (right-padded with pad_token_id, or 0 without one).
    std::vector<double> score(const std::vector<std::vector<int>>& sequences, int max_batch = 16) const;

  private:
    MoeModel backbone_;
    at::Tensor score_;
    int num_labels_ = 1;
    int label_ = 0;
    std::optional<int64_t> pad_token_id_;
};

}  // namespace moerl::model
