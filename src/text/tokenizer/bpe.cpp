// BPE: loading the vocabulary and merges, and merging one word by rank.
#include "bpe.hpp"

#include <algorithm>
#include <cstdio>

namespace moerl::text::detail {

void PairMap::reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
}

void PairMap::insert(int32_t a, int32_t b, Value v) {
    uint64_t key = pack(a, b);
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
        Slot& s = slots_[i];
        if (s.key == key || s.key == kEmpty) {
            s.key = key;
            s.value = v;
            return;
        }
    }
}

void WordCache::insert(std::string_view word, const int32_t* ids, size_t n) {
    constexpr size_t kMaxWords = 1 << 16;
    if (map_.size() >= kMaxWords) {
        map_.clear();
        pool_.clear();
    }
    auto offset = static_cast<uint32_t>(pool_.size());
    pool_.insert(pool_.end(), ids, ids + n);
    map_.emplace(std::string(word), std::make_pair(offset, static_cast<uint32_t>(n)));
}

namespace {
// Decodes the UTF-8 byte-level form of a token to its bytes; false if a character is not in the
// byte-level alphabet.
bool byte_level_bytes(std::string_view token, std::string& out) {
    out.clear();
    size_t i = 0;
    while (i < token.size()) {
        int b = byte_of_char(next_code_point(token, i));
        if (b < 0) return false;
        out.push_back(static_cast<char>(b));
    }
    return true;
}
}  // namespace

// Ids index the embedding rows and size the id-to-token table; real vocabularies have a few
// hundred thousand, so an id past this is a broken file rather than a big model.
constexpr int64_t kMaxTokenId = (int64_t{1} << 22) - 1;

Bpe::Bpe(const JsonNode& model) {
    JsonNode vocab = model.at("vocab");
    if (!vocab.raw().is_object()) vocab.fail("is not an object of token: id");
    int32_t max_id = -1;
    vocab_.reserve(vocab.raw().size());
    for (auto it = vocab.raw().begin(); it != vocab.raw().end(); ++it) {
        if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
            it.value().get<int64_t>() > kMaxTokenId)
            JsonNode(it.value(), vocab.file(), vocab.path() + "['" + it.key() + "']")
                .fail("is not a token id (0 to " + std::to_string(kMaxTokenId) + ")");
        auto id = static_cast<int32_t>(it.value().get<int64_t>());
        vocab_.emplace(it.key(), id);
        max_id = std::max(max_id, id);
    }
    id_to_token_.resize(max_id + 1);
    for (const auto& [tok, id] : vocab_) id_to_token_[id] = tok;

    if (model.has("dropout")) {
        if (!model.at("dropout").raw().is_number()) model.at("dropout").fail("is not a number");
        double d = model.raw()["dropout"].get<double>();
        if (d != 0.0) model.at("dropout").fail("is not supported (encoding would not be deterministic)");
    }
    prefix_ = model.str_or("continuing_subword_prefix", "");
    suffix_ = model.str_or("end_of_word_suffix", "");
    fuse_unk_ = model.bool_or("fuse_unk", false);
    byte_fallback_ = model.bool_or("byte_fallback", false);
    ignore_merges_ = model.bool_or("ignore_merges", false);
    if (model.has("unk_token")) {
        std::string unk = model.at("unk_token").str();
        auto it = vocab_.find(unk);
        if (it == vocab_.end()) model.at("unk_token").fail("'" + unk + "' is not in the vocabulary");
        unk_id_ = it->second;
    }

    JsonNode merges = model.at("merges");
    size_t n = merges.size();
    merges_.reserve(n);
    for (size_t r = 0; r < n; ++r) {
        const json& m = merges.raw()[r];
        std::string a, b;
        if (m.is_string()) {
            const std::string& s = m.get_ref<const std::string&>();
            size_t sp = s.find(' ');
            if (sp == std::string::npos)
                merges.at(r).fail("'" + s + "' is not two tokens separated by a space");
            a = s.substr(0, sp);
            b = s.substr(sp + 1);
        } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
            a = m[0].get<std::string>();
            b = m[1].get<std::string>();
        } else {
            merges.at(r).fail("is neither \"a b\" nor [\"a\", \"b\"]");
        }
        auto ia = vocab_.find(a), ib = vocab_.find(b);
        if (ia == vocab_.end()) merges.at(r).fail("token '" + a + "' is not in the vocabulary");
        if (ib == vocab_.end()) merges.at(r).fail("token '" + b + "' is not in the vocabulary");
        std::string merged = a + (prefix_.size() <= b.size() ? b.substr(prefix_.size()) : std::string());
        auto im = vocab_.find(merged);
        if (im == vocab_.end()) merges.at(r).fail("merged token '" + merged + "' is not in the vocabulary");
        merges_.insert(ia->second, ib->second, {static_cast<uint32_t>(r), im->second});
    }

    for (int b = 0; b < 256; ++b) {
        auto it = vocab_.find(byte_to_char_utf8(static_cast<uint8_t>(b)));
        byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", b);
        auto fb = vocab_.find(name);
        byte_fallback_ids_[b] = fb == vocab_.end() ? -1 : fb->second;
    }
    if (ignore_merges_) {
        std::string bytes;
        for (const auto& [tok, id] : vocab_)
            if (byte_level_bytes(tok, bytes)) raw_vocab_.emplace(bytes, id);
    }
}

void Bpe::initial_symbols(std::string_view word, bool raw_bytes, std::vector<int32_t>& ids) const {
    ids.clear();
    int32_t unk_pending = -1;
    auto flush_unk = [&] {
        if (unk_pending >= 0) ids.push_back(unk_pending);
        unk_pending = -1;
    };
    // A symbol that is not in the vocabulary: byte fallback, else unk, else dropped (as HF does).
    auto missing = [&](std::string_view s) {
        if (byte_fallback_) {
            bool all = true;
            for (char c : s) all = all && byte_fallback_ids_[static_cast<uint8_t>(c)] >= 0;
            if (all) {
                for (char c : s) ids.push_back(byte_fallback_ids_[static_cast<uint8_t>(c)]);
                return;
            }
        }
        if (unk_id_ >= 0) {
            if (unk_pending >= 0 && fuse_unk_) return;
            flush_unk();
            unk_pending = unk_id_;
        }
    };
    if (raw_bytes) {
        for (char c : word) {
            int32_t id = byte_ids_[static_cast<uint8_t>(c)];
            if (id >= 0) {
                flush_unk();
                ids.push_back(id);
            } else {
                missing(byte_to_char_utf8(static_cast<uint8_t>(c)));
            }
        }
        flush_unk();
        return;
    }
    thread_local std::string s;
    size_t i = 0;
    while (i < word.size()) {
        size_t b = i;
        next_code_point(word, i);
        s.clear();
        if (b > 0) s += prefix_;
        s.append(word.substr(b, i - b));
        if (i == word.size()) s += suffix_;
        auto it = vocab_.find(std::string_view(s));
        if (it != vocab_.end()) {
            flush_unk();
            ids.push_back(it->second);
        } else {
            missing(s);
        }
    }
    flush_unk();
}

// Short words: ranks of adjacent pairs in an array, the lowest (leftmost on ties) merged first.
void Bpe::merge(MergeScratch& s) const {
    std::vector<int32_t>& ids = s.ids;
    if (ids.size() > 48) return merge_long(s);
    constexpr uint32_t kNone = ~0u;
    std::vector<uint32_t>& ranks = s.ranks;
    size_t n = ids.size();
    if (n < 2) return;
    ranks.resize(n - 1);
    auto rank_at = [&](size_t i) {
        const PairMap::Value* v = merges_.find(ids[i], ids[i + 1]);
        return v ? v->rank : kNone;
    };
    for (size_t i = 0; i + 1 < n; ++i) ranks[i] = rank_at(i);
    while (n > 1) {
        size_t best = 0;
        uint32_t best_rank = kNone;
        for (size_t i = 0; i + 1 < n; ++i)
            if (ranks[i] < best_rank) {
                best_rank = ranks[i];
                best = i;
            }
        if (best_rank == kNone) break;
        ids[best] = merges_.find(ids[best], ids[best + 1])->id;
        ids.erase(ids.begin() + best + 1);
        ranks.erase(ranks.begin() + best);
        --n;
        if (best + 1 < n) ranks[best] = rank_at(best);
        if (best > 0) ranks[best - 1] = rank_at(best - 1);
    }
    ranks.resize(n > 0 ? n - 1 : 0);
}

// Long words: a min-heap of (rank, position) over a linked list of symbols, stale entries skipped
// (Hugging Face's algorithm; the same result as the short path).
void Bpe::merge_long(MergeScratch& s) const {
    auto& sym = s.symbols;
    auto& heap = s.heap;
    const auto n = static_cast<int32_t>(s.ids.size());
    sym.resize(n);
    for (int32_t i = 0; i < n; ++i) sym[i] = {s.ids[i], i - 1, i + 1 < n ? i + 1 : -1, true};
    auto worse = [](const MergeScratch::Candidate& x, const MergeScratch::Candidate& y) {
        return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
    };
    heap.clear();
    auto push = [&](int32_t pos) {
        int32_t next = sym[pos].next;
        if (next < 0) return;
        if (const PairMap::Value* v = merges_.find(sym[pos].id, sym[next].id)) {
            heap.push_back({v->rank, pos, v->id});
            std::push_heap(heap.begin(), heap.end(), worse);
        }
    };
    for (int32_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), worse);
        MergeScratch::Candidate top = heap.back();
        heap.pop_back();
        MergeScratch::Symbol& left = sym[top.pos];
        if (!left.alive || left.next < 0) continue;
        const PairMap::Value* v = merges_.find(left.id, sym[left.next].id);
        if (v == nullptr || v->id != top.id) continue;
        MergeScratch::Symbol& right = sym[left.next];
        left.id = top.id;
        right.alive = false;
        left.next = right.next;
        if (right.next >= 0) sym[right.next].prev = top.pos;
        if (left.prev >= 0) push(left.prev);
        push(top.pos);
    }
    s.ids.clear();
    for (int32_t i = 0; i < n; ++i)
        if (sym[i].alive) s.ids.push_back(sym[i].id);
}

void Bpe::tokenize(std::string_view word, bool raw_bytes, std::vector<int32_t>& out, WordCache& cache,
                   MergeScratch& scratch) const {
    if (word.empty()) return;
    if (ignore_merges_) {
        const StringMap<int32_t>& whole = raw_bytes ? raw_vocab_ : vocab_;
        auto it = whole.find(word);
        if (it != whole.end()) {
            out.push_back(it->second);
            return;
        }
    }
    constexpr size_t kMaxCachedBytes = 128;
    size_t n = 0;
    if (word.size() <= kMaxCachedBytes) {
        if (const int32_t* hit = cache.find(word, n)) {
            out.insert(out.end(), hit, hit + n);
            return;
        }
    }
    initial_symbols(word, raw_bytes, scratch.ids);
    merge(scratch);
    out.insert(out.end(), scratch.ids.begin(), scratch.ids.end());
    if (word.size() <= kMaxCachedBytes) cache.insert(word, scratch.ids.data(), scratch.ids.size());
}

}  // namespace moerl::text::detail
