#pragma once
// KVPolicy: a key quantizer, a value quantizer, the full-precision window and sinks, and where
// RoPE sits, composed into one type that KVCache<Policy> takes. Presets carry the names users know.

#include <concepts>
#include <cstddef>

#include "kvq/cache/cache_config.hpp"
#include "kvq/quant/policies.hpp"

namespace kvq::inline v0 {

template <Quantizer KeyQ, Quantizer ValueQ, std::size_t Window = 128, std::size_t Sinks = 0,
          KeyRope Rope = KeyRope::pre, class Residual = fp16, Rotation KeyRotation = Rotation::none,
          Rotation ValueRotation = Rotation::none, WindowFlush Flush = WindowFlush::none>
struct KVPolicy {
  static_assert(std::same_as<Residual, fp16> || std::same_as<Residual, bf16> || std::same_as<Residual, float>,
                "window and sink tokens are stored as fp16, bf16 or float");
  static_assert(Flush == WindowFlush::none || Window > 0, "a window that flushes holds at least one token");
  static_assert((!flushes(Flush, true) || KeyQ::axis != Axis::per_channel || Window % KeyQ::group_size == 0) &&
                    (!flushes(Flush, false) || ValueQ::axis != Axis::per_channel || Window % ValueQ::group_size == 0),
                "a window that flushes per-channel groups holds a whole number of them");
  using key_quantizer = KeyQ;
  using value_quantizer = ValueQ;
  static constexpr std::size_t window = Window;
  static constexpr std::size_t sinks = Sinks;
  static constexpr KeyRope key_rope = Rope;
  static constexpr Rotation key_rotation = KeyRotation;
  static constexpr Rotation value_rotation = ValueRotation;
  static constexpr WindowFlush flush = Flush;

  static CacheConfig config() {
    CacheConfig c;
    c.key = KeyQ::spec;
    c.value = ValueQ::spec;
    c.window = Window;
    c.sinks = Sinks;
    c.key_rope = Rope;
    c.residual = scalar_of<Residual>;
    c.key_rotation = KeyRotation;
    c.value_rotation = ValueRotation;
    c.flush = Flush;
    return c;
  }
};

template <class P>
concept KVCachePolicy = Quantizer<typename P::key_quantizer> && Quantizer<typename P::value_quantizer> && requires {
  { P::config() } -> std::same_as<CacheConfig>;
};

// The right axes: keys per channel, values per token, group 32, window 128 (KIVI's defaults), keys
// stored before RoPE and the newest 128 tokens always exact.
using K2V2 = KVPolicy<PerChannel<2, 32>, PerToken<2, 32>>;  // KIVI-2's bits and axes
using K4V4 = KVPolicy<PerChannel<4, 32>, PerToken<4, 32>>;  // KIVI-4's
using K4V2 = KVPolicy<PerChannel<4, 32>, PerToken<2, 32>>;
using K2V4 = KVPolicy<PerChannel<2, 32>, PerToken<4, 32>>;
using K8V4 = KVPolicy<PerChannel<8, 32>, PerToken<4, 32>>;
using K8V8 = KVPolicy<PerChannel<8, 32>, PerToken<8, 32>>;

// Wrong-axis ablations that reproduce the thesis (KIVI's table): never use them for serving.
using K2V2KeysPerToken = KVPolicy<PerToken<2, 32>, PerToken<2, 32>>;
using K2V2ValuesPerChannel = KVPolicy<PerChannel<2, 32>, PerChannel<2, 32>>;
using K2V2WrongAxes = KVPolicy<PerToken<2, 32>, PerChannel<2, 32>>;
using K4V4KeysPostRope = KVPolicy<PerChannel<4, 32>, PerToken<4, 32>, 128, 0, KeyRope::post>;

// KIVI as published: post-RoPE keys that leave the window 128 at a time (0 to 127 exact keys).
using KIVI2 = KVPolicy<PerChannel<2, 32>, PerToken<2, 32>, 128, 0, KeyRope::post, fp16, Rotation::none, Rotation::none,
                       WindowFlush::keys>;
using KIVI4 = KVPolicy<PerChannel<4, 32>, PerToken<4, 32>, 128, 0, KeyRope::post, fp16, Rotation::none, Rotation::none,
                       WindowFlush::keys>;

// llama.cpp's layout since its rotated caches: keys and values per token, both rotated by H.
using K4V4RotatedPerToken =
    KVPolicy<PerToken<4, 32>, PerToken<4, 32>, 128, 0, KeyRope::post, fp16, Rotation::hadamard, Rotation::hadamard>;

}  // namespace kvq::inline v0
