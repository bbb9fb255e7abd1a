// Scales and zero points in double: not a supported parameter type.
#include "kvq/quant/policies.hpp"
#if defined(KVQ_VALID)
using Q = kvq::PerToken<4, 32, kvq::Mode::asymmetric, float>;
#else
using Q = kvq::PerToken<4, 32, kvq::Mode::asymmetric, double>;
#endif
constexpr kvq::QuantizerSpec spec = Q::spec;
int main() { return spec.bits; }
