#pragma once
// KVCache: the key/value cache of one sequence, for every layer and KV head.
//
//   new k, v (pre-RoPE) -> append -> sink rows | full-precision ring -> (group due) quantized
//   once, packed -> attention reads sinks + packed groups + ring.
//
// Every append is all-or-nothing: it validates shapes, order, capacity, finiteness and the
// representability of every parameter it will write before it changes a byte.
//
// Memory: a cache's packed rows (and every row of an unquantized tensor) live in blocks of one
// layer and a fixed number of positions (CacheShape::block_tokens), committed as they are first
// written; sinks, the ring of newest rows and the rollback copies are the cache's own. Attention
// reads a stream as one segment per block (view()). Caches of a KVPool share one block store, and
// a fork shares the blocks it has in common with its parent until either writes to one.
//
// Exact rollback: the ring keeps the full-precision rows of the newest positions, packed or
// not, and a history beside it copies each row as it is packed, for the last D + G packed
// positions (D = CacheConfig::rollback_depth; D + 1 for values per token, D + R for a stream
// that flushes its window). truncate() restores
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
#include <array>
#include <concepts>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <memory>
#include <optional>

#include "kvq/cache/block_store.hpp"
#include "kvq/cache/cache_config.hpp"
#include "kvq/cache/memory.hpp"
#include "kvq/cache/stream_layout.hpp"
#include "kvq/cache/stream_view.hpp"
#include "kvq/core/aligned_buffer.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/core/convert.hpp"
#include "kvq/core/scratch.hpp"
#include "kvq/error.hpp"
#include "kvq/kernels/quantize/quantize.hpp"
#include "kvq/quant/kv_policy.hpp"
#include "kvq/rope/rope.hpp"
#include "kvq/transform/hadamard.hpp"

namespace kvq::inline v0 {

namespace detail {
struct CacheAccess;  // serialize.hpp: reads and restores the state behind the public view
}

enum class Tensor : unsigned char { keys, values };

constexpr const char* to_string(Tensor t) noexcept { return t == Tensor::keys ? "key" : "value"; }

/// Most tokens a cache holds: positions and row counts stay far from any integer's end.
inline constexpr std::size_t max_capacity = RopeTable::max_positions_limit;
/// Rows of new keys or values as an engine holds them: `tokens` x kv_heads rows of head_dim
/// contiguous elements of `type` (f32, f16 or bf16), row (t, h) starting at element
/// t * token_stride + h * head_stride of `data`.
struct TokenRows {
  const void* data = nullptr;
  Scalar type = Scalar::f32;
  std::size_t tokens = 0;
  std::size_t token_stride = 0;  // elements from one token to the next
  std::size_t head_stride = 0;   // elements from one KV head to the next
};

/// Longest block of memory: a block is committed whole.
inline constexpr std::size_t max_block_tokens = 65536;

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
  /// Positions per block of memory (a multiple of block_unit(config)); 0 chooses: the multiple
  /// of the unit nearest above 4096 (decode attention's chunk: one kernel call per chunk, as
  /// fast as one block; bench/RESULTS.md), or less when the capacity is smaller.
  std::size_t block_tokens = 0;

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
  validate(shape.rope());
  validate(config);
  if (shape.rope_style == RopeStyle::none && config.key_rope == KeyRope::pre)
    throw Error(ErrorCode::invalid_argument,
                "cache config " + to_string(config) +
                    " stores keys pre-RoPE, but the shape's rope_style is none (a layer without RoPE): its keys "
                    "are stored as given, with -post");
  if (config.quantize_keys) validate(config.key, shape.head_dim, "key quantizer");
  if (config.quantize_values) validate(config.value, shape.head_dim, "value quantizer");
  for (const auto& [heads, what] :
       {std::pair{&config.key_head_codebooks, "key"}, std::pair{&config.value_head_codebooks, "value"}})
    if (!heads->empty() && heads->size() != shape.kv_heads)
      throw Error(ErrorCode::shape_mismatch,
                  "cache config " + to_string(config) + ": " + std::to_string(heads->size()) + " " + what +
                      " codebooks per KV head for a shape of " + std::to_string(shape.kv_heads) + " KV heads");
  const std::size_t unit = block_unit(config);
  if (unit > max_block_tokens)
    throw Error(ErrorCode::invalid_argument, "cache config " + to_string(config) +
                                                 ": blocks would need a multiple of " + std::to_string(unit) +
                                                 " positions (whole tiles and groups of both "
                                                 "tensors), more than " +
                                                 std::to_string(max_block_tokens));
  if (shape.block_tokens % unit != 0 || shape.block_tokens > max_block_tokens)
    throw Error(ErrorCode::invalid_argument, "cache shape: block_tokens " + std::to_string(shape.block_tokens) +
                                                 " is not a multiple of " + std::to_string(unit) + " up to " +
                                                 std::to_string(max_block_tokens) + " (whole tiles and groups of " +
                                                 to_string(config) + ")");
}

/// The block length a cache of this shape uses (CacheShape::block_tokens, or the default).
inline std::size_t block_tokens(const CacheShape& shape, const CacheConfig& config) {
  if (shape.block_tokens != 0) return shape.block_tokens;
  const std::size_t unit = block_unit(config),
                    after_sinks = shape.capacity > config.sinks ? shape.capacity - config.sinks : 1;
  const std::size_t wanted = std::min<std::size_t>(4096, after_sinks);
  return (wanted + unit - 1) / unit * unit;
}

class LayeredKVCache;

class BasicKVCache {
 public:
  BasicKVCache(const CacheShape& shape, const CacheConfig& config) : BasicKVCache(shape, config, nullptr, nullptr) {}

  /// A cache whose blocks come from `store` and whose RoPE table is `rope` (both shared, e.g. by
  /// the sequences of a KVPool); nullptr: its own. The store's blocks must hold
  /// block_bytes(shape, config) and the table must cover shape.capacity positions. A store whose
  /// limit counts own rows (a pool's) is charged them first: capacity_exceeded when they do not fit.
  /// `own_rows_from`: a reservation of `store` the charge is drawn on instead (a pool load
  /// reserves its sequences' own rows with their blocks).
  BasicKVCache(const CacheShape& shape, const CacheConfig& config, std::shared_ptr<BlockStore> store,
               std::shared_ptr<const RopeTable> rope, BlockReservation* own_rows_from = nullptr)
      : shape_(shape), config_(config) {
    validate(shape, config);
    if (const std::size_t block_bytes = BasicKVCache::block_bytes(shape, config);
        store != nullptr && store->block_bytes() < block_bytes)
      throw Error(ErrorCode::shape_mismatch, "cache: blocks of " + std::to_string(store->block_bytes()) +
                                                 " bytes cannot hold the " + std::to_string(block_bytes) +
                                                 " this shape needs");
    if (rope != nullptr && rope->max_positions() < shape.capacity)
      throw Error(ErrorCode::shape_mismatch, "cache: the RoPE table covers " + std::to_string(rope->max_positions()) +
                                                 " positions, fewer than the capacity of " +
                                                 std::to_string(shape.capacity));
    if (rope != nullptr && !same_rotation(rope->config(), shape.rope()))
      throw Error(ErrorCode::shape_mismatch, "cache: the RoPE table rotates otherwise than the shape's RoPE");
    // The own rows are charged before they are allocated.
    charge_ = OwnRowsCharge(store, own_bytes(shape, config), own_rows_name, own_rows_from);
    block_rows_ = kvq::block_tokens(shape, config);
    shape_.block_tokens = block_rows_;
    layouts_[0] = StreamLayout(true, shape.head_dim, config, shape.capacity, block_rows_);
    layouts_[1] = StreamLayout(false, shape.head_dim, config, shape.capacity, block_rows_);
    // Each stream is below 2^47 bytes (capacity and head_dim limits); the products over layers
    // and heads are what can wrap.
    head_bytes_ = layouts_[0].bytes + layouts_[1].bytes;
    const std::size_t streams = checked_mul(shape.layers, shape.kv_heads, "cache shape: layers x kv_heads");
    own_ = AlignedBuffer(checked_mul(head_bytes_, streams, "cache storage bytes"));
    head_history_bytes_ =
        layouts_[0].history_rows * row_size(layouts_[0]) + layouts_[1].history_rows * row_size(layouts_[1]);
    history_ = AlignedBuffer(checked_mul(head_history_bytes_, streams, "cache rollback history bytes"));
    block_head_bytes_ = layouts_[0].block_bytes + layouts_[1].block_bytes;
    if (store == nullptr)
      store = std::make_shared<BlockStore>(BasicKVCache::block_bytes(shape, config),
                                           own_store_blocks(shape, config, block_rows_));
    store_ = std::move(store);
    if (rope == nullptr) rope = std::make_shared<const RopeTable>(shape.rope(), shape.capacity);
    rope_ = std::move(rope);
    for (const Tensor t : {Tensor::keys, Tensor::values}) {
      const Rotation r = t == Tensor::keys ? config.key_rotation : config.value_rotation;
      if (r != Rotation::none)
        rotations_[index(t)] = std::make_shared<const HadamardTransform>(
            shape.head_dim, r == Rotation::signed_hadamard ? std::optional(rotation_sign_seed) : std::nullopt);
    }
    tables_.resize(shape.layers);
    lengths_.assign(shape.layers, 0);
    key_peaks_.assign(shape.layers, 0.0f);
    value_peaks_.assign(shape.layers, 0.0f);
    quantized_ends_.resize(shape.layers * 2);
    history_begins_.resize(shape.layers * 2);
    kept_from_.resize(shape.layers * 2);
    for (std::size_t i = 0; i < quantized_ends_.size(); ++i)
      quantized_ends_[i] = history_begins_[i] = kept_from_[i] = layouts_[i % 2].sinks;
    scratch_.resize(scratch_floats(shape, layouts_[0], layouts_[1]));
  }

  /// Bytes of one block: every KV head's keys and values for block_tokens(shape, config) positions.
  static std::size_t block_bytes(const CacheShape& shape, const CacheConfig& config) {
    validate(shape, config);
    const std::size_t rows = kvq::block_tokens(shape, config);
    const StreamLayout k(true, shape.head_dim, config, shape.capacity, rows),
        v(false, shape.head_dim, config, shape.capacity, rows);
    return checked_mul(k.block_bytes + v.block_bytes, shape.kv_heads, "cache block bytes");
  }

  /// Bytes a new cache allocates before it holds a token (with its own store and RoPE table): its
  /// own rows (sinks, window ring) and rollback history per layer, KV head and tensor, its RoPE
  /// table and its store's block table; blocks come as tokens arrive. load() bounds it.
  static std::size_t fixed_bytes(const CacheShape& shape, const CacheConfig& config) {
    const std::size_t own = own_bytes(shape, config);  // validates
    const std::size_t rope = RopeTable::table_bytes(shape.rope(), shape.capacity);
    const std::size_t table =
        BlockStore::table_bytes(own_store_blocks(shape, config, kvq::block_tokens(shape, config)));
    const std::size_t per_layer = checked_mul(shape.layers, 128, "cache bytes");  // its block table and positions
    return saturating_add(saturating_add(own, saturating_add(rope, table)), per_layer);
  }

  /// What own_bytes() of a cache of this shape and configuration is: its own rows (sinks, window
  /// ring), rollback history and scratch. A KVPool charges them to its limit per sequence.
  static std::size_t own_bytes(const CacheShape& shape, const CacheConfig& config) {
    validate(shape, config);
    const std::size_t rows = kvq::block_tokens(shape, config);
    const StreamLayout k(true, shape.head_dim, config, shape.capacity, rows),
        v(false, shape.head_dim, config, shape.capacity, rows);
    const std::size_t per_head =
        k.bytes + v.bytes + k.history_rows * row_size(k) + v.history_rows * row_size(v);  // each below 2^48
    const std::size_t own = checked_mul(
        per_head, checked_mul(shape.layers, shape.kv_heads, "cache shape: layers x kv_heads"), "cache storage bytes");
    return saturating_add(own, scratch_floats(shape, k, v) * sizeof(float));
  }

  /// A deep copy with blocks of its own.
  BasicKVCache(const BasicKVCache& other)
      : BasicKVCache(other, std::make_shared<BlockStore>(other.store_->block_bytes(), other.store_->max_blocks())) {
    for (std::size_t l = 0; l < tables_.size(); ++l)
      for (const BlockId id : other.tables_[l]) {
        const BlockId copy = store_->acquire("a copy of a cache");
        std::memcpy(store_->data(copy), other.store_->data(id), store_->block_bytes());
        tables_[l].push_back(copy);
      }
  }
  /// A cache holding the first `length` tokens of `parent` (every layer), sharing its blocks: the
  /// fork of a sequence. Exact where parent.truncate(length) would be; throws kvq::Error as it
  /// would, and the parent never changes.
  BasicKVCache(const BasicKVCache& parent, std::size_t length) : BasicKVCache(parent, parent.store_) {
    for (std::size_t l = 0; l < tables_.size(); ++l)
      for (const BlockId id : parent.tables_[l]) {
        store_->retain(id);
        tables_[l].push_back(id);
      }
    if (length < max_length()) truncate(length);  // on a throw the destructor lets the blocks go
  }
  BasicKVCache(BasicKVCache&& other) noexcept { swap(other); }
  BasicKVCache& operator=(BasicKVCache other) noexcept {
    swap(other);
    return *this;
  }
  ~BasicKVCache() { release_blocks(); }

  void swap(BasicKVCache& other) noexcept {
    std::swap(shape_, other.shape_);
    std::swap(config_, other.config_);
    std::swap(rotations_, other.rotations_);
    std::swap(layouts_, other.layouts_);
    std::swap(rope_, other.rope_);
    std::swap(store_, other.store_);
    std::swap(block_rows_, other.block_rows_);
    std::swap(block_head_bytes_, other.block_head_bytes_);
    std::swap(head_bytes_, other.head_bytes_);
    own_.swap(other.own_);
    std::swap(head_history_bytes_, other.head_history_bytes_);
    history_.swap(other.history_);
    std::swap(tables_, other.tables_);
    std::swap(lengths_, other.lengths_);
    std::swap(key_peaks_, other.key_peaks_);
    std::swap(value_peaks_, other.value_peaks_);
    std::swap(quantized_ends_, other.quantized_ends_);
    std::swap(history_begins_, other.history_begins_);
    std::swap(kept_from_, other.kept_from_);
    std::swap(scratch_, other.scratch_);
    std::swap(charge_, other.charge_);
  }

  const CacheShape& shape() const noexcept { return shape_; }
  const CacheConfig& config() const noexcept { return config_; }
  const StreamLayout& layout(Tensor t) const noexcept { return layouts_[index(t)]; }
  const RopeTable& rope() const noexcept { return *rope_; }
  std::size_t length(std::size_t layer) const { return lengths_[checked_layer(layer, "length")]; }
  std::size_t capacity() const noexcept { return shape_.capacity; }
  /// Positions per block (CacheShape::block_tokens as chosen).
  std::size_t block_tokens() const noexcept { return block_rows_; }
  const BlockStore& blocks() const noexcept { return *store_; }

  /// Appends T tokens to one layer. keys, values: (T, kv_heads, head_dim), keys pre-RoPE when
  /// config().key_rope is pre and already rotated when it is post; `position` must equal
  /// length(layer). Throws kvq::Error and leaves the cache unchanged on any bad input, and when
  /// the blocks it needs cannot be had (capacity_exceeded from a shared store, out_of_memory).
  /// With a rotation (CacheConfig::key_rotation, value_rotation) the rows are rotated first and
  /// the checks below see the rotated rows, but a NaN or Inf is reported where the input has it.
  void append(std::size_t layer, std::size_t position, std::span<const float> keys, std::span<const float> values) {
    const ScratchTrim trim(rotated_rows()[0], rotated_rows()[1]);
    const auto [k, v] = stored_form(layer, position, keys, values);
    append_stored(layer, position, k, v);
  }

  /// The rotation config() applies to tensor t's head vectors before they are stored, or null.
  /// Built once with the cache (shared by its copies), so attention reads it without allocating.
  const HadamardTransform* rotation(Tensor t) const noexcept { return rotations_[index(t)].get(); }

  /// append for keys and values in the engine's own layout and type (f16/bf16 activations with
  /// strides): converted to float rows, then appended with every rule and check of the float
  /// append. Throws kvq::Error (shape_mismatch) when the two views disagree on the token count.
  void append(std::size_t layer, std::size_t position, const TokenRows& keys, const TokenRows& values) {
    if (keys.tokens != values.tokens || (keys.tokens != 0 && (keys.data == nullptr || values.data == nullptr)))
      throw Error(ErrorCode::shape_mismatch, "layer " + std::to_string(layer) + ": key rows of " +
                                                 std::to_string(keys.tokens) + " and value rows of " +
                                                 std::to_string(values.tokens) + " tokens (or a null view)");
    thread_local std::vector<float> k, v;
    const ScratchTrim trim(k, v);  // a long prompt's rows are not kept for the thread's life
    gather(keys, k);
    gather(values, v);
    append(layer, position, k, v);
  }

  /// The same checks as append, without changing anything: an engine can ask first and fall back.
  /// That includes the blocks it takes from a shared store (free now; another thread may take
  /// them before the append).
  bool can_append(std::size_t layer, std::size_t position, std::span<const float> keys, std::span<const float> values,
                  std::string* why = nullptr) const {
    try {
      const ScratchTrim trim(rotated_rows()[0], rotated_rows()[1]);
      const auto [k, v] = stored_form(layer, position, keys, values);
      if (const std::size_t tokens = check_append(layer, position, k, v); tokens != 0) {
        const auto [first_row, needed] = append_blocks(layer, position + tokens);
        BlockReservation room(*store_);  // let go of at once: a free block now may be taken later
        reserve_blocks(room, blocks_wanted(layer, first_row, needed), "layer", layer);
      }
      return true;
    } catch (const Error& e) {
      if (why != nullptr) *why = e.what();
      return false;
    }
  }

  /// The error truncate(length) would throw, or none: its checks without the change (a caller
  /// holding several caches checks them all before truncating any).
  std::optional<Error> truncate_error(std::size_t length) const {
    try {
      check_truncate(length);
      return std::nullopt;
    } catch (const Error& e) {
      return e;
    }
  }

  /// The error erase(first, count) would throw, or none, as truncate_error.
  std::optional<Error> erase_error(std::size_t first, std::size_t count) const {
    try {
      if (count != 0) check_erase(first, count);
      return std::nullopt;
    } catch (const Error& e) {
      return e;
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
    prepare_truncate(length);
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      if (length >= lengths_[l]) continue;
      release_blocks(
          l, blocks_for(length, truncated_end(Tensor::keys, l, length), truncated_end(Tensor::values, l, length)));
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const StreamLayout& lay = layouts_[index(t)];
        const std::size_t target = truncated_end(t, l, length);
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
  /// the position, and attention rotates them at the new one, so nothing is re-quantized (or
  /// carry no position: a layer without RoPE, rope_style none). Packed
  /// groups move whole: in a stream quantized per channel (group G), a range that reaches into the
  /// quantized positions must start at sinks + a multiple of G, and one that moves quantized
  /// groups must span a multiple of G; for a stream that flushes its window, R takes G's place
  /// (shift_unit). Positions quantized before the shift stay quantized.
  /// Throws kvq::Error and leaves the cache unchanged when the range or the layout forbids it.
  void erase(std::size_t first, std::size_t count) {
    if (count == 0) return;
    std::vector<std::uint8_t> staged;  // before anything changes
    checked_resize(staged, erase_staging_bytes(first, count), "erase's staging");
    prepare_erase(first, count);
    erase_prepared(first, count, staged.data());
  }

  /// Empties every layer; zeroes only the bytes in use, so it costs what the cache holds.
  void clear() noexcept {
    release_blocks();
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const std::size_t sinks = layouts_[index(t)].sinks;
        for (std::size_t h = 0; h < shape_.kv_heads; ++h) cut_stream(t, l, h, 0, sinks);
        quantized_ends_[l * 2 + index(t)] = history_begins_[l * 2 + index(t)] = kept_from_[l * 2 + index(t)] = sinks;
      }
      lengths_[l] = 0;
    }
    std::fill(key_peaks_.begin(), key_peaks_.end(), 0.0f);
    std::fill(value_peaks_.begin(), value_peaks_.end(), 0.0f);
  }

  /// The largest |key| (as stored: rotated with -hk) appended to `layer` since the cache was built
  /// or cleared (an upper bound after truncate and erase). Attention uses it to refuse queries
  /// whose scores could overflow.
  float key_peak(std::size_t layer) const { return key_peaks_[checked_layer(layer, "key_peak")]; }
  /// The same for values, or what a load found stored: appends keep it below value_limit(), a file
  /// need not (attention then refuses the layer).
  float value_peak(std::size_t layer) const { return value_peaks_[checked_layer(layer, "value_peak")]; }

  /// The largest |value| (as stored: rotated with -hv) an append takes beyond the residual type's
  /// own range: attention adds up to capacity() values with weights up to 1, so its sums stay
  /// within float with values under FLT_MAX / (2 capacity()).
  float value_limit() const noexcept {
    return float(double(std::numeric_limits<float>::max()) / (2.0 * double(shape_.capacity)));
  }
  /// Where rows of `t`, as given to append (before any rotation), leave what the cache rotates,
  /// stores and sums: the first NaN or Inf, else, rotated, the largest value of the first block
  /// whose L2 norm exceeds the rotation's range or (values) value_limit(), else (values) the first
  /// value at or beyond value_limit(); data.size() where none does. The residual type's range is
  /// checked on the rows as stored. attend() holds new rows to the same.
  std::size_t first_unstorable(Tensor t, std::span<const float> data) const noexcept {
    const float limit = t == Tensor::values ? value_limit() : std::numeric_limits<float>::infinity();
    if (const auto r = rotation(t)) return r->first_out_of_range(data, limit);  // a rotated value <= its block's norm
    if (all_below(data.data(), data.size(), limit)) return data.size();
    return std::size_t(std::find_if(data.begin(), data.end(), [limit](float x) { return !(std::fabs(x) < limit); }) -
                       data.begin());
  }
  /// Why first_unstorable() stopped at a finite value, for errors that name it.
  std::string unstorable_text(Tensor t) const {
    const auto r = rotation(t);
    if (r && !(t == Tensor::values && value_limit() < r->max_block_norm())) return r->range_text();
    return std::string(r ? "its block's L2 norm" : "it") + " is beyond FLT_MAX / (2 x capacity " +
           std::to_string(shape_.capacity) + "), past which attention's sums over the cache overflow";
  }

  /// First position of `layer` that `t` holds unquantized (= sinks while nothing is quantized).
  std::size_t quantized_end(Tensor t, std::size_t layer) const {
    return quantized_ends_[checked_layer(layer, "quantized_end") * 2 + index(t)];
  }
  /// First position of `layer` whose full-precision `t` row the cache still holds (in the ring or
  /// the rollback history): truncate(length) fails only where it would re-open positions before it.
  std::size_t rollback_floor(Tensor t, std::size_t layer) const {
    return history_begins_[checked_layer(layer, "rollback_floor") * 2 + index(t)];
  }

  /// Segments a stream of `layer` is read in: segment 0 holds positions [0, sinks + B), segment
  /// k > 0 holds [sinks + kB, sinks + (k + 1)B), clipped to the length (B = block_tokens()).
  std::size_t segments(std::size_t layer) const {
    const std::size_t n = length(layer), s = config_.sinks;
    return n <= s ? 1 : (n - s - 1) / block_rows_ + 1;
  }
  std::size_t segment_begin(std::size_t segment) const noexcept {
    return segment == 0 ? 0 : config_.sinks + segment * block_rows_;
  }

  /// How one (layer, KV head) stores tensor `t` over one segment (segments()): what attention
  /// kernels read. Throws kvq::Error for a layer, head or segment the cache does not have.
  StreamView view(Tensor t, std::size_t layer, std::size_t head, std::size_t segment) const {
    if (layer >= shape_.layers || head >= shape_.kv_heads || segment >= segments(layer))
      throw Error(
          ErrorCode::invalid_argument,
          "layer " + std::to_string(layer) + ", kv head " + std::to_string(head) + ", segment " +
              std::to_string(segment) + " is outside the cache's " + std::to_string(shape_.layers) + " layers, " +
              std::to_string(shape_.kv_heads) + " KV heads and " +
              (layer < shape_.layers ? std::to_string(segments(layer)) + " segments" : std::string("segments")));
    const StreamLayout& lay = layouts_[index(t)];
    const std::uint8_t* own = own_base(t, layer, head);
    const std::size_t s = lay.sinks, first = s + segment * block_rows_;
    StreamView v;
    v.spec = head_spec(t, head);
    v.quantized = lay.quantized;
    v.head_dim = lay.head_dim;
    v.residual = lay.residual;
    const std::size_t last = saturating_add(first, block_rows_);  // sinks may be up to SIZE_MAX
    v.length = std::min(lengths_[layer], last);
    v.sinks_stored = std::min(s, lengths_[layer]);
    v.sinks = own + lay.sink_offset;
    v.first_quantized = first;
    v.end_quantized = std::clamp(quantized_end(t, layer), first, last);
    v.row_bytes = lay.row_bytes;
    const bool in_block = segment < tables_[layer].size();
    const std::uint8_t* block = in_block ? section(t, layer, head, segment) : nullptr;
    if (lay.quantized) {
      if (in_block) {
        v.codes = block;
        v.scales = block + lay.block_scale_offset;
        v.zeros = lay.spec.has_zero_point() ? block + lay.block_zero_offset : nullptr;
        if (lay.spec.outliers > 0) {
          v.outlier_slots = reinterpret_cast<const std::uint16_t*>(block + lay.block_slot_offset);
          v.outlier_corrections = block + lay.block_correction_offset;
        }
      }
      v.ring = own + lay.ring_offset;
      v.ring_rows = lay.ring_rows;
      v.ring_origin = s;
    } else {
      v.ring = block;  // every row of the segment
      v.ring_rows = block_rows_;
      v.ring_origin = first;
    }
    return v;
  }
  StreamView keys(std::size_t layer, std::size_t head, std::size_t segment) const {
    return view(Tensor::keys, layer, head, segment);
  }
  StreamView values(std::size_t layer, std::size_t head, std::size_t segment) const {
    return view(Tensor::values, layer, head, segment);
  }
  /// The row at `position` as floats (dequantized when packed, rotated back when the config
  /// rotates): out (head_dim). The slow, plain way for oracles and checks.
  void read_row(Tensor t, std::size_t layer, std::size_t head, std::size_t position, float* out) const {
    read_stored_row(t, layer, head, position, out);
    if (const auto r = rotation(t)) r->inverse_head(out);
  }
  /// The row at `position` as stored (dequantized, still rotated): what the kernels read.
  void read_stored_row(Tensor t, std::size_t layer, std::size_t head, std::size_t position, float* out) const {
    if (layer < shape_.layers && position >= lengths_[layer])
      throw Error(ErrorCode::invalid_argument, "layer " + std::to_string(layer) + " holds " +
                                                   std::to_string(lengths_[layer]) + " tokens, not position " +
                                                   std::to_string(position));
    const std::size_t s = config_.sinks;
    view(t, layer, head, position < s ? 0 : (position - s) / block_rows_).read_row(position, out);
  }

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
  /// Every stored byte, in a layout fixed by shape and config: the cache's own rows, then each
  /// layer's blocks in order. Two caches that received the same tokens compare equal here,
  /// however the tokens arrived, and after a rollback within truncate()'s exact reach too. The
  /// rollback history lives beside it: it only decides how far truncate() can reach.
  std::vector<std::uint8_t> stored_bytes() const {
    std::vector<std::uint8_t> out(own_.data(), own_.data() + own_.size());
    const std::size_t block_bytes = block_head_bytes_ * shape_.kv_heads;
    for (const auto& table : tables_)
      for (const BlockId id : table) out.insert(out.end(), store_->data(id), store_->data(id) + block_bytes);
    return out;
  }

  /// Blocks layer `layer` refers to (shared ones included).
  std::size_t block_count(std::size_t layer) const { return tables_[checked_layer(layer, "block_count")].size(); }
  /// Positions [0, n) of `layer` that this cache and `other` store alike, byte for byte: equal
  /// sink rows, then the blocks both refer to (a fork's, or those KVPool::share_prefixes found)
  /// as far as both have packed them. Attention reads those positions alike in either cache, so
  /// cascade attention may read them once for both (AttentionRequest::seen_end). Positions
  /// either has not packed yet count only for a cache with itself. Throws kvq::Error
  /// (shape_mismatch) for caches that store or rotate rows differently.
  std::size_t common_prefix(const BasicKVCache& other, std::size_t layer) const {
    const std::size_t l = checked_layer(layer, "common_prefix");
    if (&other == this) return lengths_[l];
    if (other.shape_.layers != shape_.layers || other.shape_.kv_heads != shape_.kv_heads ||
        other.shape_.head_dim != shape_.head_dim || other.block_rows_ != block_rows_ || !(other.config_ == config_) ||
        !(other.rope_->config() == rope_->config()))
      throw Error(ErrorCode::shape_mismatch,
                  "common_prefix: caches of another shape, block length, RoPE or configuration (" + to_string(config_) +
                      ", " + to_string(other.config_) + ")");
    std::size_t n = std::min(lengths_[l], other.lengths_[l]);
    // Rows past a tensor's packed end are each cache's own (its window), whatever a block holds.
    for (const Tensor t : {Tensor::keys, Tensor::values})
      if (layouts_[index(t)].quantized) n = std::min({n, quantized_end(t, l), other.quantized_end(t, l)});
    std::vector<float> mine(shape_.head_dim), theirs(shape_.head_dim);
    for (std::size_t p = 0; p < std::min(n, config_.sinks); ++p)
      for (std::size_t h = 0; h < shape_.kv_heads; ++h)
        for (const Tensor t : {Tensor::keys, Tensor::values}) {
          read_stored_row(t, l, h, p, mine.data());
          other.read_stored_row(t, l, h, p, theirs.data());
          if (std::memcmp(mine.data(), theirs.data(), mine.size() * sizeof(float)) != 0) return p;
        }
    for (std::size_t k = 0; config_.sinks + k * block_rows_ < n; ++k)
      if (store_ != other.store_ || k >= tables_[l].size() || k >= other.tables_[l].size() ||
          tables_[l][k] != other.tables_[l][k])
        return config_.sinks + k * block_rows_;
    return n;
  }

  /// Bytes of the blocks the cache refers to (shared ones included).
  std::size_t block_bytes_held() const noexcept {
    std::size_t blocks = 0;
    for (const auto& table : tables_) blocks += table.size();
    return blocks * store_->block_bytes();
  }

  /// Bytes the cache holds now: its own rows (sinks, ring, rollback history), the blocks it refers
  /// to, quantization scratch, and the RoPE table unless shared. Blocks are committed as rows
  /// reach them, so this grows with the length, not the capacity.
  std::size_t allocated_bytes() const noexcept {
    return own_bytes() + block_bytes_held() + (rope_.use_count() == 1 ? rope_->bytes() : 0);
  }
  /// Bytes of the cache's own rows (sinks, rings, rollback copies) and scratch: fixed when built.
  std::size_t own_bytes() const noexcept { return own_.size() + history_.size() + scratch_.size() * sizeof(float); }

 private:
  /// This thread's copies of rotated key and value rows (appends to different layers may run
  /// concurrently), trimmed when the append or can_append using them ends (core/scratch.hpp).
  static std::array<std::vector<float>, 2>& rotated_rows() noexcept {
    thread_local std::array<std::vector<float>, 2> rows;
    return rows;
  }

  /// The rows as append() stores them: the input, or rotated copies in this thread's scratch
  /// (rotated_rows(), valid until the calling append ends). What a rotation would blur is reported first, where the
  /// input has it: a bad layer or size (check_append, before it reads a value), a NaN or Inf.
  std::pair<std::span<const float>, std::span<const float>> stored_form(std::size_t layer, std::size_t position,
                                                                        std::span<const float> keys,
                                                                        std::span<const float> values) const {
    const auto key_rotation = rotation(Tensor::keys), value_rotation = rotation(Tensor::values);
    if (!key_rotation && !value_rotation) return {keys, values};
    if (layer >= shape_.layers || keys.size() % (shape_.kv_heads * shape_.head_dim) != 0 ||
        keys.size() != values.size())
      (void)check_append(layer, position, keys, values);  // throws
    for (const Tensor t : {Tensor::keys, Tensor::values}) {
      const std::span<const float> data = t == Tensor::keys ? keys : values;
      if (const std::size_t at = first_unstorable(t, data); at < data.size())
        throw value_error(t, layer, position, at, data[at], false);
    }
    auto& [k, v] = rotated_rows();
    checked_resize(k, keys.size(), "append's rotated keys");
    checked_resize(v, values.size(), "append's rotated values");
    std::copy(keys.begin(), keys.end(), k.begin());
    std::copy(values.begin(), values.end(), v.begin());
    if (key_rotation) key_rotation->forward_unchecked(k);  // checked above, with the row's place
    if (value_rotation) value_rotation->forward_unchecked(v);
    return {k, v};
  }

  /// ", channel c", marked when the tensor is stored rotated (the channel is the rotated row's).
  std::string channel_text(Tensor t, std::size_t channel) const {
    return ", channel " + std::to_string(channel) + (rotation(t) ? " (rotated)" : "");
  }

  /// The error for value x at index i of an append's rows from `position` (rotated: as stored).
  Error value_error(Tensor t, std::size_t layer, std::size_t position, std::size_t i, float x, bool rotated) const {
    const std::size_t row = shape_.kv_heads * shape_.head_dim;
    const std::string place =
        where(t, layer, i % row / shape_.head_dim, position + i / row) +
        (rotated ? channel_text(t, i % shape_.head_dim) : ", channel " + std::to_string(i % shape_.head_dim)) +
        ": value " + std::to_string(x);
    if (!rotated && !std::isfinite(x)) return Error(ErrorCode::non_finite_input, place + " is not finite");
    if (!rotated && (rotation(t) || (t == Tensor::values && !(std::fabs(x) < value_limit()))))
      return Error(ErrorCode::unrepresentable, place + ": " + unstorable_text(t));  // what first_unstorable found
    return Error(ErrorCode::unrepresentable,
                 place + " exceeds the range of the residual type " + to_string(config_.residual));
  }

  /// append() of rows as they are stored (rotated when the config rotates).
  void append_stored(std::size_t layer, std::size_t position, std::span<const float> keys,
                     std::span<const float> values) {
    const std::size_t tokens = check_append(layer, position, keys, values);
    if (tokens == 0) return;  // nothing to write: no block copied or taken
    const auto [first_row, needed] = append_blocks(layer, position + tokens);
    prepare_blocks(layer, first_row, needed);
    key_peaks_[layer] = std::max(key_peaks_[layer], largest_magnitude(keys.data(), keys.size()));
    value_peaks_[layer] = std::max(value_peaks_[layer], largest_magnitude(values.data(), values.size()));
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

  /// The blocks an append to `layer` up to length `end` writes: from the first row's block
  /// (first_block_row) up to the count it then refers to.
  std::pair<std::size_t, std::size_t> append_blocks(std::size_t layer, std::size_t end) const {
    return {first_block_row(length(layer), quantized_end(Tensor::keys, layer), quantized_end(Tensor::values, layer)),
            blocks_for(end, std::max(quantized_end(Tensor::keys, layer), layouts_[0].quantized_end(end)),
                       std::max(quantized_end(Tensor::values, layer), layouts_[1].quantized_end(end)))};
  }

  friend struct detail::CacheAccess;
  friend class LayeredKVCache;  // erases its layers together (prepare_erase, erase_prepared)

  /// A bound on |value| for the rows of `t` that `layer` holds as stored (dequantized, still
  /// rotated): residual rows as they are, packed groups by what their extreme codes decode to
  /// (decoding every code made a load 20x slower). A load holds the peaks to it.
  float largest_stored(Tensor t, std::size_t layer) const noexcept {
    float row[max_head_dim], peak = 0.0f;
    const std::size_t s = layouts_[index(t)].sinks, length = lengths_[layer];
    for (std::size_t h = 0; h < shape_.kv_heads; ++h) {
      const auto extreme = kernels::reference::extreme_codes(head_spec(t, h));
      for (std::size_t p = 0; p < length;) {
        const std::size_t segment = p < s ? 0 : (p - s) / block_rows_;
        const StreamView v = view(t, layer, h, segment);
        const std::size_t end = std::min(length, saturating_add(s, (segment + 1) * block_rows_));
        const std::size_t packed_begin = std::max(p, v.first_quantized), packed_end = std::min(end, v.end_quantized);
        peak = std::max(peak, v.packed_bound(packed_begin, packed_end, extreme));
        for (; p < end; ++p)
          if (v.residual_at(p)) {
            load_row(v.residual, v.residual_row(p), shape_.head_dim, row);
            peak = std::max(peak, largest_magnitude(row, shape_.head_dim));
          }
      }
    }
    return peak;
  }

  static constexpr std::size_t index(Tensor t) noexcept { return t == Tensor::keys ? 0 : 1; }

  /// `layer`, or kvq::Error (invalid_argument) naming `operation` when the cache has no such layer.
  std::size_t checked_layer(std::size_t layer, const char* operation) const {
    if (layer >= shape_.layers)
      throw Error(ErrorCode::invalid_argument, std::string("cache ") + operation + ": layer " + std::to_string(layer) +
                                                   " of " + std::to_string(shape_.layers));
    return layer;
  }

  /// rows as (tokens, kv_heads, head_dim) floats.
  void gather(const TokenRows& rows, std::vector<float>& out) const {
    const std::size_t dim = shape_.head_dim, heads = shape_.kv_heads, bytes = size_of(rows.type);
    checked_resize(out, checked_mul(checked_mul(rows.tokens, heads, "token rows"), dim, "token rows"), "token rows");
    for (std::size_t t = 0; t < rows.tokens; ++t)
      for (std::size_t h = 0; h < heads; ++h)
        load_row(rows.type,
                 static_cast<const std::uint8_t*>(rows.data) + (t * rows.token_stride + h * rows.head_stride) * bytes,
                 dim, out.data() + (t * heads + h) * dim);
  }

  MemoryUsage layer_usage(std::size_t length, std::size_t key_end, std::size_t value_end) const noexcept {
    MemoryUsage u = stream_usage(layouts_[0], length, key_end);
    u += stream_usage(layouts_[1], length, value_end);
    u.code_bytes *= shape_.kv_heads;
    u.param_bytes *= shape_.kv_heads;
    u.residual_bytes *= shape_.kv_heads;
    u.values *= shape_.kv_heads;
    return u;
  }

  /// Everything but the blocks, copied from `other`; no blocks yet (the public copies add them).
  BasicKVCache(const BasicKVCache& other, std::shared_ptr<BlockStore> store)
      : charge_(store, other.own_bytes(), own_rows_name),  // first: before the copies are allocated
        shape_(other.shape_),
        config_(other.config_),
        rotations_(other.rotations_),
        rope_(other.rope_),
        store_(store),
        block_rows_(other.block_rows_),
        block_head_bytes_(other.block_head_bytes_),
        head_bytes_(other.head_bytes_),
        own_(other.own_),
        head_history_bytes_(other.head_history_bytes_),
        history_(other.history_),
        tables_(other.tables_.size()),
        lengths_(other.lengths_),
        key_peaks_(other.key_peaks_),
        value_peaks_(other.value_peaks_),
        quantized_ends_(other.quantized_ends_),
        history_begins_(other.history_begins_),
        kept_from_(other.kept_from_),
        scratch_(other.scratch_) {
    layouts_[0] = other.layouts_[0];
    layouts_[1] = other.layouts_[1];
  }
  static constexpr const char* own_rows_name = "a cache's own rows (sinks, window ring, rollback copies, scratch)";

  std::size_t max_length() const noexcept { return *std::max_element(lengths_.begin(), lengths_.end()); }

  /// The cache's own rows of one stream: sinks, then the ring of a quantized tensor.
  const std::uint8_t* own_base(Tensor t, std::size_t layer, std::size_t head) const noexcept {
    return own_.data() + (layer * shape_.kv_heads + head) * head_bytes_ + (t == Tensor::keys ? 0 : layouts_[0].bytes);
  }
  std::uint8_t* own_base(Tensor t, std::size_t layer, std::size_t head) noexcept {
    return const_cast<std::uint8_t*>(std::as_const(*this).own_base(t, layer, head));
  }
  /// One stream's part of block k of `layer` (which must exist).
  const std::uint8_t* section(Tensor t, std::size_t layer, std::size_t head, std::size_t k) const noexcept {
    return store_->data(tables_[layer][k]) + head * block_head_bytes_ +
           (t == Tensor::keys ? 0 : layouts_[0].block_bytes);
  }
  std::uint8_t* section(Tensor t, std::size_t layer, std::size_t head, std::size_t k) noexcept {
    return const_cast<std::uint8_t*>(std::as_const(*this).section(t, layer, head, k));
  }
  /// Packed row `row` (position sinks + row) and its first parameter pair: scale, then zero point.
  std::uint8_t* code_row(Tensor t, std::size_t layer, std::size_t head, std::size_t row) noexcept {
    return section(t, layer, head, row / block_rows_) + row % block_rows_ * layouts_[index(t)].row_bytes;
  }
  std::pair<std::uint8_t*, std::uint8_t*> params_of(Tensor t, std::size_t layer, std::size_t head,
                                                    std::size_t row) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    std::uint8_t* block = section(t, layer, head, row / block_rows_);
    const std::size_t offset = param_offset(lay, row % block_rows_);
    return {block + lay.block_scale_offset + offset, block + lay.block_zero_offset + offset};
  }
  /// The outlier entries of packed row `row`'s first parameter pair.
  kernels::reference::Outliers outliers_of(Tensor t, std::size_t layer, std::size_t head, std::size_t row) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    if (lay.spec.outliers == 0) return {};
    std::uint8_t* block = section(t, layer, head, row / block_rows_);
    const std::size_t entry = param_offset(lay, row % block_rows_) / size_of(lay.spec.param) * lay.spec.outliers;
    return {reinterpret_cast<std::uint16_t*>(block + lay.block_slot_offset) + entry,
            block + lay.block_correction_offset + entry * size_of(lay.spec.param)};
  }
  bool in_blocks(std::size_t layer, std::size_t row) const noexcept {
    return row / block_rows_ < tables_[layer].size();
  }

  /// The full-precision row of `position` (>= sinks): the ring of a quantized tensor, the block
  /// of an unquantized one (which must exist).
  const std::uint8_t* ring_row(Tensor t, std::size_t layer, std::size_t head, std::size_t position) const noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    const std::size_t row = position - lay.sinks;
    if (!lay.quantized) return section(t, layer, head, row / block_rows_) + row % block_rows_ * row_size(lay);
    return own_base(t, layer, head) + lay.ring_offset + row % lay.ring_rows * row_size(lay);
  }
  std::uint8_t* ring_row(Tensor t, std::size_t layer, std::size_t head, std::size_t position) noexcept {
    return const_cast<std::uint8_t*>(std::as_const(*this).ring_row(t, layer, head, position));
  }
  /// Whether ring_row(position) exists: unquantized rows live in blocks, which may be gone.
  bool ring_row_held(Tensor t, std::size_t layer, std::size_t position) const noexcept {
    return layouts_[index(t)].quantized || in_blocks(layer, position - config_.sinks);
  }

  // Blocks. A cache writes only to blocks it holds alone: prepare_blocks copies shared ones first.

  /// Where a stream of `layer` stops being held by the cache's own rows: quantized tensors keep
  /// rows [sinks, quantized end) in blocks, unquantized ones every row past the sinks.
  std::size_t block_rows_used(Tensor t, std::size_t length, std::size_t q_end) const noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    if (lay.quantized) return q_end - lay.sinks;
    return length > lay.sinks ? length - lay.sinks : 0;
  }
  /// Blocks a layer of `length` tokens with quantized ends k_end, v_end needs.
  std::size_t blocks_for(std::size_t length, std::size_t k_end, std::size_t v_end) const noexcept {
    const std::size_t rows =
        std::max(block_rows_used(Tensor::keys, length, k_end), block_rows_used(Tensor::values, length, v_end));
    return (rows + block_rows_ - 1) / block_rows_;
  }
  /// First block row a write from `length` tokens with quantized ends k_end, v_end touches.
  std::size_t first_block_row(std::size_t length, std::size_t k_end, std::size_t v_end) const noexcept {
    return std::min(block_rows_used(Tensor::keys, length, k_end), block_rows_used(Tensor::values, length, v_end));
  }
  std::size_t truncated_end(Tensor t, std::size_t layer, std::size_t length) const noexcept {
    return std::min(quantized_end(t, layer), layouts_[index(t)].quantized_end(length));
  }

  /// Blocks a write to blocks [first_row / B, needed) of `layer` takes anew: copies of the shared
  /// ones and the missing ones.
  std::size_t blocks_wanted(std::size_t layer, std::size_t first_row, std::size_t needed) const noexcept {
    const std::vector<BlockId>& table = tables_[layer];
    std::size_t copies = 0;
    for (std::size_t k = first_row / block_rows_; k < std::min(needed, table.size()); ++k)
      copies += store_->shared(table[k]);
    return copies + (needed > table.size() ? needed - table.size() : 0);
  }
  /// Adds `blocks` to `reserved`; throws kvq::Error (capacity_exceeded) naming what needs them
  /// ("layer 3", "truncate to 490") when the store has fewer free. Allocates nothing otherwise.
  void reserve_blocks(BlockReservation& reserved, std::size_t blocks, const char* what, std::size_t number) const {
    std::size_t free = 0;
    if (blocks != 0 && !reserved.add(blocks, &free))
      throw Error(ErrorCode::capacity_exceeded, std::string(what) + " " + std::to_string(number) + ": needs " +
                                                    std::to_string(blocks) + " more blocks of " +
                                                    std::to_string(block_rows_) + " positions, " +
                                                    std::to_string(free) + " free");
  }
  /// Makes blocks [first_row / B, needed) of `layer` writable: shared ones are copied, missing
  /// ones acquired, all from blocks reserved first, so it is refused before it copies anything.
  void prepare_blocks(std::size_t layer, std::size_t first_row, std::size_t needed) {
    BlockReservation reserved(*store_);
    reserve_blocks(reserved, blocks_wanted(layer, first_row, needed), "layer", layer);
    prepare_blocks(layer, first_row, needed, reserved);
  }
  /// As above, taking the new blocks from `reserved`, which holds blocks_wanted() of them. A refused
  /// allocation (out_of_memory) acquires nothing new; copies already made stay (the same bytes).
  void prepare_blocks(std::size_t layer, std::size_t first_row, std::size_t needed, BlockReservation& reserved) {
    std::vector<BlockId>& table = tables_[layer];
    for (std::size_t k = first_row / block_rows_; k < std::min(needed, table.size()); ++k) {
      if (!store_->shared(table[k])) {
        store_->written(table[k]);  // hashes of its bytes (KVPool::block_hashes) are due again
        continue;
      }
      const BlockId copy = reserved.take();
      std::memcpy(store_->data(copy), store_->data(table[k]), store_->block_bytes());
      store_->release(table[k]);
      table[k] = copy;
    }
    const std::size_t before = table.size();
    table.reserve(needed);
    try {
      while (table.size() < needed) table.push_back(reserved.take());
    } catch (...) {
      release_blocks(layer, before);
      throw;
    }
  }
  /// Lets go of the blocks of `layer` from `keep` on.
  void release_blocks(std::size_t layer, std::size_t keep) noexcept {
    std::vector<BlockId>& table = tables_[layer];
    for (std::size_t k = keep; k < table.size(); ++k) store_->release(table[k]);
    if (keep < table.size()) table.resize(keep);
  }
  void release_blocks() noexcept {
    if (store_ == nullptr) return;  // moved from
    for (std::size_t l = 0; l < tables_.size(); ++l) release_blocks(l, 0);
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
    return lay.params_before(row) * size_of(lay.spec.param);
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
      throw Error(ErrorCode::capacity_exceeded,
                  "layer " + std::to_string(layer) + ": appending " + std::to_string(tokens) + " tokens to " +
                      std::to_string(lengths_[layer]) + " exceeds the capacity of " + std::to_string(shape_.capacity));
    for (const Tensor t : {Tensor::keys, Tensor::values}) {
      const std::span<const float> data = t == Tensor::keys ? keys : values;
      const float limit = t == Tensor::keys ? overflow_threshold(config_.residual)
                                            : std::min(overflow_threshold(config_.residual), value_limit());
      if (!all_below(data.data(), data.size(), limit)) {
        for (std::size_t i = 0; i < data.size(); ++i) {
          const float x = data[i];
          if (std::fabs(x) < limit) continue;
          throw value_error(t, layer, position, i, x, rotation(t) != nullptr);
        }
      }
      check_groups(t, layer, position, tokens, data);
    }
    return tokens;
  }

  /// Every group the append will quantize must have representable parameters.
  void check_groups(Tensor t, std::size_t layer, std::size_t position, std::size_t tokens,
                    std::span<const float> input) const {
    const StreamLayout& lay = layouts_[index(t)];
    const std::size_t begin = quantized_end(t, layer), end = std::max(begin, lay.quantized_end(position + tokens));
    if (begin == end) return;
    const QuantizerSpec& spec = lay.spec;
    // Every value reaching a group is stored in the residual type first, so a group spanning
    // that type's whole range bounds them all (true for f16 storage with 2+ bit f16 params).
    const float most = max_finite(lay.residual);
    // An outlier's correction is at most the group's span (both the value and its decoding lie in it).
    auto corrections_fit = [&](float lo, float hi) {
      return spec.outliers == 0 || std::isfinite(round_to(spec.param, (hi - lo) * 1.001f));
    };
    if (kernels::reference::representable(kernels::reference::make_params(spec, -most, most)) &&
        corrections_fit(-most, most))
      return;
    const std::size_t dim = shape_.head_dim;
    float row[max_head_dim], scratch[max_head_dim];
    for (std::size_t h = 0; h < shape_.kv_heads; ++h) {
      auto load = [&](std::size_t p) {  // the row as it will sit in the ring
        if (p < position) return read_stored_row(t, layer, h, p, row);
        store_row(lay.residual, input.data() + ((p - position) * shape_.kv_heads + h) * dim, dim, scratch);
        load_row(lay.residual, scratch, dim, row);
      };
      auto check = [&](float lo, float hi, std::size_t p, std::size_t channel) {
        if (!corrections_fit(lo, hi))
          throw Error(ErrorCode::unrepresentable,
                      where(t, layer, h, p) + channel_text(t, channel) + ": the group spanning [" + std::to_string(lo) +
                          ", " + std::to_string(hi) + "] may need an outlier correction beyond " +
                          to_string(spec.param) + "'s range of " + std::to_string(max_finite(spec.param)));
        if (kernels::reference::representable(kernels::reference::make_params(spec, lo, hi))) return;
        throw Error(ErrorCode::unrepresentable,
                    where(t, layer, h, p) + channel_text(t, channel) + ": the group spanning [" + std::to_string(lo) +
                        ", " + std::to_string(hi) + "] needs a scale or zero point beyond " + to_string(spec.param) +
                        "'s range of " + std::to_string(max_finite(spec.param)) +
                        (spec.mode == Mode::iq4_nl ? " (or, past 2^36, overflows iq4_nl's least-squares fit)" : ""));
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

  /// Floats of scratch: one due per-channel group per layer (appends to different layers may run
  /// concurrently); a group longer than the stream never comes due.
  static std::size_t scratch_floats(const CacheShape& shape, const StreamLayout& k, const StreamLayout& v) noexcept {
    auto due_rows = [](const StreamLayout& lay) {
      return lay.quantized && lay.spec.axis == Axis::per_channel ? std::min(lay.spec.group, lay.ring_rows) : 1;
    };
    return std::max(due_rows(k), due_rows(v)) * shape.head_dim * shape.layers;
  }

  /// Blocks of a cache's own store: every block of the capacity twice, since load() fills new
  /// blocks before it lets go of the old.
  static std::size_t own_store_blocks(const CacheShape& shape, const CacheConfig& config, std::size_t block_rows) {
    const std::size_t per_layer =
        (std::max<std::size_t>(shape.capacity, config.sinks + 1) - config.sinks + block_rows - 1) / block_rows;
    const std::size_t blocks = checked_mul(checked_mul(per_layer, shape.layers, "cache blocks"), 2, "cache blocks");
    check_limit(blocks, BlockStore::max_blocks_limit, "cache blocks");
    return blocks;
  }

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
    const std::size_t old_length = lengths_[layer], end = quantized_end(t, layer), row = row_size(lay);
    const std::size_t s = lay.sinks, ring_rows = lay.ring_rows, floor = rollback_floor(t, layer);
    if (length < s && old_length > length)
      std::memset(own_base(t, layer, head) + lay.sink_offset + length * row, 0,
                  (std::min(s, old_length) - length) * row);
    // The ring of `length` tokens holds positions [first, length); those before `pushed_out`
    // left the ring for the history, and slots no position uses are zero.
    const std::size_t first = length > s + ring_rows ? length - ring_rows : s;
    const std::size_t pushed_out = old_length > s + ring_rows ? old_length - ring_rows : s;
    for (std::size_t p = first; p < std::min(length, pushed_out); ++p) {
      if (p >= floor && lay.history_rows != 0)
        std::memcpy(ring_row(t, layer, head, p), history_row(t, layer, head, p), row);
      else
        std::memset(ring_row(t, layer, head, p), 0, row);
    }
    for (std::size_t p = std::max(length, s); p < std::min(old_length, s + ring_rows); ++p)
      if (ring_row_held(t, layer, p)) std::memset(ring_row(t, layer, head, p), 0, row);
    if (target < end) zero_packed(t, layer, head, target - s, end - s);
  }

  /// Zeroes packed rows [a, b) (whole groups) and their parameters, where their blocks are held.
  void zero_packed(Tensor t, std::size_t layer, std::size_t head, std::size_t a, std::size_t b) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    for (std::size_t r = a; r < b && in_blocks(layer, r);) {
      const std::size_t n = std::min(b - r, block_rows_ - r % block_rows_), param_bytes = param_offset(lay, n);
      std::memset(code_row(t, layer, head, r), 0, n * lay.row_bytes);
      const auto [scales, zeros] = params_of(t, layer, head, r);
      std::memset(scales, 0, param_bytes);
      if (lay.spec.has_zero_point()) std::memset(zeros, 0, param_bytes);
      if (const auto o = outliers_of(t, layer, head, r); o.slots != nullptr) {
        std::memset(o.slots, 0, param_bytes / size_of(lay.spec.param) * lay.spec.outliers * 2);
        std::memset(o.corrections, 0, param_bytes * lay.spec.outliers);
      }
      r += n;
    }
  }

  // The first half of truncate and erase: the checks, then a private copy of every shared block
  // the change would write to. That can fail (capacity_exceeded) and changes nothing visible, so
  // a caller holding several caches (KVPool's layer groups) prepares them all before changing any.
  // The blocks of every layer's copies are reserved before the first is made: by the caller that
  // prepares several caches (reserve_truncate, reserve_erase), else here.
  void prepare_truncate(std::size_t length) {
    BlockReservation reserved = reserve_truncate(length);
    prepare_truncate(length, reserved);
  }
  void prepare_erase(std::size_t first, std::size_t count) {
    BlockReservation reserved = reserve_erase(first, count);
    prepare_erase(first, count, reserved);
  }
  /// truncate(length)'s (erase(first, count)'s) checks, and the blocks it takes anew reserved.
  BlockReservation reserve_truncate(std::size_t length) {
    check_truncate(length);
    std::size_t blocks = 0;
    for (std::size_t l = 0; l < shape_.layers; ++l)
      if (length < lengths_[l]) {
        const std::size_t k_end = truncated_end(Tensor::keys, l, length),
                          v_end = truncated_end(Tensor::values, l, length);
        blocks += blocks_wanted(l, first_block_row(length, k_end, v_end), blocks_for(length, k_end, v_end));
      }
    BlockReservation reserved(*store_);
    reserve_blocks(reserved, blocks, "truncate to", length);
    return reserved;
  }
  BlockReservation reserve_erase(std::size_t first, std::size_t count) {
    BlockReservation reserved(*store_);
    if (count == 0) return reserved;
    check_erase(first, count);
    std::size_t blocks = 0;
    for (std::size_t l = 0; l < shape_.layers; ++l)
      blocks += blocks_wanted(l, first - config_.sinks, tables_[l].size());
    reserve_blocks(reserved, blocks, "erase at", first);
    return reserved;
  }
  void prepare_truncate(std::size_t length, BlockReservation& reserved) {
    for (std::size_t l = 0; l < shape_.layers; ++l)
      if (length < lengths_[l]) {
        const std::size_t k_end = truncated_end(Tensor::keys, l, length),
                          v_end = truncated_end(Tensor::values, l, length);
        prepare_blocks(l, first_block_row(length, k_end, v_end), blocks_for(length, k_end, v_end), reserved);
      }
  }
  void prepare_erase(std::size_t first, std::size_t count, BlockReservation& reserved) {
    if (count == 0) return;
    for (std::size_t l = 0; l < shape_.layers; ++l)
      prepare_blocks(l, first - config_.sinks, tables_[l].size(), reserved);
  }

  /// Bytes erase() stages the pending rows that move in (one stream's ring).
  /// Bytes erase(first, count) stages: the full-precision rows after the range that move down
  /// (at most a ring's rows; an unquantized tensor's ring spans the capacity).
  std::size_t erase_staging_bytes(std::size_t first, std::size_t count) const noexcept {
    const std::size_t end = saturating_add(first, count);
    std::size_t moved = 0;
    for (const std::size_t length : lengths_) moved = std::max(moved, length > end ? length - end : 0);
    return std::max(std::min(moved, layouts_[0].ring_rows) * row_size(layouts_[0]),
                    std::min(moved, layouts_[1].ring_rows) * row_size(layouts_[1]));
  }
  /// The second half of erase, after prepare_erase: cannot fail. `staged`:
  /// erase_staging_bytes(first, count).
  void erase_prepared(std::size_t first, std::size_t count, std::uint8_t* staged) noexcept {
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        std::size_t& end = quantized_ends_[l * 2 + index(t)];
        const std::size_t new_end = end <= first ? end : end <= first + count ? first : end - count;
        for (std::size_t h = 0; h < shape_.kv_heads; ++h) move_down(t, l, h, first, count, end, new_end, staged);
        // The history is by position, which the shift changed: rollback starts afresh from here.
        end = history_begins_[l * 2 + index(t)] = kept_from_[l * 2 + index(t)] = new_end;
      }
      lengths_[l] -= count;
      release_blocks(l, blocks_for(lengths_[l], quantized_end(Tensor::keys, l), quantized_end(Tensor::values, l)));
    }
  }

  /// Validates erase(first, count) completely.
  void check_erase(std::size_t first, std::size_t count) const {
    const std::string range = "erasing " + std::to_string(count) + " positions from " + std::to_string(first);
    if (first < config_.sinks)
      throw Error(ErrorCode::invalid_argument,
                  range + ": the first " + std::to_string(config_.sinks) + " positions are sink tokens and are kept");
    bool moves = false;
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      if (count > lengths_[l] || first > lengths_[l] - count)
        throw Error(ErrorCode::invalid_argument,
                    range + ": layer " + std::to_string(l) + " holds " + std::to_string(lengths_[l]) + " tokens");
      moves = moves || first + count < lengths_[l];
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const StreamLayout& lay = layouts_[index(t)];
        const std::size_t end = quantized_end(t, l), g = packing_unit(config_, t == Tensor::keys);
        if (g == 1) continue;
        const char *unit = lay.flush ? "flush" : "group", *units = lay.flush ? "flushes" : "groups";
        if (first < end && (first - lay.sinks) % g != 0)
          throw Error(ErrorCode::unsupported,
                      range + ": layer " + std::to_string(l) + " would split the packed " + to_string(t) + " " + unit +
                          " starting at " + std::to_string(first - (first - lay.sinks) % g) + " (" + units + " of " +
                          std::to_string(g) + " from position " + std::to_string(lay.sinks) + ")");
        if (end > first + count && count % g != 0)
          throw Error(ErrorCode::unsupported, range + ": layer " + std::to_string(l) + " would move packed " +
                                                  to_string(t) + " " + units + " by " + std::to_string(count) +
                                                  " positions, not a multiple of their " + std::to_string(g));
      }
    }
    if (moves && config_.key_rope == KeyRope::post && shape_.rope_style != RopeStyle::none)
      throw Error(ErrorCode::unsupported, range +
                                              ": keys are stored post-RoPE and would keep their old positions' "
                                              "rotation; a cache that shifts its context stores keys pre-RoPE");
  }

  /// erase's move of one stream of one head, `end` its quantized end before the move and
  /// `new_end` after: packed rows and their parameters after the range move down by count, then
  /// the pending rows after it (through `staged`, since their ring slots may overlap). Bytes left
  /// behind become zero.
  void move_down(Tensor t, std::size_t layer, std::size_t head, std::size_t first, std::size_t count, std::size_t end,
                 std::size_t new_end, std::uint8_t* staged) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    if (end > first + count) {  // by runs within one block at both ends (group-aligned: B is whole groups)
      for (std::size_t from = first + count - lay.sinks, to = first - lay.sinks, left = end - first - count;
           left != 0;) {
        const std::size_t n = std::min({left, block_rows_ - from % block_rows_, block_rows_ - to % block_rows_});
        std::memmove(code_row(t, layer, head, to), code_row(t, layer, head, from), n * lay.row_bytes);
        const auto [to_scales, to_zeros] = params_of(t, layer, head, to);
        const auto [from_scales, from_zeros] = params_of(t, layer, head, from);
        std::memmove(to_scales, from_scales, param_offset(lay, n));
        if (lay.spec.has_zero_point()) std::memmove(to_zeros, from_zeros, param_offset(lay, n));
        if (lay.spec.outliers > 0) {
          const auto to_o = outliers_of(t, layer, head, to), from_o = outliers_of(t, layer, head, from);
          const std::size_t entries = param_offset(lay, n) / size_of(lay.spec.param) * lay.spec.outliers;
          std::memmove(to_o.slots, from_o.slots, entries * 2);
          std::memmove(to_o.corrections, from_o.corrections, entries * size_of(lay.spec.param));
        }
        from += n, to += n, left -= n;
      }
    }
    if (new_end < end) zero_packed(t, layer, head, new_end - lay.sinks, end - lay.sinks);
    const std::size_t row = row_size(lay), length = lengths_[layer];
    const std::size_t src = std::max(end, first + count);
    for (std::size_t p = src; p < length; ++p) std::memcpy(staged + (p - src) * row, ring_row(t, layer, head, p), row);
    for (std::size_t p = std::max(end, first); p < length; ++p) std::memset(ring_row(t, layer, head, p), 0, row);
    for (std::size_t p = src; p < length; ++p)
      std::memcpy(ring_row(t, layer, head, p - count), staged + (p - src) * row, row);
  }

  const std::vector<Codebook>& head_codebooks(Tensor t) const noexcept {
    return t == Tensor::keys ? config_.key_head_codebooks : config_.value_head_codebooks;
  }
  /// The quantizer of KV head `head`'s rows of tensor t: the layout's, with the head's own codebook.
  QuantizerSpec head_spec(Tensor t, std::size_t head) const noexcept {
    QuantizerSpec spec = layouts_[index(t)].spec;
    if (!head_codebooks(t).empty()) spec.codebook = head_codebooks(t)[head];
    return spec;
  }

  // The commit half of append: noexcept, since check_append has validated everything.

  void write_row(Tensor t, std::size_t layer, std::size_t head, std::size_t p, const float* x) noexcept {
    const StreamLayout& lay = layouts_[index(t)];
    std::uint8_t* dest =
        p < lay.sinks ? own_base(t, layer, head) + lay.sink_offset + p * row_size(lay) : ring_row(t, layer, head, p);
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
    const std::size_t row0 = begin - lay.sinks;
    if (lay.spec.axis == Axis::per_token) {             // read in place from the ring, every head's row in one call
      const bool one_spec = head_codebooks(t).empty();  // else a call per head, with its codebook
      for (std::size_t q = begin; q < end; ++q)
        for (std::size_t h = 0; h < shape_.kv_heads; h += one_spec ? shape_.kv_heads : 1) {
          const auto [scales, zeros] = params_of(t, layer, h, q - lay.sinks);
          kernels::quantize_rows_per_token(head_spec(t, h), lay.residual, ring_row(t, layer, h, q),
                                           one_spec ? shape_.kv_heads : 1, dim, head_bytes_, scales, zeros,
                                           block_head_bytes_, code_row(t, layer, h, q - lay.sinks), block_head_bytes_,
                                           outliers_of(t, layer, h, q - lay.sinks));
        }
      keep_rows(t, layer, begin, end);
      return;
    }
    // Group by group (a flush makes several due at once, and they may span blocks): read in place
    // from the ring unless the group wraps around its end (a window that is not a multiple of the
    // group), then through the scratch rows as floats.
    const std::size_t g = lay.spec.group;
    float* const scratch = scratch_.data() + layer * (scratch_.size() / shape_.layers);
    for (std::size_t h = 0; h < shape_.kv_heads; ++h) {
      const std::uint8_t* ring = own_base(t, layer, h) + lay.ring_offset;
      const QuantizerSpec spec = head_spec(t, h);
      for (std::size_t row = row0; row < end - lay.sinks; row += g) {
        const std::size_t slot = row % lay.ring_rows;
        const auto [scales, zeros] = params_of(t, layer, h, row);
        std::uint8_t* codes = code_row(t, layer, h, row);
        if (slot + g <= lay.ring_rows) {
          kernels::quantize_block_per_channel(spec, lay.residual, ring + slot * row_bytes, g, dim, row_bytes, scales,
                                              zeros, codes, lay.row_bytes, scratch, outliers_of(t, layer, h, row));
          continue;
        }
        for (std::size_t r = 0; r < g; ++r)
          load_row(lay.residual, ring + (row + r) % lay.ring_rows * row_bytes, dim, scratch + r * dim);
        kernels::quantize_block_per_channel(spec, scratch, g, dim, dim, scales, zeros, codes, lay.row_bytes,
                                            outliers_of(t, layer, h, row));
      }
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
      const std::uint8_t* ring = own_base(t, layer, h) + lay.ring_offset;
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
    const std::size_t first_in_ring =
        length > lay.sinks && length - lay.sinks > lay.ring_rows ? length - lay.ring_rows : lay.sinks;
    std::size_t& floor = history_begins_[layer * 2 + index(t)];
    floor = std::max(floor, std::min(kept_from_[layer * 2 + index(t)], first_in_ring));
  }

  OwnRowsCharge charge_;  // own rows in the store's limit (a pool's sequences); first, so taken before they exist
  CacheShape shape_;
  CacheConfig config_;
  std::array<std::shared_ptr<const HadamardTransform>, 2> rotations_;  // keys, values; null: not rotated
  StreamLayout layouts_[2];
  std::shared_ptr<const RopeTable> rope_;
  std::shared_ptr<BlockStore> store_;
  std::size_t block_rows_ = 0;        // positions per block
  std::size_t block_head_bytes_ = 0;  // one KV head's key and value sections of a block
  std::size_t head_bytes_ = 0;        // one KV head's own rows, keys then values
  AlignedBuffer own_;                 // (layers, kv_heads): sinks and rings
  std::size_t head_history_bytes_ = 0;
  AlignedBuffer history_;                     // (layers, kv_heads): key then value rollback rows, a ring by position
  std::vector<std::vector<BlockId>> tables_;  // (layers): block k holds positions [sinks + kB, sinks + (k + 1)B)
  std::vector<std::size_t> lengths_;
  std::vector<float> key_peaks_;             // (layers): see key_peak
  std::vector<float> value_peaks_;           // (layers): see value_peak
  std::vector<std::size_t> quantized_ends_;  // (layers, 2): first unquantized key / value position
  std::vector<std::size_t> history_begins_;  // (layers, 2): rollback floor: rows from here on are held
  std::vector<std::size_t> kept_from_;       // (layers, 2): the history holds packed rows [kept_from, quantized end)
  std::vector<float> scratch_;               // (layers): one group of due rows, as floats
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
