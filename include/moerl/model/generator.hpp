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
// A long prompt may also go in parts, between decode steps of the other slots (chunked prefill):
//   gen.prefill({s}, {first_half}); ... gen.decode(others, ...); gen.prefill({s}, {second_half});
//
// The decode path changes with the batch bucket (GeneratorOptions below); bench/RESULTS.md has the
// measurements behind each threshold.
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
    // Slots (sequences in flight). Graphs are captured for buckets of 1, 2, 4, ... up to it; a step of
    // n rows runs the smallest bucket >= n, padded. Default 64; 1..1024.
    int max_batch = 64;
    // Prompt + generated tokens of one sequence. Default 1024.
    int max_seq_len = 1024;
    // Tokens per KV-cache block. Default 16; smaller wastes less of a sequence's last block.
    int block_size = 16;
    // Blocks in the pool; 0 (default) = enough for every slot at max_seq_len. Set it lower to fit
    // long max_seq_len in less memory when most sequences end early.
    int64_t num_blocks = 0;
    // Identical prompts of one prefill call (the samples of a GRPO group) run through the model
    // once and share the cache blocks their prompt fills; each sample gets its own copy of a partial
    // last block, the only one it writes. Default true; false prefills and stores every prompt.
    bool share_prompts = true;
    // Prompt tokens (rows x longest prompt, padding included) of one pass of the model in prefill: a
    // call with more runs several passes, shortest prompts first, so that many long prompts fit the
    // activations' memory. A prompt longer than this runs alone. Default 32768.
    int64_t prefill_chunk_tokens = 32768;
    // Decode steps replayed from CUDA graphs. Default true; false launches every kernel eagerly (the
    // same results, slower): for debugging and for `profile`.
    bool cuda_graphs = true;
    // Per-kernel times of eager steps (needs cuda_graphs = false), read with Generator::profile().
    // The kernels then run in plain stream order, not overlapped. Default false.
    bool profile = false;
    // Routing records: every step also returns the experts each row used in each MoE layer
    // (GenerationStep::routing), for routing replay in training. One small device copy per MoE layer
    // a step. Default false.
    bool record_routing = false;
    // Expert parallelism: the model holds only its rank's experts (ModelOptions::ep, which the
    // prefill dispatches through), and every decode step's MoE layers dispatch and combine through
    // this low-latency buffer of the same group (a device transport, max_tokens_per_rank >=
    // max_batch, the model's dtype), inside the CUDA graphs. Collective: the group's ranks decode
    // (or call idle_step()) together. Default nullptr: every expert lives here.
    ep::Buffer* ep = nullptr;
    // FP8 rollout: decode steps read e4m3 copies of the expert weights (and, in steps of up to 8
    // rows, of the q/k/v, o and LM-head projections; larger steps read those in bf16, a small part
    // of their bytes), one fp32 scale per 128 x 128 block, quantised from the model's weights when the
    // generator is built and at each refresh_weights(). Prefill and the model itself stay bf16. About
    // half the bytes a decode step reads; what it costs in accuracy shows as the RL loop's mean
    // |log-prob difference| (the loss's importance weights correct for it). Needs a bf16 model
    // holding every expert (no ep) with hidden_size, moe_intermediate_size and heads x head_dim
    // multiples of 64; the copies take about half the model's memory again. Default false.
    bool fp8_weights = false;
    // FP8 KV cache: keys and values stored as e4m3 with one fp32 scale per (token, key-value head)
    // row (max|row| / 448), written by the decode step and by prefill, read by the tensor-core
    // attention kernel. A token's cache takes (D + 4) / (2 D) of its bf16 bytes (52% at head_dim
    // 128), so twice the sequences or context fit, and long-context steps read about half the bytes.
    // Prefill computes in bf16 and stores its keys and values quantised; a prompt continued later
    // reads them back dequantised. Needs a bf16 model with 4, 8 or 16 query heads per key-value head
    // of 64 or 128 dims. Default false.
    bool fp8_kv_cache = false;

    // Where the decode path changes with the batch bucket B. The defaults are the measured best on
    // an H200 at the Qwen3-30B-A3B shape (bench/RESULTS.md); change them only after measuring with
    // `moerl bench rollout` on the target GPU and model.
    //
    // Up to this B the dense projections (q/k/v, o, router, LM head) use the GEMV kernel instead of
    // cuBLAS, and at B = 1 the MoE layer's small kernels fold into the GEMVs. Default 1; 0 = never.
    int gemv_max_batch = 1;
    // Up to this B attention normalises and rotates q and the new key itself and stores the new key
    // and value (one kernel fewer a layer). Default 16; 0 = never.
    int fused_qk_max_batch = 16;
    // From these B on (bf16, below grouped_min_batch), the down and the gate/up expert products run on
    // the tensor cores instead of the CUDA cores. Defaults 2 and 32; 0 = never.
    int down_mma_min_batch = 2;
    int gate_up_mma_min_batch = 32;
    // From this B on (bf16, LibTorch >= 2.8), the experts run as grouped GEMMs. Default 128.
    int grouped_min_batch = 128;
};

struct GenerationStep {
    at::Tensor logits;  // [n, V] model dtype on the device, valid until the next call
    at::Tensor greedy;  // [n] int64 on the device: argmax of each row
    // With GeneratorOptions::record_routing, the experts used (global ids, the K of a row in any
    // order; int16 on the device): prefill [n, longest prompt, num_moe_layers, K], left-aligned as
    // the prompts are right-aligned (rows of -1 before a shorter prompt); decode [n, num_moe_layers, K].
    at::Tensor routing;
    // Prefill: prompt tokens that came from an identical prompt's cache blocks instead of the model
    // (GeneratorOptions::share_prompts).
    int64_t shared_tokens = 0;
};

// A queued decode step's draws, on the host (Generator::collect_step).
struct DrawnStep {
    std::vector<int64_t> tokens;
    std::vector<float> logprobs;  // log-probability of each drawn token under softmax(logits / T)
    at::Tensor routing;           // with record_routing: [n, num_moe_layers, K] int16 on the host
};

struct GeneratorStats {
    int64_t decode_steps = 0;
    int64_t decode_rows = 0;          // tokens produced by decode steps
    int64_t expert_weight_reads = 0;  // sum over decode steps and MoE layers of distinct experts used
    int64_t kv_tokens_read = 0;       // sum over decode steps and rows of cached tokens attended (per layer)
    int64_t prefill_tokens = 0;       // prompt tokens run through the model by prefill
    int64_t prefill_tokens_shared = 0;  // prompt tokens taken from an identical prompt's cache instead
};

// One token a row of logits [B, V] (bf16 or fp32 on a CUDA device, rows contiguous) drawn from
// softmax(logits / temperature) in one kernel: the first token in vocabulary order whose running mass
// exceeds uniforms[b] x the row's mass (accumulated in double, as rl::sample_tokens does on the CPU).
// Returns [2, B] double on the host: the tokens, then their log-probabilities. Throws where
// Generator::available() is false.
at::Tensor sample_on_device(const at::Tensor& logits, const std::vector<double>& uniforms,
                            double temperature);
// The same draw without waiting for the device: uniforms [B] double on the logits' device; the
// result [2, B] double stays there, ordered on the current stream after the logits.
at::Tensor sample_on_device_async(const at::Tensor& logits, const at::Tensor& uniforms, double temperature);

class Generator {
  public:
    // The model must live on a CUDA device and outlive the generator, and hold every expert unless
    // options.ep is set. Throws naming the unsupported property otherwise.
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
    // Whether a decode step of these acquired slots fits now: none is full and the new blocks they
    // need are free (decode() throws otherwise).
    bool step_fits(const std::vector<int>& slots) const;
    // Block-table entries that point at a block another slot also holds (GeneratorOptions::
    // share_prompts): the cache blocks that sharing saves right now.
    int64_t shared_blocks() const;

    // Appends each prompt (>= 1 token) to its listed, acquired slot and returns the logits of each
    // prompt's last token. An empty slot starts with it; a slot that holds tokens continues after
    // them (chunked prefill: a long prompt in parts between decode steps, or a conversation's next
    // turn), its new tokens attending to the cached ones. Identical prompts of empty slots are
    // prefilled once (GeneratorOptions::share_prompts). Checks every prompt and the free blocks
    // before it changes anything.
    GenerationStep prefill(const std::vector<int>& slots, const std::vector<std::vector<int64_t>>& prompts);
    // Gives the acquired, empty slot `to` every token slot `from` holds, without running the model:
    // the full cache blocks are shared (reference-counted; neither slot writes them again) and `to`
    // gets its own copy of a partial last block. The samples of a GRPO group whose prompt was
    // prefilled in chunks into one slot start this way. Both slots then decode independently.
    void fork(int from, int to);
    // Appends tokens [n] (int64, any device) to the n listed slots and returns the next logits.
    // Tokens that are the last step's `greedy` itself (changed in place or not) are read where they
    // lie; a step continuing the previous step's slots in the same order copies nothing to the device.
    GenerationStep decode(const std::vector<int>& slots, const at::Tensor& tokens);

    // A decode step that draws its tokens on the device and does not wait for them: runs
    // decode(slots, tokens), draws each row's next token from softmax(logits / temperature) with
    // uniforms[i] (sample_on_device's draw) and starts copying the draws and routing records to the
    // host. `tokens` may be queued_tokens() (or rows of it, on the device), so the next step can be
    // queued before the host has read this one: the GPU then runs from one step into the next while
    // the host keeps its books. At most two steps are queued; collect_step() returns the oldest
    // one's draws, waiting for them.
    void queue_step(const std::vector<int>& slots, const at::Tensor& tokens,
                    const std::vector<double>& uniforms, double temperature);
    at::Tensor queued_tokens() const;  // [n] int64 on the device: the last queued step's draws
    DrawnStep collect_step();
    int queued_steps() const;
    // Waits until the queued steps have run on the device (their draws stay to be collected).
    void wait_queued();
    // Drops the queued steps' draws once they have run.
    void drop_queued();

    // With options.ep: takes part in one decode step's dispatches and combines with no rows, as a
    // rank with nothing to decode does while the others decode.
    void idle_step();

    // The generator's own GPU memory, for a GPU shared with training (colocated RL): the KV cache
    // and the weights it keeps in its own layout (the fused q/k/v projection; with fp8_weights every
    // e4m3 copy, the bulk of it). release_memory gives both back to the driver while no sequence
    // holds a block (throws naming the slots that do) and returns the bytes given back (0 when
    // already released); the addresses stay, and so do the captured CUDA graphs. restore_memory
    // takes them back and fills the weight copies again from the model's weights (the next prefill
    // and refresh_weights do it themselves), first emptying LibTorch's allocator cache when the GPU
    // lacks the bytes; it throws naming them when even that is not enough. cache_memory_bytes and
    // weight_copy_bytes: the bytes held now; kept_memory_bytes: what release_memory keeps (the
    // step's buffers of max_batch rows and the CUDA graphs' private pools).
    int64_t release_memory();
    void restore_memory();
    int64_t cache_memory_bytes() const;
    int64_t weight_copy_bytes() const;
    int64_t kept_memory_bytes() const;

    // Re-reads weights the generator keeps in its own layout (the fused q/k/v projection); call
    // after the model's weights changed in place.
    void refresh_weights();

    GeneratorStats stats() const;  // synchronises with the device
    void reset_stats();
    // With GeneratorOptions::profile: milliseconds per kernel kind summed over the decode steps since
    // reset_stats(); empty otherwise.
    std::vector<std::pair<std::string, double>> profile() const;
    // Bytes one decode step of `rows` rows reads besides the routed experts and the KV cache (dense
    // weights and the output projection), and the bytes of one expert (gate + up + down), as this
    // engine reads them (GeneratorOptions::fp8_weights: the e4m3 copies and their scales).
    int64_t dense_bytes_per_step(int rows = 1) const;
    int64_t expert_bytes() const;
    // Bytes of one cached token across all layers (keys + values; with fp8_kv_cache their e4m3 bytes
    // and scales).
    int64_t kv_bytes_per_token() const;

  private:
    struct Impl;
    class DecodeStep;  // the kernel sequence of a step (src/model/decode_step.hpp)
    std::unique_ptr<Impl> impl_;
};

}  // namespace moerl::model
