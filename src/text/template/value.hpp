// The interpreter's values: the runtime types of @huggingface/jinja (integers and floats are both
// doubles, as JavaScript numbers are), with containers shared by reference so that `==` on two
// arrays or objects is identity, as there.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace moerl::text::jinja::detail {

class Env;
struct Value;
using EnvPtr = std::shared_ptr<Env>;
using Array = std::vector<Value>;

// Insertion-ordered string keys, as a JavaScript Map.
struct Object {
    std::vector<std::pair<std::string, Value>> entries;
    const Value* find(std::string_view key) const;
    void set(std::string key, Value value);
};

// A callable: builtins, macros, caller(). The last argument is of kind KeywordArgs when the
// call had keyword arguments.
using Function = std::function<Value(std::vector<Value>& args, const EnvPtr& scope)>;

enum class Kind {
    Undefined,
    Null,
    Boolean,
    Integer,
    Float,
    String,
    Array,
    Tuple,
    Object,
    KeywordArgs,
    Namespace,
    Function
};

// Thrown by builtins; the interpreter adds the template position of the node being evaluated.
struct EvalError {
    std::string message;
};

// What one render may build, so that a template from a user's file cannot exhaust the memory of the
// process: a string (the rendered prompt included) and the items of one list. Real chat templates
// stay far below both (a prompt of 16 MiB is millions of tokens).
constexpr std::size_t kMaxStringBytes = std::size_t{16} << 20;
constexpr std::size_t kMaxItems = std::size_t{1} << 17;
// Throw EvalError naming the limit when a string of `bytes` or a list of `count` items would pass
// it. `count` is a double so that range() and slices can check before they build.
void check_string_bytes(std::size_t bytes);
void check_items(double count);

struct Value {
    Kind kind = Kind::Undefined;
    bool boolean = false;
    double number = 0;
    std::variant<std::monostate, std::shared_ptr<const std::string>, std::shared_ptr<Array>,
                 std::shared_ptr<Object>, std::shared_ptr<const Function>>
        payload;

    static Value undefined() { return {}; }
    static Value null();
    static Value of_bool(bool b);
    static Value integer(double n);
    static Value floating(double n);
    static Value string(std::string s);
    static Value array(Array items, Kind kind = Kind::Array);
    static Value object(Object o, Kind kind = Kind::Object);
    static Value function(Function f);

    bool is_number() const { return kind == Kind::Integer || kind == Kind::Float; }
    bool is_array() const { return kind == Kind::Array || kind == Kind::Tuple; }
    // An ObjectValue in the reference (keyword arguments are one, namespaces are not).
    bool is_object() const { return kind == Kind::Object || kind == Kind::KeywordArgs; }
    bool has_attributes() const { return is_object() || kind == Kind::Namespace; }

    const std::string& str() const { return *std::get<std::shared_ptr<const std::string>>(payload); }
    Array& items() const { return *std::get<std::shared_ptr<Array>>(payload); }
    Object& obj() const { return *std::get<std::shared_ptr<Object>>(payload); }
    const Function& fn() const { return *std::get<std::shared_ptr<const Function>>(payload); }
    // The container's address, for identity comparisons (nullptr for scalars).
    const void* identity() const;
};

const char* kind_name(Kind kind);  // the reference's type names ("StringValue", ...)

bool truthy(const Value& v);
// The reference's `==` (JavaScript loose equality on the underlying values) and the strict
// equality that `in` and `unique` use.
bool loose_equal(const Value& a, const Value& b);
bool strict_equal(const Value& a, const Value& b);

// JavaScript's Number.prototype.toString.
std::string js_number(double x);
// What a value prints as in output ({{ x }}, the `string` filter on floats); none and undefined
// print nothing at the top level, and "undefined" inside a list joined by `~`.
std::string to_display(const Value& v);
// JavaScript's String(value.value): what `~` and `+` concatenate and `join` joins.
std::string to_js_string(const Value& v);

struct JsonOptions {
    int indent = 0;  // 0: one line
    bool ensure_ascii = false;
    bool sort_keys = false;
    bool custom_separators = false;
    std::string item_separator, key_separator;
};
// The reference's toJSON; undefined is "null" when undefined_as_null, else "undefined".
std::string to_json(const Value& v, const JsonOptions& options, bool undefined_as_null = true);
// JSON.stringify of a string.
void append_json_string(std::string& out, std::string_view s, bool ensure_ascii);

Value from_json(const nlohmann::ordered_json& j);

}  // namespace moerl::text::jinja::detail
