#pragma once
// SentencePiece-style BPE tokenizer with byte fallback, encoding exactly as llama2.c's `encode`
// does (dummy-prefix space, one token per UTF-8 code point or its bytes, then repeatedly merge
// the adjacent pair whose merged piece scores highest), so token ids match the reference.

#include <algorithm>
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

namespace kvq::llama {

class SentencePieceTokenizer {
 public:
  SentencePieceTokenizer(std::vector<std::string> pieces, std::vector<float> scores, int bos, int eos)
      : pieces_(std::move(pieces)), scores_(std::move(scores)), bos_(bos), eos_(eos) {
    if (pieces_.empty() || pieces_.size() != scores_.size())
      throw Error(ErrorCode::invalid_argument, "tokenizer needs one score per piece (got " +
                                                   std::to_string(pieces_.size()) + " pieces, " +
                                                   std::to_string(scores_.size()) + " scores)");
    check_id(bos_, "BOS id");
    check_id(eos_, "EOS id");
    for (std::size_t i = 0; i < pieces_.size(); ++i) ids_.emplace(pieces_[i], static_cast<int>(i));  // first wins
    // GGUF keeps SentencePiece's "▁" for a space; llama2.c's own vocab files store " ".
    if (ids_.contains(std::string(kSentencePieceSpace))) space_ = kSentencePieceSpace;
    for (int b = 0; b < 256; ++b) {
      const auto it = ids_.find(byte_piece(static_cast<unsigned char>(b)));
      byte_ids_[b] = it == ids_.end() ? -1 : it->second;
    }
  }

  /// The tokenizer embedded in a GGUF file (tokenizer.ggml.tokens / scores / bos / eos).
  explicit SentencePieceTokenizer(const GgufFile& file)
      : SentencePieceTokenizer(pieces_of(file), scores_of(file), id_of(file, "bos", 1), id_of(file, "eos", 2)) {}

  std::size_t size() const noexcept { return pieces_.size(); }
  int bos() const noexcept { return bos_; }
  int eos() const noexcept { return eos_; }
  const std::string& piece(int id) const { return pieces_[check_id(id, "token id")]; }
  float score(int id) const { return scores_[check_id(id, "token id")]; }

  std::vector<int> encode(std::string_view text, bool add_bos = true, bool add_eos = false) const {
    std::vector<int> tokens;
    tokens.reserve(text.size() + 3);
    if (add_bos) tokens.push_back(bos_);
    const std::size_t first = tokens.size();
    if (!text.empty()) tokens.push_back(lookup_or_throw(space_));  // dummy prefix, as SentencePiece adds

    std::string point;
    for (std::size_t i = 0; i < text.size();) {
      // One UTF-8 code point: a lead byte and at most three continuation bytes (as llama2.c groups them).
      std::size_t n = 1;
      while (i + n < text.size() && n < 4 && (static_cast<unsigned char>(text[i + n]) & 0xC0) == 0x80) ++n;
      point.assign(text.substr(i, n));
      if (point == " ") point = space_;
      if (const auto it = ids_.find(point); it != ids_.end()) {
        tokens.push_back(it->second);
      } else {
        for (std::size_t j = 0; j < n; ++j) tokens.push_back(byte_id(static_cast<unsigned char>(text[i + j])));
      }
      i += n;
    }

    merge(tokens, first);
    if (add_eos) tokens.push_back(eos_);
    return tokens;
  }

  /// Text of `token` following `prev_token`: byte tokens become their byte, "▁" a space, and the
  /// dummy-prefix space after BOS is dropped (llama2.c's `decode`).
  std::string decode_piece(int prev_token, int token) const {
    std::string_view piece = this->piece(token);
    if (prev_token == bos_ && piece.starts_with(space_)) piece.remove_prefix(space_.size());
    if (piece.size() == 6 && piece.starts_with("<0x") && piece.ends_with('>')) {
      const int hi = hex_digit(piece[3]), lo = hex_digit(piece[4]);
      if (hi >= 0 && lo >= 0) return std::string(1, static_cast<char>(hi * 16 + lo));
    }
    std::string out;
    out.reserve(piece.size());
    for (std::size_t i = 0; i < piece.size();) {
      if (piece.substr(i).starts_with(space_)) {
        out += ' ';
        i += space_.size();
      } else {
        out += piece[i++];
      }
    }
    return out;
  }

  /// Text of a token sequence; BOS and EOS produce no text.
  std::string decode(std::span<const int> tokens) const {
    std::string out;
    int prev = -1;
    for (const int t : tokens) {
      if (t != bos_ && t != eos_) out += decode_piece(prev, t);
      prev = t;
    }
    return out;
  }

 private:
  // Repeatedly merges the adjacent pair whose merged piece scores highest (leftmost on ties,
  // as llama2.c breaks them).
  void merge(std::vector<int>& tokens, std::size_t first) const {
    std::vector<int> symbols(tokens.begin() + static_cast<std::ptrdiff_t>(first), tokens.end());
    std::string merged;
    merge_adjacent_pairs(symbols, [&](int left, int right) -> std::optional<std::pair<double, int>> {
      merged.assign(pieces_[left]);
      merged += pieces_[right];
      const auto it = ids_.find(merged);
      // llama2.c merges only pairs scoring above its initial best of -1e10 (never NaN).
      if (it == ids_.end() || !(scores_[it->second] > kNoMerge)) return std::nullopt;
      return std::pair{-double(scores_[it->second]), it->second};
    });
    tokens.resize(first);
    tokens.insert(tokens.end(), symbols.begin(), symbols.end());
  }

  static constexpr std::string_view kSentencePieceSpace = "\xE2\x96\x81";  // U+2581
  static constexpr float kNoMerge = -1e10f;

  static std::string byte_piece(unsigned char b) {
    static constexpr char hex[] = "0123456789ABCDEF";
    return std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
  }

  static int hex_digit(char c) noexcept {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }

  static std::vector<std::string> pieces_of(const GgufFile& file) {
    if (file.find("tokenizer.ggml.model") != nullptr && file.get_string("tokenizer.ggml.model") != "llama")
      throw Error(ErrorCode::unsupported, file.source() + ": tokenizer model '" +
                                              file.get_string("tokenizer.ggml.model") +
                                              "' is not supported (only SentencePiece 'llama')");
    std::vector<std::string> pieces;
    for (const GgufValue& v : file.get_array("tokenizer.ggml.tokens", GgufType::string))
      pieces.push_back(std::get<std::string>(v.data));
    return pieces;
  }

  static std::vector<float> scores_of(const GgufFile& file) {
    std::vector<float> scores;
    for (const GgufValue& v : file.get_array("tokenizer.ggml.scores", GgufType::float32))
      scores.push_back(static_cast<float>(std::get<double>(v.data)));
    return scores;
  }

  static int id_of(const GgufFile& file, const char* which, int fallback) {
    const std::string key = std::string("tokenizer.ggml.") + which + "_token_id";
    if (file.find(key) == nullptr) return fallback;
    const std::uint64_t id = file.get_uint(key);
    if (id > 0x7fffffff) file.fail(key + " " + std::to_string(id) + " is out of range");
    return static_cast<int>(id);
  }

  std::size_t check_id(int id, const char* what) const {
    if (id < 0 || static_cast<std::size_t>(id) >= pieces_.size())
      throw Error(ErrorCode::invalid_argument, std::string(what) + " " + std::to_string(id) +
                                                   " is outside the vocabulary of " + std::to_string(pieces_.size()));
    return static_cast<std::size_t>(id);
  }

  int lookup_or_throw(const std::string& piece) const {
    const auto it = ids_.find(piece);
    if (it == ids_.end()) throw Error(ErrorCode::unsupported, "vocabulary has no piece '" + piece + "'");
    return it->second;
  }

  int byte_id(unsigned char b) const {
    if (byte_ids_[b] < 0) throw Error(ErrorCode::unsupported, "vocabulary has no byte-fallback piece " + byte_piece(b));
    return byte_ids_[b];
  }

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  int bos_ = 1, eos_ = 2;
  std::unordered_map<std::string, int> ids_;
  std::string space_ = " ";
  int byte_ids_[256] = {};
};

}  // namespace kvq::llama
