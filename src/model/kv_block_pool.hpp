// Internal: the generator's paged KV cache on the host side: which pool blocks are free, each slot's
// blocks in order, and the block table [max_batch, max_blocks] the decode kernels read (uploaded when
// it changed). Block 0 is never handed out: padding rows of a bucket point at it.
//
// A block may be referenced by several slots (the full blocks of a prompt that a GRPO group's
// samples share): it counts its references and returns to the free list when the last slot that
// holds it is released. Slots only ever write to their last block, which is never a shared one:
// sharing hands out full blocks only (the generator copies a partial last block).
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
    // Gives the empty slot `to` the first `count` blocks of slot `from` (full blocks: neither slot
    // may write them again), one more reference each.
    void share_blocks(int from, int to, int count);
    // Drops the slot's references; blocks no other slot holds go back to the free list.
    void release(int slot);

    int64_t free_blocks() const { return static_cast<int64_t>(free_list_.size()); }
    // Blocks sequences can hold (all but block 0).
    int64_t usable_blocks() const { return num_blocks_ - 1; }
    int64_t num_blocks() const { return num_blocks_; }
    int last_block(int slot) const { return slot_blocks_[slot].back(); }
    // The slot's i-th block (its tokens [i * block_size, (i + 1) * block_size)).
    int block_of(int slot, int i) const { return slot_blocks_[slot][i]; }
    int num_slot_blocks(int slot) const { return static_cast<int>(slot_blocks_[slot].size()); }
    // Block-table entries that point at a block another slot also holds: the blocks sharing saves.
    int64_t shared_references() const { return shared_references_; }

    // The host block table (int32, CPU), and whether it changed since the last call to take_changed.
    const at::Tensor& table() const { return table_; }
    bool take_changed();

  private:
    void append(int slot, int block);

    int max_blocks_;
    int64_t num_blocks_;
    std::vector<int> free_list_;
    std::vector<int> refs_;  // per block: slots holding it (0 = free)
    std::vector<std::vector<int>> slot_blocks_;
    int64_t shared_references_ = 0;
    at::Tensor table_;  // [max_batch, max_blocks]
    bool changed_ = true;
};

}  // namespace moerl::model
