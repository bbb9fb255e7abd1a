#pragma once
// Rotary position embedding (RoPE). Channel pair i of a head rotates by angle
// position * frequency(i), frequency(i) = theta^(-2i/rotary_dims) before scaling. Two
// conventions pair the channels differently:
//   adjacent_pairs: (2i, 2i+1)       llama.cpp "normal" mode, llama2.c, Meta's Llama
//   half_split:     (i, i + dims/2)  GPT-NeoX, Hugging Face transformers
// Using the wrong one for a model's weights silently ruins attention, so it is always explicit.
//
// Partial rotary (rotary_dims < head_dim) rotates the first rotary_dims channels and leaves the
// rest as they are. Models trained at one context and run at a longer one scale the frequencies
// (RopeScaling): keys stored pre-RoPE are rotated by kvq, so it must reproduce the model's RoPE
// exactly, scaling included.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numbers>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/core/aligned_buffer.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/error.hpp"

namespace kvq::inline v0 {

/// Which channels RoPE rotates together; `none` rotates none (a layer without RoPE: Llama 4's
/// NoPE layers, Command R7B's global ones), so its keys carry no position.
enum class RopeStyle : unsigned char { adjacent_pairs, half_split, none };

constexpr const char* to_string(RopeStyle style) noexcept {
  return style == RopeStyle::adjacent_pairs ? "adjacent_pairs" : style == RopeStyle::half_split ? "half_split" : "none";
}

enum class RopeScalingType : unsigned char { none, linear, llama3, yarn };

constexpr const char* to_string(RopeScalingType type) noexcept {
  switch (type) {
    case RopeScalingType::none:
      return "none";
    case RopeScalingType::linear:
      return "linear";
    case RopeScalingType::llama3:
      return "llama3";
    case RopeScalingType::yarn:
      return "yarn";
  }
  return "unknown";
}

/// How a model stretches RoPE past the context it was trained for, as its reference code does
/// (names follow Hugging Face's rope_scaling). Fields a type does not use are ignored.
///   linear: every frequency / factor (positions / factor).
///   llama3: Meta's per-frequency rule: wavelengths shorter than original_context /
///           high_freq_factor keep their frequency, longer than original_context /
///           low_freq_factor divide it by factor, and those between interpolate smoothly.
///   yarn:   frequencies blend from unscaled to / factor along a ramp over the pairs set by
///           beta_fast and beta_slow (rotations within original_context), and cos/sin are
///           multiplied by attention_factor, which therefore scales rotated q.k by its square.
/// frequency_divisors, when given (one per rotated pair, llama.cpp's rope_freqs tensor), divide
/// the frequencies after the scaling.
struct RopeScaling {
  RopeScalingType type = RopeScalingType::none;
  float factor = 1.0f;               // linear, llama3, yarn
  std::size_t original_context = 0;  // llama3, yarn: original_max_position_embeddings
  float low_freq_factor = 1.0f;      // llama3
  float high_freq_factor = 4.0f;     // llama3
  float beta_fast = 32.0f;           // yarn
  float beta_slow = 1.0f;            // yarn
  float attention_factor = 0.0f;     // yarn; 0 = the default 0.1 ln(factor) + 1
  std::vector<float> frequency_divisors{};

  bool operator==(const RopeScaling&) const = default;
};

struct RopeConfig {
  std::size_t head_dim = 0;
  RopeStyle style = RopeStyle::adjacent_pairs;
  float theta = 10000.0f;
  std::size_t rotary_dims = 0;         // channels rotated from the start of the head; 0 = head_dim
  std::ptrdiff_t position_offset = 0;  // added to every position (context shift)
  RopeScaling scaling{};

  /// Channels rotated: none for RopeStyle::none.
  std::size_t dims() const noexcept { return style == RopeStyle::none ? 0 : rotary_dims == 0 ? head_dim : rotary_dims; }
  bool operator==(const RopeConfig&) const = default;
};

namespace detail {
/// The fields of a scaling its type reads (rope_frequencies, rope_attention_factor), the others at
/// their defaults; the divisors, which every type reads, left out.
inline RopeScaling read_fields(const RopeScaling& s) noexcept {
  RopeScaling r;
  r.type = s.type;
  if (s.type != RopeScalingType::none) r.factor = s.factor;
  if (s.type == RopeScalingType::llama3 || s.type == RopeScalingType::yarn) r.original_context = s.original_context;
  if (s.type == RopeScalingType::llama3) {
    r.low_freq_factor = s.low_freq_factor;
    r.high_freq_factor = s.high_freq_factor;
  }
  if (s.type == RopeScalingType::yarn) {
    r.beta_fast = s.beta_fast;
    r.beta_slow = s.beta_slow;
    r.attention_factor = s.attention_factor;
  }
  return r;
}
}  // namespace detail

/// Whether two scalings scale alike: a field their type does not read tells none apart.
inline bool same_scaling(const RopeScaling& a, const RopeScaling& b) noexcept {
  return a.frequency_divisors == b.frequency_divisors && detail::read_fields(a) == detail::read_fields(b);
}

/// The one spelling of a scaling (files record it): the fields its type does not read at their
/// defaults.
inline RopeScaling canonical(const RopeScaling& s) {
  RopeScaling r = detail::read_fields(s);
  r.frequency_divisors = s.frequency_divisors;
  return r;
}

/// Whether two RoPEs rotate alike: rotary_dims 0 and head_dim are one spelling, a none RoPE
/// reads nothing but its head_dim, and a scaling only the fields its type reads.
inline bool same_rotation(const RopeConfig& a, const RopeConfig& b) noexcept {
  if (a.head_dim != b.head_dim || a.style != b.style) return false;
  return a.style == RopeStyle::none || (a.theta == b.theta && a.dims() == b.dims() &&
                                        a.position_offset == b.position_offset && same_scaling(a.scaling, b.scaling));
}

inline void validate(const RopeConfig& config) {
  auto fail = [](const std::string& what) { throw Error(ErrorCode::invalid_argument, "RoPE " + what); };
  auto number = [](float x) { return std::to_string(x); };
  if (config.head_dim == 0) fail("head_dim must be positive");
  if (config.style != RopeStyle::adjacent_pairs && config.style != RopeStyle::half_split &&
      config.style != RopeStyle::none)
    fail("style " + std::to_string(int(config.style)) + " is not a RopeStyle");
  if (config.style == RopeStyle::none && (config.rotary_dims != 0 || config.scaling != RopeScaling{}))
    fail("style none rotates no channel: rotary_dims must be 0 and scaling none (one spelling per RoPE)");
  const std::size_t dims = config.dims();
  if (dims % 2 != 0 || dims > config.head_dim)
    fail("rotary_dims must be even and at most head_dim (got " + std::to_string(dims) + " for head_dim " +
         std::to_string(config.head_dim) + ")");
  if (!(config.theta > 1.0f) || !std::isfinite(config.theta)) fail("theta must be finite and greater than 1");
  // Positions plus the offset stay exact in double and far from the ends of ptrdiff_t.
  if (constexpr std::ptrdiff_t most = std::ptrdiff_t(1) << 52;
      config.position_offset > most || config.position_offset < -most)
    fail("position_offset must be within +-2^52 (got " + std::to_string(config.position_offset) + ")");
  const RopeScaling& s = config.scaling;
  const std::string type = std::string(to_string(s.type)) + " scaling";
  switch (s.type) {
    case RopeScalingType::none:
      break;
    case RopeScalingType::linear:
    case RopeScalingType::llama3:
    case RopeScalingType::yarn:
      if (!(s.factor >= 1.0f) || !std::isfinite(s.factor))
        fail(type + ": factor must be finite and at least 1, got " + number(s.factor));
      break;
    default:
      fail("scaling type " + std::to_string(int(s.type)) + " is not a RopeScalingType");
  }
  if ((s.type == RopeScalingType::llama3 || s.type == RopeScalingType::yarn) && s.original_context == 0)
    fail(type + ": original_context (the trained context length) must be positive");
  if (s.type == RopeScalingType::llama3 &&
      !(s.low_freq_factor > 0.0f && s.low_freq_factor < s.high_freq_factor && std::isfinite(s.high_freq_factor)))
    fail(type + ": needs 0 < low_freq_factor < high_freq_factor, finite (got " + number(s.low_freq_factor) + " and " +
         number(s.high_freq_factor) + ")");
  if (s.type == RopeScalingType::yarn) {
    if (!(s.beta_slow > 0.0f && s.beta_slow < s.beta_fast && std::isfinite(s.beta_fast)))
      fail(type + ": needs 0 < beta_slow < beta_fast, finite (got beta_slow " + number(s.beta_slow) + ", beta_fast " +
           number(s.beta_fast) + ")");
    // Rotated q.k is scaled by its square: far outside what a model uses, that overflows.
    if (!(s.attention_factor == 0.0f || (s.attention_factor >= 1e-4f && s.attention_factor <= 1e4f)))
      fail(type + ": attention_factor must be in [1e-4, 1e4], or 0 for the default (got " + number(s.attention_factor) +
           ")");
  }
  if (!s.frequency_divisors.empty()) {
    if (s.frequency_divisors.size() != dims / 2)
      fail("frequency_divisors: " + std::to_string(s.frequency_divisors.size()) + " values for " +
           std::to_string(dims / 2) + " rotated pairs");
    for (std::size_t i = 0; i < s.frequency_divisors.size(); ++i)
      if (!(s.frequency_divisors[i] > 0.0f) || !std::isfinite(s.frequency_divisors[i]))
        fail("frequency_divisors[" + std::to_string(i) + "] = " + number(s.frequency_divisors[i]) +
             " must be finite and positive");
  }
}

/// Radians per position of every rotation pair, scaling applied, in double. `config` is valid.
inline std::vector<double> rope_frequencies(const RopeConfig& config) {
  const std::size_t dims = config.dims(), pairs = dims / 2;
  const RopeScaling& s = config.scaling;
  const double factor = s.factor, base = config.theta, context = double(s.original_context);
  // yarn's ramp, in pairs: from the pair that turns beta_fast times over the original context
  // (below it: unscaled) to the one that turns beta_slow times (beyond it: / factor).
  double ramp_low = 0.0, ramp_high = 0.0;
  if (s.type == RopeScalingType::yarn) {
    auto pair_turning = [&](double turns) {
      return double(dims) * std::log(context / (turns * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
    };
    ramp_low = std::max(std::floor(pair_turning(s.beta_fast)), 0.0);
    ramp_high = std::min(std::ceil(pair_turning(s.beta_slow)), double(dims - 1));
    if (ramp_low == ramp_high) ramp_high += 0.001;
  }
  std::vector<double> freq(pairs);
  for (std::size_t i = 0; i < pairs; ++i) {
    const double f = std::pow(base, -double(2 * i) / double(dims));
    double scaled = f;
    switch (s.type) {
      case RopeScalingType::none:
        break;
      case RopeScalingType::linear:
        scaled = f / factor;
        break;
      case RopeScalingType::llama3: {
        const double wavelength = 2.0 * std::numbers::pi / f;
        if (wavelength > context / s.low_freq_factor)
          scaled = f / factor;
        else if (wavelength >= context / s.high_freq_factor) {
          const double smooth = (context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          scaled = (1.0 - smooth) * f / factor + smooth * f;
        }
        break;
      }
      case RopeScalingType::yarn: {
        const double ramp = std::clamp((double(i) - ramp_low) / (ramp_high - ramp_low), 0.0, 1.0);
        scaled = f / factor * ramp + f * (1.0 - ramp);
        break;
      }
    }
    freq[i] = s.frequency_divisors.empty() ? scaled : scaled / double(s.frequency_divisors[i]);
  }
  return freq;
}

/// The factor RoPE multiplies rotated channels by: yarn's attention factor, 1 otherwise.
inline double rope_attention_factor(const RopeConfig& config) {
  const RopeScaling& s = config.scaling;
  if (s.type != RopeScalingType::yarn) return 1.0;
  if (s.attention_factor > 0.0f) return s.attention_factor;
  return s.factor <= 1.0f ? 1.0 : 0.1 * std::log(double(s.factor)) + 1.0;
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
    attention_factor_ = float(rope_attention_factor(config));
    const std::vector<double> freq = rope_frequencies(config);
    std::vector<double> c(pairs), s(pairs), step_c(pairs), step_s(pairs);
    for (std::size_t i = 0; i < pairs; ++i) {
      step_c[i] = std::cos(freq[i]);
      step_s[i] = std::sin(freq[i]);
    }
    for (std::size_t p = 0; p < max_positions; ++p) {
      if (p % 256 == 0) {
        const double position = double(static_cast<std::ptrdiff_t>(p) + config.position_offset);
        for (std::size_t i = 0; i < pairs; ++i)
          c[i] = std::cos(position * freq[i]), s[i] = std::sin(position * freq[i]);
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
  std::size_t bytes() const noexcept { return cos_.bytes() + sin_.bytes() + step_cos_.bytes() + step_sin_.bytes(); }
  /// bytes() of a table of `config` over max_positions (at most max_positions_limit), before it is built.
  static std::size_t table_bytes(const RopeConfig& config, std::size_t max_positions) noexcept {
    return 2 * (max_positions + steps) * (config.dims() / 2) * sizeof(float);
  }
  const float* cos_row(std::size_t position) const noexcept { return cos_.data() + position * pairs(); }
  const float* sin_row(std::size_t position) const noexcept { return sin_.data() + position * pairs(); }
  /// cos/sin of t * frequency of pair i for t in [0, steps): steps consecutive floats. A rotation
  /// to position p0 + t is the table's rotation to p0 followed by step t (kernels rotate the query
  /// back to p0 once per run of keys and each key by its step, from a table that stays in L1).
  const float* step_cos(std::size_t pair) const noexcept { return step_cos_.data() + pair * steps; }
  const float* step_sin(std::size_t pair) const noexcept { return step_sin_.data() + pair * steps; }

  /// The factor rotate() multiplies the rotated channels by (yarn's attention factor, else 1).
  /// The tables hold the rotation alone.
  float attention_factor() const noexcept { return attention_factor_; }

  /// The model's RoPE of one head vector in place: x (head_dim) at `position`.
  void rotate(float* x, std::size_t position) const { rotate_by(x, position, +1.0f, attention_factor_); }

  /// Undo rotate(): x (head_dim) at `position` back to pre-RoPE.
  void unrotate(float* x, std::size_t position) const { rotate_by(x, position, -1.0f, 1.0f / attention_factor_); }

  /// The rotation the tables hold, without the attention factor: what attention kernels apply to
  /// stored pre-RoPE keys.
  void rotate_unscaled(float* x, std::size_t position) const { rotate_by(x, position, +1.0f, 1.0f); }

  /// A query for scoring against keys rotated by rotate_unscaled(): the rotated channels carry
  /// the attention factor twice, once for the query and once for the key, so the scores are the
  /// model's (both rotated by rotate()).
  void rotate_query(float* x, std::size_t position) const {
    rotate_by(x, position, +1.0f, attention_factor_ * attention_factor_);
  }

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

  void rotate_by(float* x, std::size_t position, float direction, float magnitude) const {
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
      if (magnitude != 1.0f) x[a] *= magnitude, x[b] *= magnitude;
    }
  }

  RopeConfig config_{};
  std::size_t max_positions_ = 0;
  float attention_factor_ = 1.0f;
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
