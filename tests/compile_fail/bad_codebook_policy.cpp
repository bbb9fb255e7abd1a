// PerChannel<3, 32, codebook>: a codebook's levels are calibrated data, not a compiled policy.
#include "kvq/quant/policies.hpp"
#if defined(KVQ_VALID)
using Q = kvq::PerChannel<3, 32, kvq::Mode::lloyd_max>;
#else
using Q = kvq::PerChannel<3, 32, kvq::Mode::codebook>;
#endif
constexpr kvq::QuantizerSpec spec = Q::spec;
int main() { return spec.bits; }
