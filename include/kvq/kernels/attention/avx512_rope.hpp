#pragma once
// AVX-512 key scores for keys stored before RoPE, quantized per channel (2, 3, 4 or 8 bits, blocks of
// a multiple of 16 positions, head_dim 64 or 128, every channel rotated): the key stage of the
// integer and exact kernels when the cache rotates keys after dequantization.
//
//   score(u + t) = q . R(u + t) k = (R(u)^T q) . (R(t) k)
// Positions are taken in rotation units (32 or 16 positions of one key block). Per unit
// the query heads are rotated back to its first position u once (from the table's row u), and
// each key is rotated by its step t from RopeTable::step_cos/step_sin, 16 KB that stay in L1.
// The rotation of a key is shared by every query head of the GQA group.
//
// Codes: 16 rows transposed as dwords (one row per lane, avx512_int.hpp). A 2/3/4-bit field
// dequantizes with one shift (two and an or where a 3-bit field crosses a dword) and one vpermps
// from a per-channel table of zero + scale * code (scale * level for a level table; vpermps reads
// the low 4 bits of each lane, so narrower tables repeat with period 2^bits and no mask is
// needed); 8-bit fields convert and multiply-add. Each rotated pair multiplies into the 16 scores
// of every head (fp32 FMAs, the query channel broadcast from memory).
//
// Both tiers take these fp32 scores (reference.hpp: the integer tier quantizes post-RoPE keys
// only). Rounding the rotated keys to int8 for vpdpbusd was measured at 3% faster on Zen 4 and
// raised the integer tier's error by half: per channel pair and 16 positions the kernel spends
// 2 shifts, 2 vpermps and 4 multiply-adds on dequantizing and rotating before any dot product, and
// the conversion and packing to bytes cost what the int8 dot products save.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kvq/kernels/attention/avx512_int.hpp"
#include "kvq/kernels/attention/task.hpp"
#include "kvq/rope/rope.hpp"

#define KVQ_ROPE_INLINE KVQ_TARGET_AVX512_ATTENTION __attribute__((always_inline))

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::attention::avx512::detail {

static_assert(RopeTable::steps >= 32, "rotation units of 32 positions need 32 steps");

/// Per-task scratch of the pre-RoPE key stage.
struct RopeKeyState {
  alignas(64) float lut[max_head_dim][16];  // zero + scale * code per channel (2/3/4 bits)
  alignas(64) float scale[max_head_dim], zero[max_head_dim];
  alignas(64) float qr[register_heads][max_head_dim];     // query heads rotated back to the unit's start
  alignas(64) std::uint32_t codes[max_head_dim / 4][16];  // transposed dwords of 16 rows
  std::size_t block = ~std::size_t(0);                    // key block whose tables are loaded
};

/// Dequantization tables of key block `blk`; `codes`: what each code stands for (code_values).
template <int NV, int KB>
KVQ_ROPE_INLINE inline void rope_key_tables(const StreamView& k, RopeKeyState& P, std::size_t blk,
                                            const float* codes) noexcept {
  constexpr std::size_t dim = 16 * NV;
  const std::size_t pi = blk * dim;
  const float implied = reference::implied_zero(k.spec);
  __m512 s[NV], z[NV];
  for (int i = 0; i < NV; ++i) {
    s[i] = load16(k.spec.param, k.scales, pi + 16 * std::size_t(i));
    z[i] = k.zeros != nullptr ? load16(k.spec.param, k.zeros, pi + 16 * std::size_t(i))
                              : _mm512_mul_ps(s[i], _mm512_set1_ps(implied));
  }
  for (int i = 0; i < NV; ++i) {
    _mm512_store_ps(P.scale + 16 * i, s[i]);
    _mm512_store_ps(P.zero + 16 * i, z[i]);
  }
  if constexpr (KB < 8) {
    const __m512 code = _mm512_load_ps(codes);
    for (std::size_t c = 0; c < dim; ++c)
      _mm512_store_ps(P.lut[c], _mm512_fmadd_ps(code, _mm512_set1_ps(P.scale[c]), _mm512_set1_ps(P.zero[c])));
  }
}

/// P.qr[h] = R(p)^T q for heads [h0, h0 + NH): the query heads rotated back by position p.
template <int NV, int NH, bool HalfSplit>
KVQ_ROPE_INLINE inline void rope_rotate_queries_back(const IntState& S, RopeKeyState& P, const RopeTable& rope,
                                                     std::size_t p) noexcept {
  constexpr std::size_t dim = 16 * NV;
  const float* cs = rope.cos_row(p);
  const float* sn = rope.sin_row(p);
  const float* q0 = S.task->queries + S.h0 * dim;
  if constexpr (HalfSplit) {
    for (int i = 0; i < NV / 2; ++i) {
      const __m512 c = _mm512_loadu_ps(cs + 16 * i), s = _mm512_loadu_ps(sn + 16 * i);
      for (int h = 0; h < NH; ++h) {
        const float* q = q0 + std::size_t(h) * dim;
        const __m512 a = _mm512_loadu_ps(q + 16 * i), b = _mm512_loadu_ps(q + dim / 2 + 16 * i);
        _mm512_store_ps(P.qr[h] + 16 * i, _mm512_fmadd_ps(a, c, _mm512_mul_ps(b, s)));
        _mm512_store_ps(P.qr[h] + dim / 2 + 16 * i, _mm512_fmsub_ps(b, c, _mm512_mul_ps(a, s)));
      }
    }
  } else {
    // lanes (2i, 2i + 1) hold pair i: even lanes a c + b s, odd lanes b c - a s
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int i = 0; i < NV; ++i) {
      const __m512 c = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(cs + 8 * i)));
      const __m512 s = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(sn + 8 * i)));
      for (int h = 0; h < NH; ++h) {
        const __m512 x = _mm512_loadu_ps(q0 + std::size_t(h) * dim + 16 * i);
        _mm512_store_ps(P.qr[h] + 16 * i, _mm512_fmsubadd_ps(x, c, _mm512_mul_ps(_mm512_permute_ps(x, 0xB1), s)));
      }
    }
  }
}

/// Channel c of the 16 transposed rows, dequantized (one lane per row).
template <int KB>
KVQ_ROPE_INLINE inline __m512 rope_key_channel(const RopeKeyState& P, std::size_t c) noexcept {
  __m512i v;
  if constexpr (KB == 3) {  // a field may cross into the next dword
    v = code_field<3>(reinterpret_cast<const __m512i*>(P.codes), c);
  } else {
    constexpr std::size_t per_dword = 32 / KB;
    const unsigned shift = unsigned(KB * (c % per_dword));
    const __m512i d = _mm512_load_si512(P.codes[c / per_dword]);
    v = shift == 0 ? d : _mm512_srli_epi32(d, shift);
  }
  if constexpr (KB < 8) {
    return _mm512_permutexvar_ps(v, _mm512_load_ps(P.lut[c]));
  } else {
    const __m512i code = c % 4 == 3 ? v : _mm512_and_si512(v, _mm512_set1_epi32(0xFF));  // the top byte: no mask
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), _mm512_set1_ps(P.scale[c]), _mm512_set1_ps(P.zero[c]));
  }
}

/// Pair i of the 16 keys rotated by steps [t0, t0 + 16): y0 (first channel), y1 (second).
template <int KB, int NV, bool HalfSplit>
KVQ_ROPE_INLINE inline void rope_key_pair(const RopeKeyState& P, const RopeTable& rope, std::size_t i, std::size_t t0,
                                          __m512& y0, __m512& y1) noexcept {
  constexpr std::size_t dim = 16 * NV;
  const __m512 x0 = rope_key_channel<KB>(P, HalfSplit ? i : 2 * i);
  const __m512 x1 = rope_key_channel<KB>(P, HalfSplit ? i + dim / 2 : 2 * i + 1);
  const __m512 cs = _mm512_loadu_ps(rope.step_cos(i) + t0), sn = _mm512_loadu_ps(rope.step_sin(i) + t0);
  y0 = _mm512_fmsub_ps(x0, cs, _mm512_mul_ps(x1, sn));
  y1 = _mm512_fmadd_ps(x0, sn, _mm512_mul_ps(x1, cs));
}

/// 16 rows at `rows` transposed into P.codes.
template <int NV, int KB>
KVQ_ROPE_INLINE inline void rope_load_codes(RopeKeyState& P, const std::uint8_t* rows,
                                            const std::uint8_t* ahead) noexcept {
  constexpr int R = 2 * NV * KB, ND = R / 4;
  if (ahead != nullptr)
    for (int i = 0; i < R / 4; ++i)  // 16 rows = 4R bytes, into L2 (see avx512_int.hpp)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * std::size_t(i)), _MM_HINT_T1);
  for (int half = 0; half < (ND + 15) / 16; ++half) {
    __m512i r[16];
    transposed_dwords<R>(rows, half, r);
    for (int j = 0; j < (ND < 16 ? ND : 16); ++j) _mm512_store_si512(P.codes[16 * half + j], r[j]);
  }
}

/// Scores of the 16 positions at steps [t0, t0 + 16) of the unit into S.score[h][off ..].
template <int NV, int KB, int NH, bool HalfSplit>
KVQ_ROPE_INLINE inline void rope_keys16(IntState& S, const RopeKeyState& P, const RopeTable& rope, std::size_t t0,
                                        std::size_t off) noexcept {
  constexpr std::size_t dim = 16 * NV, pairs = 8 * NV;
  // Pairs per dword (3 bits: per 3 dwords), so that the shifts stay immediates.
  constexpr std::size_t per_step = KB == 3 ? (HalfSplit ? 32 : 16) : HalfSplit ? 32 / KB : 16 / KB;
  __m512 acc[NH];
  for (int h = 0; h < NH; ++h) acc[h] = _mm512_setzero_ps();
  for (std::size_t i0 = 0; i0 < pairs; i0 += per_step) {
#pragma GCC unroll 32
    for (std::size_t u = 0; u < per_step; ++u) {
      const std::size_t i = i0 + u, c0 = HalfSplit ? i : 2 * i, c1 = HalfSplit ? i + dim / 2 : 2 * i + 1;
      __m512 y0, y1;
      rope_key_pair<KB, NV, HalfSplit>(P, rope, i, t0, y0, y1);
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) {
        acc[h] = _mm512_fmadd_ps(y0, _mm512_set1_ps(P.qr[h][c0]), acc[h]);
        acc[h] = _mm512_fmadd_ps(y1, _mm512_set1_ps(P.qr[h][c1]), acc[h]);
      }
    }
  }
  for (int h = 0; h < NH; ++h) _mm512_store_ps(S.score[h] + off, acc[h]);
}

template <int NV, int KB, int NH, bool HalfSplit>
KVQ_TARGET_AVX512_ATTENTION inline void rope_keys_style(IntState& S, RopeKeyState& P, std::size_t a,
                                                        std::size_t n) noexcept {
  const StreamView& k = S.task->keys;
  const RopeTable& rope = *S.task->rope;
  // Units of 32 positions (16 when blocks are not a multiple of 32): measured 10% faster than 16.
  const std::size_t unit = k.spec.group % 32 == 0 ? 32 : 16, row_bytes = rope.pairs() * sizeof(float);
  for (std::size_t o = 0; o < n; o += 16) {
    const std::size_t s = a + o, from_block = (s - k.first_quantized) % k.spec.group;
    const std::size_t blk = (s - k.first_quantized) / k.spec.group, t0 = from_block % unit, u = s - t0;
    if (blk != P.block) {
      rope_key_tables<NV, KB>(k, P, blk, S.kcode);
      P.block = blk;
    }
    if (t0 == 0) {
      // Table rows are read a unit apart: too sparse for the hardware prefetcher, from DRAM.
      if (u + 2 * unit < rope.max_positions())
        for (std::size_t b = 0; b < row_bytes; b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(rope.cos_row(u + 2 * unit)) + b, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(rope.sin_row(u + 2 * unit)) + b, _MM_HINT_T0);
        }
      rope_rotate_queries_back<NV, NH, HalfSplit>(S, P, rope, u);
    }
    rope_load_codes<NV, KB>(P, k.code_row(s), read_ahead(k, k.code_row(s), S.task->next_keys));
    rope_keys16<NV, KB, NH, HalfSplit>(S, P, rope, t0, o);
  }
}

/// Scores of the tile [a, a + n) (whole key blocks) for the task's current heads.
template <int NV, int KB, int NH>
KVQ_TARGET_AVX512_ATTENTION inline void rope_keys(IntState& S, RopeKeyState& P, std::size_t a, std::size_t n) noexcept {
  if (S.task->rope->config().style == RopeStyle::half_split)
    rope_keys_style<NV, KB, NH, true>(S, P, a, n);
  else
    rope_keys_style<NV, KB, NH, false>(S, P, a, n);
}

/// The calling thread's scratch; `reset` forgets the loaded key block (a new task or head pass).
inline RopeKeyState& rope_key_state(bool reset) noexcept {
  thread_local RopeKeyState state;
  if (reset) state.block = ~std::size_t(0);
  return state;
}

}  // namespace kvq::inline v0::kernels::attention::avx512::detail

KVQ_INTRINSIC_WARNINGS_ON

#undef KVQ_ROPE_INLINE
