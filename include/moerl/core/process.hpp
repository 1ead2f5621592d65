// Facts about other processes of this machine, for errors that name a peer that is gone.
#pragma once

#include <sys/types.h>

#include <string>

namespace moerl {

// Whether process `pid` of this PID namespace still runs; one that exited and was not reaped yet
// (a zombie) counts as gone.
bool process_alive(pid_t pid);

// This process's PID namespace ("pid:[4026531836]"; empty when /proc does not say): pids of two
// processes compare only within one namespace.
std::string pid_namespace();

}  // namespace moerl
