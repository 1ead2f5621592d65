// One trainer per run: the run lock, in this process (embedded) and in Redis (when
// MOERL_TEST_REDIS_URL is set).
#include "moerl/control/run_lock.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>

#include "moerl/core/error.hpp"

using namespace moerl::control;
using namespace std::chrono_literals;

namespace {
std::vector<std::string> addresses() {
    std::vector<std::string> out{"embedded"};
    const char* url = std::getenv("MOERL_TEST_REDIS_URL");
#ifdef MOERL_HAVE_REDIS
    if (url != nullptr && *url != '\0') out.push_back(url);
#endif
    return out;
}

std::string fresh_run(const std::string& tag) {
    return "lock-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand());
}

std::string error_of(const std::function<void()>& fn) {
    try {
        fn();
    } catch (const moerl::Error& e) {
        return e.message();
    }
    return "";
}
}  // namespace

TEST(RunLock, SecondHolderIsRefusedWhileTheFirstRenews) {
    for (const auto& address : addresses()) {
        const std::string run = fresh_run("second");
        auto first = acquire_run_lock(address, run, "trainer", "train-a", 300ms);
        const auto t0 = std::chrono::steady_clock::now();
        const std::string err =
            error_of([&] { acquire_run_lock(address, run, "trainer", "train-b", 300ms); });
        EXPECT_NE(err.find("run " + run + " already has a trainer: train-a holds its lock"),
                  std::string::npos)
            << address << ": " << err;
        // It waited out a time to live: the first one renewed meanwhile.
        EXPECT_GE(std::chrono::steady_clock::now() - t0, 300ms) << address;
        EXPECT_NO_THROW(first->check()) << address;
        first.reset();  // released: the next one takes it at once
        auto next = acquire_run_lock(address, run, "trainer", "train-b", 300ms);
        EXPECT_NO_THROW(next->check()) << address;
    }
}
