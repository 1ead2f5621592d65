#include "role_metrics.hpp"

#include <memory>
#include <utility>

namespace moerl::rl {

namespace {
using Clock = std::chrono::steady_clock;

bool due(Clock::time_point& next) {
    if (Clock::now() < next) return false;
    next = Clock::now() + std::chrono::seconds(1);
    return true;
}

// The rollout worker's queue traffic, counted as it passes.
class CountedTaskQueue final : public control::TaskQueue {
  public:
    CountedTaskQueue(std::unique_ptr<control::TaskQueue> inner, MetricsRegistry& m)
        : inner_(std::move(inner)),
          leased_(m.counter("moerl_rollout_tasks_leased_total", "Tasks leased from the queue")),
          done_(m.counter("moerl_rollout_tasks_done_total",
                          "Tasks finished: experience pushed and the task acknowledged")),
          requeued_(m.counter("moerl_rollout_tasks_requeued_total",
                              "Tasks given back to the queue with their partial trajectories")) {}
    void put(const control::Task& task) override { inner_->put(task); }
    std::optional<control::Lease> lease(const std::string& worker, control::Millis wait) override {
        auto lease = inner_->lease(worker, wait);
        if (lease) leased_.add();
        return lease;
    }
    void ack(const control::Lease& lease) override {
        inner_->ack(lease);
        done_.add();
    }
    void release(const control::Lease& lease, const std::string& partial) override {
        inner_->release(lease, partial);
        requeued_.add();
    }
    void heartbeat(const std::string& worker) override { inner_->heartbeat(worker); }
    size_t outstanding() override { return inner_->outstanding(); }

  private:
    std::unique_ptr<control::TaskQueue> inner_;
    Counter &leased_, &done_, &requeued_;
};

// The trainer's policy publishes (upload to the store, then the registry entry), timed.
class TimedRegistry final : public control::Registry {
  public:
    TimedRegistry(std::unique_ptr<control::Registry> inner, MetricsRegistry& m)
        : inner_(std::move(inner)),
          last_(m.gauge("moerl_train_weight_publish_seconds",
                        "Seconds the newest policy version took to reach the store and the registry")),
          total_(m.counter("moerl_train_weight_publish_seconds_total",
                           "Seconds spent publishing policy versions")),
          count_(m.counter("moerl_train_weight_publishes_total", "Policy versions published")) {}
    void publish(int64_t version, const std::string& checkpoint_uri) override {
        const auto t0 = Clock::now();
        inner_->publish(version, checkpoint_uri);
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        last_.set(s);
        total_.add(s);
        count_.add();
    }
    std::optional<std::pair<int64_t, std::string>> latest() override { return inner_->latest(); }

  private:
    std::unique_ptr<control::Registry> inner_;
    Gauge& last_;
    Counter &total_, &count_;
};
}  // namespace

QueueSampler::QueueSampler(MetricsRegistry* m) {
    if (m)
        outstanding_ = &m->gauge("moerl_queue_tasks_outstanding",
                                 "Tasks put and not yet acknowledged (waiting or leased)");
}

void QueueSampler::sample(control::TaskQueue& tasks) {
    if (outstanding_ && due(next_)) outstanding_->set(static_cast<double>(tasks.outstanding()));
}

EnvMetrics::EnvMetrics(MetricsRegistry* m) : queue_(m) {
    if (!m) return;
    tasks_put_ =
        &m->counter("moerl_env_tasks_put_total", "Tasks put into the queue (a restarted env re-puts)");
    next_step_ = &m->gauge("moerl_env_next_step", "The next step whose tasks the env puts");
}

void EnvMetrics::step_put(int64_t tasks, int64_t next_step) {
    if (!tasks_put_) return;
    tasks_put_->add(static_cast<double>(tasks));
    next_step_->set(static_cast<double>(next_step));
}

RolloutMetrics::RolloutMetrics(MetricsRegistry* m) : metrics_(m) {
    if (!m) return;
    tokens_ = &m->counter("moerl_rollout_tokens_generated_total", "Tokens sampled");
    prompt_tokens_ = &m->counter("moerl_rollout_prompt_tokens_total", "Context tokens prefilled");
    prompt_tokens_shared_ =
        &m->counter("moerl_rollout_prompt_tokens_shared_total",
                    "Context tokens taken from a group-mate's KV cache instead of computed");
    tokens_per_s_ = &m->gauge("moerl_rollout_tokens_per_second",
                              "Tokens sampled per second of generation, since the previous update");
    policy_version_ =
        &m->gauge("moerl_rollout_policy_version", "Policy version in use (-1: none loaded yet)");
    policy_version_->set(-1);
    syncs_ = &m->counter("moerl_rollout_policy_syncs_total", "Policy versions loaded");
    sync_seconds_ = &m->gauge("moerl_rollout_policy_sync_seconds",
                              "Seconds the newest policy version took to fetch and load");
    sync_seconds_total_ =
        &m->counter("moerl_rollout_policy_sync_seconds_total", "Seconds spent loading policies");
}

void RolloutMetrics::count_queue(ControlPlane& cp) {
    if (metrics_) cp.tasks = std::make_unique<CountedTaskQueue>(std::move(cp.tasks), *metrics_);
}

void RolloutMetrics::update(const RolloutStats& s, int64_t policy_version) {
    if (!metrics_) return;
    tokens_->add(static_cast<double>(s.tokens - last_.tokens));
    prompt_tokens_->add(static_cast<double>(s.prompt_tokens - last_.prompt_tokens));
    prompt_tokens_shared_->add(static_cast<double>(s.prompt_tokens_shared - last_.prompt_tokens_shared));
    if (s.seconds > last_.seconds)
        tokens_per_s_->set(static_cast<double>(s.tokens - last_.tokens) / (s.seconds - last_.seconds));
    policy_version_->set(static_cast<double>(policy_version));
    if (s.syncs > last_.syncs) {
        syncs_->add(static_cast<double>(s.syncs - last_.syncs));
        sync_seconds_->set(s.last_sync_seconds);
        sync_seconds_total_->add(s.sync_seconds - last_.sync_seconds);
    }
    last_ = s;
}

TrainMetrics::TrainMetrics(MetricsRegistry* m) : metrics_(m), queue_(m) {
    if (!m) return;
    steps_ = &m->counter("moerl_train_steps_total", "Steps trained by this trainer process");
    tokens_ = &m->counter("moerl_train_tokens_total", "Response tokens trained on");
    version_ = &m->gauge("moerl_train_policy_version", "Newest policy version published");
    reward_ = &m->gauge("moerl_train_reward_mean", "Mean reward of the newest step's samples");
    staleness_ = &m->gauge("moerl_train_staleness_mean",
                           "Policy versions the newest step's tokens were behind, per token");
    staleness_max_ =
        &m->gauge("moerl_train_staleness_max", "Most policy versions a token of the newest step was behind");
    tokens_per_s_ = &m->gauge("moerl_train_tokens_per_second",
                              "Response tokens of the newest step per second of that step (wait included)");
    step_seconds_ = &m->gauge("moerl_train_step_seconds", "Seconds of the newest step, its wait included");
    waiting_ = &m->gauge("moerl_train_experiences_waiting", "Experiences pushed and not yet acknowledged");
}

void TrainMetrics::time_publishes(ControlPlane& cp) {
    if (metrics_) cp.registry = std::make_unique<TimedRegistry>(std::move(cp.registry), *metrics_);
}

void TrainMetrics::step(const StepResult& r, double step_seconds) {
    if (!metrics_) return;
    steps_->add();
    tokens_->add(static_cast<double>(r.response_tokens));
    version_->set(static_cast<double>(r.version));
    reward_->set(r.reward_mean);
    staleness_->set(r.staleness_mean);
    staleness_max_->set(static_cast<double>(r.staleness_max));
    step_seconds_->set(step_seconds);
    if (step_seconds > 0) tokens_per_s_->set(static_cast<double>(r.response_tokens) / step_seconds);
}

void TrainMetrics::sample(ControlPlane& cp) {
    if (!metrics_) return;
    if (cp.tasks) queue_.sample(*cp.tasks);
    if (due(next_)) waiting_->set(static_cast<double>(cp.experience->size()));
}

}  // namespace moerl::rl
