// A program that uses kvq the way a downstream project would: one include, one target.
#include <cmath>
#include <cstdio>
#include <vector>

#include "kvq/kvq.hpp"

int main() {
  kvq::KVCache<kvq::K4V2> cache(kvq::CacheShape{1, 1, 64, 256});
  constexpr std::size_t tokens = 200;  // past the 128-token window, so groups get quantized
  std::vector<float> k(64), v(64);     // (1 token, 1 head, 64 channels)
  for (std::size_t t = 0; t < tokens; ++t) {
    for (std::size_t c = 0; c < 64; ++c) {
      k[c] = std::sin(0.1f * float(t * 64 + c));
      v[c] = std::cos(0.07f * float(t + c));
    }
    cache.append(0, t, k, v);
  }
  const bool ok = cache.length(0) == tokens;
  std::printf("kvq consumer: %zu tokens cached (%s)\n", cache.length(0), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
