// PerToken<4, 32, fp8_e4m3>: an fp8 code is a byte.
#include "kvq/quant/policies.hpp"
#if defined(KVQ_VALID)
using Q = kvq::Fp8E4M3<32>;
#else
using Q = kvq::PerToken<4, 32, kvq::Mode::fp8_e4m3>;
#endif
constexpr kvq::QuantizerSpec spec = Q::spec;
int main() { return spec.bits; }
