#pragma once
// AVX-512 codes 64 at a time: load (f32, f16 or bf16 rows), encode as reference::encode does
// (kvq's affine levels, ggml's, searched level tables and fp8),
// narrow to bytes in registers, and pack from there for 2, 4 and 8 bits (pack_row otherwise).

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kvq/kernels/quantize/avx512.hpp"

#pragma GCC diagnostic push
#if !defined(__clang__)
#if !defined(__clang__)  // a GCC-only warning; clang warns about the unknown name
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kvq::inline v0::kernels::avx512 {

/// 16 values of a row stored as `In` (f32, f16 or bf16), from element c; m selects the lanes read.
template <Scalar In>
KVQ_QUANT_INLINE inline __m512 load16(const void* row, std::size_t c, __mmask16 m) noexcept {
  if constexpr (In == Scalar::f32) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(row) + c);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const std::uint16_t*>(row) + c);
    if constexpr (In == Scalar::f16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <Scalar In>
KVQ_QUANT_INLINE inline __m512 load16(const void* row, std::size_t c) noexcept {
  if constexpr (In == Scalar::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(row) + c);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(row) + c));
    if constexpr (In == Scalar::f16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

/// 16 codes as int32: rne(min(top, (x - zero) * inv)). Clamping at top before the conversion keeps
/// it in range; negative codes, and NaN (converted to INT_MIN), saturate to 0 when narrowed.
KVQ_QUANT_INLINE inline __m512i encode32(__m512 x, __m512 zero, __m512 inv, __m512 top) noexcept {
  const __m512 q = _mm512_min_ps(top, _mm512_mul_ps(_mm512_sub_ps(x, zero), inv));  // NaN stays NaN
  return _mm512_cvt_roundps_epi32(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/// 16 fp8 codes as int32: float_to_fp8(x * inv) (saturating; x * inv is never NaN), its bit
/// arithmetic lane by lane.
KVQ_QUANT_INLINE inline __m512i encode_fp8(__m512 x, __m512 inv, Fp8Format f) noexcept {
  const kvq::detail::Fp8Layout l = kvq::detail::fp8_layout(f);
  const __m512 y = _mm512_mul_ps(x, inv);
  const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(INT32_MIN)), 24);
  const __m512 a = _mm512_abs_ps(y);
  const __m512i subnormal = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(l.per_quantum)),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const int drop = 23 - l.mantissa_bits;
  __m512i u = _mm512_castps_si512(a);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, unsigned(drop)), _mm512_set1_epi32(1)),
                                           _mm512_set1_epi32((1 << (drop - 1)) - 1)));
  __m512i code =
      _mm512_sub_epi32(_mm512_srli_epi32(u, unsigned(drop)), _mm512_set1_epi32((127 - l.bias) << l.mantissa_bits));
  code = _mm512_min_epu32(code, _mm512_set1_epi32(f == Fp8Format::e4m3fn ? 0x7E : 0x7B));
  code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(l.min_normal), _CMP_LT_OQ), subnormal);
  return _mm512_or_si512(code, sign);
}

/// 16 codes of a searched level table as int32: the index of the level nearest to
/// (x - zero) * inv, halfway the upper one (reference::encode), by binary search over the
/// midpoints; NaN compares below every midpoint and gets code 0, as there.
KVQ_QUANT_INLINE inline __m512i encode_levels(__m512 x, __m512 zero, __m512 inv, const LevelSearch& search) noexcept {
  const __m512 v = _mm512_mul_ps(_mm512_sub_ps(x, zero), inv);
  __m512i code = _mm512_setzero_si512();
  for (int step = search.first_step; step > 0; step /= 2) {
    // moving up to code + step takes v at or above the midpoint just below that level
    const __m512 midpoint =
        _mm512_permutexvar_ps(_mm512_add_epi32(code, _mm512_set1_epi32(step - 1)), search.midpoints);
    code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(v, midpoint, _CMP_GE_OQ), code, _mm512_set1_epi32(step));
  }
  return code;
}

/// 16 ggml codes as int32 from inv (1 / the unrounded step), operation by operation as
/// reference::ggml_encode: 8 bits round(x * inv) + 128 (half away from zero) within [1, 255],
/// fewer trunc(x * inv + mid + 0.5) within [0, top]. The product has its own rounding step
/// (the _round_ form), so no compiler fuses it into the next addition.
KVQ_QUANT_INLINE inline __m512i encode_ggml(__m512 x, __m512 inv, int bits) noexcept {
  const __m512 y = _mm512_mul_round_ps(x, inv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 code;
  if (bits == 8) {
    const __m512 whole = _mm512_roundscale_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 away = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(y, whole)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 step = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(y, _mm512_set1_ps(-0.0f)));  // +-1 as y
    code = _mm512_add_ps(_mm512_mask_add_ps(whole, away, whole, step), _mm512_set1_ps(128.0f));
    code = _mm512_min_ps(_mm512_max_ps(code, _mm512_set1_ps(1.0f)), _mm512_set1_ps(255.0f));
  } else {
    const float mid = float(1 << (bits - 1));
    code = _mm512_roundscale_ps(_mm512_add_ps(y, _mm512_set1_ps(mid + 0.5f)), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    code = _mm512_min_ps(_mm512_max_ps(code, _mm512_setzero_ps()), _mm512_set1_ps(float((1 << bits) - 1)));
  }
  return _mm512_cvttps_epi32(code);
}

/// 4 x 16 int32 codes -> 64 bytes in channel order, saturating to [0, 255].
KVQ_QUANT_INLINE inline __m512i narrow64(__m512i a, __m512i b, __m512i c, __m512i d) noexcept {
  // The packs work within 128-bit lanes: dword 4i + j ends up holding codes 4i..4i+3 of input j.
  const __m512i bytes = _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_epi32(order, bytes);
}

/// 64 codes of a full chunk -> their packed bytes at out, for 2, 4 and 8 bits (as pack_codes).
KVQ_QUANT_INLINE inline void pack64(__m512i codes, int bits, std::uint8_t* out) noexcept {
  if (bits == 8) {
    _mm512_storeu_si512(out, codes);
  } else if (bits == 4) {
    const __m512i pairs = _mm512_maddubs_epi16(codes, _mm512_set1_epi16(0x1001));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi16_epi8(pairs));
  } else {
    const __m512i pairs = _mm512_maddubs_epi16(codes, _mm512_set1_epi16(0x0401));
    const __m256i quads = _mm256_maddubs_epi16(_mm512_cvtepi16_epi8(pairs), _mm256_set1_epi16(0x1001));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtepi16_epi8(quads));
  }
}

/// How a mode turns a value into a code; encode_row is compiled once per rule, so its inner loop
/// carries no test of the mode.
enum class CodeRule { affine, fp8, searched_levels, ggml };

inline CodeRule code_rule(const QuantizerSpec& spec) noexcept {
  return is_fp8(spec.mode)            ? CodeRule::fp8
         : searched_levels(spec.mode) ? CodeRule::searched_levels
         : spec.mode == Mode::ggml    ? CodeRule::ggml
                                      : CodeRule::affine;
}

/// One row's codes by rule Rule, packed at out; params_of(c) gives the zero points and inverses of
/// the 16 channels from c (never straddling a group), search is level_search(spec).
template <Scalar In, CodeRule Rule, class ParamsOf>
KVQ_TARGET_AVX512 inline void encode_row_by(const QuantizerSpec& spec, const LevelSearch& search, const void* row,
                                            std::size_t dim, ParamsOf params_of, std::uint8_t* out) noexcept {
  const __m512 top = _mm512_set1_ps(float(spec.levels() - 1));
  const Fp8Format format = fp8_format(spec.mode);
  const bool packs_in_register = spec.bits == 2 || spec.bits == 4 || spec.bits == 8;
  alignas(64) std::uint8_t codes[max_head_dim + 64];
  std::size_t buffered_from = dim;  // codes from here on go through the buffer and pack_row
  for (std::size_t c = 0; c < dim; c += 64) {
    __m512i q[4];
    const bool full = c + 64 <= dim;
    for (std::size_t v = 0; v < 4; ++v) {
      const std::size_t ch = c + 16 * v;
      if (!full && ch >= dim) {
        q[v] = _mm512_setzero_si512();
        continue;
      }
      const Params16 p = params_of(ch);
      const __m512 x = full || dim - ch >= 16 ? load16<In>(row, ch) : load16<In>(row, ch, tail_mask(dim - ch));
      if constexpr (Rule == CodeRule::fp8)
        q[v] = encode_fp8(x, p.inv, format);
      else if constexpr (Rule == CodeRule::searched_levels)
        q[v] = encode_levels(x, p.zero, p.inv, search);
      else if constexpr (Rule == CodeRule::ggml)
        q[v] = encode_ggml(x, p.inv, spec.bits);
      else
        q[v] = encode32(x, p.zero, p.inv, top);
    }
    const __m512i bytes = narrow64(q[0], q[1], q[2], q[3]);
    if (packs_in_register && full) {
      pack64(bytes, spec.bits, out + c * std::size_t(spec.bits) / 8);
    } else {
      _mm512_store_si512(codes + c, bytes);
      if (buffered_from == dim) buffered_from = c;
    }
  }
  if (buffered_from < dim)
    pack_row(codes + buffered_from, dim - buffered_from, spec.bits, out + buffered_from * std::size_t(spec.bits) / 8);
}

/// encode_row_by the rule of spec's mode.
template <Scalar In, class ParamsOf>
KVQ_TARGET_AVX512 inline void encode_row(const QuantizerSpec& spec, const LevelSearch& search, const void* row,
                                         std::size_t dim, ParamsOf params_of, std::uint8_t* out) noexcept {
  switch (code_rule(spec)) {
    case CodeRule::fp8:
      return encode_row_by<In, CodeRule::fp8>(spec, search, row, dim, params_of, out);
    case CodeRule::searched_levels:
      return encode_row_by<In, CodeRule::searched_levels>(spec, search, row, dim, params_of, out);
    case CodeRule::ggml:
      return encode_row_by<In, CodeRule::ggml>(spec, search, row, dim, params_of, out);
    case CodeRule::affine:
      break;
  }
  encode_row_by<In, CodeRule::affine>(spec, search, row, dim, params_of, out);
}

}  // namespace kvq::inline v0::kernels::avx512

#pragma GCC diagnostic pop
