// ggml's KV-cache block formats: blocks quantized by hand following ggml's reference quantizers
// (the expected bytes are worked out in the comments), round trips on random rows, and refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/codecs/ggml.hpp"
#include "kvq/kernels/quantize/reference.hpp"

namespace {

using kvq::ggml::BlockType;
using Bytes = std::vector<std::uint8_t>;

Bytes quantize(BlockType t, const std::vector<float>& x) {
  Bytes out(x.size() / 32 * kvq::ggml::block_bytes(t));
  kvq::ggml::quantize_row(t, x, out);
  return out;
}

std::vector<float> dequantize(BlockType t, const Bytes& b) {
  std::vector<float> y(b.size() / kvq::ggml::block_bytes(t) * 32);
  kvq::ggml::dequantize_row(t, b, y);
  return y;
}

// 4-bit codes q (value j low nibble, value j + 16 high nibble of byte j).
Bytes nibbles(const std::vector<int>& q) {
  Bytes qs(16);
  for (int j = 0; j < 16; ++j) qs[j] = std::uint8_t((q[j] & 0xF) | (q[j + 16] & 0xF) << 4);
  return qs;
}

// The uint32 qh of 5-bit codes, little-endian: bit j is bit 4 of code j.
Bytes fifth_bits(const std::vector<int>& q) {
  std::uint32_t qh = 0;
  for (int j = 0; j < 32; ++j) qh |= std::uint32_t(q[j] >> 4 & 1) << j;
  return {std::uint8_t(qh), std::uint8_t(qh >> 8), std::uint8_t(qh >> 16), std::uint8_t(qh >> 24)};
}

Bytes concat(std::initializer_list<Bytes> parts) {
  Bytes all;
  for (const Bytes& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

TEST(GgmlCodecs, Q8_0RoundsHalfAwayFromZero) {
  // amax 127: d = 127 / 127 = 1 (fp16 0x3C00), id = 1, code = roundf(x): 2.5 -> 3 and -2.5 -> -3,
  // where ties-to-even would give 2 and -2.
  std::vector<float> x(32, 0.0f);
  x[0] = -127.0f;
  x[1] = 2.5f;
  x[2] = -2.5f;
  x[3] = 0.5f;
  x[4] = 0.49f;
  x[5] = 100.7f;
  x[31] = 126.5f;
  Bytes expected = {0x00, 0x3C};
  for (int j = 0; j < 32; ++j) expected.push_back(0);
  expected[2 + 0] = std::uint8_t(-127);
  expected[2 + 1] = 3;
  expected[2 + 2] = std::uint8_t(-3);
  expected[2 + 3] = 1;
  expected[2 + 4] = 0;
  expected[2 + 5] = 101;
  expected[2 + 31] = 127;
  EXPECT_EQ(quantize(BlockType::q8_0, x), expected);
  const auto y = dequantize(BlockType::q8_0, expected);
  EXPECT_EQ(y[1], 3.0f);
  EXPECT_EQ(y[0], -127.0f);

  // amax 16: d = 16/127 = 0.1259843 -> fp16 0x3008 (1.0078125 * 2^-3 = 0.12597656); the codes use
  // the fp32 id = 127/16 = 7.9375: 1 -> round(7.9375) = 8, 8 -> round(63.5) = 64, -16 -> -127.
  std::vector<float> z(32, 0.0f);
  z[0] = 1.0f;
  z[1] = 8.0f;
  z[2] = -16.0f;
  const Bytes b = quantize(BlockType::q8_0, z);
  EXPECT_EQ(b[0], 0x08);
  EXPECT_EQ(b[1], 0x30);
  EXPECT_EQ(b[2], 8);
  EXPECT_EQ(b[3], 64);
  EXPECT_EQ(b[4], std::uint8_t(-127));
  EXPECT_EQ(dequantize(BlockType::q8_0, b)[1], 64.0f * 0.12597656f);
}

TEST(GgmlCodecs, Q4_0TruncatesXOverDPlus8Point5) {
  // The largest magnitude is -8: d = -8 / -8 = 1 (0x3C00), id = 1, code = min(15, int(x + 8.5)).
  std::vector<float> x(32, 0.0f);
  std::vector<int> q(32, 8);  // 0 -> int(8.5) = 8
  x[0] = -8.0f, q[0] = 0;     // int(0.5) = 0
  x[1] = 7.0f, q[1] = 15;     // int(15.5)
  x[2] = 7.9f, q[2] = 15;     // int(16.4) = 16, capped at 15
  x[3] = 0.5f, q[3] = 9;      // int(9.0): halves round up
  x[4] = -0.5f, q[4] = 8;     // int(8.0)
  x[5] = -0.6f, q[5] = 7;     // int(7.9)
  x[17] = 3.2f, q[17] = 11;   // int(11.7), high nibble of byte 1
  EXPECT_EQ(quantize(BlockType::q4_0, x), concat({{0x00, 0x3C}, nibbles(q)}));

  // The largest magnitude is +4 (before -4, so it wins the tie): d = 4 / -8 = -0.5 (0xB800),
  // id = -2. 4 -> int(-8 + 8.5) = 0 (value 4); -3.5 -> int(7 + 8.5) = 15 (value -3.5); -4 ->
  // int(16.5) = 16, capped: 15 (value -3.5, the asymmetry of the format).
  std::vector<float> y(32, 0.0f);
  std::vector<int> r(32, 8);
  y[0] = 4.0f, r[0] = 0;
  y[1] = -3.5f, r[1] = 15;
  y[2] = -4.0f, r[2] = 15;
  y[3] = 1.0f, r[3] = 6;  // int(-2 + 8.5) = 6, value (6 - 8) * -0.5 = 1
  const Bytes b = quantize(BlockType::q4_0, y);
  EXPECT_EQ(b, concat({{0x00, 0xB8}, nibbles(r)}));
  const auto back = dequantize(BlockType::q4_0, b);
  EXPECT_EQ(back[0], 4.0f);
  EXPECT_EQ(back[2], -3.5f);
  EXPECT_EQ(back[3], 1.0f);
}

TEST(GgmlCodecs, Q4_1StoresScaleAndMin) {
  // min -1, max 14: d = 15 / 15 = 1 (0x3C00), m = -1 (0xBC00), code = min(15, int(x + 1 + 0.5)).
  std::vector<float> x(32, 0.0f);
  std::vector<int> q(32, 1);  // 0 -> int(1.5) = 1
  x[0] = -1.0f, q[0] = 0;
  x[1] = 14.0f, q[1] = 15;
  x[2] = 0.5f, q[2] = 2;    // int(2.0)
  x[3] = 0.49f, q[3] = 1;   // int(1.99)
  x[20] = 6.7f, q[20] = 8;  // int(8.2)
  const Bytes b = quantize(BlockType::q4_1, x);
  EXPECT_EQ(b, concat({{0x00, 0x3C, 0x00, 0xBC}, nibbles(q)}));
  EXPECT_EQ(dequantize(BlockType::q4_1, b)[20], 7.0f);
}

TEST(GgmlCodecs, Q5_0AndQ5_1PutTheFifthBitInQh) {
  // Largest magnitude -16: d = 1, code = min(31, int(x + 16.5)).
  std::vector<float> x(32, 0.0f);
  std::vector<int> q(32, 16);  // fifth bit set on every zero
  x[0] = -16.0f, q[0] = 0;
  x[1] = 15.0f, q[1] = 31;
  x[2] = 15.6f, q[2] = 31;  // int(32.1) capped
  x[3] = -0.5f, q[3] = 16;  // int(16.0)
  x[4] = -1.0f, q[4] = 15;  // int(15.5): fifth bit clear
  x[31] = 2.0f, q[31] = 18;
  EXPECT_EQ(quantize(BlockType::q5_0, x), concat({{0x00, 0x3C}, fifth_bits(q), nibbles(q)}));
  // Every zero has code 16, so qh is all ones but for values 0 and 4: 0xFFFFFFEE.
  EXPECT_EQ(fifth_bits(q), (Bytes{0xEE, 0xFF, 0xFF, 0xFF}));

  // min 0, max 31: d = 1, m = 0, code = int(x + 0.5).
  std::vector<float> y(32, 0.0f);
  std::vector<int> r(32, 0);
  y[0] = 31.0f, r[0] = 31;
  y[1] = 16.5f, r[1] = 17;
  y[2] = 15.49f, r[2] = 15;
  const Bytes b = quantize(BlockType::q5_1, y);
  EXPECT_EQ(b, concat({{0x00, 0x3C, 0x00, 0x00}, fifth_bits(r), nibbles(r)}));
  EXPECT_EQ(dequantize(BlockType::q5_1, b)[1], 17.0f);
}

TEST(GgmlCodecs, Iq4NlTakesNearestLevelsThenTheLeastSquaresScale) {
  // Values exactly on the levels, -127 first: d0 = -127 / -127 = 1, codes j % 16, and the
  // least-squares scale sum(x^2 q x) / sum(x^2 q q) is exactly 1 (both sums are the same floats).
  std::vector<float> x(32);
  std::vector<int> q(32);
  for (int j = 0; j < 32; ++j) x[j] = float(kvq::ggml::iq4_nl_levels[j % 16]), q[j] = j % 16;
  EXPECT_EQ(quantize(BlockType::iq4_nl, x), concat({{0x00, 0x3C}, nibbles(q)}));

  // Ties go to the upper level: 7 is 6 from 1 and 13 (code 9), -16 is 6 from -22 and -10 (code 7);
  // zeros take level 1 (code 8). d = (127^4 + 7^3 13 + 16^3 10) / (127^4 + 7^2 13^2 + 16^2 10^2)
  // = 0.99998 -> fp16 1.0 (0x3C00).
  std::vector<float> y(32, 0.0f);
  std::vector<int> r(32, 8);
  y[0] = -127.0f, r[0] = 0;
  y[1] = 7.0f, r[1] = 9;
  y[2] = -16.0f, r[2] = 7;
  EXPECT_EQ(quantize(BlockType::iq4_nl, y), concat({{0x00, 0x3C}, nibbles(r)}));

  // Halved: d0 = 0.5, codes unchanged, d = 0.5 (0x3800); decoding gives d * level.
  for (float& v : x) v *= 0.5f;
  const Bytes b = quantize(BlockType::iq4_nl, x);
  EXPECT_EQ(b, concat({{0x00, 0x38}, nibbles(q)}));
  EXPECT_EQ(dequantize(BlockType::iq4_nl, b)[15], 56.5f);
}

// q4_0 and q5_0 store d = 0 / -8 = -0 (0x8000), as ggml does.
TEST(GgmlCodecs, ZeroBlocksStoreZeroScales) {
  const std::vector<float> zeros(32, 0.0f);
  for (BlockType t : kvq::ggml::block_types) {
    const Bytes b = quantize(t, zeros);
    const bool negative = t == BlockType::q4_0 || t == BlockType::q5_0;
    EXPECT_EQ(b[0], 0) << name(t);
    EXPECT_EQ(b[1], negative ? 0x80 : 0x00) << name(t);
    for (float v : dequantize(t, b)) EXPECT_EQ(v, 0.0f) << name(t);
  }
  // A step too small to invert (subnormal: 1 / d is infinite) codes every value 0, as a constant
  // block does, where (x - min) / d would be NaN for x = min.
  for (BlockType t : {BlockType::q4_1, BlockType::q5_1}) {
    std::vector<float> tiny(32, 0.0f);
    tiny[7] = (t == BlockType::q4_1 ? 15.0f : 31.0f) * std::ldexp(1.0f, -149);
    const Bytes b = quantize(t, tiny);
    EXPECT_EQ(b, Bytes(b.size(), 0)) << name(t);
  }
}

TEST(GgmlCodecs, RandomRowsRoundTripWithinTheirStep) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (BlockType t : kvq::ggml::block_types) {
    std::vector<float> x(32 * 40);
    for (float& v : x) v = normal(rng);
    const Bytes b = quantize(t, x);
    ASSERT_EQ(b.size(), 40 * kvq::ggml::block_bytes(t));
    const auto y = dequantize(t, b);
    const double levels = t == BlockType::q8_0 ? 254 : t == BlockType::q5_0 || t == BlockType::q5_1 ? 31 : 15;
    for (std::size_t blk = 0; blk < 40; ++blk) {
      float lo = x[blk * 32], hi = lo;
      for (std::size_t j = 0; j < 32; ++j) lo = std::min(lo, x[blk * 32 + j]), hi = std::max(hi, x[blk * 32 + j]);
      // A step of the block's range over its levels; the capped top code of q4_0/q5_0 and
      // iq4_nl's wider outer cells can cost one whole step.
      const double step = (t == BlockType::q4_1 || t == BlockType::q5_1 ? hi - lo : 2 * std::max(-lo, hi)) / levels;
      const double bound = (t == BlockType::iq4_nl ? 2.0 : 1.0) * step * 1.01;
      for (std::size_t j = 0; j < 32; ++j) EXPECT_LE(std::fabs(y[blk * 32 + j] - x[blk * 32 + j]), bound) << name(t);
    }
    // Byte-identical through the weight reader's raw entry point.
    std::vector<float> raw(x.size());
    kvq::ggml::dequantize_row(t, b, raw);
    EXPECT_EQ(raw, y);
  }
}

TEST(GgmlCodecs, NamesAndRefusals) {
  EXPECT_EQ(kvq::ggml::parse_block_type("q5_1"), BlockType::q5_1);
  EXPECT_EQ(kvq::ggml::parse_block_type("Q5_1"), std::nullopt);
  EXPECT_EQ(kvq::ggml::block_type_names(), "q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl");
  std::vector<float> x(33, 1.0f);
  Bytes out(18, 0xAA);
  EXPECT_THROW(kvq::ggml::quantize_row(BlockType::q4_0, x, out), kvq::Error);  // not whole blocks
  x.resize(32);
  Bytes small(17);
  EXPECT_THROW(kvq::ggml::quantize_row(BlockType::q4_0, x, small), kvq::Error);
  x[7] = NAN;
  EXPECT_THROW(kvq::ggml::quantize_row(BlockType::q4_0, x, out), kvq::Error);
  EXPECT_EQ(out, Bytes(18, 0xAA)) << "a failed call writes nothing";
  x[7] = 1e6f;  // q8_0: d = 1e6 / 127 fits fp16; q4_0: d = 1e6 / 8 = 125000 does not
  Bytes q8(34);
  EXPECT_NO_THROW(kvq::ggml::quantize_row(BlockType::q8_0, x, q8));
  EXPECT_THROW(kvq::ggml::quantize_row(BlockType::q4_0, x, out), kvq::Error);
  EXPECT_EQ(out, Bytes(18, 0xAA));
  std::vector<float> y(31);
  EXPECT_THROW(kvq::ggml::dequantize_row(BlockType::q8_0, q8, y), kvq::Error);
  // Blocks from elsewhere with a NaN or Inf fp16 scale (or q4_1's minimum): refused by block.
  for (const BlockType t : {BlockType::q8_0, BlockType::q4_1}) {
    for (const std::size_t at : t == BlockType::q4_1 ? std::vector<std::size_t>{0, 2} : std::vector<std::size_t>{0})
      for (const unsigned bits : {0x7e00u, 0x7c00u, 0xfc00u}) {  // NaN, +Inf, -Inf
        Bytes blocks(2 * kvq::ggml::block_bytes(t), 0x11);
        blocks[kvq::ggml::block_bytes(t) + at] = std::uint8_t(bits & 0xff);  // block 1, little-endian
        blocks[kvq::ggml::block_bytes(t) + at + 1] = std::uint8_t(bits >> 8);
        std::vector<float> z(64, 7.0f);
        try {
          kvq::ggml::dequantize_row(t, blocks, z);
          ADD_FAILURE() << "taken";
        } catch (const kvq::Error& e) {
          EXPECT_EQ(e.code(), kvq::ErrorCode::non_finite_input);
          EXPECT_NE(std::string(e.what()).find("block 1 holds a NaN or Inf"), std::string::npos) << e.what();
        }
        EXPECT_EQ(z, std::vector<float>(64, 7.0f));
        blocks[kvq::ggml::block_bytes(t) + at + 1] = 0x11;
        kvq::ggml::dequantize_row(t, blocks, z);
        for (const float v : z) EXPECT_TRUE(std::isfinite(v));
      }
  }
}

// ggml's quantize_row_q8_0_ref / q4_0_ref / q5_0_ref for one block of 32, written out here on
// their own (not through kvq's functions): the fp16 step and the codes as kvq stores them (q8_0's
// int8 codes plus 128).
struct RefBlock {
  std::uint16_t d = 0;
  std::uint8_t q[32] = {};
};
RefBlock ggml_reference_block(int bits, const float* x) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; ++j)
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  RefBlock b;
  if (bits == 8) {
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    b.d = kvq::to_fp16(d).bits;
    for (int j = 0; j < 32; ++j) b.q[j] = std::uint8_t(int(std::round(x[j] * id)) + 128);
    return b;
  }
  const float half = bits == 4 ? 8.0f : 16.0f, d = max / -half, id = d != 0.0f ? 1.0f / d : 0.0f;
  b.d = kvq::to_fp16(d).bits;
  for (int j = 0; j < 32; ++j) {
    volatile float x0 = x[j] * id;  // ggml's two roundings, not one fused multiply-add
    b.q[j] = std::uint8_t(std::min(int(2 * half) - 1, int(std::int8_t(x0 + (half + 0.5f)))));
  }
  return b;
}

// The cache's ggml levels ("k4t32g" for q4_0, "k5t32g" for q5_0, "k8t32g" for q8_0) hold ggml's
// blocks: the fp16 step and codes of the reference quantizer above for each 32 values of a head
// (ties of magnitude, zero blocks, a block whose step is subnormal), and the cache reads back
// ggml's values (as floats compare: ggml decodes the middle code to -0 where d < 0, kvq to +0).
// Whole tensors (tokens, heads, dim) through a cache configured `config` (per-token groups of
// 32), read back exactly as ggml decodes each head row's blocks of type t.
void expect_cache_holds_blocks(const std::string& config, BlockType t, const std::vector<float>& keys,
                               const std::vector<float>& values, std::size_t heads, std::size_t dim) {
  const std::size_t tokens = keys.size() / (heads * dim);
  kvq::BasicKVCache cache(kvq::CacheShape{1, heads, dim, 64}, kvq::parse_cache_config(config));
  cache.append(0, 0, keys, values);
  for (const kvq::Tensor tensor : {kvq::Tensor::keys, kvq::Tensor::values}) {
    const std::vector<float>& input = tensor == kvq::Tensor::keys ? keys : values;
    for (std::size_t p = 0; p < tokens; ++p)
      for (std::size_t h = 0; h < heads; ++h) {
        const std::vector<float> x(input.begin() + std::ptrdiff_t((p * heads + h) * dim),
                                   input.begin() + std::ptrdiff_t((p * heads + h + 1) * dim));
        std::vector<float> row(dim);
        cache.read_row(tensor, 0, h, p, row.data());
        ASSERT_EQ(row, dequantize(t, quantize(t, x))) << config << " position " << p << " head " << h;
      }
  }
}

TEST(GgmlCodecs, CacheGgmlLevelsHoldGgmlBlocks) {
  namespace ref = kvq::kernels::reference;
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t dim = 96, heads = 2, tokens = 40;  // dim: three blocks per head
  std::vector<float> keys(tokens * heads * dim), values(keys.size());
  for (auto* tensor : {&keys, &values})
    for (float& x : *tensor) x = normal(rng) * (rng() % 8 == 0 ? 30.0f : 1.0f);
  std::fill_n(keys.begin() + 3 * heads * dim, 32, 0.0f);                    // a zero block
  keys[5 * heads * dim + 3] = 400.0f, keys[5 * heads * dim + 9] = -400.0f;  // a tie: the first leads
  keys[6 * heads * dim + 33] = -400.0f, keys[6 * heads * dim + 40] = 400.0f;
  for (std::size_t c = 0; c < 32; ++c)  // steps of 4-5 bits subnormal, their inverses finite
    keys[7 * heads * dim + c] = 5e-38f * float(int(c % 5) - 2) / 2.0f;
  for (const auto& [t, bits] : {std::pair{BlockType::q8_0, 8}, {BlockType::q4_0, 4}, {BlockType::q5_0, 5}}) {
    const std::string b = std::to_string(bits);
    SCOPED_TRACE(std::string(kvq::ggml::name(t)));
    const kvq::QuantizerSpec spec = kvq::parse_quantizer("k" + b + "t32g", 'k');
    // Head rows through the cache's quantizer, against ggml's reference and the codec's blocks.
    for (std::size_t r = 0; r < tokens * heads; ++r) {
      const float* x = keys.data() + r * dim;
      std::vector<std::uint8_t> scales(3 * 2), codes(kvq::packed_bytes(dim, bits));
      ref::quantize_row_per_token(spec, x, dim, scales.data(), nullptr, codes.data());
      const Bytes blocks = quantize(t, std::vector<float>(x, x + dim));
      std::uint8_t code[96];
      kvq::unpack_codes(codes.data(), dim, bits, code);
      for (std::size_t g = 0; g < 3; ++g) {
        if (bits == 8 && r == 7 * heads && g == 0) continue;  // q8_0's 1 / d overflows there: ggml's codes are chance
        const RefBlock expected = ggml_reference_block(bits, x + 32 * g);
        const std::uint16_t step = std::uint16_t(scales[2 * g] | scales[2 * g + 1] << 8);
        ASSERT_EQ(step, expected.d) << "row " << r << " block " << g;
        const std::uint8_t* block = blocks.data() + g * kvq::ggml::block_bytes(t);
        ASSERT_EQ(std::uint16_t(block[0] | block[1] << 8), expected.d) << "row " << r << " block " << g;
        std::uint8_t q[32];
        if (t == BlockType::q8_0)
          for (std::size_t j = 0; j < 32; ++j) q[j] = std::uint8_t(block[2 + j] ^ 0x80);
        else
          kvq::ggml::detail::unpack_codes(block + (bits == 5 ? 6 : 2), bits == 5 ? block + 2 : nullptr, q);
        for (std::size_t j = 0; j < 32; ++j) {
          ASSERT_EQ(code[32 * g + j], expected.q[j]) << "row " << r << " value " << 32 * g + j;
          ASSERT_EQ(q[j], expected.q[j]) << "row " << r << " value " << 32 * g + j;
        }
      }
    }
    expect_cache_holds_blocks("k" + b + "t32g-v" + b + "t32g-r0-s0-post-f32", t, keys, values, heads, dim);
  }
}

TEST(GgmlCodecs, CacheIq4NlLevelsHoldIq4NlBlocks) {
  // Mode::iq4_nl ("k4t32i") is llama.cpp's iq4_nl cache type: per-token groups of 32 store the
  // block's scale and codes, and decode as ggml decodes the block, per token and per channel.
  std::mt19937 rng(29);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t dim = 64, heads = 2, tokens = 40;
  std::vector<float> keys(tokens * heads * dim), values(keys.size());
  for (auto* tensor : {&keys, &values})
    for (float& x : *tensor) x = normal(rng) * (rng() % 8 == 0 ? 30.0f : 1.0f);
  std::fill_n(keys.begin() + 3 * heads * dim, 32, 0.0f);                    // a zero block
  keys[5 * heads * dim + 3] = 400.0f, keys[5 * heads * dim + 9] = -400.0f;  // a tie: the first leads
  expect_cache_holds_blocks("k4t32i-v4t32i-r0-s0-post-f32", BlockType::iq4_nl, keys, values, heads, dim);
  // Per channel: each channel's run of 32 tokens is one block.
  kvq::BasicKVCache channels(kvq::CacheShape{1, 1, 8, 64}, kvq::parse_cache_config("k4c32i-v4t8i-r0-s0-post-f32"));
  channels.append(0, 0, std::span(keys).first(32 * 8), std::span(values).first(32 * 8));
  for (std::size_t c = 0; c < 8; ++c) {
    std::vector<float> column(32), decoded(32), row(8);
    for (std::size_t p = 0; p < 32; ++p) column[p] = keys[p * 8 + c];
    const std::vector<float> expected = dequantize(BlockType::iq4_nl, quantize(BlockType::iq4_nl, column));
    for (std::size_t p = 0; p < 32; ++p) {
      channels.read_row(kvq::Tensor::keys, 0, 0, p, row.data());
      ASSERT_EQ(row[c], expected[p]) << "channel " << c << " position " << p;
    }
  }
  // Past 2^36 ggml's float least-squares sums overflow (a NaN scale): refused, nothing stored,
  // with every parameter type (f16 refuses far earlier, at 7 absmax / 127 > 65504).
  for (const char* config : {"k4t32i.f32-v4t32i.f32-r0-s0-post-f32", "k4t32i.bf16-v4t32i.bf16-r0-s0-post-f32"}) {
    kvq::BasicKVCache cache(kvq::CacheShape{1, 1, 32, 4}, kvq::parse_cache_config(config));
    std::vector<float> row(32, 1.0f), huge = row;
    huge[9] = -0x1p37f;
    cache.append(0, 0, row, row);
    try {
      cache.append(0, 1, row, huge);
      ADD_FAILURE() << config << ": a value of -2^37 was stored";
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find("overflows iq4_nl's least-squares fit"), std::string::npos) << e.what();
    }
    EXPECT_EQ(cache.length(0), 1u) << config;
    huge[9] = -0x1p35f;  // within the bound: stored and read back finite
    cache.append(0, 1, row, huge);
    cache.read_row(kvq::Tensor::values, 0, 0, 1, row.data());
    EXPECT_TRUE(std::isfinite(row[0]) && std::isfinite(row[9])) << config;
    EXPECT_NEAR(row[9], -0x1p35f, 0x1p35f / 8) << config;
  }
  EXPECT_THROW((void)kvq::parse_quantizer("k3t32i", 'k'), kvq::Error);
  EXPECT_THROW((void)kvq::parse_quantizer("k4t32o1i", 'k'), kvq::Error);
  EXPECT_EQ(kvq::to_string(kvq::parse_quantizer("v4t32i", 'v'), 'v'), "v4t32i");
}

}  // namespace
