#pragma once
// AVX-512 kernel for unquantized caches (fp16 or fp32 rows: the baselines the packed caches
// are compared with, written as well as we can). Included by avx512.hpp.
//
// Per tile of up to 64 positions and up to 4 query heads of the GQA group:
//   keys: each row is converted once (vcvtph2ps) and dotted with every head (8 FMAs per head);
//         the 16 rows' partial vectors of a head are reduced into one vector of 16 scores by a
//         blend-and-swap tree kept in registers (one shuffle per merge);
//   softmax: the heads side by side, weights relative to the tile's maximum;
//   values: each row is converted once per half (64 channels) and multiplied into 4 heads x 4
//           accumulators held in registers over the tile.
// fp32 arithmetic throughout (exact tier).

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvq/kernels/attention/avx512_int.hpp"
#include "kvq/kernels/attention/task.hpp"

#define KVQ_DENSE_INLINE KVQ_TARGET_AVX512_ATTENTION __attribute__((always_inline))

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::attention::avx512::detail {

inline constexpr std::size_t dense_prefetch = 64 * 1024;  // software prefetch into L2, bytes ahead

/// Rows [begin, end) the dense kernel reads, and the next segment's rows where reading ahead
/// goes on past them (read_ahead); empty: no read-ahead.
struct RowRegion {
  const std::uint8_t *begin = nullptr, *end = nullptr, *next = nullptr;
  const std::uint8_t* ahead(const std::uint8_t* row) const noexcept {
    return begin == nullptr ? nullptr : kernels::attention::read_ahead(row, begin, end, next, dense_prefetch);
  }
};

struct DenseState {
  alignas(64) float score[4][64 + 16];
  alignas(16) float mx[4], sm[4];
  alignas(64) float corr[16], scale[16];
};

template <bool Half, int NV>
KVQ_DENSE_INLINE inline void dense_row(const std::uint8_t* row, __m512* x) noexcept {
  for (int i = 0; i < NV; ++i) {
    if constexpr (Half)
      x[i] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * i)));
    else
      x[i] = _mm512_loadu_ps(row + 64 * i);
  }
}

/// Merge of level L (1..4) of the reduction tree: lanes of a and b summed pairwise at distance
/// 2^(L-1); the result keeps a's sums in the lanes whose bit L-1 is 0 and b's in the others.
template <int L>
KVQ_DENSE_INLINE inline __m512 merge(__m512 a, __m512 b) noexcept {
  constexpr __mmask16 m = L == 1 ? 0xAAAA : L == 2 ? 0xCCCC : L == 3 ? 0xF0F0 : 0xFF00;
  const __m512 x = _mm512_mask_blend_ps(m, a, b), y = _mm512_mask_blend_ps(m, b, a);
  __m512 ys;
  if constexpr (L == 1)
    ys = _mm512_permute_ps(y, 0xB1);
  else if constexpr (L == 2)
    ys = _mm512_permute_ps(y, 0x4E);
  else if constexpr (L == 3)
    ys = _mm512_shuffle_f32x4(y, y, 0xB1);
  else
    ys = _mm512_shuffle_f32x4(y, y, 0x4E);
  return _mm512_add_ps(x, ys);
}

/// Scores of rows [0, n) (n <= 16) at `rows` for NH heads: out[h] lane t = q_h . row t.
template <bool Half, int NV, int NH>
KVQ_DENSE_INLINE inline void dense_keys16(const std::uint8_t* rows, std::size_t rb, std::size_t n, const float* q,
                                          float (*out)[64 + 16], std::size_t off, const RowRegion& region) noexcept {
  constexpr std::size_t dim = 16 * NV;
  __m512 l1[NH], l2[NH], l3[NH], l4[NH];
#pragma GCC unroll 8
  for (std::size_t t = 0; t < 16; t += 2) {
    __m512 d[2][NH];
#pragma GCC unroll 2
    for (int u = 0; u < 2; ++u) {
      __m512 x[NV];
      if (t + std::size_t(u) < n) {
        const std::uint8_t* row = rows + (t + std::size_t(u)) * rb;
        if (const std::uint8_t* ahead = region.ahead(row))
          for (std::size_t i = 0; i < rb; i += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T1);
        dense_row<Half, NV>(row, x);
      } else
        for (int i = 0; i < NV; ++i) x[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) {
        const float* qh = q + std::size_t(h) * dim;
        __m512 a0 = _mm512_mul_ps(x[0], _mm512_loadu_ps(qh));
        for (int i = 1; i < NV; ++i) a0 = _mm512_fmadd_ps(x[i], _mm512_loadu_ps(qh + 16 * i), a0);
        d[u][h] = a0;
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const __m512 m1 = merge<1>(d[0][h], d[1][h]);
      if (t % 4 == 0) {
        l1[h] = m1;
        continue;
      }
      const __m512 m2 = merge<2>(l1[h], m1);
      if (t % 8 == 2) {
        l2[h] = m2;
        continue;
      }
      const __m512 m3 = merge<3>(l2[h], m2);
      if (t == 6) {
        l3[h] = m3;
        continue;
      }
      l4[h] = merge<4>(l3[h], m3);
    }
  }
  const __mmask16 valid = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
  for (int h = 0; h < NH; ++h)
    _mm512_store_ps(out[h] + off,
                    _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), l4[h]));
}

/// acc (NH heads, natural channel order) = acc * corr + scale * sum_t p'_t * row_t over the tile.
template <bool Half, int NV, int NH>
KVQ_TARGET_AVX512_ATTENTION inline void dense_values(const DenseState& S, const std::uint8_t* rows, std::size_t rb,
                                                     std::size_t n, float* acc, const RowRegion& region) noexcept {
  constexpr std::size_t dim = 16 * NV;
  constexpr int NQ = NV / 4;  // 64-channel quarters
  for (int u = 0; u < NQ; ++u) {
    __m512 a[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < 4; ++i) a[h][i] = _mm512_setzero_ps();
    for (std::size_t t = 0; t < n; ++t) {
      const std::uint8_t* row = rows + t * rb + (Half ? 128 : 256) * std::size_t(u);
      if (const std::uint8_t* ahead = region.ahead(row))
        for (std::size_t i = 0; i < (Half ? 128u : 256u); i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T1);
      __m512 x[4];
      dense_row<Half, 4>(row, x);
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) {
        const __m512 w = _mm512_set1_ps(S.score[h][t]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) a[h][i] = _mm512_fmadd_ps(x[i], w, a[h][i]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      const __m512 c = _mm512_set1_ps(S.corr[4 * h]), e = _mm512_set1_ps(S.scale[4 * h]);
      float* o = acc + std::size_t(h) * dim + 64 * std::size_t(u);
      for (int i = 0; i < 4; ++i)
        _mm512_storeu_ps(o + 16 * i, _mm512_fmadd_ps(a[h][i], e, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * i), c)));
    }
  }
}

/// Rows [0, n) at krows / vrows (contiguous, rb bytes each), heads [h0, h0 + NH), tiles of 64.
template <bool Half, int NV, int NH>
KVQ_TARGET_AVX512_ATTENTION void dense_run(const DecodeTask& t, std::size_t h0, const std::uint8_t* krows,
                                           const std::uint8_t* vrows, std::size_t rb, std::size_t n,
                                           const RowRegion& kregion, const RowRegion& vregion) noexcept {
  constexpr std::size_t dim = 16 * NV;
  DenseState S;
  for (int h = 0; h < 4; ++h) S.mx[h] = S.sm[h] = 0.0f;
  for (int h = 0; h < NH; ++h) {
    S.mx[h] = t.max[h0 + std::size_t(h)];
    S.sm[h] = t.sum[h0 + std::size_t(h)];
  }
  for (std::size_t a = 0; a < n; a += 64) {
    const std::size_t m = n - a < 64 ? n - a : 64, mr = (m + 15) / 16 * 16;
    for (std::size_t o = 0; o < m; o += 16) {
      const std::uint8_t* r = krows + (a + o) * rb;
      dense_keys16<Half, NV, NH>(r, rb, m - o < 16 ? m - o : 16, t.queries + h0 * dim, S.score, o, kregion);
    }
    tile_softmax<NH, true>(S, mr, t.softcap);  // partial 16-row steps pad with -inf
    dense_values<Half, NV, NH>(S, vrows + a * rb, rb, m, t.acc + h0 * dim, vregion);
  }
  for (int h = 0; h < NH; ++h) {
    t.max[h0 + std::size_t(h)] = S.mx[h];
    t.sum[h0 + std::size_t(h)] = S.sm[h];
  }
}

template <bool Half, int NV>
KVQ_TARGET_AVX512_ATTENTION void dense_rows(const DecodeTask& t, const std::uint8_t* krows, const std::uint8_t* vrows,
                                            std::size_t rb, std::size_t n, const RowRegion& kregion,
                                            const RowRegion& vregion) noexcept {
  for (std::size_t h0 = 0; h0 < t.group; h0 += register_heads)
    with_heads(t.group - h0, [&]<int NH>() { dense_run<Half, NV, NH>(t, h0, krows, vrows, rb, n, kregion, vregion); });
}

/// Both streams unquantized with the same residual type: the dense kernel takes the task.
inline bool dense_supported(const DecodeTask& t) noexcept {
  const StreamView &k = t.keys, &v = t.values;
  return !k.quantized && !v.quantized && t.rope == nullptr && k.residual == v.residual &&
         (k.residual == Scalar::f16 || k.residual == Scalar::f32) && k.ring_rows == v.ring_rows &&
         k.sinks_stored == v.sinks_stored && k.first_quantized == v.first_quantized && k.ring_origin == v.ring_origin;
}

/// Positions [a, b): sink rows, then pending rows split where the ring wraps.
template <int NV>
KVQ_TARGET_AVX512_ATTENTION void dense_span(const DecodeTask& t, std::size_t a, std::size_t b) noexcept {
  const StreamView &k = t.keys, &v = t.values;
  const std::size_t rb = k.residual_row_bytes();
  const bool half = k.residual == Scalar::f16;
  auto run = [&](const std::uint8_t* kr, const std::uint8_t* vr, std::size_t n, const RowRegion& kregion,
                 const RowRegion& vregion) {
    if (half)
      dense_rows<true, NV>(t, kr, vr, rb, n, kregion, vregion);
    else
      dense_rows<false, NV>(t, kr, vr, rb, n, kregion, vregion);
  };
  // Read-ahead stays within the ring and goes on into the next segment's (sinks: no read-ahead).
  const RowRegion kring{k.ring, k.ring + k.ring_rows * rb, t.next_keys},
      vring{v.ring, v.ring + v.ring_rows * rb, t.next_values};
  while (a < b) {
    if (a < k.sinks_stored) {
      const std::size_t e = b < k.sinks_stored ? b : k.sinks_stored;
      run(k.sink_row(a), v.sink_row(a), e - a, RowRegion{}, RowRegion{});
      a = e;
      continue;
    }
    const std::size_t idx = (a - k.ring_origin) % k.ring_rows, room = k.ring_rows - idx;
    // dense_run tiles by 64 rows from where it starts: start on the ring's 64-row grid, so a
    // stream read in blocks (block_unit: whole 64s) gives the bits of one read in one piece.
    const std::size_t off_grid = (a - k.ring_origin) % 64;
    std::size_t e = b - a < room ? b : a + room;
    if (off_grid != 0 && e - a > 64 - off_grid) e = a + (64 - off_grid);
    run(k.pending_row(a), v.pending_row(a), e - a, kring, vring);
    a = e;
  }
}

}  // namespace kvq::inline v0::kernels::attention::avx512::detail

KVQ_INTRINSIC_WARNINGS_ON

#undef KVQ_DENSE_INLINE
