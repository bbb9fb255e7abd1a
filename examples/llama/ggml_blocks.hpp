#pragma once
// ggml tensor types: their numbers and names, the block each one packs, and conversion of a
// tensor's blocks to float exactly as ggml's format defines it (ggml-common.h's block layouts,
// ggml-quants.c's reference dequantization, same float operations in the same order, so weights
// come out bit-identical to llama.cpp's). Converted: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
// and the k-quants Q2_K..Q6_K. Every other type (IQ*, TQ*, Q8_1, Q8_K, integers) is refused by
// name by the caller.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "kvq/codecs/ggml.hpp"
#include "kvq/core/half.hpp"

namespace kvq::llama {

// ggml's type numbers (enum ggml_type) that this reader converts.
inline constexpr std::uint32_t ggml_type_f32 = 0;
inline constexpr std::uint32_t ggml_type_f16 = 1;
inline constexpr std::uint32_t ggml_type_q4_0 = 2;
inline constexpr std::uint32_t ggml_type_q4_1 = 3;
inline constexpr std::uint32_t ggml_type_q5_0 = 6;
inline constexpr std::uint32_t ggml_type_q5_1 = 7;
inline constexpr std::uint32_t ggml_type_q8_0 = 8;
inline constexpr std::uint32_t ggml_type_q2_k = 10;
inline constexpr std::uint32_t ggml_type_q3_k = 11;
inline constexpr std::uint32_t ggml_type_q4_k = 12;
inline constexpr std::uint32_t ggml_type_q5_k = 13;
inline constexpr std::uint32_t ggml_type_q6_k = 14;
inline constexpr std::uint32_t ggml_type_bf16 = 30;

/// How a ggml type packs values: `elements` values in `bytes` bytes per block; a row (ne0) is a
/// whole number of blocks. `dequantize` writes blocks * elements floats.
struct GgmlBlockFormat {
  std::string_view name;
  std::size_t elements = 1;
  std::size_t bytes = 4;
  void (*dequantize)(const std::uint8_t* blocks, std::size_t count, float* out) = nullptr;
};

/// Name of a ggml type number, converted or not ("Q4_K", "IQ2_XXS"), or "" if ggml has none.
inline std::string_view ggml_type_name(std::uint32_t type) noexcept {
  static constexpr std::string_view names[] = {
      "F32",      "F16",      "Q4_0",    "Q4_1",  "Q4_2",       "Q4_3",       "Q5_0",       "Q5_1",
      "Q8_0",     "Q8_1",     "Q2_K",    "Q3_K",  "Q4_K",       "Q5_K",       "Q6_K",       "Q8_K",
      "IQ2_XXS",  "IQ2_XS",   "IQ3_XXS", "IQ1_S", "IQ4_NL",     "IQ3_S",      "IQ2_S",      "IQ4_XS",
      "I8",       "I16",      "I32",     "I64",   "F64",        "IQ1_M",      "BF16",       "Q4_0_4_4",
      "Q4_0_4_8", "Q4_0_8_8", "TQ1_0",   "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8", "MXFP4"};
  return type < std::size(names) ? names[type] : std::string_view();
}

namespace detail {

// Little-endian fields of a block; blocks are byte arrays with no alignment promise.
inline float half_at(const std::uint8_t* p) noexcept {
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  return to_float(fp16{bits});
}

inline void dequantize_f32(const std::uint8_t* src, std::size_t n, float* out) { std::memcpy(out, src, 4 * n); }

inline void dequantize_f16(const std::uint8_t* src, std::size_t n, float* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = half_at(src + 2 * i);
}

inline void dequantize_bf16(const std::uint8_t* src, std::size_t n, float* out) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    out[i] = to_float(bf16{bits});
  }
}

// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are the library's ggml codecs (kvq/codecs/ggml.hpp).

// Q2_K (256 values in 16 groups of 16): scales[16] (low nibble: scale, high nibble: min, both
// times the block's fp16 d / dmin), qs[64], d, dmin. Codes of each 128-value half sit in 32 bytes,
// 2 bits each: group g of the half takes bytes 16*(g%2).. at bit 2*(g/2).
inline void dequantize_q2_k(const std::uint8_t* src, std::size_t blocks, float* out) {
  for (std::size_t b = 0; b < blocks; ++b, src += 84) {
    const std::uint8_t* scales = src;
    const float d = half_at(src + 80), dmin = half_at(src + 82);
    for (int half = 0; half < 2; ++half) {
      const std::uint8_t* qs = src + 16 + 32 * half;
      for (int g = 0; g < 8; ++g) {
        const std::uint8_t sc = scales[8 * half + g];
        const float dl = d * float(sc & 0xF), ml = dmin * float(sc >> 4);
        const int shift = 2 * (g / 2);
        for (int l = 0; l < 16; ++l) *out++ = dl * float((qs[16 * (g % 2) + l] >> shift) & 3) - ml;
      }
    }
  }
}

// Q3_K (256 values in 16 groups of 16): hmask[32], qs[64], scales[12], d. A code is 2 low bits
// laid out as Q2_K's plus a high bit from hmask (byte 16*(g%2) + l, bit 4*half + g/2); a clear
// high bit subtracts 4. The 16 6-bit scales: low nibbles in bytes 0..7 (groups 0..7 low, 8..15
// high nibble), high 2 bits in bytes 8..11 (group g: byte 8 + g%4, bit 2*(g/4)); minus 32.
inline int q3_k_scale(const std::uint8_t* s, int g) noexcept {
  const int low = g < 8 ? s[g] & 0xF : s[g - 8] >> 4;
  const int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
  return (low | high << 4) - 32;
}

inline void dequantize_q3_k(const std::uint8_t* src, std::size_t blocks, float* out) {
  for (std::size_t b = 0; b < blocks; ++b, src += 110) {
    const std::uint8_t* hmask = src;
    const std::uint8_t* scales = src + 96;
    const float d = half_at(src + 108);
    for (int half = 0; half < 2; ++half) {
      const std::uint8_t* qs = src + 32 + 32 * half;
      for (int g = 0; g < 8; ++g) {
        const float dl = d * float(q3_k_scale(scales, 8 * half + g));
        const int shift = 2 * (g / 2), bit = 4 * half + g / 2;
        for (int l = 0; l < 16; ++l) {
          const int i = 16 * (g % 2) + l;
          const int q = ((qs[i] >> shift) & 3) - (((hmask[i] >> bit) & 1) ? 0 : 4);
          *out++ = dl * float(q);
        }
      }
    }
  }
}

// The 8 6-bit (scale, min) pairs of Q4_K and Q5_K packed in 12 bytes: pairs 0..3 are the low 6
// bits of bytes 0..3 (scale) and 4..7 (min); pairs 4..7 take bytes 8..11's nibbles for their low
// 4 bits and the top 2 bits of bytes 0..3 (scale) and 4..7 (min) for their high bits.
inline void k4_scale_min(const std::uint8_t* s, int j, int& scale, int& min) noexcept {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xF) | (s[j - 4] >> 6) << 4;
    min = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
  }
}

// Q4_K (256 values in 8 groups of 32): d, dmin, scales[12], qs[128]; Q5_K adds qh[32] before qs.
// Groups 2c and 2c+1 share qs bytes 32c..32c+31, low nibble then high nibble; Q5_K's fifth bit of
// value l of group j is bit j of qh[l]. Value = d*scale * q - dmin*min.
template <bool FifthBit>
void dequantize_q4_q5_k(const std::uint8_t* src, std::size_t blocks, float* out) {
  constexpr std::size_t bytes = FifthBit ? 176 : 144;
  for (std::size_t b = 0; b < blocks; ++b, src += bytes) {
    const float d = half_at(src), dmin = half_at(src + 2);
    const std::uint8_t* scales = src + 4;
    const std::uint8_t* qh = src + 16;
    const std::uint8_t* qs = src + (FifthBit ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      int scale, min;
      k4_scale_min(scales, j, scale, min);
      const float dl = d * float(scale), ml = dmin * float(min);
      const std::uint8_t* q = qs + 32 * (j / 2);
      for (int l = 0; l < 32; ++l) {
        int code = j % 2 ? q[l] >> 4 : q[l] & 0xF;
        if constexpr (FifthBit) code += (qh[l] >> j) & 1 ? 16 : 0;
        *out++ = dl * float(code) - ml;
      }
    }
  }
}

// Q6_K (256 values in 16 groups of 16): ql[128], qh[64], int8 scales[16], d. Per 128-value half,
// value l + 32k (k = 0..3, l = 0..31) has its low 4 bits in ql[64*half + l + 32*(k%2)] (low
// nibble for k < 2, high nibble otherwise), its high 2 bits at bit 2k of qh[32*half + l], minus 32;
// its scale is scales[8*half + 2k + l/16].
inline void dequantize_q6_k(const std::uint8_t* src, std::size_t blocks, float* out) {
  for (std::size_t b = 0; b < blocks; ++b, src += 210, out += 256) {
    const float d = half_at(src + 208);
    for (int half = 0; half < 2; ++half) {
      const std::uint8_t* ql = src + 64 * half;
      const std::uint8_t* qh = src + 128 + 32 * half;
      const std::uint8_t* sc = src + 192 + 8 * half;
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 32; ++l) {
          const int low = k < 2 ? ql[l + 32 * (k % 2)] & 0xF : ql[l + 32 * (k % 2)] >> 4;
          const int q = (low | ((qh[l] >> (2 * k)) & 3) << 4) - 32;
          const float scale = float(static_cast<std::int8_t>(sc[2 * k + l / 16]));
          out[128 * half + 32 * k + l] = d * scale * float(q);
        }
    }
  }
}

}  // namespace detail

/// The block format of a type this reader converts to float, or nullptr for any other type.
inline const GgmlBlockFormat* ggml_block_format(std::uint32_t type) noexcept {
  using namespace detail;
  static constexpr GgmlBlockFormat f32{"F32", 1, 4, dequantize_f32}, f16{"F16", 1, 2, dequantize_f16},
      bf16{"BF16", 1, 2, dequantize_bf16}, q4_0{"Q4_0", 32, 18, ggml::dequantize_blocks<ggml::BlockType::q4_0>},
      q4_1{"Q4_1", 32, 20, ggml::dequantize_blocks<ggml::BlockType::q4_1>},
      q5_0{"Q5_0", 32, 22, ggml::dequantize_blocks<ggml::BlockType::q5_0>},
      q5_1{"Q5_1", 32, 24, ggml::dequantize_blocks<ggml::BlockType::q5_1>},
      q8_0{"Q8_0", 32, 34, ggml::dequantize_blocks<ggml::BlockType::q8_0>}, q2_k{"Q2_K", 256, 84, dequantize_q2_k},
      q3_k{"Q3_K", 256, 110, dequantize_q3_k}, q4_k{"Q4_K", 256, 144, dequantize_q4_q5_k<false>},
      q5_k{"Q5_K", 256, 176, dequantize_q4_q5_k<true>}, q6_k{"Q6_K", 256, 210, dequantize_q6_k};
  switch (type) {
    case ggml_type_f32:
      return &f32;
    case ggml_type_f16:
      return &f16;
    case ggml_type_bf16:
      return &bf16;
    case ggml_type_q4_0:
      return &q4_0;
    case ggml_type_q4_1:
      return &q4_1;
    case ggml_type_q5_0:
      return &q5_0;
    case ggml_type_q5_1:
      return &q5_1;
    case ggml_type_q8_0:
      return &q8_0;
    case ggml_type_q2_k:
      return &q2_k;
    case ggml_type_q3_k:
      return &q3_k;
    case ggml_type_q4_k:
      return &q4_k;
    case ggml_type_q5_k:
      return &q5_k;
    case ggml_type_q6_k:
      return &q6_k;
    default:
      return nullptr;
  }
}

/// "F32, F16, BF16, Q4_0, ...": the types ggml_block_format converts, for error messages.
inline std::string ggml_converted_types() {
  std::string list;
  for (std::uint32_t t = 0; t <= ggml_type_bf16; ++t)
    if (const GgmlBlockFormat* f = ggml_block_format(t)) list += (list.empty() ? "" : ", ") + std::string(f->name);
  return list;
}

}  // namespace kvq::llama
