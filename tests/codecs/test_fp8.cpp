// FP8 E4M3FN and E5M2: hand-worked conversions (round to nearest even, subnormals, saturation),
// every one of the 256 codes round-tripping, and the scaled encode/decode.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/codecs/fp8.hpp"

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
}

}  // namespace
