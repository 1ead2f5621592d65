// Deterministic per-rank inputs for EP tests: every rank can regenerate every other rank's data
// from the run seed, which stands in for an all-gather of the inputs.
#pragma once

#include <cmath>
#include <random>
#include <vector>

#include "moerl/ep/buffer.hpp"

namespace moerl::test {

struct RankInput {
    int num_tokens = 0;
    std::vector<uint8_t> x;           // [T, H] in config.dtype
    std::vector<int64_t> topk_idx;    // [T, K]
    std::vector<float> topk_weights;  // [T, K]
};

// Makes rank r's input: token count in [0, max] (rank zero_rank gets none), columns 0..2 hold
// (rank, t % 256, t / 256) so a misplaced row names its origin; expert ids drawn so that tokens
// often pick several experts of one rank, sometimes -1, sometimes the same expert twice.
inline RankInput make_input(const ep::Config& c, uint64_t seed, int r, int zero_rank = -1) {
    std::mt19937_64 rng(seed * 1000003 + r);
    RankInput in;
    in.num_tokens = r == zero_rank ? 0 : std::uniform_int_distribution<int>(1, c.max_tokens_per_rank)(rng);
    const int T = in.num_tokens, H = c.hidden, K = c.top_k;
    in.x.resize(static_cast<size_t>(T) * H * c.element_bytes());
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < H; ++j) {
            float v = j == 0 ? r : j == 1 ? t % 256 : j == 2 ? t / 256 : normal(rng);
            ep::store_from_float(in.x.data() + static_cast<size_t>(t) * H * c.element_bytes(), j, v, c.dtype);
        }
    in.topk_idx.resize(static_cast<size_t>(T) * K);
    in.topk_weights.resize(static_cast<size_t>(T) * K);
    std::uniform_int_distribution<int> expert(0, c.num_experts - 1);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    for (int t = 0; t < T; ++t) {
        const int home = expert(rng);
        for (int k = 0; k < K; ++k) {
            float u = unit(rng);
            int64_t e;
            if (u < 0.1f)
                e = -1;
            else if (u < 0.15f && k > 0)
                e = in.topk_idx[static_cast<size_t>(t) * K + k - 1];  // the same expert twice
            else if (u < 0.5f)
                e = std::min(c.num_experts - 1, home + k);  // neighbours: often the same rank
            else
                e = expert(rng);
            in.topk_idx[static_cast<size_t>(t) * K + k] = e;
            in.topk_weights[static_cast<size_t>(t) * K + k] = unit(rng);
        }
    }
    return in;
}

// The most rows one expert can receive in low-latency mode: rank r's input grows to max_tokens_per_rank
// tokens (new rows drawn like make_input's) and every entry of every token names expert e, so the expert
// gets each token once however often the token names it.
inline void crowd_one_expert(const ep::Config& c, RankInput& in, int r, int64_t e) {
    const int T = c.max_tokens_per_rank, H = c.hidden, K = c.top_k;
    const size_t row = static_cast<size_t>(H) * c.element_bytes();
    std::mt19937_64 rng(static_cast<uint64_t>(r) * 7919 + in.num_tokens);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    in.x.resize(static_cast<size_t>(T) * row);
    for (int t = in.num_tokens; t < T; ++t)
        for (int j = 0; j < H; ++j) {
            const float v = j == 0 ? r : j == 1 ? t % 256 : j == 2 ? t / 256 : normal(rng);
            ep::store_from_float(in.x.data() + static_cast<size_t>(t) * row, j, v, c.dtype);
        }
    in.topk_idx.assign(static_cast<size_t>(T) * K, e);
    in.topk_weights.resize(static_cast<size_t>(T) * K);
    for (int t = in.num_tokens; t < T; ++t)
        for (int k = 0; k < K; ++k) in.topk_weights[static_cast<size_t>(t) * K + k] = 0.25f + 0.125f * k;
    in.num_tokens = T;
}

inline float x_at(const ep::Config& c, const RankInput& in, int t, int j) {
    return ep::load_as_float(in.x.data() + static_cast<size_t>(t) * c.hidden * c.element_bytes(), j, c.dtype);
}

inline bool token_in_rank(const ep::Config& c, const RankInput& in, int t, int r) {
    for (int k = 0; k < c.top_k; ++k) {
        int64_t e = in.topk_idx[static_cast<size_t>(t) * c.top_k + k];
        if (e >= 0 && c.expert_owner(static_cast<int>(e)) == r) return true;
    }
    return false;
}

inline ep::View<const void> x_view(const ep::Config& c, const RankInput& in) {
    return {in.x.data(), in.num_tokens, c.hidden};
}
inline ep::View<const int64_t> idx_view(const ep::Config& c, const RankInput& in) {
    return {in.topk_idx.data(), in.num_tokens, c.top_k};
}
inline ep::View<const float> weights_view(const ep::Config& c, const RankInput& in) {
    return {in.topk_weights.data(), in.num_tokens, c.top_k};
}

// Relative tolerance per dtype for values that went through arithmetic.
inline float tolerance(ep::DType t) { return t == ep::DType::kFloat32 ? 1e-5f : 1.6e-2f; }

}  // namespace moerl::test
