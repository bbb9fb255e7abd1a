#pragma once
// CacheBackend: plugs a kvq cache into the Llama engine. This is the integration an engine
// author writes: hand the cache pre-RoPE keys (or rotate first for a post-RoPE cache), and ask
// attention for each new position, or for a prompt chunk whose own keys and values are attended
// exactly before they are stored.

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/kvq.hpp"
#include "llama/model.hpp"

namespace kvq::eval {

/// Which attention routines read the cache: `decode` for one stored position, `chunk` for a
/// prompt chunk of new positions (queries (T, heads, d) and the chunk's keys and values
/// (T, kv_heads, d), attended exactly and causally, not stored yet). Queries and new keys follow
/// the cache's key_rope.
struct AttentionFn {
  std::function<void(const BasicKVCache&, std::size_t layer, std::size_t position, std::span<const float> q,
                     std::span<float> out)>
      decode;
  std::function<void(const BasicKVCache&, std::size_t layer, std::size_t first_position, std::size_t tokens,
                     std::span<const float> q, std::span<const float> new_keys, std::span<const float> new_values,
                     std::span<float> out)>
      chunk;
};

inline AttentionFn reference_attention_fn() {
  return {[](const BasicKVCache& c, std::size_t layer, std::size_t position, std::span<const float> q,
             std::span<float> out) { reference_attention(c, layer, position, q, out); },
          [](const BasicKVCache& c, std::size_t layer, std::size_t first_position, std::size_t tokens,
             std::span<const float> q, std::span<const float> new_keys, std::span<const float> new_values,
             std::span<float> out) {
            reference_prefill_attention(c, layer, first_position, tokens, q, new_keys, new_values, out);
          }};
}

/// decode_attention over the packed cache for one position, kvq::attend for a chunk, in the
/// given accuracy tier.
inline AttentionFn decode_attention_fn(Tier tier) {
  DecodeOptions options;
  options.tier = tier;
  return {[options](const BasicKVCache& c, std::size_t layer, std::size_t position, std::span<const float> q,
                    std::span<float> out) { decode_attention(c, layer, position, q, out, options); },
          [options](const BasicKVCache& c, std::size_t layer, std::size_t first_position, std::size_t tokens,
                    std::span<const float> q, std::span<const float> new_keys, std::span<const float> new_values,
                    std::span<float> out) {
            attend(AttentionRequest{.cache = &c,
                                    .layer = layer,
                                    .first_position = first_position,
                                    .tokens = tokens,
                                    .queries = q,
                                    .new_keys = new_keys,
                                    .new_values = new_values,
                                    .out = out},
                   options);
          }};
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

/// A kvq cache in the engine, one configuration per layer (LayeredKVCache): each layer is
/// read by the attention routines as a one-layer cache.
class CacheBackend {
 public:
  CacheBackend(const llama::Model& model, std::vector<CacheConfig> configs, std::size_t capacity,
               AttentionFn attention = reference_attention_fn())
      : cache_(cache_shape(model, capacity), std::move(configs)),
        attention_(std::move(attention)),
        q_(model.config().q_dim()),
        k_(model.config().kv_dim()) {}
  CacheBackend(const llama::Model& model, const CacheConfig& config, std::size_t capacity,
               AttentionFn attention = reference_attention_fn())
      : CacheBackend(model, std::vector<CacheConfig>(model.config().layers, config), capacity, std::move(attention)) {}

  void append(std::size_t layer, std::size_t position, std::span<const float> k, std::span<const float> v) {
    if (pre_rope(layer)) return cache_.append(layer, position, k, v);
    k_.assign(k.begin(), k.end());  // a post-RoPE cache receives rotated keys
    cache_.rope(layer).rotate_heads(k_, position);
    cache_.append(layer, position, k_, v);
  }

  void attend(std::size_t layer, std::size_t position, std::span<const float> q, std::span<float> out) {
    const BasicKVCache& one = cache_.layer(layer);
    if (pre_rope(layer)) return attention_.decode(one, 0, position, q, out);
    q_.assign(q.begin(), q.end());
    cache_.rope(layer).rotate_heads(q_, position);
    attention_.decode(one, 0, position, q_, out);
  }

  /// A prompt chunk: its keys and values attended exactly, then appended by the model. A
  /// post-RoPE cache receives the chunk's queries and keys rotated, as it receives stored keys.
  void attend_chunk(std::size_t layer, std::size_t first_position, std::size_t tokens, std::span<const float> q,
                    std::span<const float> k, std::span<const float> v, std::span<float> out) {
    if (first_position != cache_.length(layer))
      throw Error(ErrorCode::out_of_order, "layer " + std::to_string(layer) + ": a chunk at position " +
                                               std::to_string(first_position) + ", the cache holds " +
                                               std::to_string(cache_.length(layer)));
    const BasicKVCache& one = cache_.layer(layer);
    if (pre_rope(layer)) return attention_.chunk(one, 0, first_position, tokens, q, k, v, out);
    const std::size_t q_dim = q_.size(), kv_dim = k_.size();
    if (tokens == 0 || q.size() != tokens * q_dim || k.size() != tokens * kv_dim)
      throw Error(ErrorCode::shape_mismatch,
                  "layer " + std::to_string(layer) + ": a chunk of " + std::to_string(tokens) + " tokens with q of " +
                      std::to_string(q.size()) + " and k of " + std::to_string(k.size()) + " values");
    chunk_q_.assign(q.begin(), q.end());
    chunk_k_.assign(k.begin(), k.end());
    for (std::size_t t = 0; t < tokens; ++t) {
      cache_.rope(layer).rotate_heads(std::span<float>(chunk_q_).subspan(t * q_dim, q_dim), first_position + t);
      cache_.rope(layer).rotate_heads(std::span<float>(chunk_k_).subspan(t * kv_dim, kv_dim), first_position + t);
    }
    attention_.chunk(one, 0, first_position, tokens, chunk_q_, chunk_k_, v, out);
  }

  const LayeredKVCache& cache() const noexcept { return cache_; }

 private:
  bool pre_rope(std::size_t layer) const { return cache_.config(layer).key_rope == KeyRope::pre; }

  LayeredKVCache cache_;
  AttentionFn attention_;
  std::vector<float> q_, k_;              // one position's query and key (post-RoPE rotation)
  std::vector<float> chunk_q_, chunk_k_;  // a chunk's
};
static_assert(llama::ChunkedKVBackend<CacheBackend>);

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
  void attend_chunk(std::size_t layer, std::size_t first_position, std::size_t tokens, std::span<const float> q,
                    std::span<const float> k, std::span<const float> v, std::span<float> out) {
    inner_.attend_chunk(layer, first_position, tokens, q, k, v, out);  // k and v are recorded as the model appends them
    q_[layer].insert(q_[layer].end(), q.begin(), q.end());
  }

  const std::vector<float>& queries(std::size_t layer) const { return q_[layer]; }  // (T, heads, d)
  const std::vector<float>& keys(std::size_t layer) const { return k_[layer]; }     // (T, kv_heads, d)
  const std::vector<float>& values(std::size_t layer) const { return v_[layer]; }   // (T, kv_heads, d)

 private:
  Inner inner_;
  std::vector<std::vector<float>> q_, k_, v_;
};

}  // namespace kvq::eval
