#pragma once
// A synthetic GGUF shaped like the models people run: Llama 3.2 1B's hyper-parameters, Q4_K
// weights of random content, Llama 3's RoPE (base 500000, frequency divisors in
// rope_freqs.weight) and a byte-level BPE tokenizer of Llama 3's size with the llama-bpe
// pre-tokenizer. The weights mean nothing, so it measures speed and exercises every path of a
// real file end to end; quality is measured on the trained model in ../shared/data.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <string>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/error.hpp"
#include "llama/bpe_tokenizer.hpp"
#include "llama/ggml_blocks.hpp"
#include "llama/gguf_writer.hpp"

namespace kvq::llama::testing {

struct SyntheticLlamaShape {
  std::uint32_t dim = 2048, layers = 16, heads = 32, kv_heads = 8, ffn = 8192, context = 131072;
  std::uint32_t vocab = 128256, special_tokens = 256;  // the last special_tokens ids are control tokens
  float rope_base = 500000.0f;
  // Llama 3.1's frequency rule, written as divisors into rope_freqs.weight as llama.cpp does.
  float rope_factor = 32.0f, low_freq_factor = 1.0f, high_freq_factor = 4.0f;
  std::uint32_t original_context = 8192;

  std::uint32_t head_dim() const noexcept { return dim / heads; }
};

namespace detail {

inline std::uint64_t splitmix64(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// Q4_K blocks of random codes and 6-bit scales and mins. With d = 8e-5 and dmin = 7.5 d the
/// weights have mean about 0 and standard deviation about 0.02, as a trained model's.
inline std::vector<std::uint8_t> random_q4_k(std::size_t values, std::uint64_t seed) {
  constexpr std::size_t block_values = 256, block_bytes = 144;
  std::vector<std::uint8_t> out(values / block_values * block_bytes);
  const std::uint16_t d = to_fp16(8e-5f).bits, dmin = to_fp16(6e-4f).bits;
  for (std::size_t b = 0; b < out.size(); b += block_bytes) {
    std::memcpy(&out[b], &d, 2);
    std::memcpy(&out[b + 2], &dmin, 2);
    for (std::size_t i = 4; i < block_bytes; i += 8) {
      const std::uint64_t r = splitmix64(seed);
      std::memcpy(&out[b + i], &r, std::min<std::size_t>(8, block_bytes - i));
    }
  }
  return out;
}

/// Llama 3's divisor of each rotated pair's frequency (the values llama.cpp's converter writes).
inline std::vector<float> llama3_frequency_divisors(const SyntheticLlamaShape& s) {
  std::vector<float> divisors;
  const double low_wavelength = double(s.original_context) / s.low_freq_factor;
  const double high_wavelength = double(s.original_context) / s.high_freq_factor;
  for (std::uint32_t i = 0; i < s.head_dim(); i += 2) {
    const double freq = std::pow(double(s.rope_base), -double(i) / s.head_dim());
    const double wavelength = 2 * std::numbers::pi / freq;
    if (wavelength < high_wavelength)
      divisors.push_back(1.0f);
    else if (wavelength > low_wavelength)
      divisors.push_back(s.rope_factor);
    else {
      const double smooth =
          (s.original_context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      divisors.push_back(float(1.0 / ((1 - smooth) / s.rope_factor + smooth)));
    }
  }
  return divisors;
}

/// GPT-2's printable spelling of byte `b`.
inline std::string byte_piece(unsigned b) {
  std::string s;
  unicode::append_utf8(s, byte_to_unicode()[b]);
  return s;
}

}  // namespace detail

/// The vocabulary: the 256 byte pieces, one merge for every pair of lowercase letters and for a
/// space before each letter, unused filler tokens up to the vocabulary's size less the special
/// tokens, then the control tokens <|begin_of_text|> (BOS), <|end_of_text|> (EOS) and reserved ones.
inline void add_synthetic_bpe_vocabulary(GgufWriter& w, const SyntheticLlamaShape& s) {
  std::vector<std::string> tokens, merges;
  std::vector<std::int32_t> types;
  for (unsigned b = 0; b < 256; ++b) tokens.push_back(detail::byte_piece(b)), types.push_back(int(TokenType::normal));
  for (const char first : std::string(" abcdefghijklmnopqrstuvwxyz"))
    for (char second = 'a'; second <= 'z'; ++second) {
      const std::string left = detail::byte_piece(static_cast<unsigned char>(first)), right(1, second);
      merges.push_back(left + " " + right);
      tokens.push_back(left + right), types.push_back(int(TokenType::normal));
    }
  const std::uint32_t normal = s.vocab - s.special_tokens;
  if (tokens.size() > normal) throw Error(ErrorCode::invalid_argument, "synthetic vocabulary too small for its merges");
  while (tokens.size() < normal)
    tokens.push_back("<|filler_" + std::to_string(tokens.size()) + "|>"), types.push_back(int(TokenType::unused));
  for (std::uint32_t i = 0; i < s.special_tokens; ++i) {
    tokens.push_back(i == 0   ? "<|begin_of_text|>"
                     : i == 1 ? "<|end_of_text|>"
                              : "<|reserved_special_token_" + std::to_string(i) + "|>");
    types.push_back(int(TokenType::control));
  }
  w.str("tokenizer.ggml.model", "gpt2")
      .str("tokenizer.ggml.pre", "llama-bpe")
      .strings("tokenizer.ggml.tokens", tokens)
      .int32s("tokenizer.ggml.token_type", types)
      .strings("tokenizer.ggml.merges", merges)
      .u32("tokenizer.ggml.bos_token_id", normal)
      .u32("tokenizer.ggml.eos_token_id", normal + 1);
}

/// The GGUF image of a `llama` model of shape `s`: Q4_K matrices (embedding tied to the output),
/// F32 norms, Llama 3 RoPE and the synthetic vocabulary. Same seed, same bytes.
inline std::vector<std::uint8_t> synthetic_llama_gguf(const SyntheticLlamaShape& s = {}, std::uint64_t seed = 1) {
  if (s.heads == 0 || s.kv_heads == 0 || s.dim % s.heads != 0 || s.dim % 256 != 0 || s.ffn % 256 != 0)
    throw Error(ErrorCode::invalid_argument,
                "synthetic Llama shape: dim and ffn must be multiples of 256 and of the heads");
  if (s.special_tokens < 2 || s.special_tokens >= s.vocab)
    throw Error(ErrorCode::invalid_argument,
                "synthetic Llama shape: the vocabulary needs room for BOS and EOS among "
                "fewer special tokens than it holds");
  GgufWriter w;
  const std::string a = "llama.";
  w.str("general.architecture", "llama")
      .str("general.name", "synthetic Llama-3.2-1B shape (random Q4_K weights)")
      .u32(a + "embedding_length", s.dim)
      .u32(a + "block_count", s.layers)
      .u32(a + "attention.head_count", s.heads)
      .u32(a + "attention.head_count_kv", s.kv_heads)
      .u32(a + "feed_forward_length", s.ffn)
      .u32(a + "context_length", s.context)
      .u32(a + "rope.dimension_count", s.head_dim())
      .f32(a + "rope.freq_base", s.rope_base)
      .f32(a + "attention.layer_norm_rms_epsilon", 1e-5f);
  add_synthetic_bpe_vocabulary(w, s);
  const std::uint64_t kv = std::uint64_t{s.kv_heads} * s.head_dim();
  const auto q4_k = [&](const std::string& name, std::uint64_t ne0, std::uint64_t ne1) {
    w.tensor(name, {ne0, ne1}, ggml_type_q4_k, detail::random_q4_k(ne0 * ne1, seed++ * 0x2545f4914f6cdd1dull));
  };
  const auto ones = [&](const std::string& name) { w.tensor_f32(name, {s.dim}, std::vector<float>(s.dim, 1.0f)); };
  q4_k("token_embd.weight", s.dim, s.vocab);
  ones("output_norm.weight");
  const std::vector<float> divisors = detail::llama3_frequency_divisors(s);
  w.tensor_f32("rope_freqs.weight", {divisors.size()}, divisors);
  for (std::uint32_t l = 0; l < s.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    ones(p + "attn_norm.weight");
    q4_k(p + "attn_q.weight", s.dim, s.dim);
    q4_k(p + "attn_k.weight", s.dim, kv);
    q4_k(p + "attn_v.weight", s.dim, kv);
    q4_k(p + "attn_output.weight", s.dim, s.dim);
    ones(p + "ffn_norm.weight");
    q4_k(p + "ffn_gate.weight", s.dim, s.ffn);
    q4_k(p + "ffn_up.weight", s.dim, s.ffn);
    q4_k(p + "ffn_down.weight", s.ffn, s.dim);
  }
  return w.bytes();
}

/// Writes synthetic_llama_gguf(s, seed) to `path`.
inline void write_synthetic_llama(const std::filesystem::path& path, const SyntheticLlamaShape& s = {},
                                  std::uint64_t seed = 1) {
  const std::vector<std::uint8_t> bytes = synthetic_llama_gguf(s, seed);
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw Error(ErrorCode::io, "cannot write the synthetic model '" + path.string() + "'");
}

}  // namespace kvq::llama::testing
