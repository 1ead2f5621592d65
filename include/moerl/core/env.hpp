// The one accessor through which moerl reads environment variables.
#pragma once

#include <optional>
#include <string>

namespace moerl::env {

// The variable's value, or nullopt when it is unset or empty.
std::optional<std::string> get(const char* name);
// The variable parsed as an integer; throws moerl::Error naming it when it is not one.
long get_int(const char* name, long fallback);
double get_double(const char* name, double fallback);
std::string get_string(const char* name, const std::string& fallback);

}  // namespace moerl::env
