// libFuzzer target: configuration strings. Whatever parses must print back as itself (one
// spelling per configuration) and either build, fill and attend a small cache (the exact tier
// agreeing with the oracle) or be refused with a kvq::Error; per-layer texts must parse to
// configurations that print and parse back as the same; nothing may crash, leak or hit undefined
// behaviour.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/kvq.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const std::vector<kvq::CacheConfig> layers = kvq::parse_layer_configs(text);
    if (kvq::parse_layer_configs(kvq::to_string(std::span<const kvq::CacheConfig>(layers))) != layers) __builtin_trap();
  } catch (const kvq::Error&) {
  }
  kvq::CacheConfig config;
  try {
    config = kvq::parse_cache_config(text);
  } catch (const kvq::Error&) {
    return 0;
  }
  if (kvq::to_string(config) != text) __builtin_trap();
  try {
    const kvq::CacheShape shape{.layers = 1, .kv_heads = 2, .head_dim = 16, .capacity = 48};
    kvq::BasicKVCache cache(shape, config);
    std::vector<float> keys(3 * 2 * 16), values(keys.size()), q(4 * 16), out(q.size());
    for (std::size_t t = 0; t + 3 <= shape.capacity; t += 3) {
      for (std::size_t i = 0; i < keys.size(); ++i) {
        keys[i] = float((t * 31 + i * 17) % 23) - 11.0f + (i % 16 == 3 ? 40.0f : 0.0f);
        values[i] = float((t * 13 + i * 7) % 19) * 0.25f - 2.0f;
      }
      cache.append(0, t, keys, values);
    }
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = float(i % 7) * 0.1f - 0.3f;
    std::vector<float> oracle(q.size());
    kvq::decode_attention(cache, 0, shape.capacity - 1, q, out, {.tier = kvq::Tier::integer});
    kvq::decode_attention(cache, 0, shape.capacity - 1, q, out, {.tier = kvq::Tier::exact});
    kvq::reference_attention(cache, 0, shape.capacity - 1, q, oracle);
    // The exact tier, on whichever kernel this CPU and compiler pick, is the oracle's attention.
    // Outputs are of order 1 and fp32 scores of keys up to about 50 can be off by about 3e-5
    // each; a broken kernel is off by far more than the bound.
    for (std::size_t i = 0; i < out.size(); ++i)
      if (!(std::abs(out[i] - oracle[i]) <= 1e-3f)) __builtin_trap();
  } catch (const kvq::Error&) {
  }
  return 0;
}
