// kvq-eval's speed on a model of the size people run: teacher forcing through a synthetic GGUF
// of Llama 3.2 1B's shape (16 layers, 32 query and 8 KV heads of 64, Q4_K weights, vocabulary
// 128256; tests/llama/synthetic_llama.hpp), tokens per second on all cores (one sequence per
// core, as kvq-eval runs its stories), per cache configuration. Prompts go in chunks of 64 tokens
// (kvq-eval --prefill-chunk 64), where matrix products carry the weights; `tokenwise` feeds one
// token at a time (kvq-eval's default), where every token reads all the weights.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "eval/cache_backend.hpp"
#include "llama/full_precision_backend.hpp"
#include "llama/inference.hpp"
#include "llama/model.hpp"
#include "llama/synthetic_llama.hpp"

namespace {

const kvq::llama::Model& model() {
  static const std::unique_ptr<kvq::llama::Model> m = [] {
    const auto path = std::filesystem::temp_directory_path() / "kvq-bench-llama-3.2-1b-shape.gguf";
    const auto start = std::chrono::steady_clock::now();
    kvq::llama::testing::write_synthetic_llama(path);
    auto file = kvq::llama::GgufFile::load(path);
    std::filesystem::remove(path);
    auto loaded = std::make_unique<kvq::llama::Model>(kvq::llama::Model::take_weights(file));
    std::fprintf(stderr, "synthetic Llama-3.2-1B-shaped model written and loaded in %.1f s\n",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    return loaded;
  }();
  return *m;
}

std::size_t threads() { return std::max(1u, std::min(std::thread::hardware_concurrency(), 8u)); }

// Sequence s of `tokens` ids: BOS, then ids of the byte and merge pieces (what text becomes).
std::vector<int> sequence(std::size_t s, std::size_t tokens) {
  std::vector<int> ids{model().config().bos};
  std::uint64_t state = 0x5eed + s;
  while (ids.size() < tokens) ids.push_back(int(kvq::llama::testing::detail::splitmix64(state) % 958));
  return ids;
}

// One iteration: every core teacher-forces its own sequence through a backend of `make(tokens)`.
template <class MakeBackend>
void teacher_force(benchmark::State& state, MakeBackend make) {
  const std::size_t tokens = std::size_t(state.range(0)), chunk = std::size_t(state.range(1)), n = threads();
  std::vector<std::vector<int>> sequences;
  for (std::size_t s = 0; s < n; ++s) sequences.push_back(sequence(s, tokens));
  double sink = 0;
  for (auto _ : state) {
    std::vector<double> nll(n);
    std::vector<std::thread> workers;
    for (std::size_t s = 0; s < n; ++s)
      workers.emplace_back([&, s] {
        nll[s] = kvq::llama::teacher_forced(
                     model(), [&] { return make(tokens); }, sequences[s], chunk)
                     .mean_nll();
      });
    for (auto& w : workers) w.join();
    for (const double x : nll) sink += x;
  }
  benchmark::DoNotOptimize(sink);
  state.counters["tokens/s"] = benchmark::Counter(double(n * tokens), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = double(n);
}

void fp32_cache(benchmark::State& state) {
  teacher_force(state, [](std::size_t tokens) { return kvq::llama::FullPrecisionBackend(model(), tokens); });
}

void kvq_cache(benchmark::State& state, const char* config) {
  teacher_force(state, [config](std::size_t tokens) {
    return kvq::eval::CacheBackend(model(), kvq::parse_cache_config(config), tokens,
                                   kvq::eval::decode_attention_fn(kvq::Tier::exact));
  });
}

void register_all() {
  const auto args = [](benchmark::internal::Benchmark* b) {
    b->Args({512, 64})->ArgNames({"tokens", "chunk"})->Iterations(1)->UseRealTime()->Unit(benchmark::kSecond);
  };
  args(benchmark::RegisterBenchmark("teacher_forcing/fp32", fp32_cache));
  for (const char* config : {"k16-v16-r0-s0", "k8c32-v4t32-r0-s0", "k4c32-v2t32-r0-s0", "k2c32-v2t32-r0-s0",
                             "k4c32-v2t32-r0-s0-post", "k2c32-v2t32-r128-s4"})
    args(benchmark::RegisterBenchmark((std::string("teacher_forcing/") + config).c_str(), kvq_cache, config));
  const auto tokenwise = [](benchmark::internal::Benchmark* b) {
    b->Args({64, 0})->ArgNames({"tokens", "chunk"})->Iterations(1)->UseRealTime()->Unit(benchmark::kSecond);
  };
  tokenwise(benchmark::RegisterBenchmark("teacher_forcing_tokenwise/fp32", fp32_cache));
  tokenwise(
      benchmark::RegisterBenchmark("teacher_forcing_tokenwise/k4c32-v2t32-r0-s0", kvq_cache, "k4c32-v2t32-r0-s0"));
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
