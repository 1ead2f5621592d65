// The decode step's attention, routing and expert kernels (src/model/cuda, no LibTorch) against plain
// CPU references: attention in both block shapes (head dims up to 128 and above) over a paged cache
// with rows of different lengths, few rows (a query head a block) and many (a block per key-value
// head's group), a padding row (fp32); the tensor-core attention (bf16, whole head groups) at long
// and odd lengths and every split count; the q/k step folded into attention against the two kernels it
// replaces; routing with exact ties, padding rows and expert counts that need 1 and 16 probabilities a
// lane; the tensor-core expert kernels against the CUDA-core ones and a CPU reference (bf16); the dense
// GEMV with and without its weights in shared memory (fp32); the fused one-row MoE kernels against the
// kernels they replace (the FP8 KV cache's kernels: decode_kv_fp8_test.cpp).
#include "decode_kernels.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "decode_test_util.hpp"
#include "moerl/ep/dtype.hpp"

using namespace decode_test;

namespace {

// Device buffers of a MoeRouting for B rows of K choices among E experts, every element `fill`.
struct RoutingBuffers {
    Dev<int> idx, offset, active, num, slots;
    Dev<float> weights;
    RoutingBuffers(int B, int K, int E, int fill)
        : idx{std::vector<int>(static_cast<size_t>(B) * K, fill)},
          offset{std::vector<int>(E + 1, fill)},
          active{std::vector<int>(E, fill)},
          num{std::vector<int>(1, fill)},
          slots{std::vector<int>(static_cast<size_t>(B) * K, fill)},
          weights{std::vector<float>(static_cast<size_t>(B) * K, static_cast<float>(fill))} {}
    mc::MoeRouting routing() const { return {idx.p, weights.p, offset.p, active.p, num.p, slots.p}; }
};

struct AttentionCase {
    int B;
    int D;  // up to 128: four lanes a token in blocks of 8 warps; above: one lane in blocks of 2
};

class DecodeAttention : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(DecodeAttention, MatchesCpuReference) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    const auto [B, D] = GetParam();
    constexpr int Hq = 8, Hkv = 2, bs = 16, max_len = 300;
    const int max_blocks = (max_len + bs - 1) / bs, num_blocks = B * max_blocks + 1;
    std::mt19937 rng(1234 + B);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<int> position(B), slot(B), table(static_cast<size_t>(B) * max_blocks);
    std::vector<int> blocks(num_blocks - 1);
    std::iota(blocks.begin(), blocks.end(), 1);  // block 0 stays unused
    std::shuffle(blocks.begin(), blocks.end(), rng);
    for (int b = 0; b < B; ++b) {
        position[b] = b == B - 1 && B > 1 ? -1 : static_cast<int>(rng() % max_len);  // the last row pads
        slot[b] = B - 1 - b;                                                         // rows and slots differ
        for (int j = 0; j < max_blocks; ++j)
            table[static_cast<size_t>(slot[b]) * max_blocks + j] =
                blocks[static_cast<size_t>(b) * max_blocks + j];
    }
    std::vector<float> q(static_cast<size_t>(B) * Hq * D), k(static_cast<size_t>(num_blocks) * bs * Hkv * D),
        v(k.size());
    for (auto* vec : {&q, &k, &v})
        for (float& x : *vec) x = normal(rng);
    const int splits = mc::attention_partial_splits(max_blocks * bs);
    Dev<float> d_q(q), d_k(k), d_v(v), d_out(std::vector<float>(q.size(), 7.0f)),
        d_partial(std::vector<float>(static_cast<size_t>(B) * Hq * splits * (D + 2)));
    Dev<int> d_pos(position), d_slot(slot), d_table(table),
        d_done(std::vector<int>(static_cast<size_t>(B) * Hq));
    for (int call = 0; call < 2; ++call)  // the second call finds the split counters back at zero
        mc::launch_paged_attention(0, d_q.p, d_k.p, d_v.p, d_pos.p, d_slot.p, d_table.p, max_blocks, bs, B,
                                   Hq, Hkv, D, d_partial.p, d_done.p, d_out.p, {nullptr, false});
    CK(cudaGetLastError());
    const std::vector<float> out = d_out.read();
    EXPECT_EQ(d_done.read(), std::vector<int>(static_cast<size_t>(B) * Hq, 0)) << "split counters not reset";

    const PagedRows rows{bs, max_blocks, position, slot, table};
    double worst = 0;
    ASSERT_NO_FATAL_FAILURE(attention_matches_cpu(out, q, k, v, rows, Hq, Hkv, D, {1e-4, 1e-4}, &worst));
    RecordProperty("worst_abs_error", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Shapes, DecodeAttention,
                         ::testing::Values(AttentionCase{1, 64}, AttentionCase{5, 64}, AttentionCase{20, 64},
                                           AttentionCase{1, 256}, AttentionCase{20, 256}),
                         [](const auto& info) {
                             return "b" + std::to_string(info.param.B) + "_d" + std::to_string(info.param.D);
                         });

// The tensor-core attention (bf16, a block per key-value head's whole group of 4, 8 or 16 heads)
// against a CPU reference in double on the same bf16 inputs: block sizes 16 and 7, lengths that are
// and are not block multiples (one token, a full block, one past it), chunks split 1 to 33 ways, rows
// whose slots differ from their index, a padding row, and NaN in every cache entry past a row's
// length (a masked token must not reach the output).
class DecodeAttentionTensorCores : public ::testing::TestWithParam<MmaAttentionCase> {};

TEST_P(DecodeAttentionTensorCores, MatchesCpuReference) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    const auto [B, Hq, Hkv, D, bs, max_len] = GetParam();
    std::mt19937 rng(99 + B + D + bs);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const PagedRows rows = scattered_rows(B, bs, max_len, rng);
    const int max_blocks = rows.max_blocks;
    const float nan = std::nanf("");
    std::vector<float> q(static_cast<size_t>(B) * Hq * D),
        k(static_cast<size_t>(rows.num_blocks()) * bs * Hkv * D, nan), v(k.size(), nan);
    for (float& x : q) x = static_cast<float>(__nv_bfloat16(2.0f * normal(rng)));
    for (int b = 0; b < B; ++b)
        for (int t = 0; t <= rows.position[b]; ++t)
            for (int h = 0; h < Hkv; ++h)
                for (int d = 0; d < D; ++d) {
                    const size_t at = rows.pool_row(b, t, h, Hkv) * D + d;
                    k[at] = static_cast<float>(__nv_bfloat16(normal(rng)));
                    v[at] = static_cast<float>(__nv_bfloat16(normal(rng)));
                }
    auto to_bf16 = [](const std::vector<float>& x) {
        std::vector<__nv_bfloat16> y(x.size());
        for (size_t i = 0; i < x.size(); ++i) y[i] = __nv_bfloat16(x[i]);
        return y;
    };
    const int splits = mc::attention_partial_splits(max_blocks * bs);
    Dev<__nv_bfloat16> d_q(to_bf16(q)), d_k(to_bf16(k)), d_v(to_bf16(v)),
        d_out(std::vector<__nv_bfloat16>(q.size(), __nv_bfloat16(7.0f)));
    Dev<float> d_partial(std::vector<float>(static_cast<size_t>(B) * Hq * splits * (D + 2)));
    Dev<int> d_pos(rows.position), d_slot(rows.slot), d_table(rows.table),
        d_done(std::vector<int>(static_cast<size_t>(B) * Hq));
    for (int call = 0; call < 2; ++call)  // the second call finds the split counters back at zero
        mc::launch_paged_attention(1, d_q.p, d_k.p, d_v.p, d_pos.p, d_slot.p, d_table.p, max_blocks, bs, B,
                                   Hq, Hkv, D, d_partial.p, d_done.p, d_out.p, {nullptr, false});
    CK(cudaGetLastError());
    const std::vector<__nv_bfloat16> out = d_out.read();
    EXPECT_EQ(d_done.read(), std::vector<int>(static_cast<size_t>(B) * Hq, 0)) << "split counters not reset";
    double worst = 0;
    ASSERT_NO_FATAL_FAILURE(attention_matches_cpu(out, q, k, v, rows, Hq, Hkv, D, {5e-3, 1e-2}, &worst));
    RecordProperty("worst_abs_error", std::to_string(worst));
}

// Splits a chunk: 33 (8 rows of 2100 tokens), 11, 2, and 1 (1024 blocks without splitting).
INSTANTIATE_TEST_SUITE_P(Shapes, DecodeAttentionTensorCores,
                         ::testing::Values(MmaAttentionCase{8, 32, 4, 128, 16, 2100},
                                           MmaAttentionCase{40, 8, 2, 64, 7, 700},
                                           MmaAttentionCase{300, 16, 1, 128, 16, 200},
                                           MmaAttentionCase{256, 32, 4, 128, 16, 300},
                                           MmaAttentionCase{34, 64, 4, 128, 16, 150}),
                         mma_case_name);

// The q/k step folded into attention (QkvInput) against the two kernels it replaces: the same
// output and the same keys and values in the pools, bit for bit, in fp32 and bf16, one row and 20
// rows with a padding row, the new token anywhere in its chunk.
template <typename T>
void fused_qk_matches_two_kernels(int dtype, int B) {
    constexpr int Hq = 8, Hkv = 2, D = 128, bs = 16, max_len = 300;
    std::mt19937 rng(77 + B + 1000 * dtype);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const PagedRows rows = contiguous_rows(B, bs, max_len, rng);
    const int heads = Hq + 2 * Hkv, max_blocks = rows.max_blocks, num_blocks = rows.num_blocks();
    auto draw = [&](size_t n) {
        std::vector<T> v(n);
        for (T& x : v) x = static_cast<T>(normal(rng));
        return v;
    };
    const std::vector<T> qkv = draw(static_cast<size_t>(B) * heads * D),
                         pool_k = draw(static_cast<size_t>(num_blocks) * bs * Hkv * D),
                         pool_v = draw(pool_k.size()), q_norm = draw(D), k_norm = draw(D);
    const int splits = mc::attention_partial_splits(max_blocks * bs);
    Dev<T> d_qkv(qkv), d_qn(q_norm), d_kn(k_norm), d_q(std::vector<T>(static_cast<size_t>(B) * Hq * D));
    Dev<T> k_two(pool_k), v_two(pool_v), k_fused(pool_k), v_fused(pool_v);
    Dev<T> out_two(std::vector<T>(static_cast<size_t>(B) * Hq * D)), out_fused(out_two.read());
    Dev<float> partial(std::vector<float>(static_cast<size_t>(B) * Hq * splits * (D + 2)));
    Dev<int> d_pos(rows.position), d_slot(rows.slot), d_table(rows.table),
        done(std::vector<int>(static_cast<size_t>(B) * Hq));
    const mc::Launch eager{nullptr, false};
    mc::launch_qk_norm_rope_store(dtype, d_qkv.p, d_qn.p, d_kn.p, 1e-6f, 1e6f, d_pos.p, d_slot.p, d_table.p,
                                  max_blocks, bs, B, Hq, Hkv, D, d_q.p, k_two.p, v_two.p, eager);
    mc::launch_paged_attention(dtype, d_q.p, k_two.p, v_two.p, d_pos.p, d_slot.p, d_table.p, max_blocks, bs,
                               B, Hq, Hkv, D, partial.p, done.p, out_two.p, eager);
    const mc::QkvInput fused{d_qkv.p, d_qn.p, d_kn.p, 1e-6f, 1e6f};
    mc::launch_paged_attention(dtype, nullptr, k_fused.p, v_fused.p, d_pos.p, d_slot.p, d_table.p, max_blocks,
                               bs, B, Hq, Hkv, D, partial.p, done.p, out_fused.p, eager, fused);
    CK(cudaGetLastError());
    auto same = [](const Dev<T>& a, const Dev<T>& b) {
        const std::vector<T> x = a.read(), y = b.read();
        return std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
    };
    EXPECT_TRUE(same(out_two, out_fused)) << "attention output differs";
    EXPECT_TRUE(same(k_two, k_fused)) << "key pool differs";
    EXPECT_TRUE(same(v_two, v_fused)) << "value pool differs";
    EXPECT_FALSE(same(k_fused, Dev<T>(pool_k))) << "the new keys were not stored";
}

TEST(DecodeAttentionFusedQk, MatchesTwoKernels) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    for (int B : {1, 20})
        for_each_dtype([&](int dtype, auto t) { fused_qk_matches_two_kernels<decltype(t)>(dtype, B); });
}

class DecodeRoute : public ::testing::TestWithParam<int> {};

TEST_P(DecodeRoute, MatchesCpuTopK) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    const int E = GetParam(), K = 8, B = 37;
    std::mt19937 rng(E);
    std::vector<float> logits(static_cast<size_t>(B) * E);
    std::vector<int> position(B);
    for (int b = 0; b < B; ++b) {
        position[b] = b % 9 == 4 ? -1 : b;
        // distinct values a thousandth apart, shuffled; rows divisible by 3 get exact ties at the top
        std::vector<int> order(E);
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        for (int e = 0; e < E; ++e) logits[static_cast<size_t>(b) * E + e] = 0.001f * order[e];
        if (b % 3 == 0)
            for (int e = 0; e < E; e += 5) logits[static_cast<size_t>(b) * E + e] = 10.0f;
    }
    Dev<float> d_logits(logits);
    Dev<int> d_pos(position);
    RoutingBuffers rb(B, K, E, -7);
    const mc::MoeRouting r = rb.routing();
    mc::launch_route(0, d_logits.p, d_pos.p, B, E, K, true, r, {nullptr, false});
    CK(cudaGetLastError());
    const auto idx = rb.idx.read(), offset = rb.offset.read(), active = rb.active.read(),
               slots = rb.slots.read();
    const auto w = rb.weights.read();
    std::vector<int> count(E, 0);
    for (int b = 0; b < B; ++b) {
        if (position[b] < 0) {
            for (int k = 0; k < K; ++k) {
                EXPECT_EQ(idx[b * K + k], -1) << "padding row " << b;
                EXPECT_EQ(w[b * K + k], 0.0f) << "padding row " << b;
            }
            continue;
        }
        const float* row = logits.data() + static_cast<size_t>(b) * E;
        std::vector<int> want(E);
        std::iota(want.begin(), want.end(), 0);
        std::stable_sort(want.begin(), want.end(), [&](int a, int c) { return row[a] > row[c]; });
        const double mx = row[want[0]];
        double z = 0, top = 0;
        for (int e = 0; e < E; ++e) z += std::exp(row[e] - mx);
        for (int k = 0; k < K; ++k) top += std::exp(row[want[k]] - mx) / z;
        for (int k = 0; k < K; ++k) {
            ASSERT_EQ(idx[b * K + k], want[k]) << "row " << b << " choice " << k;
            EXPECT_NEAR(w[b * K + k], std::exp(row[want[k]] - mx) / z / top, 1e-5)
                << "row " << b << " choice " << k;
            ++count[want[k]];
        }
    }
    // Grouping: offsets are the prefix sums of the counts, active experts ascending, and each
    // expert's slots are exactly the (row, k) entries that chose it.
    int run = 0, num_active = 0;
    for (int e = 0; e < E; ++e) {
        ASSERT_EQ(offset[e], run) << "expert_offset[" << e << "]";
        std::multiset<int> got(slots.begin() + offset[e], slots.begin() + offset[e] + count[e]), expect;
        for (int s = 0; s < B * K; ++s)
            if (idx[s] == e) expect.insert(s);
        EXPECT_EQ(got, expect) << "slots of expert " << e;
        if (count[e] > 0) {
            EXPECT_EQ(active[num_active++], e);
        }
        run += count[e];
    }
    EXPECT_EQ(offset[E], run);
    EXPECT_EQ(rb.num.read()[0], num_active);
}

INSTANTIATE_TEST_SUITE_P(Experts, DecodeRoute, ::testing::Values(8, 128, 300, 512));

std::vector<__nv_bfloat16> random_bf16(size_t n, float scale, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<__nv_bfloat16> v(n);
    for (auto& x : v) x = __float2bfloat16(normal(rng));
    return v;
}
float bf(float x) { return __bfloat162float(__float2bfloat16(x)); }
float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// A routed batch for the expert kernels: B rows of h, E experts' gate and up [E, I, H] and down
// [E, H, I] in bf16 (seeded), and the top-K routing of random logits on the device (expert `idle`
// routed to by no row when >= 0).
struct RoutedBatch {
    int B, E, K, H, I, S;
    std::vector<__nv_bfloat16> h, gate, up, down;
    RoutingBuffers rb;
    std::vector<int> idx;  // [S] the expert of each (row, k) slot
    RoutedBatch(int b, int e, int k, int hidden, int inter, unsigned seed, int idle = -1)
        : B(b), E(e), K(k), H(hidden), I(inter), S(b * k), rb(b, k, e, 0) {
        std::mt19937 rng(seed);
        std::vector<float> logits(static_cast<size_t>(B) * E);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (float& x : logits) x = normal(rng);
        if (idle >= 0)
            for (int r = 0; r < B; ++r) logits[static_cast<size_t>(r) * E + idle] = -30.0f;
        h = random_bf16(static_cast<size_t>(B) * H, 1.0f, rng);
        gate = random_bf16(static_cast<size_t>(E) * I * H, 0.06f, rng);
        up = random_bf16(gate.size(), 0.06f, rng);
        down = random_bf16(static_cast<size_t>(E) * H * I, 0.1f, rng);
        Dev<float> d_logits(logits);
        Dev<int> d_pos{std::vector<int>(B, 3)};
        mc::launch_route(0, d_logits.p, d_pos.p, B, E, K, true, rb.routing(), {nullptr, false});
        idx = rb.idx.read();
    }
    int max_active() const { return std::min(E, S); }
};

// Batches with fewer and more tokens per expert than one tensor-core pass takes (8, or 16 with two
// tiles), up to ~75 an expert (300: each expert's passes spread over blocks), output rows that do
// not fill the last block.
class DecodeExperts : public ::testing::TestWithParam<int> {};

TEST_P(DecodeExperts, TensorCoresMatchCudaCoresAndCpu) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    const int B = GetParam(), E = 16, K = 4, H = 256, I = 96, S = B * K;
    ASSERT_TRUE(mc::moe_tensor_cores_supported(1, H, I));
    const RoutedBatch rbatch(B, E, K, H, I, B);
    const auto &h = rbatch.h, &gate = rbatch.gate, &up = rbatch.up, &down = rbatch.down;
    const auto& idx = rbatch.idx;
    const mc::MoeRouting r = rbatch.rb.routing();
    const mc::Launch launch{nullptr, false};
    const int max_active = rbatch.max_active();

    Dev<__nv_bfloat16> d_h(h), d_gate(gate), d_up(up), d_down(down);
    Dev<__nv_bfloat16> act_core{std::vector<__nv_bfloat16>(static_cast<size_t>(S) * I)},
        act_mma{std::vector<__nv_bfloat16>(static_cast<size_t>(S) * I)};
    mc::launch_moe_gate_up(1, d_h.p, d_gate.p, d_up.p, r, B, K, H, I, max_active, act_core.p, launch);
    mc::launch_moe_gate_up_mma(d_h.p, d_gate.p, d_up.p, r, B, K, E, H, I, max_active, act_mma.p, launch);
    Dev<float> y_core{std::vector<float>(static_cast<size_t>(S) * H)},
        y_mma{std::vector<float>(static_cast<size_t>(S) * H, -3.0f)};
    mc::launch_moe_down(1, act_core.p, d_down.p, r, B, K, H, I, max_active, y_core.p, launch);
    mc::launch_moe_down_mma(act_core.p, d_down.p, r, B, K, E, H, I, max_active, y_mma.p, launch);
    CK(cudaGetLastError());
    const auto ac = act_core.read(), am = act_mma.read();
    const auto yc = y_core.read(), ym = y_mma.read();

    // Products of bf16 values summed in double, rounded as the kernels round them.
    auto close = [](float got, double want) {
        return std::fabs(got - want) <= 0.02 * std::fabs(want) + 2e-3;
    };
    for (int s = 0; s < S; ++s) {
        const int e = idx[s], b = s / K;
        ASSERT_GE(e, 0);
        for (int i = 0; i < I; ++i) {
            double g = 0, u = 0;
            for (int c = 0; c < H; ++c) {
                const double x = as_float(h[static_cast<size_t>(b) * H + c]);
                g += x * as_float(gate[(static_cast<size_t>(e) * I + i) * H + c]);
                u += x * as_float(up[(static_cast<size_t>(e) * I + i) * H + c]);
            }
            const float v0 = bf(static_cast<float>(g)), v1 = bf(static_cast<float>(u));
            const double want = bf(bf(v0 / (1.0f + std::exp(-v0))) * v1);
            const float got_mma = as_float(am[static_cast<size_t>(s) * I + i]);
            ASSERT_TRUE(close(got_mma, want))
                << "gate/up slot " << s << " row " << i << ": tensor cores " << got_mma << ", cpu " << want;
            ASSERT_TRUE(close(as_float(ac[static_cast<size_t>(s) * I + i]), want))
                << "gate/up slot " << s << " row " << i << " (cuda cores)";
        }
        for (int o = 0; o < H; ++o) {
            double want = 0;
            for (int i = 0; i < I; ++i)
                want += static_cast<double>(as_float(ac[static_cast<size_t>(s) * I + i])) *
                        as_float(down[(static_cast<size_t>(e) * H + o) * I + i]);
            ASSERT_TRUE(close(ym[static_cast<size_t>(s) * H + o], want))
                << "down slot " << s << " row " << o << ": tensor cores "
                << ym[static_cast<size_t>(s) * H + o] << ", cpu " << want << ", cuda cores "
                << yc[static_cast<size_t>(s) * H + o];
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Batches, DecodeExperts, ::testing::Values(1, 5, 24, 64, 300));

// The dense GEMV (fp32) against a CPU reference, its block's weights copied into shared memory (1032
// columns) and read through L2 (5128: past the shared memory a block takes), columns that end inside
// a step of the unrolled loop and output rows that do not fill the last block.
class DecodeDense : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DecodeDense, MatchesCpu) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    const auto [B, cols] = GetParam();
    const int out_rows = 45;
    std::mt19937 rng(7 + B);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> in(static_cast<size_t>(B) * cols), w(static_cast<size_t>(out_rows) * cols);
    for (float& x : in) x = normal(rng);
    for (float& x : w) x = normal(rng);
    Dev<float> d_in(in), d_w(w);
    Dev<float> d_out(std::vector<float>(static_cast<size_t>(B) * out_rows, 7.0f));
    mc::launch_dense_rows(0, d_in.p, d_w.p, B, cols, out_rows, d_out.p, {nullptr, false});
    CK(cudaGetLastError());
    const std::vector<float> out = d_out.read();
    for (int b = 0; b < B; ++b)
        for (int o = 0; o < out_rows; ++o) {
            double want = 0;
            for (int c = 0; c < cols; ++c)
                want += static_cast<double>(in[static_cast<size_t>(b) * cols + c]) *
                        w[static_cast<size_t>(o) * cols + c];
            ASSERT_NEAR(out[static_cast<size_t>(b) * out_rows + o], want, 1e-3 + 1e-5 * std::fabs(want))
                << "row " << b << " output " << o << ", " << cols << " columns";
        }
}

INSTANTIATE_TEST_SUITE_P(BatchesColumns, DecodeDense,
                         ::testing::Combine(::testing::Values(1, 3), ::testing::Values(1032, 5128)));

// The FP8 dense GEMV against a CPU product of the dequantised weights (quantised on the GPU by
// launch_quantize_fp8_blocks, whose own test checks it): one token, a few, exactly a pass of 8 and
// past it; columns of one and of several 512-column steps, rows that end inside a block of 8.
class DecodeDenseFp8 : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DecodeDenseFp8, MatchesTheDequantisedProduct) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    const auto [B, cols] = GetParam();
    const int out_rows = 301;
    std::mt19937 rng(3 + B);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<__nv_bfloat16> in(static_cast<size_t>(B) * cols), w(static_cast<size_t>(out_rows) * cols);
    for (auto& x : in) x = __float2bfloat16(normal(rng));
    for (size_t i = 0; i < w.size(); ++i)
        w[i] = __float2bfloat16(normal(rng) * (i % 977 == 0 ? 20.0f : 1.0f));
    const int block_rows = (out_rows + 127) / 128, block_cols = (cols + 127) / 128;
    Dev<__nv_bfloat16> d_in(in), d_w(w);
    Dev<uint8_t> d_q(std::vector<uint8_t>(w.size()));
    Dev<float> d_scales(std::vector<float>(static_cast<size_t>(block_rows) * block_cols));
    Dev<__nv_bfloat16> d_out(std::vector<__nv_bfloat16>(static_cast<size_t>(B) * out_rows));
    mc::launch_quantize_fp8_blocks(1, d_w.p, 1, out_rows, cols, d_q.p, d_scales.p, {nullptr, false});
    mc::launch_dense_rows_fp8(d_in.p, d_q.p, d_scales.p, B, cols, out_rows, d_out.p, {nullptr, false});
    CK(cudaGetLastError());
    const std::vector<uint8_t> q = d_q.read();
    const std::vector<float> scales = d_scales.read();
    const std::vector<__nv_bfloat16> out = d_out.read();
    for (int b = 0; b < B; ++b)
        for (int o = 0; o < out_rows; ++o) {
            double want = 0, magnitude = 0;
            for (int c = 0; c < cols; ++c) {
                const double wq =
                    static_cast<double>(moerl::ep::e4m3_to_float(q[static_cast<size_t>(o) * cols + c])) *
                    scales[static_cast<size_t>(o / 128) * block_cols + c / 128];
                const double x = __bfloat162float(in[static_cast<size_t>(b) * cols + c]);
                want += wq * x;
                magnitude += std::fabs(wq * x);
            }
            const double got = __bfloat162float(out[static_cast<size_t>(b) * out_rows + o]);
            // fp32 sums in another order, then one bf16 rounding of the result.
            ASSERT_NEAR(got, want, 1e-5 * magnitude + 8e-3 * std::fabs(want))
                << "token " << b << " row " << o << ", " << cols << " columns";
        }
}

INSTANTIATE_TEST_SUITE_P(BatchesColumns, DecodeDenseFp8,
                         ::testing::Combine(::testing::Values(1, 3, 8, 11),
                                            ::testing::Values(128, 2064, 4096)));

// The FP8 products on the tensor cores against CPU products of the dequantised weights with the
// inputs rounded to fp16 as the kernels round them. Dense: tokens in one pass and in several, column
// counts that end inside a scale block, rows that end inside a block; on a 132-SM GPU the row counts
// take each of the three column splits (4, 2 and 1 warps a row group). Experts: batches with fewer
// and more tokens an expert than a pass, a routing with idle experts.
float f16(float x) { return __half2float(__float2half_rn(std::clamp(x, -65504.0f, 65504.0f))); }

struct Fp8Weights {
    std::vector<uint8_t> q;
    std::vector<float> scales;
    int rows, cols, block_cols;
    double at(int m, int r, int c) const {
        const int block_rows = (rows + 127) / 128;
        return static_cast<double>(
                   moerl::ep::e4m3_to_float(q[(static_cast<size_t>(m) * rows + r) * cols + c])) *
               scales[(static_cast<size_t>(m) * block_rows + r / 128) * block_cols + c / 128];
    }
};

// w [batch, rows, cols] bf16 quantised on the GPU; the e4m3 bytes and scales back on the host.
struct QuantisedOnDevice {
    Dev<uint8_t> q;
    Dev<float> scales;
    Fp8Weights host;
    QuantisedOnDevice(const std::vector<__nv_bfloat16>& w, int batch, int rows, int cols)
        : q(std::vector<uint8_t>(w.size())),
          scales(
              std::vector<float>(static_cast<size_t>(batch) * ((rows + 127) / 128) * ((cols + 127) / 128))) {
        Dev<__nv_bfloat16> d_w(w);
        mc::launch_quantize_fp8_blocks(1, d_w.p, batch, rows, cols, q.p, scales.p, {nullptr, false});
        host = {q.read(), scales.read(), rows, cols, (cols + 127) / 128};
    }
};

// (tokens, output rows, columns): 17003 rows are blocks enough for the kernel that takes the tokens in
// passes (40 tokens: three passes, the last of 8), the smaller matrices take the kernel that splits
// each row's columns over warps; 192 and 320 columns end inside a scale block.
class DecodeFp8Dense : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(DecodeFp8Dense, MatchesTheDequantisedProduct) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    const auto [B, out_rows, cols] = GetParam();
    ASSERT_TRUE(mc::fp8_products_supported(cols));
    std::mt19937 rng(5 + B);
    const auto in = random_bf16(static_cast<size_t>(B) * cols, 1.0f, rng);
    auto w = random_bf16(static_cast<size_t>(out_rows) * cols, 0.05f, rng);
    w[3 * static_cast<size_t>(cols) + 7] = __float2bfloat16(2.0f);  // an outlier in one block
    QuantisedOnDevice qw(w, 1, out_rows, cols);
    Dev<__nv_bfloat16> d_in(in);
    Dev<__nv_bfloat16> d_out(
        std::vector<__nv_bfloat16>(static_cast<size_t>(B) * out_rows, __float2bfloat16(9.0f)));
    mc::launch_dense_fp8(d_in.p, qw.q.p, qw.scales.p, B, cols, out_rows, d_out.p, {nullptr, false});
    CK(cudaGetLastError());
    const auto out = d_out.read();
    for (int b = 0; b < B; ++b)
        for (int o = 0; o < out_rows; ++o) {
            double want = 0, magnitude = 0;
            for (int c = 0; c < cols; ++c) {
                const double p = qw.host.at(0, o, c) * f16(as_float(in[static_cast<size_t>(b) * cols + c]));
                want += p;
                magnitude += std::fabs(p);
            }
            ASSERT_NEAR(as_float(out[static_cast<size_t>(b) * out_rows + o]), want,
                        1e-5 * magnitude + 8e-3 * std::fabs(want))
                << "token " << b << " row " << o << " of " << out_rows << ", " << cols << " columns";
        }
}

INSTANTIATE_TEST_SUITE_P(TokensRowsColumns, DecodeFp8Dense,
                         ::testing::Values(std::make_tuple(1, 301, 320), std::make_tuple(3, 9001, 128),
                                           std::make_tuple(11, 17003, 192), std::make_tuple(40, 150, 4096),
                                           std::make_tuple(40, 17003, 320)));

// Batches of B rows over E experts (the last one idle): with 16 experts the kernel that splits each
// row's columns over warps (too few blocks of 64 rows for two an SM), with 96 gate/up in the kernel
// that runs an expert's tokens in passes of 8 or 16 (at 400 rows ~17 an expert: two passes for many;
// the down experts keep the split kernel).
class DecodeFp8Experts : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DecodeFp8Experts, MatchTheDequantisedProducts) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    const auto [B, E] = GetParam();
    const int K = 4, H = 320, I = 192, S = B * K;
    ASSERT_TRUE(mc::fp8_products_supported(H) && mc::fp8_products_supported(I));
    const RoutedBatch rbatch(B, E, K, H, I, 17 + B, /*idle=*/E - 1);
    const auto &h = rbatch.h, &gate = rbatch.gate, &up = rbatch.up, &down = rbatch.down;
    const auto& idx = rbatch.idx;
    QuantisedOnDevice qg(gate, E, I, H), qu(up, E, I, H), qd(down, E, H, I);
    const mc::MoeRouting r = rbatch.rb.routing();
    const mc::Launch launch{nullptr, false};
    const int max_active = rbatch.max_active();
    Dev<__nv_bfloat16> d_h(h);
    Dev<__nv_bfloat16> d_act(std::vector<__nv_bfloat16>(static_cast<size_t>(S) * I));
    Dev<float> d_y(std::vector<float>(static_cast<size_t>(S) * H, -3.0f));
    mc::launch_moe_gate_up_fp8(d_h.p, qg.q.p, qg.scales.p, qu.q.p, qu.scales.p, r, B, K, H, I, max_active,
                               d_act.p, launch);
    mc::launch_moe_down_fp8(d_act.p, qd.q.p, qd.scales.p, r, B, K, H, I, max_active, d_y.p, launch);
    CK(cudaGetLastError());
    const auto act = d_act.read();
    const auto y = d_y.read();
    auto close = [](float got, double want, double magnitude) {
        return std::fabs(got - want) <= 0.02 * std::fabs(want) + 1e-5 * magnitude + 1e-3;
    };
    for (int s = 0; s < S; ++s) {
        const int e = idx[s], b = s / K;
        ASSERT_TRUE(e >= 0 && e < E - 1) << "slot " << s << " routed to " << e;
        for (int i = 0; i < I; ++i) {
            double g = 0, u = 0, magnitude = 0;
            for (int c = 0; c < H; ++c) {
                const double x = f16(as_float(h[static_cast<size_t>(b) * H + c]));
                g += x * qg.host.at(e, i, c);
                u += x * qu.host.at(e, i, c);
                magnitude += std::fabs(x * qg.host.at(e, i, c)) + std::fabs(x * qu.host.at(e, i, c));
            }
            const float v0 = bf(static_cast<float>(g)), v1 = bf(static_cast<float>(u));
            const double want = bf(bf(v0 / (1.0f + std::exp(-v0))) * v1);
            const float got = as_float(act[static_cast<size_t>(s) * I + i]);
            ASSERT_TRUE(close(got, want, magnitude))
                << "gate/up slot " << s << " row " << i << ": " << got << ", cpu " << want;
        }
        for (int o = 0; o < H; ++o) {
            double want = 0, magnitude = 0;
            for (int i = 0; i < I; ++i) {
                const double p = f16(as_float(act[static_cast<size_t>(s) * I + i])) * qd.host.at(e, o, i);
                want += p;
                magnitude += std::fabs(p);
            }
            const float got = y[static_cast<size_t>(s) * H + o];
            ASSERT_NEAR(got, want, 1e-5 * magnitude + 1e-6) << "down slot " << s << " row " << o;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(BatchesExperts, DecodeFp8Experts,
                         ::testing::Values(std::make_tuple(1, 16), std::make_tuple(5, 16),
                                           std::make_tuple(24, 16), std::make_tuple(64, 16),
                                           std::make_tuple(64, 96), std::make_tuple(400, 96)));

// FP8 weights: two stacked matrices whose rows and columns end inside a 128 x 128 block, values over
// six orders of magnitude, a block of zeros and a block with one outlier. The e4m3 bytes and the
// block scales equal a CPU reference built on the EP library's e4m3 (an independent encoder) bit for
// bit, and every weight comes back within half an e4m3 step, as decode_kernels.hpp states.
TEST(DecodeFp8Quantize, BlocksMatchTheCpuAndStayWithinHalfAStep) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    const int64_t batch = 2, rows = 200, cols = 300;
    const int64_t block_rows = 2, block_cols = 3, n = batch * rows * cols;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> decade(-3.0f, 3.0f);
    std::vector<float> w(n);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = (i / cols) % rows, c = i % cols;
        const int64_t m = i / (rows * cols);
        w[i] = normal(rng) * std::pow(10.0f, decade(rng));
        if (m == 1 && r < 128 && c < 128) w[i] = 0.0f;                   // a block of zeros
        if (m == 0 && r >= 128 && c >= 256) w[i] = normal(rng) * 1e-3f;  // a block of small values ...
    }
    w[(128 + 5) * cols + 260] = 3e4f;  // ... with one outlier
    for_each_dtype([&](int dtype, auto zero) {
        using T = decltype(zero);
        SCOPED_TRACE(dtype == 0 ? "fp32" : "bf16");
        std::vector<T> typed(n);
        std::vector<float> as_given(n);  // the weights as the kernel sees them
        for (int64_t i = 0; i < n; ++i) {
            typed[i] = static_cast<T>(w[i]);
            as_given[i] = static_cast<float>(typed[i]);
        }
        Dev<T> d_w(typed);
        Dev<uint8_t> d_q(std::vector<uint8_t>(n, 0x55));
        Dev<float> d_scales(std::vector<float>(batch * block_rows * block_cols, -1.0f));
        mc::launch_quantize_fp8_blocks(dtype, d_w.p, batch, rows, cols, d_q.p, d_scales.p, {nullptr, false});
        CK(cudaGetLastError());
        const std::vector<uint8_t> q = d_q.read();
        const std::vector<float> scales = d_scales.read();
        for (int64_t m = 0; m < batch; ++m)
            for (int64_t br = 0; br < block_rows; ++br)
                for (int64_t bc = 0; bc < block_cols; ++bc) {
                    float amax = 0.0f;
                    for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
                        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c)
                            amax = std::max(amax, std::fabs(as_given[(m * rows + r) * cols + c]));
                    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
                    const float got_scale = scales[(m * block_rows + br) * block_cols + bc];
                    ASSERT_EQ(got_scale, scale) << "matrix " << m << " block " << br << ", " << bc;
                    for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
                        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c) {
                            const int64_t at = (m * rows + r) * cols + c;
                            const float x = as_given[at];
                            ASSERT_EQ(q[at], moerl::ep::float_to_e4m3(x / scale))
                                << "matrix " << m << " row " << r << " column " << c << ": " << x;
                            const double back = static_cast<double>(moerl::ep::e4m3_to_float(q[at])) * scale;
                            const double bound = std::max(std::fabs(x) / 16.0, scale / 1024.0) * (1 + 1e-6);
                            ASSERT_LE(std::fabs(back - x), bound)
                                << "row " << r << " column " << c << ": " << x;
                        }
                }
    });
}

}  // namespace

namespace {

// The fused batch-1 MoE layer (add + norm + router + routing in one kernel, the combine in the down
// kernel's last blocks, the norm inside the next GEMV) against the kernels it replaces, bit for bit:
// the router's input h, the routing, the expert outputs combined into the residual and the next
// projection. Twice in a row (the counters return to zero), one row and three rows with a padding row.
// routed (one row): the expert kernels rank the router logits themselves, the down experts combine by
// output column; else gate/up and down + combine by expert, the router's last block routing.
template <typename T>
void fused_rows_match_kernels(int dtype, int B, int E, bool routed) {
    constexpr int H = 512, K = 4, I = 128, kNext = 384;
    std::mt19937 rng(5 + B + 100 * dtype + E + 1000 * routed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto draw = [&](size_t n, float scale) {
        std::vector<T> v(n);
        for (T& x : v) x = static_cast<T>(normal(rng) * scale);
        return v;
    };
    std::vector<int> position(B);
    for (int b = 0; b < B; ++b) position[b] = b == 1 ? -1 : 10 + b;  // row 1 pads (B = 3)
    const std::vector<T> x0 = draw(static_cast<size_t>(B) * H, 1.0f), o = draw(x0.size(), 1.0f),
                         post_norm = draw(H, 1.0f), next_norm = draw(H, 1.0f),
                         router = draw(size_t{E} * H, 0.05f), gate = draw(size_t{E} * I * H, 0.05f),
                         up = draw(gate.size(), 0.05f), down = draw(size_t{E} * H * I, 0.05f),
                         next_w = draw(size_t{kNext} * H, 0.05f);
    Dev<T> d_o(o), d_post(post_norm), d_next_norm(next_norm), d_router(router), d_gate(gate), d_up(up),
        d_down(down), d_next(next_w);
    Dev<int> d_pos(position), done(std::vector<int>(mc::fused_rows_done_counters(H)));
    const int max_active = std::min(E, B * K);
    const mc::Launch eager{nullptr, false};
    if (routed) {
        EXPECT_TRUE(mc::moe_routed_one_row_supported(dtype, K, I)) << "routed experts refused";
    }
    struct Side {
        Dev<T> x, h, logits, act, next_out, h2;
        Dev<float> y;
        RoutingBuffers rb;
    };
    auto side = [&](const std::vector<T>& x) {
        return Side{Dev<T>(x),
                    Dev<T>(std::vector<T>(x.size())),
                    Dev<T>(std::vector<T>(size_t{B} * E)),
                    Dev<T>(std::vector<T>(size_t{B} * K * I)),
                    Dev<T>(std::vector<T>(size_t{B} * kNext)),
                    Dev<T>(std::vector<T>(x.size())),
                    Dev<float>(std::vector<float>(size_t{B} * K * H)),
                    RoutingBuffers(B, K, E, 0)};
    };
    Side two = side(x0), one = side(x0);
    for (int call = 0; call < 2; ++call) {
        const mc::MoeRouting r2 = two.rb.routing();
        mc::launch_add_rmsnorm(dtype, two.x.p, d_o.p, d_post.p, 1e-6f, d_pos.p, B, H, two.h.p, eager);
        mc::launch_dense_rows(dtype, two.h.p, d_router.p, B, H, E, two.logits.p, eager);
        mc::launch_route(dtype, two.logits.p, d_pos.p, B, E, K, true, r2, eager);
        mc::launch_moe_gate_up(dtype, two.h.p, d_gate.p, d_up.p, r2, B, K, H, I, max_active, two.act.p,
                               eager);
        mc::launch_moe_down(dtype, two.act.p, d_down.p, r2, B, K, H, I, max_active, two.y.p, eager);
        mc::launch_moe_combine_rmsnorm(dtype, two.x.p, two.y.p, r2, d_next_norm.p, 1e-6f, d_pos.p, B, K, H,
                                       two.h2.p, eager);
        mc::launch_dense_rows(dtype, two.h2.p, d_next.p, B, H, kNext, two.next_out.p, eager);

        const mc::MoeRouting r1 = one.rb.routing();
        mc::launch_add_norm_router_route(dtype, one.x.p, d_o.p, d_post.p, 1e-6f, d_pos.p, d_router.p, B, H, E,
                                         K, true, !routed, one.h.p, one.logits.p, r1, done.p, eager);
        if (routed) {
            mc::launch_moe_gate_up_routed(dtype, one.h.p, d_gate.p, d_up.p, one.logits.p, d_pos.p, r1, E, K,
                                          true, H, I, one.act.p, eager);
            mc::launch_moe_down_combine_routed(dtype, one.act.p, d_down.p, one.logits.p, d_pos.p, E, K, true,
                                               H, I, one.x.p, d_o.p, eager);
        } else {
            mc::launch_moe_gate_up(dtype, one.h.p, d_gate.p, d_up.p, r1, B, K, H, I, max_active, one.act.p,
                                   eager);
            mc::launch_moe_down_combine(dtype, one.act.p, d_down.p, r1, B, K, H, I, max_active, one.y.p,
                                        one.x.p, d_o.p, d_pos.p, done.p, eager);
        }
        mc::launch_norm_dense_rows(dtype, one.x.p, d_next_norm.p, 1e-6f, d_next.p, B, H, kNext,
                                   one.next_out.p, eager);
        CK(cudaGetLastError());
        const std::string at = "dtype " + std::to_string(dtype) + " B " + std::to_string(B) + " E " +
                               std::to_string(E) + (routed ? " routed" : "") + " call " +
                               std::to_string(call) + ": ";
        auto same = [](const auto& a, const auto& b, size_t n) {
            const auto u = a.read(), v = b.read();
            return std::memcmp(u.data(), v.data(), n * sizeof(u[0])) == 0;
        };
        for (int b = 0; b < B; ++b) {
            if (position[b] < 0) continue;  // padding rows: nothing defined but x left as it was
            const std::vector<T> h2 = two.h.read(), h1 = one.h.read();
            EXPECT_EQ(std::memcmp(h2.data() + b * H, h1.data() + b * H, H * sizeof(T)), 0)
                << at << "h, row " << b;
        }
        EXPECT_TRUE(same(two.rb.idx, one.rb.idx, size_t{B} * K)) << at << "top-k experts";
        EXPECT_TRUE(same(two.rb.weights, one.rb.weights, size_t{B} * K)) << at << "top-k weights";
        EXPECT_TRUE(same(two.rb.offset, one.rb.offset, size_t{E} + 1)) << at << "expert offsets";
        EXPECT_TRUE(same(two.rb.num, one.rb.num, 1)) << at << "active experts";
        EXPECT_TRUE(same(two.x, one.x, size_t{B} * H)) << at << "residual after the layer";
        const std::vector<T> a2 = two.act.read(), a1 = one.act.read();
        for (int b = 0; b < B; ++b) {
            if (position[b] < 0) continue;
            EXPECT_EQ(std::memcmp(a2.data() + static_cast<size_t>(b) * K * I,
                                  a1.data() + static_cast<size_t>(b) * K * I, size_t{K} * I * sizeof(T)),
                      0)
                << at << "gate/up output, row " << b;
        }
        const std::vector<T> n2 = two.next_out.read(), n1 = one.next_out.read();
        for (int b = 0; b < B; ++b) {
            if (position[b] < 0) continue;
            EXPECT_EQ(std::memcmp(n2.data() + b * kNext, n1.data() + b * kNext, kNext * sizeof(T)), 0)
                << at << "next projection, row " << b;
        }
        EXPECT_EQ(done.read(), std::vector<int>(done.n, 0)) << at << "counters not returned to zero";
    }
    if (B > 1) {
        EXPECT_EQ(std::memcmp(one.x.read().data() + H, x0.data() + H, H * sizeof(T)), 0)
            << "padding row written";
    }
}

}  // namespace

TEST(DecodeFusedRows, MatchKernelsTheyReplace) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    for (int B : {1, 3})
        for (int E : {64, 200})
            for (bool routed : {false, true}) {
                if (routed && B != 1) continue;  // one row only
                for_each_dtype(
                    [&](int dtype, auto t) { fused_rows_match_kernels<decltype(t)>(dtype, B, E, routed); });
            }
}

namespace {

// The argmax against the CPU: ties to the lowest index, NaN above every number, rows shorter than
// one block and rows of a real vocabulary; twice in a row (the kernel leaves its scratch zero), the
// first call advancing the positions of the rows that are not padding.
template <typename T>
void argmax_matches_cpu(int dtype, int V) {
    constexpr int B = 3;
    std::mt19937 rng(V + dtype);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<T> logits(static_cast<size_t>(B) * V);
    for (T& x : logits) x = static_cast<T>(normal(rng));
    logits[5] = logits[V - 3] = static_cast<T>(40.0f);  // row 0: a tie, the lower index wins
    logits[V + 17] = static_cast<T>(std::nanf(""));     // row 1: NaN wins
    logits[V + 18] = static_cast<T>(50.0f);
    std::vector<int64_t> want(B);
    for (int b = 0; b < B; ++b) {
        int64_t best = 0;
        for (int i = 1; i < V; ++i) {
            const float v = static_cast<float>(logits[static_cast<size_t>(b) * V + i]);
            const float m = static_cast<float>(logits[static_cast<size_t>(b) * V + best]);
            if (!std::isnan(m) && (std::isnan(v) || v > m)) best = i;
        }
        want[b] = best;
    }
    ASSERT_EQ(want[0], 5);
    ASSERT_EQ(want[1], 17);
    Dev<T> d_logits(logits);
    Dev<unsigned long long> keys{std::vector<unsigned long long>(B, 0)};
    Dev<int> blocks_done{std::vector<int>(B, 0)};
    Dev<int> position{std::vector<int>{5, -1, 0}};  // row 1 is padding: it stays put
    for (int call = 0; call < 2; ++call) {
        Dev<int64_t> out{std::vector<int64_t>(B, -1)};
        mc::launch_argmax(dtype, d_logits.p, B, V, keys.p, blocks_done.p, out.p,
                          call == 0 ? position.p : nullptr, {nullptr, call == 1});
        CK(cudaGetLastError());
        EXPECT_EQ(out.read(), want) << "dtype " << dtype << " V " << V << " call " << call;
        EXPECT_EQ(keys.read(), std::vector<unsigned long long>(B, 0)) << "keys not left zero";
        EXPECT_EQ(blocks_done.read(), std::vector<int>(B, 0)) << "block counters not left zero";
    }
    EXPECT_EQ(position.read(), (std::vector<int>{6, -1, 1})) << "positions advanced once, padding kept";
}

}  // namespace

TEST(DecodeArgmax, MatchesCpu) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    for (int V : {1000, 151936})
        for_each_dtype([&](int dtype, auto t) { argmax_matches_cpu<decltype(t)>(dtype, V); });
}
