#pragma once
// Comparing two caches the way an engine sees them: stored bytes, memory accounting, every row
// read back through the views, and reference attention at the newest position.

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/random.hpp"

namespace kvq::test {

inline std::vector<std::uint8_t> snapshot(const BasicKVCache& c) { return c.stored_bytes(); }

/// Every stored row of `layer`: (kv_heads, 2 tensors, length, head_dim), as the oracles read it.
inline std::vector<std::vector<float>> stored_rows(const BasicKVCache& c, std::size_t layer) {
  std::vector<std::vector<float>> rows;
  for (std::size_t h = 0; h < c.shape().kv_heads; ++h)
    for (const Tensor t : {Tensor::keys, Tensor::values}) {
      for (std::size_t p = 0; p < c.length(layer); ++p) {
        std::vector<float> row(c.shape().head_dim);
        c.read_row(t, layer, h, p, row.data());
        rows.push_back(std::move(row));
      }
    }
  return rows;
}

inline bool same_memory(const MemoryUsage& a, const MemoryUsage& b) {
  return a.code_bytes == b.code_bytes && a.param_bytes == b.param_bytes && a.residual_bytes == b.residual_bytes &&
         a.values == b.values;
}

/// Reference attention of two query heads per KV head at the newest position of `layer`.
inline std::vector<float> reference_output(const BasicKVCache& c, std::size_t layer) {
  const auto q = normal_vector(c.shape().kv_heads * 2 * c.shape().head_dim, 21);
  std::vector<float> out(q.size());
  if (c.length(layer) > 0) reference_attention(c, layer, c.length(layer) - 1, q, out);
  return out;
}

/// a and b hold the same state as far as anything outside the cache can tell.
inline void expect_same_state(const BasicKVCache& a, const BasicKVCache& b, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_TRUE(snapshot(a) == snapshot(b)) << "stored_bytes differs";
  EXPECT_TRUE(same_memory(a.memory(), b.memory())) << "memory() differs";
  for (std::size_t l = 0; l < a.shape().layers; ++l) {
    ASSERT_EQ(a.length(l), b.length(l)) << "layer " << l;
    for (const Tensor t : {Tensor::keys, Tensor::values})
      EXPECT_EQ(a.quantized_end(t, l), b.quantized_end(t, l)) << "layer " << l << " " << to_string(t);
    EXPECT_TRUE(stored_rows(a, l) == stored_rows(b, l)) << "rows of layer " << l << " differ";
    EXPECT_EQ(reference_output(a, l), reference_output(b, l)) << "attention of layer " << l << " differs";
  }
}

}  // namespace kvq::test
