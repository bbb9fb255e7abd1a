#pragma once
// ggml's 32-value block formats, the ones llama.cpp offers for its KV cache (--cache-type-k/v):
// q8_0, q4_0, q4_1, q5_0, q5_1 and iq4_nl, as reference codecs. Quantization follows ggml's
// reference quantizers (quantize_row_*_ref) float operation by float operation, so the bytes are
// identical to ggml's when it is built without FMA contraction; dequantization is ggml's.
//
// Block layouts (little-endian, no padding; d and m are IEEE fp16; 32 values per block):
//   q8_0   d, qs[32] int8                        x = qs * d;              d = absmax / 127
//   q4_0   d, qs[16]                             x = (q - 8) * d;         d = max / -8
//   q4_1   d, m, qs[16]                          x = q * d + m;           d = (max - min) / 15, m = min
//   q5_0   d, qh[4], qs[16]                      x = (q - 16) * d;        d = max / -16
//   q5_1   d, m, qh[4], qs[16]                   x = q * d + m;           d = (max - min) / 31, m = min
//   iq4_nl d, qs[16]                             x = d * T[q], T = the 16 non-uniform levels below
// where "max" is the value of largest magnitude (the first one on a tie). 4-bit codes: byte j of
// qs holds value j in its low nibble and value j + 16 in its high nibble; 5-bit codes add bit j
// of the uint32 qh as the fifth bit of value j.
//
// Rounding, as ggml's reference writes it: q8_0 rounds half away from zero (roundf); q4/q5
// truncate x/d + 8.5 (+16.5, or +0.5 with a min) toward zero, capped at the top code; iq4_nl takes
// the nearest level of x/d0 with d0 = max / -127 (ties to the upper level), then stores the
// least-squares scale d = sum(w q x) / sum(w q^2), w = x^2, for those codes. A block of zeros
// (iq4_nl: |x| < 1e-15) stores d = 0; its codes decode to 0 whatever they are (iq4_nl writes 0s,
// where ggml leaves them unspecified).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/error.hpp"
#include "kvq/kernels/quantize/reference.hpp"

namespace kvq::inline v0::ggml {

enum class BlockType : std::uint8_t { q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl };

inline constexpr std::size_t block_values = 32;
inline constexpr std::array<BlockType, 6> block_types = {BlockType::q8_0, BlockType::q4_0, BlockType::q4_1,
                                                         BlockType::q5_0, BlockType::q5_1, BlockType::iq4_nl};

/// iq4_nl's levels (ggml's kvalues_iq4nl).
inline constexpr std::array<std::int8_t, 16> iq4_nl_levels = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                              1,    13,   25,  38,  53,  69,  89,  113};

constexpr std::string_view name(BlockType t) noexcept {
  switch (t) {
    case BlockType::q8_0:
      return "q8_0";
    case BlockType::q4_0:
      return "q4_0";
    case BlockType::q4_1:
      return "q4_1";
    case BlockType::q5_0:
      return "q5_0";
    case BlockType::q5_1:
      return "q5_1";
    case BlockType::iq4_nl:
      return "iq4_nl";
  }
  return "";
}

/// Bytes of one block of 32 values.
constexpr std::size_t block_bytes(BlockType t) noexcept {
  switch (t) {
    case BlockType::q8_0:
      return 34;
    case BlockType::q4_0:
      return 18;
    case BlockType::q4_1:
      return 20;
    case BlockType::q5_0:
      return 22;
    case BlockType::q5_1:
      return 24;
    case BlockType::iq4_nl:
      return 18;
  }
  return 0;
}

/// "q4_0" -> BlockType::q4_0; nullopt for any other name.
inline std::optional<BlockType> parse_block_type(std::string_view text) noexcept {
  for (BlockType t : block_types)
    if (name(t) == text) return t;
  return std::nullopt;
}

/// "q8_0, q4_0, ...", for error messages.
inline std::string block_type_names() {
  std::string list;
  for (BlockType t : block_types) list += (list.empty() ? "" : ", ") + std::string(name(t));
  return list;
}

namespace detail {

inline float load_half(const std::uint8_t* p) noexcept {
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  return to_float(fp16{bits});
}

inline void store_half(std::uint8_t* p, float value) noexcept {
  const std::uint16_t bits = to_fp16(value).bits;
  std::memcpy(p, &bits, 2);
}

inline void min_max(const float* x, float& min, float& max) noexcept {
  min = x[0];
  max = x[0];
  for (std::size_t j = 1; j < block_values; ++j) {
    min = std::min(min, x[j]);
    max = std::max(max, x[j]);
  }
}

// Codes 0..31 into qs nibbles and (for 5-bit codes) qh.
inline void pack_codes(const std::uint8_t* q, std::uint8_t* qs, std::uint8_t* qh) noexcept {
  std::uint32_t high = 0;
  for (std::size_t j = 0; j < 16; ++j) {
    qs[j] = std::uint8_t((q[j] & 0xF) | (q[j + 16] & 0xF) << 4);
    high |= std::uint32_t(q[j] >> 4 & 1) << j | std::uint32_t(q[j + 16] >> 4 & 1) << (j + 16);
  }
  if (qh != nullptr) std::memcpy(qh, &high, 4);
}

inline void unpack_codes(const std::uint8_t* qs, const std::uint8_t* qh, std::uint8_t* q) noexcept {
  std::uint32_t high = 0;
  if (qh != nullptr) std::memcpy(&high, qh, 4);
  for (std::size_t j = 0; j < 16; ++j) {
    q[j] = std::uint8_t((qs[j] & 0xF) | (high >> j & 1) << 4);
    q[j + 16] = std::uint8_t((qs[j] >> 4) | (high >> (j + 16) & 1) << 4);
  }
}

// The integer part of a non-negative float (C's float-to-integer conversion), capped at top.
inline std::uint8_t truncate_code(float v, int top) noexcept {
  return std::uint8_t(std::clamp(int(std::max(v, 0.0f)), 0, top));
}

inline void quantize_block(BlockType t, const float* x, std::uint8_t* out) noexcept {
  std::uint8_t q[block_values] = {};
  switch (t) {
    case BlockType::q8_0:
    case BlockType::q4_0:
    case BlockType::q5_0: {  // the cache's ggml levels (kernels/quantize/reference.hpp) on one block
      const QuantizerSpec spec{t == BlockType::q8_0   ? 8
                               : t == BlockType::q5_0 ? 5
                                                      : 4,
                               block_values, Axis::per_token, Mode::ggml};
      const auto [params, inv] = kernels::reference::ggml_params(spec, x, block_values, 1);
      store_half(out, params.scale);
      for (std::size_t j = 0; j < block_values; ++j) q[j] = kernels::reference::ggml_encode(spec, inv, x[j]);
      if (t == BlockType::q8_0)
        for (std::size_t j = 0; j < block_values; ++j) out[2 + j] = std::uint8_t(q[j] ^ 0x80);  // int8 codes
      else
        pack_codes(q, out + (t == BlockType::q5_0 ? 6 : 2), t == BlockType::q5_0 ? out + 2 : nullptr);
      return;
    }
    case BlockType::q4_1:
    case BlockType::q5_1: {
      const bool five = t == BlockType::q5_1;
      float min, max;
      min_max(x, min, max);
      // a subnormal step has no finite inverse: its codes are 0, as for a constant block
      const float d = (max - min) / (five ? 31.0f : 15.0f), id = kernels::reference::ggml_inverse(d);
      store_half(out, d);
      store_half(out + 2, min);
      for (std::size_t j = 0; j < block_values; ++j) q[j] = truncate_code((x[j] - min) * id + 0.5f, five ? 31 : 15);
      pack_codes(q, out + (five ? 8 : 4), five ? out + 4 : nullptr);
      return;
    }
    case BlockType::iq4_nl: {  // the cache's Mode::iq4_nl quantizer, one group of 32
      constexpr QuantizerSpec spec{4, block_values, Axis::per_token, Mode::iq4_nl};
      const auto [p, inv] = kernels::reference::iq4_nl_params(spec, x, block_values, 1);
      for (std::size_t j = 0; j < block_values; ++j) q[j] = kernels::reference::encode(spec, p, inv, x[j]);
      store_half(out, p.scale);
      pack_codes(q, out + 2, nullptr);
      return;
    }
  }
}

/// The block's fp16 parameters (the scale d, and q4_1/q5_1's minimum m after it) are finite.
inline bool parameters_finite(BlockType t, const std::uint8_t* block) noexcept {
  const bool with_min = t == BlockType::q4_1 || t == BlockType::q5_1;
  return std::isfinite(load_half(block)) && (!with_min || std::isfinite(load_half(block + 2)));
}

}  // namespace detail

/// Dequantizes `blocks` blocks of type T at `src` into blocks * 32 floats at `out` (no checks:
/// the caller sized both; gguf readers use it through a function pointer).
template <BlockType T>
void dequantize_blocks(const std::uint8_t* src, std::size_t blocks, float* out) noexcept {
  constexpr std::size_t bytes = block_bytes(T);
  std::uint8_t q[block_values];
  for (std::size_t b = 0; b < blocks; ++b, src += bytes, out += block_values) {
    const float d = detail::load_half(src);
    if constexpr (T == BlockType::q8_0) {
      for (std::size_t j = 0; j < block_values; ++j) out[j] = float(std::int8_t(src[2 + j])) * d;
    } else if constexpr (T == BlockType::iq4_nl) {
      detail::unpack_codes(src + 2, nullptr, q);
      for (std::size_t j = 0; j < block_values; ++j) out[j] = d * float(iq4_nl_levels[q[j]]);
    } else {
      constexpr bool with_min = T == BlockType::q4_1 || T == BlockType::q5_1;
      constexpr bool five = T == BlockType::q5_0 || T == BlockType::q5_1;
      constexpr int centre = with_min ? 0 : five ? 16 : 8;
      const float m = with_min ? detail::load_half(src + 2) : 0.0f;
      const std::size_t after_scales = with_min ? 4 : 2;
      detail::unpack_codes(src + after_scales + (five ? 4 : 0), five ? src + after_scales : nullptr, q);
      for (std::size_t j = 0; j < block_values; ++j) {
        if constexpr (with_min)
          out[j] = float(q[j]) * d + m;
        else
          out[j] = float(int(q[j]) - centre) * d;
      }
    }
  }
}

/// `x` (a multiple of 32 finite values) as x.size() / 32 blocks of type t at `out`, which must
/// hold exactly that many bytes. Throws, writing nothing, on a bad size, a non-finite value or a
/// scale beyond fp16.
inline void quantize_row(BlockType t, std::span<const float> x, std::span<std::uint8_t> out) {
  const std::string what = "ggml " + std::string(name(t)) + ": ";
  if (x.size() % block_values != 0)
    throw Error(ErrorCode::shape_mismatch,
                what + std::to_string(x.size()) + " values are not a whole number of blocks of 32");
  const std::size_t blocks = x.size() / block_values;
  if (out.size() != blocks * block_bytes(t))
    throw Error(ErrorCode::shape_mismatch, what + std::to_string(blocks) + " blocks need " +
                                               std::to_string(blocks * block_bytes(t)) + " bytes, got " +
                                               std::to_string(out.size()));
  for (std::size_t i = 0; i < x.size(); ++i)
    if (!std::isfinite(x[i]))
      throw Error(ErrorCode::non_finite_input, what + "value " + std::to_string(i) + " (block " +
                                                   std::to_string(i / block_values) + ") is not finite");
  std::vector<std::uint8_t> staged(out.size());
  for (std::size_t b = 0; b < blocks; ++b) {
    std::uint8_t* block = staged.data() + b * block_bytes(t);
    detail::quantize_block(t, x.data() + b * block_values, block);
    if (!detail::parameters_finite(t, block))
      throw Error(ErrorCode::unrepresentable, what + "the scale of block " + std::to_string(b) + " overflows fp16");
  }
  std::copy(staged.begin(), staged.end(), out.begin());
}

/// Inverse of quantize_row: blocks.size() / block_bytes(t) blocks into out (32 values each).
/// Blocks read from elsewhere may hold a NaN or Inf fp16 parameter, which no quantizer writes:
/// refused by block, writing nothing.
inline void dequantize_row(BlockType t, std::span<const std::uint8_t> blocks, std::span<float> out) {
  const std::size_t count = blocks.size() / block_bytes(t);
  if (blocks.size() % block_bytes(t) != 0 || out.size() != count * block_values)
    throw Error(ErrorCode::shape_mismatch, "ggml " + std::string(name(t)) + ": " + std::to_string(blocks.size()) +
                                               " bytes and " + std::to_string(out.size()) +
                                               " values are not matching whole blocks");
  for (std::size_t b = 0; b < count; ++b)
    if (!detail::parameters_finite(t, blocks.data() + b * block_bytes(t)))
      throw Error(ErrorCode::non_finite_input, "ggml " + std::string(name(t)) + ": block " + std::to_string(b) +
                                                   " holds a NaN or Inf fp16 parameter");
  switch (t) {
    case BlockType::q8_0:
      return dequantize_blocks<BlockType::q8_0>(blocks.data(), count, out.data());
    case BlockType::q4_0:
      return dequantize_blocks<BlockType::q4_0>(blocks.data(), count, out.data());
    case BlockType::q4_1:
      return dequantize_blocks<BlockType::q4_1>(blocks.data(), count, out.data());
    case BlockType::q5_0:
      return dequantize_blocks<BlockType::q5_0>(blocks.data(), count, out.data());
    case BlockType::q5_1:
      return dequantize_blocks<BlockType::q5_1>(blocks.data(), count, out.data());
    case BlockType::iq4_nl:
      return dequantize_blocks<BlockType::iq4_nl>(blocks.data(), count, out.data());
  }
}

}  // namespace kvq::inline v0::ggml
