#pragma once
// Group quantization entry points: the best compiled path for this CPU, bit-identical to the
// scalar reference (kernels/quantize/reference.hpp defines the arithmetic exactly).

#include "kvq/isa.hpp"
#include "kvq/kernels/quantize/reference.hpp"
#if defined(KVQ_HAVE_X86_KERNELS)
#include "kvq/kernels/quantize/avx512.hpp"
#endif

namespace kvq::inline v0::kernels {

inline void quantize_row_per_token(const QuantizerSpec& spec, const float* x, std::size_t dim, void* scales,
                                   void* zeros, std::uint8_t* out) noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  if (isa::detected() == isa::Level::avx512 && avx512::supports(spec))
    return avx512::quantize_row_per_token(spec, x, dim, scales, zeros, out);
#endif
  reference::quantize_row_per_token(spec, x, dim, scales, zeros, out);
}

inline void quantize_block_per_channel(const QuantizerSpec& spec, const float* x, std::size_t rows, std::size_t dim,
                                       std::size_t stride, void* scales, void* zeros, std::uint8_t* out,
                                       std::size_t row_bytes) noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  if (isa::detected() == isa::Level::avx512 && avx512::supports(spec))
    return avx512::quantize_block_per_channel(spec, x, rows, dim, stride, scales, zeros, out, row_bytes);
#endif
  reference::quantize_block_per_channel(spec, x, rows, dim, stride, scales, zeros, out, row_bytes);
}

}  // namespace kvq::inline v0::kernels
