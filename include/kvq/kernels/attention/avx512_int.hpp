#pragma once
// AVX-512 VNNI integer-tier kernel for the packed span of a task: keys quantized per channel
// (2, 4 or 8 bits, blocks of a multiple of 16 positions; pre-RoPE keys take their fp32 scores from
// avx512_rope.hpp), values quantized per token
// (2, 4 or 8 bits, groups of 32 channels), head_dim 64 or 128. Included by avx512.hpp, which
// runs the sinks and the full-precision window through its generic kernel.
//
// Keys, per 16 positions: the packed rows (R bytes = R/4 dwords each) are transposed as dwords,
// so that vector j holds dword j of the 16 rows, one row per lane. Masking out one field of
// each byte leaves codes that vpdpbusd multiplies with 4 bytes of the int8 query (broadcast from
// memory) and adds into the lane of their row: the scores of 16 positions come out in one vector
// per query head, with no horizontal reduction. The query bytes are stored in the order the
// fields come out (a fixed permutation of the channels, applied to the query once per task and
// to the block's scales and zero points once per block, shared by the heads).
//
// Values, per 4 positions: the 4 packed rows are interleaved byte by byte (vpermt2b or
// vpunpck), so that each dword holds the same byte of the 4 rows; masking one field gives
// codes that vpdpbusd multiplies with the 4 rows' u8 weights (one dword per value group; rows of
// up to 32 bytes alternate two groups over the lanes, so one qword broadcast serves them, longer
// rows spread the dwords with vpermd) and accumulates per channel in int32. The channels come
// out permuted; the float accumulators keep that order and are put back at the end of the span.
//
// Per tile (64 positions or more, whole key blocks; tile_tokens): the key blocks of the tile are
// folded first (all heads at once, their reductions side by side), the scores of all heads go
// through the online softmax together as p' = exp(score - tile max), the weights p' * scale are
// quantized to u8 with one step per head and tile (bound: largest p' = 1 times the tile's
// largest value scale, a factor the heads share), and after the tile the int32 sums are scaled
// into the float accumulators. Definitions as in reference.hpp.
//
// vpdpbusd goes through inline assembly (see dpbusd()): with the intrinsic GCC 12 adds a
// register copy per instruction and never folds the broadcast query load into it.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvq/kernels/attention/avx512_common.hpp"
#include "kvq/kernels/attention/task.hpp"

#define KVQ_INT_INLINE KVQ_TARGET_AVX512_ATTENTION __attribute__((always_inline))

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::attention::avx512::detail {

// Software prefetch of the code rows into L2, this many bytes ahead (measured on Zen 4 at 32K:
// 12% faster than 8 KB into L1, which was no better than the hardware prefetcher alone).
inline constexpr std::size_t prefetch_bytes = 64 * 1024;

/// read_ahead over a segment's packed codes.
KVQ_TARGET_AVX512_ATTENTION inline const std::uint8_t* read_ahead(const StreamView& v, const std::uint8_t* row,
                                                                  const std::uint8_t* next) noexcept {
  return kernels::attention::read_ahead(row, v.codes, v.code_row(v.end_quantized), next, prefetch_bytes);
}

/// Per-task state of the integer kernel: tables, folded queries, scores, weights, accumulators.
struct IntState {
  const DecodeTask* task = nullptr;
  std::size_t dim = 0, nh = 0, h0 = 0;
  int kbits = 0, vbits = 0;
  std::size_t krow = 0, vrow = 0;  // packed bytes per row
  const float* queries = nullptr;  // the queries the tables below were built for
  std::size_t group = 0;

  // keys
  alignas(64) std::int32_t kperm[16];             // lane l of a permuted 16-channel vector <- channel
  alignas(64) float qp[max_group][max_head_dim];  // queries, channels permuted like the key fields
  // int8 folded queries, alpha and bias of the key blocks of the current tile (slot = block in tile)
  alignas(64) std::int8_t qb[max_tile / 16][register_heads][max_head_dim];
  alignas(64) float fold[max_tile / 16][2][16];        // [slot][alpha, bias][4 * head]
  alignas(64) float qt[register_heads][max_head_dim];  // q * scale of the block being folded
  alignas(64) float kcode[16];                         // what 2/3/4-bit key codes stand for (code_values)

  // values
  alignas(64) std::uint8_t vidx[8][64];          // vpermt2b indices per byte vector (rows of <= 32 bytes)
  alignas(64) std::int32_t widx[8][16];          // value group of each lane of byte vector x
  int wpair[8];                                  // rows <= 32 bytes: byte vector x holds group pair wpair[x]
  alignas(64) std::int32_t gsel[8][16];          // 4 * group of each lane of accumulator vector a
  alignas(64) std::int32_t vchan[max_head_dim];  // channel of lane l of accumulator a: vchan[16a + l]
  alignas(64) std::int32_t tperm[16], pidx[16];
  alignas(64) float st[max_tile * 4 / 16][16], zt[max_tile * 4 / 16][16];  // scales, centre values
  alignas(64) float score[register_heads][max_tile + 16];
  alignas(64) std::uint8_t wb[register_heads][max_tile * 4 + 64];
  alignas(64) float accf[register_heads][max_head_dim];  // permuted channel order
  alignas(16) float mx[register_heads], sm[register_heads];
  alignas(64) float corr[16], scale[16];  // lane 4h: exp(old max - new max), exp(tile max - new max)
  float beta[register_heads];
  alignas(64) float cg[register_heads][16];
  alignas(64) float vcode[16];  // what 2/3/4-bit value codes stand for (code_values)
};

/// The integer kernel applies: integer tier, post-RoPE, fast widths and layouts.
inline bool int_supported(const DecodeTask& t) noexcept {
  const StreamView &k = t.keys, &v = t.values;
  const std::size_t d = k.head_dim;
  if (t.tier != Tier::integer || (d != 64 && d != 128) || v.head_dim != d) return false;
  if (!k.quantized || k.spec.axis != Axis::per_channel || !fast_bits(k.spec) || k.spec.group % 16 != 0 ||
      k.spec.group > max_tile)
    return false;
  if (!v.quantized || v.spec.axis != Axis::per_token || !fast_bits(v.spec) || v.spec.group != 32) return false;
  return v.first_quantized == k.first_quantized;  // the span ends where either stream's packed rows do
}

/// 16 rows of 16 dwords -> r[j] lane t = dword j of row t.
KVQ_INT_INLINE inline void transpose16(__m512i* r) noexcept {
  __m512i a[16], s[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // s[4k + m] lane L = dword 4L + m of rows 4k .. 4k + 3
  for (int k = 0; k < 4; ++k) {
    s[4 * k + 0] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
    s[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
    s[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
    s[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i u0 = _mm512_shuffle_i32x4(s[m], s[4 + m], 0x44), u1 = _mm512_shuffle_i32x4(s[m], s[4 + m], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(s[8 + m], s[12 + m], 0x44),
                  u3 = _mm512_shuffle_i32x4(s[8 + m], s[12 + m], 0xEE);
    r[m] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    r[4 + m] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    r[8 + m] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
}

/// z[t] = [row t | row t + 4] (t < 4), z[4 + t] = [row 8 + t | row 12 + t], rows of 8 dwords ->
/// z[j] lane t = dword j of row t (j < 8).
KVQ_INT_INLINE inline void transpose8x2(__m512i* z) noexcept {
  __m512i a[8], s[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  for (int k = 0; k < 2; ++k) {
    s[4 * k + 0] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
    s[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
    s[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
    s[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    z[m] = _mm512_shuffle_i32x4(s[m], s[4 + m], 0x88);
    z[4 + m] = _mm512_shuffle_i32x4(s[m], s[4 + m], 0xDD);
  }
}

/// 16 rows of R bytes from `rows`, as dwords transposed: out[j] lane t = dword (16 * half + j) of
/// row t, for j < 16 (rows of more than 32 bytes, in halves of 64; lanes past a row's end are 0) or
/// j < R / 4 (shorter rows, half 0).
template <int R>
KVQ_INT_INLINE inline void transposed_dwords(const std::uint8_t* rows, int half, __m512i* out) noexcept {
  constexpr int ND = R / 4;
  static_assert(R % 4 == 0, "rows of whole dwords");
  if constexpr (ND % 16 != 0 && ND > 8) {  // 3-bit codes of 128 channels: 12 dwords, one masked half
    const __mmask16 m = __mmask16((1u << (ND % 16)) - 1u);
    for (int t = 0; t < 16; ++t) out[t] = _mm512_maskz_loadu_epi32(m, rows + R * t);
    transpose16(out);
  } else if constexpr (ND <= 8) {
    const __mmask8 m = __mmask8((1u << ND) - 1u);
    for (int t = 0; t < 4; ++t) {
      out[t] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi32(m, rows + R * t)),
                                  _mm256_maskz_loadu_epi32(m, rows + R * (t + 4)), 1);
      out[4 + t] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi32(m, rows + R * (t + 8))),
                                      _mm256_maskz_loadu_epi32(m, rows + R * (t + 12)), 1);
    }
    transpose8x2(out);
  } else {
    for (int t = 0; t < 16; ++t) out[t] = _mm512_loadu_si512(rows + R * t + 64 * half);
    transpose16(out);
  }
}

/// Channel c's codes in 16 transposed rows (z[j] lane t = dword j of row t) at the low bits of
/// each lane: one shift, or two and an or where the field crosses into the next dword (3 bits).
/// Bits above the field are the next fields' (masked, or ignored by a vpermps lookup).
template <int KB>
KVQ_INT_INLINE inline __m512i code_field(const __m512i* z, std::size_t c) noexcept {
  const std::size_t bit = std::size_t(KB) * c, j = bit / 32, shift = bit % 32;
  if (shift == 0) return z[j];
  const __m512i low = _mm512_srli_epi32(z[j], unsigned(shift));
  if (shift + KB <= 32) return low;
  return _mm512_or_si512(low, _mm512_slli_epi32(z[j + 1], unsigned(32 - shift)));
}

/// Channel of byte k of the permuted query (key fields of `bits`): k = 4m + i, m = jF + f. Codes
/// of widths that do not divide 8 (3 bits, the exact kernels only) are read in channel order.
inline std::size_t key_channel(std::size_t k, int bits) noexcept {
  if (8 % bits != 0) return k;
  const std::size_t F = std::size_t(8 / bits), m = k / 4, i = k % 4, j = m / F, f = m % F;
  return 4 * j * F + i * F + f;
}

KVQ_TARGET_AVX512_ATTENTION inline void int_init(IntState& S, const DecodeTask& t) noexcept {
  const StreamView &k = t.keys, &v = t.values;
  S.task = &t;
  // The exact tier's lookups read these (the integer tier takes no level table: computed_tier).
  code_values(k.spec, S.kcode);
  code_values(v.spec, S.vcode);
  // A task resumed on its next segment (block) keeps its queries and widths: the tables stand.
  if (t.resume && S.queries == t.queries && S.group == t.group && S.dim == k.head_dim && S.kbits == k.spec.bits &&
      S.vbits == v.spec.bits && S.krow == k.row_bytes && S.vrow == v.row_bytes)
    return;
  S.queries = t.queries;
  S.group = t.group;
  S.dim = k.head_dim;
  S.kbits = k.spec.bits;
  S.vbits = v.spec.bits;
  S.krow = k.row_bytes;
  S.vrow = v.row_bytes;
  for (std::size_t l = 0; l < 16; ++l) S.kperm[l] = std::int32_t(key_channel(l, S.kbits));
  for (std::size_t h = 0; h < t.group; ++h)
    for (std::size_t c = 0; c < S.dim; ++c) S.qp[h][c] = t.queries[h * S.dim + key_channel(c, S.kbits)];
  // Values: byte vector x lane l = byte beta(x, l) of 4 rows; field f of it is channel beta * F + f,
  // accumulated in vector a = x * F + f.
  const std::size_t F = std::size_t(8 / S.vbits), R = S.vrow, G = S.dim / 32;
  for (std::size_t x = 0; x < R / 16; ++x) {
    for (std::size_t l = 0; l < 16; ++l) {
      std::size_t beta;
      if (R <= 32) {
        // lanes alternate between groups 2 * pair and 2 * pair + 1 (bg bytes each)
        const std::size_t bg = 32 * std::size_t(S.vbits) / 8, per = bg / 8, pair = x / per;
        beta = bg * (2 * pair + l % 2) + 8 * (x % per) + l / 2;
        S.wpair[x] = int(pair);
        for (std::size_t r = 0; r < 4; ++r) S.vidx[x][4 * l + r] = std::uint8_t(r * R + beta);
      } else {
        beta = 64 * (x / 4) + 16 * (l / 4) + 4 * (x % 4) + l % 4;
      }
      const std::size_t group = beta * F / 32;
      S.widx[x][l] = std::int32_t(group);
      for (std::size_t f = 0; f < F; ++f) {
        const std::size_t a = x * F + f;
        S.vchan[16 * a + l] = std::int32_t(beta * F + f);
        S.gsel[a][l] = std::int32_t(4 * group);
      }
    }
  }
  // Weight vectors: lane l = (quad l / 4G, group (l % 4G) / 4, row l % 4) <- stored (row, group).
  for (std::size_t l = 0; l < 16; ++l) {
    const std::size_t qd = l / (4 * G), g = (l % (4 * G)) / 4, r = l % 4;
    S.tperm[l] = std::int32_t(qd * 4 * G + r * G + g);
    S.pidx[l] = std::int32_t(4 * qd + r);
  }
}

/// 4 vectors -> 128-bit lane h holds the sum (max) of v[h]'s lanes in all 4 lanes.
template <bool Max>
KVQ_INT_INLINE inline __m512 reduce4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) noexcept {
#define KVQ_OP(a, b) (Max ? _mm512_max_ps((a), (b)) : _mm512_add_ps((a), (b)))
  const __m512 t0 = KVQ_OP(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
  const __m512 t1 = KVQ_OP(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
  __m512 u = KVQ_OP(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
  u = KVQ_OP(u, _mm512_permute_ps(u, 0x4E));
  return KVQ_OP(u, _mm512_permute_ps(u, 0xB1));
#undef KVQ_OP
}

// vpdpbusd through inline assembly: GCC 12 copies the accumulator of the intrinsic around (a
// register move per instruction in these loops) and never folds a broadcast load into it.
/// acc += u8 bytes of u times s8 bytes of s, 4 per lane.
KVQ_INT_INLINE inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) noexcept {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
/// acc += u8 bytes of u times the 4 s8 bytes at p, broadcast to every lane.
KVQ_INT_INLINE inline __m512i dpbusd_bcast(__m512i acc, __m512i u, const std::int8_t* p) noexcept {
  using word = std::int32_t __attribute__((may_alias));
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const word*>(p)));
  return acc;
}

/// 4 vectors of int32 -> 64 bytes in lane order (r[0]'s lanes, then r[1]'s, ...), saturated to s8
/// (Signed) or u8. Two levels of packs interleave the inputs per 128-bit lane and one dword
/// permutation puts them back: half the uops of four vpmov*db stores on Intel cores.
template <bool Signed>
KVQ_INT_INLINE inline __m512i pack_bytes(const __m512i* r) noexcept {
  // after the packs, dword 4k + m holds lanes 4k .. 4k + 3 of r[m]
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  const __m512i w01 = Signed ? _mm512_packs_epi32(r[0], r[1]) : _mm512_packus_epi32(r[0], r[1]);
  const __m512i w23 = Signed ? _mm512_packs_epi32(r[2], r[3]) : _mm512_packus_epi32(r[2], r[3]);
  return _mm512_permutexvar_epi32(order, Signed ? _mm512_packs_epi16(w01, w23) : _mm512_packus_epi16(w01, w23));
}

/// Folds key block `blk`'s scales into the queries of heads [h0, h0 + NH): int8 bytes qb[slot],
/// alpha and bias in fold[slot] (lane 4h). The four heads' reductions run side by side.
template <int NV, int NH>
KVQ_INT_INLINE inline void int_fold(IntState& S, std::size_t blk, std::size_t slot) noexcept {
  const StreamView& k = S.task->keys;
  const std::size_t pi = blk * S.dim;
  const float mid = reference::mid_code(k.spec);
  const __m512i perm = _mm512_load_si512(S.kperm);
  {  // parameters of the block 4 ahead
    const std::size_t ps = size_of(k.spec.param), ahead = (pi + 4 * S.dim) * ps;
    for (std::size_t o = 0; o < S.dim * ps; o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k.scales + ahead + o), _MM_HINT_T0);
      if (k.zeros != nullptr) _mm_prefetch(reinterpret_cast<const char*>(k.zeros + ahead + o), _MM_HINT_T0);
    }
  }
  __m512 s[NV], zm[NV];
  for (int i = 0; i < NV; ++i) {
    const __m512 sc = load16(k.spec.param, k.scales, pi + 16 * std::size_t(i));
    s[i] = _mm512_permutexvar_ps(perm, sc);
    zm[i] = k.zeros != nullptr
                ? _mm512_permutexvar_ps(perm, _mm512_fmadd_ps(sc, _mm512_set1_ps(mid),
                                                              load16(k.spec.param, k.zeros, pi + 16 * std::size_t(i))))
                : _mm512_setzero_ps();
  }
  // Pass 1: q~ = q * scale (kept in S.qt for pass 2), max |q~| and q.(zero + mid * scale) per head.
  __m512 am[4], bs[4];
  for (int h = 0; h < 4; ++h) am[h] = bs[h] = _mm512_setzero_ps();
  for (int h = 0; h < NH; ++h) {
    const float* q = S.qp[S.h0 + std::size_t(h)];
    __m512 a2 = _mm512_setzero_ps(), b2 = _mm512_setzero_ps();
    for (int i = 0; i < NV; i += 2) {
      const __m512 q0 = _mm512_load_ps(q + 16 * i), q1 = _mm512_load_ps(q + 16 * i + 16);
      const __m512 t0 = _mm512_mul_ps(q0, s[i]), t1 = _mm512_mul_ps(q1, s[i + 1]);
      _mm512_store_ps(S.qt[h] + 16 * i, t0);
      _mm512_store_ps(S.qt[h] + 16 * i + 16, t1);
      am[h] = _mm512_range_ps(am[h], t0, 0x0B);  // max |.|
      a2 = _mm512_range_ps(a2, t1, 0x0B);
      bs[h] = _mm512_fmadd_ps(q0, zm[i], bs[h]);
      b2 = _mm512_fmadd_ps(q1, zm[i + 1], b2);
    }
    am[h] = _mm512_max_ps(am[h], a2);
    bs[h] = _mm512_add_ps(bs[h], b2);
  }
  const __m512 m = reduce4<true>(am[0], am[1], am[2], am[3]);  // lane 4h: max |q~| of head h
  // a zero or tiny maximum (all-zero query or scales) folds to zero, never to an infinite inverse
  const __mmask16 pos = _mm512_cmp_ps_mask(m, _mm512_set1_ps(127.0f / std::numeric_limits<float>::max()), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(pos, _mm512_set1_ps(127.0f), m);
  const __m512 alpha = _mm512_mul_ps(m, _mm512_set1_ps(1.0f / 127.0f));
  _mm512_store_ps(S.fold[slot][0], alpha);
  // Pass 2: int8 q~ / alpha, 64 channels per store, and its sum per head (vpdpbusd with ones).
  __m512 rs[4];
  for (int h = 0; h < 4; ++h) rs[h] = _mm512_setzero_ps();
  for (int h = 0; h < NH; ++h) {
    const __m512 iv = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * h), inv);
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < NV; i += 4) {
      __m512i r[4];
      for (int j = 0; j < 4; ++j) r[j] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(S.qt[h] + 16 * (i + j)), iv));
      const __m512i b = pack_bytes<true>(r);
      sum = dpbusd(sum, _mm512_set1_epi8(1), b);
      _mm512_store_si512(S.qb[slot][h] + 16 * i, b);
    }
    rs[h] = _mm512_cvtepi32_ps(sum);
  }
  // Centred codes (reference.hpp): bias q.(zero + mid * scale) - alpha * mid * sum(qi)
  const __m512 rsum = reduce4<false>(rs[0], rs[1], rs[2], rs[3]);
  _mm512_store_ps(S.fold[slot][1], _mm512_fnmadd_ps(rsum, _mm512_mul_ps(alpha, _mm512_set1_ps(mid)),
                                                    reduce4<false>(bs[0], bs[1], bs[2], bs[3])));
}

/// Scores of the 16 positions at s0 for NH heads into S.score[h][off ..].
template <int NV, int KB, int NH>
KVQ_INT_INLINE inline void int_keys16(IntState& S, std::size_t s0, std::size_t off, std::size_t slot) noexcept {
  const StreamView& k = S.task->keys;
  constexpr int F = 8 / KB, R = 2 * NV * KB, ND = R / 4;  // fields per byte, bytes and dwords per row
  const std::uint8_t* rows = k.code_row(s0);
  if (const std::uint8_t* ahead = read_ahead(k, rows, S.task->next_keys))
    for (int i = 0; i < R / 4; ++i)  // 16 rows = 4R bytes
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * std::size_t(i)), _MM_HINT_T1);
  // One accumulator per field (two for 8-bit codes, by dword parity): field f is masked in place,
  // without a shift (codes times 2^(KB f) stay within u8), and its sums are scaled back in float.
  // That is exact: the raw sums stay below 2^24, the scaled ones below 2^17 with at most 6
  // fraction bits. Separate accumulators also shorten each head's dependency chain.
  constexpr int NA = F == 1 ? 2 : F;
  __m512i acc[NA][NH];
  for (int a = 0; a < NA; ++a)
    for (int h = 0; h < NH; ++h) acc[a][h] = _mm512_setzero_si512();
  // An opaque base keeps the query addresses as base + displacement (else GCC hoists 128
  // addresses out of the loop and spills them).
  const std::int8_t* qbase = S.qb[slot][0];
  __asm__("" : "+r"(qbase));
#define KVQ_INT_DOTS(T, j)                                                                                          \
  _Pragma("GCC unroll 4") for (int f = 0; f < F; ++f) {                                                             \
    const __m512i c = KB == 8 ? (T) : _mm512_and_si512((T), _mm512_set1_epi8(char(((1u << KB) - 1u) << (KB * f)))); \
    const int a = F == 1 ? (j) % 2 : f;                                                                             \
    _Pragma("GCC unroll 4") for (int h = 0; h < NH; ++h) acc[a][h] =                                                \
        dpbusd_bcast(acc[a][h], c, qbase + max_head_dim * std::size_t(h) + 4 * ((j)*F + f));                        \
  }
  if constexpr (ND <= 8) {
    __m512i z[8];
    transposed_dwords<R>(rows, 0, z);
#pragma GCC unroll 8
    for (int j = 0; j < ND; ++j) KVQ_INT_DOTS(z[j], j)
  } else {
    for (int half = 0; half < ND / 16; ++half) {
      __m512i r[16];
      transposed_dwords<R>(rows, half, r);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) KVQ_INT_DOTS(r[j], 16 * half + j)
    }
  }
#undef KVQ_INT_DOTS
  for (int h = 0; h < NH; ++h) {
    __m512 dot = _mm512_cvtepi32_ps(acc[0][h]);
    for (int a = 1; a < NA; ++a)
      dot = F == 1 ? _mm512_add_ps(dot, _mm512_cvtepi32_ps(acc[a][h]))
                   : _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[a][h]), _mm512_set1_ps(1.0f / float(1u << (KB * a))), dot);
    _mm512_store_ps(S.score[h] + off, _mm512_fmadd_ps(dot, _mm512_set1_ps(S.fold[slot][0][4 * h]),
                                                      _mm512_set1_ps(S.fold[slot][1][4 * h])));
  }
}

template <int NV, int KB, int NH>
KVQ_TARGET_AVX512_ATTENTION inline void int_keys(IntState& S, std::size_t a, std::size_t n) noexcept {
  const StreamView& k = S.task->keys;
  // Fold every key block of the tile first: independent work the core can overlap.
  const std::size_t g = k.spec.group, b0 = (a - k.first_quantized) / g, b1 = (a + n - 1 - k.first_quantized) / g;
  for (std::size_t b = b0; b <= b1; ++b) int_fold<NV, NH>(S, b, b - b0);
  for (std::size_t o = 0; o < n; o += 16) int_keys16<NV, KB, NH>(S, a + o, o, (a + o - k.first_quantized) / g - b0);
}

/// Online softmax of the tile's n scores per head, the heads side by side. Scores become
/// p' = exp(score - tile max) (the tile's largest weight is 1), after soft-capping (softcap > 0); the true weights are
/// p = p' * scale[4h] with scale = exp(tile max - running max). Masked: scores of -inf (padding)
/// weigh exactly 0 (ops::Avx512::exp clamps below -87). Shared by the packed and dense kernels (State:
/// IntState or DenseState).
template <int NH, bool Masked = false, class State>
KVQ_TARGET_AVX512_ATTENTION inline void tile_softmax(State& S, std::size_t n, float softcap) noexcept {
  for (int h = 0; h < NH; ++h) cap_scores(S.score[h], n, softcap);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m[4];
  for (int h = 0; h < 4; ++h) m[h] = h < NH ? minus_inf : _mm512_setzero_ps();
  for (std::size_t t = 0; t < n; t += 16)
    for (int h = 0; h < NH; ++h) m[h] = _mm512_max_ps(m[h], _mm512_load_ps(S.score[h] + t));
  const __m512 tmax = reduce4<true>(m[0], m[1], m[2], m[3]);  // lane 4h: head h
  alignas(64) float tm[16];
  _mm512_store_ps(tm, tmax);
  __m512 sum[4];
  for (int h = 0; h < 4; ++h) sum[h] = _mm512_setzero_ps();
  for (int h = 0; h < NH; ++h) {
    const __m512 mv = _mm512_set1_ps(tm[4 * h]);
    for (std::size_t t = 0; t < n; t += 16) {
      const __m512 s = _mm512_load_ps(S.score[h] + t);
      __m512 p = ops::Avx512::exp(_mm512_sub_ps(s, mv));
      if constexpr (Masked) p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, minus_inf, _CMP_NEQ_OQ), p);
      _mm512_store_ps(S.score[h] + t, p);
      sum[h] = _mm512_add_ps(sum[h], p);
    }
  }
  const __m512 tsum = reduce4<false>(sum[0], sum[1], sum[2], sum[3]);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512 old = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_load_ps(S.mx)));
  const __m512 nm = _mm512_max_ps(old, tmax);
  // ops::Avx512::exp clamps: an empty state (-inf) gets a factor of ~1e-38 on its zero sums
  _mm512_store_ps(S.corr, ops::Avx512::exp(_mm512_sub_ps(old, nm)));
  _mm512_store_ps(S.scale, ops::Avx512::exp(_mm512_sub_ps(tmax, nm)));
  alignas(64) float nms[16], ts[16];
  _mm512_store_ps(nms, nm);
  _mm512_store_ps(ts, tsum);
  for (int h = 0; h < NH; ++h) {
    S.mx[h] = nms[4 * h];
    S.sm[h] = S.sm[h] * S.corr[4 * h] + S.scale[4 * h] * ts[4 * h];
  }
}

/// Byte vector x of the 4 rows at `rows` (R bytes each): dword lane l = byte beta(x, l) of rows 0..3.
template <int R>
KVQ_INT_INLINE inline __m512i int_interleave(const IntState& S, const std::uint8_t* rows, int x) noexcept {
  if constexpr (R <= 32) {
    const __m512i idx = _mm512_load_si512(S.vidx[x]);
    if constexpr (R == 16)
      return _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(rows));
    else
      return _mm512_permutex2var_epi8(_mm512_loadu_si512(rows), idx, _mm512_loadu_si512(rows + 64));
  } else {
    const int c = x / 4, kk = x % 4;
    const __m512i r0 = _mm512_loadu_si512(rows + 64 * c), r1 = _mm512_loadu_si512(rows + R + 64 * c);
    const __m512i r2 = _mm512_loadu_si512(rows + 2 * R + 64 * c), r3 = _mm512_loadu_si512(rows + 3 * R + 64 * c);
    const __m512i a01 = kk < 2 ? _mm512_unpacklo_epi8(r0, r1) : _mm512_unpackhi_epi8(r0, r1);
    const __m512i a23 = kk < 2 ? _mm512_unpacklo_epi8(r2, r3) : _mm512_unpackhi_epi8(r2, r3);
    return kk % 2 == 0 ? _mm512_unpacklo_epi16(a01, a23) : _mm512_unpackhi_epi16(a01, a23);
  }
}

/// Weights of the tile (n positions) for NH heads, P.V into int32, then into the float accumulators.
template <int NV, int VB, int NH>
KVQ_TARGET_AVX512_ATTENTION inline void int_values(IntState& S, std::size_t a, std::size_t n) noexcept {
  const StreamView& v = S.task->values;
  constexpr int G = NV / 2;                                // value groups of 32 per row
  constexpr int F = 8 / VB, R = 2 * NV * VB, NX = R / 16;  // fields per byte, bytes per row, byte vectors
  constexpr bool wide = VB == 8;                           // 8-bit codes take the unsigned side; weights are s8
  const float levels = weight_levels(VB), mid = reference::mid_code(v.spec);
  // Scales and centre values of the tile's rows, lanes ordered (quad, group, row); the scales
  // times levels / (largest scale of the tile), shared by the heads.
  const std::size_t nvec = n * G / 16, pi = v.param_index(a);
  {  // the value parameters of the tile after next (small streams the hardware prefetcher may miss)
    const std::size_t ps = size_of(v.spec.param), ahead = (pi + 2 * n * G) * ps, bytes = n * G * ps;
    for (std::size_t o = 0; o < bytes; o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(v.scales + ahead + o), _MM_HINT_T0);
      if (v.zeros != nullptr) _mm_prefetch(reinterpret_cast<const char*>(v.zeros + ahead + o), _MM_HINT_T0);
    }
  }
  const __m512i tp = _mm512_load_si512(S.tperm);
  __m512 smax = _mm512_setzero_ps();
  for (std::size_t i = 0; i < nvec; ++i) {
    const __m512 s = load16(v.spec.param, v.scales, pi + 16 * i);
    smax = _mm512_max_ps(smax, s);
    _mm512_store_ps(S.st[i], _mm512_permutexvar_ps(tp, s));
    _mm512_store_ps(S.zt[i], v.zeros != nullptr ? _mm512_permutexvar_ps(
                                                      tp, _mm512_fmadd_ps(s, _mm512_set1_ps(mid),
                                                                          load16(v.spec.param, v.zeros, pi + 16 * i)))
                                                : _mm512_setzero_ps());
  }
  float sm = _mm512_reduce_max_ps(smax);
  const __m512i pidx = _mm512_load_si512(S.pidx);
  alignas(64) float hm[16];  // lane 4h: head h's bound on p' * scale, relative to sm
  if constexpr (wide) {
    // 8-bit codes get 127 weight levels only: use each head's exact largest p' * scale.
    __m512 wmax[4];
    for (int h = 0; h < 4; ++h) wmax[h] = _mm512_setzero_ps();
    for (std::size_t i = 0; i < nvec; ++i) {
      const __m512 sv = _mm512_load_ps(S.st[i]);
      for (int h = 0; h < NH; ++h)
        wmax[h] = _mm512_max_ps(
            wmax[h], _mm512_mul_ps(_mm512_permutexvar_ps(pidx, _mm512_loadu_ps(S.score[h] + i * 16 / G)), sv));
    }
    _mm512_store_ps(
        hm, _mm512_mul_ps(reduce4<true>(wmax[0], wmax[1], wmax[2], wmax[3]), _mm512_set1_ps(inverse_step(1.0f, sm))));
  } else {
    _mm512_store_ps(hm, _mm512_set1_ps(1.0f));
  }
  const __m512 sinv = _mm512_set1_ps(inverse_step(levels, sm));
  for (std::size_t i = 0; i < nvec; ++i) _mm512_store_ps(S.st[i], _mm512_mul_ps(_mm512_load_ps(S.st[i]), sinv));
  // Weights w = p * scale <= (tile's largest p) * (tile's largest scale) = scale[4h] * sm: the
  // quantization step is beta = scale[4h] * sm / levels, and wq = rne(p' * scale * levels / sm).
  for (int h = 0; h < NH; ++h) {
    const float* p = S.score[h];
    const float hb = hm[4 * h] >= std::numeric_limits<float>::min() ? hm[4 * h] : 1.0f;
    const __m512 hinv = _mm512_set1_ps(1.0f / hb);
    __m512i ws = _mm512_setzero_si512();
    __m512 zs = _mm512_setzero_ps();
    auto weights = [&](std::size_t i) KVQ_INT_INLINE {
      const __m512 pv = G == 4 ? _mm512_broadcast_f32x4(_mm_loadu_ps(p + 4 * i))
                               : _mm512_permutexvar_ps(pidx, _mm512_loadu_ps(p + i * 16 / G));
      const __m512i r = _mm512_cvtps_epi32(wide ? _mm512_mul_ps(_mm512_mul_ps(pv, _mm512_load_ps(S.st[i])), hinv)
                                                : _mm512_mul_ps(pv, _mm512_load_ps(S.st[i])));
      ws = _mm512_add_epi32(ws, r);
      zs = _mm512_fmadd_ps(pv, _mm512_load_ps(S.zt[i]), zs);
      return r;
    };
    std::size_t i = 0;
    for (; i + 4 <= nvec; i += 4) {
      const __m512i r[4] = {weights(i), weights(i + 1), weights(i + 2), weights(i + 3)};
      _mm512_store_si512(S.wb[h] + 16 * i, pack_bytes<false>(r));
    }
    for (; i < nvec; ++i)
      _mm_store_si128(reinterpret_cast<__m128i*>(S.wb[h] + 16 * i), _mm512_cvtusepi32_epi8(weights(i)));
    const float e = S.scale[4 * h], b = e * sm * hb / levels;
    S.beta[h] = b;
    // per group: sum p * (zero + mid * scale) - beta * mid * sum wq (lanes (quad, group, row))
    __m512 c = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ws), _mm512_set1_ps(b * mid), _mm512_mul_ps(zs, _mm512_set1_ps(e)));
    c = _mm512_add_ps(c, _mm512_permute_ps(c, 0xB1));
    c = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4E));
    if constexpr (G == 2) c = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0x4E));
    _mm512_store_ps(S.cg[h], c);
  }

  // P.V: passes over the byte vectors so that NH heads' accumulators fit the registers.
  constexpr int XW = (16 / NH) / F < 1 ? 1 : ((16 / NH) / F > NX ? NX : (16 / NH) / F);
  constexpr int XP = XW >= 8 ? 8 : XW >= 4 ? 4 : XW >= 2 ? 2 : 1;  // divides NX (a power of two)
  const std::uint8_t* base = v.code_row(a);
  const __m512i mask = _mm512_set1_epi8(char((1u << (VB == 8 ? 1 : VB)) - 1u));
  constexpr auto in_place = [](int f) { return VB < 8 && ((1 << VB) - 1) << (VB * f) <= 127; };
  for (int x0 = 0; x0 < NX; x0 += XP) {
    __m512i acc[NH][XP][F];
    for (int h = 0; h < NH; ++h)
      for (int xx = 0; xx < XP; ++xx)
        for (int f = 0; f < F; ++f) acc[h][xx][f] = _mm512_setzero_si512();
    __m512i wi[XP];
    for (int xx = 0; xx < XP; ++xx) wi[xx] = _mm512_load_si512(S.widx[x0 + xx]);
    for (std::size_t qd = 0; qd < n / 4; ++qd) {
      const std::uint8_t* rows = base + 4 * qd * std::size_t(R);
      __m512i wq[NH];
      if constexpr (R > 32)
        for (int h = 0; h < NH; ++h)
          wq[h] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S.wb[h] + 4 * G * qd)));
      if (x0 == 0)  // the quad's 4R bytes
        if (const std::uint8_t* ahead = read_ahead(v, rows, S.task->next_values))
          for (int i = 0; i < (4 * R + 63) / 64; ++i)
            _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * std::size_t(i)), _MM_HINT_T1);
#pragma GCC unroll 8
      for (int xx = 0; xx < XP; ++xx) {
        const __m512i X = int_interleave<R>(S, rows, x0 + xx);
        __m512i w[NH];
#pragma GCC unroll 4
        for (int h = 0; h < NH; ++h) {
          if constexpr (R <= 32) {
            // lanes alternate between the two groups of the pair: one qword broadcast
            std::uint64_t pair;
            std::memcpy(&pair, S.wb[h] + 4 * (G * qd + 2 * std::size_t(S.wpair[x0 + xx])), 8);
            w[h] = _mm512_set1_epi64(std::int64_t(pair));
          } else {
            w[h] = _mm512_permutexvar_epi32(wi[xx], wq[h]);
          }
        }
#pragma GCC unroll 8
        for (int f = 0; f < F; ++f) {
          // fields whose codes times 2^(VB f) fit s8 are masked in place (scaled back with beta)
          const __m512i c = wide          ? X
                            : in_place(f) ? _mm512_and_si512(X, _mm512_set1_epi8(char(((1u << VB) - 1u) << (VB * f))))
                                          : _mm512_and_si512(_mm512_srli_epi32(X, unsigned(VB * f)), mask);
#pragma GCC unroll 4
          for (int h = 0; h < NH; ++h)
            acc[h][xx][f] = wide ? dpbusd(acc[h][xx][f], c, w[h]) : dpbusd(acc[h][xx][f], w[h], c);
        }
      }
    }
    for (int h = 0; h < NH; ++h) {
      const __m512 b = _mm512_set1_ps(S.beta[h]), cr = _mm512_set1_ps(S.corr[4 * h]), cv = _mm512_load_ps(S.cg[h]);
      for (int xx = 0; xx < XP; ++xx)
        for (int f = 0; f < F; ++f) {
          const int av = (x0 + xx) * F + f;
          float* o = S.accf[h] + 16 * av;
          const __m512 cgv = _mm512_permutexvar_ps(_mm512_load_si512(S.gsel[av]), cv);
          const __m512 bf = in_place(f) ? _mm512_mul_ps(b, _mm512_set1_ps(1.0f / float(1u << (VB * f)))) : b;
          _mm512_store_ps(
              o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h][xx][f]), bf, _mm512_fmadd_ps(_mm512_load_ps(o), cr, cgv)));
        }
    }
  }
}

// Pre-RoPE keys (avx512_rope.hpp): fp32 scores in both tiers.
struct RopeKeyState;
template <int NV, int KB, int NH>
KVQ_TARGET_AVX512_ATTENTION inline void rope_keys(IntState& S, RopeKeyState& P, std::size_t a, std::size_t n) noexcept;
inline RopeKeyState& rope_key_state(bool reset) noexcept;

template <int NV, int KB, int VB, int NH>
KVQ_TARGET_AVX512_ATTENTION void int_tiles(IntState& S, std::size_t a0, std::size_t a1, std::size_t T) noexcept {
  RopeKeyState& P = rope_key_state(true);
  for (std::size_t a = a0; a < a1; a += T) {
    const std::size_t n = a1 - a < T ? a1 - a : T;
    if (S.task->rope != nullptr)
      rope_keys<NV, KB, NH>(S, P, a, n);
    else
      int_keys<NV, KB, NH>(S, a, n);
    tile_softmax<NH>(S, n, S.task->softcap);
    int_values<NV, VB, NH>(S, a, n);
  }
}

/// The packed span [a0, a1) (whole tiles of whole key blocks) for every head of the task, register_heads
/// query heads per pass: each pass loads the heads' online-softmax state into S, runs
/// Span::tiles<NH> and stores the state back (Span::load/store move the accumulators).
template <class Span>
KVQ_TARGET_AVX512_ATTENTION void head_passes(IntState& S, std::size_t a0, std::size_t a1) noexcept {
  const DecodeTask& t = *S.task;
  const std::size_t T = tile_tokens(t.keys);
  for (std::size_t h0 = 0; h0 < t.group; h0 += register_heads) {
    const std::size_t nh = t.group - h0 < register_heads ? t.group - h0 : register_heads;
    S.h0 = h0;
    S.nh = nh;
    for (std::size_t h = 0; h < register_heads; ++h) S.mx[h] = S.sm[h] = 0.0f;
    for (std::size_t h = 0; h < nh; ++h) {
      S.mx[h] = t.max[h0 + h];
      S.sm[h] = t.sum[h0 + h];
    }
    Span::load(S);
    with_heads(nh, [&]<int NH>() { Span::template tiles<NH>(S, a0, a1, T); });
    for (std::size_t h = 0; h < nh; ++h) {
      t.max[h0 + h] = S.mx[h];
      t.sum[h0 + h] = S.sm[h];
    }
    Span::store(S);
  }
}

/// Runs head_passes<Span<NV, KB, VB>> for the task's key and value widths (2, 4 or 8 each; 3 bits
/// where the Span takes them): the packed-span kernels are compiled per width pair so that
/// fields, masks and shifts are constants. Shared by the integer and exact kernels.
template <template <int, int, int> class Span, int NV, int KB>
KVQ_TARGET_AVX512_ATTENTION void run_span_kb(IntState& S, std::size_t a0, std::size_t a1) noexcept {
  switch (S.vbits) {
    case 2:
      return head_passes<Span<NV, KB, 2>>(S, a0, a1);
    case 3:  // only spans that take them see 3-bit values (int_supported refuses them)
      if constexpr (Span<NV, KB, 3>::three_bit_codes) return head_passes<Span<NV, KB, 3>>(S, a0, a1);
      __builtin_trap();
    case 4:
      return head_passes<Span<NV, KB, 4>>(S, a0, a1);
    default:
      return head_passes<Span<NV, KB, 8>>(S, a0, a1);
  }
}

/// The calling thread's kernel state (one per thread, not one per kernel instantiation:
/// thread-local storage comes out of every thread's stack).
inline IntState& int_state() noexcept {
  thread_local IntState state;
  return state;
}

template <template <int, int, int> class Span, int NV>
KVQ_TARGET_AVX512_ATTENTION void run_span(const DecodeTask& t, std::size_t a0, std::size_t a1) noexcept {
  IntState& S = int_state();
  int_init(S, t);
  switch (S.kbits) {
    case 2:
      return run_span_kb<Span, NV, 2>(S, a0, a1);
    case 3:  // only spans that take them see 3-bit keys (int_supported refuses them)
      if constexpr (Span<NV, 3, 2>::three_bit_codes) return run_span_kb<Span, NV, 3>(S, a0, a1);
      __builtin_trap();
    case 4:
      return run_span_kb<Span, NV, 4>(S, a0, a1);
    default:
      return run_span_kb<Span, NV, 8>(S, a0, a1);
  }
}

/// The integer kernel's accumulators live in S.accf in the permuted channel order of the values.
/// Moved with gathers and scatters: a task crossing many blocks moves them once per block.
template <int NV, int KB, int VB>
struct IntSpan {
  static constexpr bool three_bit_codes = false;  // int_supported refuses them
  KVQ_TARGET_AVX512_ATTENTION static void load(IntState& S) noexcept {
    for (std::size_t h = 0; h < S.nh; ++h) {
      const float* acc = S.task->acc + (S.h0 + h) * S.dim;
      for (int i = 0; i < NV; ++i)
        _mm512_store_ps(S.accf[h] + 16 * i, _mm512_i32gather_ps(_mm512_load_si512(S.vchan + 16 * i), acc, 4));
    }
  }
  KVQ_TARGET_AVX512_ATTENTION static void store(IntState& S) noexcept {
    for (std::size_t h = 0; h < S.nh; ++h) {
      float* acc = S.task->acc + (S.h0 + h) * S.dim;
      for (int i = 0; i < NV; ++i)
        _mm512_i32scatter_ps(acc, _mm512_load_si512(S.vchan + 16 * i), _mm512_load_ps(S.accf[h] + 16 * i), 4);
    }
  }
  template <int NH>
  KVQ_TARGET_AVX512_ATTENTION static void tiles(IntState& S, std::size_t a0, std::size_t a1, std::size_t T) noexcept {
    int_tiles<NV, KB, VB, NH>(S, a0, a1, T);
  }
};

template <int NV>
KVQ_TARGET_AVX512_ATTENTION void int_span(const DecodeTask& t, std::size_t a0, std::size_t a1) noexcept {
  run_span<IntSpan, NV>(t, a0, a1);
}

}  // namespace kvq::inline v0::kernels::attention::avx512::detail

KVQ_INTRINSIC_WARNINGS_ON

#undef KVQ_INT_INLINE
