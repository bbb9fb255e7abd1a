#pragma once
// Rotary position embedding (RoPE). Channel pair i of a head rotates by angle
// position * theta^(-2i/rotary_dims). Two conventions pair the channels differently:
//   adjacent_pairs: (2i, 2i+1)       llama.cpp "normal" mode, llama2.c, Meta's Llama
//   half_split:     (i, i + dims/2)  GPT-NeoX, Hugging Face transformers
// Using the wrong one for a model's weights silently ruins attention, so it is always explicit.

#include <cmath>
#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include "kvq/core/aligned_buffer.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/error.hpp"

namespace kvq::inline v0 {

enum class RopeStyle : unsigned char { adjacent_pairs, half_split };

constexpr const char* to_string(RopeStyle style) noexcept {
  return style == RopeStyle::adjacent_pairs ? "adjacent_pairs" : "half_split";
}

struct RopeConfig {
  std::size_t head_dim = 0;
  RopeStyle style = RopeStyle::adjacent_pairs;
  float theta = 10000.0f;
  std::size_t rotary_dims = 0;  // channels rotated from the start of the head; 0 = head_dim
  std::ptrdiff_t position_offset = 0;  // added to every position (context shift)

  std::size_t dims() const noexcept { return rotary_dims == 0 ? head_dim : rotary_dims; }
};

inline void validate(const RopeConfig& config) {
  if (config.head_dim == 0) throw Error(ErrorCode::invalid_argument, "RoPE head_dim must be positive");
  const std::size_t dims = config.dims();
  if (dims % 2 != 0 || dims > config.head_dim)
    throw Error(ErrorCode::invalid_argument,
                "RoPE rotary_dims must be even and at most head_dim (got " + std::to_string(dims) +
                    " for head_dim " + std::to_string(config.head_dim) + ")");
  if (!(config.theta > 1.0f) || !std::isfinite(config.theta))
    throw Error(ErrorCode::invalid_argument, "RoPE theta must be finite and greater than 1");
}

/// Channel indices (first, second) of rotation pair i.
constexpr std::pair<std::size_t, std::size_t> rope_pair(RopeStyle style, std::size_t dims, std::size_t i) noexcept {
  return style == RopeStyle::adjacent_pairs ? std::pair{2 * i, 2 * i + 1} : std::pair{i, i + dims / 2};
}

/// Precomputed cos/sin per position and pair, so attention never calls trigonometry.
class RopeTable {
 public:
  RopeTable() = default;

  RopeTable(const RopeConfig& config, std::size_t max_positions) : config_(config), max_positions_(max_positions) {
    validate(config);
    const std::size_t pairs = config.dims() / 2;
    // Bounded first: a wrapped size would allocate a short table and index past it.
    check_limit(max_positions, max_positions_limit, "RoPE table positions");
    cos_ = Table(max_positions * pairs);
    sin_ = Table(max_positions * pairs);
    // Angles in double, rounded once: every entry is cos/sin of the exact angle to float rounding
    // at any position (a float angle is off by up to 1e-3 rad at 32K), so kernels may compose
    // rotations (position = tile start + step) and still agree with the table to ~1e-7.
    // Positions advance by a rotation in double (error ~1e-16 per step), re-anchored on the exact
    // cos/sin every 256 positions: a long table costs a multiply-add per entry, not a sincos.
    std::vector<double> freq(pairs), c(pairs), s(pairs), step_c(pairs), step_s(pairs);
    for (std::size_t i = 0; i < pairs; ++i) {
      freq[i] = std::pow(double(config.theta), -double(2 * i) / double(config.dims()));
      step_c[i] = std::cos(freq[i]);
      step_s[i] = std::sin(freq[i]);
    }
    for (std::size_t p = 0; p < max_positions; ++p) {
      if (p % 256 == 0) {
        const double position = double(static_cast<std::ptrdiff_t>(p) + config.position_offset);
        for (std::size_t i = 0; i < pairs; ++i) c[i] = std::cos(position * freq[i]), s[i] = std::sin(position * freq[i]);
      }
      for (std::size_t i = 0; i < pairs; ++i) {
        cos_[p * pairs + i] = float(c[i]);
        sin_[p * pairs + i] = float(s[i]);
        const double cn = c[i] * step_c[i] - s[i] * step_s[i];
        s[i] = s[i] * step_c[i] + c[i] * step_s[i];
        c[i] = cn;
      }
    }
    step_cos_ = Table(pairs * steps);
    step_sin_ = Table(pairs * steps);
    for (std::size_t i = 0; i < pairs; ++i)
      for (std::size_t t = 0; t < steps; ++t) {
        step_cos_[i * steps + t] = float(std::cos(double(t) * freq[i]));
        step_sin_[i * steps + t] = float(std::sin(double(t) * freq[i]));
      }
  }

  /// Most positions a table holds (a cache's capacity is bounded the same way).
  static constexpr std::size_t max_positions_limit = std::size_t(1) << 32;

  /// Positions per row of the step tables.
  static constexpr std::size_t steps = 32;

  const RopeConfig& config() const noexcept { return config_; }
  std::size_t max_positions() const noexcept { return max_positions_; }
  std::size_t pairs() const noexcept { return config_.dims() / 2; }
  std::size_t bytes() const noexcept {
    return cos_.bytes() + sin_.bytes() + step_cos_.bytes() + step_sin_.bytes();
  }
  const float* cos_row(std::size_t position) const noexcept { return cos_.data() + position * pairs(); }
  const float* sin_row(std::size_t position) const noexcept { return sin_.data() + position * pairs(); }
  /// cos/sin of t * frequency of pair i for t in [0, steps): steps consecutive floats. A rotation
  /// to position p0 + t is the table's rotation to p0 followed by step t (kernels rotate the query
  /// back to p0 once per run of keys and each key by its step, from a table that stays in L1).
  const float* step_cos(std::size_t pair) const noexcept { return step_cos_.data() + pair * steps; }
  const float* step_sin(std::size_t pair) const noexcept { return step_sin_.data() + pair * steps; }

  /// Rotate one head vector in place: x (head_dim) at `position`.
  void rotate(float* x, std::size_t position) const { rotate_by(x, position, +1.0f); }

  /// Undo the rotation: x (head_dim) at `position` back to pre-RoPE.
  void unrotate(float* x, std::size_t position) const { rotate_by(x, position, -1.0f); }

  /// Rotate `heads` consecutive head vectors (heads, head_dim) at one position.
  void rotate_heads(std::span<float> x, std::size_t position) const {
    check_size(x.size());
    for (std::size_t h = 0; h < x.size() / config_.head_dim; ++h) rotate(x.data() + h * config_.head_dim, position);
  }

 private:
  void check_size(std::size_t n) const {
    if (n % config_.head_dim != 0)
      throw Error(ErrorCode::shape_mismatch, "RoPE input of " + std::to_string(n) +
                                                 " values is not a whole number of heads of " +
                                                 std::to_string(config_.head_dim));
  }

  void rotate_by(float* x, std::size_t position, float direction) const {
    if (position >= max_positions_)
      throw Error(ErrorCode::invalid_argument, "RoPE position " + std::to_string(position) +
                                                   " is beyond the table of " + std::to_string(max_positions_));
    const float* c = cos_row(position);
    const float* s = sin_row(position);
    for (std::size_t i = 0; i < pairs(); ++i) {
      const auto [a, b] = rope_pair(config_.style, config_.dims(), i);
      const float x0 = x[a], x1 = x[b], sn = direction * s[i];
      x[a] = x0 * c[i] - x1 * sn;
      x[b] = x0 * sn + x1 * c[i];
    }
  }

  RopeConfig config_{};
  std::size_t max_positions_ = 0;
  // Cache-line aligned (kernels load 16 floats at a time; a split load costs two), huge pages
  // for long tables (pre-RoPE kernels read a row every 16 or 32 positions, a page apart).
  class Table {
   public:
    Table() = default;
    explicit Table(std::size_t n) : buffer_(n * sizeof(float)) {}
    float* data() noexcept { return reinterpret_cast<float*>(buffer_.data()); }
    const float* data() const noexcept { return reinterpret_cast<const float*>(buffer_.data()); }
    float& operator[](std::size_t i) noexcept { return data()[i]; }
    std::size_t bytes() const noexcept { return buffer_.size(); }

   private:
    AlignedBuffer buffer_;
  };
  Table cos_, sin_, step_cos_, step_sin_;
};

}  // namespace kvq::inline v0
