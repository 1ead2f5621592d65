// The pre-tokenizer regexes on PCRE2: UTF and Unicode properties (UCP), JIT-compiled.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>

#include "internal.hpp"

namespace moerl::text::detail {

namespace {
// Per-thread match state: match data and a JIT stack large enough for long whitespace runs.
struct MatchState {
    pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
    pcre2_match_context* context = pcre2_match_context_create(nullptr);
    pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr);
    MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
    ~MatchState() {
        pcre2_jit_stack_free(stack);
        pcre2_match_context_free(context);
        pcre2_match_data_free(data);
    }
};
MatchState& match_state() {
    thread_local MatchState state;
    return state;
}
std::string pcre2_message(int code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(code, buf, sizeof buf);
    return reinterpret_cast<const char*>(buf);
}

// Hugging Face's \s is Unicode White_Space; PCRE2's also takes U+180E.
const char* const kWhiteSpace =
    "\\t-\\r\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

const char* const kCategoryNames[] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                      "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                      "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};

// Code points that utf8proc assigns to a general category but PCRE2's older Unicode tables leave
// unassigned, as class members ("\x{a}-\x{b}..."), by category name ("Lo") and major class ("L").
// Added to \p{..} so that the regexes see the newer of the two Unicode versions.
const std::map<std::string, std::string>& newer_code_points() {
    static const std::map<std::string, std::string> adds = [] {
        std::string all;
        for (uint32_t cp = 0x80; cp <= 0x10FFFF; ++cp)
            if (cp < 0xD800 || cp > 0xDFFF) append_utf8(all, cp);
        int err = 0;
        PCRE2_SIZE offset = 0;
        const char* pat = "\\p{Cn}+";
        pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat), PCRE2_ZERO_TERMINATED,
                                         PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
        pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
        std::map<std::string, std::vector<uint32_t>> points;
        PCRE2_SIZE start = 0;
        while (pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(all.data()), all.size(), start,
                           PCRE2_NO_UTF_CHECK, md, nullptr) > 0) {
            const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
            std::string_view m(all.data() + ov[0], ov[1] - ov[0]);
            for (size_t i = 0; i < m.size();) {
                uint32_t cp = next_code_point(m, i);
                int cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
                if (cat <= 0 || cat >= static_cast<int>(std::size(kCategoryNames))) continue;
                std::string name = kCategoryNames[cat];
                points[name].push_back(cp);
                points[name.substr(0, 1)].push_back(cp);
            }
            start = ov[1];
        }
        pcre2_match_data_free(md);
        pcre2_code_free(code);
        std::map<std::string, std::string> out;
        for (auto& [name, cps] : points) {
            std::sort(cps.begin(), cps.end());
            std::string& cls = out[name];
            char buf[40];
            for (size_t i = 0; i < cps.size();) {
                size_t j = i;
                while (j + 1 < cps.size() && cps[j + 1] == cps[j] + 1) ++j;
                if (j == i)
                    std::snprintf(buf, sizeof buf, "\\x{%x}", cps[i]);
                else
                    std::snprintf(buf, sizeof buf, "\\x{%x}-\\x{%x}", cps[i], cps[j]);
                cls += buf;
                i = j + 1;
            }
        }
        return out;
    }();
    return adds;
}

// Rewrites a pattern in the Oniguruma dialect of Hugging Face files for PCRE2: \s and \S as
// White_Space, \p{X} with the code points newer than PCRE2's tables.
std::string translate(const std::string& p, const JsonNode& where) {
    std::string out;
    bool in_class = false;
    for (size_t i = 0; i < p.size(); ++i) {
        char c = p[i];
        if (c == '\\' && i + 1 < p.size()) {
            char e = p[i + 1];
            if (e == 's') {
                out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
                ++i;
                continue;
            }
            if (e == 'S') {
                if (in_class) where.fail("uses \\S inside a character class, which is not supported");
                out += "[^" + std::string(kWhiteSpace) + "]";
                ++i;
                continue;
            }
            if (e == 'p' || e == 'P') {
                size_t end = i + 2;
                std::string name;
                if (end < p.size() && p[end] == '{') {
                    size_t close = p.find('}', end);
                    if (close == std::string::npos) where.fail("has an unterminated \\p{");
                    name = p.substr(end + 1, close - end - 1);
                    end = close + 1;
                } else if (end < p.size()) {
                    name = p.substr(end, 1);
                    end += 1;
                }
                std::string prop = p.substr(i, end - i);
                auto& adds = newer_code_points();
                auto it = adds.find(name);
                if (it == adds.end() || (e == 'P' && in_class))
                    out += prop;
                else if (in_class)
                    out += prop + it->second;
                else
                    out += std::string(e == 'p' ? "[" : "[^") + "\\p{" + name + "}" + it->second + "]";
                i = end - 1;
                continue;
            }
            out += c;
            out += e;
            ++i;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            out += c;
            if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
            if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ] is literal
            continue;
        }
        if (in_class && c == ']') in_class = false;
        out += c;
    }
    return out;
}
}  // namespace

Regex::Regex(const std::string& source, const JsonNode& where) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    std::string pattern = translate(source, where);
    auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                               PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
    if (code == nullptr)
        where.fail("regex does not compile at offset " + std::to_string(offset) + ": " + pcre2_message(err));
    int rc = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    if (rc != 0 && rc != PCRE2_ERROR_JIT_BADOPTION) {
        pcre2_code_free(code);
        where.fail("regex does not JIT-compile: " + pcre2_message(rc));
    }
    code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::next_match(std::string_view s, size_t start, size_t& b, size_t& e) const {
    auto* code = static_cast<pcre2_code*>(code_);
    MatchState& st = match_state();
    auto subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    int rc = pcre2_jit_match(code, subject, s.size(), start, 0, st.data, st.context);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT || rc == PCRE2_ERROR_JIT_BADOPTION)
        rc = pcre2_match(code, subject, s.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, st.data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    MOERL_CHECK(rc >= 0, "regex match failed: ", pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
    b = ov[0];
    e = ov[1];
    return true;
}

std::string escape_regex(std::string_view literal) {
    std::string out;
    for (char c : literal) {
        if (std::string_view("\\^$.|?*+()[]{}-/").find(c) != std::string_view::npos) out.push_back('\\');
        out.push_back(c);
    }
    return out;
}

}  // namespace moerl::text::detail
