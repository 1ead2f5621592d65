// The rollout engine: batched generation with continuous batching (finished sequences leave, new
// ones join between decode steps), temperature / top-k / top-p sampling, stop tokens, length
// limits, per-token behaviour log-probs and policy versions, and routing records for replay.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "moerl/rl/config.hpp"
#include "moerl/rl/experience.hpp"

namespace moerl::model {
class MoeModel;
}

namespace moerl::rl {

struct GenRequest {
    uint64_t id = 0;          // caller's handle
    std::vector<int> prompt;  // prompt tokens (bos first)
    Trajectory prefix;        // response generated before (a resumed partial trajectory), or empty
    uint64_t seed = 0;        // sampling stream of this sequence
    int max_new_tokens = 16;  // response limit, prefix included
};

struct GenResult {
    uint64_t id = 0;
    Trajectory trajectory;
};

// [V] additive mask of params.allowed_tokens (0 where allowed, -1e9 elsewhere) in `options`;
// undefined when every token is allowed.
at::Tensor allowed_token_bias(const SamplingParams& params, int64_t vocab_size,
                              const at::TensorOptions& options);

// Samples one token per row of logits [rows, V] (any float dtype, CPU or CUDA; computed in double
// there): temperature, then top-k, then top-p, then the inverse CDF of the kept mass at uniforms[row]
// (in [0, 1)). Returns each row's token and its log-probability under the tempered (untruncated)
// distribution, which is what the trainer recomputes.
std::vector<std::pair<int, float>> sample_tokens(const at::Tensor& logits, const SamplingParams& params,
                                                 const std::vector<double>& uniforms);
// The same for one row of logits [V].
std::pair<int, float> sample_token(const float* logits, int vocab_size, const SamplingParams& params,
                                   double uniform);
// Counter-based uniform draw: the same (seed, draw) gives the same number on any batch layout.
double uniform_draw(uint64_t seed, uint64_t draw);

class RolloutEngine {
  public:
    // The model must outlive the engine; weights may be reloaded in place between steps (tokens
    // carry the version that sampled them; call refresh_weights() after). A model on a CUDA device
    // decodes through model::Generator (paged KV cache of max_seq_len tokens a sequence, fused decode
    // kernels, routing records from the decode kernels) when this build has it; otherwise through
    // the model's own prefill/decode, the reference.
    RolloutEngine(const model::MoeModel& model, const SamplingParams& params, int max_batch,
                  bool record_routing, int max_seq_len = 1024);
    ~RolloutEngine();

    void add(GenRequest request);
    // Admits waiting requests up to max_batch (prefill), then decodes one token for every active
    // sequence. Returns the sequences that finished (stop token or length limit).
    std::vector<GenResult> step(int64_t policy_version);
    // Steps until nothing is active or waiting.
    std::vector<GenResult> run_to_completion(int64_t policy_version);
    // Removes every unfinished sequence and returns its partial trajectory (preemption).
    std::vector<GenResult> drain();

    // Re-reads what the engine keeps of the weights (the CUDA engine's fused projections).
    void refresh_weights();
    // Whether sequences decode through model::Generator.
    bool uses_generator() const;

    size_t num_active() const;
    size_t num_waiting() const;
    bool idle() const { return num_active() == 0 && num_waiting() == 0; }
    int64_t tokens_generated() const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace moerl::rl
