// `moerl run CONFIG.yaml` (local mode: every role in this process).
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>

#include "commands.hpp"
#include "moerl/core/error.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/roles.hpp"

namespace moerl::cli {

void register_run_commands(CLI::App& app) {
    struct RunArgs {
        std::string config;
        bool resume = false;
        long long steps = -1;
        std::string out;
        bool quiet = false;
        bool distributed = false;
        std::string redis, store;
        int rollout_workers = 3;
    };
    auto args = std::make_shared<RunArgs>();
    CLI::App* run =
        app.add_subcommand("run", "Run RL post-training from a YAML config (all roles in this process)");
    run->add_option("config", args->config, "Run configuration (YAML), e.g. examples/quickstart.yaml")
        ->required();
    run->add_flag("--resume", args->resume,
                  "Continue the run in the output directory from its newest checkpoint");
    run->add_option("--steps", args->steps, "Override run.steps");
    run->add_option("--out", args->out, "Override run.output_dir");
    run->add_flag("--quiet", args->quiet, "No progress line");
    run->add_flag("--distributed", args->distributed,
                  "Run every role as its own process on Redis and a store (same as `moerl cluster`)");
    run->add_option("--redis", args->redis, "With --distributed: redis://host:port");
    run->add_option("--store", args->store, "With --distributed: file:///dir or s3://bucket/prefix");
    run->add_option("--rollout-workers", args->rollout_workers,
                    "With --distributed: rollout worker processes");
    run->callback([args] {
        if (args->distributed) {
            MOERL_CHECK(!args->redis.empty(), "run --distributed: --redis redis://host:port is required");
            std::vector<std::string> argv = {"moerl",
                                             "cluster",
                                             args->config,
                                             "--redis",
                                             args->redis,
                                             "--rollout-workers",
                                             std::to_string(args->rollout_workers)};
            if (!args->store.empty()) argv.insert(argv.end(), {"--store", args->store});
            if (!args->out.empty()) argv.insert(argv.end(), {"--out", args->out});
            std::vector<char*> cargv;
            for (auto& a : argv) cargv.push_back(a.data());
            cargv.push_back(nullptr);
            execv("/proc/self/exe", cargv.data());
            MOERL_FAIL("run --distributed: cannot start the cluster: ", std::strerror(errno));
        }
        rl::RunConfig cfg = rl::RunConfig::load(args->config);
        rl::RunOptions opt;
        opt.resume = args->resume;
        opt.steps = args->steps;
        opt.output_dir = args->out;
        opt.progress = !args->quiet;
        rl::RunSummary s = rl::run_local(cfg, opt);
        std::printf("run %s: %lld steps, final mean reward %.3f (first steps %.3f), %.1f s\n",
                    cfg.name.c_str(), static_cast<long long>(s.steps_done), s.final_reward, s.first_reward,
                    s.wall_seconds);
        std::printf("metrics: %s\nreward curve: %s\n", s.metrics_path.c_str(), s.svg_path.c_str());
    });
}

}  // namespace moerl::cli
