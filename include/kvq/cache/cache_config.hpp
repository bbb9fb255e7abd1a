#pragma once
// CacheConfig: everything that decides how a cache stores its tokens, as runtime values.
// Compiled policies (kv_policy.hpp) produce one; tools parse one from a string such as
// "k4c32-v2t32-r128-s1" (see parse_cache_config).

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/error.hpp"
#include "kvq/quant/spec.hpp"

namespace kvq::inline v0 {

/// Where RoPE sits relative to key quantization.
enum class KeyRope : unsigned char {
  pre,   // the cache stores pre-RoPE keys and rotates them after dequantization (KVQuant)
  post,  // the engine rotates first; the cache stores and returns rotated keys unchanged
};

struct CacheConfig {
  QuantizerSpec key{4, 32, Axis::per_channel, Mode::asymmetric, Scalar::f16};
  QuantizerSpec value{2, 32, Axis::per_token, Mode::asymmetric, Scalar::f16};
  bool quantize_keys = true;    // false: keys stay in the residual type for good
  bool quantize_values = true;  // false: values stay in the residual type for good
  std::size_t window = 128;     // R: newest tokens kept in full precision
  std::size_t sinks = 0;        // S: first tokens kept in full precision for good
  KeyRope key_rope = KeyRope::pre;
  Scalar residual = Scalar::f16;  // storage type of window and sink tokens
  // D: how many tokens truncate() can take back exactly, re-opening quantized groups and tokens
  // (speculative decoding). Costs full-precision copies of the last D + G packed rows (D + 1 for
  // a per-token tensor) per layer, KV head and tensor, made as rows are packed; 0 turns it off
  // (truncate then re-opens only rows still in the ring).
  std::size_t rollback_depth = 16;

  /// Deepest rollback a cache keeps copies for; bounds that memory (validate refuses more).
  static constexpr std::size_t max_rollback_depth = 4096;

  bool operator==(const CacheConfig&) const = default;
};

/// A configuration that keeps everything in float: the oracle's cache.
inline CacheConfig full_precision_config() {
  CacheConfig c;
  c.quantize_keys = c.quantize_values = false;
  c.window = 0;
  c.residual = Scalar::f32;
  return c;
}

/// "k4c32-v2t32-r128-s1" plus "-post" for post-RoPE keys, "-f32"/"-bf16" for the residual
/// type and "-d<D>" for a rollback depth other than 16; "k16"/"v16" keep that tensor unquantized.
inline std::string to_string(const CacheConfig& c) {
  std::string s = c.quantize_keys ? to_string(c.key, 'k') : std::string("k16");
  s += '-';
  s += c.quantize_values ? to_string(c.value, 'v') : std::string("v16");
  s += "-r" + std::to_string(c.window) + "-s" + std::to_string(c.sinks);
  if (c.key_rope == KeyRope::post) s += "-post";
  if (c.residual != Scalar::f16) s += std::string("-") + to_string(c.residual);
  if (c.rollback_depth != CacheConfig{}.rollback_depth) s += "-d" + std::to_string(c.rollback_depth);
  return s;
}

/// Throws unless `c` is a configuration kvq implements for some head_dim: every field in its
/// range (configs built in code may hold cast enum values). The cache adds the head_dim checks.
inline void validate(const CacheConfig& c) {
  if (c.quantize_keys) validate(c.key, "key quantizer");
  if (c.quantize_values) validate(c.value, "value quantizer");
  if (c.rollback_depth > CacheConfig::max_rollback_depth)
    throw Error(ErrorCode::invalid_argument, "cache configuration: rollback depth " + std::to_string(c.rollback_depth) +
                                                 " exceeds the limit of " +
                                                 std::to_string(CacheConfig::max_rollback_depth));
  if (c.key_rope != KeyRope::pre && c.key_rope != KeyRope::post)
    throw Error(ErrorCode::invalid_argument,
                "cache configuration: key_rope " + std::to_string(int(c.key_rope)) + " is not a KeyRope");
  if (!is_valid(c.residual))
    throw Error(ErrorCode::invalid_argument,
                "cache configuration: residual type " + std::to_string(int(c.residual)) + " is not a Scalar");
}

/// Parses exactly the form to_string writes: key, value, window and sinks in that order, then
/// "-post" and a residual type other than f16 when they apply. Each part appears once and none
/// is implied, so a string names one configuration and reads back as itself.
inline CacheConfig parse_cache_config(std::string_view text) {
  const std::string original(text);
  auto fail = [&](const std::string& why) -> CacheConfig {
    throw Error(ErrorCode::invalid_argument, "cache configuration '" + original + "': " + why +
                                                 " (expected e.g. k4c32-v2t32-r128-s1[-post][-f32|-bf16][-d8])");
  };
  std::vector<std::string_view> parts;
  if (!text.empty() && text.back() == '-') return fail("trailing '-'");
  while (!text.empty()) {
    const auto dash = text.find('-');
    parts.push_back(text.substr(0, dash));
    text = dash == std::string_view::npos ? std::string_view{} : text.substr(dash + 1);
  }
  if (parts.size() < 2) return fail("needs a key and a value quantizer");
  CacheConfig c;
  auto fail_naming_text = [&](const Error& e) {  // the part alone may be ambiguous: name the whole string
    const std::string prefix = std::string("kvq: ") + to_string(e.code()) + ": ";
    return fail(std::string(e.what()).substr(prefix.size()));
  };
  auto quantizer = [&](std::string_view part, char tensor) {
    try {
      return parse_quantizer(part, tensor);
    } catch (const Error& e) {
      fail_naming_text(e);
      return QuantizerSpec{};
    }
  };
  if (parts[0] == "k16")
    c.quantize_keys = false;
  else
    c.key = quantizer(parts[0], 'k');
  if (parts[1] == "v16")
    c.quantize_values = false;
  else
    c.value = quantizer(parts[1], 'v');
  if (parts.size() < 4) return fail("needs a window (r<number>) and sinks (s<number>) after the quantizers");
  auto number = [&](std::size_t i, char letter, std::size_t& out) {
    std::string_view p = parts[i];
    if (p.size() < 2 || p.front() != letter)
      return fail(std::string("part ") + std::to_string(i + 1) + " must be '" + letter + "<number>', got '" +
                  std::string(parts[i]) + "'");
    p.remove_prefix(1);
    if (!detail::parse_size(p, out) || !p.empty())
      return fail("'" + std::string(parts[i]) + "' is not a number of at most 9 digits without leading zeros");
    return c;
  };
  number(2, 'r', c.window);
  number(3, 's', c.sinks);
  std::size_t i = 4;
  if (i < parts.size() && parts[i] == "post") c.key_rope = KeyRope::post, ++i;
  if (i < parts.size() && parts[i] == "f32")
    c.residual = Scalar::f32, ++i;
  else if (i < parts.size() && parts[i] == "bf16")
    c.residual = Scalar::bf16, ++i;
  if (i < parts.size() && parts[i].front() == 'd') {
    number(i, 'd', c.rollback_depth);
    if (c.rollback_depth == CacheConfig{}.rollback_depth)
      return fail("'" + std::string(parts[i]) + "' is the default rollback depth, which is not written");
    ++i;
  }
  if (i < parts.size())
    return fail("unexpected part '" + std::string(parts[i]) +
                "' (after the sinks come only 'post', then 'f32' or 'bf16', then 'd<depth>', each at most once)");
  try {
    validate(c);
  } catch (const Error& e) {
    fail_naming_text(e);
  }
  return c;
}

}  // namespace kvq::inline v0
