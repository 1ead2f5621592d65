// Each layer adds its subcommands to the one `moerl` binary through these functions.
#pragma once

#include <CLI/CLI.hpp>

namespace moerl::cli {

// launch, worker plumbing and `bench ep` (cmd_launch.cpp, cmd_bench_ep.cpp).
void register_launch_command(CLI::App& app);
void register_bench_ep(CLI::App& bench);
// `ep check` (cmd_ep_check.cpp).
void register_ep_commands(CLI::App& app);
// `model init`, `ckpt inspect`, `bench model` (cmd_model.cpp).
void register_model_commands(CLI::App& app, CLI::App& bench);
// `run` (cmd_run.cpp).
void register_run_commands(CLI::App& app);
// `bench rl` (cmd_bench_rl.cpp).
void register_bench_rl(CLI::App& bench);
// `bench rollout` (cmd_bench_rollout.cpp).
void register_bench_rollout(CLI::App& bench);
// `tokenize` and `bench tokenizer` (cmd_tokenize.cpp).
void register_tokenize_commands(CLI::App& app, CLI::App& bench);
// `worker --role ...` (cmd_worker.cpp).
void register_worker_commands(CLI::App& app);

}  // namespace moerl::cli
