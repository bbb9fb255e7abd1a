// KVPool with real threads (and under ThreadSanitizer, preset tsan): appends to different
// sequences, and attention over one sequence while others append and the pool reports memory;
// and as an engine's workers drive it: appends, rollbacks and attention on different sequences
// while other threads add, fork and remove sequences, in a pool whose limit refuses some of them;
// and loads while another thread fills the pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/cache_state.hpp"
#include "support/random.hpp"

namespace {

/// Two layers of 2 KV heads x 64, up to 1024 positions in blocks of 64.
kvq::PoolShape small_shape() {
  kvq::PoolShape shape;
  shape.layers = 2;
  shape.kv_heads = 2;
  shape.head_dim = 64;
  shape.max_tokens = 1024;
  shape.block_tokens = 64;
  return shape;
}

TEST(KVPoolThreads, AppendsToDifferentSequencesAndAttentionRunConcurrently) {
  kvq::PoolShape shape = small_shape();
  const kvq::CacheConfig config = kvq::parse_cache_config("k4c32-v2t32-r16-s1");
  kvq::KVPool pool(shape, config);
  const std::size_t threads = 3, n = 400, row = 128;
  std::vector<kvq::SequenceId> ids;
  std::vector<std::vector<float>> keys, values;
  for (std::size_t i = 0; i < threads; ++i) {
    ids.push_back(pool.add_sequence());
    keys.push_back(kvq::test::normal_vector(n * row, unsigned(10 + i)));
    values.push_back(kvq::test::normal_vector(n * row, unsigned(20 + i)));
  }
  // A finished sequence that a reader attends to throughout.
  const kvq::SequenceId read = pool.add_sequence();
  for (std::size_t l = 0; l < 2; ++l) pool.append(read, l, 0, keys[0], values[0]);
  const auto q = kvq::test::normal_vector(4 * 64, 30);
  std::vector<float> before(q.size());
  kvq::decode_attention(pool.sequence(read), 1, n - 1, q, before);

  std::vector<std::thread> workers;
  for (std::size_t i = 0; i < threads; ++i)
    workers.emplace_back([&, i] {
      for (std::size_t p = 0; p < n; p += 25)
        for (std::size_t l = 0; l < 2; ++l)
          pool.append(ids[i], l, p, std::span(keys[i]).subspan(p * row, 25 * row),
                      std::span(values[i]).subspan(p * row, 25 * row));
      (void)pool.memory();
    });
  std::vector<float> during(q.size());
  for (int r = 0; r < 20; ++r) {
    kvq::decode_attention(pool.sequence(read), 1, n - 1, q, during);
    EXPECT_EQ(during, before);
  }
  for (auto& w : workers) w.join();
  for (std::size_t i = 0; i < threads; ++i) {
    kvq::BasicKVCache alone(pool.shape().sequence_shape(), config);
    for (std::size_t l = 0; l < 2; ++l) alone.append(l, 0, keys[i], values[i]);
    EXPECT_TRUE(pool.sequence(ids[i]).stored_bytes() == alone.stored_bytes()) << "sequence " << i;
  }
}

constexpr std::size_t kLayers = 2, kHeads = 8, kDim = 128, kRow = kHeads * kDim, kDepth = 16;

/// One sequence as its thread knows it: each layer's tokens (a refused append may leave the
/// layers at different lengths) and the longest each has held, which bounds an exact rollback.
struct Model {
  kvq::SequenceId id = 0;
  std::vector<float> keys[kLayers], values[kLayers];
  std::size_t longest[kLayers] = {};
  std::size_t length(std::size_t l) const { return keys[l].size() / kRow; }
  std::size_t shortest() const { return std::min(length(0), length(1)); }
  std::size_t exact_floor() const {  // shortest length every layer can roll back to exactly
    const std::size_t most = std::max(longest[0], longest[1]);
    return most > kDepth ? most - kDepth : 0;
  }
  void cut(std::size_t n) {
    for (std::size_t l = 0; l < kLayers; ++l)
      if (length(l) > n) {
        keys[l].resize(n * kRow);
        values[l].resize(n * kRow);
      }
  }
};

// Every refused call changes nothing, every sequence left holds what a cache of its own fed the
// same tokens holds, and every block and charge comes back.
TEST(KVPoolThreads, SequencesOfManyThreadsEqualCachesOfTheirOwn) {
  const kvq::CacheConfig config = kvq::parse_cache_config("k4c32-v2t32-r16-s1");
  kvq::PoolShape shape;
  shape.layers = kLayers;
  shape.kv_heads = kHeads;
  shape.head_dim = kDim;
  shape.max_tokens = 1024;
  shape.block_tokens = 64;
  shape.memory_blocks = 160;  // five slabs, about a dozen sequences: the threads ask for more
  kvq::KVPool pool(shape, config);
  constexpr int kThreads = 4, kSteps = 120;
  std::vector<std::vector<Model>> kept(kThreads);
  std::atomic<int> refused{0};

  auto work = [&](int t) {
    std::mt19937 rng(unsigned(500 + t));
    std::normal_distribution<float> normal;
    std::vector<Model>& mine = kept[t];
    const auto q = kvq::test::normal_vector(2 * kRow, unsigned(31 + t), 0.3f);
    std::vector<float> out(q.size());
    for (int step = 0; step < kSteps; ++step) {
      const auto op = static_cast<unsigned>(rng() % 10);
      try {
        if (mine.empty() || op == 0) {
          Model m;
          m.id = pool.add_sequence();
          mine.push_back(std::move(m));
          continue;
        }
        const std::size_t pick = rng() % mine.size();
        Model& s = mine[pick];
        if (op == 1) {
          pool.remove_sequence(s.id);
          mine.erase(mine.begin() + std::ptrdiff_t(pick));
        } else if (op <= 6) {  // 1 to 40 tokens, layer by layer
          const std::size_t add = 1 + rng() % 40;
          for (std::size_t l = 0; l < kLayers; ++l) {
            const std::size_t n = s.length(l);
            if (n + add > shape.max_tokens) break;
            std::vector<float> k(add * kRow), v(add * kRow);
            for (float& x : k) x = normal(rng);
            for (float& x : v) x = normal(rng);
            pool.append(s.id, l, n, k, v);  // a refusal here leaves the layers as they were
            s.keys[l].insert(s.keys[l].end(), k.begin(), k.end());
            s.values[l].insert(s.values[l].end(), v.begin(), v.end());
            s.longest[l] = std::max(s.longest[l], s.length(l));
          }
        } else if (op == 7 || op == 8) {  // an exact rollback, or a fork at an exact length
          const std::size_t low = s.exact_floor(), high = s.shortest();
          if (low > high || high == 0) continue;
          const std::size_t length = low + rng() % (high - low + 1);
          if (op == 7) {
            pool.truncate(s.id, length);
            s.cut(length);
          } else {
            Model child = s;
            child.id = pool.fork(s.id, length);
            child.cut(length);
            mine.push_back(std::move(child));
          }
        } else if (s.length(0) > 0) {  // attention while other threads write
          const auto view = pool.layer(s.id, 0);
          kvq::decode_attention(view.cache, view.layer, s.length(0) - 1, q, out);
          for (const float x : out) ASSERT_TRUE(std::isfinite(x));
        }
      } catch (const kvq::Error& e) {
        if (e.code() != kvq::ErrorCode::capacity_exceeded) ADD_FAILURE() << "thread " << t << ": " << e.what();
        ++refused;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (std::thread& th : threads) th.join();

  EXPECT_GT(refused.load(), 0) << "the limit never refused: the test did not reach it";
  EXPECT_LE(pool.blocks().counts().in_use + pool.blocks().counts().charged, shape.memory_blocks);
  std::size_t sequences = 0;
  for (const auto& mine : kept)
    for (const Model& s : mine) {
      ++sequences;
      kvq::BasicKVCache own(pool.shape().sequence_shape(), config);
      for (std::size_t l = 0; l < kLayers; ++l)
        if (s.length(l) > 0) own.append(l, 0, s.keys[l], s.values[l]);
      kvq::test::expect_same_state(pool.sequence(s.id), own, "sequence " + std::to_string(s.id));
    }
  EXPECT_EQ(pool.sequence_count(), sequences);
  for (const auto& mine : kept)
    for (const Model& s : mine) pool.remove_sequence(s.id);
  EXPECT_EQ(pool.blocks().counts().in_use, 0u);
  EXPECT_EQ(pool.blocks().counts().charged, 0u);
  EXPECT_EQ(pool.blocks().available(), shape.memory_blocks);
}

// A load reserves its blocks and its sequence's own rows before it reads the first block: while
// another thread fills the pool and empties it again, a load is refused up front or not at all
// (never by a block it could not take midway, "needs another block"), and what it loads equals
// what was saved. Both files: a pool file (save_sequence) and a cache file (save).
TEST(KVPoolThreads, LoadsAreRefusedUpFrontOrNotAtAll) {
  const kvq::CacheConfig config = kvq::parse_cache_config("k4c32-v2t32-r16-s1");
  kvq::PoolShape shape = small_shape();
  shape.memory_blocks = 80;  // one saved sequence (32 blocks) and a filler
  kvq::KVPool pool(shape, config);
  const std::size_t row = 2 * 64;
  std::string files[2];
  std::vector<std::uint8_t> saved_bytes;
  {
    const kvq::SequenceId id = pool.add_sequence();
    for (std::size_t l = 0; l < 2; ++l)
      pool.append(id, l, 0, kvq::test::normal_vector(1000 * row, unsigned(40 + l)),
                  kvq::test::normal_vector(1000 * row, unsigned(50 + l)));
    std::ostringstream pool_file, cache_file;
    pool.save_sequence(id, pool_file);
    kvq::save(pool.sequence(id), cache_file);
    files[0] = pool_file.str();
    files[1] = cache_file.str();
    saved_bytes = pool.sequence(id).stored_bytes();
    pool.remove_sequence(id);
  }
  std::atomic<bool> done{false};
  std::thread filler([&] {  // a sequence grown until the pool refuses it, then removed
    const auto k = kvq::test::normal_vector(64 * row, 60), v = kvq::test::normal_vector(64 * row, 61);
    while (!done.load()) {
      try {
        const kvq::SequenceId id = pool.add_sequence();
        try {
          for (std::size_t p = 0; p + 64 <= shape.max_tokens; p += 64)
            for (std::size_t l = 0; l < 2; ++l) pool.append(id, l, p, k, v);
        } catch (const kvq::Error& e) {
          if (e.code() != kvq::ErrorCode::capacity_exceeded) ADD_FAILURE() << "filler: " << e.what();
        }
        pool.remove_sequence(id);
      } catch (const kvq::Error& e) {
        if (e.code() != kvq::ErrorCode::capacity_exceeded) ADD_FAILURE() << "filler: " << e.what();
      }
    }
  });
  int loaded = 0, refused = 0;
  for (int i = 0; i < 20000 && (loaded < 30 || refused < 30); ++i) {  // until both have happened often
    std::istringstream in(files[i % 2]);
    try {
      const kvq::SequenceId id = pool.load_sequence(in);
      ++loaded;
      EXPECT_TRUE(pool.sequence(id).stored_bytes() == saved_bytes) << "load " << i;
      pool.remove_sequence(id);
    } catch (const kvq::Error& e) {
      ++refused;
      EXPECT_EQ(e.code(), kvq::ErrorCode::capacity_exceeded) << e.what();
      EXPECT_EQ(std::string(e.what()).find("another block"), std::string::npos) << "load " << i << ": " << e.what();
    }
  }
  done = true;
  filler.join();
  EXPECT_GT(loaded, 0);
  EXPECT_GT(refused, 0) << "the filler never left too little room: the test did not reach the limit";
  EXPECT_EQ(pool.sequence_count(), 0u);
  EXPECT_EQ(pool.blocks().counts().in_use, 0u);
  EXPECT_EQ(pool.blocks().counts().charged, 0u);
  EXPECT_EQ(pool.blocks().available(), shape.memory_blocks) << "a reservation was left behind";
}

}  // namespace
