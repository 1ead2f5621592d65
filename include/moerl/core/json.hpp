// JSON from files a user hands in: nlohmann::json parsed with a bound on nesting depth.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "moerl/core/error.hpp"

namespace moerl {

// Deeper than any config.json, manifest or safetensors header needs. nlohmann::json copies, prints
// and compares recursively, so a few KB of "[" parse fine and then overflow the stack.
constexpr int kMaxJsonDepth = 100;

// json::parse of [first, last): a parse_error on bad syntax, and a moerl::Error naming `source`
// when values nest deeper than kMaxJsonDepth.
template <typename Iterator>
nlohmann::json parse_json(Iterator first, Iterator last, const std::string& source) {
    return nlohmann::json::parse(first, last, [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        MOERL_CHECK(depth <= kMaxJsonDepth, source, ": JSON nested deeper than ", kMaxJsonDepth, " levels");
        return true;
    });
}
inline nlohmann::json parse_json(const std::string& text, const std::string& source) {
    return parse_json(text.begin(), text.end(), source);
}

}  // namespace moerl
