// Internal: the generator's paged KV cache on the host side: which pool blocks are free, each slot's
// blocks in order, and the block table [max_batch, max_blocks] the decode kernels read (uploaded when
// it changed). Block 0 is never handed out: padding rows of a bucket point at it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace moerl::model {

class KvBlockPool {
  public:
    // num_blocks counts block 0.
    KvBlockPool(int max_batch, int max_blocks, int64_t num_blocks);

    // Gives the slot one more block (its next block-table entry) and returns it; throws naming the
    // option to raise when none is free.
    int add_block(int slot);
    // Returns the slot's blocks to the free list.
    void release(int slot);

    int64_t free_blocks() const { return static_cast<int64_t>(free_list_.size()); }
    // Blocks sequences can hold (all but block 0).
    int64_t usable_blocks() const { return num_blocks_ - 1; }
    int64_t num_blocks() const { return num_blocks_; }
    int last_block(int slot) const { return slot_blocks_[slot].back(); }

    // The host block table (int32, CPU), and whether it changed since the last call to take_changed.
    const at::Tensor& table() const { return table_; }
    bool take_changed();

  private:
    int max_blocks_;
    int64_t num_blocks_;
    std::vector<int> free_list_;
    std::vector<std::vector<int>> slot_blocks_;
    at::Tensor table_;  // [max_batch, max_blocks]
    bool changed_ = true;
};

}  // namespace moerl::model
