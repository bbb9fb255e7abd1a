#pragma once
// Group quantization entry points: the best compiled path for this CPU, bit-identical to the
// scalar reference (kernels/quantize/reference.hpp defines the arithmetic exactly).

#include "kvq/core/convert.hpp"
#include "kvq/isa.hpp"
#include "kvq/kernels/quantize/reference.hpp"
#if defined(KVQ_HAVE_X86_KERNELS)
#include "kvq/kernels/quantize/avx512_per_channel.hpp"
#include "kvq/kernels/quantize/avx512_per_token.hpp"
#endif

namespace kvq::inline v0::kernels {

// Each entry point that takes outlier entries (spec.outliers > 0, which only the reference path
// writes) has a twin without them: the signature the fast paths share.

inline void quantize_row_per_token(const QuantizerSpec& spec, const float* x, std::size_t dim, void* scales,
                                   void* zeros, std::uint8_t* out, reference::Outliers outliers) noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  if (isa::detected() == isa::Level::avx512 && avx512::supports(spec))
    return avx512::quantize_row_per_token(spec, x, dim, scales, zeros, out);
#endif
  reference::quantize_row_per_token(spec, x, dim, scales, zeros, out, outliers);
}
inline void quantize_row_per_token(const QuantizerSpec& spec, const float* x, std::size_t dim, void* scales,
                                   void* zeros, std::uint8_t* out) noexcept {
  kernels::quantize_row_per_token(spec, x, dim, scales, zeros, out, reference::Outliers{});
}

/// Several rows per token at once (e.g. every KV head), each stored as `in` (f32, f16, bf16):
/// row r at x + r * x_stride bytes, its parameters at scales / zeros + r * param_stride bytes and
/// its packed codes at out + r * out_stride, its outlier entries param_stride bytes apart too. The
/// same bytes as quantize_row_per_token per row.
inline void quantize_rows_per_token(const QuantizerSpec& spec, Scalar in, const void* x, std::size_t rows,
                                    std::size_t dim, std::size_t x_stride, void* scales, void* zeros,
                                    std::size_t param_stride, std::uint8_t* out, std::size_t out_stride,
                                    reference::Outliers outliers = {}) noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  if (isa::detected() == isa::Level::avx512 && avx512::supports(spec))
    return avx512::quantize_rows_per_token(spec, in, x, rows, dim, x_stride, scales, zeros, param_stride, out,
                                           out_stride);
#endif
  float row[max_head_dim];
  for (std::size_t r = 0; r < rows; ++r) {
    load_row(in, static_cast<const std::uint8_t*>(x) + r * x_stride, dim, row);
    const reference::Outliers own =
        spec.outliers == 0
            ? reference::Outliers{}
            : reference::Outliers{
                  reinterpret_cast<std::uint16_t*>(reinterpret_cast<std::uint8_t*>(outliers.slots) + r * param_stride),
                  static_cast<std::uint8_t*>(outliers.corrections) + r * param_stride};
    reference::quantize_row_per_token(spec, row, dim, static_cast<std::uint8_t*>(scales) + r * param_stride,
                                      static_cast<std::uint8_t*>(zeros) + r * param_stride, out + r * out_stride, own);
  }
}

inline void quantize_block_per_channel(const QuantizerSpec& spec, const float* x, std::size_t rows, std::size_t dim,
                                       std::size_t stride, void* scales, void* zeros, std::uint8_t* out,
                                       std::size_t row_bytes, reference::Outliers outliers) noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  if (isa::detected() == isa::Level::avx512 && avx512::supports(spec))
    return avx512::quantize_block_per_channel(spec, x, rows, dim, stride, scales, zeros, out, row_bytes);
#endif
  reference::quantize_block_per_channel(spec, x, rows, dim, stride, scales, zeros, out, row_bytes, outliers);
}
inline void quantize_block_per_channel(const QuantizerSpec& spec, const float* x, std::size_t rows, std::size_t dim,
                                       std::size_t stride, void* scales, void* zeros, std::uint8_t* out,
                                       std::size_t row_bytes) noexcept {
  kernels::quantize_block_per_channel(spec, x, rows, dim, stride, scales, zeros, out, row_bytes, reference::Outliers{});
}

/// A block of rows stored as `in` (f32, f16, bf16), row r at x + r * x_stride bytes (the cache's
/// ring, read in place): the same bytes as quantize_block_per_channel on the rows as floats.
/// scratch: room for rows * dim floats, used where no fast path reads the rows in place.
inline void quantize_block_per_channel(const QuantizerSpec& spec, Scalar in, const void* x, std::size_t rows,
                                       std::size_t dim, std::size_t x_stride, void* scales, void* zeros,
                                       std::uint8_t* out, std::size_t row_bytes, float* scratch,
                                       reference::Outliers outliers = {}) noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  if (isa::detected() == isa::Level::avx512 && avx512::supports(spec))
    return avx512::quantize_block_per_channel(spec, in, x, rows, dim, x_stride, scales, zeros, out, row_bytes);
#endif
  for (std::size_t r = 0; r < rows; ++r)
    load_row(in, static_cast<const std::uint8_t*>(x) + r * x_stride, dim, scratch + r * dim);
  reference::quantize_block_per_channel(spec, scratch, rows, dim, dim, scales, zeros, out, row_bytes, outliers);
}

}  // namespace kvq::inline v0::kernels
