// attend(): blocks of query positions (speculative verification over stored tokens, prefill
// chunks with new tokens attended exactly) and batches of requests, against the Eigen oracle;
// bit-identity with decode_attention, across batching and thread counts; bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

namespace {

using kvq::AttentionRequest;
using kvq::BasicKVCache;
using kvq::CacheShape;
using kvq::Tier;
using kvq::test::relative_error;

BasicKVCache filled(const char* config, std::size_t kv_heads, std::size_t dim, std::size_t length, unsigned seed,
                    std::size_t block = 0) {
  CacheShape shape{2, kv_heads, dim, 1200};
  shape.block_tokens = block;
  BasicKVCache cache(shape, kvq::parse_cache_config(config));
  const auto k = kvq::test::outlier_keys(length, kv_heads, dim, 3, 4.0f, seed);
  const auto v = kvq::test::normal_vector(length * kv_heads * dim, seed + 1);
  for (std::size_t l = 0; l < 2; ++l) cache.append(l, 0, k, v);
  return cache;
}

/// The oracle with new tokens: the cache's rows before p0 as stored, then the new rows exact.
std::vector<float> oracle_with_new(const BasicKVCache& cache, std::size_t layer, std::size_t p0, std::size_t tokens,
                                   const std::vector<float>& q, const std::vector<float>& nk, const std::vector<float>& nv) {
  const std::size_t dim = cache.shape().head_dim, kv_heads = cache.shape().kv_heads, heads = q.size() / tokens / dim;
  const std::size_t group = heads / kv_heads;
  const bool pre = cache.config().key_rope == kvq::KeyRope::pre;
  std::vector<float> out(q.size()), row(dim);
  for (std::size_t kvh = 0; kvh < kv_heads; ++kvh) {
    const kvq::HeadTensors stored = kvq::read_head(cache, layer, kvh);
    kvq::MatrixD keys(p0 + tokens, dim), values(p0 + tokens, dim);
    keys.topRows(p0) = stored.keys.topRows(p0);
    values.topRows(p0) = stored.values.topRows(p0);
    for (std::size_t t = 0; t < tokens; ++t) {
      row.assign(nk.begin() + (t * kv_heads + kvh) * dim, nk.begin() + (t * kv_heads + kvh + 1) * dim);
      if (pre) cache.rope().rotate(row.data(), p0 + t);
      for (std::size_t c = 0; c < dim; ++c) {
        keys(p0 + t, c) = row[c];
        values(p0 + t, c) = nv[(t * kv_heads + kvh) * dim + c];
      }
    }
    for (std::size_t g = 0; g < group; ++g) {
      const std::size_t h = kvh * group + g;
      kvq::MatrixD queries(tokens, dim);
      for (std::size_t t = 0; t < tokens; ++t) {
        row.assign(q.begin() + (t * heads + h) * dim, q.begin() + (t * heads + h + 1) * dim);
        if (pre) cache.rope().rotate(row.data(), p0 + t);
        for (std::size_t c = 0; c < dim; ++c) queries(t, c) = row[c];
      }
      const kvq::MatrixD o = kvq::attend(queries, keys, values, p0);
      for (std::size_t t = 0; t < tokens; ++t)
        for (std::size_t c = 0; c < dim; ++c) out[(t * heads + h) * dim + c] = float(o(t, c));
    }
  }
  return out;
}

const char* const kConfigs[] = {"k4c32-v2t32-r20-s3", "k4c32-v2t32-r16-s0-post", "k8c32-v8t32-r8-s1-f32", "k2c16-v4t32-r0-s2",
                                "k16-v16-r0-s0-post", "k3c8-v5t16-r5-s0"};

// Speculative verification: T stored positions, every query seeing the prefix and the drafts
// before it; groups of up to 64 rows per KV head, and more (T x GQA = 5 x 16 = 80 rows).
TEST(Attend, StoredBlocksOfPositionsMatchTheOracle) {
  for (const char* text : kConfigs)
    for (const auto& [tokens, group] : {std::pair<std::size_t, std::size_t>{5, 2}, {1, 4}, {7, 3}, {5, 16}}) {
      const std::size_t kv_heads = 2, dim = 64, length = 533, p0 = length - tokens;
      const BasicKVCache cache = filled(text, kv_heads, dim, length, 5, 64);
      const auto q = kvq::test::normal_vector(tokens * kv_heads * group * dim, 6, 0.4f);
      std::vector<float> out(q.size()), oracle(q.size()), integer(q.size());
      kvq::attend({.cache = &cache, .layer = 1, .first_position = p0, .tokens = tokens, .queries = q, .out = out});
      kvq::reference_attention_block(cache, 1, p0, tokens, q, oracle);
      EXPECT_LT(relative_error(out, oracle), 1e-5) << text << " T=" << tokens << " group " << group;
      kvq::attend({.cache = &cache, .layer = 1, .first_position = p0, .tokens = tokens, .queries = q, .out = integer},
                  {.tier = Tier::integer});
      EXPECT_LT(relative_error(integer, oracle), 2.5e-2) << text << " T=" << tokens << " group " << group;
    }
}

// Prefill chunks: the stored prefix as stored, the chunk's own keys and values exact and causal.
TEST(Attend, PrefillChunksAttendTheirNewTokensExactly) {
  for (const char* text : kConfigs)
    for (const std::size_t p0 : {0u, 3u, 200u, 517u}) {
      const std::size_t kv_heads = 2, dim = 64, group = 3, tokens = 37;
      const BasicKVCache cache = filled(text, kv_heads, dim, p0, 7, 128);
      const auto q = kvq::test::normal_vector(tokens * kv_heads * group * dim, 8, 0.4f);
      const auto nk = kvq::test::outlier_keys(tokens, kv_heads, dim, 3, 4.0f, 9);
      const auto nv = kvq::test::normal_vector(tokens * kv_heads * dim, 10);
      std::vector<float> out(q.size());
      kvq::attend({.cache = &cache, .layer = 0, .first_position = p0, .tokens = tokens, .queries = q, .new_keys = nk,
                   .new_values = nv, .out = out});
      EXPECT_LT(relative_error(out, oracle_with_new(cache, 0, p0, tokens, q, nk, nv)), 1e-5) << text << " p0=" << p0;
    }
}

// What exact chunk attention buys: the prompt attending to its own keys before they are packed
// (KIVI's prefill) is closer to full precision than appending first and attending to the packed
// prompt, which is what the cache alone offers.
TEST(Attend, ExactChunksBeatAttendingToThePackedPrompt) {
  const std::size_t kv_heads = 2, dim = 64, group = 2, tokens = 256;
  const auto k = kvq::test::outlier_keys(tokens, kv_heads, dim, 3, 4.0f, 11);
  const auto v = kvq::test::normal_vector(tokens * kv_heads * dim, 12);
  const auto q = kvq::test::normal_vector(tokens * kv_heads * group * dim, 13, 0.4f);
  CacheShape shape{1, kv_heads, dim, 512};
  BasicKVCache exact(shape, kvq::full_precision_config()), packed(shape, kvq::parse_cache_config("k2c32-v2t32-r16-s0"));
  exact.append(0, 0, k, v);
  packed.append(0, 0, k, v);
  std::vector<float> truth(q.size()), chunk(q.size()), after(q.size());
  kvq::reference_attention_block(exact, 0, 0, tokens, q, truth);
  BasicKVCache empty(shape, kvq::parse_cache_config("k2c32-v2t32-r16-s0"));
  kvq::attend({.cache = &empty, .first_position = 0, .tokens = tokens, .queries = q, .new_keys = k, .new_values = v, .out = chunk});
  kvq::attend({.cache = &packed, .first_position = 0, .tokens = tokens, .queries = q, .out = after});
  EXPECT_LT(relative_error(chunk, truth), 1e-5);
  EXPECT_GT(relative_error(after, truth), 1e-2);
}

// A batch of requests over caches of different lengths and configurations: each output equals the
// request run alone, one position equals decode_attention, and threads change no bit.
TEST(Attend, BatchesAreBitIdenticalToSingleRequestsAndDecode) {
  const BasicKVCache a = filled("k4c32-v2t32-r20-s3", 2, 64, 700, 14, 64), b = filled("k4c32-v2t32-r16-s0-post", 2, 64, 301, 15);
  const BasicKVCache c = filled("k16-v16-r0-s0-post", 2, 64, 90, 16);
  const auto qa = kvq::test::normal_vector(4 * 4 * 64, 17, 0.4f), qb = kvq::test::normal_vector(1 * 4 * 64, 18, 0.4f);
  const auto qc = kvq::test::normal_vector(3 * 4 * 64, 19, 0.4f);
  const auto nk = kvq::test::normal_vector(3 * 2 * 64, 20), nv = kvq::test::normal_vector(3 * 2 * 64, 21);
  for (const Tier tier : {Tier::exact, Tier::integer}) {
    std::vector<float> oa(qa.size()), ob(qb.size()), oc(qc.size());
    const AttentionRequest batch[] = {
        {.cache = &a, .layer = 1, .first_position = 696, .tokens = 4, .queries = qa, .out = oa},
        {.cache = &b, .layer = 0, .first_position = 300, .tokens = 1, .queries = qb, .out = ob},
        {.cache = &c, .layer = 0, .first_position = 90, .tokens = 3, .queries = qc, .new_keys = nk, .new_values = nv, .out = oc},
    };
    kvq::ThreadPool threads(2);
    kvq::attend(batch, {.tier = tier, .chunk_tokens = 128, .executor = &threads});
    for (std::size_t i = 0; i < 3; ++i) {
      AttentionRequest alone = batch[i];
      std::vector<float> out(alone.out.size());
      alone.out = out;
      kvq::attend(alone, {.tier = tier, .chunk_tokens = 128});
      EXPECT_TRUE(std::equal(out.begin(), out.end(), batch[i].out.begin())) << "request " << i << " " << kvq::to_string(tier);
    }
    std::vector<float> decoded(qb.size());
    kvq::decode_attention(b, 0, 300, qb, decoded, {.tier = tier, .chunk_tokens = 128});
    EXPECT_EQ(decoded, ob);
  }
}

TEST(Attend, BadRequestsThrowBeforeWritingAnything) {
  const BasicKVCache cache = filled("k4c32-v2t32-r20-s3", 2, 64, 100, 22);
  const auto q = kvq::test::normal_vector(2 * 4 * 64, 23);
  auto nk = kvq::test::normal_vector(2 * 2 * 64, 24);
  const auto nv = kvq::test::normal_vector(2 * 2 * 64, 25);
  std::vector<float> out(q.size() + 64, 7.0f), other(q.size(), 7.0f);
  auto expect_error = [&](const std::vector<AttentionRequest>& requests, kvq::ErrorCode code, const std::string& part) {
    try {
      kvq::attend(requests);
      ADD_FAILURE() << "accepted: " << part;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; }));
    EXPECT_TRUE(std::all_of(other.begin(), other.end(), [](float x) { return x == 7.0f; }));
  };
  const AttentionRequest good{.cache = &cache, .first_position = 98, .tokens = 2, .queries = q,
                              .out = std::span(out).first(q.size())};
  AttentionRequest r = good;
  r.tokens = 0;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "zero query tokens");
  r = good;
  r.first_position = 99;  // positions 99 and 100: 100 is not stored
  expect_error({r}, kvq::ErrorCode::invalid_argument, "need them appended first");
  r = good;
  r.first_position = 101;
  r.new_keys = nk;
  r.new_values = nv;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "new tokens from position 101");
  nk[70] = std::nanf("");
  r.first_position = 100;
  expect_error({good, r}, kvq::ErrorCode::non_finite_input, "request 1: new keys of token 0, KV head 1, channel 6");
  nk[70] = 0.0f;
  r.new_values = std::span(nv).first(64);
  expect_error({r}, kvq::ErrorCode::shape_mismatch, "are not 2 tokens");
  r = good;
  r.out = std::span(out).first(100);
  expect_error({r}, kvq::ErrorCode::shape_mismatch, "do not form");
  AttentionRequest second = good;
  second.out = std::span(out).subspan(64, q.size());
  expect_error({good, second}, kvq::ErrorCode::invalid_argument, "requests 0 and 1 write overlapping outputs");
  std::vector<float> both(q.begin(), q.end());
  r = good;
  r.queries = both;
  r.out = both;
  try {
    kvq::attend(r);
    ADD_FAILURE() << "an output aliasing its queries was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("overlaps the queries"), std::string::npos) << e.what();
  }
}

}  // namespace
