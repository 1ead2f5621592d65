// Internal: what each role of a distributed run exports on /metrics (moerl/core/metrics_registry.hpp).
// Each class registers its role's metrics when given a registry and does nothing without one, so the
// role loops call it unconditionally. Names follow Prometheus' conventions: moerl_<role>_<what>_<unit>,
// counters end in _total.
#pragma once

#include <chrono>
#include <cstdint>

#include "moerl/core/metrics_registry.hpp"
#include "moerl/rl/roles.hpp"

namespace moerl::rl {

// Reads the queue's depth at most once a second (a control-plane round trip).
class QueueSampler {
  public:
    explicit QueueSampler(MetricsRegistry* metrics);
    void sample(control::TaskQueue& tasks);

  private:
    Gauge* outstanding_ = nullptr;
    std::chrono::steady_clock::time_point next_{};
};

class EnvMetrics {
  public:
    explicit EnvMetrics(MetricsRegistry* metrics);
    void step_put(int64_t tasks, int64_t next_step);
    void sample(control::TaskQueue& tasks) { queue_.sample(tasks); }

  private:
    Counter* tasks_put_ = nullptr;
    Gauge* next_step_ = nullptr;
    QueueSampler queue_;
};

class RolloutMetrics {
  public:
    // Sets moerl_rollout_policy_version to -1 (no policy yet): the readiness probe reads it.
    explicit RolloutMetrics(MetricsRegistry* metrics);
    // Wraps control.tasks so that each lease, acknowledgement and release is counted.
    void count_queue(ControlPlane& control);
    // After each RolloutWorker::work(): tokens, rate, policy version and sync times.
    void update(const RolloutStats& stats, int64_t policy_version);

  private:
    MetricsRegistry* metrics_ = nullptr;
    Counter *tokens_ = nullptr, *syncs_ = nullptr, *sync_seconds_total_ = nullptr;
    Counter *prompt_tokens_ = nullptr, *prompt_tokens_shared_ = nullptr;
    Gauge *tokens_per_s_ = nullptr, *policy_version_ = nullptr, *sync_seconds_ = nullptr;
    RolloutStats last_;
};

class TrainMetrics {
  public:
    explicit TrainMetrics(MetricsRegistry* metrics);
    // Wraps control.registry so that each publish of a policy version is timed.
    void time_publishes(ControlPlane& control);
    void step(const StepResult& result, double step_seconds);
    // Queue depth and experiences waiting, at most once a second.
    void sample(ControlPlane& control);

  private:
    MetricsRegistry* metrics_ = nullptr;
    Counter *steps_ = nullptr, *tokens_ = nullptr;
    Gauge *version_ = nullptr, *reward_ = nullptr, *staleness_ = nullptr, *staleness_max_ = nullptr,
          *tokens_per_s_ = nullptr, *step_seconds_ = nullptr, *waiting_ = nullptr;
    QueueSampler queue_;
    std::chrono::steady_clock::time_point next_{};
};

}  // namespace moerl::rl
