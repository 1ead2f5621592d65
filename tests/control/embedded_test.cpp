// Semantics of the embedded task queue, experience buffer and registry.
#include <gtest/gtest.h>

#include <thread>

#include "moerl/control/control.hpp"
#include "moerl/core/error.hpp"

using namespace moerl::control;
using namespace std::chrono_literals;

namespace {
std::string fresh_run(const char* tag) {
    static int n = 0;
    return std::string(tag) + "-" + std::to_string(n++);
}

// "id/attempt/payload" of a lease, or "none": one comparison says what was handed out.
std::string handed_out(const std::optional<Lease>& lease) {
    if (!lease) return "none";
    return lease->task.id + "/" + std::to_string(lease->task.attempt) + "/" + lease->task.payload;
}
}  // namespace

TEST(EmbeddedTaskQueue, LeaseAckAndFifo) {
    auto q = make_task_queue("embedded", fresh_run("q"), 10s);
    q->put({"a", 0, "pa", ""});
    q->put({"b", 0, "pb", ""});
    q->put({"a", 0, "again", ""});  // duplicate id: ignored
    EXPECT_EQ(q->outstanding(), 2u);
    auto l1 = q->lease("w1", 0ms);
    ASSERT_EQ(handed_out(l1), "a/0/pa");
    auto l2 = q->lease("w1", 0ms);
    ASSERT_EQ(handed_out(l2), "b/0/pb");
    EXPECT_FALSE(q->lease("w1", 20ms));
    q->ack(*l1);
    q->ack(*l1);  // harmless
    EXPECT_EQ(q->outstanding(), 1u);
    q->ack(*l2);
    EXPECT_EQ(q->outstanding(), 0u);
    q->put({"a", 0, "pa", ""});  // done tasks never come back
    EXPECT_FALSE(q->lease("w1", 0ms));
}

TEST(EmbeddedTaskQueue, ExpiredLeaseIsReassignedWithNextAttempt) {
    auto q = make_task_queue("embedded", fresh_run("q"), 50ms);
    q->put({"t", 0, "p", ""});
    auto dead = q->lease("dead", 0ms);
    ASSERT_TRUE(dead);
    EXPECT_FALSE(q->lease("alive", 10ms));  // still leased
    auto again = q->lease("alive", 500ms);  // waits for the expiry
    ASSERT_EQ(handed_out(again), "t/1/p");
    EXPECT_EQ(again->worker, "alive");
    EXPECT_NE(again->lease_id, dead->lease_id);
    // The dead worker's late release must not put the task back a second time.
    q->release(*dead, "stale");
    EXPECT_EQ(q->outstanding(), 1u);
    q->ack(*again);
    EXPECT_EQ(q->outstanding(), 0u);
}

TEST(EmbeddedTaskQueue, HeartbeatKeepsLeaseAlive) {
    auto q = make_task_queue("embedded", fresh_run("q"), 80ms);
    q->put({"t", 0, "p", ""});
    auto l = q->lease("w", 0ms);
    ASSERT_TRUE(l);
    for (int i = 0; i < 5; ++i) {
        std::this_thread::sleep_for(30ms);
        q->heartbeat("w");
    }
    EXPECT_FALSE(q->lease("other", 0ms));
}

TEST(EmbeddedTaskQueue, ReleaseReturnsPartialFirst) {
    auto q = make_task_queue("embedded", fresh_run("q"), 10s);
    q->put({"a", 0, "pa", ""});
    q->put({"b", 0, "pb", ""});
    auto l = q->lease("w1", 0ms);
    q->release(*l, "half done");
    auto r = q->lease("w2", 0ms);
    ASSERT_EQ(handed_out(r), "a/1/pa");
    EXPECT_EQ(r->task.partial, "half done");
}

TEST(EmbeddedTaskQueue, SharedByRunIdOnly) {
    const std::string run = fresh_run("q");
    auto a = make_task_queue("embedded", run, 10s);
    auto b = make_task_queue("embedded", run, 10s);
    auto other = make_task_queue("embedded", run + "x", 10s);
    a->put({"t", 0, "p", ""});
    EXPECT_FALSE(other->lease("w", 0ms));
    EXPECT_TRUE(b->lease("w", 0ms));
}

TEST(EmbeddedTaskQueue, LeaseWakesOnPut) {
    auto q = make_task_queue("embedded", fresh_run("q"), 10s);
    std::thread producer([&] {
        std::this_thread::sleep_for(30ms);
        q->put({"late", 0, "", ""});
    });
    auto l = q->lease("w", 2000ms);
    producer.join();
    ASSERT_TRUE(l);
    EXPECT_EQ(l->task.id, "late");
}

TEST(EmbeddedExperienceBuffer, DuplicateSuppressionAndAck) {
    auto buf = make_experience_buffer("embedded", fresh_run("b"));
    EXPECT_TRUE(buf->push({"t1", 0, 3, "x"}));
    EXPECT_FALSE(buf->push({"t1", 1, 4, "y"}));  // same task id: dropped
    EXPECT_TRUE(buf->push({"t2", 0, 3, "z"}));
    EXPECT_EQ(buf->size(), 2u);
    auto d = buf->take("trainer", 10, 0ms);
    ASSERT_EQ(d.size(), 2u);
    EXPECT_EQ(d[0].experience.payload, "x");
    EXPECT_EQ(d[0].experience.policy_version, 3);
    EXPECT_TRUE(buf->take("trainer", 10, 10ms).empty());  // delivered, not again
    buf->ack({d[0].delivery_id});
    EXPECT_EQ(buf->size(), 1u);
    buf->ack({d[1].delivery_id});
    EXPECT_EQ(buf->size(), 0u);
    EXPECT_FALSE(buf->push({"t1", 2, 5, "late"}));  // acknowledged ids stay suppressed
}

TEST(EmbeddedExperienceBuffer, RestartedConsumerGetsUnackedAgain) {
    const std::string run = fresh_run("b");
    auto producer = make_experience_buffer("embedded", run);
    producer->push({"t1", 0, 0, "a"});
    producer->push({"t2", 0, 0, "b"});
    {
        auto trainer = make_experience_buffer("embedded", run);
        auto d = trainer->take("trainer", 1, 0ms);
        ASSERT_EQ(d.size(), 1u);
        // crashes before acknowledging
    }
    auto trainer = make_experience_buffer("embedded", run);
    auto d = trainer->take("trainer", 10, 0ms);
    ASSERT_EQ(d.size(), 2u);
    EXPECT_EQ(d[0].experience.task_id, "t1");
    EXPECT_EQ(d[1].experience.task_id, "t2");
}

TEST(EmbeddedRegistry, VersionsOnlyIncrease) {
    auto reg = make_registry("embedded", fresh_run("r"));
    EXPECT_FALSE(reg->latest());
    reg->publish(0, "file:///v0");
    reg->publish(2, "file:///v2");
    EXPECT_THROW(reg->publish(2, "file:///again"), moerl::Error);
    EXPECT_THROW(reg->publish(1, "file:///older"), moerl::Error);
    auto latest = reg->latest();
    ASSERT_TRUE(latest);
    EXPECT_EQ(latest->first, 2);
    EXPECT_EQ(latest->second, "file:///v2");
}

TEST(Factory, UnknownAddressIsAClearError) {
    try {
        make_task_queue("tcp://nowhere", "r", 1s);
        FAIL() << "expected an error";
    } catch (const moerl::Error& e) {
        EXPECT_NE(std::string(e.what()).find("tcp://nowhere"), std::string::npos);
    }
}
