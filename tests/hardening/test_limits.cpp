// Reproducers of sizes and positions that used to overflow or corrupt silently: each must now be a
// kvq::Error naming the field, or work exactly, with nothing changed on failure.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"
#include "support/compare.hpp"
#include "support/kernels.hpp"
#include "support/random.hpp"

namespace {

using kvq::BasicKVCache;
using kvq::CacheConfig;
using kvq::CacheShape;
using kvq::ErrorCode;

constexpr std::size_t size_max = std::numeric_limits<std::size_t>::max();

template <class F>
void expect_error(F&& f, ErrorCode code, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no kvq::Error thrown; expected one mentioning '" << needle << "'";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "'" << e.what() << "' lacks '" << needle << "'";
  }
}

CacheConfig config(const char* text) { return kvq::parse_cache_config(text); }

TEST(Limits, ShapeProductsThatWrapAreRefused) {
  // kv_heads = 2^61 x head_dim 8 once made a cache of 0 bytes whose first append divided by zero.
  for (const std::size_t kv_heads : {std::size_t(1) << 61, std::size_t(1) << 58, size_max}) {
    SCOPED_TRACE(kv_heads);
    expect_error(
        [&] {
          BasicKVCache c(CacheShape{1, kv_heads, 8, 16}, config("k4c32-v2t8-r0-s0"));
        },
        ErrorCode::invalid_argument, "overflows");
  }
  expect_error(
      [&] {
        BasicKVCache c(CacheShape{size_max, 2, 8, 16}, config("k4c32-v2t8-r0-s0"));
      },
      ErrorCode::invalid_argument, "layers x kv_heads");
  expect_error(
      [&] {
        BasicKVCache c(CacheShape{1, 1, 2048, 16}, kvq::full_precision_config());
      },
      ErrorCode::invalid_argument, "head_dim");
  expect_error(
      [&] {
        BasicKVCache c(CacheShape{1, 1, 0, 16}, CacheConfig{});
      },
      ErrorCode::invalid_argument, "head_dim");
}

TEST(Limits, CapacityBeyondTheLimitIsRefusedBeforeAnyTable) {
  // 2^62 crashed in the RoPE table, SIZE_MAX wrote past it, 2^40 ended in std::bad_alloc.
  for (const std::size_t capacity : {std::size_t(1) << 62, size_max, std::size_t(1) << 40, kvq::max_capacity + 1}) {
    SCOPED_TRACE(capacity);
    expect_error(
        [&] {
          BasicKVCache c(CacheShape{1, 1, 64, capacity}, CacheConfig{});
        },
        ErrorCode::invalid_argument, "capacity");
  }
  volatile std::size_t opaque = size_max;  // not a constant: GCC would warn about the loop it guards
  expect_error([&] { kvq::RopeTable t(kvq::RopeConfig{64}, opaque); }, ErrorCode::invalid_argument,
               "RoPE table positions");
  expect_error([] { kvq::AlignedBuffer b(size_max - 10); }, ErrorCode::out_of_memory, "bytes");
}

// A window of SIZE_MAX is the natural way to say "never quantize": every sum with it once wrapped.
TEST(Limits, HugeWindowsAndSinksNeverQuantizeAndNeverWrap) {
  const std::size_t dim = 16, heads = 2, tokens = 100;
  const auto keys = kvq::test::normal_vector(tokens * heads * dim, 3);
  const auto values = kvq::test::normal_vector(tokens * heads * dim, 4);
  for (const std::size_t sinks : {std::size_t(0), std::size_t(4), size_max, size_max - 3}) {
    for (const std::size_t window : {size_max, size_max - 1, size_max - 31}) {
      SCOPED_TRACE("sinks " + std::to_string(sinks) + ", window " + std::to_string(window));
      CacheConfig c = config("k4c32-v2t8-r0-s0-f32");
      c.window = window;
      c.sinks = sinks;
      BasicKVCache cache(CacheShape{1, heads, dim, 128}, c);
      for (std::size_t t = 0; t < tokens; t += 7) {  // chunks, so the checks run at many lengths
        const std::size_t n = std::min<std::size_t>(7, tokens - t), at = t * heads * dim;
        cache.append(0, t, std::span(keys).subspan(at, n * heads * dim),
                     std::span(values).subspan(at, n * heads * dim));
      }
      EXPECT_EQ(cache.memory().code_bytes, 0u);
      // Attention reads every position: a segment's end (sinks + block) once wrapped and cut it.
      const auto q = kvq::test::normal_vector(heads * dim, 9);
      std::vector<float> out(q.size()), ref(q.size());
      kvq::decode_attention(cache, 0, tokens - 1, q, out);
      kvq::reference_attention(cache, 0, tokens - 1, q, ref);
      EXPECT_LT(kvq::test::relative_error(out, ref), 1e-5);
      std::vector<float> row(dim);
      for (std::size_t p = 0; p < tokens; ++p)
        for (std::size_t h = 0; h < heads; ++h) {
          cache.read_row(kvq::Tensor::keys, 0, h, p, row.data());
          for (std::size_t i = 0; i < dim; ++i) ASSERT_EQ(row[i], keys[(p * heads + h) * dim + i]) << p;
          cache.read_row(kvq::Tensor::values, 0, h, p, row.data());
          for (std::size_t i = 0; i < dim; ++i) ASSERT_EQ(row[i], values[(p * heads + h) * dim + i]) << p;
        }
    }
  }
}

TEST(Limits, PerChannelGroupsAreBoundedAndScratchFollowsTheCapacity) {
  expect_error([] { (void)config("k4c20000000-v2t32-r0-s0"); }, ErrorCode::invalid_argument, "4096");
  expect_error([] { (void)config("k4c999999999-v2t32-r0-s0"); }, ErrorCode::invalid_argument, "4096");
  // A group longer than the stream never comes due: its scratch is not allocated.
  BasicKVCache cache(CacheShape{1, 1, 128, 16}, config("k4c4096-v2t32-r0-s0"));
  EXPECT_LT(cache.allocated_bytes(), std::size_t(1) << 20);
}

BasicKVCache filled_cache(const char* text, std::size_t tokens, float key_scale = 1.0f) {
  const std::size_t dim = 64, heads = 2;
  BasicKVCache cache(CacheShape{1, heads, dim, 256}, config(text));
  auto keys = kvq::test::normal_vector(tokens * heads * dim, 5);
  for (float& k : keys) k *= key_scale;
  cache.append(0, 0, keys, kvq::test::normal_vector(tokens * heads * dim, 6));
  return cache;
}

TEST(Limits, AttentionPositionsThatWouldWrapAreRefused) {
  const BasicKVCache cache = filled_cache("k4c32-v2t32-r0-s0", 100);
  const auto q = kvq::test::normal_vector(4 * 64, 7);
  std::vector<float> out(q.size(), 42.0f);
  for (const std::size_t position : {size_max, size_max - 1, std::size_t(100)}) {
    SCOPED_TRACE(position);
    for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer})
      expect_error([&] { kvq::decode_attention(cache, 0, position, q, out, {.tier = tier}); },
                   ErrorCode::invalid_argument, "holds 100 tokens");
    expect_error([&] { kvq::reference_attention(cache, 0, position, q, out); }, ErrorCode::invalid_argument,
                 "holds 100 tokens");
    expect_error([&] { kvq::reference_attention_block(cache, 0, position, 2, std::span(q).first(2 * 64 * 2), out); },
                 ErrorCode::invalid_argument, "holds 100 tokens");
  }
  for (const float x : out) EXPECT_EQ(x, 42.0f);
}

// A finite query so large that q.k overflows float once gave NaN in every fp32 kernel. The limit
// is sum|q| x key_peak x 2 sqrt(2) / sqrt(d) <= FLT_MAX / 64: just past it a call is refused with
// nothing written, just below it every tier stays finite.
TEST(Limits, QueriesWhoseScoresOverflowFloatAreRefusedAndLargeOnesStayFinite) {
  for (const char* text :
       {"k4c32-v2t32-r0-s0", "k4c32-v2t32-r0-s0-post", "k3c4s-v3t8s-r0-s0-post", "k16-v16-r0-s0-f32"}) {
    SCOPED_TRACE(text);
    const BasicKVCache cache = filled_cache(text, 100);
    const auto q = kvq::test::normal_vector(4 * 64, 8);
    const double limit = std::numeric_limits<float>::max() / 64.0;
    auto with_channel = [&](double share) {  // query head 1, channel 6 holds `share` of the limit
      std::vector<float> out = q;
      out[64 + 6] = float(share * limit * 8.0 / (cache.key_peak(0) * 2 * std::sqrt(2.0)));
      return out;
    };
    std::vector<float> out(q.size(), 42.0f);
    for (const double share : {1.01, 16.0}) {
      const std::vector<float> huge = with_channel(share);
      for (const kvq::Tier tier : {kvq::Tier::exact, kvq::Tier::integer})
        expect_error([&] { kvq::decode_attention(cache, 0, 99, huge, out, {.tier = tier}); },
                     ErrorCode::unrepresentable, "query head 1");
      expect_error([&] { kvq::reference_attention(cache, 0, 99, huge, out); }, ErrorCode::unrepresentable,
                   "query head 1");
      for (const float x : out) ASSERT_EQ(x, 42.0f);
    }
    for (const double share : {0.97, 1e-3, 1e-9}) {
      SCOPED_TRACE(share);
      const std::vector<float> large = with_channel(share);
      std::vector<float> oracle(q.size()), exact(q.size()), integer(q.size());
      kvq::reference_attention(cache, 0, 99, large, oracle);
      kvq::decode_attention(cache, 0, 99, large, exact, {.tier = kvq::Tier::exact});
      kvq::decode_attention(cache, 0, 99, large, integer, {.tier = kvq::Tier::integer});
      for (std::size_t i = 0; i < q.size(); ++i) {
        ASSERT_TRUE(std::isfinite(oracle[i]) && std::isfinite(exact[i]) && std::isfinite(integer[i])) << i;
        EXPECT_NEAR(exact[i], oracle[i], 1e-4 * (1 + std::fabs(oracle[i]))) << i;
      }
    }
  }
}

using kvq::test::relative_error;

// One key or value of 1e3 to 6e4 among unit ones once moved the integer tier up to 0.16 from the
// oracle (0 where the oracle gave 0.05): its int8 step, set by the outlier, rounded the rest away.
TEST(Limits, IntegerTierKeepsItsBoundOnOutlierData) {
  const std::size_t dim = 64, heads = 2, tokens = 200, query_heads = 8;
  const auto q = kvq::test::normal_vector(query_heads * dim, 3);
  for (const char* text :
       {"k3c4s-v3t8s-r0-s0-post", "k4c32-v2t32-r0-s0-post", "k2c32-v4t32-r8-s1-post", "k8c32-v8t32-r0-s0-post"}) {
    for (const char* where : {"keys", "values", "both"}) {
      for (const float magnitude : {1e3f, 7e3f, 6e4f}) {
        SCOPED_TRACE(std::string(text) + ", " + where + ", " + std::to_string(magnitude));
        BasicKVCache cache(CacheShape{1, heads, dim, 256}, config(text));
        auto keys = kvq::test::normal_vector(tokens * heads * dim, 1);
        auto values = kvq::test::normal_vector(tokens * heads * dim, 2);
        const std::size_t at = (37 * heads + 1) * dim + 5;
        if (where[0] != 'v') keys[at] = magnitude;
        if (where[0] != 'k') values[at + 9 * heads * dim] = -magnitude;
        cache.append(0, 0, keys, values);
        std::vector<float> oracle(q.size());
        kvq::reference_attention(cache, 0, tokens - 1, q, oracle);
        for (const std::string& kernel : kvq::test::kernels_for(cache, q.size() / cache.shape().head_dim)) {
          std::vector<float> out(q.size());
          kvq::decode_attention(cache, 0, tokens - 1, q, out, {.tier = kvq::Tier::integer, .kernel = kernel});
          EXPECT_LT(relative_error(out, oracle), 2.5e-2) << kernel;
        }
      }
    }
  }
}

// The kernel that runs the integer tier of `cache` without a name (""), or the reference kernel
// where that one computes the exact tier for both (the vector kernels: AArch64's).
std::string integer_tier_kernel(const BasicKVCache& cache, std::size_t heads) {
  return kvq::test::computes_integer_tier(cache, heads) ? "" : "reference";
}

// The guard is what keeps the bound: without it the same outlier breaks it.
TEST(Limits, WithoutTheOutlierGuardTheIntegerTierLosesItsBound) {
  const std::size_t dim = 64, heads = 2, tokens = 200;
  BasicKVCache cache(CacheShape{1, heads, dim, 256}, config("k4c32-v2t32-r0-s0-post"));
  auto keys = kvq::test::normal_vector(tokens * heads * dim, 1);
  keys[(37 * heads + 1) * dim + 5] = 7e3f;
  cache.append(0, 0, keys, kvq::test::normal_vector(tokens * heads * dim, 2));
  const auto q = kvq::test::normal_vector(8 * dim, 3);
  std::vector<float> oracle(q.size()), guarded(q.size()), unguarded(q.size());
  kvq::reference_attention(cache, 0, tokens - 1, q, oracle);
  const std::string kernel = integer_tier_kernel(cache, q.size() / dim);
  kvq::decode_attention(cache, 0, tokens - 1, q, guarded, {.tier = kvq::Tier::integer, .kernel = kernel});
  kvq::decode_attention(cache, 0, tokens - 1, q, unguarded,
                        {.tier = kvq::Tier::integer, .kernel = kernel, .guard_outliers = false});
  EXPECT_LT(relative_error(guarded, oracle), 2.5e-2);
  EXPECT_GT(relative_error(unguarded, oracle), 2.5e-2);
}

// Without outliers the integer tier still runs: its answer differs from the exact tier's.
TEST(Limits, IntegerTierStillRunsWhereNothingStandsOut) {
  const BasicKVCache cache = filled_cache("k4c32-v2t32-r0-s0-post", 200);
  const auto q = kvq::test::normal_vector(4 * 64, 9);
  std::vector<float> exact(q.size()), integer(q.size());
  const std::string kernel = integer_tier_kernel(cache, q.size() / 64);
  kvq::decode_attention(cache, 0, 199, q, exact, {.tier = kvq::Tier::exact, .kernel = kernel});
  kvq::decode_attention(cache, 0, 199, q, integer, {.tier = kvq::Tier::integer, .kernel = kernel});
  EXPECT_GT(relative_error(integer, exact), 1e-5);
  EXPECT_LT(relative_error(integer, exact), 2.5e-2);
  kvq::kernels::attention::DecodeTask task;
  ASSERT_EQ(cache.segments(0), 1u);
  task.keys = cache.keys(0, 0, 0);
  task.values = cache.values(0, 0, 0);
  task.end = 200;
  EXPECT_TRUE(kvq::kernels::attention::integer_tier_carries(task));
}

TEST(Limits, TheKeyPeakBoundsWhatWasAppended) {
  BasicKVCache cache = filled_cache("k4c32-v2t32-r0-s0", 10, 3.0f);
  const float peak = cache.key_peak(0);
  EXPECT_GT(peak, 3.0f);
  EXPECT_LT(peak, 30.0f);
  cache.clear();
  EXPECT_EQ(cache.key_peak(0), 0.0f);
}

}  // namespace

namespace {

// Calls on a layer the cache does not have, and configuration text with an empty part, are
// kvq::Errors (they were std::out_of_range, and a read of an empty part's first character).
TEST(Limits, AccessorsAndParsersNameWhatIsMissing) {
  const BasicKVCache cache = filled_cache("k4c32-v2t32-r0-s0", 10);
  expect_error([&] { (void)cache.length(1); }, ErrorCode::invalid_argument, "length: layer 1 of 1");
  expect_error([&] { (void)cache.key_peak(2); }, ErrorCode::invalid_argument, "key_peak: layer 2 of 1");
  expect_error([&] { (void)cache.quantized_end(kvq::Tensor::values, 1); }, ErrorCode::invalid_argument,
               "quantized_end: layer 1");
  expect_error([&] { (void)cache.rollback_floor(kvq::Tensor::keys, size_max); }, ErrorCode::invalid_argument,
               "rollback_floor: layer");
  expect_error([&] { (void)cache.block_count(1); }, ErrorCode::invalid_argument, "block_count: layer 1");
  expect_error([&] { (void)cache.segments(1); }, ErrorCode::invalid_argument, "layer 1");
  expect_error([] { (void)config("k4c32-v2t32-r128-s1--x"); }, ErrorCode::invalid_argument, "unexpected part ''");
  expect_error([] { (void)kvq::parse_layer_configs("k4c32-v2t32-r128-s1--d8;k4c32-v2t32-r128-s1", 2); },
               ErrorCode::invalid_argument, "unexpected part ''");
}

// A yarn attention factor is squared into q.k, and positions add the offset as signed integers:
// values far outside any model's are refused before they overflow.
TEST(Limits, RopeFactorsAndOffsetsThatOverflowAreRefused) {
  kvq::RopeConfig rope{.head_dim = 64};
  rope.scaling.type = kvq::RopeScalingType::yarn;
  rope.scaling.factor = 4.0f;
  rope.scaling.original_context = 4096;
  for (const float factor : {1e20f, 1e-40f, 2e4f, 5e-5f}) {
    rope.scaling.attention_factor = factor;
    expect_error([&] { kvq::validate(rope); }, ErrorCode::invalid_argument, "attention_factor must be in");
  }
  rope.scaling.attention_factor = 1e4f;
  kvq::validate(rope);
  rope.scaling = {};
  for (const std::ptrdiff_t offset : {std::numeric_limits<std::ptrdiff_t>::max() - 100,
                                      std::numeric_limits<std::ptrdiff_t>::min(), (std::ptrdiff_t(1) << 52) + 1}) {
    rope.position_offset = offset;
    expect_error([&] { kvq::validate(rope); }, ErrorCode::invalid_argument, "position_offset");
  }
  rope.position_offset = -(std::ptrdiff_t(1) << 52);
  kvq::validate(rope);
}

// An append of no tokens to a fork writes nothing, so it copies no shared block and is not refused
// by a full store; can_append asks the store for the blocks an append takes.
TEST(Limits, EmptyAppendsTakeNoBlockAndCanAppendCountsBlocks) {
  const CacheShape shape{.layers = 1, .kv_heads = 2, .head_dim = 64, .capacity = 256};
  const CacheConfig c = config("k4c32-v2t32-r0-s0");
  const std::size_t row = 2 * 64;
  auto store = std::make_shared<kvq::BlockStore>(BasicKVCache::block_bytes(shape, c), 2);
  BasicKVCache parent(shape, c, store, nullptr);
  parent.append(0, 0, kvq::test::normal_vector(40 * row, 1), kvq::test::normal_vector(40 * row, 2));
  BasicKVCache a(parent, 40), b(parent, 40);
  const std::vector<float> none;
  a.append(0, 40, none, none);
  EXPECT_EQ(store->counts().in_use, 1u) << "an empty append copied the shared block";
  const auto one_k = kvq::test::normal_vector(row, 3), one_v = kvq::test::normal_vector(row, 4);
  a.append(0, 40, one_k, one_v);  // the copy of the shared block: the store's last
  EXPECT_EQ(store->available(), 0u);
  b.append(0, 40, none, none);
  EXPECT_TRUE(b.can_append(0, 40, none, none));
  std::string why;
  EXPECT_FALSE(b.can_append(0, 40, one_k, one_v, &why)) << "the store has no block for b's copy";
  EXPECT_NE(why.find("needs 1 more blocks"), std::string::npos) << why;
  expect_error([&] { b.append(0, 40, one_k, one_v); }, ErrorCode::capacity_exceeded, "needs 1 more blocks");
}

// An erase stages the rows that move, not a ring's worth: an unquantized tensor's ring spans the
// capacity, and an erase in a cache of 2^28 positions holding 100 once allocated and zeroed 64 GiB.
TEST(Limits, EraseStagesOnlyTheRowsThatMove) {
  const CacheShape shape{.capacity = std::size_t(1) << 28, .rope_style = kvq::RopeStyle::none};
  CacheConfig c = kvq::full_precision_config();
  c.key_rope = kvq::KeyRope::post;
  BasicKVCache cache(shape, c);
  const auto keys = kvq::test::normal_vector(100 * 128, 7), values = kvq::test::normal_vector(100 * 128, 8);
  cache.append(0, 0, keys, values);
  EXPECT_EQ(kvq::detail::CacheAccess::erase_staging_bytes(cache, 10, 5), 85u * 128 * sizeof(float))
      << "the 85 rows after the range, in the wider of the two tensors' rows";
  cache.erase(10, 5);
  ASSERT_EQ(cache.length(0), 95u);
  std::vector<float> row(128);
  for (const std::size_t p : {std::size_t(9), std::size_t(10), std::size_t(94)}) {
    const std::size_t from = p < 10 ? p : p + 5;
    cache.read_row(kvq::Tensor::keys, 0, 0, p, row.data());
    for (std::size_t i = 0; i < 128; ++i) ASSERT_EQ(row[i], keys[from * 128 + i]) << p;
  }
}

// An allocator that refuses more than 1000 elements, as a system out of memory refuses.
template <class T>
struct RefusingAllocator {
  using value_type = T;
  RefusingAllocator() = default;
  template <class U>
  RefusingAllocator(const RefusingAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    if (n > 1000) throw std::bad_alloc();
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, std::size_t n) noexcept { std::allocator<T>().deallocate(p, n); }
  friend bool operator==(const RefusingAllocator&, const RefusingAllocator&) { return true; }
};

// Workspaces sized by a call (erase's staging, append's rotated rows, attention's queries and
// partial results) go through checked_resize: a refusal is kvq::Error (out_of_memory) naming the
// workspace, as the README promises, where std::vector threw std::bad_alloc.
TEST(Limits, RefusedWorkspacesAreOutOfMemoryNotBadAlloc) {
  std::vector<float, RefusingAllocator<float>> v(10, 1.0f);
  expect_error([&] { kvq::checked_resize(v, 5000, "the test's workspace"); }, ErrorCode::out_of_memory,
               "the test's workspace: 5000 elements of 4 bytes could not be allocated");
  EXPECT_EQ(v.size(), 10u);
  EXPECT_EQ(v[9], 1.0f);
  kvq::checked_resize(v, 1000, "the test's workspace");
  EXPECT_EQ(v.size(), 1000u);
  std::vector<double> w;
  expect_error([&] { kvq::checked_resize(w, size_max, "a workspace"); }, ErrorCode::out_of_memory,
               "a workspace: " + std::to_string(size_max) + " elements exceed what a vector holds");
}

// Library-owned per-thread scratch (converted rows of append, attention's own workspace) keeps
// what it took only up to kept_scratch_bytes: a long prompt's 128 MiB is released when the call
// ends, by return or by throw, and a decode step's few KiB stay for the next call.
TEST(Limits, LargeScratchIsReleasedWhenTheCallEnds) {
  std::vector<float> small, large;
  {
    const kvq::ScratchTrim trim(small, large);
    small.resize(1000);
    large.resize(kvq::kept_scratch_bytes / sizeof(float) + 1);
  }
  EXPECT_GE(small.capacity(), 1000u);
  EXPECT_EQ(large.capacity(), 0u);
  std::vector<double> thrown;
  try {
    const kvq::ScratchTrim trim(thrown);
    thrown.resize(kvq::kept_scratch_bytes / sizeof(double) * 2);
    throw kvq::Error(ErrorCode::invalid_argument, "a bad request");
  } catch (const kvq::Error&) {
  }
  EXPECT_EQ(thrown.capacity(), 0u);
}

// decode_attention and attend hold this thread's own workspace for the call (OwnScratch): a call
// nested on the same thread (an executor running other work while its caller waits) gets a fresh
// one, so it neither overwrites nor frees the outer call's; the next call finds the thread's
// workspace again, trimmed.
TEST(Limits, NestedCallsOnOneThreadGetAWorkspaceOfTheirOwn) {
  const kvq::DecodeWorkspace* own = nullptr;
  {
    kvq::OwnScratch<kvq::DecodeWorkspace> outer;
    own = &outer.get();
    outer.get().partial.resize(kvq::kept_scratch_bytes / sizeof(float) + 1, 1.0f);
    const float* data = outer.get().partial.data();
    {
      kvq::OwnScratch<kvq::DecodeWorkspace> inner;
      EXPECT_NE(&inner.get(), own);
      EXPECT_TRUE(inner.get().partial.empty());
      inner.get().partial.resize(kvq::kept_scratch_bytes / sizeof(float) * 2);
    }
    EXPECT_EQ(outer.get().partial.data(), data);
    EXPECT_EQ(outer.get().partial.back(), 1.0f);
  }
  kvq::OwnScratch<kvq::DecodeWorkspace> next;
  EXPECT_EQ(&next.get(), own);
  EXPECT_EQ(next.get().partial.capacity(), 0u);
}

// A call given the caller's workspace leaves the thread's own to calls nested in it.
TEST(Limits, ACallWithItsOwnWorkspaceLeavesTheThreadsToOthers) {
  const kvq::DecodeWorkspace* threads = nullptr;
  {
    kvq::OwnScratch<kvq::DecodeWorkspace> first;
    threads = &first.get();
  }
  const kvq::OwnScratch<kvq::DecodeWorkspace> brought(false);
  kvq::OwnScratch<kvq::DecodeWorkspace> nested;
  EXPECT_EQ(&nested.get(), threads);
}

// attend and share_prefixes allocate small bookkeeping on the way (per-request lists, hash maps):
// they run inside with_memory_errors, which turns a refusal into out_of_memory naming the call and
// lets everything else through as it was.
TEST(Limits, RefusedBookkeepingIsOutOfMemoryNotBadAlloc) {
  expect_error([] { kvq::with_memory_errors("attend", [] { std::vector<float, RefusingAllocator<float>> v(5000); }); },
               ErrorCode::out_of_memory, "attend: memory for its bookkeeping was refused");
  expect_error([] { kvq::with_memory_errors("share_prefixes", [] { std::vector<double>().reserve(size_max); }); },
               ErrorCode::out_of_memory, "share_prefixes: its bookkeeping exceeds what a container holds");
  expect_error(
      [] {
        kvq::with_memory_errors("attend", [] { throw kvq::Error(ErrorCode::invalid_argument, "request 3: bad"); });
      },
      ErrorCode::invalid_argument, "request 3: bad");
  EXPECT_EQ(kvq::with_memory_errors("share_prefixes", [] { return std::size_t(42); }), 42u);
}

}  // namespace
