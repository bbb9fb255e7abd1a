// LayeredKVCache: one configuration per layer. Each layer holds exactly what a cache of its
// configuration holds after the same tokens; errors name the layer; truncate is all-or-nothing;
// the per-layer text reads back as itself and names what is wrong.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvq/attention/decode.hpp"
#include "kvq/attention/reference.hpp"
#include "kvq/cache/layered_kv_cache.hpp"
#include "kvq/cache/serialize.hpp"

namespace {

kvq::CacheShape shape(std::size_t layers) {
  return kvq::CacheShape{.layers = layers, .kv_heads = 2, .head_dim = 24, .capacity = 200};
}

std::vector<float> random_rows(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

const std::vector<kvq::CacheConfig> mixed =
    kvq::parse_layer_configs("k8c32-v4t24-r16-s2;k2c32-v2t24-r0-s0;k16-v16-r0-s0-f32;k4c32-v2t24-r32-s0-post", 4);

TEST(LayeredKVCache, EachLayerHoldsWhatACacheOfItsConfigurationHolds) {
  kvq::LayeredKVCache layered(shape(4), mixed);
  std::vector<kvq::BasicKVCache> alone;
  for (const kvq::CacheConfig& c : mixed) alone.emplace_back(shape(1), c);
  std::mt19937 rng(3);
  const std::size_t row = 2 * 24;
  for (std::size_t position = 0; position < 150;) {
    const std::size_t tokens = 1 + rng() % 9;
    for (std::size_t l = 0; l < 4; ++l) {
      const auto k = random_rows(tokens * row, rng), v = random_rows(tokens * row, rng);
      layered.append(l, position, k, v);
      alone[l].append(0, position, k, v);
    }
    position += tokens;
  }
  kvq::MemoryUsage sum;
  for (std::size_t l = 0; l < 4; ++l) {
    EXPECT_EQ(layered.config(l), mixed[l]);
    EXPECT_EQ(layered.length(l), alone[l].length(0));
    EXPECT_EQ(layered.layer(l).stored_bytes(), alone[l].stored_bytes()) << "layer " << l;
    sum += alone[l].memory();
  }
  EXPECT_EQ(layered.memory().total_bytes(), sum.total_bytes());
  EXPECT_EQ(layered.memory().values, sum.values);
  // Layers differ: the 2-bit layer is the smallest, the f32 one the largest.
  EXPECT_LT(alone[1].memory().total_bytes(), alone[0].memory().total_bytes());
  EXPECT_GT(alone[2].memory().total_bytes(), alone[0].memory().total_bytes());

  // A uniform configuration holds what one multi-layer cache holds, layer by layer.
  kvq::LayeredKVCache uniform(shape(3), mixed[0]);
  kvq::BasicKVCache together(shape(3), mixed[0]);
  for (std::size_t l = 0; l < 3; ++l) {
    const auto k = random_rows(40 * row, rng), v = random_rows(40 * row, rng);
    uniform.append(l, 0, k, v);
    together.append(l, 0, k, v);
  }
  EXPECT_EQ(uniform.memory().total_bytes(), together.memory().total_bytes());
  for (std::size_t l = 0; l < 3; ++l)
    for (std::size_t p = 0; p < 40; p += 13) {
      std::vector<float> a(24), b(24);
      uniform.layer(l).read_row(kvq::Tensor::keys, 0, 1, p, a.data());
      together.read_row(kvq::Tensor::keys, l, 1, p, b.data());
      EXPECT_EQ(a, b) << "layer " << l << " position " << p;
    }
}

TEST(LayeredKVCache, ErrorsNameTheLayerAndChangeNothing) {
  std::vector<kvq::CacheConfig> configs = mixed;
  configs[3].window = 0;          // layer 3 packs every complete group at once
  configs[3].rollback_depth = 0;  // and cannot re-open what it packed
  kvq::LayeredKVCache cache(shape(4), configs);
  std::mt19937 rng(5);
  const std::size_t row = 2 * 24;
  for (std::size_t l = 0; l < 4; ++l) cache.append(l, 0, random_rows(100 * row, rng), random_rows(100 * row, rng));

  std::vector<std::vector<std::uint8_t>> before;
  for (std::size_t l = 0; l < 4; ++l) before.push_back(cache.layer(l).stored_bytes());
  try {
    cache.truncate(90);  // re-opens [64, 96) in layer 3, which kept no rows to do it with
    FAIL() << "truncate past layer 3's reach succeeded";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("layer 3"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("layer 0"), std::string::npos) << e.what();
  }
  for (std::size_t l = 0; l < 4; ++l) {
    EXPECT_EQ(cache.length(l), 100u);
    EXPECT_EQ(cache.layer(l).stored_bytes(), before[l]) << "layer " << l;
  }
  cache.truncate(98);  // within every layer's reach
  for (std::size_t l = 0; l < 4; ++l) EXPECT_EQ(cache.length(l), 98u);

  // A context shift that layer 3 refuses (its post-RoPE keys would keep their old rotation):
  // named, nothing erased in any layer.
  for (std::size_t l = 0; l < 4; ++l) before[l] = cache.layer(l).stored_bytes();
  try {
    cache.erase(96, 1);  // past every packed group, so only the post-RoPE rule can refuse it
    FAIL() << "layer 3 shifted post-RoPE keys";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("layer 3"), std::string::npos) << e.what();
  }
  for (std::size_t l = 0; l < 4; ++l) EXPECT_EQ(cache.layer(l).stored_bytes(), before[l]) << "layer " << l;

  auto bad = random_rows(2 * row, rng);
  bad[5] = std::numeric_limits<float>::quiet_NaN();
  try {
    cache.append(2, 98, bad, random_rows(2 * row, rng));
    FAIL() << "a NaN key was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 2"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("layer 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.length(2), 98u);
  EXPECT_THROW(cache.append(4, 98, random_rows(row, rng), random_rows(row, rng)), kvq::Error);
  EXPECT_THROW((void)cache.layer(4), kvq::Error);
  EXPECT_THROW(kvq::LayeredKVCache(shape(3), mixed), kvq::Error);  // four configurations, three layers
  EXPECT_THROW(kvq::LayeredKVCache(shape(0), std::vector<kvq::CacheConfig>{}), kvq::Error);  // no layer at all
  // A layer count beyond any model is refused before anything is sized by it.
  for (const std::size_t layers : {kvq::LayeredKVCache::max_layers + 1, std::size_t(1) << 60}) {
    try {
      const kvq::LayeredKVCache huge(shape(layers), mixed[0]);
      ADD_FAILURE() << layers << " layers were accepted";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::to_string(layers) + " layers"), std::string::npos) << e.what();
    }
  }
  std::vector<kvq::CacheConfig> too_wide = mixed;
  too_wide[1].value.group = 32;  // per-token groups wider than head_dim 24
  try {
    kvq::LayeredKVCache c(shape(4), too_wide);
    FAIL() << "a group wider than the head was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1"), std::string::npos) << e.what();
  }
}

// A RoPE per layer (Gemma 3: theta 10,000 on local layers, 1,000,000 with linear scaling 8 on
// global ones): each layer attends as a cache of its own RoPE, bit for bit, and layers of equal
// RoPE share a table.
TEST(LayeredKVCache, EachLayerRotatesAsItsOwnRope) {
  const kvq::CacheShape base = shape(3);
  kvq::RopeConfig local = base.rope(), global = base.rope();
  global.theta = 1.0e6f;
  global.scaling.type = kvq::RopeScalingType::linear;
  global.scaling.factor = 8.0f;
  const std::vector<kvq::RopeConfig> ropes = {local, global, local};
  const std::vector<kvq::CacheConfig> configs(3, kvq::parse_cache_config("k4c32-v2t24-r16-s1"));  // pre-RoPE
  kvq::LayeredKVCache layered(base, configs, ropes);
  EXPECT_EQ(&layered.rope(0), &layered.rope(2));
  EXPECT_NE(&layered.rope(0), &layered.rope(1));
  EXPECT_THROW((void)layered.rope(), kvq::Error) << "the layers rotate differently: no one table";
  EXPECT_EQ(layered.rope(1).config(), global);
  EXPECT_EQ(layered.layer(1).shape().rope_theta, 1.0e6f);

  std::mt19937 rng(9);
  const std::size_t row = 2 * 24, length = 150, heads = 4;
  const auto k = random_rows(length * row, rng), v = random_rows(length * row, rng);
  const auto q = random_rows(heads * 24, rng);
  std::vector<std::vector<float>> outputs;
  for (std::size_t l = 0; l < 3; ++l) {
    layered.append(l, 0, k, v);
    kvq::CacheShape own = shape(1);
    own.rope_theta = ropes[l].theta;
    own.rope_scaling = ropes[l].scaling;
    kvq::BasicKVCache alone(own, configs[l]);
    alone.append(0, 0, k, v);
    std::vector<float> got(q.size()), want(q.size());
    kvq::decode_attention(layered.layer(l), 0, length - 1, q, got);
    kvq::decode_attention(alone, 0, length - 1, q, want);
    EXPECT_EQ(got, want) << "layer " << l;
    outputs.push_back(got);
  }
  EXPECT_EQ(outputs[0], outputs[2]);
  double moved = 0;  // the same tokens under the global RoPE attend elsewhere
  for (std::size_t i = 0; i < q.size(); ++i) moved = std::max(moved, double(std::abs(outputs[1][i] - outputs[0][i])));
  EXPECT_GT(moved, 1e-3);

  // One RoPE short, one for another head_dim, one the RoPE refuses: errors name what and where.
  try {
    kvq::LayeredKVCache c(base, configs, std::span(ropes).first(2));
    ADD_FAILURE() << "accepted 2 RoPE configurations for 3 layers";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::shape_mismatch);
    EXPECT_NE(std::string(e.what()).find("2 RoPE configurations for 3 layers"), std::string::npos) << e.what();
  }
  const kvq::LayeredKVCache shared(base, configs);  // one RoPE: one table for every layer
  EXPECT_EQ(&shared.rope(), &shared.rope(0));
  EXPECT_EQ(&shared.rope(0), &shared.rope(2));
  for (const auto& [broken, part] : {std::pair{std::size_t(1), "layer 1's RoPE is for head_dim 32"},
                                     std::pair{std::size_t(2), "layer 2: RoPE theta"}}) {
    std::vector<kvq::RopeConfig> bad = ropes;
    if (broken == 1)
      bad[1].head_dim = 32;
    else
      bad[2].theta = 0.5f;
    try {
      kvq::LayeredKVCache c(base, configs, bad);
      ADD_FAILURE() << "accepted: " << part;
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
}

// A layer without RoPE (Llama 4's NoPE layers): RopeStyle::none and keys stored as given (-post).
// Its keys carry no position, so erase() shifts it with the rotated layers (a post-RoPE layer of
// a rotating RoPE still refuses): every later row moves down unchanged, and attention over it
// stays on the oracle. Stored pre-RoPE it is refused by name; its table rotates nothing; a cache
// file keeps the style.
TEST(LayeredKVCache, LayersWithoutRopeShiftWithTheOthers) {
  const kvq::CacheShape base = shape(3);
  const kvq::RopeConfig rotated = base.rope(), none{.head_dim = base.head_dim, .style = kvq::RopeStyle::none};
  const std::vector<kvq::RopeConfig> ropes = {rotated, none, rotated};
  const kvq::CacheConfig pre = kvq::parse_cache_config("k4c32-v2t24-r16-s1"),
                         post = kvq::parse_cache_config("k4c32-v2t24-r16-s1-post");
  kvq::LayeredKVCache layered(base, {pre, post, pre}, ropes);
  EXPECT_EQ(layered.rope(1).pairs(), 0u);
  std::mt19937 rng(13);
  const std::size_t row = 2 * 24, length = 170, first = 33, count = 64, heads = 4;
  const auto k = random_rows(length * row, rng), v = random_rows(length * row, rng);
  for (std::size_t l = 0; l < 3; ++l) layered.append(l, 0, k, v);
  auto rows = [&](const kvq::BasicKVCache& c) {
    std::vector<float> all(2 * 2 * c.length(0) * 24);
    float* out = all.data();
    for (const kvq::Tensor t : {kvq::Tensor::keys, kvq::Tensor::values})
      for (std::size_t h = 0; h < 2; ++h)
        for (std::size_t p = 0; p < c.length(0); ++p, out += 24) c.read_row(t, 0, h, p, out);
    return all;
  };
  const std::vector<float> before = rows(layered.layer(1));
  layered.erase(first, count);
  ASSERT_EQ(layered.length(1), length - count);
  const std::vector<float> after = rows(layered.layer(1));
  for (std::size_t block = 0; block < 4; ++block)  // per tensor and head: the rows kept, in order
    for (std::size_t p = 0; p < length - count; ++p)
      for (std::size_t c = 0; c < 24; ++c) {
        const std::size_t from = p < first ? p : p + count;
        ASSERT_EQ(after[(block * (length - count) + p) * 24 + c], before[(block * length + from) * 24 + c])
            << "tensor/head " << block << " position " << p;
      }
  const auto q = random_rows(heads * 24, rng);
  for (const std::size_t l : {0u, 1u}) {
    std::vector<float> got(q.size()), oracle(q.size());
    kvq::decode_attention(layered.layer(l), 0, length - count - 1, q, got);
    kvq::reference_attention(layered.layer(l), 0, length - count - 1, q, oracle);
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < q.size(); ++i)
      worst = std::max(worst, double(std::abs(got[i] - oracle[i]))),
      scale = std::max(scale, double(std::abs(oracle[i])));
    EXPECT_LT(worst, 1e-5 * std::max(scale, 1.0)) << "layer " << l;
  }

  // A rotating RoPE with post-RoPE keys still refuses; nothing moves.
  kvq::LayeredKVCache rotated_post(base, {pre, post, pre});
  for (std::size_t l = 0; l < 3; ++l) rotated_post.append(l, 0, k, v);
  try {
    rotated_post.erase(first, count);
    ADD_FAILURE() << "a post-RoPE layer of a rotating RoPE shifted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("post-RoPE"), std::string::npos) << e.what();
  }
  EXPECT_EQ(rotated_post.length(0), length);

  // Pre-RoPE keys under no RoPE are refused; a none RoPE takes no rotary dims or scaling.
  try {
    kvq::LayeredKVCache c(base, {pre, pre, pre}, ropes);
    ADD_FAILURE() << "pre-RoPE keys without RoPE accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1: cache config k4c32-v2t24-r16-s1 stores keys pre-RoPE"),
              std::string::npos)
        << e.what();
  }
  kvq::RopeConfig bad = none;
  bad.rotary_dims = 8;
  EXPECT_THROW(kvq::RopeTable(bad, 16), kvq::Error);

  // The table rotates nothing; a cache file keeps the style.
  std::vector<float> x(24, 1.5f), y = x;
  layered.rope(1).rotate(y.data(), 77);
  EXPECT_EQ(x, y);
  std::stringstream file;
  kvq::save(layered.layer(1), file);
  const kvq::BasicKVCache loaded = kvq::load(file);
  EXPECT_EQ(loaded.shape().rope_style, kvq::RopeStyle::none);
  EXPECT_EQ(loaded.stored_bytes(), layered.layer(1).stored_bytes());
}

TEST(LayerConfigs, TextReadsBackAndNamesWhatIsWrong) {
  const std::string text = kvq::to_string(std::span<const kvq::CacheConfig>(mixed));
  EXPECT_EQ(text, "k8c32-v4t24-r16-s2;k2c32-v2t24-r0-s0;k16-v16-r0-s0-f32;k4c32-v2t24-r32-s0-post");
  EXPECT_EQ(kvq::parse_layer_configs(text), mixed);
  const auto runs = kvq::parse_layer_configs("k4c32-v2t32-r0-s0*3;k8c32-v8t32-r0-s0;k4c32-v2t32-r0-s0*2");
  ASSERT_EQ(runs.size(), 6u);
  EXPECT_EQ(runs[0], runs[2]);
  EXPECT_NE(runs[2], runs[3]);
  EXPECT_EQ(kvq::to_string(std::span<const kvq::CacheConfig>(runs)),
            "k4c32-v2t32-r0-s0*3;k8c32-v8t32-r0-s0;k4c32-v2t32-r0-s0*2");
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "item 1 is empty"},
      {"k4c32-v2t32-r0-s0;", "item 2 is empty"},
      {"k4c32-v2t32-r0-s0*0", "'*' needs a count"},
      {"k4c32-v2t32-r0-s0*", "'*' needs a count"},
      {"k4c32-v2t32-r0-s0*2x", "'*' needs a count"},
      {"k4c32-v2t32-r0-s0*99999999999999999999", "'*' needs a count"},
      {"k4c32-v2t32-r0-s0;k4x32-v2t32-r0-s0", "item 2"},
  };
  for (const auto& [input, expected] : bad) {
    try {
      (void)kvq::parse_layer_configs(input);
      ADD_FAILURE() << "'" << input << "' was accepted";
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << input << ": " << e.what();
    }
  }
  try {
    (void)kvq::parse_layer_configs("k4c32-v2t32-r0-s0*3", 5);
    ADD_FAILURE() << "three layers accepted for five";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("names 3 layers; the model has 5"), std::string::npos) << e.what();
  }
}

}  // namespace
