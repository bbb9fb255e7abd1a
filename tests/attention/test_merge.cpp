// Attention states: attend's log-sum-exp (AttentionRequest::lse) against the softmax denominator
// summed in double from the rows the cache stores; requests of stored positions only, one per
// sequence or many sequences' queries at their own positions in one; merge_attention: a cache's
// stored prefix and, separately, a chunk of new tokens, merged, equal one call over both
// (cascade attention); bad states and requests are refused before anything changes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

namespace {

using kvq::AttentionRequest;
using kvq::BasicKVCache;
using kvq::Tier;
using kvq::test::relative_error;

constexpr float none = -std::numeric_limits<float>::infinity();

/// Whether rows [first, first + count) of `dim` floats are all zero.
bool zero_rows(const std::vector<float>& x, std::size_t first, std::size_t count, std::size_t dim) {
  return std::all_of(x.begin() + std::ptrdiff_t(first * dim), x.begin() + std::ptrdiff_t((first + count) * dim),
                     [](float e) { return e == 0.0f; });
}

/// A cache of `length` tokens of outlier keys in layer 0.
BasicKVCache filled(const char* config, std::size_t kv_heads, std::size_t dim, std::size_t length, unsigned seed) {
  kvq::CacheShape shape{1, kv_heads, dim, 1024};
  shape.block_tokens = 64;
  BasicKVCache cache(shape, kvq::parse_cache_config(config));
  if (length != 0)
    cache.append(0, 0, kvq::test::outlier_keys(length, kv_heads, dim, 3, 4.0f, seed),
                 kvq::test::normal_vector(length * kv_heads * dim, seed + 1));
  return cache;
}

/// log(sum_j exp(logit_j) + exp(sink)) in double for query row (t, h) of a request at p0, over
/// the positions it sees (those before seen_end): stored rows before p0 as the cache reads them,
/// then the new keys, both rotated to their positions with the query when the cache stores keys
/// before RoPE; -inf where it sees nothing.
double expected_lse(const BasicKVCache& cache, std::size_t p0, std::size_t t, std::size_t h, std::size_t heads,
                    std::span<const float> q, const std::vector<float>& new_keys, const kvq::ScoreOptions& rule,
                    std::size_t seen_end = std::numeric_limits<std::size_t>::max()) {
  const std::size_t dim = cache.shape().head_dim, kv_heads = cache.shape().kv_heads, kvh = h / (heads / kv_heads);
  const std::size_t position = p0 + t;
  const double scale = rule.scale ? *rule.scale : 1.0 / std::sqrt(double(dim));
  const bool pre = cache.config().key_rope == kvq::KeyRope::pre;
  std::vector<float> x(q.begin() + std::ptrdiff_t((t * heads + h) * dim),
                       q.begin() + std::ptrdiff_t((t * heads + h + 1) * dim));
  if (pre) cache.rope().rotate(x.data(), position);
  std::vector<double> logits;
  std::vector<float> k(dim);
  for (std::size_t j = kvq::detail::window_start(rule, position); j <= std::min(position, seen_end - 1); ++j) {
    if (j < p0 || new_keys.empty())
      cache.read_row(kvq::Tensor::keys, 0, kvh, j, k.data());
    else
      std::copy_n(new_keys.data() + ((j - p0) * kv_heads + kvh) * dim, dim, k.data());
    if (pre) cache.rope().rotate(k.data(), j);
    double s = 0;
    for (std::size_t c = 0; c < dim; ++c) s += double(x[c]) * k[c];
    s *= scale;
    if (rule.softcap) s = *rule.softcap * std::tanh(s / *rule.softcap);
    logits.push_back(s);
  }
  if (!rule.sink_logits.empty()) logits.push_back(rule.sink_logits[h]);
  if (logits.empty()) return -std::numeric_limits<double>::infinity();
  const double m = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (const double l : logits) sum += std::exp(l - m);
  return m + std::log(sum);
}

// Decode steps (one position: decode_attention's path), stored blocks of positions and prefill
// chunks (one crossing an attention chunk: cut in two), with a scale, a cap, sink logits and a
// window; quantized keys per channel and per token, rotated keys, fp16 rows.
TEST(AttentionStates, LogSumExpIsTheSoftmaxDenominator) {
  const std::size_t kv_heads = 2, dim = 64, group = 3, heads = kv_heads * group, length = 300;
  const std::vector<float> sinks = {2.0f, -1.0f, 6.0f, 0.5f, 3.0f, -4.0f};
  std::vector<kvq::ScoreOptions> rules(4);
  rules[1] = {.scale = 0.2f, .softcap = 3.0f};
  rules[2] = {.window = 50, .sink_logits = sinks};
  rules[3].attention_chunk = 310;
  for (const char* text : {"k4c32-v2t32-r20-s3", "k4c32-v2t32-r16-s0-post", "k16-v16-r0-s0", "k4t32-v2t32-r16-s1-hk"})
    for (std::size_t i = 0; i < rules.size(); ++i) {
      const BasicKVCache cache = filled(text, kv_heads, dim, length, 3);
      const auto q = kvq::test::normal_vector(16 * heads * dim, 4, 0.4f);
      const auto nk = kvq::test::outlier_keys(16, kv_heads, dim, 3, 4.0f, 5);
      const auto nv = kvq::test::normal_vector(16 * kv_heads * dim, 6);
      struct Case {
        std::size_t p0, tokens;
        bool fresh;
      };
      for (const Case& c : {Case{length - 1, 1, false}, Case{length - 5, 5, false}, Case{length, 16, true}})
        for (const Tier tier : {Tier::exact, Tier::integer}) {
          const std::string what = std::string(text) + " rule " + std::to_string(i) + " p0 " + std::to_string(c.p0) +
                                   " T=" + std::to_string(c.tokens) + " " + kvq::to_string(tier);
          const auto qs = std::span(q).first(c.tokens * heads * dim);
          std::vector<float> out(qs.size()), plain(qs.size()), lse(c.tokens * heads, 7.0f);
          AttentionRequest r{.cache = &cache, .first_position = c.p0, .tokens = c.tokens, .queries = qs, .out = out};
          if (c.fresh) {
            r.new_keys = nk;
            r.new_values = nv;
          }
          const kvq::DecodeOptions options{.tier = tier, .chunk_tokens = 128, .scores = rules[i]};
          kvq::attend(r, options);
          r.out = plain;
          r.lse = lse;
          kvq::attend(r, options);
          EXPECT_EQ(out, plain) << what << ": asking for the log-sum-exp changed the output";
          double worst = 0;
          for (std::size_t t = 0; t < c.tokens; ++t)
            for (std::size_t h = 0; h < heads; ++h)
              worst = std::max(
                  worst, std::abs(lse[t * heads + h] - expected_lse(cache, c.p0, t, h, heads, qs,
                                                                    c.fresh ? nk : std::vector<float>{}, rules[i])));
          // Largest seen: 5.7e-7 exact; 9.6e-4 integer (the query rounded to int8 moves its logits).
          EXPECT_LT(worst, tier == Tier::exact ? 2e-6 : 5e-3) << what;
        }
    }
}

// The log-sum-exp where attend's paths differ from the test above: 128 query rows per KV head (two
// batches of the kernels' 64), a draft tree (each token's that of its path attended as a chain),
// a chain spelled as parents, and 2 threads, bit for bit as one.
TEST(AttentionStates, LogSumExpsOfBatchesTreesAndThreads) {
  const std::vector<std::int32_t> parents = {-1, 0, 0, 1, 1, 2, -1, 3, 6, 8, 5, 4, 11, 12, 7, 14};
  const std::vector<std::int32_t> chain_parents = {-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
  const std::size_t kv_heads = 2, dim = 64, group = 8, heads = kv_heads * group, tokens = 16, p0 = 200;
  const std::size_t row = heads * dim, kv_row = kv_heads * dim;
  kvq::ThreadPool threads(2);
  for (const char* text : {"k4c32-v2t32-r20-s3", "k4c32-v2t32-r16-s0-post"}) {
    const BasicKVCache cache = filled(text, kv_heads, dim, p0, 31);
    const auto q = kvq::test::normal_vector(tokens * row, 32, 0.4f);
    const auto nk = kvq::test::outlier_keys(tokens, kv_heads, dim, 3, 4.0f, 33);
    const auto nv = kvq::test::normal_vector(tokens * kv_row, 34);
    const kvq::DecodeOptions options{.chunk_tokens = 64};
    kvq::DecodeOptions on_threads = options;
    on_threads.executor = &threads;
    auto run = [&](std::span<const std::int32_t> tree, const kvq::DecodeOptions& o, std::size_t n,
                   std::span<const float> qs, std::span<const float> ks, std::span<const float> vs) {
      std::vector<float> out(qs.size()), lse(n * heads);
      kvq::attend({.cache = &cache,
                   .first_position = p0,
                   .tokens = n,
                   .queries = qs,
                   .new_keys = ks,
                   .new_values = vs,
                   .out = out,
                   .parents = tree,
                   .lse = lse},
                  o);
      return std::pair{out, lse};
    };
    const auto [chain_out, chain_lse] = run({}, options, tokens, q, nk, nv);
    double worst = 0;
    for (std::size_t t = 0; t < tokens; ++t)
      for (std::size_t h = 0; h < heads; ++h)
        worst = std::max(worst, std::abs(chain_lse[t * heads + h] - expected_lse(cache, p0, t, h, heads, q, nk, {})));
    EXPECT_LT(worst, 2e-6) << text;
    EXPECT_EQ(run(chain_parents, options, tokens, q, nk, nv), std::pair(chain_out, chain_lse)) << text;
    EXPECT_EQ(run({}, on_threads, tokens, q, nk, nv), std::pair(chain_out, chain_lse)) << text;
    const auto [tree_out, tree_lse] = run(parents, options, tokens, q, nk, nv);
    EXPECT_EQ(run(parents, on_threads, tokens, q, nk, nv), std::pair(tree_out, tree_lse)) << text;
    for (std::size_t t = 0; t < tokens; ++t) {
      std::vector<std::size_t> path;
      for (std::int32_t a = std::int32_t(t); a >= 0; a = parents[std::size_t(a)])
        path.insert(path.begin(), std::size_t(a));
      std::vector<float> pq, pk, pv;
      for (const std::size_t a : path) {
        pq.insert(pq.end(), q.begin() + std::ptrdiff_t(a * row), q.begin() + std::ptrdiff_t((a + 1) * row));
        pk.insert(pk.end(), nk.begin() + std::ptrdiff_t(a * kv_row), nk.begin() + std::ptrdiff_t((a + 1) * kv_row));
        pv.insert(pv.end(), nv.begin() + std::ptrdiff_t(a * kv_row), nv.begin() + std::ptrdiff_t((a + 1) * kv_row));
      }
      const auto [path_out, path_lse] = run({}, options, path.size(), pq, pk, pv);
      for (std::size_t h = 0; h < heads; ++h)
        EXPECT_NEAR(tree_lse[t * heads + h], path_lse[(path.size() - 1) * heads + h], 1e-6) << text << " token " << t;
    }
  }
}

// Cascade attention's batch: the queries of 24 sequences at their own positions (in no order) over
// a prefix they share, in one request (AttentionRequest::positions: 72 query rows per KV head, the
// kernels' second batch of 64 starting inside a sequence's GQA group), against each sequence's own
// request and the softmax denominator in double, in both tiers. Windows that let some queries see
// part of the prefix (the kernels reading what all see, the rest per query) or none of it,
// attention chunks, sink logits; 2 threads bit for bit as one; over an empty cache, nothing.
TEST(AttentionStates, QueriesOfManySequencesShareOneRead) {
  const std::vector<std::size_t> positions = {517, 301, 300, 900, 640, 333, 1023, 702, 404, 350, 1000, 300,
                                              799, 455, 612, 871, 302, 560, 999,  420, 731, 388, 950,  511};
  const std::size_t kv_heads = 2, dim = 64, group = 3, heads = kv_heads * group, length = 300;
  const std::size_t tokens = positions.size(), row = heads * dim;
  const std::vector<float> sinks(heads, 1.5f);
  std::vector<kvq::ScoreOptions> rules(5);
  rules[1].window = 400;           // 640 sees 241 .. 299; 702 and later see nothing
  rules[2].window = 800;           // all see 224 .. 299 (the kernels); 517 sees from 0, 1000 from 201
  rules[3].attention_chunk = 512;  // queries from 512 on see nothing
  rules[4] = {.window = 400, .sink_logits = sinks};
  kvq::ThreadPool threads(2);
  for (const char* text : {"k4c32-v2t32-r20-s3", "k4c32-v2t32-r16-s0-post", "k4t32-v2t32-r16-s1-hk"})
    for (std::size_t i = 0; i < rules.size(); ++i)
      for (const Tier tier : {Tier::exact, Tier::integer}) {
        const std::string what = std::string(text) + " rule " + std::to_string(i) + " " + kvq::to_string(tier);
        const BasicKVCache cache = filled(text, kv_heads, dim, length, 41);
        const auto q = kvq::test::normal_vector(tokens * row, 42, 0.4f);
        kvq::DecodeOptions options{.tier = tier, .chunk_tokens = 128, .scores = rules[i]};
        std::vector<float> out(q.size()), lse(tokens * heads), threaded(q.size()), threaded_lse(lse.size());
        AttentionRequest shared{.cache = &cache,
                                .first_position = 300,
                                .tokens = tokens,
                                .queries = q,
                                .out = out,
                                .lse = lse,
                                .stored_only = true,
                                .positions = positions};
        kvq::attend(shared, options);
        shared.out = threaded;
        shared.lse = threaded_lse;
        options.executor = &threads;
        kvq::attend(shared, options);
        EXPECT_EQ(out, threaded) << what;
        EXPECT_EQ(lse, threaded_lse) << what;
        options.executor = nullptr;
        std::vector<float> apart(q.size()), apart_lse(lse.size());
        std::vector<AttentionRequest> own;
        for (std::size_t t = 0; t < tokens; ++t)
          own.push_back({.cache = &cache,
                         .first_position = positions[t],
                         .queries = std::span(q).subspan(t * row, row),
                         .out = std::span(apart).subspan(t * row, row),
                         .lse = std::span(apart_lse).subspan(t * heads, heads),
                         .stored_only = true});
        kvq::attend(own, options);
        EXPECT_LT(relative_error(out, apart), tier == Tier::exact ? 1e-5 : 2.5e-2) << what;
        for (std::size_t t = 0; t < tokens; ++t) {
          const bool sees_nothing = kvq::detail::window_start(rules[i], positions[t]) >= length;
          if (sees_nothing) {
            EXPECT_TRUE(zero_rows(out, t, 1, row)) << what << " query " << t;
          }
          for (std::size_t h = 0; h < heads; ++h) {
            const double expected = expected_lse(cache, positions[t], 0, h, heads, std::span(q).subspan(t * row, row),
                                                 {}, rules[i], length);
            const std::size_t at = t * heads + h;
            if (std::isinf(expected)) {
              EXPECT_EQ(lse[at], none) << what << " query " << t;
              EXPECT_EQ(apart_lse[at], none) << what << " query " << t;
            } else {
              if (sees_nothing) {
                EXPECT_EQ(lse[at], sinks[h]) << what << " query " << t;
              }
              EXPECT_NEAR(lse[at], expected, tier == Tier::exact ? 2e-6 : 5e-3) << what << " query " << t;
              EXPECT_NEAR(apart_lse[at], lse[at], tier == Tier::exact ? 2e-6 : 5e-3) << what << " query " << t;
            }
          }
        }
        const BasicKVCache empty = filled(text, kv_heads, dim, 0, 41);
        std::fill(out.begin(), out.end(), 7.0f);
        shared.cache = &empty;
        shared.out = out;
        shared.lse = lse;
        kvq::attend(shared, options);
        EXPECT_TRUE(zero_rows(out, 0, tokens, row)) << what;
        for (std::size_t at = 0; at < lse.size(); ++at)
          EXPECT_EQ(lse[at], rules[i].sink_logits.empty() ? none : sinks[at % heads]) << what;
      }
}

// Cascade attention: the stored prefix (a request of stored positions only, its queries at their
// own positions after it) and a chunk of new tokens over an empty cache (positions from 0: RoPE
// and windows see only distances) attended apart and merged equal the chunk attended over the
// prefix in one call, outputs and log-sum-exps. Sink logits go with one part; a window of 5 lets
// the later queries see none of the prefix (zeros and -inf, which the merge passes over).
TEST(AttentionStates, PartsMergeIntoOneCall) {
  const std::size_t kv_heads = 2, dim = 64, group = 4, heads = kv_heads * group, length = 300, tokens = 9;
  const std::vector<float> sinks = {2.0f, -1.0f, 6.0f, 0.5f, 3.0f, -4.0f, 1.0f, 0.0f};
  std::vector<kvq::ScoreOptions> rules(4);
  rules[1].sink_logits = sinks;
  rules[2].window = 50;
  rules[3] = {.scale = 0.2f, .window = 5, .softcap = 3.0f};
  for (const char* text : {"k4c32-v2t32-r20-s3", "k4c32-v2t32-r16-s0-post", "k2t32-v4t32-r20-s3-post-hk-hv",
                           "k16-v16-r0-s0", "k4t32-v2t32-r16-s1-hk"})
    for (std::size_t i = 0; i < rules.size(); ++i) {
      const std::string what = std::string(text) + " rule " + std::to_string(i);
      const BasicKVCache cache = filled(text, kv_heads, dim, length, 11);
      const BasicKVCache empty = filled(text, kv_heads, dim, 0, 11);
      const auto q = kvq::test::normal_vector(tokens * heads * dim, 12, 0.4f);
      const auto nk = kvq::test::outlier_keys(tokens, kv_heads, dim, 3, 4.0f, 13);
      const auto nv = kvq::test::normal_vector(tokens * kv_heads * dim, 14);
      kvq::DecodeOptions options{.chunk_tokens = 128, .scores = rules[i]};
      std::vector<float> whole(q.size()), whole_lse(tokens * heads);
      kvq::attend({.cache = &cache,
                   .first_position = length,
                   .tokens = tokens,
                   .queries = q,
                   .new_keys = nk,
                   .new_values = nv,
                   .out = whole,
                   .lse = whole_lse},
                  options);
      std::vector<float> prefix(q.size()), prefix_lse(tokens * heads);
      kvq::attend({.cache = &cache,
                   .first_position = length,
                   .tokens = tokens,
                   .queries = q,
                   .out = prefix,
                   .lse = prefix_lse,
                   .stored_only = true},
                  options);
      if (i == 3)  // tokens 4 .. 8 see positions from 300 on only
        for (std::size_t r = 4 * heads; r < tokens * heads; ++r) {
          EXPECT_EQ(prefix_lse[r], none) << what << " row " << r;
          EXPECT_TRUE(zero_rows(prefix, r, 1, dim)) << what << " row " << r;
        }
      options.scores.sink_logits = {};  // counted once, in the prefix's part
      std::vector<float> chunk(q.size()), chunk_lse(tokens * heads);
      kvq::attend({.cache = &empty,
                   .first_position = 0,
                   .tokens = tokens,
                   .queries = q,
                   .new_keys = nk,
                   .new_values = nv,
                   .out = chunk,
                   .lse = chunk_lse},
                  options);
      EXPECT_GT(relative_error(prefix, whole), 1e-2) << what << ": the chunk changed nothing";
      kvq::merge_attention(prefix, prefix_lse, chunk, chunk_lse);
      EXPECT_LT(relative_error(prefix, whole), 1e-5) << what;
      for (std::size_t r = 0; r < whole_lse.size(); ++r) EXPECT_NEAR(prefix_lse[r], whole_lse[r], 1e-5) << what;
    }
}

// A sequence's attention cut by key positions (seen_begin, seen_end) into three parts, merged,
// equals the whole: decode steps, chains of stored positions, prefill chunks (72 query rows per KV
// head: two batches) and draft trees, cut inside the sinks, the stored prefix, a window's ragged
// edge and the new tokens; requests of stored positions only, after the stored length or (with
// seen_end) inside it; windows, attention chunks the requests cross, sink logits (given to the
// first part only); both tiers. A part a query sees nothing of is empty (zeros, -inf).
TEST(AttentionStates, RangesOfPositionsMergeIntoTheWhole) {
  constexpr std::size_t all = std::numeric_limits<std::size_t>::max();
  const std::size_t kv_heads = 2, dim = 64, group = 8, heads = kv_heads * group, length = 300;
  const std::vector<std::int32_t> tree = {-1, 0, 0, 1, -1, 3};
  const std::vector<std::size_t> after = {300, 310, 305, 330}, inside = {262, 299, 255, 280};
  const std::vector<float> sinks = kvq::test::normal_vector(heads, 40);
  std::vector<kvq::ScoreOptions> rules(3);
  rules[1] = {.window = 50, .sink_logits = sinks};
  rules[2].attention_chunk = 8;
  struct Case {
    const char* name;
    std::size_t p0, tokens;
    bool fresh, stored_only;
    std::span<const std::int32_t> parents;
    std::span<const std::size_t> positions;
    std::size_t end = all;  // the whole request's seen_end
  };
  const Case cases[] = {{"decode step", length - 1, 1, false, false, {}, {}},
                        {"chain", length - 5, 5, false, false, {}, {}},
                        {"chunk", length, 9, true, false, {}, {}},
                        {"tree", length, tree.size(), true, false, tree, {}},
                        {"stored only", 300, after.size(), false, true, {}, after},
                        {"stored only inside", 255, inside.size(), false, true, {}, inside, 250}};
  const std::pair<std::size_t, std::size_t> cuts[] = {{37, 211}, {150, length + 2}, {100, 100},
                                                      {0, 297},  {255, 270},        {2, 280}};
  const auto q = kvq::test::normal_vector(9 * heads * dim, 42, 0.4f);
  const auto nk = kvq::test::outlier_keys(9, kv_heads, dim, 3, 4.0f, 43);
  const auto nv = kvq::test::normal_vector(9 * kv_heads * dim, 44);
  for (const char* text : {"k4c32-v2t32-r20-s3", "k4c32-v2t32-r16-s0-post", "k16-v16-r0-s0", "k4t32-v2t32-r16-s1-hk"}) {
    const BasicKVCache cache = filled(text, kv_heads, dim, length, 41);
    for (std::size_t i = 0; i < rules.size(); ++i)
      for (const Case& c : cases)
        for (const auto& [c1, c2] : cuts)
          for (const Tier tier : {Tier::exact, Tier::integer}) {
            const std::string what = std::string(text) + " rule " + std::to_string(i) + " " + c.name + " cut at " +
                                     std::to_string(c1) + ", " + std::to_string(c2) + " " + kvq::to_string(tier);
            const auto qs = std::span(q).first(c.tokens * heads * dim);
            kvq::DecodeOptions options{.tier = tier, .chunk_tokens = 64, .scores = rules[i]};
            auto run = [&](std::size_t begin, std::size_t end) {
              std::vector<float> out(qs.size()), lse(c.tokens * heads);
              AttentionRequest r{.cache = &cache,
                                 .first_position = c.p0,
                                 .tokens = c.tokens,
                                 .queries = qs,
                                 .out = out,
                                 .parents = c.parents,
                                 .lse = lse,
                                 .stored_only = c.stored_only,
                                 .positions = c.positions,
                                 .seen_begin = std::min(begin, c.end),
                                 .seen_end = std::min(end, c.end)};
              if (c.fresh) {
                r.new_keys = std::span(nk).first(c.tokens * kv_heads * dim);
                r.new_values = std::span(nv).first(c.tokens * kv_heads * dim);
              }
              kvq::attend(r, options);
              return std::pair{out, lse};
            };
            const auto [whole, whole_lse] = run(0, all);
            if (c.end != all && tier == Tier::exact)  // the whole, cut inside the stored positions
              for (std::size_t t = 0; t < c.tokens; ++t)
                for (std::size_t h = 0; h < heads; ++h) {
                  const double expected = expected_lse(cache, c.positions[t], 0, h, heads,
                                                       qs.subspan(t * heads * dim, heads * dim), {}, rules[i], c.end);
                  if (std::isinf(expected)) {
                    EXPECT_EQ(whole_lse[t * heads + h], none) << what;
                  } else {
                    EXPECT_NEAR(whole_lse[t * heads + h], expected, 2e-6) << what << " token " << t << " head " << h;
                  }
                }
            auto [out, lse] = run(0, c1);
            options.scores.sink_logits = {};  // counted once, in the first part
            const auto [middle, middle_lse] = run(c1, c2);
            const auto [last, last_lse] = run(c2, all);
            if (c1 == c2) {
              EXPECT_TRUE(zero_rows(middle, 0, c.tokens * heads, dim)) << what;
              EXPECT_TRUE(std::all_of(middle_lse.begin(), middle_lse.end(), [](float x) { return x == none; })) << what;
            }
            kvq::merge_attention(out, lse, middle, middle_lse);
            kvq::merge_attention(out, lse, last, last_lse);
            // Largest seen: 1.2e-6, log-sum-exps 9.5e-7 (exact); 3.3e-3, 1.7e-4 (integer: the
            // int8 weights round per part).
            EXPECT_LT(relative_error(out, whole), tier == Tier::exact ? 1e-5 : 1e-2) << what;
            for (std::size_t r = 0; r < whole_lse.size(); ++r) {
              // (-inf: a query whose window or attention chunk starts at or after seen_end)
              if (whole_lse[r] == none) {
                EXPECT_EQ(lse[r], none) << what << " row " << r;
              } else {
                EXPECT_NEAR(lse[r], whole_lse[r], tier == Tier::exact ? 1e-5 : 1e-3) << what << " row " << r;
              }
            }
          }
  }
}

// An empty row (log-sum-exp -inf) takes the other state's row whichever side it is on, and
// adds nothing to a row that saw something, whatever its output holds.
TEST(AttentionStates, EmptyRowsWeighNothing) {
  std::vector<float> out = {1.0f, 2.0f, std::nanf(""), 5.0f}, lse = {0.5f, none};
  const std::vector<float> other = {std::nanf(""), 9.0f, 3.0f, 4.0f}, other_lse = {none, 1.5f};
  kvq::merge_attention(out, lse, other, other_lse);
  EXPECT_EQ(out, (std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f}));
  EXPECT_EQ(lse, (std::vector<float>{0.5f, 1.5f}));
  // Two equal states: the same output, the denominator doubled.
  const std::vector<float> same = out, same_lse = lse;
  kvq::merge_attention(out, lse, same, same_lse);
  for (std::size_t i = 0; i < out.size(); ++i) EXPECT_FLOAT_EQ(out[i], same[i]);
  EXPECT_FLOAT_EQ(lse[0], 0.5f + std::log(2.0f));
  // A state 200 below the other (its weight under float's range) leaves the other as it was.
  std::vector<float> big = {1.0f, 2.0f}, big_lse = {150.0f};
  const std::vector<float> small = {7.0f, 8.0f}, small_lse = {-50.0f};
  kvq::merge_attention(big, big_lse, small, small_lse);
  EXPECT_EQ(big, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(big_lse[0], 150.0f);
}

TEST(AttentionStates, BadStatesAreRefusedAndChangeNothing) {
  std::vector<float> out = {1.0f, 2.0f, 3.0f, 4.0f}, lse = {0.5f, 1.0f};
  std::vector<float> other = {5.0f, 6.0f, 7.0f, 8.0f}, other_lse = {0.0f, 2.0f};
  const auto out_before = out, lse_before = lse;
  auto expect_error = [&](std::span<float> o, std::span<float> l, std::span<const float> p, std::span<const float> pl,
                          kvq::ErrorCode code, const std::string& part) {
    try {
      kvq::merge_attention(o, l, p, pl);
      ADD_FAILURE() << "accepted: " << part;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
    EXPECT_EQ(out, out_before);
    EXPECT_EQ(lse, lse_before);
  };
  expect_error(out, lse, std::span(other).first(3), other_lse, kvq::ErrorCode::shape_mismatch,
               "outputs of 4 and 3 floats");
  expect_error(out, lse, other, std::span(other_lse).first(1), kvq::ErrorCode::shape_mismatch,
               "with log-sum-exps of 2 and 1 rows");
  expect_error(std::span(out).first(3), lse, std::span(other).first(3), other_lse, kvq::ErrorCode::shape_mismatch,
               "outputs of 3 floats are not 2 rows");
  std::vector<float> nan_lse = {std::nanf(""), 1.0f};
  expect_error(other, nan_lse, out, lse, kvq::ErrorCode::non_finite_input, "first state's log-sum-exp of row 0");
  other_lse[1] = std::nanf("");
  expect_error(out, lse, other, other_lse, kvq::ErrorCode::non_finite_input, "second state's log-sum-exp of row 1");
  other_lse[1] = std::numeric_limits<float>::infinity();
  expect_error(out, lse, other, other_lse, kvq::ErrorCode::non_finite_input, "row 1 is inf");
  other_lse[1] = 2.0f;
  expect_error(out, lse, out, other_lse, kvq::ErrorCode::invalid_argument, "the two states overlap");
  expect_error(out, lse, other, lse, kvq::ErrorCode::invalid_argument, "the two states overlap");
  std::vector<float> packed = {1.0f, 2.0f, 3.0f, 4.0f, 0.5f, 1.0f};
  const auto packed_before = packed;
  try {
    kvq::merge_attention(std::span(packed).first(4), std::span(packed).subspan(3, 2), other, other_lse);
    ADD_FAILURE() << "an output over its own log-sum-exp was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the output overlaps its log-sum-exp"), std::string::npos) << e.what();
  }
  EXPECT_EQ(packed, packed_before);
}

// attend checks the log-sum-exp as it checks the output: its size, and overlaps with the
// request's inputs, its own output and other requests' outputs, before writing anything.
TEST(AttentionStates, BadLogSumExpsThrowBeforeWritingAnything) {
  const BasicKVCache cache = filled("k4c32-v2t32-r20-s3", 2, 64, 100, 21);
  const auto q = kvq::test::normal_vector(2 * 4 * 64, 22);
  std::vector<float> out(q.size(), 7.0f), lse(8, 7.0f), other(q.size(), 7.0f);
  auto expect_error = [&](const std::vector<AttentionRequest>& requests, kvq::ErrorCode code, const std::string& part) {
    try {
      kvq::attend(requests);
      ADD_FAILURE() << "accepted: " << part;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
    for (const auto* v : {&out, &lse, &other})
      EXPECT_TRUE(std::all_of(v->begin(), v->end(), [](float x) { return x == 7.0f; })) << part;
  };
  const AttentionRequest good{.cache = &cache, .first_position = 98, .tokens = 2, .queries = q, .out = out, .lse = lse};
  AttentionRequest r = good;
  r.lse = std::span(lse).first(7);
  expect_error({r}, kvq::ErrorCode::shape_mismatch,
               "request 0: a log-sum-exp of 7 floats is not 2 x 4 (tokens x query heads)");
  r.tokens = 1;  // checked before a one-position request takes decode_attention's path
  r.first_position = 99;
  r.queries = std::span(q).first(4 * 64);
  r.out = std::span(out).first(4 * 64);
  expect_error({r}, kvq::ErrorCode::shape_mismatch, "a log-sum-exp of 7 floats is not 1 x 4 (tokens x query heads)");
  std::vector<float> both(q.begin(), q.end());
  r = good;
  r.queries = both;
  r.lse = std::span(both).first(8);
  expect_error({r}, kvq::ErrorCode::invalid_argument, "request 0: the log-sum-exp overlaps the queries");
  r = good;
  r.lse = std::span(out).last(8);
  expect_error({r}, kvq::ErrorCode::invalid_argument, "the output overlaps the log-sum-exp");
  AttentionRequest second = good;
  second.out = other;
  second.lse = std::span(other).first(8);  // over its own output: refused as its own request's
  expect_error({good, second}, kvq::ErrorCode::invalid_argument, "request 1: the output overlaps the log-sum-exp");
  second.lse = std::span(out).subspan(8, 8);  // over request 0's output
  expect_error({good, second}, kvq::ErrorCode::invalid_argument, "write overlapping outputs");
  std::vector<float> shared(q.begin(), q.end());
  AttentionRequest reads = good, writes = good;
  reads.queries = shared;
  writes.out = other;
  writes.lse = std::span(shared).first(8);
  expect_error({reads, writes}, kvq::ErrorCode::invalid_argument,
               "request 1: the log-sum-exp overlaps request 0's queries");
  EXPECT_EQ(shared, q);
  const std::vector<float> sinks(4, 1.0f);
  std::vector<float> lse_and_sinks(sinks.begin(), sinks.end());
  lse_and_sinks.resize(8, 7.0f);
  r = good;
  r.lse = lse_and_sinks;
  try {
    kvq::attend(r, {.scores = {.sink_logits = std::span(lse_and_sinks).first(4)}});
    ADD_FAILURE() << "a log-sum-exp over the sink logits was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("the log-sum-exp overlaps the sink logits"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; }));
  EXPECT_TRUE(std::all_of(lse_and_sinks.begin() + 4, lse_and_sinks.end(), [](float x) { return x == 7.0f; }));
  // Stored positions only: no new tokens, queries from the stored length on, within the capacity.
  const auto nk = kvq::test::normal_vector(2 * 2 * 64, 23), nv = kvq::test::normal_vector(2 * 2 * 64, 24);
  r = good;
  r.stored_only = true;
  r.first_position = 100;
  r.new_keys = nk;
  r.new_values = nv;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "a request of stored positions only takes no new keys or values");
  r.new_keys = r.new_values = {};
  r.first_position = 99;
  expect_error({r}, kvq::ErrorCode::invalid_argument,
               "holds 100 tokens of a capacity of 1024; queries of stored positions only over 2 positions from 99 "
               "must follow");
  r.first_position = 1023;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "only over 2 positions from 1023 must follow the stored tokens");
  r.first_position = 1025;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "only over 2 positions from 1025 must follow the stored tokens");
  r.first_position = 1022;
  EXPECT_NO_THROW(kvq::attend(r));
  std::fill(out.begin(), out.end(), 7.0f);
  std::fill(lse.begin(), lse.end(), 7.0f);
  const std::vector<std::size_t> positions = {400, 300}, beyond = {300, 1024}, three = {300, 301, 302};
  r.positions = positions;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "first_position 1022 is not the smallest of the positions, 300");
  r.first_position = 300;
  EXPECT_NO_THROW(kvq::attend(r));  // in any order
  std::fill(out.begin(), out.end(), 7.0f);
  std::fill(lse.begin(), lse.end(), 7.0f);
  r.positions = three;
  expect_error({r}, kvq::ErrorCode::shape_mismatch, "3 positions for 2 query tokens");
  r.positions = beyond;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "query position 1024 is beyond the capacity of 1024");
  r.positions = positions;
  r.stored_only = false;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "query positions are for requests of stored positions only");
  // A range of positions: not reversed; stored positions only may start where the range ends.
  r = good;
  r.seen_begin = 60;
  r.seen_end = 50;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "seen_begin 60 is after seen_end 50");
  r.seen_begin = 50;
  r.stored_only = true;
  r.first_position = 49;
  expect_error({r}, kvq::ErrorCode::invalid_argument, "from 49 must follow the stored tokens they see (before 50)");
  r.first_position = 50;
  EXPECT_NO_THROW(kvq::attend(r));  // an empty range: nothing seen
  EXPECT_TRUE(zero_rows(out, 0, 8, 64));
  EXPECT_TRUE(std::all_of(lse.begin(), lse.end(), [](float x) { return x == none; }));
}

}  // namespace
