#pragma once
// KVPool: the caches of many sequences in one paged store, as a serving engine keeps them.
//
//   add_sequence / fork / load_sequence -> SequenceId
//   append, truncate, erase             -> the sequence's BasicKVCache rules, all-or-nothing
//   sequence(id)                        -> a BasicKVCache: decode_attention, reference_attention,
//                                          metrics and save() take it as they take a KVCache
//
// Memory is committed as sequences reach new positions (in slabs of about 2 MiB of blocks), up
// to the pool's limit of blocks; every sequence shares one RoPE table. fork(id, length) shares the parent's blocks by reference
// count and copies only its own rows (sinks, ring, rollback copies): a block is copied only when
// a sequence holding a shared one writes to it, so a shared prompt costs its packed bytes once.
// A sequence's bytes do not depend on how its tokens arrived, so attention over a pool sequence
// is bit-identical to attention over a KVCache of the same shape, configuration and block length
// that received the same tokens.
//
// Thread safety: const operations may run concurrently with each other and with append,
// truncate and erase of other sequences; append, truncate and erase of different sequences may
// run concurrently. add_sequence, fork, load_sequence and remove_sequence wait for the operations
// in flight and run alone. Two operations on one sequence need the caller's synchronisation.

#include <cstddef>
#include <cstdint>
#include <istream>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <unordered_map>

#include "kvq/cache/block_store.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/cache/serialize.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/error.hpp"

namespace kvq::inline v0 {

struct PoolShape {
  std::size_t layers = 1;
  std::size_t kv_heads = 1;
  std::size_t head_dim = 128;
  std::size_t max_tokens = 4096;    // longest sequence: the shared RoPE table covers these positions
  // Positions per block, a multiple of block_unit(config): memory is committed and shared in
  // these steps, and decode attention sets up once per block (256: about 1.45x the time of one
  // block per step at 32K; 4096: about 1.05x; bench/RESULTS.md).
  std::size_t block_tokens = 256;
  std::size_t memory_blocks = 1024; // the most blocks the pool commits (block_bytes() each)
  RopeStyle rope_style = RopeStyle::adjacent_pairs;
  float rope_theta = 10000.0f;
  std::size_t rope_dims = 0;  // channels RoPE rotates from the start of each head; 0 = head_dim
  RopeScaling rope_scaling{};

  /// The shape of each sequence's cache.
  CacheShape sequence_shape() const {
    return CacheShape{.layers = layers, .kv_heads = kv_heads, .head_dim = head_dim, .capacity = max_tokens,
                      .rope_style = rope_style, .rope_theta = rope_theta, .rope_dims = rope_dims,
                      .rope_scaling = rope_scaling, .block_tokens = block_tokens};
  }
};

using SequenceId = std::uint64_t;

/// Bytes of a pool, counting each block once however many sequences share it.
struct PoolMemory {
  std::size_t committed = 0;  // blocks allocated (in use or free for reuse) and the sequences' own rows
  std::size_t used = 0;       // blocks some sequence refers to and the sequences' own rows
  std::size_t shared = 0;     // blocks more than one sequence refers to
  std::size_t own = 0;        // the sequences' own rows: sinks, rings, rollback copies
};

class KVPool {
 public:
  KVPool(const PoolShape& shape, const CacheConfig& config) : shape_(shape), config_(config) {
    const CacheShape cache = shape.sequence_shape();
    if (shape.block_tokens == 0)
      throw Error(ErrorCode::invalid_argument, "pool shape: block_tokens must be a positive multiple of " +
                                                   std::to_string(block_unit(config)));
    block_bytes_ = BasicKVCache::block_bytes(cache, config);  // validates shape and config
    check_limit(shape.memory_blocks, BlockStore::max_blocks_limit, "pool shape: memory_blocks");
    store_ = std::make_shared<BlockStore>(block_bytes_, shape.memory_blocks);
    rope_ = std::make_shared<const RopeTable>(cache.rope(), shape.max_tokens);
  }
  KVPool(const KVPool&) = delete;
  KVPool& operator=(const KVPool&) = delete;

  const PoolShape& shape() const noexcept { return shape_; }
  const CacheConfig& config() const noexcept { return config_; }
  /// Bytes of one block (all layers' blocks have this size; a block holds one layer).
  std::size_t block_bytes() const noexcept { return block_bytes_; }
  const BlockStore& blocks() const noexcept { return *store_; }
  const RopeTable& rope() const noexcept { return *rope_; }

  /// A new, empty sequence. Its own rows (sinks, ring, rollback copies) are allocated now.
  SequenceId add_sequence() {
    auto cache = std::make_unique<BasicKVCache>(shape_.sequence_shape(), config_, store_, rope_);
    std::unique_lock lock(mutex_);
    return insert(std::move(cache));
  }

  /// A new sequence holding the first `length` tokens of `parent` (every layer), sharing its
  /// blocks. Exact where truncating the parent to `length` would be (CacheConfig::rollback_depth);
  /// otherwise throws kvq::Error and nothing changes.
  SequenceId fork(SequenceId parent, std::size_t length) {
    std::unique_lock lock(mutex_);
    auto child = std::make_unique<BasicKVCache>(find(parent, "fork"), length);
    return insert(std::move(child));
  }

  /// Drops a sequence and lets go of its blocks.
  void remove_sequence(SequenceId id) {
    std::unique_lock lock(mutex_);
    (void)find(id, "remove_sequence");
    sequences_.erase(id);
  }

  bool contains(SequenceId id) const {
    std::shared_lock lock(mutex_);
    return sequences_.count(id) != 0;
  }
  std::size_t sequence_count() const {
    std::shared_lock lock(mutex_);
    return sequences_.size();
  }

  /// BasicKVCache::append on one sequence; capacity_exceeded names the blocks needed and free
  /// when the pool is full. All-or-nothing.
  void append(SequenceId id, std::size_t layer, std::size_t position, std::span<const float> keys,
              std::span<const float> values) {
    std::shared_lock lock(mutex_);
    with_context(id, [&](BasicKVCache& c) { c.append(layer, position, keys, values); });
  }
  /// The same from rows in the engine's layout and type (TokenRows: f16/bf16 with strides).
  void append(SequenceId id, std::size_t layer, std::size_t position, const TokenRows& keys, const TokenRows& values) {
    std::shared_lock lock(mutex_);
    with_context(id, [&](BasicKVCache& c) { c.append(layer, position, keys, values); });
  }
  /// BasicKVCache::truncate on one sequence (rolling back speculative tokens).
  void truncate(SequenceId id, std::size_t length) {
    std::shared_lock lock(mutex_);
    with_context(id, [&](BasicKVCache& c) { c.truncate(length); });
  }
  /// BasicKVCache::erase on one sequence (context shift).
  void erase(SequenceId id, std::size_t first, std::size_t count) {
    std::shared_lock lock(mutex_);
    with_context(id, [&](BasicKVCache& c) { c.erase(first, count); });
  }

  /// The sequence's cache, for attention, metrics and save(). Valid until the sequence is removed.
  const BasicKVCache& sequence(SequenceId id) const {
    std::shared_lock lock(mutex_);
    return find(id, "sequence");
  }

  /// A new sequence read from a cache file (save(pool.sequence(id), out) writes one) of this
  /// pool's shape and configuration. On any error (kvq::Error io, shape_mismatch,
  /// capacity_exceeded) the pool is unchanged.
  SequenceId load_sequence(std::istream& in) {
    auto cache = std::make_unique<BasicKVCache>(shape_.sequence_shape(), config_, store_, rope_);
    load(*cache, in);
    std::unique_lock lock(mutex_);
    return insert(std::move(cache));
  }

  PoolMemory memory() const {
    std::shared_lock lock(mutex_);
    PoolMemory m;
    for (const auto& [id, cache] : sequences_) m.own += cache->own_bytes();  // not the tables: appends may run
    const BlockCounts n = store_->counts();
    m.committed = n.committed * block_bytes_ + m.own;
    m.used = n.in_use * block_bytes_ + m.own;
    m.shared = n.shared * block_bytes_;
    return m;
  }

 private:
  SequenceId insert(std::unique_ptr<BasicKVCache> cache) {
    const SequenceId id = next_id_++;
    sequences_.emplace(id, std::move(cache));
    return id;
  }

  BasicKVCache& find(SequenceId id, const char* operation) const {
    const auto it = sequences_.find(id);
    if (it == sequences_.end())
      throw Error(ErrorCode::invalid_argument, std::string("pool ") + operation + ": no sequence " + std::to_string(id));
    return *it->second;
  }

  /// Runs op on the sequence; errors gain the sequence's id.
  template <class Op>
  void with_context(SequenceId id, Op&& op) {
    BasicKVCache& cache = find(id, "operation");
    try {
      op(cache);
    } catch (const Error& e) {
      throw Error(e.code(), "sequence " + std::to_string(id) + ": " + e.message());
    }
  }

  PoolShape shape_;
  CacheConfig config_;
  std::size_t block_bytes_ = 0;
  std::shared_ptr<BlockStore> store_;
  std::shared_ptr<const RopeTable> rope_;
  mutable std::shared_mutex mutex_;  // guards the map, not the sequences
  std::unordered_map<SequenceId, std::unique_ptr<BasicKVCache>> sequences_;
  SequenceId next_id_ = 0;
};

}  // namespace kvq::inline v0
