// moerl: one binary, subcommands per layer.
#include <cstdlib>
#include <iostream>

#include "commands.hpp"
#include "moerl/core/error.hpp"

int main(int argc, char** argv) {
    CLI::App app{"moerl: reinforcement-learning post-training of Mixture-of-Experts models"};
    app.require_subcommand(1);
    app.set_version_flag("--version", "moerl 0.1.0");
    CLI::App* bench = app.add_subcommand("bench", "Benchmarks; each prints a table");
    bench->require_subcommand(1);
    moerl::cli::register_launch_command(app);
    moerl::cli::register_bench_ep(*bench);
    moerl::cli::register_ep_commands(app);
#ifdef MOERL_HAVE_CMD_MODEL
    moerl::cli::register_model_commands(app, *bench);
#endif
#ifdef MOERL_HAVE_CMD_BENCH_ROLLOUT
    moerl::cli::register_bench_rollout(*bench);
#endif
#ifdef MOERL_HAVE_CMD_RUN
    moerl::cli::register_run_commands(app);
#endif
#ifdef MOERL_HAVE_CMD_BENCH_RL
    moerl::cli::register_bench_rl(*bench);
#endif
#ifdef MOERL_HAVE_CMD_TOKENIZE
    moerl::cli::register_tokenize_commands(app, *bench);
#endif
#ifdef MOERL_HAVE_CMD_WORKER
    moerl::cli::register_worker_commands(app);
#endif
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    } catch (const moerl::Error& e) {
        std::cerr << "moerl: error: " << e.message() << "\n";
        return 1;
    } catch (const std::exception& e) {
        std::cerr << "moerl: error: " << e.what() << "\n";
        return 1;
    }
    return 0;
}
