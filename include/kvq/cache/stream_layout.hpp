#pragma once
// StreamLayout: byte layout of one tensor's storage for one (layer, KV head), and the rule that
// decides which positions are quantized. The rule depends on the length alone, so the stored
// bytes are the same however the tokens arrived (one prefill, chunks, or one at a time).
//
// Quantization rule (S sinks, window R, group G):
//   * positions < S are never quantized;
//   * per-channel: the group [S + kG, S + (k+1)G) is quantized once it is complete and all its
//     tokens are older than the newest R, i.e. when S + (k+1)G <= length - R;
//   * per-token: a token is quantized once it is older than the newest R (position < length - R).
//   * a stream that flushes (CacheConfig::flush): positions [S + kR, S + (k+1)R) are quantized
//     together once the stream holds S + (k+1)R tokens (R a multiple of G when per channel).
// So by default the newest R tokens are always full precision, and at most R + G - 1 keys are
// per channel. KIVI flushes its whole key buffer of R tokens once it reaches R, so its window
// swings between 0 and R - 1 full-precision keys: keys that flush (-fk) are KIVI's exactly.
// Values that do not flush match KIVI's: a FIFO of R where the oldest token is quantized on its
// own. R = 0 quantizes every complete group at once; any R or S up to SIZE_MAX is valid (R >=
// capacity: nothing is ever quantized), and no sum of them is formed that could wrap.
//
// Ring slot (p - S) mod ring_rows holds the newest position p written there, pending or already
// packed. For rollback the cache keeps, outside the stream, a copy of each row it packs, for the
// last `history_rows` packed positions: D + G for keys per channel, D + 1 per token, D + R for a
// stream that flushes.

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <utility>

#include "kvq/cache/cache_config.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/pack/bitpack.hpp"
#include "kvq/quant/spec.hpp"

namespace kvq::inline v0 {

/// Longest attention tile (kernels/attention): bounds the kernels' stack scratch.
inline constexpr std::size_t max_tile_tokens = 128;

/// Positions per attention tile over keys stored as `spec` (quantized or not): whole per-channel
/// groups of at least 64 positions when a group fits a tile, else 32.
constexpr std::size_t tile_tokens(const QuantizerSpec& spec, bool quantized) noexcept {
  if (quantized && spec.axis == Axis::per_channel && spec.group <= max_tile_tokens)
    return spec.group * std::max<std::size_t>(1, 64 / spec.group);
  return 32;
}

/// The rows a stream packs at once: a per-channel group, a token, or a window that flushes
/// (CacheConfig::flush); 1 for a stream kept whole.
inline std::size_t packing_unit(const CacheConfig& config, bool keys) {
  const QuantizerSpec& spec = keys ? config.key : config.value;
  if (!(keys ? config.quantize_keys : config.quantize_values)) return 1;
  if (flushes(config.flush, keys)) return config.window;  // a multiple of a per-channel group (validate)
  return spec.axis == Axis::per_channel ? spec.group : 1;
}

/// The granule of a context shift (BasicKVCache::erase): a range reaching into the packed rows of
/// a stream packed in units (per-channel groups, flushes) starts at sinks + a multiple of it, and
/// one moving such rows spans a multiple of it, so that the packed rows stay those a cache of the
/// new length packs; 1 where every stream packs token by token. An engine shifting its context
/// rounds the tokens it keeps after the sinks, and those it drops, up to it.
inline std::size_t shift_unit(const CacheConfig& config) {
  return std::lcm(packing_unit(config, true), packing_unit(config, false));
}

/// Block lengths must be multiples of this: whole key tiles and whole 64-row steps of the dense
/// kernel (so attention over blocks reads the tiles one pass would), and whole per-channel groups
/// of either tensor.
inline std::size_t block_unit(const CacheConfig& config) {
  std::size_t unit = std::lcm(tile_tokens(config.key, config.quantize_keys), std::size_t(64));
  for (const auto& [spec, quantized] :
       {std::pair{config.key, config.quantize_keys}, std::pair{config.value, config.quantize_values}})
    if (quantized && spec.axis == Axis::per_channel) unit = std::lcm(unit, spec.group);
  return unit;
}

struct StreamLayout {
  QuantizerSpec spec{};
  bool quantized = false;
  std::size_t head_dim = 0, sinks = 0, window = 0, capacity = 0;
  bool flush = false;  // positions leave the window R at a time (CacheConfig::flush)
  Scalar residual = Scalar::f16;

  // Rows of a ring by position: quantized streams keep the pending rows and the newest packed
  // ones in a small ring of their own; unquantized streams keep every row after the sinks, in
  // blocks (ring_rows = capacity - sinks, so slot = position - sinks).
  std::size_t ring_rows = 0;
  std::size_t history_rows = 0;        // copies of the newest packed rows, for rollback (beside the stream)
  std::size_t max_quantized_rows = 0;  // rows of codes the capacity can need
  std::size_t row_bytes = 0;           // packed bytes per token row
  // The stream's own memory, per (layer, KV head): sink rows, then the ring of a quantized stream.
  std::size_t sink_offset = 0, ring_offset = 0, bytes = 0;
  // Its part of a block of block_rows positions (from sinks + k * block_rows): packed codes, then
  // scales and zero points for those rows, then their outliers' slots and corrections; or,
  // unquantized, the rows in the residual type.
  std::size_t block_rows = 0, block_scale_offset = 0, block_zero_offset = 0, block_bytes = 0;
  std::size_t block_slot_offset = 0, block_correction_offset = 0;

  static constexpr std::size_t align(std::size_t n) noexcept { return (n + 63) / 64 * 64; }

  StreamLayout() = default;

  /// The layout of the key (keys = true) or value stream of a cache configured `config`.
  StreamLayout(bool keys, std::size_t dim, const CacheConfig& config, std::size_t cap, std::size_t block)
      : spec(keys ? config.key : config.value),
        quantized(keys ? config.quantize_keys : config.quantize_values),
        head_dim(dim),
        sinks(config.sinks),
        window(config.window),
        capacity(cap),
        flush(quantized && flushes(config.flush, keys)),
        residual(config.residual),
        block_rows(block) {
    const std::size_t after_sinks = capacity > sinks ? capacity - sinks : 0;
    const std::size_t step = spec.axis == Axis::per_channel ? spec.group : 1;
    const std::size_t unit = packing_unit(config, keys);
    if (quantized) {
      // The pending rows: at most R + G - 1, or R when the window flushes (then a flush reads
      // them in place, from slot 0). A window of SIZE_MAX never quantizes.
      ring_rows = std::min(flush ? window : saturating_add(window, step), after_sinks);
      max_quantized_rows = after_sinks / unit * unit;
      row_bytes = packed_bytes(head_dim, spec.bits);
    } else {
      ring_rows = after_sinks;
    }
    ring_rows = std::max<std::size_t>(ring_rows, 1);  // keeps the ring's modulo defined
    // Taking back D tokens needs the rows of the D positions before the ring and those it
    // re-opens: copies of the last D + unit packed rows cover both (unit = G or 1; R where a
    // flush re-opens R rows at once).
    if (quantized && config.rollback_depth != 0)
      history_rows =
          std::min(saturating_add(std::min(config.rollback_depth, max_quantized_rows), unit), max_quantized_rows);
    const std::size_t residual_row = head_dim * size_of(residual);
    sink_offset = 0;
    ring_offset = align(std::min(sinks, capacity) * residual_row);
    bytes = ring_offset + (quantized ? align(ring_rows * residual_row) : 0);
    if (quantized) {
      const std::size_t param_bytes = params_before(block_rows) * size_of(spec.param);
      block_scale_offset = align(block_rows * row_bytes);
      block_zero_offset = block_scale_offset + align(param_bytes);
      block_slot_offset = block_zero_offset + (spec.has_zero_point() ? align(param_bytes) : 0);
      block_correction_offset = block_slot_offset + align(param_bytes / size_of(spec.param) * spec.outliers * 2);
      block_bytes = block_correction_offset + align(param_bytes * spec.outliers);
    } else {
      block_bytes = align(block_rows * residual_row);
    }
  }

  /// Parameter pairs of the first `rows` packed rows (rows: whole groups when per channel); also
  /// the index of row `rows`' first pair, counted from the start of its block or of the stream.
  std::size_t params_before(std::size_t rows) const noexcept { return kvq::params_before(spec, head_dim, rows); }

  /// First position that is not quantized when the stream holds `length` tokens.
  std::size_t quantized_end(std::size_t length) const noexcept {
    if (!quantized || length <= sinks) return sinks;
    if (flush) return sinks + std::min((length - sinks) / window * window, max_quantized_rows);
    if (length - sinks <= window) return sinks;            // no sum that could wrap
    const std::size_t eligible = length - sinks - window;  // tokens past the sinks and out of the window
    const std::size_t step = spec.axis == Axis::per_channel ? spec.group : 1;
    return sinks + std::min(eligible / step * step, max_quantized_rows);
  }
};

}  // namespace kvq::inline v0
