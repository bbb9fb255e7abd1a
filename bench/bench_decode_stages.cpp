// Where the decode time goes: each stage of the AVX-512 packed-span kernels run alone
// over 1024 packed positions of one KV head (head_dim 128, 4 query heads per KV head), the data
// in L2, so that the figures are the stages' compute cost without memory stalls. Reported as ns
// per (position, KV head); a decode step over context C with 8 KV heads costs about 8 C times the
// `tiles` figure plus the memory stalls bench_decode_attention shows.
//   fold     per key block: scales into the 4 queries, int8 queries, alpha and bias
//   dots     key scores from vpdpbusd over transposed code rows (pre-RoPE caches: dequantized,
//            rotated and dotted in fp32, avx512_rope.hpp, per tile)
//   softmax  online softmax of the tile's scores, 4 heads side by side
//   values   weight quantization and P.V on vpdpbusd, into the float accumulators
//   tiles    the whole packed-span kernel (the stages in their real order)
// Caches named "-exact" run the exact tier's stages (avx512_exact.hpp: fp32 fold, key dots and
// P.V; its softmax is the integer tier's). Names: stages/<cache>/<stage>.
#include <benchmark/benchmark.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvq/attention/decode.hpp"
#include "kvq/kvq.hpp"

namespace {

namespace k = kvq::kernels::attention::avx512::detail;

constexpr std::size_t kDim = 128, kKvHeads = 8, kGroup = 4, kSpan = 1024, kTile = 64;
constexpr int kNV = int(kDim / 16), kNH = int(kGroup);

enum class Stage { fold, dots, softmax, values, tiles };

struct Setup {
  kvq::BasicKVCache cache;
  std::vector<float> queries, max, sum, acc;
  kvq::kernels::attention::DecodeTask task;

  Setup(const std::string& config, kvq::Tier tier)
      : cache(kvq::CacheShape{.layers = 1,
                              .kv_heads = kKvHeads,
                              .head_dim = kDim,
                              .capacity = kSpan + 128,
                              .block_tokens = 2 * kSpan},
              kvq::parse_cache_config(config)),
        queries(kGroup * kDim),
        max(kGroup),
        sum(kGroup),
        acc(kGroup * kDim) {
    const std::size_t tokens = kSpan + 128;
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    std::vector<float> keys(tokens * kKvHeads * kDim), values(keys.size());
    for (auto& x : keys) x = normal(rng);
    for (auto& x : values) x = normal(rng);
    cache.append(0, 0, keys, values);
    for (auto& x : queries) x = normal(rng) / std::sqrt(float(kDim));
    if (cache.config().key_rope == kvq::KeyRope::pre) task.rope = &cache.rope();
    task.keys = cache.keys(0, 0, 0);  // one block: one segment
    task.values = cache.values(0, 0, 0);
    task.queries = queries.data();
    task.group = kGroup;
    task.begin = 0;
    task.end = tokens;
    task.tier = tier;
    task.max = max.data();
    task.sum = sum.data();
    task.acc = acc.data();
  }
};

template <int KB, int VB>
KVQ_TARGET_AVX512_ATTENTION void run_exact_stage(k::IntState& S, Stage stage) {
  const std::size_t a0 = S.task->keys.first_quantized, g = S.task->keys.spec.group;
  k::ExactState& E = k::exact_state();
  switch (stage) {
    case Stage::fold:
      for (std::size_t b = 0; b < kSpan / g; ++b) k::exact_fold<kNV, kNH>(S, E, b, b % (kTile / g));
      break;
    case Stage::dots:
      for (std::size_t a = a0; a < a0 + kSpan; a += 16)
        k::exact_keys16<kNV, KB, kNH>(S, E, a, (a - a0) % kTile, (a - a0) % kTile / g);
      break;
    case Stage::softmax:
      for (std::size_t a = a0; a < a0 + kSpan; a += kTile) k::tile_softmax<kNH>(S, kTile, 0.0f);
      break;
    case Stage::values:
      for (std::size_t a = a0; a < a0 + kSpan; a += kTile) k::exact_values<kNV, VB, kNH>(S, E, a, kTile);
      break;
    case Stage::tiles:
      k::exact_tiles<kNV, KB, VB, kNH>(S, E, a0, a0 + kSpan, kTile);
      break;
  }
}

template <int KB, int VB>
KVQ_TARGET_AVX512_ATTENTION void run_stage(k::IntState& S, Stage stage) {
  const std::size_t a0 = S.task->keys.first_quantized, g = S.task->keys.spec.group;
  if (S.task->tier == kvq::Tier::exact) return run_exact_stage<KB, VB>(S, stage);
  switch (stage) {
    case Stage::fold:
      for (std::size_t b = 0; b < kSpan / g; ++b) k::int_fold<kNV, kNH>(S, b, b % (kTile / g));
      break;
    case Stage::dots:
      if (S.task->rope != nullptr) {
        k::RopeKeyState& P = k::rope_key_state(true);
        for (std::size_t a = a0; a < a0 + kSpan; a += kTile) k::rope_keys<kNV, KB, kNH>(S, P, a, kTile);
        break;
      }
      for (std::size_t a = a0; a < a0 + kSpan; a += 16)
        k::int_keys16<kNV, KB, kNH>(S, a, (a - a0) % kTile, (a - a0) % kTile / g);
      break;
    case Stage::softmax:
      for (std::size_t a = a0; a < a0 + kSpan; a += kTile) k::tile_softmax<kNH>(S, kTile, 0.0f);
      break;
    case Stage::values:
      for (std::size_t a = a0; a < a0 + kSpan; a += kTile) k::int_values<kNV, VB, kNH>(S, a, kTile);
      break;
    case Stage::tiles:
      k::int_tiles<kNV, KB, VB, kNH>(S, a0, a0 + kSpan, kTile);
      break;
  }
}

void stage_bench(benchmark::State& state, std::string config, kvq::Tier tier, int kbits, int vbits, Stage stage) {
  if (!kvq::kernels::attention::avx512::supported()) {
    state.SkipWithError("needs the AVX-512 kernels (VNNI, VBMI)");
    return;
  }
  Setup setup(config, tier);
  k::IntState& S = k::int_state();
  k::int_init(S, setup.task);
  S.h0 = 0;
  S.nh = kGroup;
  for (std::size_t h = 0; h < kvq::kernels::attention::register_heads; ++h) {
    S.mx[h] = -std::numeric_limits<float>::infinity();
    S.sm[h] = 0.0f;
  }
  auto run = [&] {
    if (kbits == 4 && vbits == 2)
      run_stage<4, 2>(S, stage);
    else if (kbits == 2 && vbits == 2)
      run_stage<2, 2>(S, stage);
    else if (kbits == 4 && vbits == 4)
      run_stage<4, 4>(S, stage);
    else
      run_stage<8, 8>(S, stage);
  };
  run();  // warm the caches and the tables of every stage
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(S.accf);
    benchmark::DoNotOptimize(setup.acc.data());
    benchmark::ClobberMemory();
  }
  state.counters["ns_per_position"] =
      benchmark::Counter(double(kSpan), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert,
                         benchmark::Counter::kIs1000);
}

}  // namespace

int main(int argc, char** argv) {
  struct Cache {
    const char *name, *config;
    kvq::Tier tier;
    int kbits, vbits;
  };
  constexpr kvq::Tier integer = kvq::Tier::integer, exact = kvq::Tier::exact;
  const Cache caches[] = {{"K4V2-post", "k4c32-v2t32-r128-s0-post", integer, 4, 2},
                          {"K2V2-post", "k2c32-v2t32-r128-s0-post", integer, 2, 2},
                          {"K4V4-post", "k4c32-v4t32-r128-s0-post", integer, 4, 4},
                          {"K8V8-post", "k8c32-v8t32-r128-s0-post", integer, 8, 8},
                          {"K4V2-pre", "k4c32-v2t32-r128-s0", integer, 4, 2},
                          {"K4V2-post-exact", "k4c32-v2t32-r128-s0-post", exact, 4, 2},
                          {"K8V8-post-exact", "k8c32-v8t32-r128-s0-post", exact, 8, 8}};
  const std::pair<const char*, Stage> stages[] = {{"fold", Stage::fold},
                                                  {"dots", Stage::dots},
                                                  {"softmax", Stage::softmax},
                                                  {"values", Stage::values},
                                                  {"tiles", Stage::tiles}};
  for (const Cache& c : caches)
    for (const auto& [name, stage] : stages) {
      if (stage == Stage::fold && std::string(c.name).ends_with("-pre")) continue;  // pre-RoPE keys fold nothing
      if (stage == Stage::softmax && c.tier == exact) continue;                     // the integer tier's
      benchmark::RegisterBenchmark((std::string("stages/") + c.name + "/" + name).c_str(), stage_bench,
                                   std::string(c.config), c.tier, c.kbits, c.vbits, stage)
          ->Unit(benchmark::kMicrosecond);
    }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
