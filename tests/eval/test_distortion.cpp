// Scalar-quantizer distortion on synthetic heads: Lloyd-Max reaches Max's optimum on Gaussian
// data, the Hadamard transform makes heavy-tailed and outlier-channel data Gaussian enough for
// Lloyd-Max levels, and the table kvq-eval --distortion prints.
#include <gtest/gtest.h>

#include <sstream>

#include "eval/cli.hpp"
#include "eval/distortion.hpp"

namespace {

using kvq::eval::DistortionMethod;
using kvq::eval::DistortionSource;

double distortion(DistortionMethod m, int bits, const std::vector<float>& x) {
  const auto d = kvq::eval::normalized_distortion(m, bits, x);
  if (!d) ADD_FAILURE() << "no " << to_string(m) << " at " << bits << " bits";
  return d.value_or(0.0);
}

TEST(Distortion, LloydMaxWithTheTrueScaleIsWithinTwoPercentOfMax) {
  const std::vector<float> x = kvq::eval::distortion_data(DistortionSource::gaussian, 1024, 3);
  // Max's MSE (0.3634, 0.1175, 0.03454, 0.009497) times 4^bits.
  const double optimum[] = {1.4536, 1.880, 2.2106, 2.4312};
  for (int bits = 1; bits <= 4; ++bits)
    EXPECT_NEAR(distortion(DistortionMethod::lm_unit, bits, x) / optimum[bits - 1], 1.0, 0.02) << bits << " bits";
}

// At 4 bits the order turns: NormalFloat with absmax scales (1.95) beats Lloyd-Max with rms
// scales (2.29), and affine min-max (1.57, for a second stored parameter) beats both from 3 bits.
TEST(Distortion, LloydMaxLevelsBeatNormalFloatAndAffineAtLowWidths) {
  const std::vector<float> x = kvq::eval::distortion_data(DistortionSource::gaussian, 1024, 4);
  for (int bits = 2; bits <= 3; ++bits)
    EXPECT_LT(distortion(DistortionMethod::lm_rms, bits, x), distortion(DistortionMethod::nf_absmax, bits, x)) << bits;
  for (int bits = 1; bits <= 2; ++bits)
    EXPECT_LT(distortion(DistortionMethod::lm_rms, bits, x), distortion(DistortionMethod::affine, bits, x)) << bits;
}

TEST(Distortion, HadamardMakesNonGaussianDataGaussianForLloydMax) {
  const std::vector<float> gauss = kvq::eval::distortion_data(DistortionSource::gaussian, 1024, 5);
  for (DistortionSource source : {DistortionSource::laplace, DistortionSource::outlier_channel}) {
    const std::vector<float> x = kvq::eval::distortion_data(source, 1024, 6);
    for (int bits = 2; bits <= 4; ++bits) {
      const double plain = distortion(DistortionMethod::lm_rms, bits, x);
      const double rotated = distortion(DistortionMethod::hadamard_lm_rms, bits, x);
      EXPECT_LT(rotated, 0.8 * plain) << to_string(source) << " " << bits;
      if (source == DistortionSource::laplace) {  // rotated Laplace heads behave as Gaussian ones
        EXPECT_NEAR(rotated / distortion(DistortionMethod::hadamard_lm_rms, bits, gauss), 1.0, 0.05) << bits;
      }
    }
  }
}

TEST(Distortion, KvqEvalPrintsTheTable) {
  std::ostringstream out, err;
  ASSERT_EQ(kvq::eval::run_eval({"--distortion"}, out, err), 0) << err.str();
  for (const char* row : {"gaussian         lm-unit", "laplace          had+lm-rms", "outlier-channel  affine"})
    EXPECT_NE(out.str().find(row), std::string::npos) << row;
}

}  // namespace
