// Attention for engines (kvq::attend) on the shapes an engine serves:
//   prefill/<cache>/<tier>: a chunk of 512 new tokens (exact, causal) over a 32K stored prefix,
//     2 KV heads x 128 and 8 query heads; counter GFLOP/s counts 4 x d flops per (query row,
//     visible position): q.k and p.v. The per-core peaks to compare with: ../shared/PERF-NOTES.md.
//   prefill_chunked/...: the same chunk under Llama 4's chunked local attention (attention chunks
//     of 8192 positions) over a prefix of 32K - 256, so the chunk crosses a boundary halfway and
//     attend cuts it in two: GFLOP/s counts the positions each query sees, so it compares with
//     prefill's when the cut costs nothing.
//   batch/<cache>/<tier>/threads:<n>: one decode step of 64 sequences of random lengths 1K-8K (Llama
//     shapes: 8 KV heads x 128, 32 query heads) in one call; batch_separate/...: the same step as
//     64 decode_attention calls, each parallel over its own KV heads and chunks.
//   scores/<cache>/<tier>/<rule>: one decode step at 32K (Llama shapes) plain, with a 4096-position
//     sliding window, and with a logit soft-cap of 50 (Gemma 2): what the options cost.
//   serving/<cache>/block:<B>: Llama-3-8B shapes (32 layers, 8 KV heads x 128, 32 query heads), a
//     KVPool of blocks of B positions, an 8 GiB budget, 4K-token sequences. Counter `sequences`:
//     how many fit (committed bytes of one 4K sequence, all layers); s_per_token: attention time of
//     one generated token for the whole batch (all 32 layers, 2 threads, integer tier where
//     quantized), measured over 4 layers of distinct sequences (>= 1 GiB, more than any L3) and
//     scaled by 8; tokens/s: sequences / s_per_token.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"

namespace {

constexpr std::size_t kDim = 128;

std::vector<float> normal_values(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng);
  return x;
}

/// Appends `length` random positions to every layer of `cache`, 512 at a time.
void fill(kvq::BasicKVCache& cache, std::size_t length) {
  const std::size_t per_token = cache.shape().kv_heads * kDim, step = 512;
  static const std::vector<float> k = normal_values(step * 8 * kDim, 1), v = normal_values(step * 8 * kDim, 2);
  for (std::size_t l = 0; l < cache.shape().layers; ++l)
    for (std::size_t p = 0; p < length; p += step) {
      const std::size_t n = std::min(step, length - p) * per_token;
      cache.append(l, p, std::span(k).first(n), std::span(v).first(n));
    }
}

kvq::Executor* threads_of(std::size_t threads) {
  static kvq::ThreadPool one(1), two(2);
  return threads == 1 ? static_cast<kvq::Executor*>(&one) : &two;
}

void prefill(benchmark::State& state, std::string config, kvq::Tier tier, std::size_t attention_chunk) {
  constexpr std::size_t tokens = 512, kv_heads = 2, heads = 8, chunked_prefix = 32768 - tokens / 2;
  const std::size_t prefix = attention_chunk == 0 ? 32768 : chunked_prefix;
  static std::map<std::string, std::unique_ptr<kvq::BasicKVCache>> caches;
  auto& cache = caches[config + "/" + std::to_string(prefix)];
  if (!cache) {
    cache = std::make_unique<kvq::BasicKVCache>(kvq::CacheShape{1, kv_heads, kDim, prefix + tokens},
                                                kvq::parse_cache_config(config));
    fill(*cache, prefix);
  }
  const auto q = normal_values(tokens * heads * kDim, 3), nk = normal_values(tokens * kv_heads * kDim, 4),
             nv = normal_values(tokens * kv_heads * kDim, 5);
  std::vector<float> out(q.size());
  kvq::DecodeOptions options{.tier = tier};
  if (attention_chunk != 0) options.scores.attention_chunk = attention_chunk;
  for (auto _ : state) {
    kvq::attend({.cache = cache.get(),
                 .first_position = prefix,
                 .tokens = tokens,
                 .queries = q,
                 .new_keys = nk,
                 .new_values = nv,
                 .out = out},
                options);
    benchmark::DoNotOptimize(out.data());
  }
  double pairs = 0;  // (query row, visible position)
  for (std::size_t p = prefix; p < prefix + tokens; ++p)
    pairs += double(heads) * double(p + 1 - (attention_chunk == 0 ? 0 : p / attention_chunk * attention_chunk));
  state.counters["GFLOP/s"] =
      benchmark::Counter(4.0 * kDim * pairs * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void scores(benchmark::State& state, std::string config, kvq::Tier tier, std::string rule) {
  constexpr std::size_t context = 32768, kv_heads = 8, heads = 32;
  static std::map<std::string, std::unique_ptr<kvq::BasicKVCache>> caches;
  auto& cache = caches[config];
  if (!cache) {
    caches.clear();
    cache = std::make_unique<kvq::BasicKVCache>(kvq::CacheShape{1, kv_heads, kDim, context},
                                                kvq::parse_cache_config(config));
    fill(*cache, context);
  }
  const auto q = normal_values(heads * kDim, 11);
  std::vector<float> out(q.size());
  kvq::DecodeOptions options{.tier = tier};
  if (rule == "window:4096") options.scores.window = 4096;
  if (rule == "softcap:50") options.scores.softcap = 50.0f;
  for (auto _ : state) {
    kvq::decode_attention(*cache, 0, context - 1, q, out, options);
    benchmark::DoNotOptimize(out.data());
  }
}

struct Batch {
  std::vector<std::unique_ptr<kvq::BasicKVCache>> caches;
  std::vector<float> queries, out;
  std::vector<kvq::AttentionRequest> requests;
};

Batch& batch_for(const std::string& config) {
  constexpr std::size_t sequences = 64, kv_heads = 8, heads = 32;
  static std::map<std::string, Batch> built;
  if (auto it = built.find(config); it != built.end()) return it->second;
  built.clear();  // one configuration at a time keeps memory bounded
  Batch& b = built[config];
  std::mt19937 rng(6);
  std::uniform_int_distribution<std::size_t> length(1024, 8192);
  b.queries = normal_values(sequences * heads * kDim, 7);
  b.out.resize(b.queries.size());
  for (std::size_t s = 0; s < sequences; ++s) {
    const std::size_t n = length(rng);
    b.caches.push_back(
        std::make_unique<kvq::BasicKVCache>(kvq::CacheShape{1, kv_heads, kDim, n}, kvq::parse_cache_config(config)));
    fill(*b.caches.back(), n);
    b.requests.push_back({.cache = b.caches.back().get(),
                          .first_position = n - 1,
                          .queries = std::span(b.queries).subspan(s * heads * kDim, heads * kDim),
                          .out = std::span(b.out).subspan(s * heads * kDim, heads * kDim)});
  }
  return b;
}

void batch(benchmark::State& state, std::string config, kvq::Tier tier, std::size_t threads, bool separate) {
  Batch& b = batch_for(config);
  const kvq::DecodeOptions options{.tier = tier, .executor = threads_of(threads)};
  for (auto _ : state) {
    if (separate)
      for (const kvq::AttentionRequest& r : b.requests)
        kvq::decode_attention(*r.cache, 0, r.first_position, r.queries, r.out, options);
    else
      kvq::attend(b.requests, options);
    benchmark::DoNotOptimize(b.out.data());
  }
}

void serving(benchmark::State& state, std::string config, std::size_t block_tokens) {
  constexpr std::size_t model_layers = 32, layers = 4, kv_heads = 8, heads = 32, length = 4096;
  constexpr double budget = 8.0 * (1u << 30);
  kvq::PoolShape shape{.layers = layers,
                       .kv_heads = kv_heads,
                       .head_dim = kDim,
                       .max_tokens = length,
                       .block_tokens = block_tokens,
                       .memory_blocks = std::size_t(1) << 20};
  const kvq::CacheConfig c = kvq::parse_cache_config(config);
  auto append_sequence = [&](kvq::KVPool& pool) {
    const kvq::SequenceId id = pool.add_sequence();
    const auto k = normal_values(512 * kv_heads * kDim, unsigned(id) + 8),
               v = normal_values(k.size(), unsigned(id) + 9);
    for (std::size_t l = 0; l < layers; ++l)
      for (std::size_t p = 0; p < length; p += 512) pool.append(id, l, p, k, v);
    return id;
  };
  double per_sequence = 0;
  {
    kvq::KVPool probe(shape, c);
    append_sequence(probe);
    per_sequence = double(probe.memory().committed) * model_layers / layers;
  }
  const std::size_t fit = std::size_t(budget / per_sequence);
  kvq::KVPool pool(shape, c);
  std::vector<kvq::SequenceId> ids;
  for (std::size_t s = 0; s < fit; ++s) ids.push_back(append_sequence(pool));
  const auto q = normal_values(fit * heads * kDim, 10);
  std::vector<float> out(q.size());
  std::vector<std::vector<kvq::AttentionRequest>> by_layer(layers);
  for (std::size_t l = 0; l < layers; ++l)
    for (std::size_t s = 0; s < fit; ++s)
      by_layer[l].push_back({.cache = &pool.sequence(ids[s]),
                             .layer = l,
                             .first_position = length - 1,
                             .queries = std::span(q).subspan(s * heads * kDim, heads * kDim),
                             .out = std::span(out).subspan(s * heads * kDim, heads * kDim)});
  const kvq::DecodeOptions options{.tier = c.quantize_keys ? kvq::Tier::integer : kvq::Tier::exact,
                                   .executor = threads_of(2)};
  for (auto _ : state) {
    for (std::size_t l = 0; l < layers; ++l) kvq::attend(by_layer[l], options);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["sequences"] = double(fit);
  state.counters["MiB_per_sequence"] = per_sequence / (1u << 20);
  // Per iteration: 4 of the 32 layers; the counters are per generated token of the whole batch.
  state.counters["s_per_token"] = benchmark::Counter(
      1.0 / double(model_layers / layers), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["tokens/s"] =
      benchmark::Counter(double(fit) / double(model_layers / layers), benchmark::Counter::kIsIterationInvariantRate);
}

struct Named {
  const char* name;
  const char* config;
};

}  // namespace

int main(int argc, char** argv) {
  const Named caches[] = {{"fp16", "k16-v16-r0-s0-post"},
                          {"K8V4-post", "k8c32-v4t32-r128-s0-post"},
                          {"K4V2-post", "k4c32-v2t32-r128-s0-post"},
                          {"K4V2-pre", "k4c32-v2t32-r128-s0"},
                          {"K2V2-post", "k2c32-v2t32-r128-s0-post"}};
  for (const Named& c : caches)
    for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer}) {
      const std::string name(c.name);
      if (name == "fp16" && tier == kvq::Tier::integer) continue;
      const std::string row = name + "/" + kvq::to_string(tier);
      if (name == "fp16" || name.starts_with("K4V2"))
        for (const std::size_t chunk : {0, 8192})
          benchmark::RegisterBenchmark(((chunk == 0 ? "prefill/" : "prefill_chunked/") + row).c_str(), prefill,
                                       std::string(c.config), tier, chunk)
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime()
              ->Iterations(2);
      for (const std::size_t threads : {1, 2})
        for (const bool separate : {false, true})
          benchmark::RegisterBenchmark(
              ((separate ? "batch_separate/" : "batch/") + row + "/threads:" + std::to_string(threads)).c_str(), batch,
              std::string(c.config), tier, threads, separate)
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime();
    }
  for (const Named& c : caches)
    for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer}) {
      const std::string name(c.name);
      if (name != "fp16" && name != "K4V2-post") continue;
      if (name == "fp16" && tier == kvq::Tier::integer) continue;
      for (const char* rule : {"plain", "window:4096", "softcap:50"})
        benchmark::RegisterBenchmark(("scores/" + name + "/" + kvq::to_string(tier) + "/" + rule).c_str(), scores,
                                     std::string(c.config), tier, std::string(rule))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    }
  for (const Named& c : caches)
    for (const std::size_t block : {256, 4096})
      benchmark::RegisterBenchmark(("serving/" + std::string(c.name) + "/block:" + std::to_string(block)).c_str(),
                                   serving, std::string(c.config), block)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->Iterations(5);  // one run: the setup fills 1 GiB
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
