#include "moerl/core/log.hpp"

#include <cstdio>
#include <mutex>
#include <utility>

namespace moerl {
namespace {

std::mutex& sink_mutex() {
    static std::mutex m;
    return m;
}

LogSink& sink() {
    static LogSink s;
    return s;
}

}  // namespace

LogSink set_log_sink(LogSink s) {
    std::lock_guard lock(sink_mutex());
    return std::exchange(sink(), std::move(s));
}

void log_line(const std::string& text) {
    std::lock_guard lock(sink_mutex());
    if (sink()) {
        sink()(text);
        return;
    }
    std::fprintf(stderr, "moerl: %s\n", text.c_str());
    std::fflush(stderr);
}

}  // namespace moerl
