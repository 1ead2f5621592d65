// Recursive descent over the tokens with @huggingface/jinja's grammar and precedence (lowest
// first): ternary, or, and, not, comparison and membership, + - ~, * / // %, **, is-tests,
// filters, unary sign, call/member, primary.
#include <initializer_list>
#include <set>
#include <string>

#include "moerl/text/jinja.hpp"
#include "template/ast.hpp"
#include "template/lexer.hpp"

namespace moerl::text::jinja::detail {

const char* node_name(NodeKind kind) {
    switch (kind) {
        case NodeKind::Member:
            return "member access";
        case NodeKind::Slice:
            return "slice";
        case NodeKind::Call:
            return "call";
        case NodeKind::Unary:
            return "unary operator";
        case NodeKind::Binary:
            return "operator";
        case NodeKind::Filter:
            return "filter";
        case NodeKind::Test:
            return "test";
        case NodeKind::If:
            return "{% if %}";
        case NodeKind::For:
            return "{% for %}";
        case NodeKind::Set:
            return "{% set %}";
        case NodeKind::Macro:
            return "{% macro %}";
        case NodeKind::CallBlock:
            return "{% call %}";
        case NodeKind::FilterBlock:
            return "{% filter %}";
        default:
            return "expression";
    }
}

namespace {

// Tags that end a block; met where no open block takes them, they are an error.
const std::set<std::string> kClosers = {"endif",   "endfor",    "endset", "endmacro",
                                        "endcall", "endfilter", "elif",   "else"};

class Parser {
  public:
    explicit Parser(const std::vector<Token>& tokens) : t_(tokens) {}

    NodePtr program() {
        auto p = std::make_shared<Node>();
        p->kind = NodeKind::Program;
        p->line = p->column = 1;
        while (i_ < t_.size()) p->body.push_back(any());
        return p;
    }

  private:
    using Mut = std::shared_ptr<Node>;

    [[noreturn]] void fail(const std::string& what, const Token* at) const {
        int line = at ? at->line : (t_.empty() ? 1 : t_.back().line);
        int column = at ? at->column : (t_.empty() ? 1 : t_.back().column);
        throw TemplateError("chat template syntax error at line " + std::to_string(line) + ", column " +
                                std::to_string(column) + ": " + what,
                            line, column, __FILE__, __LINE__);
    }
    // Nesting of expressions (brackets, signs) and of blocks: each level takes tens of parser frames,
    // so a bound keeps a hostile template from exhausting the stack; real templates nest a few.
    static constexpr int kMaxNesting = 128;
    struct Nested {
        Parser& p;
        Nested(Parser& parser, const Token* at) : p(parser) {
            if (++p.nesting_ > kMaxNesting)
                p.fail("nested more than " + std::to_string(kMaxNesting) +
                           " levels deep (brackets, signs or blocks)",
                       at);
        }
        ~Nested() { --p.nesting_; }
        Nested(const Nested&) = delete;
        Nested& operator=(const Nested&) = delete;
    };
    int nesting_ = 0;

    const Token* peek(std::size_t k = 0) const { return i_ + k < t_.size() ? &t_[i_ + k] : nullptr; }
    const Token& next(const char* expected) {
        if (i_ >= t_.size()) fail(std::string("unexpected end of template, expected ") + expected, nullptr);
        return t_[i_++];
    }
    bool is(Tok type, std::size_t k = 0) const { return peek(k) && peek(k)->type == type; }
    bool is_ident(const char* name, std::size_t k = 0) const {
        return is(Tok::Identifier, k) && peek(k)->value == name;
    }
    const Token& expect(Tok type, const char* what) {
        const Token& tok = next(what);
        if (tok.type != type) fail(std::string("expected ") + what + ", found " + describe(tok), &tok);
        return tok;
    }
    static std::string describe(const Token& tok) {
        if (tok.type == Tok::Identifier) return "'" + tok.value + "'";
        if (tok.type == Tok::Text) return "text";
        if (tok.type == Tok::String) return "string '" + tok.value + "'";
        if (tok.type == Tok::Number) return "number " + tok.value;
        return tok_name(tok.type);
    }
    void expect_ident(const char* name) {
        const Token& tok = next(name);
        if (tok.type != Tok::Identifier || tok.value != name)
            fail(std::string("expected '") + name + "', found " + describe(tok), &tok);
    }
    bool is_statement(std::initializer_list<const char*> names) const {
        if (!is(Tok::OpenStatement) || !is(Tok::Identifier, 1)) return false;
        for (const char* n : names)
            if (peek(1)->value == n) return true;
        return false;
    }
    static Mut make(NodeKind kind, const Token& at) {
        auto n = std::make_shared<Node>();
        n->kind = kind;
        n->line = at.line;
        n->column = at.column;
        return n;
    }

    // Statements up to one of `ends` (not consumed); the end of the input there is an unclosed block.
    std::vector<NodePtr> block_until(std::initializer_list<const char*> ends, const Token& opener,
                                     const char* what) {
        std::vector<NodePtr> body;
        while (!is_statement(ends)) {
            if (i_ >= t_.size())
                fail(std::string("unclosed ") + what + " opened at line " + std::to_string(opener.line) +
                         ", column " + std::to_string(opener.column) + ": expected {% " + *ends.begin() +
                         " %} before the end",
                     nullptr);
            if (is(Tok::OpenStatement) && is(Tok::Identifier, 1) && kClosers.count(peek(1)->value))
                fail("found {% " + peek(1)->value + " %} where {% " + *ends.begin() +
                         " %} was expected (to close the " + what + " opened at line " +
                         std::to_string(opener.line) + ", column " + std::to_string(opener.column) + ")",
                     peek());
            body.push_back(any());
        }
        return body;
    }
    // `%}`, the statements up to {% end_name %}, and that closing tag.
    std::vector<NodePtr> block_to_end(const Token& opener, const char* end_name, const char* what) {
        expect(Tok::CloseStatement, "'%}'");
        std::vector<NodePtr> body = block_until({end_name}, opener, what);
        close_block(end_name);
        return body;
    }
    void close_block(const char* end_name) {
        expect(Tok::OpenStatement, "'{%'");
        expect_ident(end_name);
        expect(Tok::CloseStatement, "'%}'");
    }

    NodePtr any() {
        const Token& tok = t_[i_];
        const Nested nested(*this, &tok);
        switch (tok.type) {
            case Tok::Comment: {
                ++i_;
                return make(NodeKind::Comment, tok);
            }
            case Tok::Text: {
                ++i_;
                auto n = make(NodeKind::Text, tok);
                n->text = tok.value;
                return n;
            }
            case Tok::OpenStatement:
                return statement();
            case Tok::OpenExpression: {
                ++i_;
                NodePtr e = expression();
                expect(Tok::CloseExpression, "'}}'");
                return e;
            }
            default:
                fail("unexpected " + describe(tok) + " outside a tag", &tok);
        }
    }

    NodePtr statement() {
        const Token& open = expect(Tok::OpenStatement, "'{%'");
        const Token& name_tok = next("a statement name");
        if (name_tok.type != Tok::Identifier)
            fail("expected a statement name after '{%', found " + describe(name_tok), &name_tok);
        const std::string& name = name_tok.value;
        if (name == "set") return set_statement(open);
        if (name == "if") {
            NodePtr n = if_statement(open);
            close_block("endif");
            return n;
        }
        if (name == "for") return for_statement(open);
        if (name == "macro") return macro_statement(open);
        if (name == "call") return call_statement(open);
        if (name == "filter") return filter_statement(open);
        if (name == "break" || name == "continue") {
            expect(Tok::CloseStatement, "'%}'");
            return make(name == "break" ? NodeKind::Break : NodeKind::Continue, open);
        }
        if (kClosers.count(name)) fail("'{% " + name + " %}' without a matching opening block", &open);
        fail("unsupported statement '{% " + name +
                 " %}' (supported: set, if, for, macro, call, filter, break, continue)",
             &open);
    }

    NodePtr set_statement(const Token& open) {
        auto n = make(NodeKind::Set, open);
        n->a = sequence(false);
        if (is(Tok::Equals)) {
            ++i_;
            n->b = sequence(false);
        } else {
            expect(Tok::CloseStatement, "'=' or '%}'");
            n->body = block_until({"endset"}, open, "{% set %} block");
            expect(Tok::OpenStatement, "'{%'");
            expect_ident("endset");
        }
        expect(Tok::CloseStatement, "'%}'");
        return n;
    }

    NodePtr if_statement(const Token& open) {
        auto n = make(NodeKind::If, open);
        n->a = expression();
        expect(Tok::CloseStatement, "'%}'");
        n->body = block_until({"endif", "elif", "else"}, open, "{% if %}");
        if (is_statement({"elif"})) {
            const Token& elif = t_[i_];
            i_ += 2;
            n->alternate.push_back(if_statement(elif));
        } else if (is_statement({"else"})) {
            i_ += 2;
            expect(Tok::CloseStatement, "'%}'");
            n->alternate = block_until({"endif"}, open, "{% if %}");
        }
        return n;
    }

    NodePtr for_statement(const Token& open) {
        auto n = make(NodeKind::For, open);
        n->a = sequence(true);
        if (n->a->kind != NodeKind::Identifier && n->a->kind != NodeKind::TupleLit)
            fail("expected a name or names after 'for'", peek());
        if (!is_ident("in")) fail("expected 'in' after the loop variable", peek());
        ++i_;
        n->b = expression();
        expect(Tok::CloseStatement, "'%}'");
        n->body = block_until({"endfor", "else"}, open, "{% for %}");
        if (is_statement({"else"})) {
            i_ += 2;
            expect(Tok::CloseStatement, "'%}'");
            n->alternate = block_until({"endfor"}, open, "{% for %}");
        }
        close_block("endfor");
        return n;
    }

    NodePtr macro_statement(const Token& open) {
        auto n = make(NodeKind::Macro, open);
        NodePtr name = primary();
        if (name->kind != NodeKind::Identifier) fail("expected a macro name", &open);
        n->text = name->text;
        n->items = arguments(true);
        n->body = block_to_end(open, "endmacro", "{% macro %}");
        return n;
    }

    NodePtr call_statement(const Token& open) {
        auto n = make(NodeKind::CallBlock, open);
        if (is(Tok::OpenParen)) n->items = arguments(true);
        NodePtr callee = primary();
        if (callee->kind != NodeKind::Identifier) fail("expected a macro name after 'call'", &open);
        auto call = make(NodeKind::Call, open);
        call->a = callee;
        call->items = arguments(false);
        n->a = call;
        n->body = block_to_end(open, "endcall", "{% call %}");
        return n;
    }

    NodePtr filter_statement(const Token& open) {
        auto n = make(NodeKind::FilterBlock, open);
        NodePtr f = primary();
        if (f->kind == NodeKind::Identifier && is(Tok::OpenParen)) f = call(f);
        n->a = f;
        n->body = block_to_end(open, "endfilter", "{% filter %}");
        return n;
    }

    // `a, b, c` as a tuple, or one expression.
    NodePtr sequence(bool primary_only) {
        const Token* first = peek();
        if (!first) fail("unexpected end of template, expected an expression", nullptr);
        std::vector<NodePtr> items{primary_only ? primary() : expression()};
        bool tuple = is(Tok::Comma);
        while (tuple) {
            ++i_;
            items.push_back(primary_only ? primary() : expression());
            if (!is(Tok::Comma)) break;
        }
        if (!tuple) return items[0];
        auto n = make(NodeKind::TupleLit, *first);
        n->items = std::move(items);
        return n;
    }

    NodePtr expression() {
        const Nested nested(*this, peek());
        NodePtr a = logical_or();
        if (is_ident("if")) {
            const Token& tok = t_[i_++];
            NodePtr test = logical_or();
            if (is_ident("else")) {
                ++i_;
                auto n = make(NodeKind::Ternary, tok);
                n->a = test;
                n->b = a;
                n->c = expression();
                return n;
            }
            auto n = make(NodeKind::Select, tok);
            n->a = a;
            n->b = test;
            return n;
        }
        return a;
    }

    NodePtr binary(const Token& op, std::string text, NodePtr left, NodePtr right) {
        auto n = make(NodeKind::Binary, op);
        n->text = std::move(text);
        n->a = std::move(left);
        n->b = std::move(right);
        return n;
    }

    // `a or b or c`, `a and b`: left-associative levels whose operator is a word.
    NodePtr left_assoc_word(const char* word, NodePtr (Parser::*next)()) {
        NodePtr left = (this->*next)();
        while (is_ident(word)) {
            const Token& op = t_[i_++];
            left = binary(op, word, left, (this->*next)());
        }
        return left;
    }
    NodePtr logical_or() { return left_assoc_word("or", &Parser::logical_and); }
    NodePtr logical_and() { return left_assoc_word("and", &Parser::logical_not); }
    NodePtr logical_not() {
        if (is_ident("not")) {
            const Token& op = t_[i_++];
            auto n = make(NodeKind::Unary, op);
            n->text = "not";
            n->a = logical_not();
            return n;
        }
        return comparison();
    }
    NodePtr comparison() {
        NodePtr left = additive();
        while (true) {
            const Token* op = peek();
            std::string text;
            if (is_ident("not") && is_ident("in", 1)) {
                text = "not in";
                i_ += 2;
            } else if (is_ident("in") || is(Tok::Comparison)) {
                text = op->value;
                ++i_;
            } else {
                break;
            }
            left = binary(*op, text, left, additive());
        }
        return left;
    }
    // One left-associative level: operands from `next`, joined by operators of token type `op`.
    NodePtr left_assoc(Tok op, NodePtr (Parser::*next)()) {
        NodePtr left = (this->*next)();
        while (is(op)) {
            const Token& tok = t_[i_++];
            left = binary(tok, tok.value, left, (this->*next)());
        }
        return left;
    }
    NodePtr additive() { return left_assoc(Tok::Additive, &Parser::multiplicative); }
    NodePtr multiplicative() { return left_assoc(Tok::Multiplicative, &Parser::power); }
    NodePtr power() { return left_assoc(Tok::Power, &Parser::test); }
    NodePtr test() {
        NodePtr operand = filter();
        while (is_ident("is")) {
            const Token& tok = t_[i_++];
            bool negate = is_ident("not");
            if (negate) ++i_;
            NodePtr name = primary();
            if (name->kind != NodeKind::Identifier) fail("expected a test name after 'is'", &tok);
            if (is(Tok::OpenParen))
                fail("tests with arguments ('is " + name->text + "(...)') are not supported", &tok);
            auto n = make(NodeKind::Test, tok);
            n->a = operand;
            n->text = name->text;
            n->flag = negate;
            operand = n;
        }
        return operand;
    }
    NodePtr filter() {
        NodePtr operand = unary_sign();
        while (is(Tok::Pipe)) {
            const Token& tok = t_[i_++];
            NodePtr f = primary();
            if (f->kind != NodeKind::Identifier) fail("expected a filter name after '|'", &tok);
            if (is(Tok::OpenParen)) f = call(f);
            auto n = make(NodeKind::Filter, tok);
            n->a = operand;
            n->b = f;
            operand = n;
        }
        return operand;
    }
    NodePtr unary_sign() {
        const Token* tok = peek();
        if (tok && (tok->type == Tok::Unary || tok->type == Tok::Additive) &&
            (tok->value == "-" || tok->value == "+")) {
            ++i_;
            const Nested nested(*this, tok);
            auto n = make(NodeKind::Unary, *tok);
            n->text = tok->value;
            n->a = unary_sign();
            return n;
        }
        NodePtr m = member(primary());
        return is(Tok::OpenParen) ? call(m) : m;
    }
    NodePtr call(NodePtr callee) {
        auto n = make(NodeKind::Call, *peek());
        n->line = callee->line;
        n->column = callee->column;
        n->a = std::move(callee);
        n->items = arguments(false);
        NodePtr e = member(n);
        return is(Tok::OpenParen) ? call(e) : e;
    }

    std::vector<NodePtr> arguments(bool parameters) {
        expect(Tok::OpenParen, "'('");
        std::vector<NodePtr> args;
        std::set<std::string> names;
        bool saw_keyword = false, saw_spread = false;
        while (!is(Tok::CloseParen)) {
            const Token* tok = peek();
            if (!tok) fail("unexpected end of template in an argument list, expected ')'", nullptr);
            bool kw_spread = is(Tok::Power);
            bool spread = is(Tok::Multiplicative) && tok->value == "*";
            if (parameters && (kw_spread || spread)) fail("argument unpacking in a parameter list", tok);
            if (kw_spread) {
                ++i_;
                auto n = make(NodeKind::KeywordSpread, *tok);
                n->a = expression();
                args.push_back(n);
                if (is(Tok::Comma)) ++i_;
                if (!is(Tok::CloseParen)) fail("'**' must be the last argument", peek());
                break;
            }
            NodePtr arg;
            if (spread) {
                if (saw_spread) fail("only one '*' argument unpacking is allowed", tok);
                saw_spread = true;
                ++i_;
                auto n = make(NodeKind::Spread, *tok);
                n->a = expression();
                arg = n;
            } else {
                arg = expression();
                if (is(Tok::Equals)) {
                    ++i_;
                    if (arg->kind != NodeKind::Identifier)
                        fail("expected a name before '=' in an argument list", tok);
                    auto n = make(NodeKind::KeywordArg, *tok);
                    n->text = arg->text;
                    n->a = expression();
                    arg = n;
                }
                if (parameters) {
                    if (arg->kind != NodeKind::Identifier && arg->kind != NodeKind::KeywordArg)
                        fail("expected a parameter name", tok);
                    if (!names.insert(arg->text).second) fail("duplicate parameter '" + arg->text + "'", tok);
                }
                if (arg->kind == NodeKind::KeywordArg)
                    saw_keyword = true;
                else if (saw_keyword)
                    fail(parameters ? "a parameter without default follows one with a default"
                                    : "a positional argument follows a keyword argument",
                         tok);
                else if (saw_spread)
                    fail("a positional argument follows '*' unpacking", tok);
            }
            args.push_back(arg);
            if (is(Tok::Comma)) ++i_;
        }
        expect(Tok::CloseParen, "')'");
        return args;
    }

    // [key], [i], [a:b:c]
    NodePtr subscript(const Token& open) {
        std::vector<NodePtr> parts;
        bool slice = false;
        while (!is(Tok::CloseSquare)) {
            if (!peek()) fail("unexpected end of template, expected ']'", nullptr);
            if (is(Tok::Colon)) {
                parts.push_back(nullptr);
                ++i_;
                slice = true;
            } else {
                parts.push_back(expression());
                if (is(Tok::Colon)) {
                    ++i_;
                    slice = true;
                }
            }
        }
        if (parts.empty()) fail("empty subscript '[]'", &open);
        if (!slice) return parts[0];
        if (parts.size() > 3) fail("a slice takes at most 3 parts", &open);
        auto n = make(NodeKind::Slice, open);
        n->a = parts.size() > 0 ? parts[0] : nullptr;
        n->b = parts.size() > 1 ? parts[1] : nullptr;
        n->c = parts.size() > 2 ? parts[2] : nullptr;
        return n;
    }

    NodePtr member(NodePtr object) {
        while (is(Tok::Dot) || is(Tok::OpenSquare)) {
            const Token& op = t_[i_++];
            auto n = make(NodeKind::Member, op);
            n->a = object;
            n->flag = op.type == Tok::OpenSquare;
            if (n->flag) {
                n->b = subscript(op);
                expect(Tok::CloseSquare, "']'");
            } else {
                n->b = primary();
                if (n->b->kind != NodeKind::Identifier && n->b->kind != NodeKind::IntegerLit)
                    fail("expected a name or an integer after '.'", &op);
            }
            object = n;
        }
        return object;
    }

    NodePtr primary() {
        const Token& tok = next("an expression");
        switch (tok.type) {
            case Tok::Number: {
                bool is_float = tok.value.find('.') != std::string::npos;
                auto n = make(is_float ? NodeKind::FloatLit : NodeKind::IntegerLit, tok);
                n->number = std::stod(tok.value);
                return n;
            }
            case Tok::String: {
                auto n = make(NodeKind::StringLit, tok);
                n->text = tok.value;
                while (is(Tok::String)) n->text += t_[i_++].value;  // 'a' 'b' is 'ab'
                return n;
            }
            case Tok::Identifier: {
                auto n = make(NodeKind::Identifier, tok);
                n->text = tok.value;
                return n;
            }
            case Tok::OpenParen: {
                NodePtr e = sequence(false);
                expect(Tok::CloseParen, "')'");
                return e;
            }
            case Tok::OpenSquare: {
                auto n = make(NodeKind::ArrayLit, tok);
                while (!is(Tok::CloseSquare)) {
                    if (!peek()) fail("unexpected end of template in a list, expected ']'", &tok);
                    n->items.push_back(expression());
                    if (is(Tok::Comma)) ++i_;
                }
                ++i_;
                return n;
            }
            case Tok::OpenCurly: {
                auto n = make(NodeKind::ObjectLit, tok);
                while (!is(Tok::CloseCurly)) {
                    if (!peek()) fail("unexpected end of template in a dict, expected '}'", &tok);
                    n->items.push_back(expression());
                    expect(Tok::Colon, "':' between key and value");
                    n->items.push_back(expression());
                    if (is(Tok::Comma)) ++i_;
                }
                ++i_;
                return n;
            }
            default:
                fail("unexpected " + describe(tok) + ", expected an expression", &tok);
        }
    }

    const std::vector<Token>& t_;
    std::size_t i_ = 0;
};

}  // namespace

NodePtr parse(const std::vector<Token>& tokens) { return Parser(tokens).program(); }

}  // namespace moerl::text::jinja::detail
