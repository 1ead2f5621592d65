// Starts the ranks of a role's test program as processes with torchrun's environment (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT) around a TCPStore hosted by the test; and, in the rank
// program, this process's place among them.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "moerl/rl/role_processes.hpp"

extern char** environ;

namespace moerl::rl::test {
namespace fs = std::filesystem;

struct Ranks {
    std::vector<int> codes;  // exit status of each rank
    std::string log;         // their stderr
};

// Whether this process may give a child its own mount namespace with a tmpfs in it (root).
inline bool can_unshare() {
    const fs::path probe = fs::temp_directory_path() / ("moerl-unshare-" + std::to_string(::getpid()));
    fs::create_directories(probe);
    const std::string cmd =
        "/usr/bin/unshare --mount --propagation private -- /bin/sh -c 'mount -t tmpfs tmpfs \"$0\"' " +
        probe.string() + " >/dev/null 2>&1";
    const bool ok = std::system(cmd.c_str()) == 0;
    fs::remove(probe);
    return ok;
}

// Runs W ranks of `program ARGS...` with torchrun's environment around a TCPStore hosted here,
// each rank's stderr in out/rankR.log; kills them after 300 s. With `private_out`, ranks 1.. see
// an empty filesystem of their own at `out` (a tmpfs in a mount namespace), as ranks on other
// machines would.
inline Ranks run_ranks(const std::string& program, int W, const fs::path& out,
                       const std::vector<std::string>& args_in,
                       const std::vector<std::string>& extra_env = {}, bool private_out = false) {
    c10d::TCPStoreOptions o;
    o.port = 0;
    o.isServer = true;
    o.numWorkers = W;
    o.waitWorkers = false;
    auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
    fs::create_directories(out);
    std::vector<pid_t> pids;
    for (int r = 0; r < W; ++r) {
        std::vector<std::string> env;
        for (char** e = environ; *e; ++e) env.emplace_back(*e);
        env.push_back("RANK=" + std::to_string(r));
        env.push_back("WORLD_SIZE=" + std::to_string(W));
        env.push_back("MASTER_PORT=" + std::to_string(server->getPort()));
        env.push_back("MASTER_ADDR=127.0.0.1");
        for (const auto& e : extra_env) env.push_back(e);
        const std::string log = (out / ("rank" + std::to_string(r) + ".log")).string();
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_addopen(&fa, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        std::vector<std::string> args{program};
        args.insert(args.end(), args_in.begin(), args_in.end());
        if (private_out && r > 0)
            args.insert(args.begin(),
                        {"/usr/bin/unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                         "mount -t tmpfs tmpfs \"$0\" && exec \"$@\"", out.string()});
        std::vector<char*> argv, envp;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        for (auto& e : env) envp.push_back(e.data());
        envp.push_back(nullptr);
        pid_t pid = -1;
        EXPECT_EQ(posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data()), 0);
        posix_spawn_file_actions_destroy(&fa);
        pids.push_back(pid);
    }
    Ranks res;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
    for (pid_t pid : pids) {
        int status = 0;
        while (waitpid(pid, &status, WNOHANG) == 0) {
            if (std::chrono::steady_clock::now() > deadline) {
                for (pid_t p : pids) kill(p, SIGKILL);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        res.codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
    }
    for (int r = 0; r < W; ++r) {
        std::stringstream ss;
        ss << std::ifstream(out / ("rank" + std::to_string(r) + ".log")).rdbuf();
        res.log += "rank " + std::to_string(r) + ": " + ss.str();
    }
    return res;
}

// In a rank program: this process among the test's ranks (RANK, WORLD_SIZE, MASTER_PORT), tokens
// over `transport`, calls and sums as MOERL_TEST_COLLECTIVES says (default auto), waits of at most
// timeout_s.
inline RoleProcesses processes_from_environment(const std::string& transport, double timeout_s) {
    RoleProcesses p;
    p.rank = std::atoi(std::getenv("RANK"));
    p.world_size = std::atoi(std::getenv("WORLD_SIZE"));
    p.local_rank = p.rank;
    p.ep_transport = transport;
    p.timeout_s = timeout_s;
    if (const char* collectives = std::getenv("MOERL_TEST_COLLECTIVES")) p.collectives = collectives;
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
    o.isServer = false;
    o.numWorkers = p.world_size;
    o.timeout = std::chrono::seconds(60);
    p.store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
    return p;
}

}  // namespace moerl::rl::test
