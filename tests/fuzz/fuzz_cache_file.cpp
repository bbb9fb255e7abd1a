// libFuzzer target: cache files and pool files (serialize.hpp, KVPool::save). Loading either
// succeeds, after which the target reads back and attends like any cache, or throws kvq::Error
// and leaves the target exactly as it was; nothing may crash, leak or hit undefined behaviour.
// The seeds are a cache file, a pool file and a one-sequence file of a pool with a configuration
// per layer, of the shapes below (partial, scaled RoPE), the last two in pool format version 1
// (still read), and a pool file of a pool with a RoPE per layer (version 2).
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"

namespace {

kvq::CacheShape cache_shape() {
  kvq::CacheShape s{.layers = 2, .kv_heads = 1, .head_dim = 16, .capacity = 48, .rope_dims = 8};
  s.rope_scaling.type = kvq::RopeScalingType::llama3, s.rope_scaling.factor = 8.0f,
  s.rope_scaling.original_context = 32;
  s.rope_scaling.frequency_divisors = {1.0f, 2.0f, 4.0f, 8.0f};
  return s;
}

kvq::PoolShape pool_shape() {
  const kvq::CacheShape c = cache_shape();
  return kvq::PoolShape{.layers = 2,
                        .kv_heads = 1,
                        .head_dim = 16,
                        .max_tokens = 128,
                        .block_tokens = 64,
                        .memory_blocks = 32,
                        .rope_dims = c.rope_dims,
                        .rope_scaling = c.rope_scaling};
}

const kvq::CacheConfig& config() {
  static const kvq::CacheConfig c = kvq::parse_cache_config("k4c8-v2t8-r4-s1-d6");
  return c;
}

/// A configuration per layer: layer 1 in another one, with its own block store.
const std::vector<kvq::CacheConfig>& layer_configs() {
  static const std::vector<kvq::CacheConfig> c = kvq::parse_layer_configs("k4c8-v2t8-r4-s1-d6;k2c8-v4t8-r4-s0-d6", 2);
  return c;
}

/// A RoPE per layer: layer 1 rotated otherwise, so each layer is a group of its own.
std::vector<kvq::RopeConfig> layer_ropes() {
  kvq::RopeConfig global = pool_shape().sequence_shape().rope();
  global.theta = 5.0e5f, global.rotary_dims = 16;
  global.scaling = {.type = kvq::RopeScalingType::linear, .factor = 4.0f};
  return {pool_shape().sequence_shape().rope(), global};
}

/// Reads every row and attends at the newest position of every layer, as an engine would.
void use(const kvq::BasicKVCache& cache) {
  std::vector<float> row(cache.shape().head_dim), q(2 * cache.shape().kv_heads * cache.shape().head_dim, 0.25f),
      out(q.size());
  for (std::size_t l = 0; l < cache.shape().layers; ++l) {
    for (std::size_t h = 0; h < cache.shape().kv_heads; ++h)
      for (std::size_t p = 0; p < cache.length(l); ++p)
        for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values}) cache.read_row(t, l, h, p, row.data());
    if (cache.length(l) == 0) continue;
    try {
      for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer})
        kvq::decode_attention(cache, l, cache.length(l) - 1, q, out, {.tier = tier});
    } catch (const kvq::Error&) {  // e.g. scores that could overflow: refused, not undefined
    }
  }
}

/// Loads `bytes` into an empty pool whose layers may differ (a whole pool, or one sequence) and
/// uses every layer it then holds; a refused load must leave the pool holding nothing. Empties
/// the pool again.
void load_and_use(kvq::KVPool& pool, const std::string& bytes, bool whole) {
  const std::size_t layers = pool.shape().layers;
  try {
    std::istringstream in(bytes, std::ios::binary);
    if (whole)
      pool.load(in);
    else
      (void)pool.load_sequence(in);
    for (kvq::SequenceId id = 0; id < 8; ++id)
      if (pool.contains(id))
        for (std::size_t l = 0; l < layers; ++l) use(pool.layer(id, l).cache);
  } catch (const kvq::Error&) {
    if (pool.sequence_count() != 0) __builtin_trap();
    for (std::size_t l = 0; l < layers; ++l)
      if (pool.blocks(l).counts().in_use != 0) __builtin_trap();
  }
  for (kvq::SequenceId id = 0; id < 8; ++id)
    if (pool.contains(id)) pool.remove_sequence(id);
}

void fill(kvq::BasicKVCache& cache, std::size_t tokens) {
  std::vector<float> k(tokens * cache.shape().kv_heads * cache.shape().head_dim), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = float(i % 13) - 6.0f, v[i] = float(i % 7) * 0.5f - 1.5f;
  for (std::size_t l = 0; l < cache.shape().layers; ++l) cache.append(l, 0, k, v);
}

}  // namespace

#ifdef KVQ_FUZZ_WRITE_SEEDS
// Built by hand to write the seeds: a cache file and a pool file with forks sharing blocks.
#include <fstream>
int main(int, char** argv) {
  kvq::BasicKVCache cache(cache_shape(), config());
  fill(cache, 30);
  cache.truncate(27);
  std::ofstream(std::string(argv[1]) + "/cache.kvq", std::ios::binary) << [&] {
    std::ostringstream out(std::ios::binary);
    kvq::save(cache, out);
    return out.str();
  }();
  kvq::KVPool pool(pool_shape(), config());
  const kvq::SequenceId a = pool.add_sequence();
  std::vector<float> k(90 * 16), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = float(i % 11) - 5.0f, v[i] = float(i % 5) - 2.0f;
  for (std::size_t l = 0; l < 2; ++l) pool.append(a, l, 0, k, v);
  (void)pool.fork(a, 90);
  (void)pool.fork(a, 86);
  std::ostringstream out(std::ios::binary);
  pool.save(out);
  std::ofstream(std::string(argv[1]) + "/pool.kvq", std::ios::binary) << out.str();
  kvq::KVPool layered(pool_shape(), layer_configs());
  const kvq::SequenceId b = layered.add_sequence();
  for (std::size_t l = 0; l < 2; ++l) layered.append(b, l, 0, k, v);
  std::ostringstream session(std::ios::binary);
  layered.save_sequence(b, session);
  std::ofstream(std::string(argv[1]) + "/layers.kvq", std::ios::binary) << session.str();
  kvq::KVPool rotated(pool_shape(), std::vector<kvq::CacheConfig>(2, config()), layer_ropes());
  const kvq::SequenceId c = rotated.add_sequence();
  for (std::size_t l = 0; l < 2; ++l) rotated.append(c, l, 0, k, v);
  (void)rotated.fork(c, 86);
  std::ostringstream ropes(std::ios::binary);
  rotated.save(ropes);
  std::ofstream(std::string(argv[1]) + "/ropes.kvq", std::ios::binary) << ropes.str();
}
#else
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  kvq::BasicKVCache cache(cache_shape(), config());
  fill(cache, 11);
  const std::vector<std::uint8_t> before = cache.stored_bytes();
  try {
    std::istringstream in(bytes, std::ios::binary);
    kvq::load(cache, in);
    use(cache);
  } catch (const kvq::Error&) {
    if (cache.stored_bytes() != before || cache.length(0) != 11) __builtin_trap();
  }
  kvq::KVPool pool(pool_shape(), config());
  try {
    std::istringstream in(bytes, std::ios::binary);
    pool.load(in);
    for (kvq::SequenceId id = 0; id < 8; ++id)
      if (pool.contains(id)) use(pool.sequence(id));
  } catch (const kvq::Error&) {
    if (pool.sequence_count() != 0 || pool.blocks().counts().in_use != 0) __builtin_trap();
  }
  // A pool with a configuration per layer, as a whole pool and as one sequence (either file kind),
  // and a pool with a RoPE per layer.
  kvq::KVPool layered(pool_shape(), layer_configs());
  for (const bool whole : {true, false}) load_and_use(layered, bytes, whole);
  kvq::KVPool rotated(pool_shape(), std::vector<kvq::CacheConfig>(2, config()), layer_ropes());
  load_and_use(rotated, bytes, true);
  return 0;
}
#endif
