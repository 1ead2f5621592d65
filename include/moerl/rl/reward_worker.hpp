// The reward stage: a reward model (model::RewardModel, reward.model_path) scores finished
// experiences between rollout and training.
//
//   rollout: verifier reward x reward.verifier_weight -> put on the scoring stage (ControlPlane::scoring)
//   reward:  lease a batch -> score prompt + response -> reward += reward.model_weight x score
//            -> push to the experience buffer -> ack each lease
//
// The scoring stage is a task queue of its own (the run's queue backend, namespaced by
// scoring_run_id()), so it has the task queue's guarantees: a lease not acknowledged within the
// lease timeout goes to another reward worker. A worker killed before its push loses nothing (the
// lease expires and the experience is scored again); one killed after its push and before its ack
// leaves an experience whose second push the buffer refuses (exactly once per task id), so the
// trainer sees every experience once, with the same score (scoring is deterministic).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "moerl/control/control.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/roles.hpp"

namespace moerl::rl {

// The namespace of a run's scoring stage in the control plane.
std::string scoring_run_id(const std::string& run_id);

struct RewardStats {
    int64_t scored = 0;      // experiences scored and passed on to the buffer
    int64_t duplicates = 0;  // of them, refused by the buffer: passed on before by a worker that died
    int64_t redone = 0;      // leases handed out before (their first holder died or stopped)
    int64_t released = 0;    // leases given back unscored on a termination notice
    int64_t batches = 0;     // reward-model forwards
    double seconds = 0;      // time spent in the reward model
};

class RewardWorker {
  public:
    // Loads reward.model_path on reward.device in reward.dtype; throws when it is no reward model
    // or its vocabulary is smaller than the policy's.
    RewardWorker(const RunConfig& config, ControlPlane& control, std::string name);
    ~RewardWorker();

    // Leases up to reward.batch_size experiences (waiting up to `wait` for the first), scores them
    // and passes them on, until none arrives within `wait` or `stop` is set (a batch leased but not
    // yet scored is then released). Returns the number passed on.
    size_t work(control::Millis wait, const std::atomic<bool>* stop = nullptr);
    const RewardStats& stats() const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace moerl::rl
