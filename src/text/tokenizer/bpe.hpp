// The BPE model: vocabulary, merge ranks and the per-word merge.
#pragma once

#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "internal.hpp"

namespace moerl::text::detail {

struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// (left id, right id) -> (rank, merged id): open addressing, the hot lookup of the merge loop.
class PairMap {
  public:
    struct Value {
        uint32_t rank;
        int32_t id;
    };
    void reserve(size_t n);
    // Later entries replace earlier ones for the same pair, as in Hugging Face's map.
    void insert(int32_t a, int32_t b, Value v);
    const Value* find(int32_t a, int32_t b) const {
        uint64_t key = pack(a, b);
        for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
            const Slot& s = slots_[i];
            if (s.key == key) return &s.value;
            if (s.key == kEmpty) return nullptr;
        }
    }

  private:
    static constexpr uint64_t kEmpty = ~0ull;
    struct Slot {
        uint64_t key = kEmpty;
        Value value{};
    };
    static uint64_t pack(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
    static size_t hash(uint64_t k) { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> 20); }
    std::vector<Slot> slots_;
    size_t mask_ = 0;
};

// Words already merged by this thread: word -> ids.
class WordCache {
  public:
    const int32_t* find(std::string_view word, size_t& n) const {
        auto it = map_.find(word);
        if (it == map_.end()) return nullptr;
        n = it->second.second;
        return pool_.data() + it->second.first;
    }
    void insert(std::string_view word, const int32_t* ids, size_t n);

  private:
    StringMap<std::pair<uint32_t, uint32_t>> map_;
    std::vector<int32_t> pool_;
};

// Scratch of one thread for the merge loop.
struct MergeScratch {
    std::vector<int32_t> ids;
    std::vector<uint32_t> ranks;
    struct Symbol {
        int32_t id, prev, next;
        bool alive;
    };
    std::vector<Symbol> symbols;
    struct Candidate {
        uint32_t rank;
        int32_t pos, id;
    };
    std::vector<Candidate> heap;
};

class Bpe {
  public:
    explicit Bpe(const JsonNode& model);
    // Appends the ids of one pre-token. `raw_bytes`: the word is raw bytes whose byte-level
    // characters are the model's symbols (the ByteLevel step was left to the model).
    void tokenize(std::string_view word, bool raw_bytes, std::vector<int32_t>& out, WordCache& cache,
                  MergeScratch& scratch) const;
    bool supports_raw_bytes() const { return prefix_.empty() && suffix_.empty(); }

    const StringMap<int32_t>& vocab() const { return vocab_; }
    const std::vector<std::string>& id_to_token() const { return id_to_token_; }

  private:
    void initial_symbols(std::string_view word, bool raw_bytes, std::vector<int32_t>& ids) const;
    void merge(MergeScratch& s) const;
    void merge_long(MergeScratch& s) const;

    StringMap<int32_t> vocab_;
    std::vector<std::string> id_to_token_;
    StringMap<int32_t> raw_vocab_;  // byte-level tokens by their bytes, for ignore_merges
    PairMap merges_;
    int32_t byte_ids_[256];
    int32_t byte_fallback_ids_[256];
    int32_t unk_id_ = -1;
    bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
    std::string prefix_, suffix_;
};

}  // namespace moerl::text::detail
