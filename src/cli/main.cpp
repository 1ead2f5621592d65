// moerl: one binary, subcommands per layer.
#include <cstdlib>
#include <iostream>

#include "commands.hpp"
#include "moerl/core/error.hpp"
#include "worker_control.hpp"

int main(int argc, char** argv) {
    CLI::App app{"moerl: reinforcement-learning post-training of Mixture-of-Experts models"};
    app.require_subcommand(1);
    app.set_version_flag("--version", "moerl 0.1.0");
    app.footer(moerl::cli::kExitStatusHelp);
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
    } catch (const CLI::RuntimeError& e) {  // a command's own exit status; it said why already
        return e.get_exit_code();
    } catch (const CLI::ParseError& e) {
        const bool unknown_command = app.get_subcommands().empty() && argc > 1 && argv[1][0] != '-';
        if (unknown_command) {
            std::cerr << "moerl: unknown command '" << argv[1] << "'\n";
        } else if (app.exit(e) == 0) {
            return 0;  // --help, --version
        }
        if (app.get_subcommands().empty()) {
            std::string names;
            for (const CLI::App* sub : app.get_subcommands({}))
                names += (names.empty() ? "" : ", ") + sub->get_name();
            std::cerr << "moerl commands: " << names << " (moerl COMMAND --help for each)\n";
        }
        return moerl::cli::kExitUsage;
    } catch (const moerl::Error& e) {
        std::cerr << "moerl: error: " << e.message() << "\n";
        return moerl::cli::kExitError;
    } catch (const std::exception& e) {
        std::cerr << "moerl: error: " << e.what() << "\n";
        return moerl::cli::kExitError;
    }
    return 0;
}
