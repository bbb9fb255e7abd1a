#pragma once
// Seeded random tensors shared by the tests.

#include <cstddef>
#include <random>
#include <vector>

namespace kvq::test {

inline std::vector<float> normal_vector(std::size_t n, unsigned seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

/// (tokens, heads, dim) keys with a large constant offset on `channel` of every head: the fixed
/// outlier channel of real keys.
inline std::vector<float> outlier_keys(std::size_t tokens, std::size_t heads, std::size_t dim, std::size_t channel,
                                       float offset, unsigned seed) {
  std::vector<float> k = normal_vector(tokens * heads * dim, seed);
  for (std::size_t i = channel; i < k.size(); i += dim) k[i] += offset;
  return k;
}

}  // namespace kvq::test
