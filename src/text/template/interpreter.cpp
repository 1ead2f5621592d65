#include "template/interpreter.hpp"

#include <algorithm>
#include <cmath>
#include <optional>

#include "moerl/text/jinja.hpp"
#include "template/unicode.hpp"

namespace moerl::text::jinja::detail {

namespace {
struct BreakSignal {};
struct ContinueSignal {};

[[noreturn]] void fail(std::string message) { throw EvalError{std::move(message)}; }

// The item `x[i]` reads from a sequence of n items, or none when i is out of range. A negative i
// counts from the end; a NaN index (from `x % 0`) reads item 0, as the reference does.
std::optional<std::size_t> element_position(double index, std::size_t n) {
    double i = std::isnan(index) ? 0 : std::trunc(index);
    double len = static_cast<double>(n);
    if (i < 0) i += len;
    if (i < 0 || i >= len) return std::nullopt;
    return static_cast<std::size_t>(i);
}

// Python's slice over a sequence of n items: the indices it picks.
std::vector<std::size_t> slice_indices(std::size_t n, const Value& start_v, const Value& stop_v,
                                       const Value& step_v) {
    double len = static_cast<double>(n);
    double step = step_v.kind == Kind::Undefined ? 1 : step_v.number;
    std::vector<std::size_t> out;
    if (step == 0) fail("slice step cannot be zero");
    double start, stop;
    if (step > 0) {
        start = start_v.kind == Kind::Undefined ? 0 : start_v.number;
        stop = stop_v.kind == Kind::Undefined ? len : stop_v.number;
        start = start < 0 ? std::max(len + start, 0.0) : std::min(start, len);
        stop = stop < 0 ? std::max(len + stop, 0.0) : std::min(stop, len);
        for (double i = start; i < stop; i += step) out.push_back(static_cast<std::size_t>(i));
    } else {
        start = start_v.kind == Kind::Undefined ? len - 1 : start_v.number;
        stop = stop_v.kind == Kind::Undefined ? -1 : stop_v.number;
        start = start < 0 ? std::max(len + start, -1.0) : std::min(start, len - 1);
        stop = stop < -1 ? std::max(len + stop, -1.0) : std::min(stop, len - 1);
        for (double i = start; i > stop; i += step) out.push_back(static_cast<std::size_t>(i));
    }
    return out;
}

// The byte offset of each code point of s, then s.size(): code point k is s[at[k], at[k + 1]).
std::vector<std::size_t> code_point_offsets(const std::string& s) {
    std::vector<std::size_t> at;
    for (std::size_t i = 0; i < s.size();) {
        at.push_back(i);
        next_code_point(s, i);
    }
    at.push_back(s.size());
    return at;
}

// Identifier loads of kwargs/varargs in a macro body make the macro collect extra arguments.
bool uses_name(const Node* n, const char* name) {
    if (!n) return false;
    if (n->kind == NodeKind::Identifier && n->text == name) return true;
    for (const NodePtr* p : {&n->a, &n->b, &n->c})
        if (uses_name(p->get(), name)) return true;
    for (const auto* list : {&n->items, &n->body, &n->alternate})
        for (const auto& child : *list)
            if (uses_name(child.get(), name)) return true;
    return false;
}
bool body_uses(const std::vector<NodePtr>& body, const char* name) {
    for (const auto& n : body)
        if (uses_name(n.get(), name)) return true;
    return false;
}

// Checks that `value` unpacks into the names of a tuple target (`for a, b in ...`, `set a, b = ...`).
void check_unpack(const Node& target, const Value& value, const char* where) {
    if (!value.is_array() || (value.kind == Kind::Tuple && *where == 0))  // a for loop takes lists only
        fail(std::string("Cannot unpack non-iterable type") + where + ": " + kind_name(value.kind));
    std::size_t have = value.items().size(), want = target.items.size();
    if (have != want) fail(std::string("Too ") + (want > have ? "few" : "many") + " items to unpack" + where);
}

// Binds a loop or set target: a name, or names unpacking a list of as many items.
void bind_target(const Node& target, const Value& value, Env& env, const char* where) {
    if (target.kind == NodeKind::Identifier) {
        env.set(target.text, value);
        return;
    }
    check_unpack(target, value, where);
    for (std::size_t j = 0; j < target.items.size(); ++j) {
        if (target.items[j]->kind != NodeKind::Identifier)
            fail(std::string("Cannot unpack to a non-name") + where + ": " +
                 node_name(target.items[j]->kind));
        env.set(target.items[j]->text, value.items()[j]);
    }
}

}  // namespace

Value Env::lookup(const std::string& name) const {
    for (const Env* e = this; e; e = e->parent_.get()) {
        auto it = e->vars_.find(name);
        if (it != e->vars_.end()) return it->second;
    }
    return Value::undefined();
}

std::string Interpreter::run(const Node& program, const EnvPtr& global) {
    struct ReleaseNamespaces {
        std::unordered_map<const void*, Value>& assigned;
        ~ReleaseNamespaces() {
            for (auto& [identity, ns] : assigned) ns.obj().entries.clear();
        }
    } release{assigned_namespaces_};
    std::string out;
    try {
        exec_block(program.body, global, out);
    } catch (const BreakSignal&) {
        throw TemplateError("chat template error: {% break %} outside a loop", 0, 0, __FILE__, __LINE__);
    } catch (const ContinueSignal&) {
        throw TemplateError("chat template error: {% continue %} outside a loop", 0, 0, __FILE__, __LINE__);
    }
    return out;
}

void Interpreter::exec_block(const std::vector<NodePtr>& body, const EnvPtr& env, std::string& out) {
    for (const auto& n : body) exec(*n, env, out);
}

void Interpreter::take_steps(std::size_t count) {
    steps_ += count;
    if (steps_ > kMaxRenderSteps)
        fail("rendering took more than " + std::to_string(kMaxRenderSteps) +
             " steps (the renderer's limit on the work of one render; an endless loop?)");
}

void Interpreter::exec(const Node& n, const EnvPtr& env, std::string& out) {
    try {
        take_steps(1);
        switch (n.kind) {
            case NodeKind::Text:
                out += n.text;
                check_string_bytes(out.size());
                return;
            case NodeKind::Comment:
                return;
            case NodeKind::Macro:
                env->set(n.text, make_macro("'" + n.text + "'", n.items, n.body));
                return;
            case NodeKind::If: {
                bool test = truthy(eval(*n.a, env));
                exec_block(test ? n.body : n.alternate, env, out);
                return;
            }
            case NodeKind::For:
                exec_for(n, env, out);
                return;
            case NodeKind::Set:
                exec_set(n, env);
                return;
            case NodeKind::Break:
                throw BreakSignal{};
            case NodeKind::Continue:
                throw ContinueSignal{};
            default: {
                Value v = eval(n, env);
                if (v.kind != Kind::Null && v.kind != Kind::Undefined) out += to_display(v);
                check_string_bytes(out.size());
                return;
            }
        }
    } catch (const EvalError& e) {
        throw TemplateError("chat template error at line " + std::to_string(n.line) + ", column " +
                                std::to_string(n.column) + " (" + node_name(n.kind) + "): " + e.message,
                            n.line, n.column, __FILE__, __LINE__);
    }
}

Value Interpreter::eval(const Node& n, const EnvPtr& env) {
    try {
        take_steps(1);
        Value v = eval_inner(n, env);
        // What calls, filters and operators build costs its size; a name or member only reads.
        if (n.kind == NodeKind::Call || n.kind == NodeKind::Filter || n.kind == NodeKind::FilterBlock ||
            n.kind == NodeKind::Binary) {
            if (v.is_array()) take_steps(v.items().size());
            if (v.kind == Kind::String) take_steps(v.str().size() / 64);
        }
        return v;
    } catch (const EvalError& e) {
        throw TemplateError("chat template error at line " + std::to_string(n.line) + ", column " +
                                std::to_string(n.column) + " (" + node_name(n.kind) + "): " + e.message,
                            n.line, n.column, __FILE__, __LINE__);
    }
}

Value Interpreter::eval_inner(const Node& n, const EnvPtr& env) {
    switch (n.kind) {
        case NodeKind::Text:
        case NodeKind::StringLit:
            return Value::string(n.text);
        case NodeKind::IntegerLit:
            return Value::integer(n.number);
        case NodeKind::FloatLit:
            return Value::floating(n.number);
        case NodeKind::Comment:
            return Value::null();
        case NodeKind::ArrayLit:
        case NodeKind::TupleLit: {
            Array items;
            for (const auto& i : n.items) items.push_back(eval(*i, env));
            return Value::array(std::move(items), n.kind == NodeKind::TupleLit ? Kind::Tuple : Kind::Array);
        }
        case NodeKind::ObjectLit: {
            Object o;
            for (std::size_t i = 0; i + 1 < n.items.size(); i += 2) {
                Value key = eval(*n.items[i], env);
                if (key.kind != Kind::String)
                    fail(std::string("Object keys must be strings: got ") + kind_name(key.kind));
                o.set(key.str(), eval(*n.items[i + 1], env));
            }
            return Value::object(std::move(o));
        }
        case NodeKind::Identifier:
            return env->lookup(n.text);
        case NodeKind::Call:
            return eval_call(n, env);
        case NodeKind::Member:
            return eval_member(n, env);
        case NodeKind::Unary: {
            Value v = eval(*n.a, env);
            if (n.text == "not") return Value::of_bool(!truthy(v));
            double sign = n.text == "-" ? -1 : 1;
            if (v.is_number()) {
                Value r = v;
                r.number = sign * v.number;
                return r;
            }
            if (v.kind == Kind::Boolean) return Value::integer(sign * (v.boolean ? 1 : 0));
            fail("unknown operator \"" + n.text + "\" for " + kind_name(v.kind));
        }
        case NodeKind::Binary:
            return eval_binary(n, env);
        case NodeKind::Filter:
            return apply_filter(eval(*n.a, env), *n.b, env);
        case NodeKind::FilterBlock:
            return apply_filter(Value::string(render_block(n.body, env)), *n.a, env);
        case NodeKind::Test: {
            Value v = eval(*n.a, env);
            bool found = false;
            bool r = run_test(n.text, v, found);
            if (!found) fail("unknown test '" + n.text + "'");
            return Value::of_bool(n.flag ? !r : r);
        }
        case NodeKind::Select: {
            if (!truthy(eval(*n.b, env))) return Value::undefined();
            return eval(*n.a, env);
        }
        case NodeKind::Ternary:
            return truthy(eval(*n.a, env)) ? eval(*n.b, env) : eval(*n.c, env);
        case NodeKind::CallBlock: {
            const Node& call = *n.a;
            std::vector<NodePtr> params = n.items;
            bool kw = body_uses(n.body, "kwargs"), va = body_uses(n.body, "varargs");
            EnvPtr defining = env;
            const Node* block = &n;
            Value caller = Value::function(
                [this, params, kw, va, defining, block](std::vector<Value>& args, const EnvPtr&) {
                    take_steps(kStepsPerCall);
                    auto scope = std::make_shared<Env>(defining);
                    bind_macro_arguments("None", params, kw, va, args, scope);
                    return Value::string(render_block(block->body, scope));
                });
            auto [args, kwargs] = eval_arguments(call.items, env);
            args.push_back(Value::object(std::move(kwargs), Kind::KeywordArgs));
            Value fn = eval(*call.a, env);
            if (fn.kind != Kind::Function)
                fail(std::string("Cannot call something that is not a function: got ") + kind_name(fn.kind));
            auto scope = std::make_shared<Env>(env);
            scope->set("caller", caller);
            return fn.fn()(args, scope);
        }
        default:  // statements run through exec(); slices and arguments are parts of other nodes
            break;
    }
    fail(std::string("unsupported ") + node_name(n.kind) + " here");
}

Value Interpreter::eval_binary(const Node& n, const EnvPtr& env) {
    const std::string& op = n.text;
    Value left = eval(*n.a, env);
    if (op == "and") return truthy(left) ? eval(*n.b, env) : left;
    if (op == "or") return truthy(left) ? left : eval(*n.b, env);
    Value right = eval(*n.b, env);
    if (op == "==") return Value::of_bool(loose_equal(left, right));
    if (op == "!=") return Value::of_bool(!loose_equal(left, right));
    bool membership = op == "in" || op == "not in";
    if (left.kind == Kind::Undefined || right.kind == Kind::Undefined) {
        if (right.kind == Kind::Undefined && membership) return Value::of_bool(op == "not in");
        fail("Cannot perform operation " + op + " on undefined values");
    }
    if (left.kind == Kind::Null || right.kind == Kind::Null) fail("Cannot perform operation on null values");
    if (op == "~") return Value::string(to_js_string(left) + to_js_string(right));
    bool left_numeric = left.is_number() || left.kind == Kind::Boolean;
    bool right_numeric = right.is_number() || right.kind == Kind::Boolean;
    if (op == "**" && left_numeric && right_numeric) {
        double a = left.kind == Kind::Boolean ? left.boolean : left.number;
        double b = right.kind == Kind::Boolean ? right.boolean : right.number;
        if (a == 0 && b < 0) fail("0.0 cannot be raised to a negative power");
        double r = std::pow(a, b);
        if (!std::isfinite(r)) fail("Exponentiation result is not a finite real number");
        bool is_float = left.kind == Kind::Float || right.kind == Kind::Float || b < 0;
        return is_float ? Value::floating(r) : Value::integer(r);
    }
    if (left.is_number() && right.is_number()) {
        double a = left.number, b = right.number;
        bool is_float = left.kind == Kind::Float || right.kind == Kind::Float;
        auto num = [&](double r) { return is_float ? Value::floating(r) : Value::integer(r); };
        if (op == "+") return num(a + b);
        if (op == "-") return num(a - b);
        if (op == "*") return num(a * b);
        if (op == "/") return Value::floating(a / b);
        if (op == "//") return num(std::floor(a / b));
        if (op == "%") return num(std::fmod(a, b));
        if (op == "<") return Value::of_bool(a < b);
        if (op == ">") return Value::of_bool(a > b);
        if (op == ">=") return Value::of_bool(a >= b);
        if (op == "<=") return Value::of_bool(a <= b);
    } else if (left.is_array() && right.is_array()) {
        if (op == "+") {
            Array items = left.items();
            items.insert(items.end(), right.items().begin(), right.items().end());
            return Value::array(std::move(items));
        }
    } else if (right.is_array()) {
        if (membership) {
            bool member = false;
            for (const auto& x : right.items())
                if (strict_equal(x, left)) member = true;
            return Value::of_bool(op == "in" ? member : !member);
        }
    }
    if ((left.kind == Kind::String || right.kind == Kind::String) && op == "+")
        return Value::string(to_js_string(left) + to_js_string(right));
    if (left.kind == Kind::String && right.kind == Kind::String && membership) {
        bool member = right.str().find(left.str()) != std::string::npos;
        return Value::of_bool(op == "in" ? member : !member);
    }
    if (left.kind == Kind::String && right.is_object() && membership) {
        bool member = right.obj().find(left.str()) != nullptr;
        return Value::of_bool(op == "in" ? member : !member);
    }
    fail("Unknown operator \"" + op + "\" between " + kind_name(left.kind) + " and " + kind_name(right.kind));
}

Value Interpreter::eval_member(const Node& n, const EnvPtr& env) {
    Value object = eval(*n.a, env);
    const Node& p = *n.b;
    Value property;
    if (n.flag) {
        if (p.kind == NodeKind::Slice) return eval_slice(object, p, env);
        property = eval(p, env);
    } else if (p.kind == NodeKind::IntegerLit) {
        property = Value::integer(p.number);
    } else {
        property = Value::string(p.text);
    }
    if (object.has_attributes()) {
        if (property.kind != Kind::String)
            fail(std::string("Cannot access property with non-string: got ") + kind_name(property.kind));
        if (const Value* v = object.obj().find(property.str())) return *v;
        return object.is_object() ? object_member(object, property.str()) : Value::undefined();
    }
    if (object.is_array() || object.kind == Kind::String) {
        if (property.kind == Kind::Integer) {
            if (object.kind == Kind::String) {
                const std::string& str = object.str();
                take_steps(str.size());
                const auto offsets = code_point_offsets(str);
                auto at = element_position(property.number, offsets.size() - 1);
                return at ? Value::string(str.substr(offsets[*at], offsets[*at + 1] - offsets[*at]))
                          : Value::undefined();
            }
            const Array& items = object.items();
            auto at = element_position(property.number, items.size());
            return at ? items[*at] : Value::undefined();
        }
        if (property.kind == Kind::String) {
            if (object.kind == Kind::String) return string_member(object, property.str());
            if (property.str() == "length") return Value::integer(static_cast<double>(object.items().size()));
            return Value::undefined();
        }
        fail(std::string("Cannot access property with non-string/non-number: got ") +
             kind_name(property.kind));
    }
    if (property.kind != Kind::String)
        fail(std::string("Cannot access property with non-string: got ") + kind_name(property.kind));
    return Value::undefined();
}

Value Interpreter::eval_slice(const Value& object, const Node& slice, const EnvPtr& env) {
    if (!object.is_array() && object.kind != Kind::String) fail("Slice object must be an array or string");
    Value start = slice.a ? eval(*slice.a, env) : Value::undefined();
    Value stop = slice.b ? eval(*slice.b, env) : Value::undefined();
    Value step = slice.c ? eval(*slice.c, env) : Value::undefined();
    for (const Value* v : {&start, &stop, &step})
        if (v->kind != Kind::Integer && v->kind != Kind::Undefined)
            fail("Slice bounds must be integers or empty");
    if (object.is_array()) {
        const Array& items = object.items();
        Array out;
        for (std::size_t i : slice_indices(items.size(), start, stop, step)) out.push_back(items[i]);
        return Value::array(std::move(out));
    }
    const std::string& str = object.str();
    take_steps(str.size());
    const auto offsets = code_point_offsets(str);
    std::string out;
    for (std::size_t i : slice_indices(offsets.size() - 1, start, stop, step))
        out.append(str, offsets[i], offsets[i + 1] - offsets[i]);
    return Value::string(std::move(out));
}

std::pair<std::vector<Value>, Object> Interpreter::eval_arguments(const std::vector<NodePtr>& args,
                                                                  const EnvPtr& env) {
    std::vector<Value> positional;
    Object kwargs;
    auto add = [&](const std::string& key, Value v) {
        if (kwargs.find(key)) fail("Got multiple values for keyword argument '" + key + "'");
        kwargs.entries.emplace_back(key, std::move(v));
    };
    for (const auto& a : args) {
        if (a->kind == NodeKind::Spread) {
            Value v = eval(*a->a, env);
            if (!v.is_array()) fail(std::string("Cannot unpack non-iterable type: ") + kind_name(v.kind));
            for (const auto& x : v.items()) positional.push_back(x);
        } else if (a->kind != NodeKind::KeywordArg && a->kind != NodeKind::KeywordSpread) {
            positional.push_back(eval(*a, env));
        }
    }
    for (const auto& a : args) {
        if (a->kind == NodeKind::KeywordArg) {
            add(a->text, eval(*a->a, env));
        } else if (a->kind == NodeKind::KeywordSpread) {
            Value v = eval(*a->a, env);
            if (!v.is_object())
                fail(std::string("Argument after ** must be a mapping, not ") + kind_name(v.kind));
            for (const auto& [k, x] : v.obj().entries) add(k, x);
        }
    }
    return {std::move(positional), std::move(kwargs)};
}

Value Interpreter::eval_call(const Node& n, const EnvPtr& env) {
    auto [args, kwargs] = eval_arguments(n.items, env);
    if (!kwargs.entries.empty()) args.push_back(Value::object(std::move(kwargs), Kind::KeywordArgs));
    Value fn = eval(*n.a, env);
    if (fn.kind != Kind::Function)
        fail(std::string("Cannot call something that is not a function: got ") + kind_name(fn.kind));
    return fn.fn()(args, env);
}

void Interpreter::exec_for(const Node& n, const EnvPtr& env, std::string& out) {
    auto scope = std::make_shared<Env>(env);
    const Node* iterable_node = n.b.get();
    const Node* test = nullptr;
    if (iterable_node->kind == NodeKind::Select) {
        test = iterable_node->b.get();
        iterable_node = iterable_node->a.get();
    }
    Value iterable = eval(*iterable_node, scope);
    if (!iterable.is_array() && !iterable.is_object())
        fail(std::string("Expected iterable or object type in for loop: got ") + kind_name(iterable.kind));
    Array keys;
    if (iterable.is_object())
        for (const auto& [k, v] : iterable.obj().entries) keys.push_back(Value::string(k));
    const Array& all = iterable.is_object() ? keys : iterable.items();

    const Node& target = *n.a;

    take_steps(all.size());
    Array items;
    for (const auto& current : all) {
        if (test) {
            auto loop_scope = std::make_shared<Env>(scope);
            bind_target(target, current, *loop_scope, "");
            if (!truthy(eval(*test, loop_scope))) continue;
        } else if (target.kind != NodeKind::Identifier) {
            check_unpack(target, current,
                         "");  // the reference rejects a bad unpack before the first iteration
        }
        items.push_back(current);
    }

    bool no_iteration = true;
    std::size_t count = items.size();
    for (std::size_t i = 0; i < count; ++i) {
        Object loop;
        loop.entries.reserve(9);
        loop.entries.emplace_back("index", Value::integer(static_cast<double>(i + 1)));
        loop.entries.emplace_back("index0", Value::integer(static_cast<double>(i)));
        loop.entries.emplace_back("revindex", Value::integer(static_cast<double>(count - i)));
        loop.entries.emplace_back("revindex0", Value::integer(static_cast<double>(count - i - 1)));
        loop.entries.emplace_back("first", Value::of_bool(i == 0));
        loop.entries.emplace_back("last", Value::of_bool(i + 1 == count));
        loop.entries.emplace_back("length", Value::integer(static_cast<double>(count)));
        loop.entries.emplace_back("previtem", i > 0 ? items[i - 1] : Value::undefined());
        loop.entries.emplace_back("nextitem", i + 1 < count ? items[i + 1] : Value::undefined());
        scope->set("loop", Value::object(std::move(loop)));
        bind_target(target, items[i], *scope, "");
        take_steps(kStepsPerIteration);  // an empty body still costs each iteration
        std::string body;
        try {
            exec_block(n.body, scope, body);
        } catch (const ContinueSignal&) {
            continue;  // what the body printed before {% continue %} is dropped, as in the reference
        } catch (const BreakSignal&) {
            break;
        }
        out += body;
        check_string_bytes(out.size());
        no_iteration = false;
    }
    if (no_iteration) exec_block(n.alternate, scope, out);
}

void Interpreter::exec_set(const Node& n, const EnvPtr& env) {
    Value rhs = n.b ? eval(*n.b, env) : Value::string(render_block(n.body, env));
    const Node& target = *n.a;
    if (target.kind == NodeKind::Identifier || target.kind == NodeKind::TupleLit) {
        bind_target(target, rhs, *env, " in set");
    } else if (target.kind == NodeKind::Member) {
        Value object = eval(*target.a, env);
        if (object.kind != Kind::Namespace) fail("cannot assign attribute on non-namespace object");
        if (target.flag || target.b->kind != NodeKind::Identifier)
            fail("Cannot assign to member with non-identifier property");
        assigned_namespaces_.emplace(object.identity(), object);
        object.obj().set(target.b->text, std::move(rhs));
    } else {
        fail("invalid target of {% set %}");
    }
}

void Interpreter::bind_macro_arguments(const std::string& display_name, const std::vector<NodePtr>& params,
                                       bool use_kwargs, bool use_varargs, std::vector<Value> args,
                                       const EnvPtr& scope) {
    Object kwargs;
    if (!args.empty() && args.back().kind == Kind::KeywordArgs) {
        kwargs = args.back().obj();
        args.pop_back();
    }
    std::vector<std::pair<std::string, const Node*>> pending;
    for (std::size_t i = 0; i < params.size(); ++i) {
        const Node& p = *params[i];
        const std::string& name = p.text;
        Value v;
        bool have = i < args.size();
        if (have) v = args[i];
        if (!have) {
            for (auto it = kwargs.entries.begin(); it != kwargs.entries.end(); ++it) {
                if (it->first == name) {
                    v = it->second;
                    have = true;
                    kwargs.entries.erase(it);
                    break;
                }
            }
        }
        if (!have && p.kind == NodeKind::KeywordArg) pending.emplace_back(name, p.a.get());
        scope->set(name, have ? v : Value::undefined());
    }
    if (use_kwargs)
        scope->set("kwargs", Value::object(kwargs));
    else if (!kwargs.entries.empty())
        fail("macro " + display_name + " takes no keyword argument '" + kwargs.entries[0].first + "'");
    if (use_varargs) {
        Array rest;
        for (std::size_t i = params.size(); i < args.size(); ++i) rest.push_back(args[i]);
        scope->set("varargs", Value::array(std::move(rest)));
    } else if (args.size() > params.size()) {
        fail("macro " + display_name + " takes not more than " + std::to_string(params.size()) +
             " argument(s)");
    }
    for (const auto& [name, def] : pending) scope->set(name, eval(*def, scope));
}

Value Interpreter::make_macro(const std::string& display_name, const std::vector<NodePtr>& params,
                              const std::vector<NodePtr>& body) {
    bool kw = body_uses(body, "kwargs"), va = body_uses(body, "varargs");
    const std::vector<NodePtr>* body_ptr = &body;
    const std::vector<NodePtr>* params_ptr = &params;
    return Value::function([this, display_name, params_ptr, body_ptr, kw, va](std::vector<Value>& args,
                                                                              const EnvPtr& caller_scope) {
        if (macro_depth_ >= kMaxMacroDepth)
            fail("macro " + display_name + " nested deeper than " + std::to_string(kMaxMacroDepth) +
                 " calls (endless recursion?)");
        struct Depth {
            int& d;
            ~Depth() { --d; }
        } depth{++macro_depth_};
        take_steps(kStepsPerCall);
        auto scope = std::make_shared<Env>(caller_scope);
        bind_macro_arguments(display_name, *params_ptr, kw, va, args, scope);
        return Value::string(render_block(*body_ptr, scope));
    });
}

}  // namespace moerl::text::jinja::detail
