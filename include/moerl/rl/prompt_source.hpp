// Where a run's prompts come from: a built-in digit task (rl::TaskGenerator) or a JSONL dataset
// rendered with the tokenizer's chat template (text::Dataset, text::ChatTemplate). Both give the
// prompt of (step, prompt index) as a pure function of the seed, so a resumed run continues with
// the same prompts from env_next_step, and held-out eval prompts for greedy pass@1.
//
// The dataset source, the Hugging Face tokenizer and the verifier mix need the text layer; without
// it (a build without PCRE2/utf8proc) a data: config fails at validation, naming what is missing.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moerl/rl/config.hpp"
#include "moerl/rl/env.hpp"

namespace moerl::rl {

// A prompt ready to generate from: its problem (what the verifier needs) and its tokens.
struct Prompt {
    Problem problem;
    std::vector<int> tokens;  // task: bos + characters; data: the encoded (templated) prompt
};

class PromptSource {
  public:
    virtual ~PromptSource() = default;
    // The prompt_idx-th prompt of training step `step` (deterministic). A dataset prompt longer
    // than data.max_prompt_tokens, or past the last of data.epochs, throws naming file and line.
    virtual Prompt train(int64_t step, int prompt_idx) const = 0;
    // Eval prompts: min(eval.prompts, the eval split's size) of them, the same at every eval.
    virtual int64_t eval_size() const = 0;
    virtual Prompt eval(int64_t i) const = 0;
    // What a checkpoint stores about the data after `env_next_step` steps were put (null for tasks),
    // and the check a resumed run makes against it (the same file size and seed).
    virtual nlohmann::json state(int64_t env_next_step) const = 0;
    virtual void check_state(const nlohmann::json& state) const = 0;
};

// A 64-bit hash of two values (splitmix-style): the seeds of prompts and samples derive from it.
uint64_t mix_seed(uint64_t a, uint64_t b);

// The task's or the dataset's source for `config`.
std::unique_ptr<PromptSource> make_prompt_source(const RunConfig& config);

// The rewarder of the run's prompts: the task's verifier, or the verifier mix (reward.verifiers)
// over the response decoded by the run's tokenizer.
std::unique_ptr<Rewarder> make_prompt_rewarder(const RunConfig& config);

// The id of the token `name` under config.tokenizer_path; throws naming `key` when it has none.
int token_id(const RunConfig& config, const std::string& name, const std::string& key);

// The text of response tokens under the run's tokenizer (for logs: special tokens kept).
std::string decode_response(const RunConfig& config, const std::vector<int>& tokens);
// The tokens of `text` under the run's tokenizer (no special tokens added), and how many ids that
// tokenizer has: what a response can hold (`moerl bench reward` draws from them).
std::vector<int> encode_response(const RunConfig& config, const std::string& text);
int response_vocab_size(const RunConfig& config);

// Fills in what the tokenizer and the checkpoint decide (called by RunConfig::from_yaml_text; the
// data files are not read here, so that a rollout worker needs only the tokenizer):
// tokenizer_path from model_path, model.vocab_size (random init), the stop tokens and the default
// verifier mix; checks the tokenizer against the embedding. Throws naming the key when they do not fit
// together.
void resolve_text_config(RunConfig& config, const std::vector<std::string>& stop_token_names,
                         bool vocab_size_given);

// Copies the tokenizer files (tokenizer.json, tokenizer_config.json and, where present,
// special_tokens_map.json, chat_template.jinja, generation_config.json) next to a checkpoint's
// weights, so that a published policy is usable as it is. No-op without a tokenizer.
void copy_tokenizer_files(const RunConfig& config, const std::string& dir);

}  // namespace moerl::rl
