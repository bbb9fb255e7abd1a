#pragma once
// The decode-attention kernels of this build that this CPU runs on a cache's layout, by name
// (kernels/attention/registry.hpp): tests run each of them, not only the one chosen.
#include <cstddef>
#include <string>
#include <string_view>
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

/// Whether the kernel called `name` (empty: the one chosen without a name) computes the integer
/// tier where it is asked for (KernelEntry::integer_tier; `cache` an affine one whose streams
/// have that tier): the vector kernels compute the exact tier for both.
inline bool computes_integer_tier(const BasicKVCache& cache, std::size_t heads, std::string_view name = {}) {
  const RopeTable* rope = cache.config().key_rope == KeyRope::pre ? &cache.rope() : nullptr;
  return kernels::attention::select_kernel(cache.keys(0, 0, 0), cache.values(0, 0, 0), heads / cache.shape().kv_heads,
                                           rope, detail::key_unrotation(cache) != nullptr, name)
      .integer_tier;
}

}  // namespace kvq::test
