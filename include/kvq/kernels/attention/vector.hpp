#pragma once
// Decode attention written once over a vector-ops type (kernels/ops/): the tile loop, key scores,
// online softmax, RoPE and value accumulation of task.hpp, with the dot products and the value
// updates in vectors of Ops::width lanes. On scalar ops (fp64 products) it is the reference
// kernel, which takes every configuration; on NEON it is the AArch64 kernel; on AVX2 and AVX-512
// ops it runs after the hand-tuned x86 kernels (registry.hpp), for caches they refuse or read
// only row by row, and is measured against them. A new instruction set is one ops file and one
// registry entry.
//
// Keys: a packed per-channel block folds its scales into the query (post-RoPE) or is dequantized
// row by row and rotated (pre-RoPE); rows packed per token in groups of whole vectors are
// dequantized in vectors (and rotated when pre-RoPE); other rows are read through
// StreamView::read_row. Pre-RoPE keys stored rotated (DecodeTask::unrotate) are rotated back
// first, once per row for the whole GQA group. Each row
// is dotted with every query head of the GQA group. Values packed per token add
// (p * scale) * code + p * zero per group; other rows are read whole. The integer tier computes
// task.hpp's definitions: its sums of integer products are integers below 2^24 here, which fp32
// vector FMAs add exactly (on scalar ops, the reference, task.hpp's loops run as written).
// Dense-and-sparse outliers add their
// corrections: q . e to a key's score (post-RoPE), e to a dequantized key row before rotation
// (pre-RoPE), p * e to a value channel; caches with them run the exact tier for both tiers.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "kvq/attention/scores.hpp"
#include "kvq/isa.hpp"
#include "kvq/kernels/attention/task.hpp"
#include "kvq/kernels/ops/scalar.hpp"
// The x86 entry points rely on GCC's `flatten` inlining the ops into a target function; clang
// refuses vector arguments in the template's own (untargeted) functions, so its builds leave them
// out: there they do not exist by name, caches the hand-tuned kernels refuse (outliers, level
// tables off AVX-512, rotated pre-RoPE keys off AVX-512) run on the reference kernel, and those
// they read only row by row stay on them.
#if defined(KVQ_HAVE_X86_KERNELS) && !defined(__clang__)
#define KVQ_HAVE_X86_VECTOR_KERNELS 1
#include "kvq/kernels/ops/avx2.hpp"
#include "kvq/kernels/ops/avx512.hpp"
#endif
#if defined(__aarch64__)
#include "kvq/kernels/ops/neon.hpp"
#endif

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::attention {

template <class Ops>
struct VectorKernel {
  static constexpr std::size_t width = Ops::width;
  static constexpr std::size_t heads_per_pass = 8;     // folded queries on the stack: 8 x max_head_dim
  static constexpr std::size_t max_value_groups = 64;  // per-token value groups per row, integer tier

  /// Shapes the kernel takes: head_dim a multiple of the vector width.
  static bool accepts(const StreamView& keys, const StreamView& values, std::size_t group, const RopeTable*) noexcept {
    const std::size_t d = keys.head_dim;
    return d > 0 && d % width == 0 && d <= max_head_dim && values.head_dim == d && group > 0 && group <= max_group;
  }

  /// a . b over n channels (a multiple of the width), in two accumulators.
  static float dot(const float* a, const float* b, std::size_t n) noexcept {
    typename Ops::Vec s0 = Ops::zero(), s1 = Ops::zero();
    std::size_t c = 0;
    for (; c + 2 * width <= n; c += 2 * width) {
      s0 = Ops::fma(Ops::load(a + c), Ops::load(b + c), s0);
      s1 = Ops::fma(Ops::load(a + c + width), Ops::load(b + c + width), s1);
    }
    if (c < n) s0 = Ops::fma(Ops::load(a + c), Ops::load(b + c), s0);
    return Ops::sum(Ops::add(s0, s1));
  }

  /// acc += w * row over n channels.
  static void add_scaled(float w, const float* row, float* acc, std::size_t n) noexcept {
    const typename Ops::Vec wv = Ops::set1(w);
    for (std::size_t c = 0; c < n; c += width)
      Ops::store(acc + c, Ops::fma(wv, Ops::load(row + c), Ops::load(acc + c)));
  }

  /// The codes of row p of a packed stream as floats (the levels they name, for a level table):
  /// out (head_dim).
  static void codes_of(const StreamView& s, std::size_t p, float* out) noexcept {
    const std::uint8_t* in = s.code_row(p);
    const std::size_t n = s.head_dim;
    if (s.spec.bits == 8) {
      for (std::size_t c = 0; c < n; ++c) out[c] = float(in[c]);
    } else if (s.spec.bits == 4 && n % 2 == 0) {  // byte by byte, constant shifts: the loops vectorize
      for (std::size_t i = 0; i < n / 2; ++i) {
        out[2 * i] = float(in[i] & 15u);
        out[2 * i + 1] = float(in[i] >> 4);
      }
    } else if (s.spec.bits == 2 && n % 4 == 0) {
      for (std::size_t i = 0; i < n / 4; ++i)
        for (unsigned k = 0; k < 4; ++k) out[4 * i + k] = float((in[i] >> (2 * k)) & 3u);
    } else {
      std::uint8_t codes[max_head_dim];
      unpack_codes(in, n, s.spec.bits, codes);
      for (std::size_t c = 0; c < n; ++c) out[c] = float(codes[c]);
    }
    if (const float* levels = code_levels(s.spec))  // a level table: the level each code names
      for (std::size_t c = 0; c < n; ++c) out[c] = levels[std::size_t(out[c])];
  }

  /// The scales and zero points of the packed per-channel key block holding row a: (head_dim) each.
  static void load_key_params(const StreamView& k, std::size_t a, float* scale, float* zero) noexcept {
    const std::size_t pi = k.param_index(a), psize = size_of(k.spec.param);
    for (std::size_t c = 0; c < k.head_dim; ++c) {
      const auto gp =
          reference::load_params(k.spec, k.scales + pi * psize, k.zeros == nullptr ? nullptr : k.zeros + pi * psize, c);
      scale[c] = gp.scale;
      zero[c] = gp.zero;
    }
  }

  /// Exact scores of the packed per-channel key block [a, b) of the tile starting at `tile`: the
  /// block's scales fold into the query (score = q.zero + (q * scale).code), or, pre-RoPE, its
  /// rows are dequantized (zero + scale * code) and rotated. Query heads go in passes of
  /// heads_per_pass, each unpacking the rows once.
  static void key_block_scores(const DecodeTask& task, std::size_t a, std::size_t b, std::size_t tile,
                               float (*scores)[max_tile]) noexcept {
    const StreamView& k = task.keys;
    const std::size_t dim = k.head_dim, pi = k.param_index(a);
    alignas(64) float scale[max_head_dim], zero[max_head_dim], row[max_head_dim];
    load_key_params(k, a, scale, zero);
    if (task.rope != nullptr) {
      const std::size_t n = k.spec.outliers, group_start = a - (a - k.first_quantized) % k.spec.group;
      for (std::size_t p = a; p < b; ++p) {
        codes_of(k, p, row);
        for (std::size_t c = 0; c < dim; c += width)
          Ops::store(row + c, Ops::fma(Ops::load(scale + c), Ops::load(row + c), Ops::load(zero + c)));
        for (std::size_t e = pi * n; e < (pi + dim) * n; ++e)
          if (group_start + k.outlier_slots[e] == p)
            row[(e - pi * n) / n] += load_scalar(k.spec.param, k.outlier_corrections, e);
        if (task.unrotate != nullptr) unrotate_row(*task.unrotate, row);
        task.rope->rotate_unscaled(row, p);
        for (std::size_t h = 0; h < task.group; ++h) scores[h][p - tile] = dot(task.queries + h * dim, row, dim);
      }
      return;
    }
    alignas(64) float folded[heads_per_pass][max_head_dim];
    float bias[heads_per_pass];
    for (std::size_t h0 = 0; h0 < task.group; h0 += heads_per_pass) {
      const std::size_t heads = std::min(heads_per_pass, task.group - h0);
      for (std::size_t h = 0; h < heads; ++h) {
        const float* q = task.queries + (h0 + h) * dim;
        for (std::size_t c = 0; c < dim; ++c) folded[h][c] = q[c] * scale[c];
        bias[h] = dot(q, zero, dim);
      }
      for (std::size_t p = a; p < b; ++p) {
        codes_of(k, p, row);
        for (std::size_t h = 0; h < heads; ++h) scores[h0 + h][p - tile] = bias[h] + dot(folded[h], row, dim);
      }
    }
  }

  /// Whether n products of integers up to `a` and `b` sum exactly in fp32 (below 2^24), whatever
  /// their order: then a vector dot product of integer-valued floats is the integer dot product.
  static constexpr bool sums_exactly(std::size_t n, std::size_t a, std::size_t b) noexcept {
    return n * a * b < (std::size_t{1} << 24);
  }

  /// The integer tier's key scores of the packed per-channel key block [a, b) (post-RoPE):
  /// detail::integer_key_scores, with each row's int8 x code sum taken as a vector dot product.
  static void integer_key_block_scores(const DecodeTask& task, std::size_t a, std::size_t b, std::size_t tile,
                                       float (*scores)[max_tile]) noexcept {
    const StreamView& k = task.keys;
    const std::size_t dim = k.head_dim;
    if (Ops::width == 1 || !sums_exactly(dim, 127, (std::size_t{1} << k.spec.bits) - 1))
      return detail::integer_key_scores(task, a, b, tile, scores);
    alignas(64) float scale[max_head_dim], zero[max_head_dim], row[max_head_dim];
    load_key_params(k, a, scale, zero);
    const float mid = reference::mid_code(k.spec);
    alignas(64) float qi[heads_per_pass][max_head_dim];
    float bias[heads_per_pass], alpha[heads_per_pass], qsum[heads_per_pass];
    for (std::size_t h0 = 0; h0 < task.group; h0 += heads_per_pass) {
      const std::size_t heads = std::min(heads_per_pass, task.group - h0);
      for (std::size_t h = 0; h < heads; ++h) {
        const float* q = task.queries + (h0 + h) * dim;
        float amax = 0.0f;
        bias[h] = 0.0f;
        for (std::size_t c = 0; c < dim; ++c) {
          amax = std::max(amax, std::fabs(q[c] * scale[c]));
          bias[h] += q[c] * (zero[c] + mid * scale[c]);
        }
        const float inv = inverse_step(127.0f, amax);
        alpha[h] = amax / 127.0f;
        std::int32_t sum = 0;
        for (std::size_t c = 0; c < dim; ++c) {
          const auto code = std::int8_t(std::nearbyint(q[c] * scale[c] * inv));
          qi[h][c] = float(code);
          sum += code;
        }
        qsum[h] = float(sum);
      }
      for (std::size_t p = a; p < b; ++p) {
        codes_of(k, p, row);
        for (std::size_t h = 0; h < heads; ++h)
          scores[h0 + h][p - tile] = bias[h] + alpha[h] * (dot(qi[h], row, dim) - mid * qsum[h]);
      }
    }
  }

  /// The integer tier's value accumulation of packed per-token rows [a, b) with weights (exp'd
  /// scores): detail::integer_values, each row's codes unpacked once for every head and its
  /// integer weight x code sums taken in vectors.
  static void integer_value_rows(const DecodeTask& task, std::size_t tile_begin, std::size_t a, std::size_t b,
                                 float (*weights)[max_tile]) noexcept {
    const StreamView& v = task.values;
    const std::size_t dim = v.head_dim, group = v.spec.group, groups = groups_per_row(v.spec, dim);
    const std::size_t psize = size_of(v.spec.param), top = (std::size_t{1} << v.spec.bits) - 1;
    const float levels = weight_levels(v.spec.bits);
    if (Ops::width == 1 || group % width != 0 || groups > max_value_groups ||
        !sums_exactly(b - a, std::size_t(levels), top))
      return detail::integer_values(task, tile_begin, a, b, weights);
    const float mid = reference::mid_code(v.spec);
    // The weights' step as detail::integer_values takes it (codes of up to 7 bits: the largest
    // weight times the largest scale of the rows, both shared by the heads).
    float smax = 0.0f;
    for (std::size_t p = a; p < b; ++p)
      for (std::size_t g = 0; g < groups; ++g) smax = std::max(smax, detail::param(v, v.scales, v.param_index(p) + g));
    alignas(64) float dots[heads_per_pass][max_head_dim], codes[max_head_dim];
    float inv[heads_per_pass], beta[heads_per_pass], wsum[heads_per_pass][max_value_groups],
        zsum[heads_per_pass][max_value_groups];
    for (std::size_t h0 = 0; h0 < task.group; h0 += heads_per_pass) {
      const std::size_t heads = std::min(heads_per_pass, task.group - h0);
      for (std::size_t h = 0; h < heads; ++h) {
        const float* w = weights[h0 + h] - tile_begin;
        float wmax = 0.0f;
        if (v.spec.bits <= 7) {
          float pmax = 0.0f;
          for (std::size_t p = a; p < b; ++p) pmax = std::max(pmax, w[p]);
          wmax = pmax * smax;
        } else {
          for (std::size_t p = a; p < b; ++p)
            for (std::size_t g = 0; g < groups; ++g)
              wmax = std::max(wmax, w[p] * detail::param(v, v.scales, v.param_index(p) + g));
        }
        inv[h] = inverse_step(levels, wmax);
        beta[h] = wmax / levels;
        std::fill(dots[h], dots[h] + dim, 0.0f);
        std::fill(wsum[h], wsum[h] + groups, 0.0f);
        std::fill(zsum[h], zsum[h] + groups, 0.0f);
      }
      for (std::size_t p = a; p < b; ++p) {
        codes_of(v, p, codes);
        const std::size_t pi = v.param_index(p);
        for (std::size_t g = 0; g < groups; ++g) {
          const auto gp = reference::load_params(v.spec, v.scales + pi * psize,
                                                 v.zeros == nullptr ? nullptr : v.zeros + pi * psize, g);
          const float centre = gp.zero + mid * gp.scale;
          for (std::size_t h = 0; h < heads; ++h) {
            const float w = weights[h0 + h][p - tile_begin];
            const float wq = float(std::int32_t(std::nearbyint(w * gp.scale * inv[h])));
            const typename Ops::Vec wv = Ops::set1(wq);
            for (std::size_t c = g * group; c < std::min(dim, (g + 1) * group); c += width)
              Ops::store(dots[h] + c, Ops::fma(wv, Ops::load(codes + c), Ops::load(dots[h] + c)));
            wsum[h][g] += wq;
            zsum[h][g] += w * centre;
          }
        }
      }
      for (std::size_t h = 0; h < heads; ++h) {
        float* acc = task.acc + (h0 + h) * dim;
        for (std::size_t c = 0; c < dim; ++c)
          acc[c] += beta[h] * (dots[h][c] - mid * wsum[h][c / group]) + zsum[h][c / group];
      }
    }
  }

  static_assert(width <= 16, "butterfly_lane_signs covers vectors of up to 16 lanes");

  /// y <- y rotated back (HadamardTransform::inverse_head's sums and differences, in vectors):
  /// the butterflies within vectors, then between them, then the norm and the signs. A block is
  /// never narrower than a vector: head_dim is a multiple of the width (accepts).
  static void unrotate_row(const HadamardTransform& t, float* y) noexcept {
    if constexpr (width == 1) {
      t.inverse_head(y);
    } else {
      const std::size_t dim = t.dim(), block = t.block();
      // Within each vector, distances 1, 2, 4, 8 below the width (butterfly_lane_signs). No Vec
      // crosses a function boundary here: the ops' target attributes reach only the flattened
      // entry points.
      for (std::size_t c = 0; c < dim; c += width) {
        typename Ops::Vec x = Ops::load(y + c);
        auto stage = [&]<std::size_t len>() {
          if constexpr (len < width)
            x = Ops::fma(x, Ops::load(butterfly_lane_signs[std::countr_zero(len)].data()),
                         Ops::template exchange<len>(x));
        };
        stage.template operator()<1>();
        stage.template operator()<2>();
        stage.template operator()<4>();
        stage.template operator()<8>();
        Ops::store(y + c, x);
      }
      for (std::size_t len = width; len < block; len *= 2)
        for (std::size_t i = 0; i < dim; i += 2 * len)
          for (std::size_t j = i; j < i + len; j += width) {
            const typename Ops::Vec a = Ops::load(y + j), c = Ops::load(y + j + len);
            Ops::store(y + j, Ops::add(a, c));
            Ops::store(y + j + len, Ops::sub(a, c));
          }
      const typename Ops::Vec norm = Ops::set1(t.norm());
      const std::span<const float> signs = t.signs();
      for (std::size_t c = 0; c < dim; c += width) {
        typename Ops::Vec x = Ops::mul(Ops::load(y + c), norm);
        if (!signs.empty()) x = Ops::mul(x, Ops::load(signs.data() + c));
        Ops::store(y + c, x);
      }
    }
  }

  /// Whether row p of `s` is packed per token in groups the vectors cover whole (on scalar ops,
  /// the reference, rows are read as StreamView::read_row defines them).
  static bool vector_token_row(const StreamView& s, std::size_t p) noexcept {
    return width > 1 && s.quantized && s.spec.axis == Axis::per_token && s.spec.group % width == 0 &&
           p >= s.first_quantized && p < s.end_quantized;
  }

  /// Row p of a stream packed per token (vector_token_row): zero + scale * code per group in
  /// vectors, plus its outliers' corrections; StreamView::read_row up to fused rounding.
  static void dequantize_token_row(const StreamView& s, std::size_t p, float* out) noexcept {
    const std::size_t dim = s.head_dim, group = s.spec.group, pi = s.param_index(p), psize = size_of(s.spec.param);
    codes_of(s, p, out);
    for (std::size_t g = 0; g * group < dim; ++g) {
      const auto gp =
          reference::load_params(s.spec, s.scales + pi * psize, s.zeros == nullptr ? nullptr : s.zeros + pi * psize, g);
      const typename Ops::Vec scale = Ops::set1(gp.scale), zero = Ops::set1(gp.zero);
      for (std::size_t c = g * group; c < std::min(dim, (g + 1) * group); c += width)
        Ops::store(out + c, Ops::fma(scale, Ops::load(out + c), zero));
    }
    const std::size_t n = s.spec.outliers;
    for (std::size_t e = pi * n; e < (pi + groups_per_row(s.spec, dim)) * n; ++e)
      out[(e - pi * n) / n * group + s.outlier_slots[e]] += load_scalar(s.spec.param, s.outlier_corrections, e);
  }

  /// Dense-and-sparse keys: the scores of rows [a, b) of a packed per-channel block (post-RoPE)
  /// gain q . e for each outlier's correction e.
  static void add_key_outliers(const DecodeTask& task, std::size_t a, std::size_t b, std::size_t tile,
                               float (*scores)[max_tile]) noexcept {
    const StreamView& k = task.keys;
    const std::size_t n = k.spec.outliers, dim = k.head_dim, first = k.param_index(a) * n;
    const std::size_t group_start = a - (a - k.first_quantized) % k.spec.group;
    for (std::size_t e = first; e < first + dim * n; ++e) {
      const std::size_t row = group_start + k.outlier_slots[e];
      if (row < a || row >= b) continue;
      const float correction = load_scalar(k.spec.param, k.outlier_corrections, e);
      const float* q = task.queries + (e - first) / n;
      for (std::size_t h = 0; h < task.group; ++h) scores[h][row - tile] += q[h * dim] * correction;
    }
  }

  /// Dense-and-sparse values: acc += w * e at each outlier of packed per-token row p.
  static void add_value_outliers(const DecodeTask& task, std::size_t p, const float* weights,
                                 std::size_t stride) noexcept {
    const StreamView& v = task.values;
    const std::size_t n = v.spec.outliers, dim = v.head_dim, first = v.param_index(p) * n;
    for (std::size_t e = first; e < first + groups_per_row(v.spec, dim) * n; ++e) {
      const std::size_t c = (e - first) / n * v.spec.group + v.outlier_slots[e];
      const float correction = load_scalar(v.spec.param, v.outlier_corrections, e);
      for (std::size_t h = 0; h < task.group; ++h) task.acc[h * dim + c] += weights[h * stride] * correction;
    }
  }

  /// acc += w * value row p for every head, the row packed per token in groups of a multiple of
  /// the width: each group adds (w * scale) * code + w * zero, never a dequantized row.
  static void add_packed_value_row(const DecodeTask& task, std::size_t p, const float* weights,
                                   std::size_t stride) noexcept {
    const StreamView& v = task.values;
    const std::size_t dim = v.head_dim, group = v.spec.group, pi = v.param_index(p), psize = size_of(v.spec.param);
    alignas(64) float codes[max_head_dim];
    codes_of(v, p, codes);
    for (std::size_t g = 0; g * group < dim; ++g) {
      const auto gp =
          reference::load_params(v.spec, v.scales + pi * psize, v.zeros == nullptr ? nullptr : v.zeros + pi * psize, g);
      const std::size_t end = std::min(dim, (g + 1) * group);
      for (std::size_t h = 0; h < task.group; ++h) {
        const float w = weights[h * stride];
        const typename Ops::Vec ws = Ops::set1(w * gp.scale), wz = Ops::set1(w * gp.zero);
        float* acc = task.acc + h * dim;
        for (std::size_t c = g * group; c < end; c += width)
          Ops::store(acc + c, Ops::add(Ops::fma(ws, Ops::load(codes + c), Ops::load(acc + c)), wz));
      }
    }
  }

  static void run(const DecodeTask& task) noexcept {
    const StreamView &k = task.keys, &v = task.values;
    const std::size_t dim = k.head_dim;
    start_state(task);
    float scores[max_group][max_tile];
    alignas(64) float row[max_head_dim];
    const bool packed_values = v.quantized && v.spec.axis == Axis::per_token && v.spec.group % width == 0;
    const bool integer = computed_tier(task) == Tier::integer;
    for (std::size_t a = task.begin; a < task.end;) {
      const std::size_t b = tile_end(k, a, task.end), n = b - a;
      // Keys block by block (a tile holds whole key blocks when keys are quantized per channel).
      for (std::size_t s0 = a; s0 < b;) {
        std::size_t s1 = b;
        if (k.quantized && k.spec.axis == Axis::per_channel && s0 >= k.first_quantized && s0 < k.end_quantized)
          s1 = std::min(b, k.first_quantized + ((s0 - k.first_quantized) / k.spec.group + 1) * k.spec.group);
        if (quantized_key_block(k, s0, s1)) {
          if (integer && task.rope == nullptr)
            integer_key_block_scores(task, s0, s1, a, scores);
          else
            key_block_scores(task, s0, s1, a, scores);
          if (has_outliers(k) && task.rope == nullptr) add_key_outliers(task, s0, s1, a, scores);
        } else {
          for (std::size_t p = s0; p < s1; ++p) {
            if (vector_token_row(k, p))
              dequantize_token_row(k, p, row);
            else
              k.read_row(p, row);
            if (task.unrotate != nullptr) unrotate_row(*task.unrotate, row);
            if (task.rope != nullptr) task.rope->rotate_unscaled(row, p);
            for (std::size_t h = 0; h < task.group; ++h) scores[h][p - a] = dot(task.queries + h * dim, row, dim);
          }
        }
        s0 = s1;
      }
      for (std::size_t h = 0; h < task.group; ++h) {
        cap_scores(scores[h], n, task.softcap);
        softmax_update(scores[h], n, task.max[h], task.sum[h], task.acc + h * dim, dim);
      }
      const auto [qa, qb] = integer ? quantized_value_rows(v, a, b) : std::pair{a, a};
      if (qa < qb) integer_value_rows(task, a, qa, qb, scores);
      for (std::size_t p = a; p < b; ++p) {
        if (p >= qa && p < qb) continue;
        if (packed_values && p >= v.first_quantized && p < v.end_quantized) {
          add_packed_value_row(task, p, &scores[0][p - a], max_tile);
          if (has_outliers(v)) add_value_outliers(task, p, &scores[0][p - a], max_tile);
          continue;
        }
        v.read_row(p, row);
        for (std::size_t h = 0; h < task.group; ++h) add_scaled(scores[h][p - a], row, task.acc + h * dim, dim);
      }
      a = b;
    }
  }
};

/// The reference kernel: any width, group, axis, parameter and residual type, any head_dim.
inline void decode_task(const DecodeTask& task) noexcept { VectorKernel<ops::Scalar>::run(task); }

// Entry points of the vector kernel per instruction set. On x86 the ops carry target attributes;
// `flatten` inlines the whole kernel into an entry compiled for the same target.
#if defined(KVQ_HAVE_X86_VECTOR_KERNELS)
__attribute__((target("avx2,fma,f16c"), flatten)) inline void vector_avx2_task(const DecodeTask& task) noexcept {
  VectorKernel<ops::Avx2>::run(task);
}
__attribute__((target("avx512f,fma,f16c"), flatten)) inline void vector_avx512_task(const DecodeTask& task) noexcept {
  VectorKernel<ops::Avx512>::run(task);
}
#endif
#if defined(__aarch64__)
inline void vector_neon_task(const DecodeTask& task) noexcept { VectorKernel<ops::Neon>::run(task); }
#endif

}  // namespace kvq::inline v0::kernels::attention

KVQ_INTRINSIC_WARNINGS_ON
