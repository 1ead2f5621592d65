// Template source to tokens, as @huggingface/jinja's lexer does it (same preprocessing, same
// whitespace control, same token kinds), with each token's line and column in the source.
#pragma once

#include <string>
#include <vector>

namespace moerl::text::jinja::detail {

enum class Tok {
    Text,
    Number,
    String,
    Identifier,
    Equals,
    OpenParen,
    CloseParen,
    OpenStatement,
    CloseStatement,
    OpenExpression,
    CloseExpression,
    OpenSquare,
    CloseSquare,
    OpenCurly,
    CloseCurly,
    Comma,
    Dot,
    Colon,
    Pipe,
    Additive,
    Multiplicative,
    Power,
    Comparison,
    Unary,
    Comment,
};

const char* tok_name(Tok t);

struct Token {
    Tok type;
    std::string value;
    int line = 0;
    int column = 0;
};

// Throws TemplateError on a malformed token (unterminated string or comment, bad escape, a
// character that starts no token).
std::vector<Token> tokenize(const std::string& source);

}  // namespace moerl::text::jinja::detail
