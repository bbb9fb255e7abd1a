// QuantizerSpec / CacheConfig strings, validation, and the compiled policies and presets.

#include <gtest/gtest.h>

#include <string>
#include <type_traits>
#include <vector>

#include "kvq/cache/cache_config.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/error.hpp"
#include "kvq/quant/kv_policy.hpp"
#include "kvq/quant/policies.hpp"
#include "kvq/quant/spec.hpp"

namespace {

using kvq::Axis;
using kvq::CacheConfig;
using kvq::KeyRope;
using kvq::Mode;
using kvq::QuantizerSpec;
using kvq::Scalar;

// ---------------------------------------------------------------------------------------------
// Compiled policies and presets

static_assert(kvq::Quantizer<kvq::PerChannel<2, 32>>);
static_assert(kvq::Quantizer<kvq::PerToken<8, 128, Mode::symmetric, float>>);
static_assert(!kvq::Quantizer<int>);
static_assert(!kvq::Quantizer<CacheConfig>);
static_assert(kvq::KVCachePolicy<kvq::K2V2> && kvq::KVCachePolicy<kvq::K4V2> && kvq::KVCachePolicy<kvq::K8V4> &&
              kvq::KVCachePolicy<kvq::K4V4> && kvq::KVCachePolicy<kvq::K2V4> && kvq::KVCachePolicy<kvq::K8V8> &&
              kvq::KVCachePolicy<kvq::K2V2KeysPerToken> && kvq::KVCachePolicy<kvq::K2V2ValuesPerChannel> &&
              kvq::KVCachePolicy<kvq::K2V2WrongAxes> && kvq::KVCachePolicy<kvq::K4V4KeysPostRope>);
static_assert(!kvq::KVCachePolicy<kvq::PerChannel<2, 32>>);
static_assert(!kvq::KVCachePolicy<int>);

template <class P, int KeyBits, Axis KeyAxis, int ValueBits, Axis ValueAxis>
constexpr bool preset_is() {
  using K = typename P::key_quantizer;
  using V = typename P::value_quantizer;
  return K::bits == KeyBits && K::axis == KeyAxis && V::bits == ValueBits && V::axis == ValueAxis &&
         K::group_size == 32 && V::group_size == 32 && K::mode == Mode::asymmetric && V::mode == Mode::asymmetric &&
         P::window == 128 && P::sinks == 0;
}
// The right axes (KIVI): keys per channel, values per token.
static_assert(preset_is<kvq::K2V2, 2, Axis::per_channel, 2, Axis::per_token>(), "K2V2 is KIVI-2");
static_assert(preset_is<kvq::K4V4, 4, Axis::per_channel, 4, Axis::per_token>());
static_assert(preset_is<kvq::K4V2, 4, Axis::per_channel, 2, Axis::per_token>());
static_assert(preset_is<kvq::K2V4, 2, Axis::per_channel, 4, Axis::per_token>());
static_assert(preset_is<kvq::K8V4, 8, Axis::per_channel, 4, Axis::per_token>());
static_assert(preset_is<kvq::K8V8, 8, Axis::per_channel, 8, Axis::per_token>());
// The deliberately wrong-axis ablations.
static_assert(preset_is<kvq::K2V2KeysPerToken, 2, Axis::per_token, 2, Axis::per_token>());
static_assert(preset_is<kvq::K2V2ValuesPerChannel, 2, Axis::per_channel, 2, Axis::per_channel>());
static_assert(preset_is<kvq::K2V2WrongAxes, 2, Axis::per_token, 2, Axis::per_channel>());
static_assert(preset_is<kvq::K4V4KeysPostRope, 4, Axis::per_channel, 4, Axis::per_token>());
static_assert(kvq::K4V4KeysPostRope::key_rope == KeyRope::post && kvq::K4V2::key_rope == KeyRope::pre);
// Policies' specs agree with their knobs, parameter types included.
static_assert(kvq::PerChannel<3, 64>::spec == QuantizerSpec{3, 64, Axis::per_channel, Mode::asymmetric, Scalar::f16});
static_assert(kvq::PerToken<5, 16, Mode::symmetric, kvq::bf16>::spec ==
              QuantizerSpec{5, 16, Axis::per_token, Mode::symmetric, Scalar::bf16});
static_assert(kvq::PerToken<1, 1, Mode::asymmetric, float>::spec.param == Scalar::f32);
static_assert(std::is_empty_v<kvq::PerChannel<2, 32>> && std::is_empty_v<kvq::K4V2>, "policies carry no state");

TEST(Policies, PresetConfigsMatchTheirStrings) {
  EXPECT_EQ(kvq::K4V2::config(), kvq::parse_cache_config("k4c32-v2t32-r128-s0"));
  EXPECT_EQ(kvq::K2V2::config(), kvq::parse_cache_config("k2c32-v2t32-r128-s0"));
  EXPECT_EQ(kvq::K8V4::config(), kvq::parse_cache_config("k8c32-v4t32-r128-s0"));
  EXPECT_EQ(kvq::K2V2WrongAxes::config(), kvq::parse_cache_config("k2t32-v2c32-r128-s0"));
  EXPECT_EQ(kvq::K4V4KeysPostRope::config(), kvq::parse_cache_config("k4c32-v4t32-r128-s0-post"));
  EXPECT_EQ(kvq::to_string(kvq::KIVI2::config()), "k2c32-v2t32-r128-s0-fk-post");
  EXPECT_EQ(kvq::to_string(kvq::KIVI4::config()), "k4c32-v4t32-r128-s0-fk-post");
  EXPECT_EQ(kvq::to_string(kvq::K4V2::config()), "k4c32-v2t32-r128-s0");
  using Custom = kvq::KVPolicy<kvq::PerChannel<3, 64, Mode::symmetric, kvq::bf16>,
                               kvq::PerToken<6, 16, Mode::asymmetric, float>, 64, 4, KeyRope::post, float>;
  EXPECT_EQ(kvq::to_string(Custom::config()), "k3c64s.bf16-v6t16.f32-r64-s4-post-f32");
  EXPECT_EQ(Custom::config(), kvq::parse_cache_config("k3c64s.bf16-v6t16.f32-r64-s4-post-f32"));
}

// ---------------------------------------------------------------------------------------------
// String round trips

std::vector<QuantizerSpec> spec_grid() {
  std::vector<QuantizerSpec> grid;
  for (int bits = 1; bits <= 8; ++bits)
    for (const Axis axis : {Axis::per_channel, Axis::per_token})
      for (const std::size_t group : {1, 16, 32, 128, 1024, 4096})
        for (const Mode mode : {Mode::asymmetric, Mode::symmetric, Mode::ggml, Mode::normal_float, Mode::lloyd_max,
                                Mode::iq4_nl, Mode::fp8_e4m3, Mode::fp8_e5m2})
          for (const Scalar param : {Scalar::f16, Scalar::bf16, Scalar::f32}) {
            if ((mode == Mode::normal_float && (bits < 2 || bits > 4)) || (mode == Mode::lloyd_max && bits > 4) ||
                (kvq::mode_bits(mode) != 0 && bits != kvq::mode_bits(mode)))
              continue;  // the level tables hold 2..4, 1..4, 4 (iq4_nl) and 8 (fp8) bits
            grid.push_back(QuantizerSpec{bits, group, axis, mode, param});
          }
  return grid;
}

TEST(Spec, QuantizerStringRoundTrip) {
  for (const QuantizerSpec& spec : spec_grid())
    for (const char tensor : {'k', 'v'}) {
      const std::string text = kvq::to_string(spec, tensor);
      ASSERT_EQ(text.front(), tensor);
      ASSERT_EQ(kvq::parse_quantizer(text, tensor), spec) << text;
      ASSERT_EQ(kvq::to_string(kvq::parse_quantizer(text, tensor), tensor), text);
    }
  // Hand-written forms; the default suffix is never written, so it is not read either.
  EXPECT_EQ(kvq::to_string(QuantizerSpec{4, 32, Axis::per_channel, Mode::asymmetric, Scalar::f16}, 'k'), "k4c32");
  EXPECT_EQ(kvq::to_string(QuantizerSpec{2, 64, Axis::per_token, Mode::symmetric, Scalar::f16}, 'v'), "v2t64s");
  EXPECT_EQ(kvq::to_string(QuantizerSpec{8, 128, Axis::per_token, Mode::asymmetric, Scalar::bf16}, 'v'), "v8t128.bf16");
  EXPECT_THROW((void)kvq::parse_quantizer("k4c32.f16", 'k'), kvq::Error);
  EXPECT_EQ(kvq::parse_quantizer("v3t8s.f32", 'v'),
            (QuantizerSpec{3, 8, Axis::per_token, Mode::symmetric, Scalar::f32}));
  EXPECT_EQ(kvq::parse_quantizer("k4t32g", 'k'), kvq::GgmlQ4_0::spec);
  EXPECT_EQ(kvq::to_string(kvq::GgmlQ8_0::spec, 'v'), "v8t32g");
  EXPECT_THROW((void)kvq::parse_quantizer("k4t32sg", 'k'), kvq::Error);
  // ggml levels keep no outliers: refused by the parser and by validate.
  EXPECT_THROW((void)kvq::parse_quantizer("k4t32o1g", 'k'), kvq::Error);
  EXPECT_THROW(kvq::validate(QuantizerSpec{4, 32, Axis::per_token, Mode::ggml, Scalar::f16, 1}, "keys"), kvq::Error);
  EXPECT_EQ(kvq::parse_quantizer("v4t32n", 'v'), (kvq::PerToken<4, 32, Mode::normal_float>::spec));
  EXPECT_EQ(kvq::parse_quantizer("k3c32l.bf16", 'k'), (kvq::PerChannel<3, 32, Mode::lloyd_max, kvq::bf16>::spec));
  for (const char* bad : {"k1t32n", "k5t32n", "k8c32l", "k3c32o1l", "k3c32ln"})
    EXPECT_THROW((void)kvq::parse_quantizer(bad, 'k'), kvq::Error) << bad;
  EXPECT_THROW(kvq::validate(QuantizerSpec{5, 32, Axis::per_token, Mode::lloyd_max}, "keys"), kvq::Error);
  EXPECT_THROW(kvq::validate(QuantizerSpec{1, 32, Axis::per_token, Mode::normal_float}, "keys"), kvq::Error);
  // One table names every mode: the parser and validate give the same width message.
  const auto message = [](auto&& call) {
    try {
      call();
    } catch (const kvq::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(
      message([] { (void)kvq::parse_quantizer("k5t32n", 'k'); }).find("normal_float levels take 2..4 bits, got 5"),
      std::string::npos);
  EXPECT_NE(message([] {
              kvq::validate(QuantizerSpec{3, 32, Axis::per_token, Mode::iq4_nl}, "keys");
            }).find("keys: iq4_nl levels take 4 bits, got 3"),
            std::string::npos);
  EXPECT_NE(message([] {
              kvq::validate(QuantizerSpec{4, 32, Axis::per_token, Mode(9)}, "keys");
            }).find("mode 9 is not a Mode"),
            std::string::npos);
  EXPECT_STREQ(kvq::to_string(Mode(9)), "unknown");
  EXPECT_EQ(kvq::mode_width_error(Mode(9), 4), "mode 9 is not a Mode");
  EXPECT_EQ(kvq::mode_width_error(Mode::lloyd_max, 4), "");
  EXPECT_STREQ(kvq::to_string(Mode::fp8_e5m2), "fp8_e5m2");
  EXPECT_EQ(kvq::mode_suffix(Mode::fp8_e4m3), "e4m3");
  EXPECT_EQ(kvq::mode_bits(Mode::lloyd_max), 0);
}

TEST(Spec, CacheConfigStringRoundTrip) {
  const std::vector<QuantizerSpec> keys = {QuantizerSpec{2, 32, Axis::per_channel},
                                           QuantizerSpec{4, 128, Axis::per_token, Mode::symmetric, Scalar::bf16},
                                           QuantizerSpec{8, 1, Axis::per_channel, Mode::asymmetric, Scalar::f32}};
  const std::vector<QuantizerSpec> values = {QuantizerSpec{2, 32, Axis::per_token},
                                             QuantizerSpec{1, 64, Axis::per_channel, Mode::symmetric, Scalar::f32},
                                             QuantizerSpec{5, 16, Axis::per_token, Mode::asymmetric, Scalar::bf16}};
  int checked = 0;
  for (const bool quantize_keys : {true, false})
    for (const bool quantize_values : {true, false})
      for (const QuantizerSpec& k : keys)
        for (const QuantizerSpec& v : values)
          for (const std::size_t window : {0, 32, 128, 4096})
            for (const std::size_t sinks : {0, 1, 4})
              for (const KeyRope rope : {KeyRope::pre, KeyRope::post})
                for (const Scalar residual : {Scalar::f16, Scalar::bf16, Scalar::f32}) {
                  CacheConfig c;
                  c.quantize_keys = quantize_keys;
                  c.quantize_values = quantize_values;
                  // An unquantized tensor's spec is not written; the parser leaves the default.
                  c.key = quantize_keys ? k : CacheConfig{}.key;
                  c.value = quantize_values ? v : CacheConfig{}.value;
                  c.window = window;
                  c.sinks = sinks;
                  c.key_rope = rope;
                  c.residual = residual;
                  const std::string text = kvq::to_string(c);
                  ASSERT_EQ(kvq::parse_cache_config(text), c) << text;
                  ASSERT_EQ(kvq::to_string(kvq::parse_cache_config(text)), text);
                  ++checked;
                }
  EXPECT_EQ(checked, 2 * 2 * 3 * 3 * 4 * 3 * 2 * 3);
  // Hand-written forms.
  const CacheConfig c = kvq::parse_cache_config("k2c32-v16-r64-s2-post-bf16");
  EXPECT_TRUE(c.quantize_keys);
  EXPECT_FALSE(c.quantize_values);
  EXPECT_EQ(c.key, (QuantizerSpec{2, 32, Axis::per_channel, Mode::asymmetric, Scalar::f16}));
  EXPECT_EQ(c.window, 64u);
  EXPECT_EQ(c.sinks, 2u);
  EXPECT_EQ(c.key_rope, KeyRope::post);
  EXPECT_EQ(c.residual, Scalar::bf16);
  EXPECT_EQ(kvq::to_string(kvq::full_precision_config()), "k16-v16-r0-s0-f32");
  // The rollback depth is written only when it is not the default, so existing names stay.
  for (const std::size_t depth : {0, 1, 16, 40, 4096}) {
    CacheConfig d = kvq::K4V2::config();
    d.rollback_depth = depth;
    const std::string text = kvq::to_string(d);
    EXPECT_EQ(text, depth == 16 ? "k4c32-v2t32-r128-s0" : "k4c32-v2t32-r128-s0-d" + std::to_string(depth));
    EXPECT_EQ(kvq::parse_cache_config(text), d) << text;
  }
  EXPECT_THROW((void)kvq::parse_cache_config("k4c32-v2t32-r128-s0-d16"), kvq::Error);  // the default is not written
  for (const auto& [text, flush] : {std::pair{"k2c32-v2t32-r128-s0-fk-post", kvq::WindowFlush::keys},
                                    {"k4t64-v4t64-r128-s0-fk-fv-post", kvq::WindowFlush::both},
                                    {"k4c32-v2t32-r7-s3-fv-hk-f32-d4", kvq::WindowFlush::values}}) {
    const CacheConfig f = kvq::parse_cache_config(text);
    EXPECT_EQ(f.flush, flush) << text;
    EXPECT_EQ(kvq::to_string(f), text);
  }
}

// ---------------------------------------------------------------------------------------------
// Bad strings and bad specs

// Runs f, expects a kvq::Error whose message contains every one of `needles`.
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> needles,
                  kvq::ErrorCode code = kvq::ErrorCode::invalid_argument) {
  try {
    f();
    ADD_FAILURE() << "no kvq::Error thrown; expected one mentioning '" << *needles.begin() << "'";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), code);
    const std::string what = e.what();
    for (const std::string& n : needles)
      EXPECT_NE(what.find(n), std::string::npos) << "'" << what << "' lacks '" << n << "'";
  }
}

TEST(Spec, InvalidQuantizerStringsThrowNamingTheText) {
  for (const char* text : {"k0c32", "k9c32", "k4x32", "k4c0", "k4c32-", "k4c32.f64", "k4c32ss", "k4c", "k4", "kc32",
                           "K4c32", "k4c32 ", "k-4c32", "k10c32", "k4c32.bf16.f32"}) {
    SCOPED_TRACE(text);
    expect_error([&] { (void)kvq::parse_quantizer(text, 'k'); }, {std::string("'") + text + "'"});
  }
  expect_error([] { (void)kvq::parse_quantizer("", 'k'); }, {"''", "must start with 'k'"});
  expect_error([] { (void)kvq::parse_quantizer("v4t32", 'k'); }, {"'v4t32'", "must start with 'k'"});
  expect_error([] { (void)kvq::parse_quantizer("k4c32", 'v'); }, {"'k4c32'", "must start with 'v'"});
  expect_error([] { (void)kvq::parse_quantizer("k9c32", 'k'); }, {"'k9c32'", "bits"});
  expect_error([] { (void)kvq::parse_quantizer("k4x32", 'k'); }, {"'k4x32'", "axis"});
  expect_error([] { (void)kvq::parse_quantizer("k4c0", 'k'); }, {"'k4c0'", "group"});
  expect_error([] { (void)kvq::parse_quantizer("k4c32.f64", 'k'); }, {"'k4c32.f64'", "'.f64'"});
}

TEST(Spec, InvalidCacheConfigStringsThrowNamingTheText) {
  for (const char* text : {"", "k4c32", "k4c32-", "v2t32-k4c32", "k4c32-v2t32-rfoo", "k4c32-v2t32-r", "k4c32-v2t32-s1x",
                           "k4c32-v2t32-r128-foo", "k4c32-v9t32", "k0c32-v2t32", "k4c32-v2t32-f64", "k4c32-k2t32",
                           "k4c32-v2t32--r128", "-k4c32-v2t32", "k4c32-v2t32-r-5"}) {
    SCOPED_TRACE(text);
    try {
      (void)kvq::parse_cache_config(text);
      ADD_FAILURE() << "accepted '" << text << "'";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument);
      EXPECT_FALSE(std::string(e.what()).empty());
    }
  }
  expect_error([] { (void)kvq::parse_cache_config("k4c32-v2t32-rfoo"); }, {"'k4c32-v2t32-rfoo'", "rfoo"});
  expect_error([] { (void)kvq::parse_cache_config("k4c32-v2t32-r128-xyz"); }, {"xyz"});
  expect_error([] { (void)kvq::parse_cache_config("k4c32-v9t32"); }, {"'v9t32'"});
  expect_error([] { (void)kvq::parse_cache_config("v4t32-v2t32"); }, {"'v4t32'", "must start with 'k'"});
  expect_error([] { (void)kvq::parse_cache_config(""); }, {"''"});
}

// One spelling per configuration: each part once, in order, nothing implied, no leading zeros.
TEST(Spec, ParserAcceptsOnlyTheCanonicalForm) {
  for (const char* text : {"k4c32-v2t32",
                           "k4c32-v2t32-r128",
                           "k4c32-v2t32-s0-r128",
                           "k4c32-v2t32-r1-r2-s0",
                           "k4c32-v2t32-r128-s0-s1",
                           "k4c32-v2t32-r128-s0-pre",
                           "k4c32-v2t32-r128-s0-f16",
                           "k4c32-v2t32-r128-s0-post-post",
                           "k4c32-v2t32-r128-s0-f32-post",
                           "k4c32-v2t32-r128-s0-f32-bf16",
                           "k4c32-v2t32-r0128-s0",
                           "k4c32-v2t32-r128-s00",
                           "k04c32-v2t32-r128-s0",
                           "k4c032-v2t32-r128-s0",
                           "k4c32.f16-v2t32-r128-s0",
                           "k4c32-v2t32-r+5-s0",
                           "k4c32-v2t32-r 5-s0",
                           "k4c32-v2t32-r1234567890-s0",
                           "k4c4097-v2t32-r128-s0",
                           "k4c999999999-v2t32-r128-s0",
                           "k4c32-v2t32-d5-r128-s0",
                           "k4c32-v2t32-r128-s0-d5-post",
                           "k4c32-v2t32-r128-s0-d16",
                           "k4c32-v2t32-r128-s0-d4097",
                           "k4c32-v2t32-r128-s0-d5-d6",
                           "k4c32-v2t32-r128-s0-fv-fk",
                           "k4c32-v2t32-r128-s0-fk-fk",
                           "k4c32-v2t32-r128-s0-post-fk",
                           "k4c32-v2t32-r128-fk-s0"}) {
    SCOPED_TRACE(text);
    expect_error([&] { (void)kvq::parse_cache_config(text); }, {std::string("'") + text + "'"});
  }
  EXPECT_NO_THROW((void)kvq::parse_cache_config("k4c4096-v2t32-r999999999-s0"));
  expect_error([] { (void)kvq::parse_cache_config("k4c32-v2t32-r128"); }, {"sinks"});
  expect_error([] { (void)kvq::parse_cache_config("k4c32-v2t32-r128-s0-pre"); }, {"'pre'"});
  expect_error([] { (void)kvq::parse_cache_config("k4c999999999-v2t32-r128-s0"); }, {"4096"});
}

// A window flushes R rows of a quantized tensor at a time: whole groups when per channel.
TEST(Spec, FlushNeedsQuantizedRowsAWindowAndWholeGroups) {
  expect_error([] { (void)kvq::parse_cache_config("k16-v2t32-r128-s0-fk"); }, {"keys flush", "not quantized"});
  expect_error([] { (void)kvq::parse_cache_config("k4c32-v16-r128-s0-fv"); }, {"values flush", "not quantized"});
  expect_error([] { (void)kvq::parse_cache_config("k4c32-v2t32-r0-s0-fk"); }, {"keys flush", "window is 0"});
  expect_error([] { (void)kvq::parse_cache_config("k4c32-v2t32-r48-s0-fk"); },
               {"'k4c32-v2t32-r48-s0-fk'", "window of 48 is no multiple of their group of 32"});
  expect_error([] { (void)kvq::parse_cache_config("k4c32-v2c32-r40-s0-fv"); }, {"values flush", "group of 32"});
  EXPECT_NO_THROW((void)kvq::parse_cache_config("k4t32-v2t32-r7-s0-fk-fv"));  // per token: any window
  CacheConfig c;
  c.flush = static_cast<kvq::WindowFlush>(4);
  expect_error([&] { kvq::validate(c); }, {"flush 4"});
}

// Configurations built in code go through the same checks as parsed ones.
TEST(Spec, ValidateConfigRejectsValuesOutsideTheirEnums) {
  EXPECT_NO_THROW(kvq::validate(CacheConfig{}));
  auto expect_bad = [](CacheConfig c, const char* needle) {
    expect_error([&] { kvq::validate(c); }, {needle});
    expect_error([&] { kvq::BasicKVCache cache(kvq::CacheShape{1, 1, 32, 64}, c); }, {needle});
  };
  CacheConfig c;
  c.key.axis = static_cast<Axis>(9);
  expect_bad(c, "axis 9");
  c = {};
  c.value.param = static_cast<Scalar>(7);
  expect_bad(c, "parameter type 7");
  c = {};
  c.value.mode = static_cast<Mode>(9);
  expect_bad(c, "mode 9");
  c = {};
  c.residual = static_cast<Scalar>(7);
  expect_bad(c, "residual type 7");
  c = {};
  c.key_rope = static_cast<kvq::KeyRope>(2);
  expect_bad(c, "key_rope 2");
  c = {};
  c.key.group = kvq::max_group_tokens + 1;
  expect_bad(c, "4097");
  c = {};
  c.quantize_keys = false;  // an unused quantizer is not checked
  c.key.axis = static_cast<Axis>(9);
  EXPECT_NO_THROW(kvq::validate(c));
}

TEST(Spec, ValidateRejectsWhatTheKernelsCannotRun) {
  const QuantizerSpec ok{4, 32, Axis::per_token};
  EXPECT_NO_THROW(kvq::validate(ok, 32, "value quantizer"));
  EXPECT_NO_THROW(kvq::validate(ok, 1024, "value quantizer"));
  EXPECT_NO_THROW(kvq::validate(QuantizerSpec{4, 100, Axis::per_token}, 128, "v"));  // a shorter last group is fine
  EXPECT_NO_THROW(
      kvq::validate(QuantizerSpec{4, 512, Axis::per_channel}, 64, "k"));  // per-channel groups run over tokens
  expect_error([&] { kvq::validate(ok, 16, "value quantizer"); }, {"value quantizer", "32", "16"});
  expect_error([&] { kvq::validate(ok, 0, "key quantizer"); }, {"key quantizer", "head_dim"});
  expect_error([&] { kvq::validate(ok, kvq::max_head_dim + 1, "key quantizer"); }, {"key quantizer", "1025"});
  expect_error([&] { kvq::validate(QuantizerSpec{0, 32, Axis::per_token}, 64, "v"); }, {"bits"});
  expect_error([&] { kvq::validate(QuantizerSpec{9, 32, Axis::per_token}, 64, "v"); }, {"bits", "9"});
  expect_error([&] { kvq::validate(QuantizerSpec{4, 0, Axis::per_channel}, 64, "k"); }, {"group"});
  EXPECT_EQ(kvq::groups_per_row(QuantizerSpec{4, 32, Axis::per_token}, 128), 4u);
  EXPECT_EQ(kvq::groups_per_row(QuantizerSpec{4, 32, Axis::per_token}, 136), 5u);
  EXPECT_EQ(kvq::groups_per_row(QuantizerSpec{4, 128, Axis::per_token}, 100), 1u);
  EXPECT_EQ((QuantizerSpec{3, 32}.levels()), 8);
  EXPECT_FALSE((QuantizerSpec{3, 32, Axis::per_token, Mode::symmetric}.has_zero_point()));
}

}  // namespace
