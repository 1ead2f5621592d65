#include "added_tokens.hpp"

#include <utf8proc.h>

#include <cstring>

namespace moerl::text::detail {

void TokenMatcher::build(const std::vector<const AddedToken*>& tokens,
                         const std::vector<std::string>& patterns) {
    tokens_ = tokens;
    nodes_.assign(1, Node{});
    for (size_t k = 0; k < tokens.size(); ++k) {
        const std::string& p = patterns[k];
        if (p.empty()) continue;
        first_byte_[static_cast<unsigned char>(p[0])] = true;
        int32_t at = 0;
        for (char ch : p) {
            auto c = static_cast<unsigned char>(ch);
            int32_t next = -1;
            for (auto& [byte, child] : nodes_[at].children)
                if (byte == c) next = child;
            if (next < 0) {
                next = static_cast<int32_t>(nodes_.size());
                nodes_[at].children.emplace_back(c, next);
                nodes_.emplace_back();
            }
            at = next;
        }
        // Two tokens with the same text: the first one added wins, as in HF's trie.
        if (nodes_[at].token < 0) nodes_[at].token = static_cast<int32_t>(k);
    }
}

int TokenMatcher::longest_at(std::string_view text, size_t i, size_t& len) const {
    int32_t at = 0, best = -1;
    for (size_t j = i; j < text.size(); ++j) {
        auto c = static_cast<unsigned char>(text[j]);
        int32_t next = -1;
        for (auto& [byte, child] : nodes_[at].children)
            if (byte == c) {
                next = child;
                break;
            }
        if (next < 0) break;
        at = next;
        if (nodes_[at].token >= 0) {
            best = nodes_[at].token;
            len = j + 1 - i;
        }
    }
    return best;
}

namespace {
uint32_t code_point_before(std::string_view s, size_t end, size_t& begin) {
    begin = end - 1;
    while (begin > 0 && (static_cast<unsigned char>(s[begin]) & 0xC0) == 0x80) --begin;
    size_t i = begin;
    return next_code_point(s, i);
}
// A character of regex \w (alphabetic, marks, decimal digits, connector punctuation, joiners):
// what Hugging Face's single_word looks at beside a match.
bool is_word_char(uint32_t cp) {
    if (cp == 0x200C || cp == 0x200D) return true;
    auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
    return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_ND) || c == UTF8PROC_CATEGORY_NL ||
           c == UTF8PROC_CATEGORY_PC;
}
}  // namespace

void TokenMatcher::split(std::string_view text, std::vector<Piece>& out) const {
    auto push_text = [&](size_t b, size_t e) {
        if (e > b) out.push_back({text.data() + b, static_cast<uint32_t>(e - b), -1});
    };
    if (tokens_.empty()) {
        push_text(0, text.size());
        return;
    }
    size_t done = 0;  // end of the last emitted piece
    size_t i = 0;
    while (i < text.size()) {
        if (!first_byte_[static_cast<unsigned char>(text[i])]) {
            const void* hit = nullptr;
            // Jump to the next byte that can start a token.
            for (size_t j = i + 1; j < text.size(); ++j)
                if (first_byte_[static_cast<unsigned char>(text[j])]) {
                    hit = text.data() + j;
                    break;
                }
            if (hit == nullptr) break;
            i = static_cast<const char*>(hit) - text.data();
        }
        size_t len = 0;
        int k = longest_at(text, i, len);
        if (k < 0) {
            ++i;
            continue;
        }
        const AddedToken& t = *tokens_[k];
        size_t start = i, stop = i + len;
        i = stop;  // matches never overlap, even when this one is then rejected
        if (t.single_word) {
            size_t b;
            bool word_before = start > 0 && is_word_char(code_point_before(text, start, b));
            size_t j = stop;
            bool word_after = stop < text.size() && is_word_char(next_code_point(text, j));
            if (word_before || word_after) continue;
        }
        if (t.lstrip) {
            size_t s = start;
            while (s > done) {
                size_t b;
                if (!is_whitespace(code_point_before(text, s, b))) break;
                s = b;
            }
            start = s;
        }
        if (t.rstrip) {
            while (stop < text.size()) {
                size_t j = stop;
                if (!is_whitespace(next_code_point(text, j))) break;
                stop = j;
            }
            i = stop;
        }
        push_text(done, start);
        out.push_back({text.data() + start, static_cast<uint32_t>(stop - start), t.id});
        done = stop;
    }
    push_text(done, text.size());
}

}  // namespace moerl::text::detail
