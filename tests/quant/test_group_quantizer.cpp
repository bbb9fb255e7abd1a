// Group quantization: error bounds derived from the stored parameters, constant and
// unrepresentable groups, byte-identical fast paths, and the key-axis thesis in miniature.

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/core/convert.hpp"
#include "kvq/isa.hpp"
#include "kvq/kernels/quantize/quantize.hpp"
#include "kvq/kernels/quantize/reference.hpp"
#include "kvq/pack/bitpack.hpp"
#include "kvq/quant/code_levels.hpp"
#include "kvq/quant/spec.hpp"

namespace {

using kvq::Axis;
using kvq::Mode;
using kvq::QuantizerSpec;
using kvq::Scalar;
namespace ref = kvq::kernels::reference;

constexpr std::uint8_t sentinel = 0xa7;

std::string describe(const QuantizerSpec& s) {
  return kvq::to_string(s, s.axis == Axis::per_channel ? 'k' : 'v') + " (" + kvq::to_string(s.mode) + ")";
}

std::vector<QuantizerSpec> all_specs(Axis axis, std::size_t group) {
  std::vector<QuantizerSpec> specs;
  for (int bits = 1; bits <= 8; ++bits)
    for (const Mode mode : {Mode::asymmetric, Mode::symmetric})
      for (const Scalar param : {Scalar::f16, Scalar::bf16, Scalar::f32})
        specs.push_back(QuantizerSpec{bits, group, axis, mode, param});
  return specs;
}

// A codebook of 2^bits ascending f16 levels ending in 2^-24 and 1, whose midpoint 0.5 + 2^-25 is
// no float (encoders must compare as the reference does in double); below them, from -1 up.
QuantizerSpec codebook_spec(int bits, std::size_t group, Axis axis, Scalar param) {
  QuantizerSpec spec{bits, group, axis, Mode::codebook, param};
  const std::size_t n = std::size_t(1) << bits;
  for (std::size_t i = 0; i + 2 < n; ++i)
    spec.codebook[i] = kvq::round_to(Scalar::f16, -1.0f + float(i) / float(n - 2));
  spec.codebook[n - 2] = 0x1p-24f;
  spec.codebook[n - 1] = 1.0f;
  return spec;
}

// The level-table specs the AVX-512 quantizer searches: NormalFloat, Lloyd-Max, codebooks.
std::vector<QuantizerSpec> searched_level_specs(Axis axis, std::size_t group) {
  std::vector<QuantizerSpec> specs;
  for (const Scalar param : {Scalar::f16, Scalar::bf16, Scalar::f32})
    for (int bits = 1; bits <= 4; ++bits) {
      if (bits >= 2) specs.push_back(QuantizerSpec{bits, group, axis, Mode::normal_float, param});
      specs.push_back(QuantizerSpec{bits, group, axis, Mode::lloyd_max, param});
      specs.push_back(codebook_spec(bits, group, axis, param));
    }
  return specs;
}

// all_specs and the other modes the AVX-512 quantizer writes (ggml's, level tables, fp8).
std::vector<QuantizerSpec> fast_path_specs(Axis axis, std::size_t group) {
  std::vector<QuantizerSpec> specs = all_specs(axis, group);
  for (int bits = 1; bits <= 8; ++bits)
    for (const Scalar param : {Scalar::f16, Scalar::bf16, Scalar::f32})
      specs.push_back(QuantizerSpec{bits, group, axis, Mode::ggml, param});
  for (const QuantizerSpec& spec : searched_level_specs(axis, group)) specs.push_back(spec);
  for (const Mode mode : {Mode::fp8_e4m3, Mode::fp8_e5m2})
    for (const Scalar param : {Scalar::f16, Scalar::bf16, Scalar::f32})
      specs.push_back(QuantizerSpec{8, group, axis, mode, param});
  return specs;
}

// Code j of a packed row, read bit by bit from the documented layout.
unsigned read_code(const std::uint8_t* row, std::size_t j, int bits) {
  unsigned code = 0;
  for (int k = 0; k < bits; ++k) {
    const std::size_t bit = std::size_t(bits) * j + std::size_t(k);
    code |= unsigned((row[bit / 8] >> (bit % 8)) & 1u) << k;
  }
  return code;
}

// Bits of a packed row's last byte beyond its codes must be zero.
void expect_clean_tail(const std::uint8_t* row, std::size_t n, int bits) {
  const std::size_t used = n * std::size_t(bits);
  if (used % 8 == 0) return;
  EXPECT_EQ(row[used / 8] >> (used % 8), 0) << "unused high bits are not zero";
}

struct Buffers {
  std::vector<std::uint8_t> scales, zeros, codes;
  Buffers(std::size_t params, std::size_t code_bytes)
      : scales(params * 4 + 8, sentinel), zeros(params * 4 + 8, sentinel), codes(code_bytes + 8, sentinel) {}
};

// Bytes from `from` on must still be the sentinel.
void expect_untouched(const std::vector<std::uint8_t>& v, std::size_t from, const char* what) {
  for (std::size_t i = from; i < v.size(); ++i)
    ASSERT_EQ(v[i], sentinel) << what << " written past its end at byte " << i;
}

// |x - x^| <= scale/2 + (how far the stored levels fall short of the group's range) + float rounding.
float error_bound(const QuantizerSpec& spec, const ref::GroupParams& p, float lo, float hi, float x) {
  const float top = float(spec.levels() - 1);
  const float top_level = p.zero + top * p.scale;
  float slack;
  if (spec.mode == Mode::asymmetric) {
    slack = std::fabs(p.zero - lo) + std::max(0.0f, hi - top_level);
  } else {
    const float absmax = std::max(std::fabs(lo), std::fabs(hi));
    slack = std::fabs(p.zero + absmax) + std::max(0.0f, absmax - top_level);
  }
  const float eps = 1e-4f * p.scale + 8 * std::numeric_limits<float>::epsilon() *
                                          (std::fabs(x) + std::fabs(p.zero) + std::fabs(top_level));
  return 0.5f * p.scale + slack + eps;
}

// The dequantized value is zero + code * scale. A compiler may fuse that into one multiply-add
// (GCC does on AArch64), which skips the product's rounding: allow that one rounding and the sum's.
float decode_tolerance(const ref::GroupParams& p, float code) {
  return 2 * std::numeric_limits<float>::epsilon() * (std::fabs(p.zero) + std::fabs(code * p.scale));
}

std::vector<float> normal_data(std::size_t n, std::mt19937& rng, float sigma = 1.0f) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Round trips against error bounds

void check_row_per_token(const QuantizerSpec& spec, const std::vector<float>& x) {
  const std::size_t dim = x.size();
  const std::size_t groups = kvq::groups_per_row(spec, dim);
  Buffers b(groups, kvq::packed_bytes(dim, spec.bits));
  ref::quantize_row_per_token(spec, x.data(), dim, b.scales.data(), b.zeros.data(), b.codes.data());
  SCOPED_TRACE(describe(spec) + " dim " + std::to_string(dim));
  expect_untouched(b.scales, groups * kvq::size_of(spec.param), "scales");
  expect_untouched(b.zeros, spec.has_zero_point() ? groups * kvq::size_of(spec.param) : 0, "zeros");
  expect_untouched(b.codes, kvq::packed_bytes(dim, spec.bits), "codes");
  expect_clean_tail(b.codes.data(), dim, spec.bits);

  std::vector<float> decoded(dim);
  ref::dequantize_row_per_token(spec, b.codes.data(), dim, b.scales.data(), b.zeros.data(), decoded.data());
  for (std::size_t g = 0; g < groups; ++g) {
    const std::size_t begin = g * spec.group, end = std::min(dim, begin + spec.group);
    const float lo = *std::min_element(x.begin() + long(begin), x.begin() + long(end));
    const float hi = *std::max_element(x.begin() + long(begin), x.begin() + long(end));
    const ref::GroupParams p = ref::load_params(spec, b.scales.data(), b.zeros.data(), g);
    ASSERT_TRUE(ref::representable(p));
    ASSERT_GE(p.scale, 0.0f);
    for (std::size_t c = begin; c < end; ++c) {
      const float code = float(read_code(b.codes.data(), c, spec.bits));
      const float mine = p.zero + code * p.scale;
      ASSERT_NEAR(decoded[c], mine, decode_tolerance(p, code)) << "channel " << c;
      ASSERT_LE(std::fabs(x[c] - mine), error_bound(spec, p, lo, hi, x[c]))
          << "channel " << c << " x " << x[c] << " scale " << p.scale << " zero " << p.zero;
    }
  }
}

TEST(GroupQuantizer, PerTokenRoundTripWithinBound) {
  std::mt19937 rng(1);
  for (const std::size_t dim : {8, 40, 100, 128, 136}) {
    for (const std::size_t group : {std::size_t(8), std::size_t(16), std::size_t(32), std::size_t(64), dim}) {
      if (group > dim) continue;
      for (int variant = 0; variant < 3; ++variant) {
        std::vector<float> x = normal_data(dim, rng);
        if (variant == 1) x[dim / 3] *= 100, x[dim - 1] *= 100;  // outlier channels
        if (variant == 2)
          for (auto& v : x) v = v * 0.01f + 3.0f;  // offset, narrow range
        for (const QuantizerSpec& spec : all_specs(Axis::per_token, group)) {
          check_row_per_token(spec, x);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

void check_block_per_channel(const QuantizerSpec& spec, const std::vector<float>& x, std::size_t rows, std::size_t dim,
                             std::size_t stride) {
  const std::size_t row_bytes = kvq::packed_bytes(dim, spec.bits) + 3;  // a gap the kernel must not touch
  Buffers b(dim, rows * row_bytes);
  ref::quantize_block_per_channel(spec, x.data(), rows, dim, stride, b.scales.data(), b.zeros.data(), b.codes.data(),
                                  row_bytes);
  SCOPED_TRACE(describe(spec) + " rows " + std::to_string(rows) + " dim " + std::to_string(dim) + " stride " +
               std::to_string(stride));
  expect_untouched(b.scales, dim * kvq::size_of(spec.param), "scales");
  expect_untouched(b.zeros, spec.has_zero_point() ? dim * kvq::size_of(spec.param) : 0, "zeros");
  std::vector<float> lo(x.begin(), x.begin() + long(dim)), hi = lo;  // each channel's range over the block
  for (std::size_t r = 1; r < rows; ++r)
    for (std::size_t c = 0; c < dim; ++c)
      lo[c] = std::min(lo[c], x[r * stride + c]), hi[c] = std::max(hi[c], x[r * stride + c]);
  std::vector<float> decoded(dim);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::uint8_t* row = b.codes.data() + r * row_bytes;
    for (std::size_t i = kvq::packed_bytes(dim, spec.bits); i < row_bytes; ++i) ASSERT_EQ(row[i], sentinel);
    expect_clean_tail(row, dim, spec.bits);
    ref::dequantize_row_per_channel(spec, row, dim, b.scales.data(), b.zeros.data(), decoded.data());
    for (std::size_t c = 0; c < dim; ++c) {
      const ref::GroupParams p = ref::load_params(spec, b.scales.data(), b.zeros.data(), c);
      ASSERT_TRUE(ref::representable(p));
      const float v = x[r * stride + c];
      const float code = float(read_code(row, c, spec.bits));
      const float mine = p.zero + code * p.scale;
      ASSERT_NEAR(decoded[c], mine, decode_tolerance(p, code)) << "row " << r << " channel " << c;
      ASSERT_LE(std::fabs(v - mine), error_bound(spec, p, lo[c], hi[c], v)) << "row " << r << " channel " << c;
    }
  }
}

TEST(GroupQuantizer, PerChannelRoundTripWithinBound) {
  std::mt19937 rng(2);
  for (const std::size_t dim : {8, 40, 100, 128, 136}) {
    for (const std::size_t rows : {1, 3, 32, 33}) {
      for (const std::size_t pad : {0, 5}) {
        const std::size_t stride = dim + pad;
        for (int variant = 0; variant < 2; ++variant) {
          std::vector<float> x = normal_data(rows * stride, rng);
          for (std::size_t r = 0; r < rows; ++r) {
            if (variant == 1) x[r * stride + dim / 2] *= 100;  // an outlier channel
            for (std::size_t c = dim; c < stride; ++c) x[r * stride + c] = std::numeric_limits<float>::quiet_NaN();
          }
          for (const QuantizerSpec& spec : all_specs(Axis::per_channel, 32)) {
            check_block_per_channel(spec, x, rows, dim, stride);
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Constant and unrepresentable groups

TEST(GroupQuantizer, ConstantGroupReconstructsToTheStoredValue) {
  for (const float value : {0.0f, 1.0f, -3.3f, 0.1f, 1e-3f, 12345.678f, -65504.0f, 1e-30f}) {
    for (const QuantizerSpec& spec : all_specs(Axis::per_token, 32)) {
      SCOPED_TRACE(describe(spec) + " value " + std::to_string(value));
      const std::vector<float> x(32, value);
      Buffers b(1, kvq::packed_bytes(32, spec.bits));
      ref::quantize_row_per_token(spec, x.data(), 32, b.scales.data(), b.zeros.data(), b.codes.data());
      std::vector<float> decoded(32);
      ref::dequantize_row_per_token(spec, b.codes.data(), 32, b.scales.data(), b.zeros.data(), decoded.data());
      const ref::GroupParams stored = ref::load_params(spec, b.scales.data(), b.zeros.data(), 0);
      if (!ref::representable(stored)) {  // only a symmetric f16 scale, 2|v| / (2^b - 1), may overflow
        EXPECT_TRUE(spec.mode == Mode::symmetric && spec.param == Scalar::f16 &&
                    2.0f * std::fabs(value) / float(spec.levels() - 1) >= 65520.0f);
        continue;
      }
      for (const float d : decoded) {
        ASSERT_FALSE(std::isnan(d));
        if (spec.mode == Mode::asymmetric) {
          ASSERT_EQ(d, kvq::round_to(spec.param, value));  // exact for f32
          if (spec.param == Scalar::f32) {
            ASSERT_EQ(d, value);
          }
        } else {  // symmetric levels are +-k*scale/2: within the bound of the stored scale
          const ref::GroupParams p = ref::load_params(spec, b.scales.data(), b.zeros.data(), 0);
          ASSERT_LE(std::fabs(d - value), error_bound(spec, p, value, value, value));
        }
      }
    }
    // The same through the per-channel block and the dispatched fast path.
    for (const QuantizerSpec& spec : all_specs(Axis::per_channel, 32)) {
      if (spec.mode != Mode::asymmetric) continue;
      const std::size_t rows = 5, dim = 33;
      const std::vector<float> x(rows * dim, value);
      Buffers b(dim, rows * kvq::packed_bytes(dim, spec.bits));
      kvq::kernels::quantize_block_per_channel(spec, x.data(), rows, dim, dim, b.scales.data(), b.zeros.data(),
                                               b.codes.data(), kvq::packed_bytes(dim, spec.bits));
      std::vector<float> decoded(dim);
      for (std::size_t r = 0; r < rows; ++r) {
        ref::dequantize_row_per_channel(spec, b.codes.data() + r * kvq::packed_bytes(dim, spec.bits), dim,
                                        b.scales.data(), b.zeros.data(), decoded.data());
        for (const float d : decoded) ASSERT_EQ(d, kvq::round_to(spec.param, value)) << describe(spec);
      }
    }
  }
}

// ggml's levels at every width, both axes and parameter types: each value within one step of the
// group (half a step at 8 bits, where q8_0 rounds) plus what rounding the step to the parameter
// type moves the outer levels; the value of largest magnitude is the bottom level. A constant
// group below 8 bits with f32 steps decodes to itself (the step is the value over a power of two).
TEST(GroupQuantizer, GgmlLevelsRoundTripWithinAStep) {
  std::mt19937 rng(9);
  for (int bits = 1; bits <= 8; ++bits)
    for (const Axis axis : {Axis::per_token, Axis::per_channel})
      for (const Scalar param : {Scalar::f16, Scalar::bf16, Scalar::f32}) {
        const QuantizerSpec spec{bits, 32, axis, Mode::ggml, param};
        SCOPED_TRACE(describe(spec));
        const float mid = ref::mid_code(spec);
        const float rel = param == Scalar::f32 ? 0.0f : param == Scalar::bf16 ? 0x1p-8f : 0x1p-11f;
        for (int variant = 0; variant < 3; ++variant) {
          std::vector<float> x = normal_data(32, rng, variant == 1 ? 50.0f : 1.0f);
          if (variant == 2) std::fill(x.begin(), x.end(), -3.25f);
          Buffers b(1, axis == Axis::per_token ? kvq::packed_bytes(32, bits) : 32 * kvq::packed_bytes(1, bits));
          std::vector<float> decoded(32);
          if (axis == Axis::per_token) {
            kvq::kernels::quantize_row_per_token(spec, x.data(), 32, b.scales.data(), b.zeros.data(), b.codes.data());
            ref::dequantize_row_per_token(spec, b.codes.data(), 32, b.scales.data(), b.zeros.data(), decoded.data());
          } else {  // one channel of 32 tokens
            const std::size_t row_bytes = kvq::packed_bytes(1, bits);
            kvq::kernels::quantize_block_per_channel(spec, x.data(), 32, 1, 1, b.scales.data(), b.zeros.data(),
                                                     b.codes.data(), row_bytes);
            for (std::size_t r = 0; r < 32; ++r)
              ref::dequantize_row_per_channel(spec, b.codes.data() + r * row_bytes, 1, b.scales.data(), b.zeros.data(),
                                              &decoded[r]);
          }
          expect_untouched(b.zeros, 0, "zeros");  // no zero point is stored
          const float scale = ref::load_params(spec, b.scales.data(), nullptr, 0).scale;
          const float lead = ref::leading_value(x.data(), 32, 1);
          ASSERT_EQ(scale, kvq::round_to(param, ref::ggml_step(spec, lead)));
          const float bound = std::fabs(scale) * ((bits == 8 ? 0.5f : 1.0f) + (mid + 1.0f) * rel + 4e-5f);
          for (std::size_t i = 0; i < 32; ++i) ASSERT_LE(std::fabs(decoded[i] - x[i]), bound) << "value " << i;
          if (bits < 8) {
            EXPECT_NEAR(-mid * scale, lead, mid * std::fabs(scale) * rel);  // the bottom level
          }
          if (variant == 2 && bits < 8 && param == Scalar::f32) {
            for (const float d : decoded) ASSERT_EQ(d, -3.25f);
          }
        }
      }
}

// Level tables (NormalFloat 2-4 bits, Lloyd-Max 1-4 bits), both axes and parameter types: the
// scale is the group's absmax over the outer level, as stored; each code names the level nearest
// to x / scale (no other level is nearer); the value decodes to level * scale, so the largest
// magnitude comes back within the scale's rounding.
TEST(GroupQuantizer, LevelTablesCodeTheNearestLevel) {
  std::mt19937 rng(11);
  for (const Mode mode : {Mode::normal_float, Mode::lloyd_max})
    for (int bits = mode == Mode::normal_float ? 2 : 1; bits <= 4; ++bits)
      for (const Axis axis : {Axis::per_token, Axis::per_channel})
        for (const Scalar param : {Scalar::f16, Scalar::bf16, Scalar::f32}) {
          const QuantizerSpec spec{bits, 32, axis, mode, param};
          SCOPED_TRACE(describe(spec));
          const float* levels = kvq::code_levels(spec);
          ASSERT_NE(levels, nullptr);
          const std::size_t n = std::size_t(spec.levels());
          const float outer = std::max(-levels[0], levels[n - 1]);
          std::vector<float> x = normal_data(32, rng, 3.0f);
          x[5] = -0.0f;
          Buffers b(1, axis == Axis::per_token ? kvq::packed_bytes(32, bits) : 32 * kvq::packed_bytes(1, bits));
          const std::size_t row_bytes = kvq::packed_bytes(1, bits);
          std::vector<float> decoded(32);
          std::vector<unsigned> codes(32);
          if (axis == Axis::per_token) {
            kvq::kernels::quantize_row_per_token(spec, x.data(), 32, b.scales.data(), b.zeros.data(), b.codes.data());
            ref::dequantize_row_per_token(spec, b.codes.data(), 32, b.scales.data(), b.zeros.data(), decoded.data());
            for (std::size_t i = 0; i < 32; ++i) codes[i] = read_code(b.codes.data(), i, bits);
          } else {  // one channel of 32 tokens
            kvq::kernels::quantize_block_per_channel(spec, x.data(), 32, 1, 1, b.scales.data(), b.zeros.data(),
                                                     b.codes.data(), row_bytes);
            for (std::size_t r = 0; r < 32; ++r) {
              ref::dequantize_row_per_channel(spec, b.codes.data() + r * row_bytes, 1, b.scales.data(), b.zeros.data(),
                                              &decoded[r]);
              codes[r] = read_code(b.codes.data() + r * row_bytes, 0, bits);
            }
          }
          expect_untouched(b.zeros, 0, "zeros");
          float absmax = 0.0f;
          for (const float v : x) absmax = std::max(absmax, std::fabs(v));
          const float scale = ref::load_params(spec, b.scales.data(), nullptr, 0).scale;
          ASSERT_EQ(scale, kvq::round_to(param, absmax / outer));
          const float inv = 1.0f / scale;
          for (std::size_t i = 0; i < 32; ++i) {
            ASSERT_LT(codes[i], n);
            volatile float product = x[i] * inv;  // rounded to float as the quantizer rounds it (no FMA)
            const double v = product;
            for (std::size_t j = 0; j < n; ++j)
              ASSERT_LE(std::fabs(v - double(levels[codes[i]])), std::fabs(v - double(levels[j])))
                  << "value " << i << " level " << j;
            ASSERT_EQ(decoded[i], levels[codes[i]] * scale) << "value " << i;
          }
        }
}

TEST(GroupQuantizer, ParametersBeyondTheParameterTypeAreUnrepresentable) {
  std::mt19937 rng(5);
  for (int bits = 1; bits <= 8; ++bits) {
    // A huge negative value: the f16 zero point (the minimum) overflows at every width.
    std::vector<float> x = normal_data(32, rng);
    x[7] = -1e5f;
    QuantizerSpec spec{bits, 32, Axis::per_token, Mode::asymmetric, Scalar::f16};
    Buffers b(1, kvq::packed_bytes(32, bits));
    ref::quantize_row_per_token(spec, x.data(), 32, b.scales.data(), b.zeros.data(), b.codes.data());
    EXPECT_FALSE(ref::representable(ref::load_params(spec, b.scales.data(), b.zeros.data(), 0))) << bits;
    EXPECT_FALSE(ref::representable(ref::make_params(spec, -1e5f, 1.0f))) << bits;
    // bf16 and f32 hold it.
    for (const Scalar wide : {Scalar::bf16, Scalar::f32}) {
      spec.param = wide;
      EXPECT_TRUE(ref::representable(ref::make_params(spec, -1e5f, 1.0f))) << bits;
    }
    // A huge positive value: the f16 scale (range / (2^b - 1)) overflows once the range exceeds 65520 levels' worth.
    const float range_limit = 65520.0f * float((1 << bits) - 1);
    spec = QuantizerSpec{bits, 32, Axis::per_token, Mode::asymmetric, Scalar::f16};
    EXPECT_FALSE(ref::representable(ref::make_params(spec, -1.0f, range_limit * 1.01f))) << bits;
    EXPECT_TRUE(ref::representable(ref::make_params(spec, -1.0f, range_limit * 0.99f))) << bits;
    spec.mode = Mode::symmetric;  // scale = 2 absmax / (2^b - 1)
    EXPECT_FALSE(ref::representable(ref::make_params(spec, -1.0f, range_limit * 0.51f))) << bits;
    EXPECT_TRUE(ref::representable(ref::make_params(spec, -1.0f, range_limit * 0.49f))) << bits;
  }
  // One huge value at 1 bit and f16: range > 65504 makes the stored scale infinite.
  std::vector<float> x = normal_data(32, rng);
  x[3] = 70000.0f;
  const QuantizerSpec spec{1, 32, Axis::per_token, Mode::asymmetric, Scalar::f16};
  Buffers b(1, kvq::packed_bytes(32, 1));
  kvq::kernels::quantize_row_per_token(spec, x.data(), 32, b.scales.data(), b.zeros.data(), b.codes.data());
  EXPECT_FALSE(ref::representable(ref::load_params(spec, b.scales.data(), b.zeros.data(), 0)));
}

// ---------------------------------------------------------------------------------------------
// Fast paths: byte-identical to the reference

enum class Pattern { normal, ties, constant, tiny, huge, signed_zeros };
constexpr Pattern all_patterns[] = {Pattern::normal, Pattern::ties, Pattern::constant,
                                    Pattern::tiny,   Pattern::huge, Pattern::signed_zeros};
const char* name(Pattern p) {
  switch (p) {
    case Pattern::normal:
      return "normal";
    case Pattern::ties:
      return "ties";
    case Pattern::constant:
      return "constant";
    case Pattern::tiny:
      return "tiny";
    case Pattern::huge:
      return "huge";
    case Pattern::signed_zeros:
      return "signed_zeros";
  }
  return "?";
}

// rows x stride values; `spec` decides where exact ties are planted.
std::vector<float> make_data(Pattern pattern, const QuantizerSpec& spec, std::size_t n, std::mt19937& rng) {
  std::vector<float> v(n);
  const int top = spec.levels() - 1;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> half_steps(0, 2 * top);
  std::uniform_int_distribution<int> coin(0, 2);
  const float huge = spec.param == Scalar::f16 ? 30000.0f : 1e30f;
  const bool centred = spec.mode == Mode::symmetric || spec.mode == Mode::ggml;
  const float end = spec.mode == Mode::ggml ? (spec.bits == 8 ? 127.0f : float(spec.levels() / 2))
                    : centred               ? float(top) * 0.5f
                                            : float(top);
  for (std::size_t i = 0; i < n; ++i) {
    switch (pattern) {
      case Pattern::normal:
        v[i] = normal(rng) * 2.0f + 0.5f;
        break;
      // Half-integer steps of a unit scale: (x - zero) * inv lands exactly on k + 0.5. Centred
      // modes get both ends, either first (ggml's lead is the first of them); ggml's ends, 127
      // at 8 bits and 2^(b-1) below, make its step 1 (or -1).
      case Pattern::ties:
        v[i] = std::clamp(float(half_steps(rng)) * 0.5f - (centred ? float(top) * 0.5f : 0.0f), -end, end);
        if (i % 7 == 0) v[i] = end;
        if (i % 7 == 1) v[i] = centred ? -end : 0.0f;
        break;
      case Pattern::constant:
        v[i] = 1.75f;
        break;
      case Pattern::tiny:
        v[i] = 1.0f + normal(rng) * 1e-6f;
        break;
      case Pattern::huge:
        v[i] = (normal(rng) > 0 ? huge : -huge) * (0.5f + 0.25f * std::fabs(normal(rng)));
        break;
      case Pattern::signed_zeros:
        v[i] = coin(rng) == 0 ? 0.0f : coin(rng) == 1 ? -0.0f : 0.0f;
        break;
    }
  }
  return v;
}

using RowFn = void (*)(const QuantizerSpec&, const float*, std::size_t, void*, void*, std::uint8_t*) noexcept;
using BlockFn = void (*)(const QuantizerSpec&, const float*, std::size_t, std::size_t, std::size_t, void*, void*,
                         std::uint8_t*, std::size_t) noexcept;

void compare_row(RowFn fast, const QuantizerSpec& spec, const std::vector<float>& x, const std::string& what) {
  const std::size_t dim = x.size(), groups = kvq::groups_per_row(spec, dim);
  Buffers want(groups, kvq::packed_bytes(dim, spec.bits)), got = want;
  ref::quantize_row_per_token(spec, x.data(), dim, want.scales.data(), want.zeros.data(), want.codes.data());
  fast(spec, x.data(), dim, got.scales.data(), got.zeros.data(), got.codes.data());
  SCOPED_TRACE(what + " " + describe(spec) + " dim " + std::to_string(dim));
  for (std::size_t i = 0; i < want.codes.size(); ++i) ASSERT_EQ(got.codes[i], want.codes[i]) << "code byte " << i;
  for (std::size_t i = 0; i < want.scales.size(); ++i) ASSERT_EQ(got.scales[i], want.scales[i]) << "scale byte " << i;
  for (std::size_t i = 0; i < want.zeros.size(); ++i) ASSERT_EQ(got.zeros[i], want.zeros[i]) << "zero byte " << i;
}

void compare_block(BlockFn fast, const QuantizerSpec& spec, const std::vector<float>& x, std::size_t rows,
                   std::size_t dim, std::size_t stride, const std::string& what) {
  const std::size_t row_bytes = kvq::packed_bytes(dim, spec.bits) + 1;
  Buffers want(dim, rows * row_bytes), got = want;
  ref::quantize_block_per_channel(spec, x.data(), rows, dim, stride, want.scales.data(), want.zeros.data(),
                                  want.codes.data(), row_bytes);
  fast(spec, x.data(), rows, dim, stride, got.scales.data(), got.zeros.data(), got.codes.data(), row_bytes);
  SCOPED_TRACE(what + " " + describe(spec) + " rows " + std::to_string(rows) + " dim " + std::to_string(dim));
  for (std::size_t i = 0; i < want.codes.size(); ++i) ASSERT_EQ(got.codes[i], want.codes[i]) << "code byte " << i;
  for (std::size_t i = 0; i < want.scales.size(); ++i) ASSERT_EQ(got.scales[i], want.scales[i]) << "scale byte " << i;
  for (std::size_t i = 0; i < want.zeros.size(); ++i) ASSERT_EQ(got.zeros[i], want.zeros[i]) << "zero byte " << i;
}

constexpr std::size_t awkward_dims[] = {1, 7, 8, 15, 16, 17, 31, 33, 100, 128, 130, 1024};

void run_row_comparison(RowFn fast, bool only_supported, const std::string& what) {
  std::mt19937 rng(3);
  for (const std::size_t dim : awkward_dims)
    for (const std::size_t group : {16, 32, 64, 128, 24, 8})
      for (const Pattern pattern : all_patterns)
        for (const QuantizerSpec& spec : fast_path_specs(Axis::per_token, group)) {
          if (only_supported && group % 16 != 0) continue;
          const std::size_t reps = dim >= 128 ? 1 : 3;
          for (std::size_t rep = 0; rep < reps; ++rep) {
            compare_row(fast, spec, make_data(pattern, spec, dim, rng), what + " " + name(pattern));
            if (::testing::Test::HasFatalFailure()) return;
          }
        }
}

void run_block_comparison(BlockFn fast, const std::string& what) {
  std::mt19937 rng(4);
  for (const std::size_t dim : awkward_dims) {
    std::vector<std::size_t> row_counts;
    if (dim < 128)
      for (std::size_t r = 1; r <= 40; ++r) row_counts.push_back(r);
    else if (dim < 1024)
      row_counts = {1, 2, 16, 33};
    else
      row_counts = {1, 17};
    for (const std::size_t rows : row_counts) {
      // Every width, mode and type on a few row counts; a rotating sample on the others.
      const bool full = rows <= 3 || rows == 16 || rows == 17 || rows == 32 || rows == 33 || rows == 40;
      for (const Pattern pattern : all_patterns) {
        if (!full && pattern != all_patterns[rows % std::size(all_patterns)]) continue;
        const std::vector<QuantizerSpec> specs = fast_path_specs(Axis::per_channel, 32);
        for (std::size_t s = 0; s < specs.size(); ++s) {
          if (!full && s % 5 != rows % 5) continue;
          const QuantizerSpec& spec = specs[s];
          const std::size_t stride = dim + (rows % 3);  // padded rows too
          std::vector<float> x = make_data(pattern, spec, rows * stride, rng);
          for (std::size_t r = 0; r < rows; ++r)
            for (std::size_t c = dim; c < stride; ++c) x[r * stride + c] = std::numeric_limits<float>::quiet_NaN();
          compare_block(fast, spec, x, rows, dim, stride, what + " " + name(pattern));
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(GroupQuantizerFastPath, DispatchedPerTokenMatchesReferenceByteForByte) {
  run_row_comparison(&kvq::kernels::quantize_row_per_token, false, "dispatched");
}

TEST(GroupQuantizerFastPath, DispatchedPerChannelMatchesReferenceByteForByte) {
  run_block_comparison(&kvq::kernels::quantize_block_per_channel, "dispatched");
}

#if defined(KVQ_HAVE_X86_KERNELS)
TEST(GroupQuantizerFastPath, Avx512PerTokenMatchesReferenceByteForByte) {
  if (kvq::isa::detected() != kvq::isa::Level::avx512) GTEST_SKIP() << "this CPU lacks AVX-512";
  EXPECT_TRUE(kvq::kernels::avx512::supports(QuantizerSpec{4, 32, Axis::per_token}));
  EXPECT_FALSE(kvq::kernels::avx512::supports(QuantizerSpec{4, 24, Axis::per_token}));
  EXPECT_TRUE(kvq::kernels::avx512::supports(QuantizerSpec{4, 24, Axis::per_channel}));
  EXPECT_TRUE(kvq::kernels::avx512::supports(QuantizerSpec{8, 32, Axis::per_token, Mode::fp8_e5m2}));
  EXPECT_FALSE(kvq::kernels::avx512::supports(QuantizerSpec{4, 32, Axis::per_token, Mode::iq4_nl}));
  EXPECT_TRUE(kvq::kernels::avx512::supports(QuantizerSpec{4, 32, Axis::per_token, Mode::ggml}));
  EXPECT_TRUE(kvq::kernels::avx512::supports(QuantizerSpec{3, 32, Axis::per_token, Mode::lloyd_max}));
  EXPECT_TRUE(kvq::kernels::avx512::supports(codebook_spec(2, 32, Axis::per_channel, Scalar::f16)));
  run_row_comparison(&kvq::kernels::avx512::quantize_row_per_token, true, "avx512");
}

TEST(GroupQuantizerFastPath, Avx512PerChannelMatchesReferenceByteForByte) {
  if (kvq::isa::detected() != kvq::isa::Level::avx512) GTEST_SKIP() << "this CPU lacks AVX-512";
  run_block_comparison(&kvq::kernels::avx512::quantize_block_per_channel, "avx512");
}
#endif

// Values at and beside every midpoint of neighbouring levels, in groups whose scale is exactly 1
// (each holds the levels' outer ends): every path codes them as the reference, whose comparison in
// double the fast paths make in float.
TEST(GroupQuantizerFastPath, LevelTableMidpointsCodeAsTheReference) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  for (const QuantizerSpec& table : searched_level_specs(Axis::per_token, 16)) {
    const float* levels = kvq::code_levels(table);
    const std::size_t n = std::size_t(table.levels());
    const float low = table.mode == Mode::codebook ? -1.0f : -std::max(-levels[0], levels[n - 1]);
    std::vector<float> probes;
    for (std::size_t i = 0; i + 1 < n; ++i) {
      const double midpoint = 0.5 * (double(levels[i]) + double(levels[i + 1]));
      const float below = float(midpoint) <= midpoint ? float(midpoint) : std::nextafter(float(midpoint), -inf);
      const float above = std::nextafter(below, inf);
      for (const float v : {std::nextafter(below, -inf), below, above, std::nextafter(above, inf)}) probes.push_back(v);
      // The reference moves up a level between `below` and `above` (or at `below`, an exact midpoint).
      EXPECT_LE(ref::encode(table, {1.0f, 0.0f, levels}, 1.0f, std::nextafter(below, -inf)), i);
      EXPECT_EQ(ref::encode(table, {1.0f, 0.0f, levels}, 1.0f, above), i + 1);
    }
    // Groups of 16: the two ends, then 14 probes (the last group padded with the low end).
    std::vector<float> x;
    for (std::size_t p = 0; p < probes.size(); p += 14) {
      x.push_back(low);
      x.push_back(-low);
      for (std::size_t k = p; k < p + 14; ++k) x.push_back(k < probes.size() ? probes[k] : low);
    }
    const std::size_t groups = x.size() / 16;
    Buffers unit(groups, kvq::packed_bytes(x.size(), table.bits));
    ref::quantize_row_per_token(table, x.data(), x.size(), unit.scales.data(), unit.zeros.data(), unit.codes.data());
    for (std::size_t g = 0; g < groups; ++g)
      ASSERT_EQ(ref::load_params(table, unit.scales.data(), unit.zeros.data(), g).scale, 1.0f) << describe(table);
    for (const Axis axis : {Axis::per_token, Axis::per_channel}) {
      QuantizerSpec spec = table;
      spec.axis = axis;
      SCOPED_TRACE(describe(spec));
      if (axis == Axis::per_token) {
        compare_row(&kvq::kernels::quantize_row_per_token, spec, x, "midpoints");
      } else {  // channel g holds group g down its 16 rows
        std::vector<float> block(16 * groups);
        for (std::size_t g = 0; g < groups; ++g)
          for (std::size_t r = 0; r < 16; ++r) block[r * groups + g] = x[g * 16 + r];
        spec.group = 16;
        compare_block(&kvq::kernels::quantize_block_per_channel, spec, block, 16, groups, groups, "midpoints");
      }
      if (HasFatalFailure()) return;
    }
  }
}

// Several rows per call (the cache's KV heads), stored as f32, f16 or bf16 and read in place, with
// gaps between rows, parameter sets and code rows that must stay untouched.
void compare_rows(const QuantizerSpec& spec, Scalar in, std::size_t rows, const std::vector<float>& x, std::size_t dim,
                  const std::string& what) {
  const std::size_t groups = kvq::groups_per_row(spec, dim), code_bytes = kvq::packed_bytes(dim, spec.bits);
  const std::size_t x_stride = dim * kvq::size_of(in) + 8, param_stride = groups * 4 + 4, out_stride = code_bytes + 5;
  std::vector<std::uint8_t> stored(rows * x_stride, sentinel);
  for (std::size_t r = 0; r < rows; ++r) kvq::store_row(in, x.data() + r * dim, dim, stored.data() + r * x_stride);
  Buffers want(rows * param_stride, rows * out_stride), got = want;
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<float> row(dim);
    kvq::load_row(in, stored.data() + r * x_stride, dim, row.data());
    ref::quantize_row_per_token(spec, row.data(), dim, want.scales.data() + r * param_stride,
                                want.zeros.data() + r * param_stride, want.codes.data() + r * out_stride);
  }
  kvq::kernels::quantize_rows_per_token(spec, in, stored.data(), rows, dim, x_stride, got.scales.data(),
                                        got.zeros.data(), param_stride, got.codes.data(), out_stride);
  SCOPED_TRACE(what + " " + describe(spec) + " input " + kvq::to_string(in) + " rows " + std::to_string(rows) +
               " dim " + std::to_string(dim));
  for (std::size_t i = 0; i < want.codes.size(); ++i) ASSERT_EQ(got.codes[i], want.codes[i]) << "code byte " << i;
  for (std::size_t i = 0; i < want.scales.size(); ++i) ASSERT_EQ(got.scales[i], want.scales[i]) << "scale byte " << i;
  for (std::size_t i = 0; i < want.zeros.size(); ++i) ASSERT_EQ(got.zeros[i], want.zeros[i]) << "zero byte " << i;
}

TEST(GroupQuantizerFastPath, DispatchedRowsPerTokenMatchReferenceByteForByte) {
  std::mt19937 rng(8);
  constexpr std::size_t row_counts[] = {1, 4, 5, 8, 3, 17};
  std::size_t turn = 0;
  for (const std::size_t dim : awkward_dims)
    for (const std::size_t group : {16, 32, 64, 128, 48, 24})
      for (const Pattern pattern : all_patterns)
        for (const QuantizerSpec& spec : fast_path_specs(Axis::per_token, group))
          for (const Scalar in : {Scalar::f32, Scalar::f16, Scalar::bf16}) {
            // Row counts around the 16-group batches: 1, 4, 5 and 8 heads, and a rotating odd count.
            const std::size_t rows = row_counts[turn++ % std::size(row_counts)];
            if (dim >= 1024 && rows > 5) continue;
            std::vector<float> x = make_data(pattern, spec, rows * dim, rng);
            if (in == Scalar::f16 && pattern == Pattern::huge)  // keep the rows finite in f16
              for (auto& v : x) v = std::clamp(v, -65504.0f, 65504.0f);
            compare_rows(spec, in, rows, x, dim, name(pattern));
            if (HasFatalFailure()) return;
          }
}

// A per-channel block read in place as f32, f16 or bf16 rows with gaps between them (the cache's
// ring): the bytes of the reference on the rows as floats, and nothing outside its output written.
TEST(GroupQuantizerFastPath, DispatchedBlockFromStoredRowsMatchesReferenceByteForByte) {
  std::mt19937 rng(9);
  for (const std::size_t dim : awkward_dims)
    for (const std::size_t rows : {1, 7, 32})
      for (const Pattern pattern : all_patterns)
        for (const QuantizerSpec& spec : fast_path_specs(Axis::per_channel, rows))
          for (const Scalar in : {Scalar::f32, Scalar::f16, Scalar::bf16}) {
            if (dim >= 1024 && rows > 7) continue;
            std::vector<float> x = make_data(pattern, spec, rows * dim, rng);
            if (in == Scalar::f16 && pattern == Pattern::huge)  // keep the rows finite in f16
              for (auto& v : x) v = std::clamp(v, -65504.0f, 65504.0f);
            const std::size_t x_stride = dim * kvq::size_of(in) + 8, row_bytes = kvq::packed_bytes(dim, spec.bits) + 3;
            std::vector<std::uint8_t> stored(rows * x_stride, sentinel);
            std::vector<float> as_floats(rows * dim);
            for (std::size_t r = 0; r < rows; ++r) {
              kvq::store_row(in, x.data() + r * dim, dim, stored.data() + r * x_stride);
              kvq::load_row(in, stored.data() + r * x_stride, dim, as_floats.data() + r * dim);
            }
            Buffers want(dim, rows * row_bytes), got = want;
            ref::quantize_block_per_channel(spec, as_floats.data(), rows, dim, dim, want.scales.data(),
                                            want.zeros.data(), want.codes.data(), row_bytes);
            std::vector<float> scratch(rows * dim);
            kvq::kernels::quantize_block_per_channel(spec, in, stored.data(), rows, dim, x_stride, got.scales.data(),
                                                     got.zeros.data(), got.codes.data(), row_bytes, scratch.data());
            SCOPED_TRACE(std::string(name(pattern)) + " " + describe(spec) + " input " + kvq::to_string(in) + " rows " +
                         std::to_string(rows) + " dim " + std::to_string(dim));
            ASSERT_EQ(got.codes, want.codes);
            ASSERT_EQ(got.scales, want.scales);
            ASSERT_EQ(got.zeros, want.zeros);
          }
}

// ---------------------------------------------------------------------------------------------
// The thesis in miniature: keys with a fixed outlier channel want per-channel groups.

double relative_error(const std::vector<float>& x, const std::vector<float>& y) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) num += double(x[i] - y[i]) * (x[i] - y[i]), den += double(x[i]) * x[i];
  return std::sqrt(num / den);
}

// (tokens, dim) row-major -> reconstruction with per-channel groups of `tokens` tokens.
std::vector<float> roundtrip_per_channel(const QuantizerSpec& spec, const std::vector<float>& x, std::size_t tokens,
                                         std::size_t dim) {
  const std::size_t row_bytes = kvq::packed_bytes(dim, spec.bits);
  Buffers b(dim, tokens * row_bytes);
  kvq::kernels::quantize_block_per_channel(spec, x.data(), tokens, dim, dim, b.scales.data(), b.zeros.data(),
                                           b.codes.data(), row_bytes);
  std::vector<float> out(x.size());
  for (std::size_t t = 0; t < tokens; ++t)
    ref::dequantize_row_per_channel(spec, b.codes.data() + t * row_bytes, dim, b.scales.data(), b.zeros.data(),
                                    out.data() + t * dim);
  return out;
}

std::vector<float> roundtrip_per_token(const QuantizerSpec& spec, const std::vector<float>& x, std::size_t tokens,
                                       std::size_t dim) {
  const std::size_t groups = kvq::groups_per_row(spec, dim), row_bytes = kvq::packed_bytes(dim, spec.bits);
  std::vector<float> out(x.size());
  for (std::size_t t = 0; t < tokens; ++t) {
    Buffers b(groups, row_bytes);
    kvq::kernels::quantize_row_per_token(spec, x.data() + t * dim, dim, b.scales.data(), b.zeros.data(),
                                         b.codes.data());
    ref::dequantize_row_per_token(spec, b.codes.data(), dim, b.scales.data(), b.zeros.data(), out.data() + t * dim);
  }
  return out;
}

TEST(GroupQuantizerThesis, OutlierChannelsFavourPerChannelKeys) {
  constexpr std::size_t tokens = 32, dim = 128;
  std::mt19937 rng(6);
  std::vector<float> keys = normal_data(tokens * dim, rng);  // (tokens, dim)
  for (std::size_t t = 0; t < tokens; ++t)
    for (const std::size_t c : {5, 77}) keys[t * dim + c] = 50.0f * (1.0f + 0.1f * keys[t * dim + c]);
  for (const int bits : {2, 4}) {
    const double per_channel =
        relative_error(keys, roundtrip_per_channel(QuantizerSpec{bits, tokens, Axis::per_channel}, keys, tokens, dim));
    const double per_token =
        relative_error(keys, roundtrip_per_token(QuantizerSpec{bits, 32, Axis::per_token}, keys, tokens, dim));
    RecordProperty("bits" + std::to_string(bits) + "_per_channel", std::to_string(per_channel));
    RecordProperty("bits" + std::to_string(bits) + "_per_token", std::to_string(per_token));
    EXPECT_LT(per_channel, 0.5 * per_token)
        << bits << " bits: per-channel " << per_channel << ", per-token " << per_token;
  }
}

TEST(GroupQuantizerThesis, OutlierTokensFavourPerTokenValues) {
  constexpr std::size_t tokens = 32, dim = 128;
  std::mt19937 rng(7);
  std::vector<float> values = normal_data(tokens * dim, rng);
  for (const std::size_t t : {3, 20})
    for (std::size_t c = 0; c < dim; ++c) values[t * dim + c] *= 50.0f;
  for (const int bits : {2, 4}) {
    const double per_channel = relative_error(
        values, roundtrip_per_channel(QuantizerSpec{bits, tokens, Axis::per_channel}, values, tokens, dim));
    const double per_token =
        relative_error(values, roundtrip_per_token(QuantizerSpec{bits, 32, Axis::per_token}, values, tokens, dim));
    EXPECT_LT(per_token, per_channel) << bits << " bits: per-channel " << per_channel << ", per-token " << per_token;
  }
}

}  // namespace
