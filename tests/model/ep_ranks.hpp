// Test harness: EP ranks as threads of this process, each with its own moerl::ep::Buffer (host
// transport) and a file store in a shared temporary directory.
#pragma once

#include <ATen/core/Tensor.h>
#include <unistd.h>

#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model_test_util.hpp"
#include "moerl/ep/buffer.hpp"
#include "moerl/model/config.hpp"

namespace moerl::model::test {

inline std::string unique_job(const std::string& tag) {
    static std::atomic<int> counter{0};
    return "moerl-model-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

// Runs fn(rank, buffer) on `world` threads; rethrows the first failure after all joined.
inline void run_ranks(int world, const ModelConfig& c, int max_tokens, at::ScalarType dtype,
                      const std::function<void(int, ep::Buffer&)>& fn) {
    TempDir store_dir("store");
    const std::string job = unique_job("ep");
    std::mutex mu;
    std::exception_ptr failure;
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
            try {
                auto store = ep::make_file_store(store_dir.path);
                ep::Config cfg = model::ep_config_for(c, dtype, world, r, max_tokens);
                cfg.timeout_s = 30;
                cfg.transport = "host";
                cfg.job_id = job;
                ep::Buffer buffer(cfg, store.get());
                fn(r, buffer);
                buffer.destroy();
            } catch (...) {
                std::lock_guard lock(mu);
                if (!failure) failure = std::current_exception();
            }
        });
    }
    for (auto& t : threads) t.join();
    if (failure) std::rethrow_exception(failure);
}

// Splits [0, n) into `world` contiguous parts, possibly empty.
inline std::pair<int64_t, int64_t> part(int64_t n, int world, int r) {
    const int64_t base = n / world, extra = n % world;
    const int64_t begin = r * base + std::min<int64_t>(r, extra);
    return {begin, base + (r < extra ? 1 : 0)};
}

}  // namespace moerl::model::test
