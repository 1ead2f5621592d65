// Added and special tokens: found in the text before the pre-tokenizer runs, with Hugging Face's
// leftmost-longest matching and lstrip / rstrip / single_word rules.
#pragma once

#include <string>
#include <vector>

#include "internal.hpp"

namespace moerl::text::detail {

struct AddedToken {
    std::string content;
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
};

// Finds one set of tokens (those matched on the raw text, or those matched on normalised text).
class TokenMatcher {
  public:
    // `patterns[k]` is the text matched for tokens[k] (normalised content for normalized tokens).
    void build(const std::vector<const AddedToken*>& tokens, const std::vector<std::string>& patterns);
    bool empty() const { return tokens_.empty(); }
    // Splits `text` into token pieces and text pieces (appended to out).
    void split(std::string_view text, std::vector<Piece>& out) const;

  private:
    // Longest token starting at text[i], or -1.
    int longest_at(std::string_view text, size_t i, size_t& len) const;
    struct Node {
        std::vector<std::pair<unsigned char, int32_t>> children;
        int32_t token = -1;  // index into tokens_
    };
    std::vector<Node> nodes_;
    std::vector<const AddedToken*> tokens_;
    bool first_byte_[256] = {};
};

}  // namespace moerl::text::detail
