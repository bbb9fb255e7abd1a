// pack_codes / unpack_codes / code_at against a bit-by-bit model of the documented layout.

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kvq/pack/bitpack.hpp"

namespace {

// The layout, written as its definition: bit k of code j is bit b*j + k of a little-endian stream.
std::vector<std::uint8_t> model_pack(const std::vector<std::uint8_t>& codes, int bits) {
  const std::size_t total_bits = codes.size() * std::size_t(bits);
  std::vector<std::uint8_t> out((total_bits + 7) / 8, 0);
  for (std::size_t j = 0; j < codes.size(); ++j)
    for (int k = 0; k < bits; ++k)
      if ((codes[j] >> k) & 1) {
        const std::size_t bit = std::size_t(bits) * j + std::size_t(k);
        out[bit / 8] = std::uint8_t(out[bit / 8] | (1u << (bit % 8)));
      }
  return out;
}

std::vector<std::size_t> lengths() {
  std::vector<std::size_t> n;
  for (std::size_t i = 0; i <= 70; ++i) n.push_back(i);
  for (std::size_t i : {127, 128, 129, 1000}) n.push_back(i);
  return n;
}

TEST(Bitpack, PackedBytes) {
  EXPECT_EQ(kvq::packed_bytes(0, 3), 0u);
  EXPECT_EQ(kvq::packed_bytes(1, 1), 1u);
  EXPECT_EQ(kvq::packed_bytes(8, 1), 1u);
  EXPECT_EQ(kvq::packed_bytes(9, 1), 2u);
  EXPECT_EQ(kvq::packed_bytes(128, 2), 32u);
  EXPECT_EQ(kvq::packed_bytes(3, 3), 2u);
  EXPECT_EQ(kvq::packed_bytes(8, 3), 3u);
  EXPECT_EQ(kvq::packed_bytes(100, 7), 88u);
  EXPECT_EQ(kvq::packed_bytes(5, 8), 5u);
}

TEST(Bitpack, MatchesBitByBitModelForEveryWidthAndLength) {
  std::mt19937 rng(2024);
  for (int bits = 1; bits <= 8; ++bits) {
    std::uniform_int_distribution<int> code(0, (1 << bits) - 1);
    for (const std::size_t n : lengths()) {
      for (int pattern = 0; pattern < 3; ++pattern) {
        std::vector<std::uint8_t> codes(n);
        for (auto& c : codes) c = std::uint8_t(pattern == 0 ? code(rng) : pattern == 1 ? (1 << bits) - 1 : 0);
        const std::vector<std::uint8_t> want = model_pack(codes, bits);
        ASSERT_EQ(want.size(), kvq::packed_bytes(n, bits));
        // Poison the output and one guard byte: every packed byte must be written (high bits 0),
        // and nothing past packed_bytes.
        std::vector<std::uint8_t> got(want.size() + 1, 0xcd);
        kvq::pack_codes(codes.data(), n, bits, got.data());
        for (std::size_t i = 0; i < want.size(); ++i)
          ASSERT_EQ(got[i], want[i]) << "bits " << bits << " n " << n << " pattern " << pattern << " byte " << i;
        ASSERT_EQ(got.back(), 0xcd) << "wrote past packed_bytes: bits " << bits << " n " << n;

        std::vector<std::uint8_t> back(n + 1, 0xee);
        kvq::unpack_codes(got.data(), n, bits, back.data());
        for (std::size_t j = 0; j < n; ++j) ASSERT_EQ(back[j], codes[j]) << "bits " << bits << " n " << n << " j " << j;
        ASSERT_EQ(back[n], 0xee);
        // One code at a time, from a row of exactly packed_bytes (ASan sees a read past it).
        for (std::size_t j = 0; j < n; ++j)
          ASSERT_EQ(kvq::code_at(want.data(), j, bits), codes[j]) << "bits " << bits << " n " << n << " j " << j;
      }
    }
  }
}

TEST(Bitpack, UnpackIgnoresNeighbouringBytes) {
  // A row followed by another row's bytes: unpacking n codes must not depend on them.
  for (int bits = 1; bits <= 8; ++bits)
    for (std::size_t n : {1, 3, 5, 13}) {
      std::vector<std::uint8_t> codes(n, std::uint8_t((1 << bits) - 1));
      std::vector<std::uint8_t> packed(kvq::packed_bytes(n, bits) + 4, 0xff);
      kvq::pack_codes(codes.data(), n, bits, packed.data());
      std::vector<std::uint8_t> back(n);
      kvq::unpack_codes(packed.data(), n, bits, back.data());
      EXPECT_EQ(back, codes);
    }
}

TEST(Bitpack, DocumentedLayouts) {
  auto pack = [](std::vector<std::uint8_t> codes, int bits) {
    std::vector<std::uint8_t> out(kvq::packed_bytes(codes.size(), bits));
    kvq::pack_codes(codes.data(), codes.size(), bits, out.data());
    return out;
  };
  using Bytes = std::vector<std::uint8_t>;
  // b=2: byte = c0 | c1<<2 | c2<<4 | c3<<6
  EXPECT_EQ(pack({1, 2, 3, 0}, 2), Bytes{0b00111001});
  EXPECT_EQ(pack({3, 0, 0, 0, 1}, 2), (Bytes{0b00000011, 0b00000001}));
  // b=4: byte = c0 | c1<<4
  EXPECT_EQ(pack({0xa, 0x5, 0xf}, 4), (Bytes{0x5a, 0x0f}));
  // b=3 crosses bytes: byte0 = c0 | c1<<3 | (c2&3)<<6, byte1 = c2>>2 | c3<<1 | c4<<4 | (c5&1)<<7
  EXPECT_EQ(pack({1, 2, 7, 0, 0, 0, 0, 0}, 3), (Bytes{0b11010001, 0b00000001, 0b00000000}));
  EXPECT_EQ(pack({0, 0, 0, 5, 3, 1}, 3), (Bytes{0b00000000, 0b10111010, 0b00000000}));
  EXPECT_EQ(pack({7, 7, 7, 7, 7, 7, 7, 7}, 3), (Bytes{0xff, 0xff, 0xff}));
  EXPECT_EQ(pack({6}, 3), Bytes{0b00000110});
  // b=1: byte = c0 | c1<<1 | ... ; b=8: byte = c0
  EXPECT_EQ(pack({1, 0, 0, 0, 0, 0, 0, 1, 1}, 1), (Bytes{0b10000001, 0b00000001}));
  EXPECT_EQ(pack({200, 7}, 8), (Bytes{200, 7}));
}

}  // namespace
