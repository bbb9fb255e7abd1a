// KVCache: the quantization rule at the window's edges, chunking invariance, memory accounting,
// strong guarantee on bad input, and cache operations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/cache_state.hpp"
#include "support/random.hpp"

namespace {

using kvq::Axis;
using kvq::BasicKVCache;
using kvq::CacheConfig;
using kvq::CacheShape;

CacheConfig config_of(const char* text) { return kvq::parse_cache_config(text); }

using kvq::test::snapshot;

void append_all(BasicKVCache& cache, const std::vector<float>& k, const std::vector<float>& v, std::size_t begin,
                std::size_t end) {
  const std::size_t row = cache.shape().kv_heads * cache.shape().head_dim;
  for (std::size_t l = 0; l < cache.shape().layers; ++l)
    cache.append(l, begin, std::span(k).subspan(begin * row, (end - begin) * row),
                 std::span(v).subspan(begin * row, (end - begin) * row));
}

// Full-precision key positions after a prompt of n tokens: the newest R always, plus the
// incomplete or not-yet-due group, plus the sinks.
TEST(KVCacheWindow, QuantizesExactlyWhatTheRuleSays) {
  const std::size_t R = 16, G = 8;
  for (std::size_t S : {0u, 1u, 4u}) {
    for (std::size_t n : {R - 1, R, R + 1, R + G - 1, R + G, R + G + S, R + G + S + 1, 3 * R + 5}) {
      CacheConfig c = config_of("k4c8-v2t8-r16-s0-f32");
      c.sinks = S;
      BasicKVCache cache(CacheShape{1, 2, 16, 200}, c);
      const auto k = kvq::test::normal_vector(n * 2 * 16, 1), v = kvq::test::normal_vector(n * 2 * 16, 2);
      append_all(cache, k, v, 0, n);
      ASSERT_EQ(cache.segments(0), 1u);  // one block holds the capacity: one view holds the stream
      const kvq::StreamView kv = cache.keys(0, 1, 0), vv = cache.values(0, 1, 0);
      const std::size_t expect_k = n >= S + R ? S + (n - S - R) / G * G : S;
      const std::size_t expect_v = n > S + R ? n - R : S;
      EXPECT_EQ(kv.end_quantized, expect_k) << "S=" << S << " n=" << n;
      EXPECT_EQ(vv.end_quantized, expect_v) << "S=" << S << " n=" << n;
      EXPECT_TRUE(kv.end_quantized == S || kv.end_quantized + R <= n) << "the newest R keys stay full precision";
      if (n > S) {
        EXPECT_LE(n - kv.end_quantized, R + G - 1);
      }
      // Sinks and pending rows read back exactly (f32 residual); quantized rows approximately.
      std::vector<float> row(16);
      for (std::size_t p = 0; p < n; ++p) {
        kv.read_row(p, row.data());
        for (std::size_t c2 = 0; c2 < 16; ++c2) {
          const float x = k[(p * 2 + 1) * 16 + c2];
          if (p < S || p >= kv.end_quantized) {
            EXPECT_EQ(row[c2], x) << "position " << p;
          } else {
            EXPECT_NEAR(row[c2], x, 1.0) << "position " << p;
          }
        }
      }
    }
  }
}

// Every packed key block holds exactly the reference quantization of the rows appended, as the
// residual type stored them: whether the block was read in place from the ring or, where it wraps
// around the ring's end (windows that are not a multiple of the group), through floats.
TEST(KVCacheWindow, PackedKeyBlocksAreTheReferenceQuantizationOfTheStoredRows) {
  for (const char* text :
       {"k4c32-v2t32-r20-s3", "k2c16-v4t32-r32-s0-bf16", "k8c32-v8t32-r128-s1-f32", "k3c8-v5t16-r5-s0",
        "k4c32s-v2t32-r40-s0", "k4c32-v2t32-r64-s3-fk", "k2c16-v4t32-r48-s0-fk-fv"}) {
    const CacheShape shape{1, 2, 64, 400};
    const std::size_t n = 301, dim = 64;
    const auto k = kvq::test::outlier_keys(n, 2, dim, 3, 8.0f, 12), v = kvq::test::normal_vector(n * 2 * dim, 13);
    BasicKVCache cache(shape, config_of(text));
    for (std::size_t p = 0; p < n; ++p) append_all(cache, k, v, p, p + 1);
    for (std::size_t h = 0; h < 2; ++h) {
      ASSERT_EQ(cache.segments(0), 1u);
      const kvq::StreamView s = cache.keys(0, h, 0);
      const std::size_t g = s.spec.group, param_bytes = kvq::size_of(s.spec.param);
      ASSERT_GT(s.end_quantized, s.first_quantized + 4 * g) << text;
      for (std::size_t b0 = s.first_quantized; b0 < s.end_quantized; b0 += g) {
        std::vector<float> rows(g * dim);
        std::vector<std::uint8_t> stored(dim * 4);
        for (std::size_t r = 0; r < g; ++r) {  // the appended keys as the residual type rounds them
          kvq::store_row(s.residual, k.data() + ((b0 + r) * 2 + h) * dim, dim, stored.data());
          kvq::load_row(s.residual, stored.data(), dim, rows.data() + r * dim);
        }
        std::vector<std::uint8_t> codes(g * s.row_bytes), scales(dim * param_bytes), zeros(dim * param_bytes);
        kvq::kernels::reference::quantize_block_per_channel(s.spec, rows.data(), g, dim, dim, scales.data(),
                                                            zeros.data(), codes.data(), s.row_bytes);
        const std::size_t p = s.param_index(b0) * param_bytes;
        EXPECT_TRUE(std::equal(codes.begin(), codes.end(), s.code_row(b0)))
            << text << " head " << h << " block at " << b0;
        EXPECT_TRUE(std::equal(scales.begin(), scales.end(), s.scales + p))
            << text << " head " << h << " block at " << b0;
        if (s.zeros != nullptr) {
          EXPECT_TRUE(std::equal(zeros.begin(), zeros.end(), s.zeros + p))
              << text << " head " << h << " block at " << b0;
        }
      }
    }
  }
}

TEST(KVCacheWindow, ZeroWindowQuantizesEveryCompleteGroupAtOnce) {
  BasicKVCache cache(CacheShape{1, 1, 8, 64}, config_of("k2c4-v2t8-r0-s0"));
  const auto k = kvq::test::normal_vector(10 * 8, 3), v = kvq::test::normal_vector(10 * 8, 4);
  append_all(cache, k, v, 0, 10);
  EXPECT_EQ(cache.quantized_end(kvq::Tensor::keys, 0), 8u);
  EXPECT_EQ(cache.quantized_end(kvq::Tensor::values, 0), 10u);
}

// Keys that flush their window are KIVI's: after a prompt of L tokens it keeps the last L mod R
// keys exact and quantizes the rest (its prefill), and while decoding it quantizes the R exact
// keys together once there are R. Values keep sliding: the newest R exact. Checked at every
// length against those two rules as KIVI writes them, and against what read_row returns.
TEST(KVCacheWindow, KeysThatFlushTheirWindowAreQuantizedAsKIVIDoes) {
  const std::size_t R = 64, dim = 32, n = 300;
  const CacheShape shape{1, 1, dim, 400};
  const CacheConfig config = config_of("k2c32-v2t32-r64-s0-fk-post-f32");
  const auto k = kvq::test::outlier_keys(n, 1, dim, 3, 8.0f, 21), v = kvq::test::normal_vector(n * dim, 22);
  BasicKVCache decoded(shape, config);
  std::vector<float> row(dim);
  for (std::size_t length = 1; length <= n; ++length) {
    append_all(decoded, k, v, length - 1, length);
    BasicKVCache prompt(shape, config);
    append_all(prompt, k, v, 0, length);
    const std::size_t key_end = length - length % R, value_end = length > R ? length - R : 0;
    for (const BasicKVCache* c : {&decoded, &prompt}) {
      ASSERT_EQ(c->quantized_end(kvq::Tensor::keys, 0), key_end) << "length " << length;
      ASSERT_EQ(c->quantized_end(kvq::Tensor::values, 0), value_end) << "length " << length;
    }
    EXPECT_TRUE(snapshot(decoded) == snapshot(prompt)) << "length " << length;
    for (std::size_t p = key_end > 0 ? key_end - 1 : 0; p < length; ++p) {  // the exact keys, and the last packed one
      decoded.read_row(kvq::Tensor::keys, 0, 0, p, row.data());
      const bool exact = std::equal(row.begin(), row.end(), k.begin() + std::ptrdiff_t(p * dim));
      EXPECT_EQ(exact, p >= key_end) << "length " << length << " position " << p;
    }
  }
  // At most R - 1 keys are exact, where a sliding window keeps R to R + G - 1: fewer bytes.
  BasicKVCache sliding(shape, config_of("k2c32-v2t32-r64-s0-post-f32"));
  append_all(sliding, k, v, 0, n);
  EXPECT_LT(decoded.memory().total_bytes(), sliding.memory().total_bytes());
}

// With sinks, per-channel values that flush too, up to a capacity that holds no whole number of
// windows after the sinks: positions [S + kR, S + (k+1)R) are packed once S + (k+1)R are held,
// and a window longer than the capacity packs nothing and keeps no rollback copies.
TEST(KVCacheWindow, FlushesCountFromTheSinksUpToTheCapacity) {
  const std::size_t dim = 32, capacity = 300;
  const CacheShape shape{1, 1, dim, capacity};
  const auto k = kvq::test::outlier_keys(capacity, 1, dim, 3, 8.0f, 23),
             v = kvq::test::normal_vector(capacity * dim, 24);
  for (const auto& [text, R, S] : {std::tuple{"k4c32-v4c32-r64-s3-fk-fv", 64u, 3u},
                                   {"k4c16-v2t32-r48-s5-fk", 48u, 5u},
                                   {"k4c32-v2t32-r512-s1-fk-fv", 512u, 1u}}) {
    SCOPED_TRACE(text);
    const CacheConfig config = config_of(text);
    BasicKVCache cache(shape, config);
    for (std::size_t length = 1; length <= capacity; ++length) {
      append_all(cache, k, v, length - 1, length);
      const std::size_t flushed = length > S ? S + (length - S) / R * R : S;
      ASSERT_EQ(cache.quantized_end(kvq::Tensor::keys, 0), flushed) << "length " << length;
      const std::size_t values = config.flush == kvq::WindowFlush::both ? flushed : length > S + R ? length - R : S;
      ASSERT_EQ(cache.quantized_end(kvq::Tensor::values, 0), values) << "length " << length;
    }
    CacheConfig no_rollback = config;
    no_rollback.rollback_depth = 0;
    EXPECT_EQ(BasicKVCache::own_bytes(shape, config) == BasicKVCache::own_bytes(shape, no_rollback), R > capacity);
  }
}

TEST(KVCacheChunking, StorageIsByteIdenticalHoweverTokensArrive) {
  for (const char* text :
       {"k4c32-v2t32-r20-s3", "k3c8-v5t16-r0-s0", "k2t32-v2c32-r7-s1", "k8c16s-v4t64s-r33-s2-bf16",
        "k3c32o1-v4t16o2-r20-s3", "k4c32-v2t32-r64-s3-fk", "k3c8-v5t16-r24-s0-fk-fv", "k2c16-v4c16-r32-s1-fk-fv"}) {
    const CacheShape shape{2, 2, 64, 300};
    const std::size_t n = 257, row = 2 * 64;
    const auto k = kvq::test::outlier_keys(n, 2, 64, 3, 8.0f, 5), v = kvq::test::normal_vector(n * row, 6);
    BasicKVCache one_shot(shape, config_of(text)), chunked(shape, config_of(text)), single(shape, config_of(text));
    append_all(one_shot, k, v, 0, n);
    std::mt19937 rng(11);
    for (std::size_t begin = 0; begin < n;) {
      const std::size_t end = std::min(n, begin + 1 + rng() % 40);
      append_all(chunked, k, v, begin, end);
      begin = end;
    }
    for (std::size_t p = 0; p < n; ++p) append_all(single, k, v, p, p + 1);
    EXPECT_TRUE(snapshot(one_shot) == snapshot(chunked)) << text;
    EXPECT_TRUE(snapshot(one_shot) == snapshot(single)) << text;
    const auto q = kvq::test::normal_vector(4 * 64, 7);
    std::vector<float> a(q.size()), b(q.size());
    kvq::reference_attention(one_shot, 1, n - 1, q, a);
    kvq::reference_attention(single, 1, n - 1, q, b);
    EXPECT_EQ(a, b) << text;
  }
}

TEST(KVCacheMemory, AccountingMatchesAFormulaAndThePlan) {
  const CacheShape shape{3, 4, 128, 4096};
  BasicKVCache cache(shape, config_of("k4c32-v2t32-r128-s1"));
  const std::size_t n = 1000, row = 4 * 128;
  const auto k = kvq::test::normal_vector(n * row, 8), v = kvq::test::normal_vector(n * row, 9);
  append_all(cache, k, v, 0, n);
  const kvq::MemoryUsage m = cache.memory();
  // Keys: groups of 32 after 1 sink, due when older than 128 -> (1000-128-1)/32 = 27 groups.
  const std::size_t key_rows = 27 * 32, value_rows = 1000 - 128 - 1;
  const std::size_t heads = 3 * 4;
  EXPECT_EQ(m.code_bytes, heads * (key_rows * 64 + value_rows * 32));
  EXPECT_EQ(m.param_bytes, heads * (27 * 128 * 2 * 2 + value_rows * 4 * 2 * 2));
  EXPECT_EQ(m.residual_bytes, heads * ((n - key_rows) + (n - value_rows)) * 128 * 2);
  EXPECT_EQ(m.values, heads * n * 128 * 2);
  EXPECT_NEAR(m.bits_per_value(), 8.0 * double(m.total_bytes()) / double(m.values), 1e-12);
  const kvq::MemoryUsage plan = cache.planned_memory(n);
  EXPECT_EQ(plan.total_bytes(), m.total_bytes());
  // Long contexts approach the asymptote: 4 + 2 bits of codes + 16*2/32 bits of params each.
  EXPECT_NEAR(cache.planned_memory(4096).bits_per_value(), 3.0 + 1.0 + 0.5, 0.5);
  EXPECT_GE(cache.allocated_bytes(), m.total_bytes());
}

class KVCacheBadInput : public ::testing::Test {
 protected:
  const CacheShape shape{2, 2, 32, 80};
  BasicKVCache cache{shape, config_of("k4c8-v2t32-r4-s1")};
  std::vector<float> k = kvq::test::normal_vector(10 * 64, 12), v = kvq::test::normal_vector(10 * 64, 13);

  void SetUp() override { append_all(cache, k, v, 0, 10); }

  // The call throws the given code, its message names `needle`, and nothing changed.
  template <class F>
  void expect_rejected(F&& call, kvq::ErrorCode code, const std::string& needle) {
    const auto before = snapshot(cache);
    const std::size_t l0 = cache.length(0), l1 = cache.length(1);
    try {
      call();
      ADD_FAILURE() << "expected kvq::Error mentioning " << needle;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(snapshot(cache) == before);
    EXPECT_EQ(cache.length(0), l0);
    EXPECT_EQ(cache.length(1), l1);
  }
};

TEST_F(KVCacheBadInput, ShapesOrderCapacityAndValues) {
  std::vector<float> row(2 * 64, 0.5f), short_row(63, 0.5f);
  expect_rejected([&] { cache.append(0, 10, short_row, short_row); }, kvq::ErrorCode::shape_mismatch, "kv heads");
  expect_rejected([&] { cache.append(0, 9, row, row); }, kvq::ErrorCode::out_of_order, "position 9");
  expect_rejected([&] { cache.append(2, 10, row, row); }, kvq::ErrorCode::invalid_argument, "layer 2");
  std::vector<float> too_many(71 * 64, 0.5f);
  expect_rejected([&] { cache.append(1, 10, too_many, too_many); }, kvq::ErrorCode::capacity_exceeded, "capacity");

  std::vector<float> bad = row;
  bad[64 + 32 + 7] = std::numeric_limits<float>::quiet_NaN();  // token 1, head 1, channel 7
  expect_rejected([&] { cache.append(0, 10, bad, row); }, kvq::ErrorCode::non_finite_input,
                  "layer 0, kv head 1, position 11 (key), channel 7");
  bad[64 + 32 + 7] = std::numeric_limits<float>::infinity();
  expect_rejected([&] { cache.append(0, 10, row, bad); }, kvq::ErrorCode::non_finite_input, "(value)");
  bad[64 + 32 + 7] = 1e6f;  // beyond fp16, the residual type
  expect_rejected([&] { cache.append(0, 10, bad, row); }, kvq::ErrorCode::unrepresentable, "residual");
}

TEST(KVCacheBadParams, GroupWhoseScaleOverflowsIsRejectedWholly) {
  // f32 residual holds 60000 and -60000, but the 1-bit f16 scale of their range (120000) cannot.
  BasicKVCache cache(CacheShape{1, 1, 8, 64}, config_of("k1c4-v8t8-r0-s0-f32"));
  std::vector<float> k(4 * 8, 0.0f), v(4 * 8, 0.0f);
  k[0] = 60000.0f;
  k[8] = -60000.0f;
  const auto before = snapshot(cache);
  try {
    cache.append(0, 0, k, v);
    ADD_FAILURE() << "expected an error";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unrepresentable);
    EXPECT_NE(std::string(e.what()).find("channel 0"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(snapshot(cache) == before);
  EXPECT_EQ(cache.length(0), 0u);
  std::string why;
  EXPECT_FALSE(cache.can_append(0, 0, k, v, &why));
  EXPECT_NE(why.find("f16"), std::string::npos) << why;
  k[8] = 0.0f;
  EXPECT_TRUE(cache.can_append(0, 0, k, v));
}

TEST(KVCacheBadInput2, ConstantGroupsReconstructExactly) {
  BasicKVCache cache(CacheShape{1, 1, 16, 64}, config_of("k2c8-v3t16-r0-s0-f32"));
  std::vector<float> k(16 * 16, 1.25f), v(16 * 16, -3.5f);
  cache.append(0, 0, k, v);
  std::vector<float> row(16);
  for (std::size_t p = 0; p < 16; ++p) {
    cache.read_row(kvq::Tensor::keys, 0, 0, p, row.data());
    for (float x : row) EXPECT_EQ(x, 1.25f);
    cache.read_row(kvq::Tensor::values, 0, 0, p, row.data());
    for (float x : row) EXPECT_EQ(x, -3.5f);
  }
}

TEST(KVCacheOperations, TruncateForkAndClear) {
  BasicKVCache cache(CacheShape{1, 1, 8, 64}, config_of("k4c4-v4t8-r8-s0"));
  const auto k = kvq::test::normal_vector(20 * 8, 14), v = kvq::test::normal_vector(20 * 8, 15);
  append_all(cache, k, v, 0, 20);  // keys quantized up to 12, values up to 12
  BasicKVCache fork = cache;
  EXPECT_TRUE(snapshot(fork) == snapshot(cache));
  cache.truncate(11);  // re-opens keys [0, 12) and values [3, 12) from the rollback history
  EXPECT_EQ(cache.length(0), 11u);
  EXPECT_EQ(cache.quantized_end(kvq::Tensor::keys, 0), 0u);
  EXPECT_EQ(cache.quantized_end(kvq::Tensor::values, 0), 3u);
  cache.truncate(14);  // longer than the cache: nothing happens
  EXPECT_EQ(cache.length(0), 11u);
  append_all(cache, k, v, 11, 20);  // re-appending the same tokens restores the same state
  EXPECT_TRUE(snapshot(fork) == snapshot(cache));
  cache.clear();
  EXPECT_EQ(cache.length(0), 0u);
  const auto bytes = cache.stored_bytes();
  EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](auto b) { return b == 0; }));
  EXPECT_EQ(cache.block_count(0), 0u);
  EXPECT_EQ(fork.length(0), 20u);
}

using kvq::test::stored_rows;

std::vector<float> attend(const BasicKVCache& c, std::size_t layer, kvq::Tier tier) {
  const auto q = kvq::test::normal_vector(c.shape().kv_heads * 2 * c.shape().head_dim, 21);
  std::vector<float> out(q.size());
  kvq::DecodeOptions o;
  o.tier = tier;
  kvq::decode_attention(c, layer, c.length(layer) - 1, q, out, o);
  return out;
}

// Context shift: the rows after the erased range move down unchanged (packed groups and flushes
// whole, pending rows through the ring). Where the range lies inside the packed rows, the cache
// equals one that received only the kept tokens, for attention now and after further appends.
TEST(KVCacheOperations, EraseMovesLaterTokensDownUnchanged) {
  std::size_t compared_with_fresh = 0;
  for (const char* text :
       {"k4c32-v2t32-r20-s3", "k2c16-v4c16-r0-s0", "k16-v16-r0-s2", "k8c16-v4t64s-r33-s2-bf16", "k4c32-v2t32-r128-s1",
        "k3c32-v3t16-r8-s1", "k3c32o1-v2t16o1-r8-s1", "k4c32-v2t32-r32-s1-fk", "k3c16-v3t16-r32-s1-fk-fv"}) {
    const CacheConfig config = config_of(text);
    const CacheShape shape{2, 2, 64, 400};
    const std::size_t n = 300, row = 2 * 64, s = config.sinks;
    const auto k = kvq::test::outlier_keys(n + 40, 2, 64, 3, 8.0f, 31),
               v = kvq::test::normal_vector((n + 40) * row, 32);
    BasicKVCache original(shape, config);
    append_all(original, k, v, 0, n);
    struct Range {
      std::size_t first, count;
    };
    std::vector<Range> ranges{{s, 64}, {s + 96, 32}, {s + 32, 160}};
    if (config.window >= 20) ranges.push_back({n - 9, 5});  // pending rows only
    for (const Range& r : ranges) {
      SCOPED_TRACE(std::string(text) + " erase [" + std::to_string(r.first) + ", +" + std::to_string(r.count) + ")");
      BasicKVCache cache = original;
      cache.erase(r.first, r.count);
      for (std::size_t l = 0; l < 2; ++l) {
        ASSERT_EQ(cache.length(l), n - r.count);
        // the original's rows without the erased ones, in order
        const auto before = stored_rows(original, l), after = stored_rows(cache, l);
        std::vector<std::vector<float>> expected;
        for (std::size_t i = 0; i < before.size(); ++i) {
          const std::size_t p = i % n;
          if (p < r.first || p >= r.first + r.count) expected.push_back(before[i]);
        }
        EXPECT_TRUE(after == expected) << "layer " << l;
      }
      bool inside = true;
      for (std::size_t l = 0; l < 2; ++l)
        for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values})
          inside = inside && r.first + r.count <= original.quantized_end(t, l);
      if (!inside) continue;
      ++compared_with_fresh;
      // the same as a cache that never saw the erased tokens, also after more tokens arrive
      std::vector<float> kept_k(k.begin(), k.begin() + r.first * row), kept_v(v.begin(), v.begin() + r.first * row);
      kept_k.insert(kept_k.end(), k.begin() + (r.first + r.count) * row, k.end());
      kept_v.insert(kept_v.end(), v.begin() + (r.first + r.count) * row, v.end());
      BasicKVCache fresh(shape, config);
      append_all(fresh, kept_k, kept_v, 0, n - r.count);
      for (std::size_t l = 0; l < 2; ++l) {
        EXPECT_EQ(cache.quantized_end(kvq::Tensor::keys, l), fresh.quantized_end(kvq::Tensor::keys, l));
        EXPECT_EQ(cache.quantized_end(kvq::Tensor::values, l), fresh.quantized_end(kvq::Tensor::values, l));
      }
      for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer})
        EXPECT_EQ(attend(cache, 1, tier), attend(fresh, 1, tier));
      append_all(cache, kept_k, kept_v, n - r.count, n - r.count + 40);
      append_all(fresh, kept_k, kept_v, n - r.count, n - r.count + 40);
      EXPECT_EQ(attend(cache, 0, kvq::Tier::exact), attend(fresh, 0, kvq::Tier::exact));
      EXPECT_TRUE(stored_rows(cache, 0) == stored_rows(fresh, 0));
    }
  }
  EXPECT_GE(compared_with_fresh, 10u);
}

TEST(KVCacheOperations, EraseRejectsWhatItCannotMoveAndChangesNothing) {
  const CacheShape shape{2, 1, 64, 200};
  const auto k = kvq::test::normal_vector(150 * 64, 41), v = kvq::test::normal_vector(150 * 64, 42);
  auto expect_rejected = [&](const char* text, std::size_t first, std::size_t count, kvq::ErrorCode code,
                             const char* needle) {
    SCOPED_TRACE(std::string(text) + " erase [" + std::to_string(first) + ", +" + std::to_string(count) + ")");
    BasicKVCache cache(shape, config_of(text));
    append_all(cache, k, v, 0, 150);
    cache.append(0, 150, std::span(k).first(64), std::span(v).first(64));  // layer 0 one token longer
    const auto before = snapshot(cache);
    try {
      cache.erase(first, count);
      ADD_FAILURE() << "no error";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(snapshot(cache) == before);
    EXPECT_EQ(cache.length(0), 151u);
    EXPECT_EQ(cache.length(1), 150u);
  };
  // 150 tokens, r20, one sink: keys packed up to 1 + 4 * 32 = 129, values up to 130
  expect_rejected("k4c32-v2t32-r20-s1", 0, 32, kvq::ErrorCode::invalid_argument, "sink");
  expect_rejected("k4c32-v2t32-r20-s1", 140, 11, kvq::ErrorCode::invalid_argument, "layer 1 holds 150");
  expect_rejected("k4c32-v2t32-r20-s1", 17, 32, kvq::ErrorCode::unsupported,
                  "split the packed key group starting at 1");
  expect_rejected("k4c32-v2t32-r20-s1", 33, 20, kvq::ErrorCode::unsupported, "move packed key groups by 20");
  expect_rejected("k4c32-v2t32-r20-s1-post", 33, 32, kvq::ErrorCode::unsupported, "post-RoPE");
  expect_rejected("k16-v4c16-r0-s0", 8, 16, kvq::ErrorCode::unsupported, "value group starting at 0");
  // keys that flush 64 at a time: packed up to 1 + 2 * 64 = 129, moved in whole flushes
  expect_rejected("k4c32-v2t32-r64-s1-fk", 33, 64, kvq::ErrorCode::unsupported,
                  "split the packed key flush starting at 1 (flushes of 64 from position 1)");
  expect_rejected("k4c32-v2t32-r64-s1-fk", 65, 32, kvq::ErrorCode::unsupported, "move packed key flushes by 32");

  // post-RoPE keys may lose their tail: nothing moves
  BasicKVCache cache(shape, config_of("k4c32-v2t32-r20-s1-post"));
  append_all(cache, k, v, 0, 150);
  cache.erase(129, 21);
  EXPECT_EQ(cache.length(0), 129u);
  cache.erase(5, 0);
  EXPECT_EQ(cache.length(1), 129u);
}

// shift_unit is erase's granule: a context shift that keeps the sinks and a number of tokens and
// drops a number, each rounded up to it, is accepted; one token off it is refused where packed
// per-channel groups or flushed windows are involved.
TEST(KVCacheOperations, ShiftsRoundedToTheShiftUnitAreAccepted) {
  const CacheShape shape{2, 2, 64, 400};
  const auto k = kvq::test::normal_vector(300 * 128, 51), v = kvq::test::normal_vector(300 * 128, 52);
  for (const auto& [text, unit] : {std::pair{"k4c32-v2t32-r20-s3", 32u},
                                   {"k2c16-v4c16-r0-s0", 16u},
                                   {"k4c32-v4c64-r8-s1", 64u},
                                   {"k16-v16-r0-s2", 1u},
                                   {"k4t32-v2t32-r16-s1", 1u},
                                   {"k4c32-v2t32-r64-s1-fk", 64u},
                                   {"k4t32-v2t32-r24-s1-fk-fv", 24u}}) {
    SCOPED_TRACE(text);
    const CacheConfig config = config_of(text);
    EXPECT_EQ(kvq::shift_unit(config), std::size_t(unit));
    BasicKVCache cache(shape, config);
    append_all(cache, k, v, 0, 300);
    const std::size_t u = unit;  // clang 14 lambdas cannot capture a structured binding
    const auto round_up = [u](std::size_t n) { return (n + u - 1) / u * u; };
    for (const auto& [keep, drop] : {std::pair{5u, 40u}, {37u, 100u}, {64u, 31u}, {100u, 100u}, {0u, 7u}}) {
      const std::size_t first = config.sinks + round_up(keep), count = round_up(drop);
      ASSERT_LE(first + count, 300u);
      const auto error = cache.erase_error(first, count);
      EXPECT_FALSE(error) << "keep " << keep << ", drop " << drop << ": " << error->what();
    }
    if (unit > 1) {
      EXPECT_TRUE(cache.erase_error(config.sinks + 1, unit)) << "a range starting off the unit";
      EXPECT_TRUE(cache.erase_error(config.sinks, unit / 2)) << "a range spanning half the unit";
    }
  }
}

// ---- exact rollback ----

// Random appends (random chunks of new random tokens) and rollbacks of up to D tokens below the
// longest length held: after every step the cache equals one fed the surviving tokens directly.
TEST(KVCacheRollback, RandomRollbacksEqualAFreshCache) {
  std::size_t rollbacks = 0, reopened = 0;
  for (const char* text : {"k4c32-v2t32-r20-s3", "k2c16-v4c16-r0-s0", "k16-v16-r0-s2", "k8c16-v4t32s-r33-s2-bf16",
                           "k3c8-v5t16-r5-s0-d5", "k2t32-v2c32-r7-s1-d40", "k4c8-v2t8-r8-s0-d1", "k4c32-v2t32-r128-s1",
                           "k3c8o1-v4t8o1-r5-s0-d5", "k4c32-v2t32-r64-s3-fk", "k3c8-v5t16-r16-s0-fk-fv-d5",
                           "k2c16-v4t32-r32-s1-fk-d40", "k4c32-v2c32-r64-s1-fk-fv-d8"}) {
    const CacheConfig config = config_of(text);
    const std::size_t D = config.rollback_depth, dim = 32, heads = 2, row = heads * dim, capacity = 400;
    const CacheShape shape{2, heads, dim, capacity};
    BasicKVCache cache(shape, config);
    std::vector<float> k, v;  // the surviving tokens: (length, heads, dim)
    std::mt19937 rng(std::hash<std::string>{}(text));
    std::size_t length = 0, longest = 0;
    for (int step = 0; step < 60; ++step) {
      const std::size_t chunk = std::min<std::size_t>(1 + rng() % 24, capacity - length);
      const auto nk = kvq::test::outlier_keys(chunk, heads, dim, 3, 6.0f, unsigned(rng())),
                 nv = kvq::test::normal_vector(chunk * row, unsigned(rng()));
      k.resize(length * row);
      v.resize(length * row);
      k.insert(k.end(), nk.begin(), nk.end());
      v.insert(v.end(), nv.begin(), nv.end());
      append_all(cache, k, v, length, length + chunk);
      length += chunk;
      longest = std::max(longest, length);
      if (step % 3 == 2 || length + 24 >= capacity) {  // roll back somewhere in [longest - D, length)
        const std::size_t floor = longest > D ? longest - D : 0;
        if (floor >= length) continue;
        const std::size_t keep = rng() % 2 == 0 ? floor : floor + rng() % (length - floor);
        std::size_t before = 0;
        for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values}) before += cache.quantized_end(t, 0);
        cache.truncate(keep);
        for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values}) before -= cache.quantized_end(t, 0);
        reopened += before != 0;
        ++rollbacks;
        length = keep;
      }
      BasicKVCache fresh(shape, config);
      append_all(fresh, k, v, 0, length);
      const std::string where =
          std::string(text) + " step " + std::to_string(step) + " length " + std::to_string(length);
      kvq::test::expect_same_state(cache, fresh, where);
      for (std::size_t l = 0; l < 2; ++l) {  // the newest R keys and values are full precision
        for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values}) {
          const std::size_t end = cache.quantized_end(t, l);
          if (kvq::flushes(config.flush, t == kvq::Tensor::keys))  // fewer than R since the last flush
            EXPECT_TRUE(end >= length || length - end < config.window) << where;
          else
            EXPECT_TRUE(end == config.sinks || end + config.window <= length) << where;
        }
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
  EXPECT_GE(rollbacks, 100u);
  EXPECT_GE(reopened, 50u) << "most rollbacks must re-open quantized rows";
}

// The case that needed this: 105 tokens, window 8, roll back 5 and continue with other tokens.
// truncate used to keep positions quantized (3 full-precision values left) and the cache then
// differed from one that saw only the accepted tokens.
TEST(KVCacheRollback, ReappendingDifferentTokensAfterARollback) {
  const CacheShape shape{1, 2, 32, 256};
  const CacheConfig config = config_of("k4c8-v2t8-r8-s0");
  const std::size_t row = 2 * 32;
  const auto k = kvq::test::outlier_keys(110, 2, 32, 5, 8.0f, 51), v = kvq::test::normal_vector(110 * row, 52);
  const auto k2 = kvq::test::outlier_keys(110, 2, 32, 5, 8.0f, 53), v2 = kvq::test::normal_vector(110 * row, 54);
  BasicKVCache cache(shape, config);
  append_all(cache, k, v, 0, 105);
  cache.truncate(100);
  EXPECT_EQ(cache.quantized_end(kvq::Tensor::values, 0), 92u) << "the newest 8 values are full precision again";
  EXPECT_EQ(cache.quantized_end(kvq::Tensor::keys, 0), 88u);
  std::vector<float> ka(k.begin(), k.begin() + 100 * row), va(v.begin(), v.begin() + 100 * row);
  ka.insert(ka.end(), k2.begin(), k2.begin() + 10 * row);  // 10 different tokens
  va.insert(va.end(), v2.begin(), v2.begin() + 10 * row);
  append_all(cache, ka, va, 100, 110);
  BasicKVCache fresh(shape, config);
  append_all(fresh, ka, va, 0, 110);
  kvq::test::expect_same_state(cache, fresh, "after rollback and 10 different tokens");
}

TEST(KVCacheRollback, CutsBelowTheSinksAndToZero) {
  const CacheShape shape{1, 1, 16, 128};
  const CacheConfig config = config_of("k4c8-v2t8-r0-s4");
  const auto k = kvq::test::normal_vector(40 * 16, 61), v = kvq::test::normal_vector(40 * 16, 62);
  for (const std::size_t keep : {0u, 2u, 4u, 5u}) {
    BasicKVCache cache(shape, config), fresh(shape, config);
    append_all(cache, k, v, 0, 18);
    cache.truncate(keep);
    append_all(fresh, k, v, 0, keep);
    kvq::test::expect_same_state(cache, fresh, "kept " + std::to_string(keep));
  }
}

TEST(KVCacheRollback, DeeperCutsThrowAndChangeNothing) {
  const CacheShape shape{2, 2, 64, 300};
  const auto k = kvq::test::outlier_keys(200, 2, 64, 3, 8.0f, 71), v = kvq::test::normal_vector(200 * 128, 72);
  auto expect_rejected = [&](const char* text, std::size_t keep, const std::string& needle) {
    SCOPED_TRACE(std::string(text) + " truncate(" + std::to_string(keep) + ")");
    BasicKVCache cache(shape, config_of(text));
    append_all(cache, k, v, 0, 200);
    const BasicKVCache before = cache;
    try {
      cache.truncate(keep);
      ADD_FAILURE() << "no error";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    kvq::test::expect_same_state(cache, before, "unchanged");
    EXPECT_EQ(cache.rollback_floor(kvq::Tensor::values, 1), before.rollback_floor(kvq::Tensor::values, 1));
  };
  // 200 tokens, r20, 3 sinks, D = 16: keys packed to 163, copies of the last 48 from 115, their
  // ring (52 rows) from 148; values packed to 180, copies of the last 17 from 163, ring from 179.
  expect_rejected("k4c32-v2t32-r20-s3", 182,
                  "layer 0: truncating from 200 to 182 tokens would re-open quantized value positions [162, 180), but "
                  "full-precision rows are kept only from position 163 (rollback depth 16)");
  expect_rejected("k4c32-v2t32-r20-s3-d0", 198, "value positions [178, 180)");
  expect_rejected("k4c32-v16-r20-s3-d0", 180, "key positions [131, 163)");
  BasicKVCache cache(shape, config_of("k4c32-v16-r20-s3-d0"));
  append_all(cache, k, v, 0, 200);
  cache.truncate(190);  // pending rows only: no rollback depth needed
  EXPECT_EQ(cache.length(1), 190u);
  // After a rollback the reach is counted from the longest length held, not the current one.
  BasicKVCache twice(shape, config_of("k4c32-v2t32-r20-s3"));
  append_all(twice, k, v, 0, 200);
  twice.truncate(190);
  EXPECT_THROW(twice.truncate(182), kvq::Error);
  twice.truncate(184);
  EXPECT_EQ(twice.length(0), 184u);
}

// Deeper than D below the longest length, a cut that re-opens nothing still works: reading is
// exact, only ring slots whose old (packed) rows are gone differ from a fresh cache (zero).
TEST(KVCacheRollback, DeepCutsThatReopenNothingStayExact) {
  const CacheShape shape{1, 2, 64, 300};
  const CacheConfig config = config_of("k4c32-v16-r20-s3-d0");
  const auto k = kvq::test::outlier_keys(200, 2, 64, 3, 8.0f, 81), v = kvq::test::normal_vector(200 * 128, 82);
  BasicKVCache cache(shape, config), fresh(shape, config);
  append_all(cache, k, v, 0, 200);
  cache.truncate(190);  // keys stay packed to 163; ring rows of 138..147 are gone
  append_all(fresh, k, v, 0, 190);
  EXPECT_EQ(cache.quantized_end(kvq::Tensor::keys, 0), fresh.quantized_end(kvq::Tensor::keys, 0));
  EXPECT_TRUE(stored_rows(cache, 0) == stored_rows(fresh, 0));
  EXPECT_EQ(kvq::test::reference_output(cache, 0), kvq::test::reference_output(fresh, 0));
  EXPECT_TRUE(kvq::test::same_memory(cache.memory(), fresh.memory()));
  append_all(cache, k, v, 190, 200);  // the lost slots are written again: the bytes agree again
  BasicKVCache longer(shape, config);
  append_all(longer, k, v, 0, 200);
  kvq::test::expect_same_state(cache, longer, "after re-appending the cut tokens");
}

TEST(KVCacheRollback, HistoryIsCountedInAllocatedBytes) {
  const CacheShape shape{2, 4, 128, 1024};
  const BasicKVCache with(shape, config_of("k4c32-v2t32-r128-s1")), without(shape, config_of("k4c32-v2t32-r128-s1-d0"));
  // D + G = 48 key and D + 1 = 17 value rows per layer and head, f16
  EXPECT_EQ(with.allocated_bytes() - without.allocated_bytes(), 2 * 4 * (48 + 17) * 128 * 2u);
  EXPECT_TRUE(with.stored_bytes() == without.stored_bytes())
      << "the stream layout does not depend on the rollback depth";
}

TEST(KVCachePolicy, CompiledPolicyMatchesItsRuntimeDescription) {
  kvq::KVCache<kvq::K4V2> typed(CacheShape{1, 1, 64, 256});
  EXPECT_EQ(kvq::to_string(typed.config()), "k4c32-v2t32-r128-s0");
  EXPECT_THROW(kvq::KVCache<kvq::K4V2>(CacheShape{1, 1, 16, 256}), kvq::Error);  // group 32 > head_dim 16
}

}  // namespace
