// The acknowledgement at commit (DeferredAckBuffer) over the embedded experience buffer.
#include "moerl/control/deferred_ack.hpp"

#include <gtest/gtest.h>

#include "moerl/control/control.hpp"
#include "moerl/core/error.hpp"

using namespace moerl::control;
using namespace std::chrono_literals;

namespace {
std::string fresh_run(const char* tag) {
    static int n = 0;
    return std::string("deferred-") + tag + "-" + std::to_string(n++);
}

std::vector<std::string> ids_of(const std::vector<Delivery>& ds) {
    std::vector<std::string> out;
    for (const auto& d : ds) out.push_back(d.delivery_id);
    return out;
}

std::vector<std::string> task_ids_of(const std::vector<Delivery>& ds) {
    std::vector<std::string> out;
    for (const auto& d : ds) out.push_back(d.experience.task_id);
    return out;
}

// A buffer whose ack() fails, as a Redis past its retry budget would.
class FailingAck final : public ExperienceBuffer {
  public:
    bool push(const Experience&) override { return true; }
    std::vector<Delivery> take(const std::string&, size_t, Millis) override { return {}; }
    void ack(const std::vector<std::string>& ids) override {
        if (fail) MOERL_FAIL("ack of ", ids.size(), " deliveries failed");
        acked += ids.size();
    }
    size_t size() override { return 0; }
    bool fail = true;
    size_t acked = 0;
};
}  // namespace

TEST(DeferredAckBuffer, AckWaitsForCommit) {
    const std::string run = fresh_run("commit");
    DeferredAckBuffer buf(make_experience_buffer("embedded", run));
    for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(buf.push({id, 0, 0, id}));
    EXPECT_FALSE(buf.push({"a", 1, 0, "again"}));  // exactly once, as the wrapped buffer
    auto ds = buf.take("trainer", 10, 0ms);
    ASSERT_EQ(ds.size(), 3u);
    buf.ack({ds[0].delivery_id, ds[1].delivery_id});
    EXPECT_EQ(buf.size(), 3u) << "acknowledged before the commit";
    EXPECT_EQ(buf.uncommitted(), 2u);
    EXPECT_EQ(buf.commit(), 2u);
    EXPECT_EQ(buf.size(), 1u);
    EXPECT_EQ(buf.uncommitted(), 0u);
    EXPECT_EQ(buf.commit(), 0u);
    buf.ack({ds[2].delivery_id});
    EXPECT_EQ(buf.commit(), 1u);
    EXPECT_EQ(buf.size(), 0u);
}

TEST(DeferredAckBuffer, TrainerKilledBeforeCommitLeavesExperienceUnacked) {
    const std::string run = fresh_run("killed");
    auto server = make_experience_buffer("embedded", run);  // the buffer outlives the trainers
    {
        DeferredAckBuffer trainer(make_experience_buffer("embedded", run));
        for (const char* id : {"s0-p0-g0", "s0-p0-g1"}) ASSERT_TRUE(trainer.push({id, 0, 0, id}));
        auto ds = trainer.take("trainer", 10, 0ms);
        ASSERT_EQ(ds.size(), 2u);
        trainer.ack(ids_of(ds));  // the step trained on them; its checkpoint never came
    }
    // The successor (a new handle of the same consumer) gets both again.
    DeferredAckBuffer successor(make_experience_buffer("embedded", run));
    EXPECT_EQ(successor.size(), 2u);
    auto again = successor.take("trainer", 10, 0ms);
    EXPECT_EQ(task_ids_of(again), (std::vector<std::string>{"s0-p0-g0", "s0-p0-g1"}));
    successor.ack(ids_of(again));
    successor.commit();
    EXPECT_EQ(successor.size(), 0u);
}

TEST(DeferredAckBuffer, FailedCommitKeepsTheAcksForTheNextOne) {
    auto inner = std::make_unique<FailingAck>();
    FailingAck& failing = *inner;
    DeferredAckBuffer buf(std::move(inner));
    buf.ack({"1", "2"});
    EXPECT_THROW(buf.commit(), moerl::Error);
    EXPECT_EQ(buf.uncommitted(), 2u);
    buf.ack({"3"});
    failing.fail = false;
    EXPECT_EQ(buf.commit(), 3u);
    EXPECT_EQ(failing.acked, 3u);
}
