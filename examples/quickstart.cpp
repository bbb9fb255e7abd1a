// kvq quickstart: fill caches of several presets with the same 2000 tokens, then compare their
// size with fp16 and their error where it matters, at the attention output.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kvq/kvq.hpp"

const kvq::CacheShape shape{.layers = 1, .kv_heads = 8, .head_dim = 128, .capacity = 4096};
const std::size_t tokens = 2000, row = shape.kv_heads * shape.head_dim;

template <class Policy>
void report(const char* name, const std::vector<float>& keys, const std::vector<float>& values,
            const std::vector<float>& q, const std::vector<float>& exact) {
  kvq::KVCache<Policy> cache(shape);
  cache.append(0, 0, keys, values);  // pre-RoPE keys; RoPE is applied after dequantization
  std::vector<float> out(q.size());
  kvq::reference_attention(cache, 0, tokens - 1, q, out);  // 32 query heads at the last position
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < q.size(); ++i) {
    diff += (out[i] - exact[i]) * double(out[i] - exact[i]);
    norm += double(exact[i]) * exact[i];
  }
  const kvq::MemoryUsage m = cache.memory();
  std::printf("%-22s %-20s %6.0f B  %5.2f  %6.2fx  %.4f\n", name, kvq::to_string(cache.config()).c_str(),
              double(m.total_bytes()) / tokens, m.bits_per_value(), 1.0 / m.ratio_to_fp16(), std::sqrt(diff / norm));
}

int main() {
  // Keys with one outlier channel per head, as trained models have; unit-normal values.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> keys(tokens * row), values(tokens * row), q(32 * shape.head_dim);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys[i] = normal(rng) + (i % shape.head_dim == 5 ? 12.0f : 0.0f);
    values[i] = normal(rng);
  }
  for (float& x : q) x = normal(rng);

  kvq::KVCache<kvq::Dynamic> full(shape, kvq::full_precision_config());
  full.append(0, 0, keys, values);
  std::vector<float> exact(q.size());
  kvq::reference_attention(full, 0, tokens - 1, q, exact);

  std::printf("%-22s %-20s %8s  %5s  %7s  %s\n", "preset", "config", "bytes/tok", "bits", "vs fp16", "attention error");
  report<kvq::K8V4>("K8V4", keys, values, q, exact);
  report<kvq::K4V4>("K4V4", keys, values, q, exact);
  report<kvq::K4V2>("K4V2", keys, values, q, exact);
  report<kvq::K2V2>("K2V2", keys, values, q, exact);
  report<kvq::K2V2KeysPerToken>("K2V2, keys per token", keys, values, q, exact);
}
