// The decode step's latency-bound kernels one at a time, at the Qwen3-30B-A3B shape (hidden 2048,
// 32 query / 4 key-value heads of 128, 128 experts top-8): the time of one launch inside a CUDA
// graph of many back-to-back launches (what a decode step pays for it, launch gap included), plain
// and with programmatic dependent launch, next to an empty kernel's (the cache store and attention
// with bf16 and FP8 KV caches). Then the weight-streaming
// kernels (dense GEMVs, expert products on CUDA or tensor cores) in the same way, each launch on
// another copy of the weights (or another routing) so that nothing is served from L2, with the
// bandwidth of the weight bytes each launch reads. Last, one decode layer at batch 1 with its kernels
// in step order, against the sum of the same kernels timed alone, and each kernel's cost inside the
// layer (the layer less the layer without it), and the same layer as the generator runs one-row
// steps. No LibTorch: it runs wherever the decode kernels build.
//   decode_kernels_bench [--iters N] [--batch 1,16,64] [--len 137,193,1024,4096] [--no-gemv]
//                        [--no-attention] [--no-layer] [--skew S]
// (--len picks the attention rows and leaves the other kernels out. --skew S routes the expert
// rows as a trained policy does, to a few popular experts: router logits N(0, 1) - S log(1 + e) for
// expert e; 0, the default, is uniform.)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/common.cuh"

namespace {

namespace mc = moerl::model::cuda;

void check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    std::fprintf(stderr, "decode_kernels_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
}
#define CK(x) check((x), #x)

constexpr int kH = 2048, kHq = 32, kHkv = 4, kD = 128, kE = 128, kK = 8, kI = 768, kBlock = 16;

// p[i] = a small pseudo-random bf16 (hash of i and seed): large weight buffers without a host copy.
__global__ void fill_kernel(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
         i += size_t{gridDim.x} * blockDim.x) {
        unsigned v = static_cast<unsigned>(i) * 2654435761u ^ seed * 40503u;
        v ^= v >> 15;
        v *= 2246822519u;
        v ^= v >> 13;
        p[i] = __float2bfloat16((static_cast<float>(v & 0xffff) / 65536.0f - 0.5f) * 0.05f);
    }
}

// Device buffers of random bf16 (or zeroed ints), freed at exit.
struct Pool {
    std::vector<void*> ptrs;
    std::mt19937 rng{7};
    ~Pool() {
        for (void* p : ptrs) cudaFree(p);
    }
    __nv_bfloat16* bf16(size_t n, float scale = 1.0f) {
        std::vector<__nv_bfloat16> h(n);
        std::normal_distribution<float> d(0.0f, scale);
        for (auto& v : h) v = __float2bfloat16(d(rng));
        void* p = nullptr;
        CK(cudaMalloc(&p, n * 2));
        CK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
        ptrs.push_back(p);
        return static_cast<__nv_bfloat16*>(p);
    }
    __nv_bfloat16* bf16_filled(size_t n) {
        void* p = nullptr;
        CK(cudaMalloc(&p, n * 2));
        fill_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, static_cast<unsigned>(ptrs.size()));
        CK(cudaGetLastError());
        ptrs.push_back(p);
        return static_cast<__nv_bfloat16*>(p);
    }
    template <typename T>
    T* zeros(size_t n) {
        void* p = nullptr;
        CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
        CK(cudaMemset(p, 0, std::max<size_t>(n, 1) * sizeof(T)));
        ptrs.push_back(p);
        return static_cast<T*>(p);
    }
    // Zeroed routing buffers for B rows of top-kK over kE experts.
    mc::MoeRouting routing(int B) {
        mc::MoeRouting r;
        r.topk_idx = zeros<int>(static_cast<size_t>(B) * kK);
        r.topk_weights = zeros<float>(static_cast<size_t>(B) * kK);
        r.expert_offset = zeros<int>(kE + 1);
        r.active_experts = zeros<int>(kE);
        r.num_active = zeros<int>(1);
        r.expert_slots = zeros<int>(static_cast<size_t>(B) * kK);
        return r;
    }
    template <typename T>
    T* copy(const std::vector<T>& h) {
        T* p = zeros<T>(h.size());
        CK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
        return p;
    }
};

__global__ void empty_kernel() {
    mc::griddep_wait();
    mc::griddep_launch_dependents();
}

// Microseconds per launch: `launch` captured `n` times into one graph, the graph replayed `iters`
// times after a warm-up; median of five timings.
double time_in_graph(cudaStream_t stream, int n, int iters, const std::function<void()>& launch) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; ++i) launch();
    CK(cudaStreamEndCapture(stream, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaGraphLaunch(exec, stream));
    CK(cudaStreamSynchronize(stream));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<double> runs;
    for (int r = 0; r < 5; ++r) {
        CK(cudaEventRecord(a, stream));
        for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(exec, stream));
        CK(cudaEventRecord(b, stream));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        runs.push_back(1000.0 * ms / (static_cast<double>(iters) * n));
    }
    std::sort(runs.begin(), runs.end());
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return runs[2];
}

// Microseconds per launch of `launch(i, l)` (i: the launch's index in the graph, 0..63), with plain
// launches and with overlapped ones (programmatic dependent launch).
struct Times {
    double plain, overlap;
};
Times plain_and_overlapped(cudaStream_t stream, int iters,
                           const std::function<void(int, const mc::Launch&)>& launch) {
    constexpr int n = 64;
    double t[2];
    for (int ov = 0; ov < 2; ++ov) {
        int i = 0;
        const mc::Launch l{stream, ov == 1};
        t[ov] = time_in_graph(stream, n, iters, [&] { launch(i++, l); });
    }
    return {t[0], t[1]};
}

// "1,16,64" -> {1, 16, 64}; every entry must be in [1, 1 << 20].
bool parse_list(const char* text, std::vector<int>& out) {
    out.clear();
    std::string item;
    for (const char* c = text;; ++c) {
        if (*c == ',' || *c == 0) {
            char* end = nullptr;
            const long v = std::strtol(item.c_str(), &end, 10);
            if (item.empty() || *end != 0 || v < 1 || v > (1 << 20)) return false;
            out.push_back(static_cast<int>(v));
            item.clear();
            if (*c == 0) return true;
        } else {
            item += *c;
        }
    }
}

// The weight-streaming kernels of a decode layer: us per launch and GB/s of weights read.
void gemv_table(cudaStream_t stream, int iters, const std::vector<int>& batches, float skew, Pool& pool) {
    std::printf(
        "\nweights read per launch / us per launch (launch i reads copy i of the weights, or routing i;\n"
        "together several times the L2), plain and overlapped launches\n\n");
    std::printf(
        "| kernel | batch | variant | MB | plain us | GB/s | overlap us | GB/s "
        "|\n|---|---|---|---|---|---|---|---|\n");
    auto row = [&](const char* name, int B, const std::string& variant, double mb,
                   const std::function<void(int, const mc::Launch&)>& f) {
        const Times t = plain_and_overlapped(stream, iters, f);
        std::printf("| %s | %d | %s | %.1f | %.2f | %.0f | %.2f | %.0f |\n", name, B, variant.c_str(), mb,
                    t.plain, mb * 1e-3 / (t.plain * 1e-6), t.overlap, mb * 1e-3 / (t.overlap * 1e-6));
        std::fflush(stdout);
    };
    // Dense projections: fused q/k/v [5120, 2048] and o [2048, 4096], copies enough for 400 MB.
    struct Dense {
        const char* name;
        int out_rows, cols;
    };
    const Dense dense[] = {{"qkv gemv", (kHq + 2 * kHkv) * kD, kH}, {"o gemv", kH, kHq * kD}};
    for (const Dense& d : dense) {
        const size_t elems = static_cast<size_t>(d.out_rows) * d.cols;
        const int copies = static_cast<int>(400e6 / (elems * 2.0)) + 1;
        auto* w = pool.bf16_filled(elems * copies);
        const int max_b = *std::max_element(batches.begin(), batches.end());
        auto* in = pool.bf16_filled(static_cast<size_t>(max_b) * d.cols);
        auto* out = pool.bf16_filled(static_cast<size_t>(max_b) * d.out_rows);
        // The same weights in e4m3 with their block scales (FP8 rollout): a byte a weight.
        auto* q = pool.zeros<uint8_t>(elems * copies);
        const size_t num_scales = static_cast<size_t>((d.out_rows + 127) / 128) * ((d.cols + 127) / 128);
        auto* scales = pool.zeros<float>(num_scales * copies);
        mc::launch_quantize_fp8_blocks(1, w, copies, d.out_rows, d.cols, q, scales, {stream, false});
        for (int B : batches) {
            if (B > 8) continue;  // larger batches go to cuBLAS (bf16 weights, FP8 rollout too)
            const double fp8_mb = (elems + num_scales * 4) * 1e-6;
            row(d.name, B, "fp8 tensor cores", fp8_mb, [&](int i, const mc::Launch& l) {
                const int k = i % copies;
                mc::launch_dense_fp8(in, q + k * elems, scales + k * num_scales, B, d.cols, d.out_rows, out,
                                     l);
            });
            if (B > 4) continue;
            row(d.name, B, "cuda cores", elems * 2e-6, [&](int i, const mc::Launch& l) {
                mc::launch_dense_rows(1, in, w + (i % copies) * elems, B, d.cols, d.out_rows, out, l);
            });
            row(d.name, B, "fp8 weights", (elems + num_scales * 4) * 1e-6, [&](int i, const mc::Launch& l) {
                const int k = i % copies;
                mc::launch_dense_rows_fp8(in, q + k * elems, scales + k * num_scales, B, d.cols, d.out_rows,
                                          out, l);
            });
        }
    }
    // The LM head [151936, 2048] with the final norm inside, one row (622 MB, one copy: past L2 anyway),
    // a block per 8 weight rows as the generator runs it at batch 1.
    if (std::find(batches.begin(), batches.end(), 1) != batches.end()) {
        constexpr int kVocab = 151936;
        const size_t elems = static_cast<size_t>(kVocab) * kH;
        auto* w = pool.bf16_filled(elems);
        auto* x = pool.bf16_filled(kH);
        auto* norm_w = pool.bf16_filled(kH);
        auto* out = pool.bf16_filled(kVocab);
        row("lm head (norm inside)", 1, "cuda cores", elems * 2e-6, [&](int, const mc::Launch& l) {
            mc::launch_norm_dense_rows(1, x, norm_w, 1e-6f, w, 1, kH, kVocab, out, l);
        });
        // FP8 rollout's LM head (the final norm in the kernel before it): 311 MB.
        const size_t num_scales = static_cast<size_t>((kVocab + 127) / 128) * (kH / 128);
        auto* q = pool.zeros<uint8_t>(elems);
        auto* scales = pool.zeros<float>(num_scales);
        mc::launch_quantize_fp8_blocks(1, w, 1, kVocab, kH, q, scales, {stream, false});
        row("lm head", 1, "fp8 tensor cores", (elems + num_scales * 4) * 1e-6,
            [&](int, const mc::Launch& l) { mc::launch_dense_fp8(x, q, scales, 1, kH, kVocab, out, l); });
    }
    // Experts: gate/up [E, I, H] and down [E, H, I], one routing per launch out of 16 (random logits).
    auto* gate = pool.bf16_filled(static_cast<size_t>(kE) * kI * kH);
    auto* up = pool.bf16_filled(static_cast<size_t>(kE) * kI * kH);
    auto* down = pool.bf16_filled(static_cast<size_t>(kE) * kH * kI);
    // Their e4m3 copies (FP8 rollout): a byte a weight and a scale per 128 x 128 block.
    const size_t expert_elems = static_cast<size_t>(kE) * kI * kH;
    const size_t gate_scales = static_cast<size_t>(kE) * ((kI + 127) / 128) * (kH / 128);
    const size_t down_scales = static_cast<size_t>(kE) * (kH / 128) * ((kI + 127) / 128);
    auto* gate_q = pool.zeros<uint8_t>(expert_elems);
    auto* up_q = pool.zeros<uint8_t>(expert_elems);
    auto* down_q = pool.zeros<uint8_t>(expert_elems);
    auto* gate_s = pool.zeros<float>(gate_scales);
    auto* up_s = pool.zeros<float>(gate_scales);
    auto* down_s = pool.zeros<float>(down_scales);
    mc::launch_quantize_fp8_blocks(1, gate, kE, kI, kH, gate_q, gate_s, {stream, false});
    mc::launch_quantize_fp8_blocks(1, up, kE, kI, kH, up_q, up_s, {stream, false});
    mc::launch_quantize_fp8_blocks(1, down, kE, kH, kI, down_q, down_s, {stream, false});
    constexpr int kRoutings = 16;
    for (int B : batches) {
        std::vector<int> position(B, 10);
        int* d_pos = pool.copy(position);
        std::vector<mc::MoeRouting> routes(kRoutings);
        double active = 0, busiest = 0;
        for (auto& r : routes) {
            r = pool.routing(B);
            std::vector<__nv_bfloat16> h(static_cast<size_t>(B) * kE);
            std::normal_distribution<float> noise(0.0f, 1.0f);
            for (size_t i = 0; i < h.size(); ++i)
                h[i] = __float2bfloat16(noise(pool.rng) - skew * std::log(1.0f + static_cast<float>(i % kE)));
            auto* logits = pool.copy(h);
            mc::launch_route(1, logits, d_pos, B, kE, kK, true, r, {stream, false});
            int num = 0;
            std::vector<int> offsets(kE + 1);
            CK(cudaMemcpyAsync(&num, r.num_active, sizeof(int), cudaMemcpyDeviceToHost, stream));
            CK(cudaMemcpyAsync(offsets.data(), r.expert_offset, sizeof(int) * (kE + 1),
                               cudaMemcpyDeviceToHost, stream));
            CK(cudaStreamSynchronize(stream));
            active += num;
            int most = 0;
            for (int e = 0; e < kE; ++e) most = std::max(most, offsets[e + 1] - offsets[e]);
            busiest += most;
        }
        active /= kRoutings;
        busiest /= kRoutings;
        std::printf(
            "| (routing at batch %d, skew %.2f: %.1f experts active, the busiest holds %.1f rows) | | | | | "
            "| | |\n",
            B, skew, active, busiest);
        const int max_active = std::min(kE, B * kK);
        auto* h = pool.bf16_filled(static_cast<size_t>(B) * kH);
        auto* act = pool.bf16_filled(static_cast<size_t>(B) * kK * kI);
        auto* y = pool.zeros<float>(static_cast<size_t>(B) * kK * kH);
        const double gate_up_mb = active * 2.0 * kI * kH * 2e-6, down_mb = active * kH * kI * 2e-6;
        row("experts gate+up", B, "cuda cores", gate_up_mb, [&](int i, const mc::Launch& l) {
            mc::launch_moe_gate_up(1, h, gate, up, routes[i % kRoutings], B, kK, kH, kI, max_active, act, l);
        });
        if (mc::moe_tensor_cores_supported(1, kH, kI))
            row("experts gate+up", B, "tensor cores", gate_up_mb, [&](int i, const mc::Launch& l) {
                mc::launch_moe_gate_up_mma(h, gate, up, routes[i % kRoutings], B, kK, kE, kH, kI, max_active,
                                           act, l);
            });
        row("experts down", B, "cuda cores", down_mb, [&](int i, const mc::Launch& l) {
            mc::launch_moe_down(1, act, down, routes[i % kRoutings], B, kK, kH, kI, max_active, y, l);
        });
        if (mc::moe_tensor_cores_supported(1, kH, kI))
            row("experts down", B, "tensor cores", down_mb, [&](int i, const mc::Launch& l) {
                mc::launch_moe_down_mma(act, down, routes[i % kRoutings], B, kK, kE, kH, kI, max_active, y,
                                        l);
            });
        row("experts gate+up", B, "fp8 tensor cores", gate_up_mb / 2, [&](int i, const mc::Launch& l) {
            mc::launch_moe_gate_up_fp8(h, gate_q, gate_s, up_q, up_s, routes[i % kRoutings], B, kK, kH, kI,
                                       max_active, act, l);
        });
        row("experts down", B, "fp8 tensor cores", down_mb / 2, [&](int i, const mc::Launch& l) {
            mc::launch_moe_down_fp8(act, down_q, down_s, routes[i % kRoutings], B, kK, kH, kI, max_active, y,
                                    l);
        });
    }
}

// One decode layer at batch 1 (Qwen3-30B-A3B shape, 193 cached tokens), its ten kernels in step
// order — q/k/v GEMV, q/k norm + RoPE + cache store, attention, o GEMV, add + norm, router GEMV,
// route, expert gate/up and down (CUDA cores, as the engine runs batch 1), combine + norm — each
// launch a layer of its own among 8 (its own dense weights; experts as its router picks), as in a
// step: us per layer, plain and overlapped, next to the same kernels timed one kind at a time and
// to what each adds to the layer.
void layer_table(cudaStream_t stream, int iters, Pool& pool) {
    constexpr int B = 1, kLayers = 8, seq = 193, kQkvRows = (kHq + 2 * kHkv) * kD;
    const int max_blocks = (seq + kBlock - 1) / kBlock;
    std::vector<int> position(B, seq - 1), slot(B, 0), table(max_blocks);
    for (int j = 0; j < max_blocks; ++j) table[j] = 1 + j;
    int* d_pos = pool.copy(position);
    int* d_slot = pool.copy(slot);
    int* d_table = pool.copy(table);
    const size_t pool_elems = static_cast<size_t>(max_blocks + 1) * kBlock * kHkv * kD;
    struct Layer {
        __nv_bfloat16 *qkv_w, *o_w, *router_w, *k_pool, *v_pool;
    };
    std::vector<Layer> layers(kLayers);
    for (Layer& l : layers) {
        l.qkv_w = pool.bf16_filled(static_cast<size_t>(kQkvRows) * kH);
        l.o_w = pool.bf16_filled(static_cast<size_t>(kH) * kHq * kD);
        l.router_w = pool.bf16_filled(static_cast<size_t>(kE) * kH);
        l.k_pool = pool.bf16_filled(pool_elems);
        l.v_pool = pool.bf16_filled(pool_elems);
    }
    auto* gate = pool.bf16_filled(static_cast<size_t>(kE) * kI * kH);
    auto* up = pool.bf16_filled(static_cast<size_t>(kE) * kI * kH);
    auto* down = pool.bf16_filled(static_cast<size_t>(kE) * kH * kI);
    auto* x = pool.bf16_filled(kH);
    auto* h = pool.bf16_filled(kH);
    auto* norm_w = pool.bf16_filled(kH);
    auto* qn = pool.bf16_filled(kD);
    auto* kn = pool.bf16_filled(kD);
    auto* qkv = pool.bf16_filled(kQkvRows);
    auto* q = pool.bf16_filled(static_cast<size_t>(kHq) * kD);
    auto* attn = pool.bf16_filled(static_cast<size_t>(kHq) * kD);
    auto* o = pool.bf16_filled(kH);
    auto* logits = pool.bf16_filled(kE);
    auto* act = pool.bf16_filled(static_cast<size_t>(kK) * kI);
    auto* y = pool.zeros<float>(static_cast<size_t>(kK) * kH);
    const int splits = mc::attention_partial_splits(max_blocks * kBlock);
    auto* partial = pool.zeros<float>(static_cast<size_t>(B) * kHq * splits * (kD + 2));
    int* done = pool.zeros<int>(static_cast<size_t>(B) * kHq);
    std::vector<mc::MoeRouting> routes(kLayers);  // each layer's, so experts timed alone vary too
    for (mc::MoeRouting& r : routes) r = pool.routing(B);
    // kinds: bit i launches kernel i of the layer (all: the layer)
    auto layer = [&](int i, unsigned kinds, const mc::Launch& l) {
        const Layer& w = layers[i % kLayers];
        const mc::MoeRouting& r = routes[i % kLayers];
        if (kinds & 1u) mc::launch_dense_rows(1, h, w.qkv_w, B, kH, kQkvRows, qkv, l);
        if (kinds & 2u)
            mc::launch_qk_norm_rope_store(1, qkv, qn, kn, 1e-6f, 1e6f, d_pos, d_slot, d_table, max_blocks,
                                          kBlock, B, kHq, kHkv, kD, q, w.k_pool, w.v_pool, l);
        if (kinds & 4u)
            mc::launch_paged_attention(1, q, w.k_pool, w.v_pool, d_pos, d_slot, d_table, max_blocks, kBlock,
                                       B, kHq, kHkv, kD, partial, done, attn, l);
        if (kinds & 8u) mc::launch_dense_rows(1, attn, w.o_w, B, kHq * kD, kH, o, l);
        if (kinds & 16u) mc::launch_add_rmsnorm(1, x, o, norm_w, 1e-6f, d_pos, B, kH, h, l);
        if (kinds & 32u) mc::launch_dense_rows(1, h, w.router_w, B, kH, kE, logits, l);
        if (kinds & 64u) mc::launch_route(1, logits, d_pos, B, kE, kK, true, r, l);
        if (kinds & 128u) mc::launch_moe_gate_up(1, h, gate, up, r, B, kK, kH, kI, kK, act, l);
        if (kinds & 256u) mc::launch_moe_down(1, act, down, r, B, kK, kH, kI, kK, y, l);
        if (kinds & 512u) mc::launch_moe_combine_rmsnorm(1, x, y, r, norm_w, 1e-6f, d_pos, B, kK, kH, h, l);
    };
    for (int i = 0; i < kLayers; ++i) layer(i, 1023u, {stream, false});  // every layer's routing
    CK(cudaStreamSynchronize(stream));
    const char* names[] = {"qkv gemv",     "qk norm+rope+store", "attention", "o gemv",
                           "add+norm",     "router gemv",        "route",     "experts gate+up",
                           "experts down", "combine+norm"};
    std::printf(
        "\none decode layer at batch 1 (%d tokens), its kernels in step order, each launch the next of %d "
        "layers (us per layer): each kernel alone (one kind at a time), and what it adds to the layer "
        "(the layer less the layer without it)\n\n",
        seq, kLayers);
    auto time_kinds = [&](unsigned kinds) {
        return plain_and_overlapped(stream, iters, [&](int i, const mc::Launch& l) { layer(i, kinds, l); });
    };
    Times sum{0, 0};
    Times alone[10];
    for (int k = 0; k < 10; ++k) {
        alone[k] = time_kinds(1u << k);
        sum.plain += alone[k].plain, sum.overlap += alone[k].overlap;
    }
    const Times whole = time_kinds(1023u);
    // A kernel's cost inside the layer: the layer less the layer without it (its neighbours then
    // overlap each other instead).
    std::printf(
        "| kernel | alone: plain us | overlap us | in the layer: plain us | overlap us "
        "|\n|---|---|---|---|---|\n");
    for (int k = 0; k < 10; ++k) {
        const Times without = time_kinds(1023u & ~(1u << k));
        std::printf("| %s | %.2f | %.2f | %.2f | %.2f |\n", names[k], alone[k].plain, alone[k].overlap,
                    whole.plain - without.plain, whole.overlap - without.overlap);
        std::fflush(stdout);
    }
    std::printf("| sum | %.2f | %.2f | | |\n| the layer | | | %.2f | %.2f |\n", sum.plain, sum.overlap,
                whole.plain, whole.overlap);

    // The same layer as the generator runs one-row steps (fused q/k, fused rows): 6 kernels, the
    // router logits ranked in the expert kernels where those fit.
    int* fused_done = pool.zeros<int>(mc::fused_rows_done_counters(kH));
    const mc::QkvInput qkv_in{qkv, qn, kn, 1e-6f, 1e6f};
    const bool routed = mc::moe_routed_one_row_supported(1, kK, kI);
    auto fused_layer = [&](int i, unsigned kinds, const mc::Launch& l) {
        const Layer& w = layers[i % kLayers];
        const mc::MoeRouting& r = routes[i % kLayers];
        if (kinds & 1u) mc::launch_norm_dense_rows(1, x, norm_w, 1e-6f, w.qkv_w, B, kH, kQkvRows, qkv, l);
        if (kinds & 2u)
            mc::launch_paged_attention(1, nullptr, w.k_pool, w.v_pool, d_pos, d_slot, d_table, max_blocks,
                                       kBlock, B, kHq, kHkv, kD, partial, done, attn, l, qkv_in);
        if (kinds & 4u) mc::launch_dense_rows(1, attn, w.o_w, B, kHq * kD, kH, o, l);
        if (kinds & 8u)
            mc::launch_add_norm_router_route(1, x, o, norm_w, 1e-6f, d_pos, w.router_w, B, kH, kE, kK, true,
                                             !routed, h, logits, r, fused_done, l);
        if (routed) {
            if (kinds & 16u)
                mc::launch_moe_gate_up_routed(1, h, gate, up, logits, d_pos, r, kE, kK, true, kH, kI, act, l);
            if (kinds & 32u)
                mc::launch_moe_down_combine_routed(1, act, down, logits, d_pos, kE, kK, true, kH, kI, x, o,
                                                   l);
            return;
        }
        if (kinds & 16u) mc::launch_moe_gate_up(1, h, gate, up, r, B, kK, kH, kI, kK, act, l);
        if (kinds & 32u)
            mc::launch_moe_down_combine(1, act, down, r, B, kK, kH, kI, kK, y, x, o, d_pos, fused_done, l);
    };
    const char* fused_names[] = {"norm + qkv gemv", "q/k norm+rope+store + attention",
                                 "o gemv",          "add+norm + router gemv + route",
                                 "experts gate+up", "experts down + combine"};
    auto time_fused = [&](unsigned kinds) {
        return plain_and_overlapped(stream, iters,
                                    [&](int i, const mc::Launch& l) { fused_layer(i, kinds, l); });
    };
    const Times fused = time_fused(63u);
    std::printf(
        "\nthe same layer in 6 kernels (what one-row steps run%s)\n\n"
        "| kernel | in the layer: plain us | overlap us |\n|---|---|---|\n",
        routed ? ", the logits ranked in the expert kernels" : "");
    for (int k = 0; k < 6; ++k) {
        const Times without = time_fused(63u & ~(1u << k));
        std::printf("| %s | %.2f | %.2f |\n", fused_names[k], fused.plain - without.plain,
                    fused.overlap - without.overlap);
        std::fflush(stdout);
    }
    std::printf("| the layer | %.2f | %.2f |\n", fused.plain, fused.overlap);
}

}  // namespace

int main(int argc, char** argv) {
    int iters = 20;
    std::vector<int> batches = {1, 16, 64}, lens = {137, 193, 1024, 4096};
    bool attention_only = false, gemv = true, attention = true, layer = true;
    float skew = 0.0f;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        bool ok = i + 1 < argc;
        if (flag == "--no-gemv" || flag == "--no-attention" || flag == "--no-layer") {
            (flag == "--no-gemv" ? gemv : flag == "--no-layer" ? layer : attention) = false;
            ok = true;
        } else if (ok && flag == "--iters") {
            char* end = nullptr;
            iters = static_cast<int>(std::strtol(argv[++i], &end, 10));
            ok = *end == 0 && iters >= 1;
        } else if (ok && flag == "--batch") {
            ok = parse_list(argv[++i], batches);
        } else if (ok && flag == "--skew") {
            char* end = nullptr;
            skew = std::strtof(argv[++i], &end);
            ok = *end == 0 && skew >= 0.0f;
        } else if (ok && flag == "--len") {
            ok = parse_list(argv[++i], lens);
            attention_only = true;
        } else {
            ok = false;
        }
        if (!ok) {
            std::fprintf(
                stderr,
                "decode_kernels_bench: bad argument '%s'\nusage: decode_kernels_bench [--iters N >= 1] "
                "[--batch 1,16,64] [--len 137,193,1024,4096] [--no-gemv] [--no-attention] [--no-layer] "
                "[--skew S >= 0]\n",
                argv[i]);
            return 2;
        }
    }
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        std::fprintf(stderr, "decode_kernels_bench: no CUDA device\n");
        return 1;
    }
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::printf("%s; shape hidden %d, heads %d/%d x %d, %d experts top-%d of width %d, KV blocks of %d\n",
                prop.name, kH, kHq, kHkv, kD, kE, kK, kI, kBlock);
    std::printf("us per launch inside a graph of 64 back-to-back launches (median of 5 x %d replays)\n\n",
                iters);
    std::printf("| kernel | batch | seq | plain us | overlap us |\n|---|---|---|---|---|\n");
    auto row = [&](const std::string& name, int B, int seq, const std::function<void(const mc::Launch&)>& f) {
        const Times t = plain_and_overlapped(stream, iters, [&](int, const mc::Launch& l) { f(l); });
        std::printf("| %s | %d | %s | %.2f | %.2f |\n", name.c_str(), B,
                    seq > 0 ? std::to_string(seq).c_str() : "-", t.plain, t.overlap);
        std::fflush(stdout);
    };
    if (!attention_only)
        row("empty", 1, 0,
            [&](const mc::Launch& l) { mc::launch_kernel(empty_kernel, dim3(1), dim3(32), 0, l); });

    Pool pool;
    for (int B : batches) {
        // Norms, q/k norm + RoPE + cache store, route, combine: at a sequence of 193 tokens.
        const int seq = 193, max_blocks = (seq + kBlock - 1) / kBlock, num_blocks = B * max_blocks + 1;
        std::vector<int> position(B, seq - 1), slot(B), table(static_cast<size_t>(B) * max_blocks);
        for (int b = 0; b < B; ++b) {
            slot[b] = b;
            for (int j = 0; j < max_blocks; ++j)
                table[static_cast<size_t>(b) * max_blocks + j] = 1 + b * max_blocks + j;
        }
        int* d_pos = pool.copy(position);
        int* d_slot = pool.copy(slot);
        int* d_table = pool.copy(table);
        const size_t pool_elems = static_cast<size_t>(num_blocks) * kBlock * kHkv * kD;
        auto* k_pool = pool.bf16(pool_elems);
        auto* v_pool = pool.bf16(pool_elems);
        auto* x = pool.bf16(static_cast<size_t>(B) * kH);
        auto* delta = pool.bf16(static_cast<size_t>(B) * kH);
        auto* h = pool.bf16(static_cast<size_t>(B) * kH);
        auto* norm_w = pool.bf16(kH);
        auto* qkv = pool.bf16(static_cast<size_t>(B) * (kHq + 2 * kHkv) * kD);
        auto* qn = pool.bf16(kD);
        auto* kn = pool.bf16(kD);
        auto* q = pool.bf16(static_cast<size_t>(B) * kHq * kD);
        auto* attn_out = pool.bf16(static_cast<size_t>(B) * kHq * kD);
        auto* logits = pool.bf16(static_cast<size_t>(B) * kE);
        const mc::MoeRouting r = pool.routing(B);
        auto* y = pool.zeros<float>(static_cast<size_t>(B) * kK * kH);

        if (!attention_only) {
            row("add_rmsnorm", B, 0, [&](const mc::Launch& l) {
                mc::launch_add_rmsnorm(1, x, delta, norm_w, 1e-6f, d_pos, B, kH, h, l);
            });
            row("qk_norm_rope_store", B, seq, [&](const mc::Launch& l) {
                mc::launch_qk_norm_rope_store(1, qkv, qn, kn, 1e-6f, 1e6f, d_pos, d_slot, d_table, max_blocks,
                                              kBlock, B, kHq, kHkv, kD, q, k_pool, v_pool, l);
            });
            // The same into an FP8 KV cache (e4m3 rows and their scales).
            auto* k8 = pool.zeros<uint8_t>(pool_elems);
            auto* v8 = pool.zeros<uint8_t>(pool_elems);
            const mc::KvScales scales8{pool.zeros<float>(pool_elems / kD),
                                       pool.zeros<float>(pool_elems / kD)};
            row("qk_norm_rope_store fp8 kv", B, seq, [&](const mc::Launch& l) {
                mc::launch_qk_norm_rope_store(1, qkv, qn, kn, 1e-6f, 1e6f, d_pos, d_slot, d_table, max_blocks,
                                              kBlock, B, kHq, kHkv, kD, q, k8, v8, l, scales8);
            });
            row("route", B, 0,
                [&](const mc::Launch& l) { mc::launch_route(1, logits, d_pos, B, kE, kK, true, r, l); });
            mc::launch_route(1, logits, d_pos, B, kE, kK, true, r,
                             {stream, false});  // combine reads real routes
            row("combine_rmsnorm", B, 0, [&](const mc::Launch& l) {
                mc::launch_moe_combine_rmsnorm(1, x, y, r, norm_w, 1e-6f, d_pos, B, kK, kH, h, l);
            });
        }
        // Attention at several sequence lengths.
        for (int len : attention ? lens : std::vector<int>{}) {
            const int mb = (len + kBlock - 1) / kBlock, nb = B * mb + 1;
            std::vector<int> pos_len(B, len - 1), tab(static_cast<size_t>(B) * mb);
            for (int b = 0; b < B; ++b)
                for (int j = 0; j < mb; ++j) tab[static_cast<size_t>(b) * mb + j] = 1 + b * mb + j;
            int* d_pos_len = pool.copy(pos_len);
            int* d_tab = pool.copy(tab);
            const size_t elems = static_cast<size_t>(nb) * kBlock * kHkv * kD;
            auto* kp = pool.bf16(elems);
            auto* vp = pool.bf16(elems);
            const int splits = mc::attention_partial_splits(mb * kBlock);
            auto* partial = pool.zeros<float>(static_cast<size_t>(B) * kHq * splits * (kD + 2));
            int* done = pool.zeros<int>(static_cast<size_t>(B) * kHq);
            row("attention", B, len, [&](const mc::Launch& l) {
                mc::launch_paged_attention(1, q, kp, vp, d_pos_len, d_slot, d_tab, mb, kBlock, B, kHq, kHkv,
                                           kD, partial, done, attn_out, l);
            });
            // Over an FP8 KV cache: half the bytes of each cached token, plus a scale a row.
            auto* kp8 = pool.zeros<uint8_t>(elems);
            auto* vp8 = pool.zeros<uint8_t>(elems);
            const mc::KvScales s8{pool.zeros<float>(elems / kD), pool.zeros<float>(elems / kD)};
            row("attention fp8 kv", B, len, [&](const mc::Launch& l) {
                mc::launch_paged_attention(1, q, kp8, vp8, d_pos_len, d_slot, d_tab, mb, kBlock, B, kHq, kHkv,
                                           kD, partial, done, attn_out, l, {}, s8);
            });
        }
    }
    if (gemv && !attention_only) gemv_table(stream, iters, batches, skew, pool);
    if (layer && !attention_only) layer_table(stream, iters, pool);
    CK(cudaStreamSynchronize(stream));
    return 0;
}
