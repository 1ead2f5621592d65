// The run configuration of `moerl run CONFIG.yaml`: every field with its default and limits,
// parsed strictly (unknown keys, wrong types and impossible sizes name the key).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moerl/model/config.hpp"
#include "moerl/rl/env.hpp"
#include "moerl/rl/grpo.hpp"
// Plain option structs only: the text layer's library is needed where they are used (prompt_source).
#include "moerl/text/dataset.hpp"
#include "moerl/text/verifier.hpp"

namespace moerl::rl {

struct SamplingParams {
    double temperature = 1.0;            // > 0
    double top_p = 1.0;                  // (0, 1]
    int top_k = 0;                       // 0 = off, else >= 1
    int max_new_tokens = 0;              // 0 = the task's longest answer + 1 (data: 256)
    std::vector<int> stop_tokens = {2};  // eos; with a tokenizer: its eos and end-of-turn tokens
    // Constrained sampling: only these tokens (and the stop tokens) are drawn; rollout and trainer
    // mask the same logits, so behaviour and trained log-probs agree. Empty = the whole vocabulary.
    std::vector<int> allowed_tokens;
};

// data: prompts from a JSONL file instead of a built-in task (needs the text layer). Each line holds
// `prompt` (a string, formatted as one user turn) or `messages` (a chat), `answer`, and any other
// fields the verifiers read; the prompt is rendered with the tokenizer's chat template and encoded.
struct DataConfig {
    // path, eval_path, eval_fraction, seed (default run.seed), shuffle, epochs, validate, the field
    // names (prompt_field, messages_field, answer_field, id_field). eval_limit = eval.prompts.
    text::DatasetOptions dataset;
    // Apply tokenizer_config.json's chat_template with add_generation_prompt: -1 = when the tokenizer
    // has one, else 0 (raw prompt text, or the messages' contents joined by newlines) or 1 (required).
    int chat_template = -1;
    std::string system_prompt;  // a system turn before each prompt (not when the line has one)
    // Variables the template sees, e.g. {"enable_thinking": false} for Qwen3 (data.template_vars;
    // data.enable_thinking is a shortcut for that one).
    nlohmann::json template_vars = nlohmann::json::object();
    // A prompt longer than this (in tokens, after the template) fails with an error naming its file
    // and line: the trainer's buffers and the rollout KV cache are sized from it. 1..65536.
    int max_prompt_tokens = 256;
};

// eval: greedy (argmax) pass@1 and mean reward on the eval split (data mode) or on held-out
// generated tasks (task mode), logged in metrics.jsonl as eval_pass_at_1 / eval_reward.
struct EvalConfig {
    int64_t every = 0;  // training steps between evals (and one after the last step); 0 = off
    int prompts = 64;   // eval prompts per eval (at most the eval split's size), >= 1
};

struct RunConfig {
    std::string source = "config";  // file name used in error messages
    // run
    std::string name = "run";
    uint64_t seed = 1;
    int64_t steps = 100;  // training steps (policy versions 1..steps), >= 1
    std::string output_dir = "runs/run";
    int64_t checkpoint_every = 0;  // 0 = only at the end
    int keep_checkpoints = 2;      // >= 1
    double stop_at_reward = 0;     // > 0: stop once the mean reward of the last 10 steps reaches it
    int threads = 1;               // LibTorch intra-op threads per rank
    // model: built from these unless model_path names an HF checkpoint to start from
    model::ModelConfig model;
    std::string model_path;
    // prompts: a built-in digit task (`task:`, the default) or a JSONL dataset (`data:`)
    TaskSpec task;
    bool use_data = false;  // a data: section was given (task: and data: exclude each other)
    DataConfig data;
    // tokenizer.json (a file or a directory with tokenizer_config.json); default: model_path when it
    // holds one. Required with data. Sets model.vocab_size for random init and the stop tokens.
    std::string tokenizer_path;
    EvalConfig eval;
    // rollout
    SamplingParams sampling;
    int rollout_max_batch = 64;  // sequences decoded together, >= 1
    bool record_routing = true;
    bool stop_tokens_given = false;  // rollout.stop_tokens was set (else the tokenizer decides)
    // Where the rollout worker's model lives: cpu, or cuda (the first GPU, where sequences decode
    // through model::Generator, the fused CUDA engine, routing records included), in fp32 or bf16;
    // fp8 (cuda): a bf16 model whose decode steps read e4m3 copies of its weights, quantised at each
    // weight sync (model::GeneratorOptions::fp8_weights).
    std::string rollout_device = "cpu";
    std::string rollout_dtype = "fp32";
    int rollout_max_seq_len = 1024;  // prompt + response a sequence may hold on cuda (its KV cache)
    // cuda: context tokens prefilled a step, in parts between the decode steps of the sequences
    // already running (RolloutEngineOptions::prefill_chunk_tokens); 0 = each context whole.
    int64_t rollout_prefill_chunk_tokens = 8192;
    // cuda: the KV cache's format. auto: the rollout dtype's; fp8: e4m3 rows with one scale each
    // (model::GeneratorOptions::fp8_kv_cache), about half the bytes a cached token takes in bf16.
    // Needs rollout.dtype bf16 or fp8 and 4, 8 or 16 query heads per key-value head of 64 or 128 dims.
    std::string rollout_kv_cache_dtype = "auto";
    // train
    int group_size = 8;        // G, >= 2
    int prompts_per_step = 8;  // >= 1
    double lr = 1e-3;          // peak learning rate
    // Learning-rate schedule over the training steps: linear warmup from 0 over lr_warmup_steps,
    // then constant, or a cosine decay to lr_min_ratio x lr at run.steps.
    std::string lr_schedule = "constant";  // constant | cosine
    int64_t lr_warmup_steps = 0;           // >= 0
    double lr_min_ratio = 0.0;             // cosine floor, in [0, 1]
    double weight_decay = 0.0;
    double beta1 = 0.9, beta2 = 0.99, adam_eps = 1e-8;
    double grad_clip = 1.0;  // 0 = off
    int ppo_epochs = 1;      // updates per batch, >= 1
    int max_staleness = 0;   // policy versions a sample may lag, >= 0 (0 = on-policy)
    bool routing_replay = false;
    GrpoParams grpo;
    // Where the trainer runs: cpu, or cuda (one GPU a process: ranks.ep 1, or ranks.train processes).
    std::string train_device = "cpu";
    // fp32, or bf16: forward and backward in bf16 with fp32 master weights and AdamW moments.
    std::string train_dtype = "fp32";
    // AdamW's two moments: fp32, or bf16 (train.device: cuda with train.dtype: bf16): 4 bytes a
    // parameter less to keep and 8 less to read and write each update (20 instead of 28), rounded
    // stochastically so that the moments' small steps survive on average (as DeepSeek-V3 trained).
    // Checkpoints hold them in fp32 either way.
    std::string moments_dtype = "fp32";
    // Tokens (prompt + response) a micro-batch may hold, > 0: a rank packs its samples into rows of
    // at most this many tokens (several samples per row, no padding), runs forward and backward per
    // row and steps the optimizer once (gradient accumulation). 0 (default): one padded batch.
    int64_t micro_batch_tokens = 0;
    // Activation checkpointing: each decoder layer keeps only its input through the forward and is
    // run again in the backward (about a third more compute, activation memory of about one layer):
    // for long sequences or large micro-batches that do not fit otherwise.
    bool activation_checkpointing = false;
    // reward
    double verifier_weight = 1.0;
    // data: the verifier mix, e.g. [{kind: math, weight: 1.0}, {kind: format, weight: 0.2, pattern:
    // ...}]; default [{kind: math}]. Kinds: math, countdown, exact, format, external (text/verifier.hpp).
    // The first one decides pass@1 in eval (list the correctness check first).
    std::vector<text::VerifierSpec> verifiers;
    // data: reward scale of a response that hit max_new_tokens without a stop token, in [0, 1].
    double truncated_scale = 1.0;
    std::string reward_model_path;  // HF checkpoint + scalar head, optional
    double reward_model_weight = 0.0;
    // reward_model_weight is > 0 exactly when reward_model_path is set. The reward model's
    // settings (reward_worker.hpp). label: the row of score.weight that is the
    // reward (-1: the head must have one row); batch_size: sequences per forward, >= 1 (larger
    // batches use the device better, smaller ones pass experiences on sooner).
    int reward_label = -1;
    int reward_batch_size = 16;
    std::string reward_device = "cpu";  // cpu | cuda (the first GPU)
    std::string reward_dtype = "fp32";  // fp32 | bf16
    // ranks
    int ep_ranks = 2;  // training EP group size, divides num_experts
    // Trainer processes: 1 runs the ep_ranks as threads of one process (host transport); N > 1 runs
    // N processes of one EP rank each (ep_ranks == N), gradients summed through c10d's Gloo.
    int train_ranks = 1;
    // How the trainer's processes move tokens: host (shared memory), fabric/<provider> (libfabric:
    // tcp, efa) on the CPU; cuda (CUDA IPC and NVLink, one node) or cuda-fabric/<provider> (GPU
    // memory over libfabric, between nodes: cuda-fabric/efa) on a GPU. Empty: host on the CPU, cuda
    // on a GPU.
    std::string train_ep_transport;
    // True for the transports that move GPU memory (cuda, cuda-fabric/<provider>).
    static bool is_device_transport(const std::string& t) {
        return t == "cuda" || t.rfind("cuda-fabric/", 0) == 0;
    }
    std::string trainer_ep_transport() const {
        return !train_ep_transport.empty() ? train_ep_transport : train_device == "cuda" ? "cuda" : "host";
    }
    // Processes of one rollout engine: 1 holds every expert; M > 1 shards the experts over M
    // processes of one EP rank each (num_experts divisible by M), which step together as one worker
    // towards the queue (`moerl worker --role rollout` under `moerl launch -n M`). Their tokens move
    // over ranks.transport when it suits rollout.device, else host on the CPU and cuda on a GPU.
    int rollout_ranks = 1;
    // The processes of one instance of `role` ("train": train_ranks, "rollout": rollout_ranks, any
    // other role: 1).
    int role_ranks(const std::string& role) const {
        return role == "train" ? train_ranks : role == "rollout" ? rollout_ranks : 1;
    }
    std::string rollout_ep_transport() const {
        const bool gpu = rollout_device == "cuda";
        if (!train_ep_transport.empty() && is_device_transport(train_ep_transport) == gpu)
            return train_ep_transport;
        return gpu ? "cuda" : "host";
    }
    // How new policy versions reach rollout workers on other machines (distributed mode): store
    // (each version as files in the checkpoint store; works everywhere), or broadcast (the trainer
    // broadcasts each version to the workers that joined, over c10d's Gloo or NCCL with CUDA weights
    // on both sides; the store keeps only the checkpoints). Workers in the trainer's process or on its
    // machine copy from memory or by CUDA IPC whatever this says.
    std::string sync_transfer = "store";
    // broadcast: the address the workers reach the trainer at (default: MOERL_SYNC_ADDRESS, else
    // the hostname) and the port of its rendezvous store (MOERL_SYNC_PORT overrides it; 0: any free
    // one, advertised in the registry).
    std::string sync_address;
    int sync_port = 29600;
    double sync_timeout_s = 120;      // a broadcast or group formation taking longer fails
    double sync_join_timeout_s = 10;  // how long a worker has to answer when the group is formed anew
    // control plane
    std::string queue = "embedded";
    std::string buffer = "embedded";
    std::string registry = "embedded";
    std::string store;  // default: file://<output_dir>/checkpoints
    int64_t lease_timeout_ms = 30000;

    // Parse YAML text; `source` names the file in errors ("quickstart.yaml: train.group_size: ...").
    static RunConfig from_yaml_text(const std::string& text, const std::string& source);
    static RunConfig load(const std::string& path);
    // Cross-field checks (sizes that cannot work together); throws naming the key.
    void validate() const;
    int max_new_tokens() const;
    // Longest prompt in tokens (the task's, or data.max_prompt_tokens).
    int max_prompt_tokens() const;
    // Longest sequence: prompt + response (sizes the trainer's buffers and the KV cache).
    int64_t max_sequence_tokens() const;
    // The learning rate of training step `step` (0-based) under the schedule.
    double lr_at(int64_t step) const;
    std::string store_uri() const;
};

}  // namespace moerl::rl
