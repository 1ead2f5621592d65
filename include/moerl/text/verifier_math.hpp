// The pieces of the math verifier, for tests and for callers that grade answers themselves.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace moerl::text::math {

struct FinalAnswer {
    std::string text;    // as written, e.g. "\frac{1}{2}" or "1,234"
    std::string source;  // "boxed" | "####" | "last_number"
};

// The content of the last \boxed{...} (or \fbox{...}) with balanced braces, nested ones included.
std::optional<std::string> last_boxed(std::string_view text);
// The last \boxed{}, else the rest of the line after the last "####", else the last number.
std::optional<FinalAnswer> extract_final_answer(std::string_view text);
// The reference answer of an example: its \boxed{} or "####" part when it has one, else all of it.
std::string reference_answer(std::string_view answer);

// A number as an exact fraction num/den (den > 0, lowest terms) when it fits in 128 bits, and as a
// long double always. `percent` when it was written with a percent sign (50% has value 50).
struct Number {
    __int128 num = 0;
    __int128 den = 1;
    bool exact = true;
    long double value = 0;
    bool percent = false;
    std::string str() const;  // "1/2", "-3", or the long double
};

// The answer read as a number after stripping LaTeX wrappers, "$", \text{...} and unit words; nullopt
// when it is not one (e.g. "\sqrt{2}", "x+1", "A").
std::optional<Number> parse_number(std::string_view answer);

// Whether two answers are the same: as numbers when both are (exact, or within relative_tolerance
// when it is > 0; a percentage also equals its value / 100), else as text with white space, "$" and
// \text{} wrappers removed.
bool answers_equal(std::string_view reference, std::string_view candidate, double relative_tolerance = 0.0);

}  // namespace moerl::text::math
