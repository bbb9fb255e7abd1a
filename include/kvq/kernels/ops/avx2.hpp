#pragma once
// AVX2 + FMA ops: 8 fp32 lanes. Members carry the target attribute, so a kernel instantiated on
// them runs through an entry point with the same attribute (vector.hpp's KVQ_VECTOR_ENTRY).

#include <immintrin.h>

#include <cstddef>

#include "kvq/isa.hpp"

#define KVQ_TARGET_AVX2_OPS __attribute__((target("avx2,fma,f16c")))

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::ops {

struct Avx2 {
  using Vec = __m256;
  static constexpr std::size_t width = 8;
  KVQ_TARGET_AVX2_OPS static Vec zero() noexcept { return _mm256_setzero_ps(); }
  KVQ_TARGET_AVX2_OPS static Vec set1(float x) noexcept { return _mm256_set1_ps(x); }
  KVQ_TARGET_AVX2_OPS static Vec load(const float* p) noexcept { return _mm256_loadu_ps(p); }
  KVQ_TARGET_AVX2_OPS static void store(float* p, Vec v) noexcept { _mm256_storeu_ps(p, v); }
  KVQ_TARGET_AVX2_OPS static Vec add(Vec a, Vec b) noexcept { return _mm256_add_ps(a, b); }
  KVQ_TARGET_AVX2_OPS static Vec sub(Vec a, Vec b) noexcept { return _mm256_sub_ps(a, b); }
  KVQ_TARGET_AVX2_OPS static Vec mul(Vec a, Vec b) noexcept { return _mm256_mul_ps(a, b); }
  KVQ_TARGET_AVX2_OPS static Vec fma(Vec a, Vec b, Vec c) noexcept { return _mm256_fmadd_ps(a, b, c); }
  /// Lane j takes lane j ^ len (len a power of two below the width).
  template <std::size_t len>
  KVQ_TARGET_AVX2_OPS static Vec exchange(Vec x) noexcept {
    if constexpr (len == 1) return _mm256_permute_ps(x, 0xb1);
    if constexpr (len == 2) return _mm256_permute_ps(x, 0x4e);
    if constexpr (len == 4) return _mm256_permute2f128_ps(x, x, 0x01);
  }
  KVQ_TARGET_AVX2_OPS static float sum(Vec v) noexcept {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
};

}  // namespace kvq::inline v0::kernels::ops

KVQ_INTRINSIC_WARNINGS_ON
