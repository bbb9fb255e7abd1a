// KVPolicy's key quantizer must satisfy kvq::Quantizer.
#include "kvq/quant/kv_policy.hpp"
struct NotAQuantizer {
  static constexpr int bits = 4;  // but no group_size, axis, mode, param_type or spec
};
#if defined(KVQ_VALID)
using P = kvq::KVPolicy<kvq::PerChannel<4, 32>, kvq::PerToken<2, 32>>;
#else
using P = kvq::KVPolicy<NotAQuantizer, kvq::PerToken<2, 32>>;
#endif
int main() { return int(P::window); }
