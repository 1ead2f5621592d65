#include "cluster.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>

#include "moerl/core/error.hpp"
#include "worker_control.hpp"

namespace moerl::cli {

namespace {
using Clock = std::chrono::steady_clock;

// Forks and execs this binary with `argv` in process group `group` (0: a new group led by the
// child). The child gets SIGTERM when the supervisor dies, even by SIGKILL.
pid_t spawn(const std::vector<std::string>& argv, pid_t group) {
    std::vector<char*> cargv;
    for (const auto& s : argv) cargv.push_back(const_cast<char*>(s.c_str()));
    cargv.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    MOERL_CHECK(pid >= 0, "cluster: fork failed: ", std::strerror(errno));
    if (pid == 0) {
        ::setpgid(0, group);
        ::prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (::getppid() != parent) ::_exit(1);  // the supervisor died before prctl took effect
        ::execv("/proc/self/exe", cargv.data());
        std::fprintf(stderr, "cluster: exec /proc/self/exe failed: %s\n", std::strerror(errno));
        ::_exit(127);
    }
    ::setpgid(pid, group == 0 ? pid : group);  // also here: no race with the child's exec
    return pid;
}

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }
}  // namespace

int supervise(const std::vector<ChildSpec>& specs, const SuperviseOptions& opt,
              const std::atomic<bool>& stop) {
    std::map<pid_t, size_t> running;  // pid -> index in specs
    pid_t group = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
        const pid_t pid = spawn(specs[i].argv, group);
        if (group == 0) group = pid;
        running[pid] = i;
    }
    int restarts = 0, trainer_status = -1;
    auto stop_all = [&] {
        // The trainer is done (or we were told to stop): the rest get the grace period.
        for (const auto& [pid, i] : running) ::kill(pid, SIGTERM);
        const auto deadline = Clock::now() + std::chrono::duration<double>(opt.grace_s + 2);
        while (!running.empty() && Clock::now() < deadline) {
            const pid_t pid = ::waitpid(-1, nullptr, WNOHANG);
            if (pid > 0) {
                running.erase(pid);
            } else {
                std::this_thread::sleep_for(std::chrono::milliseconds(50));
            }
        }
        for (const auto& [pid, i] : running) {
            log_line("cluster", specs[i].role + " (pid " + std::to_string(pid) +
                                    ") did not stop within the grace period; killing it");
            ::kill(pid, SIGKILL);
            ::waitpid(pid, nullptr, 0);
        }
        running.clear();
    };
    try {
        while (trainer_status < 0 && !stop.load()) {
            int status = 0;
            const pid_t pid = ::waitpid(-1, &status, WNOHANG);
            if (pid <= 0) {
                std::this_thread::sleep_for(std::chrono::milliseconds(100));
                continue;
            }
            auto it = running.find(pid);
            if (it == running.end()) continue;
            const size_t i = it->second;
            running.erase(it);
            const int code = exit_code(status);
            const bool trainer = specs[i].role == "train";
            if (trainer && code == 0) {  // the run is over
                trainer_status = code;
                break;
            }
            if (code == 0) continue;  // the run is over for it
            if (stop.load()) break;   // stopping anyway
            // A failed trainer is restarted too: it resumes from its newest checkpoint, after the
            // lock of the dead one expired.
            MOERL_CHECK(++restarts <= opt.max_restarts, "cluster: a ", specs[i].role, " process exited with ",
                        code, " (", restarts - 1, " restarts so far, --max-restarts ", opt.max_restarts,
                        "); giving up");
            log_line("cluster", specs[i].role + " (pid " + std::to_string(pid) + ") exited with " +
                                    std::to_string(code) +
                                    (trainer ? "; restarting it (it resumes from its newest checkpoint)"
                                             : "; restarting it") +
                                    ", restart " + std::to_string(restarts) + " of " +
                                    std::to_string(opt.max_restarts));
            running[spawn(specs[i].argv, group)] = i;
        }
    } catch (...) {
        stop_all();
        throw;
    }
    stop_all();
    return trainer_status;
}

}  // namespace moerl::cli
