// PerToken<5, 32, normal_float>: the NormalFloat table holds 2..4 bits.
#include "kvq/quant/policies.hpp"
#if defined(KVQ_VALID)
using Q = kvq::PerToken<4, 32, kvq::Mode::normal_float>;
#else
using Q = kvq::PerToken<5, 32, kvq::Mode::normal_float>;
#endif
constexpr kvq::QuantizerSpec spec = Q::spec;
int main() { return spec.bits; }
