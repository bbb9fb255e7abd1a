// attend(): blocks of query positions (speculative verification over stored tokens, prefill
// chunks with new tokens attended exactly) and batches of requests, against the Eigen oracle;
// bit-identity with decode_attention, across batching and thread counts; bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/compare.hpp"
#include "support/kernels.hpp"
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
                                   const std::vector<float>& q, const std::vector<float>& nk,
                                   const std::vector<float>& nv, const kvq::ScoreOptions& rule = {}) {
  std::vector<float> out(q.size());
  kvq::reference_prefill_attention(cache, layer, p0, tokens, q, nk, nv, out, rule);
  return out;
}

const char* const kConfigs[] = {
    "k4c32-v2t32-r20-s3",    "k4c32-v2t32-r16-s0-post", "k8c32-v8t32-r8-s1-f32",      "k2c16-v4t32-r0-s2",
    "k16-v16-r0-s0-post",    "k3c8-v5t16-r5-s0",        "k3c32o1-v2t16o1-r20-s3",     "k4t32-v2t32-r16-s1-post-hk-hsv",
    "k4c32-v2t32-r20-s3-hv", "k4t32-v2t32-r16-s1-hsk",  "k4c32-v2t32-r64-s3-fk-post", "k2c32-v4t32-r64-s1-fk-fv"};

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
      kvq::attend({.cache = &cache,
                   .layer = 0,
                   .first_position = p0,
                   .tokens = tokens,
                   .queries = q,
                   .new_keys = nk,
                   .new_values = nv,
                   .out = out});
      EXPECT_LT(relative_error(out, oracle_with_new(cache, 0, p0, tokens, q, nk, nv)), 1e-5) << text << " p0=" << p0;
    }
}

// Prefill chunks of 1 to 512 tokens over a stored prefix, on head dims 64 and 96 (96: no AVX-512
// kernel), GQA 1, 3 and 8, with sinks, windows and a sliding window, in both tiers.
TEST(Attend, PrefillChunksOfEverySizeOnAwkwardShapes) {
  struct Shape {
    std::size_t kv_heads, dim, group;
  };
  for (const char* text : {"k4c32-v2t32-r20-s3", "k4c32-v2t32-r16-s0-post", "k16-v16-r0-s1-post"})
    for (const Shape& shape : {Shape{2, 96, 3}, Shape{1, 64, 8}, Shape{3, 64, 1}})
      for (const std::size_t tokens : {1u, 3u, 16u, 128u, 512u}) {
        if (tokens == 512 && shape.dim != 64) continue;  // the oracle in double is the slow part
        const std::size_t p0 = 300, heads = shape.kv_heads * shape.group;
        const BasicKVCache cache = filled(text, shape.kv_heads, shape.dim, p0, 41, 64);
        const auto q = kvq::test::normal_vector(tokens * heads * shape.dim, 42, 0.4f);
        const auto nk = kvq::test::outlier_keys(tokens, shape.kv_heads, shape.dim, 3, 4.0f, 43);
        const auto nv = kvq::test::normal_vector(tokens * shape.kv_heads * shape.dim, 44);
        for (const bool windowed : {false, true}) {
          kvq::ScoreOptions rule;
          if (windowed) rule.window = 200;
          const auto oracle = oracle_with_new(cache, 0, p0, tokens, q, nk, nv, rule);
          const std::string what = std::string(text) + " dim " + std::to_string(shape.dim) + " group " +
                                   std::to_string(shape.group) + " T=" + std::to_string(tokens) +
                                   (windowed ? " window" : "");
          for (const Tier tier : {Tier::exact, Tier::integer}) {
            std::vector<float> out(q.size());
            kvq::attend({.cache = &cache,
                         .layer = 0,
                         .first_position = p0,
                         .tokens = tokens,
                         .queries = q,
                         .new_keys = nk,
                         .new_values = nv,
                         .out = out},
                        {.tier = tier, .chunk_tokens = 128, .scores = rule});
            EXPECT_LT(relative_error(out, oracle), tier == Tier::exact ? 1e-5 : 2.5e-2)
                << what << " " << kvq::to_string(tier);
          }
        }
      }
}

// A prompt attended in chunks of different sizes (each chunk exact, then appended) gives the
// same outputs as in one chunk when the cache stores what it is given (fp32 rows).
TEST(Attend, ChunkSizesAgreeOnALosslessCache) {
  const std::size_t kv_heads = 2, dim = 64, group = 4, heads = kv_heads * group, tokens = 300;
  const auto q = kvq::test::normal_vector(tokens * heads * dim, 45, 0.4f);
  const auto k = kvq::test::outlier_keys(tokens, kv_heads, dim, 3, 4.0f, 46);
  const auto v = kvq::test::normal_vector(tokens * kv_heads * dim, 47);
  auto run = [&](std::size_t chunk) {
    BasicKVCache cache(CacheShape{1, kv_heads, dim, 512}, kvq::parse_cache_config("k16-v16-r0-s0-f32"));
    std::vector<float> out(q.size());
    for (std::size_t p = 0; p < tokens; p += chunk) {
      const std::size_t n = std::min(chunk, tokens - p);
      const auto rows = [&](const std::vector<float>& x, std::size_t width) {
        return std::span(x).subspan(p * width, n * width);
      };
      kvq::attend({.cache = &cache,
                   .first_position = p,
                   .tokens = n,
                   .queries = rows(q, heads * dim),
                   .new_keys = rows(k, kv_heads * dim),
                   .new_values = rows(v, kv_heads * dim),
                   .out = std::span(out).subspan(p * heads * dim, n * heads * dim)});
      cache.append(0, p, rows(k, kv_heads * dim), rows(v, kv_heads * dim));
    }
    return out;
  };
  const auto whole = run(tokens);
  for (const std::size_t chunk : {1u, 7u, 64u, 128u}) EXPECT_LT(relative_error(run(chunk), whole), 1e-6) << chunk;
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
  kvq::attend({.cache = &empty,
               .first_position = 0,
               .tokens = tokens,
               .queries = q,
               .new_keys = k,
               .new_values = v,
               .out = chunk});
  kvq::attend({.cache = &packed, .first_position = 0, .tokens = tokens, .queries = q, .out = after});
  EXPECT_LT(relative_error(chunk, truth), 1e-5);
  EXPECT_GT(relative_error(after, truth), 1e-2);
}

// A batch of requests over caches of different lengths and configurations: each output equals the
// request run alone, one position equals decode_attention, and threads change no bit.
TEST(Attend, BatchesAreBitIdenticalToSingleRequestsAndDecode) {
  const BasicKVCache a = filled("k4c32-v2t32-r20-s3", 2, 64, 700, 14, 64),
                     b = filled("k4c32-v2t32-r16-s0-post", 2, 64, 301, 15);
  const BasicKVCache c = filled("k16-v16-r0-s0-post", 2, 64, 90, 16);
  const auto qa = kvq::test::normal_vector(4 * 4 * 64, 17, 0.4f), qb = kvq::test::normal_vector(1 * 4 * 64, 18, 0.4f);
  const auto qc = kvq::test::normal_vector(3 * 4 * 64, 19, 0.4f);
  const auto nk = kvq::test::normal_vector(3 * 2 * 64, 20), nv = kvq::test::normal_vector(3 * 2 * 64, 21);
  for (const Tier tier : {Tier::exact, Tier::integer}) {
    std::vector<float> oa(qa.size()), ob(qb.size()), oc(qc.size());
    const AttentionRequest batch[] = {
        {.cache = &a, .layer = 1, .first_position = 696, .tokens = 4, .queries = qa, .out = oa},
        {.cache = &b, .layer = 0, .first_position = 300, .tokens = 1, .queries = qb, .out = ob},
        {.cache = &c,
         .layer = 0,
         .first_position = 90,
         .tokens = 3,
         .queries = qc,
         .new_keys = nk,
         .new_values = nv,
         .out = oc},
    };
    kvq::ThreadPool threads(2);
    kvq::attend(batch, {.tier = tier, .chunk_tokens = 128, .executor = &threads});
    // In the caller's workspace (which the caller can free), bit for bit the same.
    kvq::DecodeWorkspace workspace;
    std::vector<float> oa2(qa.size());
    AttentionRequest again[] = {batch[0], batch[1], batch[2]};
    again[0].out = oa2;
    kvq::attend(again, {.tier = tier, .chunk_tokens = 128, .executor = &threads, .workspace = &workspace});
    EXPECT_EQ(oa2, oa);
    EXPECT_EQ(workspace.queries.size(), qa.size() + qb.size() + qc.size()) << "attend left the workspace unused";
    EXPECT_FALSE(workspace.partial.empty());
    for (std::size_t i = 0; i < 3; ++i) {
      AttentionRequest alone = batch[i];
      std::vector<float> out(alone.out.size());
      alone.out = out;
      kvq::attend(alone, {.tier = tier, .chunk_tokens = 128});
      EXPECT_TRUE(std::equal(out.begin(), out.end(), batch[i].out.begin()))
          << "request " << i << " " << kvq::to_string(tier);
    }
    std::vector<float> decoded(qb.size());
    kvq::decode_attention(b, 0, 300, qb, decoded, {.tier = tier, .chunk_tokens = 128});
    EXPECT_EQ(decoded, ob);
  }
}

// A block of stored positions crossing two attention-chunk boundaries runs as its three parts:
// in a batch beside a request that crosses none, on two threads and in both tiers, its output is
// bit for bit that of the parts given as requests of their own (a block planned whole would read
// the positions before a boundary in its exact part, and round them otherwise).
TEST(Attend, RequestsCrossingAttentionChunksRunAsTheirParts) {
  const BasicKVCache cache = filled("k4c32-v2t32-r20-s3", 2, 64, 533, 41, 64);
  const std::size_t heads = 6, row = heads * 64;
  const auto q = kvq::test::normal_vector(37 * row, 42, 0.4f), other = kvq::test::normal_vector(3 * row, 43, 0.4f);
  const kvq::ScoreOptions rule{.attention_chunk = 16};  // 200 .. 236: parts 200-207, 208-223, 224-236
  for (const Tier tier : {Tier::exact, Tier::integer}) {
    std::vector<float> whole(q.size()), parts(q.size()), beside(other.size()), alone(other.size());
    const AttentionRequest batch[] = {
        {.cache = &cache, .layer = 1, .first_position = 200, .tokens = 37, .queries = q, .out = whole},
        {.cache = &cache, .layer = 0, .first_position = 500, .tokens = 3, .queries = other, .out = beside},
    };
    kvq::ThreadPool threads(2);
    kvq::attend(batch, {.tier = tier, .chunk_tokens = 64, .executor = &threads, .scores = rule});
    std::vector<AttentionRequest> split;
    for (const auto& [first, tokens] : {std::pair{200u, 8u}, std::pair{208u, 16u}, std::pair{224u, 13u}})
      split.push_back({.cache = &cache,
                       .layer = 1,
                       .first_position = first,
                       .tokens = tokens,
                       .queries = std::span(q).subspan((first - 200) * row, tokens * row),
                       .out = std::span(parts).subspan((first - 200) * row, tokens * row)});
    split.push_back({.cache = &cache, .layer = 0, .first_position = 500, .tokens = 3, .queries = other, .out = alone});
    kvq::attend(split, {.tier = tier, .chunk_tokens = 64, .scores = rule});
    EXPECT_EQ(whole, parts) << kvq::to_string(tier);
    EXPECT_EQ(beside, alone) << kvq::to_string(tier);
    std::vector<float> oracle(q.size());
    kvq::reference_attention_block(cache, 1, 200, 37, q, oracle, rule);
    EXPECT_LT(relative_error(whole, oracle), tier == Tier::exact ? 1e-5 : 2.5e-2) << kvq::to_string(tier);
  }
}

// A softmax scale, sliding windows (shorter than a chunk, a block, the request; reaching into
// the sink tokens or not), chunked local attention (a boundary inside the stored block and inside
// the prefill chunk), logit soft-capping and learned sink logits, against the oracle applying the
// same rule: decode in every kernel and both tiers, attend's stored blocks and prefill chunks with
// new tokens on the kernel chosen for the cache.
TEST(Attend, ScoreOptionsMatchTheOracle) {
  const std::size_t kv_heads = 2, dim = 64, group = 3, heads = kv_heads * group;
  // Logits about the scores' size (the sink takes a part of the weight: a few percent to most),
  // and far beyond them either way (next to all of it, none).
  const std::vector<float> logits = {6.0f, 1.0f, 4.0f, -2.0f, 5.0f, 3.0f};
  const std::vector<float> extreme = {40.0f, -40.0f, 0.0f, 40.0f, -40.0f, 2.0f};
  std::vector<kvq::ScoreOptions> rules(12);
  rules[0].scale = 0.05f;
  rules[1].window = 1;
  rules[2].window = 37;
  rules[3].window = 300;
  rules[4].softcap = 2.0f;
  rules[5] = {.scale = 0.2f, .window = 100, .softcap = 3.0f};
  rules[6].sink_logits = logits;
  rules[7] = {.window = 128, .sink_logits = logits};                    // gpt-oss's local layers
  rules[8].attention_chunk = 210;                                       // prefill 200 .. 236 crosses 210
  rules[9] = {.window = 5, .attention_chunk = 530};                     // stored block 526 .. 532 crosses 530
  rules[10] = {.scale = 0.2f, .softcap = 3.0f, .sink_logits = logits};  // logits above the cap: not capped
  rules[11].sink_logits = extreme;
  for (const char* text : {"k4c32-v2t32-r20-s3", "k4c32-v2t32-r16-s0-post", "k16-v16-r0-s0-post",
                           "k8c32-v8t32-r8-s1-f32", "k4t32-v2t32-r16-s1-hk"}) {
    const BasicKVCache cache = filled(text, kv_heads, dim, 533, 31, 64);
    const BasicKVCache prefix = filled(text, kv_heads, dim, 200, 31, 64);
    const auto q1 = kvq::test::normal_vector(heads * dim, 32, 0.4f);
    const auto q = kvq::test::normal_vector(37 * heads * dim, 33, 0.4f);
    const auto nk = kvq::test::outlier_keys(37, kv_heads, dim, 3, 4.0f, 34);
    const auto nv = kvq::test::normal_vector(37 * kv_heads * dim, 35);
    for (std::size_t i = 0; i < rules.size(); ++i) {
      const kvq::ScoreOptions& rule = rules[i];
      const std::string what = std::string(text) + " rule " + std::to_string(i);
      std::vector<float> oracle(q1.size()), plain(q1.size()), out(q1.size());
      for (const std::size_t position : {532u, 250u, 2u}) {
        kvq::reference_attention(cache, 1, position, q1, oracle, rule);
        kvq::reference_attention(cache, 1, position, q1, plain);
        if (rule.scale || rule.softcap || !rule.sink_logits.empty() || kvq::detail::window_start(rule, position) > 0) {
          EXPECT_GT(relative_error(plain, oracle), 1e-3) << what << ": the rule changed nothing";
        }
        for (const std::string& kernel : kvq::test::kernels_for(cache, q1.size() / dim)) {
          kvq::decode_attention(cache, 1, position, q1, out, {.chunk_tokens = 64, .kernel = kernel, .scores = rule});
          EXPECT_LT(relative_error(out, oracle), 1e-5) << what << " decode at " << position << " on " << kernel;
          kvq::decode_attention(cache, 1, position, q1, out,
                                {.tier = Tier::integer, .chunk_tokens = 64, .kernel = kernel, .scores = rule});
          EXPECT_LT(relative_error(out, oracle), 2.5e-2)
              << what << " integer decode at " << position << " on " << kernel;
        }
      }
      const std::size_t tokens = 7, p0 = 533 - tokens;
      const auto qs = std::span(q).first(tokens * heads * dim);
      std::vector<float> block(qs.size()), stored(qs.size());
      kvq::reference_attention_block(cache, 1, p0, tokens, qs, block, rule);
      kvq::attend({.cache = &cache, .layer = 1, .first_position = p0, .tokens = tokens, .queries = qs, .out = stored},
                  {.chunk_tokens = 64, .scores = rule});
      EXPECT_LT(relative_error(stored, block), 1e-5) << what << " stored block";
      std::vector<float> fresh(q.size());
      kvq::attend({.cache = &prefix,
                   .layer = 0,
                   .first_position = 200,
                   .tokens = 37,
                   .queries = q,
                   .new_keys = nk,
                   .new_values = nv,
                   .out = fresh},
                  {.chunk_tokens = 64, .scores = rule});
      EXPECT_LT(relative_error(fresh, oracle_with_new(prefix, 0, 200, 37, q, nk, nv, rule)), 1e-5)
          << what << " prefill";
    }
  }
}

// A draft tree (Medusa, EAGLE, SpecInfer): each new token attends to the stored prefix and its
// path from a root, at position p0 + depth. Two roots, branches of different depths, a token whose
// parent is not the token before it; sliding windows that reach into the stored rows and that
// cut paths, an attention chunk boundary between depths. Each token's output is the last row of
// its path attended as a chain (the oracle, and kvq's own chain), on 2 threads bit for bit as on
// one; a chain spelled as parents is bit-identical to none.
TEST(Attend, DraftTreesAttendEachPathAsAChain) {
  const std::vector<std::int32_t> parents = {-1, 0, 0, 1, 1, 2, -1, 3, 6, 8, 5, 4};
  const std::size_t kv_heads = 2, dim = 64, tokens = parents.size(), p0 = 200;
  std::vector<kvq::ScoreOptions> rules(4);
  rules[1].window = 40;
  rules[2].window = 3;
  rules[3].attention_chunk = 202;  // depths 0 and 1 before the boundary, 2 and 3 after it
  const auto nk = kvq::test::outlier_keys(tokens, kv_heads, dim, 3, 4.0f, 53);
  const auto nv = kvq::test::normal_vector(tokens * kv_heads * dim, 54);
  kvq::ThreadPool threads(2);
  // GQA 8 and 6: 96 and 72 query rows per KV head, two batches of the kernels' 64 (with GQA 6 the
  // second starts inside token 10's group).
  for (const auto& [text, group] : {std::pair{"k4c32-v2t32-r20-s3", 3u}, std::pair{"k4c32-v2t32-r16-s0-post", 8u},
                                    std::pair{"k16-v16-r0-s0-post", 6u}, std::pair{"k4t32-v2t32-r16-s1-hsk", 8u}}) {
    const std::size_t row = kv_heads * group * dim;
    const auto q = kvq::test::normal_vector(tokens * row, 52, 0.4f);
    const BasicKVCache cache = filled(text, kv_heads, dim, p0, 51, 64);
    for (std::size_t i = 0; i < rules.size(); ++i)
      for (const Tier tier : {Tier::exact, Tier::integer}) {
        const std::string what = std::string(text) + " rule " + std::to_string(i) + " " + kvq::to_string(tier);
        const kvq::DecodeOptions options{.tier = tier, .chunk_tokens = 64, .scores = rules[i]};
        const AttentionRequest tree{.cache = &cache,
                                    .first_position = p0,
                                    .tokens = tokens,
                                    .queries = q,
                                    .new_keys = nk,
                                    .new_values = nv,
                                    .parents = parents};
        std::vector<float> out(q.size()), threaded(q.size());
        AttentionRequest request = tree;
        request.out = out;
        kvq::attend(request, options);
        request.out = threaded;
        kvq::DecodeOptions on_threads = options;
        on_threads.executor = &threads;
        kvq::attend(request, on_threads);
        EXPECT_EQ(out, threaded) << what;
        for (std::size_t t = 0; t < tokens; ++t) {
          std::vector<std::size_t> path;
          for (std::int32_t a = std::int32_t(t); a >= 0; a = parents[std::size_t(a)])
            path.insert(path.begin(), std::size_t(a));
          std::vector<float> pq, pk, pv;
          for (const std::size_t a : path) {
            pq.insert(pq.end(), q.begin() + std::ptrdiff_t(a * row), q.begin() + std::ptrdiff_t((a + 1) * row));
            for (const auto& [from, to] : {std::pair{&nk, &pk}, std::pair{&nv, &pv}})
              to->insert(to->end(), from->begin() + std::ptrdiff_t(a * kv_heads * dim),
                         from->begin() + std::ptrdiff_t((a + 1) * kv_heads * dim));
          }
          std::vector<float> chain(pq.size());
          kvq::attend({.cache = &cache,
                       .first_position = p0,
                       .tokens = path.size(),
                       .queries = pq,
                       .new_keys = pk,
                       .new_values = pv,
                       .out = chain},
                      options);
          const auto last = [&](const std::vector<float>& x, std::size_t r) {
            return std::vector<float>(x.begin() + std::ptrdiff_t(r * row), x.begin() + std::ptrdiff_t((r + 1) * row));
          };
          const auto oracle = oracle_with_new(cache, 0, p0, path.size(), pq, pk, pv, rules[i]);
          EXPECT_LT(relative_error(last(out, t), last(oracle, path.size() - 1)), tier == Tier::exact ? 1e-5 : 2.5e-2)
              << what << " token " << t;
          if (tier == Tier::exact && !rules[i].attention_chunk) {  // a chain runs its parts on the kernels
            EXPECT_LT(relative_error(last(out, t), last(chain, path.size() - 1)), 1e-6) << what << " token " << t;
          }
        }
        if (rules[i].attention_chunk) continue;  // a chain is cut at the boundary, a tree is not
        std::vector<std::int32_t> line(tokens);
        for (std::size_t t = 0; t < tokens; ++t) line[t] = std::int32_t(t) - 1;
        std::vector<float> as_tree(q.size()), as_chain(q.size());
        request.parents = line;
        request.out = as_tree;
        kvq::attend(request, options);
        request.parents = {};
        request.out = as_chain;
        kvq::attend(request, options);
        EXPECT_EQ(as_tree, as_chain) << what;
      }
  }
}

// A tree needs room for its deepest token, not for all of its tokens: four drafts two deep fit
// in the last two positions of the capacity, where four chained ones or three deep do not.
TEST(Attend, DraftTreesNeedRoomForTheirDepthOnly) {
  const std::size_t kv_heads = 2, dim = 64, heads = 4, p0 = 1198;  // capacity 1200
  const BasicKVCache cache = filled("k4c32-v2t32-r20-s3", kv_heads, dim, p0, 55, 64);
  const auto q = kvq::test::normal_vector(4 * heads * dim, 56, 0.4f);
  const auto nk = kvq::test::outlier_keys(4, kv_heads, dim, 3, 4.0f, 57);
  const auto nv = kvq::test::normal_vector(4 * kv_heads * dim, 58);
  const std::vector<std::int32_t> two_deep = {-1, -1, 0, 0}, three_deep = {-1, 0, 1, -1};
  std::vector<float> out(q.size());
  AttentionRequest r{.cache = &cache,
                     .first_position = p0,
                     .tokens = 4,
                     .queries = q,
                     .new_keys = nk,
                     .new_values = nv,
                     .out = out,
                     .parents = two_deep};
  kvq::attend(r);
  // Token 3 (a child of root 0, at p0 + 1) against its path as a chain.
  const std::size_t row = heads * dim, kv_row = kv_heads * dim;
  std::vector<float> pq(q.begin(), q.begin() + std::ptrdiff_t(row)),
      pk(nk.begin(), nk.begin() + std::ptrdiff_t(kv_row)), pv(nv.begin(), nv.begin() + std::ptrdiff_t(kv_row));
  pq.insert(pq.end(), q.begin() + std::ptrdiff_t(3 * row), q.end());
  pk.insert(pk.end(), nk.begin() + std::ptrdiff_t(3 * kv_row), nk.end());
  pv.insert(pv.end(), nv.begin() + std::ptrdiff_t(3 * kv_row), nv.end());
  const auto oracle = oracle_with_new(cache, 0, p0, 2, pq, pk, pv);
  EXPECT_LT(relative_error(std::vector<float>(out.begin() + std::ptrdiff_t(3 * row), out.end()),
                           std::vector<float>(oracle.begin() + std::ptrdiff_t(row), oracle.end())),
            1e-5);
  for (const bool chain : {true, false}) {
    r.parents = chain ? std::span<const std::int32_t>() : std::span<const std::int32_t>(three_deep);
    try {
      kvq::attend(r);
      ADD_FAILURE() << (chain ? "a chain" : "a tree three deep") << " beyond the capacity was accepted";
    } catch (const kvq::Error& e) {
      const std::string expected = chain ? "4 new tokens from position 1198 need" : "(a draft tree 3 deep)";
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
}

TEST(Attend, BadScoreOptionsThrowBeforeWritingAnything) {
  const BasicKVCache cache = filled("k4c32-v2t32-r20-s3", 2, 64, 100, 36);
  const auto q = kvq::test::normal_vector(2 * 4 * 64, 37);
  std::vector<float> out(q.size(), 7.0f);
  std::vector<float> logits(4, 1.0f), infinite(4, 1.0f), three(3, 1.0f);  // queries of 4 heads
  logits[3] = std::nanf("");
  infinite[0] = -std::numeric_limits<float>::infinity();
  std::vector<kvq::ScoreOptions> rules(10);
  rules[0].window = 0;
  rules[1].scale = -1.0f;
  rules[2].scale = std::nanf("");
  rules[3].softcap = std::numeric_limits<float>::infinity();
  rules[4].sink_logits = logits;
  rules[5].attention_chunk = 0;
  rules[6].sink_logits = infinite;
  rules[7].sink_logits = three;
  rules[8].softcap = 1e-39f;                             // 1 / cap overflows: a score of 0 would be 0 * inf
  rules[9].sink_logits = std::span(out).subspan(64, 4);  // the merge would overwrite them as it read them
  const char* const parts[] = {"sliding window of 0",
                               "softmax scale -1",
                               "softmax scale nan",
                               "soft-cap inf",
                               "sink logit of query head 3 is nan",
                               "chunks of 0 positions",
                               "sink logit of query head 0 is -inf",
                               "3 sink logits for 4 query heads",
                               "finite reciprocal",
                               "the output overlaps the sink logits"};
  for (std::size_t i = 0; i < rules.size(); ++i) {
    const kvq::DecodeOptions options{.scores = rules[i]};
    for (const std::size_t tokens : {1u, 2u}) {
      try {
        kvq::attend({.cache = &cache,
                     .first_position = 98,
                     .tokens = tokens,
                     .queries = std::span(q).first(tokens * 4 * 64),
                     .out = std::span(out).first(tokens * 4 * 64)},
                    options);
        ADD_FAILURE() << "accepted: " << parts[i];
      } catch (const kvq::Error& e) {
        EXPECT_EQ(e.code(), i == 7 ? kvq::ErrorCode::shape_mismatch : kvq::ErrorCode::invalid_argument);
        EXPECT_NE(std::string(e.what()).find(parts[i]), std::string::npos) << e.what();
      }
    }
    EXPECT_THROW(kvq::decode_attention(cache, 0, 99, std::span(q).first(4 * 64), std::span(out).first(4 * 64), options),
                 kvq::Error);
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; })) << parts[i];
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
  const AttentionRequest good{
      .cache = &cache, .first_position = 98, .tokens = 2, .queries = q, .out = std::span(out).first(q.size())};
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
  const std::vector<std::int32_t> root_twice = {-1, -1}, one = {-1}, ahead = {-1, 1}, below = {-2, 0};
  r = good;
  r.parents = root_twice;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "a draft tree (parents) needs its new keys and values");
  r.first_position = 100;
  r.new_keys = nk;
  r.new_values = nv;
  EXPECT_NO_THROW(kvq::attend(r));  // two roots: accepted
  std::fill(out.begin(), out.end(), 7.0f);
  r.parents = one;
  expect_error({r}, kvq::ErrorCode::shape_mismatch, "1 parents for 2 new tokens");
  r.parents = ahead;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "the parent of new token 1 is 1, neither -1");
  r.parents = below;
  expect_error({good, r}, kvq::ErrorCode::invalid_argument, "request 1: the parent of new token 0 is -2");
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
  // One request's output over another's queries: refused as within one request.
  std::vector<float> shared(q.begin(), q.end());
  AttentionRequest reads = good, writes = good;
  reads.queries = shared;
  writes.out = shared;
  expect_error({reads, writes}, kvq::ErrorCode::invalid_argument, "request 1: the output overlaps request 0's queries");
  EXPECT_EQ(shared, q);
  // Three requests whose outputs lie in one buffer out of request order: the overlapping pair is
  // found whatever lies between them in memory, and so is an input under a later output.
  const std::size_t n = q.size();
  std::vector<float> wide(4 * n, 7.0f);
  AttentionRequest a = good, b = good, c = good;
  a.out = std::span(wide).subspan(0, n);
  b.out = std::span(wide).subspan(3 * n, n);
  c.out = std::span(wide).subspan(n / 2, n);
  expect_error({a, b, c}, kvq::ErrorCode::invalid_argument, "requests 0 and 2 write overlapping outputs");
  c.out = std::span(wide).subspan(n, n);
  std::copy(q.begin(), q.end(), wide.begin() + std::ptrdiff_t(3 * n));
  c.queries = std::span<const float>(wide).subspan(3 * n, n);  // request 1's output
  expect_error({a, b, c}, kvq::ErrorCode::invalid_argument, "request 1: the output overlaps request 2's queries");
  c.queries = q;
  EXPECT_NO_THROW(kvq::attend(std::vector<AttentionRequest>{a, b, c}));  // apart: accepted
}

// New values are held to what the cache would store: attention adds up to its capacity of them
// (value_limit(), here FLT_MAX / 2400), and a rotated cache rotates them first (each rotated value
// is at most its block's norm). f32 rows of 1e37 are refused by name before anything is written
// (they summed to inf); rows at the bound attend to finite outputs.
TEST(Attend, NewValuesStayWithinWhatTheCacheSums) {
  for (const char* text : {"k16-v16-r0-s0-f32", "k4c32-v2t32-r20-s3-post-hk-hv-f32"}) {
    SCOPED_TRACE(text);
    const BasicKVCache cache = filled(text, 2, 64, 100, 71);
    const bool rotated = cache.rotation(kvq::Tensor::values) != nullptr;
    const auto q = kvq::test::normal_vector(2 * 4 * 64, 72);
    const auto nk = kvq::test::normal_vector(2 * 2 * 64, 73);
    std::vector<float> nv = kvq::test::normal_vector(2 * 2 * 64, 74), out(q.size(), 7.0f);
    const AttentionRequest r{.cache = &cache,
                             .first_position = 100,
                             .tokens = 2,
                             .queries = q,
                             .new_keys = nk,
                             .new_values = nv,
                             .out = out};
    ASSERT_LT(cache.value_limit(), 1e37f);
    std::fill(nv.begin() + 3 * 64, nv.end(), 1e37f);  // token 1, KV head 1
    try {
      kvq::attend(r);
      ADD_FAILURE() << "values beyond what attention sums were accepted";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::unrepresentable) << e.what();
      EXPECT_NE(std::string(e.what()).find("new values of token 1, KV head 1, channel 0"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find((rotated ? "its block's L2 norm is beyond" : "it is beyond") +
                                           std::string(" FLT_MAX / (2 x capacity 1200)")),
                std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; }));
    // 64 equal values have a norm of 8 times one of them.
    std::fill(nv.begin() + 3 * 64, nv.end(), cache.value_limit() / (rotated ? 8 : 1) * (1 - 1e-6f));
    kvq::attend(r);
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); }));
  }
}

// Chunks of any size, up to SIZE_MAX, plan the same single chunk as one that spans the cache (a
// chunk rounded up to whole tiles must not wrap, nor a chunk boundary past sinks of a tile or more).
TEST(Attend, HugeChunksAreOneChunk) {
  const BasicKVCache cache = filled("k16-v16-r0-s80", 1, 64, 100, 61);
  const auto q = kvq::test::normal_vector(2 * 64, 62);
  std::vector<float> ref(q.size()), whole(q.size()), block(q.size()), out(q.size());
  kvq::reference_attention(cache, 0, 60, q, ref);  // one position, two query heads
  kvq::decode_attention(cache, 0, 60, q, whole, {.chunk_tokens = 1u << 20});
  EXPECT_LT(relative_error(whole, ref), 1e-5);
  // Two positions, one query head each.
  const AttentionRequest two{.cache = &cache, .first_position = 59, .tokens = 2, .queries = q, .out = out};
  kvq::attend(two, {.chunk_tokens = 1u << 20});
  block = out;
  for (const std::size_t chunk : {std::numeric_limits<std::size_t>::max(), std::numeric_limits<std::size_t>::max() - 31,
                                  std::numeric_limits<std::size_t>::max() / 2 + 1}) {
    kvq::decode_attention(cache, 0, 60, q, out, {.chunk_tokens = chunk});
    EXPECT_EQ(out, whole) << chunk;
    kvq::attend(two, {.chunk_tokens = chunk});
    EXPECT_EQ(out, block) << chunk;
  }
}

// More than 64 query heads per KV head: decode_attention refuses them by name, decode_kernel too,
// and attend() takes them alone as in a batch.
TEST(Attend, GroupsBeyondTheDecodeKernelsRunInBatches) {
  const BasicKVCache cache = filled("k4c32-v2t32-r20-s3", 1, 64, 100, 63);
  const auto q = kvq::test::normal_vector(65 * 64, 64);
  std::vector<float> ref(q.size()), alone(q.size()), batched(q.size()), other(q.size());
  kvq::reference_attention(cache, 0, 99, q, ref);
  try {
    kvq::decode_attention(cache, 0, 99, q, alone);
    ADD_FAILURE() << "65 query heads per KV head accepted";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unsupported);
    EXPECT_NE(e.message().find("65 query heads per KV head exceed 64"), std::string::npos) << e.message();
  }
  EXPECT_THROW((void)kvq::decode_kernel(cache, 65), kvq::Error);
  EXPECT_THROW((void)kvq::decode_kernel(cache, 0), kvq::Error);
  const AttentionRequest one{.cache = &cache, .first_position = 99, .tokens = 1, .queries = q, .out = alone};
  kvq::attend(one, {.tier = Tier::exact});
  EXPECT_LT(relative_error(alone, ref), 1e-5);
  AttentionRequest second = one;
  second.out = other;
  AttentionRequest first = one;
  first.out = batched;
  kvq::attend(std::vector<AttentionRequest>{first, second}, {.tier = Tier::exact});
  EXPECT_EQ(alone, batched);
}

}  // namespace
