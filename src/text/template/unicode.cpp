#include "template/unicode.hpp"

#include <utf8proc.h>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <vector>

namespace moerl::text::jinja::detail {

char32_t next_code_point(std::string_view s, std::size_t& i) {
    utf8proc_int32_t cp = 0;
    auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                              static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n <= 0) {
        ++i;
        return 0xFFFD;
    }
    i += static_cast<std::size_t>(n);
    return static_cast<char32_t>(cp);
}

void append_utf8(std::string& out, char32_t cp) {
    utf8proc_uint8_t buf[4];
    auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
    out.append(reinterpret_cast<const char*>(buf), static_cast<std::size_t>(n));
}

bool is_js_space(char32_t cp) {
    switch (cp) {
        case 0x09:
        case 0x0A:
        case 0x0B:
        case 0x0C:
        case 0x0D:
        case 0x20:
        case 0xA0:
        case 0x1680:
        case 0x2028:
        case 0x2029:
        case 0x202F:
        case 0x205F:
        case 0x3000:
        case 0xFEFF:
            return true;
        default:
            return cp >= 0x2000 && cp <= 0x200A;
    }
}

std::size_t space_run(std::string_view s, std::size_t pos) {
    std::size_t i = pos;
    while (i < s.size()) {
        std::size_t j = i;
        if (!is_js_space(next_code_point(s, j))) break;
        i = j;
    }
    return i - pos;
}

std::size_t space_run_start(std::string_view s, std::size_t end) {
    std::size_t start = end;
    while (start > 0) {
        std::size_t lead = start - 1;  // step back to the first byte of the previous code point
        while (lead > 0 && (static_cast<unsigned char>(s[lead]) & 0xC0) == 0x80 && start - lead < 4) --lead;
        std::size_t j = lead;
        char32_t cp = next_code_point(s, j);
        if (j != start || !is_js_space(cp)) break;
        start = lead;
    }
    return start;
}

std::string_view trim_start(std::string_view s) { return s.substr(space_run(s, 0)); }
std::string_view trim_end(std::string_view s) { return s.substr(0, space_run_start(s, s.size())); }
std::string_view trim(std::string_view s) { return trim_end(trim_start(s)); }

namespace {

// SpecialCasing.txt's unconditional upper-case mappings to several code points (JavaScript's
// toUpperCase applies them; utf8proc maps one to one).
struct MultiUpper {
    char32_t from;
    char32_t to[3];
};
// clang-format off
const MultiUpper kMultiUpper[] = {
    {0xDF, {0x53, 0x53}}, {0x149, {0x2BC, 0x4E}}, {0x1F0, {0x4A, 0x30C}}, {0x390, {0x399, 0x308, 0x301}},
    {0x3B0, {0x3A5, 0x308, 0x301}}, {0x587, {0x535, 0x552}}, {0x1E96, {0x48, 0x331}},
    {0x1E97, {0x54, 0x308}}, {0x1E98, {0x57, 0x30A}}, {0x1E99, {0x59, 0x30A}}, {0x1E9A, {0x41, 0x2BE}},
    {0x1F50, {0x3A5, 0x313}}, {0x1F52, {0x3A5, 0x313, 0x300}}, {0x1F54, {0x3A5, 0x313, 0x301}},
    {0x1F56, {0x3A5, 0x313, 0x342}}, {0x1F80, {0x1F08, 0x399}}, {0x1F81, {0x1F09, 0x399}},
    {0x1F82, {0x1F0A, 0x399}}, {0x1F83, {0x1F0B, 0x399}}, {0x1F84, {0x1F0C, 0x399}},
    {0x1F85, {0x1F0D, 0x399}}, {0x1F86, {0x1F0E, 0x399}}, {0x1F87, {0x1F0F, 0x399}},
    {0x1F88, {0x1F08, 0x399}}, {0x1F89, {0x1F09, 0x399}}, {0x1F8A, {0x1F0A, 0x399}},
    {0x1F8B, {0x1F0B, 0x399}}, {0x1F8C, {0x1F0C, 0x399}}, {0x1F8D, {0x1F0D, 0x399}},
    {0x1F8E, {0x1F0E, 0x399}}, {0x1F8F, {0x1F0F, 0x399}}, {0x1F90, {0x1F28, 0x399}},
    {0x1F91, {0x1F29, 0x399}}, {0x1F92, {0x1F2A, 0x399}}, {0x1F93, {0x1F2B, 0x399}},
    {0x1F94, {0x1F2C, 0x399}}, {0x1F95, {0x1F2D, 0x399}}, {0x1F96, {0x1F2E, 0x399}},
    {0x1F97, {0x1F2F, 0x399}}, {0x1F98, {0x1F28, 0x399}}, {0x1F99, {0x1F29, 0x399}},
    {0x1F9A, {0x1F2A, 0x399}}, {0x1F9B, {0x1F2B, 0x399}}, {0x1F9C, {0x1F2C, 0x399}},
    {0x1F9D, {0x1F2D, 0x399}}, {0x1F9E, {0x1F2E, 0x399}}, {0x1F9F, {0x1F2F, 0x399}},
    {0x1FA0, {0x1F68, 0x399}}, {0x1FA1, {0x1F69, 0x399}}, {0x1FA2, {0x1F6A, 0x399}},
    {0x1FA3, {0x1F6B, 0x399}}, {0x1FA4, {0x1F6C, 0x399}}, {0x1FA5, {0x1F6D, 0x399}},
    {0x1FA6, {0x1F6E, 0x399}}, {0x1FA7, {0x1F6F, 0x399}}, {0x1FA8, {0x1F68, 0x399}},
    {0x1FA9, {0x1F69, 0x399}}, {0x1FAA, {0x1F6A, 0x399}}, {0x1FAB, {0x1F6B, 0x399}},
    {0x1FAC, {0x1F6C, 0x399}}, {0x1FAD, {0x1F6D, 0x399}}, {0x1FAE, {0x1F6E, 0x399}},
    {0x1FAF, {0x1F6F, 0x399}}, {0x1FB2, {0x1FBA, 0x399}}, {0x1FB3, {0x391, 0x399}}, {0x1FB4, {0x386, 0x399}},
    {0x1FB6, {0x391, 0x342}}, {0x1FB7, {0x391, 0x342, 0x399}}, {0x1FBC, {0x391, 0x399}},
    {0x1FC2, {0x1FCA, 0x399}}, {0x1FC3, {0x397, 0x399}}, {0x1FC4, {0x389, 0x399}}, {0x1FC6, {0x397, 0x342}},
    {0x1FC7, {0x397, 0x342, 0x399}}, {0x1FCC, {0x397, 0x399}}, {0x1FD2, {0x399, 0x308, 0x300}},
    {0x1FD3, {0x399, 0x308, 0x301}}, {0x1FD6, {0x399, 0x342}}, {0x1FD7, {0x399, 0x308, 0x342}},
    {0x1FE2, {0x3A5, 0x308, 0x300}}, {0x1FE3, {0x3A5, 0x308, 0x301}}, {0x1FE4, {0x3A1, 0x313}},
    {0x1FE6, {0x3A5, 0x342}}, {0x1FE7, {0x3A5, 0x308, 0x342}}, {0x1FF2, {0x1FFA, 0x399}},
    {0x1FF3, {0x3A9, 0x399}}, {0x1FF4, {0x38F, 0x399}}, {0x1FF6, {0x3A9, 0x342}},
    {0x1FF7, {0x3A9, 0x342, 0x399}}, {0x1FFC, {0x3A9, 0x399}}, {0xFB00, {0x46, 0x46}},
    {0xFB01, {0x46, 0x49}}, {0xFB02, {0x46, 0x4C}}, {0xFB03, {0x46, 0x46, 0x49}},
    {0xFB04, {0x46, 0x46, 0x4C}}, {0xFB05, {0x53, 0x54}}, {0xFB06, {0x53, 0x54}}, {0xFB13, {0x544, 0x546}},
    {0xFB14, {0x544, 0x535}}, {0xFB15, {0x544, 0x53B}}, {0xFB16, {0x54E, 0x546}}, {0xFB17, {0x544, 0x53D}}
};
// clang-format on

const MultiUpper* multi_upper(char32_t cp) {
    if (cp < 0xDF || cp > 0xFB17) return nullptr;
    auto it = std::lower_bound(std::begin(kMultiUpper), std::end(kMultiUpper), cp,
                               [](const MultiUpper& m, char32_t c) { return m.from < c; });
    return it != std::end(kMultiUpper) && it->from == cp ? it : nullptr;
}

bool is_letter(char32_t cp) {
    auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
    return cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
}
bool is_mark(char32_t cp) {
    return utf8proc_category(static_cast<utf8proc_int32_t>(cp)) == UTF8PROC_CATEGORY_MN;
}

std::u32string decode(std::string_view s, std::vector<std::size_t>& starts) {
    std::u32string out;
    for (std::size_t i = 0; i < s.size();) {
        starts.push_back(i);
        out.push_back(next_code_point(s, i));
    }
    starts.push_back(s.size());
    return out;
}

// Capital sigma lower-cases to the final form after a letter and before none (marks skipped).
bool final_sigma(const std::u32string& cps, std::size_t k) {
    std::size_t p = k;
    while (p > 0 && is_mark(cps[p - 1])) --p;
    if (p == 0 || !is_letter(cps[p - 1])) return false;
    std::size_t n = k + 1;
    while (n < cps.size() && is_mark(cps[n])) ++n;
    return n == cps.size() || !is_letter(cps[n]);
}

std::string map_case(std::string_view s, bool upper) {
    std::string out;
    out.reserve(s.size());
    bool ascii = std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
    if (ascii) {
        for (char c : s) out.push_back(static_cast<char>(upper ? std::toupper(c) : std::tolower(c)));
        return out;
    }
    std::vector<std::size_t> starts;
    std::u32string cps = decode(s, starts);
    for (std::size_t k = 0; k < cps.size(); ++k) {
        char32_t cp = cps[k];
        if (cp == 0xFFFD && starts[k + 1] == starts[k] + 1) {
            out.push_back(s[starts[k]]);  // keep a malformed byte as it was
            continue;
        }
        if (upper) {
            if (const MultiUpper* m = multi_upper(cp)) {
                for (char32_t t : m->to)
                    if (t) append_utf8(out, t);
                continue;
            }
            append_utf8(out, static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(cp))));
        } else if (cp == 0x130) {  // İ lower-cases to i + combining dot above
            append_utf8(out, 0x69);
            append_utf8(out, 0x307);
        } else if (cp == 0x3A3 && final_sigma(cps, k)) {
            append_utf8(out, 0x3C2);
        } else {
            append_utf8(out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
        }
    }
    return out;
}
}  // namespace

std::string to_upper(std::string_view s) { return map_case(s, true); }
std::string to_lower(std::string_view s) { return map_case(s, false); }

std::size_t num_code_points(std::string_view s) {
    std::size_t n = 0;
    for (std::size_t i = 0; i < s.size(); ++n) next_code_point(s, i);
    return n;
}

std::size_t utf16_length(std::string_view s) {
    std::size_t n = 0;
    for (std::size_t i = 0; i < s.size();) n += next_code_point(s, i) > 0xFFFF ? 2 : 1;
    return n;
}

}  // namespace moerl::text::jinja::detail
