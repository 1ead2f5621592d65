// Counters and gauges of a process, registered by name and rendered in Prometheus' text
// exposition format 0.0.4. The roles bump and set them from their loops; a scraper (the health
// server) reads them from another thread. Lock-free updates; registration and rendering take one
// mutex.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace moerl {

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
    // A gauge computed at scrape time; an exception or NaN from `read` leaves the sample out of that
    // scrape. `read` runs on the scraper's thread: it must not touch objects that die before the
    // registry.
    void gauge_fn(const std::string& name, const std::string& help, std::function<double()> read);

    // The current value of a registered metric; nullopt when no metric has that name.
    std::optional<double> value(const std::string& name) const;

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
    static double read(const Entry& e);

    mutable std::mutex mutex_;
    std::map<std::string, Entry> entries_;  // GUARDED_BY(mutex_)
};

}  // namespace moerl
