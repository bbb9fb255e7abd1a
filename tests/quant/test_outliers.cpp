// Dense-and-sparse outliers (QuantizerSpec::outliers): which values are left out of a group's
// range, what is stored for them, and that the cache's readers (read_row, the attention kernels'
// selection, memory accounting, the append checks) see the corrected values.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/compare.hpp"
#include "support/kernels.hpp"
#include "support/random.hpp"

namespace {

using kvq::Axis;
using kvq::BasicKVCache;
using kvq::CacheConfig;
using kvq::CacheShape;
using kvq::Mode;
using kvq::QuantizerSpec;
using kvq::Scalar;
namespace ref = kvq::kernels::reference;

TEST(Outliers, SpecStringsRoundTripAndBadCountsAreRefused) {
  const QuantizerSpec k = kvq::parse_quantizer("k3c32o1", 'k');
  EXPECT_EQ(k.outliers, 1u);
  EXPECT_EQ(k.axis, Axis::per_channel);
  EXPECT_EQ(kvq::to_string(k, 'k'), "k3c32o1");
  for (const char* text : {"v4t8o2s.bf16", "v2t128o3", "k8c128o64.f32"})
    EXPECT_EQ(kvq::to_string(kvq::parse_quantizer(text, text[0]), text[0]), text);
  const CacheConfig c = kvq::parse_cache_config("k3c32o1-v2t8o1-r0-s0");
  EXPECT_EQ(kvq::to_string(c), "k3c32o1-v2t8o1-r0-s0");
  EXPECT_FALSE(c == kvq::parse_cache_config("k3c32-v2t8o1-r0-s0"));
  for (const char* bad : {"k3c32o0", "k3c32o01", "k3c4o4", "k3c128o65", "k3c32o", "k3c32so1"}) {
    try {
      (void)kvq::parse_quantizer(bad, 'k');
      ADD_FAILURE() << bad << " parsed";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument) << bad;
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
  // The compiled policies carry them too.
  using K3V4Sparse = kvq::KVPolicy<kvq::PerChannel<3, 32, Mode::asymmetric, kvq::fp16, 1>, kvq::PerToken<4, 32>>;
  static_assert(K3V4Sparse::key_quantizer::outliers == 1);
  EXPECT_EQ(kvq::to_string(K3V4Sparse::config()), "k3c32o1-v4t32-r128-s0");
  // Per-token groups with outliers must tile the head: every group has group values.
  QuantizerSpec v = kvq::parse_quantizer("v3t6o1", 'v');
  EXPECT_THROW(kvq::validate(v, 8, "values"), kvq::Error);
  EXPECT_NO_THROW(kvq::validate(v, 12, "values"));
  v.outliers = 6;
  EXPECT_THROW(kvq::validate(v, "values"), kvq::Error);
}

struct Coded {
  std::vector<float> decoded;
  std::vector<std::uint16_t> slots;
  float scale = 0, zero = 0;
};

// One per-token group of 8 values, 3 bits, f32 parameters.
Coded code_group(const std::vector<float>& x, std::size_t outliers, Mode mode = Mode::asymmetric) {
  const QuantizerSpec spec{3, 8, Axis::per_token, mode, Scalar::f32, outliers};
  float scale = 0, zero = 0;
  std::vector<float> corrections(outliers + 1);
  Coded out;
  out.slots.resize(outliers + 1, 0xffff);
  std::uint8_t packed[8];
  ref::quantize_row_per_token(spec, x.data(), 8, &scale, &zero, packed, {out.slots.data(), corrections.data()});
  out.decoded.resize(8);
  ref::dequantize_row_per_token(spec, packed, 8, &scale, &zero, out.decoded.data(),
                                {out.slots.data(), corrections.data()});
  out.slots.resize(outliers);
  out.scale = scale;
  out.zero = mode == Mode::asymmetric ? zero : -3.5f * scale;
  return out;
}

TEST(Outliers, HandWorkedGroups) {
  // The maximum leaves the range: 0..6 over 7 steps; 100 decodes through its correction.
  {
    const std::vector<float> x{0, 1, 2, 3, 4, 5, 6, 100};
    const Coded c = code_group(x, 1);
    EXPECT_EQ(c.slots, std::vector<std::uint16_t>{7});
    EXPECT_FLOAT_EQ(c.scale, 6.0f / 7.0f);
    EXPECT_EQ(c.zero, 0.0f);
    EXPECT_NEAR(c.decoded[7], 100.0f, 1e-4f);
    for (std::size_t i = 0; i < 7; ++i) EXPECT_LE(std::fabs(c.decoded[i] - x[i]), c.scale / 2 + 1e-6f) << i;
  }
  // The minimum, when it is the far one.
  EXPECT_EQ(code_group({-50, 1, 2, 3, 4, 5, 6, 7}, 1).slots, std::vector<std::uint16_t>{0});
  // A tie leaves out the maximum.
  {
    const Coded c = code_group({-10, 0, 0, 0, 0, 0, 0, 10}, 1);
    EXPECT_EQ(c.slots, std::vector<std::uint16_t>{7});
    EXPECT_EQ(c.zero, -10.0f);
    EXPECT_NEAR(c.decoded[7], 10.0f, 1e-5f);
  }
  // Two: 80 first (the smaller range left is 45, not 80), then -40; slots in ascending order.
  {
    const std::vector<float> x{0, 1, 2, 3, 4, 5, -40, 80};
    const Coded c = code_group(x, 2);
    EXPECT_EQ(c.slots, (std::vector<std::uint16_t>{6, 7}));
    EXPECT_FLOAT_EQ(c.scale, 5.0f / 7.0f);
    for (std::size_t i = 0; i < 8; ++i) EXPECT_NEAR(c.decoded[i], x[i], i >= 6 ? 1e-4f : c.scale / 2 + 1e-6f) << i;
  }
  // Symmetric: the largest magnitude; the maximum on a tie.
  EXPECT_EQ(code_group({1, -9, 2, 3, 0, 0, 0, 0}, 1, Mode::symmetric).slots, std::vector<std::uint16_t>{1});
  EXPECT_EQ(code_group({1, -9, 2, 9, 0, 0, 0, 0}, 1, Mode::symmetric).slots, std::vector<std::uint16_t>{3});
}

TEST(Outliers, PerChannelBlocksKeepEachChannelsSpikes) {
  const std::size_t rows = 32, dim = 16;
  std::vector<float> x = kvq::test::normal_vector(rows * dim, 3);
  x[5 * dim + 3] = 40.0f;
  x[17 * dim + 3] = -30.0f;
  x[9 * dim + 11] = 25.0f;
  std::vector<float> worst(2);
  for (const std::size_t n : {0u, 2u}) {
    const QuantizerSpec spec{3, rows, Axis::per_channel, Mode::asymmetric, Scalar::f16, n};
    std::vector<kvq::fp16> scales(dim), zeros(dim), corrections(dim * n);
    std::vector<std::uint16_t> slots(dim * n);
    const std::size_t row_bytes = kvq::packed_bytes(dim, 3);
    std::vector<std::uint8_t> codes(rows * row_bytes);
    ref::quantize_block_per_channel(spec, x.data(), rows, dim, dim, scales.data(), zeros.data(), codes.data(),
                                    row_bytes, {slots.data(), corrections.data()});
    if (n == 2) {
      EXPECT_EQ(slots[3 * n], 5u);
      EXPECT_EQ(slots[3 * n + 1], 17u);
      EXPECT_TRUE(slots[11 * n] == 9u || slots[11 * n + 1] == 9u);
      for (std::size_t c = 0; c < dim; ++c) EXPECT_LT(slots[c * n], slots[c * n + 1]) << c;
    }
    float& w = worst[n == 0 ? 0 : 1];
    for (std::size_t r = 0; r < rows; ++r) {
      float out[dim];
      ref::dequantize_row_per_channel(spec, codes.data() + r * row_bytes, dim, scales.data(), zeros.data(), out, r,
                                      {slots.data(), corrections.data()});
      for (std::size_t c = 0; c < dim; ++c) w = std::max(w, std::fabs(out[c] - x[r * dim + c]));
    }
  }
  // Without outliers channel 3's step spans 70 / 7; with two per group the spikes are kept
  // (to fp16 rounding of their corrections) and the steps shrink to the Gaussian bulk.
  EXPECT_GT(worst[0], 2.0f);
  EXPECT_LT(worst[1], 0.6f);
}

// Every packed row of a cache decodes to the reference quantization of the rows it was given,
// corrections included; memory counts each outlier's slot and correction.
TEST(Outliers, CacheRowsAreTheReferenceQuantizationWithCorrections) {
  const CacheShape shape{1, 2, 16, 200};
  const CacheConfig config = kvq::parse_cache_config("k3c32o1.f32-v3t8o1.f32-r0-s1-f32");
  const std::size_t n = 150, dim = 16, row = 2 * dim;
  std::vector<float> k = kvq::test::outlier_keys(n, 2, dim, 3, 8.0f, 5), v = kvq::test::normal_vector(n * row, 6);
  std::mt19937 rng(7);
  for (int i = 0; i < 40; ++i) k[rng() % k.size()] *= 12.0f, v[rng() % v.size()] *= 12.0f;
  BasicKVCache cache(shape, config);
  cache.append(0, 0, k, v);
  ASSERT_EQ(cache.quantized_end(kvq::Tensor::keys, 0), 1u + 4 * 32);
  ASSERT_EQ(cache.quantized_end(kvq::Tensor::values, 0), n);
  for (std::size_t h = 0; h < 2; ++h) {
    // Keys: the reference quantization of each group of 32 rows.
    for (std::size_t g = 1; g + 32 <= 1 + 4 * 32; g += 32) {
      std::vector<float> rows(32 * dim), scales(dim), zeros(dim), corrections(dim);
      std::vector<std::uint16_t> slots(dim);
      for (std::size_t r = 0; r < 32; ++r)
        std::copy_n(k.begin() + std::ptrdiff_t(((g + r) * 2 + h) * dim), dim, rows.begin() + std::ptrdiff_t(r * dim));
      const std::size_t row_bytes = kvq::packed_bytes(dim, 3);
      std::vector<std::uint8_t> codes(32 * row_bytes);
      ref::quantize_block_per_channel(config.key, rows.data(), 32, dim, dim, scales.data(), zeros.data(), codes.data(),
                                      row_bytes, {slots.data(), corrections.data()});
      for (std::size_t r = 0; r < 32; ++r) {
        float expected[dim], stored[dim];
        ref::dequantize_row_per_channel(config.key, codes.data() + r * row_bytes, dim, scales.data(), zeros.data(),
                                        expected, r, {slots.data(), corrections.data()});
        cache.read_row(kvq::Tensor::keys, 0, h, g + r, stored);
        for (std::size_t c = 0; c < dim; ++c) ASSERT_EQ(stored[c], expected[c]) << "key " << g + r << " ch " << c;
      }
    }
    // Values: each token's two groups of 8.
    for (std::size_t p = 1; p < n; ++p) {
      float scales[2], zeros[2], corrections[2], expected[dim], stored[dim];
      std::uint16_t slots[2];
      std::uint8_t codes[8];
      ref::quantize_row_per_token(config.value, v.data() + (p * 2 + h) * dim, dim, scales, zeros, codes,
                                  {slots, corrections});
      ref::dequantize_row_per_token(config.value, codes, dim, scales, zeros, expected, {slots, corrections});
      cache.read_row(kvq::Tensor::values, 0, h, p, stored);
      for (std::size_t c = 0; c < dim; ++c) ASSERT_EQ(stored[c], expected[c]) << "value " << p << " ch " << c;
    }
  }
  // f32 parameters: a key group costs 16 channels x (scale, zero, slot, correction) = 16 x 14
  // bytes, a value row 2 groups x 14 (the sink stays full precision).
  EXPECT_EQ(cache.memory().param_bytes, 2 * (4 * 16 * 14 + (n - 1) * 2 * 14));
}

TEST(Outliers, OnlyKernelsThatReadThemAreChosenOrNamed) {
  const CacheShape shape{1, 2, 64, 300};
  BasicKVCache cache(shape, kvq::parse_cache_config("k4c32o1-v2t32o1-r16-s1-post"));
  cache.append(0, 0, kvq::test::normal_vector(200 * 2 * 64, 1), kvq::test::normal_vector(200 * 2 * 64, 2));
  const std::vector<std::string> names = kvq::test::kernels_for(cache, 8);
  for (const std::string& name : names) {
    const auto* e =
        &*std::find_if(kvq::kernels::attention::registry().begin(), kvq::kernels::attention::registry().end(),
                       [&](const auto& entry) { return entry.name == name; });
    EXPECT_TRUE(e->outliers) << name;
  }
  EXPECT_EQ(names.back(), "reference");
  const std::string chosen = kvq::decode_kernel(cache, 8);
#if defined(KVQ_HAVE_X86_KERNELS)
  if (kvq::kernels::attention::avx512::supported()) {
    EXPECT_EQ(chosen, "vector-avx512");
  }
#elif defined(__aarch64__)
  EXPECT_EQ(chosen, "vector-neon");
#endif
  for (const auto& e : kvq::kernels::attention::registry()) {
    if (e.outliers || !e.available()) continue;
    try {
      (void)kvq::decode_kernel(cache, 8, {.kernel = e.name});
      ADD_FAILURE() << e.name << " was run on outliers";
    } catch (const kvq::Error& error) {
      EXPECT_EQ(error.code(), kvq::ErrorCode::unsupported);
      EXPECT_NE(std::string(error.what()).find("outliers"), std::string::npos) << error.what();
    }
  }
}

// Keys with rare spikes (0.5% of values 30 times larger, as activation outliers are): one outlier
// per channel and group takes them out of the 3-bit range, and the attention output is closer.
TEST(Outliers, CutAttentionErrorOnSpikyKeys) {
  const CacheShape shape{1, 2, 64, 600};
  const std::size_t n = 512, row = 2 * 64;
  std::vector<float> k = kvq::test::normal_vector(n * row, 11), v = kvq::test::normal_vector(n * row, 12);
  std::mt19937 rng(13);
  for (int i = 0; i < int(n * row / 200); ++i) k[rng() % k.size()] *= 30.0f;
  const auto q = kvq::test::normal_vector(8 * 64, 14, 0.5f);
  auto output = [&](const char* text) {
    BasicKVCache cache(shape, kvq::parse_cache_config(text));
    cache.append(0, 0, k, v);
    std::vector<float> out(q.size());
    kvq::decode_attention(cache, 0, n - 1, q, out);
    return out;
  };
  const std::vector<float> exact = output("k16-v16-r0-s0"), plain = output("k3c32-v8t64-r0-s0"),
                           dense_sparse = output("k3c32o1-v8t64-r0-s0");
  const double e_plain = kvq::test::relative_error(plain, exact),
               e_outliers = kvq::test::relative_error(dense_sparse, exact);
  EXPECT_LT(e_outliers, 0.4 * e_plain) << e_outliers << " vs " << e_plain;  // measured 0.19x
}

// A correction the parameter type cannot hold is refused before anything is stored.
TEST(Outliers, UnrepresentableCorrectionsAreRefusedAndChangeNothing) {
  const CacheShape shape{1, 1, 8, 64};
  std::vector<float> k(8, 0.5f), v{-60000, 60000, 0, 0, 0, 0, 0, 0};
  BasicKVCache plain(shape, kvq::parse_cache_config("k16-v3t8-r0-s0-f32"));
  EXPECT_NO_THROW(plain.append(0, 0, k, v));
  BasicKVCache cache(shape, kvq::parse_cache_config("k16-v3t8o1-r0-s0-f32"));
  const std::vector<std::uint8_t> before = cache.stored_bytes();
  try {
    cache.append(0, 0, k, v);
    ADD_FAILURE() << "the append was taken";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unrepresentable);
    EXPECT_NE(std::string(e.what()).find("outlier correction"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.length(0), 0u);
  EXPECT_EQ(cache.stored_bytes(), before);
}

}  // namespace
