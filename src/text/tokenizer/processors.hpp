// Post-processors (special tokens around an encoding) and decoders (tokens back to text).
#pragma once

#include <string>
#include <vector>

#include "internal.hpp"

namespace moerl::text::detail {

// TemplateProcessing / BertProcessing / RobertaProcessing / ByteLevel / Sequence, for single
// sequences: the ids to put before and after the encoded text when special tokens are asked for.
struct PostProcessor {
    std::vector<int32_t> before, after;
};
PostProcessor make_post_processor(const JsonNode& node);

class Decoder {
  public:
    virtual ~Decoder() = default;
    virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};
std::unique_ptr<Decoder> make_decoder(const JsonNode& node);

}  // namespace moerl::text::detail
