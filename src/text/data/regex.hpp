// A compiled PCRE2 pattern (UTF and Unicode classes on; invalid UTF-8 in a subject never matches
// rather than failing), searched with bounded backtracking so that no response can stall a verifier.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moerl::text::detail {

// Named apart from the tokenizer's detail::Regex (src/text/tokenizer/internal.hpp): one program may link
// both.
class PatternRegex {
  public:
    // Throws moerl::Error naming `what`, the pattern and the offset of a compile error.
    PatternRegex(const std::string& pattern, bool dotall, const std::string& what);
    ~PatternRegex();
    PatternRegex(const PatternRegex&) = delete;
    PatternRegex& operator=(const PatternRegex&) = delete;

    struct Match {
        std::vector<std::optional<std::string_view>> groups;  // [0] the whole match, then the groups
    };
    enum class Result { kMatch, kNoMatch, kLimit };
    // The first match at or after `start`; kLimit when the backtracking or memory limit was hit.
    Result search(std::string_view subject, size_t start, Match& out) const;
    // The last non-overlapping match; kLimit as above.
    Result search_last(std::string_view subject, Match& out) const;
    int num_groups() const { return num_groups_; }

  private:
    void* code_ = nullptr;  // pcre2_code_8
    int num_groups_ = 0;
    std::string what_;
};

}  // namespace moerl::text::detail
