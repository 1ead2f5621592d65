// Weight sync by broadcast (src/rl/policy_broadcast.hpp) over c10d's Gloo on loopback: a trainer of
// two EP ranks and rollout workers in threads of this process, each with weights of its own. The
// workers get exactly the trainer's weights (also in another dtype and holding part of the
// experts), a worker that joins later gets the current version, a dead member is left out of the
// next generation while the others still receive, and a worker whose shapes differ gets an error
// naming the weight.
#include "policy_broadcast.hpp"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "moerl/core/error.hpp"

using namespace moerl;
using namespace moerl::rl::detail;

namespace {

constexpr int kExperts = 4;

// Dense "embed" [6, 4] and an expert stack "experts" [experts, 3, 4], filled from `seed`.
std::vector<moerl::model::NamedParameter> weights(int64_t experts, at::ScalarType dtype, double seed) {
    auto opts = at::TensorOptions().dtype(dtype);
    at::Tensor embed = at::arange(24, opts.dtype(at::kFloat)).reshape({6, 4}).mul(seed).to(dtype);
    at::Tensor stack =
        at::arange(experts * 12, opts.dtype(at::kFloat)).reshape({experts, 3, 4}).add(seed).to(dtype);
    return {{"embed", embed, false}, {"experts", stack, true}};
}

// Two trainer ranks: experts 0-1 and 2-3, the dense weight on both.
std::vector<BroadcastSource> trainer_weights(double seed) {
    auto full = weights(kExperts, at::kFloat, seed);
    std::vector<BroadcastSource> s(2);
    for (int r = 0; r < 2; ++r) {
        s[r].first_expert = 2 * r;
        s[r].weights = {{"embed", full[0].tensor.clone(), false},
                        {"experts", full[1].tensor.narrow(0, 2 * r, 2).clone(), true}};
    }
    return s;
}

BroadcastOptions options() {
    BroadcastOptions o;
    o.address = "127.0.0.1";
    o.port = 0;
    o.timeout_s = 20;
    o.join_timeout_s = 2;
    return o;
}

// A worker's thread: receives `version` until it has it (or 30 s pass), as a rollout worker's sync
// does between decode steps.
class Worker {
  public:
    Worker(std::string name, std::vector<moerl::model::NamedParameter> target, int first_expert)
        : target_(target),
          receiver_(std::make_unique<PolicyReceiver>(std::move(name), std::move(target), first_expert, 20)) {}
    void start(const std::string& uri, int64_t version) {
        got_.reset();
        thread_ = std::thread([this, uri, version] {
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
            while (!got_ && std::chrono::steady_clock::now() < deadline) {
                try {
                    got_ = receiver_->receive(uri, version);
                } catch (const moerl::Error&) {  // failed part way: it asked again
                }
                if (!got_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
            }
        });
    }
    std::optional<int64_t> join() {
        thread_.join();
        return got_;
    }
    PolicyReceiver& receiver() { return *receiver_; }
    void die() { receiver_.reset(); }  // its sockets close, as a killed process's do
    const std::vector<moerl::model::NamedParameter>& target() const { return target_; }

  private:
    std::vector<moerl::model::NamedParameter> target_;
    std::unique_ptr<PolicyReceiver> receiver_;
    std::thread thread_;
    std::optional<int64_t> got_;
};

void expect_weights(const Worker& w, double seed, int first_expert) {
    auto full = weights(kExperts, at::kFloat, seed);
    const at::Tensor& embed = w.target()[0].tensor;
    const at::Tensor& stack = w.target()[1].tensor;
    EXPECT_TRUE(at::equal(embed.to(at::kFloat), full[0].tensor.to(embed.scalar_type()).to(at::kFloat)));
    at::Tensor rows = full[1].tensor.narrow(0, first_expert, stack.size(0));
    EXPECT_TRUE(at::equal(stack.to(at::kFloat), rows.to(stack.scalar_type()).to(at::kFloat)));
}

// The trainer's send of `version` while the workers receive it.
std::vector<std::string> send_while(PolicyBroadcaster& b, int64_t version, double seed,
                                    std::vector<Worker*> workers, bool joiners_only = false) {
    const std::string uri = b.uri("t");
    std::atomic<bool> announced{false};
    std::vector<std::string> got;
    std::thread trainer([&] {
        got = joiners_only ? b.serve_joiners(version, trainer_weights(seed))
                           : b.send(version, trainer_weights(seed), [&] { announced = true; });
    });
    for (Worker* w : workers) w->start(uri, version);
    trainer.join();
    EXPECT_TRUE(joiners_only || announced.load());
    return got;
}

TEST(PolicyBroadcast, WorkersGetTheTrainersWeightsAndLaterJoinersTheCurrentVersion) {
    if (!policy_broadcast_unavailable().empty()) GTEST_SKIP() << policy_broadcast_unavailable();
    PolicyBroadcaster b(options());
    // No worker has asked yet: v1 is announced to nobody; the workers ask to join.
    Worker a("a", weights(kExperts, at::kFloat, 0), 0);
    Worker half("half", weights(2, at::kBFloat16, 0), 2);  // experts 2-3, in bf16
    EXPECT_TRUE(b.send(1, trainer_weights(1), [] {}).empty());
    EXPECT_FALSE(a.receiver().receive(b.uri("t"), 1).has_value());
    EXPECT_FALSE(half.receiver().receive(b.uri("t"), 1).has_value());
    ASSERT_TRUE(b.has_joiners());
    // The trainer serves them while it waits for experiences: both get v1.
    const auto first = send_while(b, 1, 1, {&a, &half}, /*joiners_only=*/true);
    EXPECT_EQ(a.join(), 24 * 4 + 4 * 12 * 4);
    EXPECT_EQ(half.join(), 24 * 2 + 2 * 12 * 2);
    EXPECT_EQ(first, (std::vector<std::string>{"a", "half"}));
    expect_weights(a, 1, 0);
    expect_weights(half, 1, 2);
    EXPECT_FALSE(b.has_joiners());

    // v2 to both, in the same group: a send forms no new generation.
    const int64_t gen_before = b.generation();
    EXPECT_EQ(send_while(b, 2, 2, {&a, &half}), (std::vector<std::string>{"a", "half"}));
    a.join(), half.join();
    expect_weights(a, 2, 0);
    expect_weights(half, 2, 2);
    EXPECT_EQ(b.generation(), gen_before);
    // A third worker asks at v2 and gets it at the trainer's next chance, the others keeping theirs.
    Worker late("late", weights(kExperts, at::kFloat, 0), 0);
    EXPECT_FALSE(late.receiver().receive(b.uri("t"), 2).has_value());
    ASSERT_TRUE(b.has_joiners());
    EXPECT_EQ(send_while(b, 2, 2, {&late}, true), std::vector<std::string>{"late"});
    EXPECT_TRUE(late.join().has_value());
    expect_weights(late, 2, 0);

    // v3 forms one group of all three again.
    EXPECT_EQ(send_while(b, 3, 3, {&a, &half, &late}).size(), 3u);
    a.join(), half.join(), late.join();
    expect_weights(a, 3, 0);
    expect_weights(half, 3, 2);
    expect_weights(late, 3, 0);
}

TEST(PolicyBroadcast, ADeadMemberIsLeftOutAndTheOthersStillReceive) {
    if (!policy_broadcast_unavailable().empty()) GTEST_SKIP() << policy_broadcast_unavailable();
    PolicyBroadcaster b(options());
    Worker a("a", weights(kExperts, at::kFloat, 0), 0), dead("dead", weights(kExperts, at::kFloat, 0), 0);
    b.send(1, trainer_weights(1), [] {});
    a.receiver().receive(b.uri("t"), 1);
    dead.receiver().receive(b.uri("t"), 1);
    send_while(b, 1, 1, {&a, &dead}, true);
    ASSERT_TRUE(a.join() && dead.join());
    const int64_t gen = b.generation();
    dead.die();
    // The send to the old group fails on the dead member; the trainer forms a new generation, which
    // leaves it out after join_timeout_s.
    EXPECT_EQ(send_while(b, 2, 2, {&a}), std::vector<std::string>{"a"});
    EXPECT_TRUE(a.join().has_value());
    expect_weights(a, 2, 0);
    EXPECT_GT(b.generation(), gen);
    EXPECT_FALSE(a.receiver().incomplete());
}

TEST(PolicyBroadcast, AWorkerOfAnotherShapeGetsAnErrorNamingTheWeight) {
    if (!policy_broadcast_unavailable().empty()) GTEST_SKIP() << policy_broadcast_unavailable();
    PolicyBroadcaster b(options());
    auto wrong = weights(kExperts, at::kFloat, 0);
    wrong[0].tensor = at::zeros({6, 5});
    PolicyReceiver w("wrong", wrong, 0, 20);
    b.send(1, trainer_weights(1), [] {});
    // Checked before it asks to join: it never enters a group it would break.
    try {
        w.receive(b.uri("t"), 1);
        FAIL() << "no error";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("weight embed is [6, 4] in the trainer but [6, 5] in the rollout model"),
                  std::string::npos)
            << e.message();
    }
    EXPECT_FALSE(b.has_joiners());
    EXPECT_FALSE(w.incomplete());
}

TEST(PolicyBroadcast, BadUrisAndPortsAreErrors) {
    if (!policy_broadcast_unavailable().empty()) GTEST_SKIP() << policy_broadcast_unavailable();
    Worker w("w", weights(kExperts, at::kFloat, 0), 0);
    try {
        w.receiver().receive("broadcast://nohostport/x", 1);
        FAIL() << "no error";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("names no HOST:PORT"), std::string::npos) << e.message();
    }
    PolicyBroadcaster first(options());
    BroadcastOptions o = options();
    o.port = first.port();
    try {
        PolicyBroadcaster second(o);
        FAIL() << "two stores on one port";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("cannot listen on port " + std::to_string(o.port) + " (sync.port)"),
                  std::string::npos)
            << e.message();
    }
}

}  // namespace
