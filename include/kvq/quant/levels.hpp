#pragma once
// Non-uniform scalar quantization: a fixed, sorted set of reconstruction levels, the code of a
// value is the index of its nearest level. Two level sets need no calibration:
//   Lloyd-Max levels for a unit Gaussian (the MSE-optimal scalar quantizer of N(0,1)), computed
//   once by Lloyd's iteration on the Gaussian density with closed-form cell integrals;
//   NormalFloat levels (QLoRA's NF4 construction for any bit width): Gaussian quantiles with an
//   exact zero, normalised to [-1, 1].
// Groups of values share one scale: either their absolute maximum mapped onto the outermost
// level, or their root-mean-square (the group read as a unit-variance Gaussian).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numbers>
#include <span>
#include <string>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/error.hpp"

namespace kvq::inline v0 {

namespace detail {

inline double gaussian_pdf(double x) noexcept {
  return std::isinf(x) ? 0.0 : std::exp(-0.5 * x * x) / std::sqrt(2.0 * std::numbers::pi);
}
inline double gaussian_cdf(double x) noexcept { return 0.5 * std::erfc(-x / std::numbers::sqrt2); }

/// Inverse of gaussian_cdf by bisection: slow, exact to a few ulps, computed once per level set.
inline double gaussian_quantile(double p) noexcept {
  double lo = -40.0, hi = 40.0;
  for (int i = 0; i < 200 && hi - lo > 0; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (mid == lo || mid == hi) break;
    (gaussian_cdf(mid) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

}  // namespace detail

/// Expected squared error of nearest-level quantization of X ~ N(0,1) with `levels` (sorted
/// ascending): cells split at the midpoints; per cell [a, b] with level c the closed form
/// E[(X - c)^2; a < X < b] = int x^2 phi + c^2 (Phi(b) - Phi(a)) - 2c (phi(a) - phi(b)), summed.
inline double gaussian_distortion(std::span<const double> levels) {
  double d = 1.0;  // sum over cells of int x^2 phi
  for (std::size_t i = 0; i < levels.size(); ++i) {
    const double a = i == 0 ? -INFINITY : 0.5 * (levels[i - 1] + levels[i]);
    const double b = i + 1 == levels.size() ? INFINITY : 0.5 * (levels[i] + levels[i + 1]);
    const double c = levels[i];
    d += c * c * (detail::gaussian_cdf(b) - detail::gaussian_cdf(a)) -
         2.0 * c * (detail::gaussian_pdf(a) - detail::gaussian_pdf(b));
  }
  return d;
}

/// Lloyd-Max levels of N(0,1) with 2^bits levels, bits 1..8, in double: Lloyd's iteration (each
/// level moves to the conditional mean of its cell, (phi(a) - phi(b)) / (Phi(b) - Phi(a))) from
/// the Gaussian quantiles, until no level moves by more than 1e-13.
inline std::vector<double> lloyd_max_gaussian_levels(int bits) {
  if (bits < 1 || bits > 8)
    throw Error(ErrorCode::invalid_argument, "Lloyd-Max levels: bits must be in 1..8, got " + std::to_string(bits));
  const std::size_t n = std::size_t(1) << bits;
  std::vector<double> c(n), t(n + 1);
  for (std::size_t i = 0; i < n; ++i) c[i] = detail::gaussian_quantile((double(i) + 0.5) / double(n));
  for (int iteration = 0; iteration < 200000; ++iteration) {
    t[0] = -INFINITY;
    t[n] = INFINITY;
    for (std::size_t i = 1; i < n; ++i) t[i] = 0.5 * (c[i - 1] + c[i]);
    double moved = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double mass = detail::gaussian_cdf(t[i + 1]) - detail::gaussian_cdf(t[i]);
      const double mean = (detail::gaussian_pdf(t[i]) - detail::gaussian_pdf(t[i + 1])) / mass;
      moved = std::max(moved, std::fabs(mean - c[i]));
      c[i] = mean;
    }
    if (moved < 1e-13) break;
  }
  for (std::size_t i = 0; i < n / 2; ++i) {  // exactly symmetric about zero
    const double magnitude = 0.5 * (c[n - 1 - i] - c[i]);
    c[i] = -magnitude;
    c[n - 1 - i] = magnitude;
  }
  return c;
}

/// NormalFloat levels with 2^bits levels, bits 2..8 (QLoRA's construction, which gives its NF4
/// table at 4 bits): 2^(b-1) positive and 2^(b-1) - 1 negative Gaussian quantiles taken evenly
/// from 1/2 to `offset` = 1 - (1/(2(2^b - 1)) + 1/(2^(b+1))) / 2, an exact zero, all divided by
/// the largest, so the outermost levels are -1 and 1.
inline std::vector<double> normal_float_levels(int bits) {
  if (bits < 2 || bits > 8)
    throw Error(ErrorCode::invalid_argument,
                "NormalFloat levels: bits must be in 2..8 (the set needs a zero and a level on each side), got " +
                    std::to_string(bits));
  const double n = double(1 << bits);
  const double offset = 1.0 - 0.5 * (1.0 / (2.0 * (n - 1.0)) + 1.0 / (2.0 * n));
  const std::size_t positive = std::size_t(1) << (bits - 1), negative = positive - 1;
  std::vector<double> levels;
  // linspace(offset, 1/2, count + 1) without its last point, mapped through the quantile.
  auto side = [&](std::size_t count, double sign) {
    for (std::size_t i = 0; i < count; ++i)
      levels.push_back(sign * detail::gaussian_quantile(offset + (0.5 - offset) * double(i) / double(count)));
  };
  side(positive, 1.0);
  side(negative, -1.0);
  levels.push_back(0.0);
  std::sort(levels.begin(), levels.end());
  const double top = levels.back(), bottom = -levels.front();
  for (double& l : levels) l /= l > 0 ? top : bottom;
  return levels;
}

/// A sorted set of 2..256 float reconstruction levels; codes are indices into it. A value takes
/// its nearest level, and a value exactly halfway between two levels takes the upper one.
class LevelSet {
 public:
  explicit LevelSet(std::span<const double> levels) {
    if (levels.size() < 2 || levels.size() > 256)
      throw Error(ErrorCode::invalid_argument, "level set: needs 2..256 levels, got " + std::to_string(levels.size()));
    for (std::size_t i = 0; i < levels.size(); ++i) {
      const float l = float(levels[i]);
      if (!std::isfinite(l))
        throw Error(ErrorCode::invalid_argument, "level set: level " + std::to_string(i) + " is not finite");
      if (i > 0 && !(l > levels_.back()))
        throw Error(ErrorCode::invalid_argument,
                    "level set: levels must rise strictly as floats; level " + std::to_string(i) + " does not");
      levels_.push_back(l);
    }
    // Midpoints in double: exact for two floats, so the nearest level is decided exactly.
    for (std::size_t i = 1; i < levels_.size(); ++i)
      thresholds_.push_back(0.5 * (double(levels_[i - 1]) + double(levels_[i])));
  }

  std::span<const float> levels() const noexcept { return levels_; }
  std::size_t size() const noexcept { return levels_.size(); }
  float max_magnitude() const noexcept { return std::max(-levels_.front(), levels_.back()); }

  std::uint8_t encode(float x) const noexcept {
    // Thresholds at or below x; NaN compares false and takes code 0.
    const auto above = std::upper_bound(thresholds_.begin(), thresholds_.end(), double(x));
    return std::uint8_t(above - thresholds_.begin());
  }
  float decode(std::uint8_t code) const noexcept { return levels_[std::min<std::size_t>(code, levels_.size() - 1)]; }

 private:
  std::vector<float> levels_;
  std::vector<double> thresholds_;
};

/// Lloyd-Max levels of N(0,1), bits 1..4, computed on first use.
inline const LevelSet& lloyd_max_gaussian(int bits) {
  if (bits < 1 || bits > 4)
    throw Error(ErrorCode::invalid_argument, "Lloyd-Max level set: bits must be in 1..4, got " + std::to_string(bits));
  static const std::array<LevelSet, 4> sets = {
      LevelSet(lloyd_max_gaussian_levels(1)), LevelSet(lloyd_max_gaussian_levels(2)),
      LevelSet(lloyd_max_gaussian_levels(3)), LevelSet(lloyd_max_gaussian_levels(4))};
  return sets[std::size_t(bits - 1)];
}

/// NormalFloat levels, bits 2..4, computed on first use.
inline const LevelSet& normal_float(int bits) {
  if (bits < 2 || bits > 4)
    throw Error(ErrorCode::invalid_argument,
                "NormalFloat level set: bits must be in 2..4, got " + std::to_string(bits));
  static const std::array<LevelSet, 3> sets = {LevelSet(normal_float_levels(2)), LevelSet(normal_float_levels(3)),
                                               LevelSet(normal_float_levels(4))};
  return sets[std::size_t(bits - 2)];
}

/// How a group's scale is chosen; a value x is coded as levels.encode(x * (1 / scale)).
enum class GroupScale : std::uint8_t {
  absmax,  // scale = absmax / max_magnitude(levels): the largest value lands on an outer level
  rms,     // scale = sqrt(mean(x^2)): the group is read as a unit-variance Gaussian
};

/// Groups of `group` consecutive values (the last may be shorter) coded with one set of levels,
/// each group's scale stored as `param` (the codes are computed from the stored scale).
struct LevelCodec {
  const LevelSet* levels = nullptr;
  std::size_t group = 32;
  GroupScale scale = GroupScale::absmax;
  Scalar param = Scalar::f16;

  std::size_t groups(std::size_t n) const noexcept { return n / group + (n % group != 0); }

  /// Codes (one byte each) and scales of `x`; throws before writing anything on bad input.
  void encode(std::span<const float> x, std::span<std::uint8_t> codes, std::span<float> scales) const {
    check(x.size(), codes.size(), scales.size());
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!std::isfinite(x[i]))
        throw Error(ErrorCode::non_finite_input, "level codec: value " + std::to_string(i) + " is not finite");
    // Every scale checked before the first write.
    for (std::size_t g = 0; g < groups(x.size()); ++g)
      if (!std::isfinite(group_scale(x, g)))
        throw Error(ErrorCode::unrepresentable,
                    "level codec: the scale of group " + std::to_string(g) + " overflows its parameter type");
    for (std::size_t g = 0; g < groups(x.size()); ++g) {
      const float stored = scales[g] = group_scale(x, g);
      const float inv = stored >= std::numeric_limits<float>::min() ? 1.0f / stored : 0.0f;
      for (std::size_t i = g * group; i < std::min(x.size(), g * group + group); ++i)
        codes[i] = levels->encode(x[i] * inv);
    }
  }

  void decode(std::span<const std::uint8_t> codes, std::span<const float> scales, std::span<float> out) const {
    check(out.size(), codes.size(), scales.size());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = levels->decode(codes[i]) * scales[i / group];
  }

 private:
  // Group g's scale as stored (infinite when it overflows the parameter type).
  float group_scale(std::span<const float> x, std::size_t g) const {
    const std::size_t begin = g * group, end = std::min(x.size(), begin + group);
    double s = 0;
    if (scale == GroupScale::absmax) {
      float absmax = 0;
      for (std::size_t i = begin; i < end; ++i) absmax = std::max(absmax, std::fabs(x[i]));
      s = double(absmax) / double(levels->max_magnitude());
    } else {
      for (std::size_t i = begin; i < end; ++i) s += double(x[i]) * double(x[i]);
      s = std::sqrt(s / double(end - begin));
    }
    return round_to(param, float(s));
  }

  void check(std::size_t n, std::size_t codes, std::size_t scales) const {
    if (levels == nullptr) throw Error(ErrorCode::invalid_argument, "level codec: no level set");
    if (group == 0) throw Error(ErrorCode::invalid_argument, "level codec: group size must be positive");
    if (codes != n || scales != groups(n))
      throw Error(ErrorCode::shape_mismatch, "level codec: " + std::to_string(n) + " values need " + std::to_string(n) +
                                                 " codes and " + std::to_string(groups(n)) + " scales, got " +
                                                 std::to_string(codes) + " and " + std::to_string(scales));
  }
};

}  // namespace kvq::inline v0
