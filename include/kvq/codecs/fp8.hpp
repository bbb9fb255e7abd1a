#pragma once
// 8-bit floats as KV-cache codecs (vLLM's fp8 caches): OCP FP8 E4M3 in its "fn" variant (bias 7,
// no infinities, one NaN per sign S.1111.111, largest finite 448) and E5M2 (bias 15, IEEE-style
// infinities and NaNs, largest finite 57344). A stored value is fp8(x / scale) with a per-tensor
// or per-head float scale, and reads back as to_float(code) * scale.
//
// Conversion from float rounds to nearest, ties to even, through the subnormals. Overflow
// saturates to the largest finite value of the sign (what vLLM's clamp before the cast does); with
// `saturate` off, E5M2 overflows to infinity and E4M3FN, which has none, to NaN. NaN stays NaN.

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kvq/error.hpp"

namespace kvq::inline v0 {

enum class Fp8Format : std::uint8_t { e4m3fn, e5m2 };

constexpr std::string_view name(Fp8Format f) noexcept { return f == Fp8Format::e4m3fn ? "e4m3" : "e5m2"; }

namespace detail {

struct Fp8Layout {
  int mantissa_bits, bias;
  bool has_infinity;  // e5m2: exponent all ones is Inf/NaN; e4m3fn: only S.1111.111 is NaN
};

constexpr Fp8Layout fp8_layout(Fp8Format f) noexcept {
  return f == Fp8Format::e4m3fn ? Fp8Layout{3, 7, false} : Fp8Layout{2, 15, true};
}

}  // namespace detail

/// The value of an fp8 code (NaN codes give a quiet NaN).
inline float fp8_to_float(Fp8Format f, std::uint8_t code) noexcept {
  const detail::Fp8Layout l = detail::fp8_layout(f);
  const int exponent_bits = 7 - l.mantissa_bits;
  const int exponent = code >> l.mantissa_bits & ((1 << exponent_bits) - 1);
  const int mantissa = code & ((1 << l.mantissa_bits) - 1);
  const float sign = code & 0x80 ? -1.0f : 1.0f;
  const int top = (1 << exponent_bits) - 1;
  if (l.has_infinity && exponent == top) return mantissa == 0 ? sign * INFINITY : NAN;
  if (!l.has_infinity && exponent == top && mantissa == (1 << l.mantissa_bits) - 1) return NAN;
  if (exponent == 0) return sign * std::ldexp(float(mantissa), 1 - l.bias - l.mantissa_bits);
  return sign * std::ldexp(float(mantissa + (1 << l.mantissa_bits)), exponent - l.bias - l.mantissa_bits);
}

/// Largest finite value of the format: 448 (e4m3fn) or 57344 (e5m2).
inline float fp8_max(Fp8Format f) noexcept { return fp8_to_float(f, f == Fp8Format::e4m3fn ? 0x7E : 0x7B); }

/// The fp8 code nearest to x (ties to even); overflow as the header says.
inline std::uint8_t float_to_fp8(Fp8Format f, float x, bool saturate = true) noexcept {
  const detail::Fp8Layout l = detail::fp8_layout(f);
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const std::uint8_t nan = f == Fp8Format::e4m3fn ? 0x7F : 0x7E;
  if (std::isnan(x)) return std::uint8_t(sign | nan);
  const double a = std::fabs(double(x));
  const double largest = double(fp8_max(f));
  // Quantum of a's binade (the subnormal quantum below the normal range); a / quantum is exact
  // in double, and nearbyint rounds it half to even.
  const int min_exponent = 1 - l.bias;
  int exponent = a > 0 ? std::ilogb(a) : min_exponent;
  if (exponent < min_exponent) exponent = min_exponent;
  const double quantum = std::ldexp(1.0, exponent - l.mantissa_bits);
  const double rounded = std::isinf(a) ? a : std::nearbyint(a / quantum) * quantum;
  if (rounded > largest) {
    if (saturate) return std::uint8_t(sign | (f == Fp8Format::e4m3fn ? 0x7E : 0x7B));
    return std::uint8_t(sign | (l.has_infinity ? 0x7C : nan));
  }
  if (rounded < std::ldexp(1.0, min_exponent))  // subnormal (or zero): exponent field 0
    return std::uint8_t(sign | int(rounded / std::ldexp(1.0, min_exponent - l.mantissa_bits)));
  const int e = std::ilogb(rounded);  // rounding may have carried into the next binade
  const int mantissa = int(rounded / std::ldexp(1.0, e - l.mantissa_bits)) - (1 << l.mantissa_bits);
  return std::uint8_t(sign | (e + l.bias) << l.mantissa_bits | mantissa);
}

/// codes[i] = fp8(x[i] / scale); throws, writing nothing, on a scale that is not finite and positive
/// or mismatched sizes. Non-finite inputs are refused too: a cache must not store them.
inline void fp8_encode(Fp8Format f, std::span<const float> x, float scale, std::span<std::uint8_t> codes) {
  const std::string what = "fp8 " + std::string(name(f)) + ": ";
  if (!(std::isfinite(scale) && scale > 0))
    throw Error(ErrorCode::invalid_argument, what + "scale must be finite and positive, got " + std::to_string(scale));
  if (codes.size() != x.size())
    throw Error(ErrorCode::shape_mismatch,
                what + std::to_string(x.size()) + " values need as many codes, got " + std::to_string(codes.size()));
  for (std::size_t i = 0; i < x.size(); ++i)
    if (!std::isfinite(x[i]))
      throw Error(ErrorCode::non_finite_input, what + "value " + std::to_string(i) + " is not finite");
  for (std::size_t i = 0; i < x.size(); ++i) codes[i] = float_to_fp8(f, x[i] / scale);
}

inline void fp8_decode(Fp8Format f, std::span<const std::uint8_t> codes, float scale, std::span<float> out) {
  if (codes.size() != out.size())
    throw Error(ErrorCode::shape_mismatch, "fp8 " + std::string(name(f)) + ": " + std::to_string(codes.size()) +
                                               " codes need as many values, got " + std::to_string(out.size()));
  for (std::size_t i = 0; i < codes.size(); ++i) out[i] = fp8_to_float(f, codes[i]) * scale;
}

}  // namespace kvq::inline v0
