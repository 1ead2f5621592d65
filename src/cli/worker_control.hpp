// Process control of `moerl run`, `moerl worker` and `moerl cluster`: the termination notice and
// its grace period, exit statuses, and the timestamped, role-prefixed log lines.
//
// Preemption: SIGTERM (a spot termination notice), SIGINT or SIGHUP sets stop_flag(); a rollout
// worker stops taking tasks and releases its leases with their partial trajectories, the trainer
// stops before its next step. A process that has not exited `grace_s` seconds after the notice
// exits anyway (its leases then expire after the lease timeout, like those of a SIGKILLed worker).
// A second signal ends the process at once.
#pragma once

#include <atomic>
#include <string>

namespace moerl::cli {

// Exit statuses (also in `moerl --help`).
constexpr int kExitError = 1;      // an error, said on stderr
constexpr int kExitUsage = 2;      // a bad command line
constexpr int kExitGraceOver = 3;  // did not stop within the grace period after a notice
constexpr const char* kExitStatusHelp =
    "Exit status: 0 the run finished (run.steps or run.stop_at_reward) or the command succeeded; "
    "1 error; 2 bad command line; 3 a worker did not stop within its grace period; "
    "128+N stopped by signal N before the end (130 SIGINT, 143 SIGTERM, 129 SIGHUP): "
    "`moerl run ... --resume` continues from the newest checkpoint.";

// Set by the first SIGTERM, SIGINT or SIGHUP once install_stop_handlers() ran.
const std::atomic<bool>& stop_flag();
void install_stop_handlers();
// The signal that set stop_flag() (0: none), and its name ("SIGTERM").
int stop_signal();
std::string stop_signal_name();
// 128 + stop_signal(): the exit status of a run stopped by it.
int stopped_exit_code();
// After the notice, exits the process with status 3 once `grace_s` seconds have passed.
void start_grace_watchdog(const std::string& who, double grace_s);
// "2026-12-02T01:02:03Z [who] text" on stderr.
void log_line(const std::string& who, const std::string& text);
// `seconds` as the shortest decimal ("20", "0.5"), for messages and re-executed command lines.
std::string seconds_text(double seconds);

}  // namespace moerl::cli
