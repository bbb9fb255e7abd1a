#pragma once
// AArch64 Advanced SIMD ops: 4 fp32 lanes. Every AArch64 CPU has them, so kernels on these ops
// need no runtime check.

#include <arm_neon.h>

#include <cstddef>

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
  /// Lane j takes lane j ^ len (len a power of two below the width).
  template <std::size_t len>
  static Vec exchange(Vec x) noexcept {
    if constexpr (len == 1) return vrev64q_f32(x);
    if constexpr (len == 2) return vextq_f32(x, x, 2);
  }
  static float sum(Vec v) noexcept { return vaddvq_f32(v); }
};

}  // namespace kvq::inline v0::kernels::ops
