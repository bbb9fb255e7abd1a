// Rotated caches (CacheConfig::key_rotation, value_rotation): configuration strings and policies,
// rows stored rotated and read back in the model's space, the error a rotation removes from
// per-token groups with an outlier channel, bad input, files. The kernels' agreement with the
// oracle on rotated caches is in tests/attention (test_decode_attention, test_attend).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/compare.hpp"
#include "support/kernels.hpp"
#include "support/random.hpp"

namespace {

using kvq::BasicKVCache;
using kvq::CacheShape;
using kvq::Rotation;
using kvq::Tensor;

std::string error_of(const std::string& text) {
  try {
    (void)kvq::parse_cache_config(text);
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument);
    return e.what();
  }
  ADD_FAILURE() << text << " was taken";
  return {};
}

TEST(Rotation, ConfigStringsRoundTripAndBadOnesAreRefused) {
  for (const char* text :
       {"k4t32-v2t32-r16-s0-post-hk-hv", "k4c32-v2t32-r16-s0-post-hsk", "k4c32-v2t32-r128-s1-hsv",
        "k2t16-v4t16-r0-s0-post-hk-hsv-f32-d4", "k4t32-v2t32-r16-s0-hk", "k4c32-v2t32-r0-s1-hsk-hv"}) {
    const kvq::CacheConfig c = kvq::parse_cache_config(text);
    EXPECT_EQ(kvq::to_string(c), text);
  }
  const kvq::CacheConfig c = kvq::parse_cache_config("k4t32-v2t32-r16-s0-post-hk-hsv");
  EXPECT_EQ(c.key_rotation, Rotation::hadamard);
  EXPECT_EQ(c.value_rotation, Rotation::signed_hadamard);
  EXPECT_EQ(kvq::parse_cache_config("k4c32-v2t32-r16-s0").key_rotation, Rotation::none);

  EXPECT_NE(error_of("k16-v2t32-r16-s0-post-hk").find("quantized keys"), std::string::npos);
  EXPECT_NE(error_of("k4c32-v16-r16-s0-hv").find("quantized values"), std::string::npos);
  for (const char* text : {"k4c32-v2t32-r16-s0-post-hv-hk", "k4c32-v2t32-r16-s0-post-hk-hsk",
                           "k4c32-v2t32-r16-s0-post-hk-hk", "k4c32-v2t32-r16-s0-hx", "k4c32-v2t32-r16-s0-f32-hv"})
    EXPECT_NE(error_of(text).find("unexpected part"), std::string::npos) << text;

  kvq::CacheConfig bad;
  bad.value_rotation = Rotation(7);
  EXPECT_THROW(kvq::validate(bad), kvq::Error);

  EXPECT_EQ(kvq::to_string(kvq::K4V4RotatedPerToken::config()), "k4t32-v4t32-r128-s0-post-hk-hv");
}

// Rows are stored rotated: the window's f32 rows are exactly H x (up to rounding), read_row
// returns x, and packed rows come back within their quantization error.
TEST(Rotation, RowsAreStoredRotatedAndReadBackInTheModelSpace) {
  for (const char* text :
       {"k4t32-v4t32-r16-s1-post-hk-hsv-f32", "k8c16-v8t16-r16-s1-post-hsk-hv-f32", "k4t32-v4t32-r16-s1-hsk-f32"}) {
    SCOPED_TRACE(text);
    const std::size_t dim = 96, kv_heads = 2, n = 100;  // 96: three blocks of 32
    BasicKVCache cache(CacheShape{1, kv_heads, dim, 128}, kvq::parse_cache_config(text));
    const auto k = kvq::test::outlier_keys(n, kv_heads, dim, 5, 6.0f, 1);
    const auto v = kvq::test::normal_vector(n * kv_heads * dim, 2);
    cache.append(0, 0, k, v);
    for (const Tensor t : {Tensor::keys, Tensor::values}) {
      const std::vector<float>& input = t == Tensor::keys ? k : v;
      const auto rotation = cache.rotation(t);
      if (t == Tensor::values && cache.config().value_rotation == Rotation::none) continue;
      ASSERT_NE(rotation, nullptr);
      for (std::size_t p : {std::size_t(0), std::size_t(40), n - 1}) {  // a sink, a packed row, a window row
        for (std::size_t h = 0; h < kv_heads; ++h) {
          std::vector<float> x(input.begin() + std::ptrdiff_t((p * kv_heads + h) * dim),
                               input.begin() + std::ptrdiff_t((p * kv_heads + h + 1) * dim));
          std::vector<float> model(dim), stored(dim), rotated = x;
          rotation->forward(rotated);
          cache.read_row(t, 0, h, p, model.data());
          cache.read_stored_row(t, 0, h, p, stored.data());
          const double bound = p == 40 ? 0.1 : 1e-6;  // 4- or 8-bit groups (measured up to 0.07); exact rows
          EXPECT_LT(kvq::test::relative_error(model, x), bound) << p;
          EXPECT_LT(kvq::test::relative_error(stored, rotated), bound) << p;
          EXPECT_GT(kvq::test::relative_error(stored, x), 0.5) << p;  // stored rotated, not as given
        }
      }
    }
  }
}

// Per-token keys and values with an outlier channel (12 x the others' spread, as real keys
// have), one group per head vector: its range follows the outlier, so the other channels get
// few levels. The rotation spreads it over the head, and the attention output is closer to the
// exact one. (With groups of 32 only the outlier's group suffers: 0.69x there.) Pre-RoPE keys,
// rotated back before RoPE in the kernels, gain as much as post-RoPE keys, whose query rotates.
TEST(Rotation, CutsTheErrorOfPerTokenGroupsWithAnOutlierChannel) {
  const CacheShape shape{1, 2, 128, 600};
  const std::size_t n = 512, dim = 128;
  auto k = kvq::test::outlier_keys(n, 2, dim, 7, 0.0f, 21), v = kvq::test::normal_vector(n * 2 * dim, 22);
  for (std::size_t i = 7; i < k.size(); i += dim) k[i] *= 12.0f, v[i] *= 12.0f;
  const auto q = kvq::test::normal_vector(8 * dim, 23, 0.3f);
  auto output = [&](const std::string& text, kvq::Tier tier) {
    BasicKVCache cache(shape, kvq::parse_cache_config(text));
    cache.append(0, 0, k, v);
    std::vector<float> out(q.size());
    kvq::DecodeOptions o;
    o.tier = tier;
    kvq::decode_attention(cache, 0, n - 1, q, out, o);
    return out;
  };
  for (const std::string rope : {"-post", ""}) {
    SCOPED_TRACE(rope.empty() ? "pre-RoPE keys" : "post-RoPE keys");
    const std::vector<float> exact = output("k16-v16-r0-s0" + rope + "-f32", kvq::Tier::exact);
    for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer}) {
      const double plain = kvq::test::relative_error(output("k4t128-v2t128-r0-s0" + rope, tier), exact);
      const double rotated = kvq::test::relative_error(output("k4t128-v2t128-r0-s0" + rope + "-hk-hv", tier), exact);
      const double signed_rotated =
          kvq::test::relative_error(output("k4t128-v2t128-r0-s0" + rope + "-hsk-hsv", tier), exact);
      EXPECT_LT(rotated, 0.6 * plain) << rotated << " vs " << plain;                // post-RoPE: 0.41x (0.91 -> 0.37)
      EXPECT_LT(signed_rotated, 0.6 * plain) << signed_rotated << " vs " << plain;  // post-RoPE: 0.40x
    }
  }
}

// A query that would overflow float once scaled (and rotated) is refused before any output is
// written, even when the keys (all zero) bound no score; a smaller one is taken, and the same
// one is refused under a larger softmax scale.
TEST(Rotation, QueriesBeyondFloatOnceScaledOrRotatedAreRefused) {
  const CacheShape shape{1, 1, 64, 40};
  const std::vector<float> zeros(8 * 64, 0.0f), huge(2 * 64, 1e37f), large(2 * 64, 1e33f);
  for (const char* text :
       {"k4t32-v4t32-r0-s0-post-hk", "k16-v16-r0-s0-post", "k4c32-v2t32-r0-s0", "k4t32-v4t32-r0-s0-hk"}) {
    SCOPED_TRACE(text);
    BasicKVCache cache(shape, kvq::parse_cache_config(text));
    cache.append(0, 0, zeros, zeros);
    // Only a post-RoPE rotation rotates the query (a pre-RoPE one rotates keys back).
    const bool query_rotated =
        cache.config().key_rotation != Rotation::none && cache.config().key_rope == kvq::KeyRope::post;
    const std::string rotated = query_rotated ? " and rotated" : "";
    auto refused = [&](const std::vector<float>& q, const kvq::ScoreOptions& scores) {
      std::vector<float> out(q.size(), 7.0f);
      try {
        kvq::decode_attention(cache, 0, 7, q, out, {.scores = scores});
        ADD_FAILURE() << "taken";
      } catch (const kvq::Error& e) {
        EXPECT_EQ(e.code(), kvq::ErrorCode::unrepresentable);
        EXPECT_NE(std::string(e.what()).find("query head 0 at position 7: |q|_1 = "), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("once scaled" + rotated), std::string::npos) << e.what();
      }
      for (const float x : out) EXPECT_EQ(x, 7.0f);
      EXPECT_THROW(
          kvq::attend({.cache = &cache, .layer = 0, .first_position = 7, .tokens = 1, .queries = q, .out = out},
                      {.scores = scores}),
          kvq::Error);
    };
    refused(huge, {});
    kvq::ScoreOptions wide;
    wide.scale = 1e3f;
    refused(large, wide);
    std::vector<float> out(large.size(), 7.0f);
    kvq::decode_attention(cache, 0, 7, large, out);
    for (const float x : out) EXPECT_EQ(x, 0.0f);  // zero keys, zero values: a finite answer
  }
}

// Pre-RoPE keys stored rotated are rotated back in the kernels: keys whose butterflies could sum
// beyond float (f32 window rows of 1e36, rotated into one channel of 8e36) are refused at
// attention, before any output is written, whatever the query.
TEST(Rotation, PreRopeKeysThatWouldOverflowOnceRotatedBackAreRefused) {
  const CacheShape shape{1, 1, 64, 40};
  BasicKVCache cache(shape, kvq::parse_cache_config("k4t32-v4t32-r16-s0-hk-f32"));
  cache.append(0, 0, std::vector<float>(4 * 64, 1e36f), std::vector<float>(4 * 64, 1.0f));
  const std::vector<float> q(2 * 64, 0.0f);
  std::vector<float> out(q.size(), 7.0f);
  try {
    kvq::decode_attention(cache, 0, 3, q, out);
    ADD_FAILURE() << "taken";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unrepresentable);
    EXPECT_NE(std::string(e.what()).find("beyond float's range once rotated back over 64 channels"), std::string::npos)
        << e.what();
  }
  for (const float x : out) EXPECT_EQ(x, 7.0f);
}

// Bad input is reported where the caller put it, and changes nothing; can_append answers what
// append would do with the rows as they will be stored.
TEST(Rotation, BadRowsAreRefusedWhereTheInputHasThemAndChangeNothing) {
  const CacheShape shape{1, 2, 64, 64};
  BasicKVCache cache(shape, kvq::parse_cache_config("k4t32-v2t32-r8-s0-post-hk-hsv"));
  auto k = kvq::test::normal_vector(3 * 2 * 64, 31), v = kvq::test::normal_vector(3 * 2 * 64, 32);
  cache.append(0, 0, std::span(k).first(2 * 64), std::span(v).first(2 * 64));
  const std::vector<std::uint8_t> before = cache.stored_bytes();
  auto refused = [&](const std::vector<float>& keys, const std::vector<float>& values, kvq::ErrorCode code,
                     const std::string& words) {
    std::string why;
    EXPECT_FALSE(cache.can_append(0, 1, keys, values, &why));
    EXPECT_NE(why.find(words), std::string::npos) << why;
    try {
      cache.append(0, 1, keys, values);
      ADD_FAILURE() << "the append was taken";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    EXPECT_EQ(cache.length(0), 1u);
    EXPECT_EQ(cache.stored_bytes(), before);
  };
  std::vector<float> nan_keys = k;
  nan_keys[(1 * 2 + 1) * 64 + 5] = std::numeric_limits<float>::quiet_NaN();  // token 1, head 1, channel 5
  refused(nan_keys, v, kvq::ErrorCode::non_finite_input, "kv head 1, position 2 (key), channel 5");
  // A constant key row within f16's range rotates (H, no signs) into one channel of 8 x the value: beyond it.
  std::vector<float> large = k;
  std::fill(large.begin() + 64, large.begin() + 128, 30000.0f);
  refused(large, v, kvq::ErrorCode::unrepresentable, "channel 0 (rotated): value 240000");
  refused(std::vector<float>(k.begin(), k.end() - 1), v, kvq::ErrorCode::shape_mismatch, "kv heads");
  // And the other way: a spike beyond f16 in one channel spreads to 1/8 of it over the head.
  std::vector<float> spike = k;
  spike[64 + 9] = 70000.0f;
  EXPECT_TRUE(cache.can_append(0, 1, spike, v));
  EXPECT_NO_THROW(cache.append(0, 1, spike, v));
  EXPECT_EQ(cache.length(0), 4u);
}

// An append to an empty one-layer cache whose first value is refused as unrepresentable, with
// `why` in the message: the cache stays empty.
void expect_first_value_refused(BasicKVCache& cache, const std::vector<float>& keys, const std::vector<float>& values,
                                const std::string& why) {
  try {
    cache.append(0, 0, keys, values);
    ADD_FAILURE() << "taken";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unrepresentable);
    EXPECT_NE(std::string(e.what()).find("position 0 (value), channel 0: value"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.length(0), 0u);
}

// f32 rows are rotated only within the rotation's range (butterfly sums of a block of 64 values of
// 1e37 overflow float), and values, stored rotated, only within value_limit() (attention sums up
// to capacity of them): beyond the smaller bound the input value is named, and the cache is left
// as it was; a row at the bound is stored and read back.
TEST(Rotation, InputsBeyondTheRotationsRangeAreRefused) {
  for (const std::size_t capacity : {4u, 40u}) {  // the rotation's bound is the smaller, then the sums'
    SCOPED_TRACE(capacity);
    const CacheShape shape{1, 1, 64, capacity};
    BasicKVCache cache(shape, kvq::parse_cache_config("k4t32-v4t32-r16-s0-post-hk-hv-f32"));
    const float norm_limit = cache.rotation(kvq::Tensor::values)->max_block_norm();
    EXPECT_EQ(cache.value_limit() < norm_limit, capacity == 40);
    std::vector<float> k(64, 1.0f), v(64, 1e37f);
    expect_first_value_refused(cache, k, v,
                               capacity == 4 ? "has an L2 norm beyond FLT_MAX / (2 sqrt 64)"
                                             : "L2 norm is beyond FLT_MAX / (2 x capacity 40)");
    std::fill(v.begin(), v.end(), std::min(norm_limit, cache.value_limit()) / 8 * (1 - 1e-6f));  // norm 8x
    cache.append(0, 0, k, v);
    std::vector<float> row(64);
    cache.read_row(kvq::Tensor::values, 0, 0, 0, row.data());
    for (std::size_t c = 0; c < 64; ++c) EXPECT_NEAR(row[c] / v[c], 1.0f, 1e-5f) << c;
  }
}

// Attention adds up to capacity values with weights up to 1: f32 values beyond value_limit()
// (FLT_MAX / (2 capacity)) are refused by name and leave the cache as it was; values at the bound
// attend to a finite output equal to the oracle's.
TEST(Rotation, ValuesBeyondWhatAttentionSumsAreRefused) {
  const CacheShape shape{1, 1, 64, 4096};
  BasicKVCache cache(shape, kvq::parse_cache_config("k16-v16-r0-s0-f32"));
  const std::vector<float> k(200 * 64, 0.0f);
  std::vector<float> v(200 * 64, 1e37f);
  expect_first_value_refused(cache, k, v, "is beyond FLT_MAX / (2 x capacity 4096)");
  std::fill(v.begin(), v.end(), cache.value_limit() * (1 - 1e-6f));
  cache.append(0, 0, k, v);
  const std::vector<float> q(2 * 64, 1.0f);
  std::vector<float> out(q.size()), ref(q.size());
  kvq::decode_attention(cache, 0, 199, q, out);
  kvq::reference_attention(cache, 0, 199, q, ref);
  for (std::size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i] / ref[i], 1.0f, 1e-5f) << i;
}

// A file keeps the rotation in its configuration text; the loaded cache attends identically.
TEST(Rotation, FilesKeepTheRotation) {
  for (const char* text : {"k4t32-v2t32-r16-s1-post-hk-hsv", "k4t32-v2t32-r16-s1-hsk"}) {
    SCOPED_TRACE(text);
    const CacheShape shape{2, 2, 64, 300};
    BasicKVCache cache(shape, kvq::parse_cache_config(text));
    const auto k = kvq::test::normal_vector(200 * 2 * 64, 41), v = kvq::test::normal_vector(200 * 2 * 64, 42);
    for (std::size_t l = 0; l < 2; ++l) cache.append(l, 0, k, v);
    std::stringstream file;
    kvq::save(cache, file);
    const BasicKVCache loaded = kvq::load(file);
    EXPECT_EQ(loaded.config(), cache.config());
    EXPECT_EQ(loaded.stored_bytes(), cache.stored_bytes());
    const auto q = kvq::test::normal_vector(4 * 64, 43);
    std::vector<float> a(q.size()), b(q.size());
    kvq::decode_attention(cache, 1, 199, q, a);
    kvq::decode_attention(loaded, 1, 199, q, b);
    EXPECT_EQ(a, b);
  }
}

}  // namespace
