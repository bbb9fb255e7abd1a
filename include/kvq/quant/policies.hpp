#pragma once
// Quantizer policies: empty types whose constants describe one quantizer. They carry no state
// (that lives in the cache) and compile to a constexpr QuantizerSpec that the kernels dispatch on.

#include <concepts>
#include <cstddef>

#include "kvq/quant/spec.hpp"

namespace kvq::inline v0 {

template <class Q>
concept Quantizer = requires {
  { Q::bits } -> std::convertible_to<int>;
  { Q::group_size } -> std::convertible_to<std::size_t>;
  { Q::axis } -> std::convertible_to<Axis>;
  { Q::mode } -> std::convertible_to<Mode>;
  typename Q::param_type;
  { Q::spec } -> std::convertible_to<QuantizerSpec>;
};

namespace detail {
template <int Bits, std::size_t Group, class Param, std::size_t Outliers = 0, Mode M = Mode::asymmetric>
consteval bool check_quantizer() {
  static_assert(Outliers == 0 || min_max_levels(M),
                "only kvq's affine levels keep outliers (ggml's levels and level tables do not)");
  static_assert(M != Mode::normal_float || (Bits >= 2 && Bits <= 4), "NormalFloat levels take 2..4 bits");
  static_assert(M != Mode::lloyd_max || Bits <= 4, "Lloyd-Max levels take 1..4 bits");
  static_assert(M != Mode::iq4_nl || Bits == 4, "iq4_nl levels take 4 bits");
  static_assert((M != Mode::fp8_e4m3 && M != Mode::fp8_e5m2) || Bits == 8, "fp8 levels take 8 bits");
  static_assert(M != Mode::codebook,
                "codebook levels are calibrated data: set QuantizerSpec::codebook in a CacheConfig at run time");
  static_assert(Bits >= 1 && Bits <= 8, "a quantizer's bit width must be between 1 and 8");
  static_assert(Group >= 1, "a quantizer's group must hold at least one element");
  static_assert(Outliers == 0 || (Outliers < Group && Outliers <= max_outliers),
                "a quantizer keeps fewer outliers per group than the group holds, and at most max_outliers");
  static_assert(std::same_as<Param, fp16> || std::same_as<Param, bf16> || std::same_as<Param, float>,
                "scales and zero points are stored as fp16, bf16 or float");
  return true;
}
}  // namespace detail

/// Keys: one scale and zero point per channel per run of `Group` consecutive tokens (KIVI).
template <int Bits, std::size_t Group, Mode M = Mode::asymmetric, class Param = fp16, std::size_t Outliers = 0>
struct PerChannel {
  static_assert(detail::check_quantizer<Bits, Group, Param, Outliers, M>());
  static constexpr int bits = Bits;
  static constexpr std::size_t group_size = Group;
  static constexpr Axis axis = Axis::per_channel;
  static constexpr Mode mode = M;
  using param_type = Param;
  static constexpr std::size_t outliers = Outliers;
  static constexpr QuantizerSpec spec{Bits, Group, Axis::per_channel, M, scalar_of<Param>, Outliers};
};

/// Values: one scale and zero point per `Group` consecutive channels of one token.
/// `Group` equal to the head dimension means one pair per token and head.
template <int Bits, std::size_t Group, Mode M = Mode::asymmetric, class Param = fp16, std::size_t Outliers = 0>
struct PerToken {
  static_assert(detail::check_quantizer<Bits, Group, Param, Outliers, M>());
  static constexpr int bits = Bits;
  static constexpr std::size_t group_size = Group;
  static constexpr Axis axis = Axis::per_token;
  static constexpr Mode mode = M;
  using param_type = Param;
  static constexpr std::size_t outliers = Outliers;
  static constexpr QuantizerSpec spec{Bits, Group, Axis::per_token, M, scalar_of<Param>, Outliers};
};

/// llama.cpp's cache types (--cache-type-k/v) as quantizers: ggml's blocks of 32 values along
/// the head with an fp16 step, the same numbers as its reference quantizers.
using GgmlQ8_0 = PerToken<8, 32, Mode::ggml>;
using GgmlQ5_0 = PerToken<5, 32, Mode::ggml>;
using GgmlQ4_0 = PerToken<4, 32, Mode::ggml>;

/// vLLM's fp8 cache types with a scale per group (of `Group` channels of one token) in place of
/// one per tensor.
template <std::size_t Group, class Param = fp16>
using Fp8E4M3 = PerToken<8, Group, Mode::fp8_e4m3, Param>;
template <std::size_t Group, class Param = fp16>
using Fp8E5M2 = PerToken<8, Group, Mode::fp8_e5m2, Param>;

}  // namespace kvq::inline v0
