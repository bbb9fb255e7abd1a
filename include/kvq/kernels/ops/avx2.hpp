#pragma once
// AVX2 + FMA ops: 8 fp32 lanes. Members carry the target attribute; vector.hpp compiles its
// copy of the kernel on them under the same target.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/core/convert.hpp"
#include "kvq/isa.hpp"

// The features these ops need: their members, vector.hpp's copy of the kernel and its entry
// point are compiled for them.
#define KVQ_AVX2_OPS_FEATURES "avx2,fma,f16c"
#define KVQ_TARGET_AVX2_OPS __attribute__((target(KVQ_AVX2_OPS_FEATURES)))

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
  KVQ_TARGET_AVX2_OPS static Vec max(Vec a, Vec b) noexcept { return _mm256_max_ps(a, b); }
  /// Lane j takes lane j ^ len (len a power of two below the width).
  template <std::size_t len>
  KVQ_TARGET_AVX2_OPS static Vec exchange(Vec x) noexcept {
    if constexpr (len == 1) return _mm256_permute_ps(x, 0xb1);
    if constexpr (len == 2) return _mm256_permute_ps(x, 0x4e);
    if constexpr (len == 4) return _mm256_permute2f128_ps(x, x, 0x01);
  }
  /// The 4 floats at p, each twice: p0 p0 p1 p1 ... (a RoPE table's value for both lanes of a pair).
  KVQ_TARGET_AVX2_OPS static Vec doubled(const float* p) noexcept {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  }
  /// exp(x) for x <= 0 (about 1 ulp); lanes below -87 give a tiny positive number.
  KVQ_TARGET_AVX2_OPS static Vec exp(Vec x) noexcept {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
      p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    // 2^n with n in [-126, 0]: the exponent field directly
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  /// Codes [0, 8) of `bits` bits each (2, 4 or 8), packed from the low bits of p up, as floats.
  template <unsigned bits>
  KVQ_TARGET_AVX2_OPS static Vec codes(const std::uint8_t* p) noexcept {
    if constexpr (bits == 8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    } else {
      std::uint32_t word = 0;
      std::memcpy(&word, p, bits);  // 8 codes of `bits` bits: `bits` bytes
      constexpr int b = int(bits);
      const __m256i shifted = _mm256_srlv_epi32(_mm256_set1_epi32(int(word)),
                                                _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b));
      return _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32((1 << b) - 1)));
    }
  }
  /// Value i of an array of type t, fp16 converted by F16C.
  KVQ_TARGET_AVX2_OPS static float load_scalar(kvq::Scalar t, const void* base, std::size_t i) noexcept {
    return kvq::detail::load_scalar_f16c(t, base, i);
  }
  KVQ_TARGET_AVX2_OPS static float sum(Vec v) noexcept {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  /// The largest lane.
  KVQ_TARGET_AVX2_OPS static float largest(Vec v) noexcept {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
};

}  // namespace kvq::inline v0::kernels::ops

KVQ_INTRINSIC_WARNINGS_ON
