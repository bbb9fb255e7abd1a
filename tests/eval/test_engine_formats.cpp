// Engine formats simulated for kvq-eval: names, the row codec against the codecs it stands for,
// and the fp32 backend's stored-row filter.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "eval/engine_formats.hpp"
#include "eval/report.hpp"
#include "kvq/rope/rope.hpp"
#include "llama/full_precision_backend.hpp"
#include "support/random.hpp"

namespace {

using kvq::eval::EngineRowCodec;
using kvq::eval::parse_engine_format;

TEST(EngineFormats, NamesParseAndEveryListedNameIsAccepted) {
  const auto f = parse_engine_format("ggml-iq4_nl-hadamard");
  EXPECT_EQ(f.block, kvq::ggml::BlockType::iq4_nl);
  EXPECT_TRUE(f.hadamard);
  EXPECT_EQ(parse_engine_format("fp8-e5m2").fp8, kvq::Fp8Format::e5m2);
  EXPECT_FALSE(parse_engine_format("fp8-e4m3").block.has_value());
  const auto names = kvq::eval::engine_format_names();
  EXPECT_EQ(names.size(), 19u);
  for (const auto& n : names) {
    EXPECT_TRUE(kvq::eval::is_engine_format_name(n)) << n;
    EXPECT_EQ(parse_engine_format(n).name, n);
  }
  EXPECT_THROW(parse_engine_format("ggml-"), kvq::Error);
  EXPECT_THROW(parse_engine_format("ggml-q4_0-hadamard-hadamard"), kvq::Error);
  EXPECT_THROW(parse_engine_format("fp8-e4m3-hadamard"), kvq::Error);
  EXPECT_FALSE(kvq::eval::is_engine_format_name("k4c32-v4t8-r0-s0"));
  const auto turbo = parse_engine_format("turbo-k3v4");
  EXPECT_TRUE(turbo.turbo());
  EXPECT_EQ(turbo.key_bits, 3);
  EXPECT_EQ(turbo.value_bits, 4);
  EXPECT_DOUBLE_EQ(turbo.bits_per_value(128), 3.5 + 0.125);  // one fp16 scale per head vector
  for (const char* bad : {"turbo-k5v4", "turbo-k3", "turbo-k3v4x", "turbo-v4k3", "turbo-"}) {
    try {
      (void)parse_engine_format(bad);
      ADD_FAILURE() << bad << " parsed";
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

TEST(EngineFormats, RowCodecIsTheCodecOnWholeRowsWithTheRotationAroundIt) {
  // 4 heads of 16: a row of 64 = two q4_0 blocks, each spanning two heads.
  const std::vector<float> k = kvq::test::outlier_keys(1, 4, 16, 3, 9.0f, 1), v = kvq::test::normal_vector(64, 2);
  for (const char* name : {"ggml-q4_0", "ggml-q4_0-hadamard", "fp8-e5m2"}) {
    const auto format = parse_engine_format(name);
    EngineRowCodec codec(format, 4, 16);
    std::vector<float> key = k, value = v;
    codec(key, value);
    std::vector<float> expected = k;
    const kvq::HadamardTransform h(16);
    if (format.hadamard) h.forward(expected);
    if (format.block) {
      std::vector<std::uint8_t> blocks(2 * kvq::ggml::block_bytes(*format.block));
      kvq::ggml::quantize_row(*format.block, expected, blocks);
      kvq::ggml::dequantize_row(*format.block, blocks, expected);
    } else {
      for (float& x : expected) x = kvq::fp8_to_float(format.fp8, kvq::float_to_fp8(format.fp8, x));
    }
    if (format.hadamard) h.inverse(expected);
    EXPECT_EQ(key, expected) << name;
    EXPECT_NE(key, k) << name << ": something was quantized";
  }
  // TurboQuant-style: each head rotated with the fixed random signs, then coded per head vector
  // (Lloyd-Max levels scaled by the RMS for keys at 3 bits; int8 by absmax for values at 8).
  {
    const auto format = parse_engine_format("turbo-k3v8");
    EngineRowCodec codec(format, 4, 16);
    std::vector<float> key = k, value = v;
    codec(key, value);
    const kvq::HadamardTransform h(16, EngineRowCodec::turbo_sign_seed);
    for (const auto& [x, original, bits] : {std::tuple{&key, &k, 3}, std::tuple{&value, &v, 8}}) {
      std::vector<float> expected = *original, scales(4);
      std::vector<std::uint8_t> codes(64);
      h.forward(expected);
      const kvq::LevelCodec c = EngineRowCodec::turbo_codec(bits, 16);
      EXPECT_EQ(c.levels->size(), bits == 8 ? 255u : 8u);
      c.encode(expected, codes, scales);
      c.decode(codes, scales, expected);
      h.inverse(expected);
      EXPECT_EQ(*x, expected) << bits << " bits";
      EXPECT_NE(*x, *original) << bits << " bits: something was quantized";
    }
    double key_error = 0, value_error = 0;
    for (std::size_t i = 0; i < 64; ++i)
      key_error += std::pow(key[i] - k[i], 2), value_error += std::pow(value[i] - v[i], 2);
    EXPECT_LT(value_error, key_error) << "8 bits lose less than 3";
  }
  // Rows of 24 values are not whole ggml blocks; fp8 has no blocks.
  EXPECT_THROW(EngineRowCodec(parse_engine_format("ggml-q8_0"), 3, 8), kvq::Error);
  EXPECT_NO_THROW(EngineRowCodec(parse_engine_format("fp8-e4m3"), 3, 8));
}

TEST(EngineFormats, BackendAttendsOverFilteredRowsAndAThrowingFilterStoresNothing) {
  const kvq::RopeConfig rope{8, kvq::RopeStyle::adjacent_pairs, 10000.0f};
  int calls = 0;
  kvq::llama::FullPrecisionBackend plain(1, 2, 1, rope, 4),
      zeroed(1, 2, 1, rope, 4, [&](std::span<float> k, std::span<float> v) {
        ++calls;
        for (float& x : v) x = 0.0f;
        if (k[0] > 100.0f) throw std::runtime_error("refused");
      });
  const std::vector<float> k = kvq::test::normal_vector(8, 3), v = kvq::test::normal_vector(8, 4),
                           q = kvq::test::normal_vector(16, 5);
  plain.append(0, 0, k, v);
  zeroed.append(0, 0, k, v);
  std::vector<float> out(16);
  zeroed.attend(0, 0, q, out);
  for (float x : out) EXPECT_EQ(x, 0.0f);  // attention read the filtered values
  plain.attend(0, 0, q, out);
  EXPECT_NE(out[0], 0.0f);
  EXPECT_EQ(std::vector<float>(zeroed.values(0).begin(), zeroed.values(0).end()), v);  // values() as appended
  std::vector<float> big = k;
  big[0] = 1000.0f;  // cos(1) * 1000 after RoPE at position 1: still above 100
  EXPECT_THROW(zeroed.append(0, 1, big, v), std::runtime_error);
  EXPECT_EQ(zeroed.length(0), 1u);
  EXPECT_EQ(zeroed.keys(0).size(), 8u);
  zeroed.append(0, 1, k, v);  // the sequence continues where it was
  EXPECT_EQ(zeroed.length(0), 2u);
  EXPECT_EQ(calls, 3);
}

// Hugging Face's quantized cache: affine min-max per 64 values of a head vector (the vector where
// head_dim < 64), fp16 scale and minimum; 2 or 4 bits, residual 128.
TEST(EngineFormats, HuggingFaceFormatsQuantizeGroupsOf64Affine) {
  const auto f = parse_engine_format("hf-int4");
  EXPECT_TRUE(f.hf());
  EXPECT_EQ(f.residual(), 128u);
  EXPECT_DOUBLE_EQ(f.bits_per_value(128), 4.5);
  EXPECT_DOUBLE_EQ(f.bits_per_value(8), 8.0);
  EXPECT_DOUBLE_EQ(parse_engine_format("hf-int2").bits_per_value(64), 2.5);
  EXPECT_THROW(parse_engine_format("hf-int3"), kvq::Error);
  for (const std::size_t head_dim : {std::size_t{128}, std::size_t{8}})
    for (const int bits : {4, 2}) {
      EngineRowCodec codec(parse_engine_format(bits == 4 ? "hf-int4" : "hf-int2"), 2, head_dim);
      const std::vector<float> k0 = kvq::test::normal_vector(2 * head_dim, 11),
                               v0 = kvq::test::normal_vector(2 * head_dim, 12);
      std::vector<float> k = k0, v = v0;
      codec(k, v);
      const std::size_t group = std::min<std::size_t>(64, head_dim);
      for (std::size_t g = 0; g < k0.size(); g += group) {
        float lo = k0[g], hi = k0[g];
        for (std::size_t i = g; i < g + group; ++i) lo = std::min(lo, k0[i]), hi = std::max(hi, k0[i]);
        const float step = (hi - lo) / float((1 << bits) - 1);
        std::vector<float> levels;
        for (std::size_t i = g; i < g + group; ++i) {
          EXPECT_NEAR(k[i], k0[i], 0.5f * step + 2e-3f) << "group " << g / group << ", " << bits << " bits";
          if (std::find(levels.begin(), levels.end(), k[i]) == levels.end()) levels.push_back(k[i]);
        }
        EXPECT_LE(levels.size(), std::size_t{1} << bits);
      }
      EXPECT_NE(v, v0);
    }
}

// A delayed filter (Hugging Face's residual): rows stay exact until `delay` gather, and the next
// append filters them all at once.
TEST(EngineFormats, DelayedFilterWaitsForTheResidualToFill) {
  const kvq::RopeConfig rope{4, kvq::RopeStyle::adjacent_pairs, 10000.0f};
  int calls = 0;
  kvq::llama::FullPrecisionBackend kv(
      1, 1, 1, rope, 8,
      [&](std::span<float>, std::span<float> v) {
        ++calls;
        for (float& x : v) x = 0.0f;
      },
      3);
  const std::vector<float> zero(4, 0.0f), q(4, 0.0f);  // equal keys: uniform attention
  std::vector<float> out(4);
  for (std::size_t p = 0; p < 3; ++p) kv.append(0, p, zero, std::vector<float>(4, float(p + 1)));
  EXPECT_EQ(kv.unfiltered(0), 3u);
  kv.attend(0, 2, q, out);
  EXPECT_FLOAT_EQ(out[0], 2.0f);  // (1 + 2 + 3) / 3: all exact
  kv.append(0, 3, zero, std::vector<float>(4, 4.0f));
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(kv.unfiltered(0), 1u);
  kv.attend(0, 3, q, out);
  EXPECT_FLOAT_EQ(out[0], 1.0f);  // (0 + 0 + 0 + 4) / 4: the first three filtered
}

TEST(EngineFormats, ReportNamesThemAndChartsThemAsPoints) {
  kvq::eval::ConfigResult kvq_row, engine_row;
  kvq_row.config = kvq::parse_cache_config("k4c32-v4t8-r0-s0");
  kvq_row.bits_per_value = 6.79;
  kvq_row.mean_kl = 0.002;
  engine_row.engine = parse_engine_format("ggml-q4_0-hadamard");
  engine_row.bits_per_value = 4.5;
  engine_row.mean_kl = 0.6;
  std::ostringstream table;
  kvq::eval::print_table(table, {kvq_row, engine_row}, 1.0, 100);
  EXPECT_NE(table.str().find("ggml-q4_0-hadamard           rows/32 + H        4.50"), std::string::npos) << table.str();
  const std::string svg = kvq::eval::svg_chart({kvq_row, engine_row}, "t");
  EXPECT_NE(svg.find(">ggml-q4_0-hadamard</text>"), std::string::npos);
  EXPECT_EQ(svg.find(">k4c32-v4t8-r0-s0</text>"), std::string::npos);  // kvq rows are lines, not labels
}

}  // namespace
