// Exact fractions over 128-bit integers with overflow reported, for the math and countdown verifiers.
#pragma once

#include <optional>
#include <string>

namespace moerl::text::detail {

struct Rational {
    __int128 num = 0;
    __int128 den = 1;  // > 0, gcd(num, den) = 1

    static std::optional<Rational> make(__int128 num, __int128 den);  // nullopt when den == 0
    long double value() const { return static_cast<long double>(num) / static_cast<long double>(den); }
    bool is_integer() const { return den == 1; }
    bool operator==(const Rational&) const = default;
    std::string str() const;
};

// nullopt on overflow (and, for div, on division by zero).
std::optional<Rational> add(const Rational& a, const Rational& b);
std::optional<Rational> sub(const Rational& a, const Rational& b);
std::optional<Rational> mul(const Rational& a, const Rational& b);
std::optional<Rational> div(const Rational& a, const Rational& b);

std::string to_string(__int128 v);

}  // namespace moerl::text::detail
