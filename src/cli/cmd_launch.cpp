#include "commands.hpp"
#include "launch.hpp"

namespace moerl::cli {

void register_launch_command(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "launch", "Start N local ranks with torchrun's environment (like torchrun --standalone)");
    struct Opts {
        int num_ranks = 1;
        int master_port = 0;
        double grace_s = 10.0;
        std::vector<std::string> argv;
    };
    auto opts = std::make_shared<Opts>();
    cmd->add_option("-n,--nproc", opts->num_ranks, "number of local ranks")->check(CLI::Range(1, 1024));
    cmd->add_option("--master-port", opts->master_port, "rendezvous port (0 = a free one)");
    cmd->add_option("--grace", opts->grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks");
    cmd->add_option("command", opts->argv, "the command every rank runs (after --)")->required();
    cmd->callback([opts] {
        int code = launch_local(opts->num_ranks, opts->argv, opts->master_port, opts->grace_s);
        if (code != 0) std::exit(code);
    });
}

}  // namespace moerl::cli
