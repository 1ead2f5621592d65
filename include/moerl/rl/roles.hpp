// The RL roles, each parameterized only by the control plane (task queue, experience buffer,
// registry, checkpoint store), so the same code runs in one process (embedded backends, `moerl
// run`) or as separate processes against Redis and S3 (distributed mode).
//
//   env:      put_step_tasks()        -> task queue (G tasks per prompt, deterministic seeds)
//   rollout:  RolloutWorker::work()   lease -> generate -> score -> push experience -> ack;
//             on stop: release leases with the partial trajectory
//   reward:   RewardWorker::work()    with a reward model, between rollout and training
//             (reward_worker.hpp)
//   train:    TrainerRole::train_step() take -> GRPO -> publish version N+1 -> ack
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moerl/control/control.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/experience.hpp"
#include "moerl/rl/rollout.hpp"
#include "moerl/rl/trainer.hpp"

namespace moerl::rl {

struct ControlPlane {
    std::unique_ptr<control::TaskQueue> tasks;
    std::unique_ptr<control::ExperienceBuffer> experience;
    std::unique_ptr<control::Registry> registry;
    std::unique_ptr<control::CheckpointStore> store;
    // Experiences waiting for the reward model (reward_worker.hpp); null without reward.model_path.
    std::unique_ptr<control::TaskQueue> scoring;
    // From config.queue / buffer / registry / store_uri(), namespaced by run_id.
    static ControlPlane connect(const RunConfig& config, const std::string& run_id);
};

// ---- env -------------------------------------------------------------------------------------
// The task of sample `sample_idx` of prompt `prompt_idx` of `step`; a pure function of the seed.
TaskPayload make_task_payload(const RunConfig& config, int64_t step, int prompt_idx, int sample_idx);
// Puts the prompts_per_step x group_size tasks of `step` (re-putting is a no-op).
void put_step_tasks(const RunConfig& config, control::TaskQueue& tasks, int64_t step);

// ---- rollout ---------------------------------------------------------------------------------
struct RolloutStats {
    int64_t pushed = 0;      // experiences accepted by the buffer (or put on the scoring stage)
    int64_t duplicates = 0;  // experiences the buffer already had (a redone task)
    int64_t released = 0;    // tasks given back with a partial trajectory
    int64_t tokens = 0;      // tokens sampled
    // Context tokens prefilled, and of them those shared with a group-mate instead of computed.
    int64_t prompt_tokens = 0, prompt_tokens_shared = 0;
    double seconds = 0;         // time spent in work(): generating, scoring, syncing
    double reward_seconds = 0;  // of it, scoring finished responses
    DecodeTraffic decode;       // of it, the CUDA engine's decode steps on this process's rank
    // Policy versions loaded into the rollout model, the seconds that took (in all, the newest),
    // the weight bytes copied from the trainer's memory (mem://, cuda-ipc://; over processes every
    // rank's), and how the newest arrived: "memory", "cuda-ipc", "file" or "store".
    int64_t syncs = 0;
    double sync_seconds = 0, last_sync_seconds = 0;
    int64_t sync_bytes = 0;
    std::string sync_path;
};

class RolloutWorker {
  public:
    // cache_dir: where published policies fetched from a store are kept. processes (world_size > 1):
    // this worker is rank 0 of a rollout engine over that many processes (config.rollout_ranks),
    // which shard the experts; ranks 1.. run follow_rollout_engine(). If a rank dies, work() gives
    // every task it holds back to the queue and throws, naming the rank.
    RolloutWorker(const RunConfig& config, ControlPlane& control, std::string name, std::string cache_dir,
                  const RoleProcesses* processes = nullptr);
    ~RolloutWorker();

    // Loads the registry's latest policy when it is newer than the one in use; returns the version
    // in use (-1 before anything was published).
    int64_t sync_policy();
    // Leases tasks and generates with continuous batching (new leases join as sequences finish),
    // pushing each finished experience and acknowledging its task. Returns when no task arrives
    // within `wait` and nothing is in flight, after `max_engine_steps` decode steps (> 0; leases
    // stay held), or when `stop` becomes true (then every lease is released with its partial
    // trajectory). Returns the number of experiences pushed.
    size_t work(control::Millis wait, const std::atomic<bool>* stop = nullptr, int max_engine_steps = 0);
    // Preemption: gives every leased task back with its partial trajectory.
    size_t release_all();
    // The engine's own GPU memory (the KV cache, its weight copies) back to the GPU while it holds no
    // sequence (colocated with the trainer on one GPU: the trainer uses it until the next sync or
    // work()). Returns the bytes.
    int64_t release_memory();
    // What the engine keeps of its GPU memory meanwhile (RolloutEngine::kept_memory_bytes).
    int64_t kept_memory_bytes() const;
    const RolloutStats& stats() const;
    int64_t policy_version() const;
    // False once a rank of the engine has failed (the engine cannot generate again).
    bool healthy() const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// Ranks 1.. of a rollout engine over processes: generates what rank 0 hands out and loads the
// policies it loads (from control.store, kept under cache_dir) until rank 0 stops.
void follow_rollout_engine(const RunConfig& config, ControlPlane& control, const std::string& cache_dir,
                           const RoleProcesses& processes);

// ---- train -----------------------------------------------------------------------------------
// How the trainer hands new policy versions to the rollout workers.
enum class PolicyHandoff {
    // Files: a directory (file://), turned into store checkpoints by a StorePolicyRegistry for
    // workers on other machines. Works everywhere.
    kFiles,
    // The workers are in this process, holding every expert, and the trainer too: they copy its
    // tensors in memory (mem://).
    kInProcess,
    // The workers are this run's processes on this machine (`moerl run` over ranks.train or
    // ranks.rollout, launched together): by CUDA IPC (cuda-ipc://) where the trainer's and the
    // rollout's weights are on CUDA devices, else files; a fallback says why in one log line.
    kThisMachine,
    // The workers are on other machines (distributed mode, sync.transfer: broadcast): each version
    // is broadcast from the trainer to the workers that joined (src/rl/policy_broadcast.hpp); the
    // store gets only checkpoints.
    kBroadcast,
};

struct StepResult {
    int64_t step = 0;
    int64_t version = 0;  // published after this step
    double reward_mean = 0, reward_std = 0;
    double exact_fraction = 0;  // samples the verifier called correct
    double staleness_mean = 0;  // policy versions behind, per token
    int64_t staleness_max = 0;
    int64_t response_tokens = 0;
    std::vector<std::string> task_ids;  // the experiences trained on, group-major
    int64_t retried = 0;                // of them, from tasks handed out more than once
    int64_t duplicates = 0;  // experiences trained on before a restart, dropped since the last step
    TrainStats train;
    double train_seconds = 0;      // the GRPO update
    int64_t train_peak_bytes = 0;  // peak GPU memory of the update (this process's device; 0 off the GPU)
    double publish_seconds = 0;    // publishing the new policy version
};

class TrainerRole {
  public:
    // handoff: where the rollout workers are, so how new versions reach them (PolicyHandoff). With
    // `processes` (more than one), this is their rank 0: files hold every rank's experts, CUDA IPC
    // hands every rank's handles. The rollout workers sync between training steps (the loop runs
    // them in turn), and a cuda-ipc:// reader checks that no update began while it copied.
    TrainerRole(const RunConfig& config, ControlPlane& control, std::string work_dir,
                PolicyHandoff handoff = PolicyHandoff::kFiles, const RoleProcesses* processes = nullptr);
    ~TrainerRole();
    // Fresh start: publishes version 0. Resume: restores the newest checkpoint in the store
    // (weights, optimizer, consumed data, experiences taken but not yet trained on) and publishes
    // its version. Returns the next step to train.
    int64_t start(bool resume);
    // Takes the experiences of `step` (waiting up to `wait` for all of them; nullopt on timeout),
    // runs GRPO, publishes version step + 1 and acknowledges what it used.
    std::optional<StepResult> train_step(int64_t step, control::Millis wait);
    // Writes a checkpoint (HF weights, optimizer, trainer_state.json; manifest last) for `next_step`.
    void save_checkpoint(int64_t next_step, int64_t env_next_step);
    // The env's progress saved in the checkpoint start() resumed from (0 on a fresh start).
    int64_t resumed_env_next_step() const;
    int64_t version() const;
    // Experiences of `step` taken and held for training (what a waiting trainer already has).
    size_t num_held(int64_t step) const;
    // Publishes the current version again (the registry lost it: a control plane without its data).
    void republish_policy();
    // Writes the current policy's weights to `dir` as a Hugging Face checkpoint (config.json and
    // fp32 safetensors; every rank's experts), no optimizer state: what `moerl bench rollout --model`
    // and other tools load.
    void save_weights(const std::string& dir) const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// ---- eval ------------------------------------------------------------------------------------
// Greedy (argmax) responses to the prompt source's eval prompts under the registry's latest policy,
// scored by the run's verifiers (no reward model): pass@1 is the share the first verifier (a task:
// an exact answer) calls correct.
struct EvalResult {
    int64_t version = -1;  // the policy evaluated
    int64_t prompts = 0;
    double pass_at_1 = 0;
    double reward = 0;  // mean
    double seconds = 0;
    std::string sample;  // the response to the first eval prompt, decoded
};

class Evaluator {
  public:
    // cache_dir: where policies fetched from a store are kept.
    Evaluator(const RunConfig& config, ControlPlane& control, std::string cache_dir);
    ~Evaluator();
    EvalResult run();

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// ---- benchmark -------------------------------------------------------------------------------
// Generation throughput of the rollout engine with a randomly initialised model of `config`.
struct RolloutBench {
    int max_batch = 0;
    int64_t sequences = 0;
    int64_t tokens = 0;
    double seconds = 0;
};
RolloutBench bench_rollout(const RunConfig& config, int num_sequences, int max_batch);

}  // namespace moerl::rl
