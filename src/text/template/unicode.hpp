// UTF-8 helpers with JavaScript's notion of whitespace and case, which the reference renderer
// (JavaScript) applies to strip, trim, split and the whitespace-control markers.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace moerl::text::jinja::detail {

// Decodes the code point at s[i] and advances i; a malformed byte decodes as U+FFFD, length 1.
char32_t next_code_point(std::string_view s, std::size_t& i);
void append_utf8(std::string& out, char32_t cp);

// JavaScript's WhiteSpace and LineTerminator (what /\s/ and String.prototype.trim match).
bool is_js_space(char32_t cp);
// Byte length of the whitespace run that starts at s[pos].
std::size_t space_run(std::string_view s, std::size_t pos);
// Byte offset where the whitespace run ending at s[end) begins.
std::size_t space_run_start(std::string_view s, std::size_t end);

std::string_view trim(std::string_view s);
std::string_view trim_start(std::string_view s);
std::string_view trim_end(std::string_view s);

// JavaScript's toUpperCase/toLowerCase: utf8proc's mappings plus the multi-code-point ones
// (ß -> SS, ligatures, İ) and the final sigma.
std::string to_upper(std::string_view s);
std::string to_lower(std::string_view s);

std::size_t num_code_points(std::string_view s);
// Length in UTF-16 code units, which is what a JavaScript string's length counts.
std::size_t utf16_length(std::string_view s);

}  // namespace moerl::text::jinja::detail
