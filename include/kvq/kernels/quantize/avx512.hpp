#pragma once
// AVX-512 group quantization: same arithmetic as reference.hpp, 16 channels at a time, and
// packing by BMI2 pext (8 one-byte codes -> b bytes of the little-endian bit stream). This header
// holds the parameter arithmetic and packing shared by avx512_per_token.hpp (rows, groups along
// channels) and avx512_per_channel.hpp (blocks, groups along tokens).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvq/kernels/quantize/reference.hpp"

#define KVQ_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,bmi2,f16c,fma")))
// Small helpers are forced inline: passed by value across a call, their vectors go through memory.
#define KVQ_QUANT_INLINE KVQ_TARGET_AVX512 __attribute__((always_inline))

// GCC 12 warns on its own intrinsic headers (_mm512_undefined_* placeholders) when inlined
// through target attributes; the warning is about GCC's code, not ours.
#pragma GCC diagnostic push
#if !defined(__clang__)
#if !defined(__clang__)  // a GCC-only warning; clang warns about the unknown name
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kvq::inline v0::kernels::avx512 {

/// The modes whose codes the AVX-512 quantizer finds by searching their level table (NormalFloat,
/// Lloyd-Max, codebooks); iq4_nl's least-squares scale takes the reference.
constexpr bool searched_levels(Mode m) noexcept {
  return m == Mode::normal_float || m == Mode::lloyd_max || m == Mode::codebook;
}

/// Per-token groups must be whole vectors, and the levels kvq's own, ggml's, a searched table or
/// fp8; everything else is handled here.
inline bool supports(const QuantizerSpec& spec) noexcept {
  return spec.outliers == 0 && (affine_levels(spec.mode) || searched_levels(spec.mode) || is_fp8(spec.mode)) &&
         (spec.axis == Axis::per_channel || spec.group % 16 == 0);
}

/// A level table as encode_levels searches it. reference::encode compares a float v with the
/// midpoints of neighbouring levels in double; v is at or above a midpoint exactly when it is at
/// or above the least float not below it, so that is what lane i holds (the midpoint of levels i
/// and i + 1; +inf past the last).
struct LevelSearch {
  __m512 midpoints;
  int first_step;  // half the levels: the binary search's first probe (0: not a searched mode)
};

KVQ_TARGET_AVX512 inline LevelSearch level_search(const QuantizerSpec& spec) noexcept {
  if (!searched_levels(spec.mode)) return {_mm512_set1_ps(std::numeric_limits<float>::infinity()), 0};
  alignas(64) float midpoints[16];
  std::fill_n(midpoints, 16, std::numeric_limits<float>::infinity());
  const float* levels = code_levels(spec);
  for (int i = 0; i + 1 < spec.levels(); ++i) {
    const double exact = 0.5 * (double(levels[i]) + double(levels[i + 1]));
    const float rounded = float(exact);
    midpoints[i] = double(rounded) < exact ? std::nextafter(rounded, std::numeric_limits<float>::infinity()) : rounded;
  }
  return {_mm512_load_ps(midpoints), spec.levels() / 2};
}

KVQ_QUANT_INLINE inline __m512 round_to(Scalar s, __m512 v) noexcept {
  if (s == Scalar::f16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  if (s == Scalar::bf16) {  // round half to even on the upper 16 bits (inputs are finite)
    const __m512i x = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int(0xffff0000u))));
  }
  return v;
}

/// The least values of type s not below v (>= 0), as half.hpp's round_up_to.
KVQ_QUANT_INLINE inline __m512 round_up_to(Scalar s, __m512 v) noexcept {
  if (s == Scalar::f16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
  if (s == Scalar::bf16) {  // a positive value's upper 16 bits, plus one where any lower bit is set
    const __m512i x = _mm512_add_epi32(_mm512_castps_si512(v), _mm512_set1_epi32(0xffff));
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xffff0000u))));
  }
  return v;
}

KVQ_QUANT_INLINE inline void store_params(Scalar s, void* base, std::size_t index, __m512 v, __mmask16 m) noexcept {
  if (s == Scalar::f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(base) + index, m, v);
  } else if (s == Scalar::f16) {
    _mm256_mask_storeu_epi16(static_cast<std::uint16_t*>(base) + index, m,
                             _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {  // v is already bf16-exact: the upper halves are the bits
    _mm256_mask_storeu_epi16(static_cast<std::uint16_t*>(base) + index, m,
                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
  }
}

struct Params16 {
  __m512 zero, inv, scale;
};

/// Parameters of 16 groups from their ranges, rounded as stored (not stored yet).
KVQ_QUANT_INLINE inline Params16 compute_params(const QuantizerSpec& spec, __m512 lo, __m512 hi) noexcept {
  const __m512 top = _mm512_set1_ps(float(spec.levels() - 1));
  lo = _mm512_add_ps(lo, _mm512_setzero_ps());  // -0 -> +0, as in reference::make_params
  hi = _mm512_add_ps(hi, _mm512_setzero_ps());
  Params16 p;
  if (spec.mode == Mode::asymmetric) {
    p.scale = round_to(spec.param, _mm512_div_ps(_mm512_sub_ps(hi, lo), top));
    p.zero = round_to(spec.param, lo);
  } else if (spec.mode == Mode::codebook) {  // scalef halves exactly, as a product would, but never fuses
    const __m512 half = _mm512_scalef_ps(_mm512_sub_ps(hi, lo), _mm512_set1_ps(-1.0f));
    p.scale = round_to(spec.param, half);
    p.zero = round_to(spec.param, _mm512_add_ps(lo, half));
  } else if (searched_levels(spec.mode)) {
    const float* levels = code_levels(spec);
    const float outer = std::max(-levels[0], levels[spec.levels() - 1]);
    const __m512 absmax = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
    p.scale = round_to(spec.param, _mm512_div_ps(absmax, _mm512_set1_ps(outer)));
    p.zero = _mm512_setzero_ps();
  } else if (is_fp8(spec.mode)) {
    const __m512 absmax = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
    p.scale = round_up_to(spec.param, _mm512_div_ps(absmax, _mm512_set1_ps(fp8_max(fp8_format(spec.mode)))));
    p.zero = _mm512_setzero_ps();
  } else {
    const __m512 absmax = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
    p.scale = round_to(spec.param, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(2.0f), absmax), top));
    p.zero = _mm512_mul_ps(_mm512_set1_ps(-reference::mid_code(spec)), p.scale);
  }
  const __mmask16 normal = _mm512_cmp_ps_mask(p.scale, _mm512_set1_ps(std::numeric_limits<float>::min()), _CMP_GE_OQ);
  p.inv = _mm512_maskz_div_ps(normal, _mm512_set1_ps(1.0f), p.scale);
  return p;
}

/// ggml blocks: the parameters of 16 groups from their leads (each group's value of largest
/// magnitude, the first on a tie), with inv = 1 / the unrounded step, 0 where that is not finite
/// (reference::ggml_params).
KVQ_QUANT_INLINE inline Params16 ggml_params(const QuantizerSpec& spec, __m512 lead) noexcept {
  const float mid = reference::mid_code(spec);
  const __m512 d = spec.bits == 8 ? _mm512_div_ps(_mm512_abs_ps(lead), _mm512_set1_ps(127.0f))
                                  : _mm512_div_ps(lead, _mm512_set1_ps(-mid));
  Params16 p;
  p.scale = round_to(spec.param, d);
  p.zero = _mm512_mul_ps(_mm512_set1_ps(-mid), p.scale);
  const __m512 inv =
      _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.0f), d);
  const __mmask16 finite =
      _mm512_cmp_ps_mask(_mm512_abs_ps(inv), _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_LT_OQ);
  p.inv = _mm512_maskz_mov_ps(finite, inv);
  return p;
}

/// ggml's lead of 16 groups from their ranges: the end of larger magnitude. Where the two ends
/// have one magnitude and differ (lo = -hi), the first of them in the group leads: those lanes
/// are set in `tie` for the caller to resolve.
KVQ_QUANT_INLINE inline __m512 lead_of_range(__m512 lo, __m512 hi, __mmask16& tie) noexcept {
  lo = _mm512_add_ps(lo, _mm512_setzero_ps());  // -0 -> +0: a group of zeros leads with +0
  hi = _mm512_add_ps(hi, _mm512_setzero_ps());
  const __m512 low_magnitude = _mm512_abs_ps(lo), high_magnitude = _mm512_abs_ps(hi);
  tie = _mm512_cmp_ps_mask(low_magnitude, high_magnitude, _CMP_EQ_OQ) & _mm512_cmp_ps_mask(lo, hi, _CMP_NEQ_OQ);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(low_magnitude, high_magnitude, _CMP_GT_OQ), hi, lo);
}

/// Stores the lanes in m of scale (and zero, when the mode keeps one) at element `index`.
KVQ_QUANT_INLINE inline void store_params(const QuantizerSpec& spec, void* scales, void* zeros, std::size_t index,
                                          __m512 scale, __m512 zero, __mmask16 m) noexcept {
  store_params(spec.param, scales, index, scale, m);
  if (spec.has_zero_point()) store_params(spec.param, zeros, index, zero, m);
}

/// Parameters of 16 groups from their ranges, rounded as stored, and stored.
KVQ_QUANT_INLINE inline Params16 make_params(const QuantizerSpec& spec, __m512 lo, __m512 hi, void* scales, void* zeros,
                                             std::size_t index, __mmask16 m) noexcept {
  const Params16 p = compute_params(spec, lo, hi);
  store_params(spec, scales, zeros, index, p.scale, p.zero, m);
  return p;
}

/// codes (dim bytes) -> packed row; identical to pack_codes. Widths 2 and 4 combine neighbouring
/// bytes with multiply-adds (c0 + 16 c1, then c0 + 4 c1 + 16 c2 + 64 c3); the others by pext,
/// 8 codes -> `bits` bytes, gathered in a 64-bit register so every store is a whole word.
KVQ_TARGET_AVX512 inline void pack_row(const std::uint8_t* codes, std::size_t dim, int bits,
                                       std::uint8_t* out) noexcept {
  if (bits == 8) {
    std::memcpy(out, codes, dim);
    return;
  }
  std::size_t i = 0;
  if (bits == 4) {
    for (; i + 64 <= dim; i += 64) {
      const __m512i pairs = _mm512_maddubs_epi16(_mm512_loadu_si512(codes + i), _mm512_set1_epi16(0x1001));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i / 2), _mm512_cvtepi16_epi8(pairs));
    }
  } else if (bits == 2) {
    for (; i + 64 <= dim; i += 64) {
      const __m512i pairs = _mm512_maddubs_epi16(_mm512_loadu_si512(codes + i), _mm512_set1_epi16(0x0401));
      const __m256i quads = _mm256_maddubs_epi16(_mm512_cvtepi16_epi8(pairs), _mm256_set1_epi16(0x1001));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 4), _mm256_cvtepi16_epi8(quads));
    }
  } else {
    const std::uint64_t mask = 0x0101010101010101ull * ((1u << bits) - 1u);
    std::uint64_t acc = 0;
    int filled = 0;
    std::uint8_t* o = out;
    for (; i + 8 <= dim; i += 8) {
      std::uint64_t word;
      std::memcpy(&word, codes + i, 8);
      const std::uint64_t packed = _pext_u64(word, mask);  // 8 * bits bits
      acc |= packed << filled;
      filled += 8 * bits;
      if (filled >= 64) {
        std::memcpy(o, &acc, 8);
        o += 8;
        filled -= 64;
        acc = filled > 0 ? packed >> (8 * bits - filled) : 0;
      }
    }
    for (; filled > 0; filled -= 8, acc >>= 8) *o++ = std::uint8_t(acc);
  }
  if (i < dim) pack_codes(codes + i, dim - i, bits, out + i * std::size_t(bits) / 8);
}

KVQ_QUANT_INLINE inline __mmask16 tail_mask(std::size_t remaining) noexcept {
  return remaining >= 16 ? __mmask16(0xffff) : __mmask16((1u << remaining) - 1u);
}

}  // namespace kvq::inline v0::kernels::avx512

#pragma GCC diagnostic pop
