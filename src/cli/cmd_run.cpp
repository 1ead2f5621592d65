// `moerl run CONFIG.yaml` (local mode: every role in this process; --distributed: `moerl cluster`).
#include <cstdio>

#include "commands.hpp"
#include "distributed_run.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/run.hpp"

namespace moerl::cli {

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
        rl::RunConfig cfg = rl::RunConfig::load(args->config);
        args->run.progress = !args->quiet;
        rl::RunSummary s = rl::run_local(cfg, args->run);
        std::printf("run %s: %lld steps, final mean reward %.3f (first steps %.3f), %.1f s\n",
                    cfg.name.c_str(), static_cast<long long>(s.steps_done), s.final_reward, s.first_reward,
                    s.wall_seconds);
        std::printf("metrics: %s\nreward curve: %s\n", s.metrics_path.c_str(), s.svg_path.c_str());
    });
}

}  // namespace moerl::cli
