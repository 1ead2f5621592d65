// Hugging Face tokenizers (tokenizer.json + tokenizer_config.json): byte-level BPE with the
// normalizer, pre-tokenizer, added tokens, post-processor and decoder of the file, giving the same
// ids as Hugging Face's `tokenizers` library.
//
// Input text must be valid UTF-8: encode() throws moerl::Error naming the byte offset of the first
// invalid sequence. decode() turns byte sequences that are not valid UTF-8 (a token cut inside a
// character) into U+FFFD, one per maximal invalid subpart, as Hugging Face does.
//
// A Tokenizer is immutable after load and safe to use from many threads at once; each thread keeps
// its own word cache and scratch buffers.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moerl::text {

namespace detail {
struct TokenizerImpl;
}

// What tokenizer_config.json says (every field optional; absent fields stay empty/false).
struct TokenizerConfig {
    std::optional<std::string> bos_token;
    std::optional<std::string> eos_token;
    std::optional<std::string> pad_token;
    std::optional<std::string> unk_token;
    bool add_bos_token = false;
    bool add_eos_token = false;
    std::string chat_template;  // the Jinja source; empty when the config has none
};

class Tokenizer {
  public:
    // `path` is a tokenizer.json file or a directory holding one (and maybe tokenizer_config.json).
    // Throws moerl::Error naming the file and the JSON path of anything malformed or unsupported.
    static Tokenizer load(const std::string& path);
    // From the text of a tokenizer.json (and optionally of a tokenizer_config.json); `name` is used
    // in error messages.
    static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json = {},
                               const std::string& name = "tokenizer.json");

    Tokenizer(Tokenizer&&) noexcept;
    Tokenizer& operator=(Tokenizer&&) noexcept;
    ~Tokenizer();

    // Token ids of `text`. add_special_tokens runs the file's post-processor (e.g. a bos token
    // from TemplateProcessing), as Hugging Face's encode(text, add_special_tokens) does.
    std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
    // Appends to `ids` (no allocation once `ids` has grown enough).
    void encode_into(std::string_view text, bool add_special_tokens, std::vector<int32_t>& ids) const;
    // Encodes every text on up to `num_threads` threads (0: the hardware's count).
    std::vector<std::vector<int32_t>> encode_batch(std::span<const std::string> texts,
                                                   bool add_special_tokens = true, int num_threads = 0) const;
    // Text of `ids`; ids out of range are skipped, as Hugging Face does.
    std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

    std::optional<std::string> id_to_token(int32_t id) const;
    std::optional<int32_t> token_to_id(std::string_view token) const;
    // One more than the largest id of the model or the added tokens (the embedding rows needed).
    int32_t vocab_size() const;
    bool is_special(int32_t id) const;

    const TokenizerConfig& config() const;
    // Ids of the config's special tokens, where it names them and they are in the vocabulary.
    std::optional<int32_t> bos_id() const;
    std::optional<int32_t> eos_id() const;
    std::optional<int32_t> pad_id() const;

  private:
    explicit Tokenizer(std::unique_ptr<detail::TokenizerImpl> impl);
    std::unique_ptr<detail::TokenizerImpl> impl_;
};

}  // namespace moerl::text
