#pragma once
// KVCache: the key/value cache of one sequence, for every layer and KV head.
//
//   new k, v (pre-RoPE) -> append -> sink rows | full-precision ring -> (group due) quantized
//   once, packed -> attention reads sinks + packed groups + ring.
//
// Every append is all-or-nothing: it validates shapes, order, capacity, finiteness and the
// representability of every parameter it will write before it changes a byte.
//
// Exact rollback: the ring keeps the full-precision rows of the newest positions, packed or
// not, and a history beside it copies each row as it is packed, for the last D + G packed
// positions (D = CacheConfig::rollback_depth; D + 1 for values per token). truncate() restores
// the ring a shorter cache would have and re-opens the quantized groups and tokens it would not
// have packed yet, so a cache cut by up to D tokens holds exactly the bytes of one that never
// saw the dropped tokens. Cost: those rows per layer, KV head and tensor in the residual type,
// counted in allocated_bytes(), and one row copy per packed row; rollback_depth = 0 turns it off.
//
// Threads: const member functions (views, memory, attention) may run concurrently with each
// other. append() to different layers may run concurrently with each other and with const calls
// that read only other layers. Anything else on one cache (two appends to one layer, truncate,
// erase, clear, load) needs the caller's synchronization.

#include <algorithm>
#include <concepts>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvq/cache/cache_config.hpp"
#include "kvq/cache/memory.hpp"
#include "kvq/cache/stream_layout.hpp"
#include "kvq/cache/stream_view.hpp"
#include "kvq/core/aligned_buffer.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/core/convert.hpp"
#include "kvq/error.hpp"
#include "kvq/kernels/quantize/quantize.hpp"
#include "kvq/quant/kv_policy.hpp"
#include "kvq/rope/rope.hpp"

namespace kvq::inline v0 {

namespace detail {
struct CacheAccess;  // serialize.hpp: reads and restores the state behind the public view
}

enum class Tensor : unsigned char { keys, values };

constexpr const char* to_string(Tensor t) noexcept { return t == Tensor::keys ? "key" : "value"; }

/// Most tokens a cache holds: positions and row counts stay far from any integer's end.
inline constexpr std::size_t max_capacity = RopeTable::max_positions_limit;

/// The model-side geometry a cache is built for. Limits: head_dim <= max_head_dim, capacity <=
/// max_capacity, and the storage of layers x kv_heads x capacity must fit a size_t (checked).
struct CacheShape {
  std::size_t layers = 1;
  std::size_t kv_heads = 1;
  std::size_t head_dim = 128;
  std::size_t capacity = 4096;  // tokens
  RopeStyle rope_style = RopeStyle::adjacent_pairs;
  float rope_theta = 10000.0f;
  std::size_t rope_dims = 0;  // channels RoPE rotates from the start of each head; 0 = head_dim
  RopeScaling rope_scaling{};

  RopeConfig rope() const { return RopeConfig{head_dim, rope_style, rope_theta, rope_dims, 0, rope_scaling}; }
};

/// Throws kvq::Error naming the field unless a cache of this shape and configuration can exist.
inline void validate(const CacheShape& shape, const CacheConfig& config) {
  if (shape.layers == 0 || shape.kv_heads == 0 || shape.capacity == 0)
    throw Error(ErrorCode::invalid_argument, "cache shape needs at least one layer, KV head and token of capacity");
  if (shape.head_dim == 0 || shape.head_dim > max_head_dim)
    throw Error(ErrorCode::invalid_argument, "cache shape: head_dim must be in 1.." + std::to_string(max_head_dim) +
                                                 ", got " + std::to_string(shape.head_dim));
  check_limit(shape.capacity, max_capacity, "cache shape: capacity");
  if (shape.rope_style != RopeStyle::adjacent_pairs && shape.rope_style != RopeStyle::half_split)
    throw Error(ErrorCode::invalid_argument,
                "cache shape: rope_style " + std::to_string(int(shape.rope_style)) + " is not a RopeStyle");
  validate(shape.rope());
  validate(config);
  if (config.quantize_keys) validate(config.key, shape.head_dim, "key quantizer");
  if (config.quantize_values) validate(config.value, shape.head_dim, "value quantizer");
}

class BasicKVCache {
 public:
  BasicKVCache(const CacheShape& shape, const CacheConfig& config) : shape_(shape), config_(config) {
    validate(shape, config);
    layouts_[0] = StreamLayout(config.key, config.quantize_keys, shape.head_dim, config, shape.capacity);
    layouts_[1] = StreamLayout(config.value, config.quantize_values, shape.head_dim, config, shape.capacity);
    // Each stream is below 2^47 bytes (capacity and head_dim limits); the products over layers
    // and heads are what can wrap.
    head_bytes_ = layouts_[0].bytes + layouts_[1].bytes;
    const std::size_t streams = checked_mul(shape.layers, shape.kv_heads, "cache shape: layers x kv_heads");
    storage_ = AlignedBuffer(checked_mul(head_bytes_, streams, "cache storage bytes"));
    head_history_bytes_ = layouts_[0].history_rows * row_size(layouts_[0]) + layouts_[1].history_rows * row_size(layouts_[1]);
    history_ = AlignedBuffer(checked_mul(head_history_bytes_, streams, "cache rollback history bytes"));
    rope_ = RopeTable(shape.rope(), shape.capacity);
    lengths_.assign(shape.layers, 0);
    key_peaks_.assign(shape.layers, 0.0f);
    quantized_ends_.resize(shape.layers * 2);
    history_begins_.resize(shape.layers * 2);
    kept_from_.resize(shape.layers * 2);
    for (std::size_t i = 0; i < quantized_ends_.size(); ++i)
      quantized_ends_[i] = history_begins_[i] = kept_from_[i] = layouts_[i % 2].sinks;
    // Scratch holds one due per-channel group per layer (appends to different layers may run
    // concurrently); a group longer than the stream never comes due.
    auto due_rows = [&](const StreamLayout& lay) {
      return lay.quantized && lay.spec.axis == Axis::per_channel ? std::min(lay.spec.group, lay.ring_rows) : 1;
    };
    scratch_.resize(std::max(due_rows(layouts_[0]), due_rows(layouts_[1])) * shape.head_dim * shape.layers);
  }

  const CacheShape& shape() const noexcept { return shape_; }
  const CacheConfig& config() const noexcept { return config_; }
  const StreamLayout& layout(Tensor t) const noexcept { return layouts_[index(t)]; }
  const RopeTable& rope() const noexcept { return rope_; }
  std::size_t length(std::size_t layer) const { return lengths_.at(layer); }
  std::size_t capacity() const noexcept { return shape_.capacity; }

  /// Appends T tokens to one layer. keys, values: (T, kv_heads, head_dim), keys pre-RoPE when
  /// config().key_rope is pre and already rotated when it is post; `position` must equal
  /// length(layer). Throws kvq::Error and leaves the cache unchanged on any bad input.
  void append(std::size_t layer, std::size_t position, std::span<const float> keys, std::span<const float> values) {
    const std::size_t tokens = check_append(layer, position, keys, values);
    key_peaks_[layer] = std::max(key_peaks_[layer], largest_magnitude(keys.data(), keys.size()));
    for (std::size_t t = 0; t < tokens; ++t) {
      const std::size_t p = position + t;
      for (std::size_t h = 0; h < shape_.kv_heads; ++h) {
        const std::size_t offset = (t * shape_.kv_heads + h) * shape_.head_dim;
        write_row(Tensor::keys, layer, h, p, keys.data() + offset);
        write_row(Tensor::values, layer, h, p, values.data() + offset);
      }
      quantize_due(Tensor::keys, layer, p + 1);
      quantize_due(Tensor::values, layer, p + 1);
      raise_floor(Tensor::keys, layer, p + 1);
      raise_floor(Tensor::values, layer, p + 1);
      lengths_[layer] = p + 1;
    }
  }

  /// The same checks as append, without changing anything: an engine can ask first and fall back.
  bool can_append(std::size_t layer, std::size_t position, std::span<const float> keys, std::span<const float> values,
                  std::string* why = nullptr) const {
    try {
      (void)check_append(layer, position, keys, values);
      return true;
    } catch (const Error& e) {
      if (why != nullptr) *why = e.what();
      return false;
    }
  }

  /// Drops tokens from `length` on in every layer (a no-op for layers holding no more), e.g. to
  /// roll back rejected speculative tokens. Quantized groups and tokens that a cache of `length`
  /// tokens would not have quantized yet are re-opened from their full-precision rows, and tokens
  /// appended next may differ from the dropped ones. A cut to at least (longest length the layer
  /// has held since it was cleared or shifted by erase()) - config().rollback_depth always works
  /// and leaves the cache byte for byte equal to one that received only the kept tokens. A deeper
  /// cut works while the rows it re-opens are still held (rollback_floor()): views and attention
  /// are then exact, but ring slots whose old rows are gone stay zero. Otherwise throws
  /// kvq::Error (unsupported) and changes nothing.
  void truncate(std::size_t length) {
    check_truncate(length);
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      if (length >= lengths_[l]) continue;
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const StreamLayout& lay = layouts_[index(t)];
        const std::size_t target = std::min(quantized_end(t, l), lay.quantized_end(length));
        for (std::size_t h = 0; h < shape_.kv_heads; ++h) cut_stream(t, l, h, length, target);
        quantized_ends_[l * 2 + index(t)] = target;
        std::size_t& floor = history_begins_[l * 2 + index(t)];
        floor = std::min(floor, std::max(lay.sinks, length));
        std::size_t& kept = kept_from_[l * 2 + index(t)];
        kept = std::min(kept, target);
      }
      lengths_[l] = length;
    }
  }

  /// Context shift: drops positions [first, first + count) from every layer and moves the later
  /// tokens down by count, e.g. to keep the sinks and the recent past when a conversation outgrows
  /// the capacity. Moved keys must be stored pre-RoPE (KeyRope::pre): their bytes do not depend on
  /// the position, and attention rotates them at the new one, so nothing is re-quantized. Packed
  /// groups move whole: in a stream quantized per channel (group G), a range that reaches into the
  /// quantized positions must start at sinks + a multiple of G, and one that moves quantized
  /// groups must span a multiple of G. Positions quantized before the shift stay quantized.
  /// Throws kvq::Error and leaves the cache unchanged when the range or the layout forbids it.
  void erase(std::size_t first, std::size_t count) {
    if (count == 0) return;
    check_erase(first, count);
    // Pending rows that move are staged here: allocated before anything changes.
    std::vector<std::uint8_t> staged(std::max(layouts_[0].ring_rows * row_size(layouts_[0]),
                                              layouts_[1].ring_rows * row_size(layouts_[1])));
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        std::size_t& end = quantized_ends_[l * 2 + index(t)];
        const std::size_t new_end = end <= first ? end : end <= first + count ? first : end - count;
        for (std::size_t h = 0; h < shape_.kv_heads; ++h) move_down(t, l, h, first, count, end, new_end, staged.data());
        // The history is by position, which the shift changed: rollback starts afresh from here.
        end = history_begins_[l * 2 + index(t)] = kept_from_[l * 2 + index(t)] = new_end;
      }
      lengths_[l] -= count;
    }
  }

  /// Empties every layer; zeroes only the bytes in use, so it costs what the cache holds.
  void clear() noexcept {
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const std::size_t sinks = layouts_[index(t)].sinks;
        for (std::size_t h = 0; h < shape_.kv_heads; ++h) cut_stream(t, l, h, 0, sinks);
        quantized_ends_[l * 2 + index(t)] = history_begins_[l * 2 + index(t)] = kept_from_[l * 2 + index(t)] = sinks;
      }
      lengths_[l] = 0;
    }
    std::fill(key_peaks_.begin(), key_peaks_.end(), 0.0f);
  }

  /// The largest |key| appended to `layer` since the cache was built or cleared (an upper bound
  /// after truncate and erase). Attention uses it to refuse queries whose scores could overflow.
  float key_peak(std::size_t layer) const { return key_peaks_.at(layer); }

  /// First position of `layer` that `t` holds unquantized (= sinks while nothing is quantized).
  std::size_t quantized_end(Tensor t, std::size_t layer) const { return quantized_ends_.at(layer * 2 + index(t)); }
  /// First position of `layer` whose full-precision `t` row the cache still holds (in the ring or
  /// the rollback history): truncate(length) fails only where it would re-open positions before it.
  std::size_t rollback_floor(Tensor t, std::size_t layer) const { return history_begins_.at(layer * 2 + index(t)); }

  StreamView view(Tensor t, std::size_t layer, std::size_t head) const {
    if (layer >= shape_.layers || head >= shape_.kv_heads)
      throw Error(ErrorCode::invalid_argument, "layer " + std::to_string(layer) + ", kv head " + std::to_string(head) +
                                                   " is outside the cache's " + std::to_string(shape_.layers) +
                                                   " layers and " + std::to_string(shape_.kv_heads) + " KV heads");
    const StreamLayout& lay = layouts_[index(t)];
    const std::uint8_t* base = stream_base(t, layer, head);
    StreamView v;
    v.spec = lay.spec;
    v.quantized = lay.quantized;
    v.head_dim = lay.head_dim;
    v.residual = lay.residual;
    v.length = lengths_[layer];
    v.sinks_stored = std::min(lay.sinks, v.length);
    v.sinks = base + lay.sink_offset;
    v.first_quantized = lay.sinks;
    v.end_quantized = quantized_end(t, layer);
    v.codes = base + lay.code_offset;
    v.row_bytes = lay.row_bytes;
    v.scales = base + lay.scale_offset;
    v.zeros = lay.spec.has_zero_point() ? base + lay.zero_offset : nullptr;
    v.ring = base + lay.ring_offset;
    v.ring_rows = lay.ring_rows;
    return v;
  }
  StreamView keys(std::size_t layer, std::size_t head) const { return view(Tensor::keys, layer, head); }
  StreamView values(std::size_t layer, std::size_t head) const { return view(Tensor::values, layer, head); }

  /// What the cache holds now (all layers).
  MemoryUsage memory() const noexcept {
    MemoryUsage total;
    for (std::size_t l = 0; l < shape_.layers; ++l)
      total += layer_usage(lengths_[l], quantized_end(Tensor::keys, l), quantized_end(Tensor::values, l));
    return total;
  }
  /// What the cache would hold with `length` tokens in every layer.
  MemoryUsage planned_memory(std::size_t length) const noexcept {
    MemoryUsage total;
    const std::size_t k_end = layouts_[0].quantized_end(length), v_end = layouts_[1].quantized_end(length);
    for (std::size_t l = 0; l < shape_.layers; ++l) total += layer_usage(length, k_end, v_end);
    return total;
  }
  /// Every stored byte, in a layout fixed by shape and config: two caches that received the
  /// same tokens compare equal here, however the tokens arrived, and after a rollback within
  /// truncate()'s exact reach too. The rollback history lives beside it: it only decides how far
  /// truncate() can reach.
  std::span<const std::uint8_t> raw_storage() const noexcept { return {storage_.data(), storage_.size()}; }

  /// Bytes reserved up front for the whole capacity: storage, rollback history, RoPE table and
  /// quantization scratch. Appends allocate nothing beyond this.
  std::size_t allocated_bytes() const noexcept {
    return storage_.size() + history_.size() + rope_.bytes() + scratch_.size() * sizeof(float);
  }

 private:
  friend struct detail::CacheAccess;

  static constexpr std::size_t index(Tensor t) noexcept { return t == Tensor::keys ? 0 : 1; }

  MemoryUsage layer_usage(std::size_t length, std::size_t key_end, std::size_t value_end) const noexcept {
    MemoryUsage u = stream_usage(layouts_[0], length, key_end);
    u += stream_usage(layouts_[1], length, value_end);
    u.code_bytes *= shape_.kv_heads;
    u.param_bytes *= shape_.kv_heads;
    u.residual_bytes *= shape_.kv_heads;
    u.values *= shape_.kv_heads;
    return u;
  }

  const std::uint8_t* stream_base(Tensor t, std::size_t layer, std::size_t head) const noexcept {
    return storage_.data() + (layer * shape_.kv_heads + head) * head_bytes_ + (t == Tensor::keys ? 0 : layouts_[0].bytes);
  }
  std::uint8_t* stream_base(Tensor t, std::size_t layer, std::size_t head) noexcept {
    return const_cast<std::uint8_t*>(std::as_const(*this).stream_base(t, layer, head));
  }
  const std::uint8_t* ring_row(Tensor t, std::size_t layer, std::size_t head, std::size_t position) const noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    return stream_base(t, layer, head) + lay.ring_offset + (position - lay.sinks) % lay.ring_rows * row_size(lay);
  }
  std::uint8_t* ring_row(Tensor t, std::size_t layer, std::size_t head, std::size_t position) noexcept {
    return const_cast<std::uint8_t*>(std::as_const(*this).ring_row(t, layer, head, position));
  }
  /// The rollback copy of quantized `position` (history_rows > 0).
  const std::uint8_t* history_row(Tensor t, std::size_t layer, std::size_t head, std::size_t position) const noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    const std::uint8_t* base = history_.data() + (layer * shape_.kv_heads + head) * head_history_bytes_ +
                               (t == Tensor::keys ? 0 : layouts_[0].history_rows * row_size(layouts_[0]));
    return base + (position - lay.sinks) % lay.history_rows * row_size(lay);
  }
  std::uint8_t* history_row(Tensor t, std::size_t layer, std::size_t head, std::size_t position) noexcept {
    return const_cast<std::uint8_t*>(std::as_const(*this).history_row(t, layer, head, position));
  }
  /// Byte offset of the first parameter of packed row `row` (position sinks + row).
  static std::size_t param_offset(const StreamLayout& lay, std::size_t row) noexcept {
    return (lay.spec.axis == Axis::per_channel ? row / lay.spec.group * lay.head_dim
                                               : row * groups_per_row(lay.spec, lay.head_dim)) *
           size_of(lay.spec.param);
  }

  std::string where(Tensor t, std::size_t layer, std::size_t head, std::size_t position) const {
    return "layer " + std::to_string(layer) + ", kv head " + std::to_string(head) + ", position " +
           std::to_string(position) + " (" + to_string(t) + ")";
  }

  /// Validates an append completely; returns the number of tokens.
  std::size_t check_append(std::size_t layer, std::size_t position, std::span<const float> keys,
                           std::span<const float> values) const {
    if (layer >= shape_.layers)
      throw Error(ErrorCode::invalid_argument, "layer " + std::to_string(layer) + " is outside the cache's " +
                                                   std::to_string(shape_.layers) + " layers");
    const std::size_t row = shape_.kv_heads * shape_.head_dim;
    if (keys.size() % row != 0 || keys.size() != values.size())
      throw Error(ErrorCode::shape_mismatch,
                  "layer " + std::to_string(layer) + ": keys hold " + std::to_string(keys.size()) + " and values " +
                      std::to_string(values.size()) + " floats; both must be tokens x " +
                      std::to_string(shape_.kv_heads) + " kv heads x " + std::to_string(shape_.head_dim));
    const std::size_t tokens = keys.size() / row;
    if (position != lengths_[layer])
      throw Error(ErrorCode::out_of_order, "layer " + std::to_string(layer) + ": appending at position " +
                                               std::to_string(position) + " but the layer holds " +
                                               std::to_string(lengths_[layer]) + " tokens");
    if (tokens > shape_.capacity - lengths_[layer])
      throw Error(ErrorCode::capacity_exceeded, "layer " + std::to_string(layer) + ": appending " +
                                                    std::to_string(tokens) + " tokens to " +
                                                    std::to_string(lengths_[layer]) + " exceeds the capacity of " +
                                                    std::to_string(shape_.capacity));
    const float limit = overflow_threshold(config_.residual);
    for (const Tensor t : {Tensor::keys, Tensor::values}) {
      const std::span<const float> data = t == Tensor::keys ? keys : values;
      if (!all_below(data.data(), data.size(), limit)) {
        for (std::size_t i = 0; i < data.size(); ++i) {
          const float x = data[i];
          if (std::fabs(x) < limit) continue;
          const std::size_t token = i / row, head = i % row / shape_.head_dim, channel = i % shape_.head_dim;
          throw Error(std::isfinite(x) ? ErrorCode::unrepresentable : ErrorCode::non_finite_input,
                      where(t, layer, head, position + token) + ", channel " + std::to_string(channel) + ": value " +
                          std::to_string(x) +
                          (std::isfinite(x) ? std::string(" exceeds the range of the residual type ") + to_string(config_.residual)
                                            : std::string(" is not finite")));
        }
      }
      check_groups(t, layer, position, tokens, data);
    }
    return tokens;
  }

  /// Every group the append will quantize must have representable parameters.
  void check_groups(Tensor t, std::size_t layer, std::size_t position, std::size_t tokens, std::span<const float> input) const {
    const StreamLayout& lay = layouts_[index(t)];
    const std::size_t begin = quantized_end(t, layer), end = std::max(begin, lay.quantized_end(position + tokens));
    if (begin == end) return;
    const QuantizerSpec& spec = lay.spec;
    // Every value reaching a group is stored in the residual type first, so a group spanning
    // that type's whole range bounds them all (true for f16 storage with 2+ bit f16 params).
    const float most = max_finite(lay.residual);
    if (kernels::reference::representable(kernels::reference::make_params(spec, -most, most))) return;
    const std::size_t dim = shape_.head_dim;
    float row[max_head_dim], scratch[max_head_dim];
    for (std::size_t h = 0; h < shape_.kv_heads; ++h) {
      const StreamView stored = view(t, layer, h);
      auto load = [&](std::size_t p) {  // the row as it will sit in the ring
        if (p < position) return stored.read_row(p, row);
        store_row(lay.residual, input.data() + ((p - position) * shape_.kv_heads + h) * dim, dim, scratch);
        load_row(lay.residual, scratch, dim, row);
      };
      auto check = [&](float lo, float hi, std::size_t p, std::size_t channel) {
        if (kernels::reference::representable(kernels::reference::make_params(spec, lo, hi))) return;
        throw Error(ErrorCode::unrepresentable,
                    where(t, layer, h, p) + ", channel " + std::to_string(channel) + ": the group spanning [" +
                        std::to_string(lo) + ", " + std::to_string(hi) + "] needs a scale or zero point beyond " +
                        to_string(spec.param) + "'s range of " + std::to_string(max_finite(spec.param)));
      };
      if (spec.axis == Axis::per_token) {
        for (std::size_t p = begin; p < end; ++p) {
          load(p);
          for (std::size_t c0 = 0; c0 < dim; c0 += spec.group) {
            const auto [lo, hi] = std::minmax_element(row + c0, row + std::min(dim, c0 + spec.group));
            check(*lo, *hi, p, c0);
          }
        }
        continue;
      }
      float lo[max_head_dim], hi[max_head_dim];
      for (std::size_t g = begin; g < end; g += spec.group) {
        for (std::size_t p = g; p < g + spec.group; ++p) {
          load(p);
          for (std::size_t c = 0; c < dim; ++c) {
            lo[c] = p == g ? row[c] : std::min(lo[c], row[c]);
            hi[c] = p == g ? row[c] : std::max(hi[c], row[c]);
          }
        }
        for (std::size_t c = 0; c < dim; ++c) check(lo[c], hi[c], g, c);
      }
    }
  }

  static std::size_t row_size(const StreamLayout& lay) noexcept { return lay.head_dim * size_of(lay.residual); }

  /// Validates truncate(length): every position to re-open must still have its full-precision row.
  void check_truncate(std::size_t length) const {
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      if (length >= lengths_[l]) continue;
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const std::size_t end = quantized_end(t, l), target = std::min(end, layouts_[index(t)].quantized_end(length));
        const std::size_t reopen_end = std::min(end, length), floor = rollback_floor(t, l);
        if (target < reopen_end && target < floor)
          throw Error(ErrorCode::unsupported,
                      "layer " + std::to_string(l) + ": truncating from " + std::to_string(lengths_[l]) + " to " +
                          std::to_string(length) + " tokens would re-open quantized " + to_string(t) + " positions [" +
                          std::to_string(target) + ", " + std::to_string(reopen_end) +
                          "), but full-precision rows are kept only from position " + std::to_string(floor) +
                          " (rollback depth " + std::to_string(config_.rollback_depth) + ")");
      }
    }
  }

  /// truncate's commit for one stream of one head: the sink rows, ring and packed rows become
  /// what a cache of `length` tokens holds (ring rows of positions before the rollback floor,
  /// which are gone, become zero), with the packed rows [target, quantized end) re-opened.
  void cut_stream(Tensor t, std::size_t layer, std::size_t head, std::size_t length, std::size_t target) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    std::uint8_t* base = stream_base(t, layer, head);
    const std::size_t old_length = lengths_[layer], end = quantized_end(t, layer), row = row_size(lay);
    const std::size_t s = lay.sinks, ring_rows = lay.ring_rows, floor = rollback_floor(t, layer);
    if (length < s && old_length > length)
      std::memset(base + lay.sink_offset + length * row, 0, (std::min(s, old_length) - length) * row);
    // The ring of `length` tokens holds positions [first, length); those before `pushed_out`
    // left the ring for the history, and slots no position uses are zero.
    const std::size_t first = length > s + ring_rows ? length - ring_rows : s;
    const std::size_t pushed_out = old_length > s + ring_rows ? old_length - ring_rows : s;
    for (std::size_t p = first; p < std::min(length, pushed_out); ++p) {
      if (p >= floor && lay.history_rows != 0) std::memcpy(ring_row(t, layer, head, p), history_row(t, layer, head, p), row);
      else std::memset(ring_row(t, layer, head, p), 0, row);
    }
    for (std::size_t p = std::max(length, s); p < std::min(old_length, s + ring_rows); ++p)
      std::memset(ring_row(t, layer, head, p), 0, row);
    if (target >= end) return;
    const std::size_t a = target - s, b = end - s, param_bytes = param_offset(lay, b) - param_offset(lay, a);
    std::memset(base + lay.code_offset + a * lay.row_bytes, 0, (b - a) * lay.row_bytes);
    std::memset(base + lay.scale_offset + param_offset(lay, a), 0, param_bytes);
    if (lay.spec.has_zero_point()) std::memset(base + lay.zero_offset + param_offset(lay, a), 0, param_bytes);
  }

  /// Validates erase(first, count) completely.
  void check_erase(std::size_t first, std::size_t count) const {
    const std::string range = "erasing " + std::to_string(count) + " positions from " + std::to_string(first);
    if (first < config_.sinks)
      throw Error(ErrorCode::invalid_argument, range + ": the first " + std::to_string(config_.sinks) +
                                                   " positions are sink tokens and are kept");
    bool moves = false;
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      if (count > lengths_[l] || first > lengths_[l] - count)
        throw Error(ErrorCode::invalid_argument, range + ": layer " + std::to_string(l) + " holds " +
                                                     std::to_string(lengths_[l]) + " tokens");
      moves = moves || first + count < lengths_[l];
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const StreamLayout& lay = layouts_[index(t)];
        if (!lay.quantized || lay.spec.axis != Axis::per_channel) continue;
        const std::size_t end = quantized_end(t, l), g = lay.spec.group;
        if (first < end && (first - lay.sinks) % g != 0)
          throw Error(ErrorCode::unsupported, range + ": layer " + std::to_string(l) + " would split the packed " +
                                                  to_string(t) + " group starting at " +
                                                  std::to_string(first - (first - lay.sinks) % g) + " (groups of " +
                                                  std::to_string(g) + " from position " + std::to_string(lay.sinks) + ")");
        if (end > first + count && count % g != 0)
          throw Error(ErrorCode::unsupported, range + ": layer " + std::to_string(l) + " would move packed " +
                                                  to_string(t) + " groups by " + std::to_string(count) +
                                                  " positions, not a multiple of their " + std::to_string(g));
      }
    }
    if (moves && config_.key_rope == KeyRope::post)
      throw Error(ErrorCode::unsupported, range + ": keys are stored post-RoPE and would keep their old positions' "
                                                  "rotation; a cache that shifts its context stores keys pre-RoPE");
  }

  /// erase's move of one stream of one head, `end` its quantized end before the move and
  /// `new_end` after: packed rows and their parameters after the range move down by count, then
  /// the pending rows after it (through `staged`, since their ring slots may overlap). Bytes left
  /// behind become zero.
  void move_down(Tensor t, std::size_t layer, std::size_t head, std::size_t first, std::size_t count, std::size_t end,
                 std::size_t new_end, std::uint8_t* staged) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    std::uint8_t* base = stream_base(t, layer, head);
    if (end > first + count) {
      const std::size_t from = first + count - lay.sinks, to = first - lay.sinks, rows = end - first - count;
      std::memmove(base + lay.code_offset + to * lay.row_bytes, base + lay.code_offset + from * lay.row_bytes,
                   rows * lay.row_bytes);
      const std::size_t bytes = param_offset(lay, from + rows) - param_offset(lay, from);
      std::memmove(base + lay.scale_offset + param_offset(lay, to), base + lay.scale_offset + param_offset(lay, from), bytes);
      if (lay.spec.has_zero_point())
        std::memmove(base + lay.zero_offset + param_offset(lay, to), base + lay.zero_offset + param_offset(lay, from), bytes);
    }
    if (new_end < end) {
      const std::size_t a = new_end - lay.sinks, b = end - lay.sinks, bytes = param_offset(lay, b) - param_offset(lay, a);
      std::memset(base + lay.code_offset + a * lay.row_bytes, 0, (b - a) * lay.row_bytes);
      std::memset(base + lay.scale_offset + param_offset(lay, a), 0, bytes);
      if (lay.spec.has_zero_point()) std::memset(base + lay.zero_offset + param_offset(lay, a), 0, bytes);
    }
    const std::size_t row = row_size(lay), length = lengths_[layer];
    const std::size_t src = std::max(end, first + count);
    for (std::size_t p = src; p < length; ++p) std::memcpy(staged + (p - src) * row, ring_row(t, layer, head, p), row);
    for (std::size_t p = std::max(end, first); p < length; ++p) std::memset(ring_row(t, layer, head, p), 0, row);
    for (std::size_t p = src; p < length; ++p) std::memcpy(ring_row(t, layer, head, p - count), staged + (p - src) * row, row);
  }

  // The commit half of append: noexcept, since check_append has validated everything.

  void write_row(Tensor t, std::size_t layer, std::size_t head, std::size_t p, const float* x) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    std::uint8_t* base = stream_base(t, layer, head);
    const std::size_t row_bytes = shape_.head_dim * size_of(lay.residual);
    std::uint8_t* dest = p < lay.sinks ? base + lay.sink_offset + p * row_bytes
                                       : base + lay.ring_offset + (p - lay.sinks) % lay.ring_rows * row_bytes;
    store_row(lay.residual, x, shape_.head_dim, dest);
  }

  /// Quantizes, in every head, whatever the rule makes due once the layer holds `length` tokens.
  void quantize_due(Tensor t, std::size_t layer, std::size_t length) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    std::size_t& q_end = quantized_ends_[layer * 2 + index(t)];
    const std::size_t begin = q_end, end = std::max(begin, lay.quantized_end(length));
    if (begin == end) return;
    q_end = end;
    const std::size_t dim = shape_.head_dim, row_bytes = dim * size_of(lay.residual);
    const std::size_t row0 = begin - lay.sinks, param_size = size_of(lay.spec.param);
    const std::size_t param0 = (lay.spec.axis == Axis::per_channel ? row0 / lay.spec.group * dim
                                                                   : row0 * groups_per_row(lay.spec, dim)) * param_size;
    if (lay.spec.axis == Axis::per_token) {  // every head's row in one call, read in place from the ring
      std::uint8_t* base = stream_base(t, layer, 0);
      for (std::size_t q = begin; q < end; ++q) {
        const std::size_t params = param0 + (q - begin) * groups_per_row(lay.spec, dim) * param_size;
        kernels::quantize_rows_per_token(lay.spec, lay.residual, base + lay.ring_offset + (q - lay.sinks) % lay.ring_rows * row_bytes,
                                         shape_.kv_heads, dim, head_bytes_, base + lay.scale_offset + params,
                                         base + lay.zero_offset + params, head_bytes_,
                                         base + lay.code_offset + (q - lay.sinks) * lay.row_bytes, head_bytes_);
      }
      keep_rows(t, layer, begin, end);
      return;
    }
    // The due rows are read in place from the ring unless they wrap around its end (a window
    // that is not a multiple of the group), then through the scratch rows as floats.
    const std::size_t first_slot = row0 % lay.ring_rows;
    float* const scratch = scratch_.data() + layer * (scratch_.size() / shape_.layers);
    const bool contiguous = first_slot + (end - begin) <= lay.ring_rows;
    for (std::size_t h = 0; h < shape_.kv_heads; ++h) {
      std::uint8_t* base = stream_base(t, layer, h);
      std::uint8_t* codes = base + lay.code_offset + row0 * lay.row_bytes;
      void* scales = base + lay.scale_offset + param0;
      void* zeros = base + lay.zero_offset + param0;
      if (contiguous) {
        kernels::quantize_block_per_channel(lay.spec, lay.residual, base + lay.ring_offset + first_slot * row_bytes,
                                            end - begin, dim, row_bytes, scales, zeros, codes, lay.row_bytes,
                                            scratch);
        continue;
      }
      float* rows = scratch;
      for (std::size_t q = begin; q < end; ++q) {
        const std::uint8_t* src = base + lay.ring_offset + (q - lay.sinks) % lay.ring_rows * row_bytes;
        load_row(lay.residual, src, dim, rows + (q - begin) * dim);
      }
      kernels::quantize_block_per_channel(lay.spec, rows, end - begin, dim, dim, scales, zeros, codes, lay.row_bytes);
    }
    keep_rows(t, layer, begin, end);
  }

  /// Rows [begin, end) have just been packed: copy the newest history_rows of them into the
  /// rollback history (a ring by position), by contiguous runs while they are hot in the cache.
  void keep_rows(Tensor t, std::size_t layer, std::size_t begin, std::size_t end) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    std::size_t& kept = kept_from_[layer * 2 + index(t)];
    const std::size_t copy_rows = lay.history_rows, first = end - std::min(end - begin, copy_rows);
    kept = std::max(kept, end - std::min(end - lay.sinks, copy_rows));
    if (first == end) return;
    const std::size_t row = row_size(lay), ring_rows = lay.ring_rows;
    const std::size_t from_slot = (first - lay.sinks) % ring_rows, to_slot = (first - lay.sinks) % copy_rows;
    for (std::size_t h = 0; h < shape_.kv_heads; ++h) {
      const std::uint8_t* ring = stream_base(t, layer, h) + lay.ring_offset;
      std::uint8_t* copies = history_row(t, layer, h, lay.sinks);  // slot 0
      for (std::size_t done = 0, from = from_slot, to = to_slot; done < end - first;) {
        const std::size_t run = std::min({end - first - done, ring_rows - from, copy_rows - to});
        std::memcpy(copies + to * row, ring + from * row, run * row);
        done += run;
        from = from + run == ring_rows ? 0 : from + run;
        to = to + run == copy_rows ? 0 : to + run;
      }
    }
  }

  /// After a write made the layer `length` tokens long: rows that left the ring are held only if
  /// the history has them.
  void raise_floor(Tensor t, std::size_t layer, std::size_t length) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    const std::size_t first_in_ring = length > lay.sinks && length - lay.sinks > lay.ring_rows ? length - lay.ring_rows : lay.sinks;
    std::size_t& floor = history_begins_[layer * 2 + index(t)];
    floor = std::max(floor, std::min(kept_from_[layer * 2 + index(t)], first_in_ring));
  }

  CacheShape shape_;
  CacheConfig config_;
  StreamLayout layouts_[2];
  RopeTable rope_;
  std::size_t head_bytes_ = 0;
  AlignedBuffer storage_;
  std::size_t head_history_bytes_ = 0;
  AlignedBuffer history_;  // (layers, kv_heads): key then value rollback rows, a ring by position
  std::vector<std::size_t> lengths_;
  std::vector<float> key_peaks_;             // (layers): see key_peak
  std::vector<std::size_t> quantized_ends_;  // (layers, 2): first unquantized key / value position
  std::vector<std::size_t> history_begins_;  // (layers, 2): rollback floor: rows from here on are held
  std::vector<std::size_t> kept_from_;       // (layers, 2): the history holds packed rows [kept_from, quantized end)
  std::vector<float> scratch_;  // (layers): one group of due rows, as floats
};

/// Marks a cache whose configuration is chosen at run time.
struct Dynamic {};

/// KVCache<Policy> takes its configuration from a compiled policy (kv_policy.hpp);
/// KVCache<Dynamic> takes a CacheConfig, for tools that choose from the command line.
template <class Policy>
  requires KVCachePolicy<Policy> || std::same_as<Policy, Dynamic>
class KVCache : public BasicKVCache {
 public:
  using policy = Policy;
  explicit KVCache(const CacheShape& shape) : BasicKVCache(shape, Policy::config()) {}
};

template <>
class KVCache<Dynamic> : public BasicKVCache {
 public:
  using BasicKVCache::BasicKVCache;
};

}  // namespace kvq::inline v0
