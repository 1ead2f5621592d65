#include "rational.hpp"

#include <algorithm>

namespace moerl::text::detail {

namespace {

__int128 gcd(__int128 a, __int128 b) {
    if (a < 0) a = -a;
    if (b < 0) b = -b;
    while (b != 0) {
        __int128 t = a % b;
        a = b;
        b = t;
    }
    return a;
}

}  // namespace

std::optional<Rational> Rational::make(__int128 num, __int128 den) {
    if (den == 0) return std::nullopt;
    if (den < 0) num = -num, den = -den;
    const __int128 g = gcd(num, den);
    if (g > 1) num /= g, den /= g;
    return Rational{num, den};
}

std::string to_string(__int128 v) {
    if (v == 0) return "0";
    const bool negative = v < 0;
    std::string s;
    while (v != 0) {
        const int digit = static_cast<int>(v % 10);
        s += static_cast<char>('0' + (digit < 0 ? -digit : digit));
        v /= 10;
    }
    if (negative) s += '-';
    std::reverse(s.begin(), s.end());
    return s;
}

std::string Rational::str() const {
    return den == 1 ? to_string(num) : to_string(num) + "/" + to_string(den);
}

std::optional<Rational> add(const Rational& a, const Rational& b) {
    __int128 x, y, d;
    if (__builtin_mul_overflow(a.num, b.den, &x) || __builtin_mul_overflow(b.num, a.den, &y) ||
        __builtin_add_overflow(x, y, &x) || __builtin_mul_overflow(a.den, b.den, &d))
        return std::nullopt;
    return Rational::make(x, d);
}

std::optional<Rational> sub(const Rational& a, const Rational& b) { return add(a, Rational{-b.num, b.den}); }

std::optional<Rational> mul(const Rational& a, const Rational& b) {
    __int128 n, d;
    if (__builtin_mul_overflow(a.num, b.num, &n) || __builtin_mul_overflow(a.den, b.den, &d))
        return std::nullopt;
    return Rational::make(n, d);
}

std::optional<Rational> div(const Rational& a, const Rational& b) {
    if (b.num == 0) return std::nullopt;
    __int128 n, d;
    if (__builtin_mul_overflow(a.num, b.den, &n) || __builtin_mul_overflow(a.den, b.num, &d))
        return std::nullopt;
    return Rational::make(n, d);
}

}  // namespace moerl::text::detail
