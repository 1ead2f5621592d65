// Members of strings, arrays and objects, the `is` tests, and the global functions, with the
// reference's behaviour (strip() ignores its argument and trims all whitespace, as there).
#include <algorithm>
#include <cmath>
#include <ctime>

#include "template/interpreter.hpp"
#include "template/unicode.hpp"

namespace moerl::text::jinja::detail {

namespace {
[[noreturn]] void fail(std::string message) { throw EvalError{std::move(message)}; }

Value method(std::function<Value(std::vector<Value>&)> f) {
    return Value::function([f = std::move(f)](std::vector<Value>& args, const EnvPtr&) { return f(args); });
}

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
    return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// startswith/endswith take a string or a tuple of strings.
Value affix_test(const char* name, const std::string& s, std::vector<Value>& args,
                 bool (*test)(const std::string&, const std::string&)) {
    if (args.empty()) fail(std::string(name) + "() requires at least one argument");
    const Value& p = args[0];
    if (p.kind == Kind::String) return Value::of_bool(test(s, p.str()));
    if (p.is_array()) {
        for (const auto& item : p.items()) {
            if (item.kind != Kind::String) fail(std::string(name) + "() tuple elements must be strings");
            if (test(s, item.str())) return Value::of_bool(true);
        }
        return Value::of_bool(false);
    }
    fail(std::string(name) + "() argument must be a string or tuple of strings");
}

bool is_ascii_word(unsigned char c) { return std::isalnum(c) || c == '_'; }

std::string title_case(const std::string& s) {
    std::string out = s;
    for (std::size_t i = 0; i < out.size(); ++i) {
        auto c = static_cast<unsigned char>(out[i]);
        bool boundary = i == 0 || !is_ascii_word(static_cast<unsigned char>(out[i - 1]));
        if (boundary && is_ascii_word(c)) out[i] = static_cast<char>(std::toupper(c));
    }
    return out;
}

std::string capitalize(const std::string& s) {
    if (s.empty()) return s;
    std::size_t i = 0;
    char32_t cp = next_code_point(s, i);
    if (cp > 0xFFFF) return s;  // charAt(0) is half of a surrogate pair there, which has no case
    return to_upper(s.substr(0, i)) + s.substr(i);
}

Value split(const std::string& s, std::vector<Value>& args) {
    Value sep = args.size() > 0 ? args[0] : Value::null();
    if (sep.kind != Kind::String && sep.kind != Kind::Null) fail("sep argument must be a string or null");
    Value max_v = args.size() > 1 ? args[1] : Value::integer(-1);
    if (max_v.kind != Kind::Integer) fail("maxsplit argument must be a number");
    double maxsplit = max_v.number;
    Array out;
    if (sep.kind == Kind::Null) {
        std::string_view text = trim_start(s);
        std::size_t i = 0;
        while (i < text.size()) {
            i += space_run(text, i);
            if (i >= text.size()) break;
            std::size_t start = i;
            while (i < text.size()) {
                std::size_t j = i;
                if (is_js_space(next_code_point(text, j))) break;
                i = j;
            }
            if (maxsplit != -1 && static_cast<double>(out.size()) >= maxsplit) {
                out.push_back(Value::string(std::string(text.substr(start))));
                break;
            }
            out.push_back(Value::string(std::string(text.substr(start, i - start))));
        }
        return Value::array(std::move(out));
    }
    const std::string& d = sep.str();
    if (d.empty()) fail("empty separator");
    std::vector<std::string> parts;
    for (std::size_t start = 0;;) {
        std::size_t at = s.find(d, start);
        if (at == std::string::npos) {
            parts.push_back(s.substr(start));
            break;
        }
        parts.push_back(s.substr(start, at - start));
        start = at + d.size();
    }
    if (maxsplit != -1 && static_cast<double>(parts.size()) > maxsplit) {
        // at most maxsplit splits; a negative maxsplit other than -1 keeps the whole string
        std::size_t keep = maxsplit < 0 ? 0 : static_cast<std::size_t>(maxsplit);
        std::string rest;
        for (std::size_t i = keep; i < parts.size(); ++i) rest += (i > keep ? d : "") + parts[i];
        parts.resize(keep);
        parts.push_back(rest);
    }
    for (auto& p : parts) out.push_back(Value::string(std::move(p)));
    return Value::array(std::move(out));
}

Value object_items(const Value& o) {
    Array out;
    for (const auto& [k, v] : o.obj().entries) out.push_back(Value::array({Value::string(k), v}));
    return Value::array(std::move(out));
}

Value dictsort(const Value& o, std::vector<Value>& args) {
    Object kwargs;
    std::vector<Value> positional;
    for (const auto& a : args) {
        if (a.kind == Kind::KeywordArgs)
            kwargs = a.obj();
        else
            positional.push_back(a);
    }
    auto pick = [&](std::size_t i, const char* name, Value fallback) {
        if (i < positional.size()) return positional[i];
        const Value* v = kwargs.find(name);
        return v ? *v : fallback;
    };
    Value case_sensitive = pick(0, "case_sensitive", Value::of_bool(false));
    if (case_sensitive.kind != Kind::Boolean) fail("case_sensitive must be a boolean");
    Value by = pick(1, "by", Value::string("key"));
    if (by.kind != Kind::String) fail("by must be a string");
    if (by.str() != "key" && by.str() != "value") fail("by must be either 'key' or 'value'");
    Value reverse = pick(2, "reverse", Value::of_bool(false));
    if (reverse.kind != Kind::Boolean) fail("reverse must be a boolean");
    Array items = object_items(o).items();
    std::size_t index = by.str() == "key" ? 0 : 1;
    std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
        int r = compare_values(a.items()[index], b.items()[index], case_sensitive.boolean);
        return (reverse.boolean ? -r : r) < 0;
    });
    return Value::array(std::move(items));
}

std::string strftime_now(const std::string& format) {
    static const char* kMonths[] = {"January", "February", "March",     "April",   "May",      "June",
                                    "July",    "August",   "September", "October", "November", "December"};
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    auto pad2 = [](int n) { return (n < 10 ? "0" : "") + std::to_string(n); };
    std::string out;
    for (std::size_t i = 0; i < format.size(); ++i) {
        if (format[i] != '%' || i + 1 >= format.size()) {
            out += format[i];
            continue;
        }
        char c = format[i + 1];
        switch (c) {
            case 'Y':
                out += std::to_string(tm.tm_year + 1900);
                break;
            case 'm':
                out += pad2(tm.tm_mon + 1);
                break;
            case 'd':
                out += pad2(tm.tm_mday);
                break;
            case 'b':
                out += std::string(kMonths[tm.tm_mon]).substr(0, 3);
                break;
            case 'B':
                out += kMonths[tm.tm_mon];
                break;
            case 'H':
                out += pad2(tm.tm_hour);
                break;
            case 'M':
                out += pad2(tm.tm_min);
                break;
            case '%':
                out += '%';
                break;
            default:
                out += format.substr(i, 2);
        }
        ++i;
    }
    return out;
}

std::pair<std::string, Value> namespace_entry(const Value& pair) {
    Array parts;
    if (pair.is_array()) {
        parts = pair.items();
    } else if (pair.kind == Kind::String) {
        const std::string& s = pair.str();
        for (std::size_t i = 0; i < s.size();) {
            std::size_t start = i;
            next_code_point(s, i);
            parts.push_back(Value::string(s.substr(start, i - start)));
        }
    }
    if (parts.size() != 2) fail("namespace expected an object or an iterable of [key, value] pairs");
    if (parts[0].kind != Kind::String) fail("namespace keys must be strings");
    return {parts[0].str(), parts[1]};
}

}  // namespace

std::string js_replace(const std::string& s, const std::string& from, const std::string& to, double count,
                       bool has_count) {
    if (has_count && count == 0) return s;
    double remaining = !has_count || count < 0 ? INFINITY : count;
    std::string out;
    if (from.empty()) {  // an empty pattern matches before every code point and at the end
        std::size_t i = 0;
        while (true) {
            if (remaining > 0) {
                out += to;
                check_string_bytes(out.size());
                --remaining;
            }
            if (i >= s.size()) break;
            std::size_t start = i;
            next_code_point(s, i);
            out.append(s, start, i - start);
        }
        return out;
    }
    std::size_t start = 0;
    while (remaining > 0) {
        std::size_t at = s.find(from, start);
        if (at == std::string::npos) break;
        out.append(s, start, at - start);
        out += to;
        check_string_bytes(out.size());
        start = at + from.size();
        --remaining;
    }
    out.append(s, start, std::string::npos);
    return out;
}

Value string_member(const Value& sv, const std::string& name) {
    const std::string& s = sv.str();
    if (name == "length") return Value::integer(static_cast<double>(utf16_length(s)));
    if (name == "upper") return method([sv](auto&) { return Value::string(to_upper(sv.str())); });
    if (name == "lower") return method([sv](auto&) { return Value::string(to_lower(sv.str())); });
    if (name == "strip") return method([sv](auto&) { return Value::string(std::string(trim(sv.str()))); });
    if (name == "rstrip")
        return method([sv](auto&) { return Value::string(std::string(trim_end(sv.str()))); });
    if (name == "lstrip")
        return method([sv](auto&) { return Value::string(std::string(trim_start(sv.str()))); });
    if (name == "title") return method([sv](auto&) { return Value::string(title_case(sv.str())); });
    if (name == "capitalize") return method([sv](auto&) { return Value::string(capitalize(sv.str())); });
    if (name == "startswith")
        return method([sv](auto& args) { return affix_test("startswith", sv.str(), args, starts_with); });
    if (name == "endswith")
        return method([sv](auto& args) { return affix_test("endswith", sv.str(), args, ends_with); });
    if (name == "split") return method([sv](auto& args) { return split(sv.str(), args); });
    if (name == "replace") {
        return method([sv](std::vector<Value>& args) {
            if (args.size() < 2) fail("replace() requires at least two arguments");
            if (args[0].kind != Kind::String || args[1].kind != Kind::String)
                fail("replace() arguments must be strings");
            Value count = Value::null();
            if (args.size() > 2) {
                if (args[2].kind == Kind::KeywordArgs) {
                    const Value* c = args[2].obj().find("count");
                    count = c ? *c : Value::null();
                } else {
                    count = args[2];
                }
            }
            if (count.kind != Kind::Integer && count.kind != Kind::Null)
                fail("replace() count argument must be a number or null");
            return Value::string(js_replace(sv.str(), args[0].str(), args[1].str(), count.number,
                                            count.kind == Kind::Integer));
        });
    }
    return Value::undefined();
}

Value object_member(const Value& ov, const std::string& name) {
    if (name == "get") {
        return method([ov](std::vector<Value>& args) {
            if (args.empty() || args[0].kind != Kind::String)
                fail(std::string("Object key must be a string: got ") +
                     (args.empty() ? "undefined" : kind_name(args[0].kind)));
            if (const Value* v = ov.obj().find(args[0].str())) return *v;
            return args.size() > 1 ? args[1] : Value::null();
        });
    }
    if (name == "items") return method([ov](auto&) { return object_items(ov); });
    if (name == "keys") {
        return method([ov](auto&) {
            Array out;
            for (const auto& [k, v] : ov.obj().entries) out.push_back(Value::string(k));
            return Value::array(std::move(out));
        });
    }
    if (name == "values") {
        return method([ov](auto&) {
            Array out;
            for (const auto& [k, v] : ov.obj().entries) out.push_back(v);
            return Value::array(std::move(out));
        });
    }
    if (name == "dictsort") return method([ov](std::vector<Value>& args) { return dictsort(ov, args); });
    return Value::undefined();
}

bool is_test(const std::string& name) {
    static const char* kTests[] = {"defined",  "undefined", "none",     "string",  "boolean",
                                   "true",     "false",     "number",   "integer", "callable",
                                   "iterable", "mapping",   "sequence", "lower",   "upper",
                                   "odd",      "even",      "equalto",  "eq"};
    for (const char* t : kTests)
        if (name == t) return true;
    return false;
}

bool run_test(const std::string& name, const Value& v, bool& found, const Value* other) {
    found = true;
    if (name == "defined") return v.kind != Kind::Undefined;
    if (name == "undefined") return v.kind == Kind::Undefined;
    if (name == "none") return v.kind == Kind::Null;
    if (name == "string") return v.kind == Kind::String;
    if (name == "boolean") return v.kind == Kind::Boolean;
    if (name == "true") return v.kind == Kind::Boolean && v.boolean;
    if (name == "false") return v.kind == Kind::Boolean && !v.boolean;
    if (name == "number") return v.is_number();
    if (name == "integer") return v.kind == Kind::Integer;
    if (name == "callable") return v.kind == Kind::Function;
    if (name == "iterable") return v.kind == Kind::Array || v.kind == Kind::String;
    if (name == "mapping") return v.is_object();
    if (name == "sequence") return v.is_array() || v.is_object() || v.kind == Kind::String;
    if (name == "lower") return v.kind == Kind::String && v.str() == to_lower(v.str());
    if (name == "upper") return v.kind == Kind::String && v.str() == to_upper(v.str());
    if (name == "odd" || name == "even") {
        if (v.kind != Kind::Integer) fail("cannot " + name + " on " + kind_name(v.kind));
        bool odd = std::fmod(v.number, 2) != 0;
        return name == "odd" ? odd : !odd;
    }
    if (name == "equalto" || name == "eq") {
        if (!other) fail("test '" + name + "' needs a value to compare with");
        return strict_equal(v, *other);
    }
    found = false;
    return false;
}

int compare_values(const Value& a, const Value& b, bool case_sensitive) {
    if (a.kind == Kind::Null && b.kind == Kind::Null) return 0;
    if (a.kind == Kind::Null || b.kind == Kind::Null)
        fail(std::string("Cannot compare ") + kind_name(a.kind) + " with " + kind_name(b.kind));
    if (a.kind == Kind::Undefined && b.kind == Kind::Undefined) return 0;
    if (a.kind == Kind::Undefined || b.kind == Kind::Undefined)
        fail(std::string("Cannot compare ") + kind_name(a.kind) + " with " + kind_name(b.kind));
    bool an = a.is_number() || a.kind == Kind::Boolean, bn = b.is_number() || b.kind == Kind::Boolean;
    if (an && bn) {
        double x = a.kind == Kind::Boolean ? a.boolean : a.number;
        double y = b.kind == Kind::Boolean ? b.boolean : b.number;
        return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.kind != b.kind)
        fail(std::string("Cannot compare different types: ") + kind_name(a.kind) + " and " +
             kind_name(b.kind));
    if (a.kind != Kind::String) fail(std::string("Cannot compare type: ") + kind_name(a.kind));
    std::string x = case_sensitive ? a.str() : to_lower(a.str());
    std::string y = case_sensitive ? b.str() : to_lower(b.str());
    return x < y ? -1 : x > y ? 1 : 0;
}

Value attribute_path(const Value& item, const std::string& path) {
    Value v = item;
    for (std::size_t start = 0;;) {
        std::size_t dot = path.find('.', start);
        std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
        if (v.has_attributes()) {
            const Value* x = v.obj().find(part);
            v = x ? *x : Value::undefined();
        } else if (v.is_array()) {
            // parseInt: leading digits
            std::size_t k = 0;
            while (k < part.size() && std::isdigit(static_cast<unsigned char>(part[k]))) ++k;
            if (k == 0) return Value::undefined();
            double index = std::stod(part.substr(0, k));
            if (index >= static_cast<double>(v.items().size())) return Value::undefined();
            Value next = v.items()[static_cast<std::size_t>(index)];
            v = next;
        } else {
            return Value::undefined();
        }
        if (dot == std::string::npos) break;
        start = dot + 1;
    }
    return v;
}

EnvPtr make_global_env() {
    auto env = std::make_shared<Env>();
    env->set("false", Value::of_bool(false));
    env->set("true", Value::of_bool(true));
    env->set("none", Value::null());
    env->set("False", Value::of_bool(false));
    env->set("True", Value::of_bool(true));
    env->set("None", Value::null());
    env->set("raise_exception", method([](std::vector<Value>& args) -> Value {
                 fail("raise_exception: " + (args.empty() ? std::string() : to_js_string(args[0])));
             }));
    env->set("range", method([](std::vector<Value>& args) {
                 std::vector<double> n;
                 for (const auto& a : args) {
                     if (!a.is_number()) fail("range() arguments must be numbers");
                     n.push_back(a.number);
                 }
                 if (n.empty()) fail("range() expects at least one argument");
                 double start = n.size() > 1 ? n[0] : 0, stop = n.size() > 1 ? n[1] : n[0];
                 double step = n.size() > 2 ? n[2] : 1;
                 if (step == 0) fail("range() step must not be zero");
                 // Counted first: a step too small to move `i` would otherwise never end the loop.
                 check_items(std::max(0.0, std::ceil((stop - start) / step)));
                 Array out;
                 for (double i = start; step > 0 ? i < stop : i > stop; i += step)
                     out.push_back(std::trunc(i) == i ? Value::integer(i) : Value::floating(i));
                 return Value::array(std::move(out));
             }));
    env->set("strftime_now", method([](std::vector<Value>& args) {
                 if (args.empty() || args[0].kind != Kind::String)
                     fail("strftime_now() expects a format string");
                 return Value::string(strftime_now(args[0].str()));
             }));
    env->set("namespace", method([](std::vector<Value>& args) {
                 std::vector<Value> positional = args;
                 Object kwargs;
                 if (!positional.empty() && positional.back().kind == Kind::KeywordArgs) {
                     kwargs = positional.back().obj();
                     positional.pop_back();
                 }
                 if (positional.size() > 1)
                     fail("namespace expected at most 1 argument, got " + std::to_string(positional.size()));
                 Object entries;
                 if (positional.size() == 1) {
                     const Value& source = positional[0];
                     if (source.is_object()) {
                         for (const auto& [k, v] : source.obj().entries) entries.set(k, v);
                     } else if (source.is_array()) {
                         for (const auto& pair : source.items()) {
                             auto [k, v] = namespace_entry(pair);
                             entries.set(k, v);
                         }
                     } else {
                         fail(std::string("'") + kind_name(source.kind) + "' object is not iterable");
                     }
                 }
                 for (const auto& [k, v] : kwargs.entries) entries.set(k, v);
                 return Value::object(std::move(entries), Kind::Namespace);
             }));
    return env;
}

}  // namespace moerl::text::jinja::detail
