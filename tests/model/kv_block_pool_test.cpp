// The generator's block bookkeeping on the host: blocks shared by a group's samples are counted per
// holder and come back to the free list only with the last of them; misuse is refused by name.
#include "kv_block_pool.hpp"

#include <gtest/gtest.h>

#include <string>

#include "moerl/core/error.hpp"

namespace moerl::model {
namespace {

int table_entry(const KvBlockPool& p, int slot, int i) { return p.table()[slot][i].item<int>(); }

TEST(KvBlockPool, SharedBlocksReturnWithTheirLastHolder) {
    KvBlockPool pool(/*max_batch=*/3, /*max_blocks=*/4, /*num_blocks=*/9);  // 8 usable
    ASSERT_EQ(pool.free_blocks(), 8);
    const int a0 = pool.add_block(0), a1 = pool.add_block(0), a2 = pool.add_block(0);
    pool.share_blocks(0, 1, 2);  // slot 1: a0, a1, then a block of its own
    const int b2 = pool.add_block(1);
    pool.share_blocks(0, 2, 2);
    EXPECT_EQ(pool.free_blocks(), 4);
    EXPECT_EQ(pool.shared_references(), 4);
    EXPECT_EQ(table_entry(pool, 1, 0), a0);
    EXPECT_EQ(table_entry(pool, 1, 1), a1);
    EXPECT_EQ(table_entry(pool, 1, 2), b2);
    EXPECT_EQ(table_entry(pool, 2, 1), a1);
    EXPECT_NE(b2, a2);
    pool.release(0);  // the leader leaves first: only its own last block comes back
    EXPECT_EQ(pool.free_blocks(), 5);
    EXPECT_EQ(pool.shared_references(), 2);
    pool.release(2);
    EXPECT_EQ(pool.free_blocks(), 5);
    EXPECT_EQ(pool.shared_references(), 0);
    pool.release(1);
    EXPECT_EQ(pool.free_blocks(), 8);
    pool.release(1);  // an empty slot holds nothing: nothing changes
    EXPECT_EQ(pool.free_blocks(), 8);
}

TEST(KvBlockPool, MisuseIsRefusedAndChangesNothing) {
    KvBlockPool pool(2, 3, 5);  // 4 usable
    pool.add_block(0);
    pool.add_block(1);
    auto refused = [&](auto&& call, const std::string& want) {
        try {
            call();
            ADD_FAILURE() << "accepted; wanted: " << want;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
        }
    };
    refused([&] { pool.share_blocks(0, 1, 1); }, "slot 1 already holds 1 blocks");
    refused([&] { pool.share_blocks(0, 0, 1); }, "cannot share blocks with itself");
    pool.release(1);
    refused([&] { pool.share_blocks(0, 1, 2); }, "slot 0 holds 1 blocks, 2 were to be shared");
    EXPECT_EQ(pool.free_blocks(), 3);
    EXPECT_EQ(pool.shared_references(), 0);
    pool.add_block(0);
    pool.add_block(0);
    refused([&] { pool.add_block(0); }, "already holds 3 blocks");
    pool.add_block(1);
    refused([&] { pool.add_block(1); }, "KV cache out of blocks: all 4 blocks are in use");
    pool.release(0);
    pool.release(1);
    EXPECT_EQ(pool.free_blocks(), 4);
}

}  // namespace
}  // namespace moerl::model
