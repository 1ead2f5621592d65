// CUDA variants (bf16) checked against the fp32 CPU model; skipped without a GPU.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include "ep_ranks.hpp"
#include "model_test_util.hpp"
#include "moerl/core/error.hpp"
#include "moerl/model/adamw.hpp"
#include "moerl/model/layers.hpp"
#include "moerl/model/model.hpp"
#include "train_rows.hpp"

namespace moerl::model {
namespace {

using test::part;
using test::run_ranks;
using test::tiny_config;

// bf16 keeps 8 bits of mantissa; a 3-layer model accumulates a few ulps.
constexpr double kBf16Tol = 6e-2;

#define SKIP_WITHOUT_CUDA() \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

ModelConfig gpu_config() {
    ModelConfig c = tiny_config(3, true);
    c.hidden_size = 64;
    c.head_dim = 16;
    c.validate();
    return c;
}

// An fp32 CPU model holding exactly the bf16 weights of `gpu`.
MoeModel cpu_twin(const MoeModel& gpu) {
    MoeModel cpu(gpu.config(), {});
    c10::NoGradGuard no_grad;
    auto src = gpu.state_dict();
    auto dst = cpu.state_dict();
    for (size_t i = 0; i < src.size(); ++i) dst[i].second.copy_(src[i].second.to(at::kCPU, at::kFloat));
    return cpu;
}

// Every parameter's gradient on the GPU points where the CPU twin's does (cosine > 0.95: bf16).
void expect_same_gradient_directions(const MoeModel& gpu, const MoeModel& cpu) {
    auto gp = gpu.named_parameters(), cp = cpu.named_parameters();
    ASSERT_EQ(gp.size(), cp.size());
    for (size_t i = 0; i < gp.size(); ++i) {
        at::Tensor a = gp[i].tensor.grad().to(at::kCPU, at::kDouble).flatten();
        at::Tensor b = cp[i].tensor.grad().to(at::kDouble).flatten();
        ASSERT_TRUE(at::isfinite(a).all().item<bool>()) << gp[i].name;
        const double cos =
            (a * b).sum().item<double>() / (a.norm().item<double>() * b.norm().item<double>() + 1e-30);
        EXPECT_GT(cos, 0.95) << gp[i].name;
    }
}

at::Tensor left_padded_mask(const std::vector<int64_t>& lengths, int64_t S) {
    at::Tensor mask = at::zeros({static_cast<int64_t>(lengths.size()), S}, at::kLong);
    for (size_t i = 0; i < lengths.size(); ++i) mask[i].narrow(0, S - lengths[i], lengths[i]).fill_(1);
    return mask;
}

TEST(Cuda, Bf16ForwardAndGradientsMatchCpuFp32) {
    SKIP_WITHOUT_CUDA();
    ModelConfig c = gpu_config();
    MoeModel gpu(c, {at::Device(at::kCUDA, 0), at::kBFloat16});
    gpu.init_random(1);
    MoeModel cpu = cpu_twin(gpu);
    at::manual_seed(2);
    at::Tensor ids = at::randint(1, c.vocab_size, {3, 10}, at::kLong);
    at::Tensor mask = left_padded_mask({10, 6, 8}, 10);
    ForwardOutput ref = cpu.forward(ids, mask, test::recording());
    {
        // Routing may differ where two router probabilities are within bf16 rounding; most must agree.
        c10::NoGradGuard no_grad;
        ForwardOutput own = gpu.forward(ids, mask, test::recording());
        EXPECT_GT((own.routing.cpu() == ref.routing).to(at::kFloat).mean().item<double>(), 0.9);
    }
    // Replaying the fp32 routing removes those flips, so what remains is bf16 arithmetic.
    ForwardOutput out = gpu.forward(ids, mask, test::recording(ref.routing));
    EXPECT_TRUE(out.logits.is_cuda());
    EXPECT_EQ(out.logits.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(out.routing.cpu(), ref.routing));
    EXPECT_CLOSE(out.logits, ref.logits, kBf16Tol);
    EXPECT_CLOSE(out.token_logprobs * mask.to(at::kCUDA), ref.token_logprobs * mask, 10 * kBf16Tol);
    {
        // Inference may take another expert kernel (grouped GEMM on LibTorch >= 2.8) than training.
        c10::NoGradGuard no_grad;
        ForwardOutput inference = gpu.forward(ids, mask, test::recording(ref.routing));
        EXPECT_CLOSE(inference.logits, out.logits, kBf16Tol);
    }

    (out.token_logprobs * mask.to(at::kCUDA)).sum().backward();
    (ref.token_logprobs * mask).sum().backward();
    expect_same_gradient_directions(gpu, cpu);
}

// Packed rows (segment ids, trailing padding) take the varlen flash path on the GPU; it must give
// what the dense-mask path of the fp32 CPU model gives, in log-probs (the trainer's selected path)
// and in gradients.
TEST(Cuda, PackedVarlenForwardAndGradientsMatchCpuFp32) {
    SKIP_WITHOUT_CUDA();
    ModelConfig c = gpu_config();
    MoeModel gpu(c, {at::Device(at::kCUDA, 0), at::kBFloat16});
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    ASSERT_TRUE(varlen_attention_available(at::TensorOptions().device(at::kCUDA, 0).dtype(at::kBFloat16),
                                           c.num_attention_heads, c.num_key_value_heads, c.head_dim));
#endif
    gpu.init_random(7);
    MoeModel cpu = cpu_twin(gpu);
    at::manual_seed(8);
    const int64_t S = 24;
    at::Tensor ids = at::randint(1, c.vocab_size, {2, S}, at::kLong);
    at::Tensor seg = at::zeros({2, S}, at::kLong);
    seg[0].narrow(0, 0, 7).fill_(1), seg[0].narrow(0, 7, 11).fill_(2), seg[0].narrow(0, 18, 6).fill_(3);
    seg[1].narrow(0, 0, 13).fill_(1), seg[1].narrow(0, 13, 5).fill_(2);  // 6 padding columns
    at::Tensor chosen = seg > 0;
    ForwardOptions o = test::recording();
    o.segment_ids = seg;
    ForwardOutput ref = cpu.forward(ids, at::Tensor(), o);
    o.replay_routing = ref.routing;
    o.return_logits = false;
    o.logprob_mask = chosen;
    ForwardOutput out = gpu.forward(ids, at::Tensor(), o);
    at::Tensor keep = chosen.clone();
    keep.select(1, 0).fill_(false);
    EXPECT_CLOSE(out.token_logprobs.cpu(), ref.token_logprobs * keep, 10 * kBf16Tol);
    out.token_logprobs.sum().backward();
    (ref.token_logprobs * keep).sum().backward();
    expect_same_gradient_directions(gpu, cpu);
    // With activation checkpointing: each layer runs again in the backward (varlen attention and
    // the grouped experts included), and the gradients still point where the CPU's do.
    gpu.zero_grad();
    o.activation_checkpointing = true;
    ForwardOutput again = gpu.forward(ids, at::Tensor(), o);
    EXPECT_CLOSE(again.token_logprobs.cpu(), out.token_logprobs.cpu(), kBf16Tol);
    again.token_logprobs.sum().backward();
    expect_same_gradient_directions(gpu, cpu);
}

// The trainer's inputs given on the host (checked and laid out there, copied without a wait; with
// no padding the experts need not read the routing back) give the step that the same inputs on the
// device give; a bad token id on the host is refused naming it.
TEST(Cuda, HostInputsGiveTheStepOfDeviceInputs) {
    SKIP_WITHOUT_CUDA();
    ModelConfig c = gpu_config();
    const int64_t S = 24;
    at::manual_seed(10);
    at::Tensor ids = at::randint(1, c.vocab_size, {1, S}, at::kLong);
    at::Tensor seg = at::ones({1, S}, at::kLong);
    seg[0].narrow(0, 10, 14).fill_(2);  // two samples packed, every column real
    ForwardOptions o = test::recording();
    o.return_logits = false;
    o.segment_ids = seg;
    o.logprob_mask = seg > 0;
    std::vector<at::Tensor> lp, routing;
    std::vector<std::vector<NamedParameter>> params;
    std::vector<std::unique_ptr<MoeModel>> models;
    for (const bool on_host : {true, false}) {
        models.push_back(
            std::make_unique<MoeModel>(c, ModelOptions{at::Device(at::kCUDA, 0), at::kBFloat16}));
        models.back()->init_random(9);
        ForwardOptions oi = o;
        if (!on_host) oi.segment_ids = seg.cuda(), oi.logprob_mask = oi.logprob_mask.cuda();
        ForwardOutput out = models.back()->forward(on_host ? ids : ids.cuda(), at::Tensor(), oi);
        out.token_logprobs.sum().backward();
        lp.push_back(out.token_logprobs.cpu());
        routing.push_back(out.routing.cpu());
        params.push_back(models.back()->named_parameters());
    }
    EXPECT_TRUE(at::equal(routing[0], routing[1]));
    EXPECT_CLOSE(lp[0], lp[1], 1e-6);
    ASSERT_EQ(params[0].size(), params[1].size());
    for (size_t i = 0; i < params[0].size(); ++i)
        EXPECT_CLOSE(params[0][i].tensor.grad().to(at::kCPU, at::kFloat),
                     params[1][i].tensor.grad().to(at::kCPU, at::kFloat), 1e-2)
            << params[0][i].name;
    at::Tensor bad = ids.clone();
    bad[0][5] = c.vocab_size;
    try {
        models.front()->forward(bad, at::Tensor(), o);
        ADD_FAILURE() << "an id past the vocabulary was taken";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("input_ids holds token ids"), std::string::npos) << e.what();
    }
}

// The response log-probs of training on the GPU, in fp32 and bf16, against the CPU's full
// log_softmax in fp32: values and both gradients, with temperature and an allowed-token bias.
void expect_selected_logprobs_match(int64_t V) {
    at::manual_seed(5);
    const int64_t N = 300, H = 64;
    at::Tensor hidden0 = at::randn({N, H}) * 0.5, weight0 = at::randn({V, H}) * 0.5;
    at::Tensor bias = at::zeros({V});
    bias.narrow(0, 900, 100).fill_(-1e9);
    at::Tensor targets = at::randint(0, 900, {N}, at::kLong);
    at::Tensor g = at::randn({N});
    const double T = 0.7;
    at::Tensor h_ref = hidden0.clone().requires_grad_(true), w_ref = weight0.clone().requires_grad_(true);
    at::Tensor ref = at::log_softmax(at::matmul(h_ref, w_ref.t()) / T + bias, 1)
                         .gather(1, targets.unsqueeze(1))
                         .squeeze(1);
    (ref * g).sum().backward();
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
        const double tol = dtype == at::kFloat ? 1e-4 : kBf16Tol;
        auto on_gpu = [&](const at::Tensor& t) { return t.to(at::kCUDA, dtype).requires_grad_(true); };
        at::Tensor h = on_gpu(hidden0), w = on_gpu(weight0);
        // Chunks of 64 rows: several chunks and a partial last one.
        at::Tensor lp = selected_logprobs(h, w, targets.cuda(), T, bias.cuda(), 64 * V * 4);
        EXPECT_CLOSE(lp.cpu(), ref, tol) << dtype << ", vocabulary " << V;
        (lp * g.cuda()).sum().backward();
        EXPECT_CLOSE(h.grad().cpu().to(at::kFloat), h_ref.grad(), tol) << dtype;
        EXPECT_CLOSE(w.grad().cpu().to(at::kFloat), w_ref.grad(), tol) << dtype;
    }
}

// As above on a vocabulary of one partial group of the kernel's loads (1000) and of several (40000).
TEST(Cuda, SelectedLogprobsMatchCpuFp32) {
    SKIP_WITHOUT_CUDA();
    for (const int64_t V : {1000, 40000}) expect_selected_logprobs_match(V);
}

// The row kernels' RMSNorm (forward and both gradients) against the LibTorch composition it
// replaces, on the vectorised widths (head 128, hidden 2048, 4096 and 6144: one, two and four column
// chunks a thread), a width that is not a multiple of 8, more rows than the backward has blocks, and
// a width past what the kernels take (composed instead).
TEST(Cuda, RmsNormKernelMatchesTheComposition) {
    SKIP_WITHOUT_CUDA();
    at::manual_seed(11);
    struct Shape {
        int64_t rows, width;
    };
    for (const Shape shape : {Shape{231, 128}, Shape{231, 2048}, Shape{231, 36}, Shape{231, 4096},
                              Shape{231, 6144}, Shape{2500, 2048}, Shape{5, 9000}}) {
        const int64_t W = shape.width;
        for (const auto dtype : {at::kFloat, at::kBFloat16}) {
            const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
            const auto opts = at::TensorOptions().device(at::kCUDA).dtype(dtype);
            at::Tensor x0 = (at::randn({shape.rows, W}) * 3).to(opts),
                       w0 = (1 + 0.5 * at::randn({W})).to(opts);
            at::Tensor g = at::randn({shape.rows, W}).to(opts);
            at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
            at::Tensor y = rms_norm(x, w, 1e-6);
            (y * g).sum().backward();
            at::Tensor xr = x0.to(at::kDouble).requires_grad_(true),
                       wr = w0.to(at::kDouble).requires_grad_(true);
            at::Tensor yr = wr * (xr * at::rsqrt(xr.pow(2).mean(-1, true) + 1e-6));
            (yr * g.to(at::kDouble)).sum().backward();
            const std::string what = std::to_string(shape.rows) + " rows of " + std::to_string(W) +
                                     (dtype == at::kFloat ? " fp32" : " bf16");
            EXPECT_CLOSE(y.to(at::kCPU, at::kFloat), yr.detach().to(at::kCPU, at::kFloat), tol) << what;
            EXPECT_CLOSE(x.grad().to(at::kCPU, at::kFloat), xr.grad().to(at::kCPU, at::kFloat), tol) << what;
            EXPECT_CLOSE(w.grad().to(at::kCPU, at::kFloat), wr.grad().to(at::kCPU, at::kFloat), tol) << what;
        }
    }
}

// q's and k's RMSNorm and RoPE in one kernel each way equal the composition apply_rope(rms_norm(x))
// in double: the values and the gradients of x and of the norm's weight, for head widths 128 (the
// Qwen3 one), 16 and 256, positions past the start, and every head of a token rotated by its
// position; an odd number of head rows (a warp takes two of 128 at once) and more rows than the
// backward's warps take in one round.
TEST(Cuda, NormRopeKernelMatchesTheComposition) {
    SKIP_WITHOUT_CUDA();
    if (!cuda_rows_serve(at::zeros({1}, at::kCUDA))) GTEST_SKIP() << "no CUDA row kernels in this build";
    at::manual_seed(13);
    struct Shape {
        int64_t D, B, S, heads;
    };
    for (const Shape shape : {Shape{128, 2, 37, 4}, Shape{16, 2, 37, 4}, Shape{256, 2, 37, 4},
                              Shape{128, 1, 37, 3}, Shape{128, 2, 2100, 4}}) {
        const int64_t D = shape.D;
        for (const auto dtype : {at::kFloat, at::kBFloat16}) {
            const double tol = dtype == at::kFloat ? 1e-5 : 3e-2;
            const auto opts = at::TensorOptions().device(at::kCUDA).dtype(dtype);
            const int64_t B = shape.B, S = shape.S, heads = shape.heads;
            at::Tensor positions =
                (at::arange(S, at::kLong).unsqueeze(0) + at::tensor({0, 500}).unsqueeze(1));
            auto [cos4, sin4] = rope_tables(positions.to(at::kCUDA), D, 1e6, dtype);  // [B, 1, S, D]
            at::Tensor cos = cos4.transpose(1, 2), sin = sin4.transpose(1, 2);        // [B, S, 1, D]
            at::Tensor x0 = (at::randn({B, S, heads, D}) * 3).to(opts),
                       w0 = (1 + 0.5 * at::randn({D})).to(opts);
            at::Tensor g = at::randn({B, S, heads, D}).to(opts);
            at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
            at::Tensor y = cuda_rms_norm_rope(x, w, cos, sin, 1e-6);
            ASSERT_TRUE(y.defined()) << "head width " << D;
            (y * g).sum().backward();
            at::Tensor xr = x0.to(at::kDouble).requires_grad_(true),
                       wr = w0.to(at::kDouble).requires_grad_(true);
            at::Tensor n = wr * (xr * at::rsqrt(xr.pow(2).mean(-1, true) + 1e-6));
            at::Tensor yr = apply_rope(n, cos.to(at::kDouble), sin.to(at::kDouble));
            (yr * g.to(at::kDouble)).sum().backward();
            const std::string what = "head width " + std::to_string(D) + ", " +
                                     std::to_string(B * S * heads) + " rows" +
                                     (dtype == at::kFloat ? " fp32" : " bf16");
            EXPECT_CLOSE(y.to(at::kCPU, at::kFloat), yr.detach().to(at::kCPU, at::kFloat), tol) << what;
            EXPECT_CLOSE(x.grad().to(at::kCPU, at::kFloat), xr.grad().to(at::kCPU, at::kFloat), tol) << what;
            EXPECT_CLOSE(w.grad().to(at::kCPU, at::kFloat), wr.grad().to(at::kCPU, at::kFloat), tol) << what;
            // rms_norm_rope, what the model calls, takes the kernel too and gives the same values.
            EXPECT_TRUE(at::equal(rms_norm_rope(x0, w0, cos, sin, 1e-6), y.detach())) << what;
        }
    }
    // Head widths the kernel does not take come back undefined; rms_norm_rope composes them.
    const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    at::Tensor odd = at::randn({1, 3, 2, 24}).to(opts), c = at::ones({1, 3, 1, 24}, opts),
               s = at::zeros_like(c);
    EXPECT_FALSE(cuda_rms_norm_rope(odd, at::ones({24}, opts), c, s, 1e-6).defined());
    EXPECT_CLOSE(rms_norm_rope(odd, at::ones({24}, opts), c, s, 1e-6).to(at::kCPU, at::kFloat),
                 rms_norm(odd, at::ones({24}, opts), 1e-6).to(at::kCPU, at::kFloat), 1e-6);
}

// Each token's K slot rows gathered from expert order and summed in one kernel (of one input, or of
// two summed with each other) equal the gather then sum: fp32 to rounding, bf16 within its step, on
// a width on the vectorised path and one off it.
TEST(Cuda, SlotSumKernelMatchesTheComposition) {
    SKIP_WITHOUT_CUDA();
    if (!cuda_rows_serve(at::zeros({1}, at::kCUDA))) GTEST_SKIP() << "no CUDA row kernels in this build";
    at::manual_seed(14);
    for (const int64_t H : {2048, 36}) {
        for (const int64_t K : {8, 1}) {
            for (const auto dtype : {at::kFloat, at::kBFloat16}) {
                const int64_t T = 203;
                at::Tensor rows = at::randn({T * K, H}).to(at::kCUDA, dtype);
                at::Tensor inverse = at::randperm(T * K, at::kLong).to(at::kCUDA);
                at::Tensor also = at::randn({T * K, H}).to(at::kCUDA, dtype);
                at::Tensor got = cuda_slot_sum(rows, inverse, K);
                at::Tensor got_both = cuda_slot_sum(rows, inverse, K, also);
                ASSERT_TRUE(got.defined() && got_both.defined());
                auto summed = [&](const at::Tensor& r) {
                    return r.to(at::kDouble).index_select(0, inverse).view({T, K, H}).sum(1);
                };
                const std::string what = "width " + std::to_string(H) + ", K " + std::to_string(K) +
                                         (dtype == at::kFloat ? " fp32" : " bf16");
                const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
                EXPECT_CLOSE(got.to(at::kCPU, at::kFloat), summed(rows).to(at::kCPU, at::kFloat), tol)
                    << what;
                EXPECT_CLOSE(got_both.to(at::kCPU, at::kFloat),
                             (summed(rows) + summed(also)).to(at::kCPU, at::kFloat), tol)
                    << what << ", two inputs";
            }
        }
    }
    // More than 32 slots a token, or rows that do not divide into tokens: left to the composition.
    at::Tensor rows = at::zeros({66, 8}, at::TensorOptions().device(at::kCUDA));
    EXPECT_FALSE(cuda_slot_sum(rows, at::arange(66, at::kLong).to(at::kCUDA), 33).defined());
    EXPECT_FALSE(cuda_slot_sum(rows, at::arange(66, at::kLong).to(at::kCUDA), 4).defined());
    // A second input of another shape: left to the composition.
    EXPECT_FALSE(
        cuda_slot_sum(rows, at::arange(66, at::kLong).to(at::kCUDA), 6, at::zeros({66, 4}, rows.options()))
            .defined());
}

// The experts' activation with the routing weight of each row, one kernel each way, equals the
// composition silu(g) * u * w in double: the values and the gradients of g, u and w, at a width on
// the vectorised path and one off it. The trainer's grouped experts call it.
TEST(Cuda, WeightedSwigluKernelMatchesTheComposition) {
    SKIP_WITHOUT_CUDA();
    if (!cuda_rows_serve(at::zeros({1}, at::kCUDA))) GTEST_SKIP() << "no CUDA row kernels in this build";
    at::manual_seed(12);
    for (const int64_t W : {768, 36}) {
        for (const auto dtype : {at::kFloat, at::kBFloat16}) {
            const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
            const auto opts = at::TensorOptions().device(at::kCUDA).dtype(dtype);
            at::Tensor g0 = (at::randn({301, W}) * 3).to(opts), u0 = at::randn({301, W}).to(opts);
            at::Tensor w0 = at::rand({301}).to(at::kCUDA), dh = at::randn({301, W}).to(opts);
            at::Tensor g = g0.clone().requires_grad_(true), u = u0.clone().requires_grad_(true),
                       w = w0.clone().requires_grad_(true);
            at::Tensor h = cuda_weighted_swiglu(g, u, w);
            (h * dh).sum().backward();
            at::Tensor gr = g0.to(at::kDouble).requires_grad_(true),
                       ur = u0.to(at::kDouble).requires_grad_(true),
                       wr = w0.to(at::kDouble).requires_grad_(true);
            at::Tensor hr = at::silu(gr) * ur * wr.unsqueeze(1);
            (hr * dh.to(at::kDouble)).sum().backward();
            const std::string what = "width " + std::to_string(W) + (dtype == at::kFloat ? " fp32" : " bf16");
            EXPECT_CLOSE(h.to(at::kCPU, at::kFloat), hr.detach().to(at::kCPU, at::kFloat), tol) << what;
            EXPECT_CLOSE(g.grad().to(at::kCPU, at::kFloat), gr.grad().to(at::kCPU, at::kFloat), tol) << what;
            EXPECT_CLOSE(u.grad().to(at::kCPU, at::kFloat), ur.grad().to(at::kCPU, at::kFloat), tol) << what;
            EXPECT_CLOSE(w.grad().to(at::kCPU, at::kFloat), wr.grad().to(at::kCPU, at::kFloat), tol) << what;
            EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
        }
    }
    // Shapes that do not belong together are refused by name.
    const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    try {
        cuda_weighted_swiglu(at::zeros({4, 8}, opts), at::zeros({4, 8}, opts), at::zeros({3}, at::kCUDA));
        ADD_FAILURE() << "3 weights for 4 rows were accepted";
    } catch (const moerl::Error& e) {
        EXPECT_NE(std::string(e.what()).find("weighted_swiglu"), std::string::npos) << e.what();
    }
}

// The AdamW update pass against torch.optim's formula in double: fp32 moments on the 16-byte path
// with its tail, on a view one element off alignment (one element at a time), with the clipping
// scale read from the device; bf16 moments within a bf16 step of the reference. And bf16 moments
// round without bias: a second moment decaying by beta2 = 0.999 a step reaches 0.999^1000 on
// average (round to nearest would keep it at 1: a 0.1% step is under half of bf16's).
TEST(Cuda, AdamwMasterStepMatchesTheReference) {
    SKIP_WITHOUT_CUDA();
    if (!adamw_master_available()) GTEST_SKIP() << "no CUDA trainer kernels in this build";
    at::manual_seed(5);
    const int64_t n = 100003;  // past the last group of 8: a tail
    const auto cuda = at::TensorOptions().device(at::kCUDA);
    struct Case {
        at::ScalarType moments;
        int64_t offset;  // elements into a larger allocation: 1 = not 16-byte aligned
        bool scale_on_device;
    };
    for (const Case& c : {Case{at::kFloat, 0, false}, Case{at::kFloat, 1, false}, Case{at::kFloat, 0, true},
                          Case{at::kBFloat16, 0, false}, Case{at::kBFloat16, 1, true}}) {
        const std::string what = std::string(c.moments == at::kFloat ? "fp32" : "bf16") +
                                 " moments, offset " + std::to_string(c.offset) +
                                 (c.scale_on_device ? ", scale on the device" : "");
        auto on_gpu = [&](const at::Tensor& host, at::ScalarType type) {
            at::Tensor big = at::empty({n + c.offset}, cuda.dtype(type));
            at::Tensor t = big.narrow(0, c.offset, n);
            t.copy_(host);
            return t;
        };
        const at::Tensor p0 = at::randn({n}), g0 = at::randn({n}).to(at::kBFloat16).to(at::kFloat);
        const at::Tensor m0 = (at::randn({n}) * 0.1).to(c.moments).to(at::kFloat);
        const at::Tensor v0 = (at::rand({n}) * 0.2 + 0.01).to(c.moments).to(at::kFloat);
        at::Tensor p = on_gpu(p0, at::kFloat), g = on_gpu(g0, at::kBFloat16);
        at::Tensor m = on_gpu(m0, c.moments), v = on_gpu(v0, c.moments), w = on_gpu(p0, at::kBFloat16);
        AdamwStep s;
        s.lr = 1e-2, s.beta1 = 0.9, s.beta2 = 0.99, s.weight_decay = 0.1, s.eps = 1e-8, s.step = 3;
        s.grad_scale = 0.5;
        double scale = 0.5;
        if (c.scale_on_device) {
            s.grad_scale = 7.0;  // ignored
            s.grad_scale_on_device = at::full({1}, 0.25, cuda.dtype(at::kFloat));
            scale = 0.25;
        }
        s.rounding_seed = 11;
        adamw_master_step(p, g, m, v, w, s);
        // The reference in double.
        const at::Tensor gd = g0.to(at::kDouble) * scale;
        const at::Tensor md = m0.to(at::kDouble) * s.beta1 + gd * (1 - s.beta1);
        const at::Tensor vd = v0.to(at::kDouble) * s.beta2 + gd * gd * (1 - s.beta2);
        const double bc1 = 1 - std::pow(s.beta1, 3.0), bc2 = 1 - std::pow(s.beta2, 3.0);
        const at::Tensor pd = p0.to(at::kDouble) * (1 - s.lr * s.weight_decay) -
                              (s.lr / bc1) * md / (vd.sqrt() / std::sqrt(bc2) + s.eps);
        auto worst = [](const at::Tensor& got, const at::Tensor& want) {
            return (got.to(at::kCPU, at::kDouble) - want).abs().max().item<double>();
        };
        EXPECT_LT(worst(p, pd), 1e-5) << what;
        EXPECT_LT(worst(w, pd), 1.0 / 128 * pd.abs().max().item<double>()) << what;  // bf16 of the master
        EXPECT_EQ(worst(w, p.to(at::kBFloat16).to(at::kCPU, at::kDouble)), 0.0) << what;
        // fp32 moments to fp32's rounding of the sums; bf16 ones within one bf16 step (2^-7 relative).
        const double rel = c.moments == at::kFloat ? 0.0 : 1.0 / 128 + 1e-5;
        const double abs_tol = c.moments == at::kFloat ? 1e-6 : 1e-7;
        const at::Tensor m_err = (m.to(at::kCPU, at::kDouble) - md).abs() - rel * md.abs();
        const at::Tensor v_err = (v.to(at::kCPU, at::kDouble) - vd).abs() - rel * vd.abs();
        EXPECT_LT(m_err.max().item<double>(), abs_tol) << what;
        EXPECT_LT(v_err.max().item<double>(), abs_tol) << what;
    }
    // Unbiased rounding: 1000 steps of zero gradient from v = 1.
    const int64_t k = 4096;
    at::Tensor p = at::zeros({k}, cuda.dtype(at::kFloat)), g = at::zeros({k}, cuda.dtype(at::kBFloat16));
    at::Tensor m = at::zeros({k}, cuda.dtype(at::kBFloat16)), v = at::ones({k}, cuda.dtype(at::kBFloat16));
    AdamwStep s;
    s.lr = 0, s.beta1 = 0.9, s.beta2 = 0.999;
    for (int t = 1; t <= 1000; ++t) {
        s.step = t;
        s.rounding_seed = static_cast<uint32_t>(t) * 2654435761u;
        adamw_master_step(p, g, m, v, at::Tensor(), s);
    }
    const double mean = v.to(at::kCPU, at::kDouble).mean().item<double>(), want = std::pow(0.999, 1000.0);
    EXPECT_NEAR(mean, want, 0.01 * want) << "bf16 second moments after 1000 decays";
    // Moments of two dtypes are refused by name.
    try {
        adamw_master_step(p, g, m, v.to(at::kFloat), at::Tensor(), s);
        ADD_FAILURE() << "bf16 and fp32 moments were accepted together";
    } catch (const moerl::Error& e) {
        EXPECT_NE(std::string(e.what()).find("both moments fp32 or both bf16"), std::string::npos)
            << e.what();
    }
}

// The body of the test below for a vocabulary of V.
void expect_odd_vocabulary_logprobs_match(int64_t V) {
    const int64_t N = 50, H = 32;
    at::Tensor hidden0 = at::randn({N, H}), weight0 = at::randn({V, H}) * 0.3;
    at::Tensor targets = at::randint(0, 900, {N}, at::kLong);
    at::Tensor g = at::randn({N});
    at::Tensor masked = at::zeros({V});
    masked.narrow(0, 950, 53).fill_(-INFINITY);
    for (const bool with_bias : {false, true}) {
        at::Tensor bias = with_bias ? masked : at::Tensor();
        at::Tensor h_ref = hidden0.clone().requires_grad_(true), w_ref = weight0.clone().requires_grad_(true);
        at::Tensor z = at::matmul(h_ref, w_ref.t());
        if (with_bias) z = z + bias;
        at::Tensor ref = at::log_softmax(z, 1).gather(1, targets.unsqueeze(1)).squeeze(1);
        (ref * g).sum().backward();
        at::Tensor h = hidden0.cuda().requires_grad_(true), w = weight0.cuda().requires_grad_(true);
        at::Tensor lp =
            selected_logprobs(h, w, targets.cuda(), 1.0, with_bias ? bias.cuda() : bias, 16 * V * 4);
        EXPECT_CLOSE(lp.cpu(), ref, 1e-4) << "vocabulary " << V << ", bias " << with_bias;
        (lp * g.cuda()).sum().backward();
        EXPECT_CLOSE(h.grad().cpu(), h_ref.grad(), 1e-4) << "vocabulary " << V << ", bias " << with_bias;
        EXPECT_CLOSE(w.grad().cpu(), w_ref.grad(), 1e-4) << "vocabulary " << V << ", bias " << with_bias;
    }
}

// The log-probability row kernel off its vectorised path: vocabularies that are not a multiple of
// 8 (one partial group of loads, and several), no temperature, no bias, and a bias of -inf on some
// tokens.
TEST(Cuda, SelectedLogprobsOnAnOddVocabularyWithMaskedTokens) {
    SKIP_WITHOUT_CUDA();
    at::manual_seed(6);
    for (const int64_t V : {1003, 20003}) expect_odd_vocabulary_logprobs_match(V);
}

TEST(Cuda, Bf16DecodeMatchesRecompute) {
    SKIP_WITHOUT_CUDA();
    ModelConfig c = gpu_config();
    const at::Device dev(at::kCUDA, 0);
    MoeModel gpu(c, {dev, at::kBFloat16});
    gpu.init_random(3);
    at::manual_seed(4);
    const int64_t B = 3, S = 7, steps = 5;
    at::Tensor ids = at::randint(1, c.vocab_size, {B, S}, at::kLong);
    at::Tensor mask = left_padded_mask({7, 3, 5}, S);
    at::Tensor cont = at::randint(1, c.vocab_size, {steps, B}, at::kLong);
    KvCache cache = gpu.new_cache(B, S + steps);
    std::vector<at::Tensor> logits = {gpu.prefill(cache, ids, mask).logits};
    for (int64_t s = 0; s < steps; ++s) logits.push_back(gpu.decode(cache, cont[s]).logits);
    at::Tensor all_ids = at::cat({ids, cont.t()}, 1);
    at::Tensor all_mask = at::cat({mask, at::ones({B, steps}, at::kLong)}, 1);
    c10::NoGradGuard no_grad;
    ForwardOutput full = gpu.forward(all_ids, all_mask);
    for (int64_t s = 0; s <= steps; ++s) {
        EXPECT_CLOSE(logits[s], full.logits.select(1, S - 1 + s).to(at::kFloat), kBf16Tol) << "step " << s;
    }
}

TEST(Cuda, RoutingReplayIsExact) {
    SKIP_WITHOUT_CUDA();
    ModelConfig c = gpu_config();
    MoeModel gpu(c, {at::Device(at::kCUDA, 0), at::kBFloat16});
    gpu.init_random(5);
    at::Tensor ids = at::randint(1, c.vocab_size, {2, 9}, at::kLong);
    ForwardOutput rec = gpu.forward(ids, at::Tensor(), test::recording());
    {
        c10::NoGradGuard no_grad;
        for (auto& [name, t] : gpu.state_dict())
            if (name.find("mlp.gate.weight") != std::string::npos) t.add_(at::randn_like(t) * 0.5);
    }
    ForwardOutput again = gpu.forward(ids, at::Tensor(), test::recording(rec.routing));
    EXPECT_TRUE(at::equal(again.routing, rec.routing));
}

// Forward only: with ranks as threads of one process, CUDA backward would run every rank's graph
// on LibTorch's single autograd worker thread for the device, and the first collective would
// wait forever for the others. Ranks as processes (the real deployment) do not share it.
TEST(Cuda, EpOverHostTransportMatchesOneRankBf16) {
    SKIP_WITHOUT_CUDA();
    ModelConfig c = gpu_config();
    const at::Device dev(at::kCUDA, 0);
    const int world = 2;
    const int64_t B = 4, S = 8;
    at::manual_seed(6);
    at::Tensor ids = at::randint(1, c.vocab_size, {B, S}, at::kLong);
    at::Tensor mask = left_padded_mask({8, 5, 8, 2}, S);
    MoeModel single(c, {dev, at::kBFloat16});
    single.init_random(7);
    at::Tensor ref;
    {
        c10::NoGradGuard no_grad;
        ref = single.forward(ids, mask).logits;
    }
    std::vector<at::Tensor> parts(world);
    run_ranks(world, c, static_cast<int>(B * S), at::kBFloat16, [&](int rank, ep::Buffer& buffer) {
        MoeModel model(c, {dev, at::kBFloat16, &buffer});
        model.init_random(7);
        auto [begin, count] = part(B, world, rank);
        ForwardOutput out = model.forward(ids.narrow(0, begin, count), mask.narrow(0, begin, count));
        parts[rank] = out.logits.detach();
    });
    EXPECT_CLOSE(at::cat(parts, 0), ref, kBf16Tol);
}

}  // namespace
}  // namespace moerl::model
