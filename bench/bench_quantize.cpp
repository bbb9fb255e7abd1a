// Group quantization throughput (issue 2): keys per channel (blocks of 32 tokens x 128) and
// values per token (128 channels), 2/4/8 bits, fp32 input, reference and dispatched path side
// by side (bytes/s of fp32 input); values per token for all 8 KV heads of a token per call, from
// f32 or f16 rows (bytes/s of the equivalent fp32 input); and cache append throughput (values/s,
// K and V counted).
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "kvq/kvq.hpp"

namespace {

std::vector<float> input(std::size_t n) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng);
  return x;
}

template <bool Reference>
void keys_per_channel(benchmark::State& state) {
  const kvq::QuantizerSpec spec{int(state.range(0)), 32, kvq::Axis::per_channel};
  constexpr std::size_t rows = 32, dim = 128, blocks = 64;  // 1 MiB of input per iteration
  const auto x = input(blocks * rows * dim);
  std::vector<std::uint16_t> scales(blocks * dim), zeros(blocks * dim);
  const std::size_t row_bytes = kvq::packed_bytes(dim, spec.bits);
  std::vector<std::uint8_t> codes(blocks * rows * row_bytes);
  for (auto _ : state) {
    for (std::size_t b = 0; b < blocks; ++b) {
      const float* src = x.data() + b * rows * dim;
      if constexpr (Reference)
        kvq::kernels::reference::quantize_block_per_channel(spec, src, rows, dim, dim, scales.data() + b * dim,
                                                            zeros.data() + b * dim, codes.data() + b * rows * row_bytes,
                                                            row_bytes);
      else
        kvq::kernels::quantize_block_per_channel(spec, src, rows, dim, dim, scales.data() + b * dim,
                                                 zeros.data() + b * dim, codes.data() + b * rows * row_bytes,
                                                 row_bytes);
    }
    benchmark::DoNotOptimize(codes.data());
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * std::int64_t(x.size() * sizeof(float)));
}

template <bool Reference, kvq::Mode M = kvq::Mode::asymmetric>
void values_per_token(benchmark::State& state) {
  const kvq::QuantizerSpec spec{int(state.range(0)), 32, kvq::Axis::per_token, M};
  constexpr std::size_t dim = 128, tokens = 2048;
  const auto x = input(tokens * dim);
  const std::size_t row_bytes = kvq::packed_bytes(dim, spec.bits), groups = kvq::groups_per_row(spec, dim);
  std::vector<std::uint16_t> scales(tokens * groups), zeros(tokens * groups);
  std::vector<std::uint8_t> codes(tokens * row_bytes);
  for (auto _ : state) {
    for (std::size_t t = 0; t < tokens; ++t) {
      if constexpr (Reference)
        kvq::kernels::reference::quantize_row_per_token(spec, x.data() + t * dim, dim, scales.data() + t * groups,
                                                        zeros.data() + t * groups, codes.data() + t * row_bytes);
      else
        kvq::kernels::quantize_row_per_token(spec, x.data() + t * dim, dim, scales.data() + t * groups,
                                             zeros.data() + t * groups, codes.data() + t * row_bytes);
    }
    benchmark::DoNotOptimize(codes.data());
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * std::int64_t(x.size() * sizeof(float)));
}

// All KV heads of a token per call, as the cache's append quantizes them: 8 rows of 128 channels
// per call, stored as In (f32, or f16 as in the cache's full-precision ring).
template <kvq::Scalar In>
void values_per_token_heads(benchmark::State& state) {
  const kvq::QuantizerSpec spec{int(state.range(0)), 32, kvq::Axis::per_token};
  constexpr std::size_t dim = 128, heads = 8, tokens = 256;
  const auto x = input(tokens * heads * dim);
  std::vector<std::uint8_t> stored(x.size() * kvq::size_of(In));
  kvq::store_row(In, x.data(), x.size(), stored.data());
  const std::size_t row_bytes = kvq::packed_bytes(dim, spec.bits), groups = kvq::groups_per_row(spec, dim);
  std::vector<std::uint16_t> scales(tokens * heads * groups), zeros(tokens * heads * groups);
  std::vector<std::uint8_t> codes(tokens * heads * row_bytes);
  const std::size_t in_row = dim * kvq::size_of(In);
  for (auto _ : state) {
    for (std::size_t t = 0; t < tokens; ++t)
      kvq::kernels::quantize_rows_per_token(spec, In, stored.data() + t * heads * in_row, heads, dim, in_row,
                                            scales.data() + t * heads * groups, zeros.data() + t * heads * groups,
                                            groups * sizeof(std::uint16_t), codes.data() + t * heads * row_bytes,
                                            row_bytes);
    benchmark::DoNotOptimize(codes.data());
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * std::int64_t(x.size() * sizeof(float)));
}

// One token at a time, as decode appends: 8 KV heads x 128, K4V2 (k4c32-v2t32-r128).
void cache_append(benchmark::State& state) {
  constexpr std::size_t heads = 8, dim = 128, capacity = 8192;
  kvq::BasicKVCache cache(kvq::CacheShape{1, heads, dim, capacity}, kvq::parse_cache_config("k4c32-v2t32-r128-s0"));
  const auto k = input(heads * dim), v = input(heads * dim);
  std::size_t position = 0;
  for (auto _ : state) {
    if (position == capacity) {
      cache.clear();
      position = 0;
    }
    cache.append(0, position++, k, v);
  }
  state.counters["values/s"] =
      benchmark::Counter(double(2 * heads * dim), benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK(keys_per_channel<true>)->Name("quantize_keys_per_channel/reference")->Arg(2)->Arg(4)->Arg(8);
BENCHMARK(keys_per_channel<false>)->Name("quantize_keys_per_channel/dispatched")->Arg(2)->Arg(4)->Arg(8);
BENCHMARK(values_per_token<true>)->Name("quantize_values_per_token/reference")->Arg(2)->Arg(4)->Arg(8);
BENCHMARK(values_per_token<false>)->Name("quantize_values_per_token/dispatched")->Arg(2)->Arg(4)->Arg(8);
// Other modes, AVX-512 and the scalar reference: ggml's q4_0 and q8_0, fp8
BENCHMARK(values_per_token<false, kvq::Mode::ggml>)->Name("quantize_values_per_token/ggml/dispatched")->Arg(4)->Arg(8);
BENCHMARK(values_per_token<true, kvq::Mode::ggml>)->Name("quantize_values_per_token/ggml/reference")->Arg(4)->Arg(8);
BENCHMARK(values_per_token<false, kvq::Mode::fp8_e4m3>)->Name("quantize_values_per_token/e4m3/dispatched")->Arg(8);
BENCHMARK(values_per_token<false, kvq::Mode::fp8_e5m2>)->Name("quantize_values_per_token/e5m2/dispatched")->Arg(8);
BENCHMARK(values_per_token<true, kvq::Mode::fp8_e4m3>)->Name("quantize_values_per_token/e4m3/reference")->Arg(8);
BENCHMARK(values_per_token<true, kvq::Mode::fp8_e5m2>)->Name("quantize_values_per_token/e5m2/reference")->Arg(8);
// Level tables (codes by search among the levels): Lloyd-Max and NormalFloat, AVX-512 and the
// scalar reference
BENCHMARK(values_per_token<false, kvq::Mode::lloyd_max>)
    ->Name("quantize_values_per_token/lm/dispatched")
    ->Arg(2)
    ->Arg(4);
BENCHMARK(values_per_token<true, kvq::Mode::lloyd_max>)->Name("quantize_values_per_token/lm/reference")->Arg(2)->Arg(4);
BENCHMARK(values_per_token<false, kvq::Mode::normal_float>)->Name("quantize_values_per_token/nf/dispatched")->Arg(4);
BENCHMARK(values_per_token<true, kvq::Mode::normal_float>)->Name("quantize_values_per_token/nf/reference")->Arg(4);
BENCHMARK(values_per_token_heads<kvq::Scalar::f32>)
    ->Name("quantize_values_per_token/8_heads_f32")
    ->Arg(2)
    ->Arg(4)
    ->Arg(8);
BENCHMARK(values_per_token_heads<kvq::Scalar::f16>)
    ->Name("quantize_values_per_token/8_heads_f16")
    ->Arg(2)
    ->Arg(4)
    ->Arg(8);
BENCHMARK(cache_append)->Name("cache_append/K4V2/8x128");

BENCHMARK_MAIN();
