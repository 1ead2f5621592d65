// Shared helpers for the model tests: tiny configs, temporary directories, tensor comparisons.
#pragma once

#include <ATen/ATen.h>
#include <ftw.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include "moerl/model/config.hpp"
#include "moerl/model/model.hpp"

namespace moerl::model::test {

// hidden 32, 2 or 3 layers, 8 experts top-2: runs in milliseconds on one CPU core.
inline ModelConfig tiny_config(int layers = 2, bool dense_layer = false) {
    ModelConfig c;
    c.vocab_size = 97;
    c.hidden_size = 32;
    c.num_hidden_layers = layers;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.intermediate_size = 48;
    c.moe_intermediate_size = 16;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.norm_topk_prob = true;
    c.rope_theta = 10000.0;
    c.max_position_embeddings = 256;
    c.initializer_range = 0.2;  // larger than HF's 0.02 so routing and attention are far from uniform
    if (dense_layer) c.mlp_only_layers = {1};
    c.validate();
    return c;
}

// Unique per process, call and time.
inline std::string temp_dir(const std::string& tag) {
    static std::atomic<int> counter{0};
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    auto dir = std::filesystem::temp_directory_path() /
               ("moerl-model-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++) +
                "-" + std::to_string(now));
    std::filesystem::create_directories(dir);
    return dir.string();
}

struct TempDir {
    std::string path;
    explicit TempDir(const std::string& tag) : path(temp_dir(tag)) {}
    // nftw, not std::filesystem::remove_all: the pip LibTorch 2.x exports its own remove_all,
    // which crashes when it wins symbol resolution.
    ~TempDir() {
        nftw(
            path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
            FTW_DEPTH | FTW_PHYS);
    }
};

// Largest |a - b| relative to max(1, max |b|).
inline double rel_max_diff(const at::Tensor& a, const at::Tensor& b) {
    at::Tensor x = a.detach().to(at::kCPU, at::kDouble), y = b.detach().to(at::kCPU, at::kDouble);
    EXPECT_EQ(x.sizes(), y.sizes());
    if (x.numel() == 0) return 0.0;
    const double scale = std::max(1.0, y.abs().max().item<double>());
    return (x - y).abs().max().item<double>() / scale;
}

#define EXPECT_CLOSE(a, b, tol) EXPECT_LE(::moerl::model::test::rel_max_diff((a), (b)), (tol)) << #a " vs " #b

// Forward options recording the routing, optionally replaying `replay`.
inline ForwardOptions recording(const at::Tensor& replay = {}) {
    ForwardOptions o;
    o.record_routing = true;
    o.replay_routing = replay;
    return o;
}

inline ForwardOptions replaying(const at::Tensor& replay) {
    ForwardOptions o;
    o.replay_routing = replay;
    return o;
}

// Runs fn and returns the moerl::Error message (fails the test when nothing is thrown).
template <typename Fn>
std::string error_of(Fn&& fn) {
    try {
        fn();
    } catch (const std::exception& e) {
        return e.what();
    }
    ADD_FAILURE() << "expected an exception";
    return "";
}

}  // namespace moerl::model::test
