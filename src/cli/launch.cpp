#include "launch.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "moerl/core/env.hpp"
#include "moerl/core/error.hpp"
#include "moerl/ep/c10d_store.hpp"

namespace moerl::cli {

namespace {

volatile sig_atomic_t g_forward_signal = 0;
void on_signal(int sig) { g_forward_signal = sig; }

}  // namespace

RankEnv rank_env_from_environment() {
    RankEnv e;
    e.rank = static_cast<int>(env::get_int("RANK", 0));
    e.world_size = static_cast<int>(env::get_int("WORLD_SIZE", 1));
    e.local_rank = static_cast<int>(env::get_int("LOCAL_RANK", e.rank));
    e.local_world_size = static_cast<int>(env::get_int("LOCAL_WORLD_SIZE", e.world_size));
    e.master_addr = env::get_string("MASTER_ADDR", "127.0.0.1");
    e.master_port = static_cast<int>(env::get_int("MASTER_PORT", 29500));
    MOERL_CHECK(e.world_size >= 1 && e.rank >= 0 && e.rank < e.world_size, "RANK=", e.rank,
                " WORLD_SIZE=", e.world_size, ": expected 0 <= RANK < WORLD_SIZE");
    return e;
}

std::unique_ptr<ep::Store> make_tcp_store(const RankEnv& env, double timeout_s) {
    return std::make_unique<ep::C10dStore>(connect_rank_store(env, timeout_s));
}

std::string self_executable() {
    std::error_code ec;
    const auto path = std::filesystem::read_symlink("/proc/self/exe", ec);
    MOERL_CHECK(!ec, "cannot find this program's path (/proc/self/exe): ", ec.message());
    return path.string();
}

c10::intrusive_ptr<c10d::Store> connect_rank_store(const RankEnv& env, double timeout_s) {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(env.master_port);
    const bool agent = env::get_string("TORCHELASTIC_USE_AGENT_STORE", "") == "True";
    o.isServer = !agent && env.rank == 0;
    o.numWorkers = env.world_size;
    o.waitWorkers = false;
    o.timeout = std::chrono::milliseconds(static_cast<long>(timeout_s * 1000));
    try {
        return c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
    } catch (const std::exception& e) {
        MOERL_FAIL("cannot reach the rendezvous store at ", env.master_addr, ":", env.master_port, ": ",
                   e.what());
    }
}

std::shared_ptr<void> host_tcp_store(int& port, int world_size) {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(port);
    o.isServer = true;
    o.numWorkers = world_size;
    o.waitWorkers = false;
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
    port = store->getPort();
    auto holder = std::make_shared<c10::intrusive_ptr<c10d::TCPStore>>(std::move(store));
    return std::static_pointer_cast<void>(holder);
}

c10::intrusive_ptr<c10d::TCPStore> connect_local_store(int port, int world_size,
                                                       std::chrono::seconds timeout) {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(port);
    o.isServer = false;
    o.numWorkers = world_size;
    o.timeout = timeout;
    return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

std::vector<nlohmann::json> run_forked_ranks(int world_size,
                                             const std::function<nlohmann::json(int rank, int port)>& fn) {
    int port = 0;
    auto server = host_tcp_store(port, world_size);
    const std::string dir = (std::filesystem::temp_directory_path() /
                             ("moerl-ranks-" + std::to_string(getpid()) + "-" + std::to_string(port)))
                                .string();
    std::filesystem::create_directories(dir);
    std::vector<pid_t> pids;
    for (int r = 0; r < world_size; ++r) {
        const pid_t pid = fork();
        MOERL_CHECK(pid >= 0, "fork failed: ", std::strerror(errno));
        if (pid == 0) {
            nlohmann::json j;
            int code = 0;
            try {
                j = fn(r, port);
            } catch (const std::exception& e) {
                j = {{"error", e.what()}};
                code = 1;
            }
            std::ofstream(dir + "/" + std::to_string(r)) << j.dump();
            _exit(code);
        }
        pids.push_back(pid);
    }
    for (pid_t p : pids) waitpid(p, nullptr, 0);
    std::vector<nlohmann::json> results;
    for (int r = 0; r < world_size; ++r) {
        const std::string file = dir + "/" + std::to_string(r);
        std::stringstream ss;
        ss << std::ifstream(file).rdbuf();
        results.push_back(ss.str().empty() ? nlohmann::json{{"error", "rank crashed"}}
                                           : nlohmann::json::parse(ss.str()));
        std::remove(file.c_str());
    }
    ::rmdir(
        dir.c_str());  // one file per rank, then the folder (some LibTorch builds export a broken remove_all)
    return results;
}

int launch_local(int num_ranks, const std::vector<std::string>& argv, int master_port, double grace_s) {
    MOERL_CHECK(num_ranks >= 1, "launch: -n ", num_ranks, ", expected >= 1");
    MOERL_CHECK(!argv.empty(), "launch: no command given (usage: moerl launch -n N -- command args...)");
    int port = master_port;
    auto server = host_tcp_store(port, num_ranks);
    std::vector<pid_t> pids;
    for (int r = 0; r < num_ranks; ++r) {
        pid_t pid = fork();
        MOERL_CHECK(pid >= 0, "launch: fork failed: ", std::strerror(errno));
        if (pid == 0) {
            setenv("RANK", std::to_string(r).c_str(), 1);
            setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
            setenv("WORLD_SIZE", std::to_string(num_ranks).c_str(), 1);
            setenv("LOCAL_WORLD_SIZE", std::to_string(num_ranks).c_str(), 1);
            setenv("GROUP_RANK", "0", 1);
            setenv("MASTER_ADDR", "127.0.0.1", 1);
            setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
            setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
            std::vector<char*> args;
            for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
            args.push_back(nullptr);
            execvp(args[0], args.data());
            std::cerr << "moerl launch: cannot run '" << argv[0] << "': " << std::strerror(errno) << "\n";
            _exit(127);
        }
        pids.push_back(pid);
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    int result = 0;
    int alive = num_ranks;
    bool stopping = false;
    auto stop_deadline = std::chrono::steady_clock::time_point::max();
    auto stop_all = [&](int sig) {
        for (pid_t p : pids)
            if (p > 0) kill(p, sig);
    };
    // The first failure (or a signal to the launcher) decides the exit status; SIGKILL follows
    // after the grace period.
    auto begin_stop = [&](int sig, int status) {
        stopping = true;
        result = status;
        stop_all(sig);
        stop_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(long(grace_s * 1000));
    };
    while (alive > 0) {
        if (g_forward_signal != 0 && !stopping) begin_stop(g_forward_signal, 128 + g_forward_signal);
        int status = 0;
        pid_t done = waitpid(-1, &status, WNOHANG);
        if (done > 0) {
            for (int r = 0; r < num_ranks; ++r) {
                if (pids[r] != done) continue;
                pids[r] = -1;
                --alive;
                int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                if (code != 0 && !stopping) {
                    std::cerr << "moerl launch: rank " << r << " exited with status " << code
                              << "; stopping the other ranks\n";
                    begin_stop(SIGTERM, code);
                }
            }
            continue;
        }
        if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
            stop_all(SIGKILL);
            stop_deadline = std::chrono::steady_clock::time_point::max();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return result;
}

}  // namespace moerl::cli
