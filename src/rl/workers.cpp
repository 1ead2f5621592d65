// The distributed mode's worker processes (run.hpp): env, rollout, reward and train, one role each.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <thread>

#include "moerl/control/run_lock.hpp"
#include "moerl/control/run_store.hpp"
#include "moerl/core/error.hpp"
#include "moerl/rl/reward_worker.hpp"
#include "moerl/rl/run.hpp"
#include "role_metrics.hpp"

namespace moerl::rl {

namespace {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using control::Millis;

void say(const WorkerContext& w, const std::string& text) {
    if (w.log) w.log(text);
}
bool stopping(const WorkerContext& w) { return w.stop && w.stop->load(); }

// The run is over once the trainer wrote the marker; checked at most every 2 s (a store request).
class DoneWatch {
  public:
    explicit DoneWatch(control::CheckpointStore& store) : store_(store) {}
    bool done() {
        if (done_) return true;
        if (Clock::now() < next_check_) return false;
        next_check_ = Clock::now() + std::chrono::seconds(2);
        done_ = control::run_done(store_);
        return done_;
    }

  private:
    control::CheckpointStore& store_;
    Clock::time_point next_check_{};
    bool done_ = false;
};

// The worker fetches every policy version into DIR/cache/policy-v{N} and DIR/policy/policy-v{N};
// only the newest `keep` of each are worth keeping.
void prune_policy_dirs(const fs::path& dir, size_t keep) {
    for (const char* sub : {"cache", "policy"}) {
        std::vector<fs::path> versions;
        std::error_code ec;
        for (const auto& e : fs::directory_iterator(dir / sub, ec))
            if (e.path().filename().string().rfind("policy-v", 0) == 0) versions.push_back(e.path());
        std::sort(versions.begin(), versions.end());  // zero-padded: by version
        for (size_t i = 0; i + keep < versions.size(); ++i) fs::remove_all(versions[i], ec);
    }
}

// Renews the worker's leases every lease_timeout / 4 on a thread of its own, also while the
// engine loads a policy or decodes a long step (the queue's connection has its own mutex).
class Heartbeat {
  public:
    Heartbeat(control::TaskQueue& tasks, const WorkerContext& w, Millis lease_timeout)
        : every_(std::max<int64_t>(50, lease_timeout.count() / 4)) {
        thread_ = std::thread([this, &tasks, &w] {
            std::unique_lock lock(mutex_);
            while (!cv_.wait_for(lock, every_, [&] { return quit_; })) {
                lock.unlock();
                try {
                    tasks.heartbeat(w.name);
                } catch (const std::exception& e) {
                    say(w, std::string("heartbeat failed: ") + e.what());
                }
                lock.lock();
            }
        });
    }
    ~Heartbeat() {
        {
            std::lock_guard lock(mutex_);
            quit_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }

  private:
    const Millis every_;
    std::mutex mutex_;
    std::condition_variable cv_;
    bool quit_ = false;  // GUARDED_BY(mutex_)
    std::thread thread_;
};
}  // namespace

void run_env_worker(const RunConfig& cfg, ControlPlane& cp, const WorkerContext& w) {
    DoneWatch done(*cp.store);
    EnvMetrics metrics(w.metrics);
    int64_t env_next = 0;
    int64_t last_logged = -2;
    auto next_log = Clock::now();
    say(w, "waiting for the trainer to publish policy v0");
    while (!stopping(w) && !done.done()) {
        auto latest = cp.registry->latest();
        const int64_t version = latest ? latest->first : -1;
        if (version >= 0) {
            while (env_next <= version + cfg.max_staleness && env_next < cfg.steps && !stopping(w)) {
                put_step_tasks(cfg, *cp.tasks, env_next++);
                metrics.step_put(int64_t{cfg.prompts_per_step} * cfg.group_size, env_next);
            }
        }
        metrics.sample(*cp.tasks);
        // The trainer's progress line numbers steps from 1; the env says what it put every 30 s.
        if (env_next - 1 != last_logged && env_next > 0 && (last_logged < 0 || Clock::now() >= next_log)) {
            last_logged = env_next - 1;
            next_log = Clock::now() + std::chrono::seconds(30);
            say(w, "put the tasks of steps up to " + std::to_string(last_logged + 1) + "/" +
                       std::to_string(cfg.steps) + " (policy v" + std::to_string(version) + ")");
        }
        if (version >= cfg.steps) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    say(w, stopping(w) ? "stopped" : "run finished");
}

void run_rollout_worker(const RunConfig& cfg, ControlPlane& cp, const WorkerContext& w,
                        const std::string& cache_dir, const RoleProcesses* processes) {
    RolloutMetrics metrics(w.metrics);
    metrics.count_queue(cp);
    RolloutWorker worker(cfg, cp, w.name, cache_dir, processes);
    DoneWatch done(*cp.store);
    {
        Heartbeat heartbeat(*cp.tasks, w, Millis(cfg.lease_timeout_ms));
        // Tasks appear once version 0 is published; a worker that leased one before loading any
        // policy could not generate it.
        if (!stopping(w) && !done.done() && worker.sync_policy() < 0)
            say(w, "waiting for the trainer to publish policy v0");
        while (!stopping(w) && !done.done() && worker.sync_policy() < 0)
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        metrics.update(worker.stats(), worker.policy_version());
        int failures = 0;
        while (!stopping(w) && !done.done()) {
            try {
                // At most 32 decode steps a call, so the metrics follow a long stretch of work.
                worker.work(Millis(500), w.stop, 32);
                metrics.update(worker.stats(), worker.policy_version());
                prune_policy_dirs(cache_dir, 2);
                failures = 0;
            } catch (const moerl::Error& e) {
                // E.g. a policy version pruned from the store while this worker was fetching it:
                // give the leases back and try again with the newest version.
                const int64_t released = worker.stats().released;
                say(w, "work failed: " + e.message());
                // A rollout engine that lost a rank cannot generate again; its tasks are back.
                if (!worker.healthy()) {
                    say(w, "the rollout engine lost a rank; every task it held went back to the queue (" +
                               std::to_string(released) + " given back in all); exiting for a restart");
                    throw;
                }
                worker.release_all();
                if (++failures >= 5) throw;
                std::this_thread::sleep_for(std::chrono::milliseconds(200));
            }
        }
        if (stopping(w)) worker.release_all();  // work() released already; nothing left normally
    }
    const auto& s = worker.stats();
    char line[256];
    std::snprintf(line, sizeof line,
                  "%s: pushed %lld duplicates %lld released %lld tokens %lld (%.0f tok/s) v%lld",
                  stopping(w) ? "terminated" : "run finished", static_cast<long long>(s.pushed),
                  static_cast<long long>(s.duplicates), static_cast<long long>(s.released),
                  static_cast<long long>(s.tokens), s.seconds > 0 ? s.tokens / s.seconds : 0.0,
                  static_cast<long long>(worker.policy_version()));
    say(w, line);
}

void run_reward_worker(const RunConfig& cfg, ControlPlane& cp, const WorkerContext& w) {
    RewardWorker worker(cfg, cp, w.name);
    DoneWatch done(*cp.store);
    {
        Heartbeat heartbeat(*cp.scoring, w, Millis(cfg.lease_timeout_ms));
        while (!stopping(w) && !done.done()) worker.work(Millis(500), w.stop);
    }
    const auto& s = worker.stats();
    char line[256];
    std::snprintf(
        line, sizeof line,
        "%s: scored %lld duplicates %lld redone %lld released %lld in %lld batches (%.1f s in the model)",
        stopping(w) ? "terminated" : "run finished", static_cast<long long>(s.scored),
        static_cast<long long>(s.duplicates), static_cast<long long>(s.redone),
        static_cast<long long>(s.released), static_cast<long long>(s.batches), s.seconds);
    say(w, line);
}

RunSummary run_train_worker(const RunConfig& cfg, ControlPlane& cp, const WorkerContext& w,
                            const TrainWorkerOptions& opt) {
    // One trainer per run: a second one is refused; a killed one's successor waits out the
    // lock's time to live (10 s) and takes over.
    auto lock = control::acquire_run_lock(cfg.registry, w.run_id, "trainer", w.name, Millis(10000));
    cp.registry =
        std::make_unique<control::StorePolicyRegistry>(std::move(cp.registry), *cp.store, opt.keep_policies);
    TrainLoopOptions loop;
    loop.resume = !control::published_checkpoints(*cp.store, "ckpt-").empty();
    loop.stop = w.stop;
    loop.who = w.name;
    loop.log = w.log;
    loop.audit_path = opt.audit_path;
    loop.check = [&lock] { lock->check(); };
    loop.metrics = w.metrics;
    loop.control_plane_reset = [&lock] { return lock->take_reset(); };
    loop.trainer_processes = opt.trainer_processes;
    if (cfg.sync_transfer == "broadcast") loop.handoff = PolicyHandoff::kBroadcast;
    return train_loop(cfg, cp, loop, nullptr);
}

}  // namespace moerl::rl
