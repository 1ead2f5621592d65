#include "decode_step.hpp"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/version.h>

#include <algorithm>

#include "moerl/core/cuda_check.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/model/layers.hpp"

// Grouped GEMM (one kernel per projection for all experts, no host sync) from LibTorch 2.8 on.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define MOERL_HAVE_GROUPED_MM 1
#endif

namespace moerl::model {

Generator::DecodeStep::DecodeStep(const MoeModel::Impl& m, const GeneratorOptions& opt, int max_blocks,
                                  int64_t num_blocks)
    : profiler(opt.profile),
      m_(m),
      opt_(opt),
      dtype_(m.options.dtype == at::kFloat ? 0 : 1),
      H_(m.config.hidden_size),
      Hq_(m.config.num_attention_heads),
      Hkv_(m.config.num_key_value_heads),
      D_(m.config.head_dim),
      E_(m.config.num_experts),
      K_(m.config.num_experts_per_tok),
      I_(m.config.moe_intermediate_size),
      V_(m.config.vocab_size),
      max_blocks_(max_blocks) {
#ifdef MOERL_HAVE_GROUPED_MM
    use_grouped_mm_ = dtype_ == 1;
#else
    use_grouped_mm_ = false;
#endif
    auto t = at::TensorOptions().device(m.options.device).dtype(m.options.dtype);
    auto i32 = t.dtype(at::kInt);
    {
        // Every layer's pools (and scales) in one region of device memory (zeroed), 256-byte aligned each.
        const bool fp8 = opt.fp8_kv_cache;
        const at::TensorOptions pool_t = t.dtype(fp8 ? at::kByte : m.options.dtype);
        const int64_t rows = num_blocks * opt.block_size * Hkv_;
        auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
        const size_t pool_bytes =
            aligned(static_cast<size_t>(rows * D_) * at::elementSize(pool_t.dtype().toScalarType()));
        const size_t scale_bytes = fp8 ? aligned(static_cast<size_t>(rows) * sizeof(float)) : 0;
        const size_t layer_bytes = 2 * (pool_bytes + scale_bytes);
        const int device =
            m.options.device.has_index() ? m.options.device.index() : c10::cuda::current_device();
        cache_memory = std::make_unique<DeviceRegion>(
            device, m.layers.size() * layer_bytes, "the KV cache",
            "lower rollout.max_batch or rollout max_seq_len, or GeneratorOptions::num_blocks; or halve it "
            "with rollout.kv_cache_dtype: fp8");
        char* base = static_cast<char*>(cache_memory->data());
        for (size_t l = 0; l < m.layers.size(); ++l) {
            char* layer = base + l * layer_bytes;
            k_pool.push_back(at::from_blob(layer, {num_blocks, opt.block_size, Hkv_, D_}, pool_t));
            v_pool.push_back(
                at::from_blob(layer + pool_bytes, {num_blocks, opt.block_size, Hkv_, D_}, pool_t));
            if (!fp8) continue;
            const at::TensorOptions f32 = t.dtype(at::kFloat);
            k_scale.push_back(at::from_blob(layer + 2 * pool_bytes, {num_blocks, opt.block_size, Hkv_}, f32));
            v_scale.push_back(
                at::from_blob(layer + 2 * pool_bytes + scale_bytes, {num_blocks, opt.block_size, Hkv_}, f32));
        }
    }
    place_weight_copies();
    take_weights();
    const int64_t B = opt.max_batch;
    // The step's buffers of max_batch rows, counted as they are made (buffer_bytes).
    auto buffer = [this](at::Tensor made) {
        buffer_bytes_ += static_cast<int64_t>(made.nbytes());
        return made;
    };
    tokens = buffer(at::zeros({B}, t.dtype(at::kLong)));
    position = buffer(at::full({B}, -1, i32));
    slot = buffer(at::zeros({B}, i32));
    table = buffer(at::zeros({B, max_blocks}, i32));
    x_ = buffer(at::zeros({B, H_}, t));
    h_ = buffer(at::zeros({B, H_}, t));
    qkv_ = buffer(at::zeros({B, (Hq_ + 2 * Hkv_) * D_}, t));
    q_ = buffer(at::zeros({B, Hq_ * D_}, t));
    attn_ = buffer(at::zeros({B, Hq_ * D_}, t));
    attn_partial_ = buffer(at::zeros(
        {B * Hkv_ * cuda::attention_partial_splits(max_blocks * opt.block_size) * (Hq_ / Hkv_) * (D_ + 2)},
        t.dtype(at::kFloat)));
    attn_split_done_ = buffer(at::zeros({B * Hq_}, i32));
    o_ = buffer(at::zeros({B, H_}, t));
    router_logits_ = buffer(at::zeros({B, std::max<int64_t>(E_, 1)}, t));
    act_ = buffer(at::zeros({B * K_, I_}, t));
    y_ = buffer(at::zeros({B * K_, H_}, t.dtype(at::kFloat)));
    logits = buffer(at::zeros({B, V_}, t));
    greedy = buffer(at::zeros({B}, t.dtype(at::kLong)));
    argmax_keys_ = buffer(at::zeros({B}, t.dtype(at::kLong)));
    argmax_done_ = buffer(at::zeros({B}, i32));
    fused_done_ = buffer(at::zeros({cuda::fused_rows_done_counters(static_cast<int>(H_))}, i32));
    topk_idx_ = buffer(at::zeros({B * K_}, i32));
    topk_weights_ = buffer(at::zeros({B * K_}, t.dtype(at::kFloat)));
    expert_offset_ = buffer(at::zeros({E_ + 1}, i32));
    active_experts_ = buffer(at::zeros({std::max<int64_t>(E_, 1)}, i32));
    num_active_ = buffer(at::zeros({1}, i32));
    expert_slots_ = buffer(at::zeros({B * K_}, i32));
    experts_read = buffer(at::zeros({1}, t.dtype(at::kLong)));
    if (opt.record_routing)
        routing_record = buffer(at::full({B, std::max(1, m.config.num_moe_layers()), K_}, -1, i32));
    if (opt.ep != nullptr) {
        const ep::Config& c = opt.ep->config();
        ep_topk_ = buffer(at::full({B, K_}, -1, t.dtype(at::kLong)));
        ep_recv_x_ =
            buffer(at::zeros({int64_t{c.num_local_experts()} * c.low_latency_rows_per_expert(), H_}, t));
        ep_out_ = buffer(at::zeros({B, H_}, t));
    }
}

void Generator::DecodeStep::experts_over_ep(int B, const LayerWeights& w, cudaStream_t stream) {
    ep::Buffer& buffer = *opt_.ep;
    const ep::DeviceStreamScope on_this_stream(stream);
    at::Tensor topk = ep_topk_.narrow(0, 0, B);
    topk.copy_(topk_idx_.narrow(0, 0, int64_t{B} * K_).view({B, K_}));
    ep::LowLatencyOutput out;
    out.recv_x = {ep_recv_x_.data_ptr(), ep_recv_x_.size(0), H_};
    const ep::LowLatencyHandle handle =
        buffer.low_latency_dispatch({h_.data_ptr(), B, H_}, {topk.data_ptr<int64_t>(), B, K_}, out);
    // Every local expert over its whole block of rows (other ranks' rows too, when B is 0); rows
    // past its count are never read back.
    const int64_t L = w.experts_gate.size(0);
    at::Tensor xs = ep_recv_x_.view({L, -1, H_});
    at::Tensor g = at::bmm(xs, w.experts_gate.transpose(1, 2));
    at::Tensor u = at::bmm(xs, w.experts_up.transpose(1, 2));
    at::Tensor y = at::bmm(at::silu(g) * u, w.experts_down.transpose(1, 2)).contiguous();
    buffer.low_latency_combine({y.data_ptr(), y.size(0) * y.size(1), H_}, {topk.data_ptr<int64_t>(), B, K_},
                               {topk_weights_.data_ptr<float>(), B, K_}, handle, {ep_out_.data_ptr(), B, H_});
}

void Generator::DecodeStep::idle_ep() {
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    for (const LayerWeights& w : m_.layers)
        if (w.moe_index >= 0) experts_over_ep(0, w, stream);
}

void Generator::DecodeStep::record(int moe_index, int B, const cuda::Launch& launch) {
    if (!opt_.record_routing) return;
    const size_t row = static_cast<size_t>(K_) * sizeof(int);
    MOERL_CUDA_CHECK(cudaMemcpy2DAsync(routing_record.data_ptr<int>() + moe_index * K_,
                                       routing_record.stride(0) * sizeof(int), topk_idx_.data_ptr<int>(), row,
                                       row, B, cudaMemcpyDeviceToDevice, launch.stream));
}

void Generator::DecodeStep::place_weight_copies() {
    // What the copies are (tensor, sizes, element type), then their bytes, then views of the region.
    struct Copy {
        at::Tensor* into;
        std::vector<int64_t> sizes;
        at::ScalarType dtype;
    };
    std::vector<Copy> copies;
    const size_t L = m_.layers.size();
    qkv_weight_.resize(L);
    for (size_t l = 0; l < L; ++l)
        copies.push_back({&qkv_weight_[l], {(Hq_ + 2 * Hkv_) * D_, H_}, m_.options.dtype});
    if (opt_.fp8_weights) {
        auto fp8 = [&](std::vector<int64_t> sizes, Fp8Matrix& f) {
            const int64_t batch = sizes.size() == 3 ? sizes[0] : 1, rows = sizes[sizes.size() - 2],
                          cols = sizes.back();
            copies.push_back({&f.q, sizes, at::kByte});
            copies.push_back({&f.scales,
                              {batch, (rows + cuda::kFp8BlockRows - 1) / cuda::kFp8BlockRows,
                               (cols + cuda::kFp8BlockCols - 1) / cuda::kFp8BlockCols},
                              at::kFloat});
        };
        fp8_layers_.resize(L);
        for (size_t l = 0; l < L; ++l) {
            const LayerWeights& w = m_.layers[l];
            Fp8Layer& f = fp8_layers_[l];
            fp8({(Hq_ + 2 * Hkv_) * D_, H_}, f.qkv);
            fp8(w.o_proj.sizes().vec(), f.o);
            if (w.moe_index < 0) continue;
            fp8(w.experts_gate.sizes().vec(), f.gate);
            fp8(w.experts_up.sizes().vec(), f.up);
            fp8(w.experts_down.sizes().vec(), f.down);
        }
        fp8(m_.output_weight().sizes().vec(), fp8_head_);
    }
    auto bytes = [](const Copy& c) {
        int64_t n = 1;
        for (int64_t d : c.sizes) n *= d;
        return (static_cast<size_t>(n) * at::elementSize(c.dtype) + 255) / 256 * 256;
    };
    size_t total = 0;
    for (const Copy& c : copies) total += bytes(c);
    const int device =
        m_.options.device.has_index() ? m_.options.device.index() : c10::cuda::current_device();
    weight_copies = std::make_unique<DeviceRegion>(
        device, total,
        "the rollout's weight copies (the fused q/k/v projection; e4m3 with rollout.dtype fp8)",
        "rollout.dtype bf16 keeps no e4m3 copies; a smaller train.micro_batch_tokens leaves the trainer's "
        "cache smaller");
    char* next = static_cast<char*>(weight_copies->data());
    for (const Copy& c : copies) {
        *c.into = at::from_blob(next, c.sizes, at::TensorOptions().device(m_.options.device).dtype(c.dtype));
        next += bytes(c);
    }
}

void Generator::DecodeStep::take_weights() {
    if (!weight_copies->mapped()) take_memory(*weight_copies);
    for (size_t l = 0; l < m_.layers.size(); ++l) {
        const LayerWeights& w = m_.layers[l];
        at::cat_out(qkv_weight_[l], {w.q_proj.detach(), w.k_proj.detach(), w.v_proj.detach()}, 0);
    }
    if (!opt_.fp8_weights) return;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    for (size_t l = 0; l < m_.layers.size(); ++l) {
        const LayerWeights& w = m_.layers[l];
        Fp8Layer& f = fp8_layers_[l];
        quantize(qkv_weight_[l], f.qkv, stream);
        quantize(w.o_proj, f.o, stream);
        if (w.moe_index < 0) continue;
        quantize(w.experts_gate, f.gate, stream);
        quantize(w.experts_up, f.up, stream);
        quantize(w.experts_down, f.down, stream);
    }
    quantize(m_.output_weight(), fp8_head_, stream);
    MOERL_CUDA_CHECK(cudaGetLastError());
}

void Generator::DecodeStep::take_memory(DeviceRegion& region) {
    if (region.map(/*may_fail=*/true)) return;
    // What training left in LibTorch's cache goes back to the driver first.
    c10::cuda::CUDACachingAllocator::emptyCache();
    region.map();
}

void Generator::DecodeStep::quantize(const at::Tensor& w, Fp8Matrix& into, cudaStream_t stream) {
    const at::Tensor src = w.detach().contiguous();
    MOERL_CHECK(src.scalar_type() == at::kBFloat16 && (src.dim() == 2 || src.dim() == 3),
                "fp8_weights: expected bf16 weights of 2 or 3 dimensions, got ", src.scalar_type(), " ",
                src.sizes());
    const int64_t batch = src.dim() == 3 ? src.size(0) : 1, rows = src.size(-2), cols = src.size(-1);
    MOERL_CHECK(into.q.sizes() == src.sizes(), "fp8_weights: the weight ", src.sizes(),
                " changed shape since its e4m3 copy ", into.q.sizes(), " was placed");
    cuda::launch_quantize_fp8_blocks(1, src.data_ptr(), batch, rows, cols, into.q.data_ptr<uint8_t>(),
                                     into.scales.data_ptr<float>(), {stream, false});
}

int64_t Generator::DecodeStep::fp8_dense_saving(int rows) const {
    if (!opt_.fp8_weights || rows > kFp8DenseMaxRows) return 0;
    auto saving = [](const Fp8Matrix& f) { return f.q.numel() * 2 - f.q.numel() - f.scales.numel() * 4; };
    int64_t bytes = saving(fp8_head_);
    for (const Fp8Layer& f : fp8_layers_) bytes += saving(f.qkv) + saving(f.o);
    return bytes;
}

int64_t Generator::DecodeStep::fp8_expert_bytes() const {
    for (const Fp8Layer& f : fp8_layers_)
        if (f.gate.q.defined())
            return (f.gate.q.numel() + f.up.q.numel() + f.down.q.numel()) / E_ +
                   4 * (f.gate.scales.numel() + f.up.scales.numel() + f.down.scales.numel()) / E_;
    return 0;
}

cuda::MoeRouting Generator::DecodeStep::routing() const {
    return {topk_idx_.data_ptr<int>(),
            topk_weights_.data_ptr<float>(),
            expert_offset_.data_ptr<int>(),
            active_experts_.data_ptr<int>(),
            num_active_.data_ptr<int>(),
            expert_slots_.data_ptr<int>(),
            reinterpret_cast<unsigned long long*>(experts_read.data_ptr<int64_t>())};
}

void Generator::DecodeStep::linear(const at::Tensor& in, const at::Tensor& weight, at::Tensor& out, int B,
                                   const cuda::Launch& launch, const Fp8Matrix* fp8) const {
    if (fp8 != nullptr) {
        const int cols = static_cast<int>(weight.size(1)), out_rows = static_cast<int>(weight.size(0));
        // One row through q/k/v or o (a few thousand output rows): the CUDA-core GEMV, one warp a row,
        // keeps more loads in flight than the tensor-core kernel's few blocks (H200, 30B-A3B shape:
        // 6.2 and 5.3 us against 7.6 and 11.3). The LM head's 152k rows fill the GPU either way.
        if (B == 1 && out_rows <= kFp8OneRowCudaCoreMaxRows)
            cuda::launch_dense_rows_fp8(in.data_ptr(), fp8->q.data_ptr<uint8_t>(),
                                        fp8->scales.data_ptr<float>(), B, cols, out_rows, out.data_ptr(),
                                        launch);
        else
            cuda::launch_dense_fp8(in.data_ptr(), fp8->q.data_ptr<uint8_t>(), fp8->scales.data_ptr<float>(),
                                   B, cols, out_rows, out.data_ptr(), launch);
        return;
    }
    if (B <= opt_.gemv_max_batch) {
        cuda::launch_dense_rows(dtype_, in.data_ptr(), weight.data_ptr(), B, static_cast<int>(weight.size(1)),
                                static_cast<int>(weight.size(0)), out.data_ptr(), launch);
        return;
    }
    at::Tensor out_b = out.narrow(0, 0, B);
    at::mm_out(out_b, in.narrow(0, 0, B), weight.t());
}

void Generator::DecodeStep::run(int B, const int64_t* token_ids) {
    const ModelConfig& c = m_.config;
    const int H = static_cast<int>(H_), Hq = static_cast<int>(Hq_), Hkv = static_cast<int>(Hkv_),
              D = static_cast<int>(D_), E = static_cast<int>(E_), K = static_cast<int>(K_),
              I = static_cast<int>(I_), V = static_cast<int>(V_);
    // Overlapped launches only without per-kernel profiling (its events sit between the kernels).
    const cuda::Launch launch{at::cuda::getCurrentCUDAStream().stream(), !profiler.enabled()};
    const float eps = static_cast<float>(c.rms_norm_eps);
    const int* pos = position.data_ptr<int>();
    const int* slots = slot.data_ptr<int>();
    const int* tbl = table.data_ptr<int>();
    auto rows = [B](const at::Tensor& t) { return t.narrow(0, 0, B); };
    mark("start", launch);
    cuda::launch_embed_rmsnorm(dtype_, token_ids, m_.embed.data_ptr(), m_.layers[0].input_norm.data_ptr(),
                               eps, B, V, H, x_.data_ptr(), h_.data_ptr(), launch);
    mark("embed+norm", launch);
    const cuda::MoeRouting r = routing();
    const int max_active = std::min(E, B * K);
    const bool experts_grouped_mm = B >= opt_.grouped_min_batch && use_grouped_mm_;
    const bool tensor_cores = cuda::moe_tensor_cores_supported(dtype_, H, I);
    const bool gate_up_mma =
        tensor_cores && opt_.gate_up_mma_min_batch > 0 && B >= opt_.gate_up_mma_min_batch;
    const bool down_mma = tensor_cores && opt_.down_mma_min_batch > 0 && B >= opt_.down_mma_min_batch;
    // One-row steps of an MoE layer with the CUDA-core experts: add + norm, router and routing in one
    // kernel, the combine in the down experts, the norm in the next q/k/v GEMV (or the LM head): 6
    // kernels a layer with the fused q/k step. The expert kernels rank the router logits where they fit.
    // FP8 rollout: the experts always read their e4m3 copies, the dense projections up to
    // kFp8DenseMaxRows rows (past that they are a small part of a step's bytes: bf16 and cuBLAS).
    const bool fp8 = opt_.fp8_weights;
    const bool fp8_dense = fp8 && B <= kFp8DenseMaxRows;
    auto dense_fp8 = [&](const Fp8Matrix& f) { return fp8_dense ? &f : nullptr; };
    const bool fuse_moe = B == 1 && B <= opt_.gemv_max_batch && !experts_grouped_mm && !gate_up_mma &&
                          !down_mma && opt_.ep == nullptr && !fp8;
    const bool route_in_experts = cuda::moe_routed_one_row_supported(dtype_, K, I);
    int* done = fused_done_.data_ptr<int>();
    // Set when x holds the residual but h not yet its norm: the next GEMV normalises x itself.
    const at::Tensor* norm_pending = nullptr;
    for (size_t l = 0; l < m_.layers.size(); ++l) {
        const LayerWeights& w = m_.layers[l];
        const at::Tensor& next_norm = l + 1 < m_.layers.size() ? m_.layers[l + 1].input_norm : m_.final_norm;
        if (norm_pending != nullptr) {
            cuda::launch_norm_dense_rows(dtype_, x_.data_ptr(), norm_pending->data_ptr(), eps,
                                         qkv_weight_[l].data_ptr(), B, H,
                                         static_cast<int>(qkv_weight_[l].size(0)), qkv_.data_ptr(), launch);
            norm_pending = nullptr;
        } else {
            linear(h_, qkv_weight_[l], qkv_, B, launch, fp8 ? dense_fp8(fp8_layers_[l].qkv) : nullptr);
        }
        mark("qkv mm", launch);
        // Up to fused_qk_max_batch, attention normalises and rotates q and the new key itself.
        const cuda::KvScales kv_scales = this->kv_scales(l);  // an FP8 cache's scales
        cuda::QkvInput qkv_in;
        if (B <= opt_.fused_qk_max_batch) {
            qkv_in = {qkv_.data_ptr(), w.q_norm.data_ptr(), w.k_norm.data_ptr(), eps,
                      static_cast<float>(c.rope_theta)};
        } else {
            cuda::launch_qk_norm_rope_store(dtype_, qkv_.data_ptr(), w.q_norm.data_ptr(), w.k_norm.data_ptr(),
                                            eps, static_cast<float>(c.rope_theta), pos, slots, tbl,
                                            max_blocks_, opt_.block_size, B, Hq, Hkv, D, q_.data_ptr(),
                                            k_pool[l].data_ptr(), v_pool[l].data_ptr(), launch, kv_scales);
            mark("qk norm+rope+store", launch);
        }
        cuda::launch_paged_attention(dtype_, q_.data_ptr(), k_pool[l].data_ptr(), v_pool[l].data_ptr(), pos,
                                     slots, tbl, max_blocks_, opt_.block_size, B, Hq, Hkv, D,
                                     attn_partial_.data_ptr<float>(), attn_split_done_.data_ptr<int>(),
                                     attn_.data_ptr(), launch, qkv_in, kv_scales);
        mark("attention", launch);
        linear(attn_, w.o_proj, o_, B, launch, fp8 ? dense_fp8(fp8_layers_[l].o) : nullptr);
        mark("o mm", launch);
        if (w.moe_index >= 0 && fuse_moe) {
            cuda::launch_add_norm_router_route(dtype_, x_.data_ptr(), o_.data_ptr(), w.post_norm.data_ptr(),
                                               eps, pos, w.router.data_ptr(), B, H, E, K, c.norm_topk_prob,
                                               !route_in_experts, h_.data_ptr(), router_logits_.data_ptr(), r,
                                               done, launch);
            mark("add+norm+router+route", launch);
            if (route_in_experts) {
                cuda::launch_moe_gate_up_routed(dtype_, h_.data_ptr(), w.experts_gate.data_ptr(),
                                                w.experts_up.data_ptr(), router_logits_.data_ptr(), pos, r, E,
                                                K, c.norm_topk_prob, H, I, act_.data_ptr(), launch);
                mark("experts gate+up", launch);
                cuda::launch_moe_down_combine_routed(dtype_, act_.data_ptr(), w.experts_down.data_ptr(),
                                                     router_logits_.data_ptr(), pos, E, K, c.norm_topk_prob,
                                                     H, I, x_.data_ptr(), o_.data_ptr(), launch);
                mark("experts down+combine", launch);
            } else {
                cuda::launch_moe_gate_up(dtype_, h_.data_ptr(), w.experts_gate.data_ptr(),
                                         w.experts_up.data_ptr(), r, B, K, H, I, max_active, act_.data_ptr(),
                                         launch);
                mark("experts gate+up", launch);
                cuda::launch_moe_down_combine(dtype_, act_.data_ptr(), w.experts_down.data_ptr(), r, B, K, H,
                                              I, max_active, y_.data_ptr<float>(), x_.data_ptr(),
                                              o_.data_ptr(), pos, done, launch);
                mark("experts down+combine", launch);
            }
            record(w.moe_index, B, launch);
            norm_pending = &next_norm;
            continue;
        }
        cuda::launch_add_rmsnorm(dtype_, x_.data_ptr(), o_.data_ptr(), w.post_norm.data_ptr(), eps, pos, B, H,
                                 h_.data_ptr(), launch);
        mark("add+norm", launch);
        if (w.moe_index >= 0) {
            linear(h_, w.router, router_logits_, B, launch);
            mark("router mm", launch);
            cuda::launch_route(dtype_, router_logits_.data_ptr(), pos, B, E, K, c.norm_topk_prob, r, launch);
            mark("route", launch);
            if (opt_.ep != nullptr) {
                experts_over_ep(B, w, launch.stream);
                mark("experts over EP", launch);
                cuda::launch_add_rmsnorm(dtype_, x_.data_ptr(), ep_out_.data_ptr(), next_norm.data_ptr(), eps,
                                         pos, B, H, h_.data_ptr(), launch);
                mark("add+norm", launch);
                record(w.moe_index, B, launch);
                continue;
            }
            if (fp8) {
                const Fp8Layer& f = fp8_layers_[l];
                cuda::launch_moe_gate_up_fp8(h_.data_ptr(), f.gate.q.data_ptr<uint8_t>(),
                                             f.gate.scales.data_ptr<float>(), f.up.q.data_ptr<uint8_t>(),
                                             f.up.scales.data_ptr<float>(), r, B, K, H, I, max_active,
                                             act_.data_ptr(), launch);
                mark("experts gate+up", launch);
                cuda::launch_moe_down_fp8(act_.data_ptr(), f.down.q.data_ptr<uint8_t>(),
                                          f.down.scales.data_ptr<float>(), r, B, K, H, I, max_active,
                                          y_.data_ptr<float>(), launch);
                mark("experts down", launch);
            } else if (experts_grouped_mm) {
                experts_grouped(B, w, launch);
                mark("experts grouped gemm", launch);
            } else {
                if (gate_up_mma)
                    cuda::launch_moe_gate_up_mma(h_.data_ptr(), w.experts_gate.data_ptr(),
                                                 w.experts_up.data_ptr(), r, B, K, E, H, I, max_active,
                                                 act_.data_ptr(), launch);
                else
                    cuda::launch_moe_gate_up(dtype_, h_.data_ptr(), w.experts_gate.data_ptr(),
                                             w.experts_up.data_ptr(), r, B, K, H, I, max_active,
                                             act_.data_ptr(), launch);
                mark("experts gate+up", launch);
                if (down_mma)
                    cuda::launch_moe_down_mma(act_.data_ptr(), w.experts_down.data_ptr(), r, B, K, E, H, I,
                                              max_active, y_.data_ptr<float>(), launch);
                else
                    cuda::launch_moe_down(dtype_, act_.data_ptr(), w.experts_down.data_ptr(), r, B, K, H, I,
                                          max_active, y_.data_ptr<float>(), launch);
                mark("experts down", launch);
            }
            cuda::launch_moe_combine_rmsnorm(dtype_, x_.data_ptr(), y_.data_ptr<float>(), r,
                                             next_norm.data_ptr(), eps, pos, B, K, H, h_.data_ptr(), launch);
            mark("combine+norm", launch);
            record(w.moe_index, B, launch);
        } else {
            at::Tensor mlp = swiglu(rows(h_), w.gate_proj, w.up_proj, w.down_proj).contiguous();
            cuda::launch_add_rmsnorm(dtype_, x_.data_ptr(), mlp.data_ptr(), next_norm.data_ptr(), eps, pos, B,
                                     H, h_.data_ptr(), launch);
            mark("dense mlp", launch);
        }
    }
    // The LM head: after fused MoE rows the GEMV normalises x itself (the final norm inside).
    const at::Tensor& head = m_.output_weight();
    if (norm_pending != nullptr)
        cuda::launch_norm_dense_rows(dtype_, x_.data_ptr(), norm_pending->data_ptr(), eps, head.data_ptr(), B,
                                     H, V, logits.data_ptr(), launch);
    else
        linear(h_, head, logits, B, launch, fp8 ? dense_fp8(fp8_head_) : nullptr);
    mark("lm_head", launch);
    // The argmax moves the rows' positions on by one: a step continuing them uploads nothing.
    auto* keys = reinterpret_cast<unsigned long long*>(argmax_keys_.data_ptr<int64_t>());
    cuda::launch_argmax(dtype_, logits.data_ptr(), B, V, keys, argmax_done_.data_ptr<int>(),
                        greedy.data_ptr<int64_t>(), position.data_ptr<int>(), launch);
    mark("argmax", launch);
    MOERL_CUDA_CHECK(cudaGetLastError());
}

// Tokens sorted by expert (the routing's slot lists), one grouped GEMM per projection on the tensor
// cores, results scattered back to their slots: the gather, the activation and the scatter are one
// kernel each (as LibTorch operations they were about ten small kernels a layer). Capturable: every
// size is fixed by the bucket; slots past the routed total are left out of y.
void Generator::DecodeStep::experts_grouped(int B, const LayerWeights& w, const cuda::Launch& launch) {
#ifdef MOERL_HAVE_GROUPED_MM
    const int64_t S = int64_t{B} * K_;
    const cuda::MoeRouting r = routing();
    at::Tensor xs = at::empty({S, H_}, h_.options());
    cuda::launch_gather_slot_rows(h_.data_ptr(), r, static_cast<int>(S), K_, H_, xs.data_ptr(), launch);
    at::Tensor offs = expert_offset_.narrow(0, 1, E_);  // cumulative ends per expert
    at::Tensor g = at::_grouped_mm(xs, w.experts_gate.transpose(-2, -1), offs);
    at::Tensor u = at::_grouped_mm(xs, w.experts_up.transpose(-2, -1), offs);
    cuda::launch_silu_mul(g.data_ptr(), u.data_ptr(), g.numel(), g.data_ptr(), launch);  // in place
    at::Tensor o = at::_grouped_mm(g, w.experts_down.transpose(-2, -1), offs);
    cuda::launch_scatter_slot_rows(o.data_ptr(), r, static_cast<int>(S), E_, H_, y_.data_ptr<float>(),
                                   launch);
#else
    (void)B;
    (void)w;
    (void)launch;
    MOERL_FAIL("grouped expert GEMM needs LibTorch >= 2.8");
#endif
}

}  // namespace moerl::model
