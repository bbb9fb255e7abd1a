#pragma once
// Other engines' KV-cache formats, simulated for side-by-side evaluation: every key and value is
// quantized and dequantized exactly as the engine stores it, at the engine's granularity, and
// attention then reads the dequantized rows in fp32. This measures what the format loses, not
// how fast any kernel reads it.
//
//   ggml-<type>           llama.cpp's --cache-type-k/-v <type> (q8_0, q4_0, q4_1, q5_0, q5_1,
//                         iq4_nl): post-RoPE keys and values, each position's row of
//                         kv_heads * head_dim values in blocks of 32 (ggml's reference quantizer)
//   ggml-<type>-hadamard  the same after llama.cpp's rotation of quantized caches: the normalized
//                         Walsh-Hadamard transform of each head of K and V (blocks of the largest
//                         power of two dividing head_dim), read back through its inverse
//   fp8-e4m3, fp8-e5m2    vLLM's fp8 caches with the default per-tensor scale 1: every value
//                         rounded to fp8 (e4m3 saturating at 448)

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/codecs/fp8.hpp"
#include "kvq/codecs/ggml.hpp"
#include "kvq/error.hpp"
#include "kvq/transform/hadamard.hpp"

namespace kvq::eval {

struct EngineFormat {
  std::string name;
  std::optional<ggml::BlockType> block;  // ggml formats
  Fp8Format fp8 = Fp8Format::e4m3fn;     // otherwise
  bool hadamard = false;

  /// Stored bits per K/V value, scales included (fp8's per-tensor scales are counted by the caller).
  double bits_per_value() const noexcept {
    return block ? 8.0 * double(ggml::block_bytes(*block)) / double(ggml::block_values) : 8.0;
  }
};

inline bool is_engine_format_name(std::string_view text) noexcept {
  return text.starts_with("ggml-") || text.starts_with("fp8-");
}

/// Every engine format kvq-eval knows, in the order --set engines lists them.
inline std::vector<std::string> engine_format_names() {
  std::vector<std::string> names;
  for (ggml::BlockType t : ggml::block_types) names.push_back("ggml-" + std::string(ggml::name(t)));
  for (ggml::BlockType t : ggml::block_types) names.push_back("ggml-" + std::string(ggml::name(t)) + "-hadamard");
  names.push_back("fp8-e4m3");
  names.push_back("fp8-e5m2");
  return names;
}

inline EngineFormat parse_engine_format(std::string_view text) {
  EngineFormat f{std::string(text), std::nullopt};
  if (text == "fp8-e4m3") return f;
  if (text == "fp8-e5m2") {
    f.fp8 = Fp8Format::e5m2;
    return f;
  }
  if (text.starts_with("ggml-")) {
    std::string_view type = text.substr(5);
    constexpr std::string_view suffix = "-hadamard";
    if (type.ends_with(suffix)) {
      type.remove_suffix(suffix.size());
      f.hadamard = true;
    }
    if ((f.block = ggml::parse_block_type(type))) return f;
    throw Error(ErrorCode::invalid_argument, "unknown ggml cache type '" + std::string(type) + "' in '" +
                                                 std::string(text) + "': expected one of " + ggml::block_type_names() +
                                                 ", optionally followed by -hadamard");
  }
  throw Error(ErrorCode::invalid_argument,
              "unknown engine format '" + std::string(text) + "': expected ggml-<type>[-hadamard] or fp8-e4m3, fp8-e5m2");
}

/// Quantizes and dequantizes one position's post-RoPE key and value rows (heads of head_dim) in
/// place, as `format` stores them.
class EngineRowCodec {
 public:
  EngineRowCodec(EngineFormat format, std::size_t kv_heads, std::size_t head_dim)
      : format_(std::move(format)), hadamard_(head_dim), row_(kv_heads * head_dim) {
    if (format_.block && row_ % ggml::block_values != 0)
      throw Error(ErrorCode::unsupported, format_.name + ": llama.cpp stores rows of whole 32-value blocks, but this model's " +
                                              std::to_string(kv_heads) + " KV heads x head_dim " +
                                              std::to_string(head_dim) + " = " + std::to_string(row_) + " values");
    if (format_.block) blocks_.resize(row_ / ggml::block_values * ggml::block_bytes(*format_.block));
    else codes_.resize(row_);
  }

  void operator()(std::span<float> key, std::span<float> value) {
    round_trip(key);
    round_trip(value);
  }

  const EngineFormat& format() const noexcept { return format_; }

 private:
  void round_trip(std::span<float> x) {
    if (format_.hadamard) hadamard_.forward(x);
    if (format_.block) {
      ggml::quantize_row(*format_.block, x, blocks_);
      ggml::dequantize_row(*format_.block, blocks_, x);
    } else {
      fp8_encode(format_.fp8, x, 1.0f, codes_);
      fp8_decode(format_.fp8, codes_, 1.0f, x);
    }
    if (format_.hadamard) hadamard_.inverse(x);
  }

  EngineFormat format_;
  HadamardTransform hadamard_;
  std::size_t row_;
  std::vector<std::uint8_t> blocks_, codes_;
};

}  // namespace kvq::eval
