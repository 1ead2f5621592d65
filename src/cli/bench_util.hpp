// Shared by the benchmark commands: timing, formatting, dtype names and the device copy bandwidth
// every GPU benchmark reports beside its own figures.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "moerl/core/error.hpp"
#include "moerl/model/config.hpp"

namespace moerl::cli {

using Clock = std::chrono::steady_clock;

inline at::ScalarType dtype_of(const std::string& name) {
    if (name == "float32" || name == "fp32") return at::kFloat;
    if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
    if (name == "float16" || name == "fp16") return at::kHalf;
    MOERL_FAIL("dtype \"", name, "\" is not supported, expected float32, bfloat16 or float16");
}

inline std::string human_bytes(double b) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (b >= 1024 && u < 4) b /= 1024, ++u;
    char buf[32];
    std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
    return buf;
}

inline std::string human_count(double n) {
    char buf[32];
    if (n >= 1e9)
        std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
    else if (n >= 1e6)
        std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
    else
        std::snprintf(buf, sizeof buf, "%.0f", n);
    return buf;
}

inline double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Device copy bandwidth, counted as bytes read + written per second (how HBM figures are quoted).
inline double copy_bandwidth(const at::Device& device) {
    const int64_t n = int64_t{1} << 28;  // 1 GiB of fp32 per buffer
    at::Tensor a = at::empty({n}, at::TensorOptions().device(device).dtype(at::kFloat)).fill_(1.0);
    at::Tensor b = at::empty_like(a);
    b.copy_(a);
    (void)b[0].item<float>();
    std::vector<double> times;
    for (int i = 0; i < 5; ++i) {
        auto t0 = Clock::now();
        for (int j = 0; j < 10; ++j) b.copy_(a);
        (void)b[0].item<float>();  // synchronises the device
        times.push_back(seconds_since(t0) / 10);
    }
    return 2.0 * n * 4 / median(times);
}

// A Qwen3-MoE-shaped benchmark config (dense MLP width 3 x hidden, normalised top-k, RoPE theta 1e6).
inline model::ModelConfig bench_config(int hidden, int layers, int heads, int kv_heads, int head_dim,
                                       int moe_width, int experts, int top_k, int vocab) {
    model::ModelConfig c;
    c.vocab_size = vocab;
    c.hidden_size = hidden;
    c.num_hidden_layers = layers;
    c.num_attention_heads = heads;
    c.num_key_value_heads = kv_heads;
    c.head_dim = head_dim;
    c.intermediate_size = 3 * hidden;
    c.moe_intermediate_size = moe_width;
    c.num_experts = experts;
    c.num_experts_per_tok = top_k;
    c.norm_topk_prob = true;
    c.rope_theta = 1e6;
    c.validate();
    return c;
}

}  // namespace moerl::cli
