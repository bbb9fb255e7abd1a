#pragma once
// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of iSCSI, ext4 and SSE4.2's
// crc32 instruction: crc32c("123456789") = 0xE3069283. The table-driven version (eight bytes
// per step, "slicing by 8") is the reference and runs everywhere; x86-64 CPUs with SSE4.2 take
// the crc32 instruction instead (several times faster; tests compare the two).

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/isa.hpp"

#if defined(KVQ_HAVE_X86_KERNELS)
#include <nmmintrin.h>
#endif

namespace kvq::inline v0 {

namespace detail {

using Crc32cTables = std::array<std::array<std::uint32_t, 256>, 8>;

// tables[k][b]: the CRC of byte b followed by k zero bytes.
constexpr Crc32cTables make_crc32c_tables() noexcept {
  Crc32cTables tables{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    tables[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::size_t b = 0; b < 256; ++b) tables[k][b] = (tables[k - 1][b] >> 8) ^ tables[0][tables[k - 1][b] & 0xFF];
  return tables;
}

inline constexpr Crc32cTables crc32c_tables = make_crc32c_tables();

}  // namespace detail

/// CRC-32C of `size` bytes by table lookups; pass a previous result as `crc` to continue it.
inline std::uint32_t crc32c_reference(const void* data, std::size_t size, std::uint32_t crc = 0) noexcept {
  const auto& t = detail::crc32c_tables;
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (; size >= 8; p += 8, size -= 8) {
    const std::uint32_t lo =
        (std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24) ^ crc;
    crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^ t[3][p[4]] ^
          t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
  }
  for (; size > 0; ++p, --size) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xFF];
  return ~crc;
}

#if defined(KVQ_HAVE_X86_KERNELS)
namespace detail {
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42(const void* data, std::size_t size,
                                                                    std::uint32_t crc) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t c = ~crc;
  for (; size >= 8; p += 8, size -= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  auto c32 = std::uint32_t(c);
  for (; size > 0; ++p, --size) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}
}  // namespace detail
#endif

/// CRC-32C of `size` bytes; pass a previous result as `crc` to continue it over more bytes.
inline std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc = 0) noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  static const bool sse42 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  if (sse42) return detail::crc32c_sse42(data, size, crc);
#endif
  return crc32c_reference(data, size, crc);
}

}  // namespace kvq::inline v0
