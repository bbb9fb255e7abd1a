#pragma once
// Minimum and maximum of many groups at once. Each group's lanes are first folded into one min and
// one max vector; a transposing tree then halves the lanes per group while it doubles the groups
// per vector, so 16 groups cost 15 shuffle-pair steps per tree instead of 16 full horizontal
// reductions, and the result is one vector of 16 minima and one of 16 maxima, ready for the
// vector parameter arithmetic.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kvq/kernels/quantize/avx512_encode.hpp"

#pragma GCC diagnostic push
#if !defined(__clang__)
#if !defined(__clang__)  // a GCC-only warning; clang warns about the unknown name
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kvq::inline v0::kernels::avx512 {

/// Lane-wise min and max over the n >= 1 channels of one group starting at element c of row;
/// lanes past the group repeat a member, so they never widen the range.
template <Scalar In>
KVQ_QUANT_INLINE inline void group_range(const void* row, std::size_t c, std::size_t n, __m512& lo,
                                         __m512& hi) noexcept {
  if (n < 16) {
    const __mmask16 m = __mmask16((1u << n) - 1u);
    const __m512 v = load16<In>(row, c, m);
    lo = hi = _mm512_mask_blend_ps(m, _mm512_broadcastss_ps(_mm512_castps512_ps128(v)), v);
    return;
  }
  __m512 l = load16<In>(row, c), h = l;
  std::size_t i = 16;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16<In>(row, c + i);
    l = _mm512_min_ps(l, v);
    h = _mm512_max_ps(h, v);
  }
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1u);
    const __m512 v = load16<In>(row, c + i, m);
    l = _mm512_min_ps(l, _mm512_mask_blend_ps(m, l, v));
    h = _mm512_max_ps(h, _mm512_mask_blend_ps(m, h, v));
  }
  lo = l;
  hi = h;
}

namespace detail {

struct Min {
  KVQ_QUANT_INLINE __m512 operator()(__m512 a, __m512 b) const noexcept { return _mm512_min_ps(a, b); }
};
struct Max {
  KVQ_QUANT_INLINE __m512 operator()(__m512 a, __m512 b) const noexcept { return _mm512_max_ps(a, b); }
};

// One tree level: a and b each hold groups in segments of w lanes; the result holds both
// vectors' groups in segments of w / 2 lanes.
template <class Op>
KVQ_QUANT_INLINE inline __m512 halve16(__m512 a, __m512 b, Op op) noexcept {  // 16 -> 8 lanes
  return op(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
}
template <class Op>
KVQ_QUANT_INLINE inline __m512 halve8(__m512 a, __m512 b, Op op) noexcept {  // 8 -> 4 lanes
  return op(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
template <class Op>
KVQ_QUANT_INLINE inline __m512 halve_in_lanes(__m512 a, __m512 b, Op op) noexcept {  // 4 -> 2 and 2 -> 1 lanes
  return op(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/// 16 vectors -> lane 4i + m reduces v[4m + i] (see slot_of).
template <class Op>
KVQ_QUANT_INLINE inline __m512 reduce16(const __m512* v, Op op) noexcept {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = halve16(v[2 * i], v[2 * i + 1], op);
  for (int i = 0; i < 4; ++i) b[i] = halve8(a[2 * i], a[2 * i + 1], op);
  for (int i = 0; i < 2; ++i) c[i] = halve_in_lanes(b[2 * i], b[2 * i + 1], op);
  return halve_in_lanes(c[0], c[1], op);
}

}  // namespace detail

/// Where group g (0..15) goes among reduce16's inputs so that lane g of the result is group g.
constexpr std::size_t slot_of(std::size_t g) noexcept { return 4 * (g % 4) + g / 4; }

/// lo[slot_of(g)], hi[slot_of(g)] for 16 groups -> their minima and maxima, lane g for group g.
KVQ_QUANT_INLINE inline void reduce_ranges16(const __m512* lo, const __m512* hi, __m512& min16,
                                             __m512& max16) noexcept {
  min16 = detail::reduce16(lo, detail::Min{});
  max16 = detail::reduce16(hi, detail::Max{});
}

/// The same for at most 4 groups in lo[0..3], hi[0..3] (lanes 4.. of the result are undefined):
/// min and max share the last two levels, so this costs a third of the full tree.
KVQ_QUANT_INLINE inline void reduce_ranges4(const __m512* lo, const __m512* hi, __m512& min4, __m512& max4) noexcept {
  using detail::Max;
  using detail::Min;
  // Both trees down to one 4-lane segment per group: [g0 g1 g2 g3].
  const __m512 l = detail::halve8(detail::halve16(lo[0], lo[1], Min{}), detail::halve16(lo[2], lo[3], Min{}), Min{});
  const __m512 h = detail::halve8(detail::halve16(hi[0], hi[1], Max{}), detail::halve16(hi[2], hi[3], Max{}), Max{});
  // Segment g: [min min max max], then [min max min max]; the mask picks max where it belongs.
  __m512 a = _mm512_shuffle_ps(l, h, _MM_SHUFFLE(2, 0, 2, 0)), b = _mm512_shuffle_ps(l, h, _MM_SHUFFLE(3, 1, 3, 1));
  const __m512 r = _mm512_mask_max_ps(_mm512_min_ps(a, b), 0xcccc, a, b);
  a = _mm512_shuffle_ps(r, r, _MM_SHUFFLE(2, 0, 2, 0));
  b = _mm512_shuffle_ps(r, r, _MM_SHUFFLE(3, 1, 3, 1));
  const __m512 s = _mm512_mask_max_ps(_mm512_min_ps(a, b), 0xaaaa, a, b);  // segment g: [min max min max]
  const __m512i four_g = _mm512_slli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  min4 = _mm512_permutexvar_ps(four_g, s);
  max4 = _mm512_permutexvar_ps(_mm512_add_epi32(four_g, _mm512_set1_epi32(1)), s);
}

}  // namespace kvq::inline v0::kernels::avx512

#pragma GCC diagnostic pop
