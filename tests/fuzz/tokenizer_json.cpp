// Fuzz target: a Hugging Face tokenizer.json and its tokenizer_config.json. The input is the
// tokenizer.json text, then a NUL byte and the tokenizer_config.json text (absent: no config). An
// accepted tokenizer encodes a fixed text and a slice of the input, and decodes what it encoded.
#include <algorithm>
#include <cstring>
#include <string_view>
#include <vector>

#include "fuzz_target.hpp"
#include "moerl/text/tokenizer.hpp"

namespace {

using moerl::fuzz::require;

// True when `s` is well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool is_utf8(std::string_view s) {
    for (size_t i = 0; i < s.size();) {
        const auto c = static_cast<unsigned char>(s[i]);
        size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        if (n == 0 || i + n > s.size()) return false;
        uint32_t cp = n == 1 ? c : c & (0x7F >> n);
        for (size_t k = 1; k < n; ++k) {
            const auto d = static_cast<unsigned char>(s[i + k]);
            if ((d & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (d & 0x3F);
        }
        static constexpr uint32_t kMinOfLength[] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < kMinOfLength[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += n;
    }
    return true;
}

// Encodes `text` both ways and checks what the header promises of the ids and of their decoding.
void encode_and_decode(const moerl::text::Tokenizer& tok, std::string_view text) {
    for (bool add_special : {true, false}) {
        const std::vector<int32_t> ids = tok.encode(text, add_special);
        for (int32_t id : ids) require(id >= 0 && id < tok.vocab_size(), "encoded id in [0, vocab_size)");
        for (bool skip_special : {false, true}) {
            std::string decoded;
            try {
                decoded = tok.decode(ids, skip_special);
            } catch (...) {
                require(false, "decode of encoded ids does not throw");
            }
            require(is_utf8(decoded), "decode gives valid UTF-8");
        }
        if (!add_special) {
            // Appending to ids already there gives the same ids after them.
            std::vector<int32_t> appended = {0};
            tok.encode_into(text, false, appended);
            require(std::equal(ids.begin(), ids.end(), appended.begin() + 1, appended.end()),
                    "encode_into appends what encode returns");
        }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string input = moerl::fuzz::as_text(data, size);
    const size_t nul = input.find('\0');
    const std::string_view tokenizer_json = std::string_view(input).substr(0, nul);
    const std::string_view config_json =
        nul == std::string::npos ? std::string_view() : std::string_view(input).substr(nul + 1);
    return moerl::fuzz::parse_or_refuse([&] {
        const auto tok = moerl::text::Tokenizer::from_json(tokenizer_json, config_json, "tokenizer.json");
        require(tok.vocab_size() >= 0, "vocab_size is not negative");
        encode_and_decode(
            tok, "Hello, world! It's 2025: caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac  x\n\ty \xf0\x9f\x99\x82");
        // A slice of the file (its strings hold the tokens and added tokens it may split on); a slice
        // that is not UTF-8 is refused by encode with a moerl::Error, which ends this input.
        if (is_utf8(tokenizer_json.substr(0, 256))) encode_and_decode(tok, tokenizer_json.substr(0, 256));
        for (const auto& special : {tok.bos_id(), tok.eos_id(), tok.pad_id()})
            require(!special || (*special >= 0 && *special < tok.vocab_size()), "special id in range");
        for (int32_t id = 0; id < std::min(tok.vocab_size(), 64); ++id) {
            if (const auto token = tok.id_to_token(id))
                require(tok.token_to_id(*token).has_value(), "token found");
        }
    });
}
