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

inline CacheConfig parse_cache_config(std::string_view text) {
  const std::string original(text);
  auto fail = [&](const std::string& why) -> CacheConfig {
    throw Error(ErrorCode::invalid_argument,
                "cache configuration '" + original + "': " + why + " (expected e.g. k4c32-v2t32-r128-s1[-post][-f32][-d16])");
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
  if (parts[0] == "k16") c.quantize_keys = false;
  else c.key = parse_quantizer(parts[0], 'k');
  if (parts[1] == "v16") c.quantize_values = false;
  else c.value = parse_quantizer(parts[1], 'v');
  for (std::size_t i = 2; i < parts.size(); ++i) {
    std::string_view p = parts[i];
    if (p.empty()) return fail("empty part");
    if (p == "post") c.key_rope = KeyRope::post;
    else if (p == "pre") c.key_rope = KeyRope::pre;
    else if (p == "f32") c.residual = Scalar::f32;
    else if (p == "bf16") c.residual = Scalar::bf16;
    else if (p == "f16") c.residual = Scalar::f16;
    else if ((p.front() == 'r' || p.front() == 's' || p.front() == 'd') && p.size() > 1) {
      const char kind = p.front();
      p.remove_prefix(1);
      std::size_t n = 0;
      if (!detail::parse_size(p, n) || !p.empty()) return fail("'" + std::string(parts[i]) + "' is not a number");
      (kind == 'r' ? c.window : kind == 's' ? c.sinks : c.rollback_depth) = n;
    } else {
      return fail("unknown part '" + std::string(p) + "'");
    }
  }
  return c;
}

}  // namespace kvq::inline v0
