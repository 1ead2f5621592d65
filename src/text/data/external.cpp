// The external verifier: a child process (posix_spawn, its own process group) fed JSON lines through
// non-blocking pipes under poll() with a deadline, restarted when it crashes or hangs.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>

#include "moerl/core/error.hpp"
#include "moerl/text/verifier_external.hpp"

extern char** environ;

namespace moerl::text {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kStderrTail = 2000;  // bytes of the program's stderr quoted in errors

std::string json_line(const nlohmann::json& j) {
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

// write() that reports EPIPE instead of raising SIGPIPE, without touching the process's handlers.
ssize_t write_without_sigpipe(int fd, const char* data, size_t size) {
    sigset_t pipe_set, old, pending;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    sigpending(&pending);
    const bool was_pending = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
    const ssize_t n = ::write(fd, data, size);
    const int err = errno;
    if (n < 0 && err == EPIPE && !was_pending) {
        const timespec zero{0, 0};
        sigtimedwait(&pipe_set, nullptr, &zero);  // consume the SIGPIPE this write raised
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    errno = err;
    return n;
}

void close_fd(int& fd) {
    if (fd >= 0) ::close(fd);
    fd = -1;
}

std::string format_seconds(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", s);
    return buf;
}

std::string describe_status(int status) {
    if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
    if (WIFSIGNALED(status))
        return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
               strsignal(WTERMSIG(status)) + ")";
    return "stopped (status " + std::to_string(status) + ")";
}

}  // namespace

struct ExternalVerifier::Impl {
    ExternalOptions options;
    std::string command_text;  // the command as the user wrote it, for messages
    pid_t pid = -1;
    int to_child = -1, from_child = -1, child_err = -1;
    std::string out_buf;
    std::string err_tail;
    uint64_t next_id = 0;
    int restarts_in_a_row = 0;
    bool answered_since_start = false;  // the startup allowance is spent
    Stats stats;

    struct Item {
        size_t slot;
        std::string line;
        int failures = 0;
    };

    explicit Impl(const ExternalOptions& o) : options(o) {
        options.validate();
        for (const auto& a : options.command) command_text += (command_text.empty() ? "" : " ") + a;
        start();
    }

    ~Impl() {
        if (pid < 0) return;
        close_fd(to_child);  // end of input: a well-behaved program exits now
        const auto deadline = Clock::now() + std::chrono::seconds(2);
        int status = 0;
        while (::waitpid(pid, &status, WNOHANG) == 0) {
            if (Clock::now() >= deadline) {
                kill_child();
                break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        close_fd(from_child);
        close_fd(child_err);
    }

    std::string who() const { return "external verifier '" + command_text + "'"; }

    std::string stderr_note() const {
        return err_tail.empty() ? std::string(" (no stderr)") : "; the end of its stderr:\n" + err_tail;
    }

    void start() {
        int in[2], out[2], err[2];
        MOERL_CHECK(::pipe2(in, O_CLOEXEC) == 0, who(), ": pipe: ", std::strerror(errno));
        if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
            const int e = errno;
            ::close(in[0]), ::close(in[1]);
            MOERL_FAIL(who(), ": pipe: ", std::strerror(e));
        }
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_adddup2(&fa, in[0], 0);
        posix_spawn_file_actions_adddup2(&fa, out[1], 1);
        posix_spawn_file_actions_adddup2(&fa, err[1], 2);
        if (!options.working_dir.empty())
            posix_spawn_file_actions_addchdir_np(&fa, options.working_dir.c_str());
        posix_spawnattr_t attr;
        posix_spawnattr_init(&attr);
        // Its own process group, so that a kill reaches what a shell started; default signal handling
        // and an empty mask whatever this process has set.
        posix_spawnattr_setflags(&attr,
                                 POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
        posix_spawnattr_setpgroup(&attr, 0);
        sigset_t none, defaults;
        sigemptyset(&none);
        posix_spawnattr_setsigmask(&attr, &none);
        sigemptyset(&defaults);
        for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD}) sigaddset(&defaults, sig);
        posix_spawnattr_setsigdefault(&attr, &defaults);

        std::vector<std::string> args = options.command;
        if (args.size() == 1 && args[0].find_first_of(" \t") != std::string::npos)
            args = {"/bin/sh", "-c", args[0]};
        std::vector<char*> argv;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        const int rc = posix_spawnp(&pid, argv[0], &fa, &attr, argv.data(), environ);
        posix_spawn_file_actions_destroy(&fa);
        posix_spawnattr_destroy(&attr);
        ::close(in[0]), ::close(out[1]), ::close(err[1]);
        if (rc != 0) {
            pid = -1;
            ::close(in[1]), ::close(out[0]), ::close(err[0]);
            MOERL_FAIL(who(), ": cannot start it: ", std::strerror(rc));
        }
        to_child = in[1], from_child = out[0], child_err = err[0];
        for (int fd : {to_child, from_child, child_err})
            ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
        out_buf.clear();
        err_tail.clear();
        answered_since_start = false;
    }

    // Kills the process group and reaps the child; its wait status.
    int kill_child() {
        int status = 0;
        if (pid > 0) {
            ::kill(-pid, SIGKILL);
            ::kill(pid, SIGKILL);
            while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
            }
        }
        pid = -1;
        return status;
    }

    void stop() {
        kill_child();
        close_fd(to_child);
        close_fd(from_child);
        close_fd(child_err);
    }

    // The child closed its stdout: wait briefly for its exit status, else kill it.
    std::string reap_after_eof() {
        const auto deadline = Clock::now() + std::chrono::seconds(1);
        int status = 0;
        for (;;) {
            const pid_t r = ::waitpid(pid, &status, WNOHANG);
            if (r == pid) {
                pid = -1;
                return describe_status(status);
            }
            if (Clock::now() >= deadline) {
                kill_child();
                return "closed its stdout (killed)";
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
    }

    void drain_stderr() {
        char buf[4096];
        for (;;) {
            const ssize_t n = ::read(child_err, buf, sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                if (n == 0) close_fd(child_err);
                return;
            }
            (void)!::write(STDERR_FILENO, buf, static_cast<size_t>(n));
            err_tail.append(buf, static_cast<size_t>(n));
            if (err_tail.size() > kStderrTail) err_tail.erase(0, err_tail.size() - kStderrTail);
        }
    }

    [[noreturn]] void protocol_error(const std::string& what, const std::string& line) {
        stop();
        MOERL_FAIL(who(), ": ", what, " in the answer line '", line.substr(0, 200),
                   "' (expected {\"id\": N, \"reward\": R} with R in [0, 1]; diagnostics belong on stderr)");
    }

    void take_answer(const std::string& line, std::map<uint64_t, Item>& pending,
                     std::vector<std::optional<Verdict>>& results) {
        nlohmann::json j;
        try {
            j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception&) {
            protocol_error("not JSON", line);
        }
        if (!j.is_object() || !j.contains("id") || !j["id"].is_number_unsigned())
            protocol_error("no integer id", line);
        const uint64_t id = j["id"].get<uint64_t>();
        auto it = pending.find(id);
        if (it == pending.end())
            protocol_error(id < next_id
                               ? "an answer for item " + std::to_string(id) + " that was already answered"
                               : "an answer for item " + std::to_string(id) + " that was never sent",
                           line);
        const auto reward = j.find("reward");
        if (reward == j.end() || !reward->is_number() || !std::isfinite(reward->get<double>()) ||
            reward->get<double>() < 0 || reward->get<double>() > 1)
            protocol_error("no reward in [0, 1] for item " + std::to_string(id), line);
        Verdict v;
        v.reward = reward->get<double>();
        v.details = j.contains("details") ? j["details"] : nlohmann::json::object();
        results[it->second.slot] = std::move(v);
        pending.erase(it);
        ++stats.items;
        restarts_in_a_row = 0;
        answered_since_start = true;
    }

    // Reads what the child wrote; returns false at end of file.
    bool drain_stdout(std::map<uint64_t, Item>& pending, std::vector<std::optional<Verdict>>& results) {
        char buf[65536];
        for (;;) {
            const ssize_t n = ::read(from_child, buf, sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) return true;  // EAGAIN: nothing more for now
            if (n == 0) return false;
            out_buf.append(buf, static_cast<size_t>(n));
            size_t begin = 0;
            for (size_t nl = out_buf.find('\n'); nl != std::string::npos; nl = out_buf.find('\n', begin)) {
                std::string line = out_buf.substr(begin, nl - begin);
                begin = nl + 1;
                if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
                take_answer(line, pending, results);
            }
            out_buf.erase(0, begin);
        }
    }

    std::vector<Verdict> run(const std::vector<Scoring>& batch) {
        std::map<uint64_t, Item> pending;  // by id, so the oldest unanswered item comes first
        std::vector<std::optional<Verdict>> results(batch.size());
        std::map<uint64_t, std::string> where;
        for (size_t i = 0; i < batch.size(); ++i) {
            MOERL_CHECK(batch[i].example != nullptr, who(), ": a batch item has no example");
            const uint64_t id = next_id++;
            pending[id] = {i, json_line({{"id", id},
                                         {"response", std::string(batch[i].response)},
                                         {"example", batch[i].example->fields}})};
            where[id] = batch[i].example->where;
        }
        if (pid < 0) start();
        std::string out;
        size_t out_off = 0;
        auto refill = [&] {
            out.clear();
            out_off = 0;
            for (const auto& [id, item] : pending) out += item.line;
        };
        refill();
        auto seconds = [](double s) {
            return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
        };
        auto last_progress = Clock::now();
        while (!pending.empty()) {
            std::string failure;
            const double allowed =
                options.timeout_s + (answered_since_start ? 0.0 : options.startup_timeout_s);
            const auto deadline = last_progress + seconds(allowed);
            const auto left =
                std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() + 1;
            pollfd fds[3];
            int nfds = 0;
            fds[nfds++] = {from_child, POLLIN, 0};
            if (child_err >= 0) fds[nfds++] = {child_err, POLLIN, 0};
            const bool writing = to_child >= 0 && out_off < out.size();
            if (writing) fds[nfds++] = {to_child, POLLOUT, 0};
            const int rc =
                ::poll(fds, static_cast<nfds_t>(nfds), static_cast<int>(std::max<int64_t>(0, left)));
            if (rc < 0 && errno != EINTR) MOERL_FAIL(who(), ": poll: ", std::strerror(errno));
            const size_t before = pending.size();
            if (rc > 0) {
                if (writing) {
                    const ssize_t n =
                        write_without_sigpipe(to_child, out.data() + out_off, out.size() - out_off);
                    if (n > 0) out_off += static_cast<size_t>(n);
                    if (n < 0 && errno == EPIPE)
                        close_fd(to_child);  // it stopped reading; its stdout tells why
                }
                if (child_err >= 0) drain_stderr();
                if (!drain_stdout(pending, results)) {
                    if (child_err >= 0) drain_stderr();
                    failure = reap_after_eof();
                }
            }
            if (pending.size() < before) last_progress = Clock::now();
            if (failure.empty() && !pending.empty() && Clock::now() >= deadline && pending.size() == before) {
                kill_child();
                failure = "gave no answer within " + format_seconds(options.timeout_s) + " s" +
                          (answered_since_start ? ""
                                                : " (+ " + format_seconds(options.startup_timeout_s) +
                                                      " s startup_timeout_s)") +
                          " (killed)";
            }
            if (failure.empty() || pending.empty()) continue;
            // The program is gone: blame the oldest unanswered item, then start again and resend.
            auto& [oldest_id, oldest] = *pending.begin();
            ++oldest.failures;
            const std::string note = stderr_note();
            stop();
            MOERL_CHECK(oldest.failures < 2, who(), " ", failure, " on item ", oldest_id, " (",
                        where[oldest_id], ") a second time; giving up on it", note);
            MOERL_CHECK(restarts_in_a_row < options.max_restarts, who(), " ", failure, " on item ", oldest_id,
                        " (", where[oldest_id], "), after ", restarts_in_a_row,
                        " restarts in a row without an answer (external.max_restarts)", note);
            ++restarts_in_a_row;
            ++stats.restarts;
            stats.retries += pending.size();
            start();
            refill();
            last_progress = Clock::now();
        }
        std::vector<Verdict> verdicts;
        verdicts.reserve(results.size());
        for (auto& r : results) verdicts.push_back(std::move(*r));
        return verdicts;
    }
};

ExternalVerifier::ExternalVerifier(const ExternalOptions& options) : impl_(std::make_unique<Impl>(options)) {}

ExternalVerifier::~ExternalVerifier() = default;

Verdict ExternalVerifier::score(std::string_view response, const Example& example) {
    return score_batch({{response, &example}})[0];
}

std::vector<Verdict> ExternalVerifier::score_batch(const std::vector<Scoring>& batch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (batch.empty()) return {};
    return impl_->run(batch);
}

ExternalVerifier::Stats ExternalVerifier::stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return impl_->stats;
}

}  // namespace moerl::text
