#include "kv_block_pool.hpp"

#include <ATen/ATen.h>

#include "moerl/core/error.hpp"

namespace moerl::model {

KvBlockPool::KvBlockPool(int max_batch, int max_blocks, int64_t num_blocks)
    : max_blocks_(max_blocks),
      num_blocks_(num_blocks),
      refs_(num_blocks, 0),
      slot_blocks_(max_batch),
      table_(at::zeros({max_batch, max_blocks}, at::TensorOptions().dtype(at::kInt))) {
    for (int b = static_cast<int>(num_blocks) - 1; b >= 1; --b) free_list_.push_back(b);
}

void KvBlockPool::append(int slot, int block) {
    std::vector<int>& mine = slot_blocks_[slot];
    MOERL_CHECK(static_cast<int>(mine.size()) < max_blocks_, "KV cache: slot ", slot, " already holds ",
                max_blocks_, " blocks, its max_seq_len");
    table_.data_ptr<int>()[static_cast<int64_t>(slot) * max_blocks_ + mine.size()] = block;
    mine.push_back(block);
    changed_ = true;
}

int KvBlockPool::add_block(int slot) {
    MOERL_CHECK(!free_list_.empty(), "KV cache out of blocks: all ", num_blocks_ - 1,
                " blocks are in use (raise GeneratorOptions::num_blocks or release sequences)");
    const int b = free_list_.back();
    append(slot, b);
    free_list_.pop_back();
    refs_[b] = 1;
    return b;
}

void KvBlockPool::share_blocks(int from, int to, int count) {
    MOERL_CHECK(from != to, "KV cache: slot ", from, " cannot share blocks with itself");
    MOERL_CHECK(slot_blocks_[to].empty(), "KV cache: slot ", to, " already holds ", slot_blocks_[to].size(),
                " blocks; shared blocks must come first");
    MOERL_CHECK(count >= 0 && count <= num_slot_blocks(from), "KV cache: slot ", from, " holds ",
                num_slot_blocks(from), " blocks, ", count, " were to be shared");
    for (int i = 0; i < count; ++i) {
        const int b = slot_blocks_[from][i];
        append(to, b);
        ++refs_[b];
        ++shared_references_;
    }
}

void KvBlockPool::release(int slot) {
    for (int b : slot_blocks_[slot]) {
        MOERL_CHECK(refs_[b] > 0, "KV cache: block ", b, " of slot ", slot,
                    " was released more often than it was handed out");
        if (--refs_[b] == 0) {
            free_list_.push_back(b);
        } else {
            --shared_references_;
        }
    }
    slot_blocks_[slot].clear();
}

bool KvBlockPool::take_changed() {
    const bool changed = changed_;
    changed_ = false;
    return changed;
}

}  // namespace moerl::model
