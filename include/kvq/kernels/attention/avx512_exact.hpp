#pragma once
// AVX-512 exact-tier kernel for the packed span of a task (keys quantized per channel, pre-RoPE
// keys through avx512_rope.hpp,
// 2/3/4/8 bits, blocks of a multiple of 16; values per token, 2/3/4/8 bits, groups of 32; head_dim
// 64 or 128): the structure of the integer kernel (avx512_int.hpp) with fp32 arithmetic. It also
// runs integer-tier tasks of 3-bit codes, which the integer kernel does not unpack
// (avx512::exact_for_integer).
//   keys: the transposed codes (one row per lane) are converted field by field to fp32 (a shift
//         and a vpermps table lookup for 2, 3 and 4 bits, where 3-bit fields crossing a dword
//         take a second shift; mask and convert for 8; the table holds
//         the codes, or the levels of a level table, whose zero is 0: code_values) and
//         multiplied with the block-folded query q~ = q * scale broadcast per channel, so the 16
//         scores of a head accumulate in one vector (two, alternating); bias q.zero per block
//         and head;
//   values: each row is converted to fp32 once, 16 channels at a time (the same lookup, after
//           a variable shift, or for 3 bits a vpmultishiftqb), and multiplied with the weights
//           w = p * scale of 4 heads (registers over the tile); the zero points add sum p * zero
//           per group.
// Matches the reference attention to fp32 rounding.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/kernels/attention/avx512_int.hpp"
#include "kvq/kernels/attention/task.hpp"

#define KVQ_EXACT_INLINE KVQ_TARGET_AVX512_ATTENTION __attribute__((always_inline))

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::attention::avx512::detail {

struct ExactState {
  alignas(64) float qf[max_tile / 16][register_heads][max_head_dim];  // folded queries per block slot
  alignas(64) float bias[max_tile / 16][16];                          // lane 4h
  alignas(64) float w[register_heads][max_tile * 4 + 16];             // p' * scale per (row, group)
  alignas(64) float zs[register_heads][4];                            // sum p' * zero per group
};

/// The calling thread's scratch (one per thread, not one per kernel instantiation: thread-local
/// storage comes out of every thread's stack).
inline ExactState& exact_state() noexcept {
  thread_local ExactState state;
  return state;
}

/// Codes the exact kernel unpacks, keys and values: fast_bits, and 3 bits (eight codes in three
/// bytes, read in channel order; the integer kernel's byte fields need widths that divide 8).
inline bool exact_bits(const QuantizerSpec& spec) noexcept { return fast_bits(spec) || spec.bits == 3; }

/// The exact span kernel reads the task's layout (kernel_for and decode_task say for which tiers).
inline bool exact_supported(const DecodeTask& t) noexcept {
  const StreamView &k = t.keys, &v = t.values;
  const std::size_t d = k.head_dim;
  if ((d != 64 && d != 128) || v.head_dim != d) return false;
  if (!k.quantized || k.spec.axis != Axis::per_channel || !exact_bits(k.spec) || k.spec.group % 16 != 0 ||
      k.spec.group > max_tile)
    return false;
  if (!v.quantized || v.spec.axis != Axis::per_token || !exact_bits(v.spec) || v.spec.group != 32) return false;
  return v.first_quantized == k.first_quantized;  // the span ends where either stream's packed rows do
}

template <int NV, int NH>
KVQ_EXACT_INLINE inline void exact_fold(const IntState& S, ExactState& E, std::size_t blk, std::size_t slot) noexcept {
  const StreamView& k = S.task->keys;
  const std::size_t pi = blk * S.dim;
  const __m512i perm = _mm512_load_si512(S.kperm);
  __m512 bs[4];
  for (int h = 0; h < 4; ++h) bs[h] = _mm512_setzero_ps();
  for (int i = 0; i < NV; ++i) {
    const __m512 s = _mm512_permutexvar_ps(perm, load16(k.spec.param, k.scales, pi + 16 * std::size_t(i)));
    const __m512 z = k.zeros != nullptr
                         ? _mm512_permutexvar_ps(perm, load16(k.spec.param, k.zeros, pi + 16 * std::size_t(i)))
                         : _mm512_mul_ps(s, _mm512_set1_ps(reference::implied_zero(k.spec)));
    for (int h = 0; h < NH; ++h) {
      const __m512 q = _mm512_load_ps(S.qp[S.h0 + std::size_t(h)] + 16 * i);
      _mm512_store_ps(E.qf[slot][h] + 16 * i, _mm512_mul_ps(q, s));
      bs[h] = _mm512_fmadd_ps(q, z, bs[h]);
    }
  }
  _mm512_store_ps(E.bias[slot], reduce4<false>(bs[0], bs[1], bs[2], bs[3]));
}

/// Shift counts that bring 16 value codes of B bits to the low bits of the lanes by one variable
/// shift of their broadcast 2B bytes. 2 bits: dword lane l by 2l, so lane l holds code l. 4 bits:
/// qword lane j by 4j (vpsrlvq), so dword lane 2j holds code j and lane 2j + 1 code 8 + j; `lane`
/// gives the lane of each code, to put the channels back in order once per tile. (3 bits:
/// value_select3; their channels come out in order.)
template <int B>
struct ValueLanes {
  alignas(64) std::int32_t shift[16];
  alignas(64) std::int32_t lane[16];
};

template <int B>
inline constexpr ValueLanes<B> value_lanes = [] {
  ValueLanes<B> v{};
  for (int l = 0; l < 16; ++l) {
    v.shift[l] = B == 2 ? 2 * l : l % 2 == 0 ? 2 * l : 0;  // B = 4: the low dword of qword count 4j
    v.lane[l] = B == 2 ? l : l < 8 ? 2 * l : 2 * (l - 8) + 1;
  }
  return v;
}();

/// vpmultishiftqb controls for 3-bit value codes: 16 codes fill 6 bytes, loaded as a qword
/// broadcast to every lane; dword lane l takes the 8 bits from bit 3l of its qword (vpermps reads
/// the low 4). `control[1]` serves a qword loaded 2 bytes early (the last 16 codes of a run of 64,
/// so that no load reads past the run's 24 bytes): from bit 3l + 16.
struct ValueSelect3 {
  alignas(64) std::uint8_t control[2][64];
};

inline constexpr ValueSelect3 value_select3 = [] {
  ValueSelect3 s{};
  for (int e = 0; e < 2; ++e)
    for (int l = 0; l < 16; ++l) s.control[e][4 * l] = std::uint8_t(3 * l + 16 * e);
  return s;
}();

/// Scores of the 16 positions at s0 (exact): score[h][off ..].
template <int NV, int KB, int NH>
KVQ_EXACT_INLINE inline void exact_keys16(IntState& S, const ExactState& E, std::size_t s0, std::size_t off,
                                          std::size_t slot) noexcept {
  const StreamView& k = S.task->keys;
  constexpr int F = 8 / KB, R = 2 * NV * KB, ND = R / 4;
  const std::uint8_t* rows = k.code_row(s0);
  if (const std::uint8_t* ahead = read_ahead(k, rows, S.task->next_keys))
    for (int i = 0; i < R / 4; ++i)  // 16 rows = 4R bytes, into L2 (see avx512_int.hpp)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * std::size_t(i)), _MM_HINT_T1);
  // Two accumulators per head (by byte of the dword): with one, each head's chain of dependent
  // FMAs, not the ports, set the pace.
  __m512 acc[2][NH];
  for (int a = 0; a < 2; ++a)
    for (int h = 0; h < NH; ++h) acc[a][h] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32((1 << KB) - 1);
  const __m512 table = _mm512_load_ps(S.kcode);
  const float* qbase = E.qf[slot][0];
  __asm__("" : "+r"(qbase));
#define KVQ_EXACT_DOTS(T, j)                                                                                     \
  _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {                                                          \
    _Pragma("GCC unroll 4") for (int f = 0; f < F; ++f) {                                                        \
      const int sh = 8 * i + KB * f;                                                                             \
      const __m512i ci = sh == 0 ? (T) : _mm512_srli_epi32((T), unsigned(sh));                                   \
      const __m512 c = KB < 8          ? _mm512_permutexvar_ps(ci, table)                                        \
                       : sh + KB == 32 ? _mm512_cvtepi32_ps(ci)                                                  \
                                       : _mm512_cvtepi32_ps(_mm512_and_si512(ci, mask));                         \
      _Pragma("GCC unroll 4") for (int h = 0; h < NH; ++h) acc[i % 2][h] = _mm512_fmadd_ps(                      \
          c, _mm512_set1_ps(qbase[max_head_dim * std::size_t(h) + 4 * std::size_t((j)*F + f) + std::size_t(i)]), \
          acc[i % 2][h]);                                                                                        \
    }                                                                                                            \
  }
  if constexpr (KB == 3) {  // channel order (key_channel); a field may cross into the next dword
    __m512i z[16];
    transposed_dwords<R>(rows, 0, z);
#pragma GCC unroll 128
    for (int c = 0; c < 16 * NV; ++c) {
      const __m512 x = _mm512_permutexvar_ps(code_field<3>(z, std::size_t(c)), table);
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h)
        acc[c % 2][h] =
            _mm512_fmadd_ps(x, _mm512_set1_ps(qbase[max_head_dim * std::size_t(h) + std::size_t(c)]), acc[c % 2][h]);
    }
  } else if constexpr (ND <= 8) {
    __m512i z[8];
    transposed_dwords<R>(rows, 0, z);
    for (int j = 0; j < ND; ++j) KVQ_EXACT_DOTS(z[j], j)
  } else {
    for (int half = 0; half < ND / 16; ++half) {
      __m512i r[16];
      transposed_dwords<R>(rows, half, r);
      for (int j = 0; j < 16; ++j) KVQ_EXACT_DOTS(r[j], 16 * half + j)
    }
  }
#undef KVQ_EXACT_DOTS
  for (int h = 0; h < NH; ++h)
    _mm512_store_ps(S.score[h] + off,
                    _mm512_add_ps(_mm512_add_ps(acc[0][h], acc[1][h]), _mm512_set1_ps(E.bias[slot][4 * h])));
}

/// Value codes of VB = 2 or 4 bits as fp32, 16 channels at a time: the 2 VB bytes that hold them
/// are broadcast by the load, one variable shift (value_lanes) brings each code to the low bits of
/// its lane, and vpermps looks it up in S.vcode (code_values: its 2-bit table repeats with period
/// 4, so the bits above need no mask). 4-bit codes come out in the lane order of value_lanes<4>.lane. On Zen 4
/// the shifts issue beside the FMAs; vpmultishiftqb, used here before, takes a slot of the FMA
/// pipes (bench_pipes).
template <int VB>
KVQ_EXACT_INLINE inline __m512 value_codes16(const std::uint8_t* bytes, __m512i shift, __m512 table) noexcept {
  std::uint64_t raw = 0;
  std::memcpy(&raw, bytes, 2 * VB);
  const __m512i codes = VB == 4 ? _mm512_srlv_epi64(_mm512_set1_epi64(std::int64_t(raw)), shift)
                                : _mm512_srlv_epi32(_mm512_set1_epi32(std::int32_t(raw)), shift);
  return _mm512_permutexvar_ps(codes, table);
}

/// P.V of the tile (exact): task.acc (natural channel order) = acc * corr + e * sum_t p'_t v_t.
template <int NV, int VB, int NH>
KVQ_TARGET_AVX512_ATTENTION inline void exact_values(IntState& S, ExactState& E, std::size_t a,
                                                     std::size_t n) noexcept {
  const StreamView& v = S.task->values;
  constexpr int G = NV / 2;
  constexpr std::size_t dim = 16 * NV;
  const std::size_t pi = v.param_index(a);
  // weights p' * scale per (row, group) and sum p' * zero per group; lanes (row, group)
  alignas(64) static constexpr std::int32_t rowof2[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
  alignas(64) static constexpr std::int32_t rowof4[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
  const __m512i rowof = _mm512_load_si512(G == 4 ? rowof4 : rowof2);
  const std::size_t nvec = n * G / 16;
  __m512 zacc[NH];
  for (int h = 0; h < NH; ++h) zacc[h] = _mm512_setzero_ps();
  for (std::size_t i = 0; i < nvec; ++i) {
    const __m512 sv = load16(v.spec.param, v.scales, pi + 16 * i);
    const __m512 zv = v.zeros != nullptr ? load16(v.spec.param, v.zeros, pi + 16 * i)
                                         : _mm512_mul_ps(sv, _mm512_set1_ps(reference::implied_zero(v.spec)));
    for (int h = 0; h < NH; ++h) {
      const __m512 pv = _mm512_permutexvar_ps(rowof, _mm512_loadu_ps(S.score[h] + i * 16 / G));
      _mm512_store_ps(E.w[h] + 16 * i, _mm512_mul_ps(pv, sv));
      zacc[h] = _mm512_fmadd_ps(pv, zv, zacc[h]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    __m512 c = _mm512_add_ps(zacc[h], _mm512_shuffle_f32x4(zacc[h], zacc[h], 0x4E));
    c = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0xB1));
    if constexpr (G == 2) c = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4E));
    _mm_store_ps(E.zs[h], _mm512_castps512_ps128(c));
  }
  const std::uint8_t* base = v.code_row(a);
  const __m512i shift = _mm512_load_si512(value_lanes < VB == 4 ? 4 : 2 >.shift);
  const __m512i lane = _mm512_load_si512(value_lanes < VB == 4 ? 4 : 2 >.lane);
  const __m512 table = _mm512_load_ps(S.vcode);
  const __m512i select3 = _mm512_load_si512(value_select3.control[0]),
                select3_late = _mm512_load_si512(value_select3.control[1]);
  for (unsigned u = 0; u < unsigned(NV / 4); ++u) {
    __m512 acc[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < 4; ++i) acc[h][i] = _mm512_setzero_ps();
    for (std::size_t t = 0; t < n; ++t) {
      const std::uint8_t* row = base + t * v.row_bytes;
      if constexpr (VB == 3) {  // rows of 48 or 24 bytes: also those that cross into a line (its last byte's)
        const std::size_t at = t * v.row_bytes % 64;
        if (u == 0 && (at == 0 || at + v.row_bytes > 64))
          if (const std::uint8_t* ahead = read_ahead(v, row, S.task->next_values))
            _mm_prefetch(reinterpret_cast<const char*>(ahead + v.row_bytes - 1), _MM_HINT_T1);
      } else if (u == 0 && (t * v.row_bytes) % 64 == 0) {
        if (const std::uint8_t* ahead = read_ahead(v, row, S.task->next_values))
          _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
      }
      __m512 x[4];
      if constexpr (VB == 8) {
        for (int i = 0; i < 4; ++i)
          x[i] = _mm512_cvtepi32_ps(
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 64 * u + 16 * unsigned(i)))));
      } else if constexpr (VB == 3) {  // 16 codes in 6 bytes: one broadcast qword, one vpmultishiftqb
        for (int i = 0; i < 4; ++i) {
          std::uint64_t raw = 0;
          std::memcpy(&raw, row + 24 * u + (i < 3 ? 6 * unsigned(i) : 16), 8);
          x[i] = _mm512_permutexvar_ps(
              _mm512_multishift_epi64_epi8(i < 3 ? select3 : select3_late, _mm512_set1_epi64(std::int64_t(raw))),
              table);
        }
      } else {
        for (int i = 0; i < 4; ++i) x[i] = value_codes16<VB>(row + (64 * u + 16 * unsigned(i)) * VB / 8, shift, table);
      }
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
          acc[h][i] =
              _mm512_fmadd_ps(x[i], _mm512_set1_ps(E.w[h][t * G + (64 * u + 16 * unsigned(i)) / 32]), acc[h][i]);
    }
    for (int h = 0; h < NH; ++h) {
      const __m512 cr = _mm512_set1_ps(S.corr[4 * h]), e = _mm512_set1_ps(S.scale[4 * h]);
      float* o = S.task->acc + (S.h0 + std::size_t(h)) * dim + 64 * u;
      for (int i = 0; i < 4; ++i) {
        const __m512 sum = VB == 4 ? _mm512_permutexvar_ps(lane, acc[h][i]) : acc[h][i];  // channel order
        const __m512 tile = _mm512_add_ps(sum, _mm512_set1_ps(E.zs[h][(64 * u + 16 * unsigned(i)) / 32]));
        _mm512_storeu_ps(o + 16 * i, _mm512_fmadd_ps(tile, e, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * i), cr)));
      }
    }
  }
}

template <int NV, int KB, int VB, int NH>
KVQ_TARGET_AVX512_ATTENTION void exact_tiles(IntState& S, ExactState& E, std::size_t a0, std::size_t a1,
                                             std::size_t T) noexcept {
  const StreamView& k = S.task->keys;
  const std::size_t g = k.spec.group;
  RopeKeyState& P = rope_key_state(true);
  for (std::size_t a = a0; a < a1; a += T) {
    const std::size_t n = a1 - a < T ? a1 - a : T;
    if (S.task->rope != nullptr) {
      rope_keys<NV, KB, NH>(S, P, a, n);
    } else {
      const std::size_t b0 = (a - k.first_quantized) / g, b1 = (a + n - 1 - k.first_quantized) / g;
      for (std::size_t b = b0; b <= b1; ++b) exact_fold<NV, NH>(S, E, b, b - b0);
      for (std::size_t o = 0; o < n; o += 16)
        exact_keys16<NV, KB, NH>(S, E, a + o, o, (a + o - k.first_quantized) / g - b0);
    }
    tile_softmax<NH>(S, n, S.task->softcap);
    exact_values<NV, VB, NH>(S, E, a, n);
  }
}

/// The exact kernel accumulates in the task's output directly.
template <int NV, int KB, int VB>
struct ExactSpan {
  static constexpr bool three_bit_codes = true;
  KVQ_TARGET_AVX512_ATTENTION static void load(IntState&) noexcept {}
  KVQ_TARGET_AVX512_ATTENTION static void store(IntState&) noexcept {}
  template <int NH>
  KVQ_TARGET_AVX512_ATTENTION static void tiles(IntState& S, std::size_t a0, std::size_t a1, std::size_t T) noexcept {
    exact_tiles<NV, KB, VB, NH>(S, exact_state(), a0, a1, T);
  }
};

template <int NV>
KVQ_TARGET_AVX512_ATTENTION void exact_span(const DecodeTask& t, std::size_t a0, std::size_t a1) noexcept {
  run_span<ExactSpan, NV>(t, a0, a1);
}

}  // namespace kvq::inline v0::kernels::attention::avx512::detail

KVQ_INTRINSIC_WARNINGS_ON

#undef KVQ_EXACT_INLINE
