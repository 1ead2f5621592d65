// `moerl run CONFIG.yaml` (local mode: every role in this process) and `moerl bench rollout`.
#include <ATen/Parallel.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>

#include "commands.hpp"
#include "moerl/core/error.hpp"
#include "moerl/rl/config.hpp"
#include "moerl/rl/roles.hpp"

namespace moerl::cli {

void register_run_commands(CLI::App& app, CLI::App& bench) {
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

    struct BenchArgs {
        std::string config;
        int sequences = 512;
        std::vector<int> batches{1, 16, 64, 256};
    };
    auto bargs = std::make_shared<BenchArgs>();
    CLI::App* b =
        bench.add_subcommand("rollout", "Rollout engine generation throughput (CPU, random weights)");
    b->add_option("--config", bargs->config,
                  "Run configuration for the model and task (default: built-in tiny model)");
    b->add_option("--sequences", bargs->sequences, "Sequences generated per row");
    b->add_option("--batch", bargs->batches, "max_batch values to measure");
    b->callback([bargs] {
        rl::RunConfig cfg = bargs->config.empty() ? rl::RunConfig::from_yaml_text("{}", "defaults")
                                                  : rl::RunConfig::load(bargs->config);
        std::printf("%10s %10s %10s %10s %12s\n", "max_batch", "sequences", "tokens", "seconds", "tokens/s");
        for (int mb : bargs->batches) {
            rl::RolloutBench r = rl::bench_rollout(cfg, bargs->sequences, mb);
            std::printf("%10d %10lld %10lld %10.3f %12.0f\n", r.max_batch,
                        static_cast<long long>(r.sequences), static_cast<long long>(r.tokens), r.seconds,
                        r.tokens / std::max(1e-9, r.seconds));
        }
        std::printf("(threads: %d; model hidden %d, %d layers, %d experts top-%d)\n", at::get_num_threads(),
                    cfg.model.hidden_size, cfg.model.num_hidden_layers, cfg.model.num_experts,
                    cfg.model.num_experts_per_tok);
    });
}

}  // namespace moerl::cli
