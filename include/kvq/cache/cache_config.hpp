#pragma once
// CacheConfig: everything that decides how a cache stores its tokens, as runtime values.
// Compiled policies (kv_policy.hpp) produce one; tools parse one from a string such as
// "k4c32-v2t32-r128-s1" (see parse_cache_config).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
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

/// An orthogonal rotation of each head vector before it is stored (transform/hadamard.hpp): it
/// spreads a channel's outliers over the head, so per-token groups see narrower ranges.
/// Attention rotates the query instead of post-RoPE keys (q.k = Hq.Hk) and rotates the output
/// back (sum p Hv = H sum p v), so no kernel changes; pre-RoPE keys, which RoPE must see in the
/// model's space, are rotated back row by row after dequantization by the kernels that can (the
/// generic AVX-512 kernel, the vector kernels), which then run these caches. read_row returns
/// rows rotated back.
enum class Rotation : unsigned char {
  none,
  hadamard,         // the normalized Walsh-Hadamard transform H (block-diagonal when head_dim is no power of two)
  signed_hadamard,  // H D with fixed random signs D (rotation_sign_seed), as TurboQuant and QuaRot draw them
};

/// Which quantized tensors leave the full-precision window R rows at a time. A tensor that does
/// not flush quantizes each per-channel group (or per-token row) as soon as it is older than the
/// newest R tokens, so the newest R are always exact (R to R + G - 1 keys per channel). One that
/// flushes keeps its rows exact until R have gathered after the last flush and then quantizes all
/// R together, so 0 to R - 1 are exact: KIVI's keys (its residual_length), and the window of
/// Hugging Face's QuantizedCache for keys and values (which also packs the whole prompt at once).
/// Cheaper by up to R rows, and the newest tokens right after a flush are quantized.
enum class WindowFlush : unsigned char { none, keys, values, both };

/// Whether `flush` makes the key (keys = true) or value stream flush its window.
constexpr bool flushes(WindowFlush flush, bool keys) noexcept {
  return flush == WindowFlush::both || flush == (keys ? WindowFlush::keys : WindowFlush::values);
}

/// The seed of Rotation::signed_hadamard's signs: part of the format, the same for every cache.
inline constexpr std::uint64_t rotation_sign_seed = 0x6b76712d68616461ull;

struct CacheConfig {
  QuantizerSpec key{4, 32, Axis::per_channel, Mode::asymmetric, Scalar::f16};
  QuantizerSpec value{2, 32, Axis::per_token, Mode::asymmetric, Scalar::f16};
  bool quantize_keys = true;              // false: keys stay in the residual type for good
  bool quantize_values = true;            // false: values stay in the residual type for good
  std::size_t window = 128;               // R: newest tokens kept in full precision
  std::size_t sinks = 0;                  // S: first tokens kept in full precision for good
  WindowFlush flush = WindowFlush::none;  // which tensors leave the window R at a time (KIVI's keys)
  KeyRope key_rope = KeyRope::pre;
  Scalar residual = Scalar::f16;  // storage type of window and sink tokens
  // D: how many tokens truncate() can take back exactly, re-opening quantized groups and tokens
  // (speculative decoding). Costs full-precision copies of the last D + G packed rows (D + 1 for
  // a per-token tensor, D + R for one that flushes) per layer, KV head and tensor, made as rows
  // are packed; 0 turns it off (truncate then re-opens only rows still in the ring).
  std::size_t rollback_depth = 16;
  Rotation key_rotation = Rotation::none;  // pre-RoPE keys are rotated back before RoPE, in the kernels
  Rotation value_rotation = Rotation::none;
  // Codebook quantizers only: one codebook per KV head, the first the quantizer's own, so each
  // head's levels fit its own activations (KVQuant calibrates per layer, head and tensor); empty:
  // every head takes the quantizer's. A cache checks that there is one per KV head.
  std::vector<Codebook> key_head_codebooks, value_head_codebooks;

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

/// "hk"/"hv" for a Hadamard rotation of keys/values, "hsk"/"hsv" with random signs; "" for none.
inline std::string rotation_part(Rotation r, char tensor) {
  if (r == Rotation::none) return {};
  return std::string(r == Rotation::hadamard ? "h" : "hs") + tensor;
}

/// "k4c32-v2t32-r128-s1" plus "-fk"/"-fv" for keys/values that flush their window, "-post" for
/// post-RoPE keys, "-hk"/"-hsk" and "-hv"/"-hsv" for rotated keys and values, "-f32"/"-bf16" for
/// the residual type and "-d<D>" for a rollback depth other than 16; "k16"/"v16" keep that tensor
/// unquantized.
inline std::string to_string(const CacheConfig& c) {
  std::string s = c.quantize_keys ? to_string(c.key, 'k', c.key_head_codebooks) : std::string("k16");
  s += '-';
  s += c.quantize_values ? to_string(c.value, 'v', c.value_head_codebooks) : std::string("v16");
  s += "-r" + std::to_string(c.window) + "-s" + std::to_string(c.sinks);
  if (flushes(c.flush, true)) s += "-fk";
  if (flushes(c.flush, false)) s += "-fv";
  if (c.key_rope == KeyRope::post) s += "-post";
  if (c.key_rotation != Rotation::none) s += "-" + rotation_part(c.key_rotation, 'k');
  if (c.value_rotation != Rotation::none) s += "-" + rotation_part(c.value_rotation, 'v');
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
  if (c.flush != WindowFlush::none && c.flush != WindowFlush::keys && c.flush != WindowFlush::values &&
      c.flush != WindowFlush::both)
    throw Error(ErrorCode::invalid_argument,
                "cache configuration: flush " + std::to_string(int(c.flush)) + " is not a WindowFlush");
  for (const auto& [spec, quantized, keys, what] :
       {std::tuple{&c.key, c.quantize_keys, true, "key"}, std::tuple{&c.value, c.quantize_values, false, "value"}}) {
    if (!flushes(c.flush, keys)) continue;
    const std::string prefix = std::string("cache configuration: ") + what + "s flush their window, but ";
    if (!quantized) throw Error(ErrorCode::invalid_argument, prefix + "they are not quantized");
    if (c.window == 0)
      throw Error(ErrorCode::invalid_argument,
                  prefix + "the window is 0 (every complete group is quantized at once either way)");
    if (spec->axis == Axis::per_channel && c.window % spec->group != 0)
      throw Error(ErrorCode::invalid_argument, prefix + "the window of " + std::to_string(c.window) +
                                                   " is no multiple of their group of " + std::to_string(spec->group) +
                                                   " tokens");
  }
  if (c.key_rope != KeyRope::pre && c.key_rope != KeyRope::post)
    throw Error(ErrorCode::invalid_argument,
                "cache configuration: key_rope " + std::to_string(int(c.key_rope)) + " is not a KeyRope");
  if (!is_valid(c.residual))
    throw Error(ErrorCode::invalid_argument,
                "cache configuration: residual type " + std::to_string(int(c.residual)) + " is not a Scalar");
  for (const auto& [heads, spec, quantized, what] :
       {std::tuple{&c.key_head_codebooks, &c.key, c.quantize_keys, "key"},
        std::tuple{&c.value_head_codebooks, &c.value, c.quantize_values, "value"}}) {
    if (heads->empty()) continue;
    const std::string prefix = std::string("cache configuration: ") + what + " codebooks per KV head: ";
    if (!quantized || spec->mode != Mode::codebook)
      throw Error(ErrorCode::invalid_argument,
                  prefix + "set, but the " + what + "s are not quantized with codebook levels");
    if (heads->size() < 2)
      throw Error(ErrorCode::invalid_argument, prefix + "one codebook is the quantizer's own: leave them empty");
    if ((*heads)[0] != spec->codebook)
      throw Error(ErrorCode::invalid_argument, prefix + "KV head 0's differ from the quantizer's own codebook");
    const Codebook& own = spec->codebook;  // a name the lambda can capture (clang: no structured bindings)
    if (std::all_of(heads->begin(), heads->end(), [&own](const Codebook& levels) { return levels == own; }))
      throw Error(ErrorCode::invalid_argument,
                  prefix + "every KV head has the quantizer's own codebook: leave them empty (one spelling)");
    for (std::size_t h = 0; h < heads->size(); ++h) {
      QuantizerSpec head = *spec;
      head.codebook = (*heads)[h];
      validate_codebook(head, prefix + "KV head " + std::to_string(h) + "'s ");
    }
  }
  for (const auto& [r, quantized, what] :
       {std::tuple{c.key_rotation, c.quantize_keys, "key"}, std::tuple{c.value_rotation, c.quantize_values, "value"}}) {
    if (r != Rotation::none && r != Rotation::hadamard && r != Rotation::signed_hadamard)
      throw Error(ErrorCode::invalid_argument, std::string("cache configuration: ") + what + " rotation " +
                                                   std::to_string(int(r)) + " is not a Rotation");
    if (r != Rotation::none && !quantized)
      throw Error(ErrorCode::invalid_argument, std::string("cache configuration: a ") + what +
                                                   " rotation needs quantized " + what +
                                                   "s (it changes nothing for rows stored whole)");
  }
}

/// Parses exactly the form to_string writes: key, value, window and sinks in that order, then the
/// flushes, "-post", the rotations, a residual type other than f16 and a rollback depth other than
/// 16 when they apply. Each part appears once and none is implied, so a string names one
/// configuration and reads back as itself.
inline CacheConfig parse_cache_config(std::string_view text) {
  const std::string original(text);
  auto fail = [&](const std::string& why) -> CacheConfig {
    throw Error(ErrorCode::invalid_argument,
                "cache configuration '" + original + "': " + why +
                    " (expected e.g. k4c32-v2t32-r128-s1[-fk][-fv][-post][-hk|-hsk][-hv|-hsv][-f32|-bf16][-d8])");
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
  auto quantizer = [&](std::string_view part, char tensor, std::vector<Codebook>& heads) {
    try {
      return parse_quantizer(part, tensor, &heads);
    } catch (const Error& e) {
      fail_naming_text(e);
      return QuantizerSpec{};
    }
  };
  if (parts[0] == "k16")
    c.quantize_keys = false;
  else
    c.key = quantizer(parts[0], 'k', c.key_head_codebooks);
  if (parts[1] == "v16")
    c.quantize_values = false;
  else
    c.value = quantizer(parts[1], 'v', c.value_head_codebooks);
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
  const bool flush_keys = i < parts.size() && parts[i] == "fk";
  i += flush_keys;
  const bool flush_values = i < parts.size() && parts[i] == "fv";
  i += flush_values;
  c.flush = flush_keys ? (flush_values ? WindowFlush::both : WindowFlush::keys)
                       : (flush_values ? WindowFlush::values : WindowFlush::none);
  if (i < parts.size() && parts[i] == "post") c.key_rope = KeyRope::post, ++i;
  for (const auto& [target, tensor] : {std::pair{&c.key_rotation, 'k'}, std::pair{&c.value_rotation, 'v'}})
    for (const Rotation r : {Rotation::hadamard, Rotation::signed_hadamard})
      if (i < parts.size() && parts[i] == rotation_part(r, tensor)) {
        *target = r;
        ++i;
        break;
      }
  if (i < parts.size() && parts[i] == "f32")
    c.residual = Scalar::f32, ++i;
  else if (i < parts.size() && parts[i] == "bf16")
    c.residual = Scalar::bf16, ++i;
  if (i < parts.size() && !parts[i].empty() && parts[i].front() == 'd') {
    number(i, 'd', c.rollback_depth);
    if (c.rollback_depth == CacheConfig{}.rollback_depth)
      return fail("'" + std::string(parts[i]) + "' is the default rollback depth, which is not written");
    ++i;
  }
  if (i < parts.size())
    return fail("unexpected part '" + std::string(parts[i]) +
                "' (after the sinks come only 'fk', then 'fv', then 'post', then 'hk' or 'hsk', then 'hv' or 'hsv', "
                "then 'f32' or 'bf16', then 'd<depth>', each at most once)");
  try {
    validate(c);
  } catch (const Error& e) {
    fail_naming_text(e);
  }
  return c;
}

}  // namespace kvq::inline v0
