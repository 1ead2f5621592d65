#include "template/value.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "template/unicode.hpp"

namespace moerl::text::jinja::detail {

const Value* Object::find(std::string_view key) const {
    for (const auto& [k, v] : entries)
        if (k == key) return &v;
    return nullptr;
}

void Object::set(std::string key, Value value) {
    for (auto& [k, v] : entries) {
        if (k == key) {
            v = std::move(value);
            return;
        }
    }
    entries.emplace_back(std::move(key), std::move(value));
}

namespace {
Value scalar(Kind kind, double number = 0, bool boolean = false) {
    Value v;
    v.kind = kind;
    v.number = number;
    v.boolean = boolean;
    return v;
}
}  // namespace

Value Value::null() { return scalar(Kind::Null); }
Value Value::of_bool(bool b) { return scalar(Kind::Boolean, 0, b); }
Value Value::integer(double n) { return scalar(Kind::Integer, n); }
Value Value::floating(double n) { return scalar(Kind::Float, n); }
void check_string_bytes(std::size_t bytes) {
    if (bytes > kMaxStringBytes)
        throw EvalError{"a string of more than " + std::to_string(kMaxStringBytes >> 20) +
                        " MiB (the renderer's limit on text it builds)"};
}

void check_items(double count) {
    if (!(count <= static_cast<double>(kMaxItems)))
        throw EvalError{"a list of " + js_number(count) + " items, over the renderer's limit of " +
                        std::to_string(kMaxItems)};
}

Value Value::string(std::string s) {
    check_string_bytes(s.size());
    Value v;
    v.kind = Kind::String;
    v.payload = std::make_shared<const std::string>(std::move(s));
    return v;
}
Value Value::array(Array items, Kind kind) {
    check_items(static_cast<double>(items.size()));
    Value v;
    v.kind = kind;
    v.payload = std::make_shared<Array>(std::move(items));
    return v;
}
Value Value::object(Object o, Kind kind) {
    Value v;
    v.kind = kind;
    v.payload = std::make_shared<Object>(std::move(o));
    return v;
}
Value Value::function(Function f) {
    Value v;
    v.kind = Kind::Function;
    v.payload = std::make_shared<const Function>(std::move(f));
    return v;
}

const void* Value::identity() const {
    return std::visit(
        [](const auto& p) -> const void* {
            if constexpr (std::is_same_v<std::decay_t<decltype(p)>, std::monostate>) {
                return nullptr;
            } else {
                return p.get();
            }
        },
        payload);
}

const char* kind_name(Kind kind) {
    switch (kind) {
        case Kind::Undefined:
            return "UndefinedValue";
        case Kind::Null:
            return "NullValue";
        case Kind::Boolean:
            return "BooleanValue";
        case Kind::Integer:
            return "IntegerValue";
        case Kind::Float:
            return "FloatValue";
        case Kind::String:
            return "StringValue";
        case Kind::Array:
            return "ArrayValue";
        case Kind::Tuple:
            return "TupleValue";
        case Kind::Object:
            return "ObjectValue";
        case Kind::KeywordArgs:
            return "KeywordArgumentsValue";
        case Kind::Namespace:
            return "NamespaceValue";
        case Kind::Function:
            return "FunctionValue";
    }
    return "?";
}

bool truthy(const Value& v) {
    switch (v.kind) {
        case Kind::Undefined:
        case Kind::Null:
            return false;
        case Kind::Boolean:
            return v.boolean;
        case Kind::Integer:
        case Kind::Float:
            return v.number != 0 && !std::isnan(v.number);
        case Kind::String:
            return !v.str().empty();
        case Kind::Array:
        case Kind::Tuple:
            return !v.items().empty();
        case Kind::Object:
        case Kind::KeywordArgs:
            return !v.obj().entries.empty();
        case Kind::Namespace:  // a JavaScript Map is always truthy
        case Kind::Function:
            return true;
    }
    return false;
}

namespace {

// JavaScript's ToNumber on a string.
double string_to_number(std::string_view s) {
    s = trim(s);
    if (s.empty()) return 0;
    if (s.size() > 2 && s[0] == '0' && (s[1] | 0x20) != 'e' &&
        std::string_view("xXoObB").find(s[1]) != std::string_view::npos) {
        int base = (s[1] | 0x20) == 'x' ? 16 : (s[1] | 0x20) == 'o' ? 8 : 2;
        double r = 0;
        for (char c : s.substr(2)) {
            int d = c >= '0' && c <= '9'                     ? c - '0'
                    : (c | 0x20) >= 'a' && (c | 0x20) <= 'f' ? (c | 0x20) - 'a' + 10
                                                             : 99;
            if (d >= base) return NAN;
            r = r * base + d;
        }
        return r;
    }
    std::size_t i = 0;
    bool negative = false;
    if (s[0] == '+' || s[0] == '-') {
        negative = s[0] == '-';
        i = 1;
    }
    if (s.substr(i) == "Infinity") return negative ? -INFINITY : INFINITY;
    std::size_t digits = 0, j = i;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j, ++digits;
    if (j < s.size() && s[j] == '.') {
        ++j;
        while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j, ++digits;
    }
    if (digits == 0) return NAN;
    if (j < s.size() && (s[j] | 0x20) == 'e') {
        ++j;
        if (j < s.size() && (s[j] == '+' || s[j] == '-')) ++j;
        std::size_t e = j;
        while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
        if (j == e) return NAN;
    }
    if (j != s.size()) return NAN;
    return std::strtod(std::string(s).c_str(), nullptr);
}

// A JavaScript value's type for loose equality: numbers, strings, booleans, nullish, objects.
enum class JsType { Nullish, Boolean, Number, String, Object };

JsType js_type(const Value& v) {
    switch (v.kind) {
        case Kind::Undefined:
        case Kind::Null:
            return JsType::Nullish;
        case Kind::Boolean:
            return JsType::Boolean;
        case Kind::Integer:
        case Kind::Float:
            return JsType::Number;
        case Kind::String:
            return JsType::String;
        default:
            return JsType::Object;
    }
}

}  // namespace

bool loose_equal(const Value& a, const Value& b) {
    JsType ta = js_type(a), tb = js_type(b);
    if (ta == JsType::Nullish || tb == JsType::Nullish) return ta == tb;
    if (ta == tb) return strict_equal(a, b);
    if (ta == JsType::Boolean) return loose_equal(Value::integer(a.boolean ? 1 : 0), b);
    if (tb == JsType::Boolean) return loose_equal(a, Value::integer(b.boolean ? 1 : 0));
    if (ta == JsType::Number && tb == JsType::String) return a.number == string_to_number(b.str());
    if (ta == JsType::String && tb == JsType::Number) return string_to_number(a.str()) == b.number;
    // An object against a number or a string compares the object's primitive (its string).
    if (ta == JsType::Object && a.kind != Kind::Function)
        return loose_equal(Value::string(to_js_string(a)), b);
    if (tb == JsType::Object && b.kind != Kind::Function)
        return loose_equal(a, Value::string(to_js_string(b)));
    return false;
}

bool strict_equal(const Value& a, const Value& b) {
    JsType ta = js_type(a), tb = js_type(b);
    if (ta != tb) return false;
    switch (ta) {
        case JsType::Nullish:
            return true;  // the reference's none holds undefined, not null
        case JsType::Boolean:
            return a.boolean == b.boolean;
        case JsType::Number:
            return a.number == b.number;
        case JsType::String:
            return a.str() == b.str();
        default:
            return a.identity() == b.identity();
    }
}

std::string js_number(double x) {
    if (std::isnan(x)) return "NaN";
    if (std::isinf(x)) return x > 0 ? "Infinity" : "-Infinity";
    if (x == 0) return "0";
    std::string out;
    if (x < 0) {
        out.push_back('-');
        x = -x;
    }
    char buf[64];
    auto res = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
    std::string_view sci(buf, static_cast<std::size_t>(res.ptr - buf));  // d[.ddd]e[+-]xx
    auto e_pos = sci.find('e');
    std::string digits;
    for (char c : sci.substr(0, e_pos))
        if (c != '.') digits.push_back(c);
    int n = std::atoi(std::string(sci.substr(e_pos + 1)).c_str()) + 1;  // x = 0.digits * 10^n
    int k = static_cast<int>(digits.size());
    if (k <= n && n <= 21) {
        out += digits;
        out.append(static_cast<std::size_t>(n - k), '0');
    } else if (0 < n && n <= 21) {
        out += digits.substr(0, static_cast<std::size_t>(n));
        out += '.';
        out += digits.substr(static_cast<std::size_t>(n));
    } else if (-6 < n && n <= 0) {
        out += "0.";
        out.append(static_cast<std::size_t>(-n), '0');
        out += digits;
    } else {
        out += digits[0];
        if (k > 1) {
            out += '.';
            out += digits.substr(1);
        }
        out += 'e';
        out += n - 1 >= 0 ? '+' : '-';
        out += std::to_string(std::abs(n - 1));
    }
    return out;
}

namespace {
std::string float_display(double x) {
    if (x == 0 && std::signbit(x)) return "-0.0";
    if (std::isfinite(x) && std::fmod(x, 1.0) == 0) {
        if (std::fabs(x) >= 1e21) return js_number(x);  // toFixed falls back to toString there
        char buf[400];
        std::snprintf(buf, sizeof(buf), "%.1f", x);
        return buf;
    }
    return js_number(x);
}
}  // namespace

std::string to_display(const Value& v) {
    switch (v.kind) {
        case Kind::Undefined:
        case Kind::Null:
            return "undefined";  // the reference's none holds undefined, not null
        case Kind::Boolean:
            return v.boolean ? "true" : "false";
        case Kind::Integer:
            return js_number(v.number);
        case Kind::Float:
            return float_display(v.number);
        case Kind::String:
            return v.str();
        case Kind::Function:
            throw EvalError{"a function cannot be printed"};
        default:
            return to_json(v, {}, false);
    }
}

std::string to_js_string(const Value& v) {
    switch (v.kind) {
        case Kind::Integer:
        case Kind::Float:
            return js_number(v.number);
        case Kind::Array:
        case Kind::Tuple: {
            std::string out;
            const auto& items = v.items();
            for (std::size_t i = 0; i < items.size(); ++i) {
                if (i) out += ',';
                out += to_display(items[i]);
                check_string_bytes(out.size());
            }
            return out;
        }
        case Kind::Object:
        case Kind::KeywordArgs:
        case Kind::Namespace:
            return "[object Map]";
        default:
            return to_display(v);
    }
}

void append_json_string(std::string& out, std::string_view s, bool ensure_ascii) {
    static const char* kHex = "0123456789abcdef";
    auto escape_unit = [&](unsigned u) {
        out += "\\u";
        for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(u >> shift) & 0xF];
    };
    out += '"';
    for (std::size_t i = 0; i < s.size();) {
        auto c = static_cast<unsigned char>(s[i]);
        if (c < 0x80) {
            ++i;
            switch (c) {
                case '"':
                    out += "\\\"";
                    break;
                case '\\':
                    out += "\\\\";
                    break;
                case '\b':
                    out += "\\b";
                    break;
                case '\f':
                    out += "\\f";
                    break;
                case '\n':
                    out += "\\n";
                    break;
                case '\r':
                    out += "\\r";
                    break;
                case '\t':
                    out += "\\t";
                    break;
                default:
                    if (c < 0x20 || (ensure_ascii && c == 0x7F))
                        escape_unit(c);
                    else
                        out += static_cast<char>(c);
            }
            continue;
        }
        std::size_t start = i;
        char32_t cp = next_code_point(s, i);
        if (!ensure_ascii) {
            out.append(s.substr(start, i - start));
        } else if (cp > 0xFFFF) {
            escape_unit(0xD800 + ((cp - 0x10000) >> 10));
            escape_unit(0xDC00 + ((cp - 0x10000) & 0x3FF));
        } else {
            escape_unit(cp);
        }
    }
    out += '"';
}

namespace {
// Containers deeper than this are refused: a namespace may hold itself, and JSON of it would
// otherwise recurse until the stack runs out.
constexpr int kMaxJsonDepth = 256;

void json_into(std::string& out, const Value& v, const JsonOptions& o, int depth, bool undefined_as_null) {
    check_string_bytes(out.size());
    if (depth > kMaxJsonDepth)
        throw EvalError{"a value nested deeper than " + std::to_string(kMaxJsonDepth) +
                        " lists and objects (does a namespace hold itself?)"};
    std::string item_sep = o.custom_separators ? o.item_separator : o.indent ? "," : ", ";
    std::string key_sep = o.custom_separators ? o.key_separator : ": ";
    switch (v.kind) {
        case Kind::Null:
            out += "null";
            return;
        case Kind::Undefined:
            out += undefined_as_null ? "null" : "undefined";
            return;
        case Kind::Boolean:
            out += v.boolean ? "true" : "false";
            return;
        case Kind::Integer:
        case Kind::Float:
            out += std::isfinite(v.number) ? js_number(v.number) : "null";
            return;
        case Kind::String:
            append_json_string(out, v.str(), o.ensure_ascii);
            return;
        case Kind::Array:
        case Kind::Object:
        case Kind::Namespace:
            break;
        default:
            throw EvalError{std::string("Cannot convert to JSON: ") + kind_name(v.kind)};
    }
    std::string indent_unit(static_cast<std::size_t>(std::max(o.indent, 0)), ' ');
    std::string base = "\n";
    for (int d = 0; d < depth; ++d) base += indent_unit;
    std::string child = base + indent_unit;
    if (v.kind == Kind::Array) {
        const auto& items = v.items();
        out += '[';
        for (std::size_t i = 0; i < items.size(); ++i) {
            if (i) out += item_sep;
            if (o.indent) out += child;
            json_into(out, items[i], o, depth + 1, undefined_as_null);
        }
        if (o.indent && !items.empty()) out += base;
        out += ']';
        return;
    }
    std::vector<const std::pair<std::string, Value>*> entries;
    for (const auto& e : v.obj().entries) entries.push_back(&e);
    if (o.sort_keys)
        std::stable_sort(entries.begin(), entries.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
    out += '{';
    for (std::size_t i = 0; i < entries.size(); ++i) {
        if (i) out += item_sep;
        if (o.indent) out += child;
        append_json_string(out, entries[i]->first, o.ensure_ascii);
        out += key_sep;
        json_into(out, entries[i]->second, o, depth + 1, undefined_as_null);
    }
    if (o.indent && !entries.empty()) out += base;
    out += '}';
}

// JavaScript enumerates an object's array-index keys ("0", "17", ...) first, in numeric order.
bool is_array_index(const std::string& key) {
    if (key.empty() || key.size() > 10 || (key.size() > 1 && key[0] == '0')) return false;
    for (char c : key)
        if (c < '0' || c > '9') return false;
    return std::stoull(key) < 4294967295ULL;
}
}  // namespace

std::string to_json(const Value& v, const JsonOptions& options, bool undefined_as_null) {
    std::string out;
    json_into(out, v, options, 0, undefined_as_null);
    return out;
}

Value from_json(const nlohmann::ordered_json& j) {
    using T = nlohmann::ordered_json::value_t;
    switch (j.type()) {
        case T::null:
        case T::discarded:
            return Value::null();
        case T::boolean:
            return Value::of_bool(j.get<bool>());
        case T::number_integer:
            return Value::integer(static_cast<double>(j.get<std::int64_t>()));
        case T::number_unsigned:
            return Value::integer(static_cast<double>(j.get<std::uint64_t>()));
        case T::number_float: {
            double x = j.get<double>();
            bool integral = std::isfinite(x) && std::trunc(x) == x;  // Number.isInteger
            return integral ? Value::integer(x) : Value::floating(x);
        }
        case T::string:
            return Value::string(j.get<std::string>());
        case T::array: {
            Array items;
            items.reserve(j.size());
            for (const auto& e : j) items.push_back(from_json(e));
            return Value::array(std::move(items));
        }
        case T::object: {
            Object o;
            std::vector<std::pair<unsigned long long, std::string>> index_keys;
            for (auto it = j.begin(); it != j.end(); ++it)
                if (is_array_index(it.key())) index_keys.emplace_back(std::stoull(it.key()), it.key());
            std::sort(index_keys.begin(), index_keys.end());
            for (const auto& [n, key] : index_keys) o.entries.emplace_back(key, from_json(j.at(key)));
            for (auto it = j.begin(); it != j.end(); ++it)
                if (!is_array_index(it.key())) o.entries.emplace_back(it.key(), from_json(it.value()));
            return Value::object(std::move(o));
        }
        case T::binary:
            throw EvalError{"binary JSON values are not supported in a template context"};
    }
    return Value::null();
}

}  // namespace moerl::text::jinja::detail
