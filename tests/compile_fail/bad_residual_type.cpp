// Window and sink tokens in double: not a supported residual type.
#include "kvq/quant/kv_policy.hpp"
#if defined(KVQ_VALID)
using P = kvq::KVPolicy<kvq::PerChannel<4, 32>, kvq::PerToken<2, 32>, 128, 0, kvq::KeyRope::pre, kvq::bf16>;
#else
using P = kvq::KVPolicy<kvq::PerChannel<4, 32>, kvq::PerToken<2, 32>, 128, 0, kvq::KeyRope::pre, double>;
#endif
int main() { return int(P::window); }
