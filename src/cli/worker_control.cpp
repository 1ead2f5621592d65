#include "worker_control.hpp"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>

namespace moerl::cli {

namespace {
std::atomic<bool> g_stop{false};

extern "C" void on_stop_signal(int) { g_stop.store(true); }
}  // namespace

const std::atomic<bool>& stop_flag() { return g_stop; }

void install_stop_handlers() {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaction(sig, &sa, nullptr);
}

void start_grace_watchdog(const std::string& who, double grace_s) {
    std::thread([who, grace_s] {
        while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        std::this_thread::sleep_for(std::chrono::duration<double>(grace_s));
        char text[96];
        std::snprintf(text, sizeof text, "grace period of %g s over; exiting now", grace_s);
        log_line(who, text);
        ::_exit(3);
    }).detach();
}

void log_line(const std::string& who, const std::string& text) {
    std::fprintf(stderr, "[%s] %s\n", who.c_str(), text.c_str());
    std::fflush(stderr);
}

}  // namespace moerl::cli
