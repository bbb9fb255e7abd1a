// KVPool with real threads (and under ThreadSanitizer, preset tsan): appends to different
// sequences, and attention over one sequence while others append and the pool reports memory.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/random.hpp"

namespace {

TEST(KVPoolThreads, AppendsToDifferentSequencesAndAttentionRunConcurrently) {
  kvq::PoolShape shape;
  shape.layers = 2;
  shape.kv_heads = 2;
  shape.head_dim = 64;
  shape.max_tokens = 1024;
  shape.block_tokens = 64;
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

}  // namespace
