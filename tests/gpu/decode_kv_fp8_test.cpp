// The FP8 KV cache's kernels (src/model/cuda, no LibTorch) against CPU references: rows into e4m3
// and back, the decode step's store against the bf16 store quantised, the tensor-core attention
// over e4m3 rows against a double reference on their dequantised values, and attention storing the
// new rows itself against the store kernel.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "decode_test_util.hpp"
#include "moerl/ep/dtype.hpp"

using namespace decode_test;

namespace {

// FP8 KV cache rows (KvScales): rows over six orders of magnitude, a row of zeros and a row with one
// outlier go into shuffled pool rows as e4m3 whose bytes and scales equal the EP library's CPU
// encoder's (scale = max|row| / 448), each value within half an e4m3 step; read back they are each
// value times its scale, rounded to bf16. Pool rows not named keep their bytes and scales.
TEST(DecodeKvFp8, RowsMatchTheCpuAndComeBackWithinHalfAStep) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    constexpr int Hkv = 3, D = 128;
    constexpr int64_t n = 37, pool_rows = 50;
    std::mt19937 rng(21);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> decade(-3.0f, 3.0f);
    std::vector<__nv_bfloat16> src(static_cast<size_t>(n) * Hkv * D);
    for (int64_t i = 0; i < n; ++i)
        for (int h = 0; h < Hkv; ++h) {
            const float magnitude = std::pow(10.0f, decade(rng));
            for (int d = 0; d < D; ++d) {
                float x = normal(rng) * magnitude;
                if (i == 3 && h == 1) x = 0.0f;                                 // a row of zeros
                if (i == 5 && h == 2) x = d == 7 ? 3e4f : normal(rng) * 1e-3f;  // one outlier
                src[(static_cast<size_t>(i) * Hkv + h) * D + d] = __nv_bfloat16(x);
            }
        }
    std::vector<int64_t> order(pool_rows);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<int64_t> rows(order.begin(), order.begin() + n);
    Dev<__nv_bfloat16> d_src(src), d_back(std::vector<__nv_bfloat16>(src.size()));
    Dev<int64_t> d_rows(rows);
    Dev<uint8_t> d_pool(std::vector<uint8_t>(static_cast<size_t>(pool_rows) * Hkv * D, 0x55));
    Dev<float> d_scales(std::vector<float>(static_cast<size_t>(pool_rows) * Hkv, -1.0f));
    const mc::Launch eager{nullptr, false};
    mc::launch_kv_rows_to_fp8(d_src.p, d_rows.p, n, Hkv, D, d_pool.p, d_scales.p, eager);
    mc::launch_kv_rows_from_fp8(d_pool.p, d_scales.p, d_rows.p, n, Hkv, D, d_back.p, eager);
    CK(cudaGetLastError());
    const std::vector<uint8_t> pool = d_pool.read();
    const std::vector<float> scales = d_scales.read();
    const std::vector<__nv_bfloat16> back = d_back.read();
    std::vector<bool> written(pool_rows, false);
    for (int64_t i = 0; i < n; ++i) {
        written[rows[i]] = true;
        for (int h = 0; h < Hkv; ++h) {
            const __nv_bfloat16* x = src.data() + (static_cast<size_t>(i) * Hkv + h) * D;
            float amax = 0.0f;
            for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
            const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
            const size_t row = static_cast<size_t>(rows[i]) * Hkv + h;
            ASSERT_EQ(scales[row], scale) << "row " << i << " head " << h;
            for (int d = 0; d < D; ++d) {
                const float v = static_cast<float>(x[d]);
                const uint8_t q = pool[row * D + d];
                ASSERT_EQ(q, moerl::ep::float_to_e4m3(v / scale))
                    << "row " << i << " head " << h << " dim " << d;
                const float exact = moerl::ep::e4m3_to_float(q) * scale;
                const double bound = std::max(std::fabs(v) / 16.0, scale / 1024.0) * (1 + 1e-6);
                ASSERT_LE(std::fabs(exact - v), bound)
                    << "row " << i << " head " << h << " dim " << d << ": " << v;
                ASSERT_EQ(static_cast<float>(back[(static_cast<size_t>(i) * Hkv + h) * D + d]),
                          static_cast<float>(__nv_bfloat16(exact)))
                    << "read back, row " << i << " head " << h << " dim " << d;
            }
        }
    }
    for (int64_t r = 0; r < pool_rows; ++r) {
        if (written[r]) continue;
        for (int h = 0; h < Hkv; ++h) {
            ASSERT_EQ(scales[r * Hkv + h], -1.0f) << "pool row " << r << " was not named";
            for (int d = 0; d < D; ++d) ASSERT_EQ(pool[(r * Hkv + h) * D + d], 0x55) << "pool row " << r;
        }
    }
}

// The store of a decode step's new keys and values into an FP8 KV cache: the same q as the bf16
// store, and key and value rows equal to the bf16 store's rows quantised by launch_kv_rows_to_fp8,
// bit for bit (20 rows, a padding row whose cache entries stay untouched).
TEST(DecodeKvFp8, StoreEqualsTheBf16StoreQuantised) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    using T = __nv_bfloat16;
    constexpr int B = 20, Hq = 8, Hkv = 2, D = 128, bs = 16, max_len = 300;
    std::mt19937 rng(31);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const PagedRows paged = contiguous_rows(B, bs, max_len, rng);
    const int heads = Hq + 2 * Hkv, max_blocks = paged.max_blocks;
    const size_t pool_rows = static_cast<size_t>(paged.num_blocks()) * bs;
    auto draw = [&](size_t n, float scale) {
        std::vector<T> v(n);
        for (T& x : v) x = T(normal(rng) * scale);
        return v;
    };
    const std::vector<T> qkv = draw(static_cast<size_t>(B) * heads * D, 3.0f), q_norm = draw(D, 1.0f),
                         k_norm = draw(D, 1.0f);
    Dev<T> d_qkv(qkv), d_qn(q_norm), d_kn(k_norm);
    Dev<T> q16(std::vector<T>(static_cast<size_t>(B) * Hq * D)), q8(q16.read());
    Dev<T> k16(std::vector<T>(pool_rows * Hkv * D)), v16(k16.read());
    Dev<uint8_t> k8(std::vector<uint8_t>(pool_rows * Hkv * D, 0x55)), v8(k8.read());
    Dev<float> ks(std::vector<float>(pool_rows * Hkv, -1.0f)), vs(ks.read());
    Dev<int> d_pos(paged.position), d_slot(paged.slot), d_table(paged.table);
    const mc::Launch eager{nullptr, false};
    mc::launch_qk_norm_rope_store(1, d_qkv.p, d_qn.p, d_kn.p, 1e-6f, 1e6f, d_pos.p, d_slot.p, d_table.p,
                                  max_blocks, bs, B, Hq, Hkv, D, q16.p, k16.p, v16.p, eager);
    mc::launch_qk_norm_rope_store(1, d_qkv.p, d_qn.p, d_kn.p, 1e-6f, 1e6f, d_pos.p, d_slot.p, d_table.p,
                                  max_blocks, bs, B, Hq, Hkv, D, q8.p, k8.p, v8.p, eager, {ks.p, vs.p});
    CK(cudaGetLastError());
    const std::vector<T> a = q16.read(), b = q8.read();
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)), 0) << "q differs";
    // The bf16 store's new rows, quantised by the prefill's kernel into pools of their own.
    std::vector<int64_t> rows;
    for (int b = 0; b < B; ++b)
        if (paged.position[b] >= 0) rows.push_back(paged.pool_row(b, paged.position[b], 0, Hkv) / Hkv);
    const int64_t n = static_cast<int64_t>(rows.size());
    std::vector<int64_t> seq(n);  // the gathered rows in order
    std::iota(seq.begin(), seq.end(), 0);
    Dev<int64_t> d_seq(seq);
    for (int kv = 0; kv < 2; ++kv) {
        SCOPED_TRACE(kv == 0 ? "keys" : "values");
        const Dev<T>& bf16_pool = kv == 0 ? k16 : v16;
        const std::vector<T> all = bf16_pool.read();
        std::vector<T> gathered;
        for (int64_t r : rows)
            gathered.insert(gathered.end(), all.begin() + r * Hkv * D, all.begin() + (r + 1) * Hkv * D);
        Dev<T> d_gathered(gathered);
        Dev<uint8_t> want_q(std::vector<uint8_t>(static_cast<size_t>(n) * Hkv * D));
        Dev<float> want_s(std::vector<float>(static_cast<size_t>(n) * Hkv));
        mc::launch_kv_rows_to_fp8(d_gathered.p, d_seq.p, n, Hkv, D, want_q.p, want_s.p, eager);
        const std::vector<uint8_t> wq = want_q.read(), got_q = (kv == 0 ? k8 : v8).read();
        const std::vector<float> ws = want_s.read(), got_s = (kv == 0 ? ks : vs).read();
        for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(std::memcmp(wq.data() + i * Hkv * D, got_q.data() + rows[i] * Hkv * D, Hkv * D), 0)
                << "cache row " << rows[i];
            for (int h = 0; h < Hkv; ++h)
                ASSERT_EQ(got_s[rows[i] * Hkv + h], ws[i * Hkv + h]) << "row " << rows[i];
        }
        size_t untouched = 0;
        for (float x : got_s) untouched += x == -1.0f;
        EXPECT_EQ(untouched, (pool_rows - rows.size()) * Hkv) << "scales written outside the new rows";
    }
}

// The tensor-core attention over an FP8 KV cache against a CPU reference in double on the cache's
// dequantised values (e4m3 x scale, encoded on the CPU): the bf16 kernel's cases and a single row
// (an FP8 cache runs whole groups at every batch size), with e4m3 NaN bytes and NaN scales in every
// cache entry past a row's length (a masked token must not reach the output).
class DecodeAttentionFp8Kv : public ::testing::TestWithParam<MmaAttentionCase> {};

TEST_P(DecodeAttentionFp8Kv, MatchesCpuReferenceOnTheDequantisedCache) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    const auto [B, Hq, Hkv, D, bs, max_len] = GetParam();
    ASSERT_TRUE(mc::attention_fp8_kv_supported(Hq, Hkv, D));
    std::mt19937 rng(7 + B + D + bs);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> decade(-2.0f, 2.0f);
    PagedRows paged = scattered_rows(B, bs, max_len, rng);
    if (B == 1) paged.position[0] = max_len - 1;  // one row at the longest
    const int max_blocks = paged.max_blocks;
    const size_t rows = static_cast<size_t>(paged.num_blocks()) * bs * Hkv;
    std::vector<uint8_t> kq(rows * D, 0x7f), vq(rows * D, 0x7f);  // e4m3 NaN where nothing is cached
    std::vector<float> ks(rows, std::nanf("")), vs(rows, std::nanf("")), k(rows * D), v(rows * D);
    auto quantise = [&](std::vector<uint8_t>& q, std::vector<float>& scales, std::vector<float>& deq,
                        size_t row, float magnitude) {
        std::vector<float> x(D);
        float amax = 0.0f;
        for (float& e : x) amax = std::max(amax, std::fabs(e = normal(rng) * magnitude));
        scales[row] = amax / 448.0f;
        for (int d = 0; d < D; ++d) {
            q[row * D + d] = moerl::ep::float_to_e4m3(x[d] / scales[row]);
            deq[row * D + d] = moerl::ep::e4m3_to_float(q[row * D + d]) * scales[row];
        }
    };
    for (int b = 0; b < B; ++b)
        for (int t = 0; t <= paged.position[b]; ++t)
            for (int h = 0; h < Hkv; ++h) {
                const size_t row = paged.pool_row(b, t, h, Hkv);
                quantise(kq, ks, k, row, std::pow(10.0f, decade(rng)));  // scales far from 1 both ways
                quantise(vq, vs, v, row, std::pow(10.0f, decade(rng)));
            }
    std::vector<float> q(static_cast<size_t>(B) * Hq * D);
    for (float& x : q) x = static_cast<float>(__nv_bfloat16(2.0f * normal(rng) / std::sqrt(10.0f)));
    std::vector<__nv_bfloat16> q16(q.size());
    for (size_t i = 0; i < q.size(); ++i) q16[i] = __nv_bfloat16(q[i]);
    const int splits = mc::attention_partial_splits(max_blocks * bs);
    Dev<__nv_bfloat16> d_q(q16), d_out(std::vector<__nv_bfloat16>(q.size(), __nv_bfloat16(7.0f)));
    Dev<uint8_t> d_k(kq), d_v(vq);
    Dev<float> d_ks(ks), d_vs(vs),
        d_partial(std::vector<float>(static_cast<size_t>(B) * Hq * splits * (D + 2)));
    Dev<int> d_pos(paged.position), d_slot(paged.slot), d_table(paged.table),
        d_done(std::vector<int>(static_cast<size_t>(B) * Hq));
    for (int call = 0; call < 2; ++call)
        mc::launch_paged_attention(1, d_q.p, d_k.p, d_v.p, d_pos.p, d_slot.p, d_table.p, max_blocks, bs, B,
                                   Hq, Hkv, D, d_partial.p, d_done.p, d_out.p, {nullptr, false}, {},
                                   {d_ks.p, d_vs.p});
    CK(cudaGetLastError());
    const std::vector<__nv_bfloat16> out = d_out.read();
    EXPECT_EQ(d_done.read(), std::vector<int>(static_cast<size_t>(B) * Hq, 0)) << "split counters not reset";
    double worst = 0;
    ASSERT_NO_FATAL_FAILURE(
        attention_matches_cpu(out, q, k, v, paged, Hq, Hkv, D, {5e-3, 1e-2, true}, &worst));
    RecordProperty("worst_error_over_magnitude", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Shapes, DecodeAttentionFp8Kv,
                         ::testing::Values(MmaAttentionCase{1, 32, 4, 128, 16, 2100},
                                           MmaAttentionCase{8, 32, 4, 128, 16, 2100},
                                           MmaAttentionCase{40, 8, 2, 64, 7, 700},
                                           MmaAttentionCase{34, 64, 4, 128, 16, 150}),
                         mma_case_name);

// The same with an FP8 KV cache: the store kernel then attention against attention storing the new
// rows itself (e4m3 and their scales), bit for bit, one row and 20 rows with a padding row.
TEST(DecodeAttentionFusedQk, MatchesTwoKernelsWithAnFp8Cache) {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    using T = __nv_bfloat16;
    for (const int B : {1, 20}) {
        SCOPED_TRACE("rows " + std::to_string(B));
        constexpr int Hq = 8, Hkv = 2, D = 128, bs = 16, max_len = 300;
        std::mt19937 rng(177 + B);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        const PagedRows paged = contiguous_rows(B, bs, max_len, rng);
        const int heads = Hq + 2 * Hkv, max_blocks = paged.max_blocks;
        const size_t rows = static_cast<size_t>(paged.num_blocks()) * bs * Hkv;
        std::vector<T> qkv(static_cast<size_t>(B) * heads * D), q_norm(D), k_norm(D);
        for (auto* v : {&qkv, &q_norm, &k_norm})
            for (T& x : *v) x = T(normal(rng));
        std::vector<uint8_t> pool(rows * D);
        for (uint8_t& x : pool)
            x = static_cast<uint8_t>(rng() % 0x7f) | static_cast<uint8_t>(rng() & 0x80);  // no NaN
        std::vector<float> scales(rows);
        for (float& x : scales) x = 0.01f * (1.0f + static_cast<float>(rng() % 100));
        const int splits = mc::attention_partial_splits(max_blocks * bs);
        Dev<T> d_qkv(qkv), d_qn(q_norm), d_kn(k_norm), d_q(std::vector<T>(static_cast<size_t>(B) * Hq * D));
        Dev<uint8_t> k_two(pool), v_two(pool), k_fused(pool), v_fused(pool);
        Dev<float> ks_two(scales), vs_two(scales), ks_fused(scales), vs_fused(scales);
        Dev<T> out_two(std::vector<T>(static_cast<size_t>(B) * Hq * D)), out_fused(out_two.read());
        Dev<float> partial(std::vector<float>(static_cast<size_t>(B) * Hq * splits * (D + 2)));
        Dev<int> d_pos(paged.position), d_slot(paged.slot), d_table(paged.table),
            done(std::vector<int>(static_cast<size_t>(B) * Hq));
        const mc::Launch eager{nullptr, false};
        mc::launch_qk_norm_rope_store(1, d_qkv.p, d_qn.p, d_kn.p, 1e-6f, 1e6f, d_pos.p, d_slot.p, d_table.p,
                                      max_blocks, bs, B, Hq, Hkv, D, d_q.p, k_two.p, v_two.p, eager,
                                      {ks_two.p, vs_two.p});
        mc::launch_paged_attention(1, d_q.p, k_two.p, v_two.p, d_pos.p, d_slot.p, d_table.p, max_blocks, bs,
                                   B, Hq, Hkv, D, partial.p, done.p, out_two.p, eager, {},
                                   {ks_two.p, vs_two.p});
        const mc::QkvInput fused{d_qkv.p, d_qn.p, d_kn.p, 1e-6f, 1e6f};
        mc::launch_paged_attention(1, nullptr, k_fused.p, v_fused.p, d_pos.p, d_slot.p, d_table.p, max_blocks,
                                   bs, B, Hq, Hkv, D, partial.p, done.p, out_fused.p, eager, fused,
                                   {ks_fused.p, vs_fused.p});
        CK(cudaGetLastError());
        auto same = [](const auto& a, const auto& b) {
            const auto x = a.read(), y = b.read();
            return std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
        };
        EXPECT_TRUE(same(out_two, out_fused)) << "attention output differs";
        EXPECT_TRUE(same(k_two, k_fused)) << "key pool differs";
        EXPECT_TRUE(same(v_two, v_fused)) << "value pool differs";
        EXPECT_TRUE(same(ks_two, ks_fused)) << "key scales differ";
        EXPECT_TRUE(same(vs_two, vs_fused)) << "value scales differ";
        EXPECT_FALSE(same(ks_fused, Dev<float>(scales))) << "the new keys' scales were not stored";
        const std::vector<T> out = out_fused.read();
        EXPECT_TRUE(
            std::all_of(out.begin(), out.end(), [](T x) { return std::isfinite(static_cast<float>(x)); }));
    }
}

}  // namespace
