// KVPool and the paged cache under it: attention over many blocks, forks that share blocks,
// rollback, save/load, an exhausted pool, memory that follows the length, and random operation
// sequences checked against fresh caches fed each sequence's final tokens, and against caches of
// their own given the same operations (context shifts and files included).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include "kvq/kvq.hpp"
#include "support/cache_state.hpp"
#include "support/compare.hpp"
#include "support/file_sections.hpp"
#include "support/random.hpp"

namespace {

using kvq::BasicKVCache;
using kvq::CacheConfig;
using kvq::CacheShape;
using kvq::KVPool;
using kvq::PoolShape;
using kvq::SequenceId;

CacheConfig config_of(const char* text) { return kvq::parse_cache_config(text); }

/// Tokens of one sequence as the test model keeps them: (tokens, kv_heads, head_dim) each.
struct Tokens {
  std::vector<float> keys, values;
  std::size_t size(std::size_t row) const { return keys.size() / row; }
  void add(std::size_t n, std::size_t row, std::mt19937& rng) {
    std::normal_distribution<float> normal;
    for (std::size_t i = 0; i < n * row; ++i) keys.push_back(normal(rng) + (i % 64 == 3 ? 6.0f : 0.0f));
    for (std::size_t i = 0; i < n * row; ++i) values.push_back(normal(rng));
  }
  void cut(std::size_t n, std::size_t row) {
    keys.resize(n * row);
    values.resize(n * row);
  }
  std::span<const float> k(std::size_t from, std::size_t to, std::size_t row) const {
    return std::span(keys).subspan(from * row, (to - from) * row);
  }
  std::span<const float> v(std::size_t from, std::size_t to, std::size_t row) const {
    return std::span(values).subspan(from * row, (to - from) * row);
  }
};

std::size_t row_of(const CacheShape& s) { return s.kv_heads * s.head_dim; }

/// A cache of its own fed `tokens` in one append per layer.
BasicKVCache fresh_cache(const CacheShape& shape, const CacheConfig& config, const Tokens& tokens) {
  BasicKVCache cache(shape, config);
  const std::size_t row = row_of(shape), n = tokens.size(row);
  for (std::size_t l = 0; l < shape.layers; ++l) cache.append(l, 0, tokens.k(0, n, row), tokens.v(0, n, row));
  return cache;
}

/// Decode attention at the newest position of every layer, both tiers, two query heads per KV head.
std::vector<float> decode_outputs(const BasicKVCache& cache) {
  std::vector<float> all;
  const std::size_t heads = cache.shape().kv_heads * 2, dim = cache.shape().head_dim;
  const auto q = kvq::test::normal_vector(heads * dim, 17, 0.3f);
  std::vector<float> out(q.size());
  for (std::size_t l = 0; l < cache.shape().layers; ++l) {
    if (cache.length(l) == 0) continue;
    for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer}) {
      kvq::decode_attention(cache, l, cache.length(l) - 1, q, out, {.tier = tier, .chunk_tokens = 96});
      all.insert(all.end(), out.begin(), out.end());
    }
  }
  return all;
}

const char* const kConfigs[] = {"k4c32-v2t32-r20-s3",       "k2c16-v4t32-r32-s0-post", "k8c32-v8t32-r16-s1-f32",
                                "k3c8-v5t16-r5-s2",         "k16-v16-r0-s1",           "k16-v16-r0-s0-post-f32",
                                "k4c32-v2c32-r40-s0",       "k4t64-v16-r8-s0",         "k4c32-v2t32-r64-s3-fk",
                                "k4c32-v2t32-r128-s3-fk-fv"};

// Attention reads a stream as one segment per block: with blocks of one unit, of two, and one
// block for the whole capacity, every kernel gives the same bits, and stays near the oracle.
TEST(PagedCache, AttentionOverManyBlocksEqualsOneBlock) {
  for (const char* text : kConfigs) {
    const CacheConfig config = config_of(text);
    const std::size_t unit = kvq::block_unit(config), n = 611;
    CacheShape shape{2, 2, 64, 700};
    Tokens tokens;
    std::mt19937 rng(3);
    tokens.add(n, row_of(shape), rng);
    std::vector<std::vector<float>> outputs;
    for (const std::size_t block : {unit, 2 * unit, (700 + unit - 1) / unit * unit}) {
      shape.block_tokens = block;
      const BasicKVCache cache = fresh_cache(shape, config, tokens);
      EXPECT_EQ(cache.segments(0), block >= 700 ? 1u : (n - config.sinks + block - 1) / block) << text;
      outputs.push_back(decode_outputs(cache));
      // Exact tier near the oracle, for one layer and head group.
      const auto q = kvq::test::normal_vector(4 * 64, 17, 0.3f);
      std::vector<float> exact(q.size()), oracle(q.size());
      kvq::decode_attention(cache, 1, n - 1, q, exact);
      kvq::reference_attention(cache, 1, n - 1, q, oracle);
      EXPECT_LT(kvq::test::relative_error(exact, oracle), 1e-5) << text << " block " << block;
    }
    EXPECT_TRUE(outputs[0] == outputs[1]) << text;
    EXPECT_TRUE(outputs[0] == outputs[2]) << text;
  }
}

// Every path the cache has for attention is cut the same way: each kernel, run by name.
TEST(PagedCache, EveryKernelAgreesAcrossBlockLengths) {
  for (const auto& kernel : kvq::kernels::attention::registry()) {
    if (!kernel.available()) continue;
    for (const char* text :
         {"k4c32-v2t32-r20-s3-post", "k4c32-v2t32-r20-s3", "k4c32-v2t32-r64-s3-fk", "k4c32-v2t32-r128-s3-fk"}) {
      const CacheConfig config = config_of(text);
      CacheShape shape{1, 2, 64, 400};
      Tokens tokens;
      std::mt19937 rng(4);
      tokens.add(333, row_of(shape), rng);
      const auto q = kvq::test::normal_vector(4 * 64, 5, 0.3f);
      std::vector<float> a(q.size()), b(q.size());
      shape.block_tokens = 64;
      kvq::decode_attention(fresh_cache(shape, config, tokens), 0, 332, q, a, {.kernel = kernel.name});
      shape.block_tokens = 448;
      kvq::decode_attention(fresh_cache(shape, config, tokens), 0, 332, q, b, {.kernel = kernel.name});
      EXPECT_EQ(a, b) << text << " on " << kernel.name;
    }
  }
}

TEST(PagedCache, BlockLengthsAreCheckedAgainstTheUnit) {
  const CacheConfig config = config_of("k4c48-v2c24-r20-s0");
  EXPECT_EQ(kvq::block_unit(config), 192u);  // whole key tiles (one group of 48), value groups of 24, 64-row steps
  EXPECT_EQ(kvq::block_unit(config_of("k4c20-v2t32-r20-s0")), 960u);  // tiles of 60, 64-row steps
  EXPECT_EQ(kvq::block_unit(config_of("k16-v16-r0-s0")), 64u);
  CacheShape shape{1, 1, 64, 1000};
  shape.block_tokens = 384;
  EXPECT_EQ(BasicKVCache(shape, config).block_tokens(), 384u);
  shape.block_tokens = 96;
  try {
    BasicKVCache cache(shape, config);
    FAIL() << "a block of 96 positions was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("block_tokens 96"), std::string::npos) << e.what();
  }
}

// The cache commits blocks as rows reach them: memory follows the length, not the capacity.
TEST(PagedCache, MemoryIsCommittedAsTokensArrive) {
  const CacheShape shape{2, 2, 64, 32768};
  BasicKVCache cache(shape, config_of("k4c32-v2t32-r128-s1"));
  const std::size_t empty = cache.allocated_bytes();
  EXPECT_EQ(cache.block_count(0), 0u);
  Tokens tokens;
  std::mt19937 rng(5);
  tokens.add(1000, row_of(shape), rng);
  for (std::size_t l = 0; l < 2; ++l) cache.append(l, 0, tokens.k(0, 1000, 128), tokens.v(0, 1000, 128));
  EXPECT_EQ(cache.block_count(0), 1u);  // 872 packed value rows: one block of 4096
  EXPECT_LT(cache.allocated_bytes() - empty, 2 * cache.blocks().block_bytes() + 1);
}

// Context shift moves packed rows across block boundaries: the same rows as in one block.
TEST(PagedCache, EraseAcrossBlocksKeepsEveryRow) {
  struct Range {
    std::size_t first, count;
  };
  // Keys that flush 128 at a time move in whole flushes: each spans two blocks of 64.
  for (const auto& [text, ranges] : {std::pair{"k4c32-v2t32-r20-s3", std::vector<Range>{{35, 96}, {259, 32}, {3, 160}}},
                                     {"k4c32-v2t32-r128-s3-fk", std::vector<Range>{{131, 128}, {3, 256}}}}) {
    SCOPED_TRACE(text);
    const CacheConfig config = config_of(text);
    CacheShape shape{2, 2, 64, 1000};
    Tokens tokens;
    std::mt19937 rng(12);
    tokens.add(700, row_of(shape), rng);
    shape.block_tokens = 64;
    BasicKVCache paged = fresh_cache(shape, config, tokens);
    shape.block_tokens = 1024;
    BasicKVCache whole = fresh_cache(shape, config, tokens);
    for (const Range& r : ranges) {
      paged.erase(r.first, r.count);
      whole.erase(r.first, r.count);
      for (std::size_t l = 0; l < 2; ++l)
        EXPECT_TRUE(kvq::test::stored_rows(paged, l) == kvq::test::stored_rows(whole, l));
      EXPECT_EQ(decode_outputs(paged), decode_outputs(whole));
      const std::size_t packed =
          std::max(paged.quantized_end(kvq::Tensor::keys, 0), paged.quantized_end(kvq::Tensor::values, 0));
      EXPECT_EQ(paged.block_count(0), (packed - 3 + 63) / 64);
    }
  }
}

// Keys and values straight from an engine's fused QKV activations in f16 or bf16: the same bytes
// as appending the same numbers as dense floats.
TEST(PagedCache, AppendsStridedHalfPrecisionRows) {
  const std::size_t heads = 4, kv_heads = 2, dim = 64, tokens = 150, fused = heads + 2 * kv_heads;
  const CacheShape shape{1, kv_heads, dim, 400};
  for (const kvq::Scalar type : {kvq::Scalar::f16, kvq::Scalar::bf16}) {
    const auto x = kvq::test::normal_vector(tokens * fused * dim, 30);
    // Room for f32 too: GCC's -Warray-bounds checks store_row's f32 branch against the buffer.
    std::vector<std::uint16_t> qkv(2 * x.size());
    kvq::store_row(type, x.data(), x.size(), qkv.data());
    std::vector<float> k(tokens * kv_heads * dim), v(k.size());
    for (std::size_t t = 0; t < tokens; ++t)
      for (std::size_t h = 0; h < kv_heads; ++h) {
        kvq::load_row(type, qkv.data() + (t * fused + heads + h) * dim, dim, k.data() + (t * kv_heads + h) * dim);
        kvq::load_row(type, qkv.data() + (t * fused + heads + kv_heads + h) * dim, dim,
                      v.data() + (t * kv_heads + h) * dim);
      }
    BasicKVCache dense(shape, config_of("k4c32-v2t32-r20-s3")), strided(shape, config_of("k4c32-v2t32-r20-s3"));
    dense.append(0, 0, k, v);
    const kvq::TokenRows keys{qkv.data() + heads * dim, type, 100, fused * dim, dim};
    const kvq::TokenRows values{qkv.data() + (heads + kv_heads) * dim, type, 100, fused * dim, dim};
    strided.append(0, 0, keys, values);
    const kvq::TokenRows more_keys{qkv.data() + (100 * fused + heads) * dim, type, 50, fused * dim, dim};
    const kvq::TokenRows more_values{qkv.data() + (100 * fused + heads + kv_heads) * dim, type, 50, fused * dim, dim};
    strided.append(0, 100, more_keys, more_values);
    EXPECT_TRUE(dense.stored_bytes() == strided.stored_bytes()) << kvq::to_string(type);
    EXPECT_THROW(strided.append(0, 150, more_keys, keys), kvq::Error);
  }
}

// Kernels read ahead within a segment and, past its end, into the next segment's rows; never
// into whatever memory follows a segment.
TEST(PagedCache, ReadAheadStaysInTheSegmentAndGoesOnIntoTheNext) {
  using kvq::kernels::attention::read_ahead;
  std::vector<std::uint8_t> a(1000), b(1000);
  const std::uint8_t *begin = a.data(), *end = a.data() + a.size(), *next = b.data();
  EXPECT_EQ(read_ahead(begin + 10, begin, end, next, 100), begin + 110);
  EXPECT_EQ(read_ahead(begin + 950, begin, end, next, 100), next + 50);     // past the end: into the next
  EXPECT_EQ(read_ahead(begin + 950, begin, end, nullptr, 100), nullptr);    // the last segment
  EXPECT_EQ(read_ahead(begin + 10, begin, end, next, 1 << 20), next + 10);  // one segment ahead at most
  EXPECT_EQ(read_ahead(begin + 10, begin, end, nullptr, 1 << 20), nullptr);
}

PoolShape small_pool(std::size_t blocks = 4096) {
  PoolShape p;
  p.layers = 2;
  p.kv_heads = 2;
  p.head_dim = 64;
  p.max_tokens = 4096;
  p.block_tokens = 64;
  p.memory_blocks = blocks;
  return p;
}

/// A new sequence of `pool` fed n random tokens (kept in `tokens`) in every layer.
SequenceId add_tokens(KVPool& pool, Tokens& tokens, std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  const std::size_t row = row_of(pool.shape().sequence_shape());
  tokens.add(n, row, rng);
  const SequenceId id = pool.add_sequence();
  for (std::size_t l = 0; l < pool.shape().layers; ++l) pool.append(id, l, 0, tokens.k(0, n, row), tokens.v(0, n, row));
  return id;
}

// A fork shares every block of the prefix: memory grows by the fork's own rows only; writes on
// either side leave the other's bytes alone; removing both returns every block.
TEST(KVPool, ForkSharesThePrefixAndCopiesOnlyOwnRows) {
  const CacheConfig config = config_of("k4c32-v2t32-r32-s2");
  KVPool pool(small_pool(), config);
  const std::size_t row = 128;
  Tokens parent_tokens;
  const SequenceId parent = add_tokens(pool, parent_tokens, 2000, 6);
  std::mt19937 rng(60);
  const kvq::PoolMemory before = pool.memory();
  const std::size_t blocks_before = pool.blocks().counts().in_use;
  const SequenceId child = pool.fork(parent, 2000);
  const kvq::PoolMemory after = pool.memory();
  EXPECT_EQ(pool.blocks().counts().in_use, blocks_before) << "a fork at the full length copies no block";
  EXPECT_EQ(after.used - before.used, after.own - before.own) << "only the fork's own rows are new";
  EXPECT_EQ(after.shared, blocks_before * pool.block_bytes());
  EXPECT_TRUE(pool.sequence(child).stored_bytes() == pool.sequence(parent).stored_bytes());

  const auto parent_bytes = pool.sequence(parent).stored_bytes();
  Tokens child_tokens = parent_tokens;
  child_tokens.add(300, row, rng);
  for (std::size_t l = 0; l < 2; ++l)
    pool.append(child, l, 2000, child_tokens.k(2000, 2300, row), child_tokens.v(2000, 2300, row));
  EXPECT_TRUE(pool.sequence(parent).stored_bytes() == parent_bytes) << "the child's writes reached the parent";
  kvq::test::expect_same_state(pool.sequence(child), fresh_cache(pool.shape().sequence_shape(), config, child_tokens),
                               "child against a fresh cache");
  kvq::test::expect_same_state(pool.sequence(parent), fresh_cache(pool.shape().sequence_shape(), config, parent_tokens),
                               "parent against a fresh cache");
  EXPECT_EQ(decode_outputs(pool.sequence(child)),
            decode_outputs(fresh_cache(pool.shape().sequence_shape(), config, child_tokens)));

  pool.remove_sequence(parent);
  pool.remove_sequence(child);
  EXPECT_EQ(pool.blocks().counts().in_use, 0u);
  EXPECT_EQ(pool.memory().used, 0u);
  EXPECT_EQ(pool.sequence_count(), 0u);
}

// Speculative decoding: fork at an older length, then different tokens.
TEST(KVPool, ForkAtAnOlderLengthIsExactWithinTheRollbackDepth) {
  const CacheConfig config = config_of("k4c32-v2t32-r16-s1");  // rollback depth 16
  KVPool pool(small_pool(), config);
  const std::size_t row = 128;
  Tokens tokens;
  const SequenceId a = add_tokens(pool, tokens, 500, 7);
  std::mt19937 rng(70);
  const auto a_bytes = pool.sequence(a).stored_bytes();
  const SequenceId b = pool.fork(a, 488);
  Tokens other = tokens;
  other.cut(488, row);
  other.add(40, row, rng);
  for (std::size_t l = 0; l < 2; ++l) pool.append(b, l, 488, other.k(488, 528, row), other.v(488, 528, row));
  EXPECT_TRUE(pool.sequence(a).stored_bytes() == a_bytes);
  kvq::test::expect_same_state(pool.sequence(b), fresh_cache(pool.shape().sequence_shape(), config, other),
                               "fork at 488");
  // Beyond the depth: a named error, nothing new.
  const std::size_t count = pool.sequence_count(), used = pool.memory().used;
  try {
    (void)pool.fork(a, 400);
    FAIL() << "a fork 100 tokens back was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unsupported) << e.what();
  }
  EXPECT_EQ(pool.sequence_count(), count);
  EXPECT_EQ(pool.memory().used, used);
}

// Beam search: after reorder each beam holds its source's tokens, as a fresh cache fed them does,
// and goes on from there without touching the beams it shares blocks with. The pool's limit is
// full (no fork would fit), and the reorder needs no more.
TEST(KVPool, ReorderGivesEachBeamItsSourceAndNeedsNoMemory) {
  const CacheConfig config = config_of("k4c32-v2t32-r20-s2");
  const CacheShape shape = small_pool().sequence_shape();
  const std::size_t row = row_of(shape), own = KVPool(small_pool(), config).own_row_blocks();
  const std::size_t lengths[] = {300, 257, 180, 333, 64};
  std::vector<SequenceId> ids;
  std::vector<Tokens> tokens(5);
  auto add_beams = [&](KVPool& pool) {
    ids.clear();
    for (std::size_t i = 0; i < 5; ++i) {
      tokens[i] = {};
      ids.push_back(add_tokens(pool, tokens[i], lengths[i], unsigned(40 + i)));
    }
  };
  KVPool probe(small_pool(), config);
  add_beams(probe);
  // Exactly the beams' own rows and the blocks their tokens fill.
  KVPool pool(small_pool(5 * own + probe.blocks().counts().in_use), config);
  add_beams(pool);
  ASSERT_EQ(pool.blocks().available(), 0u);
  EXPECT_THROW((void)pool.fork(ids[0], lengths[0]), kvq::Error);

  // Beam 1 continues itself; sequence 2 continues as three beams, 4 as one, 0 and 3 end.
  const std::vector<std::size_t> sources = {2, 1, 2, 4, 2};
  const kvq::PoolMemory before = pool.memory();
  pool.reorder(ids, sources);
  EXPECT_EQ(pool.sequence_count(), 5u);
  EXPECT_EQ(pool.memory().own, before.own);
  EXPECT_LT(pool.memory().used, before.used) << "the blocks of the sequences that ended are let go of";
  std::vector<Tokens> beams(5);
  for (std::size_t i = 0; i < 5; ++i) {
    beams[i] = tokens[sources[i]];
    kvq::test::expect_same_state(pool.sequence(ids[i]), fresh_cache(shape, config, beams[i]),
                                 "beam " + std::to_string(i) + " after the reorder");
  }
  // Each beam takes a different next token: shared blocks are copied as they are written.
  std::mt19937 rng(90);
  for (std::size_t i = 0; i < 5; ++i) {
    const std::size_t n = beams[i].size(row);
    beams[i].add(3, row, rng);
    for (std::size_t l = 0; l < shape.layers; ++l)
      pool.append(ids[i], l, n, beams[i].k(n, n + 3, row), beams[i].v(n, n + 3, row));
  }
  for (std::size_t i = 0; i < 5; ++i) {
    kvq::test::expect_same_state(pool.sequence(ids[i]), fresh_cache(shape, config, beams[i]),
                                 "beam " + std::to_string(i) + " after its next tokens");
    EXPECT_EQ(decode_outputs(pool.sequence(ids[i])), decode_outputs(fresh_cache(shape, config, beams[i])));
  }
  // The identity, and a permutation, move no block.
  const std::size_t in_use = pool.blocks().counts().in_use;
  pool.reorder(ids, std::vector<std::size_t>{0, 1, 2, 3, 4});
  pool.reorder(ids, std::vector<std::size_t>{4, 3, 2, 1, 0});
  EXPECT_EQ(pool.blocks().counts().in_use, in_use);
  for (std::size_t i = 0; i < 5; ++i)
    EXPECT_TRUE(pool.sequence(ids[i]).stored_bytes() == fresh_cache(shape, config, beams[4 - i]).stored_bytes());
  for (const SequenceId id : ids) pool.remove_sequence(id);
  EXPECT_EQ(pool.blocks().counts().in_use, 0u);
  EXPECT_EQ(pool.memory().used, 0u);
}

// Cycles, cycles mixed with shares, and a sequence outside the reorder that shares blocks with
// one that ends: each beam holds its source's bytes, and the store's counts are exactly the
// references the sequences' block tables hold.
TEST(KVPool, ReorderHandlesCyclesSharesAndBystanders) {
  using Access = kvq::detail::CacheAccess;
  const CacheConfig config = config_of("k4c32-v2t32-r20-s2");
  KVPool pool(small_pool(), config);
  std::vector<Tokens> tokens(3);
  std::vector<SequenceId> ids;
  for (std::size_t i = 0; i < 3; ++i) ids.push_back(add_tokens(pool, tokens[i], 150 + 40 * i, unsigned(60 + i)));
  const SequenceId bystander = pool.fork(ids[2], 230);
  const auto bystander_bytes = pool.sequence(bystander).stored_bytes();
  auto expect_counts_match_tables = [&](const std::string& when) {
    std::map<kvq::BlockId, std::size_t> refs;
    for (const SequenceId id : {ids[0], ids[1], ids[2], bystander})
      for (std::size_t l = 0; l < pool.shape().layers; ++l)
        for (const kvq::BlockId b : Access::table(pool.sequence(id), l)) ++refs[b];
    const std::size_t shared =
        std::size_t(std::count_if(refs.begin(), refs.end(), [](auto r) { return r.second > 1; }));
    EXPECT_EQ(pool.blocks().counts().in_use, refs.size()) << when;
    EXPECT_EQ(pool.blocks().counts().shared, shared) << when;
  };
  std::vector<std::vector<std::uint8_t>> held;
  for (const SequenceId id : ids) held.push_back(pool.sequence(id).stored_bytes());
  const std::vector<std::vector<std::size_t>> orders = {{1, 2, 0}, {1, 0, 0}, {2, 2, 2}, {0, 1, 2}, {2, 0, 1}};
  for (const auto& order : orders) {
    const std::string when = "order " + std::to_string(order[0]) + std::to_string(order[1]) + std::to_string(order[2]);
    pool.reorder(ids, order);
    std::vector<std::vector<std::uint8_t>> next;
    for (std::size_t i = 0; i < 3; ++i) {
      next.push_back(held[order[i]]);
      EXPECT_TRUE(pool.sequence(ids[i]).stored_bytes() == next[i]) << when << ", beam " << i;
    }
    held = std::move(next);
    EXPECT_TRUE(pool.sequence(bystander).stored_bytes() == bystander_bytes) << when;
    expect_counts_match_tables(when);
  }
}

TEST(KVPool, RefusedReorderNamesTheProblemAndChangesNothing) {
  const CacheConfig config = config_of("k4c32-v2t32-r20-s2");
  KVPool pool(small_pool(), config);
  std::vector<SequenceId> ids;
  std::vector<Tokens> tokens(3);
  for (std::size_t i = 0; i < 3; ++i) ids.push_back(add_tokens(pool, tokens[i], 100 + 30 * i, unsigned(50 + i)));
  std::vector<std::vector<std::uint8_t>> bytes;
  for (const SequenceId id : ids) bytes.push_back(pool.sequence(id).stored_bytes());
  const std::vector<SequenceId> repeated = {ids[0], ids[1], ids[0]}, unknown = {ids[0], ids[1], ids[2] + 100};
  const std::vector<std::size_t> fine = {1, 1, 0}, short_sources = {1, 1}, beyond = {0, 3, 1};
  const struct {
    std::span<const SequenceId> ids;
    std::span<const std::size_t> sources;
    const char* needle;
  } cases[] = {{ids, short_sources, "3 sequences and 2 source indices"},
               {repeated, fine, "appears twice (index 2)"},
               {unknown, fine, "no sequence"},
               {ids, beyond, "source 3 of index 1 is not below 3"}};
  for (const auto& c : cases) {
    try {
      pool.reorder(c.ids, c.sources);
      ADD_FAILURE() << c.needle << ": accepted";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
    }
    for (std::size_t i = 0; i < 3; ++i) EXPECT_TRUE(pool.sequence(ids[i]).stored_bytes() == bytes[i]) << c.needle;
  }
  pool.reorder({}, {});  // no beams: nothing to do
  EXPECT_EQ(pool.sequence_count(), 3u);
  // Memory refused midway (reserve_share, result) would throw out_of_memory before the first
  // share; no test makes the system refuse it.
}

TEST(KVPool, ExhaustedPoolNamesTheBlocksAndChangesNothing) {
  const CacheConfig config = config_of("k4c32-v2t32-r32-s0");
  KVPool pool(small_pool(9 + KVPool(small_pool(), config).own_row_blocks()), config);  // 9 for tokens
  const std::size_t row = 128;
  Tokens tokens;
  const SequenceId s = add_tokens(pool, tokens, 250, 8);
  std::mt19937 rng(80);
  EXPECT_EQ(pool.blocks().counts().in_use, 8u);  // 218 packed value rows per layer: 4 blocks of 64
  const auto bytes = pool.sequence(s).stored_bytes();
  tokens.add(200, row, rng);
  try {  // 418 packed value rows need 7 blocks
    pool.append(s, 0, 250, tokens.k(250, 450, row), tokens.v(250, 450, row));
    FAIL() << "appending past the pool's blocks was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded);
    const std::string what = e.what();
    EXPECT_NE(what.find("sequence " + std::to_string(s)), std::string::npos) << what;
    EXPECT_NE(what.find("needs 3 more blocks"), std::string::npos) << what;
    EXPECT_NE(what.find("1 free"), std::string::npos) << what;
  }
  EXPECT_TRUE(pool.sequence(s).stored_bytes() == bytes);
  EXPECT_EQ(pool.sequence(s).length(0), 250u);
}

// A rollback or context shift of a fork copies the shared blocks it writes to, in every layer.
// Short of blocks for all of them it is refused having copied none (the sharing stays); with
// exactly enough it succeeds.
TEST(KVPool, RefusedChangesToAForkCopyNoBlock) {
  const CacheConfig config = config_of("k4c32-v2t32-r16-s1");
  const std::size_t row = 128, own = KVPool(small_pool(), config).own_row_blocks();
  std::size_t parent_blocks = 0, copies = 0;
  {
    KVPool roomy(small_pool(), config);
    Tokens t;
    const SequenceId parent = add_tokens(roomy, t, 500, 9);
    parent_blocks = roomy.blocks().counts().in_use;
    roomy.truncate(roomy.fork(parent, 500), 490);
    copies = roomy.blocks().counts().in_use - parent_blocks;
  }
  ASSERT_GE(copies, 2u) << "a copy in each layer";
  for (const std::size_t spare : {copies - 1, copies}) {
    KVPool pool(small_pool(parent_blocks + 2 * own + spare), config);
    Tokens t;
    const SequenceId parent = add_tokens(pool, t, 500, 9);
    const SequenceId child = pool.fork(parent, 500);
    ASSERT_EQ(pool.blocks().available(), spare);
    const kvq::PoolMemory before = pool.memory();
    const auto bytes = pool.sequence(child).stored_bytes();
    if (spare < copies) {
      for (const auto& [what, step] : std::vector<std::pair<std::string, std::function<void()>>>{
               {"truncate to 490", [&] { pool.truncate(child, 490); }},
               {"erase at 1", [&] { pool.erase(child, 1, 32); }}}) {
        try {
          step();
          ADD_FAILURE() << what << " without the blocks for its copies was accepted";
        } catch (const kvq::Error& e) {
          EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded) << e.what();
          EXPECT_NE(std::string(e.what()).find(what + ": needs "), std::string::npos) << e.what();
        }
        EXPECT_EQ(pool.memory().shared, before.shared) << what << " copied a shared block";
        EXPECT_EQ(pool.memory().used, before.used) << what;
        EXPECT_EQ(pool.blocks().counts().charged, 2 * own) << what << " left a charge";
        EXPECT_TRUE(pool.sequence(child).stored_bytes() == bytes) << what;
      }
      continue;
    }
    pool.truncate(child, 490);
    EXPECT_EQ(pool.blocks().available(), 0u);
    Tokens kept = t;
    kept.cut(490, row);
    kvq::test::expect_same_state(pool.sequence(child), fresh_cache(pool.shape().sequence_shape(), config, kept),
                                 "fork truncated with exactly the blocks it copies");
  }
}

TEST(KVPool, SavedSequencesLoadBackAndBadFilesChangeNothing) {
  const CacheConfig config = config_of("k4c32-v2t32-r32-s2");
  KVPool pool(small_pool(), config);
  Tokens tokens;
  const SequenceId s = add_tokens(pool, tokens, 700, 9);
  std::stringstream file;
  kvq::save(pool.sequence(s), file);
  const std::string bytes = file.str();
  const SequenceId t = pool.load_sequence(file);
  kvq::test::expect_same_state(pool.sequence(t), pool.sequence(s), "loaded sequence");
  // Into a cache of its own too: the file does not depend on the block length.
  CacheShape other = pool.shape().sequence_shape();
  other.block_tokens = 256;
  BasicKVCache own(other, config);
  std::stringstream again(bytes);
  kvq::load(own, again);
  EXPECT_TRUE(kvq::test::stored_rows(own, 1) == kvq::test::stored_rows(pool.sequence(s), 1));
  EXPECT_EQ(decode_outputs(own), decode_outputs(pool.sequence(s)));

  const std::size_t count = pool.sequence_count(), used = pool.memory().used;
  for (const std::size_t cut : {std::size_t(10), bytes.size() / 2, bytes.size() - 1}) {
    std::stringstream truncated(bytes.substr(0, cut));
    EXPECT_THROW((void)pool.load_sequence(truncated), kvq::Error) << "cut at " << cut;
  }
  std::string flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x10;
  std::stringstream corrupt(flipped);
  EXPECT_THROW((void)pool.load_sequence(corrupt), kvq::Error);
  EXPECT_EQ(pool.sequence_count(), count);
  EXPECT_EQ(pool.memory().used, used);
}

std::string saved_pool(const KVPool& pool) {
  std::ostringstream out(std::ios::binary);
  pool.save(out);
  return out.str();
}

void load_pool(KVPool& pool, const std::string& bytes) {
  std::istringstream in(bytes, std::ios::binary);
  pool.load(in);
}

/// The tokens of each sequence of a pool filled by fill_pool.
using PoolModel = std::map<SequenceId, Tokens>;

/// A pool with forks sharing prefixes, a fork written to, a rollback, a removed sequence: the ways
/// blocks come to be shared or copied.
PoolModel fill_pool(KVPool& pool, std::size_t prompt, unsigned seed) {
  PoolModel model;
  const std::size_t row = row_of(pool.shape().sequence_shape()), layers = pool.shape().layers;
  std::mt19937 rng(seed);
  Tokens base;
  const SequenceId a = add_tokens(pool, base, prompt, seed);
  model[a] = base;
  auto extend = [&](SequenceId id, std::size_t n) {
    Tokens& t = model[id];
    const std::size_t from = t.size(row);
    t.add(n, row, rng);
    for (std::size_t l = 0; l < layers; ++l)
      pool.append(id, l, from, t.k(from, from + n, row), t.v(from, from + n, row));
  };
  const SequenceId b = pool.fork(a, prompt);  // shares every block
  model[b] = base;
  extend(b, 37);
  const SequenceId c = pool.fork(a, prompt - 5);  // a speculative branch
  model[c] = base;
  model[c].cut(prompt - 5, row);
  extend(c, 20);
  pool.truncate(c, prompt + 3);
  model[c].cut(prompt + 3, row);
  extend(c, 9);
  const SequenceId gone = pool.fork(b, prompt + 37);
  pool.remove_sequence(gone);  // ids stay sparse
  extend(a, 3);
  return model;
}

// A saved pool loads back into an empty pool as it was: every sequence's bytes, rows and
// attention, its ids, the blocks shared (memory().used and .shared), and what happens next.
TEST(KVPool, SavedPoolLoadsBackWithItsSharing) {
  for (const char* text : {"k4c32-v2t32-r20-s3", "k2c16-v4t32-r8-s0-post", "k16-v16-r0-s1-f32"}) {
    SCOPED_TRACE(text);
    const CacheConfig config = config_of(text);
    KVPool pool(small_pool(), config);
    const PoolModel model = fill_pool(pool, 300, 21);
    const std::string bytes = saved_pool(pool);
    KVPool copy(small_pool(8192), config);  // another memory limit is fine
    load_pool(copy, bytes);
    ASSERT_EQ(copy.sequence_count(), pool.sequence_count());
    for (const auto& [id, tokens] : model) {
      ASSERT_TRUE(copy.contains(id)) << "sequence " << id;
      kvq::test::expect_same_state(copy.sequence(id), pool.sequence(id), "sequence " + std::to_string(id));
      EXPECT_EQ(decode_outputs(copy.sequence(id)), decode_outputs(pool.sequence(id))) << "sequence " << id;
      EXPECT_TRUE(copy.sequence(id).stored_bytes() ==
                  fresh_cache(pool.shape().sequence_shape(), config, tokens).stored_bytes());
      for (std::size_t l = 0; l < 2; ++l)
        for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values})
          EXPECT_EQ(copy.sequence(id).rollback_floor(t, l), pool.sequence(id).rollback_floor(t, l));
    }
    EXPECT_GT(pool.memory().shared, 0u);
    EXPECT_EQ(copy.memory().used, pool.memory().used);
    EXPECT_EQ(copy.memory().shared, pool.memory().shared) << "shared blocks stay shared";
    EXPECT_EQ(copy.blocks().counts().in_use, pool.blocks().counts().in_use);
    KVPool same_limit(small_pool(), config);
    load_pool(same_limit, bytes);
    EXPECT_TRUE(saved_pool(same_limit) == bytes) << "saving the loaded pool writes the same file";
    const SequenceId added = copy.add_sequence();
    EXPECT_EQ(added, pool.add_sequence()) << "ids continue where they were";
    // Writes to a sequence whose blocks are shared leave the others alone, in both pools.
    const SequenceId first = model.begin()->first;
    Tokens more = model.begin()->second;
    std::mt19937 rng(5);
    const std::size_t from = more.size(128);
    more.add(90, 128, rng);
    std::vector<std::vector<std::uint8_t>> others;
    for (const auto& [id, t] : model)
      if (id != first) others.push_back(copy.sequence(id).stored_bytes());
    for (KVPool* p : {&pool, &copy})
      for (std::size_t l = 0; l < 2; ++l)
        p->append(first, l, from, more.k(from, from + 90, 128), more.v(from, from + 90, 128));
    kvq::test::expect_same_state(copy.sequence(first), pool.sequence(first), "after more tokens");
    std::size_t k = 0;
    for (const auto& [id, t] : model)
      if (id != first) {
        EXPECT_TRUE(copy.sequence(id).stored_bytes() == others[k++]) << "sequence " << id;
      }
    for (const auto& [id, t] : model) copy.remove_sequence(id);
    copy.remove_sequence(added);
    EXPECT_EQ(copy.blocks().counts().in_use, 0u) << "every block returned";
  }
}

// Pool files on disk: written beside the target and renamed into place, so a save that fails
// leaves the file that was there; a missing file is an io error naming it.
TEST(KVPool, PoolFilesReplaceTheOldFileOnlyWhenWrittenWhole) {
  const CacheConfig config = config_of("k4c32-v2t32-r20-s3");
  KVPool pool(small_pool(), config);
  const PoolModel model = fill_pool(pool, 200, 4);
  const auto dir = std::filesystem::temp_directory_path() / ("kvq_test_pool_files_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto path = dir / "session.kvqpool";
  pool.save_file(path);
  KVPool copy(small_pool(), config);
  copy.load_file(path);
  for (const auto& [id, tokens] : model)
    kvq::test::expect_same_state(copy.sequence(id), pool.sequence(id), "sequence " + std::to_string(id));
  EXPECT_FALSE(std::filesystem::exists(dir / "session.kvqpool.partial"));

  // A save that cannot be written (its partial file's name is taken by a directory) fails and
  // leaves the old file whole.
  const auto old_size = std::filesystem::file_size(path);
  (void)pool.add_sequence();  // the pool changed since the file was written
  std::filesystem::create_directory(dir / "session.kvqpool.partial");
  try {
    pool.save_file(path);
    ADD_FAILURE() << "saving over a blocked partial file succeeded";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::io);
    EXPECT_NE(std::string(e.what()).find("session.kvqpool.partial"), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::filesystem::file_size(path), old_size);
  EXPECT_TRUE(std::filesystem::is_directory(dir / "session.kvqpool.partial")) << "what the save did not make stays";
  KVPool again(small_pool(), config);
  again.load_file(path);
  EXPECT_EQ(again.sequence_count(), model.size());

  try {
    KVPool empty(small_pool(), config);
    empty.load_file(dir / "missing.kvqpool");
    ADD_FAILURE() << "no error for a missing file";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::io);
    EXPECT_NE(std::string(e.what()).find("missing.kvqpool"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// Files for another pool, or a pool that cannot take one: named errors, nothing changed.
/// load() throws kvq::Error of `code` naming `needle`, and `target` keeps its sequences and memory.
template <class Load>
void expect_load_refused(const KVPool& target, Load&& load, kvq::ErrorCode code, const std::string& needle) {
  const std::size_t count = target.sequence_count(), used = target.memory().used;
  try {
    load();
    ADD_FAILURE() << needle << ": loaded";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  EXPECT_EQ(target.sequence_count(), count) << needle;
  EXPECT_EQ(target.memory().used, used) << needle;
}

// The limit counts each sequence's own rows (sinks, ring, rollback copies) in whole blocks while
// it lives: new sequences, forks and loaded files that do not fit are refused, nothing changed.
TEST(KVPool, OwnRowsCountAgainstTheLimit) {
  const CacheConfig config = config_of("k4c32-v2t32-r32-s4-d8");
  const PoolShape probe_shape = small_pool();
  const std::size_t own = KVPool(probe_shape, config).own_row_blocks();
  const kvq::CacheShape shape = probe_shape.sequence_shape();
  ASSERT_EQ(own, (BasicKVCache::own_bytes(shape, config) + BasicKVCache::block_bytes(shape, config) - 1) /
                     BasicKVCache::block_bytes(shape, config));
  ASSERT_GT(own, 1u);
  KVPool pool(small_pool(3 * own + 2), config);
  Tokens tokens;
  const SequenceId a = add_tokens(pool, tokens, 40, 11);  // 4 value positions packed: a block per layer
  EXPECT_EQ(pool.sequence(a).own_bytes(), BasicKVCache::own_bytes(shape, config));
  const SequenceId b = pool.fork(a, 40);
  EXPECT_EQ(pool.blocks().counts().charged, 2 * own);
  EXPECT_EQ(pool.blocks().available(), own);
  const SequenceId c = pool.add_sequence();
  EXPECT_EQ(pool.blocks().available(), 0u);
  const std::size_t used = pool.memory().used;
  for (const auto& [what, step] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"add_sequence", [&] { (void)pool.add_sequence(); }}, {"fork", [&] { (void)pool.fork(a, 40); }}}) {
    try {
      step();
      ADD_FAILURE() << what << " past the limit was accepted";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded) << what;
      EXPECT_NE(std::string(e.what()).find("own rows (sinks, window ring, rollback copies, scratch) take " +
                                           std::to_string(own) + " blocks"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(pool.sequence_count(), 3u) << what;
    EXPECT_EQ(pool.memory().used, used) << what;
    EXPECT_EQ(pool.blocks().counts().charged, 3 * own) << what;
  }
  // A saved pool of three sequences loads where its blocks and own rows fit, and only there.
  const std::string three = saved_pool(pool);
  KVPool short_of_one(small_pool(3 * own + 1), config);
  expect_load_refused(
      short_of_one, [&] { load_pool(short_of_one, three); }, kvq::ErrorCode::capacity_exceeded,
      "holds 2 blocks and 3 sequences whose own rows take " + std::to_string(3 * own));
  EXPECT_EQ(short_of_one.blocks().counts().charged, 0u);
  // load_sequence reads one sequence: a file of three is refused for its count, whatever the room.
  expect_load_refused(
      short_of_one,
      [&] {
        std::istringstream in(three, std::ios::binary);
        (void)short_of_one.load_sequence(in);
      },
      kvq::ErrorCode::invalid_argument, "holds 3 sequences; load_sequence reads one");
  KVPool exact(small_pool(3 * own + 2), config);
  load_pool(exact, three);
  EXPECT_EQ(exact.blocks().counts().charged, 3 * own);
  EXPECT_EQ(exact.blocks().available(), 0u);
  // Removing a sequence gives its share back.
  pool.remove_sequence(c);
  EXPECT_EQ(pool.blocks().counts().charged, 2 * own);
  (void)pool.add_sequence();
  pool.remove_sequence(b);
  EXPECT_EQ(pool.blocks().available(), own);
}

// Blocks freed by long sequences and then charged to many short ones' own rows are given back:
// the pool's memory stays within its budget after the churn.
TEST(KVPool, MemoryStaysWithinTheBudgetWhenFreedBlocksMakeRoomForOwnRows) {
  const CacheConfig config = config_of("k4c32-v2t32-r32-s4-d8");
  PoolShape shape = small_pool();
  shape.block_tokens = 256;  // slabs of 64 blocks
  const std::size_t own = KVPool(shape, config).own_row_blocks();
  shape.memory_blocks = 256;
  KVPool pool(shape, config);
  std::vector<SequenceId> long_ones;
  for (unsigned i = 0; i < 6; ++i) {
    Tokens tokens;
    long_ones.push_back(add_tokens(pool, tokens, 4096, 20 + i));
  }
  const std::size_t committed = pool.blocks().counts().committed;
  ASSERT_GE(committed, 3 * 64u);
  for (const SequenceId id : long_ones) pool.remove_sequence(id);
  EXPECT_EQ(pool.blocks().counts().committed, committed) << "freed blocks stay for reuse";
  std::size_t added = 0;
  try {
    for (;; ++added) (void)pool.add_sequence();
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded) << e.what();
  }
  EXPECT_EQ(added, 256 / own);
  EXPECT_EQ(pool.blocks().counts().committed, 0u) << "every empty slab went back";
  EXPECT_LE(pool.memory().committed, 256 * pool.block_bytes()) << "blocks and own rows exceed the budget";
}

TEST(KVPool, PoolFileForAnotherPoolIsRefused) {
  const CacheConfig config = config_of("k4c32-v2t32-r20-s3");
  KVPool pool(small_pool(), config);
  (void)fill_pool(pool, 200, 3);
  const std::string bytes = saved_pool(pool);
  auto expect_refused = [&](KVPool& target, kvq::ErrorCode code, const std::string& needle) {
    expect_load_refused(
        target, [&] { load_pool(target, bytes); }, code, needle);
  };
  PoolShape shape = small_pool();
  shape.block_tokens = 128;
  KVPool other_blocks(shape, config);
  expect_refused(other_blocks, kvq::ErrorCode::shape_mismatch, "blocks of 64 positions");
  shape = small_pool();
  shape.rope_scaling.type = kvq::RopeScalingType::linear, shape.rope_scaling.factor = 2.0f;
  KVPool scaled(shape, config);
  expect_refused(scaled, kvq::ErrorCode::shape_mismatch, "linear scaling");
  shape = small_pool();
  shape.rope_dims = 32;
  KVPool partial(shape, config);
  expect_refused(partial, kvq::ErrorCode::shape_mismatch, "rotary dims 32");
  KVPool other_config(small_pool(), config_of("k4c32-v2t32-r20-s2"));
  expect_refused(other_config, kvq::ErrorCode::shape_mismatch, "configured 'k4c32-v2t32-r20-s3'");
  const std::size_t blocks = pool.blocks().counts().in_use;
  KVPool small(small_pool(blocks - 1), config);
  expect_refused(small, kvq::ErrorCode::capacity_exceeded, "holds " + std::to_string(blocks) + " blocks");
  EXPECT_EQ(small.blocks().counts().in_use, 0u);
  KVPool busy(small_pool(), config);
  Tokens t;
  (void)add_tokens(busy, t, 50, 4);
  expect_refused(busy, kvq::ErrorCode::invalid_argument, "empty");
  std::ostringstream cache_file(std::ios::binary);
  kvq::save(pool.sequence(0), cache_file);
  KVPool empty(small_pool(), config);
  std::istringstream in(cache_file.str(), std::ios::binary);
  try {
    empty.load(in);
    ADD_FAILURE() << "a cache file loaded as a pool";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::io) << e.what();
    EXPECT_NE(std::string(e.what()).find("wrong magic"), std::string::npos) << e.what();
  }
  EXPECT_EQ(empty.sequence_count(), 0u);
}

// A pool of scaled, partial RoPE keeps it through the file.
TEST(KVPool, PoolFileKeepsScaledRope) {
  PoolShape shape = small_pool();
  shape.rope_dims = 32, shape.rope_scaling.type = kvq::RopeScalingType::yarn;
  shape.rope_scaling.factor = 4.0f, shape.rope_scaling.original_context = 512;
  const CacheConfig config = config_of("k4c32-v2t32-r20-s3");
  KVPool pool(shape, config);
  const PoolModel model = fill_pool(pool, 150, 8);
  KVPool copy(shape, config);
  load_pool(copy, saved_pool(pool));
  for (const auto& [id, tokens] : model) {
    kvq::test::expect_same_state(copy.sequence(id), pool.sequence(id), "sequence " + std::to_string(id));
    EXPECT_EQ(decode_outputs(copy.sequence(id)), decode_outputs(pool.sequence(id)));
  }
}

// Damage anywhere (every truncation, a flipped bit in every byte, random mutations): a named io
// error, or for the rare mutation that leaves a sound file a load, and after a failed load an
// empty pool with every block returned.
// A block or a sequence's own rows holding what no cache writes, under right CRCs: the pool
// refuses the file by name and takes nothing (the same checks as a cache file's layers).
TEST(KVPool, ForgedPoolContentsWithValidCrcsAreRefused) {
  PoolShape shape = small_pool(64);
  shape.kv_heads = 1, shape.head_dim = 16, shape.max_tokens = 256;
  const CacheConfig config = config_of("k4c8o1-v2t8-r4-s1-d6");
  KVPool pool(shape, config);
  Tokens base;
  const SequenceId a = add_tokens(pool, base, 70, 9);
  (void)pool.fork(a, 66);
  const std::string file = saved_pool(pool);
  // The error names the first sequence's first layer and where its own section starts (the
  // forged block is its first).
  std::string own_section;
  for (const auto& [start, size] : kvq::test::file_sections(file))
    if (own_section.empty() && kvq::test::section_tag(file, start) == 0x524E574F)
      own_section = "section 'sequence " + std::to_string(a) + " layer 0' at offset " + std::to_string(start) + ":";
  ASSERT_FALSE(own_section.empty());
  struct Forgery {
    std::uint32_t tag;  // the first section of this tag is forged
    std::uint8_t fill;  // every byte of its payload
    const char* needle;
  };
  const Forgery forgeries[] = {{0x4B4F4C42, 0xFF, "NaN or infinite"},  // "BLOK": codes, then NaN scales
                               {0x524E574F, 0x7F, "NaN or infinite"},  // "OWNR": NaN rows
                               {0x4B4F4C42, 0x3C, "outlier slot"}};    // slots of 0x3C3C, scales of 1.06
  for (const Forgery& f : forgeries) {
    std::string bytes = file;
    bool forged = false;
    for (const auto& [start, size] : kvq::test::file_sections(bytes))
      if (!forged && kvq::test::section_tag(bytes, start) == f.tag) {
        std::memset(bytes.data() + start + 12, f.fill, size);
        kvq::test::reseal(bytes, start, size);
        forged = true;
      }
    ASSERT_TRUE(forged) << f.needle;
    KVPool target(shape, config);
    try {
      load_pool(target, bytes);
      ADD_FAILURE() << f.needle << ": no error";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::io) << e.what();
      EXPECT_NE(std::string(e.what()).find(f.needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("kvq pool file, " + own_section), std::string::npos) << e.what();
    }
    EXPECT_EQ(target.sequence_count(), 0u) << f.needle;
    EXPECT_EQ(target.blocks().counts().in_use, 0u) << f.needle;
  }
  KVPool target(shape, config);
  load_pool(target, file);  // the file as saved loads
  EXPECT_EQ(target.sequence_count(), 2u);
}

// A forged table (valid CRCs) that lists one block twice in a sequence, its block count and block
// sections made to match: refused by name (it loaded, one sequence reading the same bytes at two
// places). Table: 5 u64s, then per sequence its id and per layer a 60-byte state, a block count
// and the block indices.
TEST(KVPool, ForgedTableListingABlockTwiceIsRefused) {
  const CacheConfig config = config_of("k4c32-v2t32-r16-s1");
  KVPool pool(small_pool(), config);
  Tokens tokens;
  (void)add_tokens(pool, tokens, 200, 31);
  const std::string file = saved_pool(pool);
  std::string forged = file.substr(0, 16);
  int block_section = 0;
  for (const auto& [start, size] : kvq::test::file_sections(file)) {
    std::string section = file.substr(start, 12 + size + 4);
    const std::uint32_t tag = kvq::test::section_tag(file, start);
    if (tag == 0x4C424154) {  // "TABL": layer 0 lists [0, 0, 1, ...], the others one less, block 1 gone
      std::uint64_t blocks;
      std::memcpy(&blocks, section.data() + 12 + 32, 8);
      --blocks;
      std::memcpy(section.data() + 12 + 32, &blocks, 8);
      std::size_t at = 12 + 40 + 8;
      for (int l = 0; l < 2; ++l) {
        at += 60;
        std::uint64_t n;
        std::memcpy(&n, section.data() + at, 8);
        at += 8;
        ASSERT_GE(n, 2u);
        for (std::uint64_t i = 0; i < n; ++i, at += 8) {
          std::uint64_t b;
          std::memcpy(&b, section.data() + at, 8);
          b = l == 0 && i == 1 ? 0 : b >= 2 ? b - 1 : b;
          std::memcpy(section.data() + at, &b, 8);
        }
      }
      kvq::test::reseal(section, 0, size);
    }
    if (tag == 0x4B4F4C42 && block_section++ == 1) continue;  // "BLOK" 1 dropped
    forged += section;
  }
  KVPool target(small_pool(), config);
  try {
    load_pool(target, forged);
    ADD_FAILURE() << "loaded";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::io) << e.what();
    EXPECT_NE(std::string(e.what()).find("layer 0: block 0 appears twice in the sequence"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(target.sequence_count(), 0u);
  EXPECT_EQ(target.blocks().counts().in_use, 0u);
  load_pool(target, file);
  EXPECT_EQ(target.sequence_count(), 1u);
}

// A pool file's key peaks are held to the keys its blocks store (a forged peak of 0 under valid
// CRCs bounded nothing, and attention's overflow check passed queries whose scores overflowed).
TEST(KVPool, ForgedKeyPeaksAreRaisedToWhatTheBlocksHold) {
  const CacheConfig config = config_of("k4c32-v2t32-r16-s1");
  KVPool pool(small_pool(), config);
  Tokens tokens;
  const SequenceId id = add_tokens(pool, tokens, 200, 33);
  const std::string file = saved_pool(pool);
  std::string forged = file;
  for (const auto& [start, size] : kvq::test::file_sections(file))
    if (kvq::test::section_tag(file, start) == 0x4C424154) {  // "TABL": each layer's key peak set to 0
      std::size_t at = start + 12 + 40 + 8;
      for (std::size_t l = 0; l < pool.sequence(id).shape().layers; ++l) {
        std::memset(forged.data() + at + 56, 0, 4);
        std::uint64_t n;
        std::memcpy(&n, forged.data() + at + 60, 8);
        at += 60 + 8 + 8 * n;
      }
      kvq::test::reseal(forged, start, size);
    }
  ASSERT_NE(forged, file);
  KVPool target(small_pool(), config);
  load_pool(target, forged);
  for (std::size_t l = 0; l < pool.sequence(id).shape().layers; ++l) {
    const float peak = pool.sequence(id).key_peak(l), raised = target.sequence(id).key_peak(l);
    EXPECT_GT(peak, 0.0f) << "layer " << l;
    EXPECT_GE(raised, 0.99f * peak) << "layer " << l;
    EXPECT_LE(raised, 1.01f * peak) << "layer " << l;
  }
}

// Ids grow and are never handed out twice: a load does not move the next id back (ids removed
// before it stay unused), and a forged next id of 2^64 - 1 leaves add_sequence refused rather than
// wrapping to 0, an id the file holds (the new sequence was dropped and 0 returned).
TEST(KVPool, SequenceIdsAreNeverHandedOutTwice) {
  const CacheConfig config = config_of("k4c32-v2t32-r16-s1");
  KVPool source(small_pool(), config);
  Tokens tokens;
  const SequenceId a = add_tokens(source, tokens, 100, 32);
  ASSERT_EQ(a, 0u);
  const std::string file = saved_pool(source);  // next id 1
  KVPool pool(small_pool(), config);
  for (int i = 0; i < 4; ++i) pool.remove_sequence(pool.add_sequence());
  load_pool(pool, file);
  EXPECT_EQ(pool.add_sequence(), 4u);

  std::string forged = file;
  bool found = false;
  for (const auto& [start, size] : kvq::test::file_sections(forged))
    if (kvq::test::section_tag(forged, start) == 0x4C424154) {  // the table's third u64: the next id
      const std::uint64_t last = ~std::uint64_t(0);
      std::memcpy(forged.data() + start + 12 + 16, &last, 8);
      kvq::test::reseal(forged, start, size);
      found = true;
    }
  ASSERT_TRUE(found);
  KVPool target(small_pool(), config);
  load_pool(target, forged);
  try {
    (void)target.add_sequence();
    ADD_FAILURE() << "an id was handed out";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded) << e.what();
    EXPECT_NE(std::string(e.what()).find("sequence ids are used up"), std::string::npos) << e.what();
  }
  EXPECT_EQ(target.sequence_count(), 1u);
  EXPECT_EQ(target.length(0, 0), 100u);
}

TEST(KVPool, DamagedPoolFileThrowsIoAndChangesNothing) {
  PoolShape shape = small_pool(64);
  shape.kv_heads = 1, shape.head_dim = 16, shape.max_tokens = 256;
  const CacheConfig config = config_of("k4c8-v2t8-r4-s1-d6");
  KVPool pool(shape, config);
  Tokens base;
  const SequenceId a = add_tokens(pool, base, 70, 9);
  (void)pool.fork(a, 70);
  (void)pool.fork(a, 66);
  const std::string file = saved_pool(pool);
  ASSERT_GT(file.size(), 1000u);
  KVPool target(shape, config);
  auto expect_io = [&](const std::string& bytes, const std::string& what) {
    try {
      load_pool(target, bytes);
      ADD_FAILURE() << what << ": no error";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::io) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("kvq pool file, section '"), std::string::npos) << what << ": " << e.what();
    }
    EXPECT_EQ(target.sequence_count(), 0u) << what;
    EXPECT_EQ(target.blocks().counts().in_use, 0u) << what;
  };
  for (std::size_t n = 0; n < file.size(); ++n) {
    expect_io(file.substr(0, n), "truncated to " + std::to_string(n));
    if (HasFailure()) return;
  }
  expect_io(file + "x", "one byte appended");
  std::mt19937 rng(31);
  for (std::size_t i = 0; i < file.size(); ++i) {
    std::string bytes = file;
    bytes[i] = char(bytes[i] ^ (1 << (rng() % 8)));
    expect_io(bytes, "a bit of byte " + std::to_string(i));
    if (HasFailure()) return;
  }
  std::size_t loaded = 0;
  for (int iteration = 0; iteration < 3000; ++iteration) {
    std::string bytes = file;
    for (int m = 1 + int(rng() % 3); m > 0; --m) {
      const std::size_t at = rng() % bytes.size();
      switch (rng() % 3) {
        case 0:
          bytes[at] = char(rng());
          break;
        case 1:
          bytes.insert(bytes.begin() + std::ptrdiff_t(at), char(rng()));
          break;
        default:
          bytes.erase(at, 1 + rng() % 16);
          break;
      }
    }
    try {
      load_pool(target, bytes);
      ++loaded;
      for (const SequenceId id : {SequenceId(0), SequenceId(1), SequenceId(2)})
        if (target.contains(id)) target.remove_sequence(id);
    } catch (const kvq::Error&) {
    }
    ASSERT_EQ(target.sequence_count(), 0u) << "iteration " << iteration;
    ASSERT_EQ(target.blocks().counts().in_use, 0u) << "iteration " << iteration;
  }
  EXPECT_LT(loaded, 30u);
  load_pool(target, file);  // and the sound file still loads
  for (const SequenceId id : {SequenceId(0), SequenceId(1), SequenceId(2)})
    kvq::test::expect_same_state(target.sequence(id), pool.sequence(id), "sequence " + std::to_string(id));
}

/// Appends tokens [from, to) of `tokens` to every layer of sequence `id` in chunks of `chunk`.
void feed(KVPool& pool, SequenceId id, const Tokens& tokens, std::size_t from, std::size_t to, std::size_t chunk) {
  const std::size_t row = row_of(pool.shape().sequence_shape());
  for (std::size_t a = from; a < to; a += chunk) {
    const std::size_t b = std::min(to, a + chunk);
    for (std::size_t l = 0; l < pool.shape().layers; ++l)
      pool.append(id, l, a, tokens.k(a, b, row), tokens.v(a, b, row));
  }
}

// Two requests with the same prompt, fed in different chunk sizes and never forked, come to share
// the prompt's sealed blocks; a third whose prompt parts at position 300 shares the blocks before
// it. Nobody's bytes or attention change, and removing either sharer leaves the other whole.
TEST(KVPool, SharePrefixesFindsACommonPromptFedInOtherChunks) {
  for (const char* text : {"k4c32-v2t32-r20-s3", "k2c16-v4t32-r8-s0-post", "k16-v16-r0-s1-f32"}) {
    SCOPED_TRACE(text);
    const CacheConfig config = config_of(text);
    KVPool pool(small_pool(), config);
    const CacheShape shape = pool.shape().sequence_shape();
    const std::size_t row = row_of(shape), n = 700, parted = 300, s = config.sinks;
    Tokens prompt, other;
    std::mt19937 rng(41);
    prompt.add(n, row, rng);
    other = prompt;
    other.cut(parted, row);
    other.add(n - parted, row, rng);
    const SequenceId a = pool.add_sequence(), b = pool.add_sequence(), c = pool.add_sequence();
    feed(pool, a, prompt, 0, n, n);
    feed(pool, b, prompt, 0, n, 37);
    feed(pool, c, other, 0, n, 128);
    const std::size_t sealed = kvq::detail::CacheAccess::sealed_blocks(pool.sequence(a), 0);
    ASSERT_GE(sealed, 8u);
    const std::size_t before_parting = (parted - s) / 64;  // blocks wholly before position 300
    for (std::size_t l = 0; l < 2; ++l) {
      const auto ha = pool.block_hashes(a, l), hb = pool.block_hashes(b, l), hc = pool.block_hashes(c, l);
      EXPECT_EQ(ha, hb) << "layer " << l;
      ASSERT_EQ(ha.size(), sealed);
      for (std::size_t k = 0; k < sealed; ++k) EXPECT_EQ(ha[k] == hc[k], k < before_parting) << "block " << k;
      if (l == 1) {
        EXPECT_NE(ha, pool.block_hashes(a, 0)) << "layers hash apart";
      }
    }
    std::map<SequenceId, std::vector<std::uint8_t>> bytes;
    std::map<SequenceId, std::vector<float>> outputs;
    for (const SequenceId id : {a, b, c}) {
      bytes[id] = pool.sequence(id).stored_bytes();
      outputs[id] = decode_outputs(pool.sequence(id));
    }
    const kvq::PoolMemory before = pool.memory();
    EXPECT_EQ(before.shared, 0u);
    const std::size_t freed = pool.share_prefixes(b);
    EXPECT_EQ(freed, 2 * sealed * pool.block_bytes()) << "every sealed block of both layers";
    EXPECT_EQ(pool.memory().used, before.used - freed);
    EXPECT_EQ(pool.memory().shared, 2 * sealed * pool.block_bytes());
    const std::size_t freed_c = pool.share_prefixes(c);
    EXPECT_EQ(freed_c, 2 * before_parting * pool.block_bytes());
    EXPECT_EQ(pool.share_prefixes(b), 0u) << "nothing left to share";
    for (const SequenceId id : {a, b, c}) {
      EXPECT_TRUE(pool.sequence(id).stored_bytes() == bytes[id]) << "sequence " << id;
      EXPECT_EQ(decode_outputs(pool.sequence(id)), outputs[id]) << "sequence " << id;
    }
    // Removing a sharer leaves the others whole; writing to one leaves the rest alone.
    pool.remove_sequence(a);
    EXPECT_TRUE(pool.sequence(b).stored_bytes() == bytes[b]);
    EXPECT_TRUE(pool.sequence(c).stored_bytes() == bytes[c]);
    Tokens longer = prompt;
    longer.add(150, row, rng);
    feed(pool, b, longer, n, n + 150, 50);
    kvq::test::expect_same_state(pool.sequence(b), fresh_cache(shape, config, longer), "the sharer goes on");
    EXPECT_TRUE(pool.sequence(c).stored_bytes() == bytes[c]);
    pool.truncate(c, n - 5);  // rollback of a sequence holding shared blocks
    other.cut(n - 5, row);
    EXPECT_TRUE(pool.sequence(c).stored_bytes() == fresh_cache(shape, config, other).stored_bytes());
    pool.remove_sequence(b);
    pool.remove_sequence(c);
    EXPECT_EQ(pool.blocks().counts().in_use, 0u);
    EXPECT_THROW((void)pool.block_hashes(a, 0), kvq::Error);
    EXPECT_THROW((void)pool.share_prefixes(a), kvq::Error);
  }
}

// Cascade attention over a pool: children forked from one parent, each going on with tokens of
// its own, store the blocks the parent had sealed alike (common_prefix); a request of stored
// positions only over one child, cut at the common prefix (seen_end), attends every child's query
// at its own position, and each child's own request from there (seen_begin) merged with it gives
// its decode step. So again after a child rolls back into the shared blocks and takes other
// tokens, after a context shift in another, and for a sibling that changed only its window's
// rows. Sequences fed the same tokens apart share only their sinks until share_prefixes shares
// their blocks.
TEST(KVPool, CascadeReadsTheCommonPrefixOnceForItsSequences) {
  // (a rollback depth of 64: child 0 rolls back past the fork)
  for (const char* text :
       {"k4c32-v2t32-r20-s3-d64", "k2c16-v4t32-r8-s0-post-d64", "k16-v16-r0-s1-f32-d64", "k2c16-v4c16-r8-s0-d64"}) {
    SCOPED_TRACE(text);
    const CacheConfig config = config_of(text);
    KVPool pool(small_pool(), config);
    const CacheShape shape = pool.shape().sequence_shape();
    const std::size_t row = row_of(shape), dim = shape.head_dim, heads = 2 * shape.kv_heads, s = config.sinks;
    Tokens parent_tokens;
    const SequenceId parent = add_tokens(pool, parent_tokens, 700, 71);
    const std::size_t sealed = kvq::detail::CacheAccess::sealed_blocks(pool.sequence(parent), 0);
    ASSERT_GE(sealed, 8u);
    std::vector<SequenceId> children;
    std::vector<Tokens> tokens;
    std::mt19937 rng(72);
    for (const std::size_t more : {17u, 90u, 200u}) {
      children.push_back(pool.fork(parent, 700));
      tokens.push_back(parent_tokens);
      tokens.back().add(more, row, rng);
      feed(pool, children.back(), tokens.back(), 700, 700 + more, more);
    }
    // The common prefix of layer l: every child reads it alike, and the cascade over it gives each
    // child's decode step.
    auto cascade = [&](const std::vector<SequenceId>& ids, std::size_t l, const std::string& when) {
      const std::size_t n = pool.common_prefix(ids, l);
      std::vector<float> a(dim), b(dim);
      for (const SequenceId id : ids)
        for (std::size_t p = 0; p < n; ++p)
          for (std::size_t h = 0; h < shape.kv_heads; ++h)
            for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values}) {
              pool.sequence(ids[0]).read_row(t, l, h, p, a.data());
              pool.sequence(id).read_row(t, l, h, p, b.data());
              if (a != b) {
                ADD_FAILURE() << when << ", layer " << l << ": position " << p << " of " << n << " differs";
                return n;
              }
            }
      const auto q = kvq::test::normal_vector(ids.size() * heads * dim, 73 + unsigned(l), 0.4f);
      std::vector<std::size_t> positions;
      for (const SequenceId id : ids) positions.push_back(pool.length(id, l) - 1);
      for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer}) {
        const kvq::DecodeOptions options{.tier = tier, .chunk_tokens = 96};
        std::vector<float> shared(q.size()), shared_lse(ids.size() * heads);
        kvq::attend({.cache = &pool.layer(ids[0], l).cache,
                     .layer = pool.layer(ids[0], l).layer,
                     .first_position = *std::min_element(positions.begin(), positions.end()),
                     .tokens = ids.size(),
                     .queries = q,
                     .out = shared,
                     .lse = shared_lse,
                     .stored_only = true,
                     .positions = positions,
                     .seen_end = n},
                    options);
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const auto qi = std::span(q).subspan(i * heads * dim, heads * dim);
          std::vector<float> own(qi.size()), own_lse(heads), step(qi.size());
          kvq::attend({.cache = &pool.sequence(ids[i]),
                       .layer = l,
                       .first_position = positions[i],
                       .queries = qi,
                       .out = own,
                       .lse = own_lse,
                       .seen_begin = n},
                      options);
          kvq::merge_attention(own, own_lse, std::span(shared).subspan(i * heads * dim, heads * dim),
                               std::span(shared_lse).subspan(i * heads, heads));
          kvq::decode_attention(pool.sequence(ids[i]), l, positions[i], qi, step, options);
          // Largest seen: 2.4e-7 exact, 2.5e-7 integer (the cut falls between whole blocks;
          // test_merge.cpp cuts anywhere).
          EXPECT_LT(kvq::test::relative_error(own, step), 1e-5)
              << when << ", layer " << l << ", child " << i << ", " << kvq::to_string(tier);
        }
      }
      return n;
    };
    for (std::size_t l = 0; l < 2; ++l) {
      const std::size_t n = cascade(children, l, "forked");
      EXPECT_GE(n, s + sealed * 64) << "layer " << l << ": the blocks sealed before the fork";
      EXPECT_LT(n, 700u) << "layer " << l;
    }
    // Child 0 rolls back as far as it can (to its rollback floor, with the window it re-opens),
    // into what it packed while sharing, then goes on with other tokens; child 2 drops 32
    // positions from sinks + 96 (a context shift of whole key groups, keys before RoPE).
    std::size_t target = 600;
    for (std::size_t l = 0; l < 2; ++l)
      for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values})
        target = std::max(target, pool.sequence(children[0]).rollback_floor(t, l));
    auto rolls_back_to = [&](std::size_t length) {
      try {
        pool.truncate(children[0], length);
        return true;
      } catch (const kvq::Error&) {  // it would re-open positions before the floor
        return false;
      }
    };
    while (!rolls_back_to(target)) ASSERT_LT(++target, 700u) << "no rollback into the shared blocks";
    tokens[0].cut(target, row);
    tokens[0].add(720 - target, row, rng);
    feed(pool, children[0], tokens[0], target, 720, 720 - target);
    for (std::size_t l = 0; l < 2; ++l) EXPECT_LE(cascade(children, l, "rolled back"), target) << "layer " << l;
    if (config.key_rope == kvq::KeyRope::pre) {  // (post-RoPE keys cannot shift)
      pool.erase(children[2], s + 96, 32);
      for (std::size_t l = 0; l < 2; ++l) EXPECT_LE(cascade(children, l, "shifted"), s + 96) << "layer " << l;
    }
    // A sibling that rolls back 3 tokens and takes others (re-opening nothing packed where values
    // are per channel): the positions it changed are not common.
    const SequenceId sibling = pool.fork(parent, 700);
    Tokens sibling_tokens = parent_tokens;
    sibling_tokens.cut(697, row);
    sibling_tokens.add(3, row, rng);
    pool.truncate(sibling, 697);
    feed(pool, sibling, sibling_tokens, 697, 700, 3);
    for (std::size_t l = 0; l < 2; ++l) EXPECT_LE(cascade({parent, sibling}, l, "sibling"), 697u) << "layer " << l;
    EXPECT_EQ(pool.common_prefix(std::vector<SequenceId>{parent}, 0), 700u) << "one sequence: all it holds";
    // The same tokens fed apart: equal sinks, blocks of their own, until share_prefixes.
    Tokens again;
    const SequenceId twin = add_tokens(pool, again, 700, 71);
    const std::vector<SequenceId> pair = {parent, twin};
    EXPECT_EQ(pool.common_prefix(pair, 0), s);
    EXPECT_GT(pool.share_prefixes(twin), 0u);
    EXPECT_GE(pool.common_prefix(pair, 0), s + sealed * 64);
    EXPECT_THROW((void)pool.common_prefix(std::vector<SequenceId>{parent, 999}, 0), kvq::Error);
    EXPECT_THROW((void)pool.common_prefix(pair, 2), kvq::Error);
  }
  // Caches that store rows differently have no common prefix to ask for.
  const CacheShape shape = small_pool().sequence_shape();
  const BasicKVCache a(shape, config_of("k4c32-v2t32-r20-s3")), b(shape, config_of("k4c32-v2t32-r20-s3-post"));
  try {
    (void)a.common_prefix(b, 0);
    ADD_FAILURE() << "caches of two configurations were compared";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::shape_mismatch) << e.what();
  }
}

// A decode step of many pool sequences in one call: two families of forks (one with its parent,
// a fork taken 40 positions back and a sequence named twice, once at a position inside the prefix
// they share), a sequence of its own and a family too short to share a block, in mixed order,
// one query behind its sequence's end. Each family reads the positions its sequences store alike
// once, up to its smallest position, and every output is that sequence's decode_attention, with
// a window and sink logits, or attention chunks, on 2 threads as on one; a sequence in no group
// gets decode_attention's bits. Bad calls change nothing. A fork's huge key of its own does not
// refuse the queries of its family (the shared part reads the cache of least key peak).
TEST(KVPool, DecodeStepOfManySequencesReadsEachFamilysPrefixOnce) {
  for (const char* text : {"k4c32-v2t32-r20-s3-d64", "k2c16-v4t32-r8-s0-post-d64", "k16-v16-r0-s1-f32-d64"}) {
    SCOPED_TRACE(text);
    const CacheConfig config = config_of(text);
    KVPool pool(small_pool(), config);
    const CacheShape shape = pool.shape().sequence_shape();
    const std::size_t row = row_of(shape), dim = shape.head_dim, heads = 2 * shape.kv_heads;
    Tokens a_tokens, b_tokens, c_tokens, d_tokens;
    const SequenceId a = add_tokens(pool, a_tokens, 700, 81), b = add_tokens(pool, b_tokens, 500, 82);
    const SequenceId alone = add_tokens(pool, c_tokens, 300, 83), short_one = add_tokens(pool, d_tokens, 40, 86);
    std::mt19937 rng(84);
    std::vector<SequenceId> forks;
    for (const auto& [parent, parent_tokens, length, more] :
         {std::tuple{a, &a_tokens, 700u, 17u}, std::tuple{a, &a_tokens, 700u, 200u}, std::tuple{a, &a_tokens, 660u, 9u},
          std::tuple{b, &b_tokens, 500u, 130u}, std::tuple{b, &b_tokens, 500u, 5u},
          std::tuple{short_one, &d_tokens, 40u, 5u}}) {
      forks.push_back(pool.fork(parent, length));
      Tokens own = *parent_tokens;
      own.cut(length, row);
      own.add(more, row, rng);
      feed(pool, forks.back(), own, length, length + more, more);
    }
    const std::vector<SequenceId> ids = {forks[0], forks[3], alone,    a,         forks[4],
                                         forks[1], forks[2], forks[5], short_one, forks[0]};
    std::vector<std::size_t> positions;
    for (const SequenceId id : ids) positions.push_back(pool.length(id, 0) - 1);
    positions[5] -= 4;   // behind its sequence's end
    positions[9] = 200;  // inside the prefix its family shares
    const auto q = kvq::test::normal_vector(ids.size() * heads * dim, 85, 0.4f);
    const std::vector<float> sink_logits = {0.5f, -1.0f, 2.0f, 0.0f};
    kvq::ThreadPool threads(2);
    for (const kvq::ScoreOptions& scores :
         {kvq::ScoreOptions{}, kvq::ScoreOptions{.window = 150, .sink_logits = sink_logits},
          kvq::ScoreOptions{.attention_chunk = 256}})
      for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer})
        for (std::size_t l = 0; l < 2; ++l) {
          const std::string where = std::string(kvq::to_string(tier)) + (scores.window ? ", window" : "") +
                                    (scores.attention_chunk ? ", chunks" : "") + ", layer " + std::to_string(l);
          const kvq::DecodeOptions options{.tier = tier, .chunk_tokens = 96, .scores = scores};
          std::vector<float> out(q.size()), threaded(q.size()), step(heads * dim);
          const kvq::PoolDecodeSummary summary = kvq::decode_attention(pool, ids, l, positions, q, out, options);
          kvq::DecodeOptions on_threads = options;
          on_threads.executor = &threads;
          (void)kvq::decode_attention(pool, ids, l, positions, q, threaded, on_threads);
          EXPECT_TRUE(out == threaded) << where;
          // Family a (its parent, three forks, one named twice) and family b (two forks).
          const std::vector<SequenceId> family_a = {a, forks[0], forks[1], forks[2]}, family_b = {forks[3], forks[4]};
          EXPECT_EQ(summary.groups, 2u) << where;
          EXPECT_EQ(summary.sequences, 7u) << where;
          EXPECT_EQ(summary.shared_positions,
                    std::min<std::size_t>(pool.common_prefix(family_a, l), 200) + pool.common_prefix(family_b, l))
              << where;
          EXPECT_GT(pool.common_prefix(family_a, l), 200u) << where;
          for (std::size_t i = 0; i < ids.size(); ++i) {
            const auto qi = std::span(q).subspan(i * heads * dim, heads * dim);
            const auto oi = std::span(out).subspan(i * heads * dim, heads * dim);
            kvq::decode_attention(pool.sequence(ids[i]), l, positions[i], qi, step, options);
            if (ids[i] == alone || ids[i] == short_one || ids[i] == forks[5]) {
              EXPECT_TRUE(std::equal(oi.begin(), oi.end(), step.begin())) << where;
            } else {
              // Largest seen: 2.3e-6 exact; 4.9e-3 integer, whose int8 weights round per part, and
              // where positions only some of a family's queries see (a window's edge, attention
              // chunks) run exact, scalar (test_merge.cpp's bound for that tier).
              const double e = kvq::test::relative_error(std::vector<float>(oi.begin(), oi.end()), step);
              EXPECT_LT(e, tier == kvq::Tier::exact ? 1e-5 : 1e-2) << where << ", sequence " << i;
            }
          }
        }
    // Bad calls: nothing written, the culprit named by its index in ids.
    std::vector<float> out(q.size(), 7.0f), bad_q = q;
    bad_q[3 * heads * dim + 5] = std::nanf("");
    auto refused = [&](const std::function<void()>& call, const char* expected) {
      try {
        call();
        ADD_FAILURE() << "accepted: " << expected;
      } catch (const kvq::Error& e) {
        EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      }
      EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; })) << expected;
    };
    for (const kvq::ScoreOptions& scores : {kvq::ScoreOptions{}, kvq::ScoreOptions{.sink_logits = sink_logits}}) {
      const kvq::DecodeOptions options{.scores = scores};
      refused([&] { (void)kvq::decode_attention(pool, ids, 0, positions, bad_q, out, options); }, "request 3");
      std::vector<std::size_t> beyond = positions;
      beyond[6] = pool.length(ids[6], 0);
      refused([&] { (void)kvq::decode_attention(pool, ids, 0, beyond, q, out, options); }, "request 6");
    }
    refused([&] { (void)kvq::decode_attention(pool, ids, 0, std::span(positions).first(3), q, out); }, "3 positions");
    refused([&] { (void)kvq::decode_attention(pool, ids, 0, positions, std::span(q).first(dim), out); }, "queries of");
    std::vector<SequenceId> unknown = ids;
    unknown[2] = 999;
    refused([&] { (void)kvq::decode_attention(pool, unknown, 0, positions, q, out); }, "999");
    refused([&] { (void)kvq::decode_attention(pool, ids, 2, positions, q, out); }, "layer 2");
    refused([&] { (void)kvq::decode_attention(pool, {}, 2, {}, {}, {}); }, "layer 2");
    EXPECT_EQ(kvq::decode_attention(pool, {}, 0, {}, {}, {}).groups, 0u);
  }
  KVPool pool(small_pool(), config_of("k16-v16-r0-s0-post-f32"));
  const std::size_t row = row_of(pool.shape().sequence_shape()), dim = 64, heads = 4;
  Tokens parent_tokens;
  const SequenceId parent = add_tokens(pool, parent_tokens, 300, 91);
  const SequenceId big = pool.fork(parent, 300), small = pool.fork(parent, 300);
  std::mt19937 rng(92);
  for (const SequenceId id : {big, small}) {
    Tokens own = parent_tokens;
    own.add(10, row, rng);
    if (id == big) own.keys[305 * row + 5] = 1e38f;
    feed(pool, id, own, 300, 310, 10);
  }
  // Against big's key peak, small's query (|q|_1 ~ 20 a head) would give scores beyond float.
  const std::vector<SequenceId> ids = {big, small};
  const std::vector<std::size_t> positions = {309, 309};
  auto q = kvq::test::normal_vector(2 * heads * dim, 93, 0.4f);
  for (std::size_t c = 0; c < heads * dim; ++c) q[c] *= 1e-3f;  // big's own query
  std::vector<float> out(q.size()), step(heads * dim);
  EXPECT_EQ(kvq::decode_attention(pool, ids, 0, positions, q, out).groups, 1u);
  for (std::size_t i = 0; i < 2; ++i) {
    kvq::decode_attention(pool.sequence(ids[i]), 0, 309, std::span(q).subspan(i * heads * dim, heads * dim), step);
    const auto oi = std::span(out).subspan(i * heads * dim, heads * dim);
    EXPECT_LT(kvq::test::relative_error(std::vector<float>(oi.begin(), oi.end()), step), 1e-5) << "sequence " << i;
  }
}

// Block hashes are kept between calls and read again only for blocks written since: a sequence
// that rolls back into its sealed blocks and takes other tokens hashes as a fresh sequence fed
// its final tokens, and share_prefixes then shares only what is equal.
TEST(KVPool, BlockHashesFollowRollbacksIntoSealedBlocks) {
  const CacheConfig config = config_of("k4c32-v2t32-r4-s1");
  const PoolShape shape = small_pool();
  KVPool pool(shape, config);
  const std::size_t row = row_of(shape.sequence_shape());
  std::mt19937 rng(43);
  Tokens tokens;
  const SequenceId a = pool.add_sequence();
  std::size_t reopened = 0;
  for (int step = 0; step < 80; ++step) {
    const std::size_t from = tokens.size(row), n = std::uniform_int_distribution<std::size_t>(1, 40)(rng);
    tokens.add(n, row, rng);
    feed(pool, a, tokens, from, from + n, n);
    const std::vector<std::uint64_t> sealed = pool.block_hashes(a, 1);
    const std::size_t back = std::uniform_int_distribution<std::size_t>(1, 16)(rng);
    if (step % 2 == 0 && tokens.size(row) > back) {
      pool.truncate(a, tokens.size(row) - back);
      tokens.cut(tokens.size(row) - back, row);
      reopened += pool.block_hashes(a, 1).size() < sealed.size();
    }
    Tokens fresh_tokens = tokens;
    const SequenceId b = pool.add_sequence();
    feed(pool, b, fresh_tokens, 0, fresh_tokens.size(row), 1000);
    for (std::size_t l = 0; l < 2; ++l) ASSERT_EQ(pool.block_hashes(a, l), pool.block_hashes(b, l)) << "step " << step;
    if (step % 8 == 0) {
      const std::vector<std::uint8_t> before = pool.sequence(a).stored_bytes();
      EXPECT_EQ(pool.share_prefixes(a), 2 * pool.block_hashes(a, 0).size() * pool.block_bytes()) << "step " << step;
      ASSERT_TRUE(pool.sequence(a).stored_bytes() == before) << "step " << step;
    }
    pool.remove_sequence(b);
  }
  EXPECT_GT(reopened, 5u) << "rollbacks re-opened sealed blocks";
  EXPECT_TRUE(pool.sequence(a).stored_bytes() == fresh_cache(shape.sequence_shape(), config, tokens).stored_bytes());
}

// What an engine sees of memory: committed blocks follow the tokens held.
TEST(KVPool, CommittedMemoryFollowsTheLength) {
  PoolShape shape = small_pool();
  shape.layers = 4;
  shape.kv_heads = 8;
  shape.head_dim = 128;
  shape.max_tokens = 32768;
  const CacheConfig config = config_of("k4c32-v2t32-r128-s1");
  KVPool pool(shape, config);
  Tokens tokens;
  const SequenceId s = add_tokens(pool, tokens, 1000, 10);
  const double held = double(pool.sequence(s).memory().total_bytes()), committed = double(pool.memory().committed);
  // Blocks round the packed rows up to 64 positions; the ring holds R + G rows and the rollback
  // copies D + G and D + 1: about 1.2x the bytes the tokens need (a cache of the whole 32K
  // capacity committed up front would be about 24x).
  EXPECT_GT(committed, held);
  EXPECT_LT(committed, 1.3 * held) << "committed " << committed << " for " << held << " bytes held";
}

// Random operations on several sequences against a model that keeps each sequence's tokens:
// after every step, each sequence equals a fresh cache fed its tokens (bytes, rows, attention).
TEST(KVPool, RandomOperationsMatchFreshCaches) {
  for (const char* text : {"k4c32-v2t32-r20-s3", "k2c16-v4t32-r8-s0-post", "k16-v16-r0-s1-f32"}) {
    const CacheConfig config = config_of(text);
    KVPool pool(small_pool(), config);
    const CacheShape shape = pool.shape().sequence_shape();
    const std::size_t row = row_of(shape);
    std::map<SequenceId, Tokens> model;
    std::mt19937 rng(11);
    auto pick = [&] {
      auto it = model.begin();
      std::advance(it, std::uniform_int_distribution<std::size_t>(0, model.size() - 1)(rng));
      return it->first;
    };
    model[pool.add_sequence()] = {};
    for (int step = 0; step < 60; ++step) {
      const int op = std::uniform_int_distribution<int>(0, 9)(rng);
      if (op < 5 || model.size() == 0) {  // append a chunk
        if (model.empty()) model[pool.add_sequence()] = {};
        const SequenceId id = pick();
        Tokens& t = model[id];
        const std::size_t from = t.size(row), n = std::uniform_int_distribution<std::size_t>(1, 90)(rng);
        if (from + n > shape.capacity) continue;
        t.add(n, row, rng);
        for (std::size_t l = 0; l < shape.layers; ++l)
          pool.append(id, l, from, t.k(from, from + n, row), t.v(from, from + n, row));
      } else if (op < 7) {  // fork within the rollback depth
        const SequenceId id = pick();
        const std::size_t n = model[id].size(row), back = std::uniform_int_distribution<std::size_t>(0, 16)(rng);
        const std::size_t length = n > back ? n - back : 0;
        try {
          const SequenceId child = pool.fork(id, length);
          Tokens t = model[id];
          t.cut(length, row);
          model[child] = t;
        } catch (const kvq::Error& e) {  // past what earlier rollbacks left: refused, nothing changed
          ASSERT_EQ(e.code(), kvq::ErrorCode::unsupported) << e.what();
        }
      } else if (op < 9) {  // roll back speculative tokens
        const SequenceId id = pick();
        const std::size_t n = model[id].size(row), back = std::uniform_int_distribution<std::size_t>(0, 16)(rng);
        try {
          pool.truncate(id, n > back ? n - back : 0);
          model[id].cut(n > back ? n - back : 0, row);
        } catch (const kvq::Error& e) {
          ASSERT_EQ(e.code(), kvq::ErrorCode::unsupported) << e.what();
        }
      } else if (model.size() > 1) {
        const SequenceId id = pick();
        pool.remove_sequence(id);
        model.erase(id);
      }
      for (const auto& [id, tokens] : model) {
        const BasicKVCache fresh = fresh_cache(shape, config, tokens);
        ASSERT_TRUE(pool.sequence(id).stored_bytes() == fresh.stored_bytes())
            << text << " step " << step << " sequence " << id;
        if (step % 10 == 9) {
          kvq::test::expect_same_state(pool.sequence(id), fresh, std::string(text) + " step " + std::to_string(step));
          EXPECT_EQ(decode_outputs(pool.sequence(id)), decode_outputs(fresh)) << text << " step " << step;
        }
      }
    }
    for (const auto& [id, tokens] : model) pool.remove_sequence(id);
    EXPECT_EQ(pool.blocks().counts().in_use, 0u) << text;
  }
}

// Random operations against mirrors: each pool sequence has a cache of its own (same shape,
// configuration and block length) that receives the same operations, context shifts and files
// included. After every step the two hold the same bytes (and, every few steps, give the same
// attention); an operation the mirror refuses, the pool refuses too and changes nothing.
TEST(KVPool, RandomOperationsMatchMirrorCaches) {
  std::size_t refused = 0, erased = 0;  // over every configuration
  for (const char* text : {"k4c32-v2t32-r20-s3", "k2c16-v4t32-r8-s0-d24", "k16-v16-r0-s1-f32"}) {
    SCOPED_TRACE(text);
    const CacheConfig config = config_of(text);
    auto pool = std::make_unique<KVPool>(small_pool(), config);
    const CacheShape shape = pool->shape().sequence_shape();
    const std::size_t row = row_of(shape);
    std::map<SequenceId, BasicKVCache> mirror;
    mirror.emplace(pool->add_sequence(), BasicKVCache(shape, config));
    std::mt19937 rng(101);
    auto uniform = [&](std::size_t lo, std::size_t hi) {
      return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
    };
    for (int step = 0; step < 120; ++step) {
      const std::string what = std::string(text) + ", step " + std::to_string(step);
      auto it = mirror.begin();
      std::advance(it, std::ptrdiff_t(uniform(0, mirror.size() - 1)));
      const SequenceId id = it->first;
      BasicKVCache& m = it->second;
      const std::size_t length = m.length(0), back = uniform(0, 20);
      // The mirror first: when it refuses, the pool must refuse and keep its bytes.
      auto both = [&](const std::function<void()>& on_mirror, const std::function<void()>& on_pool) -> bool {
        const std::vector<std::uint8_t> before = pool->sequence(id).stored_bytes();
        try {
          on_mirror();
        } catch (const kvq::Error&) {
          ++refused;
          EXPECT_THROW(on_pool(), kvq::Error) << what;
          EXPECT_TRUE(pool->sequence(id).stored_bytes() == before) << what;
          return false;
        }
        on_pool();
        return true;
      };
      const std::size_t op = uniform(0, 11);
      if (op < 5) {  // append a chunk to every layer
        const std::size_t n = uniform(1, 80);
        if (length + n > shape.capacity) continue;
        Tokens t;
        t.add(n, row, rng);
        both(
            [&] {
              for (std::size_t l = 0; l < shape.layers; ++l) m.append(l, length, t.k(0, n, row), t.v(0, n, row));
            },
            [&] {
              for (std::size_t l = 0; l < shape.layers; ++l)
                pool->append(id, l, length, t.k(0, n, row), t.v(0, n, row));
            });
      } else if (op < 7) {  // roll back speculative tokens (past the rollback depth: refused)
        const std::size_t to = length > back ? length - back : 0;
        both([&] { m.truncate(to); }, [&] { pool->truncate(id, to); });
      } else if (op < 8) {  // context shift (ranges that cut packed groups: refused)
        const std::size_t first = uniform(0, length), count = uniform(1, 70);
        erased += both([&] { m.erase(first, count); }, [&] { pool->erase(id, first, count); });
      } else if (op < 9) {  // fork at an older length
        const std::size_t at = length > back ? length - back : 0;
        std::optional<BasicKVCache> child;
        both([&] { child.emplace(m, at); }, [&] { mirror.emplace(pool->fork(id, at), std::move(*child)); });
      } else if (op < 10) {  // a session file: the sequence alone, back under a new id
        std::stringstream file;
        pool->save_sequence(id, file);
        mirror.emplace(pool->load_sequence(file), BasicKVCache(m));
      } else if (op < 11) {  // the whole pool through a file, into a new pool
        std::stringstream file;
        pool->save(file);
        auto loaded = std::make_unique<KVPool>(small_pool(), config);
        loaded->load(file);
        pool = std::move(loaded);
      } else if (mirror.size() > 1) {
        pool->remove_sequence(id);
        mirror.erase(id);
      }
      ASSERT_EQ(pool->sequence_count(), mirror.size()) << what;
      for (const auto& [sid, cache] : mirror) {
        ASSERT_TRUE(pool->sequence(sid).stored_bytes() == cache.stored_bytes()) << what << ", sequence " << sid;
        if (step % 15 == 14) {
          EXPECT_EQ(decode_outputs(pool->sequence(sid)), decode_outputs(cache)) << what << ", sequence " << sid;
        }
      }
    }
    for (const auto& [sid, cache] : mirror) pool->remove_sequence(sid);
    EXPECT_EQ(pool->blocks().counts().in_use, 0u);
  }
  EXPECT_GT(refused, 5u) << "some operations were refused";
  EXPECT_GT(erased, 5u) << "some context shifts happened";
}

// A configuration per layer: layers of one configuration share a block store, and every layer
// holds what a cache of its configuration fed the same tokens holds, through forks, appends and
// rollbacks; the operations stay all-or-nothing across the layer groups, and errors name the
// pool's layer.
std::vector<CacheConfig> per_layer_configs() {
  return kvq::parse_layer_configs("k4c32-v2t32-r20-s3;k16-v16-r0-s1-f32;k4c32-v2t32-r20-s3;k2c16-v4t32-r0-s0", 4);
}

PoolShape per_layer_pool(std::size_t blocks = 4096) {
  PoolShape p = small_pool(blocks);
  p.layers = 4;
  return p;
}

TEST(KVPoolPerLayer, EveryLayerHoldsWhatACacheOfItsConfigurationHolds) {
  const std::vector<CacheConfig> configs = per_layer_configs();
  KVPool pool(per_layer_pool(), configs);
  EXPECT_FALSE(pool.uniform());
  EXPECT_EQ(pool.configs(), configs);
  const std::size_t row = row_of(pool.shape().sequence_shape());
  std::map<SequenceId, Tokens> model;
  std::mt19937 rng(23);
  const SequenceId a = pool.add_sequence();
  auto extend = [&](SequenceId id, std::size_t n) {
    Tokens& t = model[id];
    const std::size_t from = t.size(row);
    t.add(n, row, rng);
    for (std::size_t l = 0; l < 4; ++l) pool.append(id, l, from, t.k(from, from + n, row), t.v(from, from + n, row));
  };
  extend(a, 150);
  const SequenceId b = pool.fork(a, 150);
  model[b] = model[a];
  extend(b, 45);
  const SequenceId c = pool.fork(a, 150);
  model[c] = model[a];
  extend(c, 8);
  pool.truncate(c, 155);  // within every layer's reach
  model[c].cut(155, row);
  extend(c, 30);
  EXPECT_GT(pool.memory().shared, 0u);
  auto expect_model = [&](const std::string& when) {
    for (const auto& [id, tokens] : model)
      for (std::size_t l = 0; l < 4; ++l) {
        const KVPool::LayerView v = pool.layer(id, l);
        EXPECT_EQ(v.cache.config(), configs[l]);
        EXPECT_EQ(pool.length(id, l), tokens.size(row));
        const BasicKVCache fresh = fresh_cache(v.cache.shape(), configs[l], tokens);
        ASSERT_TRUE(v.cache.stored_bytes() == fresh.stored_bytes()) << when << ": sequence " << id << " layer " << l;
        EXPECT_EQ(decode_outputs(v.cache), decode_outputs(fresh)) << when << ": sequence " << id << " layer " << l;
      }
  };
  expect_model("after forks");
  // The forks share the prefix block by block in every layer.
  for (std::size_t l = 0; l < 4; ++l) {
    const auto ha = pool.block_hashes(a, l), hb = pool.block_hashes(b, l);
    ASSERT_FALSE(ha.empty()) << "layer " << l;
    EXPECT_EQ(ha.front(), hb.front()) << "layer " << l;
  }
  // Used memory is every group's blocks in use and the sequences' own rows.
  std::size_t blocks = 0, own = 0;
  for (const auto& [id, tokens] : model)
    for (std::size_t l = 0; l < 4; l += 1) {
      const KVPool::LayerView v = pool.layer(id, l);
      if (v.layer == 0) own += v.cache.own_bytes();
    }
  for (const std::size_t l : {0u, 1u, 3u}) blocks += pool.blocks(l).counts().in_use * pool.block_bytes(l);
  EXPECT_EQ(pool.memory().used, blocks + own);
  EXPECT_EQ(&pool.blocks(0), &pool.blocks(2)) << "one configuration, one store";
  EXPECT_NE(&pool.blocks(0), &pool.blocks(1));
  // A reorder moves every layer group's caches together.
  pool.reorder(std::vector<SequenceId>{a, b, c}, std::vector<std::size_t>{2, 2, 0});
  model = {{a, model[c]}, {b, model[c]}, {c, model[a]}};
  expect_model("after a reorder");
  for (const auto& [id, tokens] : model) pool.remove_sequence(id);
  for (const std::size_t l : {0u, 1u, 3u}) EXPECT_EQ(pool.blocks(l).counts().in_use, 0u) << "layer " << l;
}

TEST(KVPoolPerLayer, FailuresNameThePoolLayerAndChangeNothing) {
  std::vector<CacheConfig> configs = per_layer_configs();
  configs[3].rollback_depth = 0;  // layer 3 keeps no rows to re-open packed ones with
  KVPool pool(per_layer_pool(), configs);
  const std::size_t row = row_of(pool.shape().sequence_shape());
  std::mt19937 rng(29);
  Tokens t;
  t.add(100, row, rng);
  const SequenceId id = pool.add_sequence();
  for (std::size_t l = 0; l < 4; ++l) pool.append(id, l, 0, t.k(0, 100, row), t.v(0, 100, row));
  auto bytes = [&] {
    std::vector<std::vector<std::uint8_t>> all;
    for (std::size_t l = 0; l < 4; ++l) all.push_back(pool.layer(id, l).cache.stored_bytes());
    return all;
  };
  const auto before = bytes();
  const kvq::PoolMemory memory_before = pool.memory();
  try {
    pool.truncate(id, 90);  // re-opens packed groups in layer 3
    FAIL() << "a rollback past layer 3's reach succeeded";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("layer 3"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(bytes() == before);
  EXPECT_EQ(pool.length(id, 0), 100u);
  // The same on a fork, whose blocks are shared: the groups before layer 3's copy none of them.
  const SequenceId child = pool.fork(id, 100);
  const kvq::PoolMemory forked = pool.memory();
  EXPECT_THROW(pool.truncate(child, 90), kvq::Error);
  EXPECT_THROW(pool.erase(child, 1, 32), kvq::Error);
  EXPECT_EQ(pool.memory().used, forked.used);
  EXPECT_EQ(pool.memory().shared, forked.shared);
  pool.remove_sequence(child);
  try {
    pool.erase(id, 1, 32);  // inside layers 0 and 2's sinks
    FAIL() << "erasing sink positions succeeded";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument);
  }
  EXPECT_TRUE(bytes() == before);
  std::vector<float> k(row, std::numeric_limits<float>::infinity()), v(row, 0.0f);
  try {
    pool.append(id, 3, 100, k, v);
    FAIL() << "an infinite key was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sequence " + std::to_string(id) + ": layer 3"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(bytes() == before);
  EXPECT_EQ(pool.memory().used, memory_before.used);

  // What needs one configuration says so, and names the way to read a per-layer pool.
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { (void)pool.sequence(id); }, [&] { (void)pool.config(); }, [&] { (void)pool.block_bytes(); }}) {
    try {
      call();
      ADD_FAILURE() << "a per-layer pool answered a uniform pool's call";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::unsupported);
      EXPECT_NE(std::string(e.what()).find("layer(id, l)"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW((void)pool.layer(id, 4), kvq::Error);
  EXPECT_THROW(KVPool(per_layer_pool(), std::vector<CacheConfig>(3, per_layer_configs()[0])), kvq::Error);

  // A full store: capacity_exceeded naming the pool layer, nothing changed. Each store gets the
  // limit's share of its layers: 2 of 4 layers, 6 blocks of 64 positions beside a sequence's own rows.
  KVPool tight(per_layer_pool(2 * (6 + pool.own_row_blocks(0))), per_layer_configs());
  const SequenceId s = tight.add_sequence();
  Tokens long_tokens;
  long_tokens.add(500, row, rng);
  tight.append(s, 0, 0, long_tokens.k(0, 300, row), long_tokens.v(0, 300, row));
  try {
    tight.append(s, 2, 0, long_tokens.k(0, 500, row), long_tokens.v(0, 500, row));
    FAIL() << "a full store took more blocks";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded);
    EXPECT_NE(std::string(e.what()).find("layer 2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tight.length(s, 2), 0u);
}

// Own rows are charged group by group: a sequence refused in any group holds no charge in the
// others, for every split of a small limit between the groups. Group 0 (layer 0, no window)
// needs few blocks and the window layers' group many, so some limits refuse in the later group.
TEST(KVPoolPerLayer, RefusedSequencesLeaveNoChargeInAnyGroup) {
  const std::vector<CacheConfig> configs =
      kvq::parse_layer_configs("k2c16-v4t32-r0-s0;k4c32-v2t32-r20-s3;k4c32-v2t32-r20-s3;k16-v16-r0-s1-f32", 4);
  std::size_t refused = 0, refused_after_group_0 = 0, added = 0;
  for (std::size_t blocks = 1; blocks <= 160; ++blocks) {
    KVPool pool(per_layer_pool(blocks), configs);
    try {
      (void)pool.add_sequence();
      ++added;
    } catch (const kvq::Error& e) {
      ASSERT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded) << e.what();
      ++refused;
      // Group 0 had room: its charge was taken, then given back.
      refused_after_group_0 += pool.blocks(0).available() >= pool.own_row_blocks(0);
      EXPECT_EQ(pool.sequence_count(), 0u);
      for (std::size_t l = 0; l < 4; ++l) EXPECT_EQ(pool.blocks(l).counts().charged, 0u) << blocks << " layer " << l;
    }
  }
  EXPECT_GT(refused, 0u);
  EXPECT_GT(refused_after_group_0, 0u) << "no limit refused a sequence in a later group";
  EXPECT_GT(added, 0u);
}

/// Every layer of sequence ia of `a` holds what layer l of sequence ib of `b` holds: bytes, rollback
/// reach, attention.
void expect_same_layers(const KVPool& a, SequenceId ia, const KVPool& b, SequenceId ib, const std::string& what) {
  for (std::size_t l = 0; l < a.shape().layers; ++l) {
    const KVPool::LayerView x = a.layer(ia, l), y = b.layer(ib, l);
    ASSERT_EQ(x.layer, y.layer) << what;
    kvq::test::expect_same_state(x.cache, y.cache, what + ", layer " + std::to_string(l));
    EXPECT_EQ(decode_outputs(x.cache), decode_outputs(y.cache)) << what << ", layer " << l;
  }
}

// A pool with a configuration per layer saves and loads as a uniform one does: every layer's
// bytes and attention, the blocks shared, the ids. One sequence saved alone (a session file)
// comes back under a new id, in this pool or another of its configurations; a damaged or
// mismatched file, a whole pool given to load_sequence, or too few free blocks change nothing.
TEST(KVPoolPerLayer, PoolAndSequenceFilesKeepEveryLayer) {
  const std::vector<CacheConfig> configs = per_layer_configs();
  KVPool pool(per_layer_pool(), configs);
  const PoolModel model = fill_pool(pool, 300, 37);
  const std::size_t row = row_of(pool.shape().sequence_shape());
  const std::string bytes = saved_pool(pool);
  KVPool copy(per_layer_pool(8192), configs);
  load_pool(copy, bytes);
  ASSERT_EQ(copy.sequence_count(), pool.sequence_count());
  for (const auto& [id, tokens] : model) {
    ASSERT_TRUE(copy.contains(id)) << "sequence " << id;
    expect_same_layers(copy, id, pool, id, "sequence " + std::to_string(id));
    for (std::size_t l = 0; l < 4; ++l) {
      const KVPool::LayerView v = copy.layer(id, l);
      EXPECT_TRUE(v.cache.stored_bytes() == fresh_cache(v.cache.shape(), configs[l], tokens).stored_bytes())
          << "sequence " << id << " layer " << l;
    }
  }
  EXPECT_GT(pool.memory().shared, 0u);
  EXPECT_EQ(copy.memory().used, pool.memory().used);
  EXPECT_EQ(copy.memory().shared, pool.memory().shared) << "shared blocks stay shared";
  KVPool same_limit(per_layer_pool(), configs);
  load_pool(same_limit, bytes);
  EXPECT_TRUE(saved_pool(same_limit) == bytes) << "saving the loaded pool writes the same file";

  // Session files: each sequence alone, into another pool and back into this one.
  KVPool other(per_layer_pool(), configs);
  std::string session;
  for (const auto& [id, tokens] : model) {
    std::stringstream file;
    pool.save_sequence(id, file);
    session = file.str();
    const SequenceId there = other.load_sequence(file);
    expect_same_layers(other, there, pool, id, "sequence " + std::to_string(id) + " in another pool");
    std::stringstream again(session);
    const SequenceId here = pool.load_sequence(again);
    EXPECT_GT(here, id);
    expect_same_layers(pool, here, pool, id, "sequence " + std::to_string(id) + " loaded beside itself");
    pool.remove_sequence(here);
  }
  EXPECT_LT(session.size(), bytes.size()) << "a session file holds its own sequence's blocks only";
  const std::size_t last = model.rbegin()->first;
  Tokens more = model.rbegin()->second;
  std::mt19937 rng(3);
  const std::size_t from = more.size(row);
  more.add(70, row, rng);
  const SequenceId restored = other.sequence_count() - 1;  // ids in `other` follow the model's order
  for (std::size_t l = 0; l < 4; ++l) {
    pool.append(last, l, from, more.k(from, from + 70, row), more.v(from, from + 70, row));
    other.append(restored, l, from, more.k(from, from + 70, row), more.v(from, from + 70, row));
  }
  expect_same_layers(other, restored, pool, last, "after more tokens");

  // Refused, nothing changed.
  auto expect_refused = [&](KVPool& target, const std::string& file, kvq::ErrorCode code, const std::string& needle) {
    expect_load_refused(
        target,
        [&] {
          std::istringstream in(file, std::ios::binary);
          (void)target.load_sequence(in);
        },
        code, needle);
  };
  expect_refused(other, bytes, kvq::ErrorCode::invalid_argument,
                 "holds " + std::to_string(model.size()) + " sequences");
  KVPool uniform(per_layer_pool(), configs[0]);
  expect_refused(uniform, session, kvq::ErrorCode::shape_mismatch,
                 "configured '" + kvq::to_string(std::span(configs)) + "'");
  Tokens t;
  std::ostringstream cache_file(std::ios::binary);
  kvq::save(uniform.sequence(add_tokens(uniform, t, 90, 8)), cache_file);
  expect_refused(other, cache_file.str(), kvq::ErrorCode::shape_mismatch, "kvq cache file holds a cache configured");
  KVPool tight(per_layer_pool(8), configs);
  expect_refused(tight, session, kvq::ErrorCode::capacity_exceeded, "blocks of the layers configured");
  for (std::size_t cut = 0; cut < session.size(); cut += 1 + cut / 8)
    expect_refused(other, session.substr(0, cut), kvq::ErrorCode::io, "kvq ");
  for (std::size_t i = 0; i < session.size(); i += 1 + i / 16) {
    std::string flipped = session;
    flipped[i] = char(flipped[i] ^ (1 << (i % 8)));
    expect_refused(other, flipped, kvq::ErrorCode::io, "kvq ");
  }

  // A uniform pool writes session files too, and still reads cache files.
  std::stringstream uniform_session;
  const SequenceId s = uniform.sequence_count() - 1;
  uniform.save_sequence(s, uniform_session);
  kvq::test::expect_same_state(uniform.sequence(uniform.load_sequence(uniform_session)), uniform.sequence(s),
                               "uniform session");
  std::istringstream cache_in(cache_file.str(), std::ios::binary);
  kvq::test::expect_same_state(uniform.sequence(uniform.load_sequence(cache_in)), uniform.sequence(s), "cache file");
}

// A RoPE per layer (Gemma 3: theta 10,000 on its local layers, 1,000,000 with linear scaling 8 on
// its global ones): layers of one configuration and RoPE form a group; each layer holds and
// attends as a cache of its configuration and RoPE, rotated by its own table, through forks and
// rollbacks; pool and session files keep each layer's RoPE, and a pool rotated otherwise refuses
// them by layer, as it refuses version 1 files (one RoPE for every layer) that do not fit it.
TEST(KVPoolPerLayer, EachLayerRotatesAsItsOwnRope) {
  const PoolShape shape = per_layer_pool();
  const kvq::RopeConfig local = shape.sequence_shape().rope();
  kvq::RopeConfig global = local;
  global.theta = 1.0e6f;
  global.scaling.type = kvq::RopeScalingType::linear;
  global.scaling.factor = 8.0f;
  const std::vector<kvq::RopeConfig> ropes = {local, global, local, local};
  const CacheConfig pre = config_of("k4c32-v2t32-r20-s3");
  const std::vector<CacheConfig> configs = {pre, pre, pre, config_of("k2c16-v4t32-r0-s0")};
  KVPool pool(shape, configs, ropes);
  EXPECT_FALSE(pool.uniform());
  EXPECT_THROW((void)pool.rope(), kvq::Error) << "the layers rotate differently: no one table";
  EXPECT_EQ(&pool.rope(0), &pool.rope(2));
  EXPECT_EQ(&pool.rope(0), &pool.rope(3)) << "one table per RoPE, whatever the configuration";
  EXPECT_EQ(pool.rope(1).config(), global);
  EXPECT_EQ(&pool.blocks(0), &pool.blocks(2));
  EXPECT_NE(&pool.blocks(0), &pool.blocks(1)) << "one configuration, two RoPEs: two groups";

  const PoolModel model = fill_pool(pool, 200, 41);
  const std::size_t heads = shape.kv_heads * 2;
  const auto q = kvq::test::normal_vector(heads * shape.head_dim, 5, 0.3f);
  auto attend = [&](const BasicKVCache& cache, std::size_t layer, kvq::Tier tier) {
    std::vector<float> out(q.size());
    kvq::decode_attention(cache, layer, cache.length(layer) - 1, q, out, {.tier = tier});
    return out;
  };
  for (const auto& [id, tokens] : model) {
    std::vector<std::vector<float>> outputs;
    for (std::size_t l = 0; l < 4; ++l) {
      const KVPool::LayerView v = pool.layer(id, l);
      CacheShape own = shape.sequence_shape();  // the layer's RoPE, set here and not read from the pool
      own.layers = 1;
      own.rope_theta = ropes[l].theta;
      own.rope_scaling = ropes[l].scaling;
      EXPECT_EQ(&v.cache.rope(), &pool.rope(l));
      EXPECT_EQ(v.cache.shape().rope_theta, ropes[l].theta);
      const BasicKVCache alone = fresh_cache(own, configs[l], tokens);
      for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer})
        EXPECT_EQ(attend(v.cache, v.layer, tier), attend(alone, 0, tier))
            << "sequence " << id << " layer " << l << " tier " << int(tier);
      outputs.push_back(attend(v.cache, v.layer, kvq::Tier::exact));
    }
    EXPECT_EQ(outputs[0], outputs[2]) << "sequence " << id;
    double moved = 0;  // the same tokens under the global RoPE attend elsewhere
    for (std::size_t i = 0; i < q.size(); ++i) moved = std::max(moved, double(std::abs(outputs[1][i] - outputs[0][i])));
    EXPECT_GT(moved, 1e-3) << "sequence " << id;
  }

  // Pool and session files keep each layer's RoPE.
  const std::string bytes = saved_pool(pool);
  KVPool copy(shape, configs, ropes);
  load_pool(copy, bytes);
  for (const auto& [id, tokens] : model) expect_same_layers(copy, id, pool, id, "sequence " + std::to_string(id));
  EXPECT_TRUE(saved_pool(copy) == bytes);
  std::stringstream session;
  pool.save_sequence(model.begin()->first, session);
  const std::string session_bytes = session.str();
  const SequenceId restored = copy.load_sequence(session);
  expect_same_layers(copy, restored, pool, model.begin()->first, "session file");

  // A pool rotated otherwise refuses them, naming the layer; nothing changes.
  auto expect_refused = [&](KVPool& target, const std::string& file, bool whole, const std::string& needle) {
    expect_load_refused(
        target,
        [&] {
          std::istringstream in(file, std::ios::binary);
          if (whole)
            target.load(in);
          else
            (void)target.load_sequence(in);
        },
        kvq::ErrorCode::shape_mismatch, needle);
  };
  KVPool one_rope(shape, configs);
  const std::string layer1 = "kvq pool file rotates layer 1 by RoPE adjacent_pairs theta 1000000";
  expect_refused(one_rope, bytes, true, layer1);
  expect_refused(one_rope, session_bytes, false, layer1);
  std::vector<kvq::RopeConfig> other = ropes;
  other[3] = global;
  KVPool other_ropes(shape, configs, other);
  expect_refused(other_ropes, bytes, true, "layer 3 by RoPE adjacent_pairs theta 10000");

  // Version 1 (no "ropes" section): every layer rotated by the header's RoPE.
  KVPool uniform(shape, configs);
  (void)fill_pool(uniform, 130, 43);
  const std::string v2 = saved_pool(uniform);
  const auto sections = kvq::test::file_sections(v2);
  ASSERT_EQ(kvq::test::section_tag(v2, sections[1].first), kvq::detail::tag_ropes);
  std::string v1 = v2.substr(0, sections[1].first) + v2.substr(sections[2].first);
  v1[8] = 1;
  KVPool from_v1(shape, configs);
  load_pool(from_v1, v1);
  for (std::size_t id = 0; id < 8; ++id)
    if (uniform.contains(id)) expect_same_layers(from_v1, id, uniform, id, "version 1, sequence " + std::to_string(id));
  EXPECT_TRUE(saved_pool(from_v1) == v2) << "saved again as version 2";
  KVPool rotated(shape, configs, ropes);
  expect_refused(rotated, v1, true,
                 "rotates layer 1 by RoPE adjacent_pairs theta 10000.000000; this pool's layer 1 by RoPE "
                 "adjacent_pairs theta 1000000");

  // One configuration on every layer, two RoPEs: a pool of one RoPE refuses its file for the RoPE
  // (the file's configuration text is the one configuration), and it refuses cache files.
  KVPool same_configs(shape, std::vector<CacheConfig>(4, pre), ropes);
  (void)fill_pool(same_configs, 100, 44);
  KVPool one_rope_same_configs(shape, std::vector<CacheConfig>(4, pre));
  expect_refused(one_rope_same_configs, saved_pool(same_configs), true, layer1);
  {
    Tokens u;
    std::stringstream cache_file;
    kvq::save(one_rope_same_configs.sequence(add_tokens(one_rope_same_configs, u, 70, 45)), cache_file);
    expect_refused(same_configs, cache_file.str(), false, "under one RoPE; this pool's layers differ");
  }
  // A RoPE spelled with rotary_dims = head_dim is the one spelled with 0, and scaling fields its
  // type does not read tell none apart: one group, one table, and the file loads.
  std::vector<kvq::RopeConfig> spelled = ropes;
  spelled[2].rotary_dims = shape.head_dim;
  spelled[1].scaling.beta_fast = 64.0f;  // yarn's; layer 1 scales linearly
  spelled[3].scaling.factor = 2.0f;      // no scaling on layer 3
  KVPool respelled(shape, configs, spelled);
  EXPECT_EQ(&respelled.blocks(0), &respelled.blocks(2));
  EXPECT_EQ(&respelled.rope(0), &respelled.rope(2));
  EXPECT_EQ(&respelled.rope(0), &respelled.rope(3));
  load_pool(respelled, bytes);
  EXPECT_TRUE(saved_pool(respelled) == bytes);

  // A forged "ropes" section (an unknown style under a right CRC) is refused by name.
  {
    std::string forged = bytes;
    const auto [start, size] = kvq::test::file_sections(forged)[1];
    forged[start + 12] = 7;  // layer 0's style
    kvq::test::reseal(forged, start, size);
    KVPool target(shape, configs, ropes);
    expect_load_refused(
        target, [&] { load_pool(target, forged); }, kvq::ErrorCode::io, "section 'ropes' at offset");
    expect_load_refused(
        target, [&] { load_pool(target, forged); }, kvq::ErrorCode::io, "unknown RoPE style 7");
  }

  // A layer without RoPE (RopeStyle::none, keys stored as given): erase shifts the whole pool, each
  // layer then holding what a cache of its own fed the kept tokens holds, and files keep it.
  {
    const std::vector<kvq::RopeConfig> nope = {
        local, {.head_dim = shape.head_dim, .style = kvq::RopeStyle::none}, global, local};
    const std::vector<CacheConfig> nope_configs = {pre, config_of("k4c32-v2t32-r20-s3-post"), pre, pre};
    KVPool shifting(shape, nope_configs, nope);
    Tokens kept;
    const SequenceId s = add_tokens(shifting, kept, 260, 46);
    shifting.erase(s, 35, 64);  // sinks 3 + a whole group of 32; two groups
    const std::size_t row = row_of(shape.sequence_shape());
    Tokens fresh;
    fresh.keys.assign(kept.keys.begin(), kept.keys.begin() + 35 * row);
    fresh.keys.insert(fresh.keys.end(), kept.keys.begin() + 99 * row, kept.keys.end());
    fresh.values.assign(kept.values.begin(), kept.values.begin() + 35 * row);
    fresh.values.insert(fresh.values.end(), kept.values.begin() + 99 * row, kept.values.end());
    for (std::size_t l = 0; l < 4; ++l) {
      CacheShape own = kvq::detail::with_rope(shape.sequence_shape(), nope[l], "test", l);
      own.layers = 1;
      const KVPool::LayerView v = shifting.layer(s, l);
      const BasicKVCache alone = fresh_cache(own, nope_configs[l], fresh);
      ASSERT_EQ(v.cache.length(v.layer), alone.length(0)) << "layer " << l;
      std::vector<float> a(shape.head_dim), b(shape.head_dim);
      for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values})
        for (std::size_t h = 0; h < shape.kv_heads; ++h)
          for (std::size_t p = 0; p < alone.length(0); ++p) {
            v.cache.read_row(t, v.layer, h, p, a.data());
            alone.read_row(t, 0, h, p, b.data());
            ASSERT_EQ(a, b) << "layer " << l << " head " << h << " position " << p;
          }
      EXPECT_EQ(attend(v.cache, v.layer, kvq::Tier::exact), attend(alone, 0, kvq::Tier::exact)) << "layer " << l;
    }
    KVPool reloaded(shape, nope_configs, nope);
    load_pool(reloaded, saved_pool(shifting));
    expect_same_layers(reloaded, s, shifting, s, "a pool with a layer without RoPE, saved and loaded");
  }

  // Every layer rotated one way, other than the shape's: a uniform pool, whose sequences are
  // caches of that RoPE, cache files included.
  KVPool all_global(shape, std::vector<CacheConfig>(4, pre), std::vector<kvq::RopeConfig>(4, global));
  EXPECT_TRUE(all_global.uniform());
  Tokens t;
  const SequenceId g = add_tokens(all_global, t, 150, 47);
  EXPECT_EQ(all_global.sequence(g).shape().rope_theta, 1.0e6f);
  std::stringstream cache_file;
  kvq::save(all_global.sequence(g), cache_file);
  kvq::test::expect_same_state(all_global.sequence(all_global.load_sequence(cache_file)), all_global.sequence(g),
                               "cache file of a pool rotated otherwise than its shape");

  // Bad RoPE lists are named.
  for (const auto& [broken, part] :
       {std::pair{0, "pool: 3 RoPE configurations for 4 layers"},
        std::pair{1, "pool: layer 1's RoPE is for head_dim 32"}, std::pair{2, "pool, layer 2: RoPE theta"}}) {
    std::vector<kvq::RopeConfig> bad = ropes;
    if (broken == 0) bad.pop_back();
    if (broken == 1) bad[1].head_dim = 32;
    if (broken == 2) bad[2].theta = 0.5f;
    try {
      KVPool p(shape, configs, bad);
      ADD_FAILURE() << "accepted: " << part;
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
  try {
    (void)pool.sequence(0);
    ADD_FAILURE() << "sequence() of a pool with a RoPE per layer";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("differ in configuration or RoPE"), std::string::npos) << e.what();
  }
}

TEST(KVPool, BadArgumentsAreNamed) {
  const CacheConfig config = config_of("k4c32-v2t32-r16-s1");
  PoolShape shape = small_pool();
  shape.block_tokens = 48;
  EXPECT_THROW(KVPool(shape, config), kvq::Error);
  shape = small_pool();
  for (const std::size_t layers : {std::size_t(4097), std::numeric_limits<std::size_t>::max()}) {
    shape.layers = layers;  // refused before anything is sized by it (a vector of SIZE_MAX threw length_error)
    try {
      KVPool refused(shape, config);
      FAIL();
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("pool shape: layers of " + std::to_string(layers)), std::string::npos)
          << e.what();
    }
  }
  shape = small_pool(0);
  try {
    KVPool refused(shape, config);
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("pool shape: memory_blocks must be at least 1"), std::string::npos)
        << e.what();
  }
  // A block size that rounds up to whole cache lines past SIZE_MAX (it wrapped to 0 and divided by it).
  EXPECT_THROW(kvq::BlockStore(std::numeric_limits<std::size_t>::max() - 10, 1), kvq::Error);
  KVPool pool(small_pool(), config);
  std::vector<float> k(3 * 128, 1.0f), v(3 * 128, 1.0f);
  const std::pair<const char*, std::function<void()>> missing[] = {{"truncate", [&] { pool.truncate(42, 0); }},
                                                                   {"erase", [&] { pool.erase(42, 0, 1); }},
                                                                   {"append", [&] { pool.append(42, 0, 0, k, v); }}};
  for (const auto& [operation, call] : missing) {
    try {
      call();
      FAIL() << operation;
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find("pool " + std::string(operation) + ": no sequence 42"), std::string::npos)
          << e.what();
    }
  }
  const SequenceId s = pool.add_sequence();
  try {
    pool.append(s, 0, 5, k, v);
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::out_of_order);
    EXPECT_NE(std::string(e.what()).find("sequence " + std::to_string(s) + ": layer 0"), std::string::npos) << e.what();
  }
}

}  // namespace
