#pragma once
// The decode-attention kernels of this build that this CPU runs on a cache's layout, by name
// (kernels/attention/registry.hpp): tests run each of them, not only the one chosen.
#include <cstddef>
#include <string>
#include <vector>

#include "kvq/attention/decode.hpp"

namespace kvq::test {

inline std::vector<std::string> kernels_for(const BasicKVCache& cache, std::size_t heads) {
  const std::size_t group = heads / cache.shape().kv_heads;
  const RopeTable* rope = cache.config().key_rope == KeyRope::pre ? &cache.rope() : nullptr;
  std::vector<std::string> names;
  for (const auto& e : kernels::attention::registry())
    if (e.available() && kernels::attention::kernel_takes(e, cache.keys(0, 0, 0), cache.values(0, 0, 0), group, rope,
                                                          detail::key_unrotation(cache) != nullptr))
      names.emplace_back(e.name);
  return names;
}

}  // namespace kvq::test
