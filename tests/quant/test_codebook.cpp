// Calibrated codebooks (Mode::codebook): the quantizer string spells the levels and reads back as
// itself, bad levels are refused naming the level, groups decode to zero + scale * level within
// their range, calibration fits levels that beat the uniform grid on the data's distribution, and
// a cache with codebooks saves and loads whole.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/cache/serialize.hpp"
#include "kvq/kernels/quantize/reference.hpp"
#include "kvq/quant/codebook.hpp"
#include "kvq/quant/spec.hpp"
#include "support/random.hpp"

namespace {

using kvq::Axis;
using kvq::Mode;
using kvq::QuantizerSpec;

const std::string b2 = "bc00b50034003c00";  // -1, -0.3125, 0.25, 1

TEST(Codebook, QuantizerStringSpellsTheLevels) {
  const QuantizerSpec s = kvq::parse_quantizer("k2c32b" + b2, 'k');
  EXPECT_EQ(s.mode, Mode::codebook);
  EXPECT_EQ(s.codebook[0], -1.0f);
  EXPECT_EQ(s.codebook[1], -0.3125f);
  EXPECT_EQ(s.codebook[2], 0.25f);
  EXPECT_EQ(s.codebook[3], 1.0f);
  EXPECT_EQ(s.codebook[4], 0.0f);
  EXPECT_TRUE(s.has_zero_point());
  EXPECT_EQ(kvq::to_string(s, 'k'), "k2c32b" + b2);
  EXPECT_EQ(kvq::to_string(kvq::parse_quantizer("v1t16bb8003800.bf16", 'v'), 'v'), "v1t16bb8003800.bf16");
  const kvq::CacheConfig c = kvq::parse_cache_config("k2c32b" + b2 + "-v2t32-r16-s1");
  EXPECT_EQ(kvq::parse_cache_config(kvq::to_string(c)), c);
}

TEST(Codebook, BadLevelsAreRefusedNamingTheLevel) {
  auto message = [](const std::string& text) {
    try {
      (void)kvq::parse_quantizer(text, 'k');
    } catch (const kvq::Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message("k2c32bbc00b5003400").find("4 lowercase hex digits"), std::string::npos);  // 3 levels
  EXPECT_NE(message("k2c32bBC00B50034003C00").find("4 lowercase hex digits"), std::string::npos);
  EXPECT_NE(message("k2c32b" + b2 + "00").find("unknown suffix"), std::string::npos);
  EXPECT_NE(message("k2c32bbc0034003c00b500").find("level 3"), std::string::npos);  // not ascending
  EXPECT_NE(message("k2c32bbc00b50034004000").find("[-1, 1]"), std::string::npos);  // 2.0
  EXPECT_NE(message("k2c32bbc0080003c003c01").find("-0"), std::string::npos);
  EXPECT_NE(message("k2c32bbc007e003c003c01").find("level 1"), std::string::npos);  // NaN
  EXPECT_NE(message("k5c32b").find("1..4 bits"), std::string::npos);
  EXPECT_NE(message("k2c32o1b" + b2).find("no outliers"), std::string::npos);

  QuantizerSpec s{2, 32, Axis::per_token, Mode::asymmetric};
  s.codebook[0] = 0.5f;  // set, but asymmetric levels read none
  EXPECT_THROW(kvq::validate(s, "value quantizer"), kvq::Error);
  s.mode = Mode::codebook;
  s.codebook = {-1.0f, -0.1f, 0.5f, 1.0f};  // -0.1 is no f16 value
  EXPECT_THROW(kvq::validate(s, "value quantizer"), kvq::Error);
  s.codebook = {-1.0f, -0.25f, 0.5f, 1.0f, 0.5f};  // an entry beyond 2 bits
  EXPECT_THROW(kvq::validate(s, "value quantizer"), kvq::Error);
  s.codebook[4] = 0.0f;
  EXPECT_NO_THROW(kvq::validate(s, "value quantizer"));
}

TEST(Codebook, GroupsDecodeToTheNearestLevelWithinTheirRange) {
  namespace ref = kvq::kernels::reference;
  const QuantizerSpec s = kvq::parse_quantizer("v2t8b" + b2, 'v');
  const std::vector<float> x = {-3.0f, 5.0f, 0.9f, 1.1f, -2.0f, 2.5f, 0.0f, 4.0f};
  float scale = 0, zero = 0;
  std::uint8_t packed[2];
  ref::quantize_row_per_token(s, x.data(), x.size(), &scale, &zero, packed);
  const ref::GroupParams p = ref::load_params(s, &scale, &zero, 0);
  EXPECT_EQ(p.scale, 4.0f);  // (5 - -3) / 2
  EXPECT_EQ(p.zero, 1.0f);   // the midpoint
  std::vector<float> out(x.size());
  ref::dequantize_row_per_token(s, packed, x.size(), &scale, &zero, out.data());
  for (std::size_t i = 0; i < x.size(); ++i) {
    float best = 0, err = std::numeric_limits<float>::infinity();
    for (int j = 0; j < 4; ++j)
      if (std::fabs(1.0f + 4.0f * s.codebook[std::size_t(j)] - x[i]) < err)
        err = std::fabs(1.0f + 4.0f * s.codebook[std::size_t(j)] - x[i]),
        best = 1.0f + 4.0f * s.codebook[std::size_t(j)];
    EXPECT_EQ(out[i], best) << i;
  }
  EXPECT_EQ(out[0], -3.0f);  // the range's ends are levels: min and max decode exactly
  EXPECT_EQ(out[1], 5.0f);
  const std::vector<float> constant(8, 0.7f);  // a constant group decodes to its value (f16)
  ref::quantize_row_per_token(s, constant.data(), 8, &scale, &zero, packed);
  ref::dequantize_row_per_token(s, packed, 8, &scale, &zero, out.data());
  for (float v : out) EXPECT_EQ(v, kvq::round_to(kvq::Scalar::f16, 0.7f));
}

// Mean squared error of quantizing rows (n, dim) per token with `spec`, relative to their power.
double relative_mse(const QuantizerSpec& spec, const std::vector<float>& rows, std::size_t dim) {
  namespace ref = kvq::kernels::reference;
  double err = 0, power = 0;
  std::vector<float> scales(dim), zeros(dim), out(dim);
  std::vector<std::uint8_t> packed(dim);
  for (std::size_t r = 0; r < rows.size() / dim; ++r) {
    ref::quantize_row_per_token(spec, rows.data() + r * dim, dim, scales.data(), zeros.data(), packed.data());
    ref::dequantize_row_per_token(spec, packed.data(), dim, scales.data(), zeros.data(), out.data());
    for (std::size_t c = 0; c < dim; ++c) {
      err += std::pow(double(out[c]) - rows[r * dim + c], 2);
      power += std::pow(double(rows[r * dim + c]), 2);
    }
  }
  return err / power;
}

TEST(Codebook, CalibrationBeatsTheUniformGridOnItsDistribution) {
  // Gaussian rows: in each group's range the values crowd the middle, where fitted levels go.
  constexpr std::size_t dim = 64;
  const auto calibration = kvq::test::normal_vector(512 * dim, 11);
  const auto held_out = kvq::test::normal_vector(512 * dim, 12);
  for (int bits = 1; bits <= 4; ++bits) {
    QuantizerSpec affine{bits, 32, Axis::per_token, Mode::asymmetric};
    kvq::CodebookCalibration cal(affine, dim);
    cal.add(calibration);
    EXPECT_EQ(cal.samples(), calibration.size());
    const QuantizerSpec fitted = cal.fit();
    EXPECT_NO_THROW(kvq::validate(fitted, dim, "fitted"));
    const double uniform = relative_mse(affine, held_out, dim), ours = relative_mse(fitted, held_out, dim);
    SCOPED_TRACE(kvq::to_string(fitted, 'v'));
    EXPECT_LT(ours, 0.95 * uniform) << bits << " bits: " << ours << " vs " << uniform;
  }
  // Uniform data: Lloyd's levels are the centres of equal cells, -3/4, -1/4, 1/4, 3/4 (the ends
  // of each group, 2 values of 32 at exactly -1 and 1, pull the outer ones out a little).
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> flat(512 * dim);
  for (float& v : flat) v = u(rng);
  kvq::CodebookCalibration cal({2, 32, Axis::per_token}, dim);
  cal.add(flat);
  const QuantizerSpec fitted = cal.fit();
  for (int j = 0; j < 4; ++j) EXPECT_NEAR(fitted.codebook[std::size_t(j)], -0.75 + 0.5 * j, 0.06) << j;
}

TEST(Codebook, CalibrationRefusesBadInputAndKeepsWhatItHas) {
  kvq::CodebookCalibration keys({3, 4, Axis::per_channel}, 8);
  std::vector<float> rows = kvq::test::normal_vector(10 * 8, 3);  // 2 whole groups of 4 rows, 2 rows left out
  keys.add(rows);
  EXPECT_EQ(keys.samples(), 2u * 4u * 8u);
  EXPECT_THROW(keys.add(std::vector<float>(7, 0.0f)), kvq::Error);  // no whole row
  rows[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(keys.add(rows), kvq::Error);
  EXPECT_EQ(keys.samples(), 64u);
  EXPECT_THROW((void)keys.fit(), kvq::Error);  // 64 samples, 8 levels need 128
  EXPECT_THROW(kvq::CodebookCalibration({5, 32, Axis::per_token}, 64), kvq::Error);
  EXPECT_THROW(kvq::CodebookCalibration({2, 128, Axis::per_token}, 64), kvq::Error);  // group > head_dim
}

TEST(Codebook, CacheWithCodebooksSavesAndLoadsWhole) {
  const kvq::CacheShape shape{2, 2, 64, 200};
  kvq::BasicKVCache cache(shape, kvq::parse_cache_config("k2c32b" + b2 + "-v2t16b" + b2 + "-r16-s1"));
  for (std::size_t l = 0; l < 2; ++l) {
    const auto k = kvq::test::normal_vector(150 * 2 * 64, unsigned(l) + 1);
    const auto v = kvq::test::normal_vector(150 * 2 * 64, unsigned(l) + 9);
    cache.append(l, 0, k, v);
  }
  std::stringstream file;
  kvq::save(cache, file);
  const kvq::BasicKVCache loaded = kvq::load(file);
  EXPECT_EQ(loaded.config(), cache.config());
  std::vector<float> a(64), b(64);
  for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values})
    for (std::size_t p = 0; p < 150; ++p) {
      cache.read_row(t, 1, 1, p, a.data());
      loaded.read_row(t, 1, 1, p, b.data());
      ASSERT_EQ(a, b) << p;
    }
}

}  // namespace
