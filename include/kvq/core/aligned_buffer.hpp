#pragma once
// Owning, zero-initialised byte buffer with cache-line alignment. Buffers of 2 MiB and more are
// 2 MiB-aligned and advised as huge pages: decode attention streams the whole cache every step,
// and one core reads about a third faster from huge pages than from 4 KiB pages on x86-64.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvq::inline v0 {

class AlignedBuffer {
 public:
  static constexpr std::size_t cache_line = 64;
  static constexpr std::size_t huge_page = std::size_t(2) << 20;

  AlignedBuffer() = default;

  explicit AlignedBuffer(std::size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    const std::size_t alignment = bytes >= huge_page ? huge_page : cache_line;
    const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
    data_ = static_cast<std::uint8_t*>(std::aligned_alloc(alignment, rounded));
    if (data_ == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (alignment == huge_page) (void)madvise(data_, rounded, MADV_HUGEPAGE);  // advisory: ignore failure
#endif
    std::memset(data_, 0, rounded);
  }

  AlignedBuffer(const AlignedBuffer& other) : AlignedBuffer(other.size_) {
    if (size_ != 0) std::memcpy(data_, other.data_, size_);
  }
  AlignedBuffer(AlignedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer other) noexcept {
    swap(other);
    return *this;
  }
  ~AlignedBuffer() { std::free(data_); }

  void swap(AlignedBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
  }

  std::uint8_t* data() noexcept { return data_; }
  const std::uint8_t* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace kvq::inline v0
