// The supervisor behind `moerl cluster`: starts worker processes (this binary, re-executed),
// restarts those that fail, and stops them all when the trainer exits or a stop is asked for.
// Children die with the supervisor: each asks the kernel for SIGTERM when its parent dies
// (PR_SET_PDEATHSIG). They share one process group of their own, so a terminal's SIGINT or
// SIGHUP reaches only the supervisor, which stops them in order (SIGTERM, grace, SIGKILL).
#pragma once

#include <atomic>
#include <string>
#include <vector>

namespace moerl::cli {

struct ChildSpec {
    std::string role;               // "train" ends the cluster when it exits with 0
    std::vector<std::string> argv;  // argv[0] is only a name: /proc/self/exe runs
};

struct SuperviseOptions {
    int max_restarts = 5;  // failed exits (the trainer's too) restarted in total, then give up
    double grace_s = 20;   // after SIGTERM, how long the children have before SIGKILL
};

// Runs the children until the trainer exits with 0 or `stop` becomes true; returns 0 then (-1
// when stopped before). A child that fails (the trainer too) is started again. Throws moerl::Error when the
// restart budget is spent.
int supervise(const std::vector<ChildSpec>& children, const SuperviseOptions& options,
              const std::atomic<bool>& stop);

}  // namespace moerl::cli
