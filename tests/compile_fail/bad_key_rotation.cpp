// A Hadamard rotation of pre-RoPE keys: the kernels rotate such keys by RoPE after dequantization.
#include "kvq/quant/kv_policy.hpp"
#if defined(KVQ_VALID)
using P = kvq::KVPolicy<kvq::PerToken<4, 32>, kvq::PerToken<2, 32>, 128, 0, kvq::KeyRope::post, kvq::fp16,
                        kvq::Rotation::hadamard>;
#else
using P = kvq::KVPolicy<kvq::PerToken<4, 32>, kvq::PerToken<2, 32>, 128, 0, kvq::KeyRope::pre, kvq::fp16,
                        kvq::Rotation::hadamard>;
#endif
int main() { return int(P::window); }
