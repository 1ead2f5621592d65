// The Redis task queue, experience buffer and registry against a real Redis 7
// (MOERL_TEST_REDIS_URL, set by scripts/test-servers.sh; skipped when unset).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "dist_util.hpp"
#include "moerl/control/control.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/log.hpp"
#ifdef MOERL_HAVE_REDIS
#include "redis_client.hpp"
#endif

namespace moerl::control {
namespace {

using namespace std::chrono_literals;
using dist_test::unique_name;

std::string redis_url() { return dist_test::env_or("MOERL_TEST_REDIS_URL"); }

#ifdef MOERL_HAVE_REDIS
#define REQUIRE_REDIS()                                                                      \
    do {                                                                                     \
        if (redis_url().empty())                                                             \
            GTEST_SKIP() << "MOERL_TEST_REDIS_URL is not set (see scripts/test-servers.sh)"; \
    } while (0)
#else
#define REQUIRE_REDIS() GTEST_SKIP() << "built without hiredis"
#endif

Task task(const std::string& id, const std::string& payload = "prompt") {
    Task t;
    t.id = id;
    t.payload = payload;
    return t;
}

TEST(RedisTaskQueue, LeaseAndAck) {
    REQUIRE_REDIS();
    auto q = make_task_queue(redis_url(), unique_name("queue"), 5000ms);
    q->put(task("t1", "p1"));
    q->put(task("t1", "again"));  // a task id already outstanding is not queued twice
    EXPECT_EQ(q->outstanding(), 1u);
    auto lease = q->lease("w1", 1000ms);
    ASSERT_TRUE(lease);
    EXPECT_EQ(lease->task.id, "t1");
    EXPECT_EQ(lease->task.payload, "p1");
    EXPECT_EQ(lease->task.attempt, 0);
    EXPECT_TRUE(lease->task.partial.empty());
    EXPECT_EQ(lease->worker, "w1");
    EXPECT_FALSE(q->lease("w2", 0ms));
    EXPECT_EQ(q->outstanding(), 1u);
    q->ack(*lease);
    q->ack(*lease);  // harmless
    EXPECT_EQ(q->outstanding(), 0u);
    q->put(task("t1"));  // done tasks are never handed out again
    EXPECT_FALSE(q->lease("w2", 200ms));
    EXPECT_EQ(q->outstanding(), 0u);
}

// The control plane loses its data (a Redis restarted empty) while a worker holds a lease, and the
// worker acknowledges it afterwards: its experience may have gone with the data, so the late ack
// must not mark the task done. The trainer then puts the task again, and it is handed out.
TEST(RedisTaskQueue, AnAckAfterTheDataWasLostLeavesTheTaskToBePutAgain) {
    REQUIRE_REDIS();
    const std::string name = unique_name("queue");
    auto q = make_task_queue(redis_url(), name, 5000ms);
    q->put(task("t1", "p1"));
    auto lease = q->lease("w1", 1000ms);
    ASSERT_TRUE(lease);
    // What a FLUSHALL does to this queue's keys (other tests share the server).
    const std::string url = redis_url().substr(0, redis_url().find('?'));
    const std::string cli = "redis-cli -u '" + url + "' ";
    ASSERT_EQ(
        std::system(
            (cli + "--scan --pattern 'moerl:{" + name + "}:*' | xargs -r " + cli + "DEL >/dev/null").c_str()),
        0);
    q->ack(*lease);
    q->put(task("t1", "p1"));
    auto again = q->lease("w2", 2000ms);
    ASSERT_TRUE(again) << "the late ack marked the lost task done";
    EXPECT_EQ(again->task.id, "t1");
    q->ack(*again);
    EXPECT_EQ(q->outstanding(), 0u);
}

TEST(RedisTaskQueue, ExpiredLeaseGoesToAnotherWorkerWithNextAttempt) {
    REQUIRE_REDIS();
    auto q = make_task_queue(redis_url(), unique_name("queue"), 300ms);
    q->put(task("t1", "p1"));
    auto first = q->lease("w1", 1000ms);
    ASSERT_TRUE(first);
    EXPECT_EQ(first->task.attempt, 0);
    EXPECT_FALSE(q->lease("w2", 0ms));  // still leased
    std::this_thread::sleep_for(400ms);
    auto second = q->lease("w2", 0ms);
    ASSERT_TRUE(second);
    EXPECT_EQ(second->task.id, "t1");
    EXPECT_EQ(second->task.attempt, 1);
    EXPECT_EQ(second->task.payload, "p1");
    // The first worker lost its lease: its late release re-queues nothing.
    q->release(*first, "stale partial");
    EXPECT_FALSE(q->lease("w3", 0ms));
    EXPECT_EQ(q->outstanding(), 1u);
    // Expires again: attempt 2.
    std::this_thread::sleep_for(400ms);
    auto third = q->lease("w3", 0ms);
    ASSERT_TRUE(third);
    EXPECT_EQ(third->task.attempt, 2);
    q->ack(*third);
    q->ack(*second);  // the task is done; acknowledging an old lease changes nothing
    EXPECT_EQ(q->outstanding(), 0u);
    std::this_thread::sleep_for(400ms);
    EXPECT_FALSE(q->lease("w4", 0ms));
}

TEST(RedisTaskQueue, ReleaseHandsTheTaskOnWithItsPartialTrajectory) {
    REQUIRE_REDIS();
    auto q = make_task_queue(redis_url(), unique_name("queue"), 10000ms);
    q->put(task("t1", "p1"));
    auto lease = q->lease("w1", 1000ms);
    ASSERT_TRUE(lease);
    q->release(*lease, "partial tokens");
    q->release(*lease, "partial tokens");  // a repeated release (retry) does not queue it twice
    EXPECT_EQ(q->outstanding(), 1u);
    auto resumed = q->lease("w2", 1000ms);
    ASSERT_TRUE(resumed);
    EXPECT_EQ(resumed->task.id, "t1");
    EXPECT_EQ(resumed->task.payload, "p1");
    EXPECT_EQ(resumed->task.partial, "partial tokens");
    EXPECT_EQ(resumed->task.attempt, 1);
    EXPECT_FALSE(q->lease("w3", 0ms));
    q->ack(*resumed);
    EXPECT_EQ(q->outstanding(), 0u);
}

TEST(RedisTaskQueue, HeartbeatKeepsTheLease) {
    REQUIRE_REDIS();
    auto q = make_task_queue(redis_url(), unique_name("queue"), 300ms);
    q->put(task("t1"));
    auto lease = q->lease("w1", 1000ms);
    ASSERT_TRUE(lease);
    for (int i = 0; i < 8; ++i) {  // 800 ms, well past the lease timeout
        std::this_thread::sleep_for(100ms);
        q->heartbeat("w1");
        EXPECT_FALSE(q->lease("w2", 0ms))
            << "lease taken over after " << (i + 1) * 100 << " ms with heartbeats";
    }
    q->heartbeat("w2");  // another worker's heartbeat does not touch w1's lease
    std::this_thread::sleep_for(400ms);
    auto taken = q->lease("w2", 0ms);
    ASSERT_TRUE(taken);
    EXPECT_EQ(taken->task.attempt, 1);
}

TEST(RedisTaskQueue, LeaseWaitsForAPut) {
    REQUIRE_REDIS();
    const std::string run = unique_name("queue");
    auto q = make_task_queue(redis_url(), run, 5000ms);
    auto producer = make_task_queue(redis_url(), run, 5000ms);
    auto start = std::chrono::steady_clock::now();
    EXPECT_FALSE(q->lease("w1", 300ms));
    auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_GE(waited, 290ms);
    EXPECT_LT(waited, 2000ms);
    std::thread put([&] {
        std::this_thread::sleep_for(200ms);
        producer->put(task("late"));
    });
    auto lease = q->lease("w1", 5000ms);
    put.join();
    ASSERT_TRUE(lease);
    EXPECT_EQ(lease->task.id, "late");
}

TEST(RedisTaskQueue, ConcurrentWorkersGetEveryTaskOnce) {
    REQUIRE_REDIS();
    const std::string run = unique_name("queue");
    constexpr int kNumTasks = 60;
    {
        auto q = make_task_queue(redis_url(), run, 10000ms);
        for (int i = 0; i < kNumTasks; ++i) q->put(task("t" + std::to_string(i)));
        EXPECT_EQ(q->outstanding(), static_cast<size_t>(kNumTasks));
    }
    std::mutex mutex;
    std::multiset<std::string> seen;
    std::vector<std::thread> workers;
    for (int w = 0; w < 3; ++w) {
        workers.emplace_back([&, w] {
            auto q = make_task_queue(redis_url(), run, 10000ms);
            const std::string name = "w" + std::to_string(w);
            while (auto lease = q->lease(name, 200ms)) {
                q->heartbeat(name);
                {
                    std::lock_guard lock(mutex);
                    seen.insert(lease->task.id);
                }
                q->ack(*lease);
            }
        });
    }
    for (auto& t : workers) t.join();
    EXPECT_EQ(seen.size(), static_cast<size_t>(kNumTasks));
    for (int i = 0; i < kNumTasks; ++i) EXPECT_EQ(seen.count("t" + std::to_string(i)), 1u);
    auto q = make_task_queue(redis_url(), run, 10000ms);
    EXPECT_EQ(q->outstanding(), 0u);
}

Experience experience(const std::string& task_id, int64_t version = 1) {
    Experience e;
    e.task_id = task_id;
    e.attempt = 2;
    e.policy_version = version;
    e.payload = std::string("payload of ") + task_id + std::string(1, '\0') + "binary";
    return e;
}

TEST(RedisExperienceBuffer, DuplicatesAreSuppressed) {
    REQUIRE_REDIS();
    const std::string run = unique_name("buffer");
    auto b = make_experience_buffer(redis_url(), run);
    auto other_worker = make_experience_buffer(redis_url(), run);
    EXPECT_TRUE(b->push(experience("t1", 7)));
    EXPECT_FALSE(b->push(experience("t1", 8)));
    EXPECT_FALSE(other_worker->push(experience("t1", 9)));
    EXPECT_TRUE(other_worker->push(experience("t2")));
    EXPECT_EQ(b->size(), 2u);
    auto got = b->take("trainer", 10, 1000ms);
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0].experience.task_id, "t1");
    EXPECT_EQ(got[0].experience.policy_version, 7);
    EXPECT_EQ(got[0].experience.attempt, 2);
    EXPECT_EQ(got[0].experience.payload, experience("t1").payload);
    EXPECT_EQ(got[1].experience.task_id, "t2");
    EXPECT_TRUE(b->take("trainer", 10, 0ms).empty());  // delivered already
    b->ack({got[0].delivery_id, got[1].delivery_id});
    b->ack({got[0].delivery_id});  // harmless
    EXPECT_EQ(b->size(), 0u);
    EXPECT_FALSE(b->push(experience("t1")));  // still a duplicate after it was consumed
    EXPECT_EQ(b->size(), 0u);
}

TEST(RedisExperienceBuffer, UnacknowledgedDeliveriesComeBackToARestartedConsumer) {
    REQUIRE_REDIS();
    const std::string run = unique_name("buffer");
    std::vector<std::string> ids;
    {
        auto b = make_experience_buffer(redis_url(), run);
        for (int i = 0; i < 5; ++i) ASSERT_TRUE(b->push(experience("t" + std::to_string(i))));
        auto first = b->take("trainer", 3, 1000ms);
        ASSERT_EQ(first.size(), 3u);
        b->ack({first[0].delivery_id});  // the step using t0 is durable; t1 and t2 are not
        EXPECT_EQ(b->size(), 4u);
    }  // the trainer dies
    auto b = make_experience_buffer(redis_url(), run);
    auto again = b->take("trainer", 10, 1000ms);
    ASSERT_EQ(again.size(), 2u);
    EXPECT_EQ(again[0].experience.task_id, "t1");
    EXPECT_EQ(again[1].experience.task_id, "t2");
    auto rest = b->take("trainer", 10, 1000ms);
    ASSERT_EQ(rest.size(), 2u);
    EXPECT_EQ(rest[0].experience.task_id, "t3");
    EXPECT_EQ(rest[1].experience.task_id, "t4");
    EXPECT_TRUE(b->take("trainer", 10, 100ms).empty());
    for (const auto& d : again) b->ack({d.delivery_id});
    for (const auto& d : rest) b->ack({d.delivery_id});
    EXPECT_EQ(b->size(), 0u);
    auto restarted = make_experience_buffer(redis_url(), run);
    EXPECT_TRUE(restarted->take("trainer", 10, 100ms).empty());
}

TEST(RedisExperienceBuffer, TakeWaitsAndConsumersSplitTheStream) {
    REQUIRE_REDIS();
    const std::string run = unique_name("buffer");
    auto b = make_experience_buffer(redis_url(), run);
    auto start = std::chrono::steady_clock::now();
    EXPECT_TRUE(b->take("a", 4, 250ms).empty());
    EXPECT_GE(std::chrono::steady_clock::now() - start, 240ms);
    std::thread pusher([&] {
        auto p = make_experience_buffer(redis_url(), run);
        std::this_thread::sleep_for(150ms);
        for (int i = 0; i < 6; ++i) p->push(experience("t" + std::to_string(i)));
    });
    auto a = b->take("a", 4, 3000ms);
    pusher.join();
    ASSERT_FALSE(a.empty());
    std::set<std::string> got;
    for (const auto& d : a) got.insert(d.experience.task_id);
    for (int round = 0; round < 10 && got.size() < 6; ++round) {
        for (const auto& d : b->take("b", 10, 200ms)) EXPECT_TRUE(got.insert(d.experience.task_id).second);
        for (const auto& d : b->take("a", 10, 0ms)) EXPECT_TRUE(got.insert(d.experience.task_id).second);
    }
    EXPECT_EQ(got.size(), 6u);
}

TEST(RedisRegistry, VersionsOnlyIncrease) {
    REQUIRE_REDIS();
    const std::string run = unique_name("registry");
    auto r = make_registry(redis_url(), run);
    EXPECT_FALSE(r->latest());
    r->publish(1, "s3://b/ckpt-1");
    auto l = r->latest();
    ASSERT_TRUE(l);
    EXPECT_EQ(l->first, 1);
    EXPECT_EQ(l->second, "s3://b/ckpt-1");
    EXPECT_THROW(r->publish(1, "s3://b/other"), moerl::Error);
    EXPECT_THROW(r->publish(0, "s3://b/ckpt-0"), moerl::Error);
    try {
        r->publish(1, "x");
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("latest published version is 1"), std::string::npos) << e.message();
    }
    r->publish(5, "s3://b/ckpt-5");
    auto reader = make_registry(redis_url(), run);
    EXPECT_EQ(reader->latest()->first, 5);
    EXPECT_EQ(reader->latest()->second, "s3://b/ckpt-5");

    // Two trainers racing: every accepted version is larger than the one accepted before.
    std::atomic<int> accepted{0};
    std::vector<std::thread> racers;
    for (int k = 0; k < 2; ++k) {
        racers.emplace_back([&] {
            auto mine = make_registry(redis_url(), run);
            for (int v = 6; v <= 40; ++v) {
                try {
                    mine->publish(v, "uri-" + std::to_string(v));
                    ++accepted;
                } catch (const moerl::Error&) {
                }
            }
        });
    }
    for (auto& t : racers) t.join();
    EXPECT_EQ(accepted.load(), 35);  // each version once, by whichever trainer came first
    EXPECT_EQ(reader->latest()->first, 40);
}

#ifdef MOERL_HAVE_REDIS
TEST(RedisClient, ParsesUrls) {
    auto a = redis::parse_url("redis://:secret@10.0.0.5:6380/3");
    EXPECT_EQ(a.host, "10.0.0.5");
    EXPECT_EQ(a.port, 6380);
    EXPECT_EQ(a.password, "secret");
    EXPECT_EQ(a.db, 3);
    EXPECT_FALSE(a.tls);
    auto b = redis::parse_url("redis://localhost");
    EXPECT_EQ(b.port, 6379);
    EXPECT_EQ(b.db, 0);
    EXPECT_TRUE(redis::parse_url("rediss://h:1").tls);
    EXPECT_THROW(redis::parse_url("redis://h:notaport"), moerl::Error);
    EXPECT_THROW(redis::parse_url("http://h:1"), moerl::Error);
    auto d = redis::parse_url("redis://default:pw@h:7");
    EXPECT_EQ(d.user, "default");
    EXPECT_EQ(d.password, "pw");
    auto c = redis::parse_url("redis://:pw@h:7/4?retry_ms=60000&timeout_ms=900");
    EXPECT_EQ(c.port, 7);
    EXPECT_EQ(c.db, 4);
    const auto o = redis::Options::from_url("redis://:pw@h:7/4?retry_ms=60000&timeout_ms=900");
    EXPECT_EQ(o.retry_budget, 60000ms);
    EXPECT_EQ(o.io_timeout, 900ms);
    EXPECT_EQ(o.backoff, redis::Options{}.backoff);
    EXPECT_EQ(redis::Options::from_url("redis://h").retry_budget, redis::Options{}.retry_budget);
    for (const char* bad : {"redis://h?retry=5", "redis://h?retry_ms=", "redis://h?retry_ms=x",
                            "redis://h?timeout_ms=0", "redis://h?backoff_ms"}) {
        try {
            redis::Options::from_url(bad);
            ADD_FAILURE() << bad << " must be refused";
        } catch (const moerl::Error& e) {
            EXPECT_NE(e.message().find(bad), std::string::npos) << e.message();
        }
    }
    try {
        make_registry("rediss://127.0.0.1:1", "x");
        ADD_FAILURE() << "rediss:// without TLS support must fail";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("TLS"), std::string::npos) << e.message();
    }
}

// A Redis of this test's own, with a password and a database number, stopped and restarted empty.
TEST(RedisClient, ReconnectsAfterARestartAndFailsClearlyWhenTheServerStaysAway) {
    if (std::system("command -v redis-server >/dev/null 2>&1") != 0)
        GTEST_SKIP() << "redis-server not installed";
    dist_test::TempDir dir("redis-own");
    const int port = dist_test::free_port();
    const std::vector<std::string> argv{
        "redis-server", "--port", std::to_string(port), "--bind", "127.0.0.1", "--save",           "",
        "--appendonly", "no",     "--requirepass",      "secret", "--dir",     dir.path().string()};
    dist_test::ServerProcess server;
    server.start(argv, port, dir / "redis.log");
    const std::string url = "redis://:secret@127.0.0.1:" + std::to_string(port) + "/2?retry_ms=3000";
    auto q = make_task_queue(url, "restart", 5000ms);
    auto r = make_registry(url, "restart");
    q->put(task("t1"));
    r->publish(3, "u3");
    EXPECT_THROW(make_registry("redis://:wrong@127.0.0.1:" + std::to_string(port), "x"), moerl::Error);
    // The password also as the ACL default user, from a file, or from REDISCLI_AUTH (out of `ps`).
    const std::string host = "127.0.0.1:" + std::to_string(port);
    EXPECT_FALSE(make_registry("redis://default:secret@" + host + "/2", "acl")->latest());
    std::ofstream(dir / "password") << "secret\n";
    EXPECT_FALSE(
        make_registry("redis://" + host + "/2?password_file=" + (dir / "password"), "file")->latest());
    ::setenv("REDISCLI_AUTH", "secret", 1);
    EXPECT_FALSE(make_registry("redis://" + host + "/2", "env")->latest());
    ::unsetenv("REDISCLI_AUTH");
    EXPECT_THROW(make_registry("redis://" + host + "/2?password_file=/nonexistent/pw", "x"), moerl::Error);

    server.stop();  // the server goes away and comes back without its data
    server.start(argv, port, dir / "redis.log");
    q->put(task("t2"));  // reconnects; the consumer group is created again
    auto lease = q->lease("w1", 1000ms);
    ASSERT_TRUE(lease);
    EXPECT_EQ(lease->task.id, "t2");
    EXPECT_FALSE(r->latest());
    r->publish(1, "u1");

    server.stop();
    // Restarted within the retry budget: the command goes through, and the client says so through
    // the program's log sink (the password masked).
    std::vector<std::string> lines;
    std::mutex lines_mutex;
    moerl::set_log_sink([&](const std::string& text) {
        std::lock_guard lock(lines_mutex);
        lines.push_back(text);
    });
    std::thread restart([&] {
        std::this_thread::sleep_for(700ms);
        server.start(argv, port, dir / "redis.log");
    });
    EXPECT_FALSE(r->latest());  // waited for the server; it lost its data again
    restart.join();
    moerl::set_log_sink({});
    ASSERT_EQ(lines.size(), 2u) << ::testing::PrintToString(lines);
    EXPECT_NE(lines[0].find("unreachable"), std::string::npos) << lines[0];
    EXPECT_NE(lines[1].find("reachable again after"), std::string::npos) << lines[1];
    for (const auto& l : lines) EXPECT_EQ(l.find("secret"), std::string::npos) << l;

    server.stop();
    auto start = std::chrono::steady_clock::now();
    try {
        r->latest();
        ADD_FAILURE() << "a command must fail once the retry budget is spent";
    } catch (const moerl::Error& e) {
        EXPECT_NE(e.message().find("unreachable"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find(std::to_string(port)), std::string::npos) << e.message();
    }
    auto took = std::chrono::steady_clock::now() - start;
    EXPECT_GE(took, 2000ms);
    EXPECT_LT(took, 10000ms);
}
#endif

}  // namespace
}  // namespace moerl::control
