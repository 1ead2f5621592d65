// The countdown verifier: a recursive-descent parser over + - * / and parentheses with exact
// fractions, checking which of the given numbers the expression uses.
#include <algorithm>
#include <cctype>
#include <cstring>

#include "moerl/core/error.hpp"
#include "rational.hpp"
#include "verifiers.hpp"

namespace moerl::text {

namespace {

using detail::Rational;

constexpr size_t kMaxExpressionBytes = 2000;
constexpr int kMaxDepth = 100;

struct Rejected {
    std::string why;
};

class ExpressionParser {
  public:
    ExpressionParser(std::string_view s, const std::vector<int64_t>& numbers, bool integer_only)
        : s_(s), numbers_(numbers), used_(numbers.size(), false), integer_only_(integer_only) {}

    Rational parse() {
        Rational v = expression(0);
        skip_ws();
        if (i_ < s_.size())
            throw Rejected{"unexpected '" + std::string(s_.substr(i_, 1)) + "' at " + std::to_string(i_)};
        return v;
    }
    std::vector<int64_t> unused() const {
        std::vector<int64_t> out;
        for (size_t k = 0; k < numbers_.size(); ++k)
            if (!used_[k]) out.push_back(numbers_[k]);
        return out;
    }

  private:
    void skip_ws() {
        while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
    }
    bool eat(std::string_view token) {
        skip_ws();
        if (s_.substr(i_, token.size()) != token) return false;
        i_ += token.size();
        return true;
    }
    // '*' or '/' (also × ÷ \times \div \cdot), or 0.
    char mul_op() {
        if (eat("*") || eat("\u00D7") || eat("\\times") || eat("\\cdot")) return '*';
        if (eat("/") || eat("\u00F7") || eat("\\div")) return '/';
        return 0;
    }

    Rational expression(int depth) {
        if (depth > kMaxDepth) throw Rejected{"parentheses nested deeper than " + std::to_string(kMaxDepth)};
        Rational v = term(depth);
        for (;;) {
            char op = eat("+") ? '+' : (eat("-") || eat("\u2212")) ? '-' : 0;
            if (op == 0) return v;
            Rational rhs = term(depth);
            auto r = op == '+' ? detail::add(v, rhs) : detail::sub(v, rhs);
            if (!r) throw Rejected{"overflow"};
            v = *r;
        }
    }

    Rational term(int depth) {
        Rational v = factor(depth);
        for (char op = mul_op(); op != 0; op = mul_op()) {
            Rational rhs = factor(depth);
            if (op == '/' && rhs.num == 0) throw Rejected{"division by zero"};
            auto r = op == '*' ? detail::mul(v, rhs) : detail::div(v, rhs);
            if (!r) throw Rejected{"overflow"};
            if (integer_only_ && !r->is_integer())
                throw Rejected{"non-integer intermediate result " + r->str() + " (integer_only)"};
            v = *r;
        }
        return v;
    }

    Rational factor(int depth) {
        if (eat("(")) {
            Rational v = expression(depth + 1);
            if (!eat(")")) throw Rejected{"missing ')'"};
            return v;
        }
        skip_ws();
        if (i_ < s_.size() && (s_[i_] == '-' || s_[i_] == '+'))
            throw Rejected{"unary '" + std::string(1, s_[i_]) + "' is not allowed"};
        if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_])))
            throw Rejected{i_ >= s_.size() ? "the expression ends early"
                                           : "unexpected '" + std::string(s_.substr(i_, 1)) + "' at " +
                                                 std::to_string(i_)};
        int64_t value = 0;
        while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) {
            const int digit = s_[i_++] - '0';
            if (value > (INT64_MAX - digit) / 10) throw Rejected{"number too large"};
            value = value * 10 + digit;
        }
        if (i_ < s_.size() && s_[i_] == '.') throw Rejected{"only integers may appear"};
        for (size_t k = 0; k < numbers_.size(); ++k) {
            if (!used_[k] && numbers_[k] == value) {
                used_[k] = true;
                return Rational{value, 1};
            }
        }
        const bool given = std::find(numbers_.begin(), numbers_.end(), value) != numbers_.end();
        throw Rejected{given ? "uses " + std::to_string(value) + " more often than it is given"
                             : "uses " + std::to_string(value) + ", which is not among the numbers"};
    }

    std::string_view s_;
    const std::vector<int64_t>& numbers_;
    std::vector<bool> used_;
    bool integer_only_;
    size_t i_ = 0;
};

std::string_view trim(std::string_view s) {
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
    return s;
}

bool is_expression_byte(char c) {
    return c != 0 && (std::isdigit(static_cast<unsigned char>(c)) ||
                      std::strchr(" \t+-*/()\xC3\x97\xB7", c) != nullptr);
}

// The expression a response gives: its last <answer>...</answer>, else its last \boxed{}, else the
// trailing run of expression characters on its last non-empty line (so "So: (1+2)*3" gives "(1+2)*3").
// The left side is kept when it holds '='.
std::optional<std::string> extract_expression(std::string_view response, std::string& source) {
    if (auto open = response.rfind("<answer>"); open != std::string_view::npos) {
        std::string_view body = response.substr(open + 8);
        body = body.substr(0, body.find("</answer>"));
        source = "answer_tag";
        return std::string(trim(body.substr(0, body.find('='))));
    }
    if (auto boxed = math::last_boxed(response)) {
        source = "boxed";
        return std::string(trim(std::string_view(*boxed).substr(0, boxed->find('='))));
    }
    std::string_view text = trim(response);
    if (text.empty()) return std::nullopt;
    std::string_view line = text.substr(text.rfind('\n') + 1);
    if (auto eq = line.rfind('='); eq != std::string_view::npos) line = line.substr(0, eq);
    size_t start = line.size();
    while (start > 0 && is_expression_byte(line[start - 1])) --start;
    // Do not split a UTF-8 sequence: × and ÷ are C3 97 and C3 B7.
    if (start < line.size() && (line[start] == '\x97' || line[start] == '\xB7')) ++start;
    std::string_view expr = trim(line.substr(start));
    if (expr.empty()) return std::nullopt;
    source = "last_line";
    return std::string(expr);
}

std::string list(const std::vector<int64_t>& v) {
    std::string s = "[";
    for (size_t k = 0; k < v.size(); ++k) s += (k ? ", " : "") + std::to_string(v[k]);
    return s + "]";
}

class CountdownVerifier final : public Verifier {
  public:
    explicit CountdownVerifier(const CountdownOptions& o) : o_(o) { o_.validate(); }
    std::string name() const override { return "countdown"; }

    Verdict score(std::string_view response, const Example& ex) override {
        const auto& nums = ex.fields.find(o_.numbers_field);
        MOERL_CHECK(nums != ex.fields.end() && nums->is_array(), ex.where,
                    ": countdown needs an array of integers \"", o_.numbers_field, "\"");
        std::vector<int64_t> numbers;
        for (const auto& n : *nums) {
            MOERL_CHECK(n.is_number_integer(), ex.where, ": \"", o_.numbers_field,
                        "\" must hold integers, got ", n.dump());
            numbers.push_back(n.get<int64_t>());
        }
        const auto& target = ex.fields.find(o_.target_field);
        MOERL_CHECK(target != ex.fields.end() && target->is_number_integer(), ex.where,
                    ": countdown needs an integer \"", o_.target_field, "\"");
        Verdict v;
        v.details["target"] = *target;
        std::string source;
        auto expr = extract_expression(response, source);
        if (!expr) {
            v.details["error"] = "no expression found";
            return v;
        }
        v.details["expression"] = valid_utf8(*expr);
        v.details["source"] = source;
        if (expr->size() > kMaxExpressionBytes) {
            v.details["error"] = "expression longer than " + std::to_string(kMaxExpressionBytes) + " bytes";
            return v;
        }
        ExpressionParser parser(*expr, numbers, o_.integer_only);
        try {
            const Rational value = parser.parse();
            v.details["value"] = value.str();
            const auto unused = parser.unused();
            if (o_.use_all && !unused.empty()) {
                v.details["error"] = "does not use " + list(unused) + " (use_all)";
            } else if (value != Rational{target->get<int64_t>(), 1}) {
                v.details["error"] = "reaches " + value.str() + ", not the target";
            } else {
                v.reward = 1.0;
            }
        } catch (const Rejected& r) {
            v.details["error"] = r.why;
        }
        return v;
    }

  private:
    CountdownOptions o_;
};

}  // namespace

std::unique_ptr<Verifier> make_countdown_verifier(const CountdownOptions& options) {
    return std::make_unique<CountdownVerifier>(options);
}

}  // namespace moerl::text
