#include "template/lexer.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string_view>

#include "moerl/text/jinja.hpp"
#include "template/unicode.hpp"

namespace moerl::text::jinja::detail {

const char* tok_name(Tok t) {
    static const char* kNames[] = {
        "text",
        "number",
        "string",
        "identifier",
        "'='",
        "'('",
        "')'",
        "'{%'",
        "'%}'",
        "'{{'",
        "'}}'",
        "'['",
        "']'",
        "'{'",
        "'}'",
        "','",
        "'.'",
        "':'",
        "'|'",
        "additive operator",
        "multiplicative operator",
        "'**'",
        "comparison operator",
        "unary operator",
        "comment",
    };
    return kNames[static_cast<int>(t)];
}

namespace {

// The preprocessed text and, for each of its bytes, the offset of that byte in the source.
struct Preprocessed {
    std::string text;
    std::vector<std::uint32_t> origin;
    explicit Preprocessed(std::size_t capacity) {
        text.reserve(capacity);
        origin.reserve(capacity);
    }
    void push(char c, std::size_t from) {
        text.push_back(c);
        origin.push_back(static_cast<std::uint32_t>(from));
    }
};

// Appends in[from, to) to out.
void copy_of(const Preprocessed& in, std::size_t from, std::size_t to, Preprocessed& out) {
    out.text.append(in.text, from, to - from);
    out.origin.insert(out.origin.end(), in.origin.begin() + static_cast<std::ptrdiff_t>(from),
                      in.origin.begin() + static_cast<std::ptrdiff_t>(to));
}

bool at_line_start(std::string_view s, std::size_t i) {
    if (i == 0) return true;
    char p = s[i - 1];
    if (p == '\n' || p == '\r') return true;
    // U+2028 and U+2029 (E2 80 A8 / E2 80 A9) end lines for JavaScript's multiline ^ too
    return i >= 3 && s.substr(i - 3, 2) == "\xE2\x80" && (s[i - 1] == '\xA8' || s[i - 1] == '\xA9');
}

// Matches `{%-? \s* (end)?generation \s* -?%}` at s[i]; returns its end and the two '-' flags.
bool match_generation_tag(std::string_view s, std::size_t i, std::size_t& end, bool& lstrip, bool& rstrip) {
    if (s.substr(i, 2) != "{%") return false;
    std::size_t j = i + 2;
    lstrip = j < s.size() && s[j] == '-';
    if (lstrip) ++j;
    j += space_run(s, j);
    if (s.substr(j, 3) == "end") j += 3;
    if (s.substr(j, 10) != "generation") return false;
    j += 10;
    j += space_run(s, j);
    rstrip = j < s.size() && s[j] == '-';
    if (rstrip) ++j;
    if (s.substr(j, 2) != "%}") return false;
    end = j + 2;
    return true;
}

// The next line start after position i (see at_line_start), or npos.
std::size_t next_line_start(std::string_view s, std::size_t i) {
    for (std::size_t k = i;;) {
        k = s.find_first_of("\n\r\xA8\xA9", k);
        if (k == std::string_view::npos) return k;
        if (at_line_start(s, ++k)) return k;
    }
}

Preprocessed preprocess(const std::string& source) {
    std::size_t n = source.size();
    if (n > 0 && source[n - 1] == '\n') --n;  // a single trailing newline is dropped
    Preprocessed p(n);
    p.text.assign(source, 0, n);
    p.origin.resize(n);
    std::iota(p.origin.begin(), p.origin.end(), 0u);

    // lstrip_blocks: spaces and tabs between a line start and {%, {# or {- go
    Preprocessed q(p.text.size());
    std::string_view t = p.text;
    std::size_t copied = 0;
    for (std::size_t i = 0; i != std::string_view::npos; i = next_line_start(t, i)) {
        std::size_t j = i;
        while (j < t.size() && (t[j] == ' ' || t[j] == '\t')) ++j;
        if (j > i && j + 1 < t.size() && t[j] == '{' &&
            (t[j + 1] == '#' || t[j + 1] == '%' || t[j + 1] == '-')) {
            copy_of(p, copied, i, q);
            copied = j;
        }
    }
    copy_of(p, copied, t.size(), q);

    // trim_blocks: the newline right after #}, %} or -} goes
    Preprocessed r(q.text.size());
    t = q.text;
    copied = 0;
    for (std::size_t k = t.find("}\n"); k != std::string_view::npos; k = t.find("}\n", k + 1)) {
        // the '#', '%' or '-' at k - 1, not inside the previous match
        if (k < copied + 1 || (t[k - 1] != '#' && t[k - 1] != '%' && t[k - 1] != '-')) continue;
        copy_of(q, copied, k + 1, r);
        copied = k + 2;
    }
    copy_of(q, copied, t.size(), r);
    if (r.text.find("generation") == std::string::npos) return r;

    // transformers' {% generation %} / {% endgeneration %} markers vanish with their '-' trims
    Preprocessed out(r.text.size());
    copied = 0;
    std::string_view s = r.text;
    for (std::size_t i = 0; i < s.size(); ++i) {
        std::size_t end;
        bool lstrip, rstrip;
        if (s[i] != '{' || !match_generation_tag(s, i, end, lstrip, rstrip)) continue;
        std::size_t before = std::max(space_run_start(s, i), copied);
        std::size_t after = end + space_run(s, end);
        copy_of(r, copied, lstrip ? before : i, out);
        if (!rstrip) copy_of(r, end, after, out);
        copied = after;
        i = after - 1;
    }
    copy_of(r, copied, s.size(), out);
    return out;
}

class Lexer {
  public:
    explicit Lexer(const std::string& source) : source_(source), pre_(preprocess(source)), src_(pre_.text) {
        line_starts_.push_back(0);
        for (std::size_t i = 0; i < source.size(); ++i)
            if (source[i] == '\n') line_starts_.push_back(i + 1);
    }

    std::vector<Token> run();

  private:
    // Tokens come in source order: the column counts on from the previous token's when both lie on
    // one line, so a template on one long line lexes in linear time (100k tokens: 28 s before).
    void position(std::size_t at, int& line, int& column) const {
        std::size_t offset = at < pre_.origin.size() ? pre_.origin[at] : source_.size();
        auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
        std::size_t start = *(it - 1);
        line = static_cast<int>(it - line_starts_.begin());
        std::size_t from = start;
        std::size_t counted = 0;
        if (last_.line_start == start && last_.offset >= start && last_.offset <= offset) {
            from = last_.offset;
            counted = last_.code_points;
        }
        counted += num_code_points(std::string_view(source_).substr(from, offset - from));
        last_ = {start, offset, counted};
        column = static_cast<int>(counted) + 1;
    }
    struct LastPosition {
        std::size_t line_start = 0, offset = 0, code_points = 0;
    };
    mutable LastPosition last_;
    [[noreturn]] void fail(const std::string& what, std::size_t at) const {
        int line, column;
        position(at, line, column);
        throw TemplateError("chat template syntax error at line " + std::to_string(line) + ", column " +
                                std::to_string(column) + ": " + what,
                            line, column, __FILE__, __LINE__);
    }
    void push(Tok type, std::string value, std::size_t at) {
        Token t{type, std::move(value)};
        position(at, t.line, t.column);
        tokens_.push_back(std::move(t));
    }
    Tok last_type() const { return tokens_.back().type; }
    bool starts(std::string_view seq) const { return src_.substr(pos_, seq.size()) == seq; }

    // Consumes characters while pred holds, decoding backslash escapes; like the reference,
    // reaching the end of the input inside the run is an error.
    template <typename Pred>
    std::string consume_while(Pred pred, std::size_t token_start);
    void strip_trailing_whitespace();
    void skip_leading_whitespace() { pos_ += space_run(src_, pos_); }

    const std::string& source_;
    Preprocessed pre_;
    std::string_view src_;
    std::vector<std::size_t> line_starts_;
    std::vector<Token> tokens_;
    std::size_t pos_ = 0;
};

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_word(char c) { return is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }

template <typename Pred>
std::string Lexer::consume_while(Pred pred, std::size_t token_start) {
    std::string out;
    while (pos_ < src_.size() && pred(src_[pos_])) {
        if (src_[pos_] == '\\') {
            ++pos_;
            if (pos_ >= src_.size()) fail("unexpected end of input in a string literal", token_start);
            char e = src_[pos_++];
            if (e == 'x' || e == 'u') {
                std::size_t len = e == 'x' ? 2 : 4;
                auto hex = src_.substr(pos_, len);
                if (hex.size() != len ||
                    hex.find_first_not_of("0123456789abcdefABCDEF") != std::string_view::npos)
                    fail("invalid hexadecimal escape \\" + std::string(1, e) + std::string(hex), pos_ - 2);
                char32_t unit = static_cast<char32_t>(std::stoul(std::string(hex), nullptr, 16));
                pos_ += len;
                // a \uD83D\uDE00 pair makes one code point; a lone surrogate prints as U+FFFD
                if (unit >= 0xD800 && unit < 0xDC00 && src_.substr(pos_, 2) == "\\u") {
                    auto low_hex = src_.substr(pos_ + 2, 4);
                    if (low_hex.size() == 4 &&
                        low_hex.find_first_not_of("0123456789abcdefABCDEF") == std::string_view::npos) {
                        char32_t low = static_cast<char32_t>(std::stoul(std::string(low_hex), nullptr, 16));
                        if (low >= 0xDC00 && low < 0xE000) {
                            append_utf8(out, 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00));
                            pos_ += 6;
                            continue;
                        }
                    }
                }
                append_utf8(out, unit >= 0xD800 && unit < 0xE000 ? 0xFFFD : unit);
                continue;
            }
            switch (e) {
                case 'n':
                    out += '\n';
                    break;
                case 't':
                    out += '\t';
                    break;
                case 'r':
                    out += '\r';
                    break;
                case 'b':
                    out += '\b';
                    break;
                case 'f':
                    out += '\f';
                    break;
                case 'v':
                    out += '\v';
                    break;
                case '\'':
                    out += '\'';
                    break;
                case '"':
                    out += '"';
                    break;
                case '\\':
                    out += '\\';
                    break;
                default:
                    fail(std::string("unknown escape \\") + e + " in a string literal", pos_ - 2);
            }
            continue;
        }
        out += src_[pos_++];
        if (pos_ >= src_.size()) fail("unexpected end of input (an unclosed tag or string)", token_start);
    }
    return out;
}

void Lexer::strip_trailing_whitespace() {
    if (tokens_.empty() || tokens_.back().type != Tok::Text) return;
    auto& v = tokens_.back().value;
    v.resize(trim_end(v).size());
    if (v.empty()) tokens_.pop_back();
}

std::vector<Token> Lexer::run() {
    struct Seq {
        std::string_view text;
        Tok type;
    };
    static const Seq kTable[] = {
        {"{%", Tok::OpenStatement},  {"%}", Tok::CloseStatement},
        {"{{", Tok::OpenExpression}, {"}}", Tok::CloseExpression},
        {"(", Tok::OpenParen},       {")", Tok::CloseParen},
        {"{", Tok::OpenCurly},       {"}", Tok::CloseCurly},
        {"[", Tok::OpenSquare},      {"]", Tok::CloseSquare},
        {",", Tok::Comma},           {".", Tok::Dot},
        {":", Tok::Colon},           {"|", Tok::Pipe},
        {"<=", Tok::Comparison},     {">=", Tok::Comparison},
        {"==", Tok::Comparison},     {"!=", Tok::Comparison},
        {"<", Tok::Comparison},      {">", Tok::Comparison},
        {"+", Tok::Additive},        {"-", Tok::Additive},
        {"~", Tok::Additive},        {"**", Tok::Power},
        {"*", Tok::Multiplicative},  {"//", Tok::Multiplicative},
        {"/", Tok::Multiplicative},  {"%", Tok::Multiplicative},
        {"=", Tok::Equals},
    };
    int curly_depth = 0;
    while (pos_ < src_.size()) {
        if (tokens_.empty() || last_type() == Tok::CloseStatement || last_type() == Tok::CloseExpression ||
            last_type() == Tok::Comment) {
            std::size_t start = pos_;
            while (pos_ < src_.size() &&
                   !(src_[pos_] == '{' && pos_ + 1 < src_.size() &&
                     (src_[pos_ + 1] == '%' || src_[pos_ + 1] == '{' || src_[pos_ + 1] == '#'))) {
                ++pos_;
            }
            if (pos_ > start) {
                push(Tok::Text, std::string(src_.substr(start, pos_ - start)), start);
                continue;
            }
        }

        std::size_t start = pos_;
        if (starts("{#")) {
            pos_ += 2;
            bool strip_before = pos_ < src_.size() && src_[pos_] == '-';
            if (strip_before) ++pos_;
            std::string comment;
            while (src_.substr(pos_, 2) != "#}") {
                if (pos_ + 2 >= src_.size()) fail("unclosed comment (no '#}')", start);
                comment += src_[pos_++];
            }
            bool strip_after = !comment.empty() && comment.back() == '-';
            if (strip_after) comment.pop_back();
            if (strip_before) strip_trailing_whitespace();
            push(Tok::Comment, comment, start);
            pos_ += 2;
            if (strip_after) skip_leading_whitespace();
            continue;
        }
        if (starts("{%-")) {
            strip_trailing_whitespace();
            push(Tok::OpenStatement, "{%", start);
            pos_ += 3;
            continue;
        }
        if (starts("{{-")) {
            strip_trailing_whitespace();
            push(Tok::OpenExpression, "{{", start);
            curly_depth = 0;
            pos_ += 3;
            continue;
        }
        // whitespace inside a tag is skipped; like the reference, running into the end is an error
        if (std::size_t ws = space_run(src_, pos_); ws > 0) {
            if (pos_ + ws >= src_.size()) fail("unexpected end of input (an unclosed tag)", start);
            pos_ += ws;
        }
        start = pos_;
        if (starts("-%}")) {
            push(Tok::CloseStatement, "%}", start);
            pos_ += 3;
            skip_leading_whitespace();
            continue;
        }
        if (starts("-}}")) {
            push(Tok::CloseExpression, "}}", start);
            pos_ += 3;
            skip_leading_whitespace();
            continue;
        }
        char c = src_[pos_];
        if (c == '-' || c == '+') {
            Tok last = tokens_.empty() ? Tok::Text : last_type();
            if (last == Tok::Text) fail(std::string("unexpected character '") + c + "'", start);
            bool binary = last == Tok::Identifier || last == Tok::Number || last == Tok::String ||
                          last == Tok::CloseParen || last == Tok::CloseSquare;
            if (!binary) {
                ++pos_;
                std::string num = consume_while(is_digit, start);
                if (!num.empty() && pos_ + 1 < src_.size() && src_[pos_] == '.' && is_digit(src_[pos_ + 1])) {
                    ++pos_;
                    num += "." + consume_while(is_digit, start);
                }
                push(num.empty() ? Tok::Unary : Tok::Number, std::string(1, c) + num, start);
                continue;
            }
        }
        bool matched = false;
        for (const auto& seq : kTable) {
            if (seq.text == "}}" && curly_depth > 0) continue;
            if (!starts(seq.text)) continue;
            push(seq.type, std::string(seq.text), start);
            if (seq.type == Tok::OpenExpression) curly_depth = 0;
            if (seq.type == Tok::OpenCurly) ++curly_depth;
            if (seq.type == Tok::CloseCurly) --curly_depth;
            pos_ += seq.text.size();
            matched = true;
            break;
        }
        if (matched) continue;
        if (c == '\'' || c == '"') {
            ++pos_;
            std::string s = consume_while([c](char x) { return x != c; }, start);
            if (pos_ >= src_.size()) fail("unterminated string literal", start);
            push(Tok::String, std::move(s), start);
            ++pos_;
            continue;
        }
        if (is_digit(c)) {
            std::string num = consume_while(is_digit, start);
            if (last_type() != Tok::Dot && pos_ + 1 < src_.size() && src_[pos_] == '.' &&
                is_digit(src_[pos_ + 1])) {
                ++pos_;
                num += "." + consume_while(is_digit, start);
            }
            push(Tok::Number, std::move(num), start);
            continue;
        }
        if (is_word(c)) {
            push(Tok::Identifier, consume_while(is_word, start), start);
            continue;
        }
        std::size_t j = pos_;
        std::string ch;
        append_utf8(ch, next_code_point(src_, j));
        fail("unexpected character '" + ch + "'", start);
    }
    return std::move(tokens_);
}

}  // namespace

std::vector<Token> tokenize(const std::string& source) { return Lexer(source).run(); }

}  // namespace moerl::text::jinja::detail
