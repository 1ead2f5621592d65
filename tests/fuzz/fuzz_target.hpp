// Shared by the fuzz targets: the parser's own error is the expected answer to bad input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "moerl/core/error.hpp"

namespace moerl::fuzz {

// Runs one parse. moerl::Error means the parser refused the input, naming what was wrong: that is
// the contract. Any other exception escapes and ends the process, so libFuzzer (or the replay
// driver) reports it: a std::exception from a library (nlohmann::json's type_error, std::bad_alloc,
// std::out_of_range) reaches the user without the file name and key, and anything else is a bug.
template <typename Parse>
int parse_or_refuse(Parse&& parse) {
    try {
        parse();
    } catch (const moerl::Error&) {
    }
    return 0;
}

// A property of an accepted input that must hold; a broken one is a finding like a crash.
inline void require(bool ok, const char* what) {
    if (!ok) {
        std::fprintf(stderr, "fuzz property broken: %s\n", what);
        std::abort();
    }
}

inline std::string as_text(const uint8_t* data, size_t size) {
    return std::string(reinterpret_cast<const char*>(data), size);
}

}  // namespace moerl::fuzz
