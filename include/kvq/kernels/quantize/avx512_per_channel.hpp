#pragma once
// AVX-512 per-channel blocks (keys): each channel's range over the block's tokens, 16 channels per
// vector, then every token row encoded and packed as in avx512_encode.hpp. Rows may be stored as
// f32, f16 or bf16 (the cache's full-precision ring), read in place.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kvq/kernels/quantize/avx512.hpp"
#include "kvq/kernels/quantize/avx512_encode.hpp"

#pragma GCC diagnostic push
#if !defined(__clang__)
#if !defined(__clang__)  // a GCC-only warning; clang warns about the unknown name
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kvq::inline v0::kernels::avx512 {

/// rows x dim values of type In, row r at x + r * x_stride bytes (the cache's full-precision ring
/// read in place) -> one parameter pair per channel and the packed code rows at out + r * row_bytes.
template <Scalar In>
KVQ_TARGET_AVX512 inline void quantize_block_per_channel(const QuantizerSpec& spec, const void* x, std::size_t rows,
                                                         std::size_t dim, std::size_t x_stride, void* scales,
                                                         void* zeros, std::uint8_t* out,
                                                         std::size_t row_bytes) noexcept {
  const auto row_at = [&](std::size_t r) { return static_cast<const std::uint8_t*>(x) + r * x_stride; };
  Params16 params[max_head_dim / 16];
  for (std::size_t c = 0, v = 0; c < dim; c += 16, ++v) {
    const __mmask16 m = tail_mask(dim - c);
    if (spec.mode == Mode::ggml) {  // each channel's lead: the first value of largest magnitude
      __m512 most = _mm512_setzero_ps(), lead = _mm512_setzero_ps();
      for (std::size_t r = 0; r < rows; ++r) {
        const __m512 value = load16<In>(row_at(r), c, m), magnitude = _mm512_abs_ps(value);
        const __mmask16 larger = _mm512_cmp_ps_mask(magnitude, most, _CMP_GT_OQ);
        most = _mm512_mask_mov_ps(most, larger, magnitude);
        lead = _mm512_mask_mov_ps(lead, larger, value);
      }
      params[v] = ggml_params(spec, lead);
      store_params(spec, scales, zeros, c, params[v].scale, params[v].zero, m);
      continue;
    }
    __m512 lo = load16<In>(row_at(0), c, m), hi = lo;
    for (std::size_t r = 1; r < rows; ++r) {
      const __m512 value = load16<In>(row_at(r), c, m);
      lo = _mm512_min_ps(lo, value);
      hi = _mm512_max_ps(hi, value);
    }
    params[v] = make_params(spec, lo, hi, scales, zeros, c, m);
  }
  const LevelSearch search = level_search(spec);
  for (std::size_t r = 0; r < rows; ++r)
    encode_row<In>(
        spec, search, row_at(r), dim, [&](std::size_t c) KVQ_TARGET_AVX512 { return params[c / 16]; },
        out + r * row_bytes);
}

/// The same with the storage type chosen at run time.
KVQ_TARGET_AVX512 inline void quantize_block_per_channel(const QuantizerSpec& spec, Scalar in, const void* x,
                                                         std::size_t rows, std::size_t dim, std::size_t x_stride,
                                                         void* scales, void* zeros, std::uint8_t* out,
                                                         std::size_t row_bytes) noexcept {
  if (in == Scalar::f16)
    quantize_block_per_channel<Scalar::f16>(spec, x, rows, dim, x_stride, scales, zeros, out, row_bytes);
  else if (in == Scalar::bf16)
    quantize_block_per_channel<Scalar::bf16>(spec, x, rows, dim, x_stride, scales, zeros, out, row_bytes);
  else
    quantize_block_per_channel<Scalar::f32>(spec, x, rows, dim, x_stride, scales, zeros, out, row_bytes);
}

/// f32 rows, `stride` floats apart.
KVQ_TARGET_AVX512 inline void quantize_block_per_channel(const QuantizerSpec& spec, const float* x, std::size_t rows,
                                                         std::size_t dim, std::size_t stride, void* scales, void* zeros,
                                                         std::uint8_t* out, std::size_t row_bytes) noexcept {
  quantize_block_per_channel<Scalar::f32>(spec, x, rows, dim, stride * sizeof(float), scales, zeros, out, row_bytes);
}

}  // namespace kvq::inline v0::kernels::avx512

#pragma GCC diagnostic pop
