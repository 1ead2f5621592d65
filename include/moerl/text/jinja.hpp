// A Jinja renderer for Hugging Face chat templates, equal byte for byte to @huggingface/jinja (the
// renderer transformers.js uses) on the subset chat templates use. The supported constructs are
// listed in src/text/template/README.md; anything else is a TemplateError naming line and column.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "moerl/core/error.hpp"

namespace moerl::text::jinja {

namespace detail {
struct Node;
}

// A syntax error, an unsupported construct, or a failure while rendering (an unknown filter, a
// type mismatch, raise_exception). line and column (1-based, column in code points) point into
// the template source as given; 0 when no place applies.
class TemplateError : public Error {
  public:
    TemplateError(const std::string& what, int line, int column, const char* file, int source_line)
        : Error(what, file, source_line), line_(line), column_(column) {}
    int template_line() const { return line_; }
    int template_column() const { return column_; }

  private:
    int line_;
    int column_;
};

// A parsed template; render() may be called many times and from several threads at once.
// The source is preprocessed as transformers does: trim_blocks and lstrip_blocks on, a single
// trailing newline dropped, {% generation %} tags removed.
class Template {
  public:
    explicit Template(const std::string& source);
    ~Template();
    Template(Template&&) noexcept;
    Template& operator=(Template&&) noexcept;

    // Renders with the keys of `context` (an object) as top-level variables. JSON numbers with an
    // integral value are integers, as in JavaScript; key order is kept (ordered_json).
    std::string render(const nlohmann::ordered_json& context) const;

  private:
    std::shared_ptr<const detail::Node> program_;
};

}  // namespace moerl::text::jinja
