// One decode step (head_dim 128, 32 query heads, 8 KV heads) over the packed cache, against an
// fp32 and an fp16 cache read by the same AVX-512 kernel (GQA-shared loads, F16C), plus the
// machine's streaming read bandwidth measured in the same run. Layers rotate so that the caches
// touched (>= 160 MB) cannot sit in the 32 MiB L3. Names: decode/<cache>/<tier>/<context>/threads:<n>;
// decode_avx2/... runs the AVX2 kernel (DecodeOptions::kernel), the path of CPUs without AVX-512, and
// decode_vector-avx2/..., decode_vector-avx512/... the kernel written once over vector ops
// (kernels/attention/vector.hpp) on those instruction sets;
// decode_blocks/.../block:<B> reads the cache in blocks of B positions (CacheShape::block_tokens;
// 32768 is one block for the whole context) where the other rows use the default; verify/.../T:<T>
// checks T stored positions in one kvq::attend call (speculative verification: one pass over the
// cache for all T x 4 query rows of a KV head), against T decode steps; verify_tree/.../branches:<B>/
// depth:<D> checks a draft tree of B branches of D new tokens each in one call (AttentionRequest::
// parents), verify_branches/... the same B branches in B calls; decode_token_keys/<layout>/
// <kernel>/... reads llama.cpp's q8_0 and q4_0 layouts (keys and values per token) on each kernel;
// shared_prefix/.../sequences:<S> attends S sequences' queries over a prefix they share in one
// request (AttentionRequest::positions), shared_prefix_apart/... in one request per sequence.
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "kvq/attention/decode.hpp"
#include "kvq/kvq.hpp"

namespace {

constexpr std::size_t kDim = 128, kHeads = 32, kKvHeads = 8;

struct Built {
  std::unique_ptr<kvq::BasicKVCache> cache;
  std::size_t layers = 0;
  double layer_bytes = 0;
};

/// A cache of `context` tokens in as many layers as 160 MB take, with room for `spare` more.
Built& cache_for(const std::string& config, std::size_t context, std::size_t block_tokens, std::size_t spare = 0) {
  static std::map<std::tuple<std::string, std::size_t, std::size_t, std::size_t>, Built> built;
  auto key = std::tuple{config, context, block_tokens, spare};
  if (auto it = built.find(key); it != built.end()) return it->second;
  built.clear();  // one cache at a time keeps memory bounded
  const kvq::CacheConfig c = kvq::parse_cache_config(config);
  kvq::BasicKVCache probe(kvq::CacheShape{1, kKvHeads, kDim, context}, c);
  const double bytes = double(probe.planned_memory(context).total_bytes());
  const std::size_t layers = std::max<std::size_t>(2, std::size_t(160e6 / bytes) + 1);
  Built b;
  kvq::CacheShape shape{layers, kKvHeads, kDim, context + spare};
  shape.block_tokens = block_tokens;
  b.cache = std::make_unique<kvq::BasicKVCache>(shape, c);
  b.layers = layers;
  b.layer_bytes = bytes;
  constexpr std::size_t block = 512;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> k(block * kKvHeads * kDim), v(k.size());
  for (auto& x : k) x = normal(rng);
  for (auto& x : v) x = normal(rng);
  for (std::size_t l = 0; l < layers; ++l)
    for (std::size_t p = 0; p < context; p += block) {
      const std::size_t n = std::min(block, context - p) * kKvHeads * kDim;
      b.cache->append(l, p, std::span(k).first(n), std::span(v).first(n));
    }
  return built.emplace(key, std::move(b)).first->second;
}

kvq::Executor* pool(std::size_t threads) {
  static kvq::ThreadPool one(1), two(2);
  return threads == 1 ? static_cast<kvq::Executor*>(&one) : &two;
}

void decode_step(benchmark::State& state, std::string config, kvq::Tier tier, std::size_t context, std::size_t threads,
                 std::string kernel, bool guard_outliers, std::size_t block_tokens) {
  Built& b = cache_for(config, context, block_tokens);
  std::vector<float> q(kHeads * kDim), out(q.size());
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  for (auto& x : q) x = normal(rng);
  kvq::DecodeOptions o;
  o.tier = tier;
  o.executor = pool(threads);
  o.kernel = kernel;
  o.guard_outliers = guard_outliers;
  std::size_t layer = 0;
  for (auto _ : state) {
    kvq::decode_attention(*b.cache, layer, context - 1, q, out, o);
    benchmark::DoNotOptimize(out.data());
    layer = (layer + 1) % b.layers;
  }
  state.counters["bytes_per_step"] = b.layer_bytes;
  state.counters["GB/s"] = benchmark::Counter(b.layer_bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["layers"] = double(b.layers);
  state.SetLabel(kvq::decode_kernel(*b.cache, kHeads, o));
}

void verify_step(benchmark::State& state, std::string config, kvq::Tier tier, std::size_t context, std::size_t tokens) {
  Built& b = cache_for(config, context, 0);
  std::vector<float> q(tokens * kHeads * kDim), out(q.size());
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (auto& x : q) x = normal(rng);
  std::size_t layer = 0;
  for (auto _ : state) {
    kvq::attend({.cache = b.cache.get(),
                 .layer = layer,
                 .first_position = context - tokens,
                 .tokens = tokens,
                 .queries = q,
                 .out = out},
                {.tier = tier});
    benchmark::DoNotOptimize(out.data());
    layer = (layer + 1) % b.layers;
  }
  state.counters["GB/s"] = benchmark::Counter(b.layer_bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// A draft tree of `branches` chains of `depth` new tokens, each from its own root at p0, in one call
// (as_tree) or one call per branch, over the cache's first context - branches x depth positions.
void verify_tree_step(benchmark::State& state, std::string config, kvq::Tier tier, std::size_t context,
                      std::size_t branches, std::size_t depth, bool as_tree) {
  Built& b = cache_for(config, context, 0);
  const std::size_t tokens = branches * depth, p0 = context - tokens;
  std::vector<float> q(tokens * kHeads * kDim), k(tokens * kKvHeads * kDim), v(k.size()), out(q.size());
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  for (auto* x : {&q, &k, &v})
    for (float& e : *x) e = normal(rng);
  std::vector<std::int32_t> parents(tokens);
  for (std::size_t t = 0; t < tokens; ++t) parents[t] = t % depth == 0 ? -1 : std::int32_t(t) - 1;
  std::size_t layer = 0;
  for (auto _ : state) {
    for (std::size_t first = 0; first < tokens; first += as_tree ? tokens : depth) {
      const std::size_t n = as_tree ? tokens : depth;
      kvq::attend({.cache = b.cache.get(),
                   .layer = layer,
                   .first_position = p0,
                   .tokens = n,
                   .queries = std::span(q).subspan(first * kHeads * kDim, n * kHeads * kDim),
                   .new_keys = std::span(k).subspan(first * kKvHeads * kDim, n * kKvHeads * kDim),
                   .new_values = std::span(v).subspan(first * kKvHeads * kDim, n * kKvHeads * kDim),
                   .out = std::span(out).subspan(first * kHeads * kDim, n * kHeads * kDim),
                   .parents = as_tree ? std::span<const std::int32_t>(parents) : std::span<const std::int32_t>()},
                  {.tier = tier});
    }
    benchmark::DoNotOptimize(out.data());
    layer = (layer + 1) % b.layers;
  }
}

// Decode steps of `sequences` sequences sharing a prefix of `context` tokens, each query at its own
// position after it (stored_only requests, whose outputs an engine merges with those over each
// sequence's own tokens): in one request with positions (shared, the prefix read once for all of
// them) or one request per sequence in one call.
void shared_prefix_step(benchmark::State& state, std::string config, kvq::Tier tier, std::size_t context,
                        std::size_t sequences, bool shared) {
  Built& b = cache_for(config, context, 0, 4096);
  std::vector<float> q(sequences * kHeads * kDim), out(q.size()), lse(sequences * kHeads);
  std::vector<std::size_t> positions(sequences);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (float& x : q) x = normal(rng);
  for (std::size_t s = 0; s < sequences; ++s) positions[s] = context + std::size_t(rng() % 4096);
  positions[0] = context;  // the request's first position
  std::vector<kvq::AttentionRequest> requests;
  for (std::size_t s = 0; s < (shared ? 1 : sequences); ++s) {
    const std::size_t n = shared ? sequences : 1;
    requests.push_back(
        {.first_position = positions[s],
         .tokens = n,
         .queries = std::span(q).subspan(s * kHeads * kDim, n * kHeads * kDim),
         .out = std::span(out).subspan(s * kHeads * kDim, n * kHeads * kDim),
         .lse = std::span(lse).subspan(s * kHeads, n * kHeads),
         .stored_only = true,
         .positions = shared ? std::span<const std::size_t>(positions) : std::span<const std::size_t>()});
  }
  std::size_t layer = 0;
  for (auto _ : state) {
    for (kvq::AttentionRequest& r : requests) {
      r.cache = b.cache.get();
      r.layer = layer;
    }
    kvq::attend(requests, {.tier = tier});
    benchmark::DoNotOptimize(out.data());
    layer = (layer + 1) % b.layers;
  }
}

// Streaming read of a 1 GiB huge-page buffer: the memory ceiling the decode figures compare to.
__attribute__((target("avx512f"))) std::uint64_t read_range(const std::uint8_t* p, std::size_t n) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (std::size_t i = 0; i + 256 <= n; i += 256) {
    a = _mm512_add_epi64(a, _mm512_load_si512(p + i));
    b = _mm512_add_epi64(b, _mm512_load_si512(p + i + 64));
    c = _mm512_add_epi64(c, _mm512_load_si512(p + i + 128));
    d = _mm512_add_epi64(d, _mm512_load_si512(p + i + 192));
  }
  alignas(64) std::uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(a, b), _mm512_add_epi64(c, d)));
  std::uint64_t s = 0;
  for (const std::uint64_t x : lanes) s += x;
  return s;
}

void read_bandwidth(benchmark::State& state, std::size_t threads) {
  static kvq::AlignedBuffer buffer = [] {
    kvq::AlignedBuffer b(std::size_t(1) << 30);
    std::memset(b.data(), 1, b.size());
    return b;
  }();
  const std::size_t n = buffer.size(), part = n / threads;
  std::uint64_t sums[2] = {};
  auto task = [&](std::size_t i) { sums[i] = read_range(buffer.data() + i * part, part); };
  for (auto _ : state) {
    pool(threads)->parallel_for(threads, task);
    benchmark::DoNotOptimize(sums);
  }
  state.counters["GB/s"] = benchmark::Counter(double(n) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

struct Named {
  const char* name;
  const char* config;
};

/// Whether this build and CPU run the kernel called `name` ("" names the automatic choice).
bool kernel_runs(std::string_view name) {
  const auto& table = kvq::kernels::attention::registry();
  return name.empty() ||
         std::any_of(table.begin(), table.end(), [&](const auto& e) { return e.name == name && e.available(); });
}

}  // namespace

int main(int argc, char** argv) {
  for (std::size_t threads : {1, 2})
    benchmark::RegisterBenchmark(("read_bandwidth/threads:" + std::to_string(threads)).c_str(), read_bandwidth, threads)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  const Named caches[] = {
      {"fp32", "k16-v16-r0-s0-post-f32"},        {"fp16", "k16-v16-r0-s0-post"},
      {"K8V8-post", "k8c32-v8t32-r128-s0-post"}, {"K4V4-post", "k4c32-v4t32-r128-s0-post"},
      {"K4V2-post", "k4c32-v2t32-r128-s0-post"}, {"K2V2-post", "k2c32-v2t32-r128-s0-post"},
      {"K8V8-pre", "k8c32-v8t32-r128-s0"},       {"K4V4-pre", "k4c32-v4t32-r128-s0"},
      {"K4V2-pre", "k4c32-v2t32-r128-s0"},       {"K2V2-pre", "k2c32-v2t32-r128-s0"},
  };
  for (std::size_t context : {1024, 4096, 16384, 32768, 65536})
    for (const Named& c : caches)
      for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer}) {
        const bool unquantized = std::string(c.name).rfind("fp", 0) == 0;
        if (unquantized && tier == kvq::Tier::integer) continue;  // nothing to quantize: one tier
        for (std::size_t threads : {1, 2})
          benchmark::RegisterBenchmark(("decode/" + std::string(c.name) + "/" + kvq::to_string(tier) + "/" +
                                        std::to_string(context) + "/threads:" + std::to_string(threads))
                                           .c_str(),
                                       decode_step, std::string(c.config), tier, context, threads, std::string(), true,
                                       std::size_t(0))
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime();
      }
  // The AVX2 kernel and the vector kernel on AVX2 and AVX-512 ops, both tiers, on the baseline and
  // the 2-bit-value caches, 32K, one thread.
  for (const std::string kernel : {"avx2", "vector-avx2", "vector-avx512"}) {
    if (!kernel_runs(kernel)) continue;
    for (const Named& c : caches) {
      const std::string_view name = c.name;
      const bool unquantized = name == "fp16";
      if (!unquantized && !name.starts_with("K4V2") && !name.starts_with("K2V2")) continue;
      for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer}) {
        if (unquantized && tier == kvq::Tier::integer) continue;
        benchmark::RegisterBenchmark(("decode_" + kernel + "/")
                                         .append(name)
                                         .append("/")
                                         .append(kvq::to_string(tier))
                                         .append("/32768/threads:1")
                                         .c_str(),
                                     decode_step, std::string(c.config), tier, std::size_t(32768), std::size_t(1),
                                     kernel, true, std::size_t(0))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
  }
  // 32K, one thread, the kernel chosen automatically:
  // - dense-and-sparse outliers (one per key group of 32 and per value group): the vector kernel,
  //   as the hand-tuned ones refuse them;
  // - rotated caches (a Hadamard transform of the query and of the output per step), beside the
  //   same caches unrotated: plain K4V2 and llama.cpp's layout, keys and values per token;
  // - pre-RoPE keys rotated (each key row rotated back before RoPE, on the generic AVX-512 kernel
  //   or the vector kernels), beside the same caches unrotated (on the specialised kernels, and
  //   below on those that run the rotated forms);
  // - 3-bit keys and values on the exact span kernel, which runs the exact tier for both tiers
  //   (avx512::exact_for_integer; the generic kernel's integer tier took twice as long).
  const Named other_forms[] = {{"outliers/K4V2o1-post", "k4c32o1-v2t32o1-r128-s0-post"},
                               {"outliers/K4V2o1-pre", "k4c32o1-v2t32o1-r128-s0"},
                               {"rotated/K4V2-post", "k4c32-v2t32-r128-s0-post"},
                               {"rotated/K4V2-post-hk-hv", "k4c32-v2t32-r128-s0-post-hk-hv"},
                               {"rotated/K4V4tok-post", "k4t32-v4t32-r128-s0-post"},
                               {"rotated/K4V4tok-post-hk-hv", "k4t32-v4t32-r128-s0-post-hk-hv"},
                               {"rotated/K4V2-pre", "k4c32-v2t32-r128-s0"},
                               {"rotated/K4V2-pre-hk", "k4c32-v2t32-r128-s0-hk"},
                               {"rotated/K4V4tok-pre", "k4t32-v4t32-r128-s0"},
                               {"rotated/K4V4tok-pre-hk-hv", "k4t32-v4t32-r128-s0-hk-hv"},
                               {"3bit/K3V2-post", "k3c32-v2t32-r128-s0-post"},
                               {"3bit/K4V3-post", "k4c32-v3t32-r128-s0-post"},
                               {"3bit/K3V3-pre", "k3c32-v3t32-r128-s0"}};
  for (const Named& c : other_forms)
    for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer})
      benchmark::RegisterBenchmark(
          ("decode_" + std::string(c.name) + "/" + kvq::to_string(tier) + "/32768/threads:1").c_str(), decode_step,
          std::string(c.config), tier, std::size_t(32768), std::size_t(1), std::string(), true, std::size_t(0))
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  // Level tables (NormalFloat, Lloyd-Max, iq4_nl, codebooks, fp8: codes read through a table) beside the same
  // affine layouts, 32K, one thread, exact tier, on the kernel chosen automatically and on the vector
  // kernel. V4n: affine keys with NormalFloat values (the tables' best use on stories260K).
  const Named level_tables[] = {
      {"K4V2-post", "k4c32-v2t32-r128-s0-post"},
      {"K4V2n-post", "k4c32n-v2t32n-r128-s0-post"},
      {"K4V2l-post", "k4c32l-v2t32l-r128-s0-post"},
      {"K4V4-post", "k4c32-v4t32-r128-s0-post"},
      {"K4V4n-post", "k4c32-v4t32n-r128-s0-post"},
      {"K4V2-pre", "k4c32-v2t32-r128-s0"},
      {"K4V2n-pre", "k4c32n-v2t32n-r128-s0"},
      {"K3V2-post", "k3c32-v2t32-r128-s0-post"},
      {"K3V2l-post", "k3c32l-v2t32l-r128-s0-post"},
      {"K3V2-pre", "k3c32-v2t32-r128-s0"},
      {"K4V3-post", "k4c32-v3t32-r128-s0-post"},
      {"K4V3-pre", "k4c32-v3t32-r128-s0"},
      {"K3V3-post", "k3c32-v3t32-r128-s0-post"},
      // llama.cpp's iq4_nl and q4_0 per token (its layout), iq4_nl keys per channel
      {"K4V4i-tok-post", "k4t32i-v4t32i-r128-s0-post"},
      {"K4V4g-tok-post", "k4t32g-v4t32g-r128-s0-post"},
      {"K4iV4i-post", "k4c32i-v4t32i-r128-s0-post"},
      // calibrated codebooks (levels as in DecodeAttention.CodebooksMatchReference)
      {"K4V2b-post",
       "k4c32bbc00ba00b880b700b500b200ae00a8002800300034003600380039003a803c00-v2t32bbc00b50034003c00-r128-s0-post"},
      {"K4V2b-pre",
       "k4c32bbc00ba00b880b700b500b200ae00a8002800300034003600380039003a803c00-v2t32bbc00b50034003c00-r128-s0"},
      {"K3V2b-post", "k3c32bbc00b800b400ac003000360039003c00-v2t32bbc00b50034003c00-r128-s0-post"},
      {"K3V2b-pre", "k3c32bbc00b800b400ac003000360039003c00-v2t32bbc00b50034003c00-r128-s0"},
      // 8-bit floats with a scale per group (vLLM's fp8 caches) beside 8-bit affine codes and fp16
      {"fp16-post", "k16-v16-r0-s0-post"},
      {"K8V8-post", "k8c32-v8t32-r128-s0-post"},
      {"K8V8e4m3-post", "k8c32e4m3-v8t32e4m3-r128-s0-post"},
      {"K8V8e5m2-post", "k8c32e5m2-v8t32e5m2-r128-s0-post"},
      {"K8V8e4m3-tok-post", "k8t128e4m3-v8t128e4m3-r128-s0-post"},
      {"K8V8e4m3-pre", "k8c32e4m3-v8t32e4m3-r128-s0"}};
  // One exact-tier step at 32K on one thread for each cache, on the kernel chosen automatically and
  // on each of `others`, named "decode_<set>/<cache>/<kernel>/exact/32768/threads:1".
  auto exact_32k_rows = [](const std::string& set, std::span<const Named> configs,
                           std::initializer_list<std::string> others) {
    std::vector<std::string> kernels{std::string()};
    kernels.insert(kernels.end(), others);
    for (const Named& c : configs)
      for (const std::string& kernel : kernels) {
        if (!kernel_runs(kernel)) continue;
        benchmark::RegisterBenchmark(
            ("decode_" + set + "/" + c.name + "/" + (kernel.empty() ? "auto" : kernel) + "/exact/32768/threads:1")
                .c_str(),
            decode_step, std::string(c.config), kvq::Tier::exact, std::size_t(32768), std::size_t(1), kernel, true,
            std::size_t(0))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  };
  exact_32k_rows("levels", level_tables, {"vector-avx512"});
  // The unrotated pre-RoPE caches above on the kernels that run their rotated forms (the generic
  // AVX-512 kernel, the vector kernels on AVX-512 and AVX2 ops): what rotating each key row back
  // costs there.
  for (const std::string kernel : {"avx512-generic", "vector-avx512", "vector-avx2"}) {
    if (!kernel_runs(kernel)) continue;
    for (const Named& c : other_forms)
      if (std::string_view(c.name).starts_with("rotated/") && std::string_view(c.name).ends_with("-pre"))
        benchmark::RegisterBenchmark(
            ("decode_" + std::string(c.name) + "/" + kernel + "/exact/32768/threads:1").c_str(), decode_step,
            std::string(c.config), kvq::Tier::exact, std::size_t(32768), std::size_t(1), kernel, true, std::size_t(0))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
  }
  // Layouts some hand-tuned kernel reads only row by row (StreamView::read_row; 3-bit codes were
  // such until the generic AVX-512 kernel unpacked them), on the kernel the registry picks for
  // them (the first that reads them at speed: KernelEntry::at_speed) and on the other kernels that
  // take them; exact tier, 32K, one thread.
  const Named row_by_row[] = {{"K4V2g8-post", "k4c32-v2t8-r128-s0-post"},  {"K4g8V2-post", "k4c8-v2t32-r128-s0-post"},
                              {"K2tV2c-post", "k2t32-v2c32-r128-s0-post"}, {"K3V2-pre", "k3c32-v2t32-r128-s0"},
                              {"K4V3-post", "k4c32-v3t32-r128-s0-post"},   {"K5tV4-post", "k5t32-v4t32-r128-s0-post"}};
  exact_32k_rows("row_by_row", row_by_row, {"avx512-generic", "avx2", "vector-avx512", "vector-avx2"});
  // Keys and values per token in groups of 32 with fp16 scales, no window: llama.cpp's cache types
  // q8_0 (8.5 bits per value) and q4_0 (4.5 bits) with ggml's levels, and the same layouts with
  // kvq's symmetric levels; 32K, one thread, both tiers, on the kernel chosen automatically and on
  // each that takes them.
  const Named token_layouts[] = {{"q8_0", "k8t32g-v8t32g-r0-s0-post"},
                                 {"q4_0", "k4t32g-v4t32g-r0-s0-post"},
                                 {"q8_0-layout", "k8t32s-v8t32s-r0-s0-post"},
                                 {"q4_0-layout", "k4t32s-v4t32s-r0-s0-post"}};
  for (const Named& c : token_layouts)
    for (const std::string kernel : {"", "avx512-generic", "avx2", "vector-avx512", "vector-avx2"}) {
      if (!kernel_runs(kernel)) continue;
      for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer}) {
        // ggml's levels run the exact tier for both (kernel_tier): no integer row for them
        if (tier == kvq::Tier::integer && kvq::parse_cache_config(c.config).key.mode == kvq::Mode::ggml) continue;
        benchmark::RegisterBenchmark(
            ("decode_token_keys/" + std::string(c.name) + "/" + (kernel.empty() ? std::string("auto") : kernel) + "/" +
             kvq::to_string(tier) + "/32768/threads:1")
                .c_str(),
            decode_step, std::string(c.config), tier, std::size_t(32768), std::size_t(1), kernel, true, std::size_t(0))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
  // The integer tier without its outlier scan (DecodeOptions::guard_outliers), 32K, one thread:
  // what the scan costs, beside the default rows above.
  for (const Named& c : caches) {
    const std::string_view name = c.name;
    if (!name.starts_with("K4V2-post") && !name.starts_with("K2V2-post")) continue;
    benchmark::RegisterBenchmark(
        std::string("decode_unguarded/").append(name).append("/integer/32768/threads:1").c_str(), decode_step,
        std::string(c.config), kvq::Tier::integer, std::size_t(32768), std::size_t(1), std::string(), false,
        std::size_t(0))
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  // fp16 and the K4V2 caches in both tiers, 32K, one thread: speculative verification of T
  // positions in one call, and the caches read in more or fewer segments.
  for (const Named& c : caches) {
    const std::string_view name = c.name;
    if (name != "fp16" && !name.starts_with("K4V2")) continue;
    for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer}) {
      if (name == "fp16" && tier == kvq::Tier::integer) continue;
      const std::string row = std::string(name).append("/").append(kvq::to_string(tier)).append("/32768/");
      for (const std::size_t tokens : {4, 8})
        benchmark::RegisterBenchmark(("verify/" + row + "T:" + std::to_string(tokens)).c_str(), verify_step,
                                     std::string(c.config), tier, std::size_t(32768), tokens)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      for (const bool as_tree : {true, false})
        benchmark::RegisterBenchmark(
            ((as_tree ? "verify_tree/" : "verify_branches/") + row + "branches:4/depth:4").c_str(), verify_tree_step,
            std::string(c.config), tier, std::size_t(32768), std::size_t(4), std::size_t(4), as_tree)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      for (const bool shared : {true, false})
        benchmark::RegisterBenchmark(
            ((shared ? "shared_prefix/" : "shared_prefix_apart/") + row + "sequences:16").c_str(), shared_prefix_step,
            std::string(c.config), tier, std::size_t(32768), std::size_t(16), shared)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      for (const std::size_t block : {256, 1024, 4096, 16384, 32768})
        benchmark::RegisterBenchmark(("decode_blocks/" + row + "block:" + std::to_string(block)).c_str(), decode_step,
                                     std::string(c.config), tier, std::size_t(32768), std::size_t(1), std::string(),
                                     true, block)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    }
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
