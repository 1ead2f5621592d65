// The CUDA generation engine (generator.hpp): slots and their cache blocks, prefill through the
// model's eager path, decode steps replayed from graphs (step_graphs.hpp) or launched eagerly
// (decode_step.hpp). Built when LibTorch has CUDA; generator_unavailable.cpp otherwise.
#include "moerl/model/generator.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cuda/decode_kernels.hpp"
#include "decode_step.hpp"
#include "kv_block_pool.hpp"
#include "model_impl.hpp"
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
    MOERL_CHECK(needed_blocks <= g.blocks.free_blocks(), "prefill: the prompts need ", needed_blocks,
                " KV-cache blocks, ", g.blocks.free_blocks(), " are free");

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
            if (j % g.opt.block_size == 0) g.blocks.add_block(s);
            src.push_back(i * longest + pad + j);
            dst.push_back(int64_t{g.blocks.last_block(s)} * g.opt.block_size + j % g.opt.block_size);
        }
        g.length[s] = len;
    }
    KvCache cache = g.model.new_cache(n, longest);
    StepOutput out = g.model.prefill(cache, ids, mask, g.opt.record_routing);
    // ...then its keys and values into the blocks.
    const int64_t Hkv = g.m.config.num_key_value_heads, D = g.m.config.head_dim;
    at::Tensor src_t = at::tensor(src, at::kLong).to(g.device),
               dst_t = at::tensor(dst, at::kLong).to(g.device);
    for (size_t l = 0; l < g.step.k_pool.size(); ++l) {
        auto move = [&](const at::Tensor& contiguous, at::Tensor& pool) {
            at::Tensor rows =
                contiguous.permute({0, 2, 1, 3}).reshape({n * longest, Hkv, D}).index_select(0, src_t);
            pool.view({g.blocks.num_blocks() * g.opt.block_size, Hkv, D}).index_copy_(0, dst_t, rows);
        };
        move(cache.keys[l], g.step.k_pool[l]);
        move(cache.values[l], g.step.v_pool[l]);
    }
    GenerationStep step;
    step.logits = out.logits.to(g.m.options.dtype);
    step.greedy = out.logits.argmax(-1);
    if (g.opt.record_routing) step.routing = out.routing;
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

void Generator::idle_step() {
    Impl& g = *impl_;
    MOERL_CHECK(g.opt.ep != nullptr, "idle_step: the generator holds every expert (no GeneratorOptions::ep)");
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(g.device);
    g.step.idle_ep();
}

void Generator::refresh_weights() {
    c10::NoGradGuard no_grad;
    c10::cuda::CUDAGuard device_guard(impl_->device);
    impl_->step.fuse_qkv();
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
    const ModelConfig& c = impl_->m.config;
    return 3 * int64_t{c.hidden_size} * c.moe_intermediate_size *
           static_cast<int64_t>(at::elementSize(impl_->m.options.dtype));
}

int64_t Generator::kv_bytes_per_token() const {
    const Impl& g = *impl_;
    return 2 * static_cast<int64_t>(g.step.k_pool.size()) * g.m.config.num_key_value_heads *
           g.m.config.head_dim * static_cast<int64_t>(at::elementSize(g.m.options.dtype));
}

}  // namespace moerl::model
