#pragma once
// Scalar-quantizer distortion on synthetic head vectors (no model): mean squared error relative to
// the data's mean square, times 4^bits, so Shannon's floor for a Gaussian source is 1 at every
// width and the optimal scalar quantizer of N(0,1) sits at Max's 1.45 / 1.88 / 2.21 / 2.43.
//
// Sources (heads of 128 channels, seeded): N(0,1); Laplace with unit variance; and N(0,1) keys with
// one fixed outlier channel per head (offset 20), the structure real keys show.
// Quantizers, all in groups of 32 consecutive channels of one token, fp16 scales:
//   affine       kvq's codec: asymmetric min-max (scale and zero point per group)
//   nf-absmax    NormalFloat levels, scale = group absmax
//   lm-unit      Lloyd-Max levels with the true scale (1): the ideal, no scale estimation
//   lm-rms       Lloyd-Max levels, scale = group root-mean-square
//   had+lm-rms   lm-rms after the normalized Hadamard transform of each head (MSE measured after
//                the inverse transform)

#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kvq/kernels/quantize/reference.hpp"
#include "kvq/quant/levels.hpp"
#include "kvq/transform/hadamard.hpp"

namespace kvq::eval {

enum class DistortionSource { gaussian, laplace, outlier_channel };
enum class DistortionMethod { affine, nf_absmax, lm_unit, lm_rms, hadamard_lm_rms, hadamard_affine };

inline const char* to_string(DistortionSource s) {
  switch (s) {
    case DistortionSource::gaussian:
      return "gaussian";
    case DistortionSource::laplace:
      return "laplace";
    case DistortionSource::outlier_channel:
      return "outlier-channel";
  }
  return "?";
}

inline const char* to_string(DistortionMethod m) {
  switch (m) {
    case DistortionMethod::affine:
      return "affine";
    case DistortionMethod::nf_absmax:
      return "nf-absmax";
    case DistortionMethod::lm_unit:
      return "lm-unit";
    case DistortionMethod::lm_rms:
      return "lm-rms";
    case DistortionMethod::hadamard_lm_rms:
      return "had+lm-rms";
    case DistortionMethod::hadamard_affine:
      return "had+affine";
  }
  return "?";
}

inline constexpr std::size_t distortion_head_dim = 128, distortion_group = 32;

/// `tokens` heads of 128 channels from `source`, seeded.
inline std::vector<float> distortion_data(DistortionSource source, std::size_t tokens, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::exponential_distribution<float> exponential(std::sqrt(2.0f));  // Laplace(b = 1/sqrt 2): variance 1
  std::vector<float> x(tokens * distortion_head_dim);
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (source == DistortionSource::laplace) {
      const float e = exponential(rng);
      x[i] = rng() & 1 ? e : -e;
    } else {
      x[i] = normal(rng);
      if (source == DistortionSource::outlier_channel && i % distortion_head_dim == 5) x[i] += 20.0f;
    }
  }
  return x;
}

/// x quantized and dequantized by `method` at `bits`; nullopt where the method has no such width.
inline std::optional<std::vector<float>> distortion_round_trip(DistortionMethod method, int bits,
                                                               const std::vector<float>& x) {
  std::vector<float> y = x;
  const bool rotate = method == DistortionMethod::hadamard_lm_rms || method == DistortionMethod::hadamard_affine;
  const HadamardTransform hadamard(distortion_head_dim);
  if (rotate) hadamard.forward(y);
  if (method == DistortionMethod::affine || method == DistortionMethod::hadamard_affine) {
    const QuantizerSpec spec{bits, distortion_group, Axis::per_token, Mode::asymmetric, Scalar::f16};
    const std::size_t groups = distortion_head_dim / distortion_group;
    std::vector<fp16> scales(groups), zeros(groups);
    std::vector<std::uint8_t> packed(distortion_head_dim);
    for (std::size_t t = 0; t < y.size(); t += distortion_head_dim) {
      kernels::reference::quantize_row_per_token(spec, y.data() + t, distortion_head_dim, scales.data(), zeros.data(),
                                                 packed.data());
      kernels::reference::dequantize_row_per_token(spec, packed.data(), distortion_head_dim, scales.data(),
                                                   zeros.data(), y.data() + t);
    }
  } else if (method == DistortionMethod::lm_unit) {
    const LevelSet& levels = lloyd_max_gaussian(bits);
    for (float& v : y) v = levels.decode(levels.encode(v));
  } else {
    if (method == DistortionMethod::nf_absmax && bits < 2) return std::nullopt;
    const LevelCodec codec{method == DistortionMethod::nf_absmax ? &normal_float(bits) : &lloyd_max_gaussian(bits),
                           distortion_group,
                           method == DistortionMethod::nf_absmax ? GroupScale::absmax : GroupScale::rms, Scalar::f16};
    std::vector<std::uint8_t> codes(y.size());
    std::vector<float> scales(codec.groups(y.size()));
    codec.encode(y, codes, scales);
    codec.decode(codes, scales, y);
  }
  if (rotate) hadamard.inverse(y);
  return y;
}

/// MSE / mean(x^2) * 4^bits, or nullopt where the method has no such width.
inline std::optional<double> normalized_distortion(DistortionMethod method, int bits, const std::vector<float>& x) {
  const auto y = distortion_round_trip(method, bits, x);
  if (!y) return std::nullopt;
  double error = 0, power = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    error += (double(x[i]) - (*y)[i]) * (double(x[i]) - (*y)[i]);
    power += double(x[i]) * x[i];
  }
  return error / power * std::pow(4.0, bits);
}

/// The table kvq-eval --distortion prints (and bench/RESULTS.md quotes).
inline void print_distortion_table(std::ostream& out, std::size_t tokens = 4096) {
  out << "SYNTHETIC DATA (no model): scalar-quantizer distortion, MSE / mean(x^2) * 4^bits (Shannon's floor for\n"
         "a Gaussian: 1; optimal scalar quantizer of N(0,1), Max 1960: 1.45 1.88 2.21 2.43). "
      << tokens
      << " heads of 128\n"
         "channels per source; groups of 32 channels, fp16 scales (affine: +1 bit/value of scale and zero\n"
         "point; level codecs: +0.5 bit/value of scale; lm-unit: the true scale, nothing stored).\n\n";
  out << fmt::format("{:<16} {:<11} {:>8} {:>8} {:>8} {:>8}\n", "source", "quantizer", "1 bit", "2 bits", "3 bits",
                     "4 bits");
  const DistortionMethod all[] = {DistortionMethod::affine,          DistortionMethod::nf_absmax,
                                  DistortionMethod::lm_unit,         DistortionMethod::lm_rms,
                                  DistortionMethod::hadamard_affine, DistortionMethod::hadamard_lm_rms};
  for (DistortionSource source :
       {DistortionSource::gaussian, DistortionSource::laplace, DistortionSource::outlier_channel}) {
    const std::vector<float> x = distortion_data(source, tokens, 17);
    for (DistortionMethod method : all) {
      std::string row = fmt::format("{:<16} {:<11}", to_string(source), to_string(method));
      for (int bits = 1; bits <= 4; ++bits) {
        const auto d = normalized_distortion(method, bits, x);
        row += d ? fmt::format(" {:>8.3f}", *d) : fmt::format(" {:>8}", "-");
      }
      out << row << "\n";
    }
  }
}

}  // namespace kvq::eval
