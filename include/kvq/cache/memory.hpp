#pragma once
// Memory accounting: what a cache holds, split by kind, and bits per value with every scale,
// zero point, outlier and full-precision token counted.

#include <cstddef>

#include "kvq/cache/stream_layout.hpp"

namespace kvq::inline v0 {

struct MemoryUsage {
  std::size_t code_bytes = 0;      // packed codes
  std::size_t param_bytes = 0;     // scales and zero points, and outliers' slots and corrections
  std::size_t residual_bytes = 0;  // sink and window tokens in the residual type
  std::size_t values = 0;          // K and V elements represented

  std::size_t total_bytes() const noexcept { return code_bytes + param_bytes + residual_bytes; }
  double bits_per_value() const noexcept { return values == 0 ? 0.0 : 8.0 * double(total_bytes()) / double(values); }
  /// Size relative to the same elements stored as fp16.
  double ratio_to_fp16() const noexcept { return values == 0 ? 0.0 : double(total_bytes()) / (2.0 * double(values)); }

  MemoryUsage& operator+=(const MemoryUsage& o) noexcept {
    code_bytes += o.code_bytes;
    param_bytes += o.param_bytes;
    residual_bytes += o.residual_bytes;
    values += o.values;
    return *this;
  }
};

/// Bytes one stream of `layout` uses when it holds `length` tokens of which those before
/// `q_end` are quantized (by default as the rule says for that length).
inline MemoryUsage stream_usage(const StreamLayout& layout, std::size_t length, std::size_t q_end) noexcept {
  MemoryUsage u;
  const std::size_t quantized_rows = length > layout.sinks ? q_end - layout.sinks : 0;
  u.code_bytes = quantized_rows * layout.row_bytes;
  if (layout.quantized) {
    const std::size_t pairs = layout.params_before(quantized_rows);
    u.param_bytes = pairs * (size_of(layout.spec.param) * (layout.spec.has_zero_point() ? 2 : 1) +
                             layout.spec.outliers * (2 + size_of(layout.spec.param)));
  }
  u.residual_bytes = (length - quantized_rows) * layout.head_dim * size_of(layout.residual);
  u.values = length * layout.head_dim;
  return u;
}

inline MemoryUsage stream_usage(const StreamLayout& layout, std::size_t length) noexcept {
  return stream_usage(layout, length, layout.quantized_end(length));
}

}  // namespace kvq::inline v0
