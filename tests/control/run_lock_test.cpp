// One trainer per run: the run lock, in this process (embedded) and in Redis (when
// MOERL_TEST_REDIS_URL is set).
#include "moerl/control/run_lock.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "moerl/core/error.hpp"
#include "temp_dir.hpp"

using namespace moerl::control;
using namespace std::chrono_literals;
using moerl::control::test::TempDir;

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

TEST(DirectoryLock, SecondProcessIsRefusedWithTheHoldersPid) {
    TempDir t;
    const std::string dir = (t.path / "out").string();
    auto held = lock_run_directory(dir);  // creates it
    EXPECT_NO_THROW(held->check());
    // A second open file description conflicts like a second process.
    const std::string err = error_of([&] { lock_run_directory(dir); });
    EXPECT_NE(err.find("output directory " + dir + " is in use by another moerl process (pid " +
                       std::to_string(::getpid()) + ","),
              std::string::npos)
        << err;
    held.reset();
    EXPECT_FALSE(std::filesystem::exists(t.path / "out" / ".moerl.lock"));
    EXPECT_NO_THROW(lock_run_directory(dir));
}

TEST(DirectoryLock, DeadHoldersLockIsTakenOver) {
    TempDir t;
    // What a SIGKILLed holder leaves: the file with its pid, no lock (the kernel dropped it).
    std::ofstream(t.path / ".moerl.lock") << "999999999\n";
    auto lock = lock_run_directory(t.path.string());
    std::ifstream in(t.path / ".moerl.lock");
    std::string pid;
    in >> pid;
    EXPECT_EQ(pid, std::to_string(::getpid()));
    EXPECT_NO_THROW(lock->check());
    std::filesystem::remove(t.path / ".moerl.lock");
    EXPECT_THROW(lock->check(), moerl::Error);
}

TEST(RunLock, ARenewalAfterTheControlPlaneLostItsDataReportsAReset) {
    const char* url = std::getenv("MOERL_TEST_REDIS_URL");
    if (url == nullptr || *url == '\0') GTEST_SKIP() << "MOERL_TEST_REDIS_URL is not set";
    const std::string run = fresh_run("reset");
    auto lock = acquire_run_lock(url, run, "trainer", "train-a", 300ms);
    std::this_thread::sleep_for(250ms);
    EXPECT_FALSE(lock->take_reset());  // a first holder creates the marker: no reset
    // What a FLUSHALL does to this run's keys (other tests share the server).
    EXPECT_EQ(std::system(("redis-cli -u '" + std::string(url) + "' DEL 'moerl:{" + run +
                           "}:lock:trainer' 'moerl:{" + run + "}:lock:trainer:epoch' >/dev/null")
                              .c_str()),
              0);
    bool reset = false;
    for (int i = 0; i < 20 && !reset; ++i) {
        std::this_thread::sleep_for(50ms);
        reset = lock->take_reset();
    }
    EXPECT_TRUE(reset);
    EXPECT_FALSE(lock->take_reset());  // once
    EXPECT_NO_THROW(lock->check());    // and it holds the lock again
}
