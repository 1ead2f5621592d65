// `moerl run CONFIG.yaml` (local mode: every role in this process; --distributed: `moerl cluster`).
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "commands.hpp"
#include "distributed_run.hpp"
#include "launch.hpp"
#include "moerl/core/error.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/run.hpp"
#include "worker_control.hpp"

namespace moerl::cli {

namespace {
// Why the run ended, where its results and checkpoints are, and how to continue it.
int report(const rl::RunConfig& cfg, const rl::RunSummary& s, const std::string& config,
           const std::string& out) {
    const std::string resume = "moerl run " + config + " --out " + out + " --resume";
    if (s.stopped) {
        const long long redo = static_cast<long long>(s.steps_done - s.checkpoint_step);
        std::printf(
            "run %s: stopped by %s after step %lld/%lld; the newest checkpoint is at step %lld, so %lld "
            "step%s will be trained again\ncontinue with: %s\n",
            cfg.name.c_str(), stop_signal_name().c_str(), static_cast<long long>(s.steps_done),
            static_cast<long long>(cfg.steps), static_cast<long long>(s.checkpoint_step), redo,
            redo == 1 ? "" : "s", resume.c_str());
        return stopped_exit_code();
    }
    if (s.reached_reward) {
        std::printf(
            "run %s: reached the reward target after step %lld/%lld (10-step mean %.3f >= "
            "run.stop_at_reward %g)\n",
            cfg.name.c_str(), static_cast<long long>(s.steps_done), static_cast<long long>(cfg.steps),
            s.final_reward, cfg.stop_at_reward);
    } else if (s.steps_done >= cfg.steps) {
        std::printf("run %s: finished all %lld steps (run.steps)\n", cfg.name.c_str(),
                    static_cast<long long>(cfg.steps));
    } else {
        std::printf("run %s: paused after step %lld/%lld; continue with: %s\n", cfg.name.c_str(),
                    static_cast<long long>(s.steps_done), static_cast<long long>(cfg.steps), resume.c_str());
    }
    std::printf("final mean reward %.3f (first steps %.3f), %.1f s\n", s.final_reward, s.first_reward,
                s.wall_seconds);
    std::printf("metrics: %s\nreward curve: %s\ncheckpoints: %s (newest at step %lld)\n",
                s.metrics_path.c_str(), s.svg_path.c_str(), s.checkpoints.c_str(),
                static_cast<long long>(s.checkpoint_step));
    return 0;
}
}  // namespace

namespace {
// This process as rank `rank` of `world` processes of `role` ("train", "rollout"), meeting them
// through the launcher's store.
std::unique_ptr<rl::RoleProcesses> role_processes(const rl::RunConfig& cfg, const RankEnv& env,
                                                  const std::string& role, int rank, int world) {
    const bool train = role == "train";
    auto p = std::make_unique<rl::RoleProcesses>();
    p->rank = rank;
    p->world_size = world;
    p->local_rank = env.local_rank;
    p->master_addr = env.master_addr;
    p->store = connect_rank_store(env, 300);
    p->ep_transport = train ? cfg.trainer_ep_transport() : cfg.rollout_ep_transport();
    // A rollout step takes milliseconds: a rank silent for a minute is gone, and its engine's tasks
    // should go back to the queue.
    if (!train) p->timeout_s = 60;
    return p;
}
}  // namespace

std::unique_ptr<rl::RoleProcesses> join_role_processes(const rl::RunConfig& cfg, const std::string& config,
                                                       const std::string& role) {
    const RankEnv env = rank_env_from_environment();
    const int want = cfg.role_ranks(role);
    MOERL_CHECK(env.world_size == want, config, ": ranks.", role, " is ", want,
                ", but this process is one of WORLD_SIZE=", env.world_size, " (torchrun's environment)");
    return role_processes(cfg, env, role, env.rank, env.world_size);
}

LocalRanks launch_or_join_local_ranks(const rl::RunConfig& cfg_in, const std::string& config,
                                      const std::vector<std::string>& argv) {
    LocalRanks out;
    if (cfg_in.train_ranks == 1 && cfg_in.rollout_ranks == 1) return out;
    rl::RunConfig cfg = cfg_in;
    cfg.validate();
    const int world = cfg.train_ranks + cfg.rollout_ranks - 1;
    if (std::getenv("WORLD_SIZE") == nullptr) {
        out.exit_code = launch_local(world, argv, 0, 10.0);
        return out;
    }
    const RankEnv env = rank_env_from_environment();
    MOERL_CHECK(env.world_size == world, config, ": ranks.train ", cfg.train_ranks, " and ranks.rollout ",
                cfg.rollout_ranks, " make ", world,
                " processes, but this is one of WORLD_SIZE=", env.world_size);
    const int r = env.rank;
    if (r > 0) ::signal(SIGINT, SIG_IGN);  // Ctrl-C stops rank 0's run, which then releases this rank
    if (cfg.train_ranks > 1 && r < cfg.train_ranks)
        out.trainer = role_processes(cfg, env, "train", r, cfg.train_ranks);
    if (cfg.rollout_ranks > 1 && (r == 0 || r >= cfg.train_ranks))
        out.rollout =
            role_processes(cfg, env, "rollout", r == 0 ? 0 : r - cfg.train_ranks + 1, cfg.rollout_ranks);
    if (r == 0) return out;
    if (out.trainer) {
        rl::follow_trainer(cfg, *out.trainer);
    } else {
        rl::follow_rollout(cfg, *out.rollout);
    }
    out.exit_code = 0;
    return out;
}

void register_run_commands(CLI::App& app) {
    struct RunArgs {
        std::string config;
        rl::RunOptions run;
        bool quiet = false;
        DistributedRunArgs distributed;
    };
    auto args = std::make_shared<RunArgs>();
    CLI::App* run =
        app.add_subcommand("run", "Run RL post-training from a YAML config (all roles in this process)");
    run->footer(kExitStatusHelp);
    run->add_option("config", args->config, "Run configuration (YAML), e.g. examples/quickstart.yaml")
        ->required();
    run->add_flag("--resume", args->run.resume,
                  "Continue the run in the output directory from its newest checkpoint");
    run->add_option("--steps", args->run.steps, "Override run.steps");
    run->add_option("--out", args->run.output_dir, "Override run.output_dir");
    run->add_flag("--quiet", args->quiet, "No progress line");
    add_distributed_run_options(run, args->distributed);
    run->callback([args] {
        if (args->distributed.enabled)
            return run_distributed(args->config, args->run.output_dir, args->distributed);
        // Silently running embedded would ignore the control plane the user named.
        MOERL_CHECK(args->distributed.redis.empty() && args->distributed.store.empty(),
                    "run: --redis and --store need --distributed (without it every role runs in this process "
                    "on embedded backends)");
        rl::RunConfig cfg = rl::RunConfig::load(args->config);
        if (!args->run.output_dir.empty()) cfg.output_dir = args->run.output_dir;
        if (args->run.steps >= 0) cfg.steps = args->run.steps;
        const std::string out = cfg.output_dir;
        MOERL_CHECK(!args->run.resume || std::filesystem::exists(out), "--resume: no earlier run in ", out,
                    " (the directory does not exist); run without --resume to start one");
        // ranks.train > 1 or ranks.rollout > 1: this command runs again as that many processes.
        std::vector<std::string> argv{self_executable(), "run", args->config, "--out", out};
        if (args->run.steps >= 0) argv.insert(argv.end(), {"--steps", std::to_string(args->run.steps)});
        if (args->run.resume) argv.push_back("--resume");
        if (args->quiet) argv.push_back("--quiet");
        const LocalRanks ranks = launch_or_join_local_ranks(cfg, args->config, argv);
        if (ranks.exit_code > 0) throw CLI::RuntimeError(ranks.exit_code);
        if (ranks.exit_code == 0) return;
        args->run.trainer_processes = ranks.trainer.get();
        args->run.rollout_processes = ranks.rollout.get();
        install_stop_handlers();
        args->run.progress = !args->quiet;
        args->run.stop = &stop_flag();
        rl::RunSummary s = rl::run_local(cfg, args->run);
        const int code = report(cfg, s, args->config, out);
        if (code != 0) throw CLI::RuntimeError(code);
    });
}

}  // namespace moerl::cli
