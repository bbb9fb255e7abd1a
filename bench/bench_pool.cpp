// KVPool against a KVCache of its own: appending one token at a time (8 KV heads x 128, K4V2),
// forking a 10K-token prefix, saving and loading one sequence and a whole pool (GB/s of file
// bytes), the memory a 32-layer sequence commits at 1000 tokens, share_prefixes for a new
// request in a pool of 16 conversations, and a decode step of 16 forks of a 32K prompt, as one pool
// decode step (cascade attention: the prompt read once) and as a request per sequence.
#include <benchmark/benchmark.h>

#include <chrono>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"

namespace {

constexpr std::size_t kHeads = 8, kDim = 128, kCapacity = 16384;

std::vector<float> normal_rows(std::size_t tokens, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(tokens * kHeads * kDim);
  for (float& v : x) v = normal(rng);
  return x;
}

kvq::CacheConfig k4v2() { return kvq::parse_cache_config("k4c32-v2t32-r128-s0"); }

kvq::PoolShape pool_shape(std::size_t layers) {
  kvq::PoolShape s;
  s.layers = layers;
  s.kv_heads = kHeads;
  s.head_dim = kDim;
  s.max_tokens = kCapacity;
  s.memory_blocks = 4096;
  return s;
}

template <class Append, class Reset>
void append_loop(benchmark::State& state, Append&& append, Reset&& reset) {
  const auto k = normal_rows(1, 1), v = normal_rows(1, 2);
  std::size_t position = 0;
  for (auto _ : state) {
    if (position == kCapacity) {
      reset();
      position = 0;
    }
    append(position++, k, v);
  }
  state.counters["values/s"] =
      benchmark::Counter(double(2 * kHeads * kDim), benchmark::Counter::kIsIterationInvariantRate);
}

void append_cache(benchmark::State& state) {
  kvq::BasicKVCache cache(kvq::CacheShape{1, kHeads, kDim, kCapacity}, k4v2());
  append_loop(
      state, [&](std::size_t p, const auto& k, const auto& v) { cache.append(0, p, k, v); }, [&] { cache.clear(); });
}

void append_pool(benchmark::State& state) {
  kvq::KVPool pool(pool_shape(1), k4v2());
  kvq::SequenceId id = pool.add_sequence();
  append_loop(
      state, [&](std::size_t p, const auto& k, const auto& v) { pool.append(id, 0, p, k, v); },
      [&] {
        pool.remove_sequence(id);
        id = pool.add_sequence();
      });
}

/// A pool holding one sequence of `tokens` tokens in 4 layers.
struct Filled {
  kvq::KVPool pool{pool_shape(4), k4v2()};
  kvq::SequenceId id = pool.add_sequence();
  explicit Filled(std::size_t tokens) {
    const auto k = normal_rows(tokens, 3), v = normal_rows(tokens, 4);
    for (std::size_t l = 0; l < 4; ++l) pool.append(id, l, 0, k, v);
  }
};

void fork_prefix(benchmark::State& state) {
  Filled f(10000);
  for (auto _ : state) {
    const kvq::SequenceId child = f.pool.fork(f.id, 10000);
    f.pool.remove_sequence(child);
  }
  const kvq::SequenceId child = f.pool.fork(f.id, 10000);
  const kvq::PoolMemory m = f.pool.memory();
  state.counters["shared_MB"] = double(m.shared) * 1e-6;
  state.counters["own_MB_per_sequence"] = double(m.own) * 0.5e-6;
  f.pool.remove_sequence(child);
}

void save_sequence(benchmark::State& state) {
  Filled f(10000);
  std::size_t bytes = 0;
  for (auto _ : state) {
    std::ostringstream out;
    kvq::save(f.pool.sequence(f.id), out);
    bytes = out.str().size();
    benchmark::DoNotOptimize(bytes);
  }
  state.counters["GB/s"] = benchmark::Counter(double(bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void load_sequence(benchmark::State& state) {
  Filled f(10000);
  std::ostringstream out;
  kvq::save(f.pool.sequence(f.id), out);
  const std::string file = out.str();
  for (auto _ : state) {
    std::istringstream in(file);
    const kvq::SequenceId id = f.pool.load_sequence(in);
    state.PauseTiming();
    f.pool.remove_sequence(id);
    state.ResumeTiming();
  }
  state.counters["GB/s"] =
      benchmark::Counter(double(file.size()) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

/// The 10K-token sequence and three forks of it, each 1000 tokens longer: the file holds the
/// shared prefix once.
struct Branched : Filled {
  Branched() : Filled(10000) {
    const auto k = normal_rows(1000, 5), v = normal_rows(1000, 6);
    for (int i = 0; i < 3; ++i) {
      const kvq::SequenceId child = pool.fork(id, 10000);
      for (std::size_t l = 0; l < 4; ++l) pool.append(child, l, 10000, k, v);
    }
  }
};

void save_pool(benchmark::State& state) {
  Branched f;
  std::size_t bytes = 0;
  for (auto _ : state) {
    std::ostringstream out;
    f.pool.save(out);
    bytes = out.str().size();
    benchmark::DoNotOptimize(bytes);
  }
  state.counters["GB/s"] = benchmark::Counter(double(bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["file_MB"] = double(bytes) * 1e-6;
}

void load_pool(benchmark::State& state) {
  Branched f;
  std::ostringstream out;
  f.pool.save(out);
  const std::string file = out.str();
  for (auto _ : state) {
    state.PauseTiming();
    auto target = std::make_unique<kvq::KVPool>(pool_shape(4), k4v2());
    std::istringstream in(file);
    state.ResumeTiming();
    target->load(in);
    benchmark::DoNotOptimize(target->sequence_count());
    state.PauseTiming();
    target.reset();
    state.ResumeTiming();
  }
  state.counters["GB/s"] =
      benchmark::Counter(double(file.size()) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

/// What a 32-layer, 8 x 128 K4V2 sequence commits at 1000 tokens, against what its tokens hold.
void memory_at_1000(benchmark::State& state) {
  kvq::PoolShape shape = pool_shape(32);
  shape.max_tokens = 32768;
  shape.block_tokens = std::size_t(state.range(0));
  shape.memory_blocks = 1 << 16;
  kvq::KVPool pool(shape, k4v2());
  const kvq::SequenceId id = pool.add_sequence();
  const auto k = normal_rows(1000, 5), v = normal_rows(1000, 6);
  for (auto _ : state)
    for (std::size_t l = 0; l < 32; ++l) {
      state.PauseTiming();
      if (l == 0) pool.truncate(id, 0);
      state.ResumeTiming();
      pool.append(id, l, 0, k, v);
    }
  const double held = double(pool.sequence(id).memory().total_bytes()), mib = 1.0 / (1 << 20);
  const kvq::PoolMemory m = pool.memory();
  state.counters["held_MiB"] = held * mib;
  state.counters["committed_MiB"] = double(m.committed) * mib;
  state.counters["committed_over_held"] = double(m.committed) / held;
  state.counters["committed_over_used"] = double(m.committed) / double(m.used);
  state.counters["own_rows_MiB"] = double(m.own) * mib;
}

/// A new request in a pool of 16 conversations (4 layers, 2048 tokens each, the first 1024 a
/// system prompt they share): it is fed the prompt and 256 tokens of its own (not timed), then
/// share_prefixes finds and shares the prompt's blocks (timed). cold_ms: the first call, which
/// hashes every sealed block of the pool, as every call did before block hashes were kept.
void share_prefixes(benchmark::State& state) {
  kvq::KVPool pool(pool_shape(4), k4v2());
  const auto prompt_k = normal_rows(1024, 7), prompt_v = normal_rows(1024, 8);
  auto add = [&](std::size_t own, unsigned seed) {
    const kvq::SequenceId id = pool.add_sequence();
    const auto k = normal_rows(own, seed), v = normal_rows(own, seed + 1);
    for (std::size_t l = 0; l < 4; ++l) {
      pool.append(id, l, 0, prompt_k, prompt_v);
      pool.append(id, l, 1024, k, v);
    }
    return id;
  };
  std::vector<kvq::SequenceId> ids;
  for (unsigned s = 0; s < 16; ++s) ids.push_back(add(1024, 100 + 2 * s));
  const auto start = std::chrono::steady_clock::now();
  benchmark::DoNotOptimize(pool.share_prefixes(ids.back()));
  state.counters["cold_ms"] =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  for (const kvq::SequenceId id : ids) pool.share_prefixes(id);
  std::size_t freed = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const kvq::SequenceId id = add(256, 99);
    state.ResumeTiming();
    freed = pool.share_prefixes(id);
    state.PauseTiming();
    pool.remove_sequence(id);
    state.ResumeTiming();
  }
  state.counters["freed_MiB"] = double(freed) / (1 << 20);
}

/// A decode step of 16 sequences forked from one 32K-token prompt, each 256 tokens of its own on:
/// in one attend call of a request per sequence, or as one pool decode step
/// (kvq::decode_attention over the pool), a cascade: the positions all of them store alike
/// (KVPool::common_prefix: the prompt's sealed blocks; the last one, holding window rows, each
/// fork copied when it packed its own) read once for all of them, a request per sequence for the
/// rest (own_positions each), merged by log-sum-exp. GQA 4; 6 layers, a step per layer in turn, so
/// the cache is read from memory as in shared_prefix_step (bench_decode_attention.cpp).
void cascade_step(benchmark::State& state, std::string config, kvq::Tier tier, bool cascade) {
  constexpr std::size_t prompt = 32768, own = 256, sequences = 16, heads = 4 * kHeads, layers = 6;
  kvq::PoolShape shape = pool_shape(layers);
  shape.max_tokens = prompt + own;
  kvq::KVPool pool(shape, kvq::parse_cache_config(config));
  const kvq::SequenceId parent = pool.add_sequence();
  const auto prompt_k = normal_rows(prompt, 11), prompt_v = normal_rows(prompt, 12);
  for (std::size_t l = 0; l < layers; ++l) pool.append(parent, l, 0, prompt_k, prompt_v);
  std::vector<kvq::SequenceId> ids;
  for (unsigned s = 0; s < sequences; ++s) {
    ids.push_back(pool.fork(parent, prompt));
    const auto k = normal_rows(own, 20 + 2 * s), v = normal_rows(own, 21 + 2 * s);
    for (std::size_t l = 0; l < layers; ++l) pool.append(ids.back(), l, prompt, k, v);
  }
  const std::vector<float> q = normal_rows(sequences * heads / kHeads, 13);
  std::vector<float> out(q.size());
  const std::vector<std::size_t> positions(sequences, prompt + own - 1);
  std::vector<kvq::AttentionRequest> requests;
  for (std::size_t s = 0; s < sequences; ++s)
    requests.push_back({.cache = &pool.sequence(ids[s]),
                        .first_position = prompt + own - 1,
                        .queries = std::span(q).subspan(s * heads * kDim, heads * kDim),
                        .out = std::span(out).subspan(s * heads * kDim, heads * kDim)});
  std::size_t layer = 0;
  kvq::PoolDecodeSummary summary;
  for (auto _ : state) {
    if (cascade) {
      summary = kvq::decode_attention(pool, ids, layer, positions, q, out, {.tier = tier});
    } else {
      for (kvq::AttentionRequest& r : requests) r.layer = layer;
      kvq::attend(requests, {.tier = tier});
    }
    benchmark::DoNotOptimize(out.data());
    layer = (layer + 1) % layers;
  }
  if (cascade && summary.groups != 1) state.SkipWithError("the forks formed no group");
  if (cascade) state.counters["own_positions"] = double(prompt + own - summary.shared_positions);
}

}  // namespace

BENCHMARK(memory_at_1000)
    ->Name("memory/K4V2/32x8x128/1000/block")
    ->Arg(64)
    ->Arg(256)
    ->Arg(1024)
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(append_cache)->Name("append/cache/K4V2/8x128");
BENCHMARK(append_pool)->Name("append/pool/K4V2/8x128");
BENCHMARK(fork_prefix)->Name("fork/K4V2/4x8x128/10000")->Unit(benchmark::kMicrosecond);
BENCHMARK(save_sequence)->Name("save/K4V2/4x8x128/10000")->Unit(benchmark::kMillisecond);
BENCHMARK(load_sequence)->Name("load/K4V2/4x8x128/10000")->Unit(benchmark::kMillisecond);
BENCHMARK(save_pool)->Name("save_pool/K4V2/4x8x128/10000+3x1000")->Unit(benchmark::kMillisecond);
BENCHMARK(load_pool)->Name("load_pool/K4V2/4x8x128/10000+3x1000")->Unit(benchmark::kMillisecond);
BENCHMARK(share_prefixes)->Name("share_prefixes/K4V2/4x8x128/16x2048")->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  for (const char* config : {"k4c32-v2t32-r128-s0", "k4c32-v2t32-r128-s0-post"})
    for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer})
      for (const bool cascade : {true, false})
        benchmark::RegisterBenchmark((std::string(cascade ? "cascade/" : "cascade_apart/") + config + "/" +
                                      kvq::to_string(tier) + "/sequences:16/prompt:32768/own:256")
                                         .c_str(),
                                     cascade_step, std::string(config), tier, cascade)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
