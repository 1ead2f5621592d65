// Adapters between the rl roles and the distributed control plane, used by `moerl worker`:
//   DeferredAckBuffer    holds the trainer's acknowledgements until its checkpoint is durable
//   StorePolicyRegistry  publishes each policy version through the checkpoint store, so workers on
//                        other machines can load it (the trainer registers a local file:// path)
//   run-done marker      a file in the store that tells env and rollout workers the run finished
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "moerl/control/control.hpp"
#include "moerl/core/error.hpp"

namespace moerl::cli {

// Experience buffer whose ack() only remembers the deliveries; flush() acknowledges them in the
// wrapped buffer. The trainer acknowledges right after a step, but a step is durable only once its
// checkpoint is published: acknowledging earlier would lose the data of a trainer killed in between.
class DeferredAckBuffer final : public control::ExperienceBuffer {
  public:
    struct Acked {
        std::string task_id;
        int attempt = 0;
    };

    explicit DeferredAckBuffer(std::unique_ptr<control::ExperienceBuffer> inner) : inner_(std::move(inner)) {}

    bool push(const control::Experience& experience) override { return inner_->push(experience); }

    std::vector<control::Delivery> take(const std::string& consumer, size_t max,
                                        control::Millis wait) override {
        auto out = inner_->take(consumer, max, wait);
        std::lock_guard lock(mutex_);
        for (const auto& d : out) delivered_[d.delivery_id] = {d.experience.task_id, d.experience.attempt};
        return out;
    }

    void ack(const std::vector<std::string>& delivery_ids) override {
        std::lock_guard lock(mutex_);
        for (const auto& id : delivery_ids) {
            pending_.push_back(id);
            auto it = delivered_.find(id);
            if (it != delivered_.end()) acked_since_.push_back(it->second);
        }
    }

    size_t size() override { return inner_->size(); }

    // Task ids acknowledged by the trainer since the last call (durable or not yet).
    std::vector<Acked> take_acked() {
        std::lock_guard lock(mutex_);
        return std::exchange(acked_since_, {});
    }

    // Acknowledges in the wrapped buffer what the trainer acknowledged so far; call after the
    // checkpoint that contains those steps is published. Returns how many deliveries.
    size_t flush() {
        std::vector<std::string> ids;
        {
            std::lock_guard lock(mutex_);
            ids = std::exchange(pending_, {});
        }
        inner_->ack(ids);
        std::lock_guard lock(mutex_);
        for (const auto& id : ids) delivered_.erase(id);
        return ids.size();
    }

  private:
    std::unique_ptr<control::ExperienceBuffer> inner_;
    std::mutex mutex_;
    std::map<std::string, Acked> delivered_;  // GUARDED_BY(mutex_): delivery id -> task
    std::vector<std::string> pending_;        // GUARDED_BY(mutex_): acked by the trainer, not yet durable
    std::vector<Acked> acked_since_;          // GUARDED_BY(mutex_)
};

inline std::string policy_checkpoint_name(int64_t version) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "policy-v%08lld", static_cast<long long>(version));
    return buf;
}

// Names "X" of the checkpoints "X/manifest.json" under `prefix` in the store, sorted.
inline std::vector<std::string> published_checkpoints(control::CheckpointStore& store,
                                                      const std::string& prefix) {
    std::set<std::string> names;
    for (const auto& key : store.list(prefix)) {
        const auto slash = key.find('/');
        if (slash != std::string::npos && key.substr(slash + 1) == "manifest.json")
            names.insert(key.substr(0, slash));
    }
    return {names.begin(), names.end()};
}

// Registry that turns the trainer's "file:///local/dir" policy into a store checkpoint
// "policy-v{N}" (registered as "store:policy-v{N}", which the rollout worker fetches through its
// cache). Keeps the newest `keep` policies in the store.
class StorePolicyRegistry final : public control::Registry {
  public:
    StorePolicyRegistry(std::unique_ptr<control::Registry> inner, control::CheckpointStore& store, int keep)
        : inner_(std::move(inner)), store_(store), keep_(keep) {
        MOERL_CHECK(keep >= 2, "policy versions kept in the store: ", keep, "; expected >= 2");
    }

    void publish(int64_t version, const std::string& checkpoint_uri) override {
        if (checkpoint_uri.rfind("file://", 0) != 0) {
            inner_->publish(version, checkpoint_uri);
            return;
        }
        const std::string name = policy_checkpoint_name(version);
        control::publish_checkpoint(store_, checkpoint_uri.substr(7), name, version, version);
        inner_->publish(version, "store:" + name);
        auto names = published_checkpoints(store_, "policy-v");
        for (size_t i = 0; i + keep_ < names.size(); ++i) {
            store_.remove(names[i] + "/manifest.json");  // first: readers stop trusting it
            for (const auto& key : store_.list(names[i] + "/")) store_.remove(key);
        }
    }

    std::optional<std::pair<int64_t, std::string>> latest() override { return inner_->latest(); }

  private:
    std::unique_ptr<control::Registry> inner_;
    control::CheckpointStore& store_;
    const size_t keep_;
};

constexpr const char* kRunDoneKey = "run_done.json";

// Written by the trainer when the run is over; env and rollout workers exit when they see it.
inline void write_run_done(control::CheckpointStore& store, const std::string& json,
                           const std::string& tmp_dir) {
    const auto path = std::filesystem::path(tmp_dir) / ("run_done." + std::to_string(::getpid()) + ".json");
    std::filesystem::create_directories(tmp_dir);
    std::ofstream(path) << json << "\n";
    store.put_file(kRunDoneKey, path.string());
    std::filesystem::remove(path);
}

}  // namespace moerl::cli
