// The CUDA generation engine (generator.hpp). Compiled with the decode kernels when LibTorch has
// CUDA (MOERL_HAVE_CUDA_GENERATOR); otherwise every entry point reports that the build lacks it.
#include "moerl/model/generator.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <map>

#include "model_impl.hpp"
#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"
#include "moerl/model/layers.hpp"

#ifdef MOERL_HAVE_CUDA_GENERATOR
#include <torch/version.h>
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define MOERL_HAVE_GROUPED_MM 1
#endif
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/decode_kernels.hpp"
#endif

namespace moerl::model {

#ifdef MOERL_HAVE_CUDA_GENERATOR

namespace {

std::vector<int> bucket_sizes(int max_batch) {
    std::vector<int> out;
    for (int b = 1; b < max_batch; b *= 2) out.push_back(b);
    out.push_back(max_batch);
    return out;
}

}  // namespace

struct Generator::Impl {
    const MoeModel& model;
    const MoeModel::Impl& m;
    GeneratorOptions opt;
    at::Device device;
    int dtype = 0;  // 0 fp32, 1 bf16 (kernel element type)
    int64_t H, Hq, Hkv, D, E, K, I, V;
    int max_blocks = 0;  // per sequence
    int64_t num_blocks = 0;
    std::vector<int> buckets;

    // Per layer: paged keys and values [num_blocks, block_size, Hkv, D], fused q/k/v weight.
    std::vector<at::Tensor> k_pool, v_pool, qkv_weight;

    // Host bookkeeping of the slots.
    std::vector<int64_t> length;                // cached tokens, -1 = free slot
    std::vector<std::vector<int>> slot_blocks;  // blocks of each slot in order
    std::vector<int> free_list;
    at::Tensor table_host;  // [max_batch, max_blocks] int32 (CPU)
    bool table_dirty = true;
    GeneratorStats host_stats;

    // Static step buffers (graphs read and write them in place), max_batch rows.
    at::Tensor tokens, position, slot, table;
    at::Tensor x, h, qkv, q, attn, attn_partial, attn_split_done, o, router_logits, act, y, logits, greedy,
        argmax_keys, argmax_done, fused_done;
    at::Tensor topk_idx, topk_weights, expert_offset, active_experts, num_active, expert_slots, experts_read;
    // One graph per batch bucket and token source (false: `tokens`, true: `greedy`, the last step's
    // own choice fed back).
    std::map<std::pair<int, bool>, std::unique_ptr<at::cuda::CUDAGraph>> graphs;
    // What `position` and `slot` hold on the device, as far as the host knows (device_inputs): a step
    // leaves its rows' positions one token on, so a step continuing the same rows uploads nothing.
    std::vector<int> device_position, device_slot;

    // MOERL_GENERATOR_PROFILE=1 with eager steps (no graphs, so every run_step really runs): time per
    // kernel kind, summed over steps.
    bool profile = false;
    std::vector<std::pair<const char*, cudaEvent_t>> marks;
    std::map<std::string, double> profile_ms;

    void mark(const char* name) {
        if (!profile) return;
        cudaEvent_t e;
        cudaEventCreate(&e);
        cudaEventRecord(e, at::cuda::getCurrentCUDAStream().stream());
        marks.push_back({name, e});
    }
    void collect_profile() {
        if (marks.empty()) return;
        cudaEventSynchronize(marks.back().second);
        for (size_t i = 1; i < marks.size(); ++i) {
            float ms = 0;
            cudaEventElapsedTime(&ms, marks[i - 1].second, marks[i].second);
            profile_ms[marks[i].first] += ms;
        }
        for (auto& [name, e] : marks) cudaEventDestroy(e);
        marks.clear();
    }
    // Weight rows per warp of the expert kernels (1, 2 or 4; 0 = the kernels' default), for tuning.
    int gate_up_rows = static_cast<int>(env::get_int("MOERL_GENERATOR_GATE_UP_ROWS", 0));
    int down_rows = static_cast<int>(env::get_int("MOERL_GENERATOR_DOWN_ROWS", 0));
    // From this batch bucket on (bf16), the experts run as grouped GEMMs (LibTorch) on the tensor cores.
    int grouped_min_batch = static_cast<int>(env::get_int("MOERL_GENERATOR_GROUPED_MIN_BATCH", 128));
    bool use_grouped_mm = false;
    // From these batch buckets on (bf16, below the grouped GEMMs' bucket), the expert products run on
    // the tensor cores (experts_mma.cu); 0 = never. Measured on an H200 (Qwen3-30B-A3B shape, in-graph
    // kernel times, bench/decode_kernels_bench.cu): down 93 -> 67 us at batch 16, the same at batch 1;
    // gate/up 131 -> 137 us at batch 16 (CUDA cores stay), 364 -> 215 us at batch 64.
    int gate_up_mma_min_batch = static_cast<int>(env::get_int("MOERL_GENERATOR_GATE_UP_MMA_MIN_BATCH", 32));
    int down_mma_min_batch = static_cast<int>(env::get_int("MOERL_GENERATOR_DOWN_MMA_MIN_BATCH", 2));
    // Up to this batch bucket the dense projections (q/k/v, o, router) use the GEMV kernel.
    int gemv_max_batch = static_cast<int>(env::get_int("MOERL_GENERATOR_GEMV_MAX_BATCH", 1));
    // Weight rows a warp of the dense GEMV (1, 2 or 4). One: measured on an H200 (Qwen3-30B-A3B shape,
    // 8 layers, bench rollout) 0.697 -> 0.688 ms a batch-1 step against two, as more blocks spread the
    // q/k/v rows evenly over the SMs.
    int gemv_rows = static_cast<int>(env::get_int("MOERL_GENERATOR_GEMV_ROWS", 1));
    // The dense GEMVs copy their weights into shared memory before waiting for the kernel before them
    // (cuda::Launch::preload) instead of asking L2 for them; so do the CUDA-core down experts. Measured
    // on an H200 (Qwen3-30B-A3B shape, 8 layers, bench rollout): step 0.687 -> 0.670 ms at batch 1,
    // the same at 16 and 64.
    bool gemv_preload = env::get_int("MOERL_GENERATOR_GEMV_PRELOAD", 1) != 0;
    // The CUDA-core gate/up experts request their first weight chunks as soon as they know their expert,
    // at one row reading it from the top-k (cuda::Launch::early_expert_loads). Measured on an H200
    // (Qwen3-30B-A3B shape, 8 layers, bench rollout, with down_by_column): step 0.639 -> 0.630 ms at
    // batch 1, 2.176 -> 2.142 at batch 16.
    bool early_expert_loads = env::get_int("MOERL_GENERATOR_EXPERT_EARLY", 1) != 0;
    // The one-row down experts and combine by output column (cuda::Launch::down_by_column): one kernel,
    // weights copied into shared memory while gate/up runs, no fp32 y and no last-block combine.
    // Measured as above: step 0.673 -> 0.639 ms at batch 1 (twice); the layer in
    // decode_kernels_bench 61.4 -> 57.6 us.
    bool down_by_column = env::get_int("MOERL_GENERATOR_DOWN_COLUMNS", 1) != 0;
    // Token tiles copied with cp.async (cuda::Launch::async_tiles). Measured on an H200 (Qwen3-30B-A3B
    // shape, 8 layers, bench rollout, twice each): step 0.632 / 0.630 -> 0.623 / 0.624 ms at batch 1,
    // 2.152 -> 2.134 at batch 16.
    bool async_tiles = env::get_int("MOERL_GENERATOR_TILE_ASYNC", 1) != 0;
    // One-row steps rank the router logits in the expert kernels instead of the router's last block
    // (cuda::Launch::route_in_experts; with the down experts by column). Measured on an H200
    // (Qwen3-30B-A3B shape, 8 layers, bench rollout, twice, alternated): step 0.628 / 0.630 -> 0.627 /
    // 0.625 ms at batch 1; the layer in decode_kernels_bench 55.65 -> 55.18 us.
    bool route_in_experts = env::get_int("MOERL_GENERATOR_ROUTE_IN_EXPERTS", 1) != 0;
    // A decode step that continues the previous one's rows with its greedy tokens copies nothing to
    // the device: the embedding reads `greedy` itself and the argmax kernel leaves the next positions
    // (no token, position or slot copies between two steps' kernels). Off: every step uploads them.
    // Measured on an H200 (Qwen3-30B-A3B shape, 8 layers, bench rollout, twice, alternated): step
    // 0.623 / 0.626 -> 0.616 / 0.616 ms at batch 1, the same at 16.
    bool device_inputs = env::get_int("MOERL_GENERATOR_DEVICE_INPUTS", 1) != 0;
    // Up to gemv_max_batch, the LM head through the GEMV kernel (the final norm inside, weights copied
    // into shared memory before it waits for the last layer) instead of a norm kernel and cuBLAS.
    // Measured on an H200 (Qwen3-30B-A3B shape, 8 layers, bench rollout, twice, alternated): step
    // 0.617 / 0.617 -> 0.607 / 0.606 ms at batch 1.
    bool lm_head_gemv = env::get_int("MOERL_GENERATOR_LM_HEAD_GEMV", 1) != 0;
    // Programmatic dependent launch of the decode kernels (each may start while the previous drains).
    bool overlap_launches = env::get_int("MOERL_GENERATOR_PDL", 1) != 0;
    // Attention block shape: lanes per token (0 = the kernels' default, 1, 2 or 4) and, with one lane,
    // warps per block (2, or 8 for few rows: 256-token chunks, no merge across blocks).
    int attention_lanes = static_cast<int>(env::get_int("MOERL_GENERATOR_ATTENTION_LANES", 0));
    int attention_warps = static_cast<int>(env::get_int("MOERL_GENERATOR_ATTENTION_WARPS", 8));
    // Attention reads position, slot and block table and asks L2 for the cached keys and values before
    // it waits for the q/k store (AttentionShape::early_loads). Measured on an H200 (Qwen3-30B-A3B
    // shape, 8 layers, bench rollout): step 0.709 -> 0.684 ms at batch 1, 5.48 -> 5.35 at 256.
    bool attention_early = env::get_int("MOERL_GENERATOR_ATTENTION_EARLY", 1) != 0;
    // Query heads an attention block serves with few rows (AttentionShape::few_rows_heads): 2 or 1.
    // Measured on an H200 (Qwen3-30B-A3B shape, 8 layers, bench rollout, twice, alternated): step
    // 0.607 / 0.607 -> 0.602 / 0.600 ms at batch 1; attention alone in decode_kernels_bench 6.57 ->
    // 6.35 us (batch 1, 193 tokens). Rows enough for a block per key-value head do not use it.
    int attention_heads = static_cast<int>(env::get_int("MOERL_GENERATOR_ATTENTION_HEADS", 1));
    // Logits an argmax thread reads (cuda::launch_argmax): 32 or 8. Measured as above: 0.607 / 0.607
    // -> 0.604 / 0.603 ms at batch 1 (one round trip of loads a thread instead of four).
    int argmax_per_thread = static_cast<int>(env::get_int("MOERL_GENERATOR_ARGMAX_PER_THREAD", 8));
    // Up to this batch bucket attention normalises and rotates q and the new key itself, from the q/k/v
    // projection, and stores the new key and value (cuda::QkvInput): one kernel fewer per layer; 0 =
    // never. Measured on an H200 (Qwen3-30B-A3B shape, 8 layers, bench rollout): the same step at
    // batch 1 and 16, 1.2% slower at 64 (3.43 against 3.39 ms: every split of a head group repeats the
    // group's q rotation).
    int fused_qk_max_batch = static_cast<int>(env::get_int("MOERL_GENERATOR_FUSED_QK_MAX_BATCH", 16));
    // One-row steps of an MoE layer with the CUDA-core experts: add + norm, router and routing in one
    // kernel, the combine in the down kernel's last blocks, the norm in the next q/k/v GEMV (or a norm
    // kernel before the LM head): 6 kernels a layer instead of 10 with fused_qk.
    bool fused_rows = env::get_int("MOERL_GENERATOR_FUSED_ROWS", 1) != 0;

    Impl(const MoeModel& owner, const MoeModel::Impl& weights, const GeneratorOptions& o)
        : model(owner), m(weights), opt(o), device(weights.options.device) {}

    cuda::MoeRouting routing() {
        cuda::MoeRouting r;
        r.topk_idx = topk_idx.data_ptr<int>();
        r.topk_weights = topk_weights.data_ptr<float>();
        r.expert_offset = expert_offset.data_ptr<int>();
        r.active_experts = active_experts.data_ptr<int>();
        r.num_active = num_active.data_ptr<int>();
        r.expert_slots = expert_slots.data_ptr<int>();
        r.experts_read = reinterpret_cast<unsigned long long*>(experts_read.data_ptr<int64_t>());
        return r;
    }

    void fuse_qkv() {
        for (size_t l = 0; l < m.layers.size(); ++l) {
            const LayerWeights& w = m.layers[l];
            at::Tensor fused = at::cat({w.q_proj.detach(), w.k_proj.detach(), w.v_proj.detach()}, 0);
            if (qkv_weight.size() <= l)
                qkv_weight.push_back(fused);
            else
                qkv_weight[l].copy_(fused);
        }
    }

    // out[:B] = in[:B] weight^T: the GEMV kernel for few rows, cuBLAS otherwise.
    void linear(const at::Tensor& in, const at::Tensor& weight, at::Tensor& out, int B,
                const cuda::Launch& launch) {
        if (B <= gemv_max_batch) {
            cuda::launch_dense_rows(dtype, in.data_ptr(), weight.data_ptr(), B,
                                    static_cast<int>(weight.size(1)), static_cast<int>(weight.size(0)),
                                    gemv_rows, out.data_ptr(), launch);
            return;
        }
        at::Tensor out_b = out.narrow(0, 0, B);
        at::mm_out(out_b, in.narrow(0, 0, B), weight.t());
    }

    // The kernels of one decode step over rows [0, B) of the static buffers, on the current stream,
    // embedding the tokens at token_ids ([B], `tokens` or `greedy`).
    void run_step(int B, const int64_t* token_ids) {
        const ModelConfig& c = m.config;
        const bool rank_in_experts =
            route_in_experts && down_by_column && cuda::down_combine_by_column(dtype, 1, K, I);
        // Overlapped launches only without per-kernel profiling (its events sit between the kernels).
        const cuda::Launch launch{at::cuda::getCurrentCUDAStream().stream(),
                                  overlap_launches && !profile,
                                  gemv_preload,
                                  early_expert_loads,
                                  down_by_column,
                                  async_tiles,
                                  rank_in_experts};
        const float eps = static_cast<float>(c.rms_norm_eps);
        const int* pos = position.data_ptr<int>();
        const int* slots = slot.data_ptr<int>();
        const int* tbl = table.data_ptr<int>();
        auto rows = [B](const at::Tensor& t) { return t.narrow(0, 0, B); };
        mark("start");
        cuda::launch_embed_rmsnorm(dtype, token_ids, m.embed.data_ptr(), m.layers[0].input_norm.data_ptr(),
                                   eps, B, static_cast<int>(V), H, x.data_ptr(), h.data_ptr(), launch);
        mark("embed+norm");
        const cuda::MoeRouting r = routing();
        const int max_active = static_cast<int>(std::min<int64_t>(E, int64_t{B} * K));
        cuda::AttentionShape attention = cuda::attention_shape(B, Hkv, attention_warps, attention_lanes);
        attention.early_loads = attention_early;
        attention.few_rows_heads = attention_heads;
        const bool experts_grouped_mm = B >= grouped_min_batch && use_grouped_mm;
        const bool tensor_cores = cuda::moe_tensor_cores_supported(dtype, H, I);
        const bool gate_up_mma = tensor_cores && gate_up_mma_min_batch > 0 && B >= gate_up_mma_min_batch;
        const bool down_mma = tensor_cores && down_mma_min_batch > 0 && B >= down_mma_min_batch;
        // fused_rows: the MoE layers' small kernels inside the GEMVs (see the flag).
        const bool fuse_moe =
            fused_rows && B == 1 && B <= gemv_max_batch && !experts_grouped_mm && !gate_up_mma && !down_mma;
        int* done = fused_done.data_ptr<int>();
        // Set when x holds the residual but h not yet its norm: the next GEMV normalises x itself.
        const at::Tensor* norm_pending = nullptr;
        for (size_t l = 0; l < m.layers.size(); ++l) {
            const LayerWeights& w = m.layers[l];
            const at::Tensor& next_norm = l + 1 < m.layers.size() ? m.layers[l + 1].input_norm : m.final_norm;
            if (norm_pending != nullptr) {
                cuda::launch_norm_dense_rows(
                    dtype, x.data_ptr(), norm_pending->data_ptr(), eps, qkv_weight[l].data_ptr(), B, H,
                    static_cast<int>(qkv_weight[l].size(0)), gemv_rows, qkv.data_ptr(), launch);
                norm_pending = nullptr;
            } else {
                linear(h, qkv_weight[l], qkv, B, launch);
            }
            mark("qkv mm");
            cuda::QkvInput qkv_in;
            if (B <= fused_qk_max_batch) {
                qkv_in = {qkv.data_ptr(), w.q_norm.data_ptr(), w.k_norm.data_ptr(), eps,
                          static_cast<float>(c.rope_theta)};
            } else {
                cuda::launch_qk_norm_rope_store(
                    dtype, qkv.data_ptr(), w.q_norm.data_ptr(), w.k_norm.data_ptr(), eps,
                    static_cast<float>(c.rope_theta), pos, slots, tbl, max_blocks, opt.block_size, B, Hq, Hkv,
                    D, q.data_ptr(), k_pool[l].data_ptr(), v_pool[l].data_ptr(), launch);
                mark("qk norm+rope+store");
            }
            cuda::launch_paged_attention(dtype, q.data_ptr(), k_pool[l].data_ptr(), v_pool[l].data_ptr(), pos,
                                         slots, tbl, max_blocks, opt.block_size, B, Hq, Hkv, D,
                                         attn_partial.data_ptr<float>(), attn_split_done.data_ptr<int>(),
                                         attn.data_ptr(), launch, attention, qkv_in);
            mark("attention");
            linear(attn, w.o_proj, o, B, launch);
            mark("o mm");
            if (w.moe_index >= 0 && fuse_moe) {
                cuda::launch_add_norm_router_route(dtype, x.data_ptr(), o.data_ptr(), w.post_norm.data_ptr(),
                                                   eps, pos, w.router.data_ptr(), B, H, E, K,
                                                   c.norm_topk_prob, gemv_rows, h.data_ptr(),
                                                   router_logits.data_ptr(), r, done, launch);
                mark("add+norm+router+route");
                if (rank_in_experts) {
                    cuda::launch_moe_gate_up_routed(dtype, h.data_ptr(), w.experts_gate.data_ptr(),
                                                    w.experts_up.data_ptr(), router_logits.data_ptr(), pos, r,
                                                    E, K, c.norm_topk_prob, H, I, act.data_ptr(), launch);
                    mark("experts gate+up");
                    cuda::launch_moe_down_combine_routed(
                        dtype, act.data_ptr(), w.experts_down.data_ptr(), router_logits.data_ptr(), pos, E, K,
                        c.norm_topk_prob, H, I, x.data_ptr(), o.data_ptr(), launch);
                    mark("experts down+combine");
                } else {
                    cuda::launch_moe_gate_up(dtype, h.data_ptr(), w.experts_gate.data_ptr(),
                                             w.experts_up.data_ptr(), r, B, K, H, I, max_active, gate_up_rows,
                                             act.data_ptr(), launch);
                    mark("experts gate+up");
                    cuda::launch_moe_down_combine(dtype, act.data_ptr(), w.experts_down.data_ptr(), r, B, K,
                                                  H, I, max_active, down_rows, y.data_ptr<float>(),
                                                  x.data_ptr(), o.data_ptr(), pos, done, launch);
                    mark("experts down+combine");
                }
                norm_pending = &next_norm;
                continue;
            }
            cuda::launch_add_rmsnorm(dtype, x.data_ptr(), o.data_ptr(), w.post_norm.data_ptr(), eps, pos, B,
                                     H, h.data_ptr(), launch);
            mark("add+norm");
            if (w.moe_index >= 0) {
                linear(h, w.router, router_logits, B, launch);
                mark("router mm");
                cuda::launch_route(dtype, router_logits.data_ptr(), pos, B, E, K, c.norm_topk_prob, r,
                                   launch);
                mark("route");
                if (experts_grouped_mm) {
                    experts_grouped(B, w);
                    mark("experts grouped gemm");
                } else {
                    if (gate_up_mma)
                        cuda::launch_moe_gate_up_mma(h.data_ptr(), w.experts_gate.data_ptr(),
                                                     w.experts_up.data_ptr(), r, B, K, E, H, I, max_active,
                                                     act.data_ptr(), launch);
                    else
                        cuda::launch_moe_gate_up(dtype, h.data_ptr(), w.experts_gate.data_ptr(),
                                                 w.experts_up.data_ptr(), r, B, K, H, I, max_active,
                                                 gate_up_rows, act.data_ptr(), launch);
                    mark("experts gate+up");
                    if (down_mma)
                        cuda::launch_moe_down_mma(act.data_ptr(), w.experts_down.data_ptr(), r, B, K, E, H, I,
                                                  max_active, y.data_ptr<float>(), launch);
                    else
                        cuda::launch_moe_down(dtype, act.data_ptr(), w.experts_down.data_ptr(), r, B, K, H, I,
                                              max_active, down_rows, y.data_ptr<float>(), launch);
                    mark("experts down");
                }
                cuda::launch_moe_combine_rmsnorm(dtype, x.data_ptr(), y.data_ptr<float>(), r,
                                                 next_norm.data_ptr(), eps, pos, B, K, H, h.data_ptr(),
                                                 launch);
                mark("combine+norm");
            } else {
                at::Tensor mlp = swiglu(rows(h), w.gate_proj, w.up_proj, w.down_proj).contiguous();
                cuda::launch_add_rmsnorm(dtype, x.data_ptr(), mlp.data_ptr(), next_norm.data_ptr(), eps, pos,
                                         B, H, h.data_ptr(), launch);
                mark("dense mlp");
            }
        }
        const at::Tensor& head = m.output_weight();
        if (lm_head_gemv && norm_pending != nullptr && B <= gemv_max_batch) {
            cuda::launch_norm_dense_rows(dtype, x.data_ptr(), norm_pending->data_ptr(), eps, head.data_ptr(),
                                         B, H, static_cast<int>(V), gemv_rows, logits.data_ptr(), launch);
        } else {
            if (norm_pending != nullptr) {
                cuda::launch_add_rmsnorm(dtype, x.data_ptr(), nullptr, norm_pending->data_ptr(), eps, pos, B,
                                         H, h.data_ptr(), launch);
                mark("final norm");
            }
            if (lm_head_gemv) {
                linear(h, head, logits, B, launch);
            } else {
                at::Tensor logits_b = rows(logits);
                at::mm_out(logits_b, rows(h), head.t());
            }
        }
        mark("lm_head");
        auto* keys = reinterpret_cast<unsigned long long*>(argmax_keys.data_ptr<int64_t>());
        cuda::launch_argmax(dtype, logits.data_ptr(), B, static_cast<int>(V), keys,
                            argmax_done.data_ptr<int>(), greedy.data_ptr<int64_t>(),
                            device_inputs ? position.data_ptr<int>() : nullptr, launch, argmax_per_thread);
        mark("argmax");
        const cudaError_t err = cudaGetLastError();
        MOERL_CHECK(err == cudaSuccess, "decode step kernels failed to launch: ", cudaGetErrorString(err));
    }

    // Large batches: tokens sorted by expert (the routing's slot lists), one grouped GEMM per
    // projection on the tensor cores, results scattered back to their slots. Capturable: every
    // size is fixed by the bucket; slots past the routed total go to y's spare last row.
    void experts_grouped(int B, const LayerWeights& w) {
#ifdef MOERL_HAVE_GROUPED_MM
        const int64_t S = int64_t{B} * K;
        at::Tensor slots = expert_slots.narrow(0, 0, S).to(at::kLong);
        at::Tensor xs = h.index_select(0, at::div(slots, K, "floor"));
        at::Tensor offs = expert_offset.narrow(0, 1, E);  // cumulative ends per expert
        at::Tensor g = at::_grouped_mm(xs, w.experts_gate.transpose(-2, -1), offs);
        at::Tensor u = at::_grouped_mm(xs, w.experts_up.transpose(-2, -1), offs);
        at::Tensor o = at::_grouped_mm(at::silu(g) * u, w.experts_down.transpose(-2, -1), offs);
        at::Tensor routed = at::arange(S, slots.options()) < expert_offset.narrow(0, E, 1).to(at::kLong);
        at::Tensor dst = at::where(routed, slots, at::full({}, y.size(0) - 1, slots.options()));
        y.index_copy_(0, dst, o.to(at::kFloat));
#else
        (void)B;
        (void)w;
        MOERL_FAIL("grouped expert GEMM needs LibTorch >= 2.8");
#endif
    }

    // Where a step reads its tokens: `greedy` (the last step's choice, fed back) or `tokens`.
    const int64_t* token_source(bool fed_back) { return (fed_back ? greedy : tokens).data_ptr<int64_t>(); }

    // Replays the graph of bucket B with the tokens of `greedy` (fed_back) or `tokens`, capturing it
    // first (after one eager warm-up on the capture stream, which also creates the cuBLAS state the
    // capture needs).
    void replay(int B, bool fed_back) {
        const int64_t* token_ids = token_source(fed_back);
        auto it = graphs.find({B, fed_back});
        if (it == graphs.end()) {
            at::cuda::CUDAStream caller = at::cuda::getCurrentCUDAStream();
            at::cuda::CUDAStream side = at::cuda::getStreamFromPool();
            at::cuda::CUDAEvent ready;
            ready.record(caller);
            ready.block(side);
            auto graph = std::make_unique<at::cuda::CUDAGraph>();
            {
                c10::cuda::CUDAStreamGuard guard(side);
                // This step's results; the capture below records the launches without running them.
                run_step(B, token_ids);
                graph->capture_begin();
                run_step(B, token_ids);
                graph->capture_end();
            }
            at::cuda::CUDAEvent done;
            done.record(side);
            done.block(caller);
            graphs.emplace(std::make_pair(B, fed_back), std::move(graph));
            return;
        }
        it->second->replay();
    }

    int bucket_for(int n) const {
        for (int b : buckets)
            if (b >= n) return b;
        return buckets.back();
    }

    // Gives the slot one more cache block (its next block-table entry); the callers have checked
    // that enough blocks are free.
    int add_block(int slot) {
        MOERL_CHECK(!free_list.empty(), "KV cache out of blocks: all ", num_blocks - 1,
                    " blocks are in use (raise GeneratorOptions::num_blocks or release sequences)");
        const int b = free_list.back();
        free_list.pop_back();
        table_host.data_ptr<int>()[static_cast<int64_t>(slot) * max_blocks + slot_blocks[slot].size()] = b;
        slot_blocks[slot].push_back(b);
        table_dirty = true;
        return b;
    }

    void check_slot(int s, const char* what) const {
        MOERL_CHECK(s >= 0 && s < opt.max_batch, what, ": slot ", s, " is out of range [0, ", opt.max_batch,
                    ")");
        MOERL_CHECK(length[s] >= 0, what, ": slot ", s, " is not acquired");
    }

    void upload_table() {
        if (!table_dirty) return;
        table.copy_(table_host.pin_memory(), /*non_blocking=*/true);
        table_dirty = false;
    }
};

Generator::Generator(const MoeModel& model, const GeneratorOptions& options)
    : impl_(std::make_unique<Impl>(model, *model.impl_, options)) {
    Impl& g = *impl_;
    const MoeModel::Impl& m = g.m;
    const ModelConfig& c = m.config;
    MOERL_CHECK(m.options.device.is_cuda(), "Generator: the model is on ", m.options.device,
                ", the generation engine needs a CUDA device");
    MOERL_CHECK(m.options.ep == nullptr,
                "Generator: the model shards its experts over an EP group; the generation "
                "engine needs every expert on this device");
    MOERL_CHECK(m.options.dtype == at::kFloat || m.options.dtype == at::kBFloat16, "Generator: model dtype ",
                m.options.dtype, " is not supported (float32 or bfloat16)");
    MOERL_CHECK(options.max_batch >= 1 && options.max_batch <= 1024,
                "Generator: max_batch = ", options.max_batch, ", expected 1..1024");
    MOERL_CHECK(options.max_seq_len >= 1, "Generator: max_seq_len = ", options.max_seq_len,
                ", expected >= 1");
    MOERL_CHECK(options.block_size >= 1, "Generator: block_size = ", options.block_size, ", expected >= 1");
    g.dtype = m.options.dtype == at::kFloat ? 0 : 1;
    g.profile = !options.cuda_graphs && env::get_int("MOERL_GENERATOR_PROFILE", 0) != 0;
#ifdef MOERL_HAVE_GROUPED_MM
    g.use_grouped_mm = g.dtype == 1;
#endif
    g.H = c.hidden_size, g.Hq = c.num_attention_heads, g.Hkv = c.num_key_value_heads, g.D = c.head_dim;
    g.E = c.num_experts, g.K = c.num_experts_per_tok, g.I = c.moe_intermediate_size, g.V = c.vocab_size;
    const int64_t vec = g.dtype == 0 ? 4 : 8;  // elements per 16 bytes
    MOERL_CHECK(g.H % 8 == 0 && g.I % 8 == 0 && g.D % 8 == 0, "Generator: hidden_size ", g.H,
                ", moe_intermediate_size ", g.I, " and head_dim ", g.D, " must be multiples of 8");
    MOERL_CHECK(g.H % vec == 0, "Generator: hidden_size must be a multiple of ", vec);
    MOERL_CHECK(g.H <= cuda::kMaxHidden, "Generator: hidden_size ", g.H, " is above the ", cuda::kMaxHidden,
                " the row kernels hold");
    MOERL_CHECK(g.D % 2 == 0 && g.D <= cuda::kMaxHeadDim, "Generator: head_dim ", g.D,
                " must be even and <= ", cuda::kMaxHeadDim);
    MOERL_CHECK(cuda::attention_group_supported(static_cast<int>(g.Hq / g.Hkv)), "Generator: ", g.Hq,
                " query heads per ", g.Hkv, " key-value heads = groups of ", g.Hq / g.Hkv,
                "; supported: 1, 2, 4, 8, 16");
    MOERL_CHECK(c.num_moe_layers() == 0 || (g.E <= cuda::kMaxExperts && g.K <= 32), "Generator: ", g.E,
                " experts, top-", g.K, "; supported: up to ", cuda::kMaxExperts, " experts, top-k <= 32");

    c10::cuda::CUDAGuard device_guard(g.device);
    g.max_blocks = static_cast<int>((options.max_seq_len + options.block_size - 1) / options.block_size);
    // Block 0 is never handed out: padding rows of a bucket point at it.
    g.num_blocks =
        options.num_blocks > 0 ? options.num_blocks + 1 : int64_t{options.max_batch} * g.max_blocks + 1;
    for (int b = static_cast<int>(g.num_blocks) - 1; b >= 1; --b) g.free_list.push_back(b);
    g.length.assign(options.max_batch, -1);
    g.slot_blocks.resize(options.max_batch);
    g.buckets = bucket_sizes(options.max_batch);

    auto t = at::TensorOptions().device(g.device).dtype(m.options.dtype);
    auto i32 = t.dtype(at::kInt);
    for (size_t l = 0; l < m.layers.size(); ++l) {
        g.k_pool.push_back(at::zeros({g.num_blocks, options.block_size, g.Hkv, g.D}, t));
        g.v_pool.push_back(at::zeros_like(g.k_pool.back()));
    }
    g.fuse_qkv();
    g.table_host = at::zeros({options.max_batch, g.max_blocks}, at::TensorOptions().dtype(at::kInt));
    const int64_t B = options.max_batch;
    g.tokens = at::zeros({B}, t.dtype(at::kLong));
    g.position = at::full({B}, -1, i32);
    g.slot = at::zeros({B}, i32);
    g.table = at::zeros({B, g.max_blocks}, i32);
    g.x = at::zeros({B, g.H}, t);
    g.h = at::zeros({B, g.H}, t);
    g.qkv = at::zeros({B, (g.Hq + 2 * g.Hkv) * g.D}, t);
    g.q = at::zeros({B, g.Hq * g.D}, t);
    g.attn = at::zeros({B, g.Hq * g.D}, t);
    g.attn_partial =
        at::zeros({B * g.Hkv * cuda::attention_partial_splits(g.max_blocks * options.block_size) *
                   (g.Hq / g.Hkv) * (g.D + 2)},
                  t.dtype(at::kFloat));
    g.attn_split_done = at::zeros({B * g.Hq}, i32);
    g.o = at::zeros({B, g.H}, t);
    g.router_logits = at::zeros({B, std::max<int64_t>(g.E, 1)}, t);
    g.act = at::zeros({B * g.K, g.I}, t);
    g.y = at::zeros({B * g.K + 1, g.H}, t.dtype(at::kFloat));  // + a spare row for unrouted slots
    g.logits = at::zeros({B, g.V}, t);
    g.greedy = at::zeros({B}, t.dtype(at::kLong));
    g.argmax_keys = at::zeros({B}, t.dtype(at::kLong));
    g.argmax_done = at::zeros({B}, i32);
    g.device_position.assign(B, -1);
    g.device_slot.assign(B, 0);
    g.fused_done = at::zeros({cuda::fused_rows_done_counters(g.H)}, i32);
    g.topk_idx = at::zeros({B * g.K}, i32);
    g.topk_weights = at::zeros({B * g.K}, t.dtype(at::kFloat));
    g.expert_offset = at::zeros({g.E + 1}, i32);
    g.active_experts = at::zeros({std::max<int64_t>(g.E, 1)}, i32);
    g.num_active = at::zeros({1}, i32);
    g.expert_slots = at::zeros({B * g.K}, i32);
    g.experts_read = at::zeros({1}, t.dtype(at::kLong));
}

Generator::~Generator() = default;

bool Generator::available() { return true; }

int Generator::acquire() {
    Impl& g = *impl_;
    for (int s = 0; s < g.opt.max_batch; ++s)
        if (g.length[s] < 0) {
            g.length[s] = 0;
            return s;
        }
    return -1;
}

void Generator::release(int slot) {
    Impl& g = *impl_;
    g.check_slot(slot, "release");
    for (int b : g.slot_blocks[slot]) g.free_list.push_back(b);
    g.slot_blocks[slot].clear();
    g.length[slot] = -1;
}

int64_t Generator::length(int slot) const {
    const Impl& g = *impl_;
    MOERL_CHECK(slot >= 0 && slot < g.opt.max_batch, "length: slot ", slot, " is out of range [0, ",
                g.opt.max_batch, ")");
    return g.length[slot];
}

int64_t Generator::free_blocks() const { return static_cast<int64_t>(impl_->free_list.size()); }

GenerationStep Generator::prefill(const std::vector<int>& slots,
                                  const std::vector<std::vector<int64_t>>& prompts) {
    Impl& g = *impl_;
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(g.device);
    MOERL_CHECK(slots.size() == prompts.size(), "prefill: ", slots.size(), " slots but ", prompts.size(),
                " prompts");
    MOERL_CHECK(!slots.empty(), "prefill: no sequences");
    const int64_t n = static_cast<int64_t>(slots.size());
    int64_t longest = 0, needed_blocks = 0;
    for (int64_t i = 0; i < n; ++i) {
        g.check_slot(slots[i], "prefill");
        MOERL_CHECK(g.length[slots[i]] == 0, "prefill: slot ", slots[i], " already holds ",
                    g.length[slots[i]], " tokens (release it first)");
        const int64_t len = static_cast<int64_t>(prompts[i].size());
        MOERL_CHECK(len >= 1, "prefill: prompt ", i, " is empty");
        MOERL_CHECK(len < g.opt.max_seq_len, "prefill: prompt ", i, " has ", len,
                    " tokens, but max_seq_len = ", g.opt.max_seq_len, " leaves no room to generate");
        for (int64_t tok : prompts[i])
            MOERL_CHECK(tok >= 0 && tok < g.V, "prefill: prompt ", i, " holds token id ", tok,
                        ", but vocab_size = ", g.V);
        longest = std::max(longest, len);
        needed_blocks += (len + g.opt.block_size - 1) / g.opt.block_size;
    }
    MOERL_CHECK(needed_blocks <= static_cast<int64_t>(g.free_list.size()), "prefill: the prompts need ",
                needed_blocks, " KV-cache blocks, ", g.free_list.size(), " are free");

    // Eager prefill of the new sequences, left-padded, into a contiguous cache...
    at::Tensor ids = at::zeros({n, longest}, at::kLong), mask = at::zeros({n, longest}, at::kLong);
    int64_t* ids_p = ids.data_ptr<int64_t>();
    int64_t* mask_p = mask.data_ptr<int64_t>();
    std::vector<int64_t> src, dst;  // token rows of the contiguous cache -> cache slots of the pool
    for (int64_t i = 0; i < n; ++i) {
        const int64_t len = static_cast<int64_t>(prompts[i].size()), pad = longest - len;
        const int s = slots[i];
        for (int64_t j = 0; j < len; ++j) {
            ids_p[i * longest + pad + j] = prompts[i][j];
            mask_p[i * longest + pad + j] = 1;
            if (j % g.opt.block_size == 0) g.add_block(s);
            src.push_back(i * longest + pad + j);
            dst.push_back(int64_t{g.slot_blocks[s].back()} * g.opt.block_size + j % g.opt.block_size);
        }
        g.length[s] = len;
    }
    KvCache cache = g.model.new_cache(n, longest);
    StepOutput out = g.model.prefill(cache, ids, mask);
    // ...then its keys and values into the blocks.
    at::Tensor src_t = at::tensor(src, at::kLong).to(g.device),
               dst_t = at::tensor(dst, at::kLong).to(g.device);
    for (size_t l = 0; l < g.k_pool.size(); ++l) {
        auto move = [&](const at::Tensor& contiguous, at::Tensor& pool) {
            at::Tensor rows =
                contiguous.permute({0, 2, 1, 3}).reshape({n * longest, g.Hkv, g.D}).index_select(0, src_t);
            pool.view({g.num_blocks * g.opt.block_size, g.Hkv, g.D}).index_copy_(0, dst_t, rows);
        };
        move(cache.keys[l], g.k_pool[l]);
        move(cache.values[l], g.v_pool[l]);
    }
    GenerationStep step;
    step.logits = out.logits.to(g.m.options.dtype);
    step.greedy = out.logits.argmax(-1);
    return step;
}

GenerationStep Generator::decode(const std::vector<int>& slots, const at::Tensor& tokens) {
    Impl& g = *impl_;
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(g.device);
    const int n = static_cast<int>(slots.size());
    MOERL_CHECK(n >= 1 && n <= g.opt.max_batch, "decode: ", n, " sequences, expected 1..", g.opt.max_batch);
    MOERL_CHECK(tokens.dim() == 1 && tokens.size(0) == n, "decode: tokens has shape ", tokens.sizes(),
                ", expected [", n, "]");
    const int B = g.opt.cuda_graphs ? g.bucket_for(n) : n;
    std::vector<bool> seen(g.opt.max_batch, false);
    for (int i = 0; i < n; ++i) {
        const int s = slots[i];
        g.check_slot(s, "decode");
        MOERL_CHECK(!seen[s], "decode: slot ", s, " is listed twice");
        seen[s] = true;
        const int64_t len = g.length[s];
        MOERL_CHECK(len >= 1, "decode: slot ", s, " has no prompt (prefill it first)");
        MOERL_CHECK(len < g.opt.max_seq_len, "decode: slot ", s,
                    " is full (max_seq_len = ", g.opt.max_seq_len, ")");
    }
    // The last step's greedy tokens, fed back as they are (or as the caller changed them in place):
    // the embedding reads them where they lie.
    const bool fed_back = g.device_inputs && tokens.is_cuda() && tokens.scalar_type() == at::kLong &&
                          tokens.is_contiguous() && tokens.data_ptr() == g.greedy.data_ptr();
    // Host tokens are checked here; device tokens (typically this generator's own greedy output) are
    // clamped to the vocabulary by the embedding kernel instead of costing a synchronisation.
    if (tokens.is_cpu()) {
        const at::Tensor ids64 = tokens.to(at::kLong);
        const int64_t* p = ids64.data_ptr<int64_t>();
        for (int i = 0; i < n; ++i)
            MOERL_CHECK(p[i] >= 0 && p[i] < g.V, "decode: tokens[", i, "] = ", p[i],
                        ", but vocab_size = ", g.V);
    }
    int64_t new_blocks = 0;
    for (int i = 0; i < n; ++i) new_blocks += g.length[slots[i]] % g.opt.block_size == 0;
    MOERL_CHECK(new_blocks <= static_cast<int64_t>(g.free_list.size()),
                "KV cache out of blocks: this step needs ", new_blocks, " new blocks, ", g.free_list.size(),
                " of ", g.num_blocks - 1,
                " are free (raise GeneratorOptions::num_blocks or release sequences)");
    std::vector<int> pos(B, -1), slot_of_row(B, 0);
    for (int i = 0; i < n; ++i) {
        const int s = slots[i];
        const int64_t len = g.length[s];
        if (len % g.opt.block_size == 0) g.add_block(s);
        pos[i] = static_cast<int>(len);
        slot_of_row[i] = s;
    }
    if (!fed_back) {
        at::Tensor ids = tokens.to(g.device, at::kLong);
        g.tokens.narrow(0, 0, n).copy_(ids);
        if (B > n) g.tokens.narrow(0, n, B - n).zero_();
    }
    const bool same_rows = g.device_inputs && std::equal(pos.begin(), pos.end(), g.device_position.begin()) &&
                           std::equal(slot_of_row.begin(), slot_of_row.end(), g.device_slot.begin());
    if (!same_rows) {
        at::Tensor meta = at::empty({2, B}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
        std::copy(pos.begin(), pos.end(), meta[0].data_ptr<int>());
        std::copy(slot_of_row.begin(), slot_of_row.end(), meta[1].data_ptr<int>());
        g.position.narrow(0, 0, B).copy_(meta[0], /*non_blocking=*/true);
        g.slot.narrow(0, 0, B).copy_(meta[1], /*non_blocking=*/true);
        std::copy(pos.begin(), pos.end(), g.device_position.begin());
        std::copy(slot_of_row.begin(), slot_of_row.end(), g.device_slot.begin());
    }
    g.upload_table();
    if (g.opt.cuda_graphs)
        g.replay(B, fed_back);
    else {
        g.run_step(B, g.token_source(fed_back));
        g.collect_profile();
    }
    if (g.device_inputs)  // the argmax kernel moved the rows on
        for (int i = 0; i < B; ++i) g.device_position[i] += g.device_position[i] >= 0;
    for (int i = 0; i < n; ++i) {
        g.host_stats.kv_tokens_read += g.length[slots[i]] + 1;
        ++g.length[slots[i]];
    }
    ++g.host_stats.decode_steps;
    g.host_stats.decode_rows += n;
    return {g.logits.narrow(0, 0, n), g.greedy.narrow(0, 0, n)};
}

void Generator::refresh_weights() {
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(impl_->device);
    impl_->fuse_qkv();
}

GeneratorStats Generator::stats() const {
    GeneratorStats s = impl_->host_stats;
    s.expert_weight_reads = impl_->experts_read.item<int64_t>();
    return s;
}

void Generator::reset_stats() {
    impl_->host_stats = {};
    impl_->experts_read.zero_();
    impl_->profile_ms.clear();
}

std::vector<std::pair<std::string, double>> Generator::profile() const {
    return {impl_->profile_ms.begin(), impl_->profile_ms.end()};
}

int64_t Generator::dense_bytes_per_step() const {
    const Impl& g = *impl_;
    int64_t bytes = 0;
    for (const auto& p : g.m.params) {
        if (p.expert) continue;
        if (p.tensor.data_ptr() == g.m.embed.data_ptr() && !g.m.config.tie_word_embeddings)
            continue;  // B rows only
        bytes += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
    }
    return bytes;
}

int64_t Generator::expert_bytes() const {
    const Impl& g = *impl_;
    return 3 * g.H * g.I * static_cast<int64_t>(at::elementSize(g.m.options.dtype));
}

int64_t Generator::kv_bytes_per_token() const {
    const Impl& g = *impl_;
    return 2 * static_cast<int64_t>(g.k_pool.size()) * g.Hkv * g.D *
           static_cast<int64_t>(at::elementSize(g.m.options.dtype));
}

#else  // no CUDA engine in this build

struct Generator::Impl {};

namespace {
[[noreturn]] void unavailable() {
    MOERL_FAIL(
        "Generator: this build has no CUDA generation engine (it needs LibTorch with CUDA and the CUDA "
        "toolkit at configure time)");
}
}  // namespace

Generator::Generator(const MoeModel&, const GeneratorOptions&) { unavailable(); }
Generator::~Generator() = default;
bool Generator::available() { return false; }
int Generator::acquire() { unavailable(); }
void Generator::release(int) { unavailable(); }
int64_t Generator::length(int) const { unavailable(); }
int64_t Generator::free_blocks() const { unavailable(); }
GenerationStep Generator::prefill(const std::vector<int>&, const std::vector<std::vector<int64_t>>&) {
    unavailable();
}
GenerationStep Generator::decode(const std::vector<int>&, const at::Tensor&) { unavailable(); }
void Generator::refresh_weights() { unavailable(); }
GeneratorStats Generator::stats() const { unavailable(); }
std::vector<std::pair<std::string, double>> Generator::profile() const { unavailable(); }
void Generator::reset_stats() { unavailable(); }
int64_t Generator::dense_bytes_per_step() const { unavailable(); }
int64_t Generator::expert_bytes() const { unavailable(); }
int64_t Generator::kv_bytes_per_token() const { unavailable(); }

#endif

}  // namespace moerl::model
