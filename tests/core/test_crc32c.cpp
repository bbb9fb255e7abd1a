// CRC-32C against the standard check value and the test vectors of RFC 3720 (iSCSI), B.4.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <string_view>
#include <vector>

#include "kvq/core/crc32c.hpp"

namespace {

TEST(Crc32c, StandardCheckValue) {
  constexpr std::string_view check = "123456789";
  EXPECT_EQ(kvq::crc32c(check.data(), check.size()), 0xE3069283u);
  EXPECT_EQ(kvq::crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, Rfc3720Vectors) {
  std::vector<std::uint8_t> bytes(32, 0);
  EXPECT_EQ(kvq::crc32c(bytes.data(), bytes.size()), 0x8A9136AAu);
  std::fill(bytes.begin(), bytes.end(), 0xFF);
  EXPECT_EQ(kvq::crc32c(bytes.data(), bytes.size()), 0x62A8AB43u);
  std::iota(bytes.begin(), bytes.end(), std::uint8_t{0});
  EXPECT_EQ(kvq::crc32c(bytes.data(), bytes.size()), 0x46DD794Eu);
  std::iota(bytes.rbegin(), bytes.rend(), std::uint8_t{0});
  EXPECT_EQ(kvq::crc32c(bytes.data(), bytes.size()), 0x113FDB5Cu);
}

TEST(Crc32c, ContinuesAcrossPieces) {
  std::vector<std::uint8_t> bytes(300);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::uint8_t(i * 131 + 7);
  const std::uint32_t whole = kvq::crc32c(bytes.data(), bytes.size());
  for (std::size_t split = 0; split <= bytes.size(); split += 7) {
    const std::uint32_t first = kvq::crc32c(bytes.data(), split);
    EXPECT_EQ(kvq::crc32c(bytes.data() + split, bytes.size() - split, first), whole) << split;
  }
  // the eight-byte steps agree with the bytewise tail at every alignment
  for (std::size_t offset = 0; offset < 8; ++offset) {
    std::uint32_t bytewise = 0;
    for (std::size_t i = offset; i < bytes.size(); ++i) bytewise = kvq::crc32c(&bytes[i], 1, bytewise);
    EXPECT_EQ(kvq::crc32c(bytes.data() + offset, bytes.size() - offset), bytewise) << offset;
  }
}

// The instruction path (where the CPU has one) against the table at every length and alignment.
TEST(Crc32c, DispatchedEqualsReference) {
  std::vector<std::uint8_t> bytes(1000);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::uint8_t((i * 2654435761u) >> 13);
  for (std::size_t offset = 0; offset < 9; ++offset)
    for (std::size_t n = 0; n + offset <= bytes.size(); n += 1 + n / 8) {
      ASSERT_EQ(kvq::crc32c(bytes.data() + offset, n, 0x12345678u),
                kvq::crc32c_reference(bytes.data() + offset, n, 0x12345678u))
          << offset << " " << n;
    }
  constexpr std::string_view check = "123456789";
  EXPECT_EQ(kvq::crc32c_reference(check.data(), check.size()), 0xE3069283u);
}

}  // namespace
