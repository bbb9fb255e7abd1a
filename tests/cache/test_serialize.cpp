// Saving and restoring caches: exact round trips, file size, and damaged or foreign files, which
// must throw kvq::Error and leave the target as it was.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "kvq/kvq.hpp"
#include "support/cache_state.hpp"
#include "support/file_sections.hpp"
#include "support/random.hpp"

namespace {

using kvq::BasicKVCache;
using kvq::CacheConfig;
using kvq::CacheShape;
using kvq::Tensor;
using kvq::test::snapshot;

CacheConfig config_of(const char* text) { return kvq::parse_cache_config(text); }

// Appends `count` random tokens (seeded) to every layer.
void append_random(BasicKVCache& cache, std::size_t count, unsigned seed) {
  const std::size_t row = cache.shape().kv_heads * cache.shape().head_dim;
  const auto k = kvq::test::outlier_keys(count, cache.shape().kv_heads, cache.shape().head_dim, 1, 6.0f, seed);
  const auto v = kvq::test::normal_vector(count * row, seed + 1);
  for (std::size_t l = 0; l < cache.shape().layers; ++l) cache.append(l, cache.length(l), k, v);
}

std::string saved(const BasicKVCache& cache) {
  std::ostringstream out(std::ios::binary);
  kvq::save(cache, out);
  return out.str();
}

void load_text(BasicKVCache& cache, const std::string& bytes) {
  std::istringstream in(bytes, std::ios::binary);
  kvq::load(cache, in);
}

// Loading `bytes` into `target` throws kvq::Error with `code`, naming each of `needles`, and
// leaves the target as it was.
void expect_load_refused(BasicKVCache& target, const std::string& bytes, kvq::ErrorCode code,
                         std::initializer_list<std::string> needles, const std::string& what) {
  const auto before = snapshot(target);
  const kvq::BlockCounts blocks = target.blocks().counts();
  std::vector<std::size_t> lengths;
  for (std::size_t l = 0; l < target.shape().layers; ++l) lengths.push_back(target.length(l));
  try {
    load_text(target, bytes);
    ADD_FAILURE() << what << ": no error";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), code) << what << ": " << e.what();
    for (const std::string& needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
  }
  EXPECT_TRUE(snapshot(target) == before) << what;
  for (std::size_t l = 0; l < target.shape().layers; ++l) EXPECT_EQ(target.length(l), lengths[l]) << what;
  EXPECT_EQ(target.blocks().counts().in_use, blocks.in_use) << what << ": the blocks a load took were kept";
}

void expect_same_rollback_reach(const BasicKVCache& a, const BasicKVCache& b) {
  for (std::size_t l = 0; l < a.shape().layers; ++l)
    for (const Tensor t : {Tensor::keys, Tensor::values}) EXPECT_EQ(a.rollback_floor(t, l), b.rollback_floor(t, l));
}

// A cache with a rollback behind it and layers of different lengths.
BasicKVCache sample_cache(const CacheShape& shape, const CacheConfig& config, std::size_t tokens, unsigned seed) {
  BasicKVCache cache(shape, config);
  append_random(cache, tokens, seed);
  cache.truncate(tokens - std::min<std::size_t>({tokens, 3, config.rollback_depth}));
  append_random(cache, 2, seed + 7);
  if (shape.layers > 1) {
    std::vector<float> k(shape.kv_heads * shape.head_dim, 0.25f), v(k.size(), -0.5f);
    cache.append(0, cache.length(0), k, v);  // layer 0 one token longer
  }
  return cache;
}

// The largest |value| of `t` that `layer` holds as stored, row by row.
float largest_stored(const BasicKVCache& cache, Tensor t, std::size_t layer) {
  std::vector<float> row(cache.shape().head_dim);
  float peak = 0.0f;
  for (std::size_t h = 0; h < cache.shape().kv_heads; ++h)
    for (std::size_t p = 0; p < cache.length(layer); ++p) {
      cache.read_stored_row(t, layer, h, p, row.data());
      for (const float x : row) peak = std::max(peak, std::fabs(x));
    }
  return peak;
}

TEST(CacheFile, RoundTripRestoresEverything) {
  for (const char* text : {"k4c32-v2t32-r20-s3", "k2c16-v4c16-r0-s0", "k16-v16-r0-s2", "k8c16s-v4t64s-r33-s2-bf16",
                           "k3c8-v5t16-r5-s0-f32-d5", "k2t32-v2c32-r7-s1-d0", "k4c32-v2t32-r128-s1-post",
                           "k3c32o2-v2t32o1-r20-s3", "k4t32g-v8t16g-r8-s1-post", "k4c32n-v3t16l-r8-s1",
                           "k4c32-v16-r20-s2", "k16-v2t32-r8-s1", "k4c32-v2t32-r64-s1-fk-fv-post"}) {
    SCOPED_TRACE(text);
    const CacheShape shape{2, 2, 64, 320};
    const CacheConfig config = config_of(text);
    for (const std::size_t tokens : {1u, 5u, 150u, 290u}) {
      SCOPED_TRACE(tokens);
      BasicKVCache original = sample_cache(shape, config, tokens, unsigned(tokens));
      const std::string bytes = saved(original);
      BasicKVCache into(shape, config);
      append_random(into, 40, 99);  // whatever the target held is replaced
      load_text(into, bytes);
      kvq::test::expect_same_state(into, original, "loaded into an existing cache");
      expect_same_rollback_reach(into, original);
      std::istringstream in(bytes, std::ios::binary);
      BasicKVCache fresh = kvq::load(in);
      EXPECT_EQ(fresh.config(), config);
      kvq::test::expect_same_state(fresh, original, "loaded as a new cache");
      for (std::size_t l = 0; l < shape.layers; ++l) {
        EXPECT_EQ(into.key_peak(l), original.key_peak(l)) << "layer " << l;
        EXPECT_EQ(fresh.key_peak(l), original.key_peak(l)) << "layer " << l;
        // What attention counts on: stored keys within twice the peak, values within the bound.
        EXPECT_LE(largest_stored(fresh, Tensor::keys, l), 2 * fresh.key_peak(l)) << "layer " << l;
        EXPECT_LE(largest_stored(fresh, Tensor::values, l), fresh.value_peak(l)) << "layer " << l;
        EXPECT_LE(fresh.value_peak(l), 1.01f * original.value_peak(l) + 1e-3f) << "layer " << l;
      }
      EXPECT_EQ(saved(fresh), bytes) << "saving the restored cache writes the same file";
      // The restored caches go on exactly like the original, rollbacks included.
      for (BasicKVCache* c : {&original, &into, &fresh}) {
        append_random(*c, 7, 1234);
        c->truncate(c->length(0) - std::min<std::size_t>(c->length(0), config.rollback_depth));
        append_random(*c, 5, 4321);
      }
      kvq::test::expect_same_state(into, original, "after more appends and a rollback");
      kvq::test::expect_same_state(fresh, original, "after more appends and a rollback (new cache)");
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// Keys of a few ten-thousandths quantize with f16 scales in subnormal steps, so their codes decode a
// little past them (e5m2 by up to 57344 x 2^-24): a load keeps the saved peak all the same.
TEST(CacheFile, TinyKeysKeepTheirPeakThroughARoundTrip) {
  for (const char* text : {"k8c8e5m2-v8t8e5m2-r4-s1", "k4c8-v2t8-r4-s1", "k4c8n-v4t8l-r4-s1"}) {
    SCOPED_TRACE(text);
    const CacheShape shape{1, 2, 16, 48};
    BasicKVCache original(shape, config_of(text));
    std::vector<float> k = kvq::test::normal_vector(30 * 2 * 16, 7), v = kvq::test::normal_vector(k.size(), 8);
    for (float& x : k) x *= 1e-4f;
    original.append(0, 0, k, v);
    const std::string bytes = saved(original);
    BasicKVCache loaded(shape, original.config());
    load_text(loaded, bytes);
    EXPECT_EQ(loaded.key_peak(0), original.key_peak(0));
    EXPECT_TRUE(saved(loaded) == bytes) << "saving the loaded cache writes another file";
  }
}

// A load bounds every packed group by what its extreme codes decode to (StreamView::inlier_bound,
// blocks of 256 parameter pairs converted at once): the same as decoding them pair by pair with
// the reference. With the outliers (packed_bound), the bound is what the rows read back where an
// outlier exceeds it. 700 tokens of head_dim 96 give
// 2016 per-channel and 2100 per-token pairs, neither a multiple of the block.
TEST(CacheFile, PackedGroupBoundsMatchTheReferenceDecode) {
  namespace ref = kvq::kernels::reference;
  for (const char* text : {"k4c32-v2t32-r0-s0", "k8c16s.bf16-v4t32s.f32-r0-s0", "k3c32o2-v2t32o1.f32-r0-s0",
                           "k4t32g-v8t32g.bf16-r0-s0", "k4c32n.f32-v3t32l.bf16-r0-s0", "k8c8e5m2-v8t32e4m3-r0-s0"}) {
    SCOPED_TRACE(text);
    const CacheShape shape{1, 2, 96, 800};
    BasicKVCache cache(shape, config_of(text));
    std::vector<float> k = kvq::test::normal_vector(700 * 2 * 96, 11), v = kvq::test::normal_vector(k.size(), 12);
    for (std::size_t i = 0; i < k.size(); ++i) {  // channels and tokens of very different sizes
      k[i] *= float(1 + i % 96 % 7 * 30);
      v[i] *= float(1 + i / 192 % 5 * 20);
    }
    cache.append(0, 0, k, v);
    for (const Tensor t : {Tensor::keys, Tensor::values})
      for (std::size_t h = 0; h < shape.kv_heads; ++h) {
        const kvq::StreamView view = cache.view(t, 0, h, 0);
        ASSERT_GT(view.end_quantized, view.first_quantized + 600);
        const auto extreme = ref::extreme_codes(view.spec);
        const bool per_channel = view.spec.axis == kvq::Axis::per_channel;
        const std::size_t per_row = per_channel ? shape.head_dim : kvq::groups_per_row(view.spec, shape.head_dim);
        const std::size_t first = view.param_index(view.first_quantized),
                          last = view.param_index(view.end_quantized - 1) + per_row;
        float expected = 0.0f;
        for (std::size_t i = first; i < last; ++i) {
          const ref::GroupParams p = ref::load_params(view.spec, view.scales, view.zeros, i);
          expected =
              std::max({expected, std::fabs(ref::decode(p, extreme.first)), std::fabs(ref::decode(p, extreme.second))});
        }
        EXPECT_FLOAT_EQ(view.inlier_bound(first, last, extreme), expected) << "head " << h;
        // Outliers are bounded exactly: by what their rows read back.
        float read = 0.0f;
        std::vector<float> row(shape.head_dim);
        for (std::size_t p = view.first_quantized; p < view.end_quantized; ++p) {
          view.read_row(p, row.data());
          for (const float x : row) read = std::max(read, std::fabs(x));
        }
        const float bound = view.packed_bound(view.first_quantized, view.end_quantized, extreme);
        EXPECT_FLOAT_EQ(bound, std::max(expected, read)) << "head " << h;
        EXPECT_LE(read, bound) << "head " << h;
      }
  }
}

// A group whose parameters decode past FLT_MAX bounds at +inf, whichever way it overflows: an
// implied zero of -mid x scale (symmetric, ggml's levels) or the top code times the scale
// (asymmetric). Hand-built segments of one key group, two channels, f32 parameters.
TEST(CacheFile, OverflowingGroupsBoundAtInfinity) {
  namespace ref = kvq::kernels::reference;
  for (const char* text : {"k4c32s.f32", "k4c32.f32", "k4c32g.f32"}) {
    SCOPED_TRACE(text);
    kvq::StreamView view;
    view.spec = kvq::parse_quantizer(text, 'k');
    view.quantized = true;
    view.head_dim = 2;
    view.end_quantized = 32;
    const std::vector<std::uint8_t> codes(32 * 1, 0x5A);  // 32 rows of 2 four-bit codes
    const float scales[2] = {1.0f, 3e38f}, zeros[2] = {0.0f, 0.0f};
    view.codes = codes.data();
    view.row_bytes = 1;
    view.scales = reinterpret_cast<const std::uint8_t*>(scales);
    view.zeros = reinterpret_cast<const std::uint8_t*>(zeros);
    EXPECT_EQ(view.packed_bound(0, 32, ref::extreme_codes(view.spec)), std::numeric_limits<float>::infinity());
    const float finite[2] = {1.0f, 2.0f};
    view.scales = reinterpret_cast<const std::uint8_t*>(finite);
    EXPECT_LT(view.packed_bound(0, 32, ref::extreme_codes(view.spec)), 100.0f);
  }
}

TEST(CacheFile, SavesToAndLoadsFromAFile) {
  const CacheShape shape{2, 2, 32, 128};
  const BasicKVCache original = sample_cache(shape, config_of("k4c8-v2t8-r8-s1"), 60, 3);
  const auto path =
      std::filesystem::temp_directory_path() / ("kvq_test_serialize_" + std::to_string(::getpid()) + ".kvq");
  kvq::save_file(original, path);
  BasicKVCache into(shape, original.config());
  kvq::load_file(into, path);
  kvq::test::expect_same_state(into, original, "load_file into");
  kvq::test::expect_same_state(kvq::load_file(path), original, "load_file new");
  std::filesystem::remove(path);
  try {
    kvq::load_file(into, path);
    ADD_FAILURE() << "no error for a missing file";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::io);
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
}

// Shapes whose RoPE the header must carry: partial rotary dims and every scaling, frequency
// divisors included (keys stored pre-RoPE are rotated at attention, so the RoPE is part of what
// the bytes mean).
std::vector<CacheShape> rope_shapes() {
  std::vector<CacheShape> shapes;
  CacheShape base{2, 2, 32, 96};
  base.rope_dims = 16;  // partial rotary
  shapes.push_back(base);
  CacheShape linear = base;
  linear.rope_dims = 0, linear.rope_scaling.type = kvq::RopeScalingType::linear, linear.rope_scaling.factor = 2.5f;
  shapes.push_back(linear);
  CacheShape llama3 = base;
  llama3.rope_theta = 500000.0f, llama3.rope_scaling.type = kvq::RopeScalingType::llama3;
  llama3.rope_scaling.factor = 8.0f, llama3.rope_scaling.original_context = 64;
  llama3.rope_scaling.frequency_divisors = {1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 8.0f};  // one per rotated pair
  shapes.push_back(llama3);
  CacheShape yarn = base;
  yarn.rope_style = kvq::RopeStyle::half_split, yarn.rope_scaling.type = kvq::RopeScalingType::yarn;
  yarn.rope_scaling.factor = 4.0f, yarn.rope_scaling.original_context = 32, yarn.rope_scaling.attention_factor = 1.25f;
  shapes.push_back(yarn);
  return shapes;
}

TEST(CacheFile, PartialAndScaledRopeRoundTrips) {
  const CacheConfig config = config_of("k4c8-v2t8-r8-s1");
  for (const CacheShape& shape : rope_shapes()) {
    SCOPED_TRACE(kvq::detail::describe(shape));
    const BasicKVCache original = sample_cache(shape, config, 70, 4);
    const std::string bytes = saved(original);
    BasicKVCache into(shape, config);
    append_random(into, 20, 8);
    load_text(into, bytes);
    kvq::test::expect_same_state(into, original, "loaded into a cache of the same RoPE");
    std::istringstream in(bytes, std::ios::binary);
    const BasicKVCache fresh = kvq::load(in);
    EXPECT_TRUE(fresh.shape().rope_scaling == shape.rope_scaling);
    EXPECT_EQ(fresh.shape().rope().dims(), shape.rope().dims());
    kvq::test::expect_same_state(fresh, original,
                                 "loaded as a new cache");  // reference attention rotates with the file's RoPE
    EXPECT_EQ(saved(fresh), bytes);
    // Any other RoPE is a mismatch naming it; the target keeps what it held.
    for (const CacheShape& other : rope_shapes()) {
      if (kvq::detail::same_shape(other, shape)) continue;
      BasicKVCache target(other, config);
      append_random(target, 9, 5);
      const auto before = snapshot(target);
      try {
        load_text(target, bytes);
        ADD_FAILURE() << "loaded into " << kvq::detail::describe(other);
      } catch (const kvq::Error& e) {
        EXPECT_EQ(e.code(), kvq::ErrorCode::shape_mismatch) << e.what();
        EXPECT_NE(std::string(e.what()).find(kvq::detail::describe(shape)), std::string::npos) << e.what();
      }
      EXPECT_TRUE(snapshot(target) == before);
    }
  }
}

// The RoPE extension is covered like every other field: any truncation or flipped bit of a file
// with partial, scaled RoPE and frequency divisors is an io error, and the target keeps its state.
TEST(CacheFile, DamagedScaledRopeFileThrowsIo) {
  CacheShape shape{1, 1, 16, 48};
  shape.rope_dims = 8, shape.rope_scaling.type = kvq::RopeScalingType::llama3, shape.rope_scaling.factor = 8.0f;
  shape.rope_scaling.original_context = 32, shape.rope_scaling.frequency_divisors = {1.0f, 2.0f, 4.0f, 8.0f};
  const CacheConfig config = config_of("k4c8-v2t8-r4-s1");
  const std::string file = saved(sample_cache(shape, config, 20, 12));
  BasicKVCache target(shape, config);
  append_random(target, 11, 3);
  const auto before = snapshot(target);
  auto expect_io = [&](const std::string& bytes, const std::string& what) {
    try {
      load_text(target, bytes);
      ADD_FAILURE() << what << ": no error";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::io) << what << ": " << e.what();
    }
    EXPECT_TRUE(snapshot(target) == before) << what;
  };
  for (std::size_t n = 0; n < file.size(); ++n) expect_io(file.substr(0, n), "truncated to " + std::to_string(n));
  for (std::size_t i = 0; i < file.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      std::string bytes = file;
      bytes[i] = char(bytes[i] ^ (1 << bit));
      expect_io(bytes, "bit " + std::to_string(bit) + " of byte " + std::to_string(i));
      if (::testing::Test::HasFailure()) return;
    }
}

// A file of format version 1 (written before the header carried the RoPE extension) reads as
// every channel rotated, no scaling. It is made here from a version 2 file by dropping the
// extension from the header.
std::string as_version_1(const std::string& v2) {
  std::uint64_t size;
  std::memcpy(&size, v2.data() + 20, 8);
  const std::string payload = v2.substr(28, size);
  std::uint32_t divisors;
  std::memcpy(&divisors, payload.data() + 52 + 44, 4);
  const std::string v1_payload = payload.substr(0, 52) + payload.substr(52 + 48 + 4 * std::size_t(divisors));
  std::string out = v2.substr(0, 16);
  out[8] = 1;
  std::string section = v2.substr(16, 4);
  const std::uint64_t v1_size = v1_payload.size();
  section.append(reinterpret_cast<const char*>(&v1_size), 8);
  section += v1_payload;
  const std::uint32_t crc = kvq::crc32c(section.data(), section.size());
  section.append(reinterpret_cast<const char*>(&crc), 4);
  return out + section + v2.substr(28 + size + 4);
}

TEST(CacheFile, Version1FilesStillLoad) {
  const CacheShape shape{2, 2, 32, 96};
  const CacheConfig config = config_of("k4c8-v2t8-r8-s1");
  const BasicKVCache original = sample_cache(shape, config, 70, 6);
  const std::string v1 = as_version_1(saved(original));
  ASSERT_EQ(v1.size() + 48, saved(original).size());
  BasicKVCache into(shape, config);
  load_text(into, v1);
  kvq::test::expect_same_state(into, original, "version 1 into a cache");
  std::istringstream in(v1, std::ios::binary);
  const BasicKVCache fresh = kvq::load(in);
  EXPECT_EQ(fresh.shape().rope_dims, 0u);
  EXPECT_TRUE(fresh.shape().rope_scaling == kvq::RopeScaling{});
  EXPECT_EQ(saved(fresh), saved(original)) << "saved again as version 2";
  // A version 1 file means full, unscaled RoPE: a scaled target is another shape.
  CacheShape scaled = shape;
  scaled.rope_scaling.type = kvq::RopeScalingType::linear, scaled.rope_scaling.factor = 2.0f;
  BasicKVCache other(scaled, config);
  EXPECT_THROW(load_text(other, v1), kvq::Error);
}

// The file holds what the cache uses (codes, parameters, sink and window rows, as memory()
// counts them, plus the rollback copies), never its capacity.
TEST(CacheFile, SizeFollowsTheTokensHeldNotTheCapacity) {
  const CacheConfig config = config_of("k4c32-v2t32-r128-s0");  // K4V2
  const std::size_t layers = 2, heads = 4, dim = 128;
  std::size_t previous = 0;
  for (const std::size_t tokens : {300u, 600u, 1200u}) {
    BasicKVCache small(CacheShape{layers, heads, dim, 1500}, config),
        large(CacheShape{layers, heads, dim, 6000}, config);
    append_random(small, tokens, 5);
    append_random(large, tokens, 5);
    const std::size_t size = saved(small).size();
    EXPECT_EQ(saved(large).size(), size) << "capacity must not matter";
    const std::size_t config_text = kvq::to_string(config).size();
    const std::size_t overhead = 16 + (16 + 104 + config_text) + (16 + layers * 60) + layers * 16;
    // beyond memory(): the packed rows still in the ring and the rollback copies of packed rows
    std::size_t full_precision_copies = 0;
    for (std::size_t l = 0; l < layers; ++l)
      for (const Tensor t : {Tensor::keys, Tensor::values}) {
        const kvq::StreamLayout& lay = small.layout(t);
        const std::size_t end = small.quantized_end(t, l), first_in_ring = tokens - lay.ring_rows;
        full_precision_copies += (end - first_in_ring + std::min(end, lay.history_rows)) * heads * dim * 2;
      }
    EXPECT_EQ(size, overhead + small.memory().total_bytes() + full_precision_copies) << tokens;
    if (previous != 0) {
      const double per_token = double(size - previous) / double(tokens / 2);
      std::printf("K4V2, %zu layers x %zu heads x %zu: %zu tokens -> %zu bytes, %.1f bytes per token\n", layers, heads,
                  dim, tokens, size, per_token);
    }
    previous = size;
  }
}

// A header names the capacity, and a new cache allocates its own rows, RoPE table and block table
// for it before the body is read: load(in) refuses a cache that would take more than its limit, so
// a few bytes cannot ask for gigabytes (capacity 2^27 at head_dim 128: a 64 GiB RoPE table).
TEST(CacheFile, ANewCacheIsBoundedBeforeItsBodyIsRead) {
  const CacheConfig config = config_of("k4c32-v2t32-r128-s0");
  const CacheShape shape{2, 4, 128, 1500};
  BasicKVCache cache(shape, config);
  append_random(cache, 300, 7);
  const std::string file = saved(cache);
  const std::size_t fixed = BasicKVCache::fixed_bytes(shape, config);
  EXPECT_GE(fixed, BasicKVCache(shape, config).allocated_bytes());  // own rows, history, scratch, RoPE table
  EXPECT_LE(fixed, BasicKVCache(shape, config).allocated_bytes() + 64 * 1024);  // and the block table, small
  std::stringstream exact(file);
  EXPECT_EQ(snapshot(kvq::load(exact, fixed)), snapshot(cache));
  std::stringstream over(file);
  try {
    (void)kvq::load(over, fixed - 1);
    ADD_FAILURE() << "a cache beyond the limit was loaded";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::io);
    EXPECT_NE(e.message().find("would allocate " + std::to_string(fixed) + " bytes before its first token"),
              std::string::npos)
        << e.message();
  }
  EXPECT_GT(BasicKVCache::fixed_bytes(CacheShape{1, 1, 128, std::size_t(1) << 27}, config), kvq::default_load_bytes);
  EXPECT_LT(BasicKVCache::fixed_bytes(CacheShape{32, 8, 128, std::size_t(1) << 20}, config), kvq::default_load_bytes);
}

// Contents no cache writes, in files whose CRCs are right (written by something else): the
// kernels would trust them (an outlier slot indexes their memory), so load names them and
// changes nothing.
TEST(CacheFile, ForgedContentsWithValidCrcsAreRejected) {
  using Access = kvq::detail::CacheAccess;
  using Piece = Access::Piece;
  struct Forgery {
    const char* config;
    Piece piece;
    Tensor tensor;
    std::size_t at;                  // byte of the piece's first run
    std::vector<std::uint8_t> with;  // the bytes written there
    const char* needle;
  };
  const std::vector<std::uint8_t> f16_nan{0x00, 0x7E}, f16_inf{0x00, 0x7C}, bf16_inf{0x80, 0x7F},
      f32_nan{0x00, 0x00, 0xC0, 0x7F};
  const Forgery forgeries[] = {
      {"k4c8-v2t8-r4-s1", Piece::scales, Tensor::keys, 6, f16_nan, "key, byte"},
      {"k4c8-v2t8-r4-s1", Piece::scales, Tensor::values, 0, f16_inf, "scale 0 of a run"},
      {"k4c8-v2t8-r4-s1", Piece::zero_points, Tensor::keys, 2, f16_inf, "zero point 1 of a run"},
      {"k4c8-v2t8-r4-s1", Piece::rows, Tensor::keys, 4, f16_nan, "full-precision value 2"},
      {"k4c8s.f32-v2t8s.bf16-r4-s1", Piece::scales, Tensor::keys, 4, f32_nan, "scale 1 of a run"},
      {"k4c8s.f32-v2t8s.bf16-r4-s1", Piece::scales, Tensor::values, 0, bf16_inf, "scale 0 of a run"},
      {"k4c8-v2t8-r4-s1-f32", Piece::rows, Tensor::values, 0, f32_nan, "full-precision value 0"},
      {"k4c8o1-v2t8-r4-s1",
       Piece::outlier_slots,
       Tensor::keys,
       2,
       {8, 0},
       "slot 8 (entry 1 of a run) is outside its group of 8"},
      {"k4c8o1-v2t8-r4-s1", Piece::outlier_corrections, Tensor::keys, 0, f16_nan, "outlier correction 0"},
      {"k4c8-v2t8o2-r4-s1", Piece::outlier_slots, Tensor::values, 2, {0, 0}, "not above the one before it"},
      {"k4c8-v2t8o1-r4-s1", Piece::outlier_slots, Tensor::values, 2, {8, 0}, "outside its group of 8"},
      {"k8c8e4m3-v8t8e4m3-r4-s1", Piece::codes, Tensor::values, 3, {0xFF}, "code 3 of a run is an e4m3 NaN"},
      {"k8c8e4m3-v8t8e4m3-r4-s1", Piece::codes, Tensor::keys, 0, {0x7F}, "e4m3 NaN"},
      {"k8c8e5m2-v8t8e5m2-r4-s1", Piece::codes, Tensor::keys, 1, {0x7C}, "code 1 of a run is an e5m2 infinity"},
      {"k8c8e5m2-v8t8e5m2-r4-s1", Piece::codes, Tensor::values, 0, {0xFE}, "e5m2 infinity or NaN"}};
  const CacheShape shape{2, 1, 16, 48};
  for (const Forgery& f : forgeries) {
    const std::string what = std::string(f.config) + ": " + f.needle;
    const CacheConfig config = config_of(f.config);
    const BasicKVCache source = sample_cache(shape, config, 30, 21);
    const std::string file = saved(source);
    // The first piece of that kind in layer 0's section (the third: header, table, layer 0).
    std::size_t offset = 0, found = SIZE_MAX;
    Access::visit_pieces(source, 0, Access::state(source, 0),
                         [&](Piece piece, Tensor t, std::size_t n, std::size_t, auto) {
                           if (found == SIZE_MAX && piece == f.piece && t == f.tensor && n >= f.at + f.with.size())
                             found = offset;
                           offset += n;
                         });
    ASSERT_NE(found, SIZE_MAX) << what;
    const auto sections = kvq::test::file_sections(file);
    ASSERT_EQ(sections.size(), 4u) << what;
    std::string bytes = file;
    std::memcpy(bytes.data() + sections[2].first + 12 + found + f.at, f.with.data(), f.with.size());
    ASSERT_NE(bytes, file) << what;
    kvq::test::reseal(bytes, sections[2].first, sections[2].second);

    BasicKVCache target(shape, config);
    append_random(target, 13, 77);
    expect_load_refused(target, bytes, kvq::ErrorCode::io, {"section 'layer 0'", f.needle}, what);
    load_text(target, file);  // the file as saved loads
    EXPECT_TRUE(snapshot(target) == snapshot(source)) << what;
  }
}

// Attention trusts a layer's key peak to bound its scores, and sums values that appends kept under
// value_limit(). A load holds a file to what it stores, not to what its table says: finite forged
// contents under valid CRCs are refused at attention by name (a key scale of 2e37 behind the saved
// peak gave NaN outputs).
TEST(CacheFile, ALoadedCacheIsHeldToWhatItStores) {
  using Access = kvq::detail::CacheAccess;
  using Piece = Access::Piece;
  const CacheShape shape{1, 1, 16, 48};
  const CacheConfig config = config_of("k4c8s.f32-v2t8s.f32-r4-s1-f32");
  const BasicKVCache source = sample_cache(shape, config, 30, 5);
  const std::string file = saved(source);
  // `source` loaded from its file with the first value of the first (or last) `piece` of `t` in
  // layer 0 set to x, and the table's key peak for layer 0 to `peak` where given.
  auto load_forged = [&](Piece piece, Tensor t, float x, bool last = false, float peak = -1.0f) {
    std::size_t offset = 0, found = SIZE_MAX;
    Access::visit_pieces(source, 0, Access::state(source, 0), [&](Piece p, Tensor u, std::size_t n, std::size_t, auto) {
      if ((found == SIZE_MAX || last) && p == piece && u == t && n >= 4) found = offset;
      offset += n;
    });
    EXPECT_NE(found, SIZE_MAX);
    const auto sections = kvq::test::file_sections(file);
    std::string bytes = file;
    std::memcpy(bytes.data() + sections[2].first + 12 + found, &x, 4);
    kvq::test::reseal(bytes, sections[2].first, sections[2].second);
    if (peak >= 0.0f) {
      std::memcpy(bytes.data() + sections[1].first + 12 + 56, &peak, 4);  // the table's first entry
      kvq::test::reseal(bytes, sections[1].first, sections[1].second);
    }
    auto loaded = std::make_unique<BasicKVCache>(shape, config);
    load_text(*loaded, bytes);
    return loaded;
  };
  auto expect_attention_refused = [](const BasicKVCache& cache, float q_value, const std::string& needle) {
    SCOPED_TRACE(needle);
    const std::vector<float> q(16, q_value);
    std::vector<float> out(16);
    try {
      kvq::decode_attention(cache, 0, cache.length(0) - 1, q, out);
      ADD_FAILURE() << needle << ": no error; out[0] = " << out[0];
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::unrepresentable) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };

  {  // the file as saved: peaks as they were, and attention runs
    BasicKVCache loaded(shape, config);
    load_text(loaded, file);
    EXPECT_EQ(loaded.key_peak(0), source.key_peak(0));
    EXPECT_LE(loaded.value_peak(0), source.value_peak(0) * 1.01f);
    std::vector<float> q(16, 100.0f), out(16);
    kvq::decode_attention(loaded, 0, loaded.length(0) - 1, q, out);
    for (const float y : out) EXPECT_TRUE(std::isfinite(y));
  }
  {  // a key scale of 2e37: codes dequantize to 1.5e38, far past the saved peak
    const auto loaded = load_forged(Piece::scales, Tensor::keys, 2e37f);
    EXPECT_GE(loaded->key_peak(0), 1e38f);
    expect_attention_refused(*loaded, 100.0f, "against keys up to");
  }
  {  // a full-precision value of 1e37, beyond FLT_MAX / 48
    const auto loaded = load_forged(Piece::rows, Tensor::values, 1e37f);
    EXPECT_EQ(loaded->value_peak(0), 1e37f);
    expect_attention_refused(*loaded, 1.0f, "holds stored values up to");
    float row[16];
    loaded->read_row(Tensor::values, 0, 0, 0, row);  // what it holds stays readable
    EXPECT_EQ(row[0], 1e37f);
  }
  {  // the same in the last row of the rollback history, which attention reads only after a truncate
    ASSERT_LT(source.rollback_floor(Tensor::values, 0), source.quantized_end(Tensor::values, 0));
    const auto loaded = load_forged(Piece::rows, Tensor::values, 1e37f, true);
    EXPECT_EQ(loaded->value_peak(0), 1e37f);
    expect_attention_refused(*loaded, 1.0f, "holds stored values up to");
  }
  for (const float peak : {-1.0f, 3e38f}) {  // a key scale of 3e38, finite, whose codes decode to
    // infinity (with the file's peak, or a forged one twice which passes FLT_MAX): refused even
    // for a zero query
    const auto loaded = load_forged(Piece::scales, Tensor::keys, 3e38f, false, peak);
    EXPECT_EQ(loaded->key_peak(0), std::numeric_limits<float>::infinity());
    expect_attention_refused(*loaded, 0.0f, "keys that decode beyond float's range");
  }
}

// A pool file checks a block that sequences share once, for the longest extent any of them uses:
// a piece checked in part before (a shorter sequence first) is checked again in full.
TEST(CacheFile, SharedPiecesAreCheckedForTheirLongestExtent) {
  using Access = kvq::detail::CacheAccess;
  BasicKVCache cache = sample_cache(CacheShape{2, 1, 16, 48}, config_of("k4c8-v2t8o1-r4-s1"), 30, 5);
  const Access::LayerState state = Access::state(cache, 0);
  std::uint8_t* slots = nullptr;
  std::size_t bytes = 0;
  Access::visit_pieces(cache, 0, state, [&](Access::Piece piece, Tensor t, std::size_t n, std::size_t, auto at) {
    if (slots == nullptr && piece == Access::Piece::outlier_slots && t == Tensor::values && n >= 8)
      slots = at(), bytes = n;
  });
  ASSERT_NE(slots, nullptr);
  EXPECT_EQ(Access::check_section(cache, 0, state), "");
  const std::uint16_t outside = 8;
  std::memcpy(slots + bytes - 2, &outside, 2);  // the run's last entry: outside its group of 8
  Access::CheckedPieces checked{{slots, bytes - 2}};
  EXPECT_NE(Access::check_section(cache, 0, state, &checked).find("slot 8"), std::string::npos);
  EXPECT_EQ(checked[slots], bytes);
  EXPECT_EQ(Access::check_section(cache, 0, state, &checked), "");  // checked in full: skipped
  EXPECT_NE(Access::check_section(cache, 0, state).find("outside its group of 8"), std::string::npos);
}

// A stream whose window flushes packs whole flushes of R rows: a file whose key stream ends inside
// one (at a group boundary, within what its length and capacity allow) is refused by name.
TEST(CacheFile, AQuantizedEndInsideAFlushIsRejected) {
  const CacheShape shape{2, 1, 16, 96};
  const CacheConfig config = config_of("k4c8-v2t8-r16-s1-fk-d6");
  BasicKVCache original(shape, config);
  append_random(original, 47, 11);
  const std::string file = saved(original);
  const std::size_t table = 16 + (16 + 104 + kvq::to_string(config).size());  // start of the table section
  std::uint64_t key_end = 0;
  std::memcpy(&key_end, file.data() + table + 20, 8);
  ASSERT_EQ(key_end, 33u);  // layer 0's keys: 1 sink and 2 flushes of 16, where this test patches
  std::string bytes = file;
  // One group of 8 past the second flush, with a rollback history that reaches it (22 rows of
  // copies: from 19), so that only the flush is wrong.
  const std::uint64_t inside = 41, kept_from = 19;
  std::memcpy(bytes.data() + table + 20, &inside, 8);
  std::memcpy(bytes.data() + table + 28, &kept_from, 8);  // the rollback floor
  std::memcpy(bytes.data() + table + 36, &kept_from, 8);  // the first row with a copy
  const std::uint32_t crc = kvq::crc32c(bytes.data() + table, 12 + 2 * 60);
  std::memcpy(bytes.data() + table + 12 + 2 * 60, &crc, 4);
  BasicKVCache target(shape, config);
  expect_load_refused(target, bytes, kvq::ErrorCode::io, {"key quantized end 41 splits a flush of 16"},
                      "a key stream packed inside a flush");
  load_text(target, file);
  EXPECT_EQ(target.stored_bytes(), original.stored_bytes());
}

class DamagedFile : public ::testing::Test {
 protected:
  const CacheShape shape{2, 1, 16, 48};
  const CacheConfig config = config_of("k4c8-v2t8-r4-s1-d6");
  std::string file;
  BasicKVCache target{shape, config};

  void SetUp() override {
    file = saved(sample_cache(shape, config, 20, 11));
    append_random(target, 13, 77);  // a target with contents of its own
  }

  // Loading `bytes` throws kvq::Error with `code` (mentioning `needle`) and leaves the target as it was.
  void expect_rejected(const std::string& bytes, kvq::ErrorCode code, const std::string& needle,
                       const std::string& what) {
    expect_load_refused(target, bytes, code, {needle}, what);
    std::istringstream in(bytes, std::ios::binary);
    EXPECT_THROW((void)kvq::load(in), kvq::Error) << what;
  }
};

TEST_F(DamagedFile, EveryTruncationThrowsIo) {
  ASSERT_GT(file.size(), 500u);
  for (std::size_t n = 0; n < file.size(); ++n) {
    expect_rejected(file.substr(0, n), kvq::ErrorCode::io, "offset", "truncated to " + std::to_string(n));
    if (HasFailure()) return;
  }
  expect_rejected(file + "x", kvq::ErrorCode::io, "after the last section", "one byte appended");
}

TEST_F(DamagedFile, EveryBitFlipThrowsIo) {
  for (std::size_t i = 0; i < file.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      std::string bytes = file;
      bytes[i] = char(bytes[i] ^ (1 << bit));
      expect_rejected(bytes, kvq::ErrorCode::io, "offset",
                      "bit " + std::to_string(bit) + " of byte " + std::to_string(i));
      if (HasFailure()) return;
    }
}

TEST_F(DamagedFile, ForeignPreambleNamesWhatIsWrong) {
  std::string bytes = file;
  bytes[0] = 'X';
  expect_rejected(bytes, kvq::ErrorCode::io, "wrong magic", "magic");
  bytes = file;
  bytes[8] = 3;
  expect_rejected(bytes, kvq::ErrorCode::io, "format version 3; this kvq reads versions 1 to 2", "version");
  bytes[8] = 0;
  expect_rejected(bytes, kvq::ErrorCode::io, "format version 0", "version 0");
  bytes = file;
  std::swap(bytes[12], bytes[15]);
  std::swap(bytes[13], bytes[14]);
  expect_rejected(bytes, kvq::ErrorCode::io, "other byte order", "byte order");
  expect_rejected("", kvq::ErrorCode::io, "section 'preamble' at offset 0", "empty");
}

// A section whose CRC is right but whose table claims more than the file holds: a string stream
// is measured first, so it is refused before any block is taken (LoadMemory tests a stream that
// cannot be measured).
TEST_F(DamagedFile, ForgedTableWithAValidCrcIsRejected) {
  const std::size_t table = 16 + (16 + 104 + kvq::to_string(config).size());  // start of the table section
  std::string bytes = file;
  auto put_u64 = [&](std::size_t at, std::uint64_t x) { std::memcpy(bytes.data() + at, &x, 8); };
  auto fix_crc = [&] {
    const std::uint32_t crc = kvq::crc32c(bytes.data() + table, 12 + 2 * 60);
    std::memcpy(bytes.data() + table + 12 + 2 * 60, &crc, 4);
  };
  // layer 0: the whole capacity, with the quantized ends, floors and copies that length would have
  const kvq::StreamLayout &k = target.layout(Tensor::keys), &v = target.layout(Tensor::values);
  put_u64(table + 12, 48);
  put_u64(table + 20, k.quantized_end(48));
  put_u64(table + 28, k.quantized_end(48) - k.history_rows);
  put_u64(table + 36, k.quantized_end(48) - k.history_rows);
  put_u64(table + 44, v.quantized_end(48));
  put_u64(table + 52, v.quantized_end(48) - v.history_rows);
  put_u64(table + 60, v.quantized_end(48) - v.history_rows);
  fix_crc();
  expect_rejected(bytes, kvq::ErrorCode::io, "section 'layer 0'", "a layer longer than its payload");
  put_u64(table + 12, 49);
  fix_crc();
  expect_rejected(bytes, kvq::ErrorCode::io, "exceeds the capacity", "a layer longer than the capacity");
  put_u64(table + 12, 48);
  put_u64(table + 20, 9);  // not a group boundary and below what 48 tokens quantize
  fix_crc();
  expect_rejected(bytes, kvq::ErrorCode::io, "key quantized end 9 is impossible", "an impossible quantized end");
  bytes = file;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bytes.data() + table + 12 + 56, &nan, 4);  // layer 0's key peak
  fix_crc();
  expect_rejected(bytes, kvq::ErrorCode::io, "key peak", "a key peak that is not a magnitude");
}

TEST_F(DamagedFile, AnotherShapeOrConfigIsAShapeMismatch) {
  auto expect_mismatch = [&](const CacheShape& s, const CacheConfig& c, const std::string& needle) {
    BasicKVCache other(s, c);
    append_random(other, 9, 5);
    expect_load_refused(other, file, kvq::ErrorCode::shape_mismatch, {needle}, needle);
  };
  expect_mismatch(CacheShape{3, 1, 16, 48}, config, "3 layers");
  expect_mismatch(CacheShape{2, 2, 16, 48}, config, "2 KV heads");
  expect_mismatch(CacheShape{2, 1, 32, 48}, config, "head_dim 32");
  expect_mismatch(CacheShape{2, 1, 16, 64}, config, "capacity 64");
  expect_mismatch(CacheShape{2, 1, 16, 48, kvq::RopeStyle::half_split}, config, "half_split");
  expect_mismatch(CacheShape{2, 1, 16, 48, kvq::RopeStyle::adjacent_pairs, 500000.0f}, config, "500000");
  CacheShape partial = shape;
  partial.rope_dims = 8;
  expect_mismatch(partial, config, "rotary dims 8");
  CacheShape scaled = shape;
  scaled.rope_scaling.type = kvq::RopeScalingType::linear, scaled.rope_scaling.factor = 2.0f;
  expect_mismatch(scaled, config, "linear scaling");
  expect_mismatch(shape, config_of("k4c8-v2t8-r4-s1"), "configured 'k4c8-v2t8-r4-s1-d6'");
  expect_mismatch(shape, config_of("k4c8-v2t8-r4-s1-post-d6"), "configured 'k4c8-v2t8-r4-s1-post-d6'");
}

// Random damage of every kind: each load either succeeds or throws kvq::Error, never crashes or
// reads out of bounds (the ASan build checks), and a failed load changes nothing.
TEST_F(DamagedFile, MutationFuzzOnlySucceedsOrThrows) {
  std::mt19937 rng(20261201);
  std::size_t loaded = 0, rejected = 0;
  load_text(target, file);  // the state every failed load must leave
  const auto before = snapshot(target);
  for (int iteration = 0; iteration < 20000; ++iteration) {
    std::string bytes = file;
    const int mutations = 1 + int(rng() % 4);
    for (int m = 0; m < mutations; ++m) {
      const std::size_t at = bytes.empty() ? 0 : rng() % bytes.size();
      switch (rng() % 5) {
        case 0:
          if (!bytes.empty()) bytes[at] = char(rng());
          break;
        case 1:
          bytes.insert(bytes.begin() + std::ptrdiff_t(at), char(rng()));
          break;
        case 2:
          if (!bytes.empty()) bytes.erase(at, 1 + rng() % 16);
          break;
        case 3:
          bytes.resize(at);
          break;
        default:
          if (!bytes.empty()) bytes[at] = char(bytes[at] ^ (1 << (rng() % 8)));
          break;
      }
    }
    const bool into_target = iteration % 2 == 0;
    try {
      if (into_target) {
        load_text(target, bytes);
        load_text(target, file);  // back to a known state for the next check
      } else {
        std::istringstream in(bytes, std::ios::binary);
        (void)kvq::load(in);
      }
      ++loaded;
    } catch (const kvq::Error&) {
      ++rejected;
      if (into_target && iteration % 16 == 0) {
        EXPECT_TRUE(snapshot(target) == before) << "iteration " << iteration;
      }
    }
  }
  EXPECT_EQ(loaded + rejected, 20000u);
  EXPECT_GT(rejected, 19000u);
}

}  // namespace
