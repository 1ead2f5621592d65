#include "processors.hpp"

#include <cstdint>
#include <cstdlib>

namespace moerl::text::detail {

namespace {

// A token id the post-processor adds; load_tokenizer checks it against the vocabulary.
int32_t token_id(const JsonNode& node) {
    const int64_t id = node.integer();
    if (id < 0 || id > INT32_MAX) node.fail("is not a token id");
    return static_cast<int32_t>(id);
}

void add_template(const JsonNode& node, PostProcessor& pp) {
    JsonNode items = node.at("single");
    JsonNode specials = node.at("special_tokens");
    bool seen_sequence = false;
    for (size_t i = 0; i < items.size(); ++i) {
        JsonNode item = items.at(i);
        if (item.has("Sequence")) {
            if (seen_sequence) item.fail("has a second Sequence in a single-sequence template");
            seen_sequence = true;
            continue;
        }
        if (!item.has("SpecialToken")) item.fail("is neither Sequence nor SpecialToken");
        std::string name = item.at("SpecialToken").at("id").str();
        if (!specials.has(name.c_str()))
            item.at("SpecialToken").at("id").fail("'" + name + "' is not in special_tokens");
        JsonNode ids = specials.at(name.c_str()).at("ids");
        auto& dst = seen_sequence ? pp.after : pp.before;
        for (size_t k = 0; k < ids.size(); ++k) dst.push_back(token_id(ids.at(k)));
    }
}

void add_processor(const JsonNode& node, PostProcessor& pp) {
    std::string type = node.at("type").str();
    if (type == "ByteLevel") return;  // offsets only
    if (type == "TemplateProcessing") return add_template(node, pp);
    if (type == "BertProcessing" || type == "RobertaProcessing") {
        pp.before.push_back(token_id(node.at("cls").at(1)));
        pp.after.push_back(token_id(node.at("sep").at(1)));
        return;
    }
    if (type == "Sequence") {
        JsonNode list = node.at("processors");
        for (size_t i = 0; i < list.size(); ++i) {
            PostProcessor inner;
            add_processor(list.at(i), inner);
            // Each processor wraps what the previous ones produced.
            pp.before.insert(pp.before.begin(), inner.before.begin(), inner.before.end());
            pp.after.insert(pp.after.end(), inner.after.begin(), inner.after.end());
        }
        return;
    }
    node.at("type").fail("'" + type + "' is not supported");
}

class ByteLevelDecoder : public Decoder {
  public:
    void decode_chain(std::vector<std::string>& tokens) const override {
        std::string bytes;
        for (const std::string& t : tokens) {
            size_t start = bytes.size();
            size_t i = 0;
            bool all = true;
            while (i < t.size()) {
                int b = byte_of_char(next_code_point(t, i));
                if (b < 0) {
                    all = false;
                    break;
                }
                bytes.push_back(static_cast<char>(b));
            }
            if (!all) {  // a token outside the alphabet (an added token) keeps its own bytes
                bytes.resize(start);
                bytes += t;
            }
        }
        tokens.assign(1, utf8_lossy(bytes));
    }
};

class ReplaceDecoder : public Decoder {
  public:
    ReplaceDecoder(const std::string& pattern, std::string content, const JsonNode& where)
        : regex_(pattern, where), content_(std::move(content)) {}
    void decode_chain(std::vector<std::string>& tokens) const override {
        for (std::string& t : tokens) {
            std::string out;
            size_t last = 0;
            regex_.for_each_match(t, [&](size_t b, size_t e) {
                out.append(t, last, b - last);
                out += content_;
                last = e;
            });
            out.append(t, last, std::string::npos);
            t = std::move(out);
        }
    }

  private:
    Regex regex_;
    std::string content_;
};

class FuseDecoder : public Decoder {
  public:
    void decode_chain(std::vector<std::string>& tokens) const override {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, all);
    }
};

// Removes up to `start` leading and `stop` trailing copies of one character from each token.
class StripDecoder : public Decoder {
  public:
    StripDecoder(std::string content, size_t start, size_t stop)
        : content_(std::move(content)), start_(start), stop_(stop) {}
    void decode_chain(std::vector<std::string>& tokens) const override {
        for (std::string& t : tokens) {
            size_t b = 0;
            for (size_t k = 0; k < start_ && t.compare(b, content_.size(), content_) == 0; ++k)
                b += content_.size();
            size_t e = t.size();
            for (size_t k = 0; k < stop_ && e >= b + content_.size() &&
                               t.compare(e - content_.size(), content_.size(), content_) == 0;
                 ++k)
                e -= content_.size();
            t = t.substr(b, e - b);
        }
    }

  private:
    std::string content_;
    size_t start_, stop_;
};

// Runs of <0xNN> tokens become the bytes they name (U+FFFD per byte when those are not UTF-8).
class ByteFallbackDecoder : public Decoder {
  public:
    void decode_chain(std::vector<std::string>& tokens) const override {
        std::vector<std::string> out;
        std::string pending;
        size_t pending_count = 0;
        auto flush = [&] {
            if (pending_count == 0) return;
            if (find_invalid_utf8(pending) == std::string_view::npos)
                out.push_back(pending);
            else
                for (size_t k = 0; k < pending_count; ++k) out.emplace_back("\xEF\xBF\xBD");
            pending.clear();
            pending_count = 0;
        };
        for (std::string& t : tokens) {
            if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
                const std::string hex = t.substr(3, 2);  // `end` points into it
                char* end = nullptr;
                long b = std::strtol(hex.c_str(), &end, 16);
                if (end != nullptr && *end == '\0') {
                    pending.push_back(static_cast<char>(b));
                    ++pending_count;
                    continue;
                }
            }
            flush();
            out.push_back(std::move(t));
        }
        flush();
        tokens = std::move(out);
    }
};

class SequenceDecoder : public Decoder {
  public:
    explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
    void decode_chain(std::vector<std::string>& tokens) const override {
        for (const auto& s : steps_) s->decode_chain(tokens);
    }

  private:
    std::vector<std::unique_ptr<Decoder>> steps_;
};

}  // namespace

PostProcessor make_post_processor(const JsonNode& node) {
    PostProcessor pp;
    add_processor(node, pp);
    return pp;
}

std::unique_ptr<Decoder> make_decoder(const JsonNode& node) {
    std::string type = node.at("type").str();
    if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
    if (type == "Fuse") return std::make_unique<FuseDecoder>();
    if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
    if (type == "Strip")
        return std::make_unique<StripDecoder>(node.at("content").str(), node.at("start").integer(),
                                              node.at("stop").integer());
    if (type == "Replace") {
        JsonNode p = node.at("pattern");
        std::string pattern = p.has("Regex") ? p.at("Regex").str() : escape_regex(p.at("String").str());
        return std::make_unique<ReplaceDecoder>(pattern, node.at("content").str(), p);
    }
    if (type == "Sequence") {
        JsonNode list = node.at("decoders");
        std::vector<std::unique_ptr<Decoder>> steps;
        for (size_t i = 0; i < list.size(); ++i) steps.push_back(make_decoder(list.at(i)));
        return std::make_unique<SequenceDecoder>(std::move(steps));
    }
    node.at("type").fail("'" + type + "' is not supported");
}

}  // namespace moerl::text::detail
