#pragma once
// Byte-level BPE (GGUF `tokenizer.ggml.model = gpt2`: Llama 3, Qwen 2, SmolLM, GPT-2). Text is
// cut at added tokens, pre-tokenized into words, each word's bytes are spelled as printable
// characters (GPT-2's byte-to-unicode map, so the vocabulary holds no raw bytes), and the
// adjacent pair of lowest merge rank is merged, leftmost first, until no listed merge applies.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvq/error.hpp"
#include "llama/gguf.hpp"
#include "llama/pair_merge.hpp"
#include "llama/pre_tokenizer.hpp"
#include "llama/unicode.hpp"

namespace kvq::llama {

/// GGUF `tokenizer.ggml.token_type` values.
enum class TokenType : std::int32_t {
  undefined = 0,
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6
};

/// GPT-2's byte-to-unicode map: printable Latin-1 bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF)
/// stand for themselves; the other 68 bytes, in increasing order, become U+0100, U+0101, ...
/// (so ' ' is U+0120 'Ġ' and '\n' U+010A 'Ċ').
constexpr std::array<char32_t, 256> byte_to_unicode() {
  std::array<char32_t, 256> map{};
  char32_t next = 0x100;
  for (unsigned b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    map[b] = printable ? char32_t(b) : next++;
  }
  return map;
}

class BpeTokenizer {
 public:
  struct Options {
    PreTokenizer pre = PreTokenizer::gpt2;
    int bos = -1, eos = -1;  // -1: the vocabulary has none
    bool add_bos = false;    // what encode() does by default
    // Llama 3's tokenizer takes a word that is itself in the vocabulary whole, merges or not.
    bool ignore_merges = false;
  };

  /// `types` empty: every token normal. `merges`: "left right" in rank order (first = merged first).
  BpeTokenizer(std::vector<std::string> tokens, std::vector<TokenType> types, const std::vector<std::string>& merges,
               Options options)
      : tokens_(std::move(tokens)), types_(std::move(types)), options_(options) {
    if (tokens_.empty()) throw Error(ErrorCode::invalid_argument, "BPE vocabulary is empty");
    if (types_.empty()) types_.assign(tokens_.size(), TokenType::normal);
    if (types_.size() != tokens_.size())
      throw Error(ErrorCode::invalid_argument, "BPE vocabulary has " + std::to_string(tokens_.size()) + " tokens but " +
                                                   std::to_string(types_.size()) + " token types");
    if (merges.empty())
      throw Error(ErrorCode::invalid_argument, "BPE vocabulary has no merges (tokenizer.ggml.merges)");
    for (const int id : {options_.bos, options_.eos})
      if (id != -1) (void)check_id(id, "BOS/EOS id");
    if (options_.add_bos && options_.bos == -1)
      throw Error(ErrorCode::invalid_argument, "BPE vocabulary adds BOS but has no BOS token id");
    for (std::size_t i = 0; i < tokens_.size(); ++i) ids_.emplace(tokens_[i], static_cast<int>(i));  // first wins
    for (std::size_t r = 0; r < merges.size(); ++r) {
      const std::size_t space = merges[r].find(' ', 1);
      if (space == std::string::npos || space + 1 >= merges[r].size())
        throw Error(ErrorCode::invalid_argument,
                    "BPE merge " + std::to_string(r) + " '" + merges[r] + "' is not two pieces separated by a space");
      ranks_.emplace(merges[r], static_cast<int>(r));  // keyed "left right": byte-level pieces hold no raw space
    }
    constexpr auto map = byte_to_unicode();
    for (unsigned b = 0; b < 256; ++b) {
      std::string s;
      unicode::append_utf8(s, map[b]);
      const auto it = ids_.find(s);
      byte_ids_[b] = it == ids_.end() ? -1 : it->second;
      bytes_of_.emplace(map[b], static_cast<char>(b));
    }
    for (std::size_t i = 0; i < tokens_.size(); ++i)
      if ((types_[i] == TokenType::control || types_[i] == TokenType::user_defined) && !tokens_[i].empty())
        specials_.push_back(static_cast<int>(i));
    // Longest first, so that a special token containing another is cut out whole.
    std::stable_sort(specials_.begin(), specials_.end(),
                     [&](int a, int b) { return tokens_[a].size() > tokens_[b].size(); });
  }

  /// The tokenizer a GGUF describes: tokens, token_type, merges, pre, BOS/EOS ids, add_bos_token.
  explicit BpeTokenizer(const GgufFile& file)
      : BpeTokenizer(strings_of(file, "tokenizer.ggml.tokens"), types_of(file), merges_of(file), options_of(file)) {}

  std::size_t size() const noexcept { return tokens_.size(); }
  int bos() const noexcept { return options_.bos; }
  int eos() const noexcept { return options_.eos; }
  bool adds_bos() const noexcept { return options_.add_bos; }
  const std::string& piece(int id) const { return tokens_[check_id(id, "token id")]; }
  TokenType type(int id) const { return types_[check_id(id, "token id")]; }

  /// Token ids of `text`. Added (user-defined) tokens are always cut out whole; control tokens
  /// such as <|endoftext|> only with `parse_special`, otherwise they are ordinary text.
  std::vector<int> encode(std::string_view text, bool add_bos, bool add_eos = false, bool parse_special = false) const {
    std::vector<int> ids;
    if (add_bos) ids.push_back(check_present(options_.bos, "BOS"));
    std::vector<std::size_t> found(specials_.size(), 0);  // each special's next offset (npos: none left)
    std::size_t start = 0;
    while (start < text.size()) {
      const auto [at, special] = next_special(text, start, parse_special, found);
      for (const std::string_view word : pre_tokenize(options_.pre, text.substr(start, at - start)))
        encode_word(word, ids);
      if (special < 0) break;
      ids.push_back(special);
      start = at + tokens_[special].size();
    }
    if (add_eos) ids.push_back(check_present(options_.eos, "EOS"));
    return ids;
  }

  /// Text of one token: control tokens have none, added tokens are their own text, the others
  /// are spelled back from byte-level characters to bytes.
  std::string decode_piece(int id) const {
    const std::string& piece = this->piece(id);
    const TokenType t = types_[static_cast<std::size_t>(id)];
    if (t == TokenType::control) return {};
    if (t == TokenType::user_defined) return piece;
    std::string out;
    for (std::size_t i = 0; i < piece.size();) {
      const unicode::Char c = unicode::decode_at(piece, i);
      const auto it = bytes_of_.find(c.code_point);
      if (it != bytes_of_.end())
        out += it->second;
      else
        out.append(piece, i, c.length);  // not a byte-level character: kept as written
      i += c.length;
    }
    return out;
  }

  std::string decode(std::span<const int> ids) const {
    std::string out;
    for (const int id : ids) out += decode_piece(id);
    return out;
  }

 private:
  // The earliest special token at or after `from` (longest first where several start there),
  // as (offset, id); (text.size(), -1) when none. `found` keeps each one's next occurrence, so a
  // text with many special tokens is searched once per special, not once per occurrence.
  std::pair<std::size_t, int> next_special(std::string_view text, std::size_t from, bool parse_special,
                                           std::vector<std::size_t>& found) const {
    std::pair<std::size_t, int> best{text.size(), -1};
    for (std::size_t i = 0; i < specials_.size(); ++i) {
      const int id = specials_[i];
      if (types_[static_cast<std::size_t>(id)] == TokenType::control && !parse_special) continue;
      if (from == 0 || found[i] < from) found[i] = text.find(tokens_[static_cast<std::size_t>(id)], from);
      if (found[i] < best.first) best = {found[i], id};  // strict: among equal offsets the longer came first
    }
    return best;
  }

  void encode_word(std::string_view word, std::vector<int>& ids) const {
    constexpr auto map = byte_to_unicode();
    std::vector<std::string> symbols;  // one byte-level character each, merged as BPE goes
    std::string spelled;
    for (const char ch : word) {
      std::string s;
      unicode::append_utf8(s, map[static_cast<unsigned char>(ch)]);
      spelled += s;
      symbols.push_back(std::move(s));
    }
    if (options_.ignore_merges)
      if (const auto it = ids_.find(spelled); it != ids_.end()) return ids.push_back(it->second);
    merge(symbols);
    for (const std::string& s : symbols) {
      if (const auto it = ids_.find(s); it != ids_.end()) {
        ids.push_back(it->second);
        continue;
      }
      // A merge result missing from the vocabulary falls back to its bytes.
      for (std::size_t i = 0; i < s.size();) {
        const unicode::Char c = unicode::decode_at(s, i);
        const unsigned char b = static_cast<unsigned char>(bytes_of_.at(c.code_point));
        if (byte_ids_[b] < 0)
          throw Error(ErrorCode::unsupported, "BPE vocabulary has no token for byte " + std::to_string(b));
        ids.push_back(byte_ids_[b]);
        i += c.length;
      }
    }
  }

  // Lowest merge rank first, leftmost on ties.
  void merge(std::vector<std::string>& symbols) const {
    std::string key;
    merge_adjacent_pairs(
        symbols,
        [&](const std::string& left, const std::string& right) -> std::optional<std::pair<double, std::string>> {
          key.assign(left).append(" ").append(right);
          const auto it = ranks_.find(key);
          if (it == ranks_.end()) return std::nullopt;
          return std::pair{double(it->second), left + right};
        });
  }

  std::size_t check_id(int id, const char* what) const {
    if (id < 0 || static_cast<std::size_t>(id) >= tokens_.size())
      throw Error(ErrorCode::invalid_argument, std::string(what) + " " + std::to_string(id) +
                                                   " is outside the vocabulary of " + std::to_string(tokens_.size()));
    return static_cast<std::size_t>(id);
  }

  static int check_present(int id, const char* what) {
    if (id < 0) throw Error(ErrorCode::invalid_argument, std::string("BPE vocabulary has no ") + what + " token");
    return id;
  }

  static std::vector<std::string> strings_of(const GgufFile& file, const char* key) {
    std::vector<std::string> out;
    for (const GgufValue& v : file.get_array(key, GgufType::string)) out.push_back(std::get<std::string>(v.data));
    return out;
  }

  static std::vector<std::string> merges_of(const GgufFile& file) {
    if (file.find("tokenizer.ggml.merges") == nullptr)
      file.fail("BPE vocabulary has no merges (tokenizer.ggml.merges is missing)");
    return strings_of(file, "tokenizer.ggml.merges");
  }

  static std::vector<TokenType> types_of(const GgufFile& file) {
    std::vector<TokenType> types;
    if (file.find("tokenizer.ggml.token_type") == nullptr) return types;
    for (const GgufValue& v : file.get_array("tokenizer.ggml.token_type", GgufType::int32)) {
      const std::int64_t t = std::get<std::int64_t>(v.data);
      if (t < 0 || t > 6) file.fail("tokenizer.ggml.token_type holds " + std::to_string(t) + ", expected 0..6");
      types.push_back(static_cast<TokenType>(t));
    }
    return types;
  }

  static Options options_of(const GgufFile& file) {
    if (file.find("tokenizer.ggml.pre") == nullptr)
      file.fail("BPE vocabulary names no pre-tokenizer (tokenizer.ggml.pre is missing)");
    Options o;
    o.pre = pre_tokenizer_named(file.get_string("tokenizer.ggml.pre"));
    o.ignore_merges = o.pre == PreTokenizer::llama3;
    o.add_bos = o.pre == PreTokenizer::llama3;  // the default llama.cpp assumes when the file is silent
    const auto id = [&](const char* key) {
      if (file.find(key) == nullptr) return -1;
      const std::uint64_t v = file.get_uint(key);
      if (v > 0x7fffffff) file.fail(std::string(key) + " " + std::to_string(v) + " is out of range");
      return static_cast<int>(v);
    };
    o.bos = id("tokenizer.ggml.bos_token_id");
    o.eos = id("tokenizer.ggml.eos_token_id");
    if (const GgufValue* v = file.find("tokenizer.ggml.add_bos_token")) {
      const bool* b = std::get_if<bool>(&v->data);
      if (b == nullptr) file.fail("tokenizer.ggml.add_bos_token is not a bool");
      o.add_bos = *b;
    }
    return o;
  }

  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  Options options_;
  std::unordered_map<std::string, int> ids_, ranks_;
  std::unordered_map<char32_t, char> bytes_of_;  // byte-level character -> byte
  int byte_ids_[256] = {};
  std::vector<int> specials_;  // control and user-defined tokens, longest first
};

}  // namespace kvq::llama
