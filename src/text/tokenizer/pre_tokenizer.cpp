// Pre-tokenizers: Split (regex or literal), ByteLevel, Digits, Whitespace, WhitespaceSplit,
// Sequence, with Hugging Face's split behaviours.
#include <utf8proc.h>

#include "internal.hpp"

namespace moerl::text::detail {

namespace {

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior behavior_of(const JsonNode& node) {
    std::string b = node.str();
    if (b == "Removed") return Behavior::kRemoved;
    if (b == "Isolated") return Behavior::kIsolated;
    if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
    if (b == "MergedWithNext") return Behavior::kMergedWithNext;
    if (b == "Contiguous") return Behavior::kContiguous;
    node.fail("'" + b + "' is not a split behaviour");
}

struct Span {
    size_t begin, end;
    bool is_match;
};

// Turns the matches of one piece into output pieces as HF's NormalizedString::split does.
class Splitter {
  public:
    Splitter(Behavior behavior, bool invert) : behavior_(behavior), invert_(invert) {}

    template <typename FindMatches>
    void run(const std::vector<Piece>& in, std::vector<Piece>& out, FindMatches&& find) const {
        std::vector<Span>& spans = spans_ref();
        for (const Piece& p : in) {
            if (p.token >= 0) {
                out.push_back(p);
                continue;
            }
            spans.clear();
            size_t prev = 0;
            find(p.view(), [&](size_t b, size_t e) {
                if (prev != b) spans.push_back({prev, b, invert_});
                spans.push_back({b, e, !invert_});
                prev = e;
            });
            if (prev != p.size) spans.push_back({prev, p.size, invert_});
            emit(p, out);
        }
    }

  private:
    void emit(const Piece& p, std::vector<Piece>& out) const {
        auto& spans = spans_ref();
        auto push = [&](size_t b, size_t e) {
            if (e > b) out.push_back({p.data + b, static_cast<uint32_t>(e - b), -1});
        };
        switch (behavior_) {
            case Behavior::kRemoved:
                for (const Span& s : spans)
                    if (!s.is_match) push(s.begin, s.end);
                break;
            case Behavior::kIsolated:
                for (const Span& s : spans) push(s.begin, s.end);
                break;
            case Behavior::kContiguous:
            case Behavior::kMergedWithPrevious: {
                // Merge a match into the span before it (Contiguous: merge runs of equal kind).
                merged_.clear();
                bool previous_match = false;
                for (const Span& s : spans) {
                    bool merge = behavior_ == Behavior::kContiguous ? s.is_match == previous_match
                                                                    : s.is_match && !previous_match;
                    if (merge && !merged_.empty())
                        merged_.back().end = s.end;
                    else
                        merged_.push_back(s);
                    previous_match = s.is_match;
                }
                for (const Span& s : merged_) push(s.begin, s.end);
                break;
            }
            case Behavior::kMergedWithNext: {
                merged_.clear();
                bool previous_match = false;
                for (size_t k = spans.size(); k-- > 0;) {
                    const Span& s = spans[k];
                    if (s.is_match && !previous_match && !merged_.empty())
                        merged_.back().begin = s.begin;
                    else
                        merged_.push_back(s);
                    previous_match = s.is_match;
                }
                for (size_t k = merged_.size(); k-- > 0;) push(merged_[k].begin, merged_[k].end);
                break;
            }
        }
    }
    static std::vector<Span>& spans_ref();
    Behavior behavior_;
    bool invert_;
    static thread_local std::vector<Span> merged_;
};
thread_local std::vector<Span> Splitter::merged_;

// The spans vector filled by run(); one per thread, shared by every Splitter.
std::vector<Span>& Splitter::spans_ref() {
    thread_local std::vector<Span> spans;
    return spans;
}

class RegexSplit : public PreTokenizer {
  public:
    RegexSplit(const std::string& pattern, Behavior behavior, bool invert, const JsonNode& where)
        : regex_(pattern, where), splitter_(behavior, invert) {}
    void split(const std::vector<Piece>& in, std::vector<Piece>& out, Arena&) const override {
        splitter_.run(in, out, [&](std::string_view s, auto&& on) { regex_.for_each_match(s, on); });
    }

  private:
    Regex regex_;
    Splitter splitter_;
};

// Splits where a predicate holds for a character, one match per character.
template <typename Pred>
class CharSplit : public PreTokenizer {
  public:
    CharSplit(Pred pred, Behavior behavior) : pred_(pred), splitter_(behavior, false) {}
    void split(const std::vector<Piece>& in, std::vector<Piece>& out, Arena&) const override {
        splitter_.run(in, out, [&](std::string_view s, auto&& on) {
            size_t i = 0;
            while (i < s.size()) {
                size_t b = i;
                if (pred_(next_code_point(s, i))) on(b, i);
            }
        });
    }

  private:
    Pred pred_;
    Splitter splitter_;
};
template <typename Pred>
std::unique_ptr<PreTokenizer> char_split(Pred pred, Behavior behavior) {
    return std::make_unique<CharSplit<Pred>>(pred, behavior);
}

bool is_numeric(uint32_t cp) {  // Rust char::is_numeric: Nd, Nl, No
    auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
    return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

const char* const kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevel : public PreTokenizer {
  public:
    ByteLevel(bool add_prefix_space, bool use_regex, bool map_chars, const JsonNode& where)
        : add_prefix_space_(add_prefix_space), map_chars_(map_chars), splitter_(Behavior::kIsolated, false) {
        if (use_regex) regex_ = std::make_unique<Regex>(kByteLevelPattern, where);
    }
    void split(const std::vector<Piece>& in, std::vector<Piece>& out, Arena& arena) const override {
        thread_local std::vector<Piece> prefixed, split;
        const std::vector<Piece>* cur = &in;
        if (add_prefix_space_) {
            prefixed.clear();
            for (const Piece& p : in) {
                if (p.token >= 0 || (p.size > 0 && p.data[0] == ' ')) {
                    prefixed.push_back(p);
                    continue;
                }
                char* d = arena.alloc(p.size + 1);
                d[0] = ' ';
                std::copy(p.data, p.data + p.size, d + 1);
                prefixed.push_back({d, p.size + 1, -1});
            }
            cur = &prefixed;
        }
        std::vector<Piece>& target = map_chars_ ? split : out;
        if (map_chars_) split.clear();
        if (regex_) {
            splitter_.run(*cur, target,
                          [&](std::string_view s, auto&& on) { regex_->for_each_match(s, on); });
        } else {
            target.insert(target.end(), cur->begin(), cur->end());
        }
        if (!map_chars_) return;
        for (const Piece& p : split) {
            if (p.token >= 0) {
                out.push_back(p);
                continue;
            }
            size_t n = 0;
            for (uint32_t k = 0; k < p.size; ++k)
                n += byte_to_char_utf8(static_cast<uint8_t>(p.data[k])).size();
            char* d = arena.alloc(n);
            size_t at = 0;
            for (uint32_t k = 0; k < p.size; ++k) {
                const std::string& c = byte_to_char_utf8(static_cast<uint8_t>(p.data[k]));
                std::copy(c.begin(), c.end(), d + at);
                at += c.size();
            }
            out.push_back({d, static_cast<uint32_t>(n), -1});
        }
    }

  private:
    bool add_prefix_space_, map_chars_;
    std::unique_ptr<Regex> regex_;
    Splitter splitter_;
};

class SequencePreTokenizer : public PreTokenizer {
  public:
    explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps)
        : steps_(std::move(steps)) {}
    void split(const std::vector<Piece>& in, std::vector<Piece>& out, Arena& arena) const override {
        // Two buffers per nesting level of Sequences, kept per thread.
        thread_local std::vector<std::unique_ptr<std::vector<Piece>[]>> levels;
        thread_local size_t depth = 0;
        if (levels.size() <= depth) levels.push_back(std::make_unique<std::vector<Piece>[]>(2));
        std::vector<Piece>& a = levels[depth][0];
        std::vector<Piece>& b = levels[depth][1];
        struct Nest {
            size_t& d;
            ~Nest() { --d; }
        } nest{++depth};
        if (steps_.empty()) {
            out.insert(out.end(), in.begin(), in.end());
            return;
        }
        const std::vector<Piece>* cur = &in;
        for (size_t k = 0; k < steps_.size(); ++k) {
            bool last = k + 1 == steps_.size();
            std::vector<Piece>& dst = last ? out : (cur == &a ? b : a);
            if (!last) dst.clear();
            steps_[k]->split(*cur, dst, arena);
            cur = &dst;
        }
    }

  private:
    std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

std::unique_ptr<PreTokenizer> make_one(const JsonNode& node, bool is_last, bool& byte_level_last) {
    std::string type = node.at("type").str();
    if (type == "Sequence") {
        JsonNode list = node.at("pretokenizers");
        std::vector<std::unique_ptr<PreTokenizer>> steps;
        for (size_t i = 0; i < list.size(); ++i)
            steps.push_back(make_one(list.at(i), is_last && i + 1 == list.size(), byte_level_last));
        return std::make_unique<SequencePreTokenizer>(std::move(steps));
    }
    if (type == "Split") {
        JsonNode p = node.at("pattern");
        std::string pattern;
        if (p.has("Regex"))
            pattern = p.at("Regex").str();
        else if (p.has("String"))
            pattern = escape_regex(p.at("String").str());
        else
            p.fail("has neither String nor Regex");
        return std::make_unique<RegexSplit>(pattern, behavior_of(node.at("behavior")),
                                            node.bool_or("invert", false), p);
    }
    if (type == "ByteLevel") {
        if (is_last) byte_level_last = true;
        return std::make_unique<ByteLevel>(node.bool_or("add_prefix_space", true),
                                           node.bool_or("use_regex", true), !is_last, node);
    }
    if (type == "Digits") {
        bool individual = node.bool_or("individual_digits", false);
        return char_split(is_numeric, individual ? Behavior::kIsolated : Behavior::kContiguous);
    }
    if (type == "WhitespaceSplit") return char_split(is_whitespace, Behavior::kRemoved);
    if (type == "Whitespace") {
        return std::make_unique<RegexSplit>(R"(\w+|[^\w\s]+)", Behavior::kRemoved, true, node);
    }
    node.at("type").fail("'" + type + "' is not supported");
}

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const JsonNode& node, bool allow_deferred, bool& deferred) {
    deferred = false;
    bool last = allow_deferred;
    return make_one(node, last, deferred);
}

}  // namespace moerl::text::detail
