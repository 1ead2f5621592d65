// The rollout engine: batched generation with continuous batching (finished sequences leave, new
// ones join between decode steps), temperature / top-k / top-p sampling, stop tokens, length
// limits, per-token behaviour log-probs and policy versions, and routing records for replay.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moerl/rl/config.hpp"
#include "moerl/rl/experience.hpp"
#include "moerl/rl/role_processes.hpp"

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
// (in [0, 1)), most likely token first. Without truncation (top_k off or >= V, top_p 1, every token
// allowed: the RL default) the inverse CDF runs in vocabulary order instead, with no sort: one kernel
// on a GPU (model::sample_on_device), the same draws on the CPU. Returns each row's token and its
// log-probability under the tempered (untruncated) distribution, which is what the trainer recomputes.
std::vector<std::pair<int, float>> sample_tokens(const at::Tensor& logits, const SamplingParams& params,
                                                 const std::vector<double>& uniforms);
// The same for one row of logits [V].
std::pair<int, float> sample_token(const float* logits, int vocab_size, const SamplingParams& params,
                                   double uniform);
// Counter-based uniform draw: the same (seed, draw) gives the same number on any batch layout.
double uniform_draw(uint64_t seed, uint64_t draw);

// Decode steps of the CUDA engine: their wall time (the model's step, drawing the tokens and copying
// the routing records, as the loop waits for them), the bytes they read as `moerl bench rollout`
// counts them (dense weights, each distinct routed expert once a layer, the KV cache attended) and
// how many there were.
struct DecodeTraffic {
    double seconds = 0;
    double bytes = 0;
    int64_t steps = 0;

    DecodeTraffic operator-(const DecodeTraffic& o) const {
        return {seconds - o.seconds, bytes - o.bytes, steps - o.steps};
    }
    DecodeTraffic& operator+=(const DecodeTraffic& o) {
        seconds += o.seconds, bytes += o.bytes, steps += o.steps;
        return *this;
    }
};

struct RolloutEngineOptions {
    int max_batch = 64;  // sequences held at once (on each rank), >= 1
    // Every sampled token's experts in each MoE layer go into the trajectory (routing replay).
    bool record_routing = false;
    // CUDA engine: prompt + response tokens a sequence may hold (its KV cache), >= 2.
    int max_seq_len = 1024;
    // world_size > 1: the engine spans that many processes, one expert-parallel rank each. Each
    // rank's model holds its share of the experts (an EP buffer over the same processes) and each
    // rank holds its own sequences, up to max_batch; every step's MoE layers are collective. Rank 0
    // is the engine its caller sees: it hands new requests to the least loaded ranks and collects
    // what finished; ranks 1.. carry out its calls in follow(). A rank that dies makes rank 0's next
    // call throw, naming it.
    const RoleProcesses* processes = nullptr;
    // CUDA engine: decode from e4m3 copies of the weights, quantised again at each
    // refresh_weights() (model::GeneratorOptions::fp8_weights); the eager CPU path ignores it.
    bool fp8_weights = false;
    // CUDA engine: keys and values cached as e4m3 rows with a scale each
    // (model::GeneratorOptions::fp8_kv_cache); the eager CPU path ignores it.
    bool fp8_kv_cache = false;
    // CUDA engine: replay decode steps from CUDA graphs (false: launch each kernel, the same
    // kernels; model::GeneratorOptions::cuda_graphs).
    bool cuda_graphs = true;
    // CUDA engine in one process: context tokens prefilled a step, at most. Joining contexts go in
    // parts of this budget, oldest group first, each step before the active sequences' decode step,
    // so a long prompt delays those by one part's prefill instead of its whole. A GRPO group's
    // context is prefilled once, into its first sample, and the others fork from it when it is
    // whole (model::Generator::fork). 0: every joining context whole in the step it joins (also
    // the behaviour over processes and on the CPU).
    int64_t prefill_chunk_tokens = 0;
};

// The options a run's config asks for: rollout.max_batch, record_routing, max_seq_len,
// prefill_chunk_tokens, dtype fp8 and kv_cache_dtype.
RolloutEngineOptions rollout_engine_options(const RunConfig& config,
                                            const RoleProcesses* processes = nullptr);

class RolloutEngine {
  public:
    // The model must outlive the engine; weights may be reloaded in place between steps (tokens
    // carry the version that sampled them; call refresh_weights() after). A model on a CUDA device
    // decodes through model::Generator (paged KV cache of max_seq_len tokens a sequence, fused decode
    // kernels, routing records from the decode kernels) when this build has it; otherwise through
    // the model's own prefill/decode, the reference. RolloutEngineOptions says the rest.
    RolloutEngine(const model::MoeModel& model, const SamplingParams& params,
                  const RolloutEngineOptions& options = {});
    ~RolloutEngine();

    void add(GenRequest request);
    // Admits waiting requests up to max_batch (prefill), then decodes one token for every active
    // sequence. Returns the sequences that finished (stop token or length limit).
    std::vector<GenResult> step(int64_t policy_version);
    // Steps until nothing is active or waiting.
    std::vector<GenResult> run_to_completion(int64_t policy_version);
    // Removes every unfinished sequence and returns its partial trajectory (preemption).
    std::vector<GenResult> drain();

    // Loads new weights into this rank's model with load_here() (when given), then re-reads what
    // the engine keeps of them (the CUDA engine's fused projections). Over processes, ranks 1.. load
    // `source` (what rank 0 loads, e.g. a policy URI) through follow()'s loader at the same time; a
    // rank that cannot makes this throw with its message. Returns the bytes every loader reported.
    int64_t refresh_weights(const std::string& source = "", const std::function<int64_t()>& load_here = {});
    // Ranks 1.. of an engine over processes: carries out rank 0's calls until rank 0's engine is
    // destroyed. load(source) puts the weights rank 0 names in refresh_weights into this rank's model
    // and returns the bytes it copied (0 when it read files).
    void follow(const std::function<int64_t(const std::string& source)>& load);
    // Sequences the engine holds at once: max_batch on each rank.
    int capacity() const;
    // False once a call over the engine's processes failed (a rank died or timed out): the engine
    // cannot generate again, and its sequences are lost; drain() then returns the requests never
    // handed out.
    bool healthy() const;
    // Whether sequences decode through model::Generator.
    bool uses_generator() const;
    // Gives the CUDA engine's own memory (the KV cache, its weight copies) back while nothing is
    // active or waiting (for training on the same GPU); the next sync or prefill takes it back.
    // Returns the bytes given back (0 otherwise).
    int64_t release_memory();
    // The CUDA engine's GPU memory that release_memory keeps (step buffers, graph pools; 0 on the CPU).
    int64_t kept_memory_bytes() const;

    size_t num_active() const;
    size_t num_waiting() const;
    bool idle() const { return num_active() == 0 && num_waiting() == 0; }
    int64_t tokens_generated() const;
    // Context tokens (prompt and resumed response) this process's rank prefilled, and of them those
    // taken from a group-mate's cache blocks instead (the CUDA engine: samples of one prompt that
    // join in one prefill).
    int64_t prompt_tokens() const;
    int64_t prompt_tokens_shared() const;

    // What the CUDA engine's decode steps on this process's rank did since the engine was made (zero
    // without the CUDA engine). Synchronises with the device when steps ran since the last call.
    DecodeTraffic decode_traffic() const;

  private:
    struct Impl;
    struct Spread;
    std::unique_ptr<Impl> impl_;
    std::unique_ptr<Spread> spread_;  // over processes
    // Ranks 1..: what rank 0's call `bytes` asks; false for stop.
    bool carry_out(const std::string& bytes, const std::function<int64_t(const std::string&)>& load);
};

}  // namespace moerl::rl
