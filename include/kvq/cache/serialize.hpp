#pragma once
// Saving a cache to a stream or file and restoring it, e.g. to park a conversation and resume it.
//
//   save(cache, out) / save_file(cache, path)
//   load(cache, in) / load_file(cache, path)   into an existing cache of the same shape and config
//   load(in) / load_file(path)                 a new cache of the shape and config the file names
//
// A restored cache equals the saved one: stored_bytes(), memory(), views, attention, how far it
// can roll back, and what further appends do. Loading is all-or-nothing: every byte is read and
// checked before the target changes. A damaged or foreign file throws kvq::Error(io) naming the
// section and offset; a sound file for another shape or configuration throws shape_mismatch.
// Version 1 records RoPE style and theta only: a cache with partial rotary dims or RoPE scaling
// is refused by save (unsupported) rather than written as another RoPE.
//
// Format (version 1), fields in the writer's byte order, which the marker records:
//   "KVQCACHE"  u32 format version  u32 byte-order marker 0x01020304
//   section "header": u32 kvq major, minor, patch | u64 layers, kv_heads, head_dim, capacity |
//                     u32 RoPE style | f32 RoPE theta | u32 n, n bytes: to_string(config)
//   section "table":  per layer: u64 length | per tensor (key, value): u64 quantized end, u64
//                     rollback floor, u64 first packed position the rollback history holds
//   section "layer l" for each layer: per KV head, per tensor (key, value): sink rows, the ring's
//                     rows in position order, packed code rows, scales, zero points (asymmetric
//                     only), the rollback history's rows [its first, quantized end); only what
//                     is in use
// A section is u32 tag | u64 payload bytes | payload | u32 CRC-32C of tag, size and payload.
// The file ends after the last layer. Its size grows with the tokens held, not with the capacity.

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
#include <type_traits>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/crc32c.hpp"
#include "kvq/error.hpp"
#include "kvq/version.hpp"

namespace kvq::inline v0 {

namespace detail {

inline constexpr char cache_file_magic[8] = {'K', 'V', 'Q', 'C', 'A', 'C', 'H', 'E'};
inline constexpr std::uint32_t cache_file_version = 1;
inline constexpr std::uint32_t byte_order_marker = 0x01020304;
inline constexpr std::uint32_t tag_header = 0x44414548, tag_table = 0x4C424154, tag_layer = 0x5259414C;  // "HEAD" "TABL" "LAYR"
inline constexpr std::size_t max_config_text = 256;

inline std::string hex(std::uint32_t x) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s = "0x";
  for (int shift = 28; shift >= 0; shift -= 4) s += digits[(x >> shift) & 0xF];
  return s;
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

  /// Bytes one stream of one head takes in a layer section.
  static std::size_t stream_bytes(const BasicKVCache& c, Tensor t, std::uint64_t length, const StreamState& s) {
    const StreamLayout& lay = layout(c, t);
    const std::size_t n = std::size_t(length), end = std::size_t(s.quantized_end), packed = end - lay.sinks;
    const std::size_t first = first_in_ring(lay, n), kept = std::size_t(s.kept_from);
    const std::size_t residual_rows = std::min(lay.sinks, n) + (n > first ? n - first : 0) + (end - kept);
    return residual_rows * row(lay) + packed * lay.row_bytes + params(lay, packed) * (lay.spec.has_zero_point() ? 2 : 1);
  }

  static std::size_t layer_bytes(const BasicKVCache& c, const LayerState& s) {
    std::size_t n = 0;
    for (const Tensor t : {Tensor::keys, Tensor::values}) n += stream_bytes(c, t, s.length, s.streams[BasicKVCache::index(t)]);
    return n * c.shape().kv_heads;
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
      // Reachable states quantize at least what the rule says and only whole groups of held tokens.
      if (st.quantized_end < lay.quantized_end(length) || st.quantized_end > std::max(length, lay.sinks) ||
          st.quantized_end - lay.sinks > lay.max_quantized_rows)
        return what + " is impossible for " + std::to_string(length) + " tokens";
      if (lay.quantized && lay.spec.axis == Axis::per_channel && (st.quantized_end - lay.sinks) % lay.spec.group != 0)
        return what + " splits a group of " + std::to_string(lay.spec.group);
      // The history holds at most history_rows packed rows; the floor lies between the sinks and
      // the length, and rows before the ring are held only where the history has them.
      const std::size_t first = first_in_ring(lay, length);
      if (st.kept_from < lay.sinks || st.kept_from > st.quantized_end || st.quantized_end - st.kept_from > lay.history_rows)
        return std::string(to_string(t)) + " rollback history from " + std::to_string(st.kept_from) +
               " is impossible for quantized end " + std::to_string(st.quantized_end);
      if (st.rollback_floor < lay.sinks || st.rollback_floor > std::max(length, lay.sinks) ||
          st.rollback_floor < std::min<std::uint64_t>(st.kept_from, first))
        return std::string(to_string(t)) + " rollback floor " + std::to_string(st.rollback_floor) + " is impossible for " +
               std::to_string(length) + " tokens";
    }
    return {};
  }

  /// Calls visit(pointer, bytes) for every piece of one layer section, in file order: the
  /// pieces of `c` (const to save, mutable to restore) in state `s`.
  /// Packed rows [0, packed) of one stream are in blocks: the file holds all their codes, then all
  /// scales, then all zero points, each visited by runs within one block.
  template <class Cache, class Visit>
  static void visit_pieces(Cache& c, std::size_t layer, const LayerState& s, Visit&& visit) {
    using Byte = std::conditional_t<std::is_const_v<Cache>, const std::uint8_t, std::uint8_t>;
    auto& cache = const_cast<BasicKVCache&>(c);  // pointers only; a const cache is only read
    const std::size_t block = cache.block_rows_;
    for (std::size_t h = 0; h < c.shape().kv_heads; ++h)
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const StreamLayout& lay = layout(c, t);
        const StreamState& st = s.streams[BasicKVCache::index(t)];
        const std::size_t r = row(lay), end = std::size_t(st.quantized_end), packed = end - lay.sinks;
        const std::size_t length = std::size_t(s.length), first = first_in_ring(lay, length);
        visit(static_cast<Byte*>(cache.own_base(t, layer, h)) + lay.sink_offset, std::min(lay.sinks, length) * r);
        for (std::size_t p = first; p < length; ++p) visit(static_cast<Byte*>(cache.ring_row(t, layer, h, p)), r);
        for (const int part : {0, 1, 2}) {  // codes, scales, zero points
          if (part == 2 && !lay.spec.has_zero_point()) break;
          for (std::size_t a = 0; a < packed;) {
            const std::size_t n = std::min(packed - a, block - a % block);
            if (part == 0) visit(static_cast<Byte*>(cache.code_row(t, layer, h, a)), n * lay.row_bytes);
            else {
              const auto [scales, zeros] = cache.params_of(t, layer, h, a);
              visit(static_cast<Byte*>(part == 1 ? scales : zeros), params(lay, n));
            }
            a += n;
          }
        }
        for (std::size_t p = std::size_t(st.kept_from); p < end; ++p)
          visit(static_cast<Byte*>(cache.history_row(t, layer, h, p)), r);
      }
  }

  /// Fresh zeroed blocks for the layer states (before restore, which cannot fail). Throws
  /// kvq::Error when the store cannot supply them, having kept none.
  static std::vector<std::vector<BlockId>> fresh_blocks(BasicKVCache& c, const std::vector<LayerState>& states) {
    std::vector<std::vector<BlockId>> tables(states.size());
    try {
      for (std::size_t l = 0; l < states.size(); ++l) {
        const LayerState& s = states[l];
        const std::size_t n = c.blocks_for(std::size_t(s.length), std::size_t(s.streams[0].quantized_end),
                                           std::size_t(s.streams[1].quantized_end));
        tables[l].reserve(n);
        while (tables[l].size() < n) tables[l].push_back(c.store_->acquire("a cache being loaded"));
      }
    } catch (...) {
      for (const auto& table : tables)
        for (const BlockId id : table) c.store_->release(id);
      throw;
    }
    return tables;
  }

  /// Replaces the cache's contents with checked layer states and section payloads. noexcept:
  /// everything was validated before.
  static void restore(BasicKVCache& c, const std::vector<LayerState>& states,
                      const std::vector<std::vector<std::uint8_t>>& payloads,
                      std::vector<std::vector<BlockId>>&& tables) noexcept {
    c.clear();
    c.tables_ = std::move(tables);
    for (std::size_t l = 0; l < states.size(); ++l) {
      const LayerState& s = states[l];
      const std::uint8_t* in = payloads[l].data();
      visit_pieces(c, l, s, [&](std::uint8_t* dest, std::size_t n) {
        if (n != 0) std::memcpy(dest, in, n);
        in += n;
      });
      c.lengths_[l] = std::size_t(s.length);
      c.key_peaks_[l] = s.key_peak;
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const std::size_t i = l * 2 + BasicKVCache::index(t);
        c.quantized_ends_[i] = std::size_t(s.streams[BasicKVCache::index(t)].quantized_end);
        c.history_begins_[i] = std::size_t(s.streams[BasicKVCache::index(t)].rollback_floor);
        c.kept_from_[i] = std::size_t(s.streams[BasicKVCache::index(t)].kept_from);
      }
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
  void put_value(T x) { put(&x, sizeof x); }
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
  explicit FileReader(std::istream& in) : in_(in) {}

  std::uint64_t offset() const noexcept { return offset_; }

  [[noreturn]] void fail(const std::string& section, std::uint64_t at, const std::string& why) const {
    throw Error(ErrorCode::io, "kvq cache file, section '" + section + "' at offset " + std::to_string(at) + ": " + why);
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
    const std::uint64_t start = offset_;
    const auto file_tag = read_value<std::uint32_t>(name);
    const auto file_size = read_value<std::uint64_t>(name);
    if (file_tag != tag) fail(name, start, "tag " + hex(file_tag) + " where " + hex(tag) + " belongs");
    if (file_size != size)
      fail(name, start, "declares " + std::to_string(file_size) + " bytes where its table entries make " + std::to_string(size));
    std::uint32_t crc = crc32c(&file_tag, sizeof file_tag);
    crc = crc32c(&file_size, sizeof file_size, crc);
    std::vector<std::uint8_t> payload;
    payload.reserve(std::min<std::size_t>(std::size_t(size), std::size_t(64) << 20));
    constexpr std::size_t chunk = std::size_t(1) << 20;
    while (payload.size() < size) {
      const std::size_t n = std::min<std::size_t>(chunk, std::size_t(size) - payload.size());
      payload.resize(payload.size() + n);
      read(payload.data() + payload.size() - n, n, name);
    }
    crc = crc32c(payload.data(), payload.size(), crc);
    const auto stored = read_value<std::uint32_t>(name);
    if (stored != crc) fail(name, start, "CRC-32C mismatch (stored " + hex(stored) + ", computed " + hex(crc) + "): the section is corrupt");
    return payload;
  }

  void expect_end() {
    if (in_.peek() != std::char_traits<char>::eof()) fail("end", offset_, "unexpected bytes after the last section");
  }

 private:
  std::istream& in_;
  std::uint64_t offset_ = 0;
};

/// Bounds-checked reads of fixed fields from a checked payload.
class PayloadReader {
 public:
  PayloadReader(const std::vector<std::uint8_t>& bytes, const FileReader& file, std::string section, std::uint64_t start)
      : bytes_(bytes), file_(file), section_(std::move(section)), start_(start) {}
  template <class T>
  T value() {
    T x;
    bytes(&x, sizeof x);
    return x;
  }
  void bytes(void* dest, std::size_t n) {
    if (n > bytes_.size() - at_) file_.fail(section_, start_, "its fields run past its " + std::to_string(bytes_.size()) + " bytes");
    std::memcpy(dest, bytes_.data() + at_, n);
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
  CacheConfig config;
};

inline FileHeader read_header(FileReader& file) {
  char magic[8];
  file.read(magic, sizeof magic, "preamble");
  if (std::memcmp(magic, cache_file_magic, sizeof magic) != 0) file.fail("preamble", 0, "not a kvq cache file (wrong magic)");
  const auto version = file.read_value<std::uint32_t>("preamble");
  if (version != cache_file_version)
    file.fail("preamble", 8, "format version " + std::to_string(version) + "; this kvq reads version " +
                                 std::to_string(cache_file_version));
  const auto marker = file.read_value<std::uint32_t>("preamble");
  if (marker != byte_order_marker)
    file.fail("preamble", 12, marker == 0x04030201u
                                  ? std::string("written on a machine of the other byte order")
                                  : "byte-order marker " + hex(marker) + " is neither order");
  // The header's size is not known before it is read: take it from the file, bounded.
  const std::uint64_t start = file.offset();
  const auto tag = file.read_value<std::uint32_t>("header");
  const auto size = file.read_value<std::uint64_t>("header");
  constexpr std::uint64_t fixed = 3 * 4 + 4 * 8 + 4 + 4 + 4;
  if (tag != tag_header) file.fail("header", start, "tag " + hex(tag) + " where " + hex(tag_header) + " belongs");
  if (size < fixed || size > fixed + max_config_text) file.fail("header", start, "implausible size " + std::to_string(size));
  std::vector<std::uint8_t> payload(static_cast<std::size_t>(size));
  file.read(payload.data(), payload.size(), "header");
  std::uint32_t crc = crc32c(&tag, sizeof tag);
  crc = crc32c(&size, sizeof size, crc);
  crc = crc32c(payload.data(), payload.size(), crc);
  const auto stored = file.read_value<std::uint32_t>("header");
  if (stored != crc) file.fail("header", start, "CRC-32C mismatch (stored " + hex(stored) + ", computed " + hex(crc) + "): the section is corrupt");

  PayloadReader in(payload, file, "header", start);
  FileHeader h;
  for (int i = 0; i < 3; ++i) (void)in.value<std::uint32_t>();  // the writing kvq's version: for people, not checked
  const auto layers = in.value<std::uint64_t>(), heads = in.value<std::uint64_t>(), dim = in.value<std::uint64_t>(),
             capacity = in.value<std::uint64_t>();
  const auto style = in.value<std::uint32_t>();
  const auto theta = in.value<float>();
  const auto n = in.value<std::uint32_t>();
  if (n != size - fixed) file.fail("header", start, "configuration text of " + std::to_string(n) + " bytes does not fill the section");
  h.config_text.resize(n);
  in.bytes(h.config_text.data(), n);
  if (style > std::uint32_t(RopeStyle::half_split)) file.fail("header", start, "unknown RoPE style " + std::to_string(style));
  constexpr std::uint64_t most = std::numeric_limits<std::size_t>::max();
  if (layers > most || heads > most || dim > most || capacity > most)
    file.fail("header", start, "a shape field exceeds this machine's size_t");
  h.shape = CacheShape{std::size_t(layers), std::size_t(heads), std::size_t(dim), std::size_t(capacity),
                       RopeStyle(style), theta};
  try {
    h.config = parse_cache_config(h.config_text);
  } catch (const Error& e) {
    file.fail("header", start, std::string("configuration is unreadable: ") + e.what());
  }
  return h;
}

/// Partial rotary or scaled RoPE, which format version 1 cannot record.
inline bool has_rope_extension(const CacheShape& s) {
  return s.rope().dims() != s.head_dim || s.rope_scaling != RopeScaling{};
}

inline std::string describe(const CacheShape& s) {
  return std::to_string(s.layers) + " layers x " + std::to_string(s.kv_heads) + " KV heads x head_dim " +
         std::to_string(s.head_dim) + ", capacity " + std::to_string(s.capacity) + ", RoPE " + to_string(s.rope_style) +
         " theta " + std::to_string(s.rope_theta) +
         (has_rope_extension(s) ? ", rotary dims " + std::to_string(s.rope().dims()) + ", " +
                                      to_string(s.rope_scaling.type) + " scaling"
                                : std::string());
}

inline void check_savable(const CacheShape& s) {
  if (has_rope_extension(s))
    throw Error(ErrorCode::unsupported, "saving a cache of " + describe(s) + ": format version " +
                                            std::to_string(cache_file_version) + " records RoPE style and theta only");
}

inline bool same_shape(const CacheShape& a, const CacheShape& b) {
  return a.layers == b.layers && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim && a.capacity == b.capacity &&
         a.rope_style == b.rope_style && std::bit_cast<std::uint32_t>(a.rope_theta) == std::bit_cast<std::uint32_t>(b.rope_theta) &&
         a.rope().dims() == b.rope().dims() && a.rope_scaling == b.rope_scaling;
}

/// Reads the table and layer sections after the header into `target` (its shape and config
/// already match the header), all-or-nothing.
inline void read_body(FileReader& file, BasicKVCache& target) {
  const std::size_t layers = target.shape().layers;
  const std::uint64_t table_start = file.offset();
  const auto table = file.section(tag_table, std::uint64_t(layers) * CacheAccess::table_entry_bytes, "table");
  PayloadReader in(table, file, "table", table_start);
  std::vector<CacheAccess::LayerState> states(layers);
  for (std::size_t l = 0; l < layers; ++l) {
    CacheAccess::LayerState& s = states[l];
    s.length = in.value<std::uint64_t>();
    for (auto& st : s.streams) {
      st.quantized_end = in.value<std::uint64_t>();
      st.rollback_floor = in.value<std::uint64_t>();
      st.kept_from = in.value<std::uint64_t>();
    }
    s.key_peak = in.value<float>();
    const std::string why = CacheAccess::check(target, s);
    if (!why.empty()) file.fail("table", table_start, "layer " + std::to_string(l) + ": " + why);
  }
  std::vector<std::vector<std::uint8_t>> payloads(layers);
  for (std::size_t l = 0; l < layers; ++l)
    payloads[l] = file.section(tag_layer, CacheAccess::layer_bytes(target, states[l]), "layer " + std::to_string(l));
  file.expect_end();
  CacheAccess::restore(target, states, payloads, CacheAccess::fresh_blocks(target, states));
}

}  // namespace detail

/// Writes `cache` to `out` (binary); throws kvq::Error(io) when the stream fails, (unsupported)
/// for RoPE the format cannot record (see above).
inline void save(const BasicKVCache& cache, std::ostream& out) {
  using detail::CacheAccess;
  detail::check_savable(cache.shape());
  out.write(detail::cache_file_magic, sizeof detail::cache_file_magic);
  out.write(reinterpret_cast<const char*>(&detail::cache_file_version), 4);
  out.write(reinterpret_cast<const char*>(&detail::byte_order_marker), 4);
  const CacheShape& s = cache.shape();
  const std::string config = to_string(cache.config());
  {
    detail::SectionWriter w(out, detail::tag_header, 3 * 4 + 4 * 8 + 4 + 4 + 4 + config.size());
    for (const int v : {version_major, version_minor, version_patch}) w.put_value(std::uint32_t(v));
    for (const std::size_t v : {s.layers, s.kv_heads, s.head_dim, s.capacity}) w.put_value(std::uint64_t(v));
    w.put_value(std::uint32_t(s.rope_style));
    w.put_value(s.rope_theta);
    w.put_value(std::uint32_t(config.size()));
    w.put(config.data(), config.size());
    w.finish();
  }
  {
    detail::SectionWriter w(out, detail::tag_table, std::uint64_t(s.layers) * CacheAccess::table_entry_bytes);
    for (std::size_t l = 0; l < s.layers; ++l) {
      const CacheAccess::LayerState st = CacheAccess::state(cache, l);
      w.put_value(st.length);
      for (const auto& stream : st.streams) {
        w.put_value(stream.quantized_end);
        w.put_value(stream.rollback_floor);
        w.put_value(stream.kept_from);
      }
      w.put_value(st.key_peak);
    }
    w.finish();
  }
  for (std::size_t l = 0; l < s.layers; ++l) {
    detail::SectionWriter w(out, detail::tag_layer, CacheAccess::layer_bytes(cache, CacheAccess::state(cache, l)));
    CacheAccess::visit_pieces(cache, l, CacheAccess::state(cache, l), [&](const void* data, std::size_t n) { w.put(data, n); });
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

/// A new cache of the shape and config the file names. The cache allocates the capacity the
/// header declares (checked only for plausibility): load into an existing cache to bound memory.
inline BasicKVCache load(std::istream& in) {
  detail::FileReader file(in);
  const detail::FileHeader h = detail::read_header(file);
  std::size_t bytes = 2 * 4;  // keys and values, f32 at most: a bound on the storage the shape asks for
  for (const std::size_t n : {h.shape.layers, h.shape.kv_heads, h.shape.head_dim, h.shape.capacity}) {
    if (n != 0 && bytes > (std::size_t(1) << 50) / n) file.fail("header", 16, "implausible shape " + detail::describe(h.shape));
    bytes *= n;
  }
  std::optional<BasicKVCache> cache;
  try {
    cache.emplace(h.shape, h.config);
  } catch (const Error& e) {
    file.fail("header", 16, std::string("the shape and configuration make no cache: ") + e.what());
  }
  detail::read_body(file, *cache);
  return std::move(*cache);
}

inline void save_file(const BasicKVCache& cache, const std::filesystem::path& path) {
  detail::check_savable(cache.shape());  // before the file is truncated
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(ErrorCode::io, "cannot open '" + path.string() + "' for writing");
  save(cache, out);
  out.close();
  if (!out) throw Error(ErrorCode::io, "writing '" + path.string() + "' failed");
}

inline void load_file(BasicKVCache& cache, const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::io, "cannot open '" + path.string() + "' for reading");
  load(cache, in);
}

inline BasicKVCache load_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::io, "cannot open '" + path.string() + "' for reading");
  return load(in);
}

}  // namespace kvq::inline v0
