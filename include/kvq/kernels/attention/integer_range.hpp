#pragma once
// Where the integer tier can carry a range of the cache. Its int8 query is stepped by the largest
// q x scale of a key block, and its value weights by the largest weight x scale of a tile: when
// one channel's (or one row's) scale dwarfs the others, the step rounds their contributions to
// nothing (one key of 60,000 among unit keys, or Mixtral's outlier channels of ~7,000 against a
// median of 0.3). decode_attention asks this per task and runs such a task in the exact tier, so
// the integer tier's bound holds on outlier data too; on data without such outliers nothing
// changes. The scan reads only the scales (vectorised) and costs 5-15% of an integer-tier step
// at 32K; DecodeOptions::guard_outliers turns it off.

#include <algorithm>
#include <cstddef>

#include "kvq/cache/stream_view.hpp"
#include "kvq/core/convert.hpp"
#include "kvq/kernels/attention/task.hpp"

namespace kvq::inline v0::kernels::attention {

/// Largest key channel scale of a task over its mean key channel scale that the int8 query carries
/// within the tier's bound. Measured on random keys with one channel's scale multiplied by R
/// (head_dim 128, K2/K4/K8): relative error 1.3-1.7e-2 at R = 1, 1.8-2.3e-2 at R = 4 (spread
/// 3.9), 4.2-5.2e-2 at R = 8 (spread 7.6) against the bound of 2.5e-2.
inline constexpr float integer_key_spread_limit = 4.0f;
/// Largest value scale over the mean scale of a task's value rows. Value outliers cost the bound
/// little where they dominate the output (1.7-2.6e-2 measured up to a 64x group or row); past
/// this the rows around a rare large one lose their weights entirely.
inline constexpr float integer_value_spread_limit = 64.0f;

/// The scale spread of the key blocks and value rows a range covers, gathered over the segments
/// it is stored in (one scan per tensor and segment: per-block scans cost three times as much for
/// no better answer, since a block whose own channels are all small loses nothing to int8).
class ScaleSpread {
 public:
  void add(const DecodeTask& task) noexcept {
    const StreamView &k = task.keys, &v = task.values;
    if (task.rope == nullptr && k.quantized && k.spec.axis == Axis::per_channel) {
      const std::size_t first = std::max(task.begin, k.first_quantized), last = std::min(task.end, k.end_quantized);
      if (first < last) {  // the key blocks hold consecutive parameter rows
        const std::size_t g = k.spec.group,
                          blocks = (last - 1 - k.first_quantized) / g - (first - k.first_quantized) / g + 1;
        keys_.add(k.spec.param, k.scales + k.param_index(first) * size_of(k.spec.param), blocks * k.head_dim);
      }
    }
    const auto [a, b] = quantized_value_rows(v, task.begin, task.end);  // the integer tier reads these rows
    if (a < b)
      values_.add(v.spec.param, v.scales + v.param_index(a) * size_of(v.spec.param),
                  (b - a) * groups_per_row(v.spec, v.head_dim));
  }
  /// False when the keys or the values have a spread the integer tier cannot carry (limits above).
  bool integer_tier_carries() const noexcept {
    return keys_.within(integer_key_spread_limit) && values_.within(integer_value_spread_limit);
  }

 private:
  struct Extent {
    float top = 0.0f;
    double sum = 0.0;
    std::size_t count = 0;
    void add(Scalar type, const std::uint8_t* scales, std::size_t n) noexcept {
      const auto [t, s] = magnitude_extent(type, scales, n);
      top = std::max(top, t);
      sum += s;
      count += n;
    }
    bool within(float limit) const noexcept { return !(double(top) * double(count) > double(limit) * sum); }
  };
  Extent keys_, values_;
};

/// ScaleSpread of one task stored in one segment.
inline bool integer_tier_carries(const DecodeTask& task) noexcept {
  ScaleSpread spread;
  spread.add(task);
  return spread.integer_tier_carries();
}

}  // namespace kvq::inline v0::kernels::attention
