// JSON paths for errors, the per-call arena, UTF-8 and the byte-level alphabet.
#include <utf8proc.h>

#include <array>
#include <cstring>

#include "internal.hpp"

namespace moerl::text::detail {

// ---- JsonNode --------------------------------------------------------------------------------
void JsonNode::fail(const std::string& what) const {
    MOERL_FAIL(file_, ": ", path_.empty() ? std::string("(top level)") : path_, " ", what);
}

JsonNode JsonNode::at(const char* key) const {
    if (!j_->is_object()) fail("is not an object");
    auto it = j_->find(key);
    if (it == j_->end()) JsonNode(*j_, file_, child(key)).fail("is missing");
    return JsonNode(*it, file_, child(key));
}

JsonNode JsonNode::at(size_t index) const {
    if (!j_->is_array()) fail("is not an array");
    if (index >= j_->size()) fail("has no element " + std::to_string(index));
    return JsonNode((*j_)[index], file_, path_ + "[" + std::to_string(index) + "]");
}

size_t JsonNode::size() const {
    if (!j_->is_array()) fail("is not an array");
    return j_->size();
}

std::string JsonNode::str() const {
    if (!j_->is_string()) fail("is not a string");
    return j_->get<std::string>();
}

bool JsonNode::boolean() const {
    if (!j_->is_boolean()) fail("is not true or false");
    return j_->get<bool>();
}

int64_t JsonNode::integer() const {
    if (!j_->is_number_integer()) fail("is not an integer");
    return j_->get<int64_t>();
}

std::string JsonNode::str_or(const char* key, const std::string& fallback) const {
    return has(key) ? at(key).str() : fallback;
}

bool JsonNode::bool_or(const char* key, bool fallback) const {
    return has(key) ? at(key).boolean() : fallback;
}

// ---- Arena -----------------------------------------------------------------------------------
char* Arena::alloc(size_t n) {
    constexpr size_t kBlock = 1 << 16;
    while (block_ < blocks_.size() && used_ + n > sizes_[block_]) {
        ++block_;
        used_ = 0;
    }
    if (block_ == blocks_.size()) {
        size_t size = n > kBlock ? n : kBlock;
        blocks_.push_back(std::make_unique<char[]>(size));
        sizes_.push_back(size);
        used_ = 0;
    }
    char* p = blocks_[block_].get() + used_;
    used_ += n;
    return p;
}

std::string_view Arena::copy(std::string_view s) {
    char* p = alloc(s.size());
    if (!s.empty()) std::memcpy(p, s.data(), s.size());
    return {p, s.size()};
}

void Arena::reset() {
    // Keep one large block rather than many: a call that needed several gets them merged.
    if (blocks_.size() > 4) {
        size_t total = 0;
        for (size_t s : sizes_) total += s;
        blocks_.clear();
        sizes_.clear();
        blocks_.push_back(std::make_unique<char[]>(total));
        sizes_.push_back(total);
    }
    block_ = 0;
    used_ = 0;
}

// ---- UTF-8 -----------------------------------------------------------------------------------
namespace {
// Length of the valid UTF-8 sequence at s[i] (>0), or minus the length of the maximal invalid
// subpart there (the bytes that one U+FFFD replaces).
int utf8_sequence(std::string_view s, size_t i) {
    auto at = [&](size_t k) -> int { return k < s.size() ? static_cast<unsigned char>(s[k]) : -1; };
    int b = at(i);
    if (b < 0x80) return 1;
    auto cont = [&](int c) { return c >= 0x80 && c <= 0xBF; };
    if (b >= 0xC2 && b <= 0xDF) return cont(at(i + 1)) ? 2 : -1;
    if (b >= 0xE0 && b <= 0xEF) {
        int c = at(i + 1);
        int lo = b == 0xE0 ? 0xA0 : 0x80, hi = b == 0xED ? 0x9F : 0xBF;
        if (c < lo || c > hi) return -1;
        return cont(at(i + 2)) ? 3 : -2;
    }
    if (b >= 0xF0 && b <= 0xF4) {
        int c = at(i + 1);
        int lo = b == 0xF0 ? 0x90 : 0x80, hi = b == 0xF4 ? 0x8F : 0xBF;
        if (c < lo || c > hi) return -1;
        if (!cont(at(i + 2))) return -2;
        return cont(at(i + 3)) ? 4 : -3;
    }
    return -1;
}
}  // namespace

size_t find_invalid_utf8(std::string_view s) {
    size_t i = 0;
    while (i < s.size()) {
        // Eight ASCII bytes at a time: the common case.
        if (i + 8 <= s.size()) {
            uint64_t w;
            std::memcpy(&w, s.data() + i, 8);
            if ((w & 0x8080808080808080ull) == 0) {
                i += 8;
                continue;
            }
        }
        int n = utf8_sequence(s, i);
        if (n < 0) return i;
        i += n;
    }
    return std::string_view::npos;
}

void append_utf8(std::string& out, uint32_t cp) {
    utf8proc_uint8_t buf[4];
    auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
    out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

std::string utf8_lossy(std::string_view bytes) {
    std::string out;
    out.reserve(bytes.size());
    size_t i = 0;
    while (i < bytes.size()) {
        int n = utf8_sequence(bytes, i);
        if (n > 0) {
            out.append(bytes.data() + i, n);
            i += n;
        } else {
            out.append("\xEF\xBF\xBD");
            i += -n;
        }
    }
    return out;
}

bool is_whitespace(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

bool is_alphanumeric(uint32_t cp) {
    auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
    return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) ||
           (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO);
}

namespace {
struct ByteAlphabet {
    std::array<std::string, 256> to_char;
    std::array<int, 512> to_byte;
    ByteAlphabet() {
        to_byte.fill(-1);
        int extra = 0;
        for (int b = 0; b < 256; ++b) {
            bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            uint32_t cp = printable ? b : 256 + extra++;
            append_utf8(to_char[b], cp);
            to_byte[cp] = b;
        }
    }
};
const ByteAlphabet& alphabet() {
    static const ByteAlphabet a;
    return a;
}
}  // namespace

const std::string& byte_to_char_utf8(uint8_t b) { return alphabet().to_char[b]; }
int byte_of_char(uint32_t cp) { return cp < 512 ? alphabet().to_byte[cp] : -1; }

}  // namespace moerl::text::detail
