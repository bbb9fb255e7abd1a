// The normalized Walsh-Hadamard transform: the explicit matrix on small sizes, orthogonality
// (norms and dot products kept, inverse undoes forward), block-diagonal heads, seeded signs.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvq/transform/hadamard.hpp"
#include "support/random.hpp"

namespace {

using kvq::HadamardTransform;

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// H[i][j] = (-1)^popcount(i & j) / sqrt(n) per block, times the sign of column j.
std::vector<float> explicit_forward(const HadamardTransform& t, const std::vector<float>& x) {
  const std::size_t d = t.dim(), n = t.block();
  std::vector<float> y(x.size(), 0.0f);
  for (std::size_t h = 0; h < x.size(); h += d)
    for (std::size_t b = 0; b < d; b += n)
      for (std::size_t i = 0; i < n; ++i) {
        double s = 0;
        for (std::size_t j = 0; j < n; ++j) {
          const double sign = t.signs().empty() ? 1.0 : t.signs()[b + j];
          s += (std::popcount(i & j) % 2 ? -1.0 : 1.0) * sign * x[h + b + j];
        }
        y[h + b + i] = float(s / std::sqrt(double(n)));
      }
  return y;
}

TEST(Hadamard, BlockIsTheLargestPowerOfTwoDividingTheHead) {
  EXPECT_EQ(kvq::hadamard_block(128), 128u);
  EXPECT_EQ(kvq::hadamard_block(96), 32u);
  EXPECT_EQ(kvq::hadamard_block(80), 16u);
  EXPECT_EQ(kvq::hadamard_block(8), 8u);
  EXPECT_EQ(kvq::hadamard_block(7), 1u);
}

TEST(Hadamard, EqualsTheExplicitMatrix) {
  // H_2 = [1 1; 1 -1] / sqrt 2, by hand.
  HadamardTransform two(2);
  std::vector<float> v = {3.0f, 1.0f};
  two.forward(v);
  EXPECT_FLOAT_EQ(v[0], 4.0f / std::sqrt(2.0f));
  EXPECT_FLOAT_EQ(v[1], 2.0f / std::sqrt(2.0f));
  for (std::size_t dim : {1u, 2u, 4u, 8u, 16u, 12u, 24u, 96u})
    for (bool signs : {false, true}) {
      const HadamardTransform t = signs ? HadamardTransform(dim, 42) : HadamardTransform(dim);
      const std::vector<float> x = kvq::test::normal_vector(3 * dim, unsigned(dim));
      std::vector<float> y = x;
      t.forward(y);
      const std::vector<float> expected = explicit_forward(t, x);
      for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], expected[i], 1e-5) << dim << " " << i;
    }
}

TEST(Hadamard, IsOrthogonal) {
  for (std::size_t dim : {8u, 64u, 96u, 128u, 80u})
    for (bool signs : {false, true}) {
      const HadamardTransform t = signs ? HadamardTransform(dim, 7) : HadamardTransform(dim);
      const std::vector<float> q = kvq::test::normal_vector(4 * dim, 1),
                               k = kvq::test::outlier_keys(1, 4, dim, 3, 20.0f, 2);
      std::vector<float> hq = q, hk = k;
      t.forward(hq);
      t.forward(hk);
      EXPECT_NEAR(dot(hq, hq), dot(q, q), 1e-5 * dot(q, q)) << dim;                         // norm kept
      EXPECT_NEAR(dot(hq, hk), dot(q, k), 1e-5 * std::sqrt(dot(q, q) * dot(k, k))) << dim;  // q.k = Hq.Hk
      std::vector<float> back = hk;
      t.inverse(back);
      float largest = 0;  // the round trip is exact to 1e-6 of the vector's largest value
      for (float v : k) largest = std::max(largest, std::fabs(v));
      for (std::size_t i = 0; i < k.size(); ++i) EXPECT_NEAR(back[i], k[i], 1e-6 * largest) << dim;
    }
}

TEST(Hadamard, SpreadsAnOutlierChannel) {
  HadamardTransform t(64);
  std::vector<float> x(64, 0.0f);
  x[5] = 8.0f;
  t.forward(x);
  for (float v : x) EXPECT_FLOAT_EQ(std::fabs(v), 1.0f);  // 8 / sqrt(64) on every channel
}

TEST(Hadamard, SignsAreFixedBySeedAndBalanced) {
  const HadamardTransform a(128, 1), b(128, 1), c(128, 2);
  EXPECT_TRUE(std::equal(a.signs().begin(), a.signs().end(), b.signs().begin()));
  EXPECT_FALSE(std::equal(a.signs().begin(), a.signs().end(), c.signs().begin()));
  int negative = 0;
  for (float s : a.signs()) negative += s < 0;
  EXPECT_GT(negative, 40);
  EXPECT_LT(negative, 88);
}

TEST(Hadamard, RejectsBadShapes) {
  EXPECT_THROW(HadamardTransform(0), kvq::Error);
  HadamardTransform t(8);
  std::vector<float> x(12, 1.0f);
  EXPECT_THROW(t.forward(x), kvq::Error);
  EXPECT_EQ(x[0], 1.0f);
}

// Blocks beyond max_block_norm() (butterfly sums that would overflow float) and NaN/Inf are
// refused by name before anything is written; blocks at the bound round-trip finite.
TEST(Hadamard, RefusesValuesItCannotTransform) {
  for (const bool signs : {false, true}) {
    const HadamardTransform t = signs ? HadamardTransform(96, 3) : HadamardTransform(96);
    ASSERT_FLOAT_EQ(t.max_block_norm(), std::numeric_limits<float>::max() / (2 * std::sqrt(32.0f)));
    for (const bool forward : {true, false}) {
      auto apply = [&](std::vector<float>& x) { forward ? t.forward(x) : t.inverse(x); };
      // Blocks of 32 equal values at the bound: the first butterfly sums reach 32 x the value.
      std::vector<float> x(2 * 96, t.max_block_norm() / std::sqrt(32.0f) * (1 - 1e-6f));
      std::vector<float> y = x;
      apply(y);
      EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float v) { return std::isfinite(v); }));
      forward ? t.inverse(y) : t.forward(y);
      for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i] / x[i], 1.0f, 1e-5f) << i;

      const std::vector<float> before = x;
      for (const float bad : {2 * t.max_block_norm(), -std::numeric_limits<float>::max(),
                              std::numeric_limits<float>::infinity(), std::nanf("")}) {
        x = before;
        x[96 + 37] = bad;  // head 1, channel 37
        try {
          apply(x);
          ADD_FAILURE() << "accepted " << bad;
        } catch (const kvq::Error& e) {
          EXPECT_EQ(e.code(), std::isfinite(bad) ? kvq::ErrorCode::invalid_argument : kvq::ErrorCode::non_finite_input);
          EXPECT_NE(std::string(e.what()).find("at head 1, channel 37"), std::string::npos) << e.what();
        }
        x[96 + 37] = before[96 + 37];
        EXPECT_EQ(x, before) << "a refused transform wrote";
      }
    }
  }
}

}  // namespace
