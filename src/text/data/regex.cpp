#define PCRE2_CODE_UNIT_WIDTH 8
#include "regex.hpp"

#include <pcre2.h>

#include "moerl/core/error.hpp"

namespace moerl::text::detail {

namespace {

constexpr uint32_t kMatchLimit = 10'000'000;   // backtracking steps per search
constexpr uint32_t kHeapLimitKib = 64 * 1024;  // backtracking memory per search

std::string error_text(int code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(code, buf, sizeof buf);
    return reinterpret_cast<const char*>(buf);
}

}  // namespace

PatternRegex::PatternRegex(const std::string& pattern, bool dotall, const std::string& what) : what_(what) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    uint32_t flags = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | (dotall ? PCRE2_DOTALL : 0);
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), flags,
                                     &err, &offset, nullptr);
    MOERL_CHECK(code != nullptr, what, ": the pattern '", pattern, "' does not compile at offset ", offset,
                ": ", error_text(err));
    code_ = code;
    // Machine code for the pattern where PCRE2 has a JIT for this processor (the interpreter
    // otherwise): the math verifier's number pattern over a 128-token response took ~80 us
    // interpreted.
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    uint32_t count = 0;
    pcre2_pattern_info(code, PCRE2_INFO_CAPTURECOUNT, &count);
    num_groups_ = static_cast<int>(count);
}

PatternRegex::~PatternRegex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

namespace {

// Match data and limits for the searches of one call (pcre2 objects are not shared across threads).
struct Scratch {
    pcre2_match_data* md;
    pcre2_match_context* ctx;
    explicit Scratch(const pcre2_code* code)
        : md(pcre2_match_data_create_from_pattern(code, nullptr)), ctx(pcre2_match_context_create(nullptr)) {
        pcre2_set_match_limit(ctx, kMatchLimit);
        pcre2_set_heap_limit(ctx, kHeapLimitKib);
    }
    ~Scratch() {
        pcre2_match_context_free(ctx);
        pcre2_match_data_free(md);
    }
};

PatternRegex::Result search_once(const pcre2_code* code, int num_groups, const std::string& what,
                                 Scratch& scratch, std::string_view subject, size_t start,
                                 PatternRegex::Match& out) {
    int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), start, 0,
                         scratch.md, scratch.ctx);
    // The JIT's stack (32 KiB) is smaller than what the interpreter may take under the heap limit:
    // such a search runs again interpreted, so both give the same answers.
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), start,
                         PCRE2_NO_JIT, scratch.md, scratch.ctx);
    if (rc == PCRE2_ERROR_NOMATCH) return PatternRegex::Result::kNoMatch;
    if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT)
        return PatternRegex::Result::kLimit;
    MOERL_CHECK(rc >= 0, what, ": matching failed: ", error_text(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch.md);
    out.groups.assign(static_cast<size_t>(num_groups) + 1, std::nullopt);
    for (int g = 0; g <= num_groups && g < rc; ++g) {
        if (ov[2 * g] == PCRE2_UNSET) continue;
        out.groups[static_cast<size_t>(g)] = subject.substr(ov[2 * g], ov[2 * g + 1] - ov[2 * g]);
    }
    return PatternRegex::Result::kMatch;
}

}  // namespace

PatternRegex::Result PatternRegex::search(std::string_view subject, size_t start, Match& out) const {
    const auto* code = static_cast<const pcre2_code*>(code_);
    Scratch scratch(code);
    return search_once(code, num_groups_, what_, scratch, subject, start, out);
}

PatternRegex::Result PatternRegex::search_last(std::string_view subject, Match& out) const {
    const auto* code = static_cast<const pcre2_code*>(code_);
    Scratch scratch(code);
    Match m;
    bool found = false;
    size_t start = 0;
    while (start <= subject.size()) {
        const Result r = search_once(code, num_groups_, what_, scratch, subject, start, m);
        if (r == Result::kLimit) return r;
        if (r == Result::kNoMatch) break;
        found = true;
        const std::string_view whole = *m.groups[0];
        const size_t end = static_cast<size_t>(whole.data() - subject.data()) + whole.size();
        out = m;
        start = whole.empty() ? end + 1 : end;
    }
    return found ? Result::kMatch : Result::kNoMatch;
}

}  // namespace moerl::text::detail
