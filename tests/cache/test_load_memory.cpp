// What a load holds beside the cache. A cache's blocks, own rows, history and RoPE table come
// from aligned_alloc; this program counts every byte that operator new holds besides (buffers,
// staging, tables) and its peak, so a load that kept the file's payload in a buffer before
// copying it into blocks shows here as a peak of the payload's size.

#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <optional>
#include <span>
#include <sstream>
#include <streambuf>
#include <string>
#include <utility>

#include "kvq/kvq.hpp"
#include "support/random.hpp"

namespace {

std::atomic<std::size_t> live_bytes{0}, peak_bytes{0};
// malloc's alignment on the targets we build for: the size sits in front of the block.
constexpr std::size_t size_header = 16;

void* counted_alloc(std::size_t n) noexcept {
  if (n > SIZE_MAX - size_header) return nullptr;
  void* p = std::malloc(n + size_header);
  if (p == nullptr) return nullptr;
  *static_cast<std::size_t*>(p) = n;
  const std::size_t now = live_bytes.fetch_add(n) + n;
  for (std::size_t seen = peak_bytes.load(); now > seen && !peak_bytes.compare_exchange_weak(seen, now);) {
  }
  return static_cast<char*>(p) + size_header;
}

void counted_free(void* p) noexcept {
  if (p == nullptr) return;
  char* base = static_cast<char*>(p) - size_header;
  live_bytes.fetch_sub(*reinterpret_cast<std::size_t*>(base));
  std::free(base);
}

void* counted_or_throw(std::size_t n) {
  if (void* p = counted_alloc(n)) return p;
  throw std::bad_alloc();
}

}  // namespace

void* operator new(std::size_t n) { return counted_or_throw(n); }
void* operator new[](std::size_t n) { return counted_or_throw(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { counted_free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { counted_free(p); }

namespace {

using kvq::BasicKVCache;
using kvq::CacheShape;

// A stream that cannot seek, as a pipe or a socket: a load cannot ask it how much it holds.
class OneWay : public std::streambuf {
 public:
  explicit OneWay(std::string bytes) : bytes_(std::move(bytes)) {
    setg(bytes_.data(), bytes_.data(), bytes_.data() + bytes_.size());
  }

 private:
  std::string bytes_;
};

// The most operator new held during f() beyond what it held before.
template <class F>
std::size_t peak_during(F&& f) {
  const std::size_t before = live_bytes.load();
  peak_bytes.store(before);
  f();
  return peak_bytes.load() - before;
}

TEST(LoadMemory, PackedRowsAreHeldOnceInTheirBlocks) {
  // A short window and no rollback copies: the file is nearly all packed rows.
  const CacheShape shape{4, 8, 128, 6144};
  const kvq::CacheConfig config = kvq::parse_cache_config("k4c32-v2t32-r16-s4-d0");
  BasicKVCache source(shape, config);
  const std::size_t tokens = 6000, row = shape.kv_heads * shape.head_dim;
  const auto keys = kvq::test::outlier_keys(tokens, shape.kv_heads, shape.head_dim, 2, 8.0f, 3);
  const auto values = kvq::test::normal_vector(tokens * row, 4);
  for (std::size_t l = 0; l < shape.layers; ++l) source.append(l, 0, keys, values);
  std::ostringstream out(std::ios::binary);
  kvq::save(source, out);
  const std::string file = out.str();

  auto same_as_source = [&](const BasicKVCache& loaded) {
    std::ostringstream again(std::ios::binary);
    kvq::save(loaded, again);
    return again.str() == file;
  };
  {  // into a cache the caller made
    BasicKVCache target(shape, config);
    target.append(0, 0, std::span(keys).first(10 * row), std::span(values).first(10 * row));
    std::istringstream in(file, std::ios::binary);
    const std::size_t held = peak_during([&] { kvq::load(target, in); });
    std::printf("load into a cache: %zu bytes held beside it for a file of %zu bytes\n", held, file.size());
    EXPECT_LT(held, file.size() / 10) << "a load into a cache held " << held << " bytes beside it for a file of "
                                      << file.size();
    EXPECT_TRUE(same_as_source(target));
  }
  {  // a new cache
    std::istringstream in(file, std::ios::binary);
    std::optional<BasicKVCache> loaded;
    const std::size_t held = peak_during([&] { loaded.emplace(kvq::load(in)); });
    std::printf("load of a new cache: %zu bytes held beside it for a file of %zu bytes\n", held, file.size());
    EXPECT_LT(held, file.size() / 10) << "a load of a new cache held " << held << " bytes beside it for a file of "
                                      << file.size();
    EXPECT_TRUE(same_as_source(*loaded));
  }
  {  // files cut short: the target keeps its contents, and the store what it had committed
    BasicKVCache target(shape, config);
    target.append(0, 0, keys, values);
    target.clear();  // its blocks stay committed for reuse
    target.append(0, 0, std::span(keys).first(100 * row), std::span(values).first(100 * row));
    const auto bytes = target.stored_bytes();
    const kvq::BlockCounts before = target.blocks().counts();
    for (const std::size_t cut : {file.size() / 3, file.size() - 1000}) {
      const std::string part = file.substr(0, cut);
      // A string stream says how much it holds: the load stops before it takes a block.
      std::istringstream seekable(part, std::ios::binary);
      try {
        kvq::load(target, seekable);
        ADD_FAILURE() << "cut at " << cut << ": loaded";
      } catch (const kvq::Error& e) {
        EXPECT_NE(std::string(e.what()).find("bytes early (truncated)"), std::string::npos) << e.what();
      }
      // A pipe does not: the load takes blocks as bytes arrive and gives them back when it fails.
      OneWay pipe_buffer(part);
      std::istream pipe(&pipe_buffer);
      EXPECT_THROW(kvq::load(target, pipe), kvq::Error) << "cut at " << cut;
      EXPECT_TRUE(target.stored_bytes() == bytes) << "cut at " << cut;
      EXPECT_EQ(target.blocks().counts().in_use, before.in_use) << "cut at " << cut;
      EXPECT_EQ(target.blocks().counts().committed, before.committed) << "cut at " << cut;
    }
    OneWay whole_buffer(file);
    std::istream whole(&whole_buffer);
    kvq::load(target, whole);
    EXPECT_TRUE(same_as_source(target)) << "a stream that cannot seek loads";
  }
}

}  // namespace
