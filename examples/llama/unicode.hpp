#pragma once
// UTF-8 decoding and the character classes that byte-level BPE pre-tokenizers test: letters
// (\p{L}), numbers (\p{N}) and white space (\s, the White_Space property).

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "llama/unicode_ranges.hpp"

namespace kvq::llama::unicode {

enum class CharClass : unsigned char { letter, number, whitespace, other };

/// One code point of a UTF-8 text: where it starts, how many bytes it takes, its value and class.
/// Invalid UTF-8 (a stray continuation byte, an overlong, truncated or surrogate sequence)
/// becomes a one-byte character of class `other`, so a split text re-joins to the same bytes.
struct Char {
  std::size_t offset = 0, length = 1;
  char32_t code_point = 0;
  CharClass cls = CharClass::other;
};

inline bool in_ranges(std::span<const CodePointRange> ranges, char32_t c) noexcept {
  const auto it = std::upper_bound(ranges.begin(), ranges.end(), c,
                                   [](char32_t v, const CodePointRange& r) { return v < r.first; });
  return it != ranges.begin() && c <= std::prev(it)->last;
}

inline bool is_whitespace(char32_t c) noexcept {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

inline CharClass classify(char32_t c) noexcept {
  if (is_whitespace(c)) return CharClass::whitespace;
  if (in_ranges(letter_ranges, c)) return CharClass::letter;
  if (in_ranges(number_ranges, c)) return CharClass::number;
  return CharClass::other;
}

/// Decodes the character starting at byte `i` of `s` (i < s.size()).
inline Char decode_at(std::string_view s, std::size_t i) noexcept {
  Char ch;
  ch.offset = i;
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char lead = byte(i);
  std::size_t n = 0;
  char32_t value = 0, min = 0;
  if (lead < 0x80)
    n = 1, value = lead;
  else if ((lead & 0xE0) == 0xC0)
    n = 2, value = lead & 0x1F, min = 0x80;
  else if ((lead & 0xF0) == 0xE0)
    n = 3, value = lead & 0x0F, min = 0x800;
  else if ((lead & 0xF8) == 0xF0)
    n = 4, value = lead & 0x07, min = 0x10000;
  bool valid = n != 0 && i + n <= s.size();
  for (std::size_t k = 1; valid && k < n; ++k) {
    valid = (byte(i + k) & 0xC0) == 0x80;
    value = (value << 6) | (byte(i + k) & 0x3F);
  }
  valid = valid && value >= min && value <= 0x10FFFF && !(value >= 0xD800 && value <= 0xDFFF);
  if (!valid) {
    ch.code_point = lead;
    return ch;  // one byte, class other
  }
  ch.length = n;
  ch.code_point = value;
  ch.cls = classify(value);
  return ch;
}

inline std::vector<Char> decode(std::string_view s) {
  std::vector<Char> chars;
  chars.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); i += chars.back().length) chars.push_back(decode_at(s, i));
  return chars;
}

inline void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

}  // namespace kvq::llama::unicode
