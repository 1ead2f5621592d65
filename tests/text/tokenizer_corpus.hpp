// A deterministic corpus of strings that exercise a tokenizer's edge cases: English with
// contractions, code with tabs and trailing spaces, digit runs, LaTeX, CJK, Arabic, Hindi, emoji
// with ZWJ sequences, combining marks, whitespace runs and CRLF, special tokens and near-misses of
// them, very long words, random code points and the empty string.
#pragma once

#include <utf8proc.h>

#include <cstdint>
#include <string>
#include <vector>

namespace moerl::text::testing {

class Rng {
  public:
    explicit Rng(uint64_t seed) : s_(seed) {}
    uint64_t next() {  // splitmix64
        uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    size_t below(size_t n) { return n ? next() % n : 0; }
    bool chance(int percent) { return below(100) < static_cast<size_t>(percent); }
    template <typename T>
    const T& pick(const std::vector<T>& v) {
        return v[below(v.size())];
    }

  private:
    uint64_t s_;
};

inline void put(std::string& out, uint32_t cp) {
    utf8proc_uint8_t buf[4];
    auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
    out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

// 1..max_parts parts, each appended by part(s, index).
template <typename F>
std::string parts(Rng& r, size_t max_parts, F&& part) {
    std::string s;
    for (size_t i = 0, n = 1 + r.below(max_parts); i < n; ++i) part(s, i);
    return s;
}

inline std::string range_chars(Rng& r, uint32_t lo, uint32_t hi, size_t n) {
    std::string s;
    for (size_t i = 0; i < n; ++i) put(s, lo + static_cast<uint32_t>(r.below(hi - lo + 1)));
    return s;
}

inline const std::vector<std::string>& english_words() {
    static const std::vector<std::string> w = {"the",
                                               "of",
                                               "and",
                                               "to",
                                               "in",
                                               "is",
                                               "you",
                                               "that",
                                               "it",
                                               "he",
                                               "was",
                                               "for",
                                               "on",
                                               "are",
                                               "as",
                                               "with",
                                               "his",
                                               "they",
                                               "I",
                                               "at",
                                               "be",
                                               "this",
                                               "have",
                                               "from",
                                               "or",
                                               "one",
                                               "had",
                                               "by",
                                               "word",
                                               "but",
                                               "not",
                                               "what",
                                               "all",
                                               "were",
                                               "we",
                                               "when",
                                               "your",
                                               "can",
                                               "said",
                                               "there",
                                               "use",
                                               "an",
                                               "each",
                                               "which",
                                               "she",
                                               "do",
                                               "how",
                                               "their",
                                               "if",
                                               "will",
                                               "up",
                                               "other",
                                               "about",
                                               "out",
                                               "many",
                                               "then",
                                               "them",
                                               "these",
                                               "so",
                                               "some",
                                               "her",
                                               "would",
                                               "make",
                                               "like",
                                               "him",
                                               "into",
                                               "time",
                                               "has",
                                               "look",
                                               "two",
                                               "more",
                                               "write",
                                               "go",
                                               "see",
                                               "number",
                                               "no",
                                               "way",
                                               "could",
                                               "people",
                                               "my",
                                               "than",
                                               "first",
                                               "water",
                                               "been",
                                               "call",
                                               "who",
                                               "oil",
                                               "its",
                                               "now",
                                               "find",
                                               "long",
                                               "down",
                                               "day",
                                               "did",
                                               "get",
                                               "come",
                                               "made",
                                               "may",
                                               "part",
                                               "Tokenization",
                                               "reinforcement",
                                               "learning",
                                               "Mixture-of-Experts",
                                               "don't",
                                               "I'm",
                                               "you'll",
                                               "they've",
                                               "she'd",
                                               "it's",
                                               "we're",
                                               "DON'T",
                                               "YOU'LL",
                                               "It'S",
                                               "o'clock",
                                               "rock'n'roll",
                                               "naïve",
                                               "café",
                                               "résumé",
                                               "Zürich",
                                               "straße",
                                               "ﬁnance",
                                               "ℌello",
                                               "Ωmega",
                                               "McDonald's",
                                               "e-mail",
                                               "U.S.A.",
                                               "Dr.",
                                               "etc.",
                                               "100%",
                                               "$5.99",
                                               "#hashtag",
                                               "@user",
                                               "https://example.com/a?b=c",
                                               "snake_case",
                                               "camelCase",
                                               "PascalCase",
                                               "SCREAMING_CASE",
                                               "x86_64",
                                               "GPT-4o",
                                               "ß",
                                               "İstanbul",
                                               "ǅ"};
    return w;
}

inline std::string english(Rng& r) {
    std::string text = parts(r, 30, [&](std::string& s, size_t i) {
        if (i) s += r.chance(5) ? "  " : " ";
        std::string w = r.pick(english_words());
        if (i == 0 && !w.empty() && w[0] >= 'a' && w[0] <= 'z' && r.chance(50))
            w[0] = static_cast<char>(w[0] - 32);
        s += w;
        if (r.chance(10))
            s += r.pick(std::vector<std::string>{",", ".", ";", ":", "!", "?", "...", " -", "'s", "'"});
    });
    if (r.chance(30)) text += r.pick(std::vector<std::string>{".", "!\n", "?\r\n", ".\n\n", " ", "\t"});
    return text;
}

inline std::string code(Rng& r) {
    static const std::vector<std::string> lines = {"def f(x):",
                                                   "return x * 2",
                                                   "for (int i = 0; i < n; ++i) {",
                                                   "}",
                                                   "if x == None:",
                                                   "import numpy as np",
                                                   "const auto& [a, b] = pairs[k];",
                                                   "std::vector<int32_t> ids;",
                                                   "printf(\"%d\\n\", x);",
                                                   "# comment",
                                                   "// TODO: fix",
                                                   "/* block */",
                                                   "x = {'a': 1, \"b\": [2, 3]}",
                                                   "    pass",
                                                   "elif y != 0:",
                                                   "let v = &mut s;",
                                                   "SELECT * FROM t WHERE id = 42;",
                                                   "<div class=\"x\">text</div>",
                                                   "a += b << 3 | c & 0xFF;",
                                                   "λx. x",
                                                   "fn main() -> Result<(), Box<dyn Error>> {",
                                                   "#include <stdio.h>",
                                                   "echo $HOME && ls -la",
                                                   "x=1;y=2"};
    return parts(r, 10, [&](std::string& s, size_t) {
        size_t indent = r.below(4);
        for (size_t k = 0; k < indent; ++k) s += r.chance(50) ? "\t" : "    ";
        s += r.pick(lines);
        if (r.chance(20)) s += std::string(1 + r.below(3), ' ');  // trailing spaces
        if (r.chance(10)) s += "\t";
        s += r.chance(20) ? "\r\n" : "\n";
        if (r.chance(10)) s += "\n";
    });
}

inline std::string digits(Rng& r) {
    std::string text = parts(r, 4, [&](std::string& s, size_t) {
        size_t len = 1 + r.below(r.chance(20) ? 60 : 8);
        for (size_t k = 0; k < len; ++k) s += static_cast<char>('0' + r.below(10));
        s += r.pick(std::vector<std::string>{" ", ",", ".", "-", "+", " = ", "x", "th ", "%", "\n", ""});
    });
    if (r.chance(20)) text += "١٢٣ ४५६ ７８９ ½ Ⅻ ²³";
    return text;
}

inline std::string latex(Rng& r) {
    static const std::vector<std::string> pieces = {"\\frac{a}{b}",
                                                    "\\sum_{i=1}^{n} x_i",
                                                    "$x^2 + y^2 = z^2$",
                                                    "\\int_0^\\infty e^{-x}\\,dx",
                                                    "\\boxed{42}",
                                                    "\\begin{align} a &= b \\\\ c &= d \\end{align}",
                                                    "\\alpha\\beta\\gamma",
                                                    "$$\\sqrt[3]{27}$$",
                                                    "\\left( \\frac{1}{2} \\right)",
                                                    "\\mathbb{R}^{n \\times m}",
                                                    "\\text{if } x > 0",
                                                    "{}^{}_{}",
                                                    "\\\\"};
    std::string s;
    size_t n = 1 + r.below(6);
    for (size_t i = 0; i < n; ++i) s += r.pick(pieces) + (r.chance(50) ? " " : "");
    return s;
}

inline std::string cjk(Rng& r) {
    return parts(r, 8, [&](std::string& s, size_t) {
        switch (r.below(6)) {
            case 0:
                s += range_chars(r, 0x4E00, 0x9FA5, 1 + r.below(12));
                break;
            case 1:
                s += range_chars(r, 0x3041, 0x3096, 1 + r.below(8));
                break;
            case 2:
                s += range_chars(r, 0x30A1, 0x30FA, 1 + r.below(8));
                break;
            case 3:
                s += range_chars(r, 0xAC00, 0xD7A3, 1 + r.below(8));
                break;
            case 4:
                s += r.pick(
                    std::vector<std::string>{"，", "。", "！", "？", "「", "」", "、", "：", "（）", "《》"});
                break;
            default:
                s += r.pick(std::vector<std::string>{"你好，世界", "机器学习", "東京都", "こんにちは",
                                                     "안녕하세요", "中文English混合", "第123条",
                                                     "ＡＢＣ１２３"});
        }
        if (r.chance(20)) s += " ";
    });
}

inline std::string arabic_hindi(Rng& r) {
    return parts(r, 6, [&](std::string& s, size_t) {
        if (r.chance(50)) {
            for (size_t k = 0, m = 1 + r.below(8); k < m; ++k) {
                put(s, 0x0621 + static_cast<uint32_t>(r.below(0x064A - 0x0621 + 1)));
                if (r.chance(30)) put(s, 0x064B + static_cast<uint32_t>(r.below(8)));
            }
        } else {
            for (size_t k = 0, m = 1 + r.below(6); k < m; ++k) {
                put(s, 0x0905 + static_cast<uint32_t>(r.below(0x0939 - 0x0905 + 1)));
                if (r.chance(40)) put(s, 0x093E + static_cast<uint32_t>(r.below(0x094D - 0x093E + 1)));
            }
        }
        s += r.pick(std::vector<std::string>{" ", "، ", "। ", "؟", ""});
    });
}

inline std::string emoji(Rng& r) {
    static const std::vector<std::string> e = {"😀",
                                               "👍🏽",
                                               "👨‍👩‍👧‍👦",
                                               "🏳️‍🌈",
                                               "🇯🇵",
                                               "🇺🇸🇬🇧",
                                               "❤️",
                                               "🧑🏿‍💻",
                                               "👩‍❤️‍💋‍👨",
                                               "✋🏻",
                                               "🤷‍♀️",
                                               "🔥🔥🔥",
                                               "⌚",
                                               "☕️",
                                               "1️⃣",
                                               "#️⃣",
                                               "🫠",
                                               "🪿",
                                               "🐈‍⬛"};
    return parts(r, 6, [&](std::string& s, size_t) {
        s += r.pick(e);
        if (r.chance(40)) s += r.pick(english_words());
        if (r.chance(40)) s += " ";
    });
}

inline std::string combining(Rng& r) {
    return parts(r, 8, [&](std::string& s, size_t) {
        switch (r.below(4)) {
            case 0:  // a base letter with combining marks, often in non-canonical order
                put(s, static_cast<uint32_t>('a' + r.below(26)));
                for (size_t k = 0, m = 1 + r.below(3); k < m; ++k)
                    put(s, 0x0300 + static_cast<uint32_t>(r.below(0x70)));
                break;
            case 1:  // decomposed Hangul: L V (T)
                put(s, 0x1100 + static_cast<uint32_t>(r.below(19)));
                put(s, 0x1161 + static_cast<uint32_t>(r.below(21)));
                if (r.chance(50)) put(s, 0x11A8 + static_cast<uint32_t>(r.below(27)));
                break;
            case 2:
                s += r.pick(std::vector<std::string>{"e\u0301", "\u00e9", "A\u030a", "\u212b", "\u1e9b\u0323",
                                                     "o\u0302\u0301", "\u0301start", "x\u20dd", "\uFB01"});
                break;
            default:
                s += "Vi\u1ec7t Nam ti\u1ebfng vi\u00ea\u0323t";
        }
        if (r.chance(30)) s += " ";
    });
}

inline std::string whitespace(Rng& r) {
    static const std::vector<std::string> ws = {" ",      "  ",     "\t",     "\n",     "\r\n",   "\r",
                                                "\n\n\n", "\u00a0", "\u3000", "\u2028", "\u2029", "\u0085",
                                                "\u200b", "\v",     "\f",     "\x1c",   "\u1680", "\u2003",
                                                "\u202f", "\u205f", "\ufeff", "\u180e", " \n ",   "\t\t"};
    return parts(r, 10, [&](std::string& s, size_t) {
        s += r.pick(ws);
        if (r.chance(40)) s += r.pick(english_words());
    });
}

inline const std::vector<std::string>& special_strings() {
    static const std::vector<std::string> s = {
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
        "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
        "<|reserved_special_token_5|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
        "<｜Assistant｜>", "<｜tool▁sep｜>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
        "<|return|>", "<|constrain|>", "<|call|>", "<|startoftext|>",
        // near-misses
        "<|im_start|", "<|im_start", "|im_start|>", "<|im_startx|>", "<||>", "< |im_start|>", "<|IM_START|>",
        "<think >", "<thinking>", "<<|im_end|>>", "<|im_end|><|im_end|>", "<|", "|>", "<｜User",
        "<|reserved_special_token_|>", "<|eot_id", "<|begin_of_text|><|begin_of_text|>", "</think",
        "<｜begin_of_sentence｜>"};
    return s;
}

inline std::string specials(Rng& r) {
    return parts(r, 6, [&](std::string& s, size_t) {
        if (r.chance(60)) s += r.pick(special_strings());
        if (r.chance(50))
            s += r.pick(std::vector<std::string>{" ", "\n", "", "user\n", "Hello", " world", "\u0301"});
    });
}

inline std::string long_word(Rng& r) {
    size_t len = 100 + r.below(r.chance(20) ? 20000 : 1000);
    std::string s;
    switch (r.below(6)) {
        case 0:
            for (size_t i = 0; i < len; ++i) s += static_cast<char>('a' + r.below(26));
            break;
        case 1:
            s.assign(len, 'a');
            break;
        case 2:
            for (size_t i = 0; i < len; ++i) s += "ab";
            break;
        case 3:
            s.assign(len, ' ');
            s += "x";
            break;
        case 4:
            for (size_t i = 0; i < len / 3; ++i) put(s, 0x4E00 + static_cast<uint32_t>(r.below(50)));
            break;
        default:
            for (size_t i = 0; i < len; ++i) s += static_cast<char>('0' + r.below(10));
    }
    return s;
}

// Any scalar value (no surrogates) that utf8proc's Unicode version assigns, plus private use:
// all planes, the Basic Multilingual Plane more often. (Code points assigned by later Unicode
// versions than the library's tables may be classified differently from Hugging Face's.)
inline std::string random_code_points(Rng& r) {
    return parts(r, 12, [&](std::string& s, size_t) {
        uint32_t cp;
        do {
            cp = static_cast<uint32_t>(r.chance(50)   ? r.below(0x800)
                                       : r.chance(60) ? r.below(0x10000)
                                                      : r.below(0x110000));
        } while ((cp >= 0xD800 && cp <= 0xDFFF) ||
                 utf8proc_category(static_cast<utf8proc_int32_t>(cp)) == UTF8PROC_CATEGORY_CN);
        put(s, cp);
    });
}

// The corpus: `n` strings, the same for the same seed.
inline std::vector<std::string> tokenizer_corpus(size_t n, uint64_t seed = 25) {
    Rng r(seed);
    std::vector<std::string> out = {"",
                                    " ",
                                    "  ",
                                    "\n",
                                    "\r\n",
                                    "a",
                                    "Hello world",
                                    " Hello",
                                    "Hello ",
                                    "'s",
                                    "'S",
                                    "\t\tx  \n",
                                    "<|im_start|>user\nHi<|im_end|>\n",
                                    "don't stop"};
    using Gen = std::string (*)(Rng&);
    const std::vector<Gen> gens = {english, code,      digits,     latex,    cjk,       arabic_hindi,
                                   emoji,   combining, whitespace, specials, long_word, random_code_points};
    while (out.size() < n) {
        if (r.chance(25)) {  // a mix of several kinds
            std::string s;
            for (size_t k = 0, m = 2 + r.below(3); k < m; ++k) {
                Gen g = gens[r.below(gens.size())];
                if (g == long_word) continue;
                s += g(r);
            }
            out.push_back(s);
        } else {
            out.push_back(gens[r.below(gens.size())](r));
        }
    }
    return out;
}

}  // namespace moerl::text::testing
