#include "kv_block_pool.hpp"

#include <ATen/ATen.h>

#include "moerl/core/error.hpp"

namespace moerl::model {

KvBlockPool::KvBlockPool(int max_batch, int max_blocks, int64_t num_blocks)
    : max_blocks_(max_blocks),
      num_blocks_(num_blocks),
      slot_blocks_(max_batch),
      table_(at::zeros({max_batch, max_blocks}, at::TensorOptions().dtype(at::kInt))) {
    for (int b = static_cast<int>(num_blocks) - 1; b >= 1; --b) free_list_.push_back(b);
}

int KvBlockPool::add_block(int slot) {
    MOERL_CHECK(!free_list_.empty(), "KV cache out of blocks: all ", num_blocks_ - 1,
                " blocks are in use (raise GeneratorOptions::num_blocks or release sequences)");
    const int b = free_list_.back();
    free_list_.pop_back();
    table_.data_ptr<int>()[static_cast<int64_t>(slot) * max_blocks_ + slot_blocks_[slot].size()] = b;
    slot_blocks_[slot].push_back(b);
    changed_ = true;
    return b;
}

void KvBlockPool::release(int slot) {
    for (int b : slot_blocks_[slot]) free_list_.push_back(b);
    slot_blocks_[slot].clear();
}

bool KvBlockPool::take_changed() {
    const bool changed = changed_;
    changed_ = false;
    return changed;
}

}  // namespace moerl::model
