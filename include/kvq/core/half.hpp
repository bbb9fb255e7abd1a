#pragma once
// IEEE binary16 and bfloat16 storage types with exact round-to-nearest-even conversion.
// Plain bit manipulation so results are identical on every compiler and ISA; the F16C
// instructions used by the kernels produce the same bits.

#include <bit>
#include <cstdint>
#include <limits>

namespace kvq::inline v0 {

struct fp16 {
  std::uint16_t bits = 0;
  static constexpr float max_finite = 65504.0f;
};
static_assert(sizeof(fp16) == 2, "fp16 must be two bytes so parameter arrays pack densely");

struct bf16 {
  std::uint16_t bits = 0;
  static constexpr float max_finite = 3.38953139e38f;
};
static_assert(sizeof(bf16) == 2, "bf16 must be two bytes so parameter arrays pack densely");

constexpr float to_float(fp16 h) noexcept {
  const std::uint32_t sign = std::uint32_t(h.bits & 0x8000u) << 16;
  const std::uint32_t exponent = (h.bits >> 10) & 0x1fu;
  std::uint32_t mantissa = h.bits & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return std::bit_cast<float>(sign);
  // Subnormal: renormalise.
  std::uint32_t e = 113;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  return std::bit_cast<float>(sign | (e << 23) | ((mantissa & 0x3ffu) << 13));
}

constexpr fp16 to_fp16(float value) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  const std::uint16_t sign = std::uint16_t((x >> 16) & 0x8000u);
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u)  // Inf or NaN (NaN keeps a quiet payload bit)
    return fp16{std::uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u))};
  if (abs >= 0x477ff000u) return fp16{std::uint16_t(sign | 0x7c00u)};  // rounds past 65504
  if (abs < 0x33000001u) return fp16{sign};                            // below half the least subnormal
  std::uint32_t exponent = abs >> 23;
  std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
  int shift = 13;
  std::uint32_t biased = exponent - 112;
  if (exponent < 113) {  // result is subnormal
    shift = 13 + int(113 - exponent);
    biased = 0;
  }
  const std::uint32_t truncated = mantissa >> shift;
  const std::uint32_t remainder = mantissa & ((1u << shift) - 1);
  const std::uint32_t halfway = 1u << (shift - 1);
  std::uint32_t result = (biased << 10) + (truncated & (biased ? 0x3ffu : 0x7ffu));
  if (biased == 0) result = truncated;
  if (remainder > halfway || (remainder == halfway && (truncated & 1u))) ++result;
  return fp16{std::uint16_t(sign | result)};
}

constexpr float to_float(bf16 b) noexcept { return std::bit_cast<float>(std::uint32_t(b.bits) << 16); }

constexpr bf16 to_bf16(float value) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bf16{std::uint16_t((x >> 16) | 0x40u)};  // quiet NaN
  const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return bf16{std::uint16_t((x + rounding) >> 16)};
}

constexpr float to_float(float value) noexcept { return value; }

/// Storage type of scales, zero points and full-precision tokens, chosen at run time.
enum class Scalar : std::uint8_t { f32, f16, bf16 };

constexpr std::size_t size_of(Scalar s) noexcept { return s == Scalar::f32 ? 4 : 2; }

/// False for a value cast from outside the enumeration (configs read from files or casts).
constexpr bool is_valid(Scalar s) noexcept { return s == Scalar::f32 || s == Scalar::f16 || s == Scalar::bf16; }

constexpr const char* to_string(Scalar s) noexcept {
  return s == Scalar::f32 ? "f32" : s == Scalar::f16 ? "f16" : "bf16";
}

/// Largest finite magnitude the type can hold.
constexpr float max_finite(Scalar s) noexcept {
  return s == Scalar::f32 ? std::numeric_limits<float>::max() : s == Scalar::f16 ? fp16::max_finite : bf16::max_finite;
}

template <class T>
inline constexpr Scalar scalar_of = Scalar::f32;
template <>
inline constexpr Scalar scalar_of<fp16> = Scalar::f16;
template <>
inline constexpr Scalar scalar_of<bf16> = Scalar::bf16;

/// Round a float to what a Scalar of type `s` would store, and back.
constexpr float round_to(Scalar s, float value) noexcept {
  return s == Scalar::f32 ? value : s == Scalar::f16 ? to_float(to_fp16(value)) : to_float(to_bf16(value));
}

/// The least value of type `s` not below `value` (finite, >= 0; infinity past the type's range):
/// a scale rounded so that nothing it divides lands beyond its target, and never to 0.
inline float round_up_to(Scalar s, float value) noexcept {
  const float r = round_to(s, value);
  if (s == Scalar::f32 || !(r < value)) return r;
  return s == Scalar::f16 ? to_float(fp16{std::uint16_t(to_fp16(r).bits + 1)})
                          : to_float(bf16{std::uint16_t(to_bf16(r).bits + 1)});
}

/// Store / load one value in a raw buffer of Scalar type `s`.
inline void store_scalar(Scalar s, void* base, std::size_t index, float value) noexcept {
  switch (s) {
    case Scalar::f32:
      static_cast<float*>(base)[index] = value;
      break;
    case Scalar::f16:
      static_cast<fp16*>(base)[index] = to_fp16(value);
      break;
    case Scalar::bf16:
      static_cast<bf16*>(base)[index] = to_bf16(value);
      break;
  }
}

inline float load_scalar(Scalar s, const void* base, std::size_t index) noexcept {
  switch (s) {
    case Scalar::f32:
      return static_cast<const float*>(base)[index];
    case Scalar::f16:
      return to_float(static_cast<const fp16*>(base)[index]);
    case Scalar::bf16:
      return to_float(static_cast<const bf16*>(base)[index]);
  }
  return 0.0f;
}

}  // namespace kvq::inline v0
