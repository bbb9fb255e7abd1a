#pragma once
// A decode task and what every kernel shares: one KV head over a range of positions, computing
// the partial online-softmax state (running max, running sum, unnormalised output) of every
// query head that shares the KV head. decode.hpp splits the context into such tasks and merges
// them exactly. The reference kernel (vector.hpp on scalar ops) follows these definitions.
//
// Positions are walked in tiles: sinks in tiles of up to 32, then tiles of whole key blocks
// (per-channel groups, at least 64 positions) aligned to the first quantized position; each key
// block folds its own scales and zero points into the query.
// Two tiers, both defined here for every configuration:
//   exact:   fp32/fp64 arithmetic on the dequantized values zero + scale * code (pre-RoPE keys
//            rotated back when stored rotated, then RoPE-rotated, after dequantization;
//            post-RoPE key scales may fold into the query).
//   integer: for a tile of per-channel quantized post-RoPE keys,
//            score = q.(z + mid * scale) + a * sum(qi * (code - mid)), mid = (2^bits - 1) / 2,
//            where q~ = q * scale (scale folded into the query, per key block), a = max|q~| / 127 and
//            qi = rne(q~ / a) in [-127, 127]; for per-token quantized values, the weights
//            w = p * scale are quantized per tile and head to wq = rne(w / b) in [0, W]
//            (W = 255 for codes of up to 7 bits, 127 for 8-bit codes), b = B / W with the bound
//            B = max_t p_t * max_t,g scale_t,g (up to 7 bits; the heads share the scale factor)
//            or B = max_t,g w_t,g (8 bits), and the output gains
//            b * sum(wq * (code - mid)) + sum(p * (zero + mid * scale)), mid = (2^bits - 1) / 2. Everything else is
//            computed as in the exact tier.
// The x86 kernels implement the same definitions (up to exp() rounding and rounding ties).
// Caches with dense-and-sparse outliers (QuantizerSpec::outliers) run the exact tier for both:
// no integer path reads the outliers' corrections. So do caches with ggml's levels (Mode::ggml,
// centred at 2^(b-1), steps of either sign) or level tables (decode.hpp's kernel_tier).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvq/attention/options.hpp"
#include "kvq/attention/scores.hpp"
#include "kvq/cache/stream_layout.hpp"
#include "kvq/cache/stream_view.hpp"
#include "kvq/pack/bitpack.hpp"
#include "kvq/rope/rope.hpp"
#include "kvq/transform/hadamard.hpp"

namespace kvq::inline v0::kernels::attention {

/// Longest tile of positions a kernel works on at once; bounds the stack scratch.
inline constexpr std::size_t max_tile = max_tile_tokens;
/// Most query heads per KV head (GQA ratio) the kernels accept.
inline constexpr std::size_t max_group = 64;
/// Query heads a kernel keeps in registers at once: a GQA group runs in passes of up to this many.
inline constexpr std::size_t register_heads = 4;

/// Calls f.template operator()<h>() with h = heads (1 to register_heads; more run as
/// register_heads): a pass's head count as a constant, so its sums stay in registers. Every
/// kernel's head-count dispatch.
template <class F>
[[gnu::always_inline]] inline void with_heads(std::size_t heads, F&& f) noexcept {
  static_assert(register_heads == 4, "one case per head count");
  switch (heads) {
    case 1:
      return f.template operator()<1>();
    case 2:
      return f.template operator()<2>();
    case 3:
      return f.template operator()<3>();
    default:
      return f.template operator()<4>();
  }
}

/// Lane j's sign in an in-vector butterfly stage of distance 2^k (k < 4), for rotating key rows
/// back (DecodeTask::unrotate) in vectors of up to 16 lanes, and (k = 0) for RoPE's adjacent
/// pairs: + where bit k of j is clear. A lane
/// computes x_j * sign + x_(j ^ 2^k): the sum (+) or the difference (-) of the pair, rounded as
/// the scalar butterfly rounds it (x * -1 is exact).
inline constexpr auto butterfly_lane_signs = [] {
  std::array<std::array<float, 16>, 4> s{};
  for (std::size_t k = 0; k < 4; ++k)
    for (std::size_t j = 0; j < 16; ++j) s[k][j] = (j >> k & 1) != 0 ? -1.0f : 1.0f;
  return s;
}();

/// Whether a stream keeps dense-and-sparse outliers (only the vector kernel reads them).
inline bool has_outliers(const StreamView& s) noexcept { return s.quantized && s.spec.outliers > 0; }
/// Whether the integer tier reads a stream: unquantized, or kvq's own affine levels without
/// outliers. Every kernel computes the exact tier for a task with any other stream (computed_tier).
inline bool integer_tier_reads(const StreamView& s) noexcept {
  return !s.quantized || (s.spec.outliers == 0 && min_max_levels(s.spec.mode));
}
/// Whether a stream's codes index a level table (NormalFloat, Lloyd-Max, a codebook): the vector
/// kernels (and so the reference) read every such stream through the table; AVX-512 looks up
/// those of 2 to 4 bits in registers, AVX2 refuses them.
inline bool has_level_table(const StreamView& s) noexcept { return s.quantized && !affine_levels(s.spec.mode); }

/// One unit of decode work: the query heads of one KV head over positions [begin, end).
struct DecodeTask {
  StreamView keys, values;
  const RopeTable* rope = nullptr;  // non-null: keys are stored pre-RoPE and rotated to their position
  // Pre-RoPE keys stored rotated (CacheConfig::key_rotation): each key row is rotated back
  // (inverse) after dequantization, before RoPE. Null otherwise; post-RoPE rotated keys meet a
  // rotated query instead and need nothing here.
  const HadamardTransform* unrotate = nullptr;
  const float* queries = nullptr;  // (group, head_dim): rotated to the query position, times 1/sqrt(head_dim)
  std::size_t group = 1;           // query heads sharing the KV head
  std::size_t begin = 0, end = 0;
  Tier tier = Tier::exact;
  float softcap = 0.0f;  // > 0: scores become softcap * tanh(score / softcap) before the softmax
  // A cache stores a stream in segments (blocks); a range crossing several runs once per segment,
  // each continuing the state the previous one left, and gives the bits of one pass over them.
  bool resume = false;  // true: max, sum and acc already hold the state of the positions before begin
  // The rows of the next segment the range reads (its packed codes, or its ring for a tensor kept
  // in full; null: none), where kernels that read ahead continue once past this segment's end:
  // the memory after a segment is another block's.
  const std::uint8_t* next_keys = nullptr;
  const std::uint8_t* next_values = nullptr;
  // Output: the online-softmax state over [begin, end).
  float* max = nullptr;  // (group) running maximum score (-inf if the range is empty)
  float* sum = nullptr;  // (group) sum of exp(score - max)
  float* acc = nullptr;  // (group, head_dim) sum of exp(score - max) * value
};

/// The tier kernels compute for a task: the one it asks for, or exact where a stream is one the
/// integer tier does not read (integer_tier_reads).
inline Tier computed_tier(const DecodeTask& t) noexcept {
  return t.tier == Tier::integer && integer_tier_reads(t.keys) && integer_tier_reads(t.values) ? Tier::integer
                                                                                               : Tier::exact;
}

/// Where a kernel reading the rows [begin, end) of a segment prefetches ahead of `row`: `distance`
/// bytes further (at most the segment's length), continuing into the next segment's rows (`next`)
/// once past the end, or nowhere (null) after the last segment.
inline const std::uint8_t* read_ahead(const std::uint8_t* row, const std::uint8_t* begin, const std::uint8_t* end,
                                      const std::uint8_t* next, std::size_t distance) noexcept {
  const std::size_t size = std::size_t(end - begin), ahead = std::size_t(row - begin) + std::min(distance, size);
  if (ahead < size) return begin + ahead;
  return next == nullptr ? nullptr : next + (ahead - size);
}

/// Tile length (stream_layout.hpp). Tiles start at first_quantized and chunks are whole tiles,
/// so tile boundaries (and with them the integer tier's per-tile weight quantization) do not
/// depend on the chunk size.
inline std::size_t tile_tokens(const StreamView& keys) noexcept { return kvq::tile_tokens(keys.spec, keys.quantized); }

/// End of the tile starting at p: sinks in tiles of up to 32, then tiles aligned to first_quantized.
inline std::size_t tile_end(const StreamView& keys, std::size_t p, std::size_t end) noexcept {
  const std::size_t s = keys.first_quantized;
  if (p < s) return std::min({s, p + 32, end});
  const std::size_t t = tile_tokens(keys);
  return std::min(end, s + ((p - s) / t + 1) * t);
}

/// End of the key block holding p, at most b: the next group boundary where keys are quantized
/// per channel (each block folds its own scales), else b.
inline std::size_t key_block_end(const StreamView& k, std::size_t p, std::size_t b) noexcept {
  if (!k.quantized || k.spec.axis != Axis::per_channel || p < k.first_quantized || p >= k.end_quantized) return b;
  return std::min(b, k.first_quantized + ((p - k.first_quantized) / k.spec.group + 1) * k.spec.group);
}

/// True when the whole tile [a, b) holds quantized per-channel keys of one block.
inline bool quantized_key_block(const StreamView& k, std::size_t a, std::size_t b) noexcept {
  return k.quantized && k.spec.axis == Axis::per_channel && a >= k.first_quantized && b <= k.end_quantized &&
         (a - k.first_quantized) / k.spec.group == (b - 1 - k.first_quantized) / k.spec.group;
}

/// Quantized per-token value rows of the tile: [first, last).
inline std::pair<std::size_t, std::size_t> quantized_value_rows(const StreamView& v, std::size_t a,
                                                                std::size_t b) noexcept {
  if (!v.quantized || v.spec.axis != Axis::per_token) return {a, a};
  const std::size_t first = std::max(a, v.first_quantized), last = std::min(b, v.end_quantized);
  return first < last ? std::pair{first, last} : std::pair{a, a};
}

/// The largest integer weight for codes of `bits`: u8 weights when codes fit a signed byte.
constexpr float weight_levels(int bits) noexcept { return bits <= 7 ? 255.0f : 127.0f; }

/// levels / bound, the inverse of the quantization step bound / levels; 0 when that would not be
/// finite (a zero or subnormal bound, or one below levels / FLT_MAX: the weights of a tile far
/// below the running maximum are about the smallest normal float).
inline float inverse_step(float levels, float bound) noexcept {
  return bound > levels / std::numeric_limits<float>::max() ? levels / bound : 0.0f;
}

/// Online softmax of one head, first half: the running maximum raised to the tile's scores' and
/// the state (sum, acc) rescaled to it.
inline void raise_max(const float* scores, std::size_t n, float& max, float& sum, float* acc,
                      std::size_t dim) noexcept {
  float m = max;
  for (std::size_t t = 0; t < n; ++t) m = std::max(m, scores[t]);
  const float correction = max == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(max - m);
  if (correction != 1.0f) {
    sum *= correction;
    for (std::size_t c = 0; c < dim; ++c) acc[c] *= correction;
  }
  max = m;
}

/// Online-softmax update of one head with a tile's scores; scores become exp(score - new max).
inline void softmax_update(float* scores, std::size_t n, float& max, float& sum, float* acc, std::size_t dim) noexcept {
  raise_max(scores, n, max, sum, acc, dim);
  const float m = max;
  for (std::size_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - m);
    sum += scores[t];
  }
}

/// The empty online-softmax state, unless the task continues one (DecodeTask::resume).
inline void start_state(const DecodeTask& task) noexcept {
  if (task.resume) return;
  const std::size_t dim = task.keys.head_dim;
  for (std::size_t h = 0; h < task.group; ++h) {
    task.max[h] = -std::numeric_limits<float>::infinity();
    task.sum[h] = 0.0f;
    std::fill(task.acc + h * dim, task.acc + (h + 1) * dim, 0.0f);
  }
}

namespace detail {

/// Unpacks the codes of row p of a quantized stream: out (dim).
inline void codes_of(const StreamView& s, std::size_t p, std::uint8_t* out) noexcept {
  unpack_codes(s.code_row(p), s.head_dim, s.spec.bits, out);
}

inline float param(const StreamView& s, const std::uint8_t* base, std::size_t i) noexcept {
  return load_scalar(s.spec.param, base, i);
}

/// Integer-tier key scores of rows [a, b) (one quantized per-channel block, post-RoPE) of the
/// tile starting at `tile`.
inline void integer_key_scores(const DecodeTask& task, std::size_t a, std::size_t b, std::size_t tile,
                               float (*scores)[max_tile]) noexcept {
  const StreamView& k = task.keys;
  const std::size_t dim = k.head_dim, pi = k.param_index(a);
  float scale[max_head_dim], zero[max_head_dim];
  for (std::size_t c = 0; c < dim; ++c) {
    const auto gp = reference::load_params(k.spec, k.scales + pi * size_of(k.spec.param),
                                           k.zeros == nullptr ? nullptr : k.zeros + pi * size_of(k.spec.param), c);
    scale[c] = gp.scale;
    zero[c] = gp.zero;
  }
  std::int8_t qi[max_head_dim];
  std::uint8_t codes[max_head_dim];
  for (std::size_t h = 0; h < task.group; ++h) {
    const float* q = task.queries + h * dim;
    // Centred as for values: the bias is q.(zero + mid * scale) and the codes count from mid.
    const float mid = reference::mid_code(k.spec);
    float amax = 0.0f, bias = 0.0f;
    for (std::size_t c = 0; c < dim; ++c) {
      amax = std::max(amax, std::fabs(q[c] * scale[c]));
      bias += q[c] * (zero[c] + mid * scale[c]);
    }
    // A tiny maximum would give an infinite inverse (and an undefined int conversion).
    const float inv = inverse_step(127.0f, amax), alpha = amax / 127.0f;
    std::int32_t qsum = 0;
    for (std::size_t c = 0; c < dim; ++c) {
      qi[c] = std::int8_t(std::nearbyint(q[c] * scale[c] * inv));
      qsum += qi[c];
    }
    for (std::size_t p = a; p < b; ++p) {
      codes_of(k, p, codes);
      std::int32_t dot = 0;
      for (std::size_t c = 0; c < dim; ++c) dot += std::int32_t(qi[c]) * std::int32_t(codes[c]);
      scores[h][p - tile] = bias + alpha * (float(dot) - mid * float(qsum));
    }
  }
}

/// Integer-tier value accumulation of rows [a, b) (quantized per token) with weights p (exp'd scores).
inline void integer_values(const DecodeTask& task, std::size_t tile_begin, std::size_t a, std::size_t b,
                           float (*weights)[max_tile]) noexcept {
  const StreamView& v = task.values;
  const std::size_t dim = v.head_dim, groups = groups_per_row(v.spec, dim), psize = size_of(v.spec.param);
  const float levels = weight_levels(v.spec.bits);
  std::uint8_t codes[max_head_dim];
  for (std::size_t h = 0; h < task.group; ++h) {
    float* acc = task.acc + h * dim;
    // The step: codes of up to 7 bits bound the weights by (largest weight of the rows) x (largest
    // scale of the rows), which the heads share; 8-bit codes (127 levels) use the exact maximum.
    float wmax = 0.0f;
    if (v.spec.bits <= 7) {
      float pmax = 0.0f, smax = 0.0f;
      for (std::size_t p = a; p < b; ++p) {
        pmax = std::max(pmax, weights[h][p - tile_begin]);
        for (std::size_t g = 0; g < groups; ++g) smax = std::max(smax, param(v, v.scales, v.param_index(p) + g));
      }
      wmax = pmax * smax;
    } else {
      for (std::size_t p = a; p < b; ++p)
        for (std::size_t g = 0; g < groups; ++g)
          wmax = std::max(wmax, weights[h][p - tile_begin] * param(v, v.scales, v.param_index(p) + g));
    }
    const float inv = inverse_step(levels, wmax), beta = wmax / levels;
    // Centred codes: value = (zero + mid * scale) + scale * (code - mid), so the weights' rounding
    // error multiplies code - mid (small) and the large zero term uses the exact weights.
    const float mid = reference::mid_code(v.spec);
    std::int32_t dots[max_head_dim] = {}, wsum[max_head_dim] = {};
    float zsum[max_head_dim] = {};
    for (std::size_t p = a; p < b; ++p) {
      codes_of(v, p, codes);
      const float w = weights[h][p - tile_begin];
      for (std::size_t g = 0; g < groups; ++g) {
        const auto gp = reference::load_params(v.spec, v.scales + v.param_index(p) * psize,
                                               v.zeros == nullptr ? nullptr : v.zeros + v.param_index(p) * psize, g);
        const auto wq = std::int32_t(std::nearbyint(w * gp.scale * inv));
        for (std::size_t c = g * v.spec.group; c < std::min(dim, (g + 1) * v.spec.group); ++c) {
          dots[c] += wq * std::int32_t(codes[c]);
          wsum[c] += wq;
          zsum[c] += w * (gp.zero + mid * gp.scale);
        }
      }
    }
    for (std::size_t c = 0; c < dim; ++c) acc[c] += beta * (float(dots[c]) - mid * float(wsum[c])) + zsum[c];
  }
}

}  // namespace detail

}  // namespace kvq::inline v0::kernels::attention
