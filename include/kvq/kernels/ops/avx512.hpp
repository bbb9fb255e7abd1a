#pragma once
// AVX-512F ops: 16 fp32 lanes. Members carry the target attribute, so a kernel instantiated on
// them runs through an entry point with the same attribute (vector.hpp's KVQ_VECTOR_ENTRY).

#include <immintrin.h>

#include <cstddef>

#include "kvq/isa.hpp"

#define KVQ_TARGET_AVX512_OPS __attribute__((target("avx512f,fma,f16c")))

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::ops {

struct Avx512 {
  using Vec = __m512;
  static constexpr std::size_t width = 16;
  KVQ_TARGET_AVX512_OPS static Vec zero() noexcept { return _mm512_setzero_ps(); }
  KVQ_TARGET_AVX512_OPS static Vec set1(float x) noexcept { return _mm512_set1_ps(x); }
  KVQ_TARGET_AVX512_OPS static Vec load(const float* p) noexcept { return _mm512_loadu_ps(p); }
  KVQ_TARGET_AVX512_OPS static void store(float* p, Vec v) noexcept { _mm512_storeu_ps(p, v); }
  KVQ_TARGET_AVX512_OPS static Vec add(Vec a, Vec b) noexcept { return _mm512_add_ps(a, b); }
  KVQ_TARGET_AVX512_OPS static Vec sub(Vec a, Vec b) noexcept { return _mm512_sub_ps(a, b); }
  KVQ_TARGET_AVX512_OPS static Vec mul(Vec a, Vec b) noexcept { return _mm512_mul_ps(a, b); }
  KVQ_TARGET_AVX512_OPS static Vec fma(Vec a, Vec b, Vec c) noexcept { return _mm512_fmadd_ps(a, b, c); }
  /// Lane j takes lane j ^ len (len a power of two below the width).
  template <std::size_t len>
  KVQ_TARGET_AVX512_OPS static Vec exchange(Vec x) noexcept {
    if constexpr (len == 1) return _mm512_permute_ps(x, 0xb1);
    if constexpr (len == 2) return _mm512_permute_ps(x, 0x4e);
    if constexpr (len == 4) return _mm512_shuffle_f32x4(x, x, 0xb1);
    if constexpr (len == 8) return _mm512_shuffle_f32x4(x, x, 0x4e);
  }
  KVQ_TARGET_AVX512_OPS static float sum(Vec v) noexcept { return _mm512_reduce_add_ps(v); }
};

}  // namespace kvq::inline v0::kernels::ops

KVQ_INTRINSIC_WARNINGS_ON
