// Internal: the kernels of the CUDA decode step (no LibTorch inside), plain launchers taking pointers,
// sizes and a Launch (stream). Every launcher is capturable in a CUDA graph: fixed grids, no host sync, no
// allocation. Element type: `dtype` 0 = fp32, 1 = bf16 for every T* argument; math is in fp32.
//
// Shapes: B rows (sequences) of one decode step, H hidden, Hq / Hkv query / key-value heads of D
// dims, E experts (K per token), I expert width, V vocabulary.
//   paged KV pool (per layer, keys and values alike): [num_blocks, block_size, Hkv, D]
//   block_table: [max_batch, max_blocks] int32, row = sequence slot, entry = pool block
//   position[b]: RoPE position of row b's new token (= tokens already cached), -1 = padding row
//   slot[b]: sequence slot of row b (its block-table row)
// Padding rows (position -1) are skipped: no cache write, no expert, zero attention output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moerl::model::cuda {

constexpr int kMaxExperts = 512;  // router softmax and per-expert counters live in shared memory
constexpr int kMaxHidden = 8192;  // residual rows live in registers of the row kernels
constexpr int kMaxHeadDim = 256;  // per-lane registers of the attention and RoPE kernels
constexpr int kMoeTokenTile = 8;  // tokens of one expert multiplied per pass over its weights

// Where the kernels of a step go: the stream, and whether they overlap (programmatic dependent
// launch, Hopper): each kernel may then start while the previous one on the stream drains, does what
// needs nothing from it (the dense GEMVs and the down experts copy their weights into shared memory,
// attention asks L2 for the cached keys and values), and waits for it before touching anything the
// previous kernels read or write. Off: plain stream order (per-kernel timing with events).
struct Launch {
    cudaStream_t stream = nullptr;
    bool overlap = false;
};

struct MoeRouting {
    int* topk_idx = nullptr;        // [B, K] global expert, -1 for padding rows
    float* topk_weights = nullptr;  // [B, K]
    int* expert_offset = nullptr;   // [E + 1] prefix sum of tokens per expert
    int* active_experts = nullptr;  // [E] experts with at least one token, ascending
    int* num_active = nullptr;      // [1]
    int* expert_slots = nullptr;    // [B * K] (row * K + k) grouped by expert (order inside a group free)
    unsigned long long* experts_read = nullptr;  // optional: += num_active (expert weight sets read)
};

// x[b] = embed[tokens[b]] (ids clamped to [0, V)); h[b] = rms_norm(x[b]) * norm_weight.
void launch_embed_rmsnorm(int dtype, const int64_t* tokens, const void* embed, const void* norm_weight,
                          float eps, int B, int V, int H, void* x, void* h, const Launch& launch);

// x += delta (when delta != nullptr); h = rms_norm(x) * norm_weight. Rows with position < 0 skipped.
void launch_add_rmsnorm(int dtype, void* x, const void* delta, const void* norm_weight, float eps,
                        const int* position, int B, int H, void* h, const Launch& launch);

// FP8 KV cache (GeneratorOptions::fp8_kv_cache): the pools hold e4m3 bytes, and each (token,
// key-value head) row of D values one fp32 scale, k and v [num_blocks, block_size, Hkv]: the row's
// values divided by max|row| / 448 and rounded to e4m3 (saturating), so each value comes back within
// half an e4m3 step, |x - q * scale| <= max(|x| / 16, scale / 1024). Null pointers: the pools hold
// the model's dtype.
struct KvScales {
    float* k = nullptr;
    float* v = nullptr;
    bool fp8() const { return k != nullptr; }
};

// qkv [B, (Hq + 2 Hkv) D] from the fused projection: q and k heads are RMS-normalised (q_norm,
// k_norm [D]) and rotated at position[b]; q goes to q_out [B, Hq, D], k and v into the pools (as
// e4m3 rows and their scales with `fp8`; bf16 only).
void launch_qk_norm_rope_store(int dtype, const void* qkv, const void* q_norm, const void* k_norm, float eps,
                               float rope_theta, const int* position, const int* slot, const int* block_table,
                               int max_blocks, int block_size, int B, int Hq, int Hkv, int D, void* q_out,
                               void* k_pool, void* v_pool, const Launch& launch, const KvScales& fp8 = {});

// The FP8 KV cache's moves outside the decode step (prefill): rows i < n of src [n, Hkv, D] (bf16)
// into pool rows rows[i] (token index: block * block_size + offset) as e4m3 with their scales; and
// the reverse, pool rows rows[i] to out [n, Hkv, D] (bf16, each value times its scale, rounded).
void launch_kv_rows_to_fp8(const void* src, const int64_t* rows, int64_t n, int Hkv, int D, uint8_t* pool,
                           float* scales, const Launch& launch);
void launch_kv_rows_from_fp8(const uint8_t* pool, const float* scales, const int64_t* rows, int64_t n,
                             int Hkv, int D, void* out, const Launch& launch);

// Query heads per key-value head the attention kernel is built for (1, 2, 4, 8, 16).
bool attention_group_supported(int group);
// Whether attention can read an FP8 KV cache: the tensor-core kernel's shapes (groups of 4, 8 or 16
// query heads of 64 or 128 dims; bf16 queries).
bool attention_fp8_kv_supported(int Hq, int Hkv, int D);

// Sequence chunk of the split attention's smallest split; partials per (row, kv head) for
// sequences of max_seq_len tokens.
constexpr int kAttentionMinChunk = 64;
int attention_partial_splits(int max_seq_len);

// The q/k step folded into the attention kernel: q, the new key and the new value come straight from
// the fused projection qkv [B, (Hq + 2 Hkv) D], q and k normalised and rotated as
// launch_qk_norm_rope_store does, and the blocks whose chunk holds row b's new token store its key
// and value into the pools before reading them. Saves a kernel (and its drain) per layer.
struct QkvInput {
    const void* qkv = nullptr;  // nullptr: q and the pools are ready (launch_qk_norm_rope_store ran)
    const void* q_norm = nullptr;
    const void* k_norm = nullptr;
    float eps = 0.0f;
    float rope_theta = 0.0f;
};

// out [B, Hq * D] = softmax(q k^T / sqrt(D)) v over the position[b] + 1 cached tokens of row b.
// bf16 steps whose blocks take a whole group of 4, 8 or 16 query heads of 64 or 128 dims (B * Hkv >=
// 32) run on the tensor cores, the probabilities rounded to bf16 for the product with the values;
// the others on the CUDA cores in fp32.
// partial: fp32 scratch of B * Hkv * attention_partial_splits(max_blocks * block_size) * (Hq / Hkv)
// * (D + 2) elements (split-sequence partial results); split_done: B * Hq ints, zero before the
// first call (each call leaves them zero). With qkv.qkv set, q is ignored (may be nullptr) and the
// pools are written. Each block reads position, slot and block table and asks L2 for the cached keys
// and values before position[b] before it waits for the previous kernel (Launch::overlap): none of
// those may be written by the two kernels just before (in a decode step the host writes them before
// the step, earlier steps the cache). With `fp8` the pools are e4m3 with those scales (KvScales):
// every step runs the tensor-core kernel with whole groups (bf16), the keys and values widened to
// bf16 exactly (as value x 2^-120, the power of two taken back in fp32), each key's scale applied to
// its scores and each value's to its probabilities before they are rounded to bf16; with qkv.qkv
// the new rows are stored quantised as launch_qk_norm_rope_store stores them.
void launch_paged_attention(int dtype, const void* q, void* k_pool, void* v_pool, const int* position,
                            const int* slot, const int* block_table, int max_blocks, int block_size, int B,
                            int Hq, int Hkv, int D, float* partial, int* split_done, void* out,
                            const Launch& launch, const QkvInput& qkv = {}, const KvScales& fp8 = {});

// Softmax top-k routing of router logits [B, E] (fp32 softmax, renormalised top-k when
// norm_topk_prob) and the grouping of the (row, k) slots by expert. One block.
void launch_route(int dtype, const void* router_logits, const int* position, int B, int E, int K,
                  bool norm_topk_prob, const MoeRouting& r, const Launch& launch);

// act[s] = silu(h[s / K] gate_e^T) * (h[s / K] up_e^T) for every slot s routed to expert e.
// gate/up [E, I, H]; act [B * K, I]. max_active: grid bound (min(E, B * K)). Each block requests
// the first chunks of its weight rows as soon as it knows its expert, before it gathers the tokens;
// with one row, block y takes top-k slot y and reads its expert from the top-k directly.
void launch_moe_gate_up(int dtype, const void* h, const void* gate, const void* up, const MoeRouting& r,
                        int B, int K, int H, int I, int max_active, void* act, const Launch& launch);

// y[s] = act[s] down_e^T (fp32) for every routed slot s; down [E, H, I]; y [B * K, H]. The weights
// are copied into shared memory before the kernel waits (the routing is complete two kernels back).
void launch_moe_down(int dtype, const void* act, const void* down, const MoeRouting& r, int B, int K, int H,
                     int I, int max_active, float* y, const Launch& launch);

// The same two expert products on the tensor cores (bf16 only, H and I multiples of 32): each warp
// takes 16 weight rows and up to 16 of an expert's tokens per pass (mma.sync, fp32 accumulation).
// For batches with a few tokens per expert, where the CUDA-core kernels above are bound by
// instruction issue rather than memory. E: experts (sizes the passes).
bool moe_tensor_cores_supported(int dtype, int H, int I);
void launch_moe_gate_up_mma(const void* h, const void* gate, const void* up, const MoeRouting& r, int B,
                            int K, int E, int H, int I, int max_active, void* act, const Launch& launch);
void launch_moe_down_mma(const void* act, const void* down, const MoeRouting& r, int B, int K, int E, int H,
                         int I, int max_active, float* y, const Launch& launch);

// FP8 weights for rollout: w [batch, rows, cols] (fp32 or bf16) to e4m3 q [batch, rows, cols] with
// one fp32 scale per 128 x 128 block, scales [batch, ceil(rows / 128), ceil(cols / 128)] (the
// block-scaled layout of FP8 checkpoints: w ~ q * scale). scale = amax / 448 over the block (1 for a
// block of zeros), q = e4m3(w / scale) rounded to nearest even, saturating. Each element comes back
// within half an e4m3 step: |w - q * scale| <= max(|w| / 16, scale / 1024).
constexpr int kFp8BlockRows = 128;
constexpr int kFp8BlockCols = 128;
void launch_quantize_fp8_blocks(int dtype, const void* w, int64_t batch, int64_t rows, int64_t cols,
                                uint8_t* q, float* scales, const Launch& launch);

// out [B, out_rows] (bf16) = in [B, cols] (bf16) (q * scale)^T with q [out_rows, cols] e4m3 and its
// block scales (launch_quantize_fp8_blocks): the dense GEMV of FP8 rollout, reading a byte a weight.
// cols a multiple of 16, at most kMaxHidden; tokens in passes of 8 over the weights.
void launch_dense_rows_fp8(const void* in, const uint8_t* q, const float* scales, int B, int cols,
                           int out_rows, void* out, const Launch& launch);

// The FP8 products of a decode step on the tensor cores, for any batch: the e4m3 weights (and their
// block scales, as launch_quantize_fp8_blocks lays them out) widen to fp16 exactly, the bf16 inputs
// are rounded to fp16 (saturating at +-65504), fp32 accumulation. Whether a matrix of `cols` columns
// can run them (a multiple of 64, at most kMaxHidden).
bool fp8_products_supported(int cols);
// out [B, out_rows] (bf16) = in [B, cols] (q * scale)^T.
void launch_dense_fp8(const void* in, const uint8_t* q, const float* scales, int B, int cols, int out_rows,
                      void* out, const Launch& launch);
// launch_moe_gate_up_mma and launch_moe_down_mma over e4m3 experts: gate/up [E, I, H], down [E, H, I],
// scales [E, ceil(rows / 128), ceil(cols / 128)] each; the same act and y, the same roundings.
void launch_moe_gate_up_fp8(const void* h, const uint8_t* gate_q, const float* gate_scales,
                            const uint8_t* up_q, const float* up_scales, const MoeRouting& r, int B, int K,
                            int H, int I, int max_active, void* act, const Launch& launch);
void launch_moe_down_fp8(const void* act, const uint8_t* down_q, const float* down_scales,
                         const MoeRouting& r, int B, int K, int H, int I, int max_active, float* y,
                         const Launch& launch);

// out [B, out_rows] = in [B, cols] weight^T with weight [out_rows, cols]: a GEMV for a few rows
// (weights read once; CUDA cores), in place of a GEMM library call at decode batch sizes. A block
// copies its weight rows into shared memory (or asks L2 for them, past 160 KB a block) before it
// waits for its predecessor (Launch::overlap); token tiles are copied with cp.async.
void launch_dense_rows(int dtype, const void* in, const void* weight, int B, int cols, int out_rows,
                       void* out, const Launch& launch);

// The grouped-GEMM experts' moves (bf16, H a multiple of 8): xs[i] = h[slot / K] for the S slots in
// expert order; act = round(silu(g)) * u over n elements; y[slot] = o[i] (fp32) for the routed slots.
void launch_gather_slot_rows(const void* h, const MoeRouting& r, int S, int K, int H, void* xs,
                             const Launch& launch);
void launch_silu_mul(const void* g, const void* u, int64_t n, void* act, const Launch& launch);
void launch_scatter_slot_rows(const void* o, const MoeRouting& r, int S, int E, int H, float* y,
                              const Launch& launch);

// x[b] += sum_k w[b, k] y[b * K + k]; h[b] = rms_norm(x[b]) * norm_weight. Padding rows skipped.
void launch_moe_combine_rmsnorm(int dtype, void* x, const float* y, const MoeRouting& r,
                                const void* norm_weight, float eps, const int* position, int B, int K, int H,
                                void* h, const Launch& launch);

// The batch-1 GEMVs with the small kernels around them folded in (made for one-row steps, where a
// layer is bound by its kernel boundaries; B rows work but take B passes over the weights). `done`
// holds fused_rows_done_counters(H) ints, zero before the first call; each call leaves them zero.
int fused_rows_done_counters(int H);

// out = (rms_norm(x) * norm_weight) weight^T: the dense GEMV normalising its input itself (every
// block, from the residual x [B, cols], cols <= kMaxHidden) in place of a norm kernel before it.
void launch_norm_dense_rows(int dtype, const void* x, const void* norm_weight, float eps, const void* weight,
                            int B, int cols, int out_rows, void* out, const Launch& launch);

// h = rms_norm(x + delta) * norm_weight (x itself is not written), logits = h router^T with router
// [E, H] (H <= kMaxHidden, E <= kMaxExperts), then (with `route`) launch_route's routing of the
// logits: add + norm, router GEMV and routing in one kernel. Without `route` the kernel stops after
// the logits, which the one-row routed expert kernels below rank themselves.
void launch_add_norm_router_route(int dtype, const void* x, const void* delta, const void* norm_weight,
                                  float eps, const int* position, const void* router, int B, int H, int E,
                                  int K, bool norm_topk_prob, bool route, void* h, void* logits,
                                  const MoeRouting& r, int* done, const Launch& launch);

// launch_moe_down, then x[b] = round(round(x[b] + delta[b]) + round(sum_k w[b, k] y[b * K + k])) for
// rows with position >= 0 (delta optional): the residual adds of add_rmsnorm and the combine without
// the norm, which the next kernel does (launch_norm_dense_rows, or launch_add_rmsnorm with no delta).
// `done`: launch_add_norm_router_route's counters (chunk c of the output columns counts on done[1 + c]).
void launch_moe_down_combine(int dtype, const void* act, const void* down, const MoeRouting& r, int B, int K,
                             int H, int I, int max_active, float* y, void* x, const void* delta,
                             const int* position, int* done, const Launch& launch);

// Whether one row's experts can run as launch_moe_gate_up_routed + launch_moe_down_combine_routed
// (the down weights of K experts' column slices fit shared memory).
bool moe_routed_one_row_supported(int dtype, int K, int I);

// One row (B = 1), after launch_add_norm_router_route left the router logits [1, E] unranked:
// gate/up whose block y ranks them (launch_route's top-k) and takes slot y's expert, block (0, 0)
// writing the routing r for later readers; then the down experts + combine by output column (one
// kernel: each block takes a few output columns of every slot's expert, its weights copied into
// shared memory before it waits, and adds them into the residual itself; no fp32 y, no last-block
// combine) whose blocks rank the logits themselves before they wait. The same act and x as
// launch_moe_gate_up + launch_moe_down_combine.
void launch_moe_gate_up_routed(int dtype, const void* h, const void* gate, const void* up, const void* logits,
                               const int* position, const MoeRouting& r, int E, int K, bool norm_topk_prob,
                               int H, int I, void* act, const Launch& launch);
void launch_moe_down_combine_routed(int dtype, const void* act, const void* down, const void* logits,
                                    const int* position, int E, int K, bool norm_topk_prob, int H, int I,
                                    void* x, const void* delta, const Launch& launch);

// out[b] = argmax of logits[b, :V] (lowest index on ties; NaN ranks above every number), one kernel.
// keys and blocks_done: B each, zero before the first call; each call leaves them zero. With
// advance_position (optional, [B]), rows whose position is >= 0 move on by one token once their argmax
// is known: a decode step that ends this way leaves the next step's positions for the same rows on
// the device (every earlier kernel of the step has finished reading them by then).
void launch_argmax(int dtype, const void* logits, int B, int V, unsigned long long* keys, int* blocks_done,
                   int64_t* out, int* advance_position, const Launch& launch);

// One token a row of logits [B, V] (rows row_stride apart) drawn from softmax(logits / temperature):
// the first token in vocabulary order whose running mass exceeds uniforms[b] x the row's mass, the
// masses accumulated in double. out [2, B]: the tokens (as doubles), then their log-probabilities.
// One block a row.
void launch_sample_rows(int dtype, const void* logits, int64_t row_stride, int B, int V, double temperature,
                        const double* uniforms, double* out, cudaStream_t stream);

}  // namespace moerl::model::cuda
