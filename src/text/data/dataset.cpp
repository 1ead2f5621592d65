// Training and eval splits, per-epoch shuffles by a keyed Feistel permutation, resumable positions.
#include "moerl/text/dataset.hpp"

#include <algorithm>
#include <cmath>

#include "moerl/core/error.hpp"

namespace moerl::text {

namespace {

// MurmurHash3's 64-bit finalizer: every input bit reaches every output bit.
uint64_t mix(uint64_t x) {
    x = (x ^ (x >> 33)) * 0xFF51AFD7ED558CCDULL;
    x = (x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53ULL;
    return x ^ (x >> 33);
}

constexpr uint64_t kSplitSalt = 0x73706C6974ULL;  // keys the held-out choice apart from epoch orders
constexpr int kFeistelRounds = 6;

}  // namespace

uint64_t permute(uint64_t index, uint64_t n, uint64_t key) {
    MOERL_CHECK(index < n, "permute: index ", index, " outside [0, ", n, ")");
    if (n == 1) return 0;
    int bits = 1;
    while (bits < 64 && (uint64_t{1} << bits) < n) ++bits;
    const int half = (bits + 1) / 2;  // the domain is 2^(2*half) >= n, at most 4n
    const uint64_t mask = (uint64_t{1} << half) - 1;
    uint64_t x = index;
    do {
        uint64_t left = x >> half, right = x & mask;
        for (int r = 0; r < kFeistelRounds; ++r) {
            const uint64_t f = mix(key ^ mix(right + (static_cast<uint64_t>(r + 1) << 56))) & mask;
            const uint64_t next = left ^ f;
            left = right;
            right = next;
        }
        x = (left << half) | right;
    } while (x >= n);  // cycle walking: x's cycle returns into [0, n) at the latest at index itself
    return x;
}

void DatasetOptions::validate_options() const {
    MOERL_CHECK(!path.empty(), "data.path: the training JSONL file is required");
    MOERL_CHECK(std::isfinite(eval_fraction) && eval_fraction >= 0 && eval_fraction < 1,
                "data.eval_fraction: expected a number in [0, 1), got ", eval_fraction);
    MOERL_CHECK(eval_path.empty() || eval_fraction == 0,
                "data.eval_fraction and data.eval_path: give one of them, not both");
    MOERL_CHECK(eval_every == 0 || !eval_path.empty() || eval_fraction > 0, "data.eval_every = ", eval_every,
                " but there is no eval split: set data.eval_path or data.eval_fraction");
    MOERL_CHECK(
        !format.prompt_field.empty() && !format.messages_field.empty() && !format.answer_field.empty(),
        "data: the prompt, messages and answer field names must not be empty");
}

Dataset::Dataset(const DatasetOptions& options) : options_(options) {
    options_.validate_options();
    train_file_ = std::make_unique<JsonlFile>(options_.path, options_.format, options_.validate);
    const uint64_t n = train_file_->size();
    if (!options_.eval_path.empty()) {
        eval_file_ = std::make_unique<JsonlFile>(options_.eval_path, options_.format, options_.validate);
    } else if (options_.eval_fraction > 0) {
        num_held_out_ = std::max<uint64_t>(1, static_cast<uint64_t>(std::floor(options_.eval_fraction * n)));
        MOERL_CHECK(num_held_out_ < n, "data.eval_fraction = ", options_.eval_fraction, " of the ", n,
                    " examples in '", options_.path, "' leaves none for training");
    }
    num_train_ = n - num_held_out_;
}

Dataset::~Dataset() = default;

uint64_t Dataset::eval_size() const {
    const uint64_t n = eval_file_ ? eval_file_->size() : num_held_out_;
    return options_.eval_limit > 0 ? std::min(n, options_.eval_limit) : n;
}

uint64_t Dataset::train_line(const DataPosition& pos) const {
    MOERL_CHECK(pos.index < num_train_, "data: position index ", pos.index, " outside the ", num_train_,
                " training examples of '", options_.path, "'");
    MOERL_CHECK(options_.epochs == 0 || pos.epoch < options_.epochs, "data: epoch ", pos.epoch,
                " is past data.epochs = ", options_.epochs);
    // Slots [0, num_train_) of the split permutation are training lines, the rest are held out.
    const uint64_t slot =
        options_.shuffle ? permute(pos.index, num_train_, mix(options_.seed) ^ mix(~pos.epoch)) : pos.index;
    if (num_held_out_ == 0) return slot;
    return permute(slot, train_file_->size(), mix(options_.seed ^ kSplitSalt));
}

Example Dataset::train(const DataPosition& pos) const { return train_file_->read(train_line(pos)); }

std::optional<Example> Dataset::next(DataPosition& pos) const {
    if (options_.epochs > 0 && pos.epoch >= options_.epochs) return std::nullopt;
    Example ex = train(pos);
    pos = advance(pos, 1);
    return ex;
}

DataPosition Dataset::advance(const DataPosition& pos, uint64_t count) const {
    const uint64_t total = pos.index + count;
    return {pos.epoch + total / num_train_, total % num_train_};
}

Example Dataset::eval(uint64_t i) const {
    MOERL_CHECK(i < eval_size(), "data: eval example ", i, " of ", eval_size());
    if (eval_file_) return eval_file_->read(i);
    return train_file_->read(permute(num_train_ + i, train_file_->size(), mix(options_.seed ^ kSplitSalt)));
}

uint64_t Dataset::index_bytes() const {
    return train_file_->index_bytes() + (eval_file_ ? eval_file_->index_bytes() : 0);
}

nlohmann::json Dataset::state(const DataPosition& pos) const {
    return {{"epoch", pos.epoch}, {"index", pos.index}, {"train_size", num_train_}, {"seed", options_.seed}};
}

DataPosition Dataset::restore(const nlohmann::json& state) const {
    DataPosition pos;
    uint64_t size = 0, seed = 0;
    try {
        pos.epoch = state.at("epoch").get<uint64_t>();
        pos.index = state.at("index").get<uint64_t>();
        size = state.at("train_size").get<uint64_t>();
        seed = state.at("seed").get<uint64_t>();
    } catch (const nlohmann::json::exception& e) {
        MOERL_FAIL("data: the checkpoint's data position is malformed (", e.what(), "): ", state.dump());
    }
    MOERL_CHECK(size == num_train_, "data: the checkpoint was made with ", size, " training examples, but '",
                options_.path, "' now gives ", num_train_);
    MOERL_CHECK(seed == options_.seed, "data: the checkpoint was made with data.seed = ", seed,
                ", but the config says ", options_.seed);
    MOERL_CHECK(pos.index < num_train_, "data: the checkpoint's index ", pos.index, " is outside the ",
                num_train_, " training examples");
    return pos;
}

}  // namespace moerl::text
