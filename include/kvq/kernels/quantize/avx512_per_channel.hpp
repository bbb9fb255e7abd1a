#pragma once
// AVX-512 per-channel blocks (keys): each channel's range over the block's tokens, 16 channels per
// vector, then every token row encoded and packed as in avx512_encode.hpp.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kvq/kernels/quantize/avx512.hpp"
#include "kvq/kernels/quantize/avx512_encode.hpp"

#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kvq::inline v0::kernels::avx512 {

KVQ_TARGET_AVX512 inline void quantize_block_per_channel(const QuantizerSpec& spec, const float* x, std::size_t rows,
                                                         std::size_t dim, std::size_t stride, void* scales, void* zeros,
                                                         std::uint8_t* out, std::size_t row_bytes) noexcept {
  Params16 params[max_head_dim / 16];
  for (std::size_t c = 0, v = 0; c < dim; c += 16, ++v) {
    const __mmask16 m = tail_mask(dim - c);
    __m512 lo = _mm512_maskz_loadu_ps(m, x + c), hi = lo;
    for (std::size_t r = 1; r < rows; ++r) {
      const __m512 value = _mm512_maskz_loadu_ps(m, x + r * stride + c);
      lo = _mm512_min_ps(lo, value);
      hi = _mm512_max_ps(hi, value);
    }
    params[v] = make_params(spec, lo, hi, scales, zeros, c, m);
  }
  for (std::size_t r = 0; r < rows; ++r)
    encode_row<Scalar::f32>(spec, x + r * stride, dim, [&](std::size_t c) KVQ_TARGET_AVX512 { return params[c / 16]; }, out + r * row_bytes);
}

}  // namespace kvq::inline v0::kernels::avx512

#pragma GCC diagnostic pop
