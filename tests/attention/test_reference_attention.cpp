// Reference attention: against a naive triple loop, pre-RoPE storage against plain post-RoPE
// attention, and the thesis on synthetic keys with an outlier channel.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/random.hpp"

namespace {

using kvq::BasicKVCache;
using kvq::CacheShape;

// out[h] = softmax(q_h . k_j / sqrt(d)) v_j over j <= pos, with keys/queries given rotated.
std::vector<double> naive_attention(const std::vector<float>& q, const std::vector<float>& k,
                                    const std::vector<float>& v, std::size_t heads, std::size_t kv_heads,
                                    std::size_t dim, std::size_t pos) {
  std::vector<double> out(heads * dim, 0.0);
  for (std::size_t h = 0; h < heads; ++h) {
    const std::size_t g = h / (heads / kv_heads);
    std::vector<double> s(pos + 1);
    double top = -1e300;
    for (std::size_t j = 0; j <= pos; ++j) {
      double acc = 0;
      for (std::size_t c = 0; c < dim; ++c) acc += double(q[h * dim + c]) * k[(j * kv_heads + g) * dim + c];
      s[j] = acc / std::sqrt(double(dim));
      top = std::max(top, s[j]);
    }
    double sum = 0;
    for (double& x : s) sum += (x = std::exp(x - top));
    for (std::size_t j = 0; j <= pos; ++j)
      for (std::size_t c = 0; c < dim; ++c) out[h * dim + c] += s[j] / sum * v[(j * kv_heads + g) * dim + c];
  }
  return out;
}

struct Case {
  std::size_t heads, kv_heads, dim, tokens;
};

TEST(ReferenceAttention, MatchesANaiveLoopWithGqaAndMqa) {
  for (const Case c : {Case{4, 4, 8, 17}, Case{8, 2, 16, 33}, Case{6, 1, 12, 5}, Case{8, 1, 64, 70}}) {
    BasicKVCache cache(CacheShape{1, c.kv_heads, c.dim, 128}, kvq::parse_cache_config("k16-v16-r0-s0-post-f32"));
    const auto k = kvq::test::normal_vector(c.tokens * c.kv_heads * c.dim, 1);
    const auto v = kvq::test::normal_vector(k.size(), 2);
    const auto q = kvq::test::normal_vector(c.heads * c.dim, 3, 2.0f);
    cache.append(0, 0, k, v);
    for (std::size_t pos : {std::size_t{0}, c.tokens / 2, c.tokens - 1}) {
      std::vector<float> out(q.size());
      kvq::reference_attention(cache, 0, pos, q, out);
      const auto expect = naive_attention(q, k, v, c.heads, c.kv_heads, c.dim, pos);
      for (std::size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], expect[i], 1e-5) << "heads " << c.heads;
    }
  }
}

TEST(ReferenceAttention, BlockIsCausalAndEqualsDecodeSteps) {
  BasicKVCache cache(CacheShape{2, 2, 16, 64}, kvq::parse_cache_config("k4c8-v4t16-r4-s1"));
  const std::size_t T = 20, heads = 4, row = 2 * 16;
  const auto k = kvq::test::normal_vector(T * row, 4), v = kvq::test::normal_vector(T * row, 5);
  const auto q = kvq::test::normal_vector(T * heads * 16, 6);
  cache.append(1, 0, k, v);
  std::vector<float> block(q.size()), step(heads * 16);
  kvq::reference_attention_block(cache, 1, 0, T, q, block);
  for (std::size_t t = 0; t < T; ++t) {
    kvq::reference_attention(cache, 1, t, std::span(q).subspan(t * heads * 16, heads * 16), step);
    for (std::size_t i = 0; i < step.size(); ++i) EXPECT_FLOAT_EQ(block[t * heads * 16 + i], step[i]);
  }
}

TEST(ReferenceAttention, PreRopeStorageMatchesPlainPostRopeAttention) {
  const std::size_t dim = 32, kvh = 2, heads = 4, T = 90;
  for (auto style : {kvq::RopeStyle::adjacent_pairs, kvq::RopeStyle::half_split}) {
    CacheShape shape{1, kvh, dim, 128, style, 10000.0f};
    const auto k = kvq::test::outlier_keys(T, kvh, dim, 4, 6.0f, 7), v = kvq::test::normal_vector(T * kvh * dim, 8);
    const auto q = kvq::test::normal_vector(heads * dim, 9, 2.0f);
    kvq::RopeTable rope(shape.rope(), 128);
    auto k_rot = k;
    for (std::size_t t = 0; t < T; ++t) rope.rotate_heads(std::span(k_rot).subspan(t * kvh * dim, kvh * dim), t);
    auto q_rot = q;
    rope.rotate_heads(q_rot, T - 1);
    const auto expect = naive_attention(q_rot, k_rot, v, heads, kvh, dim, T - 1);

    for (const char* text : {"k16-v16-r0-s0-f32", "k8c16-v8t32-r0-s0", "k8c16-v8t32-r16-s2-f32"}) {
      BasicKVCache cache(shape, kvq::parse_cache_config(text));
      cache.append(0, 0, k, v);
      std::vector<float> out(q.size());
      kvq::reference_attention(cache, 0, T - 1, q, out);
      double diff = 0, norm = 0;
      for (std::size_t i = 0; i < out.size(); ++i) {
        diff += (out[i] - expect[i]) * (out[i] - expect[i]);
        norm += expect[i] * expect[i];
      }
      const double tolerance = text[1] == '1' ? 1e-6 : 2e-2;  // exact storage vs 8-bit codes
      EXPECT_LT(std::sqrt(diff / norm), tolerance) << text;
    }
  }
}

TEST(ReferenceAttention, RejectsBadShapes) {
  BasicKVCache cache(CacheShape{1, 2, 8, 16}, kvq::full_precision_config());
  const auto kv = kvq::test::normal_vector(3 * 16, 1);
  cache.append(0, 0, kv, kv);
  std::vector<float> q(3 * 8), out(3 * 8);
  EXPECT_THROW(kvq::reference_attention(cache, 0, 2, q, out), kvq::Error);  // 3 heads over 2 KV heads
  std::vector<float> q4(4 * 8), out4(4 * 8);
  EXPECT_THROW(kvq::reference_attention(cache, 0, 3, q4, out4), kvq::Error);  // position not appended
  EXPECT_THROW(kvq::reference_attention(cache, 1, 0, q4, out4), kvq::Error);  // layer
  EXPECT_NO_THROW(kvq::reference_attention(cache, 0, 2, q4, out4));
  q4[13] = std::numeric_limits<float>::quiet_NaN();  // query head 1, channel 5
  for (auto tier : {kvq::Tier::exact, kvq::Tier::integer}) {
    kvq::DecodeOptions options;
    options.tier = tier;
    try {
      kvq::decode_attention(cache, 0, 2, q4, out4, options);
      ADD_FAILURE() << "a NaN query must be rejected";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::non_finite_input);
      EXPECT_NE(std::string(e.what()).find("query head 1, channel 5"), std::string::npos) << e.what();
    }
  }
  q4[13] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(kvq::reference_attention(cache, 0, 2, q4, out4), kvq::Error);
}

// The thesis on synthetic keys: one large, slowly varying outlier channel per head.
double score_error(const char* config, std::size_t outlier_pair, unsigned seed) {
  const std::size_t dim = 64, T = 256, kvh = 1, heads = 2;
  CacheShape shape{1, kvh, dim, T};
  auto k = kvq::test::outlier_keys(T, kvh, dim, 2 * outlier_pair, 10.0f, seed);
  const auto v = kvq::test::normal_vector(T * dim, seed + 1);
  BasicKVCache exact(shape, kvq::full_precision_config());
  BasicKVCache cache(shape, kvq::parse_cache_config(config));
  exact.append(0, 0, k, v);
  if (cache.config().key_rope == kvq::KeyRope::post) {
    for (std::size_t t = 0; t < T; ++t) exact.rope().rotate(k.data() + t * dim, t);
  }
  cache.append(0, 0, k, v);
  const kvq::HeadTensors truth = kvq::read_head(exact, 0, 0);
  std::vector<kvq::MatrixD> queries;
  for (std::size_t h = 0; h < heads; ++h) {
    kvq::MatrixD q(T, dim);
    const auto raw = kvq::test::normal_vector(T * dim, seed + 10 + unsigned(h));
    for (std::size_t t = 0; t < T; ++t) {
      std::vector<float> row(raw.begin() + long(t * dim), raw.begin() + long((t + 1) * dim));
      exact.rope().rotate(row.data(), t);
      for (std::size_t c = 0; c < dim; ++c) q(t, c) = row[c];
    }
    queries.push_back(q);
  }
  kvq::AttentionErrorAccumulator acc;
  kvq::add_head_errors(acc, cache, 0, 0, truth.keys, truth.values, queries, 0);
  return acc.errors().score_error;
}

TEST(ReferenceAttention, PerChannelPreRopeKeysBeatPostRopeWhichBeatPerToken) {
  for (int bits : {2, 4}) {
    const std::string b = std::to_string(bits);
    const std::string pre = "k" + b + "c32-v16-r0-s0", post = pre + "-post", token = "k" + b + "t32-v16-r0-s0";
    for (unsigned seed : {1u, 2u}) {
      const double e_pre = score_error(pre.c_str(), 1, seed), e_post = score_error(post.c_str(), 1, seed);
      const double e_token = score_error(token.c_str(), 1, seed);
      EXPECT_LT(e_pre, e_post) << bits << " bits";
      EXPECT_LT(e_post, e_token) << bits << " bits";
    }
  }
}

}  // namespace
