// PerChannel<4, 0>: a group must hold at least one element.
#include "kvq/quant/policies.hpp"
#if defined(KVQ_VALID)
using Q = kvq::PerChannel<4, 1>;
#else
using Q = kvq::PerChannel<4, 0>;
#endif
constexpr kvq::QuantizerSpec spec = Q::spec;
int main() { return spec.bits; }
