// Per-role HTTP endpoints for a cluster scheduler and a metrics scraper:
//   GET /healthz  200 while the process serves requests (liveness)
//   GET /readyz   200 when the readiness callback says the role's backends answer, else 503 and why
//   GET /metrics  the registry's counters and gauges (moerl/core/metrics_registry.hpp) in
//                 Prometheus' text exposition format 0.0.4
// The server runs on its own threads; the role only bumps counters and sets gauges.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "moerl/core/metrics_registry.hpp"

namespace moerl::cli {

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
