// Final-answer extraction and numeric equivalence for the math verifier.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include "moerl/text/verifier_math.hpp"
#include "rational.hpp"
#include "regex.hpp"

namespace moerl::text::math {

namespace {

using detail::Rational;

bool starts_with(std::string_view s, size_t i, std::string_view p) { return s.substr(i, p.size()) == p; }

void replace_all(std::string& s, std::string_view from, std::string_view to) {
    for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos + to.size()))
        s.replace(pos, from.size(), to);
}

std::string_view trim(std::string_view s) {
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
    return s;
}

// The index just past the '}' matching the '{' at `open`, or npos; "\{" and "\}" do not count.
size_t match_brace(std::string_view s, size_t open) {
    int depth = 0;
    for (size_t i = open; i < s.size(); ++i) {
        if (s[i] == '\\' && i + 1 < s.size() && (s[i + 1] == '{' || s[i + 1] == '}')) {
            ++i;
        } else if (s[i] == '{') {
            ++depth;
        } else if (s[i] == '}' && --depth == 0) {
            return i + 1;
        }
    }
    return std::string::npos;
}

// \text{X} and friends become " X ": the words stay (as units to strip), the markup goes.
void unwrap_text_commands(std::string& s) {
    for (std::string_view cmd : {"\\text{", "\\textbf{", "\\textrm{", "\\mathrm{", "\\mathbf{", "\\mbox{"}) {
        for (size_t pos = s.find(cmd); pos != std::string::npos; pos = s.find(cmd, pos)) {
            const size_t open = pos + cmd.size() - 1;
            const size_t end = match_brace(s, open);
            if (end == std::string::npos) break;
            s = s.substr(0, pos) + " " + s.substr(open + 1, end - open - 2) + " " + s.substr(end);
        }
    }
}

// LaTeX spacing, sizing and currency markup removed; the right side of the last '=' kept.
std::string clean(std::string_view answer) {
    std::string s(answer);
    unwrap_text_commands(s);
    for (std::string_view junk : {"\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ",
                                  "\\$", "$", "\\(", "\\)", "\\[", "\\]", "^{\\circ}", "^\\circ", "\u00B0"})
        replace_all(s, junk, "");
    replace_all(s, "{,}", ",");
    replace_all(s, "\\%", "%");
    replace_all(s, "\u2212", "-");  // the Unicode minus sign
    replace_all(s, "\\dfrac", "\\frac");
    replace_all(s, "\\tfrac", "\\frac");
    std::string_view v = trim(s);
    if (auto eq = v.rfind('='); eq != std::string_view::npos) v = trim(v.substr(eq + 1));
    while (!v.empty() && v.back() == '.') v.remove_suffix(1);
    v = trim(v);
    while (v.size() >= 2 && v.front() == '{' && match_brace(v, 0) == v.size())
        v = trim(v.substr(1, v.size() - 2));
    return std::string(v);
}

// A value read from an answer: exact when it fits, always approximate.
struct Value {
    std::optional<Rational> exact;
    long double approx = 0;
};

Value divide(const Value& a, const Value& b) {
    Value out;
    out.approx = a.approx / b.approx;
    if (a.exact && b.exact) out.exact = detail::div(*a.exact, *b.exact);
    return out;
}

// A recursive-descent reader over a cleaned answer: sign? (\frac A B | integer \frac A B | decimal (/
// decimal)?)
class NumberReader {
  public:
    explicit NumberReader(std::string_view s) : s_(s) {}
    size_t pos() const { return i_; }

    std::optional<Value> signed_number() {
        skip_ws();
        bool negative = false;
        if (i_ < s_.size() && (s_[i_] == '-' || s_[i_] == '+')) negative = s_[i_++] == '-', skip_ws();
        auto v = unsigned_number();
        if (v && negative) {
            v->approx = -v->approx;
            if (v->exact) v->exact->num = -v->exact->num;
        }
        return v;
    }

  private:
    void skip_ws() {
        while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
    }

    std::optional<Value> unsigned_number() {
        if (starts_with(s_, i_, "\\frac")) return fraction();
        auto v = decimal();
        if (!v) return std::nullopt;
        const size_t save = i_;
        skip_ws();
        if (starts_with(s_, i_, "\\frac") && v->exact && v->exact->is_integer()) {  // mixed: 1\frac{1}{2}
            auto f = fraction();
            if (!f) return std::nullopt;
            Value out{std::nullopt, v->approx + f->approx};
            if (f->exact) out.exact = detail::add(*v->exact, *f->exact);
            return out;
        }
        if (i_ < s_.size() && s_[i_] == '/') {
            ++i_;
            skip_ws();
            auto d = decimal();
            if (!d || d->approx == 0) return std::nullopt;
            return divide(*v, *d);
        }
        i_ = save;
        return v;
    }

    // \frac{A}{B} or \frac12 (one digit per argument).
    std::optional<Value> fraction() {
        i_ += 5;
        auto a = argument();
        if (!a) return std::nullopt;
        auto b = argument();
        if (!b || b->approx == 0) return std::nullopt;
        return divide(*a, *b);
    }

    std::optional<Value> argument() {
        skip_ws();
        if (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) {
            const int digit = s_[i_++] - '0';
            return Value{Rational{digit, 1}, static_cast<long double>(digit)};
        }
        if (i_ >= s_.size() || s_[i_] != '{') return std::nullopt;
        const size_t end = match_brace(s_, i_);
        if (end == std::string::npos) return std::nullopt;
        NumberReader inner(s_.substr(i_ + 1, end - i_ - 2));
        auto v = inner.signed_number();
        inner.skip_ws();
        if (!v || inner.i_ != inner.s_.size()) return std::nullopt;
        i_ = end;
        return v;
    }

    // Digits with optional thousands separators (1,234,567: groups of three after a first group of
    // at most three) and an optional fractional part.
    std::optional<Value> decimal() {
        std::string digits;
        size_t first = 0;
        while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_])))
            digits += s_[i_++], ++first;
        if (first > 0 && first <= 3) {
            while (i_ + 3 < s_.size() && s_[i_] == ',' &&
                   std::isdigit(static_cast<unsigned char>(s_[i_ + 1])) &&
                   std::isdigit(static_cast<unsigned char>(s_[i_ + 2])) &&
                   std::isdigit(static_cast<unsigned char>(s_[i_ + 3])) &&
                   (i_ + 4 >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_ + 4])))) {
                digits.append(s_.substr(i_ + 1, 3));
                i_ += 4;
            }
        }
        size_t decimals = 0;
        if (i_ + 1 < s_.size() && s_[i_] == '.' && std::isdigit(static_cast<unsigned char>(s_[i_ + 1]))) {
            ++i_;
            while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_])))
                digits += s_[i_++], ++decimals;
        }
        if (digits.empty()) return std::nullopt;
        Value v;
        std::string text = digits;
        if (decimals > 0) text.insert(text.size() - decimals, ".");
        v.approx = std::strtold(text.c_str(), nullptr);
        if (digits.size() <= 36) {  // 10^36 < 2^127
            __int128 num = 0, den = 1;
            for (char c : digits) num = num * 10 + (c - '0');
            for (size_t k = 0; k < decimals; ++k) den *= 10;
            v.exact = Rational::make(num, den);
        }
        return v;
    }

    std::string_view s_;
    size_t i_ = 0;
};

bool is_unit_char(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == ' ' || c == '.' || c == '/' || c == '^' ||
           c == '-';
}

const detail::PatternRegex& number_regex() {
    // A number as it appears in text: an optional sign (not after a word or bracket), then \frac{a}{b},
    // \frac12, digits with thousands separators, decimals, or a/b; an optional percent sign.
    static const detail::PatternRegex re(
        R"((?:(?<![\w)\]}])[-\x{2212}]\s?)?(?<![\d.])(?:\\[dt]?frac\{[^{}]*\}\{[^{}]*\}|\\[dt]?frac\d\d|)"
        R"((?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?![.\d]))?|\.\d+)(?:\s?\\?%)?)",
        false, "math verifier: number pattern");
    return re;
}

}  // namespace

std::string Number::str() const {
    std::string s = exact ? Rational{num, den}.str() : std::to_string(static_cast<double>(value));
    return percent ? s + "%" : s;
}

std::optional<std::string> last_boxed(std::string_view text) {
    std::vector<size_t> starts;
    for (std::string_view key : {"\\boxed", "\\fbox"})
        for (size_t p = text.find(key); p != std::string_view::npos; p = text.find(key, p + 1))
            starts.push_back(p + key.size());
    std::sort(starts.rbegin(), starts.rend());
    for (size_t at : starts) {
        size_t i = at;
        while (i < text.size() && text[i] == ' ') ++i;
        if (i < text.size() && text[i] == '{') {
            const size_t end = match_brace(text, i);
            if (end != std::string_view::npos) return std::string(text.substr(i + 1, end - i - 2));
        } else if (i > at && i < text.size()) {  // "\boxed 5": one token
            size_t end = i;
            while (end < text.size() && !std::isspace(static_cast<unsigned char>(text[end])) &&
                   text[end] != '$')
                ++end;
            if (end > i) return std::string(text.substr(i, end - i));
        }
    }
    return std::nullopt;
}

std::optional<FinalAnswer> extract_final_answer(std::string_view text) {
    if (auto boxed = last_boxed(text)) return FinalAnswer{*boxed, "boxed"};
    if (auto hash = text.rfind("####"); hash != std::string_view::npos) {
        std::string_view rest = text.substr(hash + 4);
        rest = trim(rest.substr(0, rest.find('\n')));
        if (!rest.empty()) return FinalAnswer{std::string(rest), "####"};
    }
    detail::PatternRegex::Match m;
    if (number_regex().search_last(text, m) == detail::PatternRegex::Result::kMatch)
        return FinalAnswer{std::string(*m.groups[0]), "last_number"};
    return std::nullopt;
}

std::string reference_answer(std::string_view answer) {
    if (auto boxed = last_boxed(answer)) return *boxed;
    if (auto hash = answer.rfind("####"); hash != std::string_view::npos) {
        std::string_view rest = trim(answer.substr(hash + 4));
        return std::string(trim(rest.substr(0, rest.find('\n'))));
    }
    return std::string(trim(answer));
}

std::optional<Number> parse_number(std::string_view answer) {
    const std::string s = clean(answer);
    NumberReader reader(s);
    auto v = reader.signed_number();
    if (!v) return std::nullopt;
    Number n;
    n.value = v->approx;
    n.exact = v->exact.has_value();
    if (v->exact) n.num = v->exact->num, n.den = v->exact->den;
    std::string_view rest = std::string_view(s).substr(reader.pos());
    const bool spaced = !rest.empty() && std::isspace(static_cast<unsigned char>(rest.front()));
    rest = trim(rest);
    if (!rest.empty() && rest.front() == '%') n.percent = true, rest = trim(rest.substr(1));
    if (rest.empty()) return n;
    // A unit tail: "19 apples", "5 dollars", "10cm", "60 km/h", "50 percent"; a single letter right
    // after the number ("2x") is algebra, not a unit.
    if (!std::isalpha(static_cast<unsigned char>(rest.front())) ||
        !std::all_of(rest.begin(), rest.end(), is_unit_char))
        return std::nullopt;
    const size_t word = std::find_if_not(rest.begin(), rest.end(),
                                         [](char c) { return std::isalpha(static_cast<unsigned char>(c)); }) -
                        rest.begin();
    if (!spaced && word < 2) return std::nullopt;
    if (rest.substr(0, word) == "percent") n.percent = true;
    return n;
}

namespace {

bool same_value(const Number& a, const Number& b, double tol) {
    if (a.exact && b.exact && a.num == b.num && a.den == b.den) return true;
    const long double scale = std::max(std::fabs(a.value), std::fabs(b.value));
    const long double diff = std::fabs(a.value - b.value);
    if ((!a.exact || !b.exact) && diff <= 1e-12L * scale) return true;
    return tol > 0 && diff <= static_cast<long double>(tol) * scale;
}

Number hundredth(Number n) {
    n.value /= 100;
    __int128 den;
    if (n.exact && !__builtin_mul_overflow(n.den, static_cast<__int128>(100), &den)) {
        auto r = Rational::make(n.num, den);
        n.num = r->num, n.den = r->den;
    } else {
        n.exact = false;
    }
    return n;
}

std::string as_text(std::string_view answer) {
    std::string s = clean(answer);
    s.erase(std::remove_if(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); }), s.end());
    return s;
}

}  // namespace

bool answers_equal(std::string_view reference, std::string_view candidate, double relative_tolerance) {
    const auto a = parse_number(reference);
    const auto b = parse_number(candidate);
    if (a && b) {
        if (same_value(*a, *b, relative_tolerance)) return true;
        if (a->percent && !b->percent) return same_value(hundredth(*a), *b, relative_tolerance);
        if (b->percent && !a->percent) return same_value(*a, hundredth(*b), relative_tolerance);
        return false;
    }
    if (a || b) return false;
    const std::string x = as_text(reference);
    return !x.empty() && x == as_text(candidate);
}

}  // namespace moerl::text::math
