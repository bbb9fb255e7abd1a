#pragma once
// AVX-512 VNNI integer-tier kernel for the packed span of a task: post-RoPE keys quantized per
// channel (2, 4 or 8 bits, blocks of a multiple of 16 positions), values quantized per token
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
// codes that vpdpbusd multiplies with the 4 rows' u8 weights (one dword per value group,
// broadcast to the lanes of its group) and accumulates per channel in int32. The channels come
// out permuted; the float accumulators keep that order and are put back at the end of the span.
//
// Per tile (64 positions or more, whole key blocks): the scores go through the online softmax,
// the weights w = p * scale of every head are quantized to u8 (one step per head and tile), and
// after the tile the int32 sums are scaled into the float accumulators. Definitions as in
// reference.hpp.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvq/kernels/attention/reference.hpp"

#define KVQ_INT_INLINE KVQ_TARGET_AVX512_ATTENTION __attribute__((always_inline))

namespace kvq::inline v0::kernels::attention::avx512::detail {

inline constexpr std::size_t int_heads = 4;        // query heads per pass over a tile
inline constexpr std::size_t prefetch_rows = 128;  // software prefetch distance in rows

/// Per-task state of the integer kernel: tables, folded queries, scores, weights, accumulators.
struct IntState {
  const DecodeTask* task = nullptr;
  std::size_t dim = 0, nh = 0, h0 = 0;
  int kbits = 0, vbits = 0;
  std::size_t krow = 0, vrow = 0;  // packed bytes per row
  std::size_t loaded_block = ~std::size_t(0);

  // keys
  alignas(64) std::int32_t kperm[16];          // lane l of a permuted 16-channel vector <- channel
  alignas(64) float qp[max_group][max_head_dim];  // queries, channels permuted like the key fields
  alignas(64) std::int8_t qb[int_heads][max_head_dim];  // int8 folded queries of the current block
  alignas(64) float alpha[int_heads], bias[int_heads];

  // values
  alignas(64) std::uint8_t vidx[8][64];     // vpermt2b indices per byte vector (rows of <= 32 bytes)
  alignas(64) std::int32_t widx[8][16];     // value group of each lane of byte vector x
  alignas(64) std::int32_t gsel[8][16];     // 4 * group of each lane of accumulator vector a
  alignas(64) std::int32_t vchan[max_head_dim];  // channel of lane l of accumulator a: vchan[16a + l]
  alignas(64) std::int32_t tperm[16], pidx[16];
  alignas(64) float st[max_tile * 4 / 16][16], zt[max_tile * 4 / 16][16];  // scales, centre values
  alignas(64) float score[int_heads][max_tile + 16];
  alignas(64) std::uint8_t wb[int_heads][max_tile * 4 + 64];
  alignas(64) float accf[int_heads][max_head_dim];  // permuted channel order
  float mx[int_heads], sm[int_heads], corr[int_heads], beta[int_heads];
  alignas(64) float cg[int_heads][16];
};

/// The integer kernel applies: integer tier, post-RoPE, fast widths and layouts.
inline bool int_supported(const DecodeTask& t) noexcept {
  const StreamView &k = t.keys, &v = t.values;
  const std::size_t d = k.head_dim;
  if (t.tier != Tier::integer || t.rope != nullptr || (d != 64 && d != 128) || v.head_dim != d) return false;
  if (!k.quantized || k.spec.axis != Axis::per_channel || !fast_bits(k.spec.bits) || k.spec.group % 16 != 0 ||
      k.spec.group > max_tile)
    return false;
  if (!v.quantized || v.spec.axis != Axis::per_token || !fast_bits(v.spec.bits) || v.spec.group != 32) return false;
  return v.first_quantized == k.first_quantized && v.end_quantized >= k.end_quantized;
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
    const __m512i u2 = _mm512_shuffle_i32x4(s[8 + m], s[12 + m], 0x44), u3 = _mm512_shuffle_i32x4(s[8 + m], s[12 + m], 0xEE);
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

/// Channel of byte k of the permuted query (key fields of `bits`): k = 4m + i, m = jF + f.
inline std::size_t key_channel(std::size_t k, int bits) noexcept {
  const std::size_t F = std::size_t(8 / bits), m = k / 4, i = k % 4, j = m / F, f = m % F;
  return 4 * j * F + i * F + f;
}

KVQ_TARGET_AVX512_ATTENTION inline void int_init(IntState& S, const DecodeTask& t) noexcept {
  const StreamView &k = t.keys, &v = t.values;
  S.task = &t;
  S.dim = k.head_dim;
  S.kbits = k.spec.bits;
  S.vbits = v.spec.bits;
  S.krow = k.row_bytes;
  S.vrow = v.row_bytes;
  S.loaded_block = ~std::size_t(0);
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
        beta = 16 * x + l;
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

/// Folds key block `blk`'s scales into the queries of heads [h0, h0 + NH): int8 bytes, alpha, bias.
template <int NV, int NH>
KVQ_INT_INLINE inline void int_fold(IntState& S, std::size_t blk) noexcept {
  const StreamView& k = S.task->keys;
  const std::size_t pi = blk * S.dim;
  const float mid = reference::mid_code(k.spec);
  const __m512i perm = _mm512_load_si512(S.kperm);
  __m512 s[NV], zm[NV];
  for (int i = 0; i < NV; ++i) {
    const __m512 sc = load16(k.spec.param, k.scales, pi + 16 * std::size_t(i));
    s[i] = _mm512_permutexvar_ps(perm, sc);
    zm[i] = k.zeros != nullptr
                ? _mm512_permutexvar_ps(perm, _mm512_fmadd_ps(sc, _mm512_set1_ps(mid), load16(k.spec.param, k.zeros, pi + 16 * std::size_t(i))))
                : _mm512_setzero_ps();
  }
  for (int h = 0; h < NH; ++h) {
    const float* q = S.qp[S.h0 + std::size_t(h)];
    __m512 amax = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    __m512 t[NV];
    for (int i = 0; i < NV; ++i) {
      const __m512 qv = _mm512_load_ps(q + 16 * i);
      t[i] = _mm512_mul_ps(qv, s[i]);
      amax = _mm512_range_ps(amax, t[i], 0x0B);  // max |.|
      b = _mm512_fmadd_ps(qv, zm[i], b);
    }
    const float m = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    const float al = m / 127.0f;
    __m512i rs = _mm512_setzero_si512();
    for (int i = 0; i < NV; ++i) {
      const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(t[i], inv));
      rs = _mm512_add_epi32(rs, r);
      _mm_store_si128(reinterpret_cast<__m128i*>(S.qb[h] + 16 * i), _mm512_cvtsepi32_epi8(r));
    }
    S.alpha[h] = al;
    S.bias[h] = _mm512_reduce_add_ps(b) - al * mid * float(_mm512_reduce_add_epi32(rs));
  }
}

KVQ_INT_INLINE inline __m512i bcast32(const std::int8_t* p) noexcept {
  std::int32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}

/// Scores of the 16 positions at s0 for NH heads into S.score[h][off ..].
template <int NV, int KB, int NH>
KVQ_INT_INLINE inline void int_keys16(IntState& S, std::size_t s0, std::size_t off) noexcept {
  const StreamView& k = S.task->keys;
  constexpr int F = 8 / KB, R = 2 * NV * KB, ND = R / 4;  // fields per byte, bytes and dwords per row
  const std::uint8_t* rows = k.code_row(s0);
  for (int i = 0; i < R / 4; ++i)  // 16 rows = 4R bytes, prefetch_rows ahead
    _mm_prefetch(reinterpret_cast<const char*>(rows + prefetch_rows * std::size_t(R) + 64 * std::size_t(i)), _MM_HINT_T0);
  __m512i acc[NH];
  for (int h = 0; h < NH; ++h) acc[h] = _mm512_setzero_si512();
  const __m512i mask = _mm512_set1_epi8(char((1u << KB) - 1u));
#define KVQ_INT_DOTS(T, j)                                                                                        \
  _Pragma("GCC unroll 4") for (int f = 0; f < F; ++f) {                                                                                   \
    const __m512i c = KB == 8 ? (T) : _mm512_and_si512(f == 0 ? (T) : _mm512_srli_epi32((T), unsigned(KB * f)), mask); \
    _Pragma("GCC unroll 4") for (int h = 0; h < NH; ++h) acc[h] = _mm512_dpbusd_epi32(acc[h], c, bcast32(S.qb[h] + 4 * ((j) * F + f)));  \
  }
  if constexpr (ND <= 8) {
    __m512i z[8];
    const __mmask16 m = __mmask16((1u << ND) - 1u);
    for (int t = 0; t < 4; ++t) {
      z[t] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi32(__mmask8(m), rows + R * t)),
                                _mm256_maskz_loadu_epi32(__mmask8(m), rows + R * (t + 4)), 1);
      z[4 + t] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi32(__mmask8(m), rows + R * (t + 8))),
                                    _mm256_maskz_loadu_epi32(__mmask8(m), rows + R * (t + 12)), 1);
    }
    transpose8x2(z);
#pragma GCC unroll 8
    for (int j = 0; j < ND; ++j) KVQ_INT_DOTS(z[j], j)
  } else {
    for (int half = 0; half < ND / 16; ++half) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(rows + R * t + 64 * half);
      transpose16(r);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) KVQ_INT_DOTS(r[j], 16 * half + j)
    }
  }
#undef KVQ_INT_DOTS
  for (int h = 0; h < NH; ++h)
    _mm512_store_ps(S.score[h] + off, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h]), _mm512_set1_ps(S.alpha[h]),
                                                      _mm512_set1_ps(S.bias[h])));
}

template <int NV, int KB, int NH>
KVQ_TARGET_AVX512_ATTENTION inline void int_keys(IntState& S, std::size_t a, std::size_t n) noexcept {
  const StreamView& k = S.task->keys;
  for (std::size_t o = 0; o < n; o += 16) {
    const std::size_t blk = (a + o - k.first_quantized) / k.spec.group;
    if (blk != S.loaded_block) {
      int_fold<NV, NH>(S, blk);
      S.loaded_block = blk;
    }
    int_keys16<NV, KB, NH>(S, a + o, o);
  }
}

/// Online softmax of the tile's n scores per head; scores become p = exp(score - max).
template <int NH>
KVQ_TARGET_AVX512_ATTENTION inline void int_softmax(IntState& S, std::size_t n) noexcept {
  for (int h = 0; h < NH; ++h) {
    __m512 m = _mm512_set1_ps(S.mx[h]);
    for (std::size_t t = 0; t < n; t += 16) m = _mm512_max_ps(m, _mm512_load_ps(S.score[h] + t));
    const float nm = _mm512_reduce_max_ps(m), old = S.mx[h];
    const float c = old == nm ? 1.0f : old == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(old - nm);
    S.corr[h] = c;
    S.mx[h] = nm;
    const __m512 mv = _mm512_set1_ps(nm);
    __m512 sum = _mm512_setzero_ps();
    for (std::size_t t = 0; t < n; t += 16) {
      const __m512 p = exp_ps(_mm512_sub_ps(_mm512_load_ps(S.score[h] + t), mv));
      _mm512_store_ps(S.score[h] + t, p);
      sum = _mm512_add_ps(sum, p);
    }
    S.sm[h] = S.sm[h] * c + _mm512_reduce_add_ps(sum);
  }
}

/// Byte vector x of the 4 rows at `rows` (R bytes each): dword lane l = byte beta(x, l) of rows 0..3.
template <int R>
KVQ_INT_INLINE inline __m512i int_interleave(const IntState& S, const std::uint8_t* rows, int x) noexcept {
  if constexpr (R <= 32) {
    const __m512i idx = _mm512_load_si512(S.vidx[x]);
    if constexpr (R == 16) return _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(rows));
    else return _mm512_permutex2var_epi8(_mm512_loadu_si512(rows), idx, _mm512_loadu_si512(rows + 64));
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
  constexpr int G = NV / 2;                 // value groups of 32 per row
  constexpr int F = 8 / VB, R = 2 * NV * VB, NX = R / 16;  // fields per byte, bytes per row, byte vectors
  constexpr bool wide = VB == 8;            // 8-bit codes take the unsigned side; weights are s8
  const float levels = weight_levels(VB), mid = reference::mid_code(v.spec);
  // Scales and centre values of the tile's rows, lanes ordered (quad, group, row).
  const std::size_t nvec = n * G / 16, pi = v.param_index(a);
  const __m512i tp = _mm512_load_si512(S.tperm);
  for (std::size_t i = 0; i < nvec; ++i) {
    const __m512 s = load16(v.spec.param, v.scales, pi + 16 * i);
    _mm512_store_ps(S.st[i], _mm512_permutexvar_ps(tp, s));
    _mm512_store_ps(S.zt[i], v.zeros != nullptr ? _mm512_permutexvar_ps(tp, _mm512_fmadd_ps(s, _mm512_set1_ps(mid), load16(v.spec.param, v.zeros, pi + 16 * i)))
                                                : _mm512_setzero_ps());
  }
  const __m512i pidx = _mm512_load_si512(S.pidx);
  for (int h = 0; h < NH; ++h) {
    const float* p = S.score[h];
    __m512 wmax = _mm512_setzero_ps();
    for (std::size_t i = 0; i < nvec; ++i)
      wmax = _mm512_max_ps(wmax, _mm512_mul_ps(_mm512_permutexvar_ps(pidx, _mm512_loadu_ps(p + i * 16 / G)), _mm512_load_ps(S.st[i])));
    const float wm = _mm512_reduce_max_ps(wmax);
    const __m512 inv = _mm512_set1_ps(wm > 0.0f ? levels / wm : 0.0f);
    __m512i ws = _mm512_setzero_si512();
    __m512 zs = _mm512_setzero_ps();
    for (std::size_t i = 0; i < nvec; ++i) {
      const __m512 pv = _mm512_permutexvar_ps(pidx, _mm512_loadu_ps(p + i * 16 / G));
      const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(pv, _mm512_load_ps(S.st[i])), inv));
      ws = _mm512_add_epi32(ws, r);
      zs = _mm512_fmadd_ps(pv, _mm512_load_ps(S.zt[i]), zs);
      _mm_store_si128(reinterpret_cast<__m128i*>(S.wb[h] + 16 * i), _mm512_cvtusepi32_epi8(r));
    }
    const float b = wm / levels;
    S.beta[h] = b;
    // per group: sum p * (zero + mid * scale) - beta * mid * sum wq (lanes (quad, group, row))
    __m512 c = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ws), _mm512_set1_ps(b * mid), zs);
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
      for (int h = 0; h < NH; ++h)
        wq[h] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S.wb[h] + 4 * G * qd)));
      if (x0 == 0) _mm_prefetch(reinterpret_cast<const char*>(rows + 4 * prefetch_rows * std::size_t(R)), _MM_HINT_T0);
      if (x0 == 0 && 4 * R > 64) _mm_prefetch(reinterpret_cast<const char*>(rows + 4 * prefetch_rows * std::size_t(R) + 64), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int xx = 0; xx < XP; ++xx) {
        const __m512i X = int_interleave<R>(S, rows, x0 + xx);
        __m512i w[NH];
#pragma GCC unroll 4
        for (int h = 0; h < NH; ++h) w[h] = _mm512_permutexvar_epi32(wi[xx], wq[h]);
#pragma GCC unroll 8
        for (int f = 0; f < F; ++f) {
          const __m512i c = wide ? X : _mm512_and_si512(f == 0 ? X : _mm512_srli_epi32(X, unsigned(VB * f)), mask);
#pragma GCC unroll 4
          for (int h = 0; h < NH; ++h)
            acc[h][xx][f] = wide ? _mm512_dpbusd_epi32(acc[h][xx][f], c, w[h]) : _mm512_dpbusd_epi32(acc[h][xx][f], w[h], c);
        }
      }
    }
    for (int h = 0; h < NH; ++h) {
      const __m512 b = _mm512_set1_ps(S.beta[h]), cr = _mm512_set1_ps(S.corr[h]), cv = _mm512_load_ps(S.cg[h]);
      for (int xx = 0; xx < XP; ++xx)
        for (int f = 0; f < F; ++f) {
          const int av = (x0 + xx) * F + f;
          float* o = S.accf[h] + 16 * av;
          const __m512 cgv = _mm512_permutexvar_ps(_mm512_load_si512(S.gsel[av]), cv);
          _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h][xx][f]), b, _mm512_fmadd_ps(_mm512_load_ps(o), cr, cgv)));
        }
    }
  }
}

template <int NV, int KB, int VB, int NH>
KVQ_TARGET_AVX512_ATTENTION void int_tiles(IntState& S, std::size_t a0, std::size_t a1, std::size_t T) noexcept {
  for (std::size_t a = a0; a < a1; a += T) {
    const std::size_t n = a1 - a < T ? a1 - a : T;
    int_keys<NV, KB, NH>(S, a, n);
    int_softmax<NH>(S, n);
    int_values<NV, VB, NH>(S, a, n);
  }
}

/// The packed span [a0, a1) (whole tiles of whole key blocks) for every head of the task.
template <int NV, int KB, int VB>
KVQ_TARGET_AVX512_ATTENTION void int_span_kb_vb(IntState& S, std::size_t a0, std::size_t a1) noexcept {
  const DecodeTask& t = *S.task;
  const std::size_t dim = S.dim, T = tile_tokens(t.keys);
  for (std::size_t h0 = 0; h0 < t.group; h0 += int_heads) {
    const std::size_t nh = t.group - h0 < int_heads ? t.group - h0 : int_heads;
    S.h0 = h0;
    S.nh = nh;
    S.loaded_block = ~std::size_t(0);
    for (std::size_t h = 0; h < nh; ++h) {
      S.mx[h] = t.max[h0 + h];
      S.sm[h] = t.sum[h0 + h];
      for (std::size_t c = 0; c < dim; ++c) S.accf[h][c] = t.acc[(h0 + h) * dim + std::size_t(S.vchan[c])];
    }
    switch (nh) {
      case 4: int_tiles<NV, KB, VB, 4>(S, a0, a1, T); break;
      case 3: int_tiles<NV, KB, VB, 3>(S, a0, a1, T); break;
      case 2: int_tiles<NV, KB, VB, 2>(S, a0, a1, T); break;
      default: int_tiles<NV, KB, VB, 1>(S, a0, a1, T); break;
    }
    for (std::size_t h = 0; h < nh; ++h) {
      t.max[h0 + h] = S.mx[h];
      t.sum[h0 + h] = S.sm[h];
      for (std::size_t c = 0; c < dim; ++c) t.acc[(h0 + h) * dim + std::size_t(S.vchan[c])] = S.accf[h][c];
    }
  }
}

template <int NV, int KB>
KVQ_TARGET_AVX512_ATTENTION void int_span_kb(IntState& S, std::size_t a0, std::size_t a1) noexcept {
  switch (S.vbits) {
    case 2: return int_span_kb_vb<NV, KB, 2>(S, a0, a1);
    case 4: return int_span_kb_vb<NV, KB, 4>(S, a0, a1);
    default: return int_span_kb_vb<NV, KB, 8>(S, a0, a1);
  }
}

template <int NV>
KVQ_TARGET_AVX512_ATTENTION void int_span(const DecodeTask& t, std::size_t a0, std::size_t a1) noexcept {
  thread_local IntState S;
  int_init(S, t);
  switch (S.kbits) {
    case 2: return int_span_kb<NV, 2>(S, a0, a1);
    case 4: return int_span_kb<NV, 4>(S, a0, a1);
    default: return int_span_kb<NV, 8>(S, a0, a1);
  }
}

}  // namespace kvq::inline v0::kernels::attention::avx512::detail

#undef KVQ_INT_INLINE
