#pragma once
// Owning, zero-initialised byte buffer with cache-line alignment; a refused allocation is a
// kvq::Error (out_of_memory), never std::bad_alloc. Buffers of 2 MiB and more are
// 2 MiB-aligned and advised as huge pages: decode attention streams the whole cache every step,
// and one core reads about a third faster from huge pages than from 4 KiB pages on x86-64.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kvq/error.hpp"

namespace kvq::inline v0 {

class AlignedBuffer {
 public:
  static constexpr std::size_t cache_line = 64;
  static constexpr std::size_t huge_page = std::size_t(2) << 20;

  AlignedBuffer() = default;

  explicit AlignedBuffer(std::size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    const std::size_t alignment = bytes >= huge_page ? huge_page : cache_line;
    // A request within one alignment of SIZE_MAX would wrap while rounding up; no system has it.
    const std::size_t rounded =
        bytes > std::size_t(-1) - alignment ? 0 : (bytes + alignment - 1) / alignment * alignment;
    data_ = rounded == 0 ? nullptr : static_cast<std::uint8_t*>(std::aligned_alloc(alignment, rounded));
    if (data_ == nullptr)
      throw Error(ErrorCode::out_of_memory, "allocating " + std::to_string(bytes) + " bytes failed");
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
