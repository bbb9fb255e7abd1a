#pragma once
// 8-bit floats as KV-cache codecs (vLLM's fp8 caches): OCP FP8 E4M3 in its "fn" variant (bias 7,
// no infinities, one NaN per sign S.1111.111, largest finite 448) and E5M2 (bias 15, IEEE-style
// infinities and NaNs, largest finite 57344). A stored value is fp8(x / scale) with a per-tensor
// or per-head float scale, and reads back as to_float(code) * scale. The cache's fp8 modes
// (Mode::fp8_e4m3 / fp8_e5m2, "k8t32e4m3") keep a scale per group instead and code through the
// same functions.
//
// Conversion from float rounds to nearest, ties to even, through the subnormals. Overflow
// saturates to the largest finite value of the sign (what vLLM's clamp before the cast does); with
// `saturate` off, E5M2 overflows to infinity and E4M3FN, which has none, to NaN. NaN stays NaN.

#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
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
  float min_normal;   // 2^(1 - bias)
  float per_quantum;  // 1 / the subnormal quantum, 2^(bias - 1 + mantissa_bits)
};

constexpr Fp8Layout fp8_layout(Fp8Format f) noexcept {
  return f == Fp8Format::e4m3fn ? Fp8Layout{3, 7, false, 0x1p-6f, 0x1p9f} : Fp8Layout{2, 15, true, 0x1p-14f, 0x1p16f};
}

}  // namespace detail

namespace detail {

// The value of every code, computed at compile time (powers of two are exact in double), so a
// cache file decodes alike on every build and libm.
constexpr std::array<float, 256> fp8_values(Fp8Format f) noexcept {
  const Fp8Layout l = fp8_layout(f);
  const int exponent_bits = 7 - l.mantissa_bits, top = (1 << exponent_bits) - 1;
  std::array<float, 256> values{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = code >> l.mantissa_bits & top;
    const int mantissa = code & ((1 << l.mantissa_bits) - 1);
    double v = 0.0;
    if (exponent == top && (l.has_infinity || mantissa == (1 << l.mantissa_bits) - 1)) {
      v = l.has_infinity && mantissa == 0 ? std::numeric_limits<double>::infinity()
                                          : std::numeric_limits<double>::quiet_NaN();
    } else {  // significand x 2^power, the subnormals with the smallest normal exponent
      v = exponent == 0 ? mantissa : mantissa + (1 << l.mantissa_bits);
      for (int power = (exponent == 0 ? 1 : exponent) - l.bias - l.mantissa_bits; power != 0;)
        power > 0 ? (v *= 2.0, --power) : (v *= 0.5, ++power);
    }
    values[std::size_t(code)] = float(code & 0x80 ? -v : v);
  }
  return values;
}

inline constexpr std::array<float, 256> fp8_e4m3fn_values = fp8_values(Fp8Format::e4m3fn);
inline constexpr std::array<float, 256> fp8_e5m2_values = fp8_values(Fp8Format::e5m2);

}  // namespace detail

/// The 256 values the codes of a format stand for, by code (NaN codes are quiet NaNs).
constexpr const float* fp8_table(Fp8Format f) noexcept {
  return f == Fp8Format::e4m3fn ? detail::fp8_e4m3fn_values.data() : detail::fp8_e5m2_values.data();
}

/// The value of an fp8 code (NaN codes give a quiet NaN).
inline float fp8_to_float(Fp8Format f, std::uint8_t code) noexcept { return fp8_table(f)[code]; }

/// Largest finite value of the format: 448 (e4m3fn) or 57344 (e5m2).
inline float fp8_max(Fp8Format f) noexcept { return fp8_to_float(f, f == Fp8Format::e4m3fn ? 0x7E : 0x7B); }

/// The fp8 code nearest to x (ties to even); overflow as the header says. Integer arithmetic on
/// the float's bits (the cache encodes every value through it).
inline std::uint8_t float_to_fp8(Fp8Format f, float x, bool saturate = true) noexcept {
  const detail::Fp8Layout l = detail::fp8_layout(f);
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const std::uint8_t nan = f == Fp8Format::e4m3fn ? 0x7F : 0x7E;
  const unsigned largest = f == Fp8Format::e4m3fn ? 0x7E : 0x7B;
  if (std::isnan(x)) return std::uint8_t(sign | nan);
  const float a = std::fabs(x);
  // Below the smallest normal the codes count quanta of 2^(1 - bias - mantissa_bits) from 0 (the
  // count 2^mantissa_bits is the smallest normal's code); scaling by a power of two is exact.
  if (a < l.min_normal) return std::uint8_t(sign | unsigned(std::nearbyint(a * l.per_quantum)));
  // Normal: round the float's 23 mantissa bits to mantissa_bits, half to even (a carry moves to
  // the exponent, as it should), then rebias the exponent field.
  const int drop = 23 - l.mantissa_bits;
  std::uint32_t u = std::bit_cast<std::uint32_t>(a);
  u += ((u >> drop) & 1u) + (1u << (drop - 1)) - 1u;
  const std::uint32_t code = (u >> drop) - (std::uint32_t(127 - l.bias) << l.mantissa_bits);
  if (code > largest) return std::uint8_t(sign | (saturate ? largest : l.has_infinity ? 0x7C : nan));
  return std::uint8_t(sign | code);
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

/// out[i] = float(codes[i]) * scale (a NaN or infinite code decodes as such); throws, writing
/// nothing, on a scale fp8_encode would refuse or mismatched sizes.
inline void fp8_decode(Fp8Format f, std::span<const std::uint8_t> codes, float scale, std::span<float> out) {
  if (!(std::isfinite(scale) && scale > 0))
    throw Error(ErrorCode::invalid_argument,
                "fp8 " + std::string(name(f)) + ": scale must be finite and positive, got " + std::to_string(scale));
  if (codes.size() != out.size())
    throw Error(ErrorCode::shape_mismatch, "fp8 " + std::string(name(f)) + ": " + std::to_string(codes.size()) +
                                               " codes need as many values, got " + std::to_string(out.size()));
  for (std::size_t i = 0; i < codes.size(); ++i) out[i] = fp8_to_float(f, codes[i]) * scale;
}

}  // namespace kvq::inline v0
