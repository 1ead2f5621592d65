// Filters: `x | name` and `x | name(args)`. The reference resolves a filter by its form (bare or
// called) and the operand's type, so the same name may exist in one form only (`trim` is bare,
// `default` is called); this follows it.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <unordered_set>

#include "template/interpreter.hpp"
#include "template/unicode.hpp"

namespace moerl::text::jinja::detail {

namespace {
[[noreturn]] void fail(std::string message) { throw EvalError{std::move(message)}; }

// JavaScript's parseInt(s, 10) and parseFloat(s); NaN when no number starts the string.
double parse_int(std::string_view s) {
    s = trim_start(s);
    std::size_t i = 0;
    bool negative = false;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
    double r = 0;
    std::size_t start = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') r = r * 10 + (s[i++] - '0');
    if (i == start) return NAN;
    return negative ? -r : r;
}

double parse_float(std::string_view s) {
    s = trim_start(s);
    std::size_t i = 0;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    if (s.substr(i, 8) == "Infinity") return s[0] == '-' ? -INFINITY : INFINITY;
    std::size_t digits = 0;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++digits;
    if (i < s.size() && s[i] == '.') {
        ++i;
        while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++digits;
    }
    if (digits == 0) return NAN;
    if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
        std::size_t j = i + 1;
        if (j < s.size() && (s[j] == '+' || s[j] == '-')) ++j;
        std::size_t e = j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
        if (j > e) i = j;
    }
    return std::strtod(std::string(s.substr(0, i)).c_str(), nullptr);
}

std::string indent_lines(const std::string& s, const std::string& pad, bool first, bool blank) {
    std::string out;
    std::size_t line = 0;
    for (std::size_t start = 0;; ++line) {
        std::size_t nl = s.find('\n', start);
        std::string_view x(s.data() + start, (nl == std::string::npos ? s.size() : nl) - start);
        if (line > 0) out += '\n';
        if (!((!first && line == 0) || (!blank && x.empty()))) out += pad;
        out += x;
        check_string_bytes(out.size());
        if (nl == std::string::npos) break;
        start = nl + 1;
    }
    return out;
}

// Array.prototype.join over the underlying values: null and undefined join as "".
std::string join_values(const Array& items, const std::string& sep) {
    std::string out;
    for (std::size_t i = 0; i < items.size(); ++i) {
        if (i) out += sep;
        if (items[i].kind != Kind::Null && items[i].kind != Kind::Undefined) out += to_js_string(items[i]);
        check_string_bytes(out.size());
    }
    return out;
}

Value kw(const Object& kwargs, const char* name, Value fallback) {
    const Value* v = kwargs.find(name);
    return v ? *v : fallback;
}
Value pos_or_kw(const std::vector<Value>& args, std::size_t i, const Object& kwargs, const char* name,
                Value fallback) {
    return i < args.size() ? args[i] : kw(kwargs, name, std::move(fallback));
}

Value sorted(const Array& items, bool reverse, bool case_sensitive, const Value& attribute) {
    Array out = items;
    auto key = [&](const Value& v) {
        if (attribute.kind == Kind::Null) return v;
        return attribute_path(
            v, attribute.kind == Kind::Integer ? js_number(attribute.number) : attribute.str());
    };
    std::stable_sort(out.begin(), out.end(), [&](const Value& a, const Value& b) {
        int r = compare_values(key(a), key(b), case_sensitive);
        return (reverse ? -r : r) < 0;
    });
    return Value::array(std::move(out));
}
}  // namespace

Value Interpreter::apply_filter(const Value& operand, const Node& filter, const EnvPtr& env) {
    if (filter.kind == NodeKind::Call) return apply_filter_call(operand, filter, env);
    const std::string& name = filter.text;
    if (name == "safe") return operand;
    if (name == "tojson") return Value::string(to_json(operand, {}));
    if (operand.is_array()) {
        const Array& items = operand.items();
        if (name == "list") return operand;
        if (name == "first") return items.empty() ? Value::undefined() : items.front();
        if (name == "last") return items.empty() ? Value::undefined() : items.back();
        if (name == "length") return Value::integer(static_cast<double>(items.size()));
        if (name == "reverse") return Value::array(Array(items.rbegin(), items.rend()));
        if (name == "sort") return sorted(items, false, false, Value::null());
        if (name == "join") return Value::string(join_values(items, ""));
        if (name == "string") return Value::string(to_json(operand, {}, false));
        if (name == "unique") {
            Array out;
            for (const auto& x : items) {
                bool seen = false;
                for (const auto& y : out) seen = seen || strict_equal(x, y);
                if (!seen) out.push_back(x);
            }
            return Value::array(std::move(out));
        }
        fail("Unknown ArrayValue filter: " + name);
    }
    if (operand.kind == Kind::String) {
        const std::string& s = operand.str();
        if (name == "length" || name == "upper" || name == "lower" || name == "title" ||
            name == "capitalize") {
            Value m = string_member(operand, name);
            if (m.kind == Kind::Function) {
                std::vector<Value> none;
                return m.fn()(none, env);
            }
            return m;
        }
        if (name == "trim") return Value::string(std::string(trim(s)));
        if (name == "indent") return Value::string(indent_lines(s, "    ", false, false));
        if (name == "join" || name == "string") return operand;
        if (name == "int") {
            double v = parse_int(s);
            return Value::integer(std::isnan(v) ? 0 : v);
        }
        if (name == "float") {
            double v = parse_float(s);
            return Value::floating(std::isnan(v) ? 0 : v);
        }
        fail("Unknown StringValue filter: " + name);
    }
    if (operand.is_number()) {
        if (name == "abs")
            return operand.kind == Kind::Integer ? Value::integer(std::fabs(operand.number))
                                                 : Value::floating(std::fabs(operand.number));
        if (name == "int") return Value::integer(std::floor(operand.number));
        if (name == "float") return Value::floating(operand.number);
        if (name == "string") return Value::string(to_display(operand));
        fail("Unknown NumericValue filter: " + name);
    }
    if (operand.is_object()) {
        if (name == "length") return Value::integer(static_cast<double>(operand.obj().entries.size()));
        Value m = object_member(operand, name);
        if (m.kind == Kind::Function) {
            std::vector<Value> none;
            return m.fn()(none, env);
        }
        fail("Unknown ObjectValue filter: " + name);
    }
    if (operand.kind == Kind::Boolean) {
        if (name == "bool") return operand;
        if (name == "int") return Value::integer(operand.boolean ? 1 : 0);
        if (name == "float") return Value::floating(operand.boolean ? 1 : 0);
        if (name == "string") return Value::string(operand.boolean ? "true" : "false");
        fail("Unknown BooleanValue filter: " + name);
    }
    fail("Cannot apply filter \"" + name + "\" to type: " + kind_name(operand.kind));
}

Value Interpreter::apply_filter_call(const Value& operand, const Node& call, const EnvPtr& env) {
    if (call.a->kind != NodeKind::Identifier) fail("a filter must be a name");
    const std::string& name = call.a->text;
    if (name == "tojson") {
        auto [args, kwargs] = eval_arguments(call.items, env);
        JsonOptions o;
        Value indent = kw(kwargs, "indent", Value::null());
        if (indent.kind != Kind::Integer && indent.kind != Kind::Null)
            fail("If set, indent must be a number");
        if (indent.kind == Kind::Integer) {
            // NaN (from `x % 0`) indents by nothing, as the reference does
            double width = std::isnan(indent.number) ? 0 : indent.number;
            if (width < 0) fail("indent must not be negative");
            check_string_bytes(static_cast<std::size_t>(std::min(width, 1e18)));
            o.indent = static_cast<int>(width);
        }
        Value ascii = kw(kwargs, "ensure_ascii", Value::of_bool(false));
        if (ascii.kind != Kind::Boolean) fail("If set, ensure_ascii must be a boolean");
        o.ensure_ascii = ascii.boolean;
        Value sort_keys = kw(kwargs, "sort_keys", Value::of_bool(false));
        if (sort_keys.kind != Kind::Boolean) fail("If set, sort_keys must be a boolean");
        o.sort_keys = sort_keys.boolean;
        Value seps = kw(kwargs, "separators", Value::null());
        if (seps.is_array()) {
            const Array& s = seps.items();
            if (s.size() != 2 || s[0].kind != Kind::String || s[1].kind != Kind::String)
                fail("separators must be a tuple of two strings");
            o.custom_separators = true;
            o.item_separator = s[0].str();
            o.key_separator = s[1].str();
        } else if (seps.kind != Kind::Null) {
            fail("If set, separators must be a tuple of two strings");
        }
        return Value::string(to_json(operand, o));
    }
    if (name == "join") {
        if (operand.kind != Kind::String && !operand.is_array())
            fail("Cannot apply filter \"join\" to type: " + std::string(kind_name(operand.kind)));
        if (operand.kind == Kind::String) take_steps(operand.str().size());
        auto [args, kwargs] = eval_arguments(call.items, env);
        Value sep = pos_or_kw(args, 0, kwargs, "separator", Value::string(""));
        if (sep.kind != Kind::String) fail("separator must be a string");
        if (operand.is_array()) return Value::string(join_values(operand.items(), sep.str()));
        // A string joins its code points, copied straight into the result.
        const std::string& s = operand.str();
        std::string out;
        for (std::size_t i = 0; i < s.size();) {
            const std::size_t start = i;
            next_code_point(s, i);
            if (start) out += sep.str();
            out.append(s, start, i - start);
            check_string_bytes(out.size());
        }
        return Value::string(std::move(out));
    }
    if (name == "int" || name == "float") {
        bool is_int = name == "int";
        auto [args, kwargs] = eval_arguments(call.items, env);
        Value fallback =
            pos_or_kw(args, 0, kwargs, "default", is_int ? Value::integer(0) : Value::floating(0));
        if (operand.kind == Kind::String) {
            double v = is_int ? parse_int(operand.str()) : parse_float(operand.str());
            if (std::isnan(v)) return fallback;
            return is_int ? Value::integer(v) : Value::floating(v);
        }
        if (operand.is_number()) return operand;
        if (operand.kind == Kind::Boolean)
            return is_int ? Value::integer(operand.boolean ? 1 : 0)
                          : Value::floating(operand.boolean ? 1 : 0);
        fail("Cannot apply filter \"" + name + "\" to type: " + kind_name(operand.kind));
    }
    if (name == "default") {
        auto [args, kwargs] = eval_arguments(call.items, env);
        Value fallback = args.size() > 0 ? args[0] : Value::string("");
        Value boolean = args.size() > 1 ? args[1] : kw(kwargs, "boolean", Value::of_bool(false));
        if (boolean.kind != Kind::Boolean) fail("`default` filter flag must be a boolean");
        if (operand.kind == Kind::Undefined || (boolean.boolean && !truthy(operand))) return fallback;
        return operand;
    }
    if (operand.is_array()) {
        const Array& items = operand.items();
        if (name == "sort") {
            auto [args, kwargs] = eval_arguments(call.items, env);
            Value reverse = pos_or_kw(args, 0, kwargs, "reverse", Value::of_bool(false));
            if (reverse.kind != Kind::Boolean) fail("reverse must be a boolean");
            Value cs = pos_or_kw(args, 1, kwargs, "case_sensitive", Value::of_bool(false));
            if (cs.kind != Kind::Boolean) fail("case_sensitive must be a boolean");
            Value attribute = pos_or_kw(args, 2, kwargs, "attribute", Value::null());
            if (attribute.kind != Kind::String && attribute.kind != Kind::Integer &&
                attribute.kind != Kind::Null)
                fail("attribute must be a string, integer, or null");
            return sorted(items, reverse.boolean, cs.boolean, attribute);
        }
        if (name == "selectattr" || name == "rejectattr") {
            bool select = name == "selectattr";
            for (const auto& x : items)
                if (!x.has_attributes()) fail("`" + name + "` can only be applied to array of objects");
            for (const auto& a : call.items)
                if (a->kind != NodeKind::StringLit) fail("arguments of `" + name + "` must be strings");
            if (call.items.empty()) fail("`" + name + "` needs an attribute name");
            std::string attr = call.items[0]->text;
            std::string test = call.items.size() > 1 ? call.items[1]->text : "";
            Value other = call.items.size() > 2 ? Value::string(call.items[2]->text) : Value::undefined();
            if (!test.empty() && !is_test(test)) fail("Unknown test: " + test);
            Array out;
            for (const auto& x : items) {
                const Value* a = x.obj().find(attr);
                bool r = false;
                if (a) {
                    bool found = false;
                    r = test.empty() ? truthy(*a) : run_test(test, *a, found, &other);
                }
                if (r == select) out.push_back(x);
            }
            return Value::array(std::move(out));
        }
        if (name == "map") {
            auto [args, kwargs] = eval_arguments(call.items, env);
            const Value* attr = kwargs.find("attribute");
            if (!attr) fail("`map` expressions without `attribute` set are not currently supported.");
            if (attr->kind != Kind::String) fail("attribute must be a string");
            const Value* fallback = kwargs.find("default");
            Array out;
            for (const auto& x : items) {
                if (!x.has_attributes()) fail("items in map must be an object");
                Value v = attribute_path(x, attr->str());
                out.push_back(v.kind == Kind::Undefined && fallback ? *fallback : v);
            }
            return Value::array(std::move(out));
        }
        fail("Unknown ArrayValue filter: " + name);
    }
    if (operand.kind == Kind::String) {
        if (name == "indent") {
            auto [args, kwargs] = eval_arguments(call.items, env);
            Value width = pos_or_kw(args, 0, kwargs, "width", Value::integer(4));
            if (width.kind != Kind::Integer) fail("width must be a number");
            Value first = pos_or_kw(args, 1, kwargs, "first", Value::of_bool(false));
            Value blank = pos_or_kw(args, 2, kwargs, "blank", Value::of_bool(false));
            double spaces = std::isnan(width.number) ? 0 : std::clamp(width.number, 0.0, 1e18);
            check_string_bytes(static_cast<std::size_t>(spaces));
            std::string pad(static_cast<std::size_t>(spaces), ' ');
            return Value::string(indent_lines(operand.str(), pad, truthy(first), truthy(blank)));
        }
        if (name == "replace") {
            auto [args, kwargs] = eval_arguments(call.items, env);
            args.push_back(Value::object(std::move(kwargs), Kind::KeywordArgs));
            return string_member(operand, "replace").fn()(args, env);
        }
        fail("Unknown StringValue filter: " + name);
    }
    if (operand.is_object()) {
        Value m = object_member(operand, name);
        if (m.kind == Kind::Function) {
            auto [args, kwargs] = eval_arguments(call.items, env);
            if (!kwargs.entries.empty()) args.push_back(Value::object(std::move(kwargs), Kind::KeywordArgs));
            return m.fn()(args, env);
        }
        fail("Unknown ObjectValue filter: " + name);
    }
    fail("Cannot apply filter \"" + name + "\" to type: " + kind_name(operand.kind));
}

}  // namespace moerl::text::jinja::detail
