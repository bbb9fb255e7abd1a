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
  static Vec fma(Vec a, Vec b, Vec c) noexcept { return vfmaq_f32(c, a, b); }
  static float sum(Vec v) noexcept { return vaddvq_f32(v); }
};

}  // namespace kvq::inline v0::kernels::ops
