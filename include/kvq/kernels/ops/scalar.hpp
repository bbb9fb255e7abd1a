#pragma once
// Scalar vector ops: one lane, products summed in double. The vector kernel on these ops is the
// reference kernel (kernels/attention/vector.hpp), so its key scores are the fp64 dot products
// of the rows it reads.

#include <cstddef>

namespace kvq::inline v0::kernels::ops {

struct Scalar {
  using Vec = double;
  static constexpr std::size_t width = 1;
  static Vec zero() noexcept { return 0.0; }
  static Vec set1(float x) noexcept { return x; }
  static Vec load(const float* p) noexcept { return *p; }
  static void store(float* p, Vec v) noexcept { *p = float(v); }
  static Vec add(Vec a, Vec b) noexcept { return a + b; }
  static Vec fma(Vec a, Vec b, Vec c) noexcept { return a * b + c; }  // a * b + c
  static float sum(Vec v) noexcept { return float(v); }
};

}  // namespace kvq::inline v0::kernels::ops
