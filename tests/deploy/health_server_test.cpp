// The health server over real HTTP on loopback: probes, readiness flips, the metrics exposition.
#include "health_server.hpp"

#include <gtest/gtest.h>
#include <httplib.h>
#include <stdlib.h>

#include <atomic>
#include <cmath>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

#include "moerl/core/error.hpp"

namespace moerl::cli {
namespace {

HealthOptions loopback() {
    HealthOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    return o;
}

httplib::Result get(int port, const std::string& path) {
    httplib::Client c("127.0.0.1", port);
    c.set_connection_timeout(2, 0);
    c.set_read_timeout(5, 0);
    return c.Get(path);
}

// Every line of a text exposition is a HELP, a TYPE or a sample of the metric the TYPE named.
void expect_valid_exposition(const std::string& text) {
    static const std::regex help(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) (.*))");
    static const std::regex type(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge))");
    static const std::regex sample(R"(([a-zA-Z_:][a-zA-Z0-9_:]*) (NaN|[+-]Inf|-?[0-9.]+(e[+-]?[0-9]+)?))");
    ASSERT_FALSE(text.empty());
    ASSERT_EQ(text.back(), '\n') << "an exposition ends with a line feed";
    std::istringstream in(text);
    std::string line, helped, typed;
    std::smatch m;
    while (std::getline(in, line)) {
        if (std::regex_match(line, m, help)) {
            helped = m[1];
        } else if (std::regex_match(line, m, type)) {
            typed = m[1];
            EXPECT_EQ(typed, helped) << line;
        } else if (std::regex_match(line, m, sample)) {
            EXPECT_EQ(m[1].str(), typed) << "sample without its TYPE line: " << line;
        } else {
            ADD_FAILURE() << "not an exposition line: '" << line << "'";
        }
    }
}

TEST(HealthServer, LivenessAndUnknownPaths) {
    MetricsRegistry metrics;
    HealthServer server(loopback(), metrics, nullptr);
    ASSERT_GT(server.port(), 0);
    auto r = get(server.port(), "/healthz");
    ASSERT_TRUE(r) << "no reply from 127.0.0.1:" << server.port();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "ok\n");
    r = get(server.port(), "/nothing-here");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 404);
}

TEST(HealthServer, ReadinessFollowsTheCallback) {
    MetricsRegistry metrics;
    std::atomic<int> state{0};  // 0: backends down, 1: up, 2: the check itself throws
    HealthServer server(loopback(), metrics, [&](std::string& why) {
        if (state.load() == 2) throw Error("redis://redis:6379: connection refused", __FILE__, __LINE__);
        why = "redis not connected yet";
        return state.load() == 1;
    });
    auto r = get(server.port(), "/readyz");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 503);
    EXPECT_NE(r->body.find("redis not connected yet"), std::string::npos) << r->body;
    state = 1;
    r = get(server.port(), "/readyz");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "ready\n");
    state = 2;
    r = get(server.port(), "/readyz");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 503);
    EXPECT_NE(r->body.find("connection refused"), std::string::npos) << r->body;
    // Liveness does not depend on the backends.
    r = get(server.port(), "/healthz");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
}

TEST(HealthServer, MetricsInTextExpositionFormat) {
    MetricsRegistry metrics;
    Counter& leased = metrics.counter("moerl_tasks_leased_total", "Tasks leased from the queue");
    Counter& requeued =
        metrics.counter("moerl_tasks_requeued_total", "Tasks given back\nwith partials \\ kept");
    Gauge& tps = metrics.gauge("moerl_rollout_tokens_per_second", "Generated tokens per second");
    std::atomic<double> depth{17};
    metrics.gauge_fn("moerl_queue_depth", "Tasks waiting in the queue", [&] { return depth.load(); });
    metrics.gauge_fn("moerl_broken_reading", "A gauge whose source fails",
                     []() -> double { throw std::runtime_error("redis down"); });
    leased.add();
    leased.add(2);
    requeued.add();
    tps.set(1234.5);

    HealthServer server(loopback(), metrics, nullptr);
    auto r = get(server.port(), "/metrics");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
    expect_valid_exposition(r->body);
    EXPECT_NE(r->body.find("# TYPE moerl_tasks_leased_total counter\nmoerl_tasks_leased_total 3\n"),
              std::string::npos)
        << r->body;
    EXPECT_NE(r->body.find("# HELP moerl_tasks_requeued_total Tasks given back\\nwith partials \\\\ kept\n"),
              std::string::npos)
        << r->body;
    EXPECT_NE(r->body.find("moerl_rollout_tokens_per_second 1234.5\n"), std::string::npos) << r->body;
    EXPECT_NE(r->body.find("moerl_queue_depth 17\n"), std::string::npos) << r->body;
    EXPECT_EQ(r->body.find("moerl_broken_reading"), std::string::npos) << "a failed reading is left out";

    // Values are read at scrape time.
    depth = 0;
    leased.add();
    r = get(server.port(), "/metrics");
    ASSERT_TRUE(r);
    EXPECT_NE(r->body.find("moerl_queue_depth 0\n"), std::string::npos) << r->body;
    EXPECT_NE(r->body.find("moerl_tasks_leased_total 4\n"), std::string::npos) << r->body;
}

TEST(HealthServer, ScrapesWhileTheRoleCounts) {
    MetricsRegistry metrics;
    Counter& steps = metrics.counter("moerl_train_steps_total", "Trainer steps");
    HealthServer server(loopback(), metrics, nullptr);
    std::atomic<bool> quit{false};
    std::thread worker([&] {
        while (!quit.load()) steps.add();
    });
    // Scrapes start once the worker has run (on a loaded machine it may start late).
    while (metrics.value("moerl_train_steps_total").value_or(0) == 0) std::this_thread::yield();
    double last = -1;
    for (int i = 0; i < 20; ++i) {
        auto r = get(server.port(), "/metrics");
        ASSERT_TRUE(r);
        std::smatch m;
        ASSERT_TRUE(std::regex_search(r->body, m, std::regex("moerl_train_steps_total ([0-9]+)\n")))
            << r->body;
        const double v = std::stod(m[1]);
        EXPECT_GE(v, last) << "a counter never goes down";
        last = v;
    }
    quit = true;
    worker.join();
    EXPECT_GT(last, 0);
}

TEST(HealthServer, RegistryRejectsBadNamesAndKindClashes) {
    MetricsRegistry metrics;
    EXPECT_THROW(metrics.counter("9lives", "x"), Error);
    EXPECT_THROW(metrics.gauge("tokens/s", "x"), Error);
    EXPECT_THROW(metrics.gauge("", "x"), Error);
    Counter& a = metrics.counter("moerl_steps_total", "Steps");
    EXPECT_EQ(&a, &metrics.counter("moerl_steps_total", "Steps")) << "same name, same counter";
    try {
        metrics.gauge("moerl_steps_total", "Steps");
        FAIL() << "a counter re-registered as a gauge";
    } catch (const Error& e) {
        EXPECT_NE(e.message().find("already registered as a counter"), std::string::npos) << e.message();
    }
    metrics.gauge_fn("moerl_depth", "Depth", [] { return 1.0; });
    EXPECT_THROW(metrics.gauge_fn("moerl_depth", "Depth", [] { return 2.0; }), Error);
    EXPECT_THROW(metrics.gauge("moerl_depth", "Depth"), Error);
}

TEST(HealthServer, RegistryReadsValuesByName) {
    // The rollout's readiness probe reads its policy version this way.
    MetricsRegistry metrics;
    EXPECT_FALSE(metrics.value("moerl_rollout_policy_version")) << "not registered yet";
    Gauge& version = metrics.gauge("moerl_rollout_policy_version", "Policy version in use");
    version.set(-1);
    EXPECT_EQ(metrics.value("moerl_rollout_policy_version"), -1.0);
    version.set(3);
    EXPECT_EQ(metrics.value("moerl_rollout_policy_version"), 3.0);
    metrics.counter("moerl_rollout_tasks_done_total", "Tasks done").add(2);
    EXPECT_EQ(metrics.value("moerl_rollout_tasks_done_total"), 2.0);
    metrics.gauge_fn("moerl_failing", "A reading that fails",
                     []() -> double { throw std::runtime_error("x"); });
    ASSERT_TRUE(metrics.value("moerl_failing"));
    EXPECT_TRUE(std::isnan(*metrics.value("moerl_failing")));
}

TEST(HealthServer, PortInUseIsAClearError) {
    MetricsRegistry metrics;
    HealthServer first(loopback(), metrics, nullptr);
    HealthOptions o = loopback();
    o.port = first.port();
    try {
        HealthServer second(o, metrics, nullptr);
        FAIL() << "two servers on port " << o.port;
    } catch (const Error& e) {
        EXPECT_NE(e.message().find("cannot listen on 127.0.0.1:" + std::to_string(o.port)), std::string::npos)
            << e.message();
    }
}

TEST(HealthServer, OptionsFromEnvironment) {
    ::setenv("MOERL_HEALTH_PORT", "9100", 1);
    ::setenv("MOERL_HEALTH_ADDR", "127.0.0.1", 1);
    HealthOptions o = HealthOptions::from_env();
    EXPECT_EQ(o.port, 9100);
    EXPECT_EQ(o.host, "127.0.0.1");
    ::setenv("MOERL_HEALTH_PORT", "70000", 1);
    try {
        HealthOptions::from_env();
        FAIL() << "port 70000 accepted";
    } catch (const Error& e) {
        EXPECT_NE(e.message().find("MOERL_HEALTH_PORT"), std::string::npos) << e.message();
    }
    ::setenv("MOERL_HEALTH_PORT", "http", 1);
    EXPECT_THROW(HealthOptions::from_env(), Error);
    ::unsetenv("MOERL_HEALTH_PORT");
    ::unsetenv("MOERL_HEALTH_ADDR");
    EXPECT_EQ(HealthOptions::from_env().port, 8080);
}

TEST(HealthServer, StopsRightAfterStarting) {
    // Destroying the server before its accept loop ran must not hang, and frees the port.
    MetricsRegistry metrics;
    HealthOptions o = loopback();
    for (int i = 0; i < 20; ++i) {
        HealthServer server(o, metrics, nullptr);
        o.port = server.port();
    }
    HealthServer again(o, metrics, nullptr);
    auto r = get(again.port(), "/healthz");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
}

}  // namespace
}  // namespace moerl::cli
