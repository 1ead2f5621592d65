#include "moerl/core/process.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

namespace moerl {

bool process_alive(pid_t pid) {
    if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return true;
    // "pid (comm) S ...": the state follows the last parenthesis.
    const size_t paren = line.rfind(')');
    return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'Z';
}

std::string pid_namespace() {
    char buf[64] = {};
    const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

}  // namespace moerl
