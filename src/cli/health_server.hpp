// Per-role HTTP endpoints for a cluster scheduler and a metrics scraper:
//   GET /healthz  200 while the process serves requests (liveness)
//   GET /readyz   200 when the readiness callback says the role's backends answer, else 503 and why
//   GET /metrics  the registered counters and gauges in Prometheus' text exposition format 0.0.4
// The server runs on its own threads; the role only bumps counters and sets gauges.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace moerl::cli {

// A monotonically increasing value (Prometheus "counter": by convention its name ends in _total).
class Counter {
  public:
    void add(double by = 1) { value_.fetch_add(by, std::memory_order_relaxed); }
    double value() const { return value_.load(std::memory_order_relaxed); }

  private:
    std::atomic<double> value_{0};
};

// A value that goes up and down (Prometheus "gauge").
class Gauge {
  public:
    void set(double v) { value_.store(v, std::memory_order_relaxed); }
    void add(double by) { value_.fetch_add(by, std::memory_order_relaxed); }
    double value() const { return value_.load(std::memory_order_relaxed); }

  private:
    std::atomic<double> value_{0};
};

// Metrics registered by name. Names must match [a-zA-Z_:][a-zA-Z0-9_:]* and are unique across kinds;
// registering a name again returns the same metric (same kind required). References stay valid for
// the registry's lifetime.
class MetricsRegistry {
  public:
    Counter& counter(const std::string& name, const std::string& help);
    Gauge& gauge(const std::string& name, const std::string& help);
    // A gauge computed at scrape time, e.g. a queue depth read from Redis; an exception or NaN
    // from `read` leaves the sample out of that scrape.
    void gauge_fn(const std::string& name, const std::string& help, std::function<double()> read);

    // The text exposition: "# HELP", "# TYPE" and one sample line per metric, sorted by name.
    std::string exposition() const;

  private:
    struct Entry {
        std::string help;
        const char* type = "gauge";
        std::unique_ptr<Counter> counter;
        std::unique_ptr<Gauge> gauge;
        std::function<double()> read;
    };
    Entry& add(const std::string& name, const std::string& help, const char* type);

    mutable std::mutex mutex_;
    std::map<std::string, Entry> entries_;  // GUARDED_BY(mutex_)
};

struct HealthOptions {
    // Address to listen on. Default "0.0.0.0" (MOERL_HEALTH_ADDR): a pod's probes come from the
    // kubelet on the node, not from loopback.
    std::string host = "0.0.0.0";
    // Port; 0 picks a free one (see HealthServer::port()). Default 8080 (MOERL_HEALTH_PORT).
    int port = 8080;
    // Threads answering requests; probes and one scraper need few (1..64).
    int threads = 2;

    static HealthOptions from_env();
    void validate() const;  // throws moerl::Error naming the bad field
};

// Says whether the role can do its work; on false, `why` is the body of the 503 reply.
using ReadyCheck = std::function<bool(std::string& why)>;

class HealthServer {
  public:
    // Listens before returning; throws moerl::Error when the address cannot be bound.
    HealthServer(const HealthOptions& options, const MetricsRegistry& metrics, ReadyCheck ready);
    ~HealthServer();  // stops listening and joins the threads
    HealthServer(const HealthServer&) = delete;
    HealthServer& operator=(const HealthServer&) = delete;

    int port() const { return port_; }

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
    int port_ = 0;
    std::thread thread_;
};

}  // namespace moerl::cli
