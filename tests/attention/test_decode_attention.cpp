// Decode attention over the packed cache: every kernel and tier against the reference attention
// on awkward sizes, invariance to chunking and thread count, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/attention/decode.hpp"
#include "kvq/kvq.hpp"
#include "support/compare.hpp"
#include "support/kernels.hpp"
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

using kvq::test::relative_error;

std::vector<float> run(const BasicKVCache& cache, const Case& c, const std::vector<float>& q, DecodeOptions o) {
  std::vector<float> out(q.size());
  kvq::decode_attention(cache, 0, c.position, q, out, o);
  return out;
}

// The kernels a test runs: whatever decode_attention picks (""), then every kernel of the
// registry this CPU runs, by name.
std::vector<std::string> kernels() {
  std::vector<std::string> all{""};
  for (const auto& e : kvq::kernels::attention::registry())
    if (e.available()) all.emplace_back(e.name);
  return all;
}

const kvq::kernels::attention::KernelEntry* entry(const std::string& name) {
  for (const auto& e : kvq::kernels::attention::registry())
    if (e.name == name) return &e;
  return nullptr;
}

/// Options that run the kernel `name` (a string that outlives them).
DecodeOptions options_for(std::string_view name) {
  DecodeOptions o;
  o.kernel = name;
  return o;
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
  const kvq::RopeTable* rope = cache.config().key_rope == kvq::KeyRope::pre ? &cache.rope() : nullptr;
  for (const std::string& kernel : kernels()) {
    SCOPED_TRACE("kernel '" + kernel + "'");
    DecodeOptions o = options_for(kernel);
    const bool unrotate = kvq::detail::key_unrotation(cache) != nullptr;
    const bool accepted =
        kernel.empty() || kvq::kernels::attention::kernel_takes(*entry(kernel), cache.keys(0, 0, 0),
                                                                cache.values(0, 0, 0), c.group, rope, unrotate);
    if (kernel == "avx2" || kernel == "vector-avx2") {
      // They take every head_dim that is a multiple of 8, and only those; the AVX2 kernel neither
      // outliers, nor pre-RoPE keys stored rotated, nor level tables.
      const bool tables = kvq::kernels::attention::has_level_table(cache.keys(0, 0, 0)) ||
                          kvq::kernels::attention::has_level_table(cache.values(0, 0, 0));
      EXPECT_EQ(accepted, c.dim % 8 == 0 &&
                              (kernel == "vector-avx2" || (cache.config().key.outliers == 0 && !unrotate && !tables)));
    }
    if (!accepted) {
      EXPECT_THROW(run(cache, c, q, o), kvq::Error);  // named, but not for this shape
      continue;
    }
    o.chunk_tokens = 64;
    o.tier = Tier::exact;
    const auto exact = run(cache, c, q, o);
    EXPECT_LT(relative_error(exact, ref), exact_bound);
    o.tier = Tier::integer;
    const auto integer = run(cache, c, q, o);
    EXPECT_LT(relative_error(integer, ref), integer_bound);
    // Streams the integer tier does not read (outliers, ggml's levels, level tables), and on AVX-512
    // the widths only the exact span kernel unpacks (3 bits): exact for both.
    if (!kvq::kernels::attention::integer_tier_reads(cache.keys(0, 0, 0)) ||
        !kvq::kernels::attention::integer_tier_reads(cache.values(0, 0, 0)) ||
        std::string_view(kvq::decode_kernel(cache, c.kv_heads * c.group, o)) == "avx512-exact") {
      EXPECT_EQ(integer, exact);
    }
  }
}

TEST(DecodeAttention, MatchesReferenceOnAwkwardSizes) {
  unsigned seed = 1;
  for (const char* config :
       {"k4c32-v2t32-r40-s1", "k2c32-v2t32-r16-s0-post", "k8c16-v8t16-r8-s3", "k4c32-v4t32-r20-s2-post",
        "k2c32-v4t64-r0-s1-f32", "k3c32-v3t32-r16-s1", "k4c32s.bf16-v2t32s.f32-r16-s1-post", "k4c48-v2t16-r8-s0-post",
        "k16-v16-r0-s0", "k4c32-v2t32-r16-s1-bf16", "k2t32-v2c32-r16-s1-post", "k8c32-v8t32-r16-s0-post",
        // unquantized caches on the dense kernel (fp16 and fp32, with sinks)
        "k16-v16-r0-s0-post", "k16-v16-r0-s3-post-f32",
        // integer kernel: K2 with V4 and V8, K8 with V2
        "k2c32-v8t32-r16-s0-post", "k8c32-v2t32-r16-s1-post", "k4c64-v2t32-r16-s1-post", "k4c16-v4t32-r16-s0-post",
        // dense-and-sparse outliers: keys before and after RoPE, values per token and per channel
        "k3c32o1-v2t32o1-r40-s1", "k4c32o2-v4t32o1-r16-s0-post", "k2c32o1-v2t32o2s-r8-s2-post",
        "k3c16o1-v3c32o1-r16-s1",
        // rotations: keys and values per token (llama.cpp's layout), per-channel keys with random
        // signs, rotated values beside pre-RoPE keys; pre-RoPE keys rotated, per token and per
        // channel (rotated back before RoPE), with outliers
        "k4t32-v2t32-r16-s1-post-hk-hv", "k4c32-v2t32-r16-s0-post-hsk-hsv", "k4c32-v2t32-r40-s1-hv",
        "k4t32-v2t32-r16-s1-hk", "k4c32-v2t32-r40-s1-hsk-hv", "k3t32o1-v2t32-r8-s0-hsk", "k3t32-v2t32-r8-s0-hk",
        "k8c16-v4t32-r16-s1-hk-f32",
        // keys per token, dequantized in vectors: llama.cpp's q8_0 and q4_0 layouts, pre-RoPE keys,
        // groups of 64, of 48 (a short last group), of 8 (narrower than an AVX-512 vector), bf16
        // and f32 parameters, and 3-bit codes with outliers
        "k8t32s-v8t32s-r16-s1-post", "k4t32s-v4t32s-r0-s0-post", "k4t64-v2t32-r16-s1", "k2t48-v2t32-r8-s0-post",
        "k2t8-v4t32-r8-s0-post", "k4t48.bf16-v4t32-r16-s1-post", "k8t32s.f32-v4t32-r16-s1", "k3t32o1-v2t32-r16-s1-post",
        "k4t16o1-v4t32-r8-s2",
        // ggml's levels (llama.cpp's q8_0, q4_0, q5_0; negative steps where a positive value leads
        // a group): per token as llama.cpp stores them, with its rotation, before RoPE, and per
        // channel on the packed-span kernels of both tiers
        "k8t32g-v8t32g-r16-s1-post", "k4t32g-v4t32g-r0-s0-post", "k4t32g-v4t32g-r16-s1-post-hk-hv",
        "k5t32g-v4t32g-r8-s0", "k4c32g-v2t32g-r16-s1", "k4c32g-v4t32g-r16-s0-post", "k2c32g-v8t32g-r16-s1-post",
        // level tables (NormalFloat, Lloyd-Max): per-channel keys before and after RoPE, per-token
        // keys and values with rotations, 3-bit codes; looked up in registers on AVX-512 (the
        // exact span kernel before and after RoPE, 2-bit values, pre-RoPE keys stored rotated on
        // the generic kernel, per channel and per token, values in groups of 16 and 64, key blocks
        // of 64)
        "k4c32n-v4t32n-r16-s1", "k2c32l-v4t32n-r16-s1-post", "k3t32l-v2t32l-r8-s0-post",
        "k4t32n-v4t32n-r16-s1-post-hk-hv", "k3c16n-v3t16l-r8-s2-hsk", "k4c32l-v2t32n-r16-s1-post",
        "k2c16n-v2t32l-r40-s1", "k4c32n-v2t32l-r16-s1-hsk", "k4c64l-v4t16n-r8-s0-post", "k2t16l-v4t64n-r0-s2",
        "k4t32n-v2t32n-r16-s1-hk", "k4c64n-v2t32n-r16-s1-post",
        // llama.cpp's iq4_nl levels: per token with its rotation, per channel before RoPE
        "k4t32i-v4t32i-r16-s1-post-hk-hv", "k4c32i-v4t32i-r16-s1", "k4t16i-v4t64i-r8-s0-post",
        // 8-bit floats with a scale per group (a 256-entry table on the vector kernels, widened
        // through f16 on the generic AVX-512 one): per channel before RoPE, per token with
        // rotations, beside affine 2-bit values
        "k8c32e4m3-v8t32e5m2-r16-s1", "k8t32e5m2-v8t64e4m3-r8-s0-post-hk-hv", "k8c64e4m3-v2t32-r16-s1-post",
        // a table beside affine levels: each stream's zero point and lookup its own
        "k4c32-v4t32n-r16-s1-post", "k4c32s-v4t32n-r16-s1-post", "k4c32n-v2t32s-r16-s1", "k4c32g-v2t32n-r16-s1-post",
        "k4c32n-v4t32-r16-s1-post",
        // 3-bit keys per channel on the exact span kernel (fields crossing dwords), before and
        // after RoPE, key blocks of 16, 48 and 64, affine, ggml's and table levels, beside 2/4/8-bit
        // values
        "k3c32-v2t32-r16-s1-post", "k3c32-v4t32-r40-s1", "k3c48l-v8t32-r8-s0-post", "k3c16n-v2t32-r16-s2",
        "k3c64s-v2t32n-r16-s1-post", "k3c32l-v4t32-r16-s0", "k3c32g-v2t32-r16-s1-post", "k3c16g-v8t32g-r8-s1",
        // 3-bit values per token on the exact span kernel (fields crossing bytes), beside 2/3/4/8-bit
        // keys before and after RoPE, affine, ggml's and table levels
        "k4c32-v3t32-r16-s1-post", "k3c32-v3t32-r40-s1", "k2c16n-v3t32l-r8-s0-post", "k8c32-v3t32g-r16-s2",
        "k3c48l-v3t32n-r8-s1-post", "k4c64-v3t32s-r16-s0",
        // windows that flush (KIVI's keys, packed beyond the values; Hugging Face's keys and values)
        "k2c32-v2t32-r64-s0-fk-post", "k4c32-v2t32-r32-s1-fk", "k4t32-v4t32-r24-s0-fk-fv-post"}) {
    for (const auto& [kv, group] : {std::pair<std::size_t, std::size_t>{2, 1}, {1, 4}, {2, 8}}) {
      for (const std::size_t dim : {64, 128}) {
        check_case({config, kv, group, dim, 301, 300}, seed++);
        check_case({config, kv, group, dim, 301, 170}, seed++);  // an older position: partial tiles
      }
    }
  }
}

TEST(DecodeAttention, CodebooksMatchReference) {
  // Calibrated levels (Mode::codebook) within each group's range: a stored zero point (the
  // midpoint) beside a level lookup, so a kernel that drops either fails. 1-4 bits: the AVX-512
  // exact span kernel before and after RoPE (2-, 3- and 4-bit keys, 2- and 3-bit values), the
  // generic kernel (per-token keys, rotations), the vector kernels (3-bit values in groups of 16, 1
  // bit), a codebook beside NormalFloat and affine levels.
  const std::string b1 = "bba003800", b2 = "bbc00b50034003c00", b3 = "bbc00b800b400ac003000360039003c00",
                    b4 = "bbc00ba00b880b700b500b200ae00a8002800300034003600380039003a803c00";
  unsigned seed = 700;
  for (const std::string& config :
       {"k4c32" + b4 + "-v2t32" + b2 + "-r16-s1", "k2c32" + b2 + "-v4t32" + b4 + "-r16-s1-post",
        "k3c16" + b3 + "-v3t16" + b3 + "-r8-s2-hsk", "k4t32" + b4 + "-v4t32-r16-s1-post-hk-hv",
        "k4c64" + b4 + "-v1t32" + b1 + "-r8-s0-post", "k4c32" + b4 + "-v4t32n-r16-s1-post",
        "k4c32-v4t16" + b4 + "-r40-s1", "k2t16" + b2 + "-v2t32" + b2 + "-r16-s0-hk",
        "k3c32" + b3 + "-v2t32" + b2 + "-r16-s1-post", "k3c16" + b3 + "-v4t32-r8-s0",
        "k4c32" + b4 + "-v3t32" + b3 + "-r16-s1-post", "k3c32" + b3 + "-v3t32" + b3 + "-r8-s0"}) {
    for (const auto& [kv, group] : {std::pair<std::size_t, std::size_t>{2, 1}, {1, 4}, {2, 8}}) {
      for (const std::size_t dim : {64, 128}) {
        check_case({config, kv, group, dim, 301, 300}, seed++);
        check_case({config, kv, group, dim, 301, 170}, seed++);
      }
    }
  }
}

TEST(DecodeAttention, HalfSplitRopeShortContextsAndOddDims) {
  unsigned seed = 100;
  for (const char* config : {"k4c32-v2t32-r16-s1", "k8c32-v4t32-r16-s2", "k2c32-v2t32-r16-s0-post",
                             "k4t16-v4t16-r16-s0-post-hk-hsv", "k4t16-v4t16-r16-s1-hsk", "k3c32-v2t32-r16-s1"}) {
    check_case({config, 2, 4, 128, 200, 199, kvq::RopeStyle::half_split}, seed++);
    check_case({config, 2, 4, 64, 3, 0}, seed++);      // one token, maybe a sink
    check_case({config, 2, 4, 128, 17, 16}, seed++);   // nothing quantized yet
    check_case({config, 1, 3, 48, 150, 149}, seed++);  // head_dim 48: no AVX-512 kernel, AVX2 takes it
  }
  // A rotation of head_dim 96 has three blocks of 32: the vector kernels' butterflies between
  // vectors stay inside each block (on AVX-512 ops, two vectors per block).
  check_case({"k4t16-v4t16-r16-s1-hsk", 2, 2, 96, 150, 149}, seed++);
  check_case({"k4c32-v2t32-r16-s1-hk", 2, 2, 96, 150, 149, kvq::RopeStyle::half_split}, seed++);
}

TEST(DecodeAttention, PreRopeKeysAtLongPositions) {
  // The kernels rotate keys by steps from a unit's first position; at long positions that must
  // still agree with the reference's rotation by the table row of each position.
  unsigned seed = 300;
  for (const auto style : {kvq::RopeStyle::adjacent_pairs, kvq::RopeStyle::half_split})
    for (const char* config : {"k4c32-v2t32-r128-s1", "k2c64-v4t32-r32-s0", "k8c16-v8t32-r16-s4",
                               "k4c32-v2t32-r64-s1-hsk", "k3c32-v2t32-r128-s1"})
      check_case({config, 1, 4, 128, 6000, 5999, style}, seed++);
}

TEST(DecodeAttention, Avx2EdgeShapes) {
  unsigned seed = 200;
  // head_dim a multiple of 8 but not of 16 (a single-vector tail), half-split halves that are
  // not a multiple of 8 (scalar rotation tail), 3 and 16 value groups per row, GQA ratios that
  // leave 1 or 2 heads of the last 4, every residual type, symmetric parameters, per-channel
  // values, keys per token, and widths without fast unpacking in both tiers.
  for (const char* config : {"k4c32-v2t8-r16-s1-post", "k4c32-v2t8-r16-s1", "k3c32-v5t32-r16-s2-post",
                             "k2c32-v4c32-r16-s1-post", "k4c32s-v4t32s-r16-s1-post", "k4t8-v2t8-r16-s1-bf16",
                             "k8c32-v8t32-r8-s1-post-f32", "k16-v16-r0-s2-bf16", "k6c16-v2t8-r16-s0"}) {
    for (const std::size_t dim : {40, 72, 96, 136}) {
      check_case({config, 2, 5, dim, 200, 199}, seed++);
      check_case({config, 1, 6, dim, 200, 150, kvq::RopeStyle::half_split}, seed++);
    }
    check_case({config, 1, 9, 128, 300, 299}, seed++);
  }
}

TEST(DecodeAttention, LargeQueriesStayFinite) {
  // Queries 15-30x larger give scores of hundreds: whole tiles (and runs of packed value rows) far
  // below the running maximum of a long chunk weigh about the smallest normal float, where the
  // integer tier's weight step must stay finite. Integer scores of such queries may move the
  // softmax further from the exact attention than integer_bound (2-bit post-RoPE keys), so the
  // integer tier is held to the reference kernel, which defines it.
  unsigned seed = 400;
  for (const char* config : {"k2c32-v2t8-r0-s0", "k2c32-v2t8-r128-s0", "k2c32-v2t8-r32-s0-post", "k4c32-v4t8-r16-s1",
                             "k8c32-v8t8-r16-s0-post", "k2c16-v2t8-r64-s2-post", "k4t8-v4t8-r16-s1-bf16"}) {
    for (const std::size_t dim : {8, 64, 128}) {
      for (const std::size_t group : {1, 2, 4}) {
        for (const float stddev : {15.0f, 30.0f}) {
          const Case c{config, 2, group, dim, 300, 299};
          const BasicKVCache cache = make_cache(c, seed);
          const auto q = kvq::test::normal_vector(c.kv_heads * c.group * c.dim, seed++ + 7, stddev);
          for (const std::size_t position : {129, 192, 299}) {
            SCOPED_TRACE(c.config + " gqa=" + std::to_string(group) + " d=" + std::to_string(dim) + " q*" +
                         std::to_string(int(stddev)) + " pos=" + std::to_string(position));
            std::vector<float> ref(q.size()), ref_int(q.size());
            kvq::reference_attention(cache, 0, position, q, ref);
            DecodeOptions r = options_for("reference");
            r.tier = Tier::integer;
            kvq::decode_attention(cache, 0, position, q, ref_int, r);
            for (const std::string& kernel : kernels()) {
              SCOPED_TRACE("kernel '" + kernel + "'");
              if (!kernel.empty() &&
                  !entry(kernel)->accepts(cache.keys(0, 0, 0), cache.values(0, 0, 0), group,
                                          cache.config().key_rope == kvq::KeyRope::pre ? &cache.rope() : nullptr))
                continue;
              DecodeOptions o = options_for(kernel);
              for (const Tier tier : {Tier::exact, Tier::integer}) {
                o.tier = tier;
                std::vector<float> out(q.size());
                kvq::decode_attention(cache, 0, position, q, out, o);
                EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); }))
                    << to_string(tier);
                // The vector kernels compute the exact tier for both (VectorKernelsComputeTheExactTierForBothTiers).
                const bool exact =
                    tier == Tier::exact || !kvq::test::computes_integer_tier(cache, q.size() / dim, kernel);
                const double err = exact ? relative_error(out, ref) : relative_error(out, ref_int);
                EXPECT_LT(err, exact ? exact_bound : integer_bound) << to_string(tier);
              }
            }
          }
        }
      }
    }
  }
}

// The output of `kernel` in `tier` at one position.
std::vector<float> kernel_output(const BasicKVCache& cache, std::size_t position, const std::vector<float>& q,
                                 const std::string& kernel, Tier tier) {
  std::vector<float> out(q.size());
  DecodeOptions o = options_for(kernel);
  o.tier = tier;
  kvq::decode_attention(cache, 0, position, q, out, o);
  return out;
}

// The relative difference of a kernel's integer tier from the reference kernel's at one position.
double integer_tier_difference(const BasicKVCache& cache, std::size_t position, const std::vector<float>& q,
                               const std::string& kernel) {
  return relative_error(kernel_output(cache, position, q, kernel, Tier::integer),
                        kernel_output(cache, position, q, "reference", Tier::integer));
}

TEST(DecodeAttention, VectorKernelsComputeTheExactTierForBothTiers) {
  // The vector kernels (vector-avx2, vector-avx512, vector-neon: the kernels named "vector-...")
  // compute the exact tier where the integer tier is asked for (VectorKernel::computes_integer_tier:
  // without integer dot products in the ops, the integer tier took 1.2x to 1.5x the exact tier's
  // time), so both tiers give the same bits, within exact_bound of the reference kernel's exact
  // tier. Shapes: value groups that are and are not a multiple of each width, a last group
  // shorter than the rest, 8-bit codes, head_dims of an odd number of vectors (48 on AVX-512) and
  // of 640, GQA ratios of 1, 3 and 9 (9: two passes of four heads and one of a single head), sharp
  // attention (queries 15x larger).
  unsigned seed = 600;
  std::size_t cases = 0;
  for (const char* config : {"k4c32-v2t32-r16-s1-post", "k2c32-v4t16-r16-s0-post", "k3c64-v8t32-r8-s2-post",
                             "k8c32-v2t8-r0-s0-post", "k4c32-v3t48-r16-s1-post", "k4c32-v2t32-r16-s1"}) {
    for (const std::size_t dim : {48, 64, 96, 128, 640}) {
      for (const std::size_t group : {1, 3, 9}) {
        for (const float stddev : {2.0f, 15.0f}) {
          const Case c{config, 1, group, dim, 301, 300};
          SCOPED_TRACE(c.config + " gqa=" + std::to_string(group) + " d=" + std::to_string(dim) + " q*" +
                       std::to_string(int(stddev)));
          const BasicKVCache cache = make_cache(c, seed);
          const auto q = kvq::test::normal_vector(c.kv_heads * c.group * c.dim, seed++ + 7, stddev);
          for (const auto& e : kvq::kernels::attention::registry()) {
            if (e.integer_tier || !e.available() ||
                !e.accepts(cache.keys(0, 0, 0), cache.values(0, 0, 0), group, nullptr))
              continue;
            SCOPED_TRACE(e.name);
            for (const std::size_t position : {300, 229}) {
              const auto exact = kernel_output(cache, position, q, e.name, Tier::exact);
              EXPECT_EQ(kernel_output(cache, position, q, e.name, Tier::integer), exact) << position;
              EXPECT_LT(relative_error(exact, kernel_output(cache, position, q, "reference", Tier::exact)), exact_bound)
                  << position;
              ++cases;
            }
          }
        }
      }
    }
  }
  const bool any =
      std::any_of(kvq::kernels::attention::registry().begin(), kvq::kernels::attention::registry().end(),
                  [](const auto& e) { return std::string_view(e.name).starts_with("vector-") && e.available(); });
  EXPECT_EQ(cases > 0, any) << "every vector kernel this CPU runs takes these shapes";
  for (const auto& e : kvq::kernels::attention::registry())
    EXPECT_EQ(e.integer_tier, !std::string_view(e.name).starts_with("vector-")) << e.name;
}

#if defined(KVQ_HAVE_X86_KERNELS)  // the AVX2 kernel exists on x86 only
bool has_kernel(const std::string& name) {
  const auto* e = entry(name);
  return e != nullptr && e->available();
}

TEST(DecodeAttention, Avx2IntegerTierFollowsTheReferenceKernel) {
  // The AVX2 kernel's integer tier sums int8 x u8 products with vpmaddubsw (2- and 4-bit codes;
  // tails of head_dims that are not a multiple of 32, odd row counts, GQA ratios that leave 1 to
  // 3 heads of the last 4); the sums are exact, so it follows the reference kernel's integer tier
  // up to exp() rounding and rounding ties (measured below 4e-6 at -O2; up to 1.6e-4 in a build
  // at -O1, as with the fp32 FMAs that summed them before), far inside integer_bound.
  // Queries 15x larger give sharp attention (u8 weights of most rows 0).
  if (!has_kernel("avx2")) GTEST_SKIP() << "no AVX2";
  unsigned seed = 500;
  for (const char* config : {"k4c32-v2t32-r16-s1-post", "k2c32-v4t32-r16-s0-post", "k4c64-v4t32-r8-s2-post",
                             "k2c16-v2t32-r0-s0-post", "k4c32-v8t32-r16-s1-post", "k8c32-v2t32-r16-s1-post"}) {
    for (const std::size_t dim : {40, 64, 72, 88, 96, 128, 136, 256}) {
      for (const std::size_t group : {1, 3, 6}) {
        for (const float stddev : {2.0f, 15.0f}) {
          const Case c{config, 1, group, dim, 301, 300};
          SCOPED_TRACE(c.config + " gqa=" + std::to_string(group) + " d=" + std::to_string(dim) + " q*" +
                       std::to_string(int(stddev)));
          const BasicKVCache cache = make_cache(c, seed);
          const auto q = kvq::test::normal_vector(c.kv_heads * c.group * c.dim, seed++ + 7, stddev);
          for (const std::size_t position : {300, 229})
            EXPECT_LT(integer_tier_difference(cache, position, q, "avx2"), 1e-3) << position;
        }
      }
    }
  }
}
#endif

TEST(DecodeAttention, IdenticalForEveryThreadCountAndCloseForEveryChunkSize) {
  // packed post- and pre-RoPE (integer and exact kernels) and fp16 (dense kernel) caches
  for (const char* config : {"k4c32-v2t32-r64-s1-post", "k2c32-v2t32-r16-s3-post", "k16-v16-r0-s1-post",
                             "k4c32-v2t32-r64-s3", "k2c16-v4t32-r16-s0"}) {
    SCOPED_TRACE(config);
    const Case c{config, 4, 4, 128, 1500, 1499};
    const BasicKVCache cache = make_cache(c, 9);
    const auto q = kvq::test::normal_vector(c.kv_heads * c.group * c.dim, 10);
    for (const std::string& kernel : kernels())
      for (const Tier tier : {Tier::exact, Tier::integer}) {
        SCOPED_TRACE("kernel '" + kernel + "'");
        DecodeOptions o = options_for(kernel);
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
          // fp32 sums over 1500 positions merged in another order: up to 1.02e-6 measured (the vector
          // kernel on AVX2 ops, fp16 cache).
          EXPECT_LT(relative_error(run(cache, c, q, o), serial), tier == Tier::exact ? 2e-6 : 2e-3) << chunk;
        }
      }
  }
}

TEST(DecodeAttention, KernelRegistry) {
  const Case c{"k4c32-v2t32-r16-s1", 2, 4, 128, 40, 39};
  const BasicKVCache cache = make_cache(c, 3);
  const auto& table = kvq::kernels::attention::registry();
  ASSERT_FALSE(table.empty());
  EXPECT_STREQ(table.back().name, "reference");  // takes every shape, so it is last
  for (std::size_t i = 0; i < table.size(); ++i)
    for (std::size_t j = i + 1; j < table.size(); ++j) EXPECT_STRNE(table[i].name, table[j].name);
  EXPECT_STREQ(kvq::decode_kernel(cache, 8, options_for("reference")), "reference");
  const std::string chosen = kvq::decode_kernel(cache, 8);
#if defined(KVQ_HAVE_X86_KERNELS)
  if (kvq::kernels::attention::avx512::supported()) {
    EXPECT_EQ(chosen.rfind("avx512-", 0), 0u) << chosen;
  } else {
    EXPECT_EQ(chosen, kvq::kernels::attention::avx2::supported() ? "avx2" : "reference");
  }
#elif defined(__aarch64__)
  EXPECT_EQ(chosen, "vector-neon");
#else
  EXPECT_EQ(chosen, "reference");
#endif
  // Every kernel this CPU runs answers to its name.
  for (const auto& e : table) {
    if (!e.available()) continue;
    EXPECT_EQ(std::string(kvq::decode_kernel(cache, 8, options_for(e.name))).rfind(e.name, 0), 0u);
  }
  // Unknown names, and names this CPU or shape rules out, are errors that say which.
  std::vector<float> q(8 * c.dim, 0.5f), out(q.size(), -1.0f);
  try {
    kvq::decode_attention(cache, 0, c.position, q, out, options_for("avx3"));
    ADD_FAILURE() << "an unknown kernel ran";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("'avx3'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("reference"), std::string::npos) << e.what();  // lists the known ones
  }
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == -1.0f; }));
  const BasicKVCache odd = make_cache({"k4c32-v2t32-r16-s1", 1, 3, 42, 40, 39}, 4);
  for (const auto& e : table) {
    if (std::string(e.name) == "reference") continue;
    EXPECT_THROW(kvq::decode_kernel(odd, 3, options_for(e.name)), kvq::Error)
        << e.name;  // 42 channels, or no CPU for it
  }
}

// decode_tier says which tier a kernel computes when the integer one is asked for: where it says
// exact, the integer request's output is the exact tier's bit for bit; where it says integer, it
// is not. Every kernel this CPU runs, on caches the integer tier reads and caches it does not
// (outliers, ggml's levels, 3-bit keys, keys stored rotated, full-precision rows, pre-RoPE keys
// beside full-precision values).
TEST(DecodeAttention, DecodeTierSaysWhichTierRan) {
  std::size_t answers[2] = {0, 0};
  for (const char* config :
       {"k4c32-v2t32-r16-s1-post", "k4c32-v2t32-r16-s1", "k3c32-v2t32-r16-s1-post", "k4c32o1-v2t32-r16-s1-post",
        "k4c32g-v2t32g-r16-s1-post", "k4c32-v2t32-r16-s1-hsk", "k8c32-v4t32-r16-s0", "k16-v16-r0-s0",
        "k4c32-v16-r16-s1", "k4c32-v16-r16-s1-post", "k16-v2t32-r16-s1"}) {
    const BasicKVCache cache = make_cache({config, 2, 4, 128, 300, 299}, 6);
    const auto q = kvq::test::normal_vector(8 * 128, 9, 0.5f);
    const kvq::RopeTable* rope = cache.config().key_rope == kvq::KeyRope::pre ? &cache.rope() : nullptr;
    for (const auto& e : kvq::kernels::attention::registry()) {
      if (!e.available() || !kvq::kernels::attention::kernel_takes(e, cache.keys(0, 0, 0), cache.values(0, 0, 0), 4,
                                                                   rope, kvq::detail::key_unrotation(cache) != nullptr))
        continue;
      SCOPED_TRACE(std::string(config) + " on '" + e.name + "'");
      const DecodeOptions exact{.tier = Tier::exact, .kernel = e.name},
          integer{.tier = Tier::integer, .kernel = e.name, .guard_outliers = false};
      EXPECT_EQ(kvq::decode_tier(cache, 8, exact), Tier::exact);
      std::vector<float> a(q.size()), b(q.size());
      kvq::decode_attention(cache, 0, 299, q, a, exact);
      kvq::decode_attention(cache, 0, 299, q, b, integer);
      const Tier said = kvq::decode_tier(cache, 8, integer);
      EXPECT_EQ(a == b, said == Tier::exact) << "decode_tier says " << kvq::to_string(said);
      ++answers[said == Tier::integer];
    }
  }
  EXPECT_GT(answers[0], 0u);  // some ran exact, some integer, on every CPU (the reference
  EXPECT_GT(answers[1], 0u);  // kernel computes the integer tier)
}

// decode_kernel names the kernel a cache's packed rows run on, so a change that sends a fast
// layout to a slower kernel fails here rather than only in the benchmarks.
TEST(DecodeAttention, KernelSelection) {
  struct Expected {
    const char* config;
    Tier tier;
    const char* avx512;
  };
  // Layouts the hand-tuned kernels read only row by row go to the vector kernel.
  const char* const vector_kernel = "vector-avx512";
  const Expected cases[] = {{"k16-v16-r0-s1-post", Tier::exact, "avx512-dense"},
                            {"k16-v16-r0-s1-post-f32", Tier::exact, "avx512-dense"},
                            {"k4c32-v2t32-r16-s1-post", Tier::exact, "avx512-exact"},
                            {"k4c32-v2t32-r16-s1-post", Tier::integer, "avx512-integer"},
                            {"k2c64-v8t32-r16-s0", Tier::integer, "avx512-integer"},
                            {"k8c32-v4t32-r16-s0", Tier::exact, "avx512-exact"},
                            // keys that flush, packed beyond the values (100 tokens: keys to
                            // 65, values to 36): still the span kernels
                            {"k4c32-v2t32-r64-s1-fk-post", Tier::exact, "avx512-exact"},
                            {"k4c32-v2t32-r64-s1-fk-post", Tier::integer, "avx512-integer"},
                            {"k3c8-v5t16-r5-s0", Tier::exact, vector_kernel},
                            // read row by row on AVX-512, unpacked in registers on AVX2: values
                            // in groups of 8, values per channel
                            {"k4c32-v2t8-r16-s1-post", Tier::exact, "avx2"},
                            {"k4t32-v4c32-r16-s1", Tier::integer, "avx2"},
                            // 3-bit keys per channel and values per token: the exact span
                            // kernel, before and after RoPE, for both tiers (exact_for_integer);
                            // stored rotated before RoPE, the generic kernel's integer tier
                            {"k3c32-v2t32-r16-s1-post", Tier::exact, "avx512-exact"},
                            {"k3c32-v4t32-r16-s1", Tier::exact, "avx512-exact"},
                            {"k3c32-v2t32-r16-s1-post", Tier::integer, "avx512-exact"},
                            {"k4c32-v3t32-r16-s1-post", Tier::exact, "avx512-exact"},
                            {"k3c32l-v3t32-r16-s1", Tier::exact, "avx512-exact"},
                            {"k3c32-v3t32-r16-s1", Tier::integer, "avx512-exact"},
                            {"k3c32-v3t32-r16-s1-hsk", Tier::integer, "avx512-generic"},
                            {"k4c32-v3t16-r16-s1-post", Tier::exact, "avx512-generic"},  // groups of 16
                            // row by row on both: pre-RoPE 5-bit keys
                            {"k5c32-v4t32-r16-s1", Tier::exact, vector_kernel},
                            {"k4t32-v2t32-r16-s1-post", Tier::integer, "avx512-generic"},
                            // pre-RoPE keys stored rotated: the generic kernel rotates them back
                            {"k4t32-v2t32-r16-s1-hk", Tier::exact, "avx512-generic"},
                            {"k4c32-v2t32-r16-s1-hsk-hv", Tier::integer, "avx512-generic"},
                            // ggml's levels run the exact tier for both
                            {"k4c32g-v2t32g-r16-s1-post", Tier::integer, "avx512-exact"},
                            // level tables of 2 to 4 bits are looked up where kvq's codes are
                            // converted (3 bits on the generic kernel); others go to the vector
                            // kernel
                            {"k4c32n-v2t32l-r16-s1-post", Tier::integer, "avx512-exact"},
                            {"k2c32l-v4t32n-r16-s1", Tier::exact, "avx512-exact"},
                            {"k4t32n-v4t32n-r16-s1-post", Tier::exact, "avx512-generic"},
                            {"k3c32l-v2t32l-r16-s1-post", Tier::exact, "avx512-exact"},
                            {"k3t32l-v2t32l-r16-s1-post", Tier::exact, "avx512-generic"},
                            {"k4c32i-v4t32i-r16-s1", Tier::exact, "avx512-exact"},
                            {"k1t32l-v4t32-r16-s1-post", Tier::exact, vector_kernel},
                            // fp8 codes: converted through f16 on the generic kernel (the span
                            // kernels' tables hold 16 levels), exact tier for both
                            {"k8c32e4m3-v8t32e5m2-r16-s1-post", Tier::integer, "avx512-generic"},
                            {"k8t32e5m2-v8t32e4m3-r16-s1", Tier::exact, "avx512-generic"},
                            {"k4c32n-v4c32n-r16-s1-post", Tier::exact, vector_kernel}};
  for (const Expected& e : cases) {
    const BasicKVCache cache = make_cache({e.config, 2, 4, 128, 100, 99}, 5);
    EXPECT_STREQ(kvq::decode_kernel(cache, 8, {.tier = e.tier, .kernel = "reference"}), "reference");
#if defined(KVQ_HAVE_X86_KERNELS)
    if (kvq::kernels::attention::avx512::supported()) {
      EXPECT_STREQ(kvq::decode_kernel(cache, 8, {.tier = e.tier}), e.avx512)
          << e.config << " " << kvq::to_string(e.tier);
    }
#elif defined(__aarch64__)
    EXPECT_STREQ(kvq::decode_kernel(cache, 8, {.tier = e.tier}), "vector-neon") << e.config;
#endif
  }
}

#if defined(KVQ_HAVE_X86_KERNELS)
// The registry's speed rules on any x86 CPU (KernelSelection pins the choice on AVX-512 only):
// the layouts each hand-tuned kernel unpacks in registers rather than reading row by row.
TEST(DecodeAttention, HandTunedKernelsSayWhatTheyReadAtSpeed) {
  struct Expected {
    const char* config;
    std::size_t dim;
    bool avx512, avx2;
  };
  const Expected cases[] = {
      {"k4c32-v2t32-r16-s1-post", 128, true, true},
      {"k4c32-v2t8-r16-s1-post", 128, false, true},     // 16 value groups of 8: AVX2's packed path
      {"k4c32-v2t32-r16-s1-post", 96, false, false},    // 3 value groups: no power of two
      {"k4c32-v4t8-r16-s1-post", 256, false, false},    // 32 value groups: more than 16
      {"k2t32-v2c32-r16-s1-post", 128, false, true},    // values per channel
      {"k4c8-v2t32-r16-s1-post", 128, false, true},     // key blocks of 8
      {"k3c32-v2t32-r16-s1-post", 128, true, true},     // 3-bit keys against the folded query
      {"k8c32e4m3-v8t32e5m2-r16-s1", 128, true, true},  // fp8 (AVX-512: through f16; AVX2 refuses it)
      {"k3c32-v2t32-r16-s1", 128, true, false},         // 3-bit keys rotated after dequantization
      {"k4c32-v3t32-r16-s1-post", 128, true, false},
      {"k3c32-v2t32-r16-s1-post", 64, true, true},
      {"k5t32-v4t32-r16-s1-post", 128, false, false},
      {"k4c32n-v2t32l-r16-s1", 128, true, true},  // tables (which AVX2 refuses in accepts)
      {"k3c32l-v2t32l-r16-s1-post", 128, true, true},
      {"k1c32-v2t32-r16-s1-post", 128, false, true},
      {"k4c32-v4t8n-r16-s1-post", 128, false, true}};
  for (const Expected& e : cases) {
    const BasicKVCache cache = make_cache({e.config, 1, 1, e.dim, 100, 99}, 6);
    const kvq::RopeTable* rope = cache.config().key_rope == kvq::KeyRope::pre ? &cache.rope() : nullptr;
    EXPECT_EQ(kvq::kernels::attention::avx512::at_speed(cache.keys(0, 0, 0), cache.values(0, 0, 0), rope), e.avx512)
        << e.config << " d=" << e.dim;
    EXPECT_EQ(kvq::kernels::attention::avx2::at_speed(cache.keys(0, 0, 0), cache.values(0, 0, 0), rope), e.avx2)
        << e.config << " d=" << e.dim;
  }
}
#endif

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
