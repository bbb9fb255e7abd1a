#pragma once
// What every AVX-512 attention kernel shares: the target attribute, the CPU check, the shapes
// the kernels take, and the vector helpers (code unpacking, exp). avx512.hpp says which kernel
// runs what.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvq/isa.hpp"
#include "kvq/kernels/attention/task.hpp"
#include "kvq/kernels/ops/avx512.hpp"

#define KVQ_TARGET_AVX512_ATTENTION \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,bmi2,f16c,fma")))

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::attention::avx512 {

/// This CPU runs these kernels (AVX-512 level plus VBMI for the code unpacking).
inline bool supported() noexcept {
  static const bool ok = [] {
    if (isa::detected() != isa::Level::avx512) return false;
    __builtin_cpu_init();
    return bool(__builtin_cpu_supports("avx512vbmi"));
  }();
  return ok;
}

/// Codes the span and integer kernels unpack: 2, 4 or 8 bits, standing for themselves or for one
/// of at most 16 levels (code_values; fp8's 256 values are read elsewhere).
inline bool fast_bits(const QuantizerSpec& spec) noexcept {
  return (spec.bits == 2 || spec.bits == 4 || spec.bits == 8) && (affine_levels(spec.mode) || spec.levels() <= 16);
}

namespace detail {

/// Codes of one stream the generic kernel turns into floats in registers: fast_bits, 3 (eight
/// codes in three bytes; its loops take any width the Unpacker gives) and fp8 (CodeMap), per
/// channel or in whole 16-channel groups.
inline bool fast_codes(const StreamView& s) noexcept {
  return s.quantized && (fast_bits(s.spec) || s.spec.bits == 3 || is_fp8(s.spec.mode)) && s.spec.group % 16 == 0;
}

/// Whether the kernels here unpack a stream's codes in registers: unquantized, or fast codes of
/// keys, or of values per token whose 16-channel vectors hold whole groups. They read other rows
/// through StreamView::read_row.
inline bool reads_at_speed(const StreamView& s, bool keys) noexcept {
  return !s.quantized ||
         (fast_codes(s) && (keys || (s.spec.axis == Axis::per_token && 16 % groups_per_row(s.spec, s.head_dim) == 0)));
}

/// What the codes of a 2-, 3- or 4-bit stream stand for, as a vpermps table read with the low 4
/// bits of a lane: the code itself (affine levels: value = zero + scale * code) or the level it
/// names (a level table: value = zero + scale * level). Narrower entries repeat with period
/// 2^bits, so the bits above a code need no mask.
inline void code_values(const QuantizerSpec& spec, float* table) noexcept {
  const float* levels = code_levels(spec);
  const int mask = spec.levels() < 16 ? spec.levels() - 1 : 15;
  for (int j = 0; j < 16; ++j) table[j] = levels != nullptr ? levels[j & mask] : float(j & mask);
}

/// How the generic kernel turns a stream's byte codes into what they stand for, in units of
/// `unit` (which its users fold into the scales): the codes themselves (affine levels), a
/// code_values table (`table`), or fp8 bytes widened to f16 bit patterns (e5m2 is the top byte
/// of an f16; e4m3fn's sign, exponent and mantissa shift into place, its values 2^8 times the
/// f16's). Exact for every code encode writes; e4m3fn's NaN codes, which it never writes, read
/// as 480.
struct CodeMap {
  const float* table = nullptr;
  bool fp8 = false;
  Fp8Format format = Fp8Format::e4m3fn;
  float unit = 1.0f;
};

/// The CodeMap of a stream's spec; `storage` (16 floats) holds its table, if any.
inline CodeMap code_map(const QuantizerSpec& spec, float* storage) noexcept {
  if (is_fp8(spec.mode)) return {nullptr, true, fp8_format(spec.mode), spec.mode == Mode::fp8_e4m3 ? 256.0f : 1.0f};
  if (affine_levels(spec.mode)) return {};
  code_values(spec, storage);
  return {storage};
}

/// 64 byte codes as 4 vectors of floats, as `map` says (in its units).
KVQ_TARGET_AVX512_ATTENTION inline void code_floats(__m512i c, __m512* x, const CodeMap& map) noexcept {
  const __m128i bytes[4] = {_mm512_castsi512_si128(c), _mm512_extracti32x4_epi32(c, 1), _mm512_extracti32x4_epi32(c, 2),
                            _mm512_extracti32x4_epi32(c, 3)};
  if (map.fp8) {
    for (int j = 0; j < 4; ++j) {
      const __m256i w = _mm256_cvtepu8_epi16(bytes[j]);
      if (map.format == Fp8Format::e5m2) {
        x[j] = _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
        continue;
      }
      const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
      const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
      x[j] = _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
    }
    return;
  }
  __m512i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm512_cvtepu8_epi32(bytes[j]);
  if (map.table == nullptr) {
    for (int j = 0; j < 4; ++j) x[j] = _mm512_cvtepi32_ps(i[j]);
    return;
  }
  const __m512 levels = _mm512_load_ps(map.table);
  for (int j = 0; j < 4; ++j) x[j] = _mm512_permutexvar_ps(i[j], levels);
}

}  // namespace detail

/// Shapes the kernels take; anything else runs on another kernel.
inline bool supports(const StreamView& keys, const StreamView& values, std::size_t group,
                     const RopeTable* rope) noexcept {
  const std::size_t d = keys.head_dim;
  if ((d != 64 && d != 128) || values.head_dim != d || group == 0 || group > max_group) return false;
  if (rope != nullptr && rope->config().dims() != d) return false;
  return true;
}

/// Whether the kernels read these streams at speed (detail::reads_at_speed; level tables of 2 to
/// 4 bits are looked up like kvq's codes, code_values). Rows read one by one through read_row run
/// 2-9x slower than on AVX2 or the vector kernels (bench/RESULTS.md), which the registry prefers
/// then.
inline bool at_speed(const StreamView& keys, const StreamView& values, const RopeTable*) noexcept {
  return detail::reads_at_speed(keys, true) && detail::reads_at_speed(values, false);
}

namespace detail {

using DecodeTask = attention::DecodeTask;

/// 16 values of type s at element index i as floats.
KVQ_TARGET_AVX512_ATTENTION inline __m512 load16(Scalar s, const std::uint8_t* base, std::size_t i) noexcept {
  if (s == Scalar::f32) return _mm512_loadu_ps(base + 4 * i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 2 * i));
  if (s == Scalar::f16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/// Up to 16 values (n of them; the rest 0) of type s as floats.
KVQ_TARGET_AVX512_ATTENTION inline __m512 load_n(Scalar s, const std::uint8_t* base, std::size_t i,
                                                 std::size_t n) noexcept {
  const __mmask16 m = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
  if (s == Scalar::f32) return _mm512_maskz_loadu_ps(m, base + 4 * i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, base + 2 * i);
  if (s == Scalar::f16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/// Unpacks 64 channels [64u, 64u + 64) of a packed row into bytes in channel order.
struct Unpacker {
  int bits = 8;
  std::size_t row_bytes = 0;
  __m512i index[2];  // vpermb source bytes per output qword, per u
  __m512i shifts;    // vpmultishiftqb bit offsets
  __m512i mask;

  KVQ_TARGET_AVX512_ATTENTION void init(int b, std::size_t rb) noexcept {
    bits = b;
    row_bytes = rb;
    alignas(64) std::uint8_t idx[2][64], sh[64];
    const unsigned per_qword = unsigned(b);  // source bytes per 8 codes
    for (unsigned u = 0; u < 2; ++u)
      for (unsigned q = 0; q < 8; ++q)
        for (unsigned j = 0; j < 8; ++j)
          idx[u][8 * q + j] = std::uint8_t((u * 8 + q) * per_qword + (j < per_qword ? j : 0));
    for (unsigned j = 0; j < 64; ++j) sh[j] = std::uint8_t((j % 8) * unsigned(b));
    index[0] = _mm512_load_si512(idx[0]);
    index[1] = _mm512_load_si512(idx[1]);
    shifts = _mm512_load_si512(sh);
    mask = _mm512_set1_epi8(char((1u << b) - 1u));
  }
  /// The packed row (at most 64 bytes are used when bits < 8).
  KVQ_TARGET_AVX512_ATTENTION __m512i load(const std::uint8_t* row) const noexcept {
    if (bits == 8) return _mm512_setzero_si512();
    const std::size_t n = row_bytes < 64 ? row_bytes : 64;
    return _mm512_maskz_loadu_epi8(n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1, row);
  }
  KVQ_TARGET_AVX512_ATTENTION __m512i codes(const std::uint8_t* row, __m512i packed, unsigned u) const noexcept {
    if (bits == 8) return _mm512_loadu_si512(row + 64 * u);
    const __m512i bytes = _mm512_permutexvar_epi8(index[u], packed);
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, bytes), mask);
  }
};

/// 16 vectors v[t] -> one vector whose lane t is the sum of v[t]'s lanes.
KVQ_TARGET_AVX512_ATTENTION inline __m512 reduce16(const float* v) noexcept {
  alignas(64) static constexpr int even[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static constexpr int odd[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i e = _mm512_load_si512(even), o = _mm512_load_si512(odd);
  __m512 x[16];
  for (int t = 0; t < 16; ++t) x[t] = _mm512_load_ps(v + 16 * t);
  for (int n = 16; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i)
      x[i] = _mm512_add_ps(_mm512_permutex2var_ps(x[2 * i], e, x[2 * i + 1]),
                           _mm512_permutex2var_ps(x[2 * i], o, x[2 * i + 1]));
  return x[0];
}

KVQ_TARGET_AVX512_ATTENTION inline __m512i reduce16_epi32(const float* v) noexcept {
  alignas(64) static constexpr int even[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static constexpr int odd[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i e = _mm512_load_si512(even), o = _mm512_load_si512(odd);
  __m512i x[16];
  for (int t = 0; t < 16; ++t) x[t] = _mm512_load_si512(v + 16 * t);
  for (int n = 16; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i)
      x[i] = _mm512_add_epi32(_mm512_permutex2var_epi32(x[2 * i], e, x[2 * i + 1]),
                              _mm512_permutex2var_epi32(x[2 * i], o, x[2 * i + 1]));
  return x[0];
}

}  // namespace detail
}  // namespace kvq::inline v0::kernels::attention::avx512

KVQ_INTRINSIC_WARNINGS_ON
