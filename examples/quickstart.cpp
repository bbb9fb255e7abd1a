// kvq quickstart: a K4V2 cache (4-bit per-channel keys, 2-bit per-token values, 128 recent
// tokens in fp16), its size against fp16, and its error at the attention output.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kvq/kvq.hpp"

int main() {
  const kvq::CacheShape shape{.layers = 1, .kv_heads = 8, .head_dim = 128, .capacity = 4096};
  kvq::KVCache<kvq::K4V2> cache(shape);
  kvq::KVCache<kvq::Dynamic> exact(shape, kvq::full_precision_config());

  // 2000 tokens of pre-RoPE keys with one outlier channel per head, as real models have.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const std::size_t tokens = 2000, row = shape.kv_heads * shape.head_dim;
  std::vector<float> keys(tokens * row), values(tokens * row);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys[i] = normal(rng) + (i % shape.head_dim == 5 ? 12.0f : 0.0f);
    values[i] = normal(rng);
  }
  cache.append(0, 0, keys, values);
  exact.append(0, 0, keys, values);

  // One decode step: 32 query heads (GQA 4:1) at the last position.
  std::vector<float> q(32 * shape.head_dim), out(q.size()), ref(q.size());
  for (float& x : q) x = normal(rng);
  kvq::reference_attention(cache, 0, tokens - 1, q, out);
  kvq::reference_attention(exact, 0, tokens - 1, q, ref);
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < q.size(); ++i) {
    diff += (out[i] - ref[i]) * double(out[i] - ref[i]);
    norm += double(ref[i]) * ref[i];
  }

  const kvq::MemoryUsage m = cache.memory();
  std::printf("config              %s\n", kvq::to_string(cache.config()).c_str());
  std::printf("bytes per token     %.0f (fp16: %zu)\n", double(m.total_bytes()) / double(tokens), 2 * 2 * row);
  std::printf("bits per value      %.2f (%.2fx smaller than fp16)\n", m.bits_per_value(), 1.0 / m.ratio_to_fp16());
  std::printf("attention error     %.4f (relative L2 at the output)\n", std::sqrt(diff / norm));
}
