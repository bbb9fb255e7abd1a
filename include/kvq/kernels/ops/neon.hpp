#pragma once
// AArch64 Advanced SIMD ops: 4 fp32 lanes. Every AArch64 CPU has them, so kernels on these ops
// need no runtime check.

#include <arm_neon.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/core/convert.hpp"

namespace kvq::inline v0::kernels::ops {

struct Neon {
  using Vec = float32x4_t;
  static constexpr std::size_t width = 4;
  static Vec zero() noexcept { return vdupq_n_f32(0.0f); }
  static Vec set1(float x) noexcept { return vdupq_n_f32(x); }
  static Vec load(const float* p) noexcept { return vld1q_f32(p); }
  static void store(float* p, Vec v) noexcept { vst1q_f32(p, v); }
  static Vec add(Vec a, Vec b) noexcept { return vaddq_f32(a, b); }
  static Vec sub(Vec a, Vec b) noexcept { return vsubq_f32(a, b); }
  static Vec mul(Vec a, Vec b) noexcept { return vmulq_f32(a, b); }
  static Vec fma(Vec a, Vec b, Vec c) noexcept { return vfmaq_f32(c, a, b); }
  static Vec max(Vec a, Vec b) noexcept { return vmaxq_f32(a, b); }
  /// Lane j takes lane j ^ len (len a power of two below the width).
  template <std::size_t len>
  static Vec exchange(Vec x) noexcept {
    if constexpr (len == 1) return vrev64q_f32(x);
    if constexpr (len == 2) return vextq_f32(x, x, 2);
  }
  /// The 2 floats at p, each twice: p0 p0 p1 p1 (a RoPE table's value for both lanes of a pair).
  static Vec doubled(const float* p) noexcept {
    const float32x2_t x = vld1_f32(p);
    return vcombine_f32(vdup_lane_f32(x, 0), vdup_lane_f32(x, 1));
  }
  /// exp(x) for x <= 0 (about 1 ulp); lanes below -87 give a tiny positive number.
  static Vec exp(Vec x) noexcept {
    x = vmaxq_f32(x, vdupq_n_f32(-87.0f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.0f / 5040.0f);
    for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
      p = vfmaq_f32(vdupq_n_f32(c), p, r);
    // 2^n with n in [-126, 0]: the exponent field directly
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
  }
  /// Codes [0, 4) of `bits` bits each (2, 4 or 8), packed from the low bits of p up, as floats.
  template <unsigned bits>
  requires(bits % 2 == 0)  // 4 codes take whole bytes
      static Vec codes(const std::uint8_t* p) noexcept {
    std::uint32_t word = 0;
    std::memcpy(&word, p, bits / 2);
    constexpr int b = int(bits);
    const int32x4_t shifts = {0, -b, -2 * b, -3 * b};  // negative: right shifts
    const std::uint32_t mask = bits == 8 ? 0xffu : (1u << bits) - 1u;
    return vcvtq_f32_u32(vandq_u32(vshlq_u32(vdupq_n_u32(word), shifts), vdupq_n_u32(mask)));
  }
  /// Value i of an array of type t, fp16 converted by the FPU (every AArch64 CPU converts fp16).
  static float load_scalar(kvq::Scalar t, const void* base, std::size_t i) noexcept {
    if (t != kvq::Scalar::f16) return kvq::load_scalar(t, base, i);
    std::uint16_t bits;
    std::memcpy(&bits, static_cast<const std::uint8_t*>(base) + 2 * i, 2);
    return float(std::bit_cast<__fp16>(bits));
  }
  static float sum(Vec v) noexcept { return vaddvq_f32(v); }
  /// The largest lane.
  static float largest(Vec v) noexcept { return vmaxvq_f32(v); }
};

}  // namespace kvq::inline v0::kernels::ops
