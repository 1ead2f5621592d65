#include "worker_control.hpp"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <thread>

namespace moerl::cli {

namespace {
std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};

extern "C" void on_stop_signal(int sig) {
    int none = 0;
    if (!g_signal.compare_exchange_strong(none, sig)) ::_exit(128 + sig);  // the second one: now
    g_stop.store(true);
}
}  // namespace

const std::atomic<bool>& stop_flag() { return g_stop; }

void install_stop_handlers() {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaction(sig, &sa, nullptr);
}

int stop_signal() { return g_signal.load(); }

std::string stop_signal_name() {
    switch (g_signal.load()) {
        case SIGTERM:
            return "SIGTERM";
        case SIGINT:
            return "SIGINT";
        case SIGHUP:
            return "SIGHUP";
        default:
            return "signal " + std::to_string(g_signal.load());
    }
}

int stopped_exit_code() { return 128 + (g_signal.load() != 0 ? g_signal.load() : SIGTERM); }

std::string seconds_text(double seconds) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", seconds);
    return buf;
}

void start_grace_watchdog(const std::string& who, double grace_s) {
    std::thread([who, grace_s] {
        while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        std::this_thread::sleep_for(std::chrono::duration<double>(grace_s));
        log_line(who, "grace period of " + seconds_text(grace_s) + " s over; exiting now");
        ::_exit(kExitGraceOver);
    }).detach();
}

void log_line(const std::string& who, const std::string& text) {
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    ::gmtime_r(&now, &utc);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &utc);
    std::fprintf(stderr, "%s [%s] %s\n", stamp, who.c_str(), text.c_str());
    std::fflush(stderr);
}

}  // namespace moerl::cli
