#pragma once
// Normalized Walsh-Hadamard transform of head vectors: an orthogonal rotation that spreads an
// outlier channel over the whole block, so a quantizer sees near-Gaussian values. Because it is
// orthogonal, q.k = (Hq).(Hk): post-RoPE keys rotated before quantization are read by rotating the
// query; pre-RoPE keys are rotated back (inverse) before RoPE, by the kernels.
//
// Blocks: a head of `dim` channels is split into blocks of the largest power of two dividing dim
// (128 -> one block of 128, 96 -> three blocks of 32, 80 -> five of 16), each transformed on its
// own: block-diagonal H, still orthogonal. Optional fixed random signs (a diagonal D of +-1 drawn
// from a seed, the same for every head) make it H D: forward(x) = H (D x), inverse(y) = D (H y).

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvq/error.hpp"

namespace kvq::inline v0 {

/// Block length used for a head of `dim` channels: the largest power of two dividing it.
constexpr std::size_t hadamard_block(std::size_t dim) noexcept { return dim & (~dim + 1); }

class HadamardTransform {
 public:
  /// `dim`: channels per head (1..65536). `sign_seed`: draw the random signs from this seed
  /// (splitmix64, so every platform draws the same signs); none: plain H.
  explicit HadamardTransform(std::size_t dim, std::optional<std::uint64_t> sign_seed = std::nullopt)
      : dim_(dim), block_(hadamard_block(dim)) {
    if (dim == 0 || dim > 65536)
      throw Error(ErrorCode::invalid_argument,
                  "Hadamard transform: dim must be in 1..65536, got " + std::to_string(dim));
    norm_ = float(1.0 / std::sqrt(double(block_)));
    if (sign_seed) {
      std::uint64_t state = *sign_seed;
      for (std::size_t i = 0; i < dim; ++i) signs_.push_back(next(state) >> 63 ? -1.0f : 1.0f);
    }
  }

  std::size_t dim() const noexcept { return dim_; }
  std::size_t block() const noexcept { return block_; }
  std::span<const float> signs() const noexcept { return signs_; }
  /// 1/sqrt(block()): the factor after each block's butterflies.
  float norm() const noexcept { return norm_; }

  /// The largest L2 norm of a block either transform takes: FLT_MAX / (2 sqrt(block())). A
  /// butterfly sum of 2^s values is at most sqrt(2^s) times their norm, and the transforms keep
  /// norms, so forward's output is always inverse's input (and the other way round).
  float max_block_norm() const noexcept {
    return float(double(std::numeric_limits<float>::max()) / (2 * std::sqrt(double(block_))));
  }

  /// Where x (whole heads) leaves the transforms' range: its first NaN or Inf, else the largest
  /// value of the first block whose norm exceeds max_block_norm() (or a smaller `norm_limit`: a
  /// bound on every value the transform gives); x.size() where it does not.
  std::size_t first_out_of_range(std::span<const float> x, double norm_limit = HUGE_VAL) const noexcept {
    const double limit = std::min(double(max_block_norm()), norm_limit), squared_limit = limit * limit;
    for (std::size_t b = 0; b + block_ <= x.size(); b += block_) {
      double squares = 0;
      for (std::size_t i = b; i < b + block_; ++i) squares += double(x[i]) * double(x[i]);
      if (squares <= squared_limit) continue;  // NaN and Inf fail
      std::size_t largest = b;
      for (std::size_t i = b; i < b + block_; ++i) {
        if (!std::isfinite(x[i])) return i;
        if (std::fabs(x[i]) > std::fabs(x[largest])) largest = i;
      }
      return largest;
    }
    return x.size();
  }

  /// Why such a value is out of range, for errors that name it.
  std::string range_text() const {
    return "its block of " + std::to_string(block_) + " channels has an L2 norm beyond FLT_MAX / (2 sqrt " +
           std::to_string(block_) + "), past which the butterflies overflow";
  }

  /// x <- H D x for every head of a (heads * dim) span of finite values whose blocks are within
  /// max_block_norm(). Anything else is refused, naming a value, before x is touched.
  void forward(std::span<float> x) const {
    check(x);
    forward_unchecked(x);
  }

  /// y <- D H y, the inverse of forward, on the same terms.
  void inverse(std::span<float> y) const {
    check(y);
    inverse_unchecked(y);
  }

  /// forward() without its checks, for callers that bound their values themselves (the cache,
  /// before it stores rows).
  void forward_unchecked(std::span<float> x) const noexcept {
    for (std::size_t h = 0; h + dim_ <= x.size(); h += dim_) {
      apply_signs(x.data() + h);
      transform_head(x.data() + h);
    }
  }

  /// inverse() without its checks: attention outputs of a rotated cache, which stay within the
  /// bound its rows were stored under.
  void inverse_unchecked(std::span<float> y) const noexcept {
    for (std::size_t h = 0; h + dim_ <= y.size(); h += dim_) inverse_head(y.data() + h);
  }

  /// inverse() of one head of dim() floats: what decode kernels call on a dequantized key row.
  void inverse_head(float* y) const noexcept {
    transform_head(y);
    apply_signs(y);
  }

 private:
  static std::uint64_t next(std::uint64_t& state) noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  void check(std::span<const float> x) const {
    if (x.size() % dim_ != 0)
      throw Error(ErrorCode::shape_mismatch, "Hadamard transform: " + std::to_string(x.size()) +
                                                 " values are not a whole number of heads of " + std::to_string(dim_));
    const std::size_t i = first_out_of_range(x);
    if (i == x.size()) return;
    const std::string place = "Hadamard transform: value " + std::to_string(x[i]) + " at head " +
                              std::to_string(i / dim_) + ", channel " + std::to_string(i % dim_);
    if (!std::isfinite(x[i])) throw Error(ErrorCode::non_finite_input, place + " is not finite");
    throw Error(ErrorCode::invalid_argument, place + ": " + range_text());
  }

  void apply_signs(float* x) const noexcept {
    for (std::size_t i = 0; i < signs_.size(); ++i) x[i] *= signs_[i];
  }

  // In-place butterflies (Sylvester order: H[i][j] = (-1)^popcount(i & j)), then 1/sqrt(block).
  void transform_head(float* x) const noexcept {
    for (std::size_t b = 0; b < dim_; b += block_) {
      float* v = x + b;
      for (std::size_t len = 1; len < block_; len *= 2)
        for (std::size_t i = 0; i < block_; i += 2 * len)
          for (std::size_t j = i; j < i + len; ++j) {
            const float a = v[j], c = v[j + len];
            v[j] = a + c;
            v[j + len] = a - c;
          }
      for (std::size_t j = 0; j < block_; ++j) v[j] *= norm_;
    }
  }

  std::size_t dim_, block_;
  float norm_ = 1.0f;
  std::vector<float> signs_;
};

}  // namespace kvq::inline v0
