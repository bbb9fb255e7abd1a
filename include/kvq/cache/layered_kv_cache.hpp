#pragma once
// LayeredKVCache: one configuration per layer. Layers differ in how much quantization they
// tolerate (kvq-eval --advise measures it), so a cache may keep more bits, a longer window or
// no quantization at all in the layers that need it, and fewer bits elsewhere.
//
// Each layer is a one-layer BasicKVCache of its own configuration; layers share one RoPE table,
// or with a RoPE per layer (Gemma 3 rotates its local and global layers differently) one table
// per distinct RoPE. Attention, metrics and save() take layer(l) with layer index 0, exactly as
// they take a KVCache: a layer's bytes, and so its attention, are those of a KVCache of that
// configuration and RoPE that received the same tokens.
//
// Per-layer configuration text (parse_layer_configs / to_string): the layers' configuration
// strings in layer order, separated by ';', a run of equal layers written once as "<config>*<n>":
//   "k8c32-v4t32-r32-s4;k4c32-v2t32-r32-s4*14;k16-v16-r0-s0"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/cache/cache_config.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/cache/memory.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/error.hpp"
#include "kvq/rope/rope.hpp"

namespace kvq::inline v0 {

namespace detail {
/// `message` from a cache holding some of a model's layers, each "layer <i>" in it written as
/// "layer <layers[i]>"; `renamed` says whether any was.
inline std::string rename_layers(const std::string& message, std::span<const std::size_t> layers,
                                 bool* renamed = nullptr) {
  constexpr std::string_view word = "layer ";
  std::string out;
  std::size_t i = 0;
  for (std::size_t at; (at = message.find(word, i)) != std::string::npos;) {
    const std::size_t digits = at + word.size();
    std::size_t end = digits, n = 0;
    while (end < message.size() && message[end] >= '0' && message[end] <= '9' && n <= layers.size())
      n = n * 10 + std::size_t(message[end++] - '0');
    out.append(message, i, digits - i);
    const bool known =
        end > digits && n < layers.size() && (end == message.size() || message[end] < '0' || message[end] > '9');
    if (known)
      out += std::to_string(layers[n]);
    else
      out.append(message, digits, end - digits);
    if (known && renamed != nullptr) *renamed = true;
    i = end;
  }
  return out + message.substr(i);
}

/// `shape` with `rope` in place of its RoPE fields: a layer's own RoPE (LayeredKVCache, KVPool),
/// which must be for the shape's head_dim at position offset 0 (`who` and `layer` name it).
inline CacheShape with_rope(CacheShape shape, const RopeConfig& rope, const std::string& who, std::size_t layer) {
  if (rope.head_dim != shape.head_dim || rope.position_offset != 0)
    throw Error(ErrorCode::shape_mismatch, who + ": layer " + std::to_string(layer) + "'s RoPE is for head_dim " +
                                               std::to_string(rope.head_dim) + " at offset " +
                                               std::to_string(rope.position_offset) + ", not the shape's head_dim " +
                                               std::to_string(shape.head_dim) + " at offset 0");
  shape.rope_style = rope.style;
  shape.rope_theta = rope.theta;
  shape.rope_dims = rope.rotary_dims;
  shape.rope_scaling = rope.scaling;
  return shape;
}

/// The table of `rope` for `positions` among `tables`, made and added when none is: layers of
/// one RoPE share a table.
inline std::shared_ptr<const RopeTable> shared_table(std::vector<std::shared_ptr<const RopeTable>>& tables,
                                                     const RopeConfig& rope, std::size_t positions) {
  for (const auto& t : tables)
    if (same_rotation(t->config(), rope)) return t;
  return tables.emplace_back(std::make_shared<const RopeTable>(rope, positions));
}
/// Most layers a model's configuration text names and a LayeredKVCache holds: far beyond any model.
inline constexpr std::size_t max_layers = 4096;
}  // namespace detail

/// "a;b*3;c" -> {a, b, b, b, c}. Throws kvq::Error (invalid_argument) naming the item that is
/// wrong, or the count when `layers` is given (non-zero) and the text names another number.
inline std::vector<CacheConfig> parse_layer_configs(std::string_view text, std::size_t layers = 0) {
  const std::string original(text);
  auto fail = [&](const std::string& why) {
    throw Error(ErrorCode::invalid_argument, "per-layer configuration '" + original + "': " + why +
                                                 " (expected e.g. k8c32-v4t32-r32-s0;k4c32-v2t32-r32-s0*3)");
  };
  constexpr std::size_t max_repeat = detail::max_layers;
  std::vector<CacheConfig> configs;
  std::size_t item = 0;
  while (true) {
    ++item;
    const std::size_t end = text.find(';');
    std::string_view part = text.substr(0, end);
    std::size_t repeat = 1;
    if (const std::size_t star = part.find('*'); star != std::string_view::npos) {
      const std::string_view count = part.substr(star + 1);
      repeat = 0;
      for (const char c : count) {
        if (c < '0' || c > '9' || repeat > max_repeat)
          fail("item " + std::to_string(item) + ": '*' needs a count in plain digits");
        repeat = repeat * 10 + std::size_t(c - '0');
      }
      if (count.empty() || count.front() == '0' || repeat > max_repeat)
        fail("item " + std::to_string(item) + ": '*' needs a count from 1 to " + std::to_string(max_repeat));
      part = part.substr(0, star);
    }
    if (part.empty()) fail("item " + std::to_string(item) + " is empty");
    CacheConfig config;
    try {
      config = parse_cache_config(part);
    } catch (const Error& e) {
      fail("item " + std::to_string(item) + ": " + e.message());
    }
    if (configs.size() + repeat > max_repeat) fail("more than " + std::to_string(max_repeat) + " layers");
    configs.insert(configs.end(), repeat, config);
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  if (layers != 0 && configs.size() != layers)
    fail("names " + std::to_string(configs.size()) + " layers; the model has " + std::to_string(layers));
  return configs;
}

/// The text parse_layer_configs reads back as `configs`, runs of equal layers joined.
inline std::string to_string(std::span<const CacheConfig> configs) {
  std::string s;
  for (std::size_t i = 0; i < configs.size();) {
    std::size_t run = 1;
    while (i + run < configs.size() && configs[i + run] == configs[i]) ++run;
    if (!s.empty()) s += ';';
    s += to_string(configs[i]);
    if (run > 1) s += '*' + std::to_string(run);
    i += run;
  }
  return s;
}

class LayeredKVCache {
 public:
  /// Most layers a layered cache holds, as parse_layer_configs reads.
  static constexpr std::size_t max_layers = detail::max_layers;

  /// configs: one per layer of `shape` (shape.layers of them), every layer rotated by the
  /// shape's RoPE. Validates every layer's configuration against the shape before anything is
  /// allocated.
  LayeredKVCache(const CacheShape& shape, const std::vector<CacheConfig>& configs)
      : LayeredKVCache(shape, configs, std::vector<RopeConfig>(std::min(shape.layers, configs.size()), shape.rope())) {}

  /// As above with each layer's own RoPE, `ropes` (one per layer, for the shape's head_dim and
  /// position_offset 0), in place of the shape's: Gemma 3 rotates its sliding-window layers with
  /// theta 10,000 and its global layers with theta 1,000,000 and linear scaling 8. A layer
  /// without RoPE (Llama 4's NoPE layers) takes {.head_dim = d, .style = RopeStyle::none} and a
  /// post-RoPE configuration: its keys and queries are used as given, and erase() shifts it with
  /// the others. layer(l).shape() carries layer l's RoPE; layers of equal RoPE share a table.
  LayeredKVCache(const CacheShape& shape, const std::vector<CacheConfig>& configs, std::span<const RopeConfig> ropes)
      : shape_(shape) {
    if (configs.size() != shape.layers)
      throw Error(ErrorCode::shape_mismatch, "layered cache: " + std::to_string(configs.size()) +
                                                 " configurations for " + std::to_string(shape.layers) + " layers");
    if (ropes.size() != shape.layers)
      throw Error(ErrorCode::shape_mismatch, "layered cache: " + std::to_string(ropes.size()) +
                                                 " RoPE configurations for " + std::to_string(shape.layers) +
                                                 " layers");
    if (configs.empty()) throw Error(ErrorCode::invalid_argument, "layered cache: the shape needs at least one layer");
    (void)checked_layers(shape.layers);
    std::vector<CacheShape> shapes;
    for (std::size_t l = 0; l < configs.size(); ++l) {
      CacheShape& one = shapes.emplace_back(detail::with_rope(shape, ropes[l], "layered cache", l));
      one.layers = 1;
      try {
        validate(one, configs[l]);
      } catch (const Error& e) {
        throw Error(e.code(), relabel(e.message(), l));
      }
    }
    std::vector<std::shared_ptr<const RopeTable>> tables;
    layers_.reserve(configs.size());
    for (std::size_t l = 0; l < configs.size(); ++l)
      layers_.emplace_back(shapes[l], configs[l], nullptr,
                           detail::shared_table(tables, shapes[l].rope(), shape.capacity));
  }

  /// Every layer with the same configuration.
  LayeredKVCache(const CacheShape& shape, const CacheConfig& config)
      : LayeredKVCache(shape, std::vector<CacheConfig>(checked_layers(shape.layers), config)) {}

  /// The shape as given; with a RoPE per layer, layer(l).shape() has layer l's RoPE fields.
  const CacheShape& shape() const noexcept { return shape_; }
  std::size_t layers() const noexcept { return layers_.size(); }
  const CacheConfig& config(std::size_t layer) const { return at(layer, "config").config(); }
  std::vector<CacheConfig> configs() const {
    std::vector<CacheConfig> out;
    for (const BasicKVCache& c : layers_) out.push_back(c.config());
    return out;
  }
  /// The RoPE table of every layer; kvq::Error (unsupported) when the layers rotate differently:
  /// read each layer's with rope(layer) then.
  const RopeTable& rope() const {
    for (const BasicKVCache& c : layers_)
      if (&c.rope() != &layers_.front().rope())
        throw Error(ErrorCode::unsupported, "layered cache rope(): the layers rotate differently; read rope(layer)");
    return layers_.front().rope();
  }
  /// Layer `layer`'s RoPE table.
  const RopeTable& rope(std::size_t layer) const { return at(layer, "rope").rope(); }

  /// Layer `layer` as a one-layer cache: attention and metrics read it with layer index 0.
  const BasicKVCache& layer(std::size_t layer) const { return at(layer, "layer"); }
  std::size_t length(std::size_t layer) const { return at(layer, "length").length(0); }

  /// BasicKVCache::append on one layer: keys pre-RoPE unless that layer's configuration says
  /// post. All-or-nothing; errors name the layer.
  void append(std::size_t layer, std::size_t position, std::span<const float> keys, std::span<const float> values) {
    BasicKVCache& c = at(layer, "append");
    try {
      c.append(0, position, keys, values);
    } catch (const Error& e) {
      throw Error(e.code(), relabel(e.message(), layer));
    }
  }

  /// BasicKVCache::truncate in every layer. Checked in every layer before any changes: when
  /// one layer cannot reach `length` exactly, its kvq::Error names it and nothing changes.
  void truncate(std::size_t length) {
    for (std::size_t l = 0; l < layers_.size(); ++l)
      if (const auto e = layers_[l].truncate_error(length)) throw Error(e->code(), relabel(e->message(), l));
    for (BasicKVCache& c : layers_) c.truncate(length);  // checked above; no block is shared
  }

  /// BasicKVCache::erase in every layer (context shift), checked in every layer first as truncate.
  void erase(std::size_t first, std::size_t count) {
    for (std::size_t l = 0; l < layers_.size(); ++l)
      if (const auto e = layers_[l].erase_error(first, count)) throw Error(e->code(), relabel(e->message(), l));
    if (count == 0) return;
    // Every layer's staging before the first change, so a refused allocation leaves none shifted.
    std::vector<std::vector<std::uint8_t>> staged;
    checked_resize(staged, layers_.size(), "erase's staging");
    for (std::size_t l = 0; l < layers_.size(); ++l)
      checked_resize(staged[l], layers_[l].erase_staging_bytes(first, count), "erase's staging");
    for (BasicKVCache& c : layers_) c.prepare_erase(first, count);  // checked above; no block is shared
    for (std::size_t l = 0; l < layers_.size(); ++l) layers_[l].erase_prepared(first, count, staged[l].data());
  }

  /// Bytes held, summed over the layers.
  MemoryUsage memory() const noexcept {
    MemoryUsage total;
    for (const BasicKVCache& c : layers_) total += c.memory();
    return total;
  }

 private:
  /// `layers`, or kvq::Error (invalid_argument) above max_layers: before anything is sized by it.
  static std::size_t checked_layers(std::size_t layers) {
    if (layers > max_layers)
      throw Error(ErrorCode::invalid_argument,
                  "layered cache: " + std::to_string(layers) + " layers (at most " + std::to_string(max_layers) + ")");
    return layers;
  }

  /// A one-layer cache's message names its layer 0: name the layer it is here.
  static std::string relabel(const std::string& message, std::size_t layer) {
    bool renamed = false;
    const std::size_t here[] = {layer};
    std::string out = detail::rename_layers(message, here, &renamed);
    return renamed ? out : "layer " + std::to_string(layer) + ": " + message;
  }

  BasicKVCache& at(std::size_t layer, const char* operation) {
    return const_cast<BasicKVCache&>(std::as_const(*this).at(layer, operation));
  }
  const BasicKVCache& at(std::size_t layer, const char* operation) const {
    if (layer >= layers_.size())
      throw Error(ErrorCode::invalid_argument, std::string("layered cache ") + operation + ": layer " +
                                                   std::to_string(layer) + " of " + std::to_string(layers_.size()));
    return layers_[layer];
  }

  CacheShape shape_;
  std::vector<BasicKVCache> layers_;
};

}  // namespace kvq::inline v0
