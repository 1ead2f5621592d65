// The CUDA generation engine (generator.hpp): slots and their cache blocks, prefill through the
// model's eager path, decode steps replayed from graphs (step_graphs.hpp) or launched eagerly
// (decode_step.hpp). Built when LibTorch has CUDA; generator_unavailable.cpp otherwise.
#include "moerl/model/generator.hpp"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <limits>
#include <map>

#include "cuda/decode_kernels.hpp"
#include "decode_step.hpp"
#include "kv_block_pool.hpp"
#include "model_impl.hpp"
#include "moerl/core/cuda_check.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "step_graphs.hpp"

namespace moerl::model {

namespace {

std::vector<int> bucket_sizes(int max_batch) {
    std::vector<int> out;
    for (int b = 1; b < max_batch; b *= 2) out.push_back(b);
    out.push_back(max_batch);
    return out;
}

int max_blocks_of(const GeneratorOptions& o) { return (o.max_seq_len + o.block_size - 1) / o.block_size; }

// Block 0 is never handed out: padding rows of a bucket point at it.
int64_t num_blocks_of(const GeneratorOptions& o) {
    return o.num_blocks > 0 ? o.num_blocks + 1 : int64_t{o.max_batch} * max_blocks_of(o) + 1;
}

}  // namespace

struct Generator::Impl {
    const MoeModel& model;
    const MoeModel::Impl& m;
    const GeneratorOptions opt;
    const at::Device device;
    const int64_t V;
    const std::vector<int> buckets;
    KvBlockPool blocks;
    std::vector<int64_t> length;  // cached tokens of each slot, -1 = free slot
    DecodeStep step;
    StepGraphs graphs;
    // What `position` and `slot` hold on the device, as far as the host knows: a step leaves its
    // rows' positions one token on, so a step continuing the same rows uploads nothing.
    std::vector<int> device_position, device_slot;
    GeneratorStats host_stats;
    // Steps of queue_step, oldest at queue_head. Each owns pinned host buffers that its copies read
    // (uniforms) and write (draws, routing): reused only after collect_step waited for the step.
    struct QueuedStep {
        int n = 0;
        at::Tensor uniforms;  // [max_batch] double, pinned
        at::Tensor draws;     // [2 max_batch] double, pinned: n tokens, then n log-probabilities
        at::Tensor routing;   // [max_batch, moe layers, K] int16, pinned
        at::Tensor tokens;    // [max_batch] int64 on the device: the draws as the next step's input
        at::cuda::CUDAEvent copied;
    };
    std::array<QueuedStep, 2> queue;
    int queue_head = 0, queue_count = 0;
    // The i-th queued step from the oldest (i = queue_count: the next one to queue).
    QueuedStep& queued(int i) { return queue[(queue_head + i) % queue.size()]; }
    const QueuedStep& queued(int i) const { return queue[(queue_head + i) % queue.size()]; }

    Impl(const MoeModel& owner, const MoeModel::Impl& weights, const GeneratorOptions& o)
        : model(owner),
          m(weights),
          opt(o),
          device(weights.options.device),
          V(weights.config.vocab_size),
          buckets(bucket_sizes(o.max_batch)),
          blocks(o.max_batch, max_blocks_of(o), num_blocks_of(o)),
          length(o.max_batch, -1),
          step(weights, o, max_blocks_of(o), num_blocks_of(o)),
          device_position(o.max_batch, -1),
          device_slot(o.max_batch, 0) {}

    // Refuses what the engine does not support, naming it.
    static void check_supported(const MoeModel::Impl& m, const GeneratorOptions& o) {
        const ModelConfig& c = m.config;
        MOERL_CHECK(m.options.device.is_cuda(), "Generator: the model is on ", m.options.device,
                    ", the generation engine needs a CUDA device");
        MOERL_CHECK(m.options.ep == nullptr || o.ep != nullptr,
                    "Generator: the model shards its experts over an EP group; give the generation "
                    "engine a low-latency buffer of that group (GeneratorOptions::ep)");
        if (o.ep != nullptr) {
            const ep::Config& d = o.ep->config();
            MOERL_CHECK(m.options.ep != nullptr,
                        "Generator: GeneratorOptions::ep is set, but the model holds "
                        "every expert (no ModelOptions::ep for the prefill)");
            const ep::Config& p = m.options.ep->config();
            MOERL_CHECK(o.ep->on_device(), "Generator: the decode EP buffer uses the ",
                        o.ep->transport_name(),
                        " transport; decode steps need a device transport (cuda or nccl)");
            MOERL_CHECK(d.world_size == p.world_size && d.rank == p.rank,
                        "Generator: the decode EP buffer is rank ", d.rank, " of ", d.world_size,
                        ", the model's is rank ", p.rank, " of ", p.world_size);
            MOERL_CHECK(d.num_experts == m.config.num_experts && d.hidden == m.config.hidden_size &&
                            d.top_k == m.config.num_experts_per_tok,
                        "Generator: the decode EP buffer has ", d.num_experts, " experts, hidden ", d.hidden,
                        ", top-", d.top_k, "; the model ", m.config.num_experts, ", ", m.config.hidden_size,
                        ", top-", m.config.num_experts_per_tok);
            MOERL_CHECK(
                (d.dtype == ep::DType::kFloat32) == (m.options.dtype == at::kFloat) && !d.fp8_dispatch,
                "Generator: the decode EP buffer moves ", ep::dtype_name(d.dtype), ", the model computes in ",
                m.options.dtype);
            MOERL_CHECK(
                d.low_latency && d.max_tokens_per_rank >= o.max_batch,
                "Generator: the decode EP buffer needs low_latency and max_tokens_per_rank >= max_batch (",
                o.max_batch, "), got ", d.max_tokens_per_rank);
        }
        MOERL_CHECK(m.options.dtype == at::kFloat || m.options.dtype == at::kBFloat16,
                    "Generator: model dtype ", m.options.dtype, " is not supported (float32 or bfloat16)");
        MOERL_CHECK(o.max_batch >= 1 && o.max_batch <= 1024, "Generator: max_batch = ", o.max_batch,
                    ", expected 1..1024");
        MOERL_CHECK(o.max_seq_len >= 1, "Generator: max_seq_len = ", o.max_seq_len, ", expected >= 1");
        MOERL_CHECK(o.block_size >= 1, "Generator: block_size = ", o.block_size, ", expected >= 1");
        MOERL_CHECK(o.prefill_chunk_tokens >= 1, "Generator: prefill_chunk_tokens = ", o.prefill_chunk_tokens,
                    ", expected >= 1");
        MOERL_CHECK(
            !(o.profile && o.cuda_graphs),
            "Generator: profile needs eager steps (cuda_graphs = false); graphs replay without the events");
        const int64_t H = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads,
                      D = c.head_dim;
        const int64_t E = c.num_experts, K = c.num_experts_per_tok, I = c.moe_intermediate_size;
        const int64_t vec = m.options.dtype == at::kFloat ? 4 : 8;  // elements per 16 bytes
        MOERL_CHECK(H % 8 == 0 && I % 8 == 0 && D % 8 == 0, "Generator: hidden_size ", H,
                    ", moe_intermediate_size ", I, " and head_dim ", D, " must be multiples of 8");
        MOERL_CHECK(H % vec == 0, "Generator: hidden_size must be a multiple of ", vec);
        MOERL_CHECK(H <= cuda::kMaxHidden, "Generator: hidden_size ", H, " is above the ", cuda::kMaxHidden,
                    " the row kernels hold");
        MOERL_CHECK(D % 2 == 0 && D <= cuda::kMaxHeadDim, "Generator: head_dim ", D,
                    " must be even and <= ", cuda::kMaxHeadDim);
        MOERL_CHECK(cuda::attention_group_supported(static_cast<int>(Hq / Hkv)), "Generator: ", Hq,
                    " query heads per ", Hkv, " key-value heads = groups of ", Hq / Hkv,
                    "; supported: 1, 2, 4, 8, 16");
        MOERL_CHECK(c.num_moe_layers() == 0 || (E <= cuda::kMaxExperts && K <= 32), "Generator: ", E,
                    " experts, top-", K, "; supported: up to ", cuda::kMaxExperts, " experts, top-k <= 32");
        if (o.fp8_kv_cache) {
            MOERL_CHECK(m.options.dtype == at::kBFloat16,
                        "Generator: fp8_kv_cache needs a bfloat16 model; this one computes in ",
                        m.options.dtype);
            MOERL_CHECK(
                cuda::attention_fp8_kv_supported(static_cast<int>(Hq), static_cast<int>(Hkv),
                                                 static_cast<int>(D)),
                "Generator: fp8_kv_cache needs 4, 8 or 16 query heads per key-value head of 64 or 128 "
                "dims (the tensor-core attention); this model has ",
                Hq, " query heads per ", Hkv, " key-value heads of ", D, " dims");
        }
        if (o.fp8_weights) {
            MOERL_CHECK(m.options.dtype == at::kBFloat16,
                        "Generator: fp8_weights needs a bfloat16 model; this one computes in ",
                        m.options.dtype);
            MOERL_CHECK(
                o.ep == nullptr,
                "Generator: fp8_weights needs every expert in this engine (GeneratorOptions::ep is set)");
            MOERL_CHECK(cuda::fp8_products_supported(static_cast<int>(H)) &&
                            cuda::fp8_products_supported(static_cast<int>(I)) &&
                            cuda::fp8_products_supported(static_cast<int>(Hq * D)),
                        "Generator: fp8_weights needs hidden_size (", H, "), moe_intermediate_size (", I,
                        ") and attention heads x head_dim (", Hq * D, ") to be multiples of 64 up to ",
                        cuda::kMaxHidden);
        }
    }

    int bucket_for(int n) const {
        for (int b : buckets)
            if (b >= n) return b;
        return buckets.back();
    }

    void check_slot(int s, const char* what) const {
        MOERL_CHECK(s >= 0 && s < opt.max_batch, what, ": slot ", s, " is out of range [0, ", opt.max_batch,
                    ")");
        MOERL_CHECK(length[s] >= 0, what, ": slot ", s, " is not acquired");
    }

    void upload_table() {
        if (blocks.take_changed()) step.table.copy_(blocks.table().pin_memory(), /*non_blocking=*/true);
    }

    // Partial last blocks to copy, pool block from[i] -> to[i], all layers.
    struct BlockCopies {
        std::vector<int64_t> from, to;
    };

    // Gives the empty slot `to` the cached tokens of slot `from`: its full blocks, shared (read-only
    // for both), and its own copy of the partial last block (queued in `copies`), the one block it
    // writes next.
    void share_prefix(int from, int to, BlockCopies& copies) {
        const int bs = opt.block_size;
        const int64_t len = length[from];
        blocks.share_blocks(from, to, static_cast<int>(len / bs));
        if (len % bs != 0) {
            copies.to.push_back(blocks.add_block(to));
            copies.from.push_back(blocks.block_of(from, static_cast<int>(len / bs)));
        }
        length[to] = len;
        host_stats.prefill_tokens_shared += len;
    }

    void copy_blocks(const BlockCopies& copies) {
        if (copies.to.empty()) return;
        const at::Tensor from_t = at::tensor(copies.from, at::kLong).to(device),
                         to_t = at::tensor(copies.to, at::kLong).to(device);
        auto copy = [&](at::Tensor& pool) { pool.index_copy_(0, to_t, pool.index_select(0, from_t)); };
        for (size_t l = 0; l < step.k_pool.size(); ++l) {
            copy(step.k_pool[l]);
            copy(step.v_pool[l]);
            if (step.k_scale.empty()) continue;
            copy(step.k_scale[l]);
            copy(step.v_scale[l]);
        }
    }

    // Where a step reads its tokens: `greedy` (the last step's choice, fed back) or `tokens`.
    const int64_t* token_source(bool fed_back) {
        return (fed_back ? step.greedy : step.tokens).data_ptr<int64_t>();
    }
};

Generator::Generator(const MoeModel& model, const GeneratorOptions& options) {
    Impl::check_supported(*model.impl_, options);
    c10::cuda::CUDAGuard device_guard(model.impl_->options.device);
    impl_ = std::make_unique<Impl>(model, *model.impl_, options);
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
    g.blocks.release(slot);
    g.length[slot] = -1;
}

int64_t Generator::length(int slot) const {
    const Impl& g = *impl_;
    MOERL_CHECK(slot >= 0 && slot < g.opt.max_batch, "length: slot ", slot, " is out of range [0, ",
                g.opt.max_batch, ")");
    return g.length[slot];
}

int64_t Generator::free_blocks() const { return impl_->blocks.free_blocks(); }

bool Generator::step_fits(const std::vector<int>& slots) const {
    const Impl& g = *impl_;
    int64_t new_blocks = 0;
    for (int s : slots) {
        g.check_slot(s, "step_fits");
        if (g.length[s] < 1 || g.length[s] >= g.opt.max_seq_len) return false;
        new_blocks += g.length[s] % g.opt.block_size == 0;
    }
    return new_blocks <= g.blocks.free_blocks();
}

int64_t Generator::shared_blocks() const { return impl_->blocks.shared_references(); }

GenerationStep Generator::prefill(const std::vector<int>& slots,
                                  const std::vector<std::vector<int64_t>>& prompts) {
    Impl& g = *impl_;
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(g.device);
    MOERL_CHECK(slots.size() == prompts.size(), "prefill: ", slots.size(), " slots but ", prompts.size(),
                " prompts");
    MOERL_CHECK(!slots.empty(), "prefill: no sequences");
    const int64_t n = static_cast<int64_t>(slots.size());
    const int bs = g.opt.block_size;
    restore_memory();
    // Identical prompts of empty slots (the samples of a GRPO group) run through the model once:
    // row_of[i] is the model row of prompt i, and leaders[r] the first prompt of row r. A slot that
    // already holds tokens (an earlier chunk of its prompt) is always a row of its own.
    std::vector<int64_t> row_of(n), cached(n);
    std::vector<int64_t> leaders;
    std::map<std::vector<int64_t>, int64_t> row_of_prompt;
    int64_t longest = 0, needed_blocks = 0;
    std::vector<bool> seen(g.opt.max_batch, false);
    for (int64_t i = 0; i < n; ++i) {
        const int s = slots[i];
        g.check_slot(s, "prefill");
        MOERL_CHECK(!seen[s], "prefill: slot ", s, " is listed twice");
        seen[s] = true;
        const int64_t have = g.length[s], len = static_cast<int64_t>(prompts[i].size());
        MOERL_CHECK(len >= 1, "prefill: prompt ", i, " is empty");
        if (have == 0)
            MOERL_CHECK(len < g.opt.max_seq_len, "prefill: prompt ", i, " has ", len,
                        " tokens, but max_seq_len = ", g.opt.max_seq_len, " leaves no room to generate");
        else
            MOERL_CHECK(have + len < g.opt.max_seq_len, "prefill: slot ", s, " holds ", have,
                        " tokens and prompt ", i, " adds ", len, ", but max_seq_len = ", g.opt.max_seq_len,
                        " leaves no room to generate");
        for (int64_t tok : prompts[i])
            MOERL_CHECK(tok >= 0 && tok < g.V, "prefill: prompt ", i, " holds token id ", tok,
                        ", but vocab_size = ", g.V);
        cached[i] = have;
        longest = std::max(longest, len);
        int64_t leader_row = -1;
        if (g.opt.share_prompts && have == 0) {
            auto [it, first] = row_of_prompt.try_emplace(prompts[i], static_cast<int64_t>(leaders.size()));
            if (!first) leader_row = it->second;
        }
        if (leader_row < 0) {
            row_of[i] = static_cast<int64_t>(leaders.size());
            leaders.push_back(i);
            needed_blocks += (have + len + bs - 1) / bs - (have + bs - 1) / bs;
        } else {
            row_of[i] = leader_row;
            needed_blocks += len % bs != 0;  // its own copy of the partial last block
        }
    }
    MOERL_CHECK(needed_blocks <= g.blocks.free_blocks(), "prefill: the prompts need ", needed_blocks,
                " KV-cache blocks, ", g.blocks.free_blocks(), " are free");

    // The rows in passes of at most opt.prefill_chunk_tokens (rows x longest new part), shortest
    // first so that a pass pads little. Each pass gathers its rows' cached tokens (if any) from the
    // blocks into a contiguous cache, runs the model's eager prefill on the new tokens, left-padded,
    // and moves their keys and values into the blocks.
    const int64_t rows = static_cast<int64_t>(leaders.size());
    std::vector<int64_t> order(rows);
    for (int64_t r = 0; r < rows; ++r) order[r] = r;
    auto len_of = [&](int64_t r) { return static_cast<int64_t>(prompts[leaders[r]].size()); };
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return len_of(x) < len_of(y); });
    const int64_t Hkv = g.m.config.num_key_value_heads, D = g.m.config.head_dim;
    const int64_t pool_tokens = g.blocks.num_blocks() * bs;
    std::vector<at::Tensor> logit_parts, routing_parts;
    for (int64_t r0 = 0; r0 < rows;) {
        int64_t r1 = r0 + 1;
        while (r1 < rows && len_of(order[r1]) * (r1 - r0 + 1) <= g.opt.prefill_chunk_tokens) ++r1;
        const int64_t pass_rows = r1 - r0, pass_len = len_of(order[r1 - 1]);
        int64_t P = 0;  // the pass's longest cached part
        for (int64_t i = 0; i < pass_rows; ++i) P = std::max(P, cached[leaders[order[r0 + i]]]);
        KvCache cache = g.model.new_cache(pass_rows, P + pass_len);
        if (P > 0) {
            // Cached tokens right-aligned in columns [0, P): pool token -> row * P + column.
            std::vector<int64_t> from, to;
            at::Tensor valid = at::zeros({pass_rows, P}, at::kBool);
            at::Tensor next_position = at::zeros({pass_rows}, at::kLong);
            for (int64_t i = 0; i < pass_rows; ++i) {
                const int64_t leader = leaders[order[r0 + i]], have = cached[leader];
                const int s = slots[leader];
                for (int64_t j = 0; j < have; ++j) {
                    from.push_back(int64_t{g.blocks.block_of(s, static_cast<int>(j / bs))} * bs + j % bs);
                    to.push_back(i * P + P - have + j);
                }
                valid[i].narrow(0, P - have, have).fill_(true);
                next_position[i] = have;
            }
            const at::Tensor from_t = at::tensor(from, at::kLong).to(g.device),
                             to_t = at::tensor(to, at::kLong).to(g.device);
            for (size_t l = 0; l < g.step.k_pool.size(); ++l) {
                // An FP8 cache's rows (scales set) come back dequantised to the model's bf16.
                auto gather = [&](const at::Tensor& pool, const float* scales, at::Tensor& contiguous) {
                    at::Tensor rows;
                    if (scales == nullptr) {
                        rows = pool.view({pool_tokens, Hkv, D}).index_select(0, from_t);
                    } else {
                        rows = at::empty({from_t.size(0), Hkv, D}, contiguous.options());
                        cuda::launch_kv_rows_from_fp8(
                            pool.data_ptr<uint8_t>(), scales, from_t.data_ptr<int64_t>(), from_t.size(0),
                            static_cast<int>(Hkv), static_cast<int>(D), rows.data_ptr(),
                            {c10::cuda::getCurrentCUDAStream().stream(), false});
                    }
                    at::Tensor flat = at::zeros({pass_rows * P, Hkv, D}, contiguous.options());
                    flat.index_copy_(0, to_t, rows);
                    contiguous.narrow(2, 0, P).copy_(flat.view({pass_rows, P, Hkv, D}).permute({0, 2, 1, 3}));
                };
                const cuda::KvScales scales = g.step.kv_scales(l);
                gather(g.step.k_pool[l], scales.k, cache.keys[l]);
                gather(g.step.v_pool[l], scales.v, cache.values[l]);
            }
            cache.key_valid.narrow(1, 0, P).copy_(valid);
            cache.next_position.copy_(next_position);
            cache.length = P;
        }
        at::Tensor ids = at::zeros({pass_rows, pass_len}, at::kLong);
        at::Tensor mask = at::zeros({pass_rows, pass_len}, at::kLong);
        int64_t* ids_p = ids.data_ptr<int64_t>();
        int64_t* mask_p = mask.data_ptr<int64_t>();
        std::vector<int64_t> src, dst;  // new token columns of the contiguous cache -> pool tokens
        for (int64_t i = 0; i < pass_rows; ++i) {
            const int64_t leader = leaders[order[r0 + i]];
            const std::vector<int64_t>& prompt = prompts[leader];
            const int64_t len = static_cast<int64_t>(prompt.size()), pad = pass_len - len,
                          have = cached[leader];
            const int s = slots[leader];
            for (int64_t j = 0; j < len; ++j) {
                ids_p[i * pass_len + pad + j] = prompt[j];
                mask_p[i * pass_len + pad + j] = 1;
                if ((have + j) % bs == 0) g.blocks.add_block(s);
                src.push_back(i * pass_len + pad + j);
                dst.push_back(int64_t{g.blocks.last_block(s)} * bs + (have + j) % bs);
            }
            g.length[s] = have + len;
        }
        StepOutput out = g.model.prefill(cache, ids, mask, g.opt.record_routing);
        const at::Tensor src_t = at::tensor(src, at::kLong).to(g.device),
                         dst_t = at::tensor(dst, at::kLong).to(g.device);
        for (size_t l = 0; l < g.step.k_pool.size(); ++l) {
            // Into an FP8 cache (scales set) as e4m3 rows and their scales.
            auto move = [&](const at::Tensor& contiguous, at::Tensor& pool, float* scales) {
                at::Tensor moved = contiguous.narrow(2, P, pass_len)
                                       .permute({0, 2, 1, 3})
                                       .reshape({pass_rows * pass_len, Hkv, D})
                                       .index_select(0, src_t);
                if (scales == nullptr) {
                    pool.view({pool_tokens, Hkv, D}).index_copy_(0, dst_t, moved);
                    return;
                }
                cuda::launch_kv_rows_to_fp8(moved.data_ptr(), dst_t.data_ptr<int64_t>(), dst_t.size(0),
                                            static_cast<int>(Hkv), static_cast<int>(D),
                                            pool.data_ptr<uint8_t>(), scales,
                                            {c10::cuda::getCurrentCUDAStream().stream(), false});
            };
            const cuda::KvScales scales = g.step.kv_scales(l);
            move(cache.keys[l], g.step.k_pool[l], scales.k);
            move(cache.values[l], g.step.v_pool[l], scales.v);
        }
        logit_parts.push_back(out.logits);
        if (g.opt.record_routing) {
            // Left-aligned to the longest prompt of the call: rows of -1 before a shorter pass.
            at::Tensor r = out.routing;
            if (pass_len < longest) {
                std::vector<int64_t> shape(r.sizes().begin(), r.sizes().end());
                shape[1] = longest - pass_len;
                r = at::cat({at::full(shape, -1, r.options()), r}, 1);
            }
            routing_parts.push_back(r);
        }
        r0 = r1;
    }
    GenerationStep step;
    // The other samples of a prompt hold its full blocks and a copy of its partial last block.
    Impl::BlockCopies copies;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t leader = leaders[row_of[i]];
        if (leader == i) continue;
        g.share_prefix(slots[leader], slots[i], copies);
        step.shared_tokens += g.length[slots[i]];
    }
    g.copy_blocks(copies);
    for (int64_t r = 0; r < rows; ++r) g.host_stats.prefill_tokens += prompts[leaders[r]].size();
    // Pass rows back to the prompts' order: prompt i is model row row_of[i], pass row place[row_of[i]].
    std::vector<int64_t> place(rows), pick(n);
    for (int64_t k = 0; k < rows; ++k) place[order[k]] = k;
    bool identity = rows == n;
    for (int64_t i = 0; i < n; ++i) {
        pick[i] = place[row_of[i]];
        identity = identity && pick[i] == i;
    }
    at::Tensor logits = logit_parts.size() == 1 ? logit_parts[0] : at::cat(logit_parts);
    at::Tensor routing;
    if (g.opt.record_routing) routing = routing_parts.size() == 1 ? routing_parts[0] : at::cat(routing_parts);
    if (!identity) {
        const at::Tensor pick_t = at::tensor(pick, at::kLong).to(logits.device());
        logits = logits.index_select(0, pick_t);
        if (g.opt.record_routing) routing = routing.index_select(0, pick_t.to(routing.device()));
    }
    step.logits = logits.to(g.m.options.dtype);
    step.greedy = logits.argmax(-1);
    if (g.opt.record_routing) step.routing = routing;
    return step;
}

void Generator::fork(int from, int to) {
    Impl& g = *impl_;
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(g.device);
    g.check_slot(from, "fork");
    g.check_slot(to, "fork");
    MOERL_CHECK(from != to, "fork: slot ", from, " cannot take its own tokens");
    MOERL_CHECK(g.length[from] >= 1, "fork: slot ", from, " holds no tokens (prefill it first)");
    MOERL_CHECK(g.length[to] == 0, "fork: slot ", to, " already holds ", g.length[to],
                " tokens (release it first)");
    const bool partial = g.length[from] % g.opt.block_size != 0;
    MOERL_CHECK(!partial || g.blocks.free_blocks() >= 1, "fork: slot ", from,
                " ends in a partial KV-cache block that slot ", to, " needs a copy of; no block is free");
    Impl::BlockCopies copies;
    g.share_prefix(from, to, copies);
    g.copy_blocks(copies);
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
    const bool fed_back = tokens.is_cuda() && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
                          tokens.data_ptr() == g.step.greedy.data_ptr();
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
    MOERL_CHECK(new_blocks <= g.blocks.free_blocks(), "KV cache out of blocks: this step needs ", new_blocks,
                " new blocks, ", g.blocks.free_blocks(), " of ", g.blocks.usable_blocks(),
                " are free (raise GeneratorOptions::num_blocks or release sequences)");
    std::vector<int> pos(B, -1), slot_of_row(B, 0);
    for (int i = 0; i < n; ++i) {
        const int s = slots[i];
        const int64_t len = g.length[s];
        if (len % g.opt.block_size == 0) g.blocks.add_block(s);
        pos[i] = static_cast<int>(len);
        slot_of_row[i] = s;
    }
    if (!fed_back) {
        at::Tensor ids = tokens.to(g.device, at::kLong);
        g.step.tokens.narrow(0, 0, n).copy_(ids);
        if (B > n) g.step.tokens.narrow(0, n, B - n).zero_();
    }
    const bool same_rows = std::equal(pos.begin(), pos.end(), g.device_position.begin()) &&
                           std::equal(slot_of_row.begin(), slot_of_row.end(), g.device_slot.begin());
    if (!same_rows) {
        at::Tensor meta = at::empty({2, B}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
        std::copy(pos.begin(), pos.end(), meta[0].data_ptr<int>());
        std::copy(slot_of_row.begin(), slot_of_row.end(), meta[1].data_ptr<int>());
        g.step.position.narrow(0, 0, B).copy_(meta[0], /*non_blocking=*/true);
        g.step.slot.narrow(0, 0, B).copy_(meta[1], /*non_blocking=*/true);
        std::copy(pos.begin(), pos.end(), g.device_position.begin());
        std::copy(slot_of_row.begin(), slot_of_row.end(), g.device_slot.begin());
    }
    g.upload_table();
    const int64_t* token_ids = g.token_source(fed_back);
    if (g.opt.cuda_graphs) {
        g.graphs.replay(B, fed_back, [&] { g.step.run(B, token_ids); });
    } else {
        g.step.run(B, token_ids);
        g.step.profiler.collect();
    }
    // The argmax kernel moved the rows on.
    for (int i = 0; i < B; ++i) g.device_position[i] += g.device_position[i] >= 0;
    for (int i = 0; i < n; ++i) {
        g.host_stats.kv_tokens_read += g.length[slots[i]] + 1;
        ++g.length[slots[i]];
    }
    ++g.host_stats.decode_steps;
    g.host_stats.decode_rows += n;
    GenerationStep step{g.step.logits.narrow(0, 0, n), g.step.greedy.narrow(0, 0, n), {}};
    if (g.opt.record_routing) step.routing = g.step.routing_record.narrow(0, 0, n).to(at::kShort);
    return step;
}

void Generator::queue_step(const std::vector<int>& slots, const at::Tensor& tokens,
                           const std::vector<double>& uniforms, double temperature) {
    Impl& g = *impl_;
    const int n = static_cast<int>(slots.size());
    MOERL_CHECK(g.queue_count < static_cast<int>(g.queue.size()), "queue_step: ", g.queue_count,
                " steps are queued already (collect_step first)");
    MOERL_CHECK(static_cast<int>(uniforms.size()) == n, "queue_step: ", uniforms.size(),
                " uniform draws for ", n, " slots");
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(g.device);
    Impl::QueuedStep& q = g.queued(g.queue_count);
    if (!q.tokens.defined()) {
        const int64_t M = g.m.config.num_moe_layers(), K = g.m.config.num_experts_per_tok;
        auto pinned = at::TensorOptions().pinned_memory(true);
        q.uniforms = at::empty({g.opt.max_batch}, pinned.dtype(at::kDouble));
        q.draws = at::empty({2 * g.opt.max_batch}, pinned.dtype(at::kDouble));
        q.routing = at::empty({g.opt.max_batch, M, K}, pinned.dtype(at::kShort));
        q.tokens = at::empty({g.opt.max_batch}, at::TensorOptions().dtype(at::kLong).device(g.device));
    }
    GenerationStep out = decode(slots, tokens);
    std::copy(uniforms.begin(), uniforms.end(), q.uniforms.data_ptr<double>());
    const at::Tensor u = q.uniforms.narrow(0, 0, n).to(g.device, /*non_blocking=*/true);
    const at::Tensor drawn = sample_on_device_async(out.logits, u, temperature);
    q.tokens.narrow(0, 0, n).copy_(drawn[0]);
    q.draws.narrow(0, 0, 2 * n).view({2, n}).copy_(drawn, /*non_blocking=*/true);
    if (g.opt.record_routing) q.routing.narrow(0, 0, n).copy_(out.routing, /*non_blocking=*/true);
    q.copied.record(c10::cuda::getCurrentCUDAStream());
    q.n = n;
    ++g.queue_count;
}

at::Tensor Generator::queued_tokens() const {
    const Impl& g = *impl_;
    MOERL_CHECK(g.queue_count > 0, "queued_tokens: no step is queued");
    const Impl::QueuedStep& q = g.queued(g.queue_count - 1);
    return q.tokens.narrow(0, 0, q.n);
}

DrawnStep Generator::collect_step() {
    Impl& g = *impl_;
    MOERL_CHECK(g.queue_count > 0, "collect_step: no step is queued");
    Impl::QueuedStep& q = g.queued(0);
    q.copied.synchronize();
    DrawnStep d;
    const double* p = q.draws.data_ptr<double>();
    d.tokens.assign(p, p + q.n);
    d.logprobs.assign(p + q.n, p + 2 * q.n);
    if (g.opt.record_routing) d.routing = q.routing.narrow(0, 0, q.n).clone();
    g.queue_head = (g.queue_head + 1) % static_cast<int>(g.queue.size());
    --g.queue_count;
    return d;
}

int Generator::queued_steps() const { return impl_->queue_count; }

void Generator::wait_queued() {
    Impl& g = *impl_;
    for (int i = 0; i < g.queue_count; ++i) g.queued(i).copied.synchronize();
}

void Generator::drop_queued() {
    wait_queued();
    impl_->queue_count = 0;
}

void Generator::idle_step() {
    Impl& g = *impl_;
    MOERL_CHECK(g.opt.ep != nullptr, "idle_step: the generator holds every expert (no GeneratorOptions::ep)");
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(g.device);
    g.step.idle_ep();
}

int64_t Generator::release_memory() {
    Impl& g = *impl_;
    DeviceRegion& cache = *g.step.cache_memory;
    DeviceRegion& copies = *g.step.weight_copies;
    const int64_t bytes = cache.held_bytes() + copies.held_bytes();
    if (bytes == 0) return 0;
    std::string holding;
    for (int s = 0; s < g.opt.max_batch; ++s)
        if (g.length[s] > 0) holding += (holding.empty() ? "" : ", ") + std::to_string(s);
    MOERL_CHECK(holding.empty(), "release_memory: slots ", holding,
                " still hold sequences in the KV cache (release them first)");
    c10::cuda::CUDAGuard device_guard(g.device);
    MOERL_CUDA_CHECK(cudaDeviceSynchronize());  // the last steps reading them
    cache.unmap();                              // no-op when already given back
    copies.unmap();
    return bytes;
}

void Generator::restore_memory() {
    Impl& g = *impl_;
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(g.device);
    if (!g.step.cache_memory->mapped()) DecodeStep::take_memory(*g.step.cache_memory);
    if (!g.step.weight_copies->mapped()) g.step.take_weights();
}

int64_t Generator::cache_memory_bytes() const { return impl_->step.cache_memory->held_bytes(); }

int64_t Generator::kept_memory_bytes() const {
    return impl_->step.buffer_bytes() + impl_->graphs.pool_bytes();
}

int64_t Generator::weight_copy_bytes() const { return impl_->step.weight_copies->held_bytes(); }

void Generator::refresh_weights() {
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(impl_->device);
    impl_->step.take_weights();
}

GeneratorStats Generator::stats() const {
    GeneratorStats s = impl_->host_stats;
    s.expert_weight_reads = impl_->step.experts_read.item<int64_t>();
    return s;
}

void Generator::reset_stats() {
    impl_->host_stats = {};
    impl_->step.experts_read.zero_();
    impl_->step.profiler.clear();
}

std::vector<std::pair<std::string, double>> Generator::profile() const {
    return impl_->step.profiler.totals();
}

int64_t Generator::dense_bytes_per_step(int rows) const {
    const Impl& g = *impl_;
    int64_t bytes = -g.step.fp8_dense_saving(rows);
    for (const auto& p : g.m.params) {
        if (p.expert) continue;
        if (p.tensor.data_ptr() == g.m.embed.data_ptr() && !g.m.config.tie_word_embeddings)
            continue;  // B rows only
        bytes += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
    }
    return bytes;
}

int64_t Generator::expert_bytes() const {
    if (impl_->opt.fp8_weights) return impl_->step.fp8_expert_bytes();
    const ModelConfig& c = impl_->m.config;
    return 3 * int64_t{c.hidden_size} * c.moe_intermediate_size *
           static_cast<int64_t>(at::elementSize(impl_->m.options.dtype));
}

int64_t Generator::kv_bytes_per_token() const {
    const Impl& g = *impl_;
    const int64_t row = g.opt.fp8_kv_cache
                            ? g.m.config.head_dim + static_cast<int64_t>(sizeof(float))
                            : g.m.config.head_dim * static_cast<int64_t>(at::elementSize(g.m.options.dtype));
    return 2 * static_cast<int64_t>(g.step.k_pool.size()) * g.m.config.num_key_value_heads * row;
}

at::Tensor sample_on_device_async(const at::Tensor& logits, const at::Tensor& uniforms, double temperature) {
    MOERL_CHECK(
        logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1 &&
            (logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat),
        "sample_on_device: logits must be [rows, vocab] bf16 or fp32 on a CUDA device, rows contiguous");
    const int64_t B = logits.size(0), V = logits.size(1);
    MOERL_CHECK(uniforms.dim() == 1 && uniforms.size(0) == B && uniforms.scalar_type() == at::kDouble &&
                    uniforms.device() == logits.device() && uniforms.is_contiguous(),
                "sample_on_device: ", uniforms.sizes(), " uniform draws (", uniforms.scalar_type(), " on ",
                uniforms.device(), ") for ", B, " rows on ", logits.device());
    MOERL_CHECK(temperature > 0, "sample_on_device: temperature must be > 0, got ", temperature);
    MOERL_CHECK(V >= 1 && V <= std::numeric_limits<int>::max(), "sample_on_device: vocabulary of ", V);
    c10::cuda::CUDAGuard guard(logits.device());
    at::Tensor out = at::empty({2, B}, logits.options().dtype(at::kDouble));
    cuda::launch_sample_rows(logits.scalar_type() == at::kFloat ? 0 : 1, logits.data_ptr(), logits.stride(0),
                             static_cast<int>(B), static_cast<int>(V), temperature,
                             uniforms.data_ptr<double>(), out.data_ptr<double>(),
                             c10::cuda::getCurrentCUDAStream().stream());
    return out;
}

at::Tensor sample_on_device(const at::Tensor& logits, const std::vector<double>& uniforms,
                            double temperature) {
    MOERL_CHECK(logits.is_cuda(), "sample_on_device: logits must be on a CUDA device");
    c10::cuda::CUDAGuard guard(logits.device());
    const at::Tensor u = at::tensor(uniforms, at::kDouble).to(logits.device());
    return sample_on_device_async(logits, u, temperature).to(at::kCPU);
}

}  // namespace moerl::model
