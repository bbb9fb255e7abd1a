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
//   turbo-k<K>v<V>        TurboQuant-style (vLLM's turboquant_k8v4 and k3v4; no QJL residual):
//                         each head of K and V rotated (normalized Hadamard with fixed random
//                         signs), then coded per head vector with one fp16 scale: K or V bits of
//                         Lloyd-Max levels for a Gaussian, scale = the vector's RMS (2, 3, 4
//                         bits), or symmetric int8, scale = absmax / 127 (8 bits)
//   hf-int4, hf-int2      Hugging Face transformers' QuantizedCache with its defaults (quanto
//                         backend, axis 0, q_group_size 64, residual_length 128): post-RoPE K and
//                         V at 4 or 2 bits, affine min-max per 64 values of a head vector (the whole
//                         vector where head_dim < 64) with fp16 scale and minimum; new rows stay
//                         exact until 128 have gathered, then all are quantized at once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "kvq/codecs/fp8.hpp"
#include "kvq/codecs/ggml.hpp"
#include "kvq/core/half.hpp"
#include "kvq/error.hpp"
#include "kvq/quant/levels.hpp"
#include "kvq/transform/hadamard.hpp"

namespace kvq::eval {

struct EngineFormat {
  std::string name;
  std::optional<ggml::BlockType> block;  // ggml formats
  Fp8Format fp8 = Fp8Format::e4m3fn;     // fp8 formats
  bool hadamard = false;
  int key_bits = 0, value_bits = 0;  // TurboQuant-style formats (hadamard with random signs)
  int hf_bits = 0;                   // Hugging Face's quantized cache

  static constexpr std::size_t hf_group = 64, hf_residual = 128;

  bool turbo() const noexcept { return key_bits != 0; }
  bool hf() const noexcept { return hf_bits != 0; }
  /// Rows a format keeps exact before it quantizes them all at once (0: each as it is stored).
  std::size_t residual() const noexcept { return hf() ? hf_residual : 0; }
  static std::size_t hf_group_of(std::size_t head_dim) noexcept { return head_dim < hf_group ? head_dim : hf_group; }

  /// Stored bits per quantized K/V value of heads of head_dim, scales included (fp8's per-tensor
  /// scales and the exact rows of a residual are counted by the caller).
  double bits_per_value(std::size_t head_dim) const noexcept {
    if (turbo()) return 0.5 * double(key_bits + value_bits) + 16.0 / double(head_dim);
    if (hf()) return double(hf_bits) + 32.0 / double(hf_group_of(head_dim));
    return block ? 8.0 * double(ggml::block_bytes(*block)) / double(ggml::block_values) : 8.0;
  }
};

/// The TurboQuant-style formats --set engines lists: vLLM's two and kvq's default bit widths.
inline constexpr std::pair<int, int> turbo_bit_pairs[] = {{8, 4}, {3, 4}, {4, 2}};

inline bool is_engine_format_name(std::string_view text) noexcept {
  return text.starts_with("ggml-") || text.starts_with("fp8-") || text.starts_with("turbo-") || text.starts_with("hf-");
}

/// Every engine format kvq-eval knows, in the order --set engines lists them.
inline std::vector<std::string> engine_format_names() {
  std::vector<std::string> names;
  for (ggml::BlockType t : ggml::block_types) names.push_back("ggml-" + std::string(ggml::name(t)));
  for (ggml::BlockType t : ggml::block_types) names.push_back("ggml-" + std::string(ggml::name(t)) + "-hadamard");
  names.push_back("fp8-e4m3");
  names.push_back("fp8-e5m2");
  for (const auto& [k, v] : turbo_bit_pairs) names.push_back("turbo-k" + std::to_string(k) + "v" + std::to_string(v));
  names.push_back("hf-int4");
  names.push_back("hf-int2");
  return names;
}

namespace detail {
/// "turbo-k<K>v<V>" -> {K, V}, each 2, 3, 4 or 8; anything else throws naming the text.
inline std::pair<int, int> parse_turbo_bits(std::string_view text) {
  auto fail = [&] {
    throw Error(ErrorCode::invalid_argument,
                "unknown TurboQuant-style format '" + std::string(text) +
                    "': expected turbo-k<K>v<V> with K and V each 2, 3, 4 or 8 (e.g. turbo-k3v4)");
  };
  std::string_view rest = text.substr(6);  // after "turbo-"
  auto bits_after = [&](char tag) {
    if (rest.size() < 2 || rest[0] != tag || std::string_view("2348").find(rest[1]) == std::string_view::npos) fail();
    const int bits = rest[1] - '0';
    rest.remove_prefix(2);
    return bits;
  };
  const int k = bits_after('k'), v = bits_after('v');
  if (!rest.empty()) fail();
  return {k, v};
}
}  // namespace detail

inline EngineFormat parse_engine_format(std::string_view text) {
  EngineFormat f{std::string(text), std::nullopt};
  if (text == "fp8-e4m3") return f;
  if (text == "fp8-e5m2") {
    f.fp8 = Fp8Format::e5m2;
    return f;
  }
  if (text.starts_with("turbo-")) {
    std::tie(f.key_bits, f.value_bits) = detail::parse_turbo_bits(text);
    f.hadamard = true;
    return f;
  }
  if (text == "hf-int4" || text == "hf-int2") {
    f.hf_bits = text == "hf-int4" ? 4 : 2;
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
              "unknown engine format '" + std::string(text) +
                  "': expected ggml-<type>[-hadamard], fp8-e4m3, fp8-e5m2, turbo-k<K>v<V>, "
                  "hf-int4 or hf-int2");
}

/// Quantizes and dequantizes one position's post-RoPE key and value rows (heads of head_dim) in
/// place, as `format` stores them.
class EngineRowCodec {
 public:
  /// The random signs of the TurboQuant-style rotation: fixed, so every run draws the same.
  static constexpr std::uint64_t turbo_sign_seed = 0x7475726230ull;

  EngineRowCodec(EngineFormat format, std::size_t kv_heads, std::size_t head_dim)
      : format_(std::move(format)),
        hadamard_(head_dim, format_.turbo() ? std::optional<std::uint64_t>(turbo_sign_seed) : std::nullopt),
        head_dim_(head_dim),
        row_(kv_heads * head_dim) {
    if (format_.block && row_ % ggml::block_values != 0)
      throw Error(ErrorCode::unsupported, format_.name +
                                              ": llama.cpp stores rows of whole 32-value blocks, but this model's " +
                                              std::to_string(kv_heads) + " KV heads x head_dim " +
                                              std::to_string(head_dim) + " = " + std::to_string(row_) + " values");
    if (format_.block)
      blocks_.resize(row_ / ggml::block_values * ggml::block_bytes(*format_.block));
    else
      codes_.resize(row_);
    scales_.resize(kv_heads);
  }

  void operator()(std::span<float> key, std::span<float> value) {
    round_trip(key, format_.key_bits);
    round_trip(value, format_.value_bits);
  }

  /// The per-head-vector codec of a TurboQuant-style format at `bits`.
  static LevelCodec turbo_codec(int bits, std::size_t head_dim) {
    static const LevelSet int8 = [] {
      std::vector<double> levels;
      for (int i = -127; i <= 127; ++i) levels.push_back(double(i));
      return LevelSet(levels);
    }();
    if (bits == 8) return LevelCodec{&int8, head_dim, GroupScale::absmax, Scalar::f16};
    return LevelCodec{&lloyd_max_gaussian(bits), head_dim, GroupScale::rms, Scalar::f16};
  }

  const EngineFormat& format() const noexcept { return format_; }

 private:
  void round_trip(std::span<float> x, int turbo_bits) {
    if (format_.hadamard) hadamard_.forward(x);
    if (format_.turbo()) {
      const LevelCodec codec = turbo_codec(turbo_bits, head_dim_);
      codec.encode(x, codes_, scales_);
      codec.decode(codes_, scales_, x);
    } else if (format_.hf()) {
      const std::size_t group = EngineFormat::hf_group_of(head_dim_);
      for (std::size_t g = 0; g < x.size(); g += group) affine_round_trip(x.subspan(g, group), format_.hf_bits);
    } else if (format_.block) {
      ggml::quantize_row(*format_.block, x, blocks_);
      ggml::dequantize_row(*format_.block, blocks_, x);
    } else {
      fp8_encode(format_.fp8, x, 1.0f, codes_);
      fp8_decode(format_.fp8, codes_, 1.0f, x);
    }
    if (format_.hadamard) hadamard_.inverse(x);
  }

  // Min-max affine levels with the scale and the minimum stored in fp16, codes rounded to nearest.
  static void affine_round_trip(std::span<float> x, int bits) {
    const auto [lo_it, hi_it] = std::minmax_element(x.begin(), x.end());
    const float lo = to_float(to_fp16(*lo_it)), top = float((1 << bits) - 1);
    const float scale = to_float(to_fp16((*hi_it - lo) / top));
    for (float& v : x) {
      const float code = scale > 0 ? std::clamp(std::nearbyint((v - lo) / scale), 0.0f, top) : 0.0f;
      v = lo + code * scale;
    }
  }

  EngineFormat format_;
  HadamardTransform hadamard_;
  std::size_t head_dim_, row_;
  std::vector<std::uint8_t> blocks_, codes_;
  std::vector<float> scales_;
};

}  // namespace kvq::eval
