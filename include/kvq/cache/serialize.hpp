#pragma once
// Saving a cache to a stream or file and restoring it, e.g. to park a conversation and resume it.
//
//   save(cache, out) / save_file(cache, path)
//   load(cache, in) / load_file(cache, path)   into an existing cache of the same shape and config
//   load(in) / load_file(path)                 a new cache of the shape and config the file names
//
// A restored cache equals the saved one: stored_bytes(), memory(), views, attention, how far it
// can roll back, and what further appends do. Loading is all-or-nothing: every byte is read and
// checked before the target changes (packed rows straight into the new blocks they belong in). A
// damaged or foreign file throws kvq::Error(io) naming the section and offset; a sound file for
// another shape, RoPE or configuration throws shape_mismatch.
//
// Format (version 2), fields in the writer's byte order, which the marker records:
//   "KVQCACHE"  u32 format version  u32 byte-order marker 0x01020304
//   section "header": u32 kvq major, minor, patch | u64 layers, kv_heads, head_dim, capacity |
//                     u32 RoPE style | f32 RoPE theta | RoPE extension (below) |
//                     u32 n, n bytes: to_string(config)
//   RoPE extension:   u64 rotary dims | u32 scaling type | f32 factor | u64 original context |
//                     f32 low and high frequency factors, beta fast and slow, attention factor |
//                     u32 n, n f32: frequency divisors
//   section "table":  per layer: u64 length | per tensor (key, value): u64 quantized end, u64
//                     rollback floor, u64 first packed position the rollback history holds
//   section "layer l" for each layer: per KV head, per tensor (key, value): sink rows, the ring's
//                     rows in position order, packed code rows, scales, zero points (asymmetric
//                     only), the rollback history's rows [its first, quantized end); only what
//                     is in use
// A section is u32 tag | u64 payload bytes | payload | u32 CRC-32C of tag, size and payload.
// The file ends after the last layer. Its size grows with the tokens held, not with the capacity.
// Version 1 files (no RoPE extension: every channel rotated, no scaling) are still read; save
// writes version 2. KVPool::save writes a whole pool with the same header and sections
// (kv_pool.hpp).

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <system_error>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvq/cache/block_store.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/cache/layered_kv_cache.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/core/crc32c.hpp"
#include "kvq/error.hpp"
#include "kvq/version.hpp"

namespace kvq::inline v0 {

namespace detail {

inline constexpr char cache_file_magic[8] = {'K', 'V', 'Q', 'C', 'A', 'C', 'H', 'E'};
inline constexpr std::uint32_t cache_file_version = 2;  // what save writes; 1 is still read
inline constexpr std::uint32_t byte_order_marker = 0x01020304;
inline constexpr std::uint32_t tag_header = 0x44414548, tag_table = 0x4C424154,
                               tag_layer = 0x5259414C;  // "HEAD" "TABL" "LAYR"
// A pool file (kv_pool.hpp): its own magic and version, the same header, blocks and own rows.
inline constexpr char pool_file_magic[8] = {'K', 'V', 'Q', '_', 'P', 'O', 'O', 'L'};
inline constexpr std::uint32_t pool_file_version = 2;                         // 1 is still read
inline constexpr std::uint32_t tag_block = 0x4B4F4C42, tag_own = 0x524E574F,  // "BLOK" "OWNR"
    tag_ropes = 0x45504F52;                                                   // "ROPE"
// Configuration text a header holds: a pool's text grows with its layers, and a codebook per KV
// head spells 2^bits x 4 hex digits per head and tensor.
inline constexpr std::size_t max_config_text = std::size_t(1) << 18;

/// Throws, before anything is written, where a file could not hold a configuration's text.
inline void check_config_text(const std::string& text) {
  if (text.size() > max_config_text)
    throw Error(ErrorCode::invalid_argument, "save: a configuration text of " + std::to_string(text.size()) +
                                                 " bytes exceeds the file format's " + std::to_string(max_config_text));
}
// The header's fixed fields: kvq version, shape, RoPE style and theta, config text length; and
// those of the RoPE extension of version 2, without its frequency divisors.
inline constexpr std::uint64_t header_fixed_bytes = 3 * 4 + 4 * 8 + 4 + 4 + 4,
                               rope_extension_bytes = 8 + 4 + 4 + 8 + 5 * 4 + 4;
inline constexpr std::uint64_t max_frequency_divisors = max_head_dim / 2;

inline std::string hex(std::uint32_t x) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s = "0x";
  for (int shift = 28; shift >= 0; shift -= 4) s += digits[(x >> shift) & 0xF];
  return s;
}

/// Index of the first NaN or infinite value among the `count` values of `type` at p, or count.
/// Runs of 256 are tested with a flag first, a loop compilers vectorize: loading a file stays
/// bound by reading it.
inline std::size_t first_non_finite(Scalar type, const std::uint8_t* p, std::size_t count) noexcept {
  auto scan = [&]<class Word>(Word exponent) {  // all exponent bits set: infinity or NaN
    constexpr std::size_t run = 256;
    for (std::size_t i = 0; i < count; i += run) {
      const std::size_t n = std::min(run, count - i);
      auto at = [&](std::size_t j) {
        Word w;
        std::memcpy(&w, p + (i + j) * sizeof(Word), sizeof(Word));
        return Word(w & exponent) == exponent;
      };
      unsigned any = 0;
      for (std::size_t j = 0; j < n; ++j) any |= unsigned(at(j));
      if (any != 0)
        for (std::size_t j = 0;; ++j)
          if (at(j)) return i + j;
    }
    return count;
  };
  if (type == Scalar::f32) return scan(std::uint32_t(0x7F800000u));
  return scan(std::uint16_t(type == Scalar::f16 ? 0x7C00 : 0x7F80));
}

/// The state behind a cache's public view: what a file holds of it, and restoring it.
struct CacheAccess {
  struct StreamState {
    std::uint64_t quantized_end = 0, rollback_floor = 0, kept_from = 0;
  };
  struct LayerState {
    std::uint64_t length = 0;
    StreamState streams[2];
    float key_peak = 0.0f;  // the largest |key| appended: attention's overflow check needs it
  };
  /// Bytes of one layer's table entry: length, three positions per stream, the key peak.
  static constexpr std::uint64_t table_entry_bytes = 7 * 8 + 4;

  static const StreamLayout& layout(const BasicKVCache& c, Tensor t) { return c.layouts_[BasicKVCache::index(t)]; }
  static std::size_t row(const StreamLayout& lay) { return BasicKVCache::row_size(lay); }
  static std::size_t params(const StreamLayout& lay, std::size_t rows) { return BasicKVCache::param_offset(lay, rows); }
  /// Bytes of the outlier entries (slots, then corrections) of `rows` packed rows.
  static std::size_t outlier_bytes(const StreamLayout& lay, std::size_t rows) {
    return params(lay, rows) / size_of(lay.spec.param) * lay.spec.outliers * (2 + size_of(lay.spec.param));
  }

  static LayerState state(const BasicKVCache& c, std::size_t layer) {
    LayerState s;
    s.length = c.lengths_[layer];
    s.key_peak = c.key_peaks_[layer];
    for (const Tensor t : {Tensor::keys, Tensor::values})
      s.streams[BasicKVCache::index(t)] = {c.quantized_end(t, layer), c.rollback_floor(t, layer),
                                           c.kept_from_[layer * 2 + BasicKVCache::index(t)]};
    return s;
  }

  /// First position the ring holds when the layer holds `length` tokens.
  static std::size_t first_in_ring(const StreamLayout& lay, std::size_t length) {
    return length > lay.sinks && length - lay.sinks > lay.ring_rows ? length - lay.ring_rows : lay.sinks;
  }

  /// Which pieces of a layer a section holds: all of them (a cache file), or only the cache's
  /// own rows (a pool file, which holds the blocks once each beside the sequences).
  enum class Pieces { all, own };

  /// Bytes one stream of one head takes in a layer section.
  static std::size_t stream_bytes(const BasicKVCache& c, Tensor t, std::uint64_t length, const StreamState& s,
                                  Pieces pieces) {
    const StreamLayout& lay = layout(c, t);
    const std::size_t n = std::size_t(length), end = std::size_t(s.quantized_end), packed = end - lay.sinks;
    const std::size_t first = first_in_ring(lay, n), kept = std::size_t(s.kept_from);
    const std::size_t ring = n > first && (pieces == Pieces::all || lay.quantized) ? n - first : 0;
    const std::size_t own = (std::min(lay.sinks, n) + ring + (end - kept)) * row(lay);
    if (pieces == Pieces::own) return own;
    return own + packed * lay.row_bytes + params(lay, packed) * (lay.spec.has_zero_point() ? 2 : 1) +
           outlier_bytes(lay, packed);
  }

  static std::size_t layer_bytes(const BasicKVCache& c, const LayerState& s, Pieces pieces = Pieces::all) {
    std::size_t n = 0;
    for (const Tensor t : {Tensor::keys, Tensor::values})
      n += stream_bytes(c, t, s.length, s.streams[BasicKVCache::index(t)], pieces);
    return n * c.shape().kv_heads;
  }

  /// The blocks layer `layer` refers to, in position order.
  static const std::vector<BlockId>& table(const BasicKVCache& c, std::size_t layer) { return c.tables_[layer]; }
  /// Blocks of `layer` no append writes again: full for both tensors (packed rows, or every row
  /// of an unquantized tensor). Only truncate and erase rewrite them, copying shared ones first.
  static std::size_t sealed_blocks(const BasicKVCache& c, std::size_t layer) {
    const std::size_t n = c.lengths_[layer];
    const std::size_t rows = std::min(c.block_rows_used(Tensor::keys, n, c.quantized_end(Tensor::keys, layer)),
                                      c.block_rows_used(Tensor::values, n, c.quantized_end(Tensor::values, layer)));
    return std::min(rows / c.block_rows_, c.tables_[layer].size());
  }
  /// The sink rows of one stream of `layer` that the layer holds.
  static std::pair<const std::uint8_t*, std::size_t> sink_rows(const BasicKVCache& c, Tensor t, std::size_t layer,
                                                               std::size_t head) {
    const StreamLayout& lay = layout(c, t);
    return {c.own_base(t, layer, head) + lay.sink_offset, std::min(lay.sinks, c.lengths_[layer]) * row(lay)};
  }
  /// Makes block k of `layer` refer to `other` instead, which holds the same bytes (the caller
  /// compared them): one block fewer in use when the old one had no other reference.
  static void share_block(BasicKVCache& c, std::size_t layer, std::size_t k, BlockId other) noexcept {
    BlockId& mine = c.tables_[layer][k];
    c.store_->retain(other);
    c.store_->release(mine);
    mine = other;
  }

  /// A pool's reorder in two steps: room in `to`'s block tables for `from`'s (may throw), then
  /// `to` made to hold what `from` holds, sharing its blocks as a fork does, in the own rows `to`
  /// already has (cannot fail). Both are caches of one pool group: one store, shape and config.
  static void reserve_share(BasicKVCache& to, const BasicKVCache& from) {
    for (std::size_t l = 0; l < to.tables_.size(); ++l) to.tables_[l].reserve(from.tables_[l].size());
  }
  static void share(BasicKVCache& to, const BasicKVCache& from) noexcept {
    for (const auto& table : from.tables_)
      for (const BlockId id : table) from.store_->retain(id);
    to.release_blocks();
    for (std::size_t l = 0; l < to.tables_.size(); ++l)
      to.tables_[l].assign(from.tables_[l].begin(), from.tables_[l].end());  // within the room reserved
    if (from.own_.size() != 0) std::memcpy(to.own_.data(), from.own_.data(), from.own_.size());
    if (from.history_.size() != 0) std::memcpy(to.history_.data(), from.history_.data(), from.history_.size());
    std::copy(from.lengths_.begin(), from.lengths_.end(), to.lengths_.begin());
    std::copy(from.key_peaks_.begin(), from.key_peaks_.end(), to.key_peaks_.begin());
    std::copy(from.value_peaks_.begin(), from.value_peaks_.end(), to.value_peaks_.begin());
    std::copy(from.quantized_ends_.begin(), from.quantized_ends_.end(), to.quantized_ends_.begin());
    std::copy(from.history_begins_.begin(), from.history_begins_.end(), to.history_begins_.begin());
    std::copy(from.kept_from_.begin(), from.kept_from_.end(), to.kept_from_.begin());
  }

  /// truncate's and erase's checks with the blocks their copies of shared blocks take set aside,
  /// then the copies, without the change itself.
  static BlockReservation reserve_truncate(BasicKVCache& c, std::size_t length) { return c.reserve_truncate(length); }
  static BlockReservation reserve_erase(BasicKVCache& c, std::size_t first, std::size_t count) {
    return c.reserve_erase(first, count);
  }
  static void prepare_truncate(BasicKVCache& c, std::size_t length, BlockReservation& reserved) {
    c.prepare_truncate(length, reserved);
  }
  static void prepare_erase(BasicKVCache& c, std::size_t first, std::size_t count, BlockReservation& reserved) {
    c.prepare_erase(first, count, reserved);
  }
  /// erase after prepare_erase, staging in `staged` (erase_staging_bytes(c, first, count) bytes):
  /// cannot fail.
  static std::size_t erase_staging_bytes(const BasicKVCache& c, std::size_t first, std::size_t count) noexcept {
    return c.erase_staging_bytes(first, count);
  }
  static void erase_prepared(BasicKVCache& c, std::size_t first, std::size_t count, std::uint8_t* staged) noexcept {
    c.erase_prepared(first, count, staged);
  }

  /// Blocks a layer in state `s` refers to.
  static std::size_t blocks_for(const BasicKVCache& c, const LayerState& s) {
    return c.blocks_for(std::size_t(s.length), std::size_t(s.streams[0].quantized_end),
                        std::size_t(s.streams[1].quantized_end));
  }

  /// Why `s` is not a state the cache can be in (empty when it is one).
  static std::string check(const BasicKVCache& c, const LayerState& s) {
    if (s.length > c.capacity())
      return "length " + std::to_string(s.length) + " exceeds the capacity of " + std::to_string(c.capacity());
    if (!(s.key_peak >= 0.0f) || !std::isfinite(s.key_peak))
      return "key peak " + std::to_string(s.key_peak) + " is not a finite magnitude";
    const std::size_t length = std::size_t(s.length);
    for (const Tensor t : {Tensor::keys, Tensor::values}) {
      const StreamLayout& lay = layout(c, t);
      const StreamState& st = s.streams[BasicKVCache::index(t)];
      const std::string what = std::string(to_string(t)) + " quantized end " + std::to_string(st.quantized_end);
      // Reachable states quantize at least what the rule says and only whole groups (and whole
      // flushes) of held tokens.
      if (st.quantized_end < lay.quantized_end(length) || st.quantized_end > std::max(length, lay.sinks) ||
          st.quantized_end - lay.sinks > lay.max_quantized_rows)
        return what + " is impossible for " + std::to_string(length) + " tokens";
      if (lay.quantized && lay.spec.axis == Axis::per_channel && (st.quantized_end - lay.sinks) % lay.spec.group != 0)
        return what + " splits a group of " + std::to_string(lay.spec.group);
      if (lay.flush && (st.quantized_end - lay.sinks) % lay.window != 0)
        return what + " splits a flush of " + std::to_string(lay.window);
      // The history holds at most history_rows packed rows; the floor lies between the sinks and
      // the length, and rows before the ring are held only where the history has them.
      const std::size_t first = first_in_ring(lay, length);
      if (st.kept_from < lay.sinks || st.kept_from > st.quantized_end ||
          st.quantized_end - st.kept_from > lay.history_rows)
        return std::string(to_string(t)) + " rollback history from " + std::to_string(st.kept_from) +
               " is impossible for quantized end " + std::to_string(st.quantized_end);
      if (st.rollback_floor < lay.sinks || st.rollback_floor > std::max(length, lay.sinks) ||
          st.rollback_floor < std::min<std::uint64_t>(st.kept_from, first))
        return std::string(to_string(t)) + " rollback floor " + std::to_string(st.rollback_floor) +
               " is impossible for " + std::to_string(length) + " tokens";
    }
    return {};
  }

  /// What a piece of a layer section holds.
  enum class Piece { rows, codes, scales, zero_points, outlier_slots, outlier_corrections };

  /// Where a piece lives when it is not in a block: the cache's own rows.
  static constexpr std::size_t own_piece = std::size_t(-1);

  /// Calls visit(piece, tensor, bytes, block, at) for every piece of one layer section, in file
  /// order, where `block` is the index of the layer's block that holds the piece, or own_piece,
  /// and at() its place in `c` (const to save, mutable to restore) in state `s`, computed only
  /// when called. Packed rows [0, packed) of one stream are in blocks: the file holds all their
  /// codes, then all scales, then all zero points, then the outliers' slots and corrections,
  /// each visited by runs within one block. Pieces::own skips whatever lives in blocks (those and
  /// the rows of an unquantized stream).
  template <class Cache, class Visit>
  static void visit_pieces(Cache& c, std::size_t layer, const LayerState& s, Visit&& visit,
                           Pieces pieces = Pieces::all) {
    using Byte = std::conditional_t<std::is_const_v<Cache>, const std::uint8_t, std::uint8_t>;
    auto& cache = const_cast<BasicKVCache&>(c);  // pointers only; a const cache is only read
    const std::size_t block = cache.block_rows_;
    for (std::size_t h = 0; h < c.shape().kv_heads; ++h)
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const StreamLayout& lay = layout(c, t);
        const StreamState& st = s.streams[BasicKVCache::index(t)];
        const std::size_t r = row(lay), end = std::size_t(st.quantized_end), packed = end - lay.sinks;
        const std::size_t length = std::size_t(s.length), first = first_in_ring(lay, length);
        visit(Piece::rows, t, std::min(lay.sinks, length) * r, own_piece,
              [&] { return static_cast<Byte*>(cache.own_base(t, layer, h)) + lay.sink_offset; });
        if (pieces == Pieces::all || lay.quantized)
          for (std::size_t p = first; p < length; ++p)
            visit(Piece::rows, t, r, lay.quantized ? own_piece : (p - lay.sinks) / block,
                  [&] { return static_cast<Byte*>(cache.ring_row(t, layer, h, p)); });
        for (const Piece part :
             {Piece::codes, Piece::scales, Piece::zero_points, Piece::outlier_slots, Piece::outlier_corrections}) {
          if (pieces == Pieces::own) break;
          if ((part == Piece::zero_points && !lay.spec.has_zero_point()) ||
              (part >= Piece::outlier_slots && lay.spec.outliers == 0))
            continue;
          for (std::size_t a = 0; a < packed;) {
            const std::size_t n = std::min(packed - a, block - a % block), k = a / block;
            const std::size_t entries = params(lay, n) / size_of(lay.spec.param) * lay.spec.outliers;
            if (part == Piece::codes) {
              visit(part, t, n * lay.row_bytes, k, [&] { return static_cast<Byte*>(cache.code_row(t, layer, h, a)); });
            } else if (part == Piece::scales || part == Piece::zero_points) {
              visit(part, t, params(lay, n), k, [&] {
                const auto [scales, zeros] = cache.params_of(t, layer, h, a);
                return static_cast<Byte*>(part == Piece::scales ? scales : zeros);
              });
            } else if (part == Piece::outlier_slots) {
              visit(part, t, entries * 2, k,
                    [&] { return reinterpret_cast<Byte*>(cache.outliers_of(t, layer, h, a).slots); });
            } else {
              visit(part, t, entries * size_of(lay.spec.param), k,
                    [&] { return static_cast<Byte*>(cache.outliers_of(t, layer, h, a).corrections); });
            }
            a += n;
          }
        }
        for (std::size_t p = std::size_t(st.kept_from); p < end; ++p)
          visit(Piece::rows, t, r, own_piece, [&] { return static_cast<Byte*>(cache.history_row(t, layer, h, p)); });
      }
  }

  /// Why the n bytes of a piece at `p` are no contents a cache writes (empty when they are): a
  /// full-precision value or parameter that is NaN or infinite, an outlier slot outside its group
  /// or out of order, an fp8 code the encoder never writes. A CRC catches damage; this catches a
  /// file written by something else, whose bytes the kernels would trust (an outlier slot indexes
  /// their memory).
  static std::string check_piece(const StreamLayout& lay, Piece piece, const std::uint8_t* p, std::size_t n) {
    const QuantizerSpec& spec = lay.spec;
    switch (piece) {
      case Piece::rows:
      case Piece::scales:
      case Piece::zero_points:
      case Piece::outlier_corrections: {
        const Scalar type = piece == Piece::rows ? lay.residual : spec.param;
        const std::size_t count = n / size_of(type), i = first_non_finite(type, p, count);
        if (i == count) return {};
        const char* what = piece == Piece::rows          ? "full-precision value"
                           : piece == Piece::scales      ? "scale"
                           : piece == Piece::zero_points ? "zero point"
                                                         : "outlier correction";
        return std::string(what) + " " + std::to_string(i) + " of a run of " + std::to_string(count) +
               " is NaN or infinite";
      }
      case Piece::codes:  // fp8: the encoder saturates, so no code is NaN (or infinite, e5m2)
        if (spec.mode == Mode::fp8_e4m3)
          for (std::size_t i = 0; i < n; ++i)
            if ((p[i] & 0x7F) == 0x7F) return "code " + std::to_string(i) + " of a run is an e4m3 NaN";
        if (spec.mode == Mode::fp8_e5m2)
          for (std::size_t i = 0; i < n; ++i)
            if ((p[i] & 0x7F) >= 0x7C) return "code " + std::to_string(i) + " of a run is an e5m2 infinity or NaN";
        return {};
      case Piece::outlier_slots: {
        // Every group holds `group` values: per token, outliers take only groups that divide head_dim.
        const std::size_t k = std::size_t(spec.outliers), size = spec.group;
        for (std::size_t e = 0; e < n / 2; ++e) {
          std::uint16_t slot, before = 0;
          std::memcpy(&slot, p + 2 * e, 2);
          if (e % k != 0) std::memcpy(&before, p + 2 * (e - 1), 2);
          if (slot >= size || (e % k != 0 && slot <= before))
            return "outlier slot " + std::to_string(slot) + " (entry " + std::to_string(e) + " of a run) is " +
                   (slot >= size ? "outside its group of " + std::to_string(size) : "not above the one before it");
        }
        return {};
      }
    }
    return {};
  }

  /// Bytes checked from each place a piece starts: a block shared by sequences is checked once for
  /// the longest extent any of them uses (a forged file may give them different ones).
  using CheckedPieces = std::unordered_map<const std::uint8_t*, std::size_t>;

  /// The first problem check_piece finds in one layer section of `c` in state `s`, as its tensor
  /// and the problem, read from the cache itself, skipping what `checked` says was checked and
  /// adding the rest.
  static std::string check_section(const BasicKVCache& c, std::size_t layer, const LayerState& s,
                                   CheckedPieces* checked = nullptr) {
    std::string why;
    visit_pieces(c, layer, s, [&](Piece piece, Tensor t, std::size_t n, std::size_t block, auto at) {
      if (!why.empty() || n == 0) return;
      const std::uint8_t* p = at();
      // Own rows are checked where they are; a block may be shared, and is checked once.
      std::size_t* done = checked != nullptr && block != own_piece ? &(*checked)[p] : nullptr;
      if (done == nullptr || *done < n) why = check_piece(layout(c, t), piece, p, n);
      if (done != nullptr) *done = std::max(*done, n);
      if (!why.empty()) why = std::string(to_string(t)) + ": " + why;
    });
    return why;
  }

  /// The blocks a load of `states` takes, reserved (counted, not yet allocated). Throws kvq::Error
  /// when the store cannot supply them.
  static BlockReservation reserve_blocks(BasicKVCache& c, const std::vector<LayerState>& states) {
    std::size_t total = 0;
    for (const LayerState& s : states) total += blocks_for(c, s);  // checked states: no overflow
    BlockReservation reserved(*c.store_);
    if (std::size_t free = 0; !reserved.add(total, &free))
      throw Error(ErrorCode::capacity_exceeded, "a cache being loaded needs " + std::to_string(total) + " blocks of " +
                                                    std::to_string(c.store_->block_bytes()) + " bytes; " +
                                                    std::to_string(free) + " are free");
    return reserved;
  }

  /// New blocks for a load, filled through the cache's own addressing (at() of visit_pieces):
  /// while this lives the cache's block tables are the new ones, taken as a read reaches them, and
  /// its own tables wait aside. take() puts them back and hands over the new ones; a throw before
  /// that puts them back, lets the new blocks go and gives the store back the slabs it committed
  /// for them. The cache is not to be used meanwhile.
  class FreshBlocks {
   public:
    FreshBlocks(BasicKVCache& c, BlockReservation& reserved)
        : cache_(c), reserved_(reserved), committed_before_(c.store_->counts().committed) {
      kept_.resize(c.tables_.size());
      c.tables_.swap(kept_);
    }
    FreshBlocks(const FreshBlocks&) = delete;
    FreshBlocks& operator=(const FreshBlocks&) = delete;
    ~FreshBlocks() {
      if (taken_) return;
      cache_.tables_.swap(kept_);
      bool any = false;
      for (const auto& table : kept_)
        for (const BlockId id : table) cache_.store_->release(id), any = true;
      if (any) cache_.store_->give_back_unused(committed_before_);
    }
    /// Room for the `blocks` blocks `layer` will take.
    void plan(std::size_t layer, std::size_t blocks) { cache_.tables_[layer].reserve(blocks); }
    /// Takes blocks until `layer` has block `k` (zeroed).
    void reach(std::size_t layer, std::size_t k) {
      std::vector<BlockId>& table = cache_.tables_[layer];
      while (table.size() <= k) {
        table.reserve(k + 1);  // before the block, a throw must not strand one; a no-op once planned
        table.push_back(reserved_.take());
      }
    }
    std::vector<std::vector<BlockId>> take() noexcept {
      taken_ = true;
      cache_.tables_.swap(kept_);
      return std::move(kept_);
    }

   private:
    BasicKVCache& cache_;
    BlockReservation& reserved_;
    std::size_t committed_before_;
    std::vector<std::vector<BlockId>> kept_;
    bool taken_ = false;
  };

  /// The largest |x| of the `bytes` bytes of `type` values at p.
  static float largest_in(Scalar type, const std::uint8_t* p, std::size_t bytes) noexcept {
    float chunk[max_head_dim], peak = 0.0f;
    const std::size_t count = bytes / size_of(type);
    for (std::size_t i = 0; i < count; i += max_head_dim) {
      const std::size_t n = std::min(max_head_dim, count - i);
      load_row(type, p + i * size_of(type), n, chunk);
      peak = std::max(peak, largest_magnitude(chunk, n));
    }
    return peak;
  }

  /// Replaces the cache's contents with checked layer states, the blocks it now holds (filled)
  /// and its own rows (`own`: per layer, as visit_pieces with Pieces::own lists them). noexcept:
  /// everything was validated before.
  static void restore(BasicKVCache& c, const std::vector<LayerState>& states,
                      const std::vector<std::vector<std::uint8_t>>& own,
                      std::vector<std::vector<BlockId>>&& tables) noexcept {
    c.clear();
    c.tables_ = std::move(tables);
    for (std::size_t l = 0; l < states.size(); ++l) {
      const LayerState& s = states[l];
      const std::uint8_t* in = own[l].data();
      float rows_peak[2] = {0.0f, 0.0f};  // every restored row: truncate re-opens history and ring rows
      visit_pieces(
          c, l, s,
          [&](Piece, Tensor t, std::size_t n, std::size_t, auto at) {
            if (n != 0) std::memcpy(at(), in, n);
            rows_peak[BasicKVCache::index(t)] =
                std::max(rows_peak[BasicKVCache::index(t)], largest_in(layout(c, t).residual, in, n));
            in += n;
          },
          Pieces::own);
      c.lengths_[l] = std::size_t(s.length);
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const std::size_t i = l * 2 + BasicKVCache::index(t);
        c.quantized_ends_[i] = std::size_t(s.streams[BasicKVCache::index(t)].quantized_end);
        c.history_begins_[i] = std::size_t(s.streams[BasicKVCache::index(t)].rollback_floor);
        c.kept_from_[i] = std::size_t(s.streams[BasicKVCache::index(t)].kept_from);
      }
      // Attention trusts the peaks to bound what it reads, so they cover what the file holds. A
      // saved peak is kept while the stored keys stay within twice it plus 1: dequantized keys
      // round a little past the appended ones (tiny ones by f16 subnormal steps), and attention's
      // score bound allows for it, so round trips stay exact. In double: 2 x peak may pass FLT_MAX.
      const float keys = std::max(rows_peak[0], c.largest_stored(Tensor::keys, l));
      c.key_peaks_[l] = double(keys) <= 2.0 * double(s.key_peak) + 1.0 ? s.key_peak : keys;
      c.value_peaks_[l] = std::max(rows_peak[1], c.largest_stored(Tensor::values, l));
    }
  }
};

/// Writes one section: tag, size, the pieces, then the CRC of all of them.
class SectionWriter {
 public:
  SectionWriter(std::ostream& out, std::uint32_t tag, std::uint64_t size) : out_(out) {
    put(&tag, sizeof tag);
    put(&size, sizeof size);
  }
  void put(const void* data, std::size_t n) {
    if (n == 0) return;
    crc_ = crc32c(data, n, crc_);
    out_.write(static_cast<const char*>(data), std::streamsize(n));
  }
  template <class T>
  void put_value(T x) {
    put(&x, sizeof x);
  }
  void finish() {
    const std::uint32_t crc = crc_;
    out_.write(reinterpret_cast<const char*>(&crc), sizeof crc);
  }

 private:
  std::ostream& out_;
  std::uint32_t crc_ = 0;
};

/// Reads a stream while counting the offset, so every error can say where it happened.
class FileReader {
 public:
  /// `kind` names the file in errors ("kvq cache file").
  FileReader(std::istream& in, std::string kind = "kvq cache file") : in_(in), kind_(std::move(kind)) {}

  std::uint64_t offset() const noexcept { return offset_; }
  /// Renames the file in later errors, once its magic has said what it is.
  void set_kind(std::string kind) { kind_ = std::move(kind); }

  [[noreturn]] void fail(const std::string& section, std::uint64_t at, const std::string& why) const {
    throw Error(ErrorCode::io, kind_ + ", section '" + section + "' at offset " + std::to_string(at) + ": " + why);
  }

  void read(void* dest, std::size_t n, const std::string& section) {
    in_.read(static_cast<char*>(dest), std::streamsize(n));
    const std::size_t got = std::size_t(in_.gcount());
    offset_ += got;
    if (got != n)
      fail(section, offset_, "the file ends " + std::to_string(n - got) + " bytes early (truncated or unreadable)");
  }
  template <class T>
  T read_value(const std::string& section) {
    T x;
    read(&x, sizeof x, section);
    return x;
  }

  /// Reads one section whose tag and size the caller expects and checks its CRC. Past the first
  /// 64 MiB the buffer grows only as bytes arrive, so a size field cannot allocate much more
  /// than the file holds.
  std::vector<std::uint8_t> section(std::uint32_t tag, std::uint64_t size, const std::string& name) {
    return section(tag, size, size, name);
  }
  /// The same for a section of [least, most] bytes.
  std::vector<std::uint8_t> section(std::uint32_t tag, std::uint64_t least, std::uint64_t most,
                                    const std::string& name) {
    std::vector<std::uint8_t> payload;
    checked_section(tag, least, most, name, [&](std::uint64_t size, std::uint32_t& crc) {
      payload.reserve(std::min<std::size_t>(std::size_t(size), std::size_t(64) << 20));
      constexpr std::size_t chunk = std::size_t(1) << 20;
      while (payload.size() < size) {
        const std::size_t n = std::min<std::size_t>(chunk, std::size_t(size) - payload.size());
        payload.resize(payload.size() + n);
        read(payload.data() + payload.size() - n, n, name);
      }
      crc = crc32c(payload.data(), payload.size(), crc);
    });
    return payload;
  }
  /// Reads a section of exactly `size` bytes into `dest` (which may hold garbage after a throw).
  void section_into(std::uint32_t tag, std::uint64_t size, const std::string& name, void* dest) {
    checked_section(tag, size, size, name, [&](std::uint64_t n, std::uint32_t& crc) {
      read(dest, std::size_t(n), name);
      crc = crc32c(dest, std::size_t(n), crc);
    });
  }

  void expect_end() {
    if (in_.peek() != std::char_traits<char>::eof()) fail("end", offset_, "unexpected bytes after the last section");
  }

  /// Bytes left in the stream, where it can seek (a file, a string); nullopt where it cannot.
  std::optional<std::uint64_t> remaining() {
    const std::istream::pos_type here = in_.tellg();
    if (here == std::istream::pos_type(-1)) return std::nullopt;
    const std::istream::pos_type end = in_.seekg(0, std::ios::end).tellg();
    in_.clear();
    in_.seekg(here);
    if (end == std::istream::pos_type(-1) || !in_) {
      in_.clear();
      return std::nullopt;
    }
    return std::uint64_t(end - here);
  }

  /// Tag and size (checked), the payload through read_payload(size, crc), then the CRC: for a
  /// reader that puts the payload where it belongs as it arrives (a cache's layers).
  template <class ReadPayload>
  void checked_section(std::uint32_t tag, std::uint64_t least, std::uint64_t most, const std::string& name,
                       ReadPayload&& read_payload) {
    const std::uint64_t start = offset_;
    const auto file_tag = read_value<std::uint32_t>(name);
    const auto file_size = read_value<std::uint64_t>(name);
    if (file_tag != tag) fail(name, start, "tag " + hex(file_tag) + " where " + hex(tag) + " belongs");
    if (least == most && file_size != least)
      fail(name, start,
           "declares " + std::to_string(file_size) + " bytes where its table entries make " + std::to_string(least));
    if (file_size < least || file_size > most)
      fail(name, start,
           "implausible size " + std::to_string(file_size) + " (expected " + std::to_string(least) + " to " +
               std::to_string(most) + ")");
    std::uint32_t crc = crc32c(&file_tag, sizeof file_tag);
    crc = crc32c(&file_size, sizeof file_size, crc);
    read_payload(file_size, crc);
    const auto stored = read_value<std::uint32_t>(name);
    if (stored != crc)
      fail(name, start,
           "CRC-32C mismatch (stored " + hex(stored) + ", computed " + hex(crc) + "): the section is corrupt");
  }

 private:
  std::istream& in_;
  std::string kind_;
  std::uint64_t offset_ = 0;
};

/// Bounds-checked reads of fixed fields from a checked payload.
class PayloadReader {
 public:
  PayloadReader(const std::vector<std::uint8_t>& bytes, const FileReader& file, std::string section,
                std::uint64_t start)
      : bytes_(bytes), file_(file), section_(std::move(section)), start_(start) {}
  template <class T>
  T value() {
    T x;
    bytes(&x, sizeof x);
    return x;
  }
  std::size_t remaining() const noexcept { return bytes_.size() - at_; }
  [[noreturn]] void fail(const std::string& why) const { file_.fail(section_, start_, why); }
  void bytes(void* dest, std::size_t n) {
    if (n > bytes_.size() - at_) fail("its fields run past its " + std::to_string(bytes_.size()) + " bytes");
    if (n != 0) std::memcpy(dest, bytes_.data() + at_, n);  // dest may be null then (an empty vector's data)
    at_ += n;
  }

 private:
  const std::vector<std::uint8_t>& bytes_;
  const FileReader& file_;
  std::string section_;
  std::uint64_t start_;
  std::size_t at_ = 0;
};

/// What the file header says: the shape and configuration of the saved cache.
struct FileHeader {
  CacheShape shape;
  std::string config_text;
  CacheConfig config;  // a cache file's (a pool file's text is checked, and compared as text)
};

/// What a header's configuration text holds: one configuration (cache files) or one per layer
/// (pool files).
enum class ConfigText { one, per_layer };

/// The file's first 8 bytes: which kind of file it is.
inline std::string read_magic(FileReader& file) {
  std::string found(8, '\0');
  file.read(found.data(), found.size(), "preamble");
  return found;
}
inline bool is_magic(const std::string& found, const char (&magic)[8]) {
  return std::memcmp(found.data(), magic, 8) == 0;
}

/// The preamble after the magic: checks the format version (one of 1..newest) and byte order;
/// returns the version.
inline std::uint32_t read_version(FileReader& file, std::uint32_t newest) {
  const auto version = file.read_value<std::uint32_t>("preamble");
  if (version == 0 || version > newest)
    file.fail("preamble", 8,
              "format version " + std::to_string(version) + "; this kvq reads versions 1 to " + std::to_string(newest));
  const auto marker = file.read_value<std::uint32_t>("preamble");
  if (marker != byte_order_marker)
    file.fail("preamble", 12,
              marker == 0x04030201u ? std::string("written on a machine of the other byte order")
                                    : "byte-order marker " + hex(marker) + " is neither order");
  return version;
}

/// Checks the magic, format version (one of 1..newest) and byte order; returns the version.
inline std::uint32_t read_preamble(FileReader& file, const char (&magic)[8], std::uint32_t newest, const char* what) {
  if (!is_magic(read_magic(file), magic)) file.fail("preamble", 0, std::string("not a ") + what + " (wrong magic)");
  return read_version(file, newest);
}

inline void write_preamble(std::ostream& out, const char (&magic)[8], std::uint32_t version) {
  out.write(magic, 8);
  out.write(reinterpret_cast<const char*>(&version), 4);
  out.write(reinterpret_cast<const char*>(&byte_order_marker), 4);
}

/// Bytes of the RoPE fields write_rope writes.
inline std::uint64_t rope_bytes(const CacheShape& s) {
  return 4 + 4 + rope_extension_bytes + 4 * s.rope_scaling.frequency_divisors.size();
}

/// The RoPE of `s` as a header (format version 2) holds it: style, theta, rotary dims, scaling.
inline void write_rope(SectionWriter& w, const CacheShape& s) {
  const RopeScaling r = canonical(s.rope_scaling);  // one RoPE, one spelling, one file
  w.put_value(std::uint32_t(s.rope_style));
  w.put_value(s.rope_theta);
  w.put_value(std::uint64_t(s.rope().dims()));
  w.put_value(std::uint32_t(r.type));
  w.put_value(r.factor);
  w.put_value(std::uint64_t(r.original_context));
  for (const float x : {r.low_freq_factor, r.high_freq_factor, r.beta_fast, r.beta_slow, r.attention_factor})
    w.put_value(x);
  w.put_value(std::uint32_t(r.frequency_divisors.size()));
  w.put(r.frequency_divisors.data(), 4 * r.frequency_divisors.size());
}

/// Reads what write_rope wrote (format version 1: the style and theta only, every channel
/// rotated, no scaling) into the RoPE fields of `s`, whose head_dim is set, and validates it.
inline void read_rope(PayloadReader& in, std::uint32_t version, CacheShape& s) {
  const auto style = in.value<std::uint32_t>();
  s.rope_theta = in.value<float>();
  std::uint64_t dims = s.head_dim;
  s.rope_scaling = RopeScaling{};
  if (version >= 2) {
    dims = in.value<std::uint64_t>();
    RopeScaling& scaling = s.rope_scaling;
    const auto type = in.value<std::uint32_t>();
    if (type > std::uint32_t(RopeScalingType::yarn)) in.fail("unknown RoPE scaling type " + std::to_string(type));
    scaling.type = RopeScalingType(type);
    scaling.factor = in.value<float>();
    const auto context = in.value<std::uint64_t>();
    for (float* x : {&scaling.low_freq_factor, &scaling.high_freq_factor, &scaling.beta_fast, &scaling.beta_slow,
                     &scaling.attention_factor})
      *x = in.value<float>();
    const auto divisors = in.value<std::uint32_t>();
    if (divisors > max_frequency_divisors || context > std::numeric_limits<std::size_t>::max())
      in.fail("implausible RoPE scaling (" + std::to_string(divisors) + " frequency divisors)");
    scaling.original_context = std::size_t(context);
    scaling.frequency_divisors.resize(divisors);
    in.bytes(scaling.frequency_divisors.data(), 4 * std::size_t(divisors));
  }
  if (style > std::uint32_t(RopeStyle::none)) in.fail("unknown RoPE style " + std::to_string(style));
  if (dims > std::numeric_limits<std::size_t>::max()) in.fail("a shape field exceeds this machine's size_t");
  s.rope_style = RopeStyle(style);
  s.rope_dims = dims == s.head_dim ? 0 : std::size_t(dims);
  try {
    validate(s.rope());
  } catch (const Error& e) {
    in.fail(std::string("the RoPE it records is invalid: ") + e.what());
  }
}

/// The header section (format version 2) of a cache of `s` configured `config`.
inline void write_header(std::ostream& out, const CacheShape& s, const std::string& config) {
  SectionWriter w(out, tag_header, header_fixed_bytes - 8 + rope_bytes(s) + config.size());
  for (const int v : {version_major, version_minor, version_patch}) w.put_value(std::uint32_t(v));
  for (const std::size_t v : {s.layers, s.kv_heads, s.head_dim, s.capacity}) w.put_value(std::uint64_t(v));
  write_rope(w, s);
  w.put_value(std::uint32_t(config.size()));
  w.put(config.data(), config.size());
  w.finish();
}

/// Reads the header section of a file of format `version`.
inline FileHeader read_header(FileReader& file, std::uint32_t version, ConfigText text = ConfigText::one) {
  const std::uint64_t start = file.offset();
  const std::uint64_t fixed = header_fixed_bytes + (version >= 2 ? rope_extension_bytes : 0);
  const auto payload = file.section(
      tag_header, fixed, fixed + (version >= 2 ? 4 * max_frequency_divisors : 0) + max_config_text, "header");
  PayloadReader in(payload, file, "header", start);
  FileHeader h;
  for (int i = 0; i < 3; ++i) (void)in.value<std::uint32_t>();  // the writing kvq's version: for people, not checked
  const auto layers = in.value<std::uint64_t>(), heads = in.value<std::uint64_t>(), dim = in.value<std::uint64_t>(),
             capacity = in.value<std::uint64_t>();
  constexpr std::uint64_t most = std::numeric_limits<std::size_t>::max();
  if (layers > most || heads > most || dim > most || capacity > most)
    in.fail("a shape field exceeds this machine's size_t");
  h.shape = CacheShape{std::size_t(layers), std::size_t(heads), std::size_t(dim), std::size_t(capacity)};
  read_rope(in, version, h.shape);
  const auto n = in.value<std::uint32_t>();
  if (n != in.remaining()) in.fail("configuration text of " + std::to_string(n) + " bytes does not fill the section");
  h.config_text.resize(n);
  in.bytes(h.config_text.data(), n);
  try {
    if (text == ConfigText::one)
      h.config = parse_cache_config(h.config_text);
    else
      (void)parse_layer_configs(h.config_text);
  } catch (const Error& e) {
    in.fail(std::string("configuration is unreadable: ") + e.what());
  }
  return h;
}

/// The preamble and header of a cache file.
inline FileHeader read_header(FileReader& file) {
  return read_header(file, read_preamble(file, cache_file_magic, cache_file_version, "kvq cache file"));
}

/// One layer's table entry (CacheAccess::table_entry_bytes).
inline void write_table_entry(SectionWriter& w, const CacheAccess::LayerState& s) {
  w.put_value(s.length);
  for (const auto& stream : s.streams) {
    w.put_value(stream.quantized_end);
    w.put_value(stream.rollback_floor);
    w.put_value(stream.kept_from);
  }
  w.put_value(s.key_peak);
}
inline CacheAccess::LayerState read_table_entry(PayloadReader& in) {
  CacheAccess::LayerState s;
  s.length = in.value<std::uint64_t>();
  for (auto& st : s.streams) {
    st.quantized_end = in.value<std::uint64_t>();
    st.rollback_floor = in.value<std::uint64_t>();
    st.kept_from = in.value<std::uint64_t>();
  }
  s.key_peak = in.value<float>();
  return s;
}

/// Partial rotary or scaled RoPE, which describe() names.
inline bool has_rope_extension(const CacheShape& s) {
  return s.rope().dims() != s.head_dim || canonical(s.rope_scaling) != RopeScaling{};
}

/// The RoPE fields of `s` for people: "adjacent_pairs theta 10000.000000, ...".
inline std::string describe_rope(const CacheShape& s) {
  if (s.rope_style == RopeStyle::none) return "none";
  return std::string(to_string(s.rope_style)) + " theta " + std::to_string(s.rope_theta) +
         (has_rope_extension(s)
              ? ", rotary dims " + std::to_string(s.rope().dims()) + ", " + to_string(s.rope_scaling.type) +
                    " scaling factor " + std::to_string(canonical(s.rope_scaling).factor) +
                    (s.rope_scaling.frequency_divisors.empty()
                         ? std::string()
                         : ", " + std::to_string(s.rope_scaling.frequency_divisors.size()) + " frequency divisors")
              : std::string());
}

inline std::string describe(const CacheShape& s) {
  return std::to_string(s.layers) + " layers x " + std::to_string(s.kv_heads) + " KV heads x head_dim " +
         std::to_string(s.head_dim) + ", capacity " + std::to_string(s.capacity) + ", RoPE " + describe_rope(s);
}

inline bool same_shape(const CacheShape& a, const CacheShape& b) {
  return a.layers == b.layers && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim && a.capacity == b.capacity &&
         same_rotation(a.rope(), b.rope());
}

/// Reads the section of layer `l` in state `s`: its packed rows straight into `fresh` blocks,
/// each taken when the read reaches it, and its own rows (sinks, ring, rollback copies) into
/// `own`, checking every piece; throws kvq::Error(io) naming the first piece no cache writes.
inline void read_layer(FileReader& file, BasicKVCache& target, std::size_t l, const CacheAccess::LayerState& s,
                       CacheAccess::FreshBlocks& fresh, std::vector<std::uint8_t>& own) {
  using Access = CacheAccess;
  const std::string name = "layer " + std::to_string(l);
  const std::uint64_t start = file.offset(), bytes = Access::layer_bytes(target, s);
  checked_resize(own, Access::layer_bytes(target, s, Access::Pieces::own), "a loaded layer's own rows");
  const std::size_t blocks = Access::blocks_for(target, s);
  fresh.plan(l, blocks);
  std::string why;  // reported once the CRC has passed: damage is named as damage
  std::uint8_t* staged = own.data();
  std::size_t offset = 0;
  auto read_piece = [&](Access::Piece piece, Tensor t, std::size_t n, std::size_t block, auto at, std::uint32_t& crc) {
    if (n == 0) return;
    std::uint8_t* to = staged;
    if (block == Access::own_piece) {
      staged += n;
    } else {
      fresh.reach(l, block);
      to = at();
    }
    file.read(to, n, name);
    crc = crc32c(to, n, crc);
    if (const std::string problem = why.empty() ? Access::check_piece(Access::layout(target, t), piece, to, n) : "";
        !problem.empty())
      why = std::string(to_string(t)) + ", byte " + std::to_string(offset) + " of the payload: " + problem;
    offset += n;
  };
  file.checked_section(tag_layer, bytes, bytes, name, [&](std::uint64_t, std::uint32_t& crc) {
    Access::visit_pieces(target, l, s, [&](Access::Piece piece, Tensor t, std::size_t n, std::size_t block, auto at) {
      read_piece(piece, t, n, block, at, crc);
    });
  });
  if (!why.empty()) file.fail(name, start, why);
  if (blocks != 0) fresh.reach(l, blocks - 1);  // blocks no piece reached
}

/// Reads the table and layer sections after the header into `target` (its shape and config
/// already match the header), all-or-nothing. A load holds the file's packed rows once, in the
/// blocks they end in. A block is taken when the first bytes for it arrive: a block holds every
/// head's keys and values and a section gives the first head's keys first, so a stream that
/// stops early may have taken blocks many times the bytes it sent (never beyond the capacity;
/// a stream that can seek is measured first), and a failed load gives that memory back. The
/// cache's own rows are staged, since the cache keeps its contents until all is read and checked.
inline void read_body(FileReader& file, BasicKVCache& target) {
  using Access = CacheAccess;
  const std::size_t layers = target.shape().layers;
  const std::uint64_t table_start = file.offset();
  const auto table = file.section(tag_table, std::uint64_t(layers) * Access::table_entry_bytes, "table");
  PayloadReader in(table, file, "table", table_start);
  std::vector<Access::LayerState> states(layers);
  for (std::size_t l = 0; l < layers; ++l) {
    const Access::LayerState& s = states[l] = read_table_entry(in);
    const std::string why = Access::check(target, s);
    if (!why.empty()) file.fail("table", table_start, "layer " + std::to_string(l) + ": " + why);
  }
  // A stream that says how much it holds gives a truncated file away before any block is taken.
  std::uint64_t needed = 0;
  for (const Access::LayerState& s : states) needed += Access::layer_bytes(target, s) + 16;  // tag, size, CRC
  if (const auto left = file.remaining(); left && *left < needed)
    file.fail("layer 0", file.offset(),
              "the file ends " + std::to_string(needed - *left) + " bytes early (truncated): the table needs " +
                  std::to_string(needed) + " bytes of layer sections");
  BlockReservation reserved = Access::reserve_blocks(target, states);
  std::vector<std::vector<std::uint8_t>> own(layers);
  Access::FreshBlocks fresh(target, reserved);
  for (std::size_t l = 0; l < layers; ++l) read_layer(file, target, l, states[l], fresh, own[l]);
  file.expect_end();
  Access::restore(target, states, own, fresh.take());
}

}  // namespace detail

/// Writes `cache` to `out` (binary); throws kvq::Error(io) when the stream fails.
inline void save(const BasicKVCache& cache, std::ostream& out) {
  using detail::CacheAccess;
  const std::string config = to_string(cache.config());
  detail::check_config_text(config);
  detail::write_preamble(out, detail::cache_file_magic, detail::cache_file_version);
  const CacheShape& s = cache.shape();
  detail::write_header(out, s, config);
  {
    detail::SectionWriter w(out, detail::tag_table, std::uint64_t(s.layers) * CacheAccess::table_entry_bytes);
    for (std::size_t l = 0; l < s.layers; ++l) detail::write_table_entry(w, CacheAccess::state(cache, l));
    w.finish();
  }
  for (std::size_t l = 0; l < s.layers; ++l) {
    detail::SectionWriter w(out, detail::tag_layer, CacheAccess::layer_bytes(cache, CacheAccess::state(cache, l)));
    CacheAccess::visit_pieces(cache, l, CacheAccess::state(cache, l),
                              [&](CacheAccess::Piece, Tensor, std::size_t n, std::size_t, auto at) { w.put(at(), n); });
    w.finish();
  }
  if (!out) throw Error(ErrorCode::io, "saving a kvq cache: the output stream failed");
}

/// Restores a cache saved by save() into `cache`, which must have the saved shape and config
/// (else kvq::Error(shape_mismatch)). On any error the cache is left exactly as it was.
inline void load(BasicKVCache& cache, std::istream& in) {
  detail::FileReader file(in);
  const detail::FileHeader h = detail::read_header(file);
  if (!detail::same_shape(h.shape, cache.shape()))
    throw Error(ErrorCode::shape_mismatch, "kvq cache file holds a cache of " + detail::describe(h.shape) +
                                               "; the target has " + detail::describe(cache.shape()));
  if (h.config_text != to_string(cache.config()))
    throw Error(ErrorCode::shape_mismatch, "kvq cache file holds a cache configured '" + h.config_text +
                                               "'; the target is configured '" + to_string(cache.config()) + "'");
  detail::read_body(file, cache);
}

/// What load(in) lets a file's header make a new cache allocate before its body is read
/// (BasicKVCache::fixed_bytes: own rows, history, RoPE table, block table): a header of a few
/// bytes could otherwise ask for any capacity. 1 GiB holds a Llama-3-8B-shaped cache of 1M
/// positions (a 512 MiB RoPE table). Blocks are taken as the body arrives (read_body), and a
/// file that can seek must hold the whole body before any is.
inline constexpr std::size_t default_load_bytes = std::size_t(1) << 30;

/// A new cache of the shape and config the file names, refused (kvq::Error io) where the cache
/// would allocate more than max_bytes before its first token; a cache loaded into is never larger
/// than its caller made it.
inline BasicKVCache load(std::istream& in, std::size_t max_bytes = default_load_bytes) {
  detail::FileReader file(in);
  const detail::FileHeader h = detail::read_header(file);
  std::size_t bytes = 2 * 4;  // keys and values, f32 at most: a bound on the storage the shape asks for
  for (const std::size_t n : {h.shape.layers, h.shape.kv_heads, h.shape.head_dim, h.shape.capacity}) {
    if (n != 0 && bytes > (std::size_t(1) << 50) / n)
      file.fail("header", 16, "implausible shape " + detail::describe(h.shape));
    bytes *= n;
  }
  std::optional<BasicKVCache> cache;
  try {
    const std::size_t fixed = BasicKVCache::fixed_bytes(h.shape, h.config);
    if (fixed > max_bytes)
      file.fail("header", 16,
                "a cache of " + detail::describe(h.shape) + " would allocate " + std::to_string(fixed) +
                    " bytes before its first token, more than the limit of " + std::to_string(max_bytes) +
                    " (load's max_bytes, or load into a cache you made)");
    cache.emplace(h.shape, h.config);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::io || e.code() == ErrorCode::out_of_memory) throw;  // the file's, or the system's
    file.fail("header", 16, std::string("the shape and configuration make no cache: ") + e.what());
  }
  detail::read_body(file, *cache);
  return std::move(*cache);
}

namespace detail {
/// Runs write(stream) into "<path>.partial", then renames it to `path`: a failed or interrupted
/// save leaves the file that was there intact.
template <class Write>
void write_file_atomically(const std::filesystem::path& path, Write write) {
  std::filesystem::path partial = path;
  partial += ".partial";
  bool created = false;  // only a partial file this call made is removed on failure
  try {
    {
      std::ofstream out(partial, std::ios::binary | std::ios::trunc);
      if (!out) throw Error(ErrorCode::io, "cannot open '" + partial.string() + "' for writing");
      created = true;
      write(out);
      out.close();
      if (!out) throw Error(ErrorCode::io, "writing '" + partial.string() + "' failed");
    }
    std::error_code ec;
    std::filesystem::rename(partial, path, ec);
    if (ec)
      throw Error(ErrorCode::io,
                  "cannot rename '" + partial.string() + "' to '" + path.string() + "': " + ec.message());
  } catch (...) {
    std::error_code ignored;
    if (created) std::filesystem::remove(partial, ignored);
    throw;
  }
}

inline std::ifstream open_for_reading(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::io, "cannot open '" + path.string() + "' for reading");
  return in;
}
}  // namespace detail

/// save() into a file, written beside it first and renamed over it: a failed save leaves any
/// file already at `path` as it was.
inline void save_file(const BasicKVCache& cache, const std::filesystem::path& path) {
  detail::write_file_atomically(path, [&](std::ostream& out) { save(cache, out); });
}

inline void load_file(BasicKVCache& cache, const std::filesystem::path& path) {
  std::ifstream in = detail::open_for_reading(path);
  load(cache, in);
}

inline BasicKVCache load_file(const std::filesystem::path& path, std::size_t max_bytes = default_load_bytes) {
  std::ifstream in = detail::open_for_reading(path);
  return load(in, max_bytes);
}

}  // namespace kvq::inline v0
