#include "moerl/text/jinja.hpp"

#include "template/ast.hpp"
#include "template/interpreter.hpp"
#include "template/lexer.hpp"

namespace moerl::text::jinja {

Template::Template(const std::string& source) : program_(detail::parse(detail::tokenize(source))) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

std::string Template::render(const nlohmann::ordered_json& context) const {
    if (!context.is_object() && !context.is_null())
        throw TemplateError(
            "chat template context must be a JSON object, got " + std::string(context.type_name()), 0, 0,
            __FILE__, __LINE__);
    detail::EnvPtr global = detail::make_global_env();
    try {
        if (context.is_object()) {
            for (auto it = context.begin(); it != context.end(); ++it) {
                // like the reference, a context key may not replace a builtin (true, range, namespace, ...)
                if (global->has_own(it.key()))
                    throw TemplateError(
                        "chat template context key '" + it.key() + "' clashes with a builtin name", 0, 0,
                        __FILE__, __LINE__);
                global->set(it.key(), detail::from_json(it.value()));
            }
        }
    } catch (const detail::EvalError& e) {
        throw TemplateError("chat template context: " + e.message, 0, 0, __FILE__, __LINE__);
    }
    detail::Interpreter interpreter;
    return interpreter.run(*program_, global);
}

}  // namespace moerl::text::jinja
