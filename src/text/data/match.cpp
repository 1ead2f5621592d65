// The exact-match and format verifiers (PCRE2 patterns, utf8proc normalisation and case folding).
#include <utf8proc.h>

#include <cctype>
#include <cstdlib>

#include "moerl/core/error.hpp"
#include "regex.hpp"
#include "verifiers.hpp"

namespace moerl::text {

namespace {

// NFC, and case folding when asked; text that is not valid UTF-8 is compared as bytes.
std::string unicode_normalize(std::string_view s, bool fold_case) {
    utf8proc_uint8_t* out = nullptr;
    const int options = UTF8PROC_STABLE | UTF8PROC_COMPOSE | (fold_case ? UTF8PROC_CASEFOLD : 0);
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                     static_cast<utf8proc_ssize_t>(s.size()), &out, static_cast<utf8proc_option_t>(options));
    if (n < 0) {
        std::string bytes(s);
        if (fold_case)
            for (char& c : bytes) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        return bytes;
    }
    std::string result(reinterpret_cast<char*>(out), static_cast<size_t>(n));
    std::free(out);
    return result;
}

std::string collapse_whitespace(std::string_view s) {
    std::string out;
    bool space = false;
    for (char c : s) {
        if (std::isspace(static_cast<unsigned char>(c))) {
            space = !out.empty();
        } else {
            if (space) out += ' ';
            space = false;
            out += c;
        }
    }
    return out;
}

class ExactVerifier final : public Verifier {
  public:
    explicit ExactVerifier(const ExactOptions& o) : o_(o) {
        o_.validate();
        if (!o_.extract.empty()) {
            extract_ = std::make_unique<detail::PatternRegex>(o_.extract, true, "verifier exact.extract");
            MOERL_CHECK(extract_->num_groups() >= 1, "verifier exact.extract: the pattern '", o_.extract,
                        "' needs a capture group around the answer");
        }
    }
    std::string name() const override { return "exact"; }

    Verdict score(std::string_view response, const Example& ex) override {
        Verdict v;
        std::string_view got = response;
        if (extract_) {
            detail::PatternRegex::Match m;
            const auto r = extract_->search_last(response, m);
            if (r != detail::PatternRegex::Result::kMatch || !m.groups[1]) {
                v.details["error"] = r == detail::PatternRegex::Result::kLimit
                                         ? "extract pattern hit the match limit"
                                         : "extract pattern did not match";
                return v;
            }
            got = *m.groups[1];
        }
        const std::string a = normalize(ex.answer), b = normalize(got);
        v.details["answer"] = valid_utf8(b);
        v.details["expected"] = valid_utf8(a);
        v.reward = a == b ? 1.0 : 0.0;
        return v;
    }

  private:
    std::string normalize(std::string_view s) const {
        std::string t = unicode_normalize(s, o_.ignore_case);
        return o_.normalize_whitespace ? collapse_whitespace(t) : t;
    }
    ExactOptions o_;
    std::unique_ptr<detail::PatternRegex> extract_;
};

class FormatVerifier final : public Verifier {
  public:
    explicit FormatVerifier(const FormatOptions& o)
        : o_(o), re_((o_.validate(), o_.pattern), o_.dotall, "verifier format.pattern") {}
    std::string name() const override { return "format"; }

    Verdict score(std::string_view response, const Example&) override {
        Verdict v;
        detail::PatternRegex::Match m;
        const auto r = re_.search(response, 0, m);
        v.reward = r == detail::PatternRegex::Result::kMatch ? 1.0 : 0.0;
        if (r == detail::PatternRegex::Result::kLimit) v.details["error"] = "the pattern hit the match limit";
        v.details["matched"] = r == detail::PatternRegex::Result::kMatch;
        return v;
    }

  private:
    FormatOptions o_;
    detail::PatternRegex re_;
};

}  // namespace

std::unique_ptr<Verifier> make_exact_verifier(const ExactOptions& options) {
    return std::make_unique<ExactVerifier>(options);
}

std::unique_ptr<Verifier> make_format_verifier(const FormatOptions& options) {
    return std::make_unique<FormatVerifier>(options);
}

}  // namespace moerl::text
