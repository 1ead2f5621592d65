// The embedded control plane: task queue, experience buffer and registry in this process, shared
// by every handle that names the same run id. One mutex per shared object guards all its state.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "backends.hpp"
#include "moerl/core/error.hpp"

namespace moerl::control {

namespace {

using Clock = std::chrono::steady_clock;

// Shared state per (kind, run id), alive while any handle holds it.
template <typename State>
std::shared_ptr<State> shared_state(const std::string& run_id) {
    static std::mutex mu;
    static std::unordered_map<std::string, std::weak_ptr<State>> states;
    std::lock_guard<std::mutex> lock(mu);
    auto& weak = states[run_id];
    auto state = weak.lock();
    if (!state) {
        state = std::make_shared<State>();
        weak = state;
    }
    return state;
}

// ---------------------------------------------------------------------------------------------
struct QueueState {
    struct Leased {
        Task task;
        std::string lease_id;
        std::string worker;
        Clock::time_point deadline;
    };
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Task> pending;                        // GUARDED_BY(mu)
    std::unordered_map<std::string, Leased> leased;  // GUARDED_BY(mu), by task id
    std::unordered_set<std::string> known;           // GUARDED_BY(mu): every task id ever put
    std::unordered_set<std::string> done;            // GUARDED_BY(mu)
    uint64_t next_lease = 0;                         // GUARDED_BY(mu)
};

class EmbeddedTaskQueue final : public TaskQueue {
  public:
    EmbeddedTaskQueue(const std::string& run_id, Millis lease_timeout)
        : state_(shared_state<QueueState>(run_id)), lease_timeout_(lease_timeout) {
        MOERL_CHECK(lease_timeout.count() > 0, "task queue lease timeout must be > 0 ms, got ",
                    lease_timeout.count());
    }

    void put(const Task& task) override {
        MOERL_CHECK(!task.id.empty(), "task queue: a task needs a non-empty id");
        std::lock_guard<std::mutex> lock(state_->mu);
        // Putting a task id twice is a no-op, so a restarted producer may re-put its tasks.
        if (!state_->known.insert(task.id).second) return;
        state_->pending.push_back(task);
        state_->cv.notify_all();
    }

    std::optional<Lease> lease(const std::string& worker, Millis wait) override {
        auto until = Clock::now() + wait;
        std::unique_lock<std::mutex> lock(state_->mu);
        for (;;) {
            auto now = Clock::now();
            // Expired leases of dead workers come first (Redis XAUTOCLAIM does the same).
            for (auto& [id, l] : state_->leased) {
                if (l.deadline <= now) {
                    l.task.attempt += 1;
                    return hand_out(l, worker, now);
                }
            }
            if (!state_->pending.empty()) {
                Task task = std::move(state_->pending.front());
                state_->pending.pop_front();
                auto& l = state_->leased[task.id];
                l.task = std::move(task);
                return hand_out(l, worker, now);
            }
            if (now >= until) return std::nullopt;
            // Wake up at the earliest lease deadline too, to reassign it.
            auto wake = until;
            for (auto& [id, l] : state_->leased) wake = std::min(wake, l.deadline);
            state_->cv.wait_until(lock, wake);
        }
    }

    void ack(const Lease& lease) override {
        std::lock_guard<std::mutex> lock(state_->mu);
        const std::string& id = lease.task.id;
        // Done whoever holds it now: a later holder's experience is rejected as a duplicate.
        state_->done.insert(id);
        state_->leased.erase(id);
        for (auto it = state_->pending.begin(); it != state_->pending.end(); ++it) {
            if (it->id == id) {
                state_->pending.erase(it);
                break;
            }
        }
        state_->cv.notify_all();
    }

    void release(const Lease& lease, const std::string& partial) override {
        std::lock_guard<std::mutex> lock(state_->mu);
        auto it = state_->leased.find(lease.task.id);
        if (it == state_->leased.end() || it->second.lease_id != lease.lease_id) return;  // reassigned
        Task task = std::move(it->second.task);
        state_->leased.erase(it);
        task.attempt += 1;
        task.partial = partial;
        state_->pending.push_front(std::move(task));
        state_->cv.notify_all();
    }

    void heartbeat(const std::string& worker) override {
        std::lock_guard<std::mutex> lock(state_->mu);
        auto deadline = Clock::now() + lease_timeout_;
        for (auto& [id, l] : state_->leased)
            if (l.worker == worker) l.deadline = deadline;
    }

    size_t outstanding() override {
        std::lock_guard<std::mutex> lock(state_->mu);
        return state_->pending.size() + state_->leased.size();
    }

  private:
    Lease hand_out(QueueState::Leased& l, const std::string& worker, Clock::time_point now) {
        l.worker = worker;
        l.lease_id = l.task.id + "#" + std::to_string(state_->next_lease++);
        l.deadline = now + lease_timeout_;
        return Lease{l.task, l.lease_id, worker};
    }

    std::shared_ptr<QueueState> state_;
    Millis lease_timeout_;
};

// ---------------------------------------------------------------------------------------------
struct BufferState {
    struct Entry {
        Experience experience;
        std::string delivery_id;
        std::string consumer;  // empty until delivered
    };
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Entry> entries;             // GUARDED_BY(mu): pushed, not acknowledged, in push order
    std::unordered_set<std::string> seen;  // GUARDED_BY(mu): task ids ever pushed
    uint64_t next_id = 0;                  // GUARDED_BY(mu)
};

class EmbeddedExperienceBuffer final : public ExperienceBuffer {
  public:
    explicit EmbeddedExperienceBuffer(const std::string& run_id)
        : state_(shared_state<BufferState>(run_id)) {}

    bool push(const Experience& experience) override {
        MOERL_CHECK(!experience.task_id.empty(), "experience buffer: an experience needs a task id");
        std::lock_guard<std::mutex> lock(state_->mu);
        if (!state_->seen.insert(experience.task_id).second) return false;
        state_->entries.push_back({experience, std::to_string(state_->next_id++), ""});
        state_->cv.notify_all();
        return true;
    }

    std::vector<Delivery> take(const std::string& consumer, size_t max, Millis wait) override {
        auto until = Clock::now() + wait;
        std::unique_lock<std::mutex> lock(state_->mu);
        // A consumer's first take through this handle is a restart: its unacknowledged deliveries
        // come again (as Redis's XREADGROUP from id 0 would give them).
        const bool restart = started_.insert(consumer).second;
        for (;;) {
            std::vector<Delivery> out;
            for (auto& e : state_->entries) {
                if (out.size() >= max) break;
                if (e.consumer.empty() || (restart && e.consumer == consumer)) {
                    e.consumer = consumer;
                    out.push_back({e.experience, e.delivery_id});
                }
            }
            if (!out.empty() || Clock::now() >= until || max == 0) return out;
            state_->cv.wait_until(lock, until);
        }
    }

    void ack(const std::vector<std::string>& delivery_ids) override {
        std::lock_guard<std::mutex> lock(state_->mu);
        std::set<std::string> ids(delivery_ids.begin(), delivery_ids.end());
        std::erase_if(state_->entries,
                      [&](const BufferState::Entry& e) { return ids.count(e.delivery_id) > 0; });
    }

    size_t size() override {
        std::lock_guard<std::mutex> lock(state_->mu);
        return state_->entries.size();
    }

  private:
    std::shared_ptr<BufferState> state_;
    std::set<std::string> started_;  // consumers that took through this handle (under state_->mu)
};

// ---------------------------------------------------------------------------------------------
struct RegistryState {
    std::mutex mu;
    std::optional<std::pair<int64_t, std::string>> latest;  // GUARDED_BY(mu)
};

class EmbeddedRegistry final : public Registry {
  public:
    explicit EmbeddedRegistry(const std::string& run_id) : state_(shared_state<RegistryState>(run_id)) {}

    void publish(int64_t version, const std::string& checkpoint_uri) override {
        std::lock_guard<std::mutex> lock(state_->mu);
        MOERL_CHECK(!state_->latest || version > state_->latest->first, "registry: cannot publish version ",
                    version, ": versions only increase and the latest is ", state_->latest->first);
        state_->latest = std::make_pair(version, checkpoint_uri);
    }

    std::optional<std::pair<int64_t, std::string>> latest() override {
        std::lock_guard<std::mutex> lock(state_->mu);
        return state_->latest;
    }

  private:
    std::shared_ptr<RegistryState> state_;
};

}  // namespace

std::unique_ptr<TaskQueue> make_embedded_task_queue(const std::string& run_id, Millis lease_timeout) {
    return std::make_unique<EmbeddedTaskQueue>(run_id, lease_timeout);
}
std::unique_ptr<ExperienceBuffer> make_embedded_experience_buffer(const std::string& run_id) {
    return std::make_unique<EmbeddedExperienceBuffer>(run_id);
}
std::unique_ptr<Registry> make_embedded_registry(const std::string& run_id) {
    return std::make_unique<EmbeddedRegistry>(run_id);
}

}  // namespace moerl::control
