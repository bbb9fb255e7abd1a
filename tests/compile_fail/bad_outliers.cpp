// PerChannel<3, 4, ..., 4>: a group of 4 cannot keep 4 outliers (none would be quantized).
#include "kvq/quant/policies.hpp"
#if defined(KVQ_VALID)
using Q = kvq::PerChannel<3, 4, kvq::Mode::asymmetric, kvq::fp16, 3>;
#else
using Q = kvq::PerChannel<3, 4, kvq::Mode::asymmetric, kvq::fp16, 4>;
#endif
constexpr kvq::QuantizerSpec spec = Q::spec;
int main() { return int(spec.outliers); }
