#pragma once
// CacheBackend: plugs a kvq cache into the Llama engine. This is the integration an engine
// author writes: hand the cache pre-RoPE keys (or rotate first for a post-RoPE cache), and ask
// attention for each new position.

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/kvq.hpp"
#include "llama/model.hpp"

namespace kvq::eval {

/// Which attention routine reads the cache.
using AttentionFn = std::function<void(const BasicKVCache&, std::size_t layer, std::size_t position,
                                       std::span<const float> q, std::span<float> out)>;

inline AttentionFn reference_attention_fn() {
  return [](const BasicKVCache& c, std::size_t layer, std::size_t position, std::span<const float> q,
            std::span<float> out) { reference_attention(c, layer, position, q, out); };
}

/// decode_attention over the packed cache, in the given accuracy tier.
inline AttentionFn decode_attention_fn(Tier tier) {
  return [tier](const BasicKVCache& c, std::size_t layer, std::size_t position, std::span<const float> q,
                std::span<float> out) {
    DecodeOptions options;
    options.tier = tier;
    decode_attention(c, layer, position, q, out, options);
  };
}

/// "reference", "exact" or "integer".
inline AttentionFn attention_fn(std::string_view name) {
  if (name == "reference") return reference_attention_fn();
  if (name == "exact") return decode_attention_fn(Tier::exact);
  if (name == "integer") return decode_attention_fn(Tier::integer);
  throw Error(ErrorCode::invalid_argument,
              "unknown attention '" + std::string(name) + "': expected reference, exact or integer");
}

inline CacheShape cache_shape(const llama::Model& model, std::size_t capacity) {
  const llama::LlamaConfig& m = model.config();
  const RopeConfig rope = model.rope_config();
  return CacheShape{m.layers, m.kv_heads, m.head_dim, capacity, rope.style, rope.theta, rope.rotary_dims, rope.scaling};
}

class CacheBackend {
 public:
  CacheBackend(const llama::Model& model, const CacheConfig& config, std::size_t capacity,
               AttentionFn attention = reference_attention_fn())
      : cache_(cache_shape(model, capacity), config), attention_(std::move(attention)),
        q_(model.config().q_dim()), k_(model.config().kv_dim()) {}

  void append(std::size_t layer, std::size_t position, std::span<const float> k, std::span<const float> v) {
    if (cache_.config().key_rope == KeyRope::pre) return cache_.append(layer, position, k, v);
    k_.assign(k.begin(), k.end());  // a post-RoPE cache receives rotated keys
    cache_.rope().rotate_heads(k_, position);
    cache_.append(layer, position, k_, v);
  }

  void attend(std::size_t layer, std::size_t position, std::span<const float> q, std::span<float> out) {
    if (cache_.config().key_rope == KeyRope::pre) return attention_(cache_, layer, position, q, out);
    q_.assign(q.begin(), q.end());
    cache_.rope().rotate_heads(q_, position);
    attention_(cache_, layer, position, q_, out);
  }

  const BasicKVCache& cache() const noexcept { return cache_; }

 private:
  BasicKVCache cache_;
  AttentionFn attention_;
  std::vector<float> q_, k_;
};
static_assert(llama::KVBackend<CacheBackend>);

/// Wraps a backend and records every layer's pre-RoPE q, k and v, for per-layer metrics.
template <llama::KVBackend Inner>
class RecordingBackend {
 public:
  RecordingBackend(Inner inner, std::size_t layers) : inner_(std::move(inner)), q_(layers), k_(layers), v_(layers) {}

  void append(std::size_t layer, std::size_t position, std::span<const float> k, std::span<const float> v) {
    k_[layer].insert(k_[layer].end(), k.begin(), k.end());
    v_[layer].insert(v_[layer].end(), v.begin(), v.end());
    inner_.append(layer, position, k, v);
  }
  void attend(std::size_t layer, std::size_t position, std::span<const float> q, std::span<float> out) {
    q_[layer].insert(q_[layer].end(), q.begin(), q.end());
    inner_.attend(layer, position, q, out);
  }

  const std::vector<float>& queries(std::size_t layer) const { return q_[layer]; }  // (T, heads, d)
  const std::vector<float>& keys(std::size_t layer) const { return k_[layer]; }     // (T, kv_heads, d)
  const std::vector<float>& values(std::size_t layer) const { return v_[layer]; }   // (T, kv_heads, d)

 private:
  Inner inner_;
  std::vector<std::vector<float>> q_, k_, v_;
};

}  // namespace kvq::eval
