// Keys per channel in groups of 32 flush a window of 48 tokens: not a whole number of groups.
#include "kvq/quant/kv_policy.hpp"
#if defined(KVQ_VALID)
using P = kvq::KVPolicy<kvq::PerChannel<4, 32>, kvq::PerToken<2, 32>, 64, 0, kvq::KeyRope::post, kvq::fp16,
                        kvq::Rotation::none, kvq::Rotation::none, kvq::WindowFlush::keys>;
#else
using P = kvq::KVPolicy<kvq::PerChannel<4, 32>, kvq::PerToken<2, 32>, 48, 0, kvq::KeyRope::post, kvq::fp16,
                        kvq::Rotation::none, kvq::Rotation::none, kvq::WindowFlush::keys>;
#endif
int main() { return int(P::window); }
