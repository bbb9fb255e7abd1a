#pragma once
// Bulk conversion between float and the storage types (fp16, bf16, f32), with the same bits as
// the scalar conversions in half.hpp: F16C rounds to nearest even exactly as to_fp16 does.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "kvq/core/half.hpp"
#include "kvq/isa.hpp"

#if defined(KVQ_HAVE_X86_KERNELS)
#include <immintrin.h>
#endif

namespace kvq::inline v0 {

/// The smallest magnitude that overflows to infinity when stored as `s`.
constexpr float overflow_threshold(Scalar s) noexcept {
  return s == Scalar::f16    ? 65520.0f                           // 65504 + half an ulp, ties to even
         : s == Scalar::bf16 ? std::bit_cast<float>(0x7f7f8000u)  // bf16 max + half an ulp
                             : std::numeric_limits<float>::infinity();
}

namespace detail {

#if defined(KVQ_HAVE_X86_KERNELS)
#pragma GCC diagnostic push
#if !defined(__clang__)
#if !defined(__clang__)  // a GCC-only warning; clang warns about the unknown name
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
/// load_scalar with the F16C conversion for fp16: the kernels (AVX2 and AVX-512, both with F16C)
/// read scalar scales and zero points this way.
__attribute__((target("f16c"))) inline float load_scalar_f16c(Scalar s, const void* base, std::size_t i) noexcept {
  if (s == Scalar::f16) {
    std::uint16_t bits;
    std::memcpy(&bits, static_cast<const std::uint8_t*>(base) + 2 * i, 2);
    return _cvtsh_ss(bits);
  }
  return load_scalar(s, base, i);
}

__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline void store_f16_avx512(const float* src, std::size_t n,
                                                                                       std::uint16_t* dst) noexcept {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1u);
    _mm256_mask_storeu_epi16(
        dst + i, m, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline void load_f16_avx512(const std::uint16_t* src,
                                                                                      std::size_t n,
                                                                                      float* dst) noexcept {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + i)));
  }
}

// Largest and summed |x| of n fp16 values; two accumulators of each hide the add latency.
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline std::pair<float, float> magnitude_extent_f16_avx512(
    const std::uint16_t* src, std::size_t n) noexcept {
  __m512 top0 = _mm512_setzero_ps(), top1 = top0, sum0 = top0, sum1 = top0;
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_abs_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    const __m512 b = _mm512_abs_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 16))));
    top0 = _mm512_max_ps(top0, a), sum0 = _mm512_add_ps(sum0, a);
    top1 = _mm512_max_ps(top1, b), sum1 = _mm512_add_ps(sum1, b);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1u);
    const __m512 a = _mm512_abs_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + i)));
    top0 = _mm512_max_ps(top0, a), sum0 = _mm512_add_ps(sum0, a);
  }
  return {_mm512_reduce_max_ps(_mm512_max_ps(top0, top1)), _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1))};
}

// Compares bit patterns: with the sign cleared, float order is integer order, and every NaN lies
// above infinity. Independent running maxima keep the loop free of a mask dependency chain.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline std::uint32_t largest_magnitude_bits_avx512(
    const float* x, std::size_t n) noexcept {
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i m0 = _mm512_setzero_si512(), m1 = m0, m2 = m0, m3 = m0;
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), magnitude));
    m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + 16), magnitude));
    m2 = _mm512_max_epu32(m2, _mm512_and_si512(_mm512_loadu_si512(x + i + 32), magnitude));
    m3 = _mm512_max_epu32(m3, _mm512_and_si512(_mm512_loadu_si512(x + i + 48), magnitude));
  }
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1u);
    m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_maskz_loadu_epi32(m, x + i), magnitude));
  }
  return _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_max_epu32(m0, m1), _mm512_max_epu32(m2, m3)));
}
#pragma GCC diagnostic pop
#endif

}  // namespace detail

/// The largest |x[i]| (0 for n = 0): the cache's key peak, on the same scan as all_below. An
/// infinite x[i] gives inf; a NaN gives NaN on AVX-512 and is passed over by the scalar loop.
inline float largest_magnitude(const float* x, std::size_t n) noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  if (isa::detected() == isa::Level::avx512) return std::bit_cast<float>(detail::largest_magnitude_bits_avx512(x, n));
#endif
  float top = 0.0f;
  for (std::size_t i = 0; i < n; ++i) top = std::max(top, std::fabs(x[i]));
  return top;
}

/// True when every |x[i]| < limit (NaN fails).
inline bool all_below(const float* x, std::size_t n, float limit) noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  if (isa::detected() == isa::Level::avx512)
    return detail::largest_magnitude_bits_avx512(x, n) < std::bit_cast<std::uint32_t>(limit);
#endif
  bool ok = true;
  for (std::size_t i = 0; i < n; ++i) ok &= std::fabs(x[i]) < limit;
  return ok;
}

/// Largest and summed |x| of n values of type s (NaN-free input; used on stored parameters).
inline std::pair<float, float> magnitude_extent(Scalar s, const void* src, std::size_t n) noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  if (s == Scalar::f16 && isa::detected() == isa::Level::avx512)
    return detail::magnitude_extent_f16_avx512(static_cast<const std::uint16_t*>(src), n);
#endif
  float top = 0.0f, sum = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    const float x = std::fabs(load_scalar(s, src, i));
    top = std::max(top, x);
    sum += x;
  }
  return {top, sum};
}

/// src (n floats) -> dst (n values of type s).
inline void store_row(Scalar s, const float* src, std::size_t n, void* dst) noexcept {
  if (n == 0) return;  // memcpy's pointers must be valid even for 0 bytes
  if (s == Scalar::f32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
#if defined(KVQ_HAVE_X86_KERNELS)
  if (s == Scalar::f16 && isa::detected() == isa::Level::avx512)
    return detail::store_f16_avx512(src, n, static_cast<std::uint16_t*>(dst));
#endif
  for (std::size_t i = 0; i < n; ++i) store_scalar(s, dst, i, src[i]);
}

/// src (n values of type s) -> dst (n floats).
inline void load_row(Scalar s, const void* src, std::size_t n, float* dst) noexcept {
  if (n == 0) return;
  if (s == Scalar::f32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
#if defined(KVQ_HAVE_X86_KERNELS)
  if (s == Scalar::f16 && isa::detected() == isa::Level::avx512)
    return detail::load_f16_avx512(static_cast<const std::uint16_t*>(src), n, dst);
#endif
  if (s == Scalar::bf16) {  // a shift: vectorises as it stands
    const auto* b = static_cast<const std::uint16_t*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(std::uint32_t(b[i]) << 16);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) dst[i] = load_scalar(s, src, i);
}

}  // namespace kvq::inline v0
