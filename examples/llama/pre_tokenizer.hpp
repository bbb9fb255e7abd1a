#pragma once
// Pre-tokenizers of byte-level BPE vocabularies: they cut text into words before BPE merges
// within each word. Each named scheme is a regular expression in its model's tokenizer.json
// (llama.cpp's llama-vocab lists them by `tokenizer.ggml.pre`); here each is matched by hand,
// alternative by alternative in the expression's order, with the same leftmost-first result:
//   gpt2:      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   llama-bpe: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
//              | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   qwen2:     as llama-bpe with \p{N} (one digit per word) for \p{N}{1,3}
//   smollm:    every \p{N} a word of its own, then gpt2 within the rest
// Contractions match only the ASCII apostrophe and ASCII letters, as the expressions do.

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/error.hpp"
#include "llama/unicode.hpp"

namespace kvq::llama {

enum class PreTokenizer : unsigned char { gpt2, llama3, qwen2, smollm };

/// The scheme a GGUF names in `tokenizer.ggml.pre`; any other name is refused by name.
inline PreTokenizer pre_tokenizer_named(std::string_view name) {
  if (name == "gpt2") return PreTokenizer::gpt2;
  if (name == "llama-bpe") return PreTokenizer::llama3;
  if (name == "qwen2") return PreTokenizer::qwen2;
  if (name == "smollm") return PreTokenizer::smollm;
  throw Error(ErrorCode::unsupported, "BPE pre-tokenizer '" + std::string(name) +
                                          "' is not supported (supported: llama-bpe, qwen2, smollm, gpt2)");
}

namespace detail {

using unicode::Char;
using unicode::CharClass;

// Each matcher returns the end (exclusive char index) of the word starting at char i of
// [i, end); the text past `end` is invisible to it, as to a regex run on that fragment.
class WordMatcher {
 public:
  WordMatcher(const std::vector<Char>& chars, std::size_t end) : c_(chars), end_(end) {}

  std::size_t gpt2(std::size_t i) const {
    if (const std::size_t n = contraction(i, false)) return i + n;
    const std::size_t j = is(i, U' ') && i + 1 < end_ && cls(i + 1) != CharClass::whitespace ? i + 1 : i;
    if (cls(j) != CharClass::whitespace) return run(j, cls(j));  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
    return trailing_space(i);
  }

  std::size_t llama3(std::size_t i, std::size_t max_digits) const {
    if (const std::size_t n = contraction(i, true)) return i + n;
    if (cls(i) == CharClass::letter) return run(i, CharClass::letter);  // `[^\r\n\p{L}\p{N}]?\p{L}+`
    const bool newline = is(i, U'\r') || is(i, U'\n');
    if (!newline && cls(i) != CharClass::number && i + 1 < end_ && cls(i + 1) == CharClass::letter)
      return run(i + 1, CharClass::letter);
    if (cls(i) == CharClass::number) return std::min(run(i, CharClass::number), i + max_digits);  // `\p{N}{1,max}`
    const std::size_t j = is(i, U' ') && i + 1 < end_ ? i + 1 : i;  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    if (cls(j) == CharClass::other) {
      std::size_t k = run(j, CharClass::other);
      while (k < end_ && (is(k, U'\r') || is(k, U'\n'))) ++k;
      return k;
    }
    // White space: `\s*[\r\n]+` takes the run up to its last line break, if it has one.
    const std::size_t k = run(i, CharClass::whitespace);
    for (std::size_t m = k; m > i; --m)
      if (is(m - 1, U'\r') || is(m - 1, U'\n')) return m;
    return trailing_space(i);
  }

 private:
  CharClass cls(std::size_t i) const { return c_[i].cls; }
  bool is(std::size_t i, char32_t ascii) const { return c_[i].code_point == ascii; }  // invalid bytes are >= 0x80

  std::size_t run(std::size_t i, CharClass k) const {
    while (i < end_ && cls(i) == k) ++i;
    return i;
  }

  // `\s+(?!\S)|\s+`: a white-space run before a non-space word leaves its last character to
  // that word (" ?\p{L}+" then takes it); at the end of the text the whole run is one word.
  std::size_t trailing_space(std::size_t i) const {
    const std::size_t k = run(i, CharClass::whitespace);
    return k == end_ || k - i < 2 ? k : k - 1;
  }

  // Length in chars of an apostrophe contraction at i ('s 't 're 've 'm 'll 'd), or 0.
  std::size_t contraction(std::size_t i, bool any_case) const {
    if (!is(i, U'\'') || i + 1 >= end_) return 0;
    const auto letter = [&](std::size_t k) -> char32_t {
      if (k >= end_ || c_[k].length != 1) return 0;
      const char32_t v = c_[k].code_point;
      return any_case && v >= U'A' && v <= U'Z' ? v - U'A' + U'a' : v;
    };
    const char32_t a = letter(i + 1), b = letter(i + 2);
    if (a == U's' || a == U't' || a == U'm' || a == U'd') return 2;
    if ((a == U'r' && b == U'e') || (a == U'v' && b == U'e') || (a == U'l' && b == U'l')) return 3;
    return 0;
  }

  const std::vector<Char>& c_;
  std::size_t end_;
};

}  // namespace detail

/// Splits `text` into words (views into `text`, in order, covering it exactly).
inline std::vector<std::string_view> pre_tokenize(PreTokenizer scheme, std::string_view text) {
  const std::vector<unicode::Char> chars = unicode::decode(text);
  std::vector<std::string_view> words;
  const auto emit = [&](std::size_t from, std::size_t to) {  // char indices
    const std::size_t begin = chars[from].offset;
    const std::size_t end = to < chars.size() ? chars[to].offset : text.size();
    words.push_back(text.substr(begin, end - begin));
  };
  const auto split = [&](std::size_t from, std::size_t to) {
    const detail::WordMatcher match(chars, to);
    for (std::size_t i = from; i < to;) {
      std::size_t next = i + 1;
      switch (scheme) {
        case PreTokenizer::gpt2:
        case PreTokenizer::smollm:
          next = match.gpt2(i);
          break;
        case PreTokenizer::llama3:
          next = match.llama3(i, 3);
          break;
        case PreTokenizer::qwen2:
          next = match.llama3(i, 1);
          break;
      }
      emit(i, next);
      i = next;
    }
  };
  if (scheme != PreTokenizer::smollm) {
    split(0, chars.size());
    return words;
  }
  // smollm isolates every number character first, then splits the text between them.
  std::size_t start = 0;
  for (std::size_t i = 0; i < chars.size(); ++i) {
    if (chars[i].cls != unicode::CharClass::number) continue;
    split(start, i);
    emit(i, i + 1);
    start = i + 1;
  }
  split(start, chars.size());
  return words;
}

}  // namespace kvq::llama
