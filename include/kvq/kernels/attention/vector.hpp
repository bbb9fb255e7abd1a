#pragma once
// Decode attention written once over a vector-ops type (kernels/ops/): the tile loop, key scores,
// online softmax, RoPE and value accumulation of task.hpp, with the dot products and the value
// updates in vectors of Ops::width lanes. On scalar ops (fp64 products) it is the reference
// kernel, which takes every configuration; on NEON it is the AArch64 kernel; on AVX2 and AVX-512
// ops it runs after the hand-tuned x86 kernels (registry.hpp), for caches they refuse or read
// only row by row, and is measured against them. A new instruction set is one ops file and one
// registry entry.
//
// Rows are read as floats block_rows at a time, then used from there: keys dotted with the GQA
// group's queries two rows and up to four heads at a time (each query vector loaded once for two
// rows), values added into sums that stay in registers for up to four heads and two vectors of
// channels (each row loaded once for the heads). A packed per-channel key block (post-RoPE) folds
// its scales into the queries and reads its codes as floats; every other key row is dequantized
// (in vectors where packed per channel, or per token in groups of whole vectors; else through
// StreamView::read_row), rotated back when stored rotated (DecodeTask::unrotate) and RoPE'd when
// pre-RoPE. Dense-and-sparse outliers add their corrections: q . e to a folded key's score, e to
// a dequantized row. Optional ops members, found with `requires`, speed the steps that pay:
// `codes<bits>` unpacks a vector of codes in registers, `exp` takes the softmax's exponentials in
// vectors, `load_scalar` converts fp16 parameters in hardware. The integer tier runs on scalar
// ops only (computes_integer_tier), as task.hpp's definitions; vector kernels compute the exact
// tier for both tiers.

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
  static constexpr std::size_t heads_per_pass = 8;  // folded queries on the stack: 8 x max_head_dim

  /// Shapes the kernel takes: head_dim a multiple of the vector width.
  static bool accepts(const StreamView& keys, const StreamView& values, std::size_t group, const RopeTable*) noexcept {
    const std::size_t d = keys.head_dim;
    return d > 0 && d % width == 0 && d <= max_head_dim && values.head_dim == d && group > 0 && group <= max_group;
  }

  /// Rows converted to floats at a time before they are dotted or added: 4 KiB at head_dim 256
  /// (blocks of 16 rows took the fp16 cache twice as long on AVX2 ops, bench/RESULTS.md).
  static constexpr std::size_t block_rows = 4;
  /// Heads whose sums stay in registers while rows are read, and vectors of channels per head
  /// for the values.
  static constexpr std::size_t register_heads = 4, value_vectors = 2;

  /// Value i of a parameter array of type t: the ops' conversion where they have one (F16C, AArch64
  /// fp16), else core/convert.hpp's bit manipulation (the same value).
  static float scalar_at(Scalar t, const void* base, std::size_t i) noexcept {
    if constexpr (requires { Ops::load_scalar(t, base, i); })
      return Ops::load_scalar(t, base, i);
    else
      return load_scalar(t, base, i);
  }

  /// The parameters of group i of a packed stream (i counts groups from the stream's first).
  static reference::GroupParams params_at(const StreamView& s, std::size_t i) noexcept {
    return reference::group_params(s.spec, scalar_at(s.spec.param, s.scales, i),
                                   s.spec.has_zero_point() ? scalar_at(s.spec.param, s.zeros, i) : 0.0f);
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

  /// Calls f.template operator()<h>() with h = heads (1 to register_heads).
  template <class F>
  static void with_heads(std::size_t heads, F&& f) noexcept {
    switch (heads) {
      case 1:
        return f.template operator()<1>();
      case 2:
        return f.template operator()<2>();
      case 3:
        return f.template operator()<3>();
      default:
        return f.template operator()<register_heads>();
    }
  }

  /// scores[h * max_tile + i] = bias[h] + q_h . rows[i] for n float rows (stride dim) and `heads`
  /// queries (stride dim): rows in pairs, so each query vector loaded serves two rows.
  template <std::size_t heads>
  static void scores_of_rows(const float* q, std::size_t dim, const float* bias, const float* rows, std::size_t n,
                             float* scores) noexcept {
    std::size_t i = 0;
    for (; i + 2 <= n; i += 2) {
      typename Ops::Vec s0[heads], s1[heads];
      for (std::size_t h = 0; h < heads; ++h) s0[h] = s1[h] = Ops::zero();
      const float *r0 = rows + i * dim, *r1 = r0 + dim;
      for (std::size_t c = 0; c < dim; c += width) {
        const typename Ops::Vec x0 = Ops::load(r0 + c), x1 = Ops::load(r1 + c);
        for (std::size_t h = 0; h < heads; ++h) {
          const typename Ops::Vec qv = Ops::load(q + h * dim + c);
          s0[h] = Ops::fma(qv, x0, s0[h]);
          s1[h] = Ops::fma(qv, x1, s1[h]);
        }
      }
      for (std::size_t h = 0; h < heads; ++h) {
        scores[h * max_tile + i] = bias[h] + Ops::sum(s0[h]);
        scores[h * max_tile + i + 1] = bias[h] + Ops::sum(s1[h]);
      }
    }
    if (i < n) {
      typename Ops::Vec s0[heads];
      for (std::size_t h = 0; h < heads; ++h) s0[h] = Ops::zero();
      for (std::size_t c = 0; c < dim; c += width) {
        const typename Ops::Vec x0 = Ops::load(rows + i * dim + c);
        for (std::size_t h = 0; h < heads; ++h) s0[h] = Ops::fma(Ops::load(q + h * dim + c), x0, s0[h]);
      }
      for (std::size_t h = 0; h < heads; ++h) scores[h * max_tile + i] = bias[h] + Ops::sum(s0[h]);
    }
  }

  /// scores[h][i] = bias[h] + q_h . rows[i] for `heads` queries (stride dim) and n float rows, in
  /// passes of register_heads heads.
  static void row_scores(const float* q, std::size_t heads, std::size_t dim, const float* bias, const float* rows,
                         std::size_t n, float* scores) noexcept {
    for (std::size_t h0 = 0; h0 < heads; h0 += register_heads)
      with_heads(std::min(register_heads, heads - h0), [&]<std::size_t h>() {
        scores_of_rows<h>(q + h0 * dim, dim, bias + h0, rows, n, scores + h0 * max_tile);
      });
  }

  /// n codes of `bits` bits from `in` as floats, without vector ops: byte by byte with constant
  /// shifts for 2, 4 and 8 bits (loops the compiler vectorizes), else through unpack_codes.
  static void unpack_as_floats(const std::uint8_t* in, std::size_t n, unsigned bits, float* out) noexcept {
    if (bits == 8) {
      for (std::size_t c = 0; c < n; ++c) out[c] = float(in[c]);
    } else if (bits == 4 && n % 2 == 0) {
      for (std::size_t i = 0; i < n / 2; ++i) {
        out[2 * i] = float(in[i] & 15u);
        out[2 * i + 1] = float(in[i] >> 4);
      }
    } else if (bits == 2 && n % 4 == 0) {
      for (std::size_t i = 0; i < n / 4; ++i)
        for (unsigned k = 0; k < 4; ++k) out[4 * i + k] = float((in[i] >> (2 * k)) & 3u);
    } else {
      std::uint8_t codes[max_head_dim];
      unpack_codes(in, n, bits, codes);
      for (std::size_t c = 0; c < n; ++c) out[c] = float(codes[c]);
    }
  }

  /// The codes of row p of a packed stream as floats (the levels they name, for a level table):
  /// out (head_dim).
  static void codes_of(const StreamView& s, std::size_t p, float* out) noexcept {
    const std::uint8_t* in = s.code_row(p);
    const std::size_t n = s.head_dim;
    // Where the ops unpack a vector of codes in registers, whole vectors are stored: the loads
    // that follow are forwarded from them (bytes stored one by one are not).
    auto in_vectors = [&]<unsigned bits>() {
      if constexpr (requires { Ops::template codes<bits>(in); }) {
        for (std::size_t c = 0; c < n; c += width) Ops::store(out + c, Ops::template codes<bits>(in + c * bits / 8));
        return true;
      }
      return false;
    };
    const unsigned bits = s.spec.bits;
    const bool in_registers = bits == 8   ? in_vectors.template operator()<8>()
                              : bits == 4 ? in_vectors.template operator()<4>()
                              : bits == 2 ? in_vectors.template operator()<2>()
                                          : false;
    if (!in_registers) unpack_as_floats(in, n, bits, out);
    if (const float* levels = code_levels(s.spec))  // a level table: the level each code names
      for (std::size_t c = 0; c < n; ++c) out[c] = levels[std::size_t(out[c])];
  }

  /// The scales and zero points of the packed per-channel key block holding row a: (head_dim) each.
  static void load_key_params(const StreamView& k, std::size_t a, float* scale, float* zero) noexcept {
    const std::size_t pi = k.param_index(a);
    for (std::size_t c = 0; c < k.head_dim; ++c) {
      const auto gp = params_at(k, pi + c);
      scale[c] = gp.scale;
      zero[c] = gp.zero;
    }
  }

  /// Row p of the packed per-channel key block whose scales and zero points are given:
  /// zero + scale * code per channel, plus its outliers' corrections.
  static void dequantize_channel_row(const StreamView& k, std::size_t p, const float* scale, const float* zero,
                                     float* out) noexcept {
    codes_of(k, p, out);
    for (std::size_t c = 0; c < k.head_dim; c += width)
      Ops::store(out + c, Ops::fma(Ops::load(scale + c), Ops::load(out + c), Ops::load(zero + c)));
    const std::size_t n = k.spec.outliers, pi = k.param_index(p);
    const std::size_t group_start = p - (p - k.first_quantized) % k.spec.group;
    for (std::size_t e = pi * n; e < (pi + k.head_dim) * n; ++e)
      if (group_start + k.outlier_slots[e] == p)
        out[(e - pi * n) / n] += scalar_at(k.spec.param, k.outlier_corrections, e);
  }

  /// Exact scores of the packed per-channel key block [a, b) of the tile starting at `tile`,
  /// post-RoPE: the block's scales fold into the query (score = q.zero + (q * scale).code), its
  /// rows' codes are read as floats block_rows at a time. Query heads go in passes of
  /// heads_per_pass (the folded queries live on the stack).
  static void folded_key_scores(const DecodeTask& task, std::size_t a, std::size_t b, std::size_t tile,
                                float (*scores)[max_tile]) noexcept {
    const StreamView& k = task.keys;
    const std::size_t dim = k.head_dim;
    alignas(64) float scale[max_head_dim], zero[max_head_dim], rows[block_rows * max_head_dim];
    alignas(64) float folded[heads_per_pass * max_head_dim];  // (heads, dim)
    float bias[heads_per_pass];
    load_key_params(k, a, scale, zero);
    for (std::size_t h0 = 0; h0 < task.group; h0 += heads_per_pass) {
      const std::size_t heads = std::min(heads_per_pass, task.group - h0);
      for (std::size_t h = 0; h < heads; ++h) {
        const float* q = task.queries + (h0 + h) * dim;
        for (std::size_t c = 0; c < dim; ++c) folded[h * dim + c] = q[c] * scale[c];
        bias[h] = dot(q, zero, dim);
      }
      for (std::size_t p = a; p < b; p += block_rows) {
        const std::size_t n = std::min(block_rows, b - p);
        for (std::size_t i = 0; i < n; ++i) codes_of(k, p + i, rows + i * dim);
        row_scores(folded, heads, dim, bias, rows, n, &scores[h0][p - tile]);
      }
    }
    if (has_outliers(k)) add_key_outliers(task, a, b, tile, scores);
  }

  /// Exact scores of key rows [a, b) of the tile starting at `tile` that are no folded block:
  /// each row read as floats (dequantized in vectors where packed), rotated back and RoPE'd as
  /// the task asks, block_rows at a time, then dotted with every query head.
  static void key_row_scores(const DecodeTask& task, std::size_t a, std::size_t b, std::size_t tile,
                             float (*scores)[max_tile]) noexcept {
    const StreamView& k = task.keys;
    const std::size_t dim = k.head_dim;
    alignas(64) float scale[max_head_dim], zero[max_head_dim], rows[block_rows * max_head_dim];
    const bool channel_block = quantized_key_block(k, a, b);
    if (channel_block) load_key_params(k, a, scale, zero);
    static constexpr float no_bias[max_group] = {};
    for (std::size_t p = a; p < b; p += block_rows) {
      const std::size_t n = std::min(block_rows, b - p);
      for (std::size_t i = 0; i < n; ++i) {
        float* row = rows + i * dim;
        if (channel_block)
          dequantize_channel_row(k, p + i, scale, zero, row);
        else if (vector_token_row(k, p + i))
          dequantize_token_row(k, p + i, row);
        else
          k.read_row(p + i, row);
        if (task.unrotate != nullptr) unrotate_row(*task.unrotate, row);
        if (task.rope != nullptr) task.rope->rotate_unscaled(row, p + i);
      }
      row_scores(task.queries, task.group, dim, no_bias, rows, n, &scores[0][p - tile]);
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
    const std::size_t dim = s.head_dim, group = s.spec.group, pi = s.param_index(p);
    codes_of(s, p, out);
    for (std::size_t g = 0; g * group < dim; ++g) {
      const auto gp = params_at(s, pi + g);
      const typename Ops::Vec scale = Ops::set1(gp.scale), zero = Ops::set1(gp.zero);
      for (std::size_t c = g * group; c < std::min(dim, (g + 1) * group); c += width)
        Ops::store(out + c, Ops::fma(scale, Ops::load(out + c), zero));
    }
    const std::size_t n = s.spec.outliers;
    for (std::size_t e = pi * n; e < (pi + groups_per_row(s.spec, dim)) * n; ++e)
      out[(e - pi * n) / n * group + s.outlier_slots[e]] += scalar_at(s.spec.param, s.outlier_corrections, e);
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
      const float correction = scalar_at(k.spec.param, k.outlier_corrections, e);
      const float* q = task.queries + (e - first) / n;
      for (std::size_t h = 0; h < task.group; ++h) scores[h][row - tile] += q[h * dim] * correction;
    }
  }

  /// acc[h] += sum_i w[h * stride + i] * rows[i] over n float rows (stride dim) for `heads` heads
  /// (acc consecutive per head), channels [c, c + vectors * width) held in registers meanwhile:
  /// each row is loaded once for all the heads, each sum stored once per n rows.
  template <std::size_t heads, std::size_t vectors>
  static void add_rows_to(float* acc, std::size_t dim, std::size_t c, const float* rows, std::size_t n, const float* w,
                          std::size_t stride) noexcept {
    typename Ops::Vec sum[heads][vectors];
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t j = 0; j < vectors; ++j) sum[h][j] = Ops::load(acc + h * dim + c + j * width);
    for (std::size_t i = 0; i < n; ++i) {
      typename Ops::Vec x[vectors];
      for (std::size_t j = 0; j < vectors; ++j) x[j] = Ops::load(rows + i * dim + c + j * width);
      for (std::size_t h = 0; h < heads; ++h) {
        const typename Ops::Vec wv = Ops::set1(w[h * stride + i]);
        for (std::size_t j = 0; j < vectors; ++j) sum[h][j] = Ops::fma(wv, x[j], sum[h][j]);
      }
    }
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t j = 0; j < vectors; ++j) Ops::store(acc + h * dim + c + j * width, sum[h][j]);
  }

  /// add_rows_to over every channel: value_vectors vectors at a time, then single vectors.
  template <std::size_t heads>
  static void add_rows(float* acc, std::size_t dim, const float* rows, std::size_t n, const float* w,
                       std::size_t stride) noexcept {
    std::size_t c = 0;
    for (; c + value_vectors * width <= dim; c += value_vectors * width)
      add_rows_to<heads, value_vectors>(acc, dim, c, rows, n, w, stride);
    for (; c < dim; c += width) add_rows_to<heads, 1>(acc, dim, c, rows, n, w, stride);
  }

  /// The exact tier's values of tile rows [a, b) outside [skip_a, skip_b) (rows the integer tier
  /// has added): read as floats block_rows at a time (packed per-token rows dequantized in
  /// vectors), then added with their weights.
  static void add_value_rows(const DecodeTask& task, std::size_t tile, std::size_t a, std::size_t b, std::size_t skip_a,
                             std::size_t skip_b, float (*weights)[max_tile]) noexcept {
    const StreamView& v = task.values;
    const std::size_t dim = v.head_dim;
    alignas(64) float rows[block_rows * max_head_dim];
    for (std::size_t p = a; p < b;) {
      if (p >= skip_a && p < skip_b) {
        p = skip_b;
        continue;
      }
      const std::size_t end = std::min({b, p + block_rows, p < skip_a ? skip_a : b});
      for (std::size_t r = p; r < end; ++r) {
        if (vector_token_row(v, r))
          dequantize_token_row(v, r, rows + (r - p) * dim);
        else
          v.read_row(r, rows + (r - p) * dim);
      }
      for (std::size_t h0 = 0; h0 < task.group; h0 += register_heads)
        with_heads(std::min(register_heads, task.group - h0), [&]<std::size_t h>() {
          add_rows<h>(task.acc + h0 * dim, dim, rows, end - p, &weights[h0][p - tile], max_tile);
        });
      p = end;
    }
  }

  /// task.hpp's softmax_update with the exponentials in vectors where the ops have them.
  static void softmax_in_vectors(float* scores, std::size_t n, float& max, float& sum, float* acc,
                                 std::size_t dim) noexcept {
    if constexpr (requires(typename Ops::Vec x) { Ops::exp(x); }) {
      raise_max(scores, n, max, sum, acc, dim);
      const typename Ops::Vec m = Ops::set1(max);
      typename Ops::Vec total = Ops::zero();
      std::size_t t = 0;
      for (; t + width <= n; t += width) {
        const typename Ops::Vec e = Ops::exp(Ops::sub(Ops::load(scores + t), m));
        Ops::store(scores + t, e);
        total = Ops::add(total, e);
      }
      float rest = 0.0f;
      for (; t < n; ++t) rest += scores[t] = std::exp(scores[t] - max);
      sum += Ops::sum(total) + rest;
    } else {
      softmax_update(scores, n, max, sum, acc, dim);
    }
  }

  /// The integer tier runs on scalar ops only, as task.hpp's definitions (the reference of the
  /// integer tier): on vector ops without integer dot products its weight quantization and
  /// integer-to-float steps cost more than its sums save (1.2x to 1.5x the exact tier's time,
  /// bench/RESULTS.md), so vector kernels compute the exact tier for both tiers.
  static constexpr bool computes_integer_tier = width == 1;

  static void run(const DecodeTask& task) noexcept {
    const StreamView &k = task.keys, &v = task.values;
    start_state(task);
    float scores[max_group][max_tile];
    const bool integer = computes_integer_tier && computed_tier(task) == Tier::integer;
    for (std::size_t a = task.begin; a < task.end;) {
      const std::size_t b = tile_end(k, a, task.end), n = b - a;
      // Keys block by block (a tile holds whole key blocks when keys are quantized per channel).
      for (std::size_t s0 = a; s0 < b;) {
        std::size_t s1 = b;
        if (k.quantized && k.spec.axis == Axis::per_channel && s0 >= k.first_quantized && s0 < k.end_quantized)
          s1 = std::min(b, k.first_quantized + ((s0 - k.first_quantized) / k.spec.group + 1) * k.spec.group);
        if (!quantized_key_block(k, s0, s1) || task.rope != nullptr)
          key_row_scores(task, s0, s1, a, scores);
        else if (integer)
          detail::integer_key_scores(task, s0, s1, a, scores);
        else
          folded_key_scores(task, s0, s1, a, scores);
        s0 = s1;
      }
      for (std::size_t h = 0; h < task.group; ++h) {
        cap_scores(scores[h], n, task.softcap);
        softmax_in_vectors(scores[h], n, task.max[h], task.sum[h], task.acc + h * k.head_dim, k.head_dim);
      }
      const auto [qa, qb] = integer ? quantized_value_rows(v, a, b) : std::pair{a, a};
      if (qa < qb) detail::integer_values(task, a, qa, qb, scores);
      add_value_rows(task, a, a, b, qa, qb, scores);
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
