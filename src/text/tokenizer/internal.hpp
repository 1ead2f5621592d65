// Pieces of the tokenizer pipeline shared by its source files (not installed).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "moerl/core/error.hpp"

namespace moerl::text::detail {

using json = nlohmann::json;

// A position in a parsed JSON file, for error messages naming the file and the JSON path
// ("tokenizer.json: pre_tokenizer.pretokenizers[1].type 'Foo' is not supported").
class JsonNode {
  public:
    JsonNode(const json& j, std::string file, std::string path = "")
        : j_(&j), file_(std::move(file)), path_(std::move(path)) {}
    const json& raw() const { return *j_; }
    const std::string& path() const { return path_; }
    const std::string& file() const { return file_; }
    bool is_null() const { return j_->is_null(); }
    bool has(const char* key) const { return j_->is_object() && j_->contains(key) && !(*j_)[key].is_null(); }
    // The member `key`; throws when it is missing.
    JsonNode at(const char* key) const;
    JsonNode at(size_t index) const;
    size_t size() const;  // of an array; throws for other types
    std::string str() const;
    bool boolean() const;
    int64_t integer() const;
    // Optional members with a default.
    std::string str_or(const char* key, const std::string& fallback) const;
    bool bool_or(const char* key, bool fallback) const;
    [[noreturn]] void fail(const std::string& what) const;

  private:
    std::string child(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
    const json* j_;
    std::string file_;
    std::string path_;
};

// A contiguous span of text moving through the pipeline. Text pieces point into the input or into
// the per-call arena; a piece with token >= 0 is an added token already matched.
struct Piece {
    const char* data;
    uint32_t size;
    int32_t token;
    std::string_view view() const { return {data, size}; }
};

// Bump allocator for text made during one encode call (normalised or prefixed pieces): pointers
// stay valid until reset(); memory is kept across calls.
class Arena {
  public:
    char* alloc(size_t n);
    std::string_view copy(std::string_view s);
    void reset();

  private:
    std::vector<std::unique_ptr<char[]>> blocks_;
    std::vector<size_t> sizes_;
    size_t block_ = 0, used_ = 0;
};

// ---- UTF-8 -----------------------------------------------------------------------------------
// Byte offset of the first invalid UTF-8 sequence in s, or npos when s is valid.
size_t find_invalid_utf8(std::string_view s);
// Decodes the code point at s[i] (s valid UTF-8) and advances i.
inline uint32_t next_code_point(std::string_view s, size_t& i) {
    auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
        ++i;
        return b;
    }
    int n = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
    uint32_t cp = b & (0x7F >> n);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    i += n;
    return cp;
}
void append_utf8(std::string& out, uint32_t cp);
// Replaces each maximal invalid subpart by U+FFFD (Rust's String::from_utf8_lossy).
std::string utf8_lossy(std::string_view bytes);
bool is_whitespace(uint32_t cp);  // Rust char::is_whitespace (Unicode White_Space)
bool is_alphanumeric(uint32_t cp);

// The GPT-2 byte-level alphabet: byte b <-> one printable code point.
const std::string& byte_to_char_utf8(uint8_t b);
int byte_of_char(uint32_t cp);  // -1 when cp is not in the alphabet

// ---- regex (PCRE2, UTF + UCP, JIT) -----------------------------------------------------------
class Regex {
  public:
    // `pattern` in the Oniguruma syntax Hugging Face files use; `where` names it in errors.
    Regex(const std::string& pattern, const JsonNode& where);
    ~Regex();
    Regex(const Regex&) = delete;
    Regex& operator=(const Regex&) = delete;
    // Calls on_match(begin, end) for each non-overlapping match in s, left to right.
    template <typename F>
    void for_each_match(std::string_view s, F&& on_match) const {
        size_t start = 0;
        size_t b, e;
        while (start <= s.size() && next_match(s, start, b, e)) {
            on_match(b, e);
            start = e > b ? e : e + 1;
            if (e == b)  // empty match: step over one whole character
                while (start < s.size() && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) ++start;
        }
    }

  private:
    bool next_match(std::string_view s, size_t start, size_t& b, size_t& e) const;
    void* code_;  // pcre2_code_8
};
std::string escape_regex(std::string_view literal);

// ---- pipeline components ---------------------------------------------------------------------
class Normalizer {
  public:
    virtual ~Normalizer() = default;
    // The normalised text of `in`; a view of `in` itself when nothing changes.
    virtual std::string_view normalize(std::string_view in, Arena& arena) const = 0;
};
std::unique_ptr<Normalizer> make_normalizer(const JsonNode& node);

class PreTokenizer {
  public:
    virtual ~PreTokenizer() = default;
    // Splits each text piece of `in` into `out` (token pieces pass through unchanged).
    virtual void split(const std::vector<Piece>& in, std::vector<Piece>& out, Arena& arena) const = 0;
};
// When the chain ends in a ByteLevel step and `allow_deferred`, that step leaves its byte-to-char
// mapping to the model (which maps bytes to its first symbols directly) and `deferred` is set.
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const JsonNode& node, bool allow_deferred, bool& deferred);

}  // namespace moerl::text::detail
