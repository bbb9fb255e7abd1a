// Bulk conversions: the vector paths store the same bits as the scalar conversions, and
// all_below rejects NaN, Inf and the first value past a threshold wherever it sits.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <vector>

#include "kvq/core/convert.hpp"
#include "support/random.hpp"

namespace {

TEST(Convert, RowsMatchScalarConversionForEveryTypeAndLength) {
  for (kvq::Scalar s : {kvq::Scalar::f16, kvq::Scalar::bf16, kvq::Scalar::f32}) {
    for (std::size_t n : {0u, 1u, 7u, 15u, 16u, 17u, 33u, 128u, 1000u}) {
      auto x = kvq::test::normal_vector(n, unsigned(n) + 1, 300.0f);
      if (n > 3) x[3] = 65519.0f;  // rounds down to 65504 in fp16
      std::vector<std::uint8_t> bulk(n * 4 + 8, 0xAB), scalar(n * 4 + 8, 0xAB);
      kvq::store_row(s, x.data(), n, bulk.data());
      for (std::size_t i = 0; i < n; ++i) kvq::store_scalar(s, scalar.data(), i, x[i]);
      EXPECT_EQ(bulk, scalar) << kvq::to_string(s) << " n=" << n;  // guard bytes past the row intact too
      std::vector<float> back(n + 1, -1.0f);
      kvq::load_row(s, bulk.data(), n, back.data());
      for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(back[i], kvq::load_scalar(s, bulk.data(), i));
      EXPECT_EQ(back[n], -1.0f);
    }
  }
}

TEST(Convert, AllBelowFindsTheOffenderAnywhere) {
  for (std::size_t n : {1u, 5u, 16u, 17u, 100u}) {
    std::vector<float> x(n, 1.0f);
    EXPECT_TRUE(kvq::all_below(x.data(), n, 65520.0f));
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -65520.0f}) {
      for (std::size_t at : {std::size_t{0}, n / 2, n - 1}) {
        auto y = x;
        y[at] = bad;
        EXPECT_FALSE(kvq::all_below(y.data(), n, 65520.0f)) << "n=" << n << " at " << at << " value " << bad;
      }
    }
  }
  const float just_below = 65519.996f;
  EXPECT_TRUE(kvq::all_below(&just_below, 1, kvq::overflow_threshold(kvq::Scalar::f16)));
  EXPECT_TRUE(std::isfinite(kvq::round_to(kvq::Scalar::f16, just_below)));
  const float at = kvq::overflow_threshold(kvq::Scalar::f16);
  EXPECT_FALSE(std::isfinite(kvq::round_to(kvq::Scalar::f16, at)));
  const float bf = kvq::overflow_threshold(kvq::Scalar::bf16);
  EXPECT_FALSE(std::isfinite(kvq::round_to(kvq::Scalar::bf16, bf)));
  EXPECT_TRUE(std::isfinite(kvq::round_to(kvq::Scalar::bf16, std::nextafter(bf, 0.0f))));
}

}  // namespace
