// BlockStore: reference counts, reuse of zeroed blocks, slabs, the limit and what it charges.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvq/cache/block_store.hpp"
#include "kvq/cache/kv_cache.hpp"

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

// Freed blocks stay committed until charges need the room; then slabs with no block in use go
// back, the last first, whether the charge or the release that empties a slab tips it. A release
// keeps the slab while the excess is less than a slab, so a slab at the limit is not recommitted
// at every block.
TEST(BlockStore, GivesBackEmptySlabsWhenChargesNeedTheRoom) {
  const std::size_t block = std::size_t(1) << 20;  // two blocks a slab
  kvq::BlockStore store(block, 6, kvq::StoreLimit::blocks_and_own_rows);
  std::vector<kvq::BlockId> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(store.acquire());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(ids[i], kvq::BlockId(i)) << "the lowest free block first";
  // Less than a slab over the limit: the slab a release empties stays.
  store.release(5);
  store.charge(1, "own rows");  // 6 committed + 1 charged, no slab empty
  EXPECT_EQ(store.counts().committed, 6u);
  store.release(4);
  EXPECT_EQ(store.counts().committed, 6u) << "one block over the limit gives back no slab";
  EXPECT_EQ(store.acquire(), 4u) << "the lowest free block first";
  store.release(4);
  store.refund(1);
  for (int i = 0; i < 4; ++i) store.release(ids[i]);
  EXPECT_EQ(store.counts().committed, 6u) << "freed blocks stay committed while nothing needs the room";
  store.charge(2, "own rows");
  EXPECT_EQ(store.counts().committed, 4u) << "the last slab goes back";
  EXPECT_EQ(store.data(5), nullptr);
  // Fragmented: a block in use in each committed slab, and charges that need the room.
  EXPECT_EQ(store.acquire(), 0u);
  EXPECT_EQ(store.acquire(), 1u);
  EXPECT_EQ(store.acquire(), 2u);
  store.release(1);
  store.charge(2, "own rows");  // 4 charged and 4 committed: a slab over the limit of 6
  EXPECT_EQ(store.counts().committed, 4u) << "no slab is empty";
  store.release(2);  // empties slab 1, which goes back
  EXPECT_EQ(store.counts().committed, 2u);
  EXPECT_EQ(store.counts().in_use, 1u);
  // Refunded, the room is committed again: the given-back slabs first.
  store.refund(4);
  for (const kvq::BlockId want : {1u, 2u, 3u, 4u, 5u}) {
    const kvq::BlockId id = store.acquire();
    EXPECT_EQ(id, want);
    ASSERT_NE(store.data(id), nullptr);
    std::memset(store.data(id), 1, block);  // the memory is there
  }
  EXPECT_EQ(store.counts().committed, 6u);
  EXPECT_EQ(store.available(), 0u);
}

// A reservation sets blocks aside for one change: take() hands them out past a limit that
// refuses acquire(), and what is not taken goes back. Reserved blocks are not charges: they give
// back no slab, since the change takes them from the store.
TEST(BlockStore, ReservedBlocksAreTakenOneAtATime) {
  kvq::BlockStore store(1000, 4, kvq::StoreLimit::blocks_and_own_rows);
  store.release(store.acquire());
  EXPECT_EQ(store.counts().committed, 4u);
  {
    kvq::BlockReservation reserved(store);
    std::size_t free = 0;
    EXPECT_FALSE(reserved.add(5, &free));
    EXPECT_EQ(free, 4u);
    EXPECT_EQ(reserved.blocks(), 0u);
    ASSERT_TRUE(reserved.add(3));
    EXPECT_EQ(store.available(), 1u);
    EXPECT_EQ(store.counts().charged, 0u);
    EXPECT_EQ(store.counts().committed, 4u) << "a reservation gives back no slab";
    const kvq::BlockId a = store.acquire();
    EXPECT_THROW((void)store.acquire(), kvq::Error) << "the reserved blocks are not for others";
    EXPECT_THROW(store.charge(1, "own rows"), kvq::Error);
    const kvq::BlockId b = reserved.take(), c = reserved.take();
    EXPECT_EQ(store.counts().in_use, 3u);
    EXPECT_NE(b, c);
    EXPECT_NE(a, b);
    store.release(a);
  }
  EXPECT_EQ(store.available(), 2u) << "the block not taken went back";
  kvq::BlockReservation empty(store);
  EXPECT_THROW((void)empty.take(), kvq::Error);
}

// Own rows charged on a reservation (a pool load's) take its blocks: the store's free room does
// not move, nothing is given to others meanwhile, and a charge beyond the reservation, or on
// another store's, is refused without changing either.
TEST(BlockStore, OwnRowsChargesDrawOnAReservation) {
  const auto store = std::make_shared<kvq::BlockStore>(1000, 6, kvq::StoreLimit::blocks_and_own_rows);
  const auto other = std::make_shared<kvq::BlockStore>(1000, 6, kvq::StoreLimit::blocks_and_own_rows);
  kvq::BlockReservation reserved(*store);
  ASSERT_TRUE(reserved.add(4));
  ASSERT_EQ(store->available(), 2u);
  for (const auto& [on, bytes] : {std::pair{store, std::size_t(5000)}, std::pair{other, std::size_t(1000)}}) {
    try {
      const kvq::OwnRowsCharge charge(on, bytes, "own rows", &reserved);
      FAIL() << bytes << " bytes were charged on a reservation of 4 blocks of another store or too few";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded) << e.what();
      EXPECT_NE(std::string(e.what()).find("reserved"), std::string::npos) << e.what();
    }
    EXPECT_EQ(reserved.blocks(), 4u);
    EXPECT_EQ(on->counts().charged, 0u);
  }
  {
    const kvq::OwnRowsCharge charge(store, 2500, "own rows", &reserved);
    EXPECT_EQ(charge.blocks(), 3u);
    EXPECT_EQ(reserved.blocks(), 1u);
    EXPECT_EQ(store->counts().charged, 3u);
    EXPECT_EQ(store->available(), 2u) << "the reserved room became the charge";
    (void)reserved.take();
    EXPECT_THROW((void)reserved.take(), kvq::Error);
  }
  EXPECT_EQ(store->counts().charged, 0u);
  EXPECT_EQ(store->available(), 5u) << "the charge refunded, the block taken still in use";
}

// A cache over a store whose blocks are too small, or a RoPE table too short, is refused as a
// shape mismatch before the store's limit is charged, however little room the limit has.
TEST(BlockStore, CachesCheckTheStoreBeforeTheyChargeIt) {
  const kvq::CacheShape shape{.layers = 2, .kv_heads = 2, .head_dim = 64, .capacity = 512};
  const kvq::CacheConfig config = kvq::parse_cache_config("k4c32-v2t32-r32-s4");
  const std::size_t block = kvq::BasicKVCache::block_bytes(shape, config);
  const auto rope = std::make_shared<const kvq::RopeTable>(shape.rope(), shape.capacity);
  const auto small = std::make_shared<kvq::BlockStore>(block - 64, 1, kvq::StoreLimit::blocks_and_own_rows);
  try {
    const kvq::BasicKVCache cache(shape, config, small, rope);
    FAIL() << "blocks too small for the shape were accepted";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::shape_mismatch) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot hold the " + std::to_string(block)), std::string::npos) << e.what();
  }
  const auto fits = std::make_shared<kvq::BlockStore>(block, 1, kvq::StoreLimit::blocks_and_own_rows);
  const auto short_rope = std::make_shared<const kvq::RopeTable>(shape.rope(), shape.capacity - 1);
  try {
    const kvq::BasicKVCache cache(shape, config, fits, short_rope);
    FAIL() << "a RoPE table short of the capacity was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::shape_mismatch) << e.what();
  }
  EXPECT_EQ(small->counts().charged, 0u);
  EXPECT_EQ(fits->counts().charged, 0u);
  // With room for its own rows, the same store and table make a cache.
  const std::size_t own = (kvq::BasicKVCache::own_bytes(shape, config) + block - 1) / block;
  const auto roomy = std::make_shared<kvq::BlockStore>(block, own + 1, kvq::StoreLimit::blocks_and_own_rows);
  const kvq::BasicKVCache cache(shape, config, roomy, rope);
  EXPECT_EQ(roomy->available(), 1u);
}

}  // namespace
