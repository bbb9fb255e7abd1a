#pragma once
// KVPool: the caches of many sequences in one paged store, as a serving engine keeps them.
//
//   add_sequence / fork / load_sequence -> SequenceId
//   append, truncate, erase             -> the sequence's BasicKVCache rules, all-or-nothing
//   reorder(ids, sources)               -> beam search: each beam takes a source's tokens
//   layer(id, l)                        -> one layer as attention reads it: {cache, layer}
//   sequence(id)                        -> (one configuration) a BasicKVCache: decode_attention,
//                                          reference_attention, metrics and save() take it as
//                                          they take a KVCache
//   save_sequence(id, out)              -> one sequence and its blocks (a session file);
//                                          load_sequence(in) restores it under a new id
//   save(out) / load(in)                -> every sequence of the pool, blocks shared as they
//   save_file(path) / load_file(path)      were; files are written beside and renamed into place
//   block_hashes / share_prefixes       -> find and share a common prompt prefix across sequences
//   common_prefix(ids, l)               -> the positions they store alike: cascade attention reads
//                                          them once for all (AttentionRequest::seen_end)
//
// Memory is committed as sequences reach new positions (in slabs of about 2 MiB of blocks). The
// pool's limit counts the blocks sequences hold and each sequence's own rows: a new sequence is
// refused (capacity_exceeded) when they do not fit. Freed blocks stay committed for reuse until own
// rows need the room, then go back a slab at a time (BlockStore); a change that copies shared
// blocks, and a load (its blocks and its sequences' own rows), reserves them all first, so no
// operation in another thread can refuse it midway. Every sequence shares the RoPE tables.
// fork(id, length) shares the parent's blocks by reference count and copies only its own rows
// (sinks, ring, rollback copies): a block is copied only when a sequence holding a shared one
// writes to it, so a shared prompt costs its packed bytes once. A sequence's bytes do not depend
// on how its tokens arrived, so attention over a pool sequence is bit-identical to attention over
// a KVCache of the same shape, configuration and block length that received the same tokens.
//
// A pool may hold a configuration per layer (kvq-eval --advise chooses one) and a RoPE per layer
// (Gemma 3 rotates its local and global layers differently): the layers of one configuration and
// RoPE form a group with a block store, and a sequence is one cache per group. Truncate and erase
// check, and copy the shared blocks they write to, in every group before changing any.
//
// Thread safety: const operations may run concurrently with each other and with append,
// truncate and erase of other sequences; append, truncate and erase of different sequences may
// run concurrently. add_sequence, fork, reorder, load_sequence, remove_sequence, save_sequence,
// save, load and share_prefixes wait for the operations in flight and run alone (add_sequence and
// load_sequence build the new caches first, beside them). Two operations on one sequence need the
// caller's synchronisation.
//
// Pool file (format version 2), in the writer's byte order and with the sections of a cache file
// (serialize.hpp: u32 tag | u64 size | payload | u32 CRC-32C):
//   "KVQ_POOL"  u32 format version  u32 byte-order marker 0x01020304
//   section "header": as a cache file's (version 2) for sequence_shape(): shape, RoPE, and the
//                     configuration text: one configuration, or one per layer (parse_layer_configs)
//   section "ropes":  per layer, its RoPE as the header holds one (style, theta, extension)
//   section "table":  u64 block_tokens, memory_blocks, next sequence id, sequences S, blocks N |
//                     per sequence: u64 id | per layer: its cache-file table entry, u64 n, n u64
//                     indices of the blocks it refers to (position order)
//   N sections "block": block_bytes(layer) bytes each (the layers that refer to a block have one
//                     configuration), stored once however many sequences share it
//   per sequence, per layer, a section "own rows": its sinks, ring and rollback rows (as in a
//                     cache file's layer section, without what lives in blocks)
// Shared prefixes stay shared: after load, sequences refer to one copy of each block as they did,
// and memory().used and .shared are what they were when saved. Version 1 files (no "ropes": every
// layer rotated by the header's RoPE) are still read.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvq/cache/block_store.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/cache/layered_kv_cache.hpp"
#include "kvq/cache/serialize.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/error.hpp"

namespace kvq::inline v0 {

struct PoolShape {
  std::size_t layers = 1;
  std::size_t kv_heads = 1;
  std::size_t head_dim = 128;
  std::size_t max_tokens = 4096;  // longest sequence: the RoPE tables cover these positions
  // Positions per block, a multiple of block_unit(config): memory is committed and shared in
  // these steps, and decode attention sets up once per block (256: 1.04x to 1.15x the time of
  // one block per step at 32K; bench/RESULTS.md).
  std::size_t block_tokens = 256;
  // The pool's memory budget in blocks: the blocks sequences hold and each sequence's own rows
  // (sinks, window ring, rollback copies, scratch) in whole blocks, charged while it lives. Blocks
  // freed stay committed for reuse until own rows need the room, then go back a slab at a time;
  // less than a slab, and the free blocks of slabs in use, may stay committed above the limit
  // (memory().committed; BlockStore). Split between the stores of a pool whose layers differ in
  // configuration or RoPE by their layers.
  std::size_t memory_blocks = 1024;
  RopeStyle rope_style = RopeStyle::adjacent_pairs;
  float rope_theta = 10000.0f;
  std::size_t rope_dims = 0;  // channels RoPE rotates from the start of each head; 0 = head_dim
  RopeScaling rope_scaling{};

  /// The shape of each sequence's cache.
  CacheShape sequence_shape() const {
    return CacheShape{.layers = layers,
                      .kv_heads = kv_heads,
                      .head_dim = head_dim,
                      .capacity = max_tokens,
                      .rope_style = rope_style,
                      .rope_theta = rope_theta,
                      .rope_dims = rope_dims,
                      .rope_scaling = rope_scaling,
                      .block_tokens = block_tokens};
  }
};

using SequenceId = std::uint64_t;

namespace detail {
/// 64-bit hash of n bytes continuing from h: a multiply-xorshift mix per 8-byte word, fast and
/// well spread, not cryptographic (KVPool::share_prefixes confirms every match byte for byte).
inline std::uint64_t hash_bytes(const void* data, std::size_t n, std::uint64_t h) noexcept {
  const auto* p = static_cast<const std::uint8_t*>(data);
  auto mix = [](std::uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  };
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = mix(h ^ (w * 0x9E3779B97F4A7C15ull));
  }
  std::uint64_t tail = 0;
  std::memcpy(&tail, p + i, n - i);
  return mix(h ^ (tail * 0x9E3779B97F4A7C15ull) ^ n);
}
}  // namespace detail

/// Bytes of a pool, counting each block once however many sequences share it.
struct PoolMemory {
  std::size_t committed = 0;  // blocks allocated (in use or free for reuse) and the sequences' own rows
  std::size_t used = 0;       // blocks some sequence refers to and the sequences' own rows
  std::size_t shared = 0;     // blocks more than one sequence refers to
  std::size_t own = 0;        // the sequences' own rows: sinks, rings, rollback copies, scratch
};

class KVPool {
 public:
  /// Every layer in one configuration.
  KVPool(const PoolShape& shape, const CacheConfig& config)
      : KVPool(shape, std::vector<CacheConfig>(checked_layers(shape), config)) {}

  /// A configuration per layer (parse_layer_configs; kvq-eval --advise prints one), every layer
  /// rotated by the shape's RoPE.
  KVPool(const PoolShape& shape, const std::vector<CacheConfig>& configs)
      : KVPool(shape, configs, std::vector<RopeConfig>(checked_layers(shape), shape.sequence_shape().rope())) {}

  /// As above with each layer's own RoPE, `ropes` (one per layer, for the shape's head_dim and
  /// position_offset 0; see LayeredKVCache for layers without RoPE). Layers of one configuration
  /// and RoPE form a group with a block store; shape.memory_blocks is split between the stores by
  /// their share of the layers (every layer of a sequence holds the same number of blocks), and
  /// block_tokens must be a multiple of every configuration's block_unit.
  KVPool(const PoolShape& shape, const std::vector<CacheConfig>& configs, std::span<const RopeConfig> ropes)
      : shape_(shape) {
    if (configs.size() != shape.layers)
      throw Error(ErrorCode::shape_mismatch, "pool: " + std::to_string(configs.size()) + " configurations for " +
                                                 std::to_string(shape.layers) + " layers");
    if (ropes.size() != shape.layers)
      throw Error(ErrorCode::shape_mismatch, "pool: " + std::to_string(ropes.size()) + " RoPE configurations for " +
                                                 std::to_string(shape.layers) + " layers");
    if (shape.layers == 0) throw Error(ErrorCode::invalid_argument, "pool shape needs at least one layer");
    checked_layers(shape);
    if (shape.memory_blocks == 0)
      throw Error(ErrorCode::invalid_argument, "pool shape: memory_blocks must be at least 1");
    check_limit(shape.memory_blocks, BlockStore::max_blocks_limit, "pool shape: memory_blocks");
    if (shape.block_tokens == 0)
      throw Error(ErrorCode::invalid_argument,
                  "pool shape: block_tokens must be a positive multiple of " + std::to_string(block_unit(configs[0])));
    const CacheShape cache = shape.sequence_shape();  // its RoPE is what pool files' headers record
    try {
      validate(cache.rope());
    } catch (const Error& e) {
      throw Error(e.code(), "pool shape: " + e.message());
    }
    where_.resize(shape.layers);
    for (std::size_t l = 0; l < shape.layers; ++l) {
      const CacheConfig& config = configs[l];
      const CacheShape own = detail::with_rope(cache, ropes[l], "pool", l);
      try {
        validate(own, config);
      } catch (const Error& e) {
        throw Error(e.code(), "pool, layer " + std::to_string(l) + ": " + e.message());
      }
      std::size_t g = 0;
      while (g < groups_.size() && !(groups_[g].config == config && same_rotation(groups_[g].shape.rope(), own.rope())))
        ++g;
      if (g == groups_.size()) groups_.push_back(LayerGroup{config, own, {}, 0, nullptr, nullptr});
      where_[l] = {g, groups_[g].layers.size()};
      groups_[g].layers.push_back(l);
    }
    std::vector<std::shared_ptr<const RopeTable>> tables;
    for (LayerGroup& group : groups_) {
      group.shape.layers = group.layers.size();
      group.block_bytes = BasicKVCache::block_bytes(group.shape, group.config);
      const std::size_t share =
          checked_mul(shape.memory_blocks, group.layers.size(), "pool shape: memory_blocks x layers");
      const std::size_t blocks = share / shape.layers + (share % shape.layers != 0);
      group.store = std::make_shared<BlockStore>(group.block_bytes, blocks, StoreLimit::blocks_and_own_rows);
      group.rope = detail::shared_table(tables, group.shape.rope(), shape.max_tokens);
      group.own_blocks = group.store->blocks_holding(BasicKVCache::own_bytes(group.shape, group.config));
    }
  }
  KVPool(const KVPool&) = delete;
  KVPool& operator=(const KVPool&) = delete;

  const PoolShape& shape() const noexcept { return shape_; }
  /// True when every layer has one configuration and one RoPE: sequence(id), config(),
  /// block_bytes() and blocks() need that, and load_sequence reads cache files only then.
  bool uniform() const noexcept { return groups_.size() == 1; }
  const CacheConfig& config() const { return uniform_group("config()").config; }
  const CacheConfig& config(std::size_t layer) const { return groups_[locate(layer, "config").group].config; }
  std::vector<CacheConfig> configs() const {
    std::vector<CacheConfig> out;
    for (const Place& p : where_) out.push_back(groups_[p.group].config);
    return out;
  }
  /// Bytes of one block (a block holds one layer's positions).
  std::size_t block_bytes() const { return uniform_group("block_bytes()").block_bytes; }
  std::size_t block_bytes(std::size_t layer) const { return groups_[locate(layer, "block_bytes").group].block_bytes; }
  const BlockStore& blocks() const { return *uniform_group("blocks()").store; }
  /// Blocks of the limit that each sequence's own rows (sinks, window ring, rollback copies,
  /// scratch) take while it lives, beside the blocks its tokens fill: what an engine plans its
  /// batch with.
  std::size_t own_row_blocks() const { return uniform_group("own_row_blocks()").own_blocks; }
  std::size_t own_row_blocks(std::size_t layer) const {
    return groups_[locate(layer, "own_row_blocks").group].own_blocks;
  }
  /// The store holding `layer`'s blocks (shared with the layers of the same configuration and RoPE).
  const BlockStore& blocks(std::size_t layer) const { return *groups_[locate(layer, "blocks").group].store; }
  /// The RoPE table of every layer; kvq::Error (unsupported) when the layers rotate differently:
  /// read each layer's with rope(layer) then.
  const RopeTable& rope() const {
    for (const LayerGroup& g : groups_)
      if (g.rope != groups_[0].rope)
        throw Error(ErrorCode::unsupported, "pool rope(): the layers rotate differently; read rope(layer)");
    return *groups_[0].rope;
  }
  /// Layer `layer`'s RoPE table (shared by the layers of one RoPE).
  const RopeTable& rope(std::size_t layer) const { return *groups_[locate(layer, "rope").group].rope; }

  /// A new, empty sequence. Its own rows (sinks, ring, rollback copies) are allocated now and
  /// charged to the pool's limit in whole blocks; capacity_exceeded when they do not fit.
  SequenceId add_sequence() {
    Sequence seq;
    for (std::size_t g = 0; g < groups_.size(); ++g) seq.push_back(empty_cache(g));
    std::unique_lock lock(mutex_);
    return insert(std::move(seq));
  }

  /// A new sequence holding the first `length` tokens of `parent` (every layer), sharing its
  /// blocks. Exact where truncating the parent to `length` would be (CacheConfig::rollback_depth);
  /// otherwise throws kvq::Error and nothing changes.
  SequenceId fork(SequenceId parent, std::size_t length) {
    std::unique_lock lock(mutex_);
    const Sequence& from = find(parent, "fork");
    Sequence child;
    for (std::size_t g = 0; g < groups_.size(); ++g) child.push_back(std::make_unique<BasicKVCache>(*from[g], length));
    return insert(std::move(child));
  }

  /// Drops a sequence and lets go of its blocks.
  void remove_sequence(SequenceId id) {
    std::unique_lock lock(mutex_);
    (void)find(id, "remove_sequence");
    sequences_.erase(id);
  }

  /// Beam search's reorder: afterwards sequence ids[i] holds what sequence ids[sources[i]] held,
  /// for every i at once (a sequence may continue as several beams, or as none). A beam that takes
  /// another's tokens shares its blocks, as fork does, in the own rows of a sequence that no beam
  /// continues, so a reorder needs no room in the pool's limit. Throws kvq::Error, and nothing
  /// changes: invalid_argument for spans of different lengths, an unknown or repeated id, or a
  /// source index out of range; out_of_memory when the system refuses its bookkeeping. Caches
  /// move between ids: a view taken before (sequence, layer) may show another beam after.
  void reorder(std::span<const SequenceId> ids, std::span<const std::size_t> sources) {
    std::unique_lock lock(mutex_);
    with_memory_errors("pool reorder", [&] { reorder_locked(ids, sources); });
  }

  bool contains(SequenceId id) const {
    std::shared_lock lock(mutex_);
    return sequences_.count(id) != 0;
  }
  std::size_t sequence_count() const {
    std::shared_lock lock(mutex_);
    return sequences_.size();
  }

  /// BasicKVCache::append on one layer of one sequence; capacity_exceeded names the blocks needed
  /// and free when the pool is full. All-or-nothing.
  void append(SequenceId id, std::size_t layer, std::size_t position, std::span<const float> keys,
              std::span<const float> values) {
    std::shared_lock lock(mutex_);
    const Place p = locate(layer, "append");
    with_context(id, "append", p, [&](Sequence& s) { s[p.group]->append(p.index, position, keys, values); });
  }
  /// The same from rows in the engine's layout and type (TokenRows: f16/bf16 with strides).
  void append(SequenceId id, std::size_t layer, std::size_t position, const TokenRows& keys, const TokenRows& values) {
    std::shared_lock lock(mutex_);
    const Place p = locate(layer, "append");
    with_context(id, "append", p, [&](Sequence& s) { s[p.group]->append(p.index, position, keys, values); });
  }
  /// BasicKVCache::truncate on one sequence (rolling back speculative tokens), every layer
  /// checked, and its shared blocks copied, before any changes.
  void truncate(SequenceId id, std::size_t length) {
    using Access = detail::CacheAccess;
    std::shared_lock lock(mutex_);
    with_context(id, "truncate", std::nullopt, [&](Sequence& s) {
      // Every group's checks, then every group's copies of shared blocks reserved, before any group
      // copies one: a refused call unshares none.
      for (std::size_t g = 0; g < s.size(); ++g)
        if (const auto e = s[g]->truncate_error(length)) throw Error(e->code(), relabel(e->message(), g));
      std::vector<BlockReservation> reservations;
      reservations.reserve(s.size());
      for (std::size_t g = 0; g < s.size(); ++g)
        in_group(g, [&] { reservations.push_back(Access::reserve_truncate(*s[g], length)); });
      for (std::size_t g = 0; g < s.size(); ++g)
        in_group(g, [&] { Access::prepare_truncate(*s[g], length, reservations[g]); });
      for (auto& cache : s) cache->truncate(length);  // prepared: cannot fail
    });
  }
  /// BasicKVCache::erase on one sequence (context shift), all-or-nothing as truncate.
  void erase(SequenceId id, std::size_t first, std::size_t count) {
    using Access = detail::CacheAccess;
    std::shared_lock lock(mutex_);
    with_context(id, "erase", std::nullopt, [&](Sequence& s) {
      if (count == 0) return;
      for (std::size_t g = 0; g < s.size(); ++g)
        if (const auto e = s[g]->erase_error(first, count)) throw Error(e->code(), relabel(e->message(), g));
      // Every allocation before the first change: each group's staging at once (erase of one
      // cache needs one), so a group cannot fail after another has moved its rows.
      std::vector<std::vector<std::uint8_t>> staged;
      staged.reserve(s.size());
      for (const auto& cache : s) staged.emplace_back(Access::erase_staging_bytes(*cache, first, count));
      std::vector<BlockReservation> reservations;
      reservations.reserve(s.size());
      for (std::size_t g = 0; g < s.size(); ++g)
        in_group(g, [&] { reservations.push_back(Access::reserve_erase(*s[g], first, count)); });
      for (std::size_t g = 0; g < s.size(); ++g)
        in_group(g, [&] { Access::prepare_erase(*s[g], first, count, reservations[g]); });
      for (std::size_t g = 0; g < s.size(); ++g) Access::erase_prepared(*s[g], first, count, staged[g].data());
    });
  }

  /// The sequence's cache, for attention, metrics and save(), in a uniform pool (else kvq::Error
  /// unsupported: a per-layer pool is read through layer(id, l)). Valid until the sequence is removed;
  /// after a reorder it may show another one.
  const BasicKVCache& sequence(SequenceId id) const {
    std::shared_lock lock(mutex_);
    (void)uniform_group("sequence(id)");
    return *find(id, "sequence")[0];
  }
  /// One layer of a sequence as attention reads it, in any pool: the cache holding it and its
  /// index there (decode_attention(v.cache, v.layer, ...), AttentionRequest{.cache = &v.cache,
  /// .layer = v.layer}). Valid until the sequence is removed; after a reorder it may show another one.
  struct LayerView {
    const BasicKVCache& cache;
    std::size_t layer;
  };
  LayerView layer(SequenceId id, std::size_t layer) const {
    std::shared_lock lock(mutex_);
    const Place p = locate(layer, "layer");
    return {*find(id, "layer")[p.group], p.index};
  }
  /// Positions [0, n) of `layer` that all the sequences store alike
  /// (BasicKVCache::common_prefix): the prefix a cascade reads once for them, from any one of
  /// them (a request with stored_only and seen_end = n), each sequence attending its own
  /// positions with seen_begin = n. Forks share what their parent had packed, share_prefixes
  /// what it finds; one sequence (or one named twice) stores all its positions alike.
  std::size_t common_prefix(std::span<const SequenceId> ids, std::size_t layer) const {
    std::shared_lock lock(mutex_);
    const Place p = locate(layer, "common_prefix");
    if (ids.empty()) return 0;
    const BasicKVCache& first = *find(ids[0], "common_prefix")[p.group];
    std::size_t n = first.length(p.index);
    for (const SequenceId id : ids) n = std::min(n, first.common_prefix(*find(id, "common_prefix")[p.group], p.index));
    return n;
  }
  /// Tokens `layer` of the sequence holds.
  std::size_t length(SequenceId id, std::size_t layer) const {
    const LayerView v = this->layer(id, layer);
    return v.cache.length(v.layer);
  }

  /// A new sequence, with a new id, read from a file save_sequence() wrote (of a pool with this
  /// one's shape, block length and configurations) or, in a uniform pool, from a cache file
  /// (save(pool.sequence(id), out)). On any error (kvq::Error io, shape_mismatch,
  /// capacity_exceeded) the pool is unchanged.
  SequenceId load_sequence(std::istream& in) {
    detail::FileReader file(in, "kvq sequence file");
    const std::string magic = detail::read_magic(file);
    Sequence seq;
    if (detail::is_magic(magic, detail::pool_file_magic)) {
      file.set_kind("kvq pool file");
      LoadedPool loaded = read_pool_file(file, /*one_sequence=*/true);
      seq = std::move(loaded.sequences.front().second);
    } else if (detail::is_magic(magic, detail::cache_file_magic)) {
      file.set_kind("kvq cache file");
      seq.push_back(read_cache_file(file));
    } else {
      file.fail("preamble", 0, "neither a kvq pool file nor a kvq cache file (wrong magic)");
    }
    std::unique_lock lock(mutex_);
    return insert(std::move(seq));
  }

  /// Writes one sequence (tokens, rollback reach, every layer) and the blocks it refers to, as a
  /// pool file holding that sequence alone: load_sequence() restores it under a new id, in any
  /// pool of this one's shape and configurations. Throws kvq::Error(io) when the stream fails.
  void save_sequence(SequenceId id, std::ostream& out) const {
    std::unique_lock lock(mutex_);  // appends hold the lock shared: none runs while blocks are read
    const Sequence& seq = find(id, "save_sequence");
    write_pool_file(out, {{id, &seq}}, id + 1);
  }

  /// Writes every sequence (ids, tokens, rollback reach) and every block they refer to, once
  /// each, to `out` (binary). Throws kvq::Error(io) when the stream fails.
  void save(std::ostream& out) const {
    std::unique_lock lock(mutex_);
    write_pool_file(out, ordered(), next_id_);
  }

  /// save() into a file, written beside it and renamed over it: a failed save leaves any file
  /// already at `path` as it was.
  void save_file(const std::filesystem::path& path) const {
    detail::write_file_atomically(path, [&](std::ostream& out) { save(out); });
  }
  /// load() from a file; kvq::Error(io) names the file when it cannot be opened.
  void load_file(const std::filesystem::path& path) {
    std::ifstream in = detail::open_for_reading(path);
    load(in);
  }

  /// Restores a pool saved by save() into this pool, which must hold no sequence (else
  /// kvq::Error invalid_argument) and have the saved shape (block_tokens and the shape's own RoPE
  /// fields included), each layer's RoPE and the configurations (else shape_mismatch); it may
  /// have another memory limit, and throws capacity_exceeded when the saved blocks and its
  /// sequences' own rows do not fit it. Sequence ids are kept, and blocks shared when saved are
  /// shared again. A damaged file throws io naming the section and offset. On any error the pool
  /// is left exactly as it was.
  void load(std::istream& in) {
    expect_empty();
    detail::FileReader file(in, "kvq pool file");
    if (!detail::is_magic(detail::read_magic(file), detail::pool_file_magic))
      file.fail("preamble", 0, "not a kvq pool file (wrong magic)");
    LoadedPool loaded = read_pool_file(file);
    std::unique_lock lock(mutex_);
    expect_empty_locked();
    sequences_.reserve(loaded.sequences.size());
    for (auto& [id, seq] : loaded.sequences) sequences_.emplace(id, std::move(seq));
    next_id_ = std::max(next_id_, loaded.next_id);  // not an id this pool handed out before
  }

  /// Content hashes of the sealed blocks of one layer of a sequence (blocks no append writes
  /// again: their positions packed, or stored in full for an unquantized tensor), in position
  /// order. Hash k covers the layer's sink rows and blocks 0..k: equal hashes mean equal prefixes
  /// up to that block's end (up to hash collisions), and since a sequence's bytes do not depend
  /// on how its tokens arrived, two sequences fed one prompt have equal hashes however it was
  /// chunked. An engine can keep them to find a request's longest cached prefix.
  std::vector<std::uint64_t> block_hashes(SequenceId id, std::size_t layer) const {
    std::shared_lock lock(mutex_);
    const Place p = locate(layer, "block_hashes");
    return chained_hashes(*find(id, "block_hashes")[p.group], layer);
  }

  /// Makes sequence `id` share, layer by layer, each of its sealed blocks whose content and
  /// whole prefix equal those of a block another sequence holds (block_hashes, then the bytes
  /// compared): its own copy is let go of and the other's referenced, as a fork would (of several
  /// equal copies, the one most sequences already refer to). Exact: the sequence's bytes, views
  /// and attention are unchanged. Returns the bytes memory().used fell by. Reads the bytes of the
  /// blocks sealed or written since the last call (the others' hashes are kept) and of the
  /// matches; waits for the operations in flight and runs alone. Refused memory (for the hashes)
  /// is kvq::Error (out_of_memory); the layers shared before it stay shared, which changes no byte.
  std::size_t share_prefixes(SequenceId id) {
    std::unique_lock lock(mutex_);
    return with_memory_errors("share_prefixes", [&] { return share_prefixes_locked(id); });
  }

  PoolMemory memory() const {
    std::shared_lock lock(mutex_);
    return memory_locked();
  }

 private:
  /// reorder, under the pool's lock.
  void reorder_locked(std::span<const SequenceId> ids, std::span<const std::size_t> sources) {
    using Access = detail::CacheAccess;
    const std::size_t n = ids.size(), none = std::size_t(-1);
    if (sources.size() != n)
      throw Error(ErrorCode::invalid_argument, "pool reorder: " + std::to_string(n) + " sequences and " +
                                                   std::to_string(sources.size()) + " source indices");
    std::vector<Sequence*> beams(n);
    std::unordered_set<SequenceId> seen;
    for (std::size_t i = 0; i < n; ++i) {
      beams[i] = &find(ids[i], "reorder");
      if (!seen.insert(ids[i]).second)
        throw Error(ErrorCode::invalid_argument, "pool reorder: sequence " + std::to_string(ids[i]) +
                                                     " appears twice (index " + std::to_string(i) + ")");
      if (sources[i] >= n)
        throw Error(ErrorCode::invalid_argument, "pool reorder: source " + std::to_string(sources[i]) + " of index " +
                                                     std::to_string(i) + " is not below " + std::to_string(n));
    }
    // Each source's caches move to one beam that continues it (itself, if it does); the other
    // beams continuing it take the caches of sequences no beam continues, filled by sharing.
    std::vector<std::size_t> taker(n, none);
    for (std::size_t i = 0; i < n; ++i)
      if (sources[i] == i) taker[i] = i;
    for (std::size_t i = 0; i < n; ++i)
      if (taker[sources[i]] == none) taker[sources[i]] = i;
    std::vector<std::size_t> unused;  // sequences no beam continues: as many as the beams sharing
    for (std::size_t j = 0; j < n; ++j)
      if (taker[j] == none) unused.push_back(j);
    std::vector<std::pair<std::size_t, std::size_t>> shares;  // (beam, the unused sequence it takes)
    for (std::size_t i = 0, next = 0; i < n; ++i)
      if (taker[sources[i]] != i) shares.emplace_back(i, unused[next++]);
    for (const auto& [i, j] : shares)
      for (std::size_t g = 0; g < groups_.size(); ++g) Access::reserve_share(*(*beams[j])[g], *(*beams[sources[i]])[g]);
    std::vector<Sequence> result(n);
    // From here nothing can fail.
    for (const auto& [i, j] : shares)
      for (std::size_t g = 0; g < groups_.size(); ++g) Access::share(*(*beams[j])[g], *(*beams[sources[i]])[g]);
    for (const auto& [i, j] : shares) result[i] = std::move(*beams[j]);
    for (std::size_t j = 0; j < n; ++j)
      if (taker[j] != none) result[taker[j]] = std::move(*beams[j]);
    for (std::size_t i = 0; i < n; ++i) *beams[i] = std::move(result[i]);
  }

  /// share_prefixes, under the pool's lock.
  std::size_t share_prefixes_locked(SequenceId id) {
    using Access = detail::CacheAccess;
    Sequence& target = find(id, "share_prefixes");
    const PoolMemory before = memory_locked();
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      const Place p = where_[l];
      const BlockStore& store = *groups_[p.group].store;
      BasicKVCache& mine_cache = *target[p.group];
      const std::vector<std::uint64_t> mine = chained_hashes(mine_cache, l);
      if (mine.empty()) continue;
      std::unordered_map<std::uint64_t, BlockId> others;  // hash -> a block of another sequence
      for (const auto& [other_id, other] : sequences_) {
        if (other_id == id) continue;
        const BasicKVCache& theirs_cache = *other[p.group];
        const std::vector<std::uint64_t> theirs = chained_hashes(theirs_cache, l);
        for (std::size_t k = 0; k < theirs.size(); ++k) {
          // Of equal copies, the one most sequences refer to (then the lowest id): repeated calls
          // leave one copy, whatever order the sequences come in.
          const BlockId b = Access::table(theirs_cache, p.index)[k];
          const auto [it, added] = others.emplace(theirs[k], b);
          const unsigned have = store.references(it->second), offered = store.references(b);
          if (!added && (offered > have || (offered == have && b < it->second))) it->second = b;
        }
      }
      // Allocation is done: what follows cannot fail.
      for (std::size_t k = 0; k < mine.size(); ++k) {
        const auto it = others.find(mine[k]);
        if (it == others.end()) break;  // the prefixes part here, and the chain with them
        const BlockId own = Access::table(mine_cache, p.index)[k];
        if (it->second != own &&
            std::memcmp(store.data(it->second), store.data(own), groups_[p.group].block_bytes) == 0)
          Access::share_block(mine_cache, p.index, k, it->second);
      }
    }
    return before.used - memory_locked().used;
  }

  /// shape.layers, or kvq::Error above LayeredKVCache's limit: before anything is sized by it.
  static std::size_t checked_layers(const PoolShape& shape) {
    check_limit(shape.layers, detail::max_layers, "pool shape: layers");
    return shape.layers;
  }

  /// Layers of one configuration and RoPE: one block store, and one cache per sequence holding them.
  struct LayerGroup {
    CacheConfig config;
    CacheShape shape;                 // a sequence's cache of the group: its layers, their RoPE
    std::vector<std::size_t> layers;  // the pool's layer indices, ascending
    std::size_t block_bytes = 0;
    std::shared_ptr<BlockStore> store;
    std::shared_ptr<const RopeTable> rope;
    std::size_t own_blocks = 0;  // what each sequence's own rows take of the store's limit
  };
  /// Where a pool layer lives: its group, and its index in that group's caches.
  struct Place {
    std::size_t group = 0, index = 0;
  };
  /// A sequence: one cache per layer group (a uniform pool's sequence is one cache).
  using Sequence = std::vector<std::unique_ptr<BasicKVCache>>;

  /// A new, empty cache of group g's layers, over its store and RoPE table; its own rows are
  /// charged to the store, or drawn on `own_rows_from` (a reservation of that store).
  std::unique_ptr<BasicKVCache> empty_cache(std::size_t g, BlockReservation* own_rows_from = nullptr) const {
    return std::make_unique<BasicKVCache>(groups_[g].shape, groups_[g].config, groups_[g].store, groups_[g].rope,
                                          own_rows_from);
  }

  Place locate(std::size_t layer, const char* operation) const {
    if (layer >= where_.size())
      throw Error(ErrorCode::invalid_argument, std::string("pool ") + operation + ": layer " + std::to_string(layer) +
                                                   " of " + std::to_string(where_.size()));
    return where_[layer];
  }

  const LayerGroup& uniform_group(const char* operation) const {
    if (groups_.size() != 1)
      throw Error(ErrorCode::unsupported,
                  std::string("pool ") + operation + ": this pool's layers differ in configuration or RoPE (" +
                      to_string(std::span<const CacheConfig>(configs())) + "); read its layers through layer(id, l)");
    return groups_[0];
  }

  /// A group cache's error names its own layer numbers: name the pool's.
  std::string relabel(const std::string& message, std::size_t g) const {
    return groups_.size() == 1 ? message : detail::rename_layers(message, groups_[g].layers);
  }

  template <class Op>
  void in_group(std::size_t g, Op&& op) const {
    try {
      op();
    } catch (const Error& e) {
      throw Error(e.code(), relabel(e.message(), g));
    }
  }

  /// Ids are handed out in increasing order, never twice; the largest is never handed out (the
  /// next would wrap to 0, an id a loaded pool may hold).
  SequenceId insert(Sequence seq) {
    if (next_id_ == std::numeric_limits<SequenceId>::max())
      throw Error(ErrorCode::capacity_exceeded, "pool: sequence ids are used up");
    sequences_.emplace(next_id_, std::move(seq));  // every id held is below next_id_
    return next_id_++;
  }

  /// block_hashes of pool layer `layer`, read from a sequence's cache of that layer's group.
  std::vector<std::uint64_t> chained_hashes(const BasicKVCache& cache, std::size_t layer) const {
    using Access = detail::CacheAccess;
    const Place p = where_[layer];
    std::uint64_t h = detail::hash_bytes(&layer, sizeof layer, 0x6B7671u);
    for (std::size_t head = 0; head < shape_.kv_heads; ++head)
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const auto [rows, bytes] = Access::sink_rows(cache, t, p.index, head);
        h = detail::hash_bytes(rows, bytes, h);
      }
    std::vector<std::uint64_t> hashes(Access::sealed_blocks(cache, p.index));
    for (std::size_t k = 0; k < hashes.size(); ++k) {
      const std::uint64_t content = block_hash(p.group, Access::table(cache, p.index)[k]);
      hashes[k] = h = detail::hash_bytes(&content, sizeof content, h);
    }
    return hashes;
  }

  /// The hash of one block's bytes, read again only when the block's version has moved since it
  /// was last hashed: a block is written only by its sole holder (after BlockStore::written), so
  /// share_prefixes reads the bytes of blocks sealed since the last call, not the whole pool.
  std::uint64_t block_hash(std::size_t group, BlockId id) const {
    const BlockStore& store = *groups_[group].store;
    const std::uint64_t key = std::uint64_t(group) << 32 | id, version = store.version(id);
    {
      std::lock_guard lock(hash_mutex_);
      if (const auto it = block_hashes_.find(key); it != block_hashes_.end() && it->second.version == version)
        return it->second.hash;
    }
    const std::uint64_t hash = detail::hash_bytes(store.data(id), groups_[group].block_bytes, 0x626C6F636Bu);
    std::lock_guard lock(hash_mutex_);
    block_hashes_[key] = {version, hash};
    return hash;
  }

  /// The configuration text of pool files: one configuration, or parse_layer_configs' text
  /// (whether or not the layers' RoPEs differ).
  std::string config_text() const {
    const std::vector<CacheConfig> all = configs();
    return std::all_of(all.begin(), all.end(), [&](const CacheConfig& c) { return c == all[0]; })
               ? to_string(all[0])
               : to_string(std::span<const CacheConfig>(all));
  }

  /// The cache holding pool layer `l` of a sequence, and the layer's index there.
  std::pair<const BasicKVCache*, std::size_t> layer_of(const Sequence& seq, std::size_t l) const {
    return {seq[where_[l].group].get(), where_[l].index};
  }

  /// The pool file format (top of this header) for `seqs`, each block once.
  void write_pool_file(std::ostream& out, const std::vector<std::pair<SequenceId, const Sequence*>>& seqs,
                       SequenceId next_id) const {
    using Access = detail::CacheAccess;
    // Each block once, numbered in order of first reference; a block is its group's.
    std::map<std::pair<std::size_t, BlockId>, std::uint64_t> index;
    std::vector<std::pair<std::size_t, BlockId>> blocks;
    std::uint64_t table_bytes = 5 * 8;
    for (const auto& [id, seq] : seqs) {
      table_bytes += 8;
      for (std::size_t l = 0; l < shape_.layers; ++l) {
        const auto [cache, at] = layer_of(*seq, l);
        table_bytes += Access::table_entry_bytes + 8 + 8 * Access::table(*cache, at).size();
        for (const BlockId b : Access::table(*cache, at))
          if (index.emplace(std::pair(where_[l].group, b), blocks.size()).second)
            blocks.emplace_back(where_[l].group, b);
      }
    }
    const std::string text = config_text();
    detail::check_config_text(text);
    detail::write_preamble(out, detail::pool_file_magic, detail::pool_file_version);
    detail::write_header(out, shape_.sequence_shape(), text);
    {
      std::uint64_t bytes = 0;
      for (std::size_t l = 0; l < shape_.layers; ++l) bytes += detail::rope_bytes(groups_[where_[l].group].shape);
      detail::SectionWriter w(out, detail::tag_ropes, bytes);
      for (std::size_t l = 0; l < shape_.layers; ++l) detail::write_rope(w, groups_[where_[l].group].shape);
      w.finish();
    }
    {
      detail::SectionWriter w(out, detail::tag_table, table_bytes);
      for (const std::size_t v :
           {shape_.block_tokens, shape_.memory_blocks, std::size_t(next_id), seqs.size(), blocks.size()})
        w.put_value(std::uint64_t(v));
      for (const auto& [id, seq] : seqs) {
        w.put_value(std::uint64_t(id));
        for (std::size_t l = 0; l < shape_.layers; ++l) {
          const auto [cache, at] = layer_of(*seq, l);
          detail::write_table_entry(w, Access::state(*cache, at));
          const std::vector<BlockId>& table = Access::table(*cache, at);
          w.put_value(std::uint64_t(table.size()));
          for (const BlockId b : table) w.put_value(index.at({where_[l].group, b}));
        }
      }
      w.finish();
    }
    for (const auto& [g, b] : blocks) {
      detail::SectionWriter w(out, detail::tag_block, groups_[g].block_bytes);
      w.put(groups_[g].store->data(b), groups_[g].block_bytes);
      w.finish();
    }
    for (const auto& [id, seq] : seqs)
      for (std::size_t l = 0; l < shape_.layers; ++l) {
        const auto [cache, at] = layer_of(*seq, l);
        const Access::LayerState st = Access::state(*cache, at);
        detail::SectionWriter w(out, detail::tag_own, Access::layer_bytes(*cache, st, Access::Pieces::own));
        Access::visit_pieces(
            *cache, at, st, [&](Access::Piece, Tensor, std::size_t n, std::size_t, auto where) { w.put(where(), n); },
            Access::Pieces::own);
        w.finish();
      }
    if (!out) throw Error(ErrorCode::io, "saving a kvq pool: the output stream failed");
  }

  /// What a pool file holds, read and checked; its sequences hold their blocks.
  struct LoadedPool {
    SequenceId next_id = 0;
    std::vector<std::pair<SequenceId, Sequence>> sequences;
  };

  /// The rest of a pool file after its magic, all read and checked before anything is returned;
  /// on any error every block taken is let go of. Blocks are read straight into their stores.
  /// `one_sequence`: load_sequence's read, which refuses any other count before reading on.
  LoadedPool read_pool_file(detail::FileReader& file, bool one_sequence = false) const {
    using Access = detail::CacheAccess;
    const std::uint32_t version = detail::read_version(file, detail::pool_file_version);
    const detail::FileHeader h = detail::read_header(file, 2, detail::ConfigText::per_layer);
    expect_header(h, shape_.sequence_shape(), "kvq pool file holds a pool");
    expect_ropes(file, version, h.shape);

    // The table: every sequence's layer states and block references, checked before any block is taken.
    const std::uint64_t table_start = file.offset();
    const auto table = file.section(detail::tag_table, 5 * 8, std::uint64_t(1) << 48, "table");
    detail::PayloadReader t(table, file, "table", table_start);
    const auto block_tokens = t.value<std::uint64_t>();
    (void)t.value<std::uint64_t>();  // the saved pool's memory limit: for people
    const auto next_id = t.value<std::uint64_t>(), count = t.value<std::uint64_t>(),
               block_count = t.value<std::uint64_t>();
    if (one_sequence && count != 1)
      throw Error(ErrorCode::invalid_argument,
                  "kvq pool file holds " + std::to_string(count) +
                      " sequences; load_sequence reads one (save_sequence), load() a whole pool");
    if (block_tokens != shape_.block_tokens)
      throw Error(ErrorCode::shape_mismatch, "kvq pool file holds blocks of " + std::to_string(block_tokens) +
                                                 " positions; this pool's blocks hold " +
                                                 std::to_string(shape_.block_tokens));
    const std::uint64_t entry = 8 + shape_.layers * (Access::table_entry_bytes + 8);
    if (count > t.remaining() / entry)
      file.fail("table", table_start, std::to_string(count) + " sequences do not fit the section");
    // The layouts every sequence has, per group, over one-block stores of their own: not charged
    // to the pool, and they never take a block.
    std::vector<std::unique_ptr<BasicKVCache>> layouts;
    for (std::size_t g = 0; g < groups_.size(); ++g)
      layouts.push_back(std::make_unique<BasicKVCache>(groups_[g].shape, groups_[g].config,
                                                       std::make_shared<BlockStore>(groups_[g].block_bytes, 1),
                                                       groups_[g].rope));
    struct Saved {
      SequenceId id;
      std::vector<Access::LayerState> states;  // per pool layer
      std::vector<std::vector<std::uint64_t>> blocks;
    };
    std::vector<Saved> saved(static_cast<std::size_t>(count));
    std::unordered_set<SequenceId> ids;
    constexpr std::size_t no_group = std::size_t(-1);
    std::vector<std::size_t> group_of(std::size_t(std::min<std::uint64_t>(block_count, t.remaining() / 8)), no_group);
    std::unordered_set<std::uint64_t> own_blocks;  // of one sequence: no block twice, in any layers
    for (Saved& q : saved) {
      own_blocks.clear();
      q.id = t.value<std::uint64_t>();
      const std::string who = "sequence " + std::to_string(q.id);
      if (q.id >= next_id)
        file.fail("table", table_start, who + " is not below the next id " + std::to_string(next_id));
      if (!ids.insert(q.id).second) file.fail("table", table_start, who + " appears twice");
      q.states.resize(shape_.layers);
      q.blocks.resize(shape_.layers);
      for (std::size_t l = 0; l < shape_.layers; ++l) {
        const std::size_t g = where_[l].group;
        const BasicKVCache& layout = *layouts[g];
        Access::LayerState& s = q.states[l];
        s = detail::read_table_entry(t);
        const std::string where = who + ", layer " + std::to_string(l) + ": ";
        if (const std::string why = Access::check(layout, s); !why.empty())
          file.fail("table", table_start, where + why);
        const auto n = t.value<std::uint64_t>();
        if (n != Access::blocks_for(layout, s))
          file.fail("table", table_start,
                    where + std::to_string(n) + " blocks where its length needs " +
                        std::to_string(Access::blocks_for(layout, s)));
        q.blocks[l].resize(std::size_t(n));
        for (std::uint64_t& b : q.blocks[l]) {
          b = t.value<std::uint64_t>();
          if (b >= group_of.size())
            file.fail("table", table_start,
                      where + "block " + std::to_string(b) + " of " + std::to_string(block_count));
          if (!own_blocks.insert(b).second)
            file.fail("table", table_start, where + "block " + std::to_string(b) + " appears twice in the sequence");
          std::size_t& owner = group_of[std::size_t(b)];
          if (owner != no_group && owner != g)
            file.fail("table", table_start,
                      where + "block " + std::to_string(b) + " is also a block of layers of another configuration");
          owner = g;
        }
      }
    }
    if (t.remaining() != 0)
      file.fail("table", table_start, std::to_string(t.remaining()) + " bytes after the last sequence");
    if (group_of.size() != block_count)
      file.fail("table", table_start, std::to_string(block_count) + " blocks do not fit the file");
    if (const auto unused = std::find(group_of.begin(), group_of.end(), no_group); unused != group_of.end())
      file.fail("table", table_start, "block " + std::to_string(unused - group_of.begin()) + " belongs to no sequence");
    // Before any block or own row is allocated: the blocks and every sequence's own rows are
    // reserved, so appends that run meanwhile cannot take their room and refuse the load midway.
    std::vector<BlockReservation> reserved;
    reserved.reserve(groups_.size());
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const auto blocks = std::size_t(std::count(group_of.begin(), group_of.end(), g));
      const std::size_t own = saturating_mul(saved.size(), groups_[g].own_blocks);
      if (std::size_t free = 0; !reserved.emplace_back(*groups_[g].store).add(saturating_add(blocks, own), &free))
        throw Error(ErrorCode::capacity_exceeded,
                    "kvq pool file holds " + std::to_string(blocks) + " blocks" +
                        (uniform() ? "" : " of the layers configured " + to_string(groups_[g].config)) + " and " +
                        std::to_string(saved.size()) + " sequences whose own rows take " + std::to_string(own) +
                        " blocks; this pool has " + std::to_string(free) + " free");
    }

    // The blocks, read straight into blocks no sequence refers to yet; let go of on any error
    // (the sequences built below hold references of their own).
    struct Held {
      std::vector<std::pair<BlockStore*, BlockId>> blocks;
      ~Held() {
        for (const auto& [store, id] : blocks) store->release(id);
      }
    } held;
    held.blocks.reserve(group_of.size());
    for (std::size_t b = 0; b < group_of.size(); ++b) {
      BlockStore& store = *groups_[group_of[b]].store;
      held.blocks.emplace_back(&store, reserved[group_of[b]].take());
      file.section_into(detail::tag_block, groups_[group_of[b]].block_bytes, "block " + std::to_string(b),
                        store.data(held.blocks.back().second));
    }
    LoadedPool loaded{next_id, {}};
    loaded.sequences.reserve(saved.size());
    Access::CheckedPieces checked;  // what check_section has read of the blocks
    for (const Saved& q : saved) {
      Sequence seq;
      for (std::size_t g = 0; g < groups_.size(); ++g) seq.push_back(empty_cache(g, &reserved[g]));
      std::vector<std::vector<std::uint8_t>> payloads(shape_.layers);
      std::vector<std::uint64_t> section_at(shape_.layers);  // where each layer's own section starts
      for (std::size_t l = 0; l < shape_.layers; ++l) {
        section_at[l] = file.offset();
        payloads[l] =
            file.section(detail::tag_own, Access::layer_bytes(*seq[where_[l].group], q.states[l], Access::Pieces::own),
                         "sequence " + std::to_string(q.id) + " layer " + std::to_string(l));
      }
      for (std::size_t g = 0; g < groups_.size(); ++g) {
        std::vector<Access::LayerState> states;
        std::vector<std::vector<std::uint8_t>> group_payloads;
        std::vector<std::vector<BlockId>> tables;
        // Room first: no allocation can fail between a retain and the table that will release it.
        states.reserve(groups_[g].layers.size());
        group_payloads.reserve(groups_[g].layers.size());
        tables.reserve(groups_[g].layers.size());
        for (const std::size_t l : groups_[g].layers) tables.emplace_back().reserve(q.blocks[l].size());
        for (std::size_t i = 0; i < groups_[g].layers.size(); ++i) {
          const std::size_t l = groups_[g].layers[i];
          states.push_back(q.states[l]);
          group_payloads.push_back(std::move(payloads[l]));
          for (const std::uint64_t b : q.blocks[l]) {
            const BlockId id = held.blocks[std::size_t(b)].second;
            groups_[g].store->retain(id);
            tables[i].push_back(id);
          }
        }
        Access::restore(*seq[g], states, group_payloads, std::move(tables));
      }
      // The contents the kernels will trust, now in place (blocks, each piece once for its longest
      // use, and own rows): a sequence that does not join the pool lets go of them.
      for (std::size_t l = 0; l < shape_.layers; ++l) {
        const auto [cache, at] = layer_of(seq, l);
        if (const std::string why = Access::check_section(*cache, at, q.states[l], &checked); !why.empty())
          file.fail("sequence " + std::to_string(q.id) + " layer " + std::to_string(l), section_at[l],
                    why + " (in its blocks or its own rows)");
      }
      loaded.sequences.emplace_back(q.id, std::move(seq));
    }
    file.expect_end();
    return loaded;
  }

  /// Throws shape_mismatch unless a file's header (`holds`: what the file holds, for the message)
  /// names `mine` (the pool's sequence shape, or a uniform pool's cache shape) and this pool's
  /// configuration text.
  void expect_header(const detail::FileHeader& h, const CacheShape& mine, const std::string& holds) const {
    if (!detail::same_shape(h.shape, mine))
      throw Error(ErrorCode::shape_mismatch,
                  holds + " of " + detail::describe(h.shape) + "; this pool's sequences are " + detail::describe(mine));
    if (const std::string text = config_text(); h.config_text != text)
      throw Error(ErrorCode::shape_mismatch,
                  holds + " configured '" + h.config_text + "'; this pool is configured '" + text + "'");
  }

  /// Throws shape_mismatch unless every layer of a pool file (of format `version`, its header
  /// `saved`) is rotated as this pool's layer is; reads the "ropes" section of version 2.
  void expect_ropes(detail::FileReader& file, std::uint32_t version, const CacheShape& saved) const {
    const std::uint64_t start = file.offset(), least = detail::rope_bytes(CacheShape{});
    const std::vector<std::uint8_t> payload =
        version >= 2 ? file.section(detail::tag_ropes, shape_.layers * least,
                                    shape_.layers * (least + 4 * detail::max_frequency_divisors), "ropes")
                     : std::vector<std::uint8_t>();
    detail::PayloadReader in(payload, file, "ropes", start);
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      const CacheShape& mine = groups_[where_[l].group].shape;
      CacheShape theirs = mine;
      if (version >= 2)
        detail::read_rope(in, version, theirs);
      else
        theirs = detail::with_rope(mine, saved.rope(), "kvq pool file", l);
      if (!detail::same_shape(theirs, mine))
        throw Error(ErrorCode::shape_mismatch, "kvq pool file rotates layer " + std::to_string(l) + " by RoPE " +
                                                   detail::describe_rope(theirs) + "; this pool's layer " +
                                                   std::to_string(l) + " by RoPE " + detail::describe_rope(mine));
    }
    if (in.remaining() != 0) in.fail(std::to_string(in.remaining()) + " bytes after the last layer's RoPE");
  }

  /// A sequence of a uniform pool from a cache file, after its magic.
  std::unique_ptr<BasicKVCache> read_cache_file(detail::FileReader& file) const {
    const detail::FileHeader h = detail::read_header(file, detail::read_version(file, detail::cache_file_version));
    if (!uniform())
      throw Error(ErrorCode::shape_mismatch, "kvq cache file holds a cache configured '" + h.config_text +
                                                 "' under one RoPE; this pool's layers differ in configuration or "
                                                 "RoPE ('" +
                                                 config_text() + "'): it reads pool and session files");
    expect_header(h, groups_[0].shape, "kvq cache file holds a cache");
    auto cache = empty_cache(0);
    detail::read_body(file, *cache);
    return cache;
  }

  PoolMemory memory_locked() const {
    PoolMemory m;
    for (const auto& [id, seq] : sequences_)
      for (const auto& cache : seq) m.own += cache->own_bytes();  // not the tables: appends may run
    m.committed = m.used = m.own;
    for (const LayerGroup& group : groups_) {
      const BlockCounts n = group.store->counts();
      m.committed += n.committed * group.block_bytes;
      m.used += n.in_use * group.block_bytes;
      m.shared += n.shared * group.block_bytes;
    }
    return m;
  }

  /// The sequences in id order.
  std::vector<std::pair<SequenceId, const Sequence*>> ordered() const {
    std::vector<std::pair<SequenceId, const Sequence*>> seqs;
    for (const auto& [id, seq] : sequences_) seqs.emplace_back(id, &seq);
    std::sort(seqs.begin(), seqs.end());
    return seqs;
  }

  void expect_empty() const {
    std::shared_lock lock(mutex_);
    expect_empty_locked();
  }
  void expect_empty_locked() const {
    if (!sequences_.empty())
      throw Error(ErrorCode::invalid_argument, "pool load: the pool holds " + std::to_string(sequences_.size()) +
                                                   " sequences; a pool is loaded into an empty one");
  }

  Sequence& find(SequenceId id, const char* operation) {
    return const_cast<Sequence&>(std::as_const(*this).find(id, operation));
  }
  const Sequence& find(SequenceId id, const char* operation) const {
    const auto it = sequences_.find(id);
    if (it == sequences_.end())
      throw Error(ErrorCode::invalid_argument,
                  std::string("pool ") + operation + ": no sequence " + std::to_string(id));
    return it->second;
  }

  /// Runs op on the sequence; errors gain the sequence's id (and, from one layer's group, the
  /// pool's layer numbers).
  template <class Op>
  void with_context(SequenceId id, const char* operation, std::optional<Place> place, Op&& op) {
    Sequence& seq = find(id, operation);
    try {
      op(seq);
    } catch (const Error& e) {
      throw Error(e.code(),
                  "sequence " + std::to_string(id) + ": " + (place ? relabel(e.message(), place->group) : e.message()));
    }
  }

  PoolShape shape_;
  std::vector<LayerGroup> groups_;
  std::vector<Place> where_;         // per pool layer
  mutable std::shared_mutex mutex_;  // guards the map, not the sequences
  struct VersionedHash {
    std::uint64_t version = 0, hash = 0;
  };
  mutable std::mutex hash_mutex_;  // guards block_hashes_ (block_hashes runs beside appends)
  mutable std::unordered_map<std::uint64_t, VersionedHash> block_hashes_;  // (group, block) -> its bytes' hash
  std::unordered_map<SequenceId, Sequence> sequences_;
  SequenceId next_id_ = 0;
};

}  // namespace kvq::inline v0
