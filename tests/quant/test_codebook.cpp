// Calibrated codebooks (Mode::codebook): the quantizer string spells the levels and reads back as
// itself, bad levels are refused naming the level, groups decode to zero + scale * level within
// their range, calibration fits levels that beat the uniform grid on the data's distribution, and
// a cache with codebooks saves and loads whole; a codebook per KV head is spelled, checked, used
// by each head's rows and saved.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/cache/serialize.hpp"
#include "kvq/kvq.hpp"
#include "kvq/kernels/quantize/reference.hpp"
#include "kvq/quant/codebook.hpp"
#include "kvq/quant/spec.hpp"
#include "support/random.hpp"

namespace {

using kvq::Axis;
using kvq::Mode;
using kvq::QuantizerSpec;

const std::string b2 = "bc00b50034003c00";  // -1, -0.3125, 0.25, 1

TEST(Codebook, QuantizerStringSpellsTheLevels) {
  const QuantizerSpec s = kvq::parse_quantizer("k2c32b" + b2, 'k');
  EXPECT_EQ(s.mode, Mode::codebook);
  EXPECT_EQ(s.codebook[0], -1.0f);
  EXPECT_EQ(s.codebook[1], -0.3125f);
  EXPECT_EQ(s.codebook[2], 0.25f);
  EXPECT_EQ(s.codebook[3], 1.0f);
  EXPECT_EQ(s.codebook[4], 0.0f);
  EXPECT_TRUE(s.has_zero_point());
  EXPECT_EQ(kvq::to_string(s, 'k'), "k2c32b" + b2);
  EXPECT_EQ(kvq::to_string(kvq::parse_quantizer("v1t16bb8003800.bf16", 'v'), 'v'), "v1t16bb8003800.bf16");
  const kvq::CacheConfig c = kvq::parse_cache_config("k2c32b" + b2 + "-v2t32-r16-s1");
  EXPECT_EQ(kvq::parse_cache_config(kvq::to_string(c)), c);
}

TEST(Codebook, BadLevelsAreRefusedNamingTheLevel) {
  auto message = [](const std::string& text) {
    try {
      (void)kvq::parse_quantizer(text, 'k');
    } catch (const kvq::Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message("k2c32bbc00b5003400").find("4 lowercase hex digits"), std::string::npos);  // 3 levels
  EXPECT_NE(message("k2c32bBC00B50034003C00").find("4 lowercase hex digits"), std::string::npos);
  EXPECT_NE(message("k2c32b" + b2 + "00").find("unknown suffix"), std::string::npos);
  EXPECT_NE(message("k2c32bbc0034003c00b500").find("level 3"), std::string::npos);  // not ascending
  EXPECT_NE(message("k2c32bbc00b50034004000").find("[-1, 1]"), std::string::npos);  // 2.0
  EXPECT_NE(message("k2c32bbc0080003c003c01").find("-0"), std::string::npos);
  EXPECT_NE(message("k2c32bbc007e003c003c01").find("level 1"), std::string::npos);  // NaN
  EXPECT_NE(message("k5c32b").find("1..4 bits"), std::string::npos);
  EXPECT_NE(message("k2c32o1b" + b2).find("no outliers"), std::string::npos);

  QuantizerSpec s{2, 32, Axis::per_token, Mode::asymmetric};
  s.codebook[0] = 0.5f;  // set, but asymmetric levels read none
  EXPECT_THROW(kvq::validate(s, "value quantizer"), kvq::Error);
  s.mode = Mode::codebook;
  s.codebook = {-1.0f, -0.1f, 0.5f, 1.0f};  // -0.1 is no f16 value
  EXPECT_THROW(kvq::validate(s, "value quantizer"), kvq::Error);
  s.codebook = {-1.0f, -0.25f, 0.5f, 1.0f, 0.5f};  // an entry beyond 2 bits
  EXPECT_THROW(kvq::validate(s, "value quantizer"), kvq::Error);
  s.codebook[4] = 0.0f;
  EXPECT_NO_THROW(kvq::validate(s, "value quantizer"));
}

TEST(Codebook, GroupsDecodeToTheNearestLevelWithinTheirRange) {
  namespace ref = kvq::kernels::reference;
  const QuantizerSpec s = kvq::parse_quantizer("v2t8b" + b2, 'v');
  const std::vector<float> x = {-3.0f, 5.0f, 0.9f, 1.1f, -2.0f, 2.5f, 0.0f, 4.0f};
  float scale = 0, zero = 0;
  std::uint8_t packed[2];
  ref::quantize_row_per_token(s, x.data(), x.size(), &scale, &zero, packed);
  const ref::GroupParams p = ref::load_params(s, &scale, &zero, 0);
  EXPECT_EQ(p.scale, 4.0f);  // (5 - -3) / 2
  EXPECT_EQ(p.zero, 1.0f);   // the midpoint
  std::vector<float> out(x.size());
  ref::dequantize_row_per_token(s, packed, x.size(), &scale, &zero, out.data());
  for (std::size_t i = 0; i < x.size(); ++i) {
    float best = 0, err = std::numeric_limits<float>::infinity();
    for (int j = 0; j < 4; ++j)
      if (std::fabs(1.0f + 4.0f * s.codebook[std::size_t(j)] - x[i]) < err)
        err = std::fabs(1.0f + 4.0f * s.codebook[std::size_t(j)] - x[i]),
        best = 1.0f + 4.0f * s.codebook[std::size_t(j)];
    EXPECT_EQ(out[i], best) << i;
  }
  EXPECT_EQ(out[0], -3.0f);  // the range's ends are levels: min and max decode exactly
  EXPECT_EQ(out[1], 5.0f);
  const std::vector<float> constant(8, 0.7f);  // a constant group decodes to its value (f16)
  ref::quantize_row_per_token(s, constant.data(), 8, &scale, &zero, packed);
  ref::dequantize_row_per_token(s, packed, 8, &scale, &zero, out.data());
  for (float v : out) EXPECT_EQ(v, kvq::round_to(kvq::Scalar::f16, 0.7f));
}

// Mean squared error of quantizing rows (n, dim) per token with `spec`, relative to their power.
double relative_mse(const QuantizerSpec& spec, const std::vector<float>& rows, std::size_t dim) {
  namespace ref = kvq::kernels::reference;
  double err = 0, power = 0;
  std::vector<float> scales(dim), zeros(dim), out(dim);
  std::vector<std::uint8_t> packed(dim);
  for (std::size_t r = 0; r < rows.size() / dim; ++r) {
    ref::quantize_row_per_token(spec, rows.data() + r * dim, dim, scales.data(), zeros.data(), packed.data());
    ref::dequantize_row_per_token(spec, packed.data(), dim, scales.data(), zeros.data(), out.data());
    for (std::size_t c = 0; c < dim; ++c) {
      err += std::pow(double(out[c]) - rows[r * dim + c], 2);
      power += std::pow(double(rows[r * dim + c]), 2);
    }
  }
  return err / power;
}

TEST(Codebook, CalibrationBeatsTheUniformGridOnItsDistribution) {
  // Gaussian rows: in each group's range the values crowd the middle, where fitted levels go.
  constexpr std::size_t dim = 64;
  const auto calibration = kvq::test::normal_vector(512 * dim, 11);
  const auto held_out = kvq::test::normal_vector(512 * dim, 12);
  for (int bits = 1; bits <= 4; ++bits) {
    QuantizerSpec affine{bits, 32, Axis::per_token, Mode::asymmetric};
    kvq::CodebookCalibration cal(affine, dim);
    cal.add(calibration);
    EXPECT_EQ(cal.samples(), calibration.size());
    const QuantizerSpec fitted = cal.fit();
    EXPECT_NO_THROW(kvq::validate(fitted, dim, "fitted"));
    const double uniform = relative_mse(affine, held_out, dim), ours = relative_mse(fitted, held_out, dim);
    SCOPED_TRACE(kvq::to_string(fitted, 'v'));
    EXPECT_LT(ours, 0.95 * uniform) << bits << " bits: " << ours << " vs " << uniform;
  }
  // Uniform data: Lloyd's levels are the centres of equal cells, -3/4, -1/4, 1/4, 3/4 (the ends
  // of each group, 2 values of 32 at exactly -1 and 1, pull the outer ones out a little).
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> flat(512 * dim);
  for (float& v : flat) v = u(rng);
  kvq::CodebookCalibration cal({2, 32, Axis::per_token}, dim);
  cal.add(flat);
  const QuantizerSpec fitted = cal.fit();
  for (int j = 0; j < 4; ++j) EXPECT_NEAR(fitted.codebook[std::size_t(j)], -0.75 + 0.5 * j, 0.06) << j;
}

TEST(Codebook, CalibrationRefusesBadInputAndKeepsWhatItHas) {
  kvq::CodebookCalibration keys({3, 4, Axis::per_channel}, 8);
  std::vector<float> rows = kvq::test::normal_vector(10 * 8, 3);  // 2 whole groups of 4 rows, 2 rows left out
  keys.add(rows);
  EXPECT_EQ(keys.samples(), 2u * 4u * 8u);
  EXPECT_THROW(keys.add(std::vector<float>(7, 0.0f)), kvq::Error);  // no whole row
  rows[5] = std::numeric_limits<float>::quiet_NaN();
  try {
    keys.add(rows);
    ADD_FAILURE() << "a NaN was calibrated on";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::non_finite_input) << e.what();
  }
  EXPECT_EQ(keys.samples(), 64u);
  EXPECT_THROW((void)keys.fit(), kvq::Error);  // 64 samples, 8 levels need 128
  EXPECT_THROW(kvq::CodebookCalibration({5, 32, Axis::per_token}, 64), kvq::Error);
  EXPECT_THROW(kvq::CodebookCalibration({2, 128, Axis::per_token}, 64), kvq::Error);  // group > head_dim
}

// A weighted fit minimizes the weighted squared error: weights of 0 leave values out, weights of
// 1 on groups of range [-1, 1] are the unweighted fit, bit for bit.
TEST(Codebook, WeightsSteerTheFit) {
  // Two channels per row, per-channel groups of 32 rows: channel 0 Gaussian and channel 1 uniform,
  // each group of channel 0 holding -1 and 1 (a half range of 1, so its weights are as given).
  std::mt19937 rng(17);
  std::normal_distribution<float> gauss(0.0f, 0.3f);
  std::uniform_real_distribution<float> flat(-5.0f, 5.0f);
  std::vector<float> rows(256 * 2), first(256);
  for (std::size_t r = 0; r < 256; ++r) {
    first[r] = rows[2 * r] = r % 32 == 0 ? -1.0f : r % 32 == 1 ? 1.0f : std::clamp(gauss(rng), -0.99f, 0.99f);
    rows[2 * r + 1] = flat(rng);
  }
  const QuantizerSpec spec{3, 32, Axis::per_channel};
  auto fit = [&](std::size_t dim, const std::vector<float>& x, kvq::CodebookCalibration::Weights w) {
    kvq::CodebookCalibration cal(spec, dim);
    cal.add(x, w);
    return cal.fit().codebook;
  };
  const std::vector<float> only_first{1.0f, 0.0f}, ones{1.0f};
  EXPECT_EQ(fit(2, rows, {.channels = only_first}), fit(1, first, {}));
  EXPECT_EQ(fit(1, first, {.channels = ones}), fit(1, first, {}));
  EXPECT_EQ(fit(1, first, {.rows = std::vector<float>(256, 1.0f)}), fit(1, first, {}));
  EXPECT_NE(fit(2, rows, {}), fit(1, first, {}));  // channel 1 moves the unweighted levels

  kvq::CodebookCalibration cal(spec, 2);
  const std::vector<float> three(3, 1.0f), nan{1.0f, std::nanf("")}, negative(256, -1.0f);
  auto refused = [&](kvq::CodebookCalibration::Weights w, const std::string& part) {
    const std::size_t before = cal.samples();
    try {
      cal.add(rows, w);
      ADD_FAILURE() << "accepted: " << part;
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
    EXPECT_EQ(cal.samples(), before);
  };
  refused({.channels = three}, "3 channel weights for 2 channels");
  refused({.channels = nan}, "channel weight 1 is nan");
  refused({.rows = negative}, "row weight 0 is -1");
  refused({.rows = three}, "3 row weights for 256 rows");
  cal.add(rows);
  refused({.channels = only_first}, "weights for a calibration added without them");
}

TEST(Codebook, CacheWithCodebooksSavesAndLoadsWhole) {
  const kvq::CacheShape shape{2, 2, 64, 200};
  kvq::BasicKVCache cache(shape, kvq::parse_cache_config("k2c32b" + b2 + "-v2t16b" + b2 + "-r16-s1"));
  for (std::size_t l = 0; l < 2; ++l) {
    const auto k = kvq::test::normal_vector(150 * 2 * 64, unsigned(l) + 1);
    const auto v = kvq::test::normal_vector(150 * 2 * 64, unsigned(l) + 9);
    cache.append(l, 0, k, v);
  }
  std::stringstream file;
  kvq::save(cache, file);
  const kvq::BasicKVCache loaded = kvq::load(file);
  EXPECT_EQ(loaded.config(), cache.config());
  std::vector<float> a(64), b(64);
  for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values})
    for (std::size_t p = 0; p < 150; ++p) {
      cache.read_row(t, 1, 1, p, a.data());
      loaded.read_row(t, 1, 1, p, b.data());
      ASSERT_EQ(a, b) << p;
    }
}

// The 2-bit levels above, and two more sets: one codebook per KV head of three.
const std::string b2_1 = "bc00b80038003c00", b2_2 = "bc00a00030003c00";  // -1, -0.5, 0.5, 1; -1, -0.0078, 0.125, 1

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const kvq::Error& e) {
    return e.what();
  }
  return "accepted";
}

TEST(Codebook, ACodebookPerKVHeadIsSpelledAndChecked) {
  const std::string text = "k2c32b" + b2 + "_" + b2_1 + "_" + b2_2 + "-v2t16b" + b2_1 + "_" + b2 + ".bf16-r16-s1";
  const kvq::CacheConfig c = kvq::parse_cache_config(text);
  ASSERT_EQ(c.key_head_codebooks.size(), 3u);
  ASSERT_EQ(c.value_head_codebooks.size(), 2u);
  EXPECT_EQ(c.key_head_codebooks[0], c.key.codebook);
  EXPECT_EQ(c.key_head_codebooks[1][1], -0.5f);
  EXPECT_EQ(c.key_head_codebooks[2][2], 0.125f);
  EXPECT_EQ(c.value_head_codebooks[1], kvq::parse_quantizer("k2c32b" + b2, 'k').codebook);
  EXPECT_EQ(c.value.param, kvq::Scalar::bf16);
  EXPECT_EQ(kvq::to_string(c), text);
  EXPECT_EQ(kvq::parse_cache_config(kvq::to_string(c)), c);

  auto parse = [](const std::string& t) { return message_of([&] { (void)kvq::parse_cache_config(t); }); };
  EXPECT_NE(parse("k2c32b" + b2 + "_-v2t16-r16-s1").find("after each '_'"), std::string::npos);
  EXPECT_NE(parse("k2c32b" + b2 + "_bc0034003c00b500-v2t16-r16-s1").find("KV head 1's codebook level 3"),
            std::string::npos);  // not ascending
  EXPECT_NE(parse("k2c32_" + b2 + "-v2t16-r16-s1").find("unknown suffix"), std::string::npos);
  EXPECT_NE(message_of([&] {
              (void)kvq::parse_quantizer("k2c32b" + b2 + "_" + b2_1, 'k');
            }).find("belongs to a cache configuration"),
            std::string::npos);

  auto check = [](const kvq::CacheConfig& config) { return message_of([&] { kvq::validate(config); }); };
  kvq::CacheConfig affine = c;
  affine.key = kvq::parse_quantizer("k2c32", 'k');
  EXPECT_NE(check(affine).find("key codebooks per KV head: set, but the keys are not quantized with codebook levels"),
            std::string::npos);
  kvq::CacheConfig one = c;
  one.value_head_codebooks.pop_back();
  EXPECT_NE(check(one).find("leave them empty"), std::string::npos);
  kvq::CacheConfig first = c;
  first.key_head_codebooks[0] = first.key_head_codebooks[1];
  EXPECT_NE(check(first).find("KV head 0's differ"), std::string::npos);
  kvq::CacheConfig unordered = c;
  std::swap(unordered.key_head_codebooks[2][0], unordered.key_head_codebooks[2][3]);
  EXPECT_NE(check(unordered).find("KV head 2's codebook level 1"), std::string::npos);
  kvq::CacheConfig same = c;
  same.key_head_codebooks.assign(3, c.key.codebook);  // b<A>_<A>_<A> is b<A>: one spelling
  EXPECT_NE(check(same).find("leave them empty (one spelling)"), std::string::npos);
  EXPECT_NE(parse("k2c32b" + b2 + "_" + b2 + "-v2t16-r16-s1").find("one spelling"), std::string::npos);

  // 4-bit levels for 8 KV heads spell 538 characters: a cache file holds them.
  kvq::CacheConfig wide = kvq::parse_cache_config("k4c32-v4t16-r16-s1");
  wide.key.mode = Mode::codebook;
  for (std::size_t h = 0; h < 8; ++h) {
    kvq::Codebook levels{};
    for (std::size_t j = 0; j < 16; ++j)
      levels[j] = j == 0    ? -1.0f
                  : j == 15 ? 1.0f
                            : kvq::round_to(kvq::Scalar::f16, -1.0f + 2.0f * float(j) / 15.0f + 0.004f * float(h));
    wide.key_head_codebooks.push_back(levels);
  }
  wide.key.codebook = wide.key_head_codebooks[0];
  EXPECT_GT(kvq::to_string(wide).size(), 512u);
  kvq::BasicKVCache eight(kvq::CacheShape{1, 8, 64, 100}, wide);
  eight.append(0, 0, kvq::test::normal_vector(60 * 8 * 64, 44), kvq::test::normal_vector(60 * 8 * 64, 45));
  std::stringstream file;
  kvq::save(eight, file);
  const kvq::BasicKVCache back = kvq::load(file);
  EXPECT_EQ(back.config(), wide);
  EXPECT_EQ(back.stored_bytes(), eight.stored_bytes());

  const std::string wrong = message_of([&] {
    (void)kvq::BasicKVCache(kvq::CacheShape{1, 2, 64, 100}, c);
  });  // 3 key codebooks, 2 heads
  EXPECT_NE(wrong.find("3 key codebooks per KV head for a shape of 2 KV heads"), std::string::npos) << wrong;
}

TEST(Codebook, EachKVHeadQuantizesWithItsOwnCodebook) {
  // Keys per channel and values per token (the cache's two quantize paths), three heads with three
  // codebooks: each head's rows are those of a cache whose one codebook is that head's, and other
  // codebooks give other rows (so a cache using one codebook for all heads fails).
  const std::vector<std::string> levels{b2, b2_1, b2_2};
  const std::string config =
      "k2c32b" + b2 + "_" + b2_1 + "_" + b2_2 + "-v2t16b" + b2_2 + "_" + b2 + "_" + b2_1 + "-r16-s1-post";
  const kvq::CacheShape shape{1, 3, 64, 200};
  const auto k = kvq::test::normal_vector(150 * 3 * 64, 41), v = kvq::test::normal_vector(150 * 3 * 64, 42);
  kvq::BasicKVCache cache(shape, kvq::parse_cache_config(config));
  cache.append(0, 0, k, v);
  std::vector<kvq::BasicKVCache> single;
  for (const std::string& l : levels) {
    single.emplace_back(shape, kvq::parse_cache_config("k2c32b" + l + "-v2t16b" + l + "-r16-s1-post"));
    single.back().append(0, 0, k, v);
  }
  std::vector<float> a(64), b(64);
  for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values})
    for (std::size_t h = 0; h < 3; ++h) {
      const std::size_t own = t == kvq::Tensor::keys ? h : (h + 2) % 3;  // the values' list starts at b2_2
      EXPECT_EQ(cache.view(t, 0, h, 0).spec.codebook, single[own].view(t, 0, h, 0).spec.codebook);
      std::size_t differ = 0;
      for (std::size_t p = 0; p < 150; ++p) {
        cache.read_row(t, 0, h, p, a.data());
        single[own].read_row(t, 0, h, p, b.data());
        ASSERT_EQ(a, b) << kvq::to_string(t) << " head " << h << " position " << p;
        single[(own + 1) % 3].read_row(t, 0, h, p, b.data());
        differ += a != b;
      }
      EXPECT_GT(differ, 100u) << kvq::to_string(t) << " head " << h;
    }

  // Attention reads each head through its view: every kernel this CPU runs agrees with the
  // reference within the exact tier's bound, keys stored after RoPE and before it (the kernels that
  // rotate keys read each head's table as well), and a saved cache loads with its codebooks.
  const auto q = kvq::test::normal_vector(3 * 2 * 64, 43);
  kvq::BasicKVCache pre(shape, kvq::parse_cache_config(config.substr(0, config.size() - 5)));  // without "-post"
  pre.append(0, 0, k, v);
  for (const kvq::BasicKVCache* c : {&cache, &pre}) {
    std::vector<float> ref(q.size()), out(q.size());
    kvq::reference_attention(*c, 0, 149, q, ref);
    std::size_t ran = 0;
    for (const auto& e : kvq::kernels::attention::registry()) {
      if (!e.available()) continue;
      kvq::DecodeOptions o;
      o.kernel = e.name;
      o.tier = kvq::Tier::exact;
      if (message_of([&] { kvq::decode_attention(*c, 0, 149, q, out, o); }) != "accepted") continue;
      double err = 0, norm = 0;
      for (std::size_t i = 0; i < q.size(); ++i) err += (out[i] - ref[i]) * (out[i] - ref[i]), norm += ref[i] * ref[i];
      EXPECT_LT(std::sqrt(err / norm), 1e-5) << e.name << " " << kvq::to_string(c->config());
      ++ran;
    }
    EXPECT_GE(ran, 2u);  // the reference kernel and at least one vector kernel
  }
  std::stringstream file;
  kvq::save(cache, file);
  const kvq::BasicKVCache loaded = kvq::load(file);
  EXPECT_EQ(loaded.config(), cache.config());
  for (std::size_t p = 0; p < 150; ++p) {
    cache.read_row(kvq::Tensor::keys, 0, 2, p, a.data());
    loaded.read_row(kvq::Tensor::keys, 0, 2, p, b.data());
    ASSERT_EQ(a, b) << p;
  }
}

}  // namespace
