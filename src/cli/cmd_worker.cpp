// `moerl worker --role env|rollout|reward|train` runs one role of a distributed run as its own
// process against Redis (queue, buffer, registry) and a checkpoint store; `moerl cluster` starts
// a local group of such processes for trying it out. Argument parsing and wiring only: the roles
// are rl::run_*_worker (rl/run.hpp), the supervisor is cluster.hpp.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <memory>
#include <vector>

#include "cluster.hpp"
#include "commands.hpp"
#include "distributed_run.hpp"
#ifdef MOERL_HAVE_HEALTH
#include "health_server.hpp"
#endif
#include "launch.hpp"
#include "moerl/control/control.hpp"
#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"
#include "moerl/core/log.hpp"
#include "moerl/model/reward_model.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/run.hpp"
#include "worker_control.hpp"

namespace moerl::cli {

namespace {
namespace fs = std::filesystem;

struct WorkerArgs {
    std::string config;
    std::string role;
    std::string redis;
    std::string store;
    std::string run_id;
    std::string worker_id;
    std::string out;
    std::string audit;
    long long lease_timeout_ms = 0;
    double grace_s = 20;
    long long checkpoint_every = 1;
    int keep_policies = 4;
};

rl::RunConfig load_config(const WorkerArgs& a) {
    rl::RunConfig cfg = rl::RunConfig::load(a.config);
    if (!a.redis.empty()) cfg.queue = cfg.buffer = cfg.registry = a.redis;
    if (!a.store.empty()) cfg.store = a.store;
    if (!a.out.empty()) cfg.output_dir = a.out;
    if (a.lease_timeout_ms > 0) cfg.lease_timeout_ms = a.lease_timeout_ms;
    // The distributed trainer acknowledges experiences only at checkpoints: it needs them often.
    MOERL_CHECK(a.checkpoint_every >= 1, "--checkpoint-every ", a.checkpoint_every, "; expected >= 1");
    cfg.checkpoint_every = a.checkpoint_every;
    cfg.validate();
    for (const std::string* addr : {&cfg.queue, &cfg.buffer, &cfg.registry}) {
        MOERL_CHECK(addr->rfind("redis://", 0) == 0, a.config, ": control plane address '", *addr,
                    "': roles in separate processes need a shared one; pass --redis redis://host:port");
    }
    return cfg;
}

std::string default_worker_id(const std::string& role) {
    char host[256] = {0};
    ::gethostname(host, sizeof host - 1);
    return role + "-" + host + "-" + std::to_string(::getpid());
}

void run_worker_as(const WorkerArgs& a, const std::string& who);

// Errors are logged with the worker's prefix, and the exit status says how it ended.
void run_worker(const WorkerArgs& a) {
    install_stop_handlers();
    const std::string who = a.worker_id.empty() ? default_worker_id(a.role) : a.worker_id;
    try {
        run_worker_as(a, who);
    } catch (const CLI::RuntimeError&) {  // an exit status, said already
        throw;
    } catch (const moerl::Error& e) {
        log_line(who, "error: " + e.message());
        throw CLI::RuntimeError(kExitError);
    } catch (const std::exception& e) {
        log_line(who, std::string("error: ") + e.what());
        throw CLI::RuntimeError(kExitError);
    }
}

void run_worker_as(const WorkerArgs& a, const std::string& who) {
    MOERL_CHECK(a.role == "env" || a.role == "rollout" || a.role == "reward" || a.role == "train", "--role ",
                a.role, "; expected env, rollout, reward or train");
    const rl::RunConfig cfg = load_config(a);
    const std::string run_id = a.run_id.empty() ? cfg.name : a.run_id;
    start_grace_watchdog(who, a.grace_s);
    // The trainer over ranks.train processes, a rollout engine over ranks.rollout (torchrun's
    // environment: a StatefulSet's pods, or `moerl launch` in one pod): rank 0 is the trainer or
    // rollout worker the control plane sees; the others hold their experts (and, for rollout, their
    // sequences) and follow it.
    std::unique_ptr<rl::RoleProcesses> processes;
    if (cfg.role_ranks(a.role) > 1) {
        log_line(who, std::string(a.role == "train" ? "trainer" : "rollout engine") + " rank " +
                          env::get_string("RANK", "0") + " of " + std::to_string(cfg.role_ranks(a.role)) +
                          ": joining the others at " + env::get_string("MASTER_ADDR", "127.0.0.1") + ":" +
                          env::get_string("MASTER_PORT", "29500"));
        processes = join_role_processes(cfg, a.config, a.role);
        if (a.role == "train" && processes->rank > 0) {
            rl::follow_trainer(cfg, *processes);
            log_line(who, "rank 0's run ended");
            return;
        }
    }
#ifdef MOERL_HAVE_HEALTH
    // Probes and metrics for a cluster scheduler, where MOERL_HEALTH_PORT asks for them (the images
    // set it; local clusters leave it unset, so their workers do not compete for one port).
    MetricsRegistry metrics;
    std::atomic<bool> connected{false};
    std::unique_ptr<HealthServer> health;
    if (env::get("MOERL_HEALTH_PORT")) {
        metrics.gauge("moerl_worker_start_time_seconds", "Unix time the worker started")
            .set(static_cast<double>(::time(nullptr)));
        metrics.gauge_fn("moerl_worker_connected", "1 once the control plane answered",
                         [&connected] { return connected.load() ? 1.0 : 0.0; });
        const bool needs_policy = a.role == "rollout" || a.role == "reward";
        health = std::make_unique<HealthServer>(
            HealthOptions::from_env(), metrics, [&connected, &metrics, needs_policy](std::string& why) {
                if (stop_flag().load()) {
                    why = "stopping (termination notice)";
                    return false;
                }
                if (!connected.load()) {
                    why = "connecting to the control plane";
                    return false;
                }
                // A rollout worker is ready once it generates: a policy is loaded.
                if (needs_policy && metrics.value("moerl_rollout_policy_version").value_or(-1) < 0) {
                    why = "no policy loaded yet";
                    return false;
                }
                return true;
            });
        log_line(who, "health server on port " + std::to_string(health->port()));
    }
#endif
    // The libraries' own lines (e.g. the Redis client reconnecting) get the timestamp and role too.
    moerl::set_log_sink([who](const std::string& text) { log_line(who, text); });
    log_line(who, "role " + a.role + ", run " + run_id + ", store " + cfg.store_uri() + ", pid " +
                      std::to_string(::getpid()));
    log_line(who, "connecting to the control plane (Redis; the URL's retry_ms bounds the wait)");
    rl::ControlPlane cp = rl::ControlPlane::connect(cfg, run_id);
    log_line(who, "connected to the control plane");
#ifdef MOERL_HAVE_HEALTH
    connected = true;
#endif
    rl::WorkerContext w{run_id, who, &stop_flag(), [who](const std::string& text) { log_line(who, text); }};
#ifdef MOERL_HAVE_HEALTH
    if (health) w.metrics = &metrics;
#endif
    if (a.role == "env") {
        rl::run_env_worker(cfg, cp, w);
    } else if (a.role == "train") {
        const rl::RunSummary s =
            rl::run_train_worker(cfg, cp, w, {a.keep_policies, a.audit, processes.get()});
        if (s.stopped) {
            // Not a finished run: a scheduler (or `moerl cluster`) must not take it for one.
            log_line(who, "stopped by " + stop_signal_name() + " before step " +
                              std::to_string(s.steps_done + 1) + "; a restarted trainer resumes at step " +
                              std::to_string(s.checkpoint_step + 1) + " from " + s.checkpoints);
            throw CLI::RuntimeError(stopped_exit_code());
        }
    } else if (a.role == "reward") {
        rl::run_reward_worker(cfg, cp, w);
    } else {
        // The ranks of an engine share its worker id: each fetches policies into its own folder.
        const std::string rank_suffix = processes ? "-rank" + std::to_string(processes->rank) : "";
        const std::string cache = (fs::path(cfg.output_dir) / "rollout" / (who + rank_suffix)).string();
        if (processes && processes->rank > 0) {
            rl::follow_rollout_engine(cfg, cp, cache, *processes);
            log_line(who, "rank 0 of the rollout engine stopped");
            return;
        }
        rl::run_rollout_worker(cfg, cp, w, cache, processes.get());
    }
}

struct ClusterArgs {
    WorkerArgs worker;
    int rollout_workers = 2;
    int reward_workers = -1;  // -1: one when the config has a reward model, else none
    int max_restarts = 5;
};

// The control plane answers now, or the cluster is not started: its workers would only wait and
// be restarted in vain.
void check_control_plane(const rl::RunConfig& cfg, const std::string& run_id) {
    std::string url = cfg.registry;
    if (url.find("retry_ms=") == std::string::npos)
        url += (url.find('?') == std::string::npos ? "?" : "&") + std::string("retry_ms=3000");
    try {
        control::make_registry(url, run_id)->latest();
    } catch (const moerl::Error& e) {
        MOERL_FAIL("cluster: the control plane does not answer, so no worker was started: ", e.message());
    }
}

void run_cluster(const ClusterArgs& c) {
    install_stop_handlers();
    MOERL_CHECK(!c.worker.redis.empty(), "cluster: --redis redis://host:port is required");
    MOERL_CHECK(c.rollout_workers >= 1, "--rollout-workers ", c.rollout_workers, "; expected >= 1");
    MOERL_CHECK(c.max_restarts >= 0, "--max-restarts ", c.max_restarts, "; expected >= 0");
    const WorkerArgs& a = c.worker;
    const rl::RunConfig cfg = load_config(a);  // fail here, not in every child
    const std::string run_id = a.run_id.empty() ? cfg.name : a.run_id;
    check_control_plane(cfg, run_id);
    const bool scored = !cfg.reward_model_path.empty();
    const int reward_workers = c.reward_workers >= 0 ? c.reward_workers : (scored ? 1 : 0);
    MOERL_CHECK(!scored || reward_workers >= 1, "--reward-workers 0, but ", a.config,
                " has a reward model (reward.model_path): nothing would score its experiences");
    MOERL_CHECK(scored || reward_workers == 0, "--reward-workers ", reward_workers, ", but ", a.config,
                " has no reward.model_path");
    if (scored) model::inspect_reward_checkpoint(cfg.reward_model_path, cfg.reward_label);
    // A rollout worker restarted under its name takes its dead predecessor's leases back at once.
    int num_rollout = 0;
    auto child = [&](const std::string& role) {
        ChildSpec s{role,
                    {"moerl", "worker", "--role", role, "--redis", a.redis, "--store", cfg.store_uri(),
                     "--run-id", run_id, "--out", cfg.output_dir, "--grace-s", seconds_text(a.grace_s),
                     "--lease-timeout-ms", std::to_string(cfg.lease_timeout_ms)}};
        if (role == "rollout")
            s.argv.insert(s.argv.end(),
                          {"--worker-id", "rollout-" + std::to_string(num_rollout++) + "-" + run_id});
        if (role == "train") {
            s.argv.insert(s.argv.end(), {"--checkpoint-every", std::to_string(a.checkpoint_every)});
            if (!a.audit.empty()) s.argv.insert(s.argv.end(), {"--audit", a.audit});
        }
        s.argv.push_back(a.config);
        // ranks.train processes of the trainer, ranks.rollout processes of each rollout engine,
        // under the local launcher (torchrun's environment); the launcher stops the others of a
        // group when one fails, and the group is restarted as a whole.
        const int ranks = cfg.role_ranks(role);
        if (ranks > 1) {
            s.argv[0] = self_executable();
            s.argv.insert(s.argv.begin(), {"moerl", "launch", "-n", std::to_string(ranks), "--grace",
                                           seconds_text(a.grace_s), "--"});
        }
        return s;
    };
    std::vector<ChildSpec> children{child("train"), child("env")};
    for (int i = 0; i < c.rollout_workers; ++i) children.push_back(child("rollout"));
    for (int i = 0; i < reward_workers; ++i) children.push_back(child("reward"));
    log_line("cluster", "run " + run_id + ": trainer, env, " + std::to_string(c.rollout_workers) +
                            " rollout and " + std::to_string(reward_workers) + " reward workers started");
    const int trainer_status = supervise(children, {c.max_restarts, a.grace_s}, stop_flag());
    MOERL_CHECK(trainer_status <= 0, "cluster: the trainer exited with ", trainer_status);
    if (stop_flag().load()) {
        log_line("cluster", "stopped by " + stop_signal_name() +
                                " before the run finished; the same command continues it from the newest "
                                "checkpoint in " +
                                cfg.store_uri());
        throw CLI::RuntimeError(stopped_exit_code());
    }
    log_line("cluster", "run finished; workers stopped");
}

void add_common_options(CLI::App* cmd, WorkerArgs& a) {
    cmd->add_option("config", a.config, "Run configuration (YAML)")->required();
    cmd->add_option("--redis", a.redis, "Redis 7 address of queue, buffer and registry: redis://host:port");
    cmd->add_option("--store", a.store, "Checkpoint store: file:///dir or s3://bucket/prefix");
    cmd->add_option("--run-id", a.run_id, "Namespace of the run's Redis keys (default: run.name)");
    cmd->add_option("--out", a.out, "Override run.output_dir (local files: metrics, caches)");
    cmd->add_option(
        "--lease-timeout-ms", a.lease_timeout_ms,
        "Override control.lease_timeout_ms: a lease not renewed this long moves to another worker");
    cmd->add_option("--grace-s", a.grace_s,
                    "Seconds between a termination notice (SIGTERM) and exit (default 20)")
        ->check(CLI::PositiveNumber);
    cmd->add_option(
        "--checkpoint-every", a.checkpoint_every,
        "Trainer: steps per checkpoint (overrides run.checkpoint_every; default 1): experiences are "
        "acknowledged once their step is in one");
    cmd->add_option("--audit", a.audit,
                    "Trainer: append one JSON line per trained step (task ids) to this file");
}

}  // namespace

void add_distributed_run_options(CLI::App* run, DistributedRunArgs& a) {
    run->add_flag("--distributed", a.enabled,
                  "Run every role as its own process on Redis and a store (same as `moerl cluster`)");
    run->add_option("--redis", a.redis, "With --distributed: redis://host:port");
    run->add_option("--store", a.store, "With --distributed: file:///dir or s3://bucket/prefix");
    run->add_option("--rollout-workers", a.rollout_workers, "With --distributed: rollout worker processes");
}

void run_distributed(const std::string& config, const std::string& out, const DistributedRunArgs& a) {
    MOERL_CHECK(!a.redis.empty(), "run --distributed: --redis redis://host:port is required");
    ClusterArgs c;
    c.worker.config = config;
    c.worker.redis = a.redis;
    c.worker.store = a.store;
    c.worker.out = out;
    c.rollout_workers = a.rollout_workers;
    run_cluster(c);
}

void register_worker_commands(CLI::App& app) {
    auto wargs = std::make_shared<WorkerArgs>();
    CLI::App* worker = app.add_subcommand(
        "worker",
        "Run one role (env, rollout, reward, train) as its own process on a distributed control plane");
    worker->add_option("--role", wargs->role, "env | rollout | reward | train")->required();
    worker->add_option(
        "--worker-id", wargs->worker_id,
        "Name of this worker (default: ROLE-HOST-PID). A rollout worker restarted under a dead one's name "
        "takes its leases back at once; never give two live workers one name");
    add_common_options(worker, *wargs);
    worker->callback([wargs] { run_worker(*wargs); });

    auto cargs = std::make_shared<ClusterArgs>();
    CLI::App* cluster = app.add_subcommand(
        "cluster", "Start a local distributed run: trainer, env, rollout and reward worker processes");
    cluster->add_option("--rollout-workers", cargs->rollout_workers, "Rollout worker processes (default 2)");
    cluster->add_option("--reward-workers", cargs->reward_workers,
                        "Reward worker processes (default: 1 when the config has reward.model_path, else 0)");
    cluster->add_option(
        "--max-restarts", cargs->max_restarts,
        "Failed worker exits (the trainer's too) restarted in total before giving up (default 5)");
    add_common_options(cluster, cargs->worker);
    cluster->callback([cargs] { run_cluster(*cargs); });
}

}  // namespace moerl::cli
