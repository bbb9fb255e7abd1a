// Decode attention with keys stored pre-RoPE under every RoPE variant (partial rotary, linear,
// llama3 and yarn scaling, per-frequency divisors): each kernel against the reference attention,
// which rotates keys and queries with the model's RoPE. Post-RoPE caches never rotate, so the
// variants reach them only through the engine.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvq/attention/decode.hpp"
#include "kvq/kvq.hpp"
#include "support/compare.hpp"
#include "support/kernels.hpp"
#include "support/random.hpp"

namespace {

using kvq::RopeScaling;
using kvq::RopeScalingType;

struct Variant {
  std::string name;
  std::size_t rope_dims;  // 0 = head_dim
  RopeScaling scaling;
};

std::vector<Variant> variants(std::size_t dim) {
  RopeScaling linear, llama3, yarn, divisors;
  linear.type = RopeScalingType::linear, linear.factor = 4.0f;
  llama3.type = RopeScalingType::llama3, llama3.factor = 8.0f, llama3.original_context = 256;
  yarn.type = RopeScalingType::yarn, yarn.factor = 8.0f, yarn.original_context = 128;
  for (std::size_t i = 0; i < dim / 4; ++i) divisors.frequency_divisors.push_back(1.0f + 0.5f * float(i % 7));
  std::vector<Variant> all;
  for (const std::size_t dims : {std::size_t(0), dim / 2}) {
    const std::string rotary = dims == 0 ? "full" : "partial";
    all.push_back({rotary + " none", dims, {}});
    all.push_back({rotary + " linear", dims, linear});
    all.push_back({rotary + " llama3", dims, llama3});
    all.push_back({rotary + " yarn", dims, yarn});
  }
  all.push_back({"partial divisors", dim / 2, divisors});
  // 20 channels: kernels rotating in vectors of 8 or 16 lanes finish the pairs one at a time.
  all.push_back({"partial tail", 20, {}});
  return all;
}

// exact: measured below 1e-6 elsewhere; integer: the bound of test_decode_attention.
constexpr double exact_bound = 1e-5, integer_bound = 2.5e-2;

TEST(DecodeRopeVariants, EveryKernelMatchesTheReference) {
  unsigned seed = 1;
  for (const auto style : {kvq::RopeStyle::adjacent_pairs, kvq::RopeStyle::half_split}) {
    for (const std::size_t dim : {std::size_t(64), std::size_t(96)}) {  // AVX-512 and AVX2 kernels
      for (const Variant& variant : variants(dim)) {
        for (const char* config : {"k4c32-v2t32-r40-s1", "k16-v16-r0-s2"}) {
          SCOPED_TRACE(variant.name + " " + kvq::to_string(style) + " d=" + std::to_string(dim) + " " + config);
          const std::size_t kv_heads = 2, group = 4, length = 600;  // beyond every original context
          kvq::CacheShape shape{1, kv_heads, dim, length, style, 10000.0f, variant.rope_dims, variant.scaling};
          kvq::BasicKVCache cache(shape, kvq::parse_cache_config(config));
          ASSERT_EQ(cache.rope().config().dims(), variant.rope_dims == 0 ? dim : variant.rope_dims);
          const auto k = kvq::test::outlier_keys(length, kv_heads, dim, 3, 4.0f, seed);
          const auto v = kvq::test::normal_vector(length * kv_heads * dim, seed + 1);
          cache.append(0, 0, k, v);
          const auto q = kvq::test::normal_vector(kv_heads * group * dim, seed + 2, 2.0f);
          seed += 3;
          for (const std::size_t position : {length - 1, std::size_t(300)}) {
            std::vector<float> ref(q.size()), out(q.size());
            kvq::reference_attention(cache, 0, position, q, ref);
            for (const std::string& kernel : kvq::test::kernels_for(cache, kv_heads * group)) {
              kvq::DecodeOptions o;
              o.kernel = kernel;
              o.chunk_tokens = 128;
              o.tier = kvq::Tier::exact;
              kvq::decode_attention(cache, 0, position, q, out, o);
              EXPECT_LT(kvq::test::relative_error(out, ref), exact_bound) << kernel << " at " << position;
              o.tier = kvq::Tier::integer;
              kvq::decode_attention(cache, 0, position, q, out, o);
              EXPECT_LT(kvq::test::relative_error(out, ref), integer_bound) << kernel << " at " << position;
            }
          }
        }
      }
    }
  }
}

// The variants matter: attention under a scaled RoPE differs from attention under the plain one,
// so a cache that dropped the scaling would fail the comparison above.
TEST(DecodeRopeVariants, ScalingChangesTheOutput) {
  const std::size_t dim = 64, length = 600;
  const auto k = kvq::test::normal_vector(length * dim, 5), v = kvq::test::normal_vector(length * dim, 6);
  const auto q = kvq::test::normal_vector(4 * dim, 7, 2.0f);
  std::vector<float> plain(q.size());
  for (const Variant& variant : variants(dim)) {
    kvq::BasicKVCache cache(
        {1, 1, dim, length, kvq::RopeStyle::half_split, 10000.0f, variant.rope_dims, variant.scaling},
        kvq::parse_cache_config("k16-v16-r0-s0"));
    cache.append(0, 0, k, v);
    std::vector<float> out(q.size());
    kvq::decode_attention(cache, 0, length - 1, q, out);
    if (variant.name == "full none")
      plain = out;
    else
      EXPECT_GT(kvq::test::relative_error(out, plain), 1e-3) << variant.name;
  }
}

TEST(DecodeRopeVariants, BadRopeInShapeIsRejectedBeforeAllocation) {
  kvq::CacheShape shape{1, 1, 64, 16};
  shape.rope_dims = 65;
  EXPECT_THROW(kvq::BasicKVCache(shape, kvq::parse_cache_config("k4c32-v2t32-r16-s0")), kvq::Error);
  shape.rope_dims = 0;
  shape.rope_scaling.type = RopeScalingType::yarn;  // no original context
  shape.rope_scaling.factor = 4.0f;
  try {
    kvq::validate(shape, kvq::parse_cache_config("k4c32-v2t32-r16-s0"));
    ADD_FAILURE() << "accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("original_context"), std::string::npos) << e.what();
  }
}

}  // namespace
