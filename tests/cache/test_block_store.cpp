// BlockStore: reference counts, reuse of zeroed blocks, slabs, the limit and what it charges.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
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

TEST(BlockStore, ChargesCountAgainstTheLimitUntilRefunded) {
  const auto shared = std::make_shared<kvq::BlockStore>(1000, 6, kvq::StoreLimit::blocks_and_own_rows);
  kvq::BlockStore& store = *shared;
  EXPECT_EQ(store.blocks_holding(1), 1u);
  EXPECT_EQ(store.blocks_holding(2048), 2u);
  EXPECT_EQ(store.blocks_holding(2049), 3u);
  {
    const kvq::OwnRowsCharge charge(shared, 3000, "sequence 4's own rows");  // 3 blocks of 1024
    EXPECT_EQ(charge.blocks(), 3u);
    EXPECT_EQ(store.counts().charged, 3u);
    EXPECT_EQ(store.available(), 3u);
    const kvq::BlockId a = store.acquire(), b = store.acquire(), c = store.acquire();
    EXPECT_EQ(store.available(), 0u);
    try {  // three blocks committed in the slab are free, but the limit is reached
      (void)store.acquire("sequence 5");
      FAIL() << "a block past the limit was handed out";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded);
      EXPECT_NE(std::string(e.what()).find("(3 by sequences' own rows)"), std::string::npos) << e.what();
    }
    store.release(c);
    try {
      const kvq::OwnRowsCharge more(shared, 2000, "sequence 6's own rows");
      FAIL() << "a charge past the limit was accepted";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded);
      EXPECT_NE(std::string(e.what()).find("sequence 6's own rows take 2 blocks of 1024 bytes, but 1 of 6 are free"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(store.counts().charged, 3u) << "a refused charge holds nothing";
    store.release(a);
    store.release(b);
  }
  EXPECT_EQ(store.counts().charged, 0u);
  EXPECT_EQ(store.available(), 6u);
  // A store whose limit counts blocks only takes no charge.
  const auto own = std::make_shared<kvq::BlockStore>(1000, 2);
  const kvq::OwnRowsCharge none(own, 1 << 20, "a cache's own rows");
  EXPECT_EQ(none.blocks(), 0u);
  EXPECT_EQ(own->available(), 2u);
}

}  // namespace
