#pragma once
// AVX2 + FMA + F16C decode attention: the definitions of reference.hpp, 8 channels per vector,
// for any head_dim that is a multiple of 8. CPUs without the AVX-512 kernels run this one.
// Same tiles (tile_tokens / tile_end), key blocks and online softmax as the reference, so the
// result does not depend on the thread count and agrees across chunk sizes.
//
// Keys, per key block of a tile, 4 query heads at a time: two rows x 4 heads accumulate in 8
// registers (each row vector loaded once for the 4 heads, each query vector once for the two
// rows) and one transposing reduction gives their 8 scores. The rows come from:
//   post-RoPE keys quantized per channel: the codes themselves (2/4/8 bits unpack in registers
//     with one variable shift; other widths through unpack_codes) against the query with the
//     block's scales folded in: exact tier q~ = q * scale plus the bias q.zero, integer tier the
//     int8 q~ of reference.hpp;
//   post-RoPE residual rows (sinks, window, fp16/bf16/fp32 caches): read in place;
//   everything else (pre-RoPE keys, keys per token): rows dequantized into a small buffer and,
//     pre-RoPE, rotated there (vector.hpp's rope_row).
// Values, 16 channels x 4 heads of accumulators in registers over the rows of a tile:
//   residual rows in place, weighted by p;
//   rows quantized per token (2/4/8 bits, groups of a multiple of 8 channels, a power of two up
//     to 16 groups per row) are never dequantized: a weight per (row, group) carries the scale
//     (exact tier p * scale, integer tier the u8 weights of reference.hpp), the codes count from
//     mid, and the centre values zero + mid * scale add once per group and tile;
//   other packed rows: dequantized into the buffer.
// Rows are prefetched into L2 64 KB ahead in their stream.
// Integer tier: the reference's integer sums, computed exactly, so its numbers up to exp()
// rounding and rounding ties.
//   2/4-bit post-RoPE keys (int_dots): per 32 channels of a row, the packed bytes are broadcast
//     and each qword shifts its own field down (key_codes), which leaves the 32 codes as bytes in
//     a fixed order (4 bits: even channels, then odd; 2 bits: channels 0, 4, .., 28, then 1, 5,
//     ..); fold() writes the int8 query in that order (qkey). vpmaddubsw (codes unsigned, query
//     signed: pair sums of at most 2 x 15 x 127, no saturation) gives int16 pair sums that add
//     up in int16 over the row (4-bit rows up to 256 channels), one vpmaddwd with ones widens
//     them, and the transposing reduction of dots() gives the scores of two rows x 4 heads.
//   2/4-bit values per token in groups of a multiple of 32 channels (int_value_chunk): rows in
//     pairs; per 32 channels the two rows' packed bytes are interleaved (vpunpcklbw) so that each
//     channel's codes of the two rows form a byte pair (value_code_pairs: even channels in one
//     vector, odd in the other), and the pair's u8 weights of the channels' group, stored
//     group-major with row pairs adjacent (wb), are one 16-bit broadcast. vpmaddubsw (weights
//     unsigned up to 255, codes signed: at most 2 x 255 x 15) sums the pair in int16; K row pairs
//     add up in int16 before they are widened into int32 sums in channel order. Then
//     acc += beta * (sum w * code - mid * sum w) + sum p * (zero + mid * scale) per group.
//   8-bit codes (vpmaddubsw would saturate), other widths and value groups: the integer-valued
//     products run as fp32 FMAs, exact as every sum stays below 2^24 (key sums reduced in
//     int32). Integer values of other layouts take the reference's own routine; pre-RoPE keys
//     are scored as in the exact tier.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvq/isa.hpp"
#include "kvq/kernels/attention/task.hpp"
#include "kvq/kernels/attention/vector.hpp"
#include "kvq/kernels/ops/avx2.hpp"

#define KVQ_TARGET_AVX2_ATTENTION __attribute__((target("avx2,fma,f16c,bmi2")))

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::attention::avx2 {

/// This CPU runs this kernel.
inline bool supported() noexcept { return isa::detected() >= isa::Level::avx2; }

/// Shapes the kernel takes: head_dim a multiple of 8; any width, axis, residual type and RoPE.
inline bool supports(const StreamView& keys, const StreamView& values, std::size_t group,
                     const RopeTable* rope) noexcept {
  const std::size_t d = keys.head_dim;
  if (d == 0 || d % 8 != 0 || d > max_head_dim || values.head_dim != d || group == 0 || group > max_group) return false;
  if (has_level_table(keys) || has_level_table(values)) return false;  // its rows are zero + scale * code
  return rope == nullptr || rope->config().head_dim == d;
}

namespace detail {

using DecodeTask = attention::DecodeTask;
using Vector = x86_avx2::VectorKernel<ops::Avx2>;  // the steps written once: RoPE, online softmax

inline constexpr std::size_t buffer_floats = 4096;   // produced rows at once (16 KB)
inline constexpr std::size_t max_value_groups = 16;  // per-token value groups per row, packed value path

inline bool fast_bits(int bits) noexcept { return bits == 2 || bits == 4 || bits == 8; }

/// Codes unpacked in registers: 2, 4 or 8 bits, per channel or per token in groups of a multiple
/// of 8 channels (dequantize_row).
inline bool unpacked_codes(const StreamView& s) noexcept {
  return s.quantized && fast_bits(s.spec.bits) && (s.spec.axis == Axis::per_channel || s.spec.group % 8 == 0);
}

/// Value groups per row of the packed value path (both tiers), or 0 where it does not apply:
/// unpacked codes per token whose rows hold a power of two of at most 16 groups.
inline std::size_t packed_value_groups(const StreamView& v) noexcept {
  if (!unpacked_codes(v) || v.spec.axis != Axis::per_token) return 0;
  const std::size_t g = groups_per_row(v.spec, v.head_dim);
  return g <= max_value_groups && (g & (g - 1)) == 0 ? g : 0;
}

/// 8 values of type s at element index i as floats.
KVQ_TARGET_AVX2_ATTENTION inline __m256 load8(Scalar s, const std::uint8_t* base, std::size_t i) noexcept {
  if (s == Scalar::f32) return _mm256_loadu_ps(reinterpret_cast<const float*>(base) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 2 * i));
  if (s == Scalar::f16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/// v[0..7] -> lane j = sum of v[j]'s lanes.
KVQ_TARGET_AVX2_ATTENTION inline __m256 reduce8(const __m256* v) noexcept {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/// The same in int32 for integer-valued lanes (exact whatever the total).
KVQ_TARGET_AVX2_ATTENTION inline __m256 reduce8_exact(const __m256* v) noexcept {
  __m256i x[8];
  for (int j = 0; j < 8; ++j) x[j] = _mm256_cvtps_epi32(v[j]);
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(x[0], x[1]), _mm256_hadd_epi32(x[2], x[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(x[4], x[5]), _mm256_hadd_epi32(x[6], x[7]));
  return _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31)));
}

/// v[0..7] -> lane j = sum of v[j]'s int32 lanes.
KVQ_TARGET_AVX2_ATTENTION inline __m256i reduce8_epi32(const __m256i* x) noexcept {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(x[0], x[1]), _mm256_hadd_epi32(x[2], x[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(x[4], x[5]), _mm256_hadd_epi32(x[6], x[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

KVQ_TARGET_AVX2_ATTENTION inline std::int32_t hsum_epi32(__m256i v) noexcept {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}

// ---- integer tier: byte codes for vpmaddubsw ----------------------------------------------

/// Bytes of the packed codes of 32 channels (Bits = 2: 8 bytes, 4: 16 bytes); the last chunk
/// of a row may hold fewer (`bytes`), the rest reads as zero.
template <int Bits>
KVQ_TARGET_AVX2_ATTENTION inline __m128i chunk_bytes(const std::uint8_t* p, std::size_t bytes) noexcept {
  if (bytes == std::size_t(4 * Bits))
    return Bits == 4 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                     : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  alignas(16) std::uint8_t tmp[16] = {};
  std::memcpy(tmp, p, bytes);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
}

/// Position of channel c (of its 32-channel chunk) in key_codes' bytes.
template <int Bits>
constexpr std::size_t key_byte(std::size_t c) noexcept {
  return Bits == 4 ? (c % 2) * 16 + c / 2 : (c % 4) * 8 + c / 4;
}

/// The 32 codes of a chunk of a key row as bytes, channel c at key_byte<Bits>(c): the packed
/// bytes are broadcast and each qword shifts its own field down.
template <int Bits>
KVQ_TARGET_AVX2_ATTENTION inline __m256i key_codes(__m128i packed) noexcept {
  if constexpr (Bits == 4) {
    const __m256i x = _mm256_broadcastsi128_si256(packed);
    return _mm256_and_si256(_mm256_srlv_epi64(x, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
  } else {
    const __m256i x = _mm256_broadcastq_epi64(packed);
    return _mm256_and_si256(_mm256_srlv_epi64(x, _mm256_setr_epi64x(0, 2, 4, 6)), _mm256_set1_epi8(0x03));
  }
}

/// The codes of 32 channels of two value rows a and b as byte pairs (a, b) per channel, in two
/// vectors of 16 channels: even channels 2l (lanes l < 8) and 16 + 2l (lanes 8 + l) in c[0],
/// the odd channels after each in c[1].
template <int Bits>
KVQ_TARGET_AVX2_ATTENTION inline void value_code_pairs(__m128i a, __m128i b, __m256i* c) noexcept {
  if constexpr (Bits == 4) {
    // byte pair j of lo / hi: the 2 channels of byte j / 8 + j of both rows, low nibble first
    const __m256i x =
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, b)), _mm_unpackhi_epi8(a, b), 1);
    const __m256i m = _mm256_set1_epi8(0x0f);
    c[0] = _mm256_and_si256(x, m);
    c[1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
  } else {
    // byte pair j: the 4 channels 4j .. 4j + 3 of both rows; 16-bit lane l takes pair l / 2
    // (+ 4 in the upper half), even lanes fields 0 and 1, odd lanes fields 2 and 3
    const __m256i ab = _mm256_broadcastsi128_si256(_mm_unpacklo_epi8(a, b));
    const __m256i x = _mm256_shuffle_epi8(ab, _mm256_setr_epi8(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7, 8, 9, 8,
                                                               9, 10, 11, 10, 11, 12, 13, 12, 13, 14, 15, 14, 15));
    const __m256i m = _mm256_set1_epi8(0x03);
    c[0] = _mm256_and_si256(_mm256_blend_epi16(x, _mm256_srli_epi16(x, 4), 0xAA), m);
    c[1] = _mm256_and_si256(_mm256_blend_epi16(_mm256_srli_epi16(x, 2), _mm256_srli_epi16(x, 6), 0xAA), m);
  }
}

/// Lanes [0, n) of a vector (n < 8 masks the tail).
KVQ_TARGET_AVX2_ATTENTION inline __m256 first_lanes(std::size_t n) noexcept {
  return _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(float(n)), _CMP_LT_OQ);
}

// ---- row sources: vector i of row t of a run of rows ----------------------------------------

// Software prefetch of the rows into L2, this many bytes ahead in their stream: the value loops
// visit a row once per 16 channels, a strided pattern the hardware prefetcher follows poorly.
inline constexpr std::size_t prefetch_bytes = 64 * 1024;

KVQ_TARGET_AVX2_ATTENTION inline void prefetch_row(const std::uint8_t* row, std::size_t bytes) noexcept {
  for (std::size_t o = 0; o < bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + prefetch_bytes + o), _MM_HINT_T1);
}

/// Packed rows (contiguous), codes as floats.
template <int Bits>
struct CodeRows {
  const std::uint8_t* base;
  std::size_t row_bytes;
  KVQ_TARGET_AVX2_ATTENTION __m256 operator()(std::size_t t, std::size_t i) const noexcept {
    return ops::Avx2::codes<Bits>(base + t * row_bytes + std::size_t(Bits) * i);
  }
  KVQ_TARGET_AVX2_ATTENTION void prefetch(std::size_t t) const noexcept {
    const std::size_t at = t * row_bytes;  // rows under 64 bytes: once per cache line
    if (row_bytes >= 64 || at % 64 < row_bytes) prefetch_row(base + at, row_bytes < 64 ? 1 : row_bytes);
  }
};

/// Residual rows (sinks, window ring) of type S, one pointer per row.
template <Scalar S>
struct ResidualRows {
  const std::uint8_t* const* rows;
  std::size_t row_bytes;
  KVQ_TARGET_AVX2_ATTENTION __m256 operator()(std::size_t t, std::size_t i) const noexcept {
    return load8(S, rows[t], 8 * i);
  }
  KVQ_TARGET_AVX2_ATTENTION void prefetch(std::size_t t) const noexcept { prefetch_row(rows[t], row_bytes); }
};

/// Rows produced into the kernel's buffer.
struct BufferRows {
  const float* base;
  std::size_t stride;
  KVQ_TARGET_AVX2_ATTENTION __m256 operator()(std::size_t t, std::size_t i) const noexcept {
    return _mm256_load_ps(base + t * stride + 8 * i);
  }
  void prefetch(std::size_t) const noexcept {}
};

struct Kernel {
  const DecodeTask& task;
  const StreamView &k, &v;
  std::size_t dim, nv, sub;  // channels, vectors per row, rows per buffer

  // The reference's layout (its integer-values routine takes it), plus a row that vector reads
  // just past the last head may touch.
  alignas(32) float scores[max_group + 1][max_tile];
  alignas(32) float buffer[buffer_floats];
  const std::uint8_t* rowptr[max_tile];
  // keys: the block's parameters, folded queries of up to 4 heads, and per head (lanes h and
  // 4 + h) score = bias + alpha * (dot - offset)
  alignas(32) float kscale[max_head_dim], kzero[max_head_dim];
  alignas(32) float qt[register_heads][max_head_dim];
  alignas(32) float bias[8], alpha[8], offset[8];
  // values quantized per token: per (row, group) scale and centre value, weights per head; per
  // head and group acc += beta * sum w * (code - mid) + vconst
  alignas(32) float vscale[max_tile * max_value_groups + 8], vcentre[max_tile * max_value_groups + 8];
  alignas(32) float weight[register_heads][max_tile * max_value_groups + 8];
  float vbeta[register_heads], vconst[register_heads][max_value_groups];
  // integer tier, vpmaddubsw paths: int8 folded queries with the channels of each 32-channel
  // chunk at key_byte(); per-token value scales and centre values group-major, and per head the
  // u8 weights group-major (row pairs adjacent) with their sums per group
  alignas(32) std::int8_t qkey[register_heads][max_head_dim + 32];
  alignas(32) float sgm[max_value_groups][max_tile + 8], cgm[max_value_groups][max_tile + 8];
  alignas(32) std::uint8_t wb[register_heads][max_value_groups][max_tile + 8];
  float vwsum[register_heads][max_value_groups];

  KVQ_TARGET_AVX2_ATTENTION explicit Kernel(const DecodeTask& t) noexcept
      : task(t),
        k(t.keys),
        v(t.values),
        dim(t.keys.head_dim),
        nv(t.keys.head_dim / 8),
        sub(std::min<std::size_t>(16, buffer_floats / t.keys.head_dim)) {}

  /// First position after p where the kind of row (residual or packed) may change.
  static std::size_t kind_end(const StreamView& s, std::size_t p) noexcept {
    return p < s.first_quantized ? s.first_quantized : p < s.end_quantized ? s.end_quantized : ~std::size_t(0);
  }

  // ---- producing rows ----------------------------------------------------------------------

  template <int Bits>
  KVQ_TARGET_AVX2_ATTENTION void dequantize_row(const StreamView& s, std::size_t p, float* out) const noexcept {
    const std::uint8_t* row = s.code_row(p);
    const std::size_t pi = s.param_index(p);
    const float mid = reference::mid_code(s.spec);
    for (std::size_t i = 0; i < nv; ++i) {
      __m256 scale, zero;
      if (s.spec.axis == Axis::per_channel) {
        scale = load8(s.spec.param, s.scales, pi + 8 * i);
        zero =
            s.zeros != nullptr ? load8(s.spec.param, s.zeros, pi + 8 * i) : _mm256_mul_ps(scale, _mm256_set1_ps(-mid));
      } else {
        const std::size_t g = pi + 8 * i / s.spec.group;
        const float sc = kvq::detail::load_scalar_f16c(s.spec.param, s.scales, g);
        scale = _mm256_set1_ps(sc);
        zero = _mm256_set1_ps(s.zeros != nullptr ? kvq::detail::load_scalar_f16c(s.spec.param, s.zeros, g) : -mid * sc);
      }
      _mm256_store_ps(out + 8 * i, _mm256_fmadd_ps(ops::Avx2::codes<Bits>(row + std::size_t(Bits) * i), scale, zero));
    }
  }

  /// Row p of stream s as floats (dequantized when packed): out (dim).
  KVQ_TARGET_AVX2_ATTENTION void produce_row(const StreamView& s, std::size_t p, float* out) const noexcept {
    if (s.residual_at(p)) {
      const std::uint8_t* row = s.residual_row(p);
      for (std::size_t i = 0; i < nv; ++i) _mm256_store_ps(out + 8 * i, load8(s.residual, row, 8 * i));
      return;
    }
    if (unpacked_codes(s)) {
      switch (s.spec.bits) {
        case 2:
          return dequantize_row<2>(s, p, out);
        case 4:
          return dequantize_row<4>(s, p, out);
        default:
          return dequantize_row<8>(s, p, out);
      }
    }
    s.read_row(p, out);
  }

  // ---- keys --------------------------------------------------------------------------------

  /// Scores of rows [0, n) of src for heads [h0, h0 + NH) into scores[h][off ..]: two rows at a
  /// time against the queries q (stride qs), score = bias + alpha * (dot - offset).
  template <int NH, bool IntegerSums, class Src>
  KVQ_TARGET_AVX2_ATTENTION void dots(const Src& src, std::size_t n, const float* q, std::size_t qs, std::size_t h0,
                                      std::size_t off) noexcept {
    const __m256 b8 = _mm256_load_ps(bias), a8 = _mm256_load_ps(alpha), o8 = _mm256_load_ps(offset);
    for (std::size_t t = 0; t < n; t += 2) {
      const std::size_t t1 = t + 1 < n ? t + 1 : t;
      if (h0 == 0) {
        src.prefetch(t);
        src.prefetch(t1);
      }
      __m256 acc[8];  // row t: heads 0..3, row t + 1: heads 0..3
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (std::size_t i = 0; i < nv; ++i) {
        const __m256 x0 = src(t, i), x1 = src(t1, i);
#pragma GCC unroll 4
        for (int h = 0; h < NH; ++h) {
          const __m256 qv = _mm256_loadu_ps(q + std::size_t(h) * qs + 8 * i);
          acc[h] = _mm256_fmadd_ps(x0, qv, acc[h]);
          acc[4 + h] = _mm256_fmadd_ps(x1, qv, acc[4 + h]);
        }
      }
      const __m256 d = IntegerSums ? reduce8_exact(acc) : reduce8(acc);
      alignas(32) float out[8];
      _mm256_store_ps(out, _mm256_add_ps(b8, _mm256_mul_ps(a8, _mm256_sub_ps(d, o8))));
      for (std::size_t h = 0; h < std::size_t(NH); ++h) {
        scores[h0 + h][off + t] = out[h];
        if (t + 1 < n) scores[h0 + h][off + t + 1] = out[4 + h];
      }
    }
  }

  template <bool IntegerSums, class Src>
  KVQ_TARGET_AVX2_ATTENTION void dots_heads(const Src& src, std::size_t n, const float* q, std::size_t qs,
                                            std::size_t h0, std::size_t nh, std::size_t off) noexcept {
    with_heads(nh, [&]<int NH>() { dots<NH, IntegerSums>(src, n, q, qs, h0, off); });
  }

  /// Integer tier, post-RoPE keys of 2 or 4 bits per channel: the key bits take vpmaddubsw.
  bool int_keys() const noexcept {
    // the int16 sums of a row: 4 bits up to 8 chunks of 32 channels (8 x 2 x 15 x 127 < 2^15),
    // 2 bits up to 43, more than max_head_dim
    return task.tier == Tier::integer && (k.spec.bits == 2 || (k.spec.bits == 4 && dim <= 256));
  }

  /// dots() for the integer tier on packed 2/4-bit rows: per 32 channels, the code bytes of
  /// two rows (key_codes) against the int8 queries qkey (vpmaddubsw: u8 x s8 -> pair sums in
  /// int16; 2 x 15 x 127 at most), summed in int16 over the row and widened once (vpmaddwd
  /// with ones) before the transposing reduction.
  template <int Bits, int NH>
  KVQ_TARGET_AVX2_ATTENTION void int_dots(const std::uint8_t* base, std::size_t row_bytes, std::size_t n,
                                          std::size_t h0, std::size_t off) noexcept {
    const __m256 b8 = _mm256_load_ps(bias), a8 = _mm256_load_ps(alpha), o8 = _mm256_load_ps(offset);
    const __m256i ones = _mm256_set1_epi16(1);
    const CodeRows<Bits> src{base, row_bytes};
    const std::size_t chunks = (dim + 31) / 32, last = (dim - 32 * (chunks - 1)) * Bits / 8;
    for (std::size_t t = 0; t < n; t += 2) {
      const std::size_t t1 = t + 1 < n ? t + 1 : t;
      if (h0 == 0) {
        src.prefetch(t);
        src.prefetch(t1);
      }
      const std::uint8_t *r0 = base + t * row_bytes, *r1 = base + t1 * row_bytes;
      __m256i acc[8];  // row t: heads 0..3, row t + 1: heads 0..3
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_si256();
      for (std::size_t j = 0; j < chunks; ++j) {
        const std::size_t bytes = j + 1 < chunks ? std::size_t(4 * Bits) : last;
        const __m256i x0 = key_codes<Bits>(chunk_bytes<Bits>(r0 + 4 * Bits * j, bytes));
        const __m256i x1 = key_codes<Bits>(chunk_bytes<Bits>(r1 + 4 * Bits * j, bytes));
#pragma GCC unroll 4
        for (int h = 0; h < NH; ++h) {
          const __m256i qv = _mm256_load_si256(reinterpret_cast<const __m256i*>(qkey[h] + 32 * j));
          acc[h] = _mm256_add_epi16(acc[h], _mm256_maddubs_epi16(x0, qv));
          acc[4 + h] = _mm256_add_epi16(acc[4 + h], _mm256_maddubs_epi16(x1, qv));
        }
      }
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_madd_epi16(acc[j], ones);
      const __m256 d = _mm256_cvtepi32_ps(reduce8_epi32(acc));
      alignas(32) float out[8];
      _mm256_store_ps(out, _mm256_add_ps(b8, _mm256_mul_ps(a8, _mm256_sub_ps(d, o8))));
      for (std::size_t h = 0; h < std::size_t(NH); ++h) {
        scores[h0 + h][off + t] = out[h];
        if (t + 1 < n) scores[h0 + h][off + t + 1] = out[4 + h];
      }
    }
  }

  template <int Bits>
  KVQ_TARGET_AVX2_ATTENTION void int_dots_heads(const std::uint8_t* base, std::size_t n, std::size_t h0, std::size_t nh,
                                                std::size_t off) noexcept {
    with_heads(nh, [&]<int NH>() { int_dots<Bits, NH>(base, k.row_bytes, n, h0, off); });
  }

  /// Key block holding p: scales and zero points per channel as floats.
  KVQ_TARGET_AVX2_ATTENTION void load_key_block(std::size_t p) noexcept {
    const std::size_t pi = k.param_index(p);
    const float mid = reference::mid_code(k.spec);
    for (std::size_t i = 0; i < nv; ++i) {
      const __m256 s = load8(k.spec.param, k.scales, pi + 8 * i);
      _mm256_store_ps(kscale + 8 * i, s);
      _mm256_store_ps(kzero + 8 * i, k.zeros != nullptr ? load8(k.spec.param, k.zeros, pi + 8 * i)
                                                        : _mm256_mul_ps(s, _mm256_set1_ps(-mid)));
    }
  }

  /// The int8 query of head h (qt, rounded) as bytes in qkey, 32 channels per chunk in the order
  /// of key_codes (key_byte), zero past dim.
  KVQ_TARGET_AVX2_ATTENTION void key_query_bytes(std::size_t h) noexcept {
    // in-lane byte order: 4 bits even channels then odd ones, 2 bits channels 0, 4, 8, 12, 1, 5, ...
    const __m256i order = k.spec.bits == 4 ? _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0,
                                                              2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)
                                           : _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0,
                                                              4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i interleave = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (std::size_t c0 = 0; c0 < dim; c0 += 32) {
      __m256i x[4];
      for (std::size_t u = 0; u < 4; ++u)
        x[u] = c0 + 8 * u < dim ? _mm256_cvtps_epi32(_mm256_load_ps(qt[h] + c0 + 8 * u)) : _mm256_setzero_si256();
      // saturating packs leave dwords of channels 0-3, 8-11, 16-19, 24-27, 4-7, ...: back in order
      const __m256i b = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(x[0], x[1]), _mm256_packs_epi32(x[2], x[3])), interleave);
      const __m256i s = _mm256_shuffle_epi8(b, order);
      // 4 bits: qwords (evens 0-14, odds 1-15, evens 16-30, odds 17-31) -> evens, odds;
      // 2 bits: dwords (c % 4 = 0, 1, 2, 3 of channels 0-15, then of 16-31) -> by c % 4
      const __m256i out =
          k.spec.bits == 4 ? _mm256_permute4x64_epi64(s, 0xD8) : _mm256_permutevar8x32_epi32(s, interleave);
      _mm256_store_si256(reinterpret_cast<__m256i*>(qkey[h] + c0), out);
    }
  }

  /// Folds the block's scales into the queries of heads [h0, h0 + nh): qt, bias, alpha, offset.
  KVQ_TARGET_AVX2_ATTENTION void fold(std::size_t h0, std::size_t nh, bool integer) noexcept {
    const float mid = reference::mid_code(k.spec);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (std::size_t j = 0; j < 8; ++j) {  // heads beyond nh: zero dots, unused scores
      bias[j] = offset[j] = 0.0f;
      alpha[j] = 1.0f;
    }
    for (std::size_t h = 0; h < nh; ++h) {
      const float* q = task.queries + (h0 + h) * dim;
      __m256 b = _mm256_setzero_ps(), amax = _mm256_setzero_ps();
      for (std::size_t i = 0; i < nv; ++i) {
        const __m256 qv = _mm256_loadu_ps(q + 8 * i), s = _mm256_load_ps(kscale + 8 * i),
                     z = _mm256_load_ps(kzero + 8 * i);
        const __m256 t = _mm256_mul_ps(qv, s);
        _mm256_store_ps(qt[h] + 8 * i, t);
        // integer: codes count from mid (reference.hpp), so the bias is q.(zero + mid * scale)
        b = _mm256_fmadd_ps(qv, integer ? _mm256_fmadd_ps(s, _mm256_set1_ps(mid), z) : z, b);
        amax = _mm256_max_ps(amax, _mm256_and_ps(t, abs_mask));
      }
      bias[h] = bias[4 + h] = ops::Avx2::sum(b);
      if (!integer) continue;
      const float m = ops::Avx2::largest(amax);
      // A tiny maximum would give an infinite inverse (and an undefined int conversion).
      const __m256 inv = _mm256_set1_ps(inverse_step(127.0f, m));
      __m256 qsum = _mm256_setzero_ps();
      for (std::size_t i = 0; i < nv; ++i) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_load_ps(qt[h] + 8 * i), inv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_store_ps(qt[h] + 8 * i, r);
        qsum = _mm256_add_ps(qsum, r);
      }
      alpha[h] = alpha[4 + h] = m / 127.0f;
      offset[h] = offset[4 + h] = mid * ops::Avx2::sum(qsum);
      if (int_keys()) key_query_bytes(h);
    }
  }

  /// Rows [s0, s1), one quantized per-channel block, post-RoPE: codes against folded queries.
  KVQ_TARGET_AVX2_ATTENTION void folded_scores(std::size_t s0, std::size_t s1, std::size_t tile) noexcept {
    const bool integer = task.tier == Tier::integer;
    load_key_block(s0);
    for (std::size_t h0 = 0; h0 < task.group; h0 += register_heads) {
      const std::size_t nh = std::min(register_heads, task.group - h0);
      fold(h0, nh, integer);
      for (std::size_t p = s0; p < s1;) {
        const std::size_t n = std::min(s1 - p, fast_bits(k.spec.bits) ? max_tile : sub);
        const float* q = qt[0];
        if (integer && int_keys()) {
          k.spec.bits == 4 ? int_dots_heads<4>(k.code_row(p), n, h0, nh, p - tile)
                           : int_dots_heads<2>(k.code_row(p), n, h0, nh, p - tile);
          p += n;
          continue;
        }
        switch (fast_bits(k.spec.bits) ? k.spec.bits : 0) {
          case 2:
            integer ? dots_heads<true>(CodeRows<2>{k.code_row(p), k.row_bytes}, n, q, max_head_dim, h0, nh, p - tile)
                    : dots_heads<false>(CodeRows<2>{k.code_row(p), k.row_bytes}, n, q, max_head_dim, h0, nh, p - tile);
            break;
          case 4:
            integer ? dots_heads<true>(CodeRows<4>{k.code_row(p), k.row_bytes}, n, q, max_head_dim, h0, nh, p - tile)
                    : dots_heads<false>(CodeRows<4>{k.code_row(p), k.row_bytes}, n, q, max_head_dim, h0, nh, p - tile);
            break;
          case 8:
            integer ? dots_heads<true>(CodeRows<8>{k.code_row(p), k.row_bytes}, n, q, max_head_dim, h0, nh, p - tile)
                    : dots_heads<false>(CodeRows<8>{k.code_row(p), k.row_bytes}, n, q, max_head_dim, h0, nh, p - tile);
            break;
          default: {  // other widths: codes unpacked into the buffer
            alignas(32) std::uint8_t codes[max_head_dim];
            for (std::size_t r = 0; r < n; ++r) {
              unpack_codes(k.code_row(p + r), dim, k.spec.bits, codes);
              for (std::size_t i = 0; i < nv; ++i)
                _mm256_store_ps(buffer + r * dim + 8 * i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                                              reinterpret_cast<const __m128i*>(codes + 8 * i)))));
            }
            const BufferRows src{buffer, dim};
            integer ? dots_heads<true>(src, n, q, max_head_dim, h0, nh, p - tile)
                    : dots_heads<false>(src, n, q, max_head_dim, h0, nh, p - tile);
          }
        }
        p += n;
      }
    }
  }

  /// Rows [s0, s1) of any kind against the task's queries; pre-RoPE rows rotated.
  KVQ_TARGET_AVX2_ATTENTION void row_scores(std::size_t s0, std::size_t s1, std::size_t tile) noexcept {
    for (std::size_t j = 0; j < 8; ++j) {
      bias[j] = offset[j] = 0.0f;
      alpha[j] = 1.0f;
    }
    const bool pre = task.rope != nullptr;
    for (std::size_t p = s0; p < s1;) {
      const std::size_t e = std::min({s1, p + sub, kind_end(k, p)}), n = e - p;
      if (!pre && k.residual_at(p)) {
        for (std::size_t r = 0; r < n; ++r) rowptr[r] = k.residual_row(p + r);
        switch (k.residual) {
          case Scalar::f16:
            all_heads(ResidualRows<Scalar::f16>{rowptr, k.residual_row_bytes()}, n, p - tile);
            break;
          case Scalar::bf16:
            all_heads(ResidualRows<Scalar::bf16>{rowptr, k.residual_row_bytes()}, n, p - tile);
            break;
          default:
            all_heads(ResidualRows<Scalar::f32>{rowptr, k.residual_row_bytes()}, n, p - tile);
            break;
        }
      } else {
        for (std::size_t r = 0; r < n; ++r) {
          produce_row(k, p + r, buffer + r * dim);
          if (pre) Vector::rope_row(*task.rope, p + r, buffer + r * dim);
        }
        all_heads(BufferRows{buffer, dim}, n, p - tile);
      }
      p = e;
    }
  }

  template <class Src>
  KVQ_TARGET_AVX2_ATTENTION void all_heads(const Src& src, std::size_t n, std::size_t off) noexcept {
    for (std::size_t h0 = 0; h0 < task.group; h0 += register_heads)
      dots_heads<false>(src, n, task.queries + h0 * dim, dim, h0, std::min(register_heads, task.group - h0), off);
  }

  /// Scores of tile [a, b) into scores[h][0 .. b - a), key block by key block as the reference.
  KVQ_TARGET_AVX2_ATTENTION void key_scores(std::size_t a, std::size_t b) noexcept {
    for (std::size_t s0 = a; s0 < b;) {
      const std::size_t s1 = key_block_end(k, s0, b);
      if (task.rope == nullptr && quantized_key_block(k, s0, s1))
        folded_scores(s0, s1, a);
      else
        row_scores(s0, s1, a);
      s0 = s1;
    }
  }

  // ---- values ------------------------------------------------------------------------------

  /// acc += p * row over rows [0, n) of src (weights scores[h][off + t]) for heads [h0, h0 + NH),
  /// W vectors (8 channels each) from vector i.
  template <int NH, int W, class Src>
  KVQ_TARGET_AVX2_ATTENTION void weighted_rows(const Src& src, std::size_t n, std::size_t h0, std::size_t off,
                                               std::size_t i) noexcept {
    __m256 acc[NH][W];
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < W; ++u)
        acc[h][u] = _mm256_loadu_ps(task.acc + (h0 + std::size_t(h)) * dim + 8 * (i + std::size_t(u)));
    for (std::size_t t = 0; t < n; ++t) {
      if (i == 0 && h0 == 0) src.prefetch(t);
      __m256 x[W];
#pragma GCC unroll 2
      for (int u = 0; u < W; ++u) x[u] = src(t, i + std::size_t(u));
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) {
        const __m256 w = _mm256_broadcast_ss(&scores[h0 + std::size_t(h)][off + t]);
#pragma GCC unroll 2
        for (int u = 0; u < W; ++u) acc[h][u] = _mm256_fmadd_ps(x[u], w, acc[h][u]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < W; ++u)
        _mm256_storeu_ps(task.acc + (h0 + std::size_t(h)) * dim + 8 * (i + std::size_t(u)), acc[h][u]);
  }

  template <int NH, class Src>
  KVQ_TARGET_AVX2_ATTENTION void weighted_rows_all(const Src& src, std::size_t n, std::size_t h0,
                                                   std::size_t off) noexcept {
    std::size_t i = 0;
    for (; i + 2 <= nv; i += 2) weighted_rows<NH, 2>(src, n, h0, off, i);
    if (i < nv) weighted_rows<NH, 1>(src, n, h0, off, i);
  }

  template <class Src>
  KVQ_TARGET_AVX2_ATTENTION void value_rows(const Src& src, std::size_t n, std::size_t off) noexcept {
    for (std::size_t h0 = 0; h0 < task.group; h0 += register_heads) {
      with_heads(task.group - h0, [&]<int NH>() { weighted_rows_all<NH>(src, n, h0, off); });
    }
  }

  /// Residual value rows [x, y) of the tile starting at `tile`.
  KVQ_TARGET_AVX2_ATTENTION void residual_values(std::size_t tile, std::size_t x, std::size_t y) noexcept {
    if (x >= y) return;
    for (std::size_t p = x; p < y; ++p) rowptr[p - x] = v.residual_row(p);
    switch (v.residual) {
      case Scalar::f16:
        return value_rows(ResidualRows<Scalar::f16>{rowptr, v.residual_row_bytes()}, y - x, x - tile);
      case Scalar::bf16:
        return value_rows(ResidualRows<Scalar::bf16>{rowptr, v.residual_row_bytes()}, y - x, x - tile);
      default:
        return value_rows(ResidualRows<Scalar::f32>{rowptr, v.residual_row_bytes()}, y - x, x - tile);
    }
  }

  /// Packed value rows [x, y) dequantized into the buffer.
  KVQ_TARGET_AVX2_ATTENTION void buffered_values(std::size_t tile, std::size_t x, std::size_t y) noexcept {
    for (std::size_t p = x; p < y;) {
      const std::size_t n = std::min(y - p, sub);
      for (std::size_t r = 0; r < n; ++r) produce_row(v, p + r, buffer + r * dim);
      value_rows(BufferRows{buffer, dim}, n, p - tile);
      p += n;
    }
  }

  /// Groups per row the packed value path takes: a power of two up to max_value_groups.

  /// Weights per (row, group) of heads [h0, h0 + nh) for the packed rows [x, x + n) of the tile
  /// at `tile` (G groups per row; vscale/vcentre filled), with their per-group terms.
  KVQ_TARGET_AVX2_ATTENTION void value_weights(std::size_t tile, std::size_t x, std::size_t n, std::size_t G,
                                               std::size_t h0, std::size_t nh, float smax) noexcept {
    const bool integer = task.tier == Tier::integer;
    const float levels = weight_levels(v.spec.bits);
    const std::size_t np = n * G;
    // Lane l of the vector at flat index f = t * G + g: row (f + l) / G; group (f + l) % G, which
    // is l % G for G < 8 and 8 * ((f / 8) % (G / 8)) + l for G >= 8.
    const std::size_t phases = G >= 8 ? G / 8 : 1;
    alignas(32) static constexpr std::int32_t spread[4][8] = {
        {0, 1, 2, 3, 4, 5, 6, 7}, {0, 0, 1, 1, 2, 2, 3, 3}, {0, 0, 0, 0, 1, 1, 1, 1}, {0, 0, 0, 0, 0, 0, 0, 0}};
    const __m256i idx = _mm256_load_si256(reinterpret_cast<const __m256i*>(spread[G == 1   ? 0
                                                                                  : G == 2 ? 1
                                                                                  : G == 4 ? 2
                                                                                           : 3]));
    for (std::size_t h = 0; h < nh; ++h) {
      const float* p = scores[h0 + h] + (x - tile);
      float* w = weight[h];
      __m256 wmax = _mm256_setzero_ps(), pmax = _mm256_setzero_ps(),
             zacc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (std::size_t f = 0; f < np; f += 8) {
        const __m256 pv = _mm256_and_ps(
            G >= 8 ? _mm256_broadcast_ss(p + f / G) : _mm256_permutevar8x32_ps(_mm256_loadu_ps(p + f / G), idx),
            first_lanes(np - f));
        const __m256 wv = _mm256_mul_ps(pv, _mm256_load_ps(vscale + f));
        _mm256_store_ps(w + f, wv);
        wmax = _mm256_max_ps(wmax, wv);
        pmax = _mm256_max_ps(pmax, pv);
        zacc[(f / 8) % phases] = _mm256_fmadd_ps(pv, _mm256_load_ps(vcentre + f), zacc[(f / 8) % phases]);
      }
      float beta = 1.0f;
      if (integer) {
        // The step: codes of up to 7 bits bound the weights by (largest weight) x (largest scale)
        // of the rows, 8-bit codes (127 levels) use the exact maximum (reference.hpp).
        const float bound = v.spec.bits <= 7 ? ops::Avx2::largest(pmax) * smax : ops::Avx2::largest(wmax);
        // Tiles far below the running maximum weigh about exp(-87) (ops::Avx2::exp; 0 or subnormal
        // in a tile's scalar tail), a bound whose plain inverse overflows: infinite weights would
        // turn the accumulators into inf and NaN (inverse_step gives 0 instead).
        const __m256 inv = _mm256_set1_ps(inverse_step(levels, bound));
        beta = bound / levels;
        for (std::size_t f = 0; f < np; f += 8)
          _mm256_store_ps(w + f, _mm256_round_ps(_mm256_mul_ps(_mm256_load_ps(w + f), inv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
      alignas(32) float zs[2][8];
      for (std::size_t j = 0; j < 2; ++j) _mm256_store_ps(zs[j], zacc[j]);
      vbeta[h] = beta;
      for (std::size_t g = 0; g < G; ++g) vconst[h][g] = 0.0f;
      for (std::size_t j = 0; j < phases; ++j)
        for (std::size_t l = 0; l < 8; ++l) vconst[h][G >= 8 ? 8 * j + l : l % G] += zs[j][l];
    }
  }

  /// acc += beta * sum_t w[t, g] * (code - mid) + vconst[g] over packed rows [x, x + n) for heads
  /// [h0, h0 + NH), W vectors from vector i. Centred codes keep the two terms small (no
  /// cancellation between sum w * code and the zero points); integer weights times half-integers
  /// stay exact in fp32.
  template <int Bits, int NH, int W, bool OneGroup>
  KVQ_TARGET_AVX2_ATTENTION void packed_rows(std::size_t x, std::size_t n, std::size_t G, std::size_t h0,
                                             std::size_t i) noexcept {
    std::size_t g[W];
    for (int u = 0; u < W; ++u) g[u] = 8 * (i + std::size_t(u)) / v.spec.group;
    __m256 acc[NH][W];
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < W; ++u) acc[h][u] = _mm256_setzero_ps();
    const CodeRows<Bits> src{v.code_row(x), v.row_bytes};
    const __m256 mid = _mm256_set1_ps(reference::mid_code(v.spec));
    for (std::size_t t = 0; t < n; ++t) {
      if (i == 0 && h0 == 0) src.prefetch(t);
      __m256 c[W];
#pragma GCC unroll 2
      for (int u = 0; u < W; ++u) c[u] = _mm256_sub_ps(src(t, i + std::size_t(u)), mid);
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) {
        const __m256 w0 = _mm256_broadcast_ss(&weight[h][t * G + g[0]]);
#pragma GCC unroll 2
        for (int u = 0; u < W; ++u)
          acc[h][u] =
              _mm256_fmadd_ps(c[u], OneGroup || u == 0 ? w0 : _mm256_broadcast_ss(&weight[h][t * G + g[u]]), acc[h][u]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < W; ++u) {
        float* o = task.acc + (h0 + std::size_t(h)) * dim + 8 * (i + std::size_t(u));
        const __m256 tile = _mm256_fmadd_ps(_mm256_set1_ps(vbeta[h]), acc[h][u], _mm256_set1_ps(vconst[h][g[u]]));
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), tile));
      }
  }

  template <int Bits, int NH>
  KVQ_TARGET_AVX2_ATTENTION void packed_rows_all(std::size_t x, std::size_t n, std::size_t G, std::size_t h0) noexcept {
    std::size_t i = 0;
    if (v.spec.group % 16 == 0)  // both vectors of a pair in one group: one weight per head
      for (; i + 2 <= nv; i += 2) packed_rows<Bits, NH, 2, true>(x, n, G, h0, i);
    for (; i + 2 <= nv; i += 2) packed_rows<Bits, NH, 2, false>(x, n, G, h0, i);
    if (i < nv) packed_rows<Bits, NH, 1, true>(x, n, G, h0, i);
  }

  template <int Bits>
  KVQ_TARGET_AVX2_ATTENTION void packed_rows_heads(std::size_t x, std::size_t n, std::size_t G, std::size_t h0,
                                                   std::size_t nh) noexcept {
    with_heads(nh, [&]<int NH>() { packed_rows_all<Bits, NH>(x, n, G, h0); });
  }

  /// Integer tier, 2/4-bit values in groups of a multiple of 32 channels: the vpmaddubsw path.
  bool int_values() const noexcept {
    return task.tier == Tier::integer && (v.spec.bits == 2 || v.spec.bits == 4) && v.spec.group % 32 == 0;
  }

  /// value_weights() for int_values(): the u8 weights of heads [h0, h0 + nh) group-major in wb
  /// (zero past row n, up to a multiple of 8), their sums per group in vwsum, and vbeta, vconst.
  /// Same numbers as value_weights (codes of up to 7 bits).
  KVQ_TARGET_AVX2_ATTENTION void int_value_weights(std::size_t tile, std::size_t x, std::size_t n, std::size_t G,
                                                   std::size_t h0, std::size_t nh, float smax) noexcept {
    const float levels = weight_levels(v.spec.bits);
    for (std::size_t h = 0; h < nh; ++h) {
      const float* p = scores[h0 + h] + (x - tile);
      __m256 pmax = _mm256_setzero_ps();
      for (std::size_t t = 0; t < n; t += 8)
        pmax = _mm256_max_ps(pmax, _mm256_and_ps(_mm256_loadu_ps(p + t), first_lanes(n - t)));
      const float bound = ops::Avx2::largest(pmax) * smax;
      const __m256 inv = _mm256_set1_ps(inverse_step(levels, bound));
      vbeta[h] = bound / levels;
      for (std::size_t g = 0; g < G; ++g) {
        __m256i ws = _mm256_setzero_si256();
        __m256 z = _mm256_setzero_ps();
        for (std::size_t t = 0; t < n; t += 8) {
          const __m256 pv = _mm256_and_ps(_mm256_loadu_ps(p + t), first_lanes(n - t));
          const __m256 w = _mm256_round_ps(_mm256_mul_ps(_mm256_mul_ps(pv, _mm256_load_ps(sgm[g] + t)), inv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          const __m256i wi = _mm256_cvtps_epi32(w);
          ws = _mm256_add_epi32(ws, wi);
          z = _mm256_fmadd_ps(pv, _mm256_load_ps(cgm[g] + t), z);
          const __m256i b =
              _mm256_packus_epi16(_mm256_packus_epi32(wi, wi), _mm256_setzero_si256());  // per half: 4 bytes
          const __m128i b8 = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(wb[h][g] + t), b8);
        }
        vwsum[h][g] = float(hsum_epi32(ws));
        vconst[h][g] = ops::Avx2::sum(z);
      }
    }
  }

  /// Channels [c0, c0 + 32) (fewer at the end of a row) of the packed value rows [x, x + n) for
  /// heads [h0, h0 + NH): rows in pairs, each channel's codes of the two rows as a byte pair
  /// (value_code_pairs) against the pair's u8 weights (one 16-bit broadcast per head: the 32
  /// channels share a group), vpmaddubsw summing the two products in int16 (2 x 255 x 15 at most),
  /// K row pairs summed in int16 and then added to int32 sums in channel order. Then
  /// acc += beta * (sum w * code - mid * sum w) + vconst, the sums exact.
  template <int Bits, int NH>
  KVQ_TARGET_AVX2_ATTENTION void int_value_chunk(std::size_t x, std::size_t n, std::size_t h0,
                                                 std::size_t c0) noexcept {
    constexpr std::size_t K = 32767 / (2 * 255 * ((1 << Bits) - 1));  // row pairs summed in int16
    const std::size_t g = c0 / v.spec.group, valid = std::min<std::size_t>(32, dim - c0), bytes = valid * Bits / 8;
    const std::uint8_t* base = v.code_row(x) + c0 * Bits / 8;
    const CodeRows<Bits> src{v.code_row(x), v.row_bytes};
    alignas(32) std::int32_t dot[NH][32] = {};
    for (std::size_t t0 = 0; t0 < n; t0 += 2 * K) {
      __m256i a[NH][2];
      for (int h = 0; h < NH; ++h) a[h][0] = a[h][1] = _mm256_setzero_si256();
      for (std::size_t t = t0; t < std::min(n, t0 + 2 * K); t += 2) {
        const std::size_t t1 = t + 1 < n ? t + 1 : t;  // an odd last row pairs with itself, weight 0
        if (c0 == 0 && h0 == 0) {
          src.prefetch(t);
          src.prefetch(t1);
        }
        __m256i c[2];
        value_code_pairs<Bits>(chunk_bytes<Bits>(base + t * v.row_bytes, bytes),
                               chunk_bytes<Bits>(base + t1 * v.row_bytes, bytes), c);
#pragma GCC unroll 4
        for (int h = 0; h < NH; ++h) {
          std::uint16_t pair;
          std::memcpy(&pair, wb[h][g] + t, 2);
          const __m256i w = _mm256_set1_epi16(std::int16_t(pair));
          a[h][0] = _mm256_add_epi16(a[h][0], _mm256_maddubs_epi16(w, c[0]));
          a[h][1] = _mm256_add_epi16(a[h][1], _mm256_maddubs_epi16(w, c[1]));
        }
      }
      for (int h = 0; h < NH; ++h) {
        // even and odd channels interleaved: 16-bit lanes of channels 0..7 | 16..23 and 8..15 | 24..31
        const __m256i u = _mm256_unpacklo_epi16(a[h][0], a[h][1]), w = _mm256_unpackhi_epi16(a[h][0], a[h][1]);
        const __m128i part[4] = {_mm256_castsi256_si128(u), _mm256_castsi256_si128(w), _mm256_extracti128_si256(u, 1),
                                 _mm256_extracti128_si256(w, 1)};
        for (int j = 0; j < 4; ++j) {
          __m256i* d = reinterpret_cast<__m256i*>(dot[h] + 8 * j);
          _mm256_store_si256(d, _mm256_add_epi32(_mm256_load_si256(d), _mm256_cvtepi16_epi32(part[j])));
        }
      }
    }
    const float mid = reference::mid_code(v.spec);
    for (int h = 0; h < NH; ++h) {
      const __m256 beta = _mm256_set1_ps(vbeta[h]), cst = _mm256_set1_ps(vconst[h][g]),
                   msum = _mm256_set1_ps(mid * vwsum[h][g]);
      float* o = task.acc + (h0 + std::size_t(h)) * dim + c0;
      for (std::size_t j = 0; j < valid; j += 8) {
        const __m256 d =
            _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dot[h] + j))), msum);
        _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_fmadd_ps(beta, d, cst)));
      }
    }
  }

  template <int Bits>
  KVQ_TARGET_AVX2_ATTENTION void int_value_rows(std::size_t x, std::size_t n, std::size_t h0, std::size_t nh) noexcept {
    for (std::size_t c0 = 0; c0 < dim; c0 += 32)
      with_heads(nh, [&]<int NH>() { int_value_chunk<Bits, NH>(x, n, h0, c0); });
  }

  /// Packed per-token value rows [x, y) of the tile at `tile`, both tiers, G groups per row.
  KVQ_TARGET_AVX2_ATTENTION void packed_values(std::size_t tile, std::size_t x, std::size_t y, std::size_t G) noexcept {
    const std::size_t n = y - x, np = n * G, pi = v.param_index(x);
    const float mid = reference::mid_code(v.spec);
    // Per (row, group): the scale and the value of the centre code, zero + mid * scale (codes
    // count from mid, as in reference.hpp; 0 for symmetric parameters).
    std::size_t f = 0;
    for (; f + 8 <= np; f += 8) _mm256_store_ps(vscale + f, load8(v.spec.param, v.scales, pi + f));
    for (; f < np; ++f) vscale[f] = kvq::detail::load_scalar_f16c(v.spec.param, v.scales, pi + f);
    for (f = 0; f + 8 <= np; f += 8)
      _mm256_store_ps(vcentre + f, v.zeros != nullptr ? _mm256_fmadd_ps(_mm256_load_ps(vscale + f), _mm256_set1_ps(mid),
                                                                        load8(v.spec.param, v.zeros, pi + f))
                                                      : _mm256_setzero_ps());
    for (; f < np; ++f)
      vcentre[f] =
          v.zeros != nullptr ? kvq::detail::load_scalar_f16c(v.spec.param, v.zeros, pi + f) + mid * vscale[f] : 0.0f;
    for (; f % 8 != 0; ++f) vscale[f] = vcentre[f] = 0.0f;
    __m256 sm = _mm256_setzero_ps();
    for (f = 0; f < np; f += 8) sm = _mm256_max_ps(sm, _mm256_load_ps(vscale + f));
    const float smax = ops::Avx2::largest(sm);
    if (int_values()) {
      // scales and centre values group-major, zero up to a multiple of 8 rows
      const __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int(G)));
      for (std::size_t g = 0; g < G; ++g)
        for (std::size_t t = 0; t < n; t += 8) {
          const __m256 m = first_lanes(n - t);
          _mm256_store_ps(sgm[g] + t, _mm256_mask_i32gather_ps(_mm256_setzero_ps(), vscale + t * G + g, rows, m, 4));
          _mm256_store_ps(cgm[g] + t, _mm256_mask_i32gather_ps(_mm256_setzero_ps(), vcentre + t * G + g, rows, m, 4));
        }
      for (std::size_t h0 = 0; h0 < task.group; h0 += register_heads) {
        const std::size_t nh = std::min(register_heads, task.group - h0);
        int_value_weights(tile, x, n, G, h0, nh, smax);
        v.spec.bits == 4 ? int_value_rows<4>(x, n, h0, nh) : int_value_rows<2>(x, n, h0, nh);
      }
      return;
    }
    for (std::size_t h0 = 0; h0 < task.group; h0 += register_heads) {
      const std::size_t nh = std::min(register_heads, task.group - h0);
      value_weights(tile, x, n, G, h0, nh, smax);
      switch (v.spec.bits) {
        case 2:
          packed_rows_heads<2>(x, n, G, h0, nh);
          break;
        case 4:
          packed_rows_heads<4>(x, n, G, h0, nh);
          break;
        default:
          packed_rows_heads<8>(x, n, G, h0, nh);
          break;
      }
    }
  }

  KVQ_TARGET_AVX2_ATTENTION void values(std::size_t a, std::size_t b) noexcept {
    std::size_t qa = a, qb = a;  // packed value rows of the tile
    if (v.quantized && std::max(a, v.first_quantized) < std::min(b, v.end_quantized)) {
      qa = std::max(a, v.first_quantized);
      qb = std::min(b, v.end_quantized);
    }
    if (qa < qb) {
      if (const std::size_t G = detail::packed_value_groups(v); G != 0)
        packed_values(a, qa, qb, G);
      else if (task.tier == Tier::integer && v.spec.axis == Axis::per_token)
        attention::detail::integer_values(task, a, qa, qb, scores);
      else
        buffered_values(a, qa, qb);
      residual_values(a, a, qa);
      residual_values(a, qb, b);
    } else {
      residual_values(a, a, b);
    }
  }

  KVQ_TARGET_AVX2_ATTENTION void run() noexcept {
    start_state(task);
    for (std::size_t a = task.begin; a < task.end;) {
      const std::size_t b = tile_end(k, a, task.end);
      key_scores(a, b);
      for (std::size_t h = 0; h < task.group; ++h) Vector::softmax_head(task, h, scores[h], b - a);
      values(a, b);
      a = b;
    }
  }
};

}  // namespace detail

/// Whether it reads these streams at speed: keys whose codes it unpacks in registers, or per
/// channel after RoPE at any width (codes against the folded query); values per channel it
/// unpacks, or per token on the packed value path. It dequantizes other rows through
/// StreamView::read_row (and takes the integer tier's values on the scalar routine), 2-3x
/// slower than the vector kernels (bench/RESULTS.md).
inline bool at_speed(const StreamView& keys, const StreamView& values, const RopeTable* rope) noexcept {
  const bool keys_fast =
      !keys.quantized || detail::unpacked_codes(keys) || (keys.spec.axis == Axis::per_channel && rope == nullptr);
  const bool values_fast =
      !values.quantized || (values.spec.axis == Axis::per_channel ? detail::unpacked_codes(values)
                                                                  : detail::packed_value_groups(values) != 0);
  return keys_fast && values_fast;
}

/// Runs one task (supports() must hold).
KVQ_TARGET_AVX2_ATTENTION inline void decode_task(const DecodeTask& task) noexcept {
  if (computed_tier(task) != task.tier) {
    DecodeTask exact = task;
    exact.tier = Tier::exact;
    return avx2::decode_task(exact);  // qualified: DecodeTask brings attention::decode_task too
  }
  detail::Kernel kernel(task);
  kernel.run();
}

}  // namespace kvq::inline v0::kernels::attention::avx2

KVQ_INTRINSIC_WARNINGS_ON
