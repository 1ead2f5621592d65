// Internal: the settings a backend address carries in its query, e.g.
// redis://host:6379/0?retry_ms=60000 or s3://bucket/prefix?part_mb=16.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "moerl/core/error.hpp"

namespace moerl::control {

// The address without its query.
inline std::string without_query(const std::string& uri) { return uri.substr(0, uri.find('?')); }

// name=value pairs of the query in order; `kind` names the address in errors ("redis URL").
inline std::vector<std::pair<std::string, std::string>> query_settings(const std::string& uri,
                                                                       const char* kind) {
    std::vector<std::pair<std::string, std::string>> out;
    const auto q = uri.find('?');
    if (q == std::string::npos) return out;
    const std::string query = uri.substr(q + 1);
    for (size_t start = 0; start < query.size();) {
        size_t end = query.find('&', start);
        if (end == std::string::npos) end = query.size();
        const std::string item = query.substr(start, end - start);
        start = end + 1;
        if (item.empty()) continue;
        const auto eq = item.find('=');
        MOERL_CHECK(eq != std::string::npos && eq > 0, kind, " '", uri, "': query item '", item,
                    "' is not name=value");
        out.emplace_back(item.substr(0, eq), item.substr(eq + 1));
    }
    return out;
}

// The integer value of setting `name` of `uri`; anything else is an error naming both.
inline long query_int(const std::string& uri, const char* kind, const std::string& name,
                      const std::string& text) {
    try {
        size_t used = 0;
        const long v = std::stol(text, &used);
        if (used == text.size()) return v;
    } catch (const std::logic_error&) {
    }
    MOERL_FAIL(kind, " '", uri, "': ", name, "='", text, "' is not an integer");
}

}  // namespace moerl::control
