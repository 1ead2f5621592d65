// The syntax tree: one node type whose fields each kind uses as its comment says.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace moerl::text::jinja::detail {

enum class NodeKind {
    Program,  // body
    Text,     // text: literal output
    Comment,
    StringLit,   // text
    IntegerLit,  // number
    FloatLit,    // number
    ArrayLit,    // items
    TupleLit,    // items
    ObjectLit,   // items: key, value, key, value, ...
    Identifier,  // text: name
    Member,      // a: object, b: property (Identifier, IntegerLit, any expression or Slice), flag: computed
    Slice,       // a: start, b: stop, c: step (each may be null)
    Call,        // a: callee, items: arguments
    KeywordArg,  // text: name, a: value
    Spread,      // a: *argument
    KeywordSpread,  // a: **argument
    Unary,          // text: "not", "-" or "+", a: operand
    Binary,         // text: operator, a: left, b: right
    Filter,         // a: operand, b: the filter (Identifier or Call)
    Test,           // a: operand, text: test name, flag: negated
    Select,         // a: value, b: condition (`x if c` without else)
    Ternary,        // a: condition, b: if true, c: if false
    If,             // a: test, body, alternate
    For,            // a: loop target (Identifier or TupleLit), b: iterable, body, alternate: else block
    Set,            // a: target, b: value (null for a block set), body
    Macro,          // text: name, items: parameters (Identifier or KeywordArg), body
    CallBlock,      // a: the Call, items: caller parameters, body
    FilterBlock,    // a: the filter (Identifier or Call), body
    Break,
    Continue,
};

struct Node;
using NodePtr = std::shared_ptr<const Node>;

struct Node {
    NodeKind kind;
    int line = 0;
    int column = 0;
    std::string text;
    double number = 0;
    bool flag = false;
    NodePtr a, b, c;
    std::vector<NodePtr> items, body, alternate;
};

const char* node_name(NodeKind kind);  // for error messages ("filter", "for loop", ...)

// Parses tokens to a Program; throws TemplateError naming the line, column and construct.
struct Token;
NodePtr parse(const std::vector<Token>& tokens);

}  // namespace moerl::text::jinja::detail
