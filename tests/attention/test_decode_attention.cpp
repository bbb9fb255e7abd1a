// Decode attention over the packed cache: every kernel and tier against the reference attention
// on awkward sizes, invariance to chunking and thread count, and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kvq/attention/decode.hpp"
#include "kvq/kvq.hpp"
#include "support/random.hpp"

namespace {

using kvq::BasicKVCache;
using kvq::CacheShape;
using kvq::DecodeOptions;
using kvq::Tier;

struct Case {
  std::string config;
  std::size_t kv_heads, group, dim, length, position;
  kvq::RopeStyle style = kvq::RopeStyle::adjacent_pairs;
};

BasicKVCache make_cache(const Case& c, unsigned seed) {
  CacheShape shape{1, c.kv_heads, c.dim, c.length + 8, c.style, 10000.0f};
  BasicKVCache cache(shape, kvq::parse_cache_config(c.config));
  const auto k = kvq::test::outlier_keys(c.length, c.kv_heads, c.dim, 3, 4.0f, seed);
  const auto v = kvq::test::normal_vector(c.length * c.kv_heads * c.dim, seed + 1);
  cache.append(0, 0, k, v);
  return cache;
}

double relative_error(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

std::vector<float> run(const BasicKVCache& cache, const Case& c, const std::vector<float>& q, DecodeOptions o) {
  std::vector<float> out(q.size());
  kvq::decode_attention(cache, 0, c.position, q, out, o);
  return out;
}

// integer: measured at most 2.35e-2 here (random keys and queries give flat attention over hundreds of
// tokens, the worst case for per-tile int8 weights); exact: measured below 1e-6.
constexpr double exact_bound = 1e-5, integer_bound = 2.5e-2;

void check_case(const Case& c, unsigned seed) {
  SCOPED_TRACE(c.config + " kv=" + std::to_string(c.kv_heads) + " gqa=" + std::to_string(c.group) +
               " d=" + std::to_string(c.dim) + " n=" + std::to_string(c.length) + " pos=" + std::to_string(c.position));
  const BasicKVCache cache = make_cache(c, seed);
  const auto q = kvq::test::normal_vector(c.kv_heads * c.group * c.dim, seed + 7, 2.0f);
  std::vector<float> ref(q.size());
  kvq::reference_attention(cache, 0, c.position, q, ref);
  for (const bool reference_kernel : {false, true}) {
    SCOPED_TRACE(reference_kernel ? "reference kernel" : "dispatched kernel");
    DecodeOptions o;
    o.reference_kernel = reference_kernel;
    o.chunk_tokens = 64;
    o.tier = Tier::exact;
    EXPECT_LT(relative_error(run(cache, c, q, o), ref), exact_bound);
    o.tier = Tier::integer;
    EXPECT_LT(relative_error(run(cache, c, q, o), ref), integer_bound);
  }
}

TEST(DecodeAttention, MatchesReferenceOnAwkwardSizes) {
  unsigned seed = 1;
  for (const char* config : {"k4c32-v2t32-r40-s1", "k2c32-v2t32-r16-s0-post", "k8c16-v8t16-r8-s3",
                             "k4c32-v4t32-r20-s2-post", "k2c32-v4t64-r0-s1-f32", "k3c32-v3t32-r16-s1",
                             "k4c32s.bf16-v2t32s.f32-r16-s1-post", "k4c48-v2t16-r8-s0-post", "k16-v16-r0-s0",
                             "k4c32-v2t32-r16-s1-bf16", "k2t32-v2c32-r16-s1-post", "k8c32-v8t32-r16-s0-post",
                             // unquantized caches on the dense kernel (fp16 and fp32, with sinks)
                             "k16-v16-r0-s0-post", "k16-v16-r0-s3-post-f32",
                             // integer kernel: K2 with V4 and V8, K8 with V2
                             "k2c32-v8t32-r16-s0-post", "k8c32-v2t32-r16-s1-post",
                             "k4c64-v2t32-r16-s1-post", "k4c16-v4t32-r16-s0-post"}) {
    for (const auto& [kv, group] : {std::pair<std::size_t, std::size_t>{2, 1}, {1, 4}, {2, 8}}) {
      for (const std::size_t dim : {64, 128}) {
        check_case({config, kv, group, dim, 301, 300}, seed++);
        check_case({config, kv, group, dim, 301, 170}, seed++);  // an older position: partial tiles
      }
    }
  }
}

TEST(DecodeAttention, HalfSplitRopeShortContextsAndOddDims) {
  unsigned seed = 100;
  for (const char* config : {"k4c32-v2t32-r16-s1", "k8c32-v4t32-r16-s2", "k2c32-v2t32-r16-s0-post"}) {
    check_case({config, 2, 4, 128, 200, 199, kvq::RopeStyle::half_split}, seed++);
    check_case({config, 2, 4, 64, 3, 0}, seed++);     // one token, maybe a sink
    check_case({config, 2, 4, 128, 17, 16}, seed++); // nothing quantized yet
    check_case({config, 1, 3, 48, 150, 149}, seed++);  // head_dim 48: reference kernel only
  }
}

TEST(DecodeAttention, IdenticalForEveryThreadCountAndCloseForEveryChunkSize) {
  // packed (integer and exact kernels) and fp16 (dense kernel) caches
  for (const char* config : {"k4c32-v2t32-r64-s1-post", "k2c32-v2t32-r16-s3-post", "k16-v16-r0-s1-post"}) {
  SCOPED_TRACE(config);
  const Case c{config, 4, 4, 128, 1500, 1499};
  const BasicKVCache cache = make_cache(c, 9);
  const auto q = kvq::test::normal_vector(c.kv_heads * c.group * c.dim, 10);
  for (const Tier tier : {Tier::exact, Tier::integer}) {
    DecodeOptions o;
    o.tier = tier;
    o.chunk_tokens = 256;
    const auto serial = run(cache, c, q, o);
    for (const std::size_t threads : {1u, 2u, 3u}) {
      kvq::ThreadPool pool(threads);
      o.executor = &pool;
      EXPECT_EQ(run(cache, c, q, o), serial) << threads << " threads";
    }
    o.executor = nullptr;
    for (const std::size_t chunk : {1u, 32u, 100u, 4096u}) {
      o.chunk_tokens = chunk;
      EXPECT_LT(relative_error(run(cache, c, q, o), serial), tier == Tier::exact ? 1e-6 : 2e-3) << chunk;
    }
  }
  }
}

TEST(DecodeAttention, PathSelection) {
  const Case c{"k4c32-v2t32-r16-s1", 2, 4, 128, 40, 39};
  const BasicKVCache cache = make_cache(c, 3);
  const auto path = kvq::decode_path(cache, 8);
#if defined(KVQ_HAVE_X86_KERNELS)
  EXPECT_EQ(path == kvq::kernels::attention::Path::avx512, kvq::kernels::attention::avx512::supported());
#else
  EXPECT_EQ(path, kvq::kernels::attention::Path::reference);
#endif
}

TEST(DecodeAttention, RejectsBadInput) {
  const Case c{"k4c32-v2t32-r16-s1", 2, 4, 64, 40, 39};
  const BasicKVCache cache = make_cache(c, 4);
  std::vector<float> q(8 * 64), out(8 * 64);
  EXPECT_THROW(kvq::decode_attention(cache, 0, 40, q, out), kvq::Error);  // position >= length
  EXPECT_THROW(kvq::decode_attention(cache, 1, 0, q, out), kvq::Error);   // no such layer
  std::vector<float> short_q(8 * 64 - 1);
  EXPECT_THROW(kvq::decode_attention(cache, 0, 0, short_q, out), kvq::Error);
  std::vector<float> q3(3 * 64), out3(3 * 64);  // 3 query heads over 2 KV heads
  EXPECT_THROW(kvq::decode_attention(cache, 0, 0, q3, out3), kvq::Error);
  std::vector<float> small_out(4 * 64);
  EXPECT_THROW(kvq::decode_attention(cache, 0, 0, q, small_out), kvq::Error);
}

}  // namespace
