#pragma once
// AVX-512F ops: 16 fp32 lanes. Members carry the target attribute; vector.hpp compiles its
// copy of the kernel on them under the same target.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/core/convert.hpp"
#include "kvq/isa.hpp"

// The features these ops need: their members, vector.hpp's copy of the kernel and its entry
// point are compiled for them.
#define KVQ_AVX512_OPS_FEATURES "avx512f,fma,f16c"
#define KVQ_TARGET_AVX512_OPS __attribute__((target(KVQ_AVX512_OPS_FEATURES)))

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
  KVQ_TARGET_AVX512_OPS static Vec max(Vec a, Vec b) noexcept { return _mm512_max_ps(a, b); }
  /// Lane j takes lane j ^ len (len a power of two below the width).
  template <std::size_t len>
  KVQ_TARGET_AVX512_OPS static Vec exchange(Vec x) noexcept {
    if constexpr (len == 1) return _mm512_permute_ps(x, 0xb1);
    if constexpr (len == 2) return _mm512_permute_ps(x, 0x4e);
    if constexpr (len == 4) return _mm512_shuffle_f32x4(x, x, 0xb1);
    if constexpr (len == 8) return _mm512_shuffle_f32x4(x, x, 0x4e);
  }
  /// The 8 floats at p, each twice: p0 p0 p1 p1 ... (a RoPE table's value for both lanes of a pair).
  KVQ_TARGET_AVX512_OPS static Vec doubled(const float* p) noexcept {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                 _mm512_castps256_ps512(_mm256_loadu_ps(p)));
  }
  /// exp(x) for x <= 0 (about 1 ulp); lanes below -87 give a tiny positive number.
  KVQ_TARGET_AVX512_OPS static Vec exp(Vec x) noexcept {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, n);
  }
  /// Codes [0, 16) of `bits` bits each (2, 4 or 8), packed from the low bits of p up, as floats:
  /// lane j takes the 32-bit word holding its code, shifted down.
  template <unsigned bits>
  KVQ_TARGET_AVX512_OPS static Vec codes(const std::uint8_t* p) noexcept {
    if constexpr (bits == 8) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    } else {
      std::uint64_t word = 0;
      std::memcpy(&word, p, 2 * bits);  // 16 codes of `bits` bits: 2 * bits bytes
      constexpr int b = int(bits);
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i at = _mm512_mullo_epi32(lane, _mm512_set1_epi32(b));  // each code's first bit
      const __m512i words = _mm512_permutexvar_epi32(_mm512_srli_epi32(at, 5),
                                                     _mm512_castsi128_si512(_mm_cvtsi64_si128(std::int64_t(word))));
      const __m512i shifted = _mm512_srlv_epi32(words, _mm512_and_si512(at, _mm512_set1_epi32(31)));
      return _mm512_cvtepi32_ps(_mm512_and_si512(shifted, _mm512_set1_epi32((1 << b) - 1)));
    }
  }
  /// Value i of an array of type t, fp16 converted by F16C.
  KVQ_TARGET_AVX512_OPS static float load_scalar(kvq::Scalar t, const void* base, std::size_t i) noexcept {
    return kvq::detail::load_scalar_f16c(t, base, i);
  }
  KVQ_TARGET_AVX512_OPS static float sum(Vec v) noexcept { return _mm512_reduce_add_ps(v); }
  /// The largest lane.
  KVQ_TARGET_AVX512_OPS static float largest(Vec v) noexcept { return _mm512_reduce_max_ps(v); }
};

}  // namespace kvq::inline v0::kernels::ops

KVQ_INTRINSIC_WARNINGS_ON
