// What the decode kernels' tests share: device buffers, the paged caches' row layouts, and the
// attention's CPU reference in double.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "decode_kernels.hpp"

namespace decode_test {

namespace mc = moerl::model::cuda;

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x

inline bool have_device() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// f(dtype, T{}) for each element type of the kernels: fp32 (0) and bf16 (1).
template <typename F>
void for_each_dtype(F&& f) {
    f(0, float{});
    f(1, __nv_bfloat16{});
}

// Device copy of a host vector, freed with the object.
template <typename T>
struct Dev {
    T* p = nullptr;
    size_t n = 0;
    explicit Dev(const std::vector<T>& v) : n(std::max<size_t>(v.size(), 1)) {
        EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
        EXPECT_EQ(cudaMemset(p, 0, n * sizeof(T)), cudaSuccess);
        if (!v.empty()) {
            EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
        }
    }
    ~Dev() { cudaFree(p); }
    std::vector<T> read() const {
        std::vector<T> out(n);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
        return out;
    }
};

// The rows of a decode step over a paged cache of blocks of bs tokens: row b's new token at
// position[b] (-1: a padding row), in sequence slot[b], whose block j is table[slot * max_blocks + j].
struct PagedRows {
    int bs = 0, max_blocks = 0;
    std::vector<int> position, slot, table;
    int num_blocks() const { return static_cast<int>(position.size()) * max_blocks + 1; }  // block 0 unused
    // The pool row (token, key-value head kv) holding row b's token t: row * D is its first element.
    size_t pool_row(int b, int t, int kv, int Hkv) const {
        const int blk = table[static_cast<size_t>(slot[b]) * max_blocks + t / bs];
        return (static_cast<size_t>(blk) * bs + t % bs) * Hkv + kv;
    }
};

// Rows at `position` in `slot`, slot s holding blocks 1 + s * max_blocks + j of the pool.
inline PagedRows rows_in_slots(std::vector<int> position, std::vector<int> slot, int bs, int max_len) {
    PagedRows r{bs, (max_len + bs - 1) / bs, std::move(position), std::move(slot), {}};
    r.table.resize(r.position.size() * r.max_blocks);
    for (int s : r.slot)
        for (int j = 0; j < r.max_blocks; ++j)
            r.table[static_cast<size_t>(s) * r.max_blocks + j] = 1 + s * r.max_blocks + j;
    return r;
}

// B rows whose slots are a permutation of the rows (slot (7 b + 3) mod B), the first four at one
// token, a full block, one past it and the longest, the others anywhere; the last pads (B > 1).
inline PagedRows scattered_rows(int B, int bs, int max_len, std::mt19937& rng) {
    std::vector<int> position(B), slot(B);
    const int special[] = {0, bs - 1, bs, max_len - 1};
    for (int b = 0; b < B; ++b) {
        position[b] = b < 4 ? special[b] : static_cast<int>(rng() % max_len);
        if (b == B - 1 && B > 1) position[b] = -1;
        slot[b] = (b * 7 + 3) % B;
    }
    return rows_in_slots(std::move(position), std::move(slot), bs, max_len);
}

// B rows in slots 0..B-1 at random positions, the last a padding row (B > 1).
inline PagedRows contiguous_rows(int B, int bs, int max_len, std::mt19937& rng) {
    std::vector<int> position(B), slot(B);
    for (int b = 0; b < B; ++b) {
        position[b] = b == B - 1 && B > 1 ? -1 : static_cast<int>(rng() % max_len);
        slot[b] = b;
    }
    return rows_in_slots(std::move(position), std::move(slot), bs, max_len);
}

// The tensor-core attention's cases: B rows, Hq / Hkv heads of D dims, blocks of bs, sequences up
// to max_len.
struct MmaAttentionCase {
    int B, Hq, Hkv, D, bs, max_len;
};
inline std::string mma_case_name(const ::testing::TestParamInfo<MmaAttentionCase>& info) {
    const MmaAttentionCase& c = info.param;
    return "b" + std::to_string(c.B) + "_g" + std::to_string(c.Hq / c.Hkv) + "_d" + std::to_string(c.D) +
           "_bs" + std::to_string(c.bs);
}

// Checks out [B, Hq, D] against softmax(q k^T / sqrt(D)) v in double over the cached tokens of each
// row (k, v: the pools' values, [rows, D]); padding rows must be zero. Each value within abs x scale
// + rel x |want|, scale 1 or (scaled_by_values) the largest |v| the head attends; *worst: the largest
// error over its scale. Stops at the first failure (call it in ASSERT_NO_FATAL_FAILURE).
struct Tolerance {
    double abs, rel;
    bool scaled_by_values = false;
};
template <typename O>
void attention_matches_cpu(const std::vector<O>& out, const std::vector<float>& q,
                           const std::vector<float>& k, const std::vector<float>& v, const PagedRows& rows,
                           int Hq, int Hkv, int D, Tolerance tol, double* worst) {
    const int B = static_cast<int>(rows.position.size()), group = Hq / Hkv;
    *worst = 0;
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < Hq; ++h) {
            const O* got = out.data() + (static_cast<size_t>(b) * Hq + h) * D;
            if (rows.position[b] < 0) {
                for (int d = 0; d < D; ++d)
                    ASSERT_EQ(static_cast<float>(got[d]), 0.0f) << "padding row " << b << " head " << h;
                continue;
            }
            const int n = rows.position[b] + 1, kv = h / group;
            const float* qh = q.data() + (static_cast<size_t>(b) * Hq + h) * D;
            auto at = [&](const std::vector<float>& pool, int t) {
                return pool.data() + rows.pool_row(b, t, kv, Hkv) * D;
            };
            std::vector<double> sc(n);
            double mx = -1e300;
            for (int t = 0; t < n; ++t) {
                double dot = 0;
                for (int d = 0; d < D; ++d) dot += static_cast<double>(qh[d]) * at(k, t)[d];
                sc[t] = dot / std::sqrt(static_cast<double>(D));
                mx = std::max(mx, sc[t]);
            }
            double sum = 0;
            for (double& x : sc) sum += (x = std::exp(x - mx));
            double scale = 1;
            if (tol.scaled_by_values) {
                scale = 0;
                for (int t = 0; t < n; ++t)
                    for (int d = 0; d < D; ++d)
                        scale = std::max(scale, std::fabs(static_cast<double>(at(v, t)[d])));
            }
            for (int d = 0; d < D; ++d) {
                double want = 0;
                for (int t = 0; t < n; ++t) want += sc[t] / sum * at(v, t)[d];
                const double err = std::fabs(static_cast<float>(got[d]) - want);
                *worst = std::max(*worst, err / scale);
                ASSERT_LT(err, tol.abs * scale + tol.rel * std::fabs(want))
                    << "row " << b << " (" << n << " tokens) head " << h << " dim " << d << ": got "
                    << static_cast<float>(got[d]) << ", want " << want;
            }
        }
}

}  // namespace decode_test
