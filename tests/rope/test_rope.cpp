// RoPE: both pairings, inverse, and the property attention relies on: a rotated dot product
// depends only on the distance between positions.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kvq/rope/rope.hpp"
#include "support/random.hpp"

namespace {

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

TEST(Rope, PairsFollowTheConvention) {
  EXPECT_EQ(kvq::rope_pair(kvq::RopeStyle::adjacent_pairs, 8, 1), (std::pair<std::size_t, std::size_t>{2, 3}));
  EXPECT_EQ(kvq::rope_pair(kvq::RopeStyle::half_split, 8, 1), (std::pair<std::size_t, std::size_t>{1, 5}));
}

TEST(Rope, MatchesTheFormulaWrittenOut) {
  for (auto style : {kvq::RopeStyle::adjacent_pairs, kvq::RopeStyle::half_split}) {
    const std::size_t d = 10;
    kvq::RopeTable table({d, style, 500.0f}, 64);
    auto x = kvq::test::normal_vector(d, 1);
    auto y = x;
    table.rotate(y.data(), 37);
    for (std::size_t i = 0; i < d / 2; ++i) {
      const std::size_t a = style == kvq::RopeStyle::adjacent_pairs ? 2 * i : i;
      const std::size_t b = style == kvq::RopeStyle::adjacent_pairs ? 2 * i + 1 : i + d / 2;
      const double angle = 37.0 * std::pow(500.0, -double(2 * i) / double(d));
      EXPECT_NEAR(y[a], x[a] * std::cos(angle) - x[b] * std::sin(angle), 1e-4);
      EXPECT_NEAR(y[b], x[a] * std::sin(angle) + x[b] * std::cos(angle), 1e-4);
    }
  }
}

TEST(Rope, UnrotateInvertsAndNormsArePreserved) {
  kvq::RopeTable table({16, kvq::RopeStyle::half_split, 10000.0f}, 300);
  auto x = kvq::test::normal_vector(16, 2);
  auto y = x;
  table.rotate(y.data(), 299);
  EXPECT_NEAR(dot(y, y), dot(x, x), 1e-4);
  table.unrotate(y.data(), 299);
  for (std::size_t i = 0; i < 16; ++i) EXPECT_NEAR(y[i], x[i], 1e-5);
}

TEST(Rope, RotatedDotProductDependsOnlyOnDistance) {
  for (auto style : {kvq::RopeStyle::adjacent_pairs, kvq::RopeStyle::half_split}) {
    kvq::RopeTable table({32, style, 10000.0f}, 200);
    const auto q = kvq::test::normal_vector(32, 3), k = kvq::test::normal_vector(32, 4);
    auto score = [&](std::size_t m, std::size_t n) {
      auto qm = q, kn = k;
      table.rotate(qm.data(), m);
      table.rotate(kn.data(), n);
      return dot(qm, kn);
    };
    EXPECT_NEAR(score(50, 20), score(130, 100), 1e-3);
    EXPECT_GT(std::abs(score(50, 20) - score(50, 21)), 1e-4);
  }
}

TEST(Rope, PartialRotaryDimsAndOffsets) {
  kvq::RopeConfig c{12, kvq::RopeStyle::adjacent_pairs, 10000.0f, 8, 5};
  kvq::RopeTable shifted(c, 20), plain({12, kvq::RopeStyle::adjacent_pairs, 10000.0f, 8, 0}, 40);
  auto x = kvq::test::normal_vector(12, 5);
  auto a = x, b = x;
  shifted.rotate(a.data(), 3);
  plain.rotate(b.data(), 8);
  for (std::size_t i = 0; i < 12; ++i) EXPECT_NEAR(a[i], b[i], 1e-5);
  EXPECT_EQ(a[9], x[9]);  // channels past rotary_dims are untouched
}

TEST(Rope, TableIsAccurateAtLongPositionsAndStepsCompose) {
  // Kernels rotate by the row of a run's first position and then by a step from the step table;
  // that agrees with the row of the position itself only if every entry is the exact cos/sin
  // rounded once (a float angle is off by ~1e-3 rad near position 30000).
  const std::size_t d = 128, n = 40000;
  const kvq::RopeTable t({d, kvq::RopeStyle::half_split, 500000.0f, 0, 3}, n);
  for (const std::size_t p : {std::size_t(0), std::size_t(31), std::size_t(20011), n - 1}) {
    for (std::size_t i = 0; i < t.pairs(); ++i) {
      const double angle = double(p + 3) * std::pow(500000.0, -double(2 * i) / double(d));
      EXPECT_NEAR(t.cos_row(p)[i], std::cos(angle), 1e-7) << p << " " << i;
      EXPECT_NEAR(t.sin_row(p)[i], std::sin(angle), 1e-7) << p << " " << i;
    }
  }
  for (const std::size_t u : {std::size_t(0), std::size_t(32000), n - kvq::RopeTable::steps}) {
    for (std::size_t s = 0; s < kvq::RopeTable::steps; ++s) {
      for (std::size_t i = 0; i < t.pairs(); ++i) {
        const double c = double(t.cos_row(u)[i]) * t.step_cos(i)[s] - double(t.sin_row(u)[i]) * t.step_sin(i)[s];
        const double sn = double(t.sin_row(u)[i]) * t.step_cos(i)[s] + double(t.cos_row(u)[i]) * t.step_sin(i)[s];
        EXPECT_NEAR(c, t.cos_row(u + s)[i], 3e-7) << u << "+" << s << " pair " << i;
        EXPECT_NEAR(sn, t.sin_row(u + s)[i], 3e-7) << u << "+" << s << " pair " << i;
      }
    }
  }
}

TEST(Rope, BadConfigurationsAreRejected) {
  EXPECT_THROW(kvq::RopeTable({7, kvq::RopeStyle::adjacent_pairs}, 4), kvq::Error);
  EXPECT_THROW(kvq::RopeTable({8, kvq::RopeStyle::adjacent_pairs, 10000.0f, 10}, 4), kvq::Error);
  EXPECT_THROW(kvq::RopeTable({8, kvq::RopeStyle::adjacent_pairs, 0.5f}, 4), kvq::Error);
  kvq::RopeTable t({8}, 4);
  std::vector<float> x(8);
  EXPECT_THROW(t.rotate(x.data(), 4), kvq::Error);
  std::vector<float> odd(9);
  EXPECT_THROW(t.rotate_heads(odd, 0), kvq::Error);
}

}  // namespace
