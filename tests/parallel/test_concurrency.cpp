// Concurrency, with real threads: ThreadPool with nested and independent callers, appends to
// different layers of one cache, and const operations (attention) on one cache from many threads.
// The concurrency label runs these under ThreadSanitizer too (preset tsan).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <mutex>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kvq/attention/decode.hpp"
#include "kvq/kvq.hpp"
#include "kvq/parallel/executor.hpp"
#include "support/random.hpp"

namespace {

using namespace std::chrono_literals;

// Runs fn on its own thread; a deadlock fails the test after `limit` instead of hanging it.
template <class F>
void within(std::chrono::seconds limit, F fn) {
  std::packaged_task<void()> task(fn);
  auto done = task.get_future();
  std::thread runner(std::move(task));
  if (done.wait_for(limit) == std::future_status::timeout) {
    std::fprintf(stderr, "deadlock: no progress within %lld s\n", static_cast<long long>(limit.count()));
    std::_Exit(1);  // the stuck threads cannot be joined
  }
  runner.join();
  done.get();
}

TEST(ThreadPoolConcurrency, NestedParallelForRunsInlineOnTheCallingThread) {
  within(60s, [] {
    kvq::ThreadPool pool(4);
    constexpr std::size_t outer = 16, inner = 7;
    std::vector<std::thread::id> outer_thread(outer);
    std::vector<std::vector<std::thread::id>> inner_thread(outer, std::vector<std::thread::id>(inner));
    std::vector<std::atomic<int>> runs(outer * inner);
    auto outer_task = [&](std::size_t i) {
      outer_thread[i] = std::this_thread::get_id();
      auto inner_task = [&](std::size_t j) {
        inner_thread[i][j] = std::this_thread::get_id();
        runs[i * inner + j].fetch_add(1);
      };
      pool.parallel_for(inner, inner_task);
    };
    pool.parallel_for(outer, outer_task);
    for (std::size_t i = 0; i < outer; ++i)
      for (std::size_t j = 0; j < inner; ++j) {
        EXPECT_EQ(runs[i * inner + j].load(), 1);
        EXPECT_EQ(inner_thread[i][j], outer_thread[i]) << "nested item " << i << "." << j << " left its thread";
      }
  });
}

// Caller A's items wait until caller B's job runs: a pool that took one job at a time would make
// B wait for A, and A would time out.
TEST(ThreadPoolConcurrency, RefusesMoreThreadsThanItsLimit) {
  try {
    const kvq::ThreadPool pool(kvq::ThreadPool::max_threads + 1);
    ADD_FAILURE() << "a pool beyond its thread limit was started";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument) << e.what();
  }
}

TEST(ThreadPoolConcurrency, IndependentCallersDoNotWaitForEachOther) {
  within(60s, [] {
    kvq::ThreadPool pool(3);
    std::mutex m;
    std::condition_variable cv;
    bool a_running = false, b_ran = false;
    std::atomic<int> a_saw_b{0};
    auto a_task = [&](std::size_t) {
      std::unique_lock lock(m);
      a_running = true;
      cv.notify_all();
      if (cv.wait_for(lock, 20s, [&] { return b_ran; })) a_saw_b.fetch_add(1);
    };
    auto b_task = [&](std::size_t) {
      std::lock_guard lock(m);
      b_ran = true;
      cv.notify_all();
    };
    std::thread a([&] { pool.parallel_for(4, a_task); });
    {
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return a_running; });
    }
    std::thread b([&] { pool.parallel_for(3, b_task); });
    b.join();
    a.join();
    EXPECT_EQ(a_saw_b.load(), 4) << "caller B waited for caller A's job";
  });
}

TEST(ThreadPoolConcurrency, ManyCallersEachItemOnceAndOwnErrors) {
  within(120s, [] {
    kvq::ThreadPool pool(3);
    constexpr int callers = 4, rounds = 150;
    std::atomic<int> wrong{0}, errors_seen{0};
    std::vector<std::thread> threads;
    for (int c = 0; c < callers; ++c) {
      threads.emplace_back([&, c] {
        std::mt19937 rng{unsigned(c)};
        for (int r = 0; r < rounds; ++r) {
          const std::size_t n = rng() % 40, bad = (r % 5 == 0 && n > 0) ? rng() % n : n;
          std::vector<std::atomic<int>> runs(n);
          auto task = [&](std::size_t i) {
            runs[i].fetch_add(1);
            if (i == bad) throw std::runtime_error("item " + std::to_string(i));
          };
          try {
            pool.parallel_for(n, task);
            if (bad != n) wrong.fetch_add(1);  // the error was lost
          } catch (const std::runtime_error& e) {
            if (bad == n || std::string(e.what()) != "item " + std::to_string(bad)) wrong.fetch_add(1);
            errors_seen.fetch_add(1);
          }
          for (auto& x : runs) wrong.fetch_add(x.load() != 1);
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(wrong.load(), 0);
    EXPECT_GT(errors_seen.load(), callers * rounds / 10);
  });
}

// Per-channel keys with a window that is not a multiple of the group go through the quantization
// scratch rows, which appends to different layers must not share.
constexpr const char* wrapping_config = "k4c32-v2t32-r40-s1";

kvq::CacheShape shape_for(std::size_t layers) { return {layers, 2, 64, 700, kvq::RopeStyle::adjacent_pairs, 10000.0f}; }

std::vector<float> layer_tokens(std::size_t layer, std::size_t tokens, unsigned salt) {
  return kvq::test::outlier_keys(tokens, 2, 64, 5, 3.0f, unsigned(layer) * 17 + salt);
}

TEST(KVCacheConcurrency, AppendsToDifferentLayersEqualSerialAppends) {
  const std::size_t layers = 4, tokens = 650;
  kvq::BasicKVCache serial(shape_for(layers), kvq::parse_cache_config(wrapping_config));
  for (std::size_t l = 0; l < layers; ++l) serial.append(l, 0, layer_tokens(l, tokens, 1), layer_tokens(l, tokens, 2));
  kvq::BasicKVCache shared(shape_for(layers), kvq::parse_cache_config(wrapping_config));
  std::vector<std::thread> threads;
  for (std::size_t l = 0; l < layers; ++l) {
    threads.emplace_back([&, l] {
      const auto k = layer_tokens(l, tokens, 1), v = layer_tokens(l, tokens, 2);
      std::mt19937 rng{unsigned(l)};
      for (std::size_t p = 0; p < tokens;) {  // chunks of 1..40 tokens
        const std::size_t n = std::min<std::size_t>(tokens - p, 1 + rng() % 40), row = 2 * 64;
        shared.append(l, p, std::span(k).subspan(p * row, n * row), std::span(v).subspan(p * row, n * row));
        p += n;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (std::size_t l = 0; l < layers; ++l) EXPECT_EQ(shared.length(l), tokens);
  EXPECT_TRUE(shared.stored_bytes() == serial.stored_bytes());
}

// The contract's middle case: attention on one layer while other threads append to the others.
TEST(KVCacheConcurrency, AttentionOnOneLayerWhileOthersAppend) {
  const std::size_t layers = 3, tokens = 500, heads = 4;
  kvq::BasicKVCache cache(shape_for(layers), kvq::parse_cache_config(wrapping_config));
  cache.append(0, 0, layer_tokens(0, tokens, 1), layer_tokens(0, tokens, 2));
  const auto q = kvq::test::normal_vector(heads * 64, 3);
  auto attend = [&] {
    std::vector<float> out(q.size());
    kvq::decode_attention(cache, 0, tokens - 1, q, out);
    return out;
  };
  const auto expected = attend();
  std::atomic<bool> appending{true};
  std::atomic<int> mismatches{0}, reads{0};
  std::thread reader([&] {
    while (appending.load() || reads.load() == 0) {
      mismatches.fetch_add(attend() != expected);
      reads.fetch_add(1);
    }
  });
  std::vector<std::thread> writers;
  for (std::size_t l = 1; l < layers; ++l)
    writers.emplace_back([&, l] {
      const auto k = layer_tokens(l, tokens, 1), v = layer_tokens(l, tokens, 2);
      for (std::size_t p = 0; p < tokens; ++p)
        cache.append(l, p, std::span(k).subspan(p * 128, 128), std::span(v).subspan(p * 128, 128));
    });
  for (auto& t : writers) t.join();
  appending.store(false);
  reader.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_GT(reads.load(), 0);
  for (std::size_t l = 1; l < layers; ++l) EXPECT_EQ(cache.length(l), tokens);
}

TEST(KVCacheConcurrency, ConstOperationsFromManyThreadsAgreeWithOneThread) {
  const std::size_t layers = 3, tokens = 600, heads = 8;
  kvq::BasicKVCache cache(shape_for(layers), kvq::parse_cache_config(wrapping_config));
  for (std::size_t l = 0; l < layers; ++l) cache.append(l, 0, layer_tokens(l, tokens, 1), layer_tokens(l, tokens, 2));
  kvq::ThreadPool pool(3);  // shared by every caller
  const auto q = kvq::test::normal_vector(heads * 64, 9);
  auto attend = [&](std::size_t layer, std::size_t position, kvq::Executor* executor) {
    std::vector<float> out(q.size());
    kvq::DecodeOptions o;
    o.executor = executor;
    o.chunk_tokens = 64;
    kvq::decode_attention(cache, layer, position, q, out, o);
    return out;
  };
  std::vector<std::vector<float>> expected;
  for (std::size_t l = 0; l < layers; ++l) expected.push_back(attend(l, tokens - 1 - l, nullptr));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < 6; ++r) {
        const std::size_t l = std::size_t(t + r) % layers;
        mismatches.fetch_add(attend(l, tokens - 1 - l, r % 2 == 0 ? &pool : nullptr) != expected[l]);
        mismatches.fetch_add(cache.memory().total_bytes() == 0 ||
                             cache.keys(l, 1, cache.segments(l) - 1).length != tokens);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
