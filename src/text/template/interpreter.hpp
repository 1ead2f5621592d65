// Evaluates a parsed template over Values with @huggingface/jinja's semantics: scopes (a for
// loop has one scope for all its iterations; if has none; macros see their caller's scope),
// loose `==`, JavaScript number and string behaviour.
#pragma once

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "template/ast.hpp"
#include "template/value.hpp"

namespace moerl::text::jinja::detail {

class Env {
  public:
    explicit Env(EnvPtr parent = nullptr) : parent_(std::move(parent)) {}
    Value lookup(const std::string& name) const;
    void set(const std::string& name, Value v) { vars_[name] = std::move(v); }
    bool has_own(const std::string& name) const { return vars_.count(name) != 0; }

  private:
    EnvPtr parent_;
    std::unordered_map<std::string, Value> vars_;
};

// The global scope a render starts from: true/false/none (and title-case forms),
// raise_exception, range, strftime_now and namespace.
EnvPtr make_global_env();

// Builtins (builtins.cpp): members of strings, arrays and objects, the `is` tests and namespace().
Value string_member(const Value& s, const std::string& name);
Value object_member(const Value& o, const std::string& name);
bool is_test(const std::string& name);
// A test by name, or false in `found` when there is none.
bool run_test(const std::string& name, const Value& v, bool& found, const Value* other = nullptr);
std::string js_replace(const std::string& s, const std::string& from, const std::string& to, double count,
                       bool has_count);
// sort/dictsort order; throws EvalError for values that do not compare.
int compare_values(const Value& a, const Value& b, bool case_sensitive);
// Nested attribute by dotted path ("a.b", "items.0"), as sort(attribute=) and map(attribute=) read it.
Value attribute_path(const Value& item, const std::string& path);

class Interpreter {
  public:
    std::string run(const Node& program, const EnvPtr& global);

  private:
    // Recursive macros are allowed; this bounds them before the C++ stack runs out.
    static constexpr int kMaxMacroDepth = 256;
    int macro_depth_ = 0;
    // Bounds the work of one render, so that a template from a user's file cannot hang the
    // process: a step is one template node evaluated, a loop iteration and a macro call cost more
    // (their scopes), a computed list or string costs its items (a string one step per 64
    // bytes), and a string taken apart into code points (indexing, slicing, join over a string)
    // one step per byte. The limit lets a runaway render end within seconds.
    static constexpr std::size_t kMaxRenderSteps = 2'000'000;
    static constexpr std::size_t kStepsPerIteration = 8;
    static constexpr std::size_t kStepsPerCall = 32;
    std::size_t steps_ = 0;
    void take_steps(std::size_t count);
    // Namespaces given an attribute during the render. An attribute may hold its own namespace (a
    // reference cycle of shared containers), so run() empties them all when the render ends.
    std::unordered_map<const void*, Value> assigned_namespaces_;

    void exec(const Node& n, const EnvPtr& env, std::string& out);
    void exec_block(const std::vector<NodePtr>& body, const EnvPtr& env, std::string& out);
    std::string render_block(const std::vector<NodePtr>& body, const EnvPtr& env) {
        std::string out;
        exec_block(body, env, out);
        return out;
    }
    Value eval(const Node& n, const EnvPtr& env);
    Value eval_inner(const Node& n, const EnvPtr& env);
    Value eval_binary(const Node& n, const EnvPtr& env);
    Value eval_member(const Node& n, const EnvPtr& env);
    Value eval_slice(const Value& object, const Node& slice, const EnvPtr& env);
    Value eval_call(const Node& n, const EnvPtr& env);
    Value apply_filter(const Value& operand, const Node& filter, const EnvPtr& env);
    Value apply_filter_call(const Value& operand, const Node& call, const EnvPtr& env);
    std::pair<std::vector<Value>, Object> eval_arguments(const std::vector<NodePtr>& args, const EnvPtr& env);
    void exec_for(const Node& n, const EnvPtr& env, std::string& out);
    void exec_set(const Node& n, const EnvPtr& env);
    // The macro's body and parameters belong to the program, which outlives the render.
    Value make_macro(const std::string& display_name, const std::vector<NodePtr>& params,
                     const std::vector<NodePtr>& body);
    void bind_macro_arguments(const std::string& display_name, const std::vector<NodePtr>& params,
                              bool use_kwargs, bool use_varargs, std::vector<Value> args,
                              const EnvPtr& scope);
};

}  // namespace moerl::text::jinja::detail
