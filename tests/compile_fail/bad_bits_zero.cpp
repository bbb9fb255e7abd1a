// PerChannel<0, 32>: a zero bit width must not compile.
#include "kvq/quant/policies.hpp"
#if defined(KVQ_VALID)
using Q = kvq::PerChannel<1, 32>;
#else
using Q = kvq::PerChannel<0, 32>;
#endif
constexpr kvq::QuantizerSpec spec = Q::spec;
int main() { return spec.bits; }
