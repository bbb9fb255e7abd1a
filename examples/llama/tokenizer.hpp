#pragma once
// The tokenizer a GGUF file embeds, whichever kind `tokenizer.ggml.model` names: SentencePiece
// BPE ("llama", also assumed when the key is absent) or byte-level BPE ("gpt2"). Any other kind
// is refused by name.

#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "kvq/error.hpp"
#include "llama/bpe_tokenizer.hpp"
#include "llama/gguf.hpp"
#include "llama/sentencepiece_tokenizer.hpp"

namespace kvq::llama {

class Tokenizer {
 public:
  explicit Tokenizer(SentencePieceTokenizer t) : impl_(std::move(t)) {}
  explicit Tokenizer(BpeTokenizer t) : impl_(std::move(t)) {}
  explicit Tokenizer(const GgufFile& file) : impl_(load(file)) {}

  std::size_t size() const {
    return std::visit([](const auto& t) { return t.size(); }, impl_);
  }
  int bos() const {
    return std::visit([](const auto& t) { return t.bos(); }, impl_);
  }
  int eos() const {
    return std::visit([](const auto& t) { return t.eos(); }, impl_);
  }
  /// Whether the model expects BOS before a text: always for SentencePiece, as the GGUF says for BPE.
  bool adds_bos() const {
    return !std::holds_alternative<BpeTokenizer>(impl_) || std::get<BpeTokenizer>(impl_).adds_bos();
  }
  const std::string& piece(int id) const {
    return std::visit([&](const auto& t) -> const std::string& { return t.piece(id); }, impl_);
  }
  std::string_view kind() const { return std::holds_alternative<BpeTokenizer>(impl_) ? "gpt2" : "llama"; }

  /// Token ids of `text`, with BOS where the model expects it.
  std::vector<int> encode(std::string_view text) const { return encode(text, adds_bos()); }
  std::vector<int> encode(std::string_view text, bool add_bos, bool add_eos = false) const {
    return std::visit([&](const auto& t) { return t.encode(text, add_bos, add_eos); }, impl_);
  }
  std::string decode(std::span<const int> tokens) const {
    return std::visit([&](const auto& t) { return t.decode(tokens); }, impl_);
  }

 private:
  using Impl = std::variant<SentencePieceTokenizer, BpeTokenizer>;

  static Impl load(const GgufFile& file) {
    const std::string kind = file.find("tokenizer.ggml.model") ? file.get_string("tokenizer.ggml.model") : "llama";
    if (kind == "llama") return SentencePieceTokenizer(file);
    if (kind == "gpt2") return BpeTokenizer(file);
    throw Error(ErrorCode::unsupported, file.source() + ": tokenizer model '" + kind +
                                            "' is not supported (SentencePiece 'llama' or byte-level BPE 'gpt2')");
  }

  Impl impl_;
};

}  // namespace kvq::llama
