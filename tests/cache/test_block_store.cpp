// BlockStore: reference counts, reuse of zeroed blocks, slabs, and the limit.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "kvq/cache/block_store.hpp"

namespace {

TEST(BlockStore, CountsReferencesAndReusesZeroedBlocks) {
  kvq::BlockStore store(1000, 8);  // rounded to 1024-byte blocks; a 2 MiB slab holds all 8
  EXPECT_EQ(store.block_bytes(), 1024u);
  const kvq::BlockId a = store.acquire(), b = store.acquire();
  EXPECT_NE(a, b);
  EXPECT_EQ(store.counts().committed, 8u);  // one slab
  EXPECT_EQ(store.counts().in_use, 2u);
  std::memset(store.data(a), 0xAB, store.block_bytes());
  store.retain(a);
  EXPECT_TRUE(store.shared(a));
  EXPECT_EQ(store.counts().shared, 1u);
  store.release(a);
  EXPECT_FALSE(store.shared(a));
  EXPECT_EQ(store.counts().in_use, 2u);
  store.release(a);
  EXPECT_EQ(store.counts().in_use, 1u);
  const kvq::BlockId c = store.acquire();  // the released block comes back zeroed
  EXPECT_EQ(c, a);
  for (std::size_t i = 0; i < store.block_bytes(); ++i) ASSERT_EQ(store.data(c)[i], 0) << i;
  EXPECT_EQ(store.available(), 6u);
}

TEST(BlockStore, RefusesPastItsLimitAndNamesWhoAsked) {
  kvq::BlockStore store(std::size_t(3) << 20, 2);  // blocks of 3 MiB: a slab each
  (void)store.acquire();
  EXPECT_EQ(store.counts().committed, 1u);
  (void)store.acquire();
  EXPECT_EQ(store.counts().committed, 2u);
  try {
    (void)store.acquire("sequence 7");
    FAIL() << "a third block was handed out";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded);
    EXPECT_NE(std::string(e.what()).find("sequence 7 needs another block, but all 2 blocks"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(store.counts().in_use, 2u);
  EXPECT_THROW(kvq::BlockStore(0, 4), kvq::Error);
  EXPECT_THROW(kvq::BlockStore(64, 0), kvq::Error);
}

}  // namespace
