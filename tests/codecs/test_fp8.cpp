// FP8 E4M3FN and E5M2: hand-worked conversions (round to nearest even, subnormals, saturation),
// every one of the 256 codes round-tripping, the scaled encode/decode, and the cache's fp8 modes
// (a scale per group).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/codecs/fp8.hpp"
#include "kvq/quant/policies.hpp"

namespace {

using kvq::float_to_fp8;
using kvq::fp8_to_float;
using kvq::Fp8Format;

constexpr Fp8Format e4 = Fp8Format::e4m3fn, e5 = Fp8Format::e5m2;

TEST(Fp8, E4M3HandWorked) {
  EXPECT_EQ(float_to_fp8(e4, 1.0f), 0x38);     // 0 0111 000: 2^(7-7)
  EXPECT_EQ(float_to_fp8(e4, -2.0f), 0xC0);    // 1 1000 000
  EXPECT_EQ(float_to_fp8(e4, 448.0f), 0x7E);   // 0 1111 110: 1.75 * 2^8, the largest
  EXPECT_EQ(float_to_fp8(e4, 0x1p-6f), 0x08);  // smallest normal
  EXPECT_EQ(float_to_fp8(e4, 0x1p-9f), 0x01);  // smallest subnormal: 1/8 * 2^-6
  EXPECT_EQ(float_to_fp8(e4, 1.0625f), 0x38);  // halfway 1 / 1.125: to the even 1.0
  EXPECT_EQ(float_to_fp8(e4, 1.1875f), 0x3A);  // halfway 1.125 / 1.25: to the even 1.25
  EXPECT_EQ(float_to_fp8(e4, 1.19f), 0x3A);
  EXPECT_EQ(float_to_fp8(e4, 0x1p-10f), 0x00);        // halfway 0 / 2^-9: to even 0
  EXPECT_EQ(float_to_fp8(e4, 3 * 0x1p-10f), 0x02);    // halfway 1 / 2 subnormal quanta: 2
  EXPECT_EQ(float_to_fp8(e4, 7.5f * 0x1p-9f), 0x08);  // halfway largest subnormal / smallest normal
  EXPECT_EQ(float_to_fp8(e4, -0.0f), 0x80);
  EXPECT_EQ(float_to_fp8(e4, 464.0f), 0x7E);  // halfway 448 / (480): to the even 448
  EXPECT_EQ(float_to_fp8(e4, 465.0f), 0x7E);  // rounds past 448: saturates
  EXPECT_EQ(float_to_fp8(e4, -1e9f), 0xFE);
  EXPECT_EQ(float_to_fp8(e4, 465.0f, false), 0x7F);  // no infinity: NaN when not saturating
  EXPECT_EQ(float_to_fp8(e4, INFINITY), 0x7E);
  EXPECT_TRUE(std::isnan(fp8_to_float(e4, float_to_fp8(e4, NAN))));
  EXPECT_EQ(fp8_to_float(e4, 0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(fp8_to_float(e4, 0x7F)));
  EXPECT_TRUE(std::isnan(fp8_to_float(e4, 0xFF)));
  EXPECT_EQ(fp8_to_float(e4, 0x78), 256.0f);  // exponent all ones is finite in e4m3fn
}

TEST(Fp8, E5M2HandWorked) {
  EXPECT_EQ(float_to_fp8(e5, 1.0f), 0x3C);             // 0 01111 00
  EXPECT_EQ(float_to_fp8(e5, 57344.0f), 0x7B);         // 0 11110 11: 1.75 * 2^15
  EXPECT_EQ(float_to_fp8(e5, 0x1p-16f), 0x01);         // smallest subnormal
  EXPECT_EQ(float_to_fp8(e5, 1.125f), 0x3C);           // halfway 1 / 1.25: to even
  EXPECT_EQ(float_to_fp8(e5, 1.375f), 0x3E);           // halfway 1.25 / 1.5: to even 1.5
  EXPECT_EQ(float_to_fp8(e5, 61440.0f), 0x7B);         // halfway 57344 / 65536: rounds up, saturates
  EXPECT_EQ(float_to_fp8(e5, 61440.0f, false), 0x7C);  // ... or overflows to infinity
  EXPECT_EQ(float_to_fp8(e5, 61439.0f, false), 0x7B);
  EXPECT_EQ(float_to_fp8(e5, -INFINITY, false), 0xFC);
  EXPECT_EQ(fp8_to_float(e5, 0x7C), INFINITY);
  EXPECT_TRUE(std::isnan(fp8_to_float(e5, 0x7D)));
  EXPECT_EQ(kvq::fp8_max(e5), 57344.0f);
  EXPECT_EQ(kvq::fp8_max(e4), 448.0f);
}

TEST(Fp8, EveryCodeRoundTripsAndFiniteCodesAreOrdered) {
  for (Fp8Format f : {e4, e5}) {
    float previous = -INFINITY;
    for (int c = 0; c < 256; ++c) {
      const float v = fp8_to_float(f, std::uint8_t(c));
      const std::uint8_t back = float_to_fp8(f, v, false);
      if (std::isnan(v)) {
        EXPECT_TRUE(std::isnan(fp8_to_float(f, back))) << c;
      } else {
        EXPECT_EQ(back, c) << kvq::name(f) << " code " << c << " value " << v;
        EXPECT_EQ(std::signbit(v), c >= 128) << c;
      }
    }
    // Positive codes in order are strictly increasing values (up to the first NaN/Inf).
    for (int c = 0; c < 128; ++c) {
      const float v = fp8_to_float(f, std::uint8_t(c));
      if (!std::isfinite(v)) break;
      EXPECT_GT(v, previous) << c;
      previous = v;
      // The midpoint to the next finite code rounds to the even one of the pair.
      const float next = fp8_to_float(f, std::uint8_t(c + 1));
      if (std::isfinite(next)) {
        const std::uint8_t mid = float_to_fp8(f, 0.5f * (v + next));
        EXPECT_EQ(mid, c % 2 == 0 ? c : c + 1) << kvq::name(f) << " " << c;
      }
    }
  }
}

// float_to_fp8 against the plain definition: the finite code nearest in value (ties to the even
// code), saturating. Every float whose top 20 bits vary (all exponents and signs, 2^12
// mantissas each), and each code's neighbours: the midpoints to the next code and a float either side.
TEST(Fp8, ConversionIsTheNearestCode) {
  for (const Fp8Format f : {e4, e5}) {
    std::vector<float> finite;  // positive finite values in code order (codes 0, 1, ...)
    for (int c = 0; c < 128 && std::isfinite(fp8_to_float(f, std::uint8_t(c))); ++c)
      finite.push_back(fp8_to_float(f, std::uint8_t(c)));
    auto nearest = [&](float x) {  // of the two codes around |x|, the nearer (the even on a tie)
      const double a = std::fabs(double(x));
      std::size_t c = std::size_t(std::lower_bound(finite.begin(), finite.end(), a) - finite.begin());
      if (c == finite.size()) {
        c = finite.size() - 1;
      } else if (c > 0) {
        const double below = a - finite[c - 1], above = finite[c] - a;
        if (below < above || (below == above && (c - 1) % 2 == 0)) --c;
      }
      return std::uint8_t((std::signbit(x) ? 0x80 : 0) | c);
    };
    std::vector<float> inputs;
    for (std::uint32_t top = 0; top < (1u << 20); ++top) {
      const float x = std::bit_cast<float>(top << 12 | (top * 2654435761u >> 20));
      if (std::isfinite(x)) inputs.push_back(x);
    }
    for (std::size_t c = 0; c + 1 < finite.size(); ++c) {
      const float mid = 0.5f * (finite[c] + finite[c + 1]);
      for (const float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY), -mid}) inputs.push_back(x);
    }
    std::size_t wrong = 0;
    for (const float x : inputs)
      if (float_to_fp8(f, x) != nearest(x) && ++wrong <= 5)
        ADD_FAILURE() << kvq::name(f) << " " << x << ": got " << int(float_to_fp8(f, x)) << ", nearest "
                      << int(nearest(x));
    EXPECT_EQ(wrong, 0u) << kvq::name(f) << " of " << inputs.size();
  }
}

TEST(Fp8, ScaledEncodeDecodeAndRefusals) {
  const std::vector<float> x = {1.0f, -3.0f, 1000.0f, 0.01f};
  std::vector<std::uint8_t> codes(4, 0x11);
  kvq::fp8_encode(e4, x, 2.0f, codes);
  EXPECT_EQ(codes[0], float_to_fp8(e4, 0.5f));
  EXPECT_EQ(codes[2], 0x7E);  // 500 saturates to 448
  std::vector<float> y(4);
  kvq::fp8_decode(e4, codes, 2.0f, y);
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_EQ(y[1], -3.0f);
  EXPECT_EQ(y[2], 896.0f);
  std::vector<std::uint8_t> untouched(4, 0x11);
  EXPECT_THROW(kvq::fp8_encode(e4, x, 0.0f, untouched), kvq::Error);
  EXPECT_THROW(kvq::fp8_encode(e4, x, NAN, untouched), kvq::Error);
  const std::vector<float> bad = {1.0f, INFINITY, 0.0f, 0.0f};
  EXPECT_THROW(kvq::fp8_encode(e5, bad, 1.0f, untouched), kvq::Error);
  EXPECT_EQ(untouched, std::vector<std::uint8_t>(4, 0x11));
  std::vector<std::uint8_t> three(3);
  EXPECT_THROW(kvq::fp8_encode(e5, x, 1.0f, three), kvq::Error);
  // Decoding takes the scales encoding takes, and writes nothing otherwise.
  for (const float scale : {NAN, INFINITY, 0.0f, -1.0f}) {
    std::vector<float> kept(4, 5.0f);
    EXPECT_THROW(kvq::fp8_decode(e4, codes, scale, kept), kvq::Error) << scale;
    EXPECT_EQ(kept, std::vector<float>(4, 5.0f)) << scale;
  }
}

// The cache's fp8 modes ("e4m3", "e5m2"): each group stores scale = P+(absmax / largest finite)
// and each value the code float_to_fp8(x / scale) (by the inverse of the stored scale), read back
// as fp8 value x scale: per token and per channel, every parameter type, a group of zeros, a
// group whose largest magnitude saturates, tiny values that round to zero or to subnormals.
TEST(Fp8, CacheModesStoreScaledFp8Codes) {
  std::mt19937 rng(41);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t dim = 64, heads = 2, tokens = 64;
  std::vector<float> keys(tokens * heads * dim), values(keys.size());
  for (auto* tensor : {&keys, &values})
    for (float& x : *tensor) x = normal(rng) * (rng() % 8 == 0 ? 50.0f : 1.0f);
  std::fill_n(values.begin() + 3 * heads * dim, 32, 0.0f);  // a group of zeros
  for (std::size_t c = 0; c < 32; ++c)                      // values spanning 1e-6..1e3 in one group
    values[4 * heads * dim + c] = std::pow(10.0f, float(c % 10) - 6.0f) * (c % 2 == 0 ? 1.0f : -1.0f);
  for (std::size_t c = 0; c < 32; ++c)  // small values: an f16 scale below the normal range
    values[5 * heads * dim + c] = normal(rng) * 1e-3f;
  for (const Fp8Format format : {e4, e5})
    for (const char* param : {"", ".bf16", ".f32"})
      for (const char* axis : {"c", "t"}) {
        const std::string fmt = format == e4 ? "e4m3" : "e5m2";
        const std::string config =
            std::string("k8") + axis + "32" + fmt + param + "-v8t32" + fmt + param + "-r0-s0-post-f32";
        SCOPED_TRACE(config);
        const kvq::CacheConfig cfg = kvq::parse_cache_config(config);
        EXPECT_EQ(kvq::to_string(cfg), config);
        kvq::BasicKVCache cache(kvq::CacheShape{1, heads, dim, tokens}, cfg);
        cache.append(0, 0, keys, values);
        for (const kvq::Tensor tensor : {kvq::Tensor::keys, kvq::Tensor::values}) {
          const std::vector<float>& input = tensor == kvq::Tensor::keys ? keys : values;
          const kvq::QuantizerSpec spec = tensor == kvq::Tensor::keys ? cfg.key : cfg.value;
          for (std::size_t h = 0; h < heads; ++h)
            for (std::size_t p = 0; p < tokens; ++p) {
              std::vector<float> row(dim);
              cache.read_row(tensor, 0, h, p, row.data());
              for (std::size_t c = 0; c < dim; ++c) {
                // The group: 32 channels of this token, or this channel in 32 tokens.
                float absmax = 0.0f;
                for (std::size_t i = 0; i < 32; ++i) {
                  const std::size_t gp = spec.axis == kvq::Axis::per_token ? p : p / 32 * 32 + i;
                  const std::size_t gc = spec.axis == kvq::Axis::per_token ? c / 32 * 32 + i : c;
                  absmax = std::max(absmax, std::fabs(input[(gp * heads + h) * dim + gc]));
                }
                const float scale = kvq::round_up_to(spec.param, absmax / kvq::fp8_max(format));
                const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
                const std::uint8_t code = float_to_fp8(format, input[(p * heads + h) * dim + c] * inv);
                ASSERT_EQ(row[c], fp8_to_float(format, code) * scale)
                    << kvq::to_string(tensor) << " head " << h << " position " << p << " channel " << c;
              }
            }
        }
      }
  // Relative error of a saturating group's largest value: within e4m3's half step (2^-4).
  kvq::BasicKVCache one(kvq::CacheShape{1, 1, 32, 1}, kvq::parse_cache_config("k8t32e4m3-v8t32e4m3-r0-s0-post-f32"));
  std::vector<float> x(32, 1.0f);
  x[7] = -3.0e4f;
  one.append(0, 0, x, x);
  std::vector<float> row(32);
  one.read_row(kvq::Tensor::values, 0, 0, 0, row.data());
  EXPECT_NEAR(row[7], -3.0e4f, 3.0e4f / 16.0f);
  EXPECT_NEAR(row[0], 1.0f, 1.0f / 16.0f);
  // Small groups with f16 scales: e5m2's scale absmax / 57344 is an f16 subnormal below absmax
  // 3.5 and under its least step below 3.4e-3. Rounded up, it clips nothing and is never 0:
  // every value comes back within the format's half step (2^-3 for e5m2, 2^-4 for e4m3).
  for (const char* config : {"k8t32e5m2-v8t32e5m2-r0-s0-post-f32", "k8t32e4m3-v8t32e4m3-r0-s0-post-f32"})
    for (const float magnitude : {2.0f, 4e-3f, 1e-3f, 1e-5f}) {
      kvq::BasicKVCache small(kvq::CacheShape{1, 1, 32, 1}, kvq::parse_cache_config(config));
      std::vector<float> y(32);
      for (std::size_t i = 0; i < 32; ++i)
        y[i] = magnitude * (0.25f + 0.75f * float(i) / 31.0f) * (i % 2 ? -1.0f : 1.0f);
      small.append(0, 0, y, y);
      small.read_row(kvq::Tensor::values, 0, 0, 0, row.data());
      const float half_step = config[6] == '5' ? 0.125f : 0.0625f;  // k8t32e5m2: the exponent width
      for (std::size_t i = 0; i < 32; ++i)
        ASSERT_LE(std::fabs(row[i] - y[i]), half_step * std::fabs(y[i]) * 1.0001f)
            << config << " magnitude " << magnitude << " value " << i << ": " << y[i] << " read as " << row[i];
    }
}

TEST(Fp8, CacheModeStringsPoliciesAndRefusals) {
  EXPECT_EQ(kvq::parse_quantizer("v8t32e4m3", 'v'), kvq::Fp8E4M3<32>::spec);
  EXPECT_EQ(kvq::parse_quantizer("k8c64e5m2.bf16", 'k'),
            (kvq::PerChannel<8, 64, kvq::Mode::fp8_e5m2, kvq::bf16>::spec));
  EXPECT_EQ(kvq::to_string(kvq::Fp8E5M2<128>::spec, 'v'), "v8t128e5m2");
  for (const char* bad : {"k4t32e4m3", "k8t32e4m", "k8t32e3m4", "k8t32o1e4m3", "k8t32e4m3s", "k8t32se4m3"})
    EXPECT_THROW((void)kvq::parse_quantizer(bad, 'k'), kvq::Error) << bad;
  try {
    kvq::validate(kvq::QuantizerSpec{4, 32, kvq::Axis::per_token, kvq::Mode::fp8_e5m2}, "values");
    ADD_FAILURE() << "a 4-bit fp8 spec was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("values: fp8_e5m2 levels take 8 bits, got 4"), std::string::npos) << e.what();
  }
  // An unrepresentable scale (f16 tops out at 65504, so |x| / 448 past it) is an error that
  // leaves the cache as it was.
  kvq::BasicKVCache cache(kvq::CacheShape{1, 1, 32, 4}, kvq::parse_cache_config("k8t32e4m3-v8t32e4m3-r0-s0-post-f32"));
  std::vector<float> x(32, 1.0f);
  cache.append(0, 0, x, x);
  std::vector<float> huge = x;
  huge[3] = 1.0e8f;
  try {
    cache.append(0, 1, huge, x);
    ADD_FAILURE() << "a key of 1e8 was stored with f16 scales";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs a scale"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.length(0), 1u);
  huge[3] = 2.0e7f;  // 2e7 / 448 fits f16
  cache.append(0, 1, huge, x);
  EXPECT_EQ(cache.length(0), 2u);
}

}  // namespace
