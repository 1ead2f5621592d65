// Internal: the generator's decode step: its static buffers (max_batch rows, read and written in
// place by the captured graphs), the paged KV pools, and the kernel sequence of one step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/decode_kernels.hpp"
#include "device_region.hpp"
#include "model_impl.hpp"
#include "moerl/model/generator.hpp"
#include "step_profiler.hpp"

namespace moerl::model {

// A member of Generator: it reads the model's weights in place (MoeModel::Impl).
class Generator::DecodeStep {
  public:
    // Allocates the pools ([num_blocks, block_size, Hkv, D] per layer) and the buffers on the model's
    // device (the caller's current device).
    DecodeStep(const MoeModel::Impl& m, const GeneratorOptions& opt, int max_blocks, int64_t num_blocks);

    // The kernels of one decode step over rows [0, B) of the buffers, on the current stream,
    // embedding the tokens at token_ids ([B], `tokens` or `greedy`).
    void run(int B, const int64_t* token_ids);

    // Re-reads the weights kept in the step's own layout from the model's: the fused q/k/v
    // projection and, with GeneratorOptions::fp8_weights, the e4m3 copies (quantised again). Takes
    // weight_copies' memory back first when it was given back.
    void take_weights();
    // Maps a region given back, emptying LibTorch's allocator cache first when the GPU lacks the
    // bytes; throws naming them when even that is not enough.
    static void take_memory(DeviceRegion& region);

    // With GeneratorOptions::fp8_weights: bytes a step of `rows` rows reads less than in bf16 for
    // the dense projections (q/k/v, o, LM head), which it reads in e4m3 up to kFp8DenseMaxRows rows;
    // and the bytes of one expert's e4m3 weights and scales.
    int64_t fp8_dense_saving(int rows) const;
    int64_t fp8_expert_bytes() const;
    // Past 8 rows the tensor-core kernels read the dense weights below cuBLAS's bf16 speed, or gain
    // too little for what e4m3 costs in agreement with bf16. H100, 8-layer Qwen3-30B-A3B shape: q/k/v
    // and o in e4m3 up to 64 rows took a step of 16 / 64 rows from 1.860 / 2.685 ms to 1.964 / 3.880;
    // the LM head alone up to 16 rows took 16 rows to 1.815-1.839 ms, but the mean |log-prob
    // difference| against bf16 from 0.0090 to 0.0195 (greedy agreement 96.7% -> 92.4%).
    static constexpr int kFp8DenseMaxRows = 8;
    static constexpr int kFp8OneRowCudaCoreMaxRows = 16384;  // see linear()

    // With GeneratorOptions::ep: one step's dispatches and combines with no rows (eager).
    void idle_ep();
    // Bytes of the step's buffers (inputs, outputs, intermediates of max_batch rows): device memory
    // the step keeps while its KV cache and weight copies are given back.
    int64_t buffer_bytes() const { return buffer_bytes_; }

    // Step inputs: tokens [max_batch] int64, position and slot [max_batch] int32 (position -1 = a
    // padding row), block table [max_batch, max_blocks] int32.
    at::Tensor tokens, position, slot, table;
    // Step outputs: logits [max_batch, V] (model dtype), greedy [max_batch] int64; experts_read [1]:
    // expert weight sets read since the last reset.
    at::Tensor logits, greedy, experts_read;
    // With GeneratorOptions::record_routing: [max_batch, num_moe_layers, K] int32, the experts each
    // row used in each MoE layer of the last step.
    at::Tensor routing_record;
    // Per layer: paged keys and values [num_blocks, block_size, Hkv, D], views of cache_memory
    // (whose GPU memory can be given back while no sequence is held, at unchanged addresses); with
    // GeneratorOptions::fp8_kv_cache the pools are e4m3 (uint8) and k_scale, v_scale [num_blocks,
    // block_size, Hkv] fp32 hold each row's scale (cuda::KvScales).
    std::vector<at::Tensor> k_pool, v_pool, k_scale, v_scale;
    // The scales of layer l for the kernels (null pointers without an FP8 KV cache).
    cuda::KvScales kv_scales(size_t l) const {
        if (k_scale.empty()) return {};
        return {k_scale[l].data_ptr<float>(), v_scale[l].data_ptr<float>()};
    }
    std::unique_ptr<DeviceRegion> cache_memory;
    // The weights kept in the step's own layout (qkv_weight_ and the e4m3 copies) are views of this
    // region: given back with the KV cache while training runs (their contents are lost; take_weights
    // fills them again at the next sync or prefill), at unchanged addresses for the graphs.
    std::unique_ptr<DeviceRegion> weight_copies;
    StepProfiler profiler;

  private:
    // A weight matrix [rows, cols] (or a stack [E, rows, cols]) in e4m3, with its 128 x 128 block
    // scales [stack, ceil(rows / 128), ceil(cols / 128)].
    struct Fp8Matrix {
        at::Tensor q, scales;
    };
    struct Fp8Layer {
        Fp8Matrix qkv, o, gate, up, down;
    };
    // out[:B] = in[:B] weight^T: the GEMV kernel up to gemv_max_batch rows, cuBLAS otherwise; the
    // e4m3 copy `fp8` on the tensor cores when given.
    void linear(const at::Tensor& in, const at::Tensor& weight, at::Tensor& out, int B,
                const cuda::Launch& launch, const Fp8Matrix* fp8 = nullptr) const;
    // Views of weight_copies for qkv_weight_ and, with GeneratorOptions::fp8_weights, every e4m3
    // copy and its scales (256-byte aligned each).
    void place_weight_copies();
    // into = e4m3(w), rewritten in place (the graphs keep its address).
    static void quantize(const at::Tensor& w, Fp8Matrix& into, cudaStream_t stream);
    // The experts of a large batch as grouped GEMMs (LibTorch >= 2.8), into y.
    void experts_grouped(int B, const LayerWeights& w, const cuda::Launch& launch);
    // With GeneratorOptions::ep: rows [0, B) of h to their experts' ranks (low-latency dispatch),
    // the local experts over the expert-major rows, the top-k weighted sum back into ep_out.
    // B = 0: a rank with no rows, serving the others' rows (idle_ep).
    void experts_over_ep(int B, const LayerWeights& w, cudaStream_t stream);
    cuda::MoeRouting routing() const;
    // Copies the routing of MoE layer `moe_index` (topk_idx) into routing_record.
    void record(int moe_index, int B, const cuda::Launch& launch);
    void mark(const char* name, const cuda::Launch& launch) { profiler.mark(name, launch.stream); }

    const MoeModel::Impl& m_;
    const GeneratorOptions opt_;
    int dtype_;  // kernel element type: 0 fp32, 1 bf16
    int64_t H_, Hq_, Hkv_, D_, E_, K_, I_, V_;
    int max_blocks_;
    bool use_grouped_mm_;
    int64_t buffer_bytes_ = 0;            // the buffers below, as the constructor made them
    std::vector<at::Tensor> qkv_weight_;  // per layer: q, k and v projections stacked
    // With GeneratorOptions::fp8_weights: per layer (experts empty in dense layers), and the LM head.
    std::vector<Fp8Layer> fp8_layers_;
    Fp8Matrix fp8_head_;
    // Intermediates of one step (max_batch rows).
    at::Tensor x_, h_, qkv_, q_, attn_, attn_partial_, attn_split_done_, o_, router_logits_, act_, y_,
        argmax_keys_, argmax_done_, fused_done_;
    at::Tensor topk_idx_, topk_weights_, expert_offset_, active_experts_, num_active_, expert_slots_;
    // With GeneratorOptions::ep: routing as int64 [max_batch, K], the expert-major rows received
    // [L * rows_per_expert, H], the combined expert output [max_batch, H] (model dtype).
    at::Tensor ep_topk_, ep_recv_x_, ep_out_;
};

}  // namespace moerl::model
