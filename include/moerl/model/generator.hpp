// The CUDA generation engine: a paged (block) KV cache shared by sequences of any length, decode
// steps made of fused kernels (RoPE + cache store, paged attention, routing, grouped expert GEMVs,
// combine + norm) around cuBLAS projections, replayed from CUDA graphs per batch-size bucket.
// Prefill runs the model's eager path (fused SDPA attention, grouped expert GEMMs) and moves the
// keys and values into the cache blocks.
//
// Sequences live in slots [0, max_batch). A step decodes any subset of the active slots, so
// sequences join (prefill) and leave (release) between steps: continuous batching.
//
//   Generator gen(model, {.max_batch = 64, .max_seq_len = 1024});
//   std::vector<int> slots = {gen.acquire(), gen.acquire()};
//   auto r = gen.prefill(slots, {prompt_a, prompt_b});    // r.greedy: next tokens [2]
//   for (...) r = gen.decode(slots, r.greedy);
//   gen.release(slots[0]);
//
// Tuning switches, read when a generator is made (defaults in brackets): MOERL_GENERATOR_GATE_UP_ROWS /
// _DOWN_ROWS (expert weight rows per warp [kernel default]), _GEMV_MAX_BATCH (largest bucket whose
// dense projections use the GEMV kernel instead of cuBLAS [1]), _GROUPED_MIN_BATCH (smallest bucket
// whose experts run as grouped GEMMs [128]), _GATE_UP_MMA_MIN_BATCH / _DOWN_MMA_MIN_BATCH (smallest
// bucket whose gate/up or down expert products use the tensor cores, bf16, below the grouped GEMMs
// [32 / 2; 0: never]), _ATTENTION_LANES (lanes per token in the attention kernel: 1, 2 or 4 [0: 4]),
// _ATTENTION_WARPS (with one lane: 2, or 8 for few rows [8]), _ATTENTION_HEADS (query heads a block
// with few rows: 2 or 1 [1]), _ARGMAX_PER_THREAD (32 or 8 [8]), _ATTENTION_EARLY (the attention kernel's
// cache reads begun before it waits for the previous kernel [1]), _PDL (programmatic dependent launch
// of the decode kernels; 0 = plain stream order [1]), _DEVICE_INPUTS (fed-back tokens read in place,
// positions moved on by the step itself; 0 = every step uploads its tokens, positions and slots [1]),
// _LM_HEAD_GEMV (one-row steps' LM head through the GEMV kernel, the final norm inside [1]), _PROFILE
// (below).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moerl/model/model.hpp"

namespace moerl::model {

struct GeneratorOptions {
    int max_batch = 64;       // slots (sequences in flight); graphs are captured for 1, 2, 4, ... up to it
    int max_seq_len = 1024;   // prompt + generated tokens of one sequence
    int block_size = 16;      // tokens per KV-cache block
    int64_t num_blocks = 0;   // blocks in the pool; 0 = enough for every slot at max_seq_len
    bool cuda_graphs = true;  // false: every step launches its kernels eagerly (same results)
};

struct GenerationStep {
    at::Tensor logits;  // [n, V] model dtype on the device, valid until the next call
    at::Tensor greedy;  // [n] int64 on the device: argmax of each row
};

struct GeneratorStats {
    int64_t decode_steps = 0;
    int64_t decode_rows = 0;          // tokens produced by decode steps
    int64_t expert_weight_reads = 0;  // sum over decode steps and MoE layers of distinct experts used
    int64_t kv_tokens_read = 0;       // sum over decode steps and rows of cached tokens attended (per layer)
};

class Generator {
  public:
    // The model must live on a CUDA device, hold every expert (no EP buffer) and outlive the
    // generator. Throws naming the unsupported property otherwise.
    Generator(const MoeModel& model, const GeneratorOptions& options = {});
    ~Generator();
    Generator(const Generator&) = delete;
    Generator& operator=(const Generator&) = delete;

    // Whether this build has the CUDA engine (LibTorch with CUDA and the decode kernels).
    static bool available();

    // A free slot, or -1 when all max_batch are in use.
    int acquire();
    // Frees the slot and its cache blocks.
    void release(int slot);
    // Cached tokens of a slot (-1 when free).
    int64_t length(int slot) const;
    int64_t free_blocks() const;

    // Starts each listed (acquired, empty) slot with its prompt (>= 1 token). Returns the logits of
    // each prompt's last token.
    GenerationStep prefill(const std::vector<int>& slots, const std::vector<std::vector<int64_t>>& prompts);
    // Appends tokens [n] (int64, any device) to the n listed slots and returns the next logits.
    // Tokens that are the last step's `greedy` itself (changed in place or not) are read where they
    // lie; a step continuing the previous step's slots in the same order copies nothing to the device.
    GenerationStep decode(const std::vector<int>& slots, const at::Tensor& tokens);

    // Re-reads weights the generator keeps in its own layout (the fused q/k/v projection); call
    // after the model's weights changed in place.
    void refresh_weights();

    GeneratorStats stats() const;  // synchronises with the device
    void reset_stats();
    // With MOERL_GENERATOR_PROFILE=1 and eager steps (cuda_graphs = false): milliseconds per kernel
    // kind summed over the decode steps since reset_stats().
    std::vector<std::pair<std::string, double>> profile() const;
    // Bytes one decode step reads besides the routed experts and the KV cache (dense weights and
    // the output projection), and the bytes of one expert (gate + up + down).
    int64_t dense_bytes_per_step() const;
    int64_t expert_bytes() const;
    // Bytes of one cached token across all layers (keys + values).
    int64_t kv_bytes_per_token() const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace moerl::model
