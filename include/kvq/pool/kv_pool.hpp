#pragma once
// KVPool: the caches of many sequences in one paged store, as a serving engine keeps them.
//
//   add_sequence / fork / load_sequence -> SequenceId
//   append, truncate, erase             -> the sequence's BasicKVCache rules, all-or-nothing
//   layer(id, l)                        -> one layer as attention reads it: {cache, layer}
//   sequence(id)                        -> (one configuration) a BasicKVCache: decode_attention,
//                                          reference_attention, metrics and save() take it as
//                                          they take a KVCache
//   save(out) / load(in)                -> (one configuration) every sequence of the pool,
//   save_file(path) / load_file(path)      blocks shared as they were; files are written beside
//                                          and renamed into place
//   block_hashes / share_prefixes       -> find and share a common prompt prefix across sequences
//
// Memory is committed as sequences reach new positions (in slabs of about 2 MiB of blocks), up
// to the pool's limit of blocks; every sequence shares one RoPE table. fork(id, length) shares
// the parent's blocks by reference count and copies only its own rows (sinks, ring, rollback
// copies): a block is copied only when a sequence holding a shared one writes to it, so a shared
// prompt costs its packed bytes once. A sequence's bytes do not depend on how its tokens
// arrived, so attention over a pool sequence is bit-identical to attention over a KVCache of the
// same shape, configuration and block length that received the same tokens.
//
// A pool may hold a configuration per layer (kvq-eval --advise chooses one): the layers of one
// configuration share a block store, and a sequence is one cache per such group. Truncate and
// erase check, and copy the shared blocks they write to, in every group before changing any.
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
#include <filesystem>
#include <fstream>
#include <istream>
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
  std::size_t max_tokens = 4096;    // longest sequence: the shared RoPE table covers these positions
  // Positions per block, a multiple of block_unit(config): memory is committed and shared in
  // these steps, and decode attention sets up once per block (256: about 1.45x the time of one
  // block per step at 32K; 4096: about 1.05x; bench/RESULTS.md).
  std::size_t block_tokens = 256;
  std::size_t memory_blocks = 1024; // the most blocks the pool commits (split between the stores
                                    // of a pool with a configuration per layer by their layers)
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
  /// Every layer in one configuration.
  KVPool(const PoolShape& shape, const CacheConfig& config) : KVPool(shape, std::vector<CacheConfig>(shape.layers, config)) {}

  /// A configuration per layer (parse_layer_configs; kvq-eval --advise prints one). Layers of one
  /// configuration share a block store; shape.memory_blocks is split between the stores by their
  /// share of the layers (every layer of a sequence holds the same number of blocks), and
  /// block_tokens must be a multiple of every configuration's block_unit.
  KVPool(const PoolShape& shape, const std::vector<CacheConfig>& configs) : shape_(shape) {
    if (configs.size() != shape.layers)
      throw Error(ErrorCode::shape_mismatch, "pool: " + std::to_string(configs.size()) + " configurations for " +
                                                 std::to_string(shape.layers) + " layers");
    if (shape.layers == 0) throw Error(ErrorCode::invalid_argument, "pool shape needs at least one layer");
    check_limit(shape.memory_blocks, BlockStore::max_blocks_limit, "pool shape: memory_blocks");
    if (shape.block_tokens == 0)
      throw Error(ErrorCode::invalid_argument, "pool shape: block_tokens must be a positive multiple of " +
                                                   std::to_string(block_unit(configs[0])));
    const CacheShape cache = shape.sequence_shape();  // validated with each configuration below
    where_.resize(shape.layers);
    for (std::size_t l = 0; l < shape.layers; ++l) {
      const CacheConfig& config = configs[l];
      const std::string where = "pool, layer " + std::to_string(l) + ": ";
      try {
        validate(cache, config);
      } catch (const Error& e) {
        throw Error(e.code(), where + e.message());
      }
      std::size_t g = 0;
      while (g < groups_.size() && !(groups_[g].config == config)) ++g;
      if (g == groups_.size()) groups_.push_back(LayerGroup{config, {}, 0, nullptr});
      where_[l] = {g, groups_[g].layers.size()};
      groups_[g].layers.push_back(l);
    }
    for (LayerGroup& group : groups_) {
      CacheShape one = cache;
      one.layers = group.layers.size();
      group.block_bytes = BasicKVCache::block_bytes(one, group.config);
      const std::size_t share = checked_mul(shape.memory_blocks, group.layers.size(), "pool shape: memory_blocks x layers");
      const std::size_t blocks = share / shape.layers + (share % shape.layers != 0);
      group.store = std::make_shared<BlockStore>(group.block_bytes, blocks);
    }
    rope_ = std::make_shared<const RopeTable>(cache.rope(), shape.max_tokens);
  }
  KVPool(const KVPool&) = delete;
  KVPool& operator=(const KVPool&) = delete;

  const PoolShape& shape() const noexcept { return shape_; }
  /// True when every layer has one configuration: sequence(id), config(), block_bytes(), blocks(),
  /// save, load and load_sequence need that.
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
  /// The store holding `layer`'s blocks (shared with the layers of the same configuration).
  const BlockStore& blocks(std::size_t layer) const { return *groups_[locate(layer, "blocks").group].store; }
  const RopeTable& rope() const noexcept { return *rope_; }

  /// A new, empty sequence. Its own rows (sinks, ring, rollback copies) are allocated now.
  SequenceId add_sequence() {
    Sequence seq;
    for (std::size_t g = 0; g < groups_.size(); ++g)
      seq.push_back(std::make_unique<BasicKVCache>(group_shape(g), groups_[g].config, groups_[g].store, rope_));
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
    with_context(id, p, [&](Sequence& s) { s[p.group]->append(p.index, position, keys, values); });
  }
  /// The same from rows in the engine's layout and type (TokenRows: f16/bf16 with strides).
  void append(SequenceId id, std::size_t layer, std::size_t position, const TokenRows& keys, const TokenRows& values) {
    std::shared_lock lock(mutex_);
    const Place p = locate(layer, "append");
    with_context(id, p, [&](Sequence& s) { s[p.group]->append(p.index, position, keys, values); });
  }
  /// BasicKVCache::truncate on one sequence (rolling back speculative tokens), every layer
  /// checked, and its shared blocks copied, before any changes.
  void truncate(SequenceId id, std::size_t length) {
    using Access = detail::CacheAccess;
    std::shared_lock lock(mutex_);
    with_context(id, std::nullopt, [&](Sequence& s) {
      for (std::size_t g = 0; g < s.size(); ++g) in_group(g, [&] { Access::prepare_truncate(*s[g], length); });
      for (auto& cache : s) cache->truncate(length);  // prepared: cannot fail
    });
  }
  /// BasicKVCache::erase on one sequence (context shift), all-or-nothing as truncate.
  void erase(SequenceId id, std::size_t first, std::size_t count) {
    using Access = detail::CacheAccess;
    std::shared_lock lock(mutex_);
    with_context(id, std::nullopt, [&](Sequence& s) {
      for (std::size_t g = 0; g < s.size(); ++g) in_group(g, [&] { Access::prepare_erase(*s[g], first, count); });
      for (auto& cache : s) cache->erase(first, count);
    });
  }

  /// The sequence's cache, for attention, metrics and save(), in a uniform pool (else kvq::Error
  /// unsupported: a per-layer pool is read through layer(id, l)). Valid until the sequence is removed.
  const BasicKVCache& sequence(SequenceId id) const {
    std::shared_lock lock(mutex_);
    (void)uniform_group("sequence(id)");
    return *find(id, "sequence")[0];
  }
  /// One layer of a sequence as attention reads it, in any pool: the cache holding it and its
  /// index there (decode_attention(v.cache, v.layer, ...), AttentionRequest{.cache = &v.cache,
  /// .layer = v.layer}). Valid until the sequence is removed.
  struct LayerView {
    const BasicKVCache& cache;
    std::size_t layer;
  };
  LayerView layer(SequenceId id, std::size_t layer) const {
    std::shared_lock lock(mutex_);
    const Place p = locate(layer, "layer");
    return {*find(id, "layer")[p.group], p.index};
  }
  /// Tokens `layer` of the sequence holds.
  std::size_t length(SequenceId id, std::size_t layer) const {
    const LayerView v = this->layer(id, layer);
    return v.cache.length(v.layer);
  }

  /// A new sequence read from a cache file (save(pool.sequence(id), out) writes one) of this
  /// uniform pool's shape and configuration. On any error (kvq::Error io, shape_mismatch,
  /// capacity_exceeded, unsupported for a per-layer pool) the pool is unchanged.
  SequenceId load_sequence(std::istream& in) {
    const LayerGroup& group = uniform_group("load_sequence");
    auto cache = std::make_unique<BasicKVCache>(shape_.sequence_shape(), group.config, group.store, rope_);
    kvq::load(*cache, in);
    Sequence seq;
    seq.push_back(std::move(cache));
    std::unique_lock lock(mutex_);
    return insert(std::move(seq));
  }

  /// Writes every sequence (ids, tokens, rollback reach) and every block they refer to, once
  /// each, to `out` (binary). Throws kvq::Error(io) when the stream fails, unsupported for a
  /// pool with a configuration per layer (its file format is not written yet).
  void save(std::ostream& out) const {
    using Access = detail::CacheAccess;
    const LayerGroup& group = uniform_group("save");
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
    detail::write_header(out, shape_.sequence_shape(), to_string(group.config));
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
      detail::SectionWriter w(out, detail::tag_block, group.block_bytes);
      w.put(group.store->data(b), group.block_bytes);
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
  /// kvq::Error invalid_argument) and have the saved shape (block_tokens included), RoPE and
  /// configuration (else shape_mismatch); it may have another memory limit, and throws
  /// capacity_exceeded when the saved blocks do not fit it. Sequence ids are kept, and blocks
  /// shared when saved are shared again. A damaged file throws io naming the section and offset.
  /// On any error the pool is left exactly as it was. Uniform pools only, as save.
  void load(std::istream& in) {
    using Access = detail::CacheAccess;
    const LayerGroup& group = uniform_group("load");
    expect_empty();
    detail::FileReader file(in, "kvq pool file");
    const std::uint32_t version = detail::read_preamble(file, detail::pool_file_magic, detail::pool_file_version, "kvq pool file");
    (void)version;  // version 1 is the only one yet
    const detail::FileHeader h = detail::read_header(file, 2);
    const CacheShape mine = shape_.sequence_shape();
    if (!detail::same_shape(h.shape, mine))
      throw Error(ErrorCode::shape_mismatch, "kvq pool file holds sequences of " + detail::describe(h.shape) +
                                                 "; this pool's are " + detail::describe(mine));
    if (h.config_text != to_string(group.config))
      throw Error(ErrorCode::shape_mismatch, "kvq pool file holds a pool configured '" + h.config_text +
                                                 "'; this pool is configured '" + to_string(group.config) + "'");

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
    const BasicKVCache layout(mine, group.config, group.store, rope_);  // the layouts every sequence has
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
    if (const std::size_t free = group.store->available(); free < block_count)
      throw Error(ErrorCode::capacity_exceeded, "kvq pool file holds " + std::to_string(block_count) + " blocks; this pool has " +
                                                    std::to_string(free) + " free");

    // The blocks, read straight into blocks no sequence refers to yet; let go of on any error.
    struct Held {
      BlockStore& store;
      std::vector<BlockId> ids;
      ~Held() {
        for (const BlockId id : ids) store.release(id);
      }
    } held{*group.store, {}};
    held.ids.reserve(std::size_t(block_count));
    for (std::size_t b = 0; b < block_count; ++b) {
      held.ids.push_back(group.store->acquire("a pool being loaded"));
      file.section_into(detail::tag_block, group.block_bytes, "block " + std::to_string(b), group.store->data(held.ids.back()));
    }
    std::vector<std::pair<SequenceId, Sequence>> loaded;
    loaded.reserve(saved.size());
    for (const Saved& q : saved) {
      auto cache = std::make_unique<BasicKVCache>(mine, group.config, group.store, rope_);
      std::vector<std::vector<std::uint8_t>> payloads(shape_.layers);
      for (std::size_t l = 0; l < shape_.layers; ++l)
        payloads[l] = file.section(detail::tag_own, Access::layer_bytes(*cache, q.states[l], Access::Pieces::own),
                                   "sequence " + std::to_string(q.id) + " layer " + std::to_string(l));
      std::vector<std::vector<BlockId>> tables(shape_.layers);
      for (std::size_t l = 0; l < shape_.layers; ++l) {
        tables[l].reserve(q.blocks[l].size());
        for (const std::uint64_t b : q.blocks[l]) {
          group.store->retain(held.ids[std::size_t(b)]);
          tables[l].push_back(held.ids[std::size_t(b)]);
        }
      }
      Access::restore(*cache, q.states, payloads, std::move(tables), Access::Pieces::own);
      loaded.emplace_back(q.id, Sequence{});
      loaded.back().second.push_back(std::move(cache));
    }
    file.expect_end();
    std::unique_lock lock(mutex_);
    expect_empty_locked();
    sequences_.reserve(loaded.size());
    for (auto& [id, seq] : loaded) sequences_.emplace(id, std::move(seq));
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
    const Place p = locate(layer, "block_hashes");
    return chained_hashes(*find(id, "block_hashes")[p.group], layer);
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
        if (it->second != own && std::memcmp(store.data(it->second), store.data(own), groups_[p.group].block_bytes) == 0)
          Access::share_block(mine_cache, p.index, k, it->second);
      }
    }
    return before.used - memory_locked().used;
  }

  PoolMemory memory() const {
    std::shared_lock lock(mutex_);
    return memory_locked();
  }

 private:
  /// Layers of one configuration: one block store, and one cache per sequence holding them.
  struct LayerGroup {
    CacheConfig config;
    std::vector<std::size_t> layers;  // the pool's layer indices, ascending
    std::size_t block_bytes = 0;
    std::shared_ptr<BlockStore> store;
  };
  /// Where a pool layer lives: its group, and its index in that group's caches.
  struct Place {
    std::size_t group = 0, index = 0;
  };
  /// A sequence: one cache per layer group (a uniform pool's sequence is one cache).
  using Sequence = std::vector<std::unique_ptr<BasicKVCache>>;

  CacheShape group_shape(std::size_t g) const {
    CacheShape s = shape_.sequence_shape();
    s.layers = groups_[g].layers.size();
    return s;
  }

  Place locate(std::size_t layer, const char* operation) const {
    if (layer >= where_.size())
      throw Error(ErrorCode::invalid_argument, std::string("pool ") + operation + ": layer " + std::to_string(layer) +
                                                   " of " + std::to_string(where_.size()));
    return where_[layer];
  }

  const LayerGroup& uniform_group(const char* operation) const {
    if (groups_.size() != 1)
      throw Error(ErrorCode::unsupported, std::string("pool ") + operation + ": this pool has a configuration per layer (" +
                                              to_string(std::span<const CacheConfig>(configs())) +
                                              "); read its layers through layer(id, l)");
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

  SequenceId insert(Sequence seq) {
    const SequenceId id = next_id_++;
    sequences_.emplace(id, std::move(seq));
    return id;
  }

  /// block_hashes of pool layer `layer`, read from a sequence's cache of that layer's group.
  std::vector<std::uint64_t> chained_hashes(const BasicKVCache& cache, std::size_t layer) const {
    using Access = detail::CacheAccess;
    const Place p = where_[layer];
    const LayerGroup& group = groups_[p.group];
    std::uint64_t h = detail::hash_bytes(&layer, sizeof layer, 0x6B7671u);
    for (std::size_t head = 0; head < shape_.kv_heads; ++head)
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const auto [rows, bytes] = Access::sink_rows(cache, t, p.index, head);
        h = detail::hash_bytes(rows, bytes, h);
      }
    std::vector<std::uint64_t> hashes(Access::sealed_blocks(cache, p.index));
    for (std::size_t k = 0; k < hashes.size(); ++k)
      hashes[k] = h = detail::hash_bytes(group.store->data(Access::table(cache, p.index)[k]), group.block_bytes, h);
    return hashes;
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

  /// The sequences of a uniform pool in id order.
  std::vector<std::pair<SequenceId, const BasicKVCache*>> ordered() const {
    std::vector<std::pair<SequenceId, const BasicKVCache*>> seqs;
    for (const auto& [id, seq] : sequences_) seqs.emplace_back(id, seq[0].get());
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
      throw Error(ErrorCode::invalid_argument, std::string("pool ") + operation + ": no sequence " + std::to_string(id));
    return it->second;
  }

  /// Runs op on the sequence; errors gain the sequence's id (and, from one layer's group, the
  /// pool's layer numbers).
  template <class Op>
  void with_context(SequenceId id, std::optional<Place> place, Op&& op) {
    Sequence& seq = find(id, "operation");
    try {
      op(seq);
    } catch (const Error& e) {
      throw Error(e.code(), "sequence " + std::to_string(id) + ": " + (place ? relabel(e.message(), place->group) : e.message()));
    }
  }

  PoolShape shape_;
  std::vector<LayerGroup> groups_;
  std::vector<Place> where_;  // per pool layer
  std::shared_ptr<const RopeTable> rope_;
  mutable std::shared_mutex mutex_;  // guards the map, not the sequences
  std::unordered_map<SequenceId, Sequence> sequences_;
  SequenceId next_id_ = 0;
};

}  // namespace kvq::inline v0
