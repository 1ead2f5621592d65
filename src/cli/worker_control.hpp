// Process control of `moerl worker` and `moerl cluster`: the termination notice and its grace
// period, and the role-prefixed log lines.
//
// Preemption: SIGTERM (a spot termination notice), SIGINT or SIGHUP sets stop_flag(); a rollout
// worker stops taking tasks and releases its leases with their partial trajectories, the trainer
// stops before its next step. A process that has not exited `grace_s` seconds after the notice
// exits anyway (its leases then expire after the lease timeout, like those of a SIGKILLed worker).
#pragma once

#include <atomic>
#include <string>

namespace moerl::cli {

// Set by the first SIGTERM, SIGINT or SIGHUP once install_stop_handlers() ran.
const std::atomic<bool>& stop_flag();
void install_stop_handlers();
// After the notice, exits the process with status 3 once `grace_s` seconds have passed.
void start_grace_watchdog(const std::string& who, double grace_s);
// "[who] text" on stderr.
void log_line(const std::string& who, const std::string& text);

}  // namespace moerl::cli
