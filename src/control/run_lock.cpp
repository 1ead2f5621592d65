#include "moerl/control/run_lock.hpp"

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "moerl/core/error.hpp"
#include "run_lock_backend.hpp"

namespace moerl::control {

namespace {
using Clock = std::chrono::steady_clock;

// Locks of this process's embedded control planes.
class EmbeddedLockBackend final : public LockBackend {
  public:
    explicit EmbeddedLockBackend(std::string key) : key_(std::move(key)) {}

    std::string take_or_renew(const std::string& holder, Millis ttl, bool& reset) override {
        reset = false;
        std::lock_guard lock(mutex());
        auto& entry = locks()[key_];
        if (entry.first.empty() || entry.first == holder || Clock::now() > entry.second)
            entry = {holder, Clock::now() + ttl};
        return entry.first;
    }

    void release(const std::string& holder) override {
        std::lock_guard lock(mutex());
        auto it = locks().find(key_);
        if (it != locks().end() && it->second.first == holder) locks().erase(it);
    }

  private:
    static std::mutex& mutex() {
        static std::mutex m;
        return m;
    }
    static std::map<std::string, std::pair<std::string, Clock::time_point>>& locks() {  // GUARDED_BY(mutex())
        static std::map<std::string, std::pair<std::string, Clock::time_point>> m;
        return m;
    }
    const std::string key_;
};

// Renews every ttl / 3 on a thread of its own; a renewal that finds another holder marks the
// lock lost (check() then throws).
class TtlLock final : public RunLock {
  public:
    TtlLock(std::unique_ptr<LockBackend> backend, std::string what, std::string holder, Millis ttl)
        : backend_(std::move(backend)), what_(std::move(what)), holder_(std::move(holder)), ttl_(ttl) {
        thread_ = std::thread([this] { renew_loop(); });
    }

    ~TtlLock() override {
        {
            std::lock_guard lock(mutex_);
            quit_ = true;
        }
        cv_.notify_all();
        thread_.join();
        try {
            backend_->release(holder_);
        } catch (const std::exception&) {  // the key expires by itself
        }
    }

    bool take_reset() override {
        std::lock_guard lock(mutex_);
        return std::exchange(reset_, false);
    }

    void check() override {
        std::lock_guard lock(mutex_);
        MOERL_CHECK(lost_to_.empty(), what_, ": ", holder_, " lost the lock to ", lost_to_,
                    " (not renewed within ", ttl_.count(), " ms); stopping");
    }

  private:
    void renew_loop() {
        std::unique_lock lock(mutex_);
        while (!cv_.wait_for(lock, ttl_ / 3, [&] { return quit_; })) {
            if (!lost_to_.empty()) continue;
            lock.unlock();
            std::string now_held_by;
            bool reset = false;
            try {
                now_held_by = backend_->take_or_renew(holder_, ttl_, reset);
            } catch (const std::exception&) {  // the control plane is away: try again next time
                now_held_by = holder_;
            }
            lock.lock();
            if (now_held_by != holder_) lost_to_ = now_held_by;
            if (reset) reset_ = true;
        }
    }

    std::unique_ptr<LockBackend> backend_;
    const std::string what_, holder_;
    const Millis ttl_;
    std::mutex mutex_;
    std::condition_variable cv_;
    bool quit_ = false;    // GUARDED_BY(mutex_)
    std::string lost_to_;  // GUARDED_BY(mutex_)
    bool reset_ = false;   // GUARDED_BY(mutex_)
    std::thread thread_;
};
}  // namespace

std::unique_ptr<RunLock> acquire_run_lock(const std::string& address, const std::string& run_id,
                                          const std::string& name, const std::string& holder, Millis ttl) {
    MOERL_CHECK(!holder.empty(), "run ", run_id, ": the ", name, " lock needs a holder name");
    MOERL_CHECK(ttl.count() >= 30, "run ", run_id, ": lock time to live ", ttl.count(),
                " ms; expected >= 30");
    std::unique_ptr<LockBackend> backend;
    if (address == "embedded") {
        backend = std::make_unique<EmbeddedLockBackend>(run_id + "/" + name);
    } else if (address.rfind("redis://", 0) == 0 || address.rfind("rediss://", 0) == 0) {
#ifdef MOERL_HAVE_REDIS
        backend = make_redis_lock_backend(address, run_id, name);
#else
        MOERL_FAIL("run ", run_id, ": ", address, ": this build has no Redis support");
#endif
    } else {
        MOERL_FAIL("run ", run_id, ": cannot lock on control plane '", address,
                   "'; expected embedded or redis://");
    }
    const auto deadline = Clock::now() + ttl + std::chrono::seconds(1);
    for (;;) {
        bool reset = false;  // a first holder finds no marker either
        const std::string held_by = backend->take_or_renew(holder, ttl, reset);
        if (held_by == holder) break;
        MOERL_CHECK(Clock::now() < deadline, "run ", run_id, " already has a ", name, ": ", held_by,
                    " holds its lock and renews it; stop that one first, or use another run id");
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return std::make_unique<TtlLock>(std::move(backend), "run " + run_id, holder, ttl);
}

}  // namespace moerl::control
