// A rollout worker restarted under its old name takes its dead predecessor's leases back at once,
// instead of waiting out the lease timeout (needs MOERL_TEST_REDIS_URL, else skips).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <set>
#include <string>

#include "moerl/control/control.hpp"

using namespace moerl::control;
using namespace std::chrono_literals;

TEST(RedisTaskQueue, ARestartedWorkerReclaimsItsOwnLeasesAtOnce) {
    const char* url = std::getenv("MOERL_TEST_REDIS_URL");
    if (url == nullptr || *url == '\0') GTEST_SKIP() << "MOERL_TEST_REDIS_URL is not set";
    const std::string run = "reclaim-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand());
    std::set<std::string> leased;
    {
        auto first = make_task_queue(url, run, Millis(60000));
        for (int i = 0; i < 3; ++i) first->put({"t" + std::to_string(i), 0, "payload", ""});
        for (int i = 0; i < 2; ++i) {
            auto lease = first->lease("rollout-0", 1000ms);
            ASSERT_TRUE(lease);
            leased.insert(lease->task.id);
        }
    }  // the process dies holding two leases
    auto restarted = make_task_queue(url, run, Millis(60000));
    std::set<std::string> again;
    for (int i = 0; i < 2; ++i) {
        auto lease = restarted->lease("rollout-0", 0ms);  // no wait: the lease timeout is a minute
        ASSERT_TRUE(lease) << "lease " << i << " of the dead process was not taken back";
        EXPECT_EQ(lease->task.attempt, 1) << lease->task.id;
        again.insert(lease->task.id);
        restarted->ack(*lease);
    }
    EXPECT_EQ(again, leased);
    auto third = restarted->lease("rollout-0", 1000ms);  // then the one never leased
    ASSERT_TRUE(third);
    EXPECT_EQ(leased.count(third->task.id), 0u);
    EXPECT_EQ(third->task.attempt, 0);
    // Another name gets nothing of them.
    EXPECT_FALSE(restarted->lease("rollout-1", 0ms));
}
