#pragma once
// Scalar reference of group quantization; every fast path must produce the same bytes.
//
// Exact definition (stored parameters are rounded to the parameter type first, and the codes are
// computed from the rounded values, so decoding needs nothing but what is stored):
//   asymmetric: scale = P((max - min) / (2^b - 1)), zero = P(min)
//               code  = clamp(rne((x - zero) * inv), 0, 2^b - 1),   x^ = zero + code * scale
//   symmetric:  scale = P(2 * absmax / (2^b - 1)), zero = -(2^b - 1) / 2 * scale (not stored)
//               code and x^ as above
// with inv = 1 / scale in float (0 when scale is 0 or subnormal, so a constant group decodes to its value
// rounded to the parameter type, never NaN), P() rounding to the parameter type, and rne
// rounding half to even.
//   ggml:       llama.cpp's reference quantizers (quantize_row_q8_0/q4_0/q5_0_ref), operation by
//               operation, so a group of 32 holds ggml's block: with lead the value of largest
//               magnitude (the first on a tie) and mid = 2^(b-1),
//               d = absmax / 127 (8 bits) or lead / -mid (fewer), scale = P(d), zero = -mid * scale,
//               code = 8 bits: round(x * inv) + 128 (round half away from zero),
//                      fewer: min(2^b - 1, trunc(x * inv + (mid + 0.5)))
//               where inv = 1 / d from the unrounded d (ggml's choice; 0 where that overflows),
//               the product rounded before the addition (no FMA). d is negative when lead is
//               positive. make_params (the representability check) leads with max on a tie.
//   normal_float, lloyd_max: T = the mode's level table (quant/code_levels.hpp, ascending),
//               scale = P(absmax / max|T|), no zero point, code = the index of the level nearest
//               to x * inv (halfway: the upper one), x^ = T[code] * scale.
//   iq4_nl:     ggml's quantize_row_iq4_nl_ref, operation by operation: T = its 16 levels, lead as
//               for ggml, d0 = lead / T[0], inv = 1 / d0, code = the nearest level of x * inv
//               (ggml's comparison of the two distances: halfway takes the upper level), then
//               scale = P(sum(w T[code] x) / sum(w T[code]^2)) with w = x^2, summed in order;
//               a group whose absmax is below 1e-15 stores scale 0 and codes 0. x^ = T[code] * scale.
//   codebook:   T = spec.codebook (ascending, in [-1, 1]), scale = P((max - min) / 2),
//               zero = P(min + (max - min) / 2), code = the index of the level nearest to
//               (x - zero) * inv (halfway: the upper one), x^ = zero + T[code] * scale.
//   fp8_e4m3, fp8_e5m2: scale = P+(absmax / F) with F the format's largest finite value (448,
//               57344) and P+ rounding up to the parameter type (a scale that is an f16
//               subnormal, as e5m2's are below absmax 3.5, may neither clip the group's largest
//               value nor be 0), no zero point, code = float_to_fp8(x * inv) (codecs/fp8.hpp:
//               nearest, ties to even, saturating; a negative value that rounds to zero keeps
//               its sign), x^ = fp8(code) * scale.
//
// Dense-and-sparse (spec.outliers = n > 0): n values of each group are left out of min and max
// (n times: asymmetric, the group's current minimum or maximum, whichever leaves the smaller
// range; symmetric, the one of larger magnitude; the maximum on a tie).
// Every value is coded as above (an outlier clamps to an end code), and each outlier stores its
// slot (the row within a per-channel group, the channel within a per-token group) and the
// correction e = P(x - x^), so it decodes to x^ + e. A group's n entries are in slot order.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>

#include "kvq/pack/bitpack.hpp"
#include "kvq/quant/code_levels.hpp"
#include "kvq/quant/spec.hpp"

namespace kvq::inline v0::kernels::reference {

/// Stored parameters of one group, as floats. `zero` is the value of code 0; with a level table
/// (non-affine modes) a code decodes to zero + levels[code] * scale (zero 0 but for codebooks).
struct GroupParams {
  float scale = 0.0f;
  float zero = 0.0f;
  const float* levels = nullptr;
};

inline float round_half_even(float x) noexcept { return std::nearbyint(x); }  // default FE_TONEAREST

inline float mid_code(const QuantizerSpec& spec) noexcept {
  return spec.mode == Mode::ggml ? float(spec.levels() / 2) : float(spec.levels() - 1) * 0.5f;
}

/// The zero point of a group that stores none, in units of its scale: -mid_code, or 0 for a level
/// table (a code decodes to scale * level).
inline float implied_zero(const QuantizerSpec& spec) noexcept {
  return code_levels(spec) != nullptr ? 0.0f : -mid_code(spec);
}

/// ggml mode: the unrounded step d of a group led by `lead` (its value of largest magnitude).
inline float ggml_step(const QuantizerSpec& spec, float lead) noexcept {
  return spec.bits == 8 ? std::fabs(lead) / 127.0f : lead / -mid_code(spec);
}

// 1 / d as ggml takes it (0 for d = 0), and 0 where that overflows (a subnormal d), which ggml
// leaves to chance.
inline float ggml_inverse(float d) noexcept {
  const float inv = d != 0.0f ? 1.0f / d : 0.0f;
  return std::isfinite(inv) ? inv : 0.0f;
}

// a * b rounded to float on its own, never fused into a following addition (an FMA would round
// differently from ggml's reference, and differently from one build to the next).
inline float unfused_product(float a, float b) noexcept {
  volatile float p = a * b;
  return p;
}

/// ggml mode: the code of x for a group of inverse step inv (ggml_inverse of the unrounded step).
inline std::uint8_t ggml_encode(const QuantizerSpec& spec, float inv, float x) noexcept {
  const float top = float(spec.levels() - 1);
  if (spec.bits == 8) return std::uint8_t(std::clamp(std::round(x * inv) + 128.0f, 1.0f, top));
  return std::uint8_t(std::clamp(std::trunc(unfused_product(x, inv) + (mid_code(spec) + 0.5f)), 0.0f, top));
}

/// The first of the n values x[i * stride] of largest magnitude, with its sign.
inline float leading_value(const float* x, std::size_t n, std::size_t stride) noexcept {
  float lead = 0.0f, most = 0.0f;
  for (std::size_t i = 0; i < n; ++i)
    if (most < std::fabs(x[i * stride])) {
      most = std::fabs(x[i * stride]);
      lead = x[i * stride];
    }
  return lead;
}

/// Parameters for a group whose values span [min, max]; non-finite when unrepresentable.
inline GroupParams make_params(const QuantizerSpec& spec, float min, float max) noexcept {
  // Adding +0 turns -0 into +0: paths may pick either zero as min/max, the stored bytes must agree.
  min += 0.0f;
  max += 0.0f;
  const float top = float(spec.levels() - 1);
  if (spec.mode == Mode::asymmetric) return {round_to(spec.param, (max - min) / top), round_to(spec.param, min)};
  if (spec.mode == Mode::ggml) {
    const float scale = round_to(spec.param, ggml_step(spec, std::fabs(min) > std::fabs(max) ? min : max));
    return {scale, -mid_code(spec) * scale};
  }
  if (spec.mode == Mode::iq4_nl) {  // iq4_nl_params sets the scale; this is its largest magnitude
    // The least-squares scale is a weighted mean of x / T[code] over the group, each within
    // (-5, 7) times lead / T[0]: 7 absmax / 127 bounds it (kv_cache's representability check).
    // Its float sums of x^3 T terms (up to max_group_tokens of them) overflow past 2^36.
    const float absmax = std::max(std::fabs(min), std::fabs(max));
    if (absmax > 0x1p36f) return {std::numeric_limits<float>::infinity(), 0.0f, code_levels(spec)};
    return {round_to(spec.param, 7.0f * absmax / 127.0f), 0.0f, code_levels(spec)};
  }
  if (spec.mode == Mode::codebook)  // halving rounds below FLT_MIN only; a fused sum would skip that
    return {round_to(spec.param, (max - min) * 0.5f), round_to(spec.param, min + unfused_product(max - min, 0.5f)),
            code_levels(spec)};
  if (is_fp8(spec.mode))
    return {round_up_to(spec.param, std::max(std::fabs(min), std::fabs(max)) / fp8_max(fp8_format(spec.mode))), 0.0f,
            code_levels(spec)};
  if (const float* levels = code_levels(spec)) {
    const float outer = std::max(-levels[0], levels[spec.levels() - 1]);
    return {round_to(spec.param, std::max(std::fabs(min), std::fabs(max)) / outer), 0.0f, levels};
  }
  const float absmax = std::max(std::fabs(min), std::fabs(max));
  const float scale = round_to(spec.param, 2.0f * absmax / top);
  return {scale, -mid_code(spec) * scale};
}

/// ggml mode: the stored parameters of the n values x[i * stride] and the inverse step their codes
/// are rounded with.
inline std::pair<GroupParams, float> ggml_params(const QuantizerSpec& spec, const float* x, std::size_t n,
                                                 std::size_t stride) noexcept {
  const float d = ggml_step(spec, leading_value(x, n, stride));
  const float scale = round_to(spec.param, d);
  return {{scale, -mid_code(spec) * scale}, ggml_inverse(d)};
}

/// iq4_nl: the index of ggml's level nearest to v (ggml's best_index_int8).
inline std::uint8_t nearest_iq4_nl(float v) noexcept {
  const float* t = detail::iq4_nl.data();
  if (v <= t[0]) return 0;
  if (v >= t[15]) return 15;
  std::size_t lo = 0, hi = 15;
  while (hi - lo > 1) {
    const std::size_t mid = (lo + hi) / 2;
    (v < t[mid] ? hi : lo) = mid;
  }
  return std::uint8_t(v - t[hi - 1] < t[hi] - v ? hi - 1 : hi);
}

/// iq4_nl: the stored parameters of the n values x[i * stride] and the inverse step their codes
/// are found with (0 for a group of zeros).
inline std::pair<GroupParams, float> iq4_nl_params(const QuantizerSpec& spec, const float* x, std::size_t n,
                                                   std::size_t stride) noexcept {
  const float* t = detail::iq4_nl.data();
  const float lead = leading_value(x, n, stride);
  if (std::fabs(lead) < 1e-15f) return {{0.0f, 0.0f, t}, 0.0f};
  const float inv = 1.0f / (lead / t[0]);
  float sumqx = 0.0f, sumq2 = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    const float v = x[i * stride], level = t[nearest_iq4_nl(inv * v)], w = v * v;
    sumqx += w * level * v;
    sumq2 += w * level * level;
  }
  return {{round_to(spec.param, sumqx / sumq2), 0.0f, t}, inv};
}

inline bool representable(const GroupParams& p) noexcept { return std::isfinite(p.scale) && std::isfinite(p.zero); }

// One form for both affine modes, a subtraction then a product: no compiler can fuse it into an
// FMA, so every build and ISA rounds identically. ggml's form is its own (see the top).
inline std::uint8_t encode(const QuantizerSpec& spec, const GroupParams& p, float inv, float x) noexcept {
  if (spec.mode == Mode::ggml) return ggml_encode(spec, inv, x);
  if (spec.mode == Mode::iq4_nl) return inv == 0.0f ? 0 : nearest_iq4_nl(inv * x);
  if (is_fp8(spec.mode)) return float_to_fp8(fp8_format(spec.mode), x * inv);
  if (p.levels != nullptr) {  // the nearest level; midpoints of two floats are exact in double
    const double v = double((x - p.zero) * inv);
    std::uint8_t code = 0;
    for (int i = 1; i < spec.levels(); ++i)
      if (v >= 0.5 * (double(p.levels[i - 1]) + double(p.levels[i]))) code = std::uint8_t(i);
    return code;
  }
  const float top = float(spec.levels() - 1);
  return std::uint8_t(std::clamp(round_half_even((x - p.zero) * inv), 0.0f, top));
}

// Subnormal scales (possible with f32 parameters) would give an infinite inverse.
inline float inverse(float scale) noexcept { return scale >= std::numeric_limits<float>::min() ? 1.0f / scale : 0.0f; }

inline float decode(const GroupParams& p, std::uint8_t code) noexcept {
  return p.levels != nullptr ? p.zero + p.levels[code] * p.scale : p.zero + float(code) * p.scale;
}

/// The codes of the spec's lowest and highest finite level: decode() is linear in the code (or its
/// level), so these two bound what any code of a group decodes to.
inline std::pair<std::uint8_t, std::uint8_t> extreme_codes(const QuantizerSpec& spec) noexcept {
  const float* levels = code_levels(spec);
  if (levels == nullptr) return {std::uint8_t(0), std::uint8_t(spec.levels() - 1)};
  int lo = -1, hi = -1;
  for (int c = 0; c < spec.levels(); ++c)
    if (std::isfinite(levels[c])) {
      if (lo < 0 || levels[c] < levels[lo]) lo = c;
      if (hi < 0 || levels[c] > levels[hi]) hi = c;
    }
  return {std::uint8_t(lo), std::uint8_t(hi)};
}

/// A group's parameters from its stored scale and zero point (read only when the spec keeps one).
inline GroupParams group_params(const QuantizerSpec& spec, float scale, float zero) noexcept {
  if (spec.has_zero_point()) return {scale, zero, code_levels(spec)};
  if (const float* levels = code_levels(spec)) return {scale, 0.0f, levels};
  return {scale, -mid_code(spec) * scale};
}

/// Parameters as they were stored (reloaded from the parameter type).
inline GroupParams load_params(const QuantizerSpec& spec, const void* scales, const void* zeros,
                               std::size_t i) noexcept {
  return group_params(spec, load_scalar(spec.param, scales, i),
                      spec.has_zero_point() ? load_scalar(spec.param, zeros, i) : 0.0f);
}

inline void store_params(const QuantizerSpec& spec, void* scales, void* zeros, std::size_t i,
                         const GroupParams& p) noexcept {
  store_scalar(spec.param, scales, i, p.scale);
  if (spec.has_zero_point()) store_scalar(spec.param, zeros, i, p.zero);
}

/// A quantizer's outlier entries (spec.outliers per parameter group, in the order of the groups'
/// parameters): slots and corrections (parameter type). Null when the spec keeps none.
struct Outliers {
  std::uint16_t* slots = nullptr;
  void* corrections = nullptr;
};
struct ConstOutliers {
  const std::uint16_t* slots = nullptr;
  const void* corrections = nullptr;
};

/// The slots of the group's outliers, ascending, at `slots` (spec.outliers of them), for the
/// group's values x[i * stride], i < n; returns the range of the other values. Values order by
/// (value, slot), so ties resolve the same way on every path.
inline std::pair<float, float> pick_outliers(const QuantizerSpec& spec, const float* x, std::size_t n,
                                             std::size_t stride, std::uint16_t* slots) noexcept {
  bool out[max_group_tokens];
  std::fill_n(out, n, false);
  auto below = [&](std::size_t i, std::size_t j) {  // x[i] before x[j]
    const float a = x[i * stride] + 0.0f, b = x[j * stride] + 0.0f;
    return a < b || (a == b && i < j);
  };
  std::size_t lo = 0, lo2 = 0, hi = 0, hi2 = 0;
  // The two lowest and two highest values left (n - k >= 2 of them, as outliers < n).
  auto scan = [&] {
    std::size_t seen = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (out[i]) continue;
      if (seen++ == 0) {
        lo = hi = i;
        lo2 = hi2 = n;
        continue;
      }
      if (below(i, lo))
        lo2 = lo, lo = i;
      else if (lo2 == n || below(i, lo2))
        lo2 = i;
      if (below(hi, i))
        hi2 = hi, hi = i;
      else if (hi2 == n || below(hi2, i))
        hi2 = i;
    }
  };
  for (std::size_t k = 0; k < spec.outliers; ++k) {
    scan();
    const float min = x[lo * stride] + 0.0f, max = x[hi * stride] + 0.0f;
    const bool take_max = spec.mode == Mode::asymmetric
                              ? max - (x[lo2 * stride] + 0.0f) >= (x[hi2 * stride] + 0.0f) - min
                              : std::fabs(max) >= std::fabs(min);
    const std::size_t slot = take_max ? hi : lo;
    out[slot] = true;
    slots[k] = std::uint16_t(slot);
  }
  std::sort(slots, slots + spec.outliers);
  scan();
  return {x[lo * stride] + 0.0f, x[hi * stride] + 0.0f};
}

/// One token x (dim) per token: groups_per_row(spec, dim) parameter pairs at scales/zeros,
/// packed codes (packed_bytes(dim, bits)) at out, and spec.outliers entries per group.
inline void quantize_row_per_token(const QuantizerSpec& spec, const float* x, std::size_t dim, void* scales,
                                   void* zeros, std::uint8_t* out, Outliers outliers = {}) noexcept {
  std::uint8_t codes[max_head_dim];
  for (std::size_t g = 0, begin = 0; begin < dim; ++g, begin += spec.group) {
    const std::size_t end = std::min(dim, begin + spec.group);
    std::uint16_t* slots = spec.outliers == 0 ? nullptr : outliers.slots + g * spec.outliers;
    GroupParams p;
    float inv;
    if (spec.mode == Mode::ggml) {
      std::tie(p, inv) = ggml_params(spec, x + begin, end - begin, 1);
    } else if (spec.mode == Mode::iq4_nl) {
      std::tie(p, inv) = iq4_nl_params(spec, x + begin, end - begin, 1);
    } else {
      const auto [lo, hi] =
          spec.outliers > 0 ? pick_outliers(spec, x + begin, end - begin, 1, slots)
                            : std::pair{*std::min_element(x + begin, x + end), *std::max_element(x + begin, x + end)};
      p = make_params(spec, lo, hi);
      inv = inverse(p.scale);
    }
    store_params(spec, scales, zeros, g, p);
    for (std::size_t c = begin; c < end; ++c) codes[c] = encode(spec, p, inv, x[c]);
    for (std::size_t k = 0; k < spec.outliers; ++k) {
      const std::size_t c = begin + slots[k];
      store_scalar(spec.param, outliers.corrections, g * spec.outliers + k, x[c] - decode(p, codes[c]));
    }
  }
  pack_codes(codes, dim, spec.bits, out);
}

/// A block of `rows` tokens x (rows, stride) per channel: dim parameter pairs at scales/zeros,
/// one packed row of codes per token at out + r * row_bytes.
inline void quantize_block_per_channel(const QuantizerSpec& spec, const float* x, std::size_t rows, std::size_t dim,
                                       std::size_t stride, void* scales, void* zeros, std::uint8_t* out,
                                       std::size_t row_bytes, Outliers outliers = {}) noexcept {
  GroupParams params[max_head_dim];
  float inv[max_head_dim];
  for (std::size_t c = 0; c < dim; ++c) {
    if (spec.mode == Mode::ggml || spec.mode == Mode::iq4_nl) {
      std::tie(params[c], inv[c]) =
          spec.mode == Mode::ggml ? ggml_params(spec, x + c, rows, stride) : iq4_nl_params(spec, x + c, rows, stride);
      store_params(spec, scales, zeros, c, params[c]);
      continue;
    }
    float lo = x[c], hi = x[c];
    if (spec.outliers > 0) {
      std::tie(lo, hi) = pick_outliers(spec, x + c, rows, stride, outliers.slots + c * spec.outliers);
    } else {
      for (std::size_t r = 1; r < rows; ++r) {
        lo = std::min(lo, x[r * stride + c]);
        hi = std::max(hi, x[r * stride + c]);
      }
    }
    params[c] = make_params(spec, lo, hi);
    store_params(spec, scales, zeros, c, params[c]);
    inv[c] = inverse(params[c].scale);
  }
  std::uint8_t codes[max_head_dim];
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < dim; ++c) codes[c] = encode(spec, params[c], inv[c], x[r * stride + c]);
    pack_codes(codes, dim, spec.bits, out + r * row_bytes);
  }
  for (std::size_t e = 0; e < dim * spec.outliers; ++e) {
    const std::size_t c = e / spec.outliers;
    const float value = x[outliers.slots[e] * stride + c];
    store_scalar(spec.param, outliers.corrections, e,
                 value - decode(params[c], encode(spec, params[c], inv[c], value)));
  }
}

/// Inverse of quantize_row_per_token: out (dim).
inline void dequantize_row_per_token(const QuantizerSpec& spec, const std::uint8_t* packed, std::size_t dim,
                                     const void* scales, const void* zeros, float* out,
                                     ConstOutliers outliers = {}) noexcept {
  std::uint8_t codes[max_head_dim];
  unpack_codes(packed, dim, spec.bits, codes);
  for (std::size_t c = 0; c < dim; ++c) out[c] = decode(load_params(spec, scales, zeros, c / spec.group), codes[c]);
  for (std::size_t e = 0; e < groups_per_row(spec, dim) * spec.outliers; ++e)
    out[e / spec.outliers * spec.group + outliers.slots[e]] += load_scalar(spec.param, outliers.corrections, e);
}

/// Row `row` of a per-channel block: out (dim), with the block's dim parameter pairs (and
/// dim * spec.outliers outlier entries).
inline void dequantize_row_per_channel(const QuantizerSpec& spec, const std::uint8_t* packed, std::size_t dim,
                                       const void* scales, const void* zeros, float* out, std::size_t row = 0,
                                       ConstOutliers outliers = {}) noexcept {
  std::uint8_t codes[max_head_dim];
  unpack_codes(packed, dim, spec.bits, codes);
  for (std::size_t c = 0; c < dim; ++c) out[c] = decode(load_params(spec, scales, zeros, c), codes[c]);
  for (std::size_t e = 0; e < dim * spec.outliers; ++e)
    if (outliers.slots[e] == row) out[e / spec.outliers] += load_scalar(spec.param, outliers.corrections, e);
}

}  // namespace kvq::inline v0::kernels::reference
