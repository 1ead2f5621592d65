// The Redis task queue against a real server (needs MOERL_TEST_REDIS_URL, else skips): a rollout worker
// restarted under its old name takes its dead predecessor's leases back at once, instead of waiting out
// the lease timeout; the group's lag, which KEDA scales the rollout workers on, stays countable as
// leases end.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <set>
#include <string>

#include "moerl/control/control.hpp"
#include "redis_client.hpp"

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

namespace redis = moerl::control::redis;

// XINFO GROUPS' lag of the queue's group: the tasks no worker has leased yet; -1 for a null lag.
static long long group_lag(redis::Client& client, const std::string& run) {
    auto reply = client.command({"XINFO", "GROUPS", redis::run_key(run, "tasks")});
    EXPECT_EQ(reply->type, REDIS_REPLY_ARRAY);
    EXPECT_EQ(reply->elements, 1u);
    const redisReply* group = reply->element[0];
    for (size_t i = 0; i + 1 < group->elements; i += 2)
        if (std::string(group->element[i]->str) == "lag")
            return group->element[i + 1]->type == REDIS_REPLY_NIL ? -1 : group->element[i + 1]->integer;
    ADD_FAILURE() << "XINFO GROUPS has no lag (Redis older than 7?)";
    return -2;
}

// The lag stays a number through acks and releases of any lease: ending the lease delivered last while
// an older one is held was an XDEL past the group's read position, after which Redis reported the lag
// as null (KEDA's lagCount scaler then reads no waiting tasks) until some worker read again. Done
// entries leave from the stream's head, so none are left once every lease has ended.
TEST(RedisTaskQueue, TheLagStaysCountableAsLeasesEnd) {
    const char* url = std::getenv("MOERL_TEST_REDIS_URL");
    if (url == nullptr || *url == '\0') GTEST_SKIP() << "MOERL_TEST_REDIS_URL is not set";
    const std::string run = "lag-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand());
    auto queue = make_task_queue(url, run, Millis(60000));
    redis::Client client(url, redis::Options::from_url(url));
    for (int i = 0; i < 5; ++i) queue->put({"t" + std::to_string(i), 0, "payload", ""});
    EXPECT_EQ(group_lag(client, run), 5);
    auto older = queue->lease("rollout-0", 1000ms);
    auto newer = queue->lease("rollout-1", 1000ms);
    ASSERT_TRUE(older && newer);
    EXPECT_EQ(group_lag(client, run), 3);
    queue->ack(*newer);  // the entry delivered last, with an older lease still held
    EXPECT_EQ(group_lag(client, run), 3);
    queue->release(*older, "");  // back on the stream as a new entry
    EXPECT_EQ(group_lag(client, run), 4);
    for (int i = 0; i < 4; ++i) {
        auto lease = queue->lease("rollout-0", 1000ms);
        ASSERT_TRUE(lease) << "lease " << i;
        if (i == 0) EXPECT_EQ(lease->task.id, "t2");
        queue->ack(*lease);
        EXPECT_EQ(group_lag(client, run), 3 - i) << "after ack " << i;
    }
    EXPECT_EQ(queue->outstanding(), 0u);
    auto length = client.command({"XLEN", redis::run_key(run, "tasks")});
    EXPECT_EQ(redis::as_integer(length.get(), "XLEN"), 0);
}
