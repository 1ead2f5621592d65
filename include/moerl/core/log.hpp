// Diagnostics of library code that has no caller to report to (a client reconnecting, a fallback
// taken): one line each, to stderr as "moerl: TEXT" unless the program sets a sink, as
// `moerl worker` does to give the lines its timestamp and role.
#pragma once

#include <functional>
#include <string>

namespace moerl {

using LogSink = std::function<void(const std::string& text)>;

// Replaces the sink for every thread (empty: back to stderr). Returns the previous one.
LogSink set_log_sink(LogSink sink);

// Writes one diagnostic line (without a trailing newline) to the sink.
void log_line(const std::string& text);

}  // namespace moerl
