// The CUDA generation engine (label gpu): greedy generation equals the CPU model's (fp32 on both)
// under continuous batching with a paged cache, graph replay equals eager launches, bad input is
// refused with a clear message. Without a GPU or a CUDA build only the refusal is checked.
#include "moerl/model/generator.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#if defined(MOERL_TEST_CUDART)
#include <cuda_runtime.h>
#endif

#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "model_test_util.hpp"
#include "moerl/core/error.hpp"
#include "moerl/model/model.hpp"

namespace moerl::model {
namespace {

#define SKIP_WITHOUT_ENGINE()                                                     \
    if (!Generator::available()) GTEST_SKIP() << "built without the CUDA engine"; \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

ModelConfig engine_config() {
    ModelConfig c = test::tiny_config(3, /*dense_layer=*/true);
    c.hidden_size = 64;
    c.head_dim = 16;
    c.validate();
    return c;
}

// The same weights on the CPU and on the GPU (fp32).
struct Twins {
    MoeModel cpu, gpu;
    explicit Twins(const ModelConfig& c, at::ScalarType gpu_dtype = at::kFloat)
        : cpu(c, {}), gpu(c, {at::Device(at::kCUDA, 0), gpu_dtype}) {
        c10::NoGradGuard no_grad;
        cpu.init_random(7);
        auto src = cpu.state_dict();
        auto dst = gpu.state_dict();
        for (size_t i = 0; i < src.size(); ++i) dst[i].second.copy_(src[i].second);
        cpu.set_requires_grad(false);
        gpu.set_requires_grad(false);
    }
};

// Greedy continuation of one prompt by the model's eager path (batch of one).
std::vector<int64_t> greedy_reference(const MoeModel& m, const std::vector<int64_t>& prompt, int steps) {
    c10::NoGradGuard no_grad;
    KvCache cache = m.new_cache(1, static_cast<int64_t>(prompt.size()) + steps + 1);
    at::Tensor ids = at::tensor(prompt, at::kLong).unsqueeze(0);
    at::Tensor next = m.prefill(cache, ids, at::Tensor()).logits.argmax(-1);
    std::vector<int64_t> out;
    for (int s = 0; s < steps; ++s) {
        out.push_back(next.item<int64_t>());
        next = m.decode(cache, next).logits.argmax(-1);
    }
    return out;
}

// Runs fn and expects an Error whose message contains needle.
template <typename F>
void expect_error(F&& fn, const std::string& needle) {
    try {
        fn();
        ADD_FAILURE() << "no error, expected one naming: " << needle;
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

std::vector<int64_t> random_prompt(int64_t len, int vocab, uint64_t seed) {
    std::vector<int64_t> p;
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < len; ++i) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p.push_back(1 + static_cast<int64_t>(x % static_cast<uint64_t>(vocab - 1)));
    }
    return p;
}

TEST(Generator, RefusedWithoutEngineOrOnCpu) {
    MoeModel cpu(engine_config(), {});
    try {
        Generator g(cpu);
        FAIL() << "a CPU model was accepted";
    } catch (const Error& e) {
        const std::string what = e.what();
        if (Generator::available())
            EXPECT_NE(what.find("needs a CUDA device"), std::string::npos) << what;
        else
            EXPECT_NE(what.find("no CUDA generation engine"), std::string::npos) << what;
    }
}

// Sequences of different lengths join and leave between steps; each must continue exactly as it
// would alone on the CPU. Block size 4 spreads every sequence over several cache blocks.
TEST(Generator, ContinuousBatchingGreedyEqualsCpu) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c);
    const int kSteps = 14;
    std::vector<std::vector<int64_t>> prompts = {
        random_prompt(3, c.vocab_size, 1), random_prompt(9, c.vocab_size, 2),
        random_prompt(1, c.vocab_size, 3), random_prompt(13, c.vocab_size, 4),
        random_prompt(6, c.vocab_size, 5)};
    std::vector<std::vector<int64_t>> expected;
    for (const auto& p : prompts) expected.push_back(greedy_reference(t.cpu, p, kSteps));

    Generator gen(t.gpu, {.max_batch = 4, .max_seq_len = 40, .block_size = 4});
    std::map<int, size_t> seq_of_slot;  // slot -> prompt index
    std::map<size_t, std::vector<int64_t>> produced;
    std::map<int, int64_t> next;  // slot -> token to feed
    auto start = [&](std::vector<size_t> which) {
        std::vector<int> slots;
        std::vector<std::vector<int64_t>> ps;
        for (size_t i : which) {
            const int s = gen.acquire();
            ASSERT_GE(s, 0);
            slots.push_back(s);
            ps.push_back(prompts[i]);
            seq_of_slot[s] = i;
        }
        at::Tensor g = gen.prefill(slots, ps).greedy.cpu();
        for (size_t j = 0; j < slots.size(); ++j) {
            next[slots[j]] = g[j].item<int64_t>();
            produced[which[j]].push_back(next[slots[j]]);
        }
    };
    start({0, 1, 2});
    for (int step = 0; step < 3 * kSteps; ++step) {
        if (step == 4) start({3});  // joins mid-way
        std::vector<int> slots;
        std::vector<int64_t> toks;
        for (auto& [s, i] : seq_of_slot)
            if (produced[i].size() < kSteps) slots.push_back(s), toks.push_back(next[s]);
        // Finished sequences leave; their slot and blocks go to the last prompt.
        for (auto it = seq_of_slot.begin(); it != seq_of_slot.end();) {
            if (produced[it->second].size() >= kSteps) {
                gen.release(it->first);
                next.erase(it->first);
                it = seq_of_slot.erase(it);
            } else {
                ++it;
            }
        }
        if (produced.count(4) == 0 && seq_of_slot.size() < 4 && step >= 4) start({4});
        if (slots.empty()) {
            if (seq_of_slot.empty()) break;
            continue;
        }
        GenerationStep r = gen.decode(slots, at::tensor(toks, at::kLong));
        at::Tensor g = r.greedy.cpu();
        for (size_t j = 0; j < slots.size(); ++j) {
            next[slots[j]] = g[j].item<int64_t>();
            produced[seq_of_slot[slots[j]]].push_back(next[slots[j]]);
        }
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
        ASSERT_GE(produced[i].size(), static_cast<size_t>(kSteps)) << "sequence " << i;
        produced[i].resize(kSteps);
        EXPECT_EQ(produced[i], expected[i])
            << "sequence " << i << " (prompt length " << prompts[i].size() << ")";
    }
}

// Logits of a step against the CPU model's, same weights, fp32 on both, with a short prompt (one
// block per head group) and a long one (the sequence split over blocks and merged); graphs with the
// kernels overlapped, and eager profiled steps (plain stream order).
class GeneratorAttention : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(GeneratorAttention, DecodeLogitsMatchCpu) {
    SKIP_WITHOUT_ENGINE();
    ModelConfig c = engine_config();
    c.max_position_embeddings = 512;
    Twins t(c);
    const auto [prompt_len, profile] = GetParam();
    std::vector<int64_t> prompt = random_prompt(prompt_len, c.vocab_size, 11);
    c10::NoGradGuard no_grad;
    KvCache cache = t.cpu.new_cache(1, prompt_len + 10);
    at::Tensor ref = t.cpu.prefill(cache, at::tensor(prompt, at::kLong).unsqueeze(0), at::Tensor()).logits;
    Generator gen(t.gpu, {.max_batch = 2,
                          .max_seq_len = prompt_len + 22,
                          .block_size = 8,
                          .cuda_graphs = !profile,
                          .profile = profile});
    const int s = gen.acquire();
    at::Tensor got = gen.prefill({s}, {prompt}).logits.cpu().to(at::kFloat);
    EXPECT_LT((got - ref).abs().max().item<float>(), 1e-4);
    for (int step = 0; step < 5; ++step) {
        at::Tensor tok = ref.argmax(-1);
        ref = t.cpu.decode(cache, tok).logits;
        got = gen.decode({s}, tok).logits.cpu().to(at::kFloat);
        EXPECT_LT((got - ref).abs().max().item<float>(), 1e-4) << "step " << step;
    }
    EXPECT_EQ(gen.profile().empty(), !profile) << "per-kernel times only when profiled";
}

INSTANTIATE_TEST_SUITE_P(PromptProfile, GeneratorAttention,
                         ::testing::Combine(::testing::Values(10, 300), ::testing::Bool()));

// Many rows (B x key-value heads >= 32: a block serves all of a key-value head's query heads, here
// four) of different lengths against the CPU model row by row (fp32 on both).
TEST(GeneratorAttentionRows, ManyRowsDecodeLogitsMatchCpu) {
    SKIP_WITHOUT_ENGINE();
    ModelConfig c = engine_config();
    c.num_attention_heads = 8;
    c.num_key_value_heads = 2;
    c.validate();
    Twins t(c);
    c10::NoGradGuard no_grad;
    constexpr int kRows = 16, kSteps = 3;
    std::vector<std::vector<int64_t>> prompts;
    std::vector<KvCache> caches;
    std::vector<at::Tensor> refs;  // [1, V] each
    for (int i = 0; i < kRows; ++i) {
        prompts.push_back(random_prompt(5 + 5 * i, c.vocab_size, 100 + i));
        caches.push_back(t.cpu.new_cache(1, 5 + 5 * i + kSteps + 1));
        refs.push_back(
            t.cpu.prefill(caches.back(), at::tensor(prompts.back(), at::kLong).unsqueeze(0), at::Tensor())
                .logits);
    }
    Generator gen(t.gpu, {.max_batch = kRows, .max_seq_len = 5 + 5 * kRows + kSteps, .block_size = 8});
    std::vector<int> slots;
    for (int i = 0; i < kRows; ++i) slots.push_back(gen.acquire());
    at::Tensor got = gen.prefill(slots, prompts).logits.cpu().to(at::kFloat);
    for (int i = 0; i < kRows; ++i)
        EXPECT_LT((got[i] - refs[i][0]).abs().max().item<float>(), 1e-4) << "row " << i;
    for (int step = 0; step < kSteps; ++step) {
        std::vector<at::Tensor> toks;
        for (int i = 0; i < kRows; ++i) {
            toks.push_back(refs[i].argmax(-1));
            refs[i] = t.cpu.decode(caches[i], toks.back()).logits;
        }
        got = gen.decode(slots, at::cat(toks)).logits.cpu().to(at::kFloat);
        for (int i = 0; i < kRows; ++i)
            EXPECT_LT((got[i] - refs[i][0]).abs().max().item<float>(), 1e-4)
                << "row " << i << ", step " << step;
    }
}

// The captured graphs (overlapped kernels: programmatic edges) replay exactly what eager launches
// compute (bf16, a padded bucket of 3 of 4), the eager kernels overlapped or, profiled, in plain
// stream order.
class GeneratorGraphs : public ::testing::TestWithParam<bool> {};

TEST_P(GeneratorGraphs, ReplayEqualsEager) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c, at::kBFloat16);
    std::vector<std::vector<int64_t>> prompts = {random_prompt(5, c.vocab_size, 21),
                                                 random_prompt(2, c.vocab_size, 22),
                                                 random_prompt(11, c.vocab_size, 23)};
    GeneratorOptions o{.max_batch = 4, .max_seq_len = 48, .block_size = 8};
    Generator graphs(t.gpu, o);
    o.cuda_graphs = false;
    o.profile = GetParam();
    Generator eager(t.gpu, o);
    std::vector<int> slots = {graphs.acquire(), graphs.acquire(), graphs.acquire()};
    for (int i = 0; i < 3; ++i) ASSERT_EQ(eager.acquire(), slots[i]);
    at::Tensor a = graphs.prefill(slots, prompts).greedy, b = eager.prefill(slots, prompts).greedy;
    ASSERT_TRUE(at::equal(a.cpu(), b.cpu()));
    for (int step = 0; step < 20; ++step) {
        GenerationStep ra = graphs.decode(slots, a), rb = eager.decode(slots, b);
        ASSERT_TRUE(at::equal(ra.greedy.cpu(), rb.greedy.cpu())) << "step " << step;
        EXPECT_TRUE(at::equal(ra.logits.cpu(), rb.logits.cpu())) << "step " << step;
        a = ra.greedy.clone(), b = rb.greedy.clone();
    }
    EXPECT_EQ(graphs.stats().decode_steps, 20);
    EXPECT_GT(graphs.stats().expert_weight_reads, 0);
}

INSTANTIATE_TEST_SUITE_P(EagerProfiled, GeneratorGraphs, ::testing::Bool());

// A step's own greedy output fed back (read where it lies; the positions moved on by the step itself,
// nothing copied to the device) continues exactly as the same tokens given from the host: with graphs
// and with eager launches, after the caller changes the fed-back tokens in place, and after a row
// leaves and the rows are reordered (the positions and slots uploaded again).
class GeneratorFeedback : public ::testing::TestWithParam<bool> {};

TEST_P(GeneratorFeedback, GreedyFedBackEqualsHostTokens) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c, at::kBFloat16);
    std::vector<std::vector<int64_t>> prompts = {random_prompt(4, c.vocab_size, 31),
                                                 random_prompt(7, c.vocab_size, 32),
                                                 random_prompt(2, c.vocab_size, 33)};
    const GeneratorOptions o{.max_batch = 4, .max_seq_len = 48, .block_size = 4, .cuda_graphs = GetParam()};
    Generator fed(t.gpu, o), host(t.gpu, o);
    std::vector<int> slots = {fed.acquire(), fed.acquire(), fed.acquire()};
    for (int i = 0; i < 3; ++i) ASSERT_EQ(host.acquire(), slots[i]);
    at::Tensor a = fed.prefill(slots, prompts).greedy;
    at::Tensor b = host.prefill(slots, prompts).greedy.cpu();
    ASSERT_TRUE(at::equal(a.cpu(), b));
    for (int step = 0; step < 24; ++step) {
        if (step == 8) {  // the caller overrides the fed-back tokens in place
            a.fill_(7);
            b.fill_(7);
        }
        if (step == 14) {  // the middle row leaves; the last one takes its place in the batch
            fed.release(slots[1]);
            host.release(slots[1]);
            slots = {slots[2], slots[0]};
            a = at::stack({a[2], a[0]});
            b = at::stack({b[2], b[0]});
        }
        GenerationStep ra = fed.decode(slots, a), rb = host.decode(slots, b);
        ASSERT_TRUE(at::equal(ra.greedy.cpu(), rb.greedy.cpu())) << "step " << step;
        EXPECT_TRUE(at::equal(ra.logits.cpu(), rb.logits.cpu())) << "step " << step;
        a = ra.greedy;  // the engine's own buffer: fed back in place
        b = rb.greedy.cpu();
    }
    for (int s : slots) EXPECT_EQ(fed.length(s), host.length(s));
}

INSTANTIATE_TEST_SUITE_P(Graphs, GeneratorFeedback, ::testing::Bool());

// The experts as grouped GEMMs (the path of large batches, forced here from one row; the slot rows
// gathered, activated and scattered by their own kernels) decode as the expert kernels do: bf16, the
// same host tokens into both, logits within bf16 rounding and the same greedy tokens, with graphs.
TEST(Generator, GroupedGemmExpertsDecodeAsTheExpertKernels) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c, at::kBFloat16);
    std::vector<std::vector<int64_t>> prompts;
    for (int i = 0; i < 6; ++i) prompts.push_back(random_prompt(3 + 2 * i, c.vocab_size, 60 + i));
    GeneratorOptions o{.max_batch = 8, .max_seq_len = 48, .block_size = 8};
    o.grouped_min_batch = 1;
    Generator grouped(t.gpu, o);
    o.grouped_min_batch = 1 << 20;
    Generator kernels(t.gpu, o);
    std::vector<int> slots;
    for (size_t i = 0; i < prompts.size(); ++i) {
        slots.push_back(grouped.acquire());
        ASSERT_EQ(kernels.acquire(), slots.back());
    }
    at::Tensor tokens = grouped.prefill(slots, prompts).greedy.cpu();
    ASSERT_TRUE(at::equal(tokens, kernels.prefill(slots, prompts).greedy.cpu()));
    int same = 0, total = 0;
    for (int step = 0; step < 10; ++step) {
        GenerationStep a = grouped.decode(slots, tokens), b = kernels.decode(slots, tokens);
        const at::Tensor la = a.logits.cpu().to(at::kFloat), lb = b.logits.cpu().to(at::kFloat);
        EXPECT_LT((la - lb).abs().max().item<float>(), 0.1f) << "step " << step;
        same += at::eq(a.greedy.cpu(), b.greedy.cpu()).sum().item<int>();
        total += static_cast<int>(slots.size());
        tokens = a.greedy.cpu();
    }
    EXPECT_GE(same, total - 2) << "greedy tokens of the two paths parted too often";
    EXPECT_GT(grouped.stats().expert_weight_reads, 0);
}

// One-row steps with the LM head through the GEMV kernel (the final norm inside it, no cuBLAS call)
// continue as the CPU model does and as cuBLAS projections do (gemv_max_batch = 0), fp32 on both.
TEST(Generator, LmHeadGemvMatchesCublasAndCpu) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c);
    const std::vector<int64_t> prompt = random_prompt(6, c.vocab_size, 41);
    constexpr int kSteps = 10;
    const std::vector<int64_t> expected = greedy_reference(t.cpu, prompt, kSteps + 1);
    auto run = [&](int gemv_max_batch, std::vector<at::Tensor>& logits) {
        Generator gen(t.gpu,
                      {.max_batch = 1, .max_seq_len = 32, .block_size = 4, .gemv_max_batch = gemv_max_batch});
        const int s = gen.acquire();
        at::Tensor next = gen.prefill({s}, {prompt}).greedy;
        std::vector<int64_t> tokens;
        for (int i = 0; i < kSteps; ++i) {
            GenerationStep r = gen.decode({s}, next);
            logits.push_back(r.logits.cpu().clone());
            tokens.push_back(r.greedy.item<int64_t>());
            next = r.greedy;
        }
        return tokens;
    };
    std::vector<at::Tensor> gemv_logits, blas_logits;
    const std::vector<int64_t> gemv = run(1, gemv_logits), blas = run(0, blas_logits);
    EXPECT_EQ(gemv, std::vector<int64_t>(expected.begin() + 1, expected.end()));
    EXPECT_EQ(gemv, blas);
    for (int i = 0; i < kSteps; ++i)
        EXPECT_TRUE(at::allclose(gemv_logits[i], blas_logits[i], 1e-4, 1e-4))
            << "step " << i << ": max difference "
            << (gemv_logits[i] - blas_logits[i]).abs().max().item<float>();
}

TEST(Generator, BadInputIsRefusedAndTheEngineStaysUsable) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c);
    Generator gen(t.gpu, {.max_batch = 2, .max_seq_len = 16, .block_size = 4, .num_blocks = 3});
    expect_error([&] { gen.decode({0}, at::tensor({1L})); }, "slot 0 is not acquired");
    const int s = gen.acquire();
    expect_error([&] { gen.decode({s}, at::tensor({1L})); }, "has no prompt");
    expect_error([&] { gen.prefill({s}, {{1, 2, c.vocab_size}}); }, "vocab_size");
    expect_error([&] { gen.prefill({s}, {std::vector<int64_t>(16, 1)}); }, "max_seq_len");
    expect_error([&] { gen.prefill({s}, {std::vector<int64_t>(13, 1)}); }, "KV-cache blocks");  // 4 of 3
    EXPECT_EQ(gen.free_blocks(), 3);
    at::Tensor g = gen.prefill({s}, {{1, 2, 3}}).greedy;
    expect_error([&] { gen.decode({s}, at::tensor({-4L})); }, "vocab_size");
    expect_error([&] { gen.decode({s, s}, at::tensor({1L, 1L})); }, "listed twice");
    expect_error([&] { gen.decode({7}, at::tensor({1L})); }, "out of range");
    // Still usable: 12 tokens fill the 3 blocks, the 13th finds none and changes nothing.
    for (int i = 3; i < 12; ++i) g = gen.decode({s}, g).greedy;
    EXPECT_EQ(gen.length(s), 12);
    expect_error([&] { gen.decode({s}, g); }, "out of blocks");
    EXPECT_EQ(gen.length(s), 12);
    gen.release(s);
    EXPECT_EQ(gen.free_blocks(), 3);

    Generator small(t.gpu, {.max_batch = 1, .max_seq_len = 6, .block_size = 4});
    const int s2 = small.acquire();
    at::Tensor h = small.prefill({s2}, {{5, 6}}).greedy;
    for (int i = 2; i < 6; ++i) h = small.decode({s2}, h).greedy;
    expect_error([&] { small.decode({s2}, h); }, "is full");
    EXPECT_EQ(small.acquire(), -1);
}

// x rounded to e4m3's grid (3 mantissa bits, steps of 2^-9 below 2^-6, at most 448 in magnitude),
// by tensor ops (round half to even, as the device's conversion).
at::Tensor e4m3_grid(const at::Tensor& x) {
    const at::Tensor step = at::pow(2.0, at::floor(at::log2(x.abs().clamp_min(1e-30))).clamp_min(-6) - 3);
    return (at::round(x / step) * step).clamp(-448, 448);
}

// Puts a weight matrix (or a stack of them) on the FP8 grid: e4m3 values times 2^-13, the first
// element of every 128 x 128 block 448 x 2^-13. The engine's quantiser then finds the scale 2^-13 in
// every block and recovers each weight exactly: an FP8 engine and a bf16 engine on such a model read
// the same weights.
void put_on_fp8_grid(at::Tensor& w) {
    at::Tensor x = e4m3_grid(w.to(at::kFloat).cpu() * 8192.0f);
    at::Tensor v = x.dim() == 3 ? x : x.unsqueeze(0);
    for (int64_t r0 = 0; r0 < v.size(1); r0 += 128)
        for (int64_t c0 = 0; c0 < v.size(2); c0 += 128) v.narrow(1, r0, 1).narrow(2, c0, 1).fill_(448.0f);
    w.copy_((x / 8192.0f).to(w.options()));
}

ModelConfig fp8_config() {
    ModelConfig c = test::tiny_config(3, /*dense_layer=*/true);
    c.hidden_size = 192;  // two scale blocks, the second one half full
    c.head_dim = 32;      // 4 heads x 32 = 128
    c.moe_intermediate_size = 64;
    c.tie_word_embeddings = false;
    c.initializer_range = 0.02;
    c.validate();
    return c;
}

// FP8 rollout (GeneratorOptions::fp8_weights). On a model whose projections lie on the FP8 grid the
// FP8 engine equals the bf16 engine but for the sum order (rounding to fp16 is exact for these
// inputs): decode steps of 1 row, 5 and 12 (dense projections in e4m3 on the CUDA cores, in e4m3 on
// the tensor cores, in bf16), the routed experts in e4m3 in all. After the model's weights change (off the
// grid) and refresh_weights(), the engine decodes exactly as an FP8 engine built on the new weights. Bad uses
// are refused by name.
TEST(Generator, Fp8WeightsDecodeAsBf16OnTheGridAndFollowWeightSyncs) {
    SKIP_WITHOUT_ENGINE();
    c10::NoGradGuard no_grad;
    const ModelConfig c = fp8_config();
    MoeModel model(c, {at::Device(at::kCUDA, 0), at::kBFloat16});
    model.init_random(3);
    model.set_requires_grad(false);
    for (auto& [name, t] : model.state_dict()) {
        const bool dense_mlp = name.find("mlp.gate_proj") != std::string::npos ||
                               name.find("mlp.up_proj") != std::string::npos ||
                               name.find("mlp.down_proj") != std::string::npos;
        if ((name.find("_proj") != std::string::npos && !dense_mlp) || name == "lm_head.weight")
            put_on_fp8_grid(t);
    }
    std::vector<std::vector<int64_t>> prompts;
    for (int b = 0; b < 12; ++b) prompts.push_back(random_prompt(5 + b % 4, c.vocab_size, 70 + b));
    constexpr int kSteps = 6;
    // Logits and experts used (sorted) of kSteps steps of `rows` rows, each step's tokens fixed in
    // advance.
    struct Steps {
        std::vector<at::Tensor> logits, experts;
    };
    auto run = [&](Generator& gen, int rows) {
        std::vector<int> slots;
        for (int b = 0; b < rows; ++b) slots.push_back(gen.acquire());
        gen.prefill(slots, std::vector<std::vector<int64_t>>(prompts.begin(), prompts.begin() + rows));
        Steps out;
        for (int i = 0; i < kSteps; ++i) {
            at::Tensor tokens = at::arange(rows, at::kLong).add_(3 * i + 1).remainder_(c.vocab_size);
            const GenerationStep r = gen.decode(slots, tokens);
            out.logits.push_back(r.logits.to(at::kFloat).cpu());
            out.experts.push_back(std::get<0>(r.routing.to(at::kInt).cpu().sort(-1)));
        }
        for (int s : slots) gen.release(s);
        return out;
    };
    const GeneratorOptions bf16_options{
        .max_batch = 12, .max_seq_len = 32, .block_size = 4, .record_routing = true};
    GeneratorOptions fp8_options = bf16_options;
    fp8_options.fp8_weights = true;
    // 5 and 12 rows sit on either side of DecodeStep's kFp8DenseMaxRows (8).
    for (const int rows : {1, 5, 12}) {
        SCOPED_TRACE("rows " + std::to_string(rows));
        Generator fp8(model, fp8_options), bf16(model, bf16_options);
        const Steps a = run(fp8, rows), b = run(bf16, rows);
        // A row whose experts differ once (a near tie in its router, tipped by the sum order) goes
        // its own way from then on: it is compared up to there.
        std::vector<bool> apart(rows, false);
        int compared = 0;
        for (int i = 0; i < kSteps; ++i)
            for (int row = 0; row < rows; ++row) {
                apart[row] = apart[row] || !at::equal(a.experts[i][row], b.experts[i][row]);
                if (apart[row]) continue;
                ++compared;
                const float scale = b.logits[i][row].abs().max().item<float>();
                const float err = (a.logits[i][row] - b.logits[i][row]).abs().max().item<float>();
                EXPECT_GT(scale, 0.0f);
                EXPECT_LE(err, 0.02f * scale)
                    << "step " << i << " row " << row << ": logits of magnitude " << scale;
            }
        EXPECT_GE(compared, rows * kSteps * 3 / 4) << "rows whose experts parted from the bf16 engine's";
    }
    // A weight sync: the model changes in place, refresh_weights() quantises again.
    Generator synced(model, fp8_options), stale(model, fp8_options);
    for (auto& [name, t] : model.state_dict())
        if (name.find("experts") != std::string::npos || name.find("self_attn") != std::string::npos ||
            name == "lm_head.weight")
            t.mul_(1.5).add_(0.003);
    synced.refresh_weights();
    Generator fresh(model, fp8_options);
    const Steps a = run(synced, 3), b = run(fresh, 3);
    for (int i = 0; i < kSteps; ++i) EXPECT_TRUE(at::equal(a.logits[i], b.logits[i])) << "step " << i;
    EXPECT_FALSE(at::equal(run(stale, 3).logits[0], a.logits[0]))
        << "an engine not refreshed decodes as the synced one";
    // What the FP8 engine refuses, by name.
    MoeModel fp32(c, {at::Device(at::kCUDA, 0), at::kFloat});
    expect_error([&] { Generator g(fp32, fp8_options); }, "fp8_weights needs a bfloat16 model");
    MoeModel narrow(engine_config(), {at::Device(at::kCUDA, 0), at::kBFloat16});
    expect_error([&] { Generator g(narrow, fp8_options); }, "multiples of 64");
}

// A model the FP8 KV cache serves: 8 query heads per 2 key-value heads of 64 dims.
ModelConfig fp8_kv_config() {
    ModelConfig c = test::tiny_config(3, /*dense_layer=*/true);
    c.hidden_size = 128;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 2;
    c.head_dim = 64;
    c.validate();
    return c;
}

// FP8 KV cache (GeneratorOptions::fp8_kv_cache). A token takes (D + 4) / 2D of the bf16 cache's
// bytes. Teacher-forced on the bf16-cache engine's greedy tokens (1 row, and 8 rows of prompts of 5
// to 12 tokens), the FP8-cache engine's logits stay within 4% of each row's range of the bf16 cache's
// on average (e4m3 keeps 3 mantissa bits: a few percent a value; 1.3-2% seen on an H100) and within a
// quarter in every row and step (a token whose experts change with the rounding moves further: 11%
// seen once), and its greedy tokens mostly agree. Forks
// of a prompt with a partial last block (its copy carries the scales) decode bit for bit as the
// prompt's own slot; a prompt continued in a second part (its cached rows read back dequantised)
// decodes close to the whole prompt. Bad uses are refused by name.
TEST(Generator, Fp8KvCacheDecodesCloseToBf16AndForksExactly) {
    SKIP_WITHOUT_ENGINE();
    c10::NoGradGuard no_grad;
    const ModelConfig c = fp8_kv_config();
    MoeModel model(c, {at::Device(at::kCUDA, 0), at::kBFloat16});
    model.init_random(5);
    model.set_requires_grad(false);
    const GeneratorOptions bf16_options{.max_batch = 8, .max_seq_len = 48, .block_size = 4};
    GeneratorOptions fp8_options = bf16_options;
    fp8_options.fp8_kv_cache = true;
    {
        Generator bf16(model, bf16_options), fp8(model, fp8_options);
        EXPECT_EQ(fp8.kv_bytes_per_token() * 2 * c.head_dim, bf16.kv_bytes_per_token() * (c.head_dim + 4));
    }
    std::vector<std::vector<int64_t>> prompts;
    for (int b = 0; b < 8; ++b) prompts.push_back(random_prompt(5 + b, c.vocab_size, 90 + b));
    for (const int rows : {1, 8}) {
        SCOPED_TRACE("rows " + std::to_string(rows));
        Generator bf16(model, bf16_options), fp8(model, fp8_options);
        std::vector<int> s16, s8;
        for (int b = 0; b < rows; ++b) s16.push_back(bf16.acquire()), s8.push_back(fp8.acquire());
        const std::vector<std::vector<int64_t>> ps(prompts.begin(), prompts.begin() + rows);
        at::Tensor tokens = bf16.prefill(s16, ps).greedy.clone();
        fp8.prefill(s8, ps);
        int64_t agree = 0, compared = 0;
        double diff_sum = 0, apart_sum = 0;
        for (int i = 0; i < 20; ++i) {
            const GenerationStep a = fp8.decode(s8, tokens);
            const at::Tensor xa = a.logits.to(at::kFloat).cpu(), ga = a.greedy.cpu();
            const GenerationStep b = bf16.decode(s16, tokens);
            const at::Tensor xb = b.logits.to(at::kFloat).cpu(), gb = b.greedy.cpu();
            const at::Tensor t = gb.unsqueeze(1);
            diff_sum += (at::log_softmax(xa, -1).gather(1, t) - at::log_softmax(xb, -1).gather(1, t))
                            .abs()
                            .sum()
                            .item<double>();
            agree += ga.eq(gb).sum().item<int64_t>();
            compared += rows;
            const at::Tensor range = std::get<0>(xb.max(-1)) - std::get<0>(xb.min(-1));
            const at::Tensor apart = std::get<0>((xa - xb).abs().max(-1));
            EXPECT_TRUE((apart <= range * 0.25).all().item<bool>())
                << "step " << i << ": logits apart by " << apart << " against row ranges " << range;
            apart_sum += (apart / range).sum().item<double>();
            tokens = b.greedy.clone();
        }
        EXPECT_LT(diff_sum / static_cast<double>(compared), 0.1) << "mean |log-prob difference|";
        EXPECT_LT(apart_sum / static_cast<double>(compared), 0.04)
            << "mean largest logit difference / row range";
        EXPECT_GE(agree * 10, compared * 7) << agree << " of " << compared << " greedy tokens agree";
    }
    // Forks: 10 tokens (two full blocks and a partial one), forked twice, the same token fed to all
    // three rows: the three rows' logits are equal.
    {
        Generator gen(model, fp8_options);
        std::vector<int> slots{gen.acquire(), gen.acquire(), gen.acquire()};
        const std::vector<int64_t> p = random_prompt(10, c.vocab_size, 81);
        at::Tensor next = gen.prefill({slots[0]}, {p}).greedy.cpu();
        gen.fork(slots[0], slots[1]);
        gen.fork(slots[0], slots[2]);
        at::Tensor fed = next.expand({3}).contiguous();
        for (int i = 0; i < 4; ++i) {  // through the partial block and into a new one
            const GenerationStep r = gen.decode(slots, fed);
            const at::Tensor l = r.logits.cpu();
            EXPECT_TRUE(at::equal(l[0], l[1]) && at::equal(l[0], l[2])) << "step " << i;
            fed = r.greedy.cpu()[0].expand({3}).contiguous();
        }
    }
    // A prompt in two parts against the whole prompt.
    {
        Generator whole(model, fp8_options), parts(model, fp8_options);
        const std::vector<int64_t> p = random_prompt(14, c.vocab_size, 82);
        const int sw = whole.acquire(), sp = parts.acquire();
        const at::Tensor lw = whole.prefill({sw}, {p}).logits.to(at::kFloat).cpu();
        parts.prefill({sp}, {std::vector<int64_t>(p.begin(), p.begin() + 9)});
        const at::Tensor lp =
            parts.prefill({sp}, {std::vector<int64_t>(p.begin() + 9, p.end())}).logits.to(at::kFloat).cpu();
        EXPECT_EQ(parts.length(sp), 14);
        EXPECT_LE((lw - lp).abs().max().item<float>(), 0.1f * (lw.max() - lw.min()).item<float>())
            << "a prompt continued from its cached (dequantised) rows";
    }
    // What the FP8 cache refuses, by name.
    MoeModel fp32(c, {at::Device(at::kCUDA, 0), at::kFloat});
    expect_error([&] { Generator g(fp32, fp8_options); }, "fp8_kv_cache needs a bfloat16 model");
    MoeModel small_heads(engine_config(), {at::Device(at::kCUDA, 0), at::kBFloat16});
    expect_error([&] { Generator g(small_heads, fp8_options); }, "of 64 or 128 dims");
}

// Greedy continuation of one prompt after one forced token (so the samples of a group diverge), by
// the model's eager path.
std::vector<int64_t> greedy_after(const MoeModel& m, const std::vector<int64_t>& prompt, int64_t forced,
                                  int steps) {
    c10::NoGradGuard no_grad;
    KvCache cache = m.new_cache(1, static_cast<int64_t>(prompt.size()) + steps + 2);
    m.prefill(cache, at::tensor(prompt, at::kLong).unsqueeze(0), at::Tensor());
    at::Tensor next = m.decode(cache, at::tensor({forced})).logits.argmax(-1);
    std::vector<int64_t> out;
    for (int s = 0; s < steps; ++s) {
        out.push_back(next.item<int64_t>());
        next = m.decode(cache, next).logits.argmax(-1);
    }
    return out;
}

// GRPO groups in one prefill: each distinct prompt runs through the model once, the samples of a
// prompt share its full blocks and copy its partial last block, and each sample then continues as it
// would alone (a different first token each, so a block written by two samples would show), also
// after the sample that prefilled the group leaves. Shared blocks return with their last holder.
TEST(Generator, SharedPromptGroupsDecodeAsIfAlone) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c);
    const int kSteps = 8;
    const std::vector<int64_t> a = random_prompt(13, c.vocab_size, 21);  // 3 full blocks + 1 token
    const std::vector<int64_t> b = random_prompt(12, c.vocab_size, 22);  // 3 full blocks
    const std::vector<int64_t> lone = random_prompt(5, c.vocab_size, 23);
    const std::vector<std::vector<int64_t>> prompts = {a, b, a, lone, b, a, b};
    const int n = static_cast<int>(prompts.size());
    for (const bool share : {true, false}) {
        SCOPED_TRACE(share ? "shared" : "unshared");
        Generator gen(t.gpu, {.max_batch = 8, .max_seq_len = 40, .block_size = 4, .share_prompts = share});
        const int64_t usable = gen.free_blocks();
        std::vector<int> slots;
        for (int i = 0; i < n; ++i) slots.push_back(gen.acquire());
        GenerationStep first = gen.prefill(slots, prompts);
        const int64_t shared_tokens = share ? 2 * 13 + 2 * 12 : 0;
        EXPECT_EQ(first.shared_tokens, shared_tokens);
        EXPECT_EQ(gen.stats().prefill_tokens, share ? 13 + 12 + 5 : 3 * 13 + 3 * 12 + 5);
        EXPECT_EQ(gen.stats().prefill_tokens_shared, shared_tokens);
        // a: 4 blocks, its two other samples 1 each (the partial copy); b: 3; lone: 2.
        EXPECT_EQ(gen.shared_blocks(), share ? 2 * 3 + 2 * 3 : 0);
        EXPECT_EQ(usable - gen.free_blocks(), share ? 4 + 2 + 3 + 2 : 3 * 4 + 3 * 3 + 2);
        {
            c10::NoGradGuard no_grad;
            const at::Tensor got = first.logits.cpu();
            for (int i = 0; i < n; ++i) {
                KvCache cache = t.cpu.new_cache(1, 16);
                const at::Tensor ref =
                    t.cpu.prefill(cache, at::tensor(prompts[i], at::kLong).unsqueeze(0), at::Tensor()).logits;
                EXPECT_LT((got[i] - ref[0]).abs().max().item<float>(), 1e-4) << "row " << i;
            }
        }
        std::vector<int64_t> forced;
        std::vector<std::vector<int64_t>> expected;
        for (int i = 0; i < n; ++i) {
            forced.push_back(1 + (7 * i) % (c.vocab_size - 1));
            expected.push_back(greedy_after(t.cpu, prompts[i], forced[i], kSteps));
        }
        std::vector<std::vector<int64_t>> produced(n);
        std::vector<int> live = slots;
        std::vector<int> row_of_live(n);
        for (int i = 0; i < n; ++i) row_of_live[i] = i;
        at::Tensor next = gen.decode(live, at::tensor(forced, at::kLong)).greedy;
        for (int step = 0; step < kSteps; ++step) {
            const at::Tensor host = next.cpu();
            for (size_t j = 0; j < live.size(); ++j)
                produced[row_of_live[j]].push_back(host[static_cast<int64_t>(j)].item<int64_t>());
            if (step == 2) {  // the sample that prefilled prompt a leaves; the others read its blocks
                gen.release(live[0]);
                live.erase(live.begin());
                row_of_live.erase(row_of_live.begin());
                next = host.narrow(0, 1, static_cast<int64_t>(live.size()));
            }
            if (step + 1 < kSteps) next = gen.decode(live, next).greedy;
        }
        for (int i = 0; i < n; ++i) {
            const size_t want = i == 0 ? 3 : kSteps;
            ASSERT_EQ(produced[i].size(), want) << "row " << i;
            EXPECT_EQ(produced[i], std::vector<int64_t>(expected[i].begin(), expected[i].begin() + want))
                << "row " << i << " (prompt length " << prompts[i].size() << ")";
        }
        for (int s : live) gen.release(s);
        EXPECT_EQ(gen.free_blocks(), usable);
        EXPECT_EQ(gen.shared_blocks(), 0);
    }
}

// A prefill in several passes (shortest prompts first, a pass of at most prefill_chunk_tokens)
// returns what one pass returns: the logits, and routing records left-aligned to the call's longest
// prompt; and the cache it leaves decodes the same.
TEST(Generator, PrefillInPassesEqualsOnePass) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c);
    const std::vector<std::vector<int64_t>> prompts = {
        random_prompt(9, c.vocab_size, 41), random_prompt(3, c.vocab_size, 42),
        random_prompt(13, c.vocab_size, 43), random_prompt(9, c.vocab_size, 41)};
    std::vector<at::Tensor> logits, routing, decoded;
    for (const int64_t chunk : {int64_t{32768}, int64_t{12}}) {
        Generator gen(t.gpu, {.max_batch = 4,
                              .max_seq_len = 24,
                              .block_size = 4,
                              .prefill_chunk_tokens = chunk,
                              .record_routing = true});
        std::vector<int> slots;
        for (size_t i = 0; i < prompts.size(); ++i) slots.push_back(gen.acquire());
        GenerationStep r = gen.prefill(slots, prompts);
        logits.push_back(r.logits.cpu());
        routing.push_back(r.routing.cpu());
        decoded.push_back(gen.decode(slots, r.greedy).logits.cpu());
    }
    ASSERT_EQ(routing[0].sizes(), routing[1].sizes());
    EXPECT_EQ(routing[0].size(1), 13);
    EXPECT_TRUE(at::equal(routing[0], routing[1])) << "routing records differ";
    EXPECT_EQ(routing[0][1].narrow(0, 0, 10).max().item<int>(), -1) << "rows before a 3-token prompt";
    EXPECT_LT((logits[0] - logits[1]).abs().max().item<float>(), 1e-5);
    EXPECT_LT((decoded[0] - decoded[1]).abs().max().item<float>(), 1e-5);
}

// Chunked prefill: prompts appended in parts (chunk ends on and off block boundaries, a pass mixing
// a continuing slot with a fresh one, another slot decoding in between) leave the cache a whole
// prefill leaves: the last part's logits equal the CPU model's for the whole prompt, and greedy
// decoding continues exactly as the CPU's.
TEST(Generator, ChunkedPrefillEqualsTheWholePrompt) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c);
    const std::vector<int64_t> a = random_prompt(21, c.vocab_size, 61),
                               b = random_prompt(10, c.vocab_size, 62),
                               other = random_prompt(5, c.vocab_size, 63);
    Generator gen(t.gpu, {.max_batch = 4, .max_seq_len = 40, .block_size = 4, .record_routing = true});
    const int sa = gen.acquire(), sb = gen.acquire(), so = gen.acquire();
    auto part = [](const std::vector<int64_t>& p, size_t from, size_t to) {
        return std::vector<int64_t>(p.begin() + from, p.begin() + to);
    };
    std::vector<int64_t> got_o{gen.prefill({so}, {other}).greedy.cpu()[0].item<int64_t>()};
    auto decode_other = [&] {
        got_o.push_back(
            gen.decode({so}, at::tensor({got_o.back()}, at::kLong)).greedy.cpu()[0].item<int64_t>());
    };
    // a: 8 (two whole blocks), then 3 in one call with b's first 3, then 3 with b's last 7, then 7.
    gen.prefill({sa}, {part(a, 0, 8)});
    decode_other();
    GenerationStep mixed = gen.prefill({sb, sa}, {part(b, 0, 3), part(a, 8, 11)});
    EXPECT_EQ(mixed.routing.size(1), 3);
    EXPECT_EQ(gen.length(sa), 11);
    decode_other();
    GenerationStep both = gen.prefill({sa, sb}, {part(a, 11, 14), part(b, 3, 10)});
    GenerationStep last = gen.prefill({sa}, {part(a, 14, 21)});
    EXPECT_EQ(gen.length(sa), 21);
    EXPECT_EQ(gen.length(sb), 10);
    EXPECT_EQ(last.routing.size(1), 7);
    EXPECT_GE(last.routing.min().item<int>(), 0) << "every token of a part has its experts recorded";
    c10::NoGradGuard no_grad;
    KvCache cache = t.cpu.new_cache(1, 30);
    at::Tensor ref = t.cpu.prefill(cache, at::tensor(a, at::kLong).unsqueeze(0), at::Tensor()).logits;
    EXPECT_LT((last.logits.cpu().to(at::kFloat) - ref).abs().max().item<float>(), 1e-4);
    // Both chunked sequences, together, and the one that decoded between their parts continue as on
    // the CPU.
    const std::vector<int64_t> want_a = greedy_reference(t.cpu, a, 6), want_b = greedy_reference(t.cpu, b, 6);
    std::vector<int64_t> got_a{last.greedy.cpu()[0].item<int64_t>()},
        got_b{both.greedy.cpu()[1].item<int64_t>()};
    for (int i = 1; i < 6; ++i) {
        at::Tensor g = gen.decode({sa, sb}, at::tensor({got_a.back(), got_b.back()}, at::kLong)).greedy.cpu();
        got_a.push_back(g[0].item<int64_t>());
        got_b.push_back(g[1].item<int64_t>());
    }
    EXPECT_EQ(got_a, want_a);
    EXPECT_EQ(got_b, want_b);
    EXPECT_EQ(got_o, greedy_reference(t.cpu, other, 3));
    // A part that would leave no room to generate is refused, naming the slot's tokens.
    expect_error([&] { gen.prefill({sa}, {std::vector<int64_t>(14, 1)}); },
                 "slot " + std::to_string(sa) + " holds 26 tokens and prompt 0 adds 14");
    EXPECT_EQ(gen.length(sa), 26);
}

// fork(): a prompt prefilled in chunks into one slot and forked into others shares its full blocks
// (reference-counted); each fork writes its own copy of the partial last block, so rows fed
// different tokens continue as the CPU model does on each; releasing them gives every block back.
// Forking into a slot that holds tokens, from an empty one, or with no block free for the partial
// copy is refused and leaves the engine usable.
TEST(Generator, ForkedSlotsDecodeAsTheirOwnPrefill) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c);
    Generator gen(t.gpu, {.max_batch = 4, .max_seq_len = 24, .block_size = 4, .num_blocks = 5});
    const std::vector<int64_t> p = random_prompt(10, c.vocab_size, 71);  // 2 full blocks + 2 tokens
    ASSERT_EQ(gen.free_blocks(), 5);
    std::vector<int> slots;
    for (int i = 0; i < 4; ++i) slots.push_back(gen.acquire());
    gen.prefill({slots[0]}, {std::vector<int64_t>(p.begin(), p.begin() + 6)});
    GenerationStep r = gen.prefill({slots[0]}, {std::vector<int64_t>(p.begin() + 6, p.end())});
    expect_error([&] { gen.fork(slots[1], slots[2]); }, "holds no tokens");
    expect_error([&] { gen.fork(slots[0], slots[0]); }, "its own tokens");
    gen.fork(slots[0], slots[1]);
    gen.fork(slots[0], slots[2]);
    expect_error([&] { gen.fork(slots[0], slots[1]); }, "already holds 10 tokens");
    EXPECT_EQ(gen.shared_blocks(), 4);  // two full blocks, twice
    EXPECT_EQ(gen.free_blocks(), 0);    // the prompt's 3, a partial copy each
    expect_error([&] { gen.fork(slots[0], slots[3]); }, "no block is free");
    EXPECT_EQ(gen.length(slots[3]), 0);
    EXPECT_EQ(gen.length(slots[2]), 10);
    // Three rows, three different next tokens, two steps (both inside the partial blocks).
    const int64_t t0 = r.greedy.cpu()[0].item<int64_t>();
    const std::vector<int64_t> fed = {t0, (t0 + 1) % c.vocab_size, (t0 + 2) % c.vocab_size};
    const std::vector<int> three = {slots[0], slots[1], slots[2]};
    at::Tensor g1 = gen.decode(three, at::tensor(fed, at::kLong)).greedy;
    const at::Tensor first = g1.cpu(), second = gen.decode(three, g1).greedy.cpu();
    for (int i = 0; i < 3; ++i) {
        std::vector<int64_t> context = p;
        context.push_back(fed[i]);
        const std::vector<int64_t> want = greedy_reference(t.cpu, context, 2);
        EXPECT_EQ((std::vector<int64_t>{first[i].item<int64_t>(), second[i].item<int64_t>()}), want)
            << "row " << i;
    }
    for (int s : three) gen.release(s);
    EXPECT_EQ(gen.free_blocks(), 5);
    EXPECT_EQ(gen.shared_blocks(), 0);
    EXPECT_EQ(gen.prefill({slots[3]}, {{1, 2, 3}}).greedy.cpu()[0].item<int64_t>(),
              greedy_reference(t.cpu, {1, 2, 3}, 1)[0]);
}

// A KV cache larger than the GPU is refused, naming the bytes and the settings to lower.
TEST(Generator, AKvCacheLargerThanTheGpuIsRefusedByName) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c);
    try {
        Generator gen(t.gpu, {.max_batch = 1024, .max_seq_len = 1 << 18});  // about 200 GiB of cache
        FAIL() << "a cache of " << gen.cache_memory_bytes() << " bytes was allocated";
    } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("out of memory: the KV cache needs"), std::string::npos) << what;
        EXPECT_NE(what.find("rollout.max_batch"), std::string::npos) << what;
    }
    Generator fits(t.gpu, {.max_batch = 2, .max_seq_len = 64});  // and the GPU is still usable
    const int s = fits.acquire();
    EXPECT_EQ(fits.prefill({s}, {{1, 2, 3}}).greedy.numel(), 1);
}

// A group that does not fit is refused before anything changes; a released slot cannot be released
// again; the engine then serves a group that fits.
TEST(Generator, SharedPromptMisuseIsRefusedAndTheEngineStaysUsable) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = engine_config();
    Twins t(c);
    Generator gen(t.gpu, {.max_batch = 4, .max_seq_len = 24, .block_size = 4, .num_blocks = 6});
    const std::vector<int64_t> p = random_prompt(13, c.vocab_size, 31);
    std::vector<int> slots;
    for (int i = 0; i < 4; ++i) slots.push_back(gen.acquire());
    // 4 blocks for the prompt and a partial copy for each of the 3 others: 7 of 6.
    expect_error([&] { gen.prefill(slots, {p, p, p, p}); }, "the prompts need 7 KV-cache blocks, 6 are free");
    expect_error(
        [&] {
            gen.prefill({slots[0], slots[0]}, {p, p});
        },
        "slot " + std::to_string(slots[0]) + " is listed twice");
    EXPECT_EQ(gen.free_blocks(), 6);
    for (int s : slots) EXPECT_EQ(gen.length(s), 0);
    GenerationStep r = gen.prefill({slots[0], slots[1]}, {p, p});
    EXPECT_EQ(r.shared_tokens, 13);
    EXPECT_EQ(gen.free_blocks(), 1);
    gen.release(slots[1]);
    expect_error([&] { gen.release(slots[1]); }, "is not acquired");
    EXPECT_EQ(gen.free_blocks(), 2);
    const std::vector<int64_t> want = greedy_reference(t.cpu, p, 4);
    std::vector<int64_t> got{r.greedy.cpu()[0].item<int64_t>()};
    at::Tensor next = r.greedy.narrow(0, 0, 1);
    for (int i = 1; i < 4; ++i) {
        next = gen.decode({slots[0]}, next).greedy;
        got.push_back(next.cpu()[0].item<int64_t>());
    }
    EXPECT_EQ(got, want);
    gen.release(slots[0]);
    EXPECT_EQ(gen.free_blocks(), 6);
}

#if defined(MOERL_TEST_CUDART)
size_t free_device_bytes() {
    size_t free = 0, total = 0;
    EXPECT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
    return free;
}

// Colocated RL: the generator's own memory (the KV cache and its weight copies: the fused q/k/v
// projection, with FP8 weights every e4m3 copy) goes back to the GPU between rollouts (the driver's
// free memory grows by it), a weight sync or the next prefill takes it back, and generation through
// the graphs captured before gives the same tokens. A sequence still in the cache keeps it, with an
// error naming its slot.
TEST(Generator, OwnMemoryGoesBackAndGenerationResumes) {
    SKIP_WITHOUT_ENGINE();
    const ModelConfig c = fp8_config();  // e4m3 copies need columns in blocks of 64
    Twins t(c, at::kBFloat16);
    for (const bool fp8 : {false, true}) {
        SCOPED_TRACE(fp8 ? "fp8 weights" : "bf16 weights");
        Generator gen(t.gpu, {.max_batch = 8, .max_seq_len = 16384, .block_size = 16, .fp8_weights = fp8});
        const std::vector<int64_t> prompt = random_prompt(37, c.vocab_size, 51);
        auto generate = [&] {
            const int s = gen.acquire();
            at::Tensor next = gen.prefill({s}, {prompt}).greedy;
            std::vector<int64_t> out{next.cpu().item<int64_t>()};
            for (int i = 0; i < 6; ++i) {
                next = gen.decode({s}, next).greedy;
                out.push_back(next.cpu().item<int64_t>());
            }
            return std::make_pair(s, out);
        };
        auto [s, before] = generate();
        const int64_t cache = gen.cache_memory_bytes(), copies = gen.weight_copy_bytes();
        ASSERT_GT(cache, 32LL << 20);  // 50 MiB: 8 slots x 16k tokens x 3 layers
        // q/k/v of every layer, bf16; with FP8 also e4m3 copies of the experts and the LM head.
        const int64_t qkv = int64_t{c.num_hidden_layers} *
                            (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * c.hidden_size *
                            2;
        EXPECT_GE(copies, fp8 ? qkv + int64_t{c.vocab_size} * c.hidden_size : qkv);
        // What stays: at least the logits of max_batch rows (bf16); the graphs' pools and other
        // buffers are not nothing, but far less than a 16k-token cache.
        const int64_t kept = gen.kept_memory_bytes();
        EXPECT_GE(kept, int64_t{8} * c.vocab_size * 2);
        EXPECT_LT(kept, cache);
        try {
            gen.release_memory();
            ADD_FAILURE() << "released the memory of a held sequence";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("slots " + std::to_string(s) + " still hold"),
                      std::string::npos)
                << e.what();
        }
        EXPECT_EQ(gen.cache_memory_bytes(), cache);
        EXPECT_EQ(gen.weight_copy_bytes(), copies);
        gen.release(s);
        torch::cuda::synchronize();
        const size_t free0 = free_device_bytes();
        EXPECT_EQ(gen.release_memory(), cache + copies);
        const size_t free1 = free_device_bytes();
        EXPECT_GE(static_cast<double>(free1) - static_cast<double>(free0),
                  0.95 * static_cast<double>(cache + copies));
        EXPECT_EQ(gen.cache_memory_bytes(), 0);
        EXPECT_EQ(gen.weight_copy_bytes(), 0);
        EXPECT_EQ(gen.kept_memory_bytes(), kept);
        EXPECT_EQ(gen.release_memory(), 0) << "already released";
        {
            // What training would do with it meanwhile.
            const int64_t n = (cache + copies) / 4;
            at::Tensor scratch = at::ones({n}, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
            EXPECT_EQ(scratch.sum().item<double>(), static_cast<double>(n));
        }
        if (fp8) {
            // A weight sync while released refills the copies (the cache waits for the prefill).
            gen.refresh_weights();
            EXPECT_EQ(gen.weight_copy_bytes(), copies);
            EXPECT_EQ(gen.cache_memory_bytes(), 0);
        }
        auto [s2, after] = generate();  // the prefill takes the rest back
        EXPECT_EQ(gen.cache_memory_bytes(), cache);
        EXPECT_EQ(gen.weight_copy_bytes(), copies);
        EXPECT_EQ(after, before);
        gen.release(s2);
    }
}
#endif

}  // namespace
}  // namespace moerl::model
