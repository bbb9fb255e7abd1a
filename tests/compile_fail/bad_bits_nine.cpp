// PerToken<9, 32>: codes are at most one byte.
#include "kvq/quant/policies.hpp"
#if defined(KVQ_VALID)
using Q = kvq::PerToken<8, 32>;
#else
using Q = kvq::PerToken<9, 32>;
#endif
constexpr kvq::QuantizerSpec spec = Q::spec;
int main() { return spec.bits; }
