#pragma once
// CodebookCalibration: fits the levels of a Mode::codebook quantizer to a model's activations.
// Each group of the calibration rows is mapped to [-1, 1] by its own range, as the quantizer
// maps it (y = (x - zero) / scale, reference.hpp), and Lloyd's algorithm (1-D k-means) places
// 2^bits levels where those values are dense: KVQuant's non-uniform datatype, without its
// sensitivity weights unless given some (Weights: what each value's error costs where it is
// consumed). Start from the uniform grid, so a fit is never worse than asymmetric levels on its
// calibration data.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/error.hpp"
#include "kvq/quant/spec.hpp"

namespace kvq::inline v0 {

/// What each value's error costs, for a sensitivity-weighted fit (KVQuant weighs its k-means so):
/// value (r, c) of the rows added weighs channels[c] x rows[r] (an empty span: 1 each) times its
/// group's squared half range, which turns an error in [-1, 1] into one in the tensor's units.
struct CodebookWeights {
  std::span<const float> channels{};  // head_dim weights, or none
  std::span<const float> rows{};      // a weight per row added, or none
};

class CodebookCalibration {
 public:
  /// `spec`: the bits (1..4), axis and group of the quantizer to fit (its mode is ignored);
  /// rows of `head_dim` channels.
  CodebookCalibration(QuantizerSpec spec, std::size_t head_dim) : spec_(spec), head_dim_(head_dim) {
    spec_.mode = Mode::codebook;
    spec_.outliers = 0;
    spec_.codebook = {};
    if (spec_.bits < 1 || spec_.bits > 4)
      throw Error(ErrorCode::invalid_argument,
                  "codebook calibration: codebook levels take 1..4 bits, got " + std::to_string(spec.bits));
    validate(uniform(), head_dim, "codebook calibration");
  }

  using Weights = CodebookWeights;

  /// Adds the rows (tokens, head_dim) of one KV head at consecutive positions. Per-channel groups
  /// are runs of `group` rows from the first; a last partial run is left out (the cache keeps such
  /// rows in full precision). Weighted (any weights given) or not, every add of a calibration
  /// alike. Throws on a non-finite value or a bad weight, adding nothing.
  void add(std::span<const float> rows, Weights weights = {}) {
    if (rows.size() % head_dim_ != 0)
      throw Error(ErrorCode::shape_mismatch, "codebook calibration: " + std::to_string(rows.size()) +
                                                 " values are no whole number of rows of " + std::to_string(head_dim_));
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (!std::isfinite(rows[i]))
        throw Error(ErrorCode::non_finite_input,
                    "codebook calibration: value " + std::to_string(i) + " is " + std::to_string(rows[i]));
    const std::size_t n = rows.size() / head_dim_;
    const bool weighted = !weights.channels.empty() || !weights.rows.empty();
    check_weights(weights, n, weighted);
    weighted_ = weighted;
    auto weight = [&](std::size_t r, std::size_t c) {
      return (weights.channels.empty() ? 1.0 : double(weights.channels[c])) *
             (weights.rows.empty() ? 1.0 : double(weights.rows[r]));
    };
    if (spec_.axis == Axis::per_channel) {
      for (std::size_t r0 = 0; r0 + spec_.group <= n; r0 += spec_.group)
        for (std::size_t c = 0; c < head_dim_; ++c)
          add_group(rows.data() + r0 * head_dim_ + c, spec_.group, head_dim_,
                    [&](std::size_t i) { return weight(r0 + i, c); });
    } else {
      for (std::size_t r = 0; r < n; ++r)
        for (std::size_t c = 0; c < head_dim_; c += spec_.group)
          add_group(rows.data() + r * head_dim_ + c, std::min(spec_.group, head_dim_ - c), 1,
                    [&](std::size_t i) { return weight(r, c + i); });
    }
  }

  /// Values collected so far (each in [-1, 1]).
  std::size_t samples() const noexcept { return samples_.size(); }

  /// The quantizer with the fitted levels (rounded to f16, ascending). Throws with fewer than
  /// 16 samples per level.
  QuantizerSpec fit(int iterations = 64) const {
    const std::size_t k = std::size_t(spec_.levels());
    if (samples_.size() < 16 * k)
      throw Error(ErrorCode::invalid_argument, "codebook calibration: " + std::to_string(samples_.size()) +
                                                   " samples fit no " + std::to_string(k) + " levels (at least " +
                                                   std::to_string(16 * k) + " needed)");
    std::vector<std::size_t> order(samples_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return samples_[a] < samples_[b]; });
    std::vector<float> y(order.size());
    // Sums of the sorted samples' weights and weighted values: each cell's (weighted) mean in O(1).
    // Unweighted, the weights are 1 and the sums are counts and plain sums, exactly.
    std::vector<double> weight_sum(y.size() + 1, 0.0), prefix(y.size() + 1, 0.0);
    for (std::size_t i = 0; i < y.size(); ++i) {
      y[i] = samples_[order[i]];
      const double w = weights_.empty() ? 1.0 : weights_[order[i]];
      weight_sum[i + 1] = weight_sum[i] + w;
      prefix[i + 1] = prefix[i] + w * double(y[i]);
    }
    QuantizerSpec start = uniform();
    std::vector<double> level(start.codebook.begin(), start.codebook.begin() + std::ptrdiff_t(k));
    for (int it = 0; it < iterations; ++it) {
      std::size_t begin = 0;
      bool moved = false;
      for (std::size_t j = 0; j < k; ++j) {  // cell j: samples nearer level j than its neighbours
        const std::size_t end =
            j + 1 == k
                ? y.size()
                : std::size_t(std::lower_bound(y.begin(), y.end(), float(0.5 * (level[j] + level[j + 1]))) - y.begin());
        if (weight_sum[end] > weight_sum[begin]) {
          const double mean = (prefix[end] - prefix[begin]) / (weight_sum[end] - weight_sum[begin]);
          moved |= mean != level[j];
          level[j] = mean;
        }
        begin = std::max(begin, end);
      }
      if (!moved) break;
    }
    QuantizerSpec out = spec_;
    for (std::size_t j = 0; j < k; ++j)  // rounded to f16; levels that round together stay apart
      out.codebook[j] = j > 0 ? std::max(f16_level(level[j]), next_f16(out.codebook[j - 1])) : f16_level(level[j]);
    for (std::size_t j = k; j-- > 0;)  // and none pushed past 1
      out.codebook[j] = std::min(out.codebook[j], j + 1 < k ? -next_f16(-out.codebook[j + 1]) : 1.0f);
    validate(out, head_dim_, "codebook calibration");
    return out;
  }

 private:
  void check_weights(const Weights& w, std::size_t rows, bool weighted) const {
    const std::string prefix = "codebook calibration: ";
    if (!samples_.empty() && weighted != weighted_)
      throw Error(ErrorCode::invalid_argument, prefix + (weighted ? "weights for a calibration added without them"
                                                                  : "rows without weights for a weighted calibration"));
    if (!w.channels.empty() && w.channels.size() != head_dim_)
      throw Error(ErrorCode::shape_mismatch, prefix + std::to_string(w.channels.size()) + " channel weights for " +
                                                 std::to_string(head_dim_) + " channels");
    if (!w.rows.empty() && w.rows.size() != rows)
      throw Error(ErrorCode::shape_mismatch,
                  prefix + std::to_string(w.rows.size()) + " row weights for " + std::to_string(rows) + " rows");
    for (const auto& [span, what] : {std::pair{w.channels, "channel"}, std::pair{w.rows, "row"}})
      for (std::size_t i = 0; i < span.size(); ++i)
        if (!(std::isfinite(span[i]) && span[i] >= 0.0f))
          throw Error(ErrorCode::invalid_argument, prefix + what + " weight " + std::to_string(i) + " is " +
                                                       std::to_string(span[i]) + ", not a finite weight of at least 0");
  }

  // Adds a group of n values (stride apart) as samples in [-1, 1]; in a weighted calibration
  // value i weighs weight(i) times the squared half range.
  template <class Weight>
  void add_group(const float* x, std::size_t n, std::size_t stride, Weight weight) {
    float lo = x[0], hi = x[0];
    for (std::size_t i = 1; i < n; ++i) lo = std::min(lo, x[i * stride]), hi = std::max(hi, x[i * stride]);
    const double half = (double(hi) - double(lo)) * 0.5, mid = double(lo) + half;
    if (half == 0.0) return;  // a constant group decodes exactly whatever the levels
    for (std::size_t i = 0; i < n; ++i) {
      samples_.push_back(float((double(x[i * stride]) - mid) / half));
      if (weighted_) weights_.push_back(weight(i) * half * half);
    }
  }

  // The uniform grid: asymmetric min-max levels.
  QuantizerSpec uniform() const {
    QuantizerSpec s = spec_;
    const int k = s.levels();
    for (int j = 0; j < k; ++j) s.codebook[std::size_t(j)] = f16_level(-1.0 + 2.0 * double(j) / double(k - 1));
    return s;
  }
  static float f16_level(double x) noexcept {  // in [-1, 1], +0 for zero
    return round_to(Scalar::f16, float(std::clamp(x, -1.0, 1.0))) + 0.0f;
  }
  // The next f16 value above x (an f16 value), never -0.
  static float next_f16(float x) noexcept {
    const std::uint16_t b = to_fp16(x).bits;
    if (x == 0.0f) return to_float(fp16{1});
    return to_float(fp16{std::uint16_t(x < 0.0f ? b - 1 : b + 1)}) + 0.0f;
  }

  QuantizerSpec spec_;
  std::size_t head_dim_;
  std::vector<float> samples_;
  std::vector<double> weights_;  // one per sample in a weighted calibration, else none (double: no product overflows)
  bool weighted_ = false;
};

}  // namespace kvq::inline v0
