#pragma once
// StreamView: read-only access to one segment of how one (layer, KV head) stores one tensor (keys
// or values). A cache keeps its packed rows in blocks, so a stream is a short list of segments
// (BasicKVCache::view); within one, positions [0, sinks_stored) are sink rows in the residual
// type, [first_quantized, end_quantized) are packed codes with their parameters, contiguous, and
// later positions are rows of the residual type in a ring by position (slot (p - ring_origin) mod
// ring_rows). Kernels read this directly; read_row() is the plain (slow) way for oracles.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>

#include "kvq/core/convert.hpp"
#include "kvq/kernels/quantize/reference.hpp"
#include "kvq/pack/bitpack.hpp"
#include "kvq/quant/spec.hpp"

namespace kvq::inline v0 {

struct StreamView {
  QuantizerSpec spec{};
  bool quantized = false;
  std::size_t head_dim = 0;
  Scalar residual = Scalar::f16;
  std::size_t length = 0;

  std::size_t sinks_stored = 0;         // min(sinks, length)
  const std::uint8_t* sinks = nullptr;  // (sinks_stored, head_dim) residual type

  std::size_t first_quantized = 0;      // first position of the segment's packed rows (>= sinks)
  std::size_t end_quantized = 0;        // first position not (yet) quantized
  const std::uint8_t* codes = nullptr;  // (end_quantized - first_quantized, row_bytes)
  std::size_t row_bytes = 0;
  const std::uint8_t* scales = nullptr;  // per-channel: (blocks, head_dim); per-token: (rows, groups_per_row)
  const std::uint8_t* zeros = nullptr;   // same shape as scales; unused when symmetric
  // spec.outliers entries per parameter pair, in the pairs' order (kernels/quantize/reference.hpp)
  const std::uint16_t* outlier_slots = nullptr;
  const std::uint8_t* outlier_corrections = nullptr;  // parameter type

  const std::uint8_t* ring = nullptr;  // (ring_rows, head_dim) residual type
  std::size_t ring_rows = 0;
  std::size_t ring_origin = 0;  // the position whose row sits in slot 0

  std::size_t residual_row_bytes() const noexcept { return head_dim * size_of(residual); }

  const std::uint8_t* sink_row(std::size_t position) const noexcept { return sinks + position * residual_row_bytes(); }
  const std::uint8_t* pending_row(std::size_t position) const noexcept {
    return ring + ((position - ring_origin) % ring_rows) * residual_row_bytes();
  }
  /// Whether the segment holds `position` in the residual type (a sink or a ring row), and that row.
  bool residual_at(std::size_t position) const noexcept {
    return position < first_quantized || position >= end_quantized;
  }
  const std::uint8_t* residual_row(std::size_t position) const noexcept {
    return position < first_quantized ? sink_row(position) : pending_row(position);
  }
  const std::uint8_t* code_row(std::size_t position) const noexcept {
    return codes + (position - first_quantized) * row_bytes;
  }
  /// Index of the first parameter pair that applies to `position` (a packed position of the segment).
  std::size_t param_index(std::size_t position) const noexcept {
    return params_before(spec, head_dim, position - first_quantized);
  }

  /// The largest |value| that packed rows [begin, end) of the segment can decode to: inliers by
  /// their group's extreme codes (`extreme`, from extreme_codes(spec)), outliers exactly. Infinite
  /// where a group's parameters overflow.
  float packed_bound(std::size_t begin, std::size_t end, std::pair<std::uint8_t, std::uint8_t> extreme) const noexcept {
    if (begin >= end) return 0.0f;
    const bool per_channel = spec.axis == Axis::per_channel;
    const std::size_t per_row = per_channel ? head_dim : groups_per_row(spec, head_dim);
    const std::size_t first = param_index(begin), last = param_index(end - 1) + per_row;
    float bound = inlier_bound(first, last, extreme);
    for (std::size_t e = first * spec.outliers; e < last * spec.outliers; ++e) {
      const std::size_t i = e / spec.outliers, slot = outlier_slots[e];
      if (slot >= spec.group) continue;  // a forged slot, refused once a pool load checks its blocks
      // Group i's slot-th row (per channel: channel i mod head_dim) or value (per token).
      const std::size_t row = per_channel ? first_quantized + i / head_dim * spec.group + slot
                                          : first_quantized + i / per_row,
                        channel = per_channel ? i % head_dim : i % per_row * spec.group + slot;
      const kernels::reference::GroupParams p = kernels::reference::load_params(spec, scales, zeros, i);
      const float x = kernels::reference::decode(p, code_at(code_row(row), channel, spec.bits)) +
                      load_scalar(spec.param, outlier_corrections, e);
      bound = std::max(bound, std::fabs(x));
    }
    return bound;
  }

  /// The largest |value| the extreme codes decode to with parameter pairs [first, last), or +inf
  /// where one overflows: decode() written out per kind of spec, over a block of pairs at a time,
  /// so that it vectorises (a load bounds every group it restores).
  float inlier_bound(std::size_t first, std::size_t last,
                     std::pair<std::uint8_t, std::uint8_t> extreme) const noexcept {
    constexpr std::size_t block = 256;
    alignas(64) float scale[block], zero[block], low[block], high[block];
    const float* levels = code_levels(spec);
    const float c0 = levels != nullptr ? levels[extreme.first] : float(extreme.first),
                c1 = levels != nullptr ? levels[extreme.second] : float(extreme.second);
    // Without a stored zero point: zero = -mid_code * scale, or exactly 0 with a level table.
    const bool implied = !spec.has_zero_point() && levels == nullptr;
    const float mid = implied ? kernels::reference::implied_zero(spec) : 0.0f;
    const std::size_t param_bytes = size_of(spec.param);
    float bound = 0.0f;
    for (std::size_t i = first; i < last; i += block) {
      const std::size_t n = std::min(block, last - i);
      load_row(spec.param, scales + i * param_bytes, n, scale);
      if (spec.has_zero_point())
        load_row(spec.param, zeros + i * param_bytes, n, zero);
      else
        for (std::size_t j = 0; j < n; ++j) zero[j] = implied ? mid * scale[j] : 0.0f;
      for (std::size_t j = 0; j < n; ++j) {
        low[j] = zero[j] + c0 * scale[j];
        high[j] = zero[j] + c1 * scale[j];
      }
      bound = std::max({bound, largest_magnitude(low, n), largest_magnitude(high, n)});
    }
    // Finite parameters (a load refuses others) overflow to inf, or to NaN = inf - inf in `high`
    // only where the implied zero is infinite, and then `low` (code 0: zero + 0) is infinite too:
    // largest_magnitude gives inf, or NaN, and either reads as +inf here.
    return bound <= std::numeric_limits<float>::max() ? bound : std::numeric_limits<float>::infinity();
  }

  /// The stored row at `position` as floats (dequantized when packed): out (head_dim).
  void read_row(std::size_t position, float* out) const noexcept {
    const std::uint8_t* stored = nullptr;
    if (position < sinks_stored)
      stored = sink_row(position);
    else if (position >= end_quantized)
      stored = pending_row(position);
    if (stored != nullptr) {
      load_row(residual, stored, head_dim, out);
      return;
    }
    const std::size_t p = param_index(position);
    const std::size_t param_bytes = size_of(spec.param);
    const std::uint8_t* s = scales + p * param_bytes;
    const std::uint8_t* z = zeros == nullptr ? nullptr : zeros + p * param_bytes;
    const kernels::reference::ConstOutliers o =
        spec.outliers == 0 ? kernels::reference::ConstOutliers{}
                           : kernels::reference::ConstOutliers{outlier_slots + p * spec.outliers,
                                                               outlier_corrections + p * spec.outliers * param_bytes};
    if (spec.axis == Axis::per_channel)
      kernels::reference::dequantize_row_per_channel(spec, code_row(position), head_dim, s, z, out,
                                                     (position - first_quantized) % spec.group, o);
    else
      kernels::reference::dequantize_row_per_token(spec, code_row(position), head_dim, s, z, out, o);
  }
};

}  // namespace kvq::inline v0
