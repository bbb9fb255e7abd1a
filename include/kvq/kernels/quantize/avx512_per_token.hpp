#pragma once
// AVX-512 per-token quantization of several rows per call (all KV heads of a token, say), with
// the arithmetic of reference::quantize_row_per_token. Rows are taken 16 groups at a time, so one
// transposing reduction (avx512_ranges.hpp) and one vector of parameter arithmetic serve 16
// groups; codes are made 64 at a time in registers and packed from there for 2, 4 and 8 bits.
// Rows may be stored as f32, f16 or bf16 (the cache's full-precision ring), read in place.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kvq/kernels/quantize/avx512_encode.hpp"
#include "kvq/kernels/quantize/avx512_ranges.hpp"

#pragma GCC diagnostic push
#if !defined(__clang__)
#if !defined(__clang__)  // a GCC-only warning; clang warns about the unknown name
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kvq::inline v0::kernels::avx512 {

/// ggml's leads of the n groups from g0 of rows whose first is at `rows` (x_stride bytes apart,
/// per_row groups each), given their ranges: lead_of_range, and where the ends tie, the first value
/// of that magnitude in the group.
template <Scalar In>
KVQ_TARGET_AVX512 inline __m512 ggml_lead(const QuantizerSpec& spec, __m512 lo, __m512 hi, std::size_t g0,
                                          std::size_t n, const std::uint8_t* rows, std::size_t x_stride,
                                          std::size_t per_row, std::size_t dim) noexcept {
  __mmask16 tie;
  const __m512 lead = lead_of_range(lo, hi, tie);
  tie &= tail_mask(n);
  if (tie == 0) return lead;
  alignas(64) float leads[16];
  _mm512_store_ps(leads, lead);
  for (; tie != 0; tie &= tie - 1) {
    const std::size_t i = std::size_t(__builtin_ctz(tie)), group = g0 + i;
    const void* row = rows + group / per_row * x_stride;
    const std::size_t begin = group % per_row * spec.group, end = std::min(dim, begin + spec.group);
    for (std::size_t c = begin; c < end; ++c) {
      const float value = load_scalar(In, row, c);
      if (std::fabs(value) == std::fabs(leads[i])) {
        leads[i] = value;
        break;
      }
    }
  }
  return _mm512_load_ps(leads);
}

/// `rows` rows of dim values of type In, row r at x + r * x_stride bytes -> for row r,
/// groups_per_row(spec, dim) parameter pairs at scales / zeros + r * param_stride bytes and
/// packed codes at out + r * out_stride. Requires supports(spec); K > 0 requires group = 16 K
/// and whole groups (dim % group = 0), and unrolls for them.
template <Scalar In, std::size_t K>
KVQ_TARGET_AVX512 inline void quantize_rows_per_token(const QuantizerSpec& spec, const void* x, std::size_t rows,
                                                      std::size_t dim, std::size_t x_stride, void* scales, void* zeros,
                                                      std::size_t param_stride, std::uint8_t* out,
                                                      std::size_t out_stride) noexcept {
  if (dim == 0) return;
  const std::size_t group = spec.group, per_row = groups_per_row(spec, dim);
  // A chunk is as many whole rows as 16 groups hold, or one row of more groups.
  const std::size_t chunk_rows = per_row >= 16 ? 1 : 16 / per_row;
  constexpr std::size_t max_chunk_groups = max_head_dim / 16 > 16 ? max_head_dim / 16 : 16;
  alignas(64) float zero[max_chunk_groups], inv[max_chunk_groups];
  const LevelSearch search = level_search(spec);
  const auto row_at = [&](std::size_t r) { return static_cast<const std::uint8_t*>(x) + r * x_stride; };
  for (std::size_t row0 = 0; row0 < rows; row0 += chunk_rows) {
    const std::size_t n_rows = rows - row0 < chunk_rows ? rows - row0 : chunk_rows, n_groups = n_rows * per_row;
    std::size_t r = 0, j = 0;  // row and group within the row of the next group to range
    for (std::size_t g0 = 0; g0 < n_groups; g0 += 16) {
      const std::size_t n = n_groups - g0 < 16 ? n_groups - g0 : 16;
      const bool small = n <= 4;
      __m512 lo[16], hi[16];
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t slot = small ? i : slot_of(i), c = j * group;
        if constexpr (K > 0) {
          const void* row = row_at(row0 + r);
          __m512 l = load16<In>(row, c), h = l;
          for (std::size_t k = 1; k < K; ++k) {
            const __m512 v = load16<In>(row, c + 16 * k);
            l = _mm512_min_ps(l, v);
            h = _mm512_max_ps(h, v);
          }
          lo[slot] = l;
          hi[slot] = h;
        } else {
          group_range<In>(row_at(row0 + r), c, dim - c < group ? dim - c : group, lo[slot], hi[slot]);
        }
        if (++j == per_row) j = 0, ++r;
      }
      for (std::size_t i = n; i < (small ? 4 : 16); ++i) {  // padding: repeat the last group
        const std::size_t slot = small ? i : slot_of(i), last = small ? n - 1 : slot_of(n - 1);
        lo[slot] = lo[last];
        hi[slot] = hi[last];
      }
      __m512 min16, max16;
      if (small)
        reduce_ranges4(lo, hi, min16, max16);
      else
        reduce_ranges16(lo, hi, min16, max16);
      const Params16 p =
          spec.mode == Mode::ggml
              ? ggml_params(spec, ggml_lead<In>(spec, min16, max16, g0, n, row_at(row0), x_stride, per_row, dim))
              : compute_params(spec, min16, max16);
      _mm512_store_ps(zero + g0, p.zero);
      _mm512_store_ps(inv + g0, p.inv);
      // Store each row's share of the 16 lanes at its own parameter address.
      for (std::size_t first = g0; first < g0 + n;) {
        const std::size_t row = first / per_row, in_row = first - row * per_row;
        const std::size_t count = per_row - in_row < g0 + n - first ? per_row - in_row : g0 + n - first;
        __m512 scale = p.scale, zero_point = p.zero;
        if (first != g0) {
          const __m512i shift =
              _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                               _mm512_set1_epi32(int(first - g0)));
          scale = _mm512_permutexvar_ps(shift, scale);
          zero_point = _mm512_permutexvar_ps(shift, zero_point);
        }
        const std::size_t offset = (row0 + row) * param_stride;
        store_params(spec, static_cast<std::uint8_t*>(scales) + offset, static_cast<std::uint8_t*>(zeros) + offset,
                     in_row, scale, zero_point, tail_mask(count));
        first += count;
      }
    }
    for (std::size_t i = 0; i < n_rows; ++i) {
      const float *row_zero = zero + i * per_row, *row_inv = inv + i * per_row;
      encode_row<In>(
          spec, search, row_at(row0 + i), dim,
          [&](std::size_t c) KVQ_TARGET_AVX512 {
            const std::size_t g = K > 0 ? c / (16 * (K > 0 ? K : 1)) : std::uint32_t(c) / std::uint32_t(group);
            return Params16{_mm512_set1_ps(row_zero[g]), _mm512_set1_ps(row_inv[g]), _mm512_setzero_ps()};
          },
          out + (row0 + i) * out_stride);
    }
  }
}

/// The same with the storage type chosen at run time, and the common group sizes unrolled.
template <Scalar In>
KVQ_TARGET_AVX512 inline void quantize_rows_per_token(const QuantizerSpec& spec, const void* x, std::size_t rows,
                                                      std::size_t dim, std::size_t x_stride, void* scales, void* zeros,
                                                      std::size_t param_stride, std::uint8_t* out,
                                                      std::size_t out_stride) noexcept {
  const std::size_t whole = dim % spec.group == 0 ? spec.group / 16 : 0;
  if (whole == 2)
    quantize_rows_per_token<In, 2>(spec, x, rows, dim, x_stride, scales, zeros, param_stride, out, out_stride);
  else if (whole == 1)
    quantize_rows_per_token<In, 1>(spec, x, rows, dim, x_stride, scales, zeros, param_stride, out, out_stride);
  else if (whole == 4)
    quantize_rows_per_token<In, 4>(spec, x, rows, dim, x_stride, scales, zeros, param_stride, out, out_stride);
  else
    quantize_rows_per_token<In, 0>(spec, x, rows, dim, x_stride, scales, zeros, param_stride, out, out_stride);
}

KVQ_TARGET_AVX512 inline void quantize_rows_per_token(const QuantizerSpec& spec, Scalar in, const void* x,
                                                      std::size_t rows, std::size_t dim, std::size_t x_stride,
                                                      void* scales, void* zeros, std::size_t param_stride,
                                                      std::uint8_t* out, std::size_t out_stride) noexcept {
  if (in == Scalar::f16)
    quantize_rows_per_token<Scalar::f16>(spec, x, rows, dim, x_stride, scales, zeros, param_stride, out, out_stride);
  else if (in == Scalar::bf16)
    quantize_rows_per_token<Scalar::bf16>(spec, x, rows, dim, x_stride, scales, zeros, param_stride, out, out_stride);
  else
    quantize_rows_per_token<Scalar::f32>(spec, x, rows, dim, x_stride, scales, zeros, param_stride, out, out_stride);
}

KVQ_TARGET_AVX512 inline void quantize_row_per_token(const QuantizerSpec& spec, const float* x, std::size_t dim,
                                                     void* scales, void* zeros, std::uint8_t* out) noexcept {
  quantize_rows_per_token<Scalar::f32>(spec, x, 1, dim, 0, scales, zeros, 0, out, 0);
}

}  // namespace kvq::inline v0::kernels::avx512

#pragma GCC diagnostic pop
