// Constructors of the verifier kinds, each in its own file, for make_verifier.
#pragma once

#include <memory>

#include "moerl/text/verifier.hpp"
#include "moerl/text/verifier_math.hpp"

namespace moerl::text {

std::unique_ptr<Verifier> make_math_verifier(const MathOptions& options);
std::unique_ptr<Verifier> make_countdown_verifier(const CountdownOptions& options);
std::unique_ptr<Verifier> make_exact_verifier(const ExactOptions& options);
std::unique_ptr<Verifier> make_format_verifier(const FormatOptions& options);

// `s` with invalid UTF-8 replaced by U+FFFD, so that details always serialise.
std::string valid_utf8(std::string_view s);

}  // namespace moerl::text
