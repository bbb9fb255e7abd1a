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

#include <bit>
#include <cmath>
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

  /// x <- H D x for every head of a (heads * dim) span.
  void forward(std::span<float> x) const {
    check(x.size());
    for (std::size_t h = 0; h < x.size(); h += dim_) {
      apply_signs(x.data() + h);
      transform_head(x.data() + h);
    }
  }

  /// y <- D H y, the inverse of forward.
  void inverse(std::span<float> y) const {
    check(y.size());
    for (std::size_t h = 0; h < y.size(); h += dim_) inverse_head(y.data() + h);
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

  void check(std::size_t n) const {
    if (n % dim_ != 0)
      throw Error(ErrorCode::shape_mismatch, "Hadamard transform: " + std::to_string(n) +
                                                 " values are not a whole number of heads of " + std::to_string(dim_));
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
