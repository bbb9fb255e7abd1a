// ggml's quantized weight formats: blocks built by hand (the k-quants packed the way ggml's
// reference quantizers pack them), every dequantized value checked, and truncated or ragged
// tensor data refused.

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "llama/ggml_blocks.hpp"
#include "llama/gguf.hpp"
#include "llama/llama_test_support.hpp"

namespace kvq::llama {
namespace {

using testing::GgufWriter;
using Bytes = std::vector<std::uint8_t>;

// fp16 bit patterns of exactly representable scales.
constexpr std::uint16_t h_one = 0x3C00, h_half = 0x3800, h_quarter = 0x3400, h_two = 0x4000, h_minus_one = 0xBC00;

void put16(Bytes& b, std::uint16_t v) { GgufWriter::put(b, v); }

// The tensor through the whole loader: one GGUF tensor of `n` values, converted to float.
std::vector<float> load(std::uint32_t type, const Bytes& data, std::uint64_t n) {
  GgufWriter w;
  w.tensor("t", {n}, type, data);
  return GgufFile::parse(w.bytes(), "blocks.gguf").tensor("t").data;
}

// Deterministic codes covering every value of `bits` bits.
std::vector<int> codes(std::size_t n, int bits, unsigned seed) {
  std::vector<int> c(n);
  for (std::size_t i = 0; i < n; ++i) c[i] = static_cast<int>((i * 37u + seed * 11u + (i >> 3)) % (1u << bits));
  return c;
}

TEST(GgmlBlocks, FormatsMatchGgmlBlockSizes) {
  const std::array<std::tuple<std::uint32_t, const char*, std::size_t, std::size_t>, 13> expected{
      {{0, "F32", 1, 4},
       {1, "F16", 1, 2},
       {30, "BF16", 1, 2},
       {2, "Q4_0", 32, 18},
       {3, "Q4_1", 32, 20},
       {6, "Q5_0", 32, 22},
       {7, "Q5_1", 32, 24},
       {8, "Q8_0", 32, 34},
       {10, "Q2_K", 256, 84},
       {11, "Q3_K", 256, 110},
       {12, "Q4_K", 256, 144},
       {13, "Q5_K", 256, 176},
       {14, "Q6_K", 256, 210}}};
  for (const auto& [type, name, elements, bytes] : expected) {
    const GgmlBlockFormat* f = ggml_block_format(type);
    ASSERT_NE(f, nullptr) << name;
    EXPECT_EQ(f->name, name);
    EXPECT_EQ(ggml_type_name(type), name);
    EXPECT_EQ(f->elements, elements) << name;
    EXPECT_EQ(f->bytes, bytes) << name;
  }
  for (const std::uint32_t refused :
       {4u, 5u, 9u, 15u, 16u, 17u, 18u, 19u, 20u, 21u, 22u, 23u, 24u, 28u, 29u, 34u, 39u, 99u})
    EXPECT_EQ(ggml_block_format(refused), nullptr) << refused;
  EXPECT_EQ(ggml_type_name(20), "IQ4_NL");
  EXPECT_EQ(ggml_type_name(99), "");
}

TEST(GgmlBlocks, Q8_0) {
  Bytes b;
  put16(b, h_half);
  for (int j = 0; j < 32; ++j) b.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(j - 16)));
  b[2] = 0x80;       // -128
  b[2 + 31] = 0x7F;  // 127
  const auto y = load(ggml_type_q8_0, b, 32);
  ASSERT_EQ(y.size(), 32u);
  EXPECT_EQ(y[0], -64.0f);
  EXPECT_EQ(y[1], -7.5f);
  EXPECT_EQ(y[16], 0.0f);
  EXPECT_EQ(y[31], 63.5f);
  for (int j = 1; j < 31; ++j) EXPECT_EQ(y[j], 0.5f * float(j - 16)) << j;
}

// Byte j of qs: value j in the low nibble, value j + 16 in the high nibble.
Bytes nibbles() {
  Bytes qs;
  for (int j = 0; j < 16; ++j) qs.push_back(static_cast<std::uint8_t>(j | (15 - j) << 4));
  return qs;
}

TEST(GgmlBlocks, Q4_0AndQ4_1) {
  Bytes b;
  put16(b, h_half);
  const Bytes qs = nibbles();
  b.insert(b.end(), qs.begin(), qs.end());
  const auto y = load(ggml_type_q4_0, b, 32);
  EXPECT_EQ(y[0], -4.0f);  // (0 - 8) * 0.5
  EXPECT_EQ(y[15], 3.5f);  // (15 - 8) * 0.5
  EXPECT_EQ(y[16], 3.5f);  // high nibble of byte 0: 15
  EXPECT_EQ(y[31], -4.0f);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 0.5f * float(j - 8)) << j;
    EXPECT_EQ(y[j + 16], 0.5f * float(7 - j)) << j;
  }

  Bytes c;
  put16(c, h_quarter);
  put16(c, h_minus_one);
  c.insert(c.end(), qs.begin(), qs.end());
  const auto z = load(ggml_type_q4_1, c, 32);
  EXPECT_EQ(z[0], -1.0f);
  EXPECT_EQ(z[15], 2.75f);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(z[j], 0.25f * float(j) - 1.0f) << j;
    EXPECT_EQ(z[j + 16], 0.25f * float(15 - j) - 1.0f) << j;
  }
}

TEST(GgmlBlocks, Q5_0AndQ5_1) {
  // qh (little-endian uint32): bit j is value j's fifth bit. 0xAAAA5555: values 0..15 have it when
  // even, values 16..31 when odd.
  const Bytes qs = nibbles();
  Bytes b;
  put16(b, h_one);
  for (const int byte : {0x55, 0x55, 0xAA, 0xAA}) b.push_back(static_cast<std::uint8_t>(byte));
  b.insert(b.end(), qs.begin(), qs.end());
  const auto y = load(ggml_type_q5_0, b, 32);
  EXPECT_EQ(y[0], 0.0f);    // 0 | 16, minus 16
  EXPECT_EQ(y[1], -15.0f);  // 1, minus 16
  EXPECT_EQ(y[16], -1.0f);  // 15, minus 16
  EXPECT_EQ(y[17], 14.0f);  // 14 | 16, minus 16
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], float((j | (j % 2 == 0 ? 16 : 0)) - 16)) << j;
    EXPECT_EQ(y[j + 16], float(((15 - j) | (j % 2 == 1 ? 16 : 0)) - 16)) << j;
  }

  Bytes c;
  put16(c, h_half);
  put16(c, h_two);
  for (const int byte : {0x00, 0x00, 0xFF, 0xFF}) c.push_back(static_cast<std::uint8_t>(byte));
  c.insert(c.end(), qs.begin(), qs.end());
  const auto z = load(ggml_type_q5_1, c, 32);
  EXPECT_EQ(z[0], 2.0f);
  EXPECT_EQ(z[16], 17.5f);  // (15 + 16) * 0.5 + 2
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(z[j], 0.5f * float(j) + 2.0f) << j;
    EXPECT_EQ(z[j + 16], 0.5f * float(31 - j) + 2.0f) << j;
  }
}

// 2-bit codes of a 256-value k-quant block as ggml's quantizers pack them: byte 32*(e/128) + e%32,
// bits 2*((e%128)/32).
Bytes pack_2bit(const std::vector<int>& L) {
  Bytes qs(64, 0);
  for (int e = 0; e < 256; ++e)
    qs[32 * (e / 128) + e % 32] |= static_cast<std::uint8_t>((L[e] & 3) << (2 * ((e % 128) / 32)));
  return qs;
}

TEST(GgmlBlocks, Q2_K) {
  const auto L = codes(256, 2, 1);
  std::array<int, 16> scale{}, min{};
  Bytes b;
  for (int g = 0; g < 16; ++g) {
    scale[g] = (g * 7 + 3) % 16;
    min[g] = (g * 5 + 1) % 16;
    b.push_back(static_cast<std::uint8_t>(scale[g] | min[g] << 4));
  }
  const Bytes qs = pack_2bit(L);
  b.insert(b.end(), qs.begin(), qs.end());
  put16(b, h_half);     // d
  put16(b, h_quarter);  // dmin
  ASSERT_EQ(b.size(), 84u);
  const auto y = load(ggml_type_q2_k, b, 256);
  ASSERT_EQ(y.size(), 256u);
  for (int e = 0; e < 256; ++e)
    EXPECT_EQ(y[e], 0.5f * float(scale[e / 16]) * float(L[e]) - 0.25f * float(min[e / 16])) << e;
  // Spot check by hand: value 0 has code (0*37 + 11) % 4 = 3, scale 3, min 1: 0.5*3*3 - 0.25.
  EXPECT_EQ(L[0], 3);
  EXPECT_EQ(y[0], 4.25f);
}

TEST(GgmlBlocks, Q3_K) {
  const auto L = codes(256, 3, 2);  // 0..7, stored as code - 4 in -4..3
  std::array<int, 16> scale{};      // 6-bit, stored as scale - 32
  Bytes scales(12, 0);
  for (int g = 0; g < 16; ++g) {
    scale[g] = (g * 13 + 5) % 64;
    // ggml's packing: low nibbles in bytes 0..7 (groups 8..15 in the high nibble), high 2 bits in
    // bytes 8..11 at bit 2*(g/4).
    scales[g % 8] |= static_cast<std::uint8_t>((scale[g] & 0xF) << (g < 8 ? 0 : 4));
    scales[8 + g % 4] |= static_cast<std::uint8_t>((scale[g] >> 4) << (2 * (g / 4)));
  }
  Bytes hmask(32, 0);  // high bit of value e: byte e%32, bit e/32
  for (int e = 0; e < 256; ++e)
    if (L[e] > 3) hmask[e % 32] |= static_cast<std::uint8_t>(1 << (e / 32));
  Bytes b = hmask;
  const Bytes qs = pack_2bit(L);
  b.insert(b.end(), qs.begin(), qs.end());
  b.insert(b.end(), scales.begin(), scales.end());
  put16(b, h_half);
  ASSERT_EQ(b.size(), 110u);
  const auto y = load(ggml_type_q3_k, b, 256);
  for (int e = 0; e < 256; ++e) EXPECT_EQ(y[e], 0.5f * float(scale[e / 16] - 32) * float(L[e] - 4)) << e;
  // By hand: value 0 has code (0 + 22) % 8 = 6 -> 2, group 0's scale 5 -> -27: 0.5 * -27 * 2.
  EXPECT_EQ(y[0], -27.0f);
}

// The 8 (scale, min) 6-bit pairs of Q4_K/Q5_K packed as ggml's quantizer packs them.
Bytes pack_k4_scales(const std::array<int, 8>& scale, const std::array<int, 8>& min) {
  Bytes s(12, 0);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      s[j] = static_cast<std::uint8_t>(scale[j]);
      s[j + 4] = static_cast<std::uint8_t>(min[j]);
    } else {
      s[j + 4] = static_cast<std::uint8_t>((scale[j] & 0xF) | (min[j] & 0xF) << 4);
      s[j - 4] |= static_cast<std::uint8_t>((scale[j] >> 4) << 6);
      s[j] |= static_cast<std::uint8_t>((min[j] >> 4) << 6);
    }
  }
  return s;
}

std::vector<float> check_q4_q5_k(bool fifth_bit) {
  const auto L = codes(256, fifth_bit ? 5 : 4, 3);
  std::array<int, 8> scale{}, min{};
  for (int j = 0; j < 8; ++j) scale[j] = (j * 19 + 40) % 64, min[j] = (j * 23 + 7) % 64;  // both halves of 6 bits
  Bytes b;
  put16(b, h_half);     // d
  put16(b, h_quarter);  // dmin
  const Bytes s = pack_k4_scales(scale, min);
  b.insert(b.end(), s.begin(), s.end());
  if (fifth_bit) {
    Bytes qh(32, 0);  // fifth bit of value e: byte e%32, bit e/32
    for (int e = 0; e < 256; ++e)
      if (L[e] > 15) qh[e % 32] |= static_cast<std::uint8_t>(1 << (e / 32));
    b.insert(b.end(), qh.begin(), qh.end());
  }
  Bytes qs(128, 0);  // value e: byte 32*(e/64) + e%32, low nibble for e%64 < 32
  for (int e = 0; e < 256; ++e)
    qs[32 * (e / 64) + e % 32] |= static_cast<std::uint8_t>((L[e] & 0xF) << (e % 64 < 32 ? 0 : 4));
  b.insert(b.end(), qs.begin(), qs.end());
  EXPECT_EQ(b.size(), fifth_bit ? 176u : 144u);
  const auto y = load(fifth_bit ? ggml_type_q5_k : ggml_type_q4_k, b, 256);
  for (int e = 0; e < 256; ++e)
    EXPECT_EQ(y[e], 0.5f * float(scale[e / 32]) * float(L[e]) - 0.25f * float(min[e / 32])) << e;
  return y;
}

TEST(GgmlBlocks, Q4_K) {
  const auto y = check_q4_q5_k(false);
  // By hand: value 160 is in pair 5 (scale (95 + 40) % 64 = 7, min (115 + 7) % 64 = 58, whose high
  // bits live in bytes 1 and 5) with code (5920 + 33 + 20) % 16 = 5: 0.5*7*5 - 0.25*58.
  EXPECT_EQ(y[160], 3.0f);
}

TEST(GgmlBlocks, Q5_K) {
  const auto y = check_q4_q5_k(true);
  // By hand: value 160's code is 5973 % 32 = 21 (fifth bit set): 0.5*7*21 - 0.25*58.
  EXPECT_EQ(y[160], 59.0f);
}

TEST(GgmlBlocks, Q6_K) {
  const auto L = codes(256, 6, 4);  // stored as code - 32
  std::array<int, 16> scale{};
  for (int g = 0; g < 16; ++g) scale[g] = (g * 29) % 255 - 127;  // int8, both signs
  Bytes ql(128, 0), qh(64, 0);
  // ggml's packing: value e = 128h + 32k + l has its low nibble in ql[64h + l + 32*(k%2)] (high
  // nibble for k >= 2) and its top 2 bits in qh[32h + l] at bit 2k.
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, k = (e % 128) / 32, l = e % 32;
    ql[64 * h + l + 32 * (k % 2)] |= static_cast<std::uint8_t>((L[e] & 0xF) << (k < 2 ? 0 : 4));
    qh[32 * h + l] |= static_cast<std::uint8_t>((L[e] >> 4) << (2 * k));
  }
  Bytes b = ql;
  b.insert(b.end(), qh.begin(), qh.end());
  for (int g = 0; g < 16; ++g) b.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(scale[g])));
  put16(b, h_half);
  ASSERT_EQ(b.size(), 210u);
  const auto y = load(ggml_type_q6_k, b, 256);
  for (int e = 0; e < 256; ++e) EXPECT_EQ(y[e], 0.5f * float(scale[e / 16]) * float(L[e] - 32)) << e;
  EXPECT_EQ(scale[0], -127);
  EXPECT_EQ(L[0], 44);       // (0 + 44) % 64
  EXPECT_EQ(y[0], -762.0f);  // 0.5 * -127 * 12
}

TEST(GgmlBlocks, SeveralBlocksAndRowsInOneTensor) {
  Bytes data;
  for (int b = 0; b < 4; ++b) {  // 2 rows of 64: block b holds (j - 16) * 2^-b
    put16(data, static_cast<std::uint16_t>(h_one - 0x400 * b));
    for (int j = 0; j < 32; ++j) data.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(j - 16)));
  }
  GgufWriter w;
  w.tensor("m", {64, 2}, ggml_type_q8_0, data);
  const auto f = GgufFile::parse(w.bytes());
  const auto& y = f.tensor("m").data;
  ASSERT_EQ(y.size(), 128u);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(y[i], std::ldexp(float(i % 32 - 16), -(i / 32))) << i;
}

void expect_io_error(const Bytes& file, std::initializer_list<std::string_view> parts) {
  try {
    (void)GgufFile::parse(file, "q.gguf");
    ADD_FAILURE() << "parse succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io);
    for (const auto part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(GgmlBlocks, TruncatedOrRaggedDataIsAnIoError) {
  for (const std::uint32_t type : {2u, 3u, 6u, 7u, 8u, 10u, 11u, 12u, 13u, 14u}) {
    const GgmlBlockFormat& f = *ggml_block_format(type);
    GgufWriter whole;
    whole.tensor("w", {f.elements * 2}, type, Bytes(2 * f.bytes, 0));
    Bytes file = whole.bytes();
    EXPECT_NO_THROW((void)GgufFile::parse(file)) << f.name;
    file.resize(file.size() - 1);  // the second block loses its last byte
    expect_io_error(file, {"'w'", "beyond the end"});

    GgufWriter ragged;  // a row that is not a whole number of blocks
    ragged.tensor("r", {f.elements + 1}, type, Bytes(2 * f.bytes, 0));
    expect_io_error(ragged.bytes(), {"'r'", "whole blocks", std::string(f.name)});
  }
}

}  // namespace
}  // namespace kvq::llama
