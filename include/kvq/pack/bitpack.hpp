#pragma once
// Bit packing of b-bit codes, b = 1..8. One layout for every width: a little-endian bit stream.
// Code j of a row occupies bits [b*j, b*j + b) of the stream, where bit k of the stream is bit
// (k mod 8) of byte (k / 8). So for widths that divide 8 each byte holds 8/b codes, lowest code
// in the lowest bits:
//   b=1: byte = c0 | c1<<1 | ... | c7<<7       b=2: byte = c0 | c1<<2 | c2<<4 | c3<<6
//   b=4: byte = c0 | c1<<4                     b=8: byte = c0
// and widths 3, 5, 6, 7 run across byte boundaries (b=3: byte0 = c0 | c1<<3 | (c2&3)<<6,
// byte1 = c2>>2 | c3<<1 | c4<<4 | (c5&1)<<7, ...). Unused high bits of a row's last byte are 0.
// A row of n codes takes packed_bytes(n, b) bytes; rows are padded to whole bytes.

#include <cstddef>
#include <cstdint>

#include "kvq/config.hpp"

namespace kvq::inline v0 {

constexpr std::size_t packed_bytes(std::size_t n, int bits) noexcept { return (n * std::size_t(bits) + 7) / 8; }

/// codes (n) with values < 2^bits  ->  out (packed_bytes(n, bits))
inline void pack_codes(const std::uint8_t* KVQ_RESTRICT codes, std::size_t n, int bits,
                       std::uint8_t* KVQ_RESTRICT out) noexcept {
  if (bits == 8) {
    for (std::size_t j = 0; j < n; ++j) out[j] = codes[j];
    return;
  }
  if (8 % bits == 0) {  // whole codes per byte
    const std::size_t per_byte = std::size_t(8 / bits);
    const std::size_t bytes = packed_bytes(n, bits);
    for (std::size_t i = 0; i < bytes; ++i) {
      unsigned byte = 0;
      for (std::size_t k = 0; k < per_byte && i * per_byte + k < n; ++k)
        byte |= unsigned(codes[i * per_byte + k]) << (k * std::size_t(bits));
      out[i] = std::uint8_t(byte);
    }
    return;
  }
  std::uint64_t acc = 0;  // pending bits, lowest first
  int filled = 0;
  std::size_t o = 0;
  for (std::size_t j = 0; j < n; ++j) {
    acc |= std::uint64_t(codes[j]) << filled;
    filled += bits;
    while (filled >= 8) {
      out[o++] = std::uint8_t(acc);
      acc >>= 8;
      filled -= 8;
    }
  }
  if (filled > 0) out[o] = std::uint8_t(acc);
}

/// in (packed_bytes(n, bits))  ->  codes (n)
inline void unpack_codes(const std::uint8_t* KVQ_RESTRICT in, std::size_t n, int bits,
                         std::uint8_t* KVQ_RESTRICT codes) noexcept {
  const unsigned mask = (1u << bits) - 1u;
  if (8 % bits == 0) {
    const std::size_t per_byte = std::size_t(8 / bits);
    for (std::size_t j = 0; j < n; ++j)
      codes[j] = std::uint8_t((in[j / per_byte] >> ((j % per_byte) * std::size_t(bits))) & mask);
    return;
  }
  std::uint64_t acc = 0;
  int filled = 0;
  std::size_t i = 0;
  for (std::size_t j = 0; j < n; ++j) {
    if (filled < bits) {
      acc |= std::uint64_t(in[i++]) << filled;
      filled += 8;
    }
    codes[j] = std::uint8_t(acc & mask);
    acc >>= bits;
    filled -= bits;
  }
}

/// Code j of a packed row: reads the bytes it spans only.
inline std::uint8_t code_at(const std::uint8_t* in, std::size_t j, int bits) noexcept {
  const std::size_t bit = j * std::size_t(bits);
  unsigned word = in[bit / 8];
  if (bit % 8 + std::size_t(bits) > 8) word |= unsigned(in[bit / 8 + 1]) << 8;
  return std::uint8_t((word >> (bit % 8)) & ((1u << bits) - 1u));
}

}  // namespace kvq::inline v0
