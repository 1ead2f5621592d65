#include "moerl/core/env.hpp"

#include <cstdlib>

#include "moerl/core/error.hpp"

namespace moerl::env {

std::optional<std::string> get(const char* name) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
}

long get_int(const char* name, long fallback) {
    auto v = get(name);
    if (!v) return fallback;
    try {
        size_t used = 0;
        long out = std::stol(*v, &used);
        MOERL_CHECK(used == v->size(), "environment variable ", name, "='", *v, "' is not an integer");
        return out;
    } catch (const std::logic_error&) {
        MOERL_FAIL("environment variable ", name, "='", *v, "' is not an integer");
    }
}

double get_double(const char* name, double fallback) {
    auto v = get(name);
    if (!v) return fallback;
    try {
        size_t used = 0;
        double out = std::stod(*v, &used);
        MOERL_CHECK(used == v->size(), "environment variable ", name, "='", *v, "' is not a number");
        return out;
    } catch (const std::logic_error&) {
        MOERL_FAIL("environment variable ", name, "='", *v, "' is not a number");
    }
}

std::string get_string(const char* name, const std::string& fallback) { return get(name).value_or(fallback); }

}  // namespace moerl::env
