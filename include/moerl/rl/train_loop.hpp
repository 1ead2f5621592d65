// The training loop, one for every mode. `moerl run` (local: every role in this process) and
// `moerl worker --role train` (distributed) both call train_loop(); they differ only by the
// control-plane backends and by who produces the experiences (an ExperienceProducer in this
// process, or rollout workers elsewhere). Both get the same metrics.jsonl rows, progress line,
// stop_at_reward rule, checkpoint cadence and reward.svg.
//
// The guarantee: an experience is acknowledged in the buffer only after the checkpoint of the
// step that used it is published (control::DeferredAckBuffer, committed after each checkpoint).
// A trainer killed in between leaves it unacknowledged, and its successor, resumed from the
// newest checkpoint, gets it again.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "moerl/core/metrics_registry.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/roles.hpp"

namespace moerl::rl {

// What producing one step's experiences took.
struct ProducedStep {
    double tokens_per_s = 0;             // sampled tokens per second of generation
    double generate_s = 0;               // decoding
    double reward_s = 0;                 // scoring the responses
    double sync_s = 0;                   // loading the newest policy into the rollout model
    int64_t sync_bytes = 0;              // of it, weight bytes copied from the trainer's memory
    std::string sync_path;               // how the newest arrived (RolloutStats::sync_path), "" for none
    int64_t rollout_released_bytes = 0;  // the rollout's KV cache and weight copies lent to training
    int64_t rollout_kept_bytes = 0;      // what it keeps meanwhile (step buffers, graph pools)
    // Context tokens prefilled, and of them those taken from a group-mate's cache blocks.
    int64_t prompt_tokens = 0, prompt_tokens_shared = 0;
    DecodeTraffic decode;  // of generate_s, the CUDA engine's decode steps (their bandwidth use)
    // Peak GPU memory (bytes allocated through LibTorch) while generating; 0 off the GPU.
    int64_t peak_bytes = 0;
};

// Produces the experiences the trainer takes, in this process, before each step.
class ExperienceProducer {
  public:
    virtual ~ExperienceProducer() = default;
    // After the trainer started: the env has put the tasks of every step < env_next_step before.
    virtual void start(int64_t env_next_step) = 0;
    // Before step `step` is trained: puts its tasks (and those up to max_staleness ahead) and
    // generates.
    virtual ProducedStep produce(int64_t step) = 0;
};

struct TrainLoopOptions {
    bool final_checkpoint = true;  // false: the end of the run writes no checkpoint (benchmarks)
    // Set: the end of a run that finished writes the policy's weights here (TrainerRole::save_weights).
    std::string final_weights_dir;
    // How new policy versions reach the rollout workers (TrainerRole).
    PolicyHandoff handoff = PolicyHandoff::kFiles;
    // The trainer is rank 0 of these processes (config.train_ranks); none: one process.
    const RoleProcesses* trainer_processes = nullptr;
    bool resume = false;        // start from the newest checkpoint in the store
    int64_t stop_after = -1;    // stop (with a checkpoint) after this many steps of this call
    double step_timeout_s = 0;  // fail when a step's experiences take longer (0: wait, saying so)
    const std::atomic<bool>* stop = nullptr;  // termination notice: stop before the next step,
                                              // without a checkpoint (the steps since the last
                                              // one are trained again after a resume)
    bool progress = true;                     // the progress line on stderr, one a step
    // Progress and log lines: "[who] ..." each on a line of its own; when empty, "[run.name] ..."
    // and, on a terminal, the progress line rewrites itself.
    std::string who;
    std::function<void(const std::string&)> log;  // start, waits, end (none when empty)
    // Called before each step and each checkpoint; throwing stops the run there (e.g. this
    // trainer lost its run's lock to another one).
    std::function<void()> check;
    std::string audit_path;  // append a JSON line per start, step (its task ids) and end
    // Steps, reward, staleness and publish times for /metrics (none when null).
    MetricsRegistry* metrics = nullptr;
    // Returns true (once per event) when the control plane lost the run's data, e.g. a Redis
    // restarted without persistence: the loop then publishes its version again and re-issues
    // the tasks of the steps in flight. Checked while waiting for experiences.
    std::function<bool()> control_plane_reset;
    int wait_note_s = 30;  // while waiting for a step's experiences, say so this often
};

struct RunSummary {
    int64_t steps_done = 0;   // steps trained in total (including before a resume)
    double final_reward = 0;  // mean reward of the last min(10, steps) steps
    double first_reward = 0;  // mean reward of the first min(10, steps) steps
    double wall_seconds = 0;
    bool reached_reward = false;  // stopped by stop_at_reward
    bool stopped = false;         // stopped by the termination notice
    std::string metrics_path, svg_path;
    std::string checkpoints;      // the store's URI
    int64_t checkpoint_step = 0;  // the step the newest checkpoint resumes at (0: none yet)
};

// Trains config.steps steps (or until stop_at_reward, stop_after or the notice), writing
// output_dir/metrics.jsonl and output_dir/reward.svg, checkpoints to the store every
// checkpoint_every steps and at the end, and the run-done marker when the run is over.
// `control.experience` is wrapped in a control::DeferredAckBuffer.
RunSummary train_loop(const RunConfig& config, ControlPlane& control, const TrainLoopOptions& options,
                      ExperienceProducer* producer);

}  // namespace moerl::rl
