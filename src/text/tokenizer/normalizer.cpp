// Normalizers: Unicode forms through utf8proc, Sequence, Replace, Prepend, Lowercase, Strip.
#include <utf8proc.h>

#include <cstdlib>
#include <cstring>

#include "internal.hpp"

namespace moerl::text::detail {

namespace {

enum class Form { kNFC, kNFD, kNFKC, kNFKD };

// True when the code point is left unchanged by the form whatever surrounds it: no decomposition
// that the form applies, canonical combining class 0, and never the second half of a composition.
bool stable_under(uint32_t cp, Form form) {
    // Below U+0300 nothing changes under NFC; below U+00A0 (U+00C0) nothing under NFKC (NFD).
    if (cp < (form == Form::kNFC ? 0x300u : form == Form::kNFKC ? 0xA0u : 0xC0u)) return true;
    if (cp >= 0x1100 && cp <= 0x11FF) return false;  // Hangul jamo compose algorithmically
    if (cp >= 0xAC00 && cp <= 0xD7A3) return form == Form::kNFC || form == Form::kNFKC;
    const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
    if (p->combining_class != 0) return false;
    if (p->decomp_seqindex != UINT16_MAX) {
        bool compat = p->decomp_type != 0;
        if (!compat || form == Form::kNFKC || form == Form::kNFKD) return false;
    }
    if (p->comb_index != UINT16_MAX && p->comb_index >= 0x8000) return false;
    return true;
}

class UnicodeForm : public Normalizer {
  public:
    explicit UnicodeForm(Form form) : form_(form) {}
    std::string_view normalize(std::string_view in, Arena& arena) const override {
        size_t i = 0;
        bool stable = true;
        while (i < in.size()) {
            if (static_cast<unsigned char>(in[i]) < 0x80) {
                ++i;
                continue;
            }
            if (!stable_under(next_code_point(in, i), form_)) {
                stable = false;
                break;
            }
        }
        if (stable) return in;
        int options = UTF8PROC_STABLE;
        if (form_ == Form::kNFC || form_ == Form::kNFKC)
            options |= UTF8PROC_COMPOSE;
        else
            options |= UTF8PROC_DECOMPOSE;
        if (form_ == Form::kNFKC || form_ == Form::kNFKD) options |= UTF8PROC_COMPAT;
        utf8proc_uint8_t* out = nullptr;
        auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(in.data()),
                              static_cast<utf8proc_ssize_t>(in.size()), &out,
                              static_cast<utf8proc_option_t>(options));
        MOERL_CHECK(n >= 0, "Unicode normalisation failed: ", utf8proc_errmsg(n));
        std::string_view result = arena.copy({reinterpret_cast<const char*>(out), static_cast<size_t>(n)});
        std::free(out);
        return result;
    }

  private:
    Form form_;
};

class SequenceNormalizer : public Normalizer {
  public:
    explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
    std::string_view normalize(std::string_view in, Arena& arena) const override {
        for (const auto& s : steps_) in = s->normalize(in, arena);
        return in;
    }

  private:
    std::vector<std::unique_ptr<Normalizer>> steps_;
};

class Replace : public Normalizer {
  public:
    Replace(std::string pattern, std::string content, const JsonNode& where)
        : regex_(pattern, where), content_(std::move(content)) {}
    std::string_view normalize(std::string_view in, Arena& arena) const override {
        std::string out;
        size_t last = 0;
        regex_.for_each_match(in, [&](size_t b, size_t e) {
            out.append(in.substr(last, b - last));
            out.append(content_);
            last = e;
        });
        if (last == 0 && out.empty()) return in;
        out.append(in.substr(last));
        return arena.copy(out);
    }

  private:
    Regex regex_;
    std::string content_;
};

class Prepend : public Normalizer {
  public:
    explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}
    std::string_view normalize(std::string_view in, Arena& arena) const override {
        if (in.empty()) return in;
        char* p = arena.alloc(prefix_.size() + in.size());
        std::memcpy(p, prefix_.data(), prefix_.size());
        std::memcpy(p + prefix_.size(), in.data(), in.size());
        return {p, prefix_.size() + in.size()};
    }

  private:
    std::string prefix_;
};

// Simple (one code point to one) lower-case mapping; Rust's to_lowercase also applies the few
// multi-character and final-sigma rules.
class Lowercase : public Normalizer {
  public:
    std::string_view normalize(std::string_view in, Arena& arena) const override {
        std::string out;
        out.reserve(in.size());
        size_t i = 0;
        while (i < in.size()) {
            uint32_t cp = next_code_point(in, i);
            append_utf8(out, static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
        }
        return out == in ? in : arena.copy(out);
    }
};

class Strip : public Normalizer {
  public:
    Strip(bool left, bool right) : left_(left), right_(right) {}
    std::string_view normalize(std::string_view in, Arena&) const override {
        if (left_) {
            size_t i = 0;
            while (i < in.size()) {
                size_t j = i;
                if (!is_whitespace(next_code_point(in, j))) break;
                i = j;
            }
            in.remove_prefix(i);
        }
        if (right_) {
            while (!in.empty()) {
                size_t start = in.size() - 1;
                while (start > 0 && (static_cast<unsigned char>(in[start]) & 0xC0) == 0x80) --start;
                size_t j = start;
                if (!is_whitespace(next_code_point(in, j))) break;
                in = in.substr(0, start);
            }
        }
        return in;
    }

  private:
    bool left_, right_;
};

std::string pattern_of(const JsonNode& node) {
    JsonNode p = node.at("pattern");
    if (p.has("Regex")) return p.at("Regex").str();
    if (p.has("String")) return escape_regex(p.at("String").str());
    p.fail("has neither String nor Regex");
}

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const JsonNode& node) {
    std::string type = node.at("type").str();
    if (type == "NFC") return std::make_unique<UnicodeForm>(Form::kNFC);
    if (type == "NFD") return std::make_unique<UnicodeForm>(Form::kNFD);
    if (type == "NFKC") return std::make_unique<UnicodeForm>(Form::kNFKC);
    if (type == "NFKD") return std::make_unique<UnicodeForm>(Form::kNFKD);
    if (type == "Sequence") {
        JsonNode list = node.at("normalizers");
        std::vector<std::unique_ptr<Normalizer>> steps;
        for (size_t i = 0; i < list.size(); ++i) steps.push_back(make_normalizer(list.at(i)));
        return std::make_unique<SequenceNormalizer>(std::move(steps));
    }
    if (type == "Replace") return std::make_unique<Replace>(pattern_of(node), node.at("content").str(), node);
    if (type == "Prepend") return std::make_unique<Prepend>(node.at("prepend").str());
    if (type == "Lowercase") return std::make_unique<Lowercase>();
    if (type == "Strip")
        return std::make_unique<Strip>(node.bool_or("strip_left", false), node.bool_or("strip_right", false));
    node.at("type").fail("'" + type + "' is not supported");
}

}  // namespace moerl::text::detail
