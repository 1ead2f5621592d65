// Test harness: runs one function per rank in forked processes and collects how each ended.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace moerl::test {

struct RankResult {
    int exit_code = -1;   // 0 = the function returned; 1 = it threw; other = crashed or killed
    std::string message;  // what() of the exception, if any
};

inline std::string unique_dir(const std::string& tag) {
    std::random_device rd;
    auto dir = std::filesystem::temp_directory_path() /
               ("moerl-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(dir);
    return dir.string();
}

// Removes the shared-memory regions named after a process that has ended: libfabric's shm provider's
// ("<pid>:...") and the host transport's ("moerl-ep-<pid>-..."). A rank that was killed, or left
// without closing its transport, leaves them behind in memory, and a later process given the same id
// would find the provider's region name taken.
inline void remove_shm_regions_of(pid_t pid) {
    std::error_code ec;
    const std::string fabric = std::to_string(pid) + ":", host = "moerl-ep-" + std::to_string(pid) + "-";
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind(fabric, 0) == 0 || name.rfind(host, 0) == 0) std::filesystem::remove(entry.path(), ec);
    }
}

// Runs fn(rank) in `world` child processes; kills them all after `limit`.
inline std::vector<RankResult> run_ranks(int world, const std::function<void(int)>& fn,
                                         std::chrono::seconds limit = std::chrono::seconds(120)) {
    const std::string dir = unique_dir("ranks");
    std::vector<pid_t> pids(world);
    for (int r = 0; r < world; ++r) {
        pid_t pid = fork();
        if (pid == 0) {
            int code = 0;
            try {
                fn(r);
            } catch (const std::exception& e) {
                std::ofstream(dir + "/" + std::to_string(r)) << e.what();
                code = 1;
            } catch (...) {
                std::ofstream(dir + "/" + std::to_string(r)) << "unknown exception";
                code = 1;
            }
            _exit(code);
        }
        pids[r] = pid;
    }
    std::vector<RankResult> out(world);
    const auto deadline = std::chrono::steady_clock::now() + limit;
    int remaining = world;
    while (remaining > 0) {
        for (int r = 0; r < world; ++r) {
            if (pids[r] == 0) continue;
            int status = 0;
            pid_t done = waitpid(pids[r], &status, WNOHANG);
            if (done == pids[r]) {
                out[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                remove_shm_regions_of(pids[r]);
                pids[r] = 0;
                --remaining;
            }
        }
        if (remaining > 0 && std::chrono::steady_clock::now() > deadline) {
            for (int r = 0; r < world; ++r)
                if (pids[r] != 0) kill(pids[r], SIGKILL);
        }
        if (remaining > 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    for (int r = 0; r < world; ++r) {
        std::ifstream f(dir + "/" + std::to_string(r));
        std::stringstream ss;
        ss << f.rdbuf();
        out[r].message = ss.str();
    }
    std::filesystem::remove_all(dir);
    return out;
}

}  // namespace moerl::test
