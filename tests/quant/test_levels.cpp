// Non-uniform levels: Lloyd-Max levels are a fixed point of Lloyd's iteration and reach the
// published distortions, NormalFloat reproduces QLoRA's NF4 table, nearest-level coding with its
// tie rule, and group codecs with both scale rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/quant/code_levels.hpp"
#include "kvq/quant/levels.hpp"

namespace {

using kvq::GroupScale;
using kvq::LevelCodec;
using kvq::LevelSet;

// Max's 1960 table (J. Max, "Quantizing for minimum distortion"): MSE of the optimal N(0,1)
// quantizer with 2, 4, 8, 16 levels.
constexpr double published_distortion[] = {0.3634, 0.1175, 0.03454, 0.009497};

TEST(LloydMax, ReachesThePublishedGaussianDistortion) {
  for (int bits = 1; bits <= 4; ++bits) {
    const std::vector<double> c = kvq::lloyd_max_gaussian_levels(bits);
    ASSERT_EQ(c.size(), std::size_t(1) << bits);
    const double d = kvq::gaussian_distortion(c);
    EXPECT_NEAR(d / published_distortion[bits - 1], 1.0, 2e-3) << bits << " bits: " << d;
    // D * 4^b: the 1.45 / 1.88 / 2.21 / 2.43.
    const double ratio[] = {1.45, 1.88, 2.21, 2.43};
    EXPECT_NEAR(d * std::pow(4.0, bits), ratio[bits - 1], 0.01) << bits << " bits";
  }
}

TEST(LloydMax, LevelsAreTheCentroidsOfTheirCellsAndMatchMaxsTable) {
  for (int bits = 1; bits <= 4; ++bits) {
    const std::vector<double> c = kvq::lloyd_max_gaussian_levels(bits);
    for (std::size_t i = 0; i < c.size(); ++i) {
      const double a = i == 0 ? -INFINITY : 0.5 * (c[i - 1] + c[i]);
      const double b = i + 1 == c.size() ? INFINITY : 0.5 * (c[i] + c[i + 1]);
      const double mean = (kvq::detail::gaussian_pdf(a) - kvq::detail::gaussian_pdf(b)) /
                          (kvq::detail::gaussian_cdf(b) - kvq::detail::gaussian_cdf(a));
      EXPECT_NEAR(c[i], mean, 1e-9) << bits << " bits, level " << i;
      EXPECT_DOUBLE_EQ(c[i], -c[c.size() - 1 - i]);
    }
    // Any perturbation of a level raises the distortion (a minimum, not just a fixed point).
    std::vector<double> moved = c;
    moved.back() += 0.01;
    EXPECT_GT(kvq::gaussian_distortion(moved), kvq::gaussian_distortion(c));
  }
  EXPECT_NEAR(kvq::lloyd_max_gaussian_levels(1)[1], std::sqrt(2.0 / 3.141592653589793), 1e-12);
  const auto two = kvq::lloyd_max_gaussian_levels(2), three = kvq::lloyd_max_gaussian_levels(3),
             four = kvq::lloyd_max_gaussian_levels(4);
  EXPECT_NEAR(two[2], 0.4528, 1e-4);
  EXPECT_NEAR(two[3], 1.510, 1e-3);
  EXPECT_NEAR(three[4], 0.2451, 1e-4);
  EXPECT_NEAR(three[7], 2.152, 1e-3);
  EXPECT_NEAR(four[8], 0.1284, 1e-4);
  EXPECT_NEAR(four[15], 2.733, 1e-3);
}

TEST(NormalFloat, FourBitsIsQloraNf4Table) {
  // bitsandbytes' NF4 code book, as published with QLoRA.
  const double nf4[] = {-1.0,
                        -0.6961928009986877,
                        -0.5250730514526367,
                        -0.39491748809814453,
                        -0.28444138169288635,
                        -0.18477343022823334,
                        -0.09105003625154495,
                        0.0,
                        0.07958029955625534,
                        0.16093020141124725,
                        0.24611230194568634,
                        0.33791524171829224,
                        0.44070982933044434,
                        0.5626170039176941,
                        0.7229568362236023,
                        1.0};
  const std::vector<double> levels = kvq::normal_float_levels(4);
  ASSERT_EQ(levels.size(), 16u);
  for (std::size_t i = 0; i < 16; ++i) EXPECT_NEAR(levels[i], nf4[i], 2e-7) << i;
  for (int bits = 2; bits <= 4; ++bits) {
    const LevelSet& set = kvq::normal_float(bits);
    EXPECT_EQ(set.size(), std::size_t(1) << bits);
    EXPECT_EQ(set.levels().front(), -1.0f);
    EXPECT_EQ(set.levels().back(), 1.0f);
    EXPECT_EQ(set.decode(set.encode(0.0f)), 0.0f) << "an exact zero";
  }
  EXPECT_THROW((void)kvq::normal_float(1), kvq::Error);
  EXPECT_THROW((void)kvq::normal_float(5), kvq::Error);
  EXPECT_THROW((void)kvq::lloyd_max_gaussian(0), kvq::Error);
  EXPECT_THROW((void)kvq::lloyd_max_gaussian(5), kvq::Error);
}

// The cache's stored-format tables (quant/code_levels.hpp) are these level sets rounded to float.
TEST(CodeLevels, CacheTablesAreTheComputedLevelSets) {
  auto expect_table = [](kvq::Mode mode, int bits, const kvq::LevelSet& set) {
    const kvq::QuantizerSpec spec{bits, 32, kvq::Axis::per_token, mode};
    const float* table = kvq::code_levels(spec);
    ASSERT_NE(table, nullptr) << kvq::to_string(mode) << " " << bits;
    ASSERT_EQ(set.size(), std::size_t(1) << bits);
    // Within an ulp: the computation goes through libm's erfc and exp, which may differ in the last
    // place from one platform to another (the reason the tables are constants).
    for (std::size_t i = 0; i < set.size(); ++i)
      EXPECT_LE(std::fabs(table[i] - set.levels()[i]), std::numeric_limits<float>::epsilon() * std::fabs(table[i]))
          << kvq::to_string(mode) << " " << bits << " level " << i;
  };
  for (int bits = 1; bits <= 4; ++bits) expect_table(kvq::Mode::lloyd_max, bits, kvq::lloyd_max_gaussian(bits));
  for (int bits = 2; bits <= 4; ++bits) expect_table(kvq::Mode::normal_float, bits, kvq::normal_float(bits));
  EXPECT_EQ(kvq::code_levels(kvq::QuantizerSpec{4, 32, kvq::Axis::per_token, kvq::Mode::symmetric}), nullptr);
}

TEST(LevelSet, NearestLevelWithTiesToTheUpperOne) {
  const double l[] = {-2.0, -0.5, 0.25, 3.0};
  const LevelSet set(l);
  EXPECT_EQ(set.encode(-100.0f), 0);
  EXPECT_EQ(set.encode(-1.26f), 0);
  EXPECT_EQ(set.encode(-1.25f), 1);   // halfway between -2 and -0.5: upper
  EXPECT_EQ(set.encode(-0.125f), 2);  // halfway between -0.5 and 0.25: upper
  EXPECT_EQ(set.encode(-0.126f), 1);
  EXPECT_EQ(set.encode(1.625f), 3);
  EXPECT_EQ(set.encode(std::nextafter(1.625f, 0.0f)), 2);
  EXPECT_EQ(set.encode(1e30f), 3);
  // Brute force: the code is a nearest level on random values.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  const LevelSet& lm = kvq::lloyd_max_gaussian(3);
  for (int i = 0; i < 10000; ++i) {
    const float x = u(rng);
    const float got = std::fabs(x - lm.decode(lm.encode(x)));
    for (float level : lm.levels()) EXPECT_LE(got, std::fabs(x - level));
  }
  const double unsorted[] = {0.0, 1.0, 1.0};
  EXPECT_THROW(LevelSet{unsorted}, kvq::Error);
  const double one[] = {0.0};
  EXPECT_THROW(LevelSet{one}, kvq::Error);
}

TEST(LevelCodec, AbsmaxPutsTheLargestValueOnAnOuterLevelAndRmsReadsAUnitGaussian) {
  const LevelSet& nf = kvq::normal_float(4);
  std::vector<float> x = {0.5f, -2.0f, 1.0f, 0.0f, 3.0f, -0.25f, 0.75f};  // groups of 4: 2 groups
  const LevelCodec codec{&nf, 4, GroupScale::absmax, kvq::Scalar::f32};
  std::vector<std::uint8_t> codes(x.size());
  std::vector<float> scales(2), out(x.size());
  codec.encode(x, codes, scales);
  EXPECT_EQ(scales[0], 2.0f);
  EXPECT_EQ(scales[1], 3.0f);
  codec.decode(codes, scales, out);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[4], 3.0f);
  EXPECT_EQ(out[3], 0.0f);
  EXPECT_EQ(out[0], 2.0f * nf.levels()[codes[0]]);

  const LevelCodec rms{&kvq::lloyd_max_gaussian(2), 4, GroupScale::rms, kvq::Scalar::f32};
  const std::vector<float> y = {1.0f, -1.0f, 1.0f, -1.0f};
  std::vector<std::uint8_t> c4(4);
  std::vector<float> s1(1), o4(4);
  rms.encode(y, c4, s1);
  EXPECT_EQ(s1[0], 1.0f);
  rms.decode(c4, s1, o4);
  EXPECT_NEAR(o4[0], 1.510, 1e-3);  // nearest Lloyd-Max level of 1.0 is 1.510 (threshold 0.98)
  EXPECT_NEAR(o4[1], -1.510, 1e-3);

  // A zero group decodes to zeros; a f16 scale is what the codes were computed from.
  std::vector<float> zeros(4, 0.0f), z1(1);
  rms.encode(zeros, c4, z1);
  rms.decode(c4, z1, o4);
  for (float v : o4) EXPECT_EQ(v, 0.0f);

  // Bad input: nothing written.
  std::vector<float> bad = {1.0f, NAN, 0.0f, 0.0f};
  s1[0] = 7.0f;
  EXPECT_THROW(rms.encode(bad, c4, s1), kvq::Error);
  EXPECT_EQ(s1[0], 7.0f);
  std::vector<float> short_scales;
  EXPECT_THROW(rms.encode(y, c4, short_scales), kvq::Error);
  const LevelCodec f16{&nf, 4, GroupScale::absmax, kvq::Scalar::f16};
  std::vector<float> huge = {1e6f, 0.0f, 0.0f, 0.0f};
  EXPECT_THROW(f16.encode(huge, c4, s1), kvq::Error);  // 1e6 > fp16's 65504

  // A scale that overflows in a later group: the first group's codes and scale are not written.
  const LevelCodec pairs{&nf, 2, GroupScale::absmax, kvq::Scalar::f16};
  std::vector<std::uint8_t> c2(4, 99);
  std::vector<float> s2(2, -7.0f);
  try {
    pairs.encode(std::vector<float>{1.0f, -1.0f, 1e6f, 2.0f}, c2, s2);
    ADD_FAILURE() << "a scale beyond fp16 was stored";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unrepresentable) << e.what();
    EXPECT_NE(std::string(e.what()).find("group 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c2, std::vector<std::uint8_t>(4, 99));
  EXPECT_EQ(s2, std::vector<float>(2, -7.0f));

  // A group longer than any input is one group (the count does not wrap).
  const LevelCodec whole{&nf, SIZE_MAX, GroupScale::absmax, kvq::Scalar::f32};
  EXPECT_EQ(whole.groups(2), 1u);
  std::vector<std::uint8_t> c1(2);
  whole.encode(std::vector<float>{0.5f, -1.0f}, c1, z1);
  EXPECT_EQ(z1[0], 1.0f);
  EXPECT_THROW(whole.encode(std::vector<float>{0.5f, -1.0f}, c1, short_scales), kvq::Error);
}

}  // namespace
