// PerToken<4, 32, ggml, fp16, 1>: ggml's levels keep no outliers.
#include "kvq/quant/policies.hpp"
#if defined(KVQ_VALID)
using Q = kvq::PerToken<4, 32, kvq::Mode::ggml, kvq::fp16, 0>;
#else
using Q = kvq::PerToken<4, 32, kvq::Mode::ggml, kvq::fp16, 1>;
#endif
constexpr kvq::QuantizerSpec spec = Q::spec;
int main() { return int(spec.outliers); }
