// What the roles of one run keep in its checkpoint store, besides the trainer's checkpoints:
//   "ckpt-{next_step}/"   trainer checkpoints (the rl layer names and writes them)
//   "policy-v{N}/"        policy versions for rollout workers on other machines (StorePolicyRegistry)
//   "run_done.json"       the run is over: env and rollout workers exit when they see it
// A checkpoint counts only once its manifest.json is there (publish_checkpoint writes it last).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moerl/control/control.hpp"

namespace moerl::control {

// Names "X" of the checkpoints "X/manifest.json" whose name starts with `prefix`, sorted.
std::vector<std::string> published_checkpoints(CheckpointStore& store, const std::string& prefix);

// Removes all but the newest `keep` (by name) of those checkpoints, each manifest first so that
// readers stop trusting it before its files go.
void prune_checkpoints(CheckpointStore& store, const std::string& prefix, size_t keep);

// "policy-v00000012": the store name of a policy version.
std::string policy_checkpoint_name(int64_t version);

// Registry that turns the trainer's "file:///local/dir" policy into the store checkpoint
// "policy-v{N}", registered as "store:policy-v{N}" (rollout workers fetch it through their
// cache), and keeps the newest `keep` policies in the store. Other URIs pass through.
class StorePolicyRegistry final : public Registry {
  public:
    StorePolicyRegistry(std::unique_ptr<Registry> inner, CheckpointStore& store, int keep);
    void publish(int64_t version, const std::string& checkpoint_uri) override;
    std::optional<std::pair<int64_t, std::string>> latest() override;

  private:
    std::unique_ptr<Registry> inner_;
    CheckpointStore& store_;
    const size_t keep_;
};

inline constexpr const char* kRunDoneKey = "run_done.json";
// Written by the trainer when the run is over (`json`: its summary); tmp_dir holds the upload.
void write_run_done(CheckpointStore& store, const std::string& json, const std::string& tmp_dir);
bool run_done(CheckpointStore& store);

}  // namespace moerl::control
