#pragma once
// KVPool: the caches of many sequences in one paged store, as a serving engine keeps them.
//
//   add_sequence / fork / load_sequence -> SequenceId
//   append, truncate, erase             -> the sequence's BasicKVCache rules, all-or-nothing
//   sequence(id)                        -> a BasicKVCache: decode_attention, reference_attention,
//                                          metrics and save() take it as they take a KVCache
//   save(out) / load(in)                -> every sequence of the pool, blocks shared as they were
//   block_hashes / share_prefixes       -> find and share a common prompt prefix across sequences
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
// run concurrently. add_sequence, fork, load_sequence, remove_sequence, save, load and
// share_prefixes wait for the operations in flight and run alone. Two operations on one sequence need the caller's
// synchronisation.
//
// Pool file (format version 1), in the writer's byte order and with the sections of a cache file
// (serialize.hpp: u32 tag | u64 size | payload | u32 CRC-32C):
//   "KVQ_POOL"  u32 format version  u32 byte-order marker 0x01020304
//   section "header": as a cache file's (version 2) for sequence_shape(): shape, RoPE, config
//   section "table":  u64 block_tokens, memory_blocks, next sequence id, sequences S, blocks N |
//                     per sequence: u64 id | per layer: its cache-file table entry, u64 n, n u64
//                     indices of the blocks it refers to (position order)
//   N sections "block": block_bytes() bytes each, stored once however many sequences share it
//   per sequence, per layer, a section "own rows": its sinks, ring and rollback rows (as in a
//                     cache file's layer section, without what lives in blocks)
// Shared prefixes stay shared: after load, sequences refer to one copy of each block as they did,
// and memory().used and .shared are what they were when saved.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <shared_mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

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
    kvq::load(*cache, in);
    std::unique_lock lock(mutex_);
    return insert(std::move(cache));
  }

  /// Writes every sequence (ids, tokens, rollback reach) and every block they refer to, once
  /// each, to `out` (binary). Throws kvq::Error(io) when the stream fails.
  void save(std::ostream& out) const {
    using Access = detail::CacheAccess;
    std::unique_lock lock(mutex_);  // appends hold the lock shared: none runs while the pool is read
    const std::vector<std::pair<SequenceId, const BasicKVCache*>> seqs = ordered();
    // Each block once, numbered in order of first reference.
    std::map<BlockId, std::uint64_t> index;
    std::vector<BlockId> blocks;
    for (const auto& [id, cache] : seqs)
      for (std::size_t l = 0; l < shape_.layers; ++l)
        for (const BlockId b : Access::table(*cache, l))
          if (index.emplace(b, blocks.size()).second) blocks.push_back(b);

    detail::write_preamble(out, detail::pool_file_magic, detail::pool_file_version);
    detail::write_header(out, shape_.sequence_shape(), to_string(config_));
    std::uint64_t table_bytes = 5 * 8;
    for (const auto& [id, cache] : seqs) {
      table_bytes += 8;
      for (std::size_t l = 0; l < shape_.layers; ++l)
        table_bytes += Access::table_entry_bytes + 8 + 8 * Access::table(*cache, l).size();
    }
    {
      detail::SectionWriter w(out, detail::tag_table, table_bytes);
      for (const std::size_t v : {shape_.block_tokens, shape_.memory_blocks, std::size_t(next_id_), seqs.size(), blocks.size()})
        w.put_value(std::uint64_t(v));
      for (const auto& [id, cache] : seqs) {
        w.put_value(std::uint64_t(id));
        for (std::size_t l = 0; l < shape_.layers; ++l) {
          detail::write_table_entry(w, Access::state(*cache, l));
          const std::vector<BlockId>& table = Access::table(*cache, l);
          w.put_value(std::uint64_t(table.size()));
          for (const BlockId b : table) w.put_value(index.at(b));
        }
      }
      w.finish();
    }
    for (const BlockId b : blocks) {
      detail::SectionWriter w(out, detail::tag_block, block_bytes_);
      w.put(store_->data(b), block_bytes_);
      w.finish();
    }
    for (const auto& [id, cache] : seqs)
      for (std::size_t l = 0; l < shape_.layers; ++l) {
        const Access::LayerState st = Access::state(*cache, l);
        detail::SectionWriter w(out, detail::tag_own, Access::layer_bytes(*cache, st, Access::Pieces::own));
        Access::visit_pieces(*cache, l, st, [&](const void* data, std::size_t n) { w.put(data, n); }, Access::Pieces::own);
        w.finish();
      }
    if (!out) throw Error(ErrorCode::io, "saving a kvq pool: the output stream failed");
  }

  /// Restores a pool saved by save() into this pool, which must hold no sequence (else
  /// kvq::Error invalid_argument) and have the saved shape (block_tokens included), RoPE and
  /// configuration (else shape_mismatch); it may have another memory limit, and throws
  /// capacity_exceeded when the saved blocks do not fit it. Sequence ids are kept, and blocks
  /// shared when saved are shared again. A damaged file throws io naming the section and offset.
  /// On any error the pool is left exactly as it was.
  void load(std::istream& in) {
    using Access = detail::CacheAccess;
    expect_empty();
    detail::FileReader file(in, "kvq pool file");
    const std::uint32_t version = detail::read_preamble(file, detail::pool_file_magic, detail::pool_file_version, "kvq pool file");
    (void)version;  // version 1 is the only one yet
    const detail::FileHeader h = detail::read_header(file, 2);
    const CacheShape mine = shape_.sequence_shape();
    if (!detail::same_shape(h.shape, mine))
      throw Error(ErrorCode::shape_mismatch, "kvq pool file holds sequences of " + detail::describe(h.shape) +
                                                 "; this pool's are " + detail::describe(mine));
    if (h.config_text != to_string(config_))
      throw Error(ErrorCode::shape_mismatch, "kvq pool file holds a pool configured '" + h.config_text +
                                                 "'; this pool is configured '" + to_string(config_) + "'");

    // The table: every sequence's layer states and block references, checked before any block is taken.
    const std::uint64_t table_start = file.offset();
    const auto table = file.section(detail::tag_table, 5 * 8, std::uint64_t(1) << 48, "table");
    detail::PayloadReader t(table, file, "table", table_start);
    const auto block_tokens = t.value<std::uint64_t>();
    (void)t.value<std::uint64_t>();  // the saved pool's memory limit: for people
    const auto next_id = t.value<std::uint64_t>(), count = t.value<std::uint64_t>(), block_count = t.value<std::uint64_t>();
    if (block_tokens != shape_.block_tokens)
      throw Error(ErrorCode::shape_mismatch, "kvq pool file holds blocks of " + std::to_string(block_tokens) +
                                                 " positions; this pool's blocks hold " + std::to_string(shape_.block_tokens));
    const std::uint64_t entry = 8 + shape_.layers * (Access::table_entry_bytes + 8);
    if (count > t.remaining() / entry) file.fail("table", table_start, std::to_string(count) + " sequences do not fit the section");
    const BasicKVCache layout(mine, config_, store_, rope_);  // the layouts every sequence has
    struct Saved {
      SequenceId id;
      std::vector<Access::LayerState> states;
      std::vector<std::vector<std::uint64_t>> blocks;
    };
    std::vector<Saved> saved(count);
    std::unordered_set<SequenceId> ids;
    std::vector<bool> referenced(std::size_t(std::min<std::uint64_t>(block_count, t.remaining() / 8)), false);
    for (std::size_t i = 0; i < saved.size(); ++i) {
      Saved& q = saved[i];
      q.id = t.value<std::uint64_t>();
      const std::string who = "sequence " + std::to_string(q.id);
      if (q.id >= next_id) file.fail("table", table_start, who + " is not below the next id " + std::to_string(next_id));
      if (!ids.insert(q.id).second) file.fail("table", table_start, who + " appears twice");
      q.states.resize(shape_.layers);
      q.blocks.resize(shape_.layers);
      for (std::size_t l = 0; l < shape_.layers; ++l) {
        Access::LayerState& s = q.states[l];
        s = detail::read_table_entry(t);
        const std::string where = who + ", layer " + std::to_string(l) + ": ";
        if (const std::string why = Access::check(layout, s); !why.empty()) file.fail("table", table_start, where + why);
        const auto n = t.value<std::uint64_t>();
        if (n != Access::blocks_for(layout, s))
          file.fail("table", table_start, where + std::to_string(n) + " blocks where its length needs " +
                                              std::to_string(Access::blocks_for(layout, s)));
        q.blocks[l].resize(std::size_t(n));
        for (std::uint64_t& b : q.blocks[l]) {
          b = t.value<std::uint64_t>();
          if (b >= referenced.size()) file.fail("table", table_start, where + "block " + std::to_string(b) + " of " + std::to_string(block_count));
          referenced[std::size_t(b)] = true;
        }
      }
    }
    if (t.remaining() != 0) file.fail("table", table_start, std::to_string(t.remaining()) + " bytes after the last sequence");
    if (referenced.size() != block_count) file.fail("table", table_start, std::to_string(block_count) + " blocks do not fit the file");
    if (const auto unused = std::find(referenced.begin(), referenced.end(), false); unused != referenced.end())
      file.fail("table", table_start, "block " + std::to_string(unused - referenced.begin()) + " belongs to no sequence");
    if (const std::size_t free = store_->available(); free < block_count)
      throw Error(ErrorCode::capacity_exceeded, "kvq pool file holds " + std::to_string(block_count) + " blocks; this pool has " +
                                                    std::to_string(free) + " free");

    // The blocks, read straight into blocks no sequence refers to yet; let go of on any error.
    struct Held {
      BlockStore& store;
      std::vector<BlockId> ids;
      ~Held() {
        for (const BlockId id : ids) store.release(id);
      }
    } held{*store_, {}};
    held.ids.reserve(std::size_t(block_count));
    for (std::size_t b = 0; b < block_count; ++b) {
      held.ids.push_back(store_->acquire("a pool being loaded"));
      file.section_into(detail::tag_block, block_bytes_, "block " + std::to_string(b), store_->data(held.ids.back()));
    }
    std::vector<std::pair<SequenceId, std::unique_ptr<BasicKVCache>>> loaded;
    loaded.reserve(saved.size());
    for (const Saved& q : saved) {
      auto cache = std::make_unique<BasicKVCache>(mine, config_, store_, rope_);
      std::vector<std::vector<std::uint8_t>> payloads(shape_.layers);
      for (std::size_t l = 0; l < shape_.layers; ++l)
        payloads[l] = file.section(detail::tag_own, Access::layer_bytes(*cache, q.states[l], Access::Pieces::own),
                                   "sequence " + std::to_string(q.id) + " layer " + std::to_string(l));
      std::vector<std::vector<BlockId>> tables(shape_.layers);
      for (std::size_t l = 0; l < shape_.layers; ++l) {
        tables[l].reserve(q.blocks[l].size());
        for (const std::uint64_t b : q.blocks[l]) {
          store_->retain(held.ids[std::size_t(b)]);
          tables[l].push_back(held.ids[std::size_t(b)]);
        }
      }
      Access::restore(*cache, q.states, payloads, std::move(tables), Access::Pieces::own);
      loaded.emplace_back(q.id, std::move(cache));
    }
    file.expect_end();
    std::unique_lock lock(mutex_);
    expect_empty_locked();
    sequences_.reserve(loaded.size());
    for (auto& [id, cache] : loaded) sequences_.emplace(id, std::move(cache));
    next_id_ = next_id;
  }

  /// Content hashes of the sealed blocks of one layer of a sequence (blocks no append writes
  /// again: their positions packed, or stored in full for an unquantized tensor), in position
  /// order. Hash k covers the layer's sink rows and blocks 0..k: equal hashes mean equal prefixes
  /// up to that block's end (up to hash collisions), and since a sequence's bytes do not depend
  /// on how its tokens arrived, two sequences fed one prompt have equal hashes however it was
  /// chunked. An engine can keep them to find a request's longest cached prefix.
  std::vector<std::uint64_t> block_hashes(SequenceId id, std::size_t layer) const {
    std::shared_lock lock(mutex_);
    const BasicKVCache& cache = find(id, "block_hashes");
    if (layer >= shape_.layers)
      throw Error(ErrorCode::invalid_argument, "pool block_hashes: layer " + std::to_string(layer) + " of " +
                                                   std::to_string(shape_.layers));
    return chained_hashes(cache, layer);
  }

  /// Makes sequence `id` share, layer by layer, each of its sealed blocks whose content and
  /// whole prefix equal those of a block another sequence holds (block_hashes, then the bytes
  /// compared): its own copy is let go of and the other's referenced, as a fork would (of several
  /// equal copies, the one most sequences already refer to). Exact: the
  /// sequence's bytes, views and attention are unchanged. Returns the bytes memory().used fell
  /// by. Reads every sealed block of the pool; waits for the operations in flight and runs alone.
  std::size_t share_prefixes(SequenceId id) {
    using Access = detail::CacheAccess;
    std::unique_lock lock(mutex_);
    BasicKVCache& target = find(id, "share_prefixes");
    const std::size_t in_use = store_->counts().in_use;
    for (std::size_t l = 0; l < shape_.layers; ++l) {
      const std::vector<std::uint64_t> mine = chained_hashes(target, l);
      if (mine.empty()) continue;
      std::unordered_map<std::uint64_t, BlockId> others;  // hash -> a block of another sequence
      for (const auto& [other_id, other] : sequences_) {
        if (other_id == id) continue;
        const std::vector<std::uint64_t> theirs = chained_hashes(*other, l);
        for (std::size_t k = 0; k < theirs.size(); ++k) {
          // Of equal copies, the one most sequences refer to (then the lowest id): repeated calls
          // leave one copy, whatever order the sequences come in.
          const BlockId b = Access::table(*other, l)[k];
          const auto [it, added] = others.emplace(theirs[k], b);
          const unsigned have = store_->references(it->second), offered = store_->references(b);
          if (!added && (offered > have || (offered == have && b < it->second))) it->second = b;
        }
      }
      // Allocation is done: what follows cannot fail.
      for (std::size_t k = 0; k < mine.size(); ++k) {
        const auto it = others.find(mine[k]);
        if (it == others.end()) break;  // the prefixes part here, and the chain with them
        const BlockId own = Access::table(target, l)[k];
        if (it->second != own && std::memcmp(store_->data(it->second), store_->data(own), block_bytes_) == 0)
          Access::share_block(target, l, k, it->second);
      }
    }
    return (in_use - store_->counts().in_use) * block_bytes_;
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

  /// block_hashes of a sequence the caller has found.
  std::vector<std::uint64_t> chained_hashes(const BasicKVCache& cache, std::size_t layer) const {
    using Access = detail::CacheAccess;
    std::uint64_t h = detail::hash_bytes(&layer, sizeof layer, 0x6B7671u);
    for (std::size_t head = 0; head < shape_.kv_heads; ++head)
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const auto [rows, bytes] = Access::sink_rows(cache, t, layer, head);
        h = detail::hash_bytes(rows, bytes, h);
      }
    std::vector<std::uint64_t> hashes(Access::sealed_blocks(cache, layer));
    for (std::size_t k = 0; k < hashes.size(); ++k)
      hashes[k] = h = detail::hash_bytes(store_->data(Access::table(cache, layer)[k]), block_bytes_, h);
    return hashes;
  }

  /// The sequences in id order.
  std::vector<std::pair<SequenceId, const BasicKVCache*>> ordered() const {
    std::vector<std::pair<SequenceId, const BasicKVCache*>> seqs;
    for (const auto& [id, cache] : sequences_) seqs.emplace_back(id, cache.get());
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
