// fp16 / bf16 conversions against the F16C instructions and against plainly written references.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kvq/core/half.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define KVQ_TEST_HAVE_F16C_INTRINSICS 1
#endif

namespace {

using kvq::bf16;
using kvq::fp16;
using kvq::Scalar;

std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }
float float_of(std::uint32_t u) { return std::bit_cast<float>(u); }

#if defined(KVQ_TEST_HAVE_F16C_INTRINSICS)
__attribute__((target("f16c"))) std::uint16_t hw_to_fp16(float x) {
  const __m128i h = _mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return static_cast<std::uint16_t>(_mm_extract_epi16(h, 0));
}
__attribute__((target("f16c"))) float hw_to_float(std::uint16_t h) { return _cvtsh_ss(h); }
bool have_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;  // cpuid: F16C is VEX-encoded, so AVX must be usable too
  if (__get_cpuid(1, &a, &b, &c, &d) == 0 || (c & bit_F16C) == 0) return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx");
}
#else
std::uint16_t hw_to_fp16(float) { return 0; }
float hw_to_float(std::uint16_t) { return 0.0f; }
bool have_f16c() { return false; }
#endif

// Plain reference: the value of a binary16 pattern from its definition.
double plain_fp16_value(std::uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0x1f)
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  else if (e == 0)
    v = std::ldexp(double(m), -24);
  else
    v = std::ldexp(double(1024 + m), e - 25);
  return sign ? -v : v;
}

// All positive finite fp16 values in increasing order (pattern i has value table[i]).
const std::vector<double>& positive_fp16_table() {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (std::uint32_t h = 0; h <= 0x7bff; ++h) t.push_back(plain_fp16_value(std::uint16_t(h)));
    return t;
  }();
  return table;
}

// Plain reference: nearest fp16 by search, ties to the even pattern, overflow at 65520.
std::uint16_t plain_to_fp16(float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return 0x7e00;
  const double a = std::fabs(double(x));
  if (a >= 65520.0) return std::uint16_t(sign | 0x7c00);
  const auto& t = positive_fp16_table();
  const auto it = std::lower_bound(t.begin(), t.end(), a);  // first value >= a
  const std::size_t hi = std::size_t(it - t.begin());
  if (hi < t.size() && t[hi] == a) return std::uint16_t(sign | hi);
  if (hi == t.size()) return std::uint16_t(sign | 0x7bff);  // (65504, 65520): rounds down
  const std::size_t lo = hi - 1;
  const double mid = (t[lo] + t[hi]) / 2;  // exact in double
  std::size_t pick = a < mid ? lo : a > mid ? hi : (lo % 2 == 0 ? lo : hi);
  return std::uint16_t(sign | pick);
}

// Plain reference: bf16 by comparing the distances to both neighbours in double.
std::uint16_t plain_to_bf16(float x) {
  if (std::isnan(x)) return 0x7fc0;
  const std::uint32_t u = bits_of(x);
  const std::uint16_t down = std::uint16_t(u >> 16);  // truncation toward zero
  const std::uint16_t up = std::uint16_t(down + 1);   // next magnitude (may be inf)
  const double a = std::fabs(double(x));
  const double da = a - std::fabs(double(float_of(std::uint32_t(down) << 16)));
  if (da == 0) return down;
  double ub;
  if ((up & 0x7fff) == 0x7f80)
    ub = std::ldexp(1.0, 128);  // where the next binade would start
  else
    ub = std::fabs(double(float_of(std::uint32_t(up) << 16)));
  const double du = ub - a;
  if (da < du) return down;
  if (du < da) return up;
  return (down & 1) == 0 ? down : up;
}

bool is_fp16_nan(std::uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

#if defined(KVQ_TEST_HAVE_F16C_INTRINSICS)  // elsewhere the plain reference is the only oracle
TEST(Fp16, HardwareOracleWorks) {
  if (!have_f16c()) GTEST_SKIP() << "no F16C: the plain reference is the only oracle";
  EXPECT_EQ(hw_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(hw_to_fp16(-65504.0f), 0xfbff);
  EXPECT_EQ(hw_to_fp16(65520.0f), 0x7c00);
  EXPECT_EQ(hw_to_fp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(hw_to_float(0x3555), 0.333251953125f);
}
#endif

TEST(Fp16, EveryPatternDecodesLikeTheDefinitionAndRoundTrips) {
  const bool hw = have_f16c();
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const fp16 h{std::uint16_t(b)};
    const float f = kvq::to_float(h);
    if (is_fp16_nan(h.bits)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << b;
      EXPECT_TRUE(is_fp16_nan(kvq::to_fp16(f).bits)) << "NaN must stay NaN: " << std::hex << b;
      continue;
    }
    EXPECT_EQ(double(f), plain_fp16_value(h.bits)) << std::hex << b;
    if (hw) {
      EXPECT_EQ(bits_of(f), bits_of(hw_to_float(h.bits))) << std::hex << b;
    }
    EXPECT_EQ(kvq::to_fp16(f).bits, b) << std::hex << b;
  }
}

TEST(Fp16, HandWrittenCases) {
  EXPECT_EQ(kvq::to_fp16(0.0f).bits, 0x0000);
  EXPECT_EQ(kvq::to_fp16(-0.0f).bits, 0x8000);
  EXPECT_EQ(kvq::to_fp16(1.0f).bits, 0x3c00);
  EXPECT_EQ(kvq::to_fp16(-2.0f).bits, 0xc000);
  EXPECT_EQ(kvq::to_fp16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(kvq::to_fp16(65519.996f).bits, 0x7bff);  // just below the overflow tie
  EXPECT_EQ(kvq::to_fp16(65520.0f).bits, 0x7c00);    // tie between 65504 and 65536 goes to even (inf)
  EXPECT_EQ(kvq::to_fp16(-65520.0f).bits, 0xfc00);
  EXPECT_EQ(kvq::to_fp16(1e9f).bits, 0x7c00);
  EXPECT_EQ(kvq::to_fp16(std::numeric_limits<float>::infinity()).bits, 0x7c00);
  EXPECT_EQ(kvq::to_fp16(std::ldexp(1.0f, -24)).bits, 0x0001);  // least subnormal
  EXPECT_EQ(kvq::to_fp16(std::ldexp(1.0f, -25)).bits, 0x0000);  // half of it: tie to even (0)
  EXPECT_EQ(kvq::to_fp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)).bits, 0x0001);
  EXPECT_EQ(kvq::to_fp16(std::ldexp(3.0f, -25)).bits, 0x0002);                          // 1.5 ulp: tie to even (2)
  EXPECT_EQ(kvq::to_fp16(std::ldexp(5.0f, -25)).bits, 0x0002);                          // 2.5 ulp: tie to even (2)
  EXPECT_EQ(kvq::to_fp16(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)).bits, 0x0400);  // carry into normal
  EXPECT_EQ(kvq::to_fp16(1.0f + std::ldexp(1.0f, -11)).bits, 0x3c00);                   // tie to even
  EXPECT_EQ(kvq::to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)).bits, 0x3c02);               // tie to even (up)
  EXPECT_EQ(kvq::to_fp16(2047.5f).bits, 0x6800);  // 2047.5 -> tie between 2047 and 2048: 2048 (even)
  EXPECT_TRUE(is_fp16_nan(kvq::to_fp16(std::numeric_limits<float>::quiet_NaN()).bits));
  EXPECT_TRUE(is_fp16_nan(kvq::to_fp16(float_of(0x7f800001u)).bits));  // signalling NaN with a low payload
}

void check_fp16(float x, bool hw) {
  const std::uint16_t got = kvq::to_fp16(x).bits;
  if (std::isnan(x)) {
    EXPECT_TRUE(is_fp16_nan(got)) << std::hex << bits_of(x);
    return;
  }
  const std::uint16_t want = plain_to_fp16(x);
  ASSERT_EQ(got, want) << "x bits " << std::hex << bits_of(x);
  if (hw) {
    ASSERT_EQ(got, hw_to_fp16(x)) << "x bits " << std::hex << bits_of(x);
  }
}

TEST(Fp16, HalfwayPointsAndTheirNeighbours) {
  const bool hw = have_f16c();
  const auto& t = positive_fp16_table();
  for (std::size_t i = 0; i + 1 < t.size(); ++i) {
    const float mid = float((t[i] + t[i + 1]) / 2);  // exact: 12 significant bits
    ASSERT_EQ(double(mid), (t[i] + t[i + 1]) / 2);
    for (const float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      check_fp16(x, hw);
      check_fp16(-x, hw);
    }
  }
  // Around the overflow threshold, one float ulp at a time.
  for (float x = 65480.0f; x <= 65560.0f; x = std::nextafter(x, 1e9f)) {
    check_fp16(x, hw);
    check_fp16(-x, hw);
  }
}

TEST(Fp16, MillionsOfRandomFloats) {
  const bool hw = have_f16c();
  std::mt19937 rng(12345);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::uniform_real_distribution<float> subnormal_range(0.0f, std::ldexp(1.0f, -13));
  std::uniform_real_distribution<float> top_range(60000.0f, 70000.0f);
  std::uniform_real_distribution<float> unit(-4.0f, 4.0f);
  for (int i = 0; i < 1'000'000; ++i) {
    check_fp16(float_of(any_bits(rng)), hw);  // every exponent, NaN and Inf included
    check_fp16(subnormal_range(rng), hw);
    check_fp16(top_range(rng), hw);
    check_fp16(unit(rng), hw);
    if (HasFatalFailure()) return;
  }
}

TEST(Bf16, HandWrittenCasesAndTies) {
  EXPECT_EQ(kvq::to_bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(kvq::to_bf16(-0.0f).bits, 0x8000);
  EXPECT_EQ(kvq::to_bf16(float_of(0x3f808000u)).bits, 0x3f80);  // tie, even below
  EXPECT_EQ(kvq::to_bf16(float_of(0x3f818000u)).bits, 0x3f82);  // tie, even above
  EXPECT_EQ(kvq::to_bf16(float_of(0x3f808001u)).bits, 0x3f81);
  EXPECT_EQ(kvq::to_bf16(float_of(0x3f807fffu)).bits, 0x3f80);
  EXPECT_EQ(kvq::to_bf16(float_of(0xbf818000u)).bits, 0xbf82);
  EXPECT_EQ(kvq::to_bf16(float_of(0x00008000u)).bits, 0x0000);  // subnormal tie
  EXPECT_EQ(kvq::to_bf16(float_of(0x00018000u)).bits, 0x0002);
  EXPECT_EQ(kvq::to_bf16(float_of(0x7f7f7fffu)).bits, 0x7f7f);
  EXPECT_EQ(kvq::to_bf16(float_of(0x7f7f8000u)).bits, 0x7f80);  // tie at the top rounds to even: inf
  EXPECT_EQ(kvq::to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80);
  EXPECT_EQ(kvq::to_bf16(std::numeric_limits<float>::infinity()).bits, 0x7f80);
  EXPECT_EQ(kvq::to_bf16(-std::numeric_limits<float>::infinity()).bits, 0xff80);
  EXPECT_TRUE(std::isnan(kvq::to_float(kvq::to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(kvq::to_float(kvq::to_bf16(float_of(0x7f800001u)))));  // payload only in low bits
  EXPECT_TRUE(std::isnan(kvq::to_float(kvq::to_bf16(float_of(0xffffffffu)))));
  EXPECT_EQ(kvq::to_float(bf16{0x4049}), 3.140625f);
}

TEST(Bf16, EveryPatternRoundTripsAndRandomFloatsMatchReference) {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = kvq::to_float(bf16{std::uint16_t(b)});
    EXPECT_EQ(bits_of(f), b << 16);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(kvq::to_float(kvq::to_bf16(f))));
    } else {
      EXPECT_EQ(kvq::to_bf16(f).bits, b) << std::hex << b;
    }
  }
  std::mt19937 rng(777);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::uniform_int_distribution<std::uint32_t> ties(0, 0xffff);
  for (int i = 0; i < 2'000'000; ++i) {
    float x = float_of(any_bits(rng));
    if (i % 2) x = float_of((std::uint32_t(ties(rng)) << 16) | 0x8000u);  // exact ties
    const std::uint16_t got = kvq::to_bf16(x).bits;
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(kvq::to_float(bf16{got})));
      continue;
    }
    ASSERT_EQ(got, plain_to_bf16(x)) << std::hex << bits_of(x);
  }
}

TEST(Scalar, RoundToStoreAndLoad) {
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 1000.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = normal(rng) * (i % 3 == 0 ? 1e-6f : 1.0f);
    EXPECT_EQ(bits_of(kvq::round_to(Scalar::f32, x)), bits_of(x));
    EXPECT_EQ(double(kvq::round_to(Scalar::f16, x)), plain_fp16_value(plain_to_fp16(x)));
    EXPECT_EQ(bits_of(kvq::round_to(Scalar::bf16, x)), std::uint32_t(plain_to_bf16(x)) << 16);
    for (const Scalar s : {Scalar::f32, Scalar::f16, Scalar::bf16}) {
      // A buffer of 4 elements with sentinels: only element 2 may change.
      std::array<std::uint8_t, 16> buffer;
      buffer.fill(0xa5);
      kvq::store_scalar(s, buffer.data(), 2, x);
      const std::size_t size = kvq::size_of(s);
      for (std::size_t b = 0; b < buffer.size(); ++b)
        if (b < 2 * size || b >= 3 * size) {
          ASSERT_EQ(buffer[b], 0xa5) << kvq::to_string(s) << " byte " << b;
        }
      EXPECT_EQ(bits_of(kvq::load_scalar(s, buffer.data(), 2)), bits_of(kvq::round_to(s, x))) << kvq::to_string(s);
    }
  }
  EXPECT_EQ(kvq::size_of(Scalar::f32), 4u);
  EXPECT_EQ(kvq::size_of(Scalar::f16), 2u);
  EXPECT_EQ(kvq::size_of(Scalar::bf16), 2u);
  EXPECT_EQ(kvq::max_finite(Scalar::f16), 65504.0f);
  EXPECT_EQ(bits_of(kvq::max_finite(Scalar::bf16)), 0x7f7f0000u);
  EXPECT_EQ(kvq::max_finite(Scalar::f32), std::numeric_limits<float>::max());
  static_assert(kvq::scalar_of<fp16> == Scalar::f16 && kvq::scalar_of<bf16> == Scalar::bf16 &&
                kvq::scalar_of<float> == Scalar::f32);
  static_assert(kvq::to_fp16(1.0f).bits == 0x3c00, "conversions are usable in constant expressions");
  static_assert(kvq::to_float(kvq::bf16{0x3f80}) == 1.0f);
}

}  // namespace
