#pragma once
// Walking and resealing the sections of a kvq cache or pool file, to forge contents under right
// CRCs (what a file written by something else could hold).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kvq/kvq.hpp"

namespace kvq::test {

/// The sections after a file's 16-byte preamble: where each starts (its tag) and its payload's size.
inline std::vector<std::pair<std::size_t, std::size_t>> file_sections(const std::string& bytes) {
  std::vector<std::pair<std::size_t, std::size_t>> sections;
  for (std::size_t at = 16; at + 12 <= bytes.size();) {
    std::uint64_t size = 0;
    std::memcpy(&size, bytes.data() + at + 4, 8);
    sections.emplace_back(at, std::size_t(size));
    at += 12 + std::size_t(size) + 4;
  }
  return sections;
}

/// The tag of the section starting at `start`.
inline std::uint32_t section_tag(const std::string& bytes, std::size_t start) {
  std::uint32_t tag = 0;
  std::memcpy(&tag, bytes.data() + start, 4);
  return tag;
}

/// Rewrites the CRC of the section at `start` (a payload of `size` bytes) to match its bytes.
inline void reseal(std::string& bytes, std::size_t start, std::size_t size) {
  const std::uint32_t crc = crc32c(bytes.data() + start, 12 + size);
  std::memcpy(bytes.data() + start + 12 + size, &crc, 4);
}

}  // namespace kvq::test
