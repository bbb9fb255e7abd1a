#pragma once
// AVX-512 decode attention (F/BW/VL/DQ + VNNI + VBMI + F16C): the definitions of reference.hpp,
// 16 channels per vector, for head_dim 64 and 128.
//
// Specialised kernels take whole tasks or their packed span (kernel_for picks):
//   avx512_dense.hpp  unquantized fp16/fp32 caches (the baselines), post-RoPE;
//   avx512_int.hpp    integer tier, keys per channel and values per token, 2/4/8 bits;
//   avx512_exact.hpp  exact tier, same layouts and 3-bit keys and values (and the integer tier of
//                     3-bit codes: exact_for_integer);
//   avx512_rope.hpp   the key scores of both when keys are stored pre-RoPE.
// The generic kernel below (Kernels<NV>) handles everything else (other widths and axes) and the
// sinks and full-precision window around the packed span. In it, packed codes of 2, 3, 4 and 8 bits
// unpack to bytes in channel order with vpermb + vpmultishiftqb, and rows packed per token
// (values, and keys in llama.cpp's layout) are dequantized in registers, codes of a level table
// looked up by vpermps (code_values), fp8 codes converted through f16 (CodeMap); other widths and
// axes read rows through StreamView::read_row (one row on the stack).
//
// Keys, per 16-token sub-tile: each row is produced once in registers and dotted with every
// query head of the GQA group; the 16 partial vectors per head are reduced together (a
// transposing add tree) into one vector of 16 scores.
//   exact, post-RoPE: codes as floats against q~ = q * scale, plus the bias q.zero.
//   exact, pre-RoPE: zero + scale * code, rotated in registers, against the rotated query.
//   integer, post-RoPE: vpdpbusd of the codes (u8) with q~ quantized to int8 per block.
// Values: exact rows accumulate in registers over a tile (64 channels x 4 heads at a time);
// integer tier: 4 token rows are interleaved byte-wise so that vpdpbusd multiplies them with
// 4 quantized weights per channel group at once.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvq/kernels/attention/avx512_common.hpp"
#include "kvq/kernels/attention/avx512_dense.hpp"
#include "kvq/kernels/attention/avx512_exact.hpp"
#include "kvq/kernels/attention/avx512_int.hpp"
#include "kvq/kernels/attention/avx512_rope.hpp"
#include "kvq/kernels/attention/vector.hpp"
#include "kvq/kernels/ops/avx512.hpp"

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::attention::avx512 {

/// Which AVX-512 kernel takes a task's rows: the dense one (both tensors unquantized), the
/// integer or exact span kernel (packed rows of the fast widths and layouts; sinks and window
/// around the span on the generic one), or the generic kernel for everything.
enum class Kernel : unsigned char { generic, dense, integer, exact };

constexpr const char* to_string(Kernel k) noexcept {
  return k == Kernel::dense     ? "avx512-dense"
         : k == Kernel::integer ? "avx512-integer"
         : k == Kernel::exact   ? "avx512-exact"
                                : "avx512-generic";
}

/// Integer-tier tasks the integer span kernel refuses and the exact one reads (3-bit codes) run the
/// exact tier there: the generic kernel's integer tier of them takes twice as long (32K,
/// bench/RESULTS.md).
inline bool exact_for_integer(const DecodeTask& task) noexcept {
  return task.tier == Tier::integer && task.unrotate == nullptr && !detail::int_supported(task) &&
         detail::exact_supported(task);
}

inline Kernel kernel_for(const DecodeTask& task) noexcept {
  if (task.unrotate != nullptr) return Kernel::generic;  // only it rotates pre-RoPE keys back
  if (detail::dense_supported(task)) return Kernel::dense;
  if (detail::int_supported(task)) return Kernel::integer;
  if (task.tier == Tier::exact ? detail::exact_supported(task) : exact_for_integer(task)) return Kernel::exact;
  return Kernel::generic;
}

namespace detail {

using Vector = x86_avx512::VectorKernel<ops::Avx512>;  // the online softmax, written once

template <int NV>
struct Kernels {
  static constexpr std::size_t dim = 16 * NV;
  static constexpr unsigned NU = NV / 4;  // 64-channel code vectors per row

  const DecodeTask& task;
  const StreamView &k, &v;
  Unpacker ku, vu;
  bool key_fast, key_token_fast, value_fast;

  alignas(64) float scores[max_group][max_tile];
  alignas(64) float part[max_group][16][16];
  alignas(64) float kscale[dim], kzero[dim];
  alignas(64) float qt[max_group][dim];  // folded queries of the current key block
  alignas(64) std::int8_t qi[max_group][dim];
  float bias[max_group], alpha[max_group];
  // Rows packed per token: parameter groups per row, and the group of each 16-channel vector
  // (no division per row).
  std::size_t key_groups = 0, value_groups = 0;
  std::uint8_t key_group_of[NV] = {}, value_group_of[NV] = {};
  // What the fast codes stand for (CodeMap), and the storage of their level tables.
  alignas(64) float key_levels[16], value_levels[16];
  CodeMap key_map, value_map;

  KVQ_TARGET_AVX512_ATTENTION explicit Kernels(const DecodeTask& t) noexcept : task(t), k(t.keys), v(t.values) {
    key_fast = detail::fast_codes(k) && k.spec.axis == Axis::per_channel;
    key_token_fast = detail::fast_codes(k) && k.spec.axis == Axis::per_token;
    value_fast = v.quantized && detail::reads_at_speed(v, false);
    if (key_fast || key_token_fast) ku.init(k.spec.bits, k.row_bytes);
    if (value_fast) vu.init(v.spec.bits, v.row_bytes);
    if (key_token_fast) token_groups(k, key_groups, key_group_of);
    if (value_fast) token_groups(v, value_groups, value_group_of);
    if (key_fast || key_token_fast) key_map = code_map(k.spec, key_levels);
    if (value_fast) value_map = code_map(v.spec, value_levels);
  }

  static void token_groups(const StreamView& s, std::size_t& groups, std::uint8_t* group_of) noexcept {
    groups = groups_per_row(s.spec, dim);
    for (int i = 0; i < NV; ++i) group_of[i] = std::uint8_t(16 * std::size_t(i) / s.spec.group);
  }

  // ---- keys ---------------------------------------------------------------------------------

  KVQ_TARGET_AVX512_ATTENTION void rotate(__m512* x, std::size_t p) const noexcept {
    const float* c = task.rope->cos_row(p);
    const float* s = task.rope->sin_row(p);
    if (task.rope->config().style == RopeStyle::half_split) {
      for (int i = 0; i < NV / 2; ++i) {
        const __m512 cv = _mm512_loadu_ps(c + 16 * i), sv = _mm512_loadu_ps(s + 16 * i);
        const __m512 a = x[i], b = x[i + NV / 2];
        x[i] = _mm512_fmsub_ps(a, cv, _mm512_mul_ps(b, sv));
        x[i + NV / 2] = _mm512_fmadd_ps(a, sv, _mm512_mul_ps(b, cv));
      }
      return;
    }
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int i = 0; i < NV; ++i) {
      const __m512 cv = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(c + 8 * i)));
      const __m512 sv = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(s + 8 * i)));
      const __m512 t = _mm512_mul_ps(_mm512_permute_ps(x[i], 0xB1), sv);
      x[i] = _mm512_fmaddsub_ps(x[i], cv, t);
    }
  }

  /// x <- x rotated back (DecodeTask::unrotate; HadamardTransform::inverse_head's sums and
  /// differences): butterflies within each vector, between vectors (blocks are the whole head:
  /// head_dim is 64 or 128), then the norm and the signs.
  KVQ_TARGET_AVX512_ATTENTION void unrotate(__m512* x) const noexcept {
    const HadamardTransform& t = *task.unrotate;
    __m512 sign[4];
    for (int s = 0; s < 4; ++s) sign[s] = _mm512_loadu_ps(butterfly_lane_signs[std::size_t(s)].data());
    for (int i = 0; i < NV; ++i) {
      x[i] = _mm512_fmadd_ps(x[i], sign[0], ops::Avx512::exchange<1>(x[i]));
      x[i] = _mm512_fmadd_ps(x[i], sign[1], ops::Avx512::exchange<2>(x[i]));
      x[i] = _mm512_fmadd_ps(x[i], sign[2], ops::Avx512::exchange<4>(x[i]));
      x[i] = _mm512_fmadd_ps(x[i], sign[3], ops::Avx512::exchange<8>(x[i]));
    }
    for (int len = 1; len < NV; len *= 2)
      for (int i = 0; i < NV; i += 2 * len)
        for (int j = i; j < i + len; ++j) {
          const __m512 a = x[j], c = x[j + len];
          x[j] = _mm512_add_ps(a, c);
          x[j + len] = _mm512_sub_ps(a, c);
        }
    const __m512 norm = _mm512_set1_ps(t.norm());
    for (int i = 0; i < NV; ++i) x[i] = _mm512_mul_ps(x[i], norm);
    if (!t.signs().empty())
      for (int i = 0; i < NV; ++i) x[i] = _mm512_mul_ps(x[i], _mm512_loadu_ps(t.signs().data() + 16 * i));
  }

  /// A full-precision or generically stored key row in registers (rotated when pre-RoPE); rows
  /// packed per token (2, 4 or 8 bits, groups of a multiple of 16 channels) are dequantized in
  /// registers.
  KVQ_TARGET_AVX512_ATTENTION void load_key_row(std::size_t p, __m512* x) const noexcept {
    if (k.residual_at(p)) {
      const std::uint8_t* row = k.residual_row(p);
      for (int i = 0; i < NV; ++i) x[i] = load16(k.residual, row, 16 * std::size_t(i));
    } else if (key_token_fast) {
      for (unsigned u = 0; u < NU; ++u) token_quarter(k, ku, key_groups, key_group_of, key_map, p, u, x + 4 * u);
    } else {
      alignas(64) float buf[dim];
      k.read_row(p, buf);
      for (int i = 0; i < NV; ++i) x[i] = _mm512_load_ps(buf + 16 * i);
    }
    if (task.unrotate != nullptr) unrotate(x);
    if (task.rope != nullptr) rotate(x, p);
  }

  /// Each head's products with row x, in two chains of FMAs (one would wait on its latency).
  KVQ_TARGET_AVX512_ATTENTION void dot_heads(const __m512* x, const float* queries, std::size_t t) noexcept {
    for (std::size_t h = 0; h < task.group; ++h) {
      const float* q = queries + h * dim;
      __m512 even = _mm512_mul_ps(x[0], _mm512_loadu_ps(q)), odd = _mm512_mul_ps(x[1], _mm512_loadu_ps(q + 16));
      for (int i = 2; i < NV; i += 2) {
        even = _mm512_fmadd_ps(x[i], _mm512_loadu_ps(q + 16 * i), even);
        odd = _mm512_fmadd_ps(x[i + 1], _mm512_loadu_ps(q + 16 * i + 16), odd);
      }
      _mm512_store_ps(part[h][t], _mm512_add_ps(even, odd));
    }
  }

  /// Block parameters of the key block holding position a (scales in key_map's units).
  KVQ_TARGET_AVX512_ATTENTION void load_key_block(std::size_t a) noexcept {
    const std::size_t pi = k.param_index(a);
    const __m512 implied = _mm512_set1_ps(reference::implied_zero(k.spec)), unit = _mm512_set1_ps(key_map.unit);
    for (int i = 0; i < NV; ++i) {
      const __m512 s = load16(k.spec.param, k.scales, pi + 16 * std::size_t(i));
      _mm512_store_ps(kscale + 16 * i, _mm512_mul_ps(s, unit));
      _mm512_store_ps(kzero + 16 * i, k.zeros != nullptr ? load16(k.spec.param, k.zeros, pi + 16 * std::size_t(i))
                                                         : _mm512_mul_ps(s, implied));
    }
  }

  /// Folds the block's scales into the queries: qt = q * scale, bias = q.zero (and int8 qi, alpha).
  KVQ_TARGET_AVX512_ATTENTION void fold_queries(bool integer) noexcept {
    for (std::size_t h = 0; h < task.group; ++h) {
      const float* q = task.queries + h * dim;
      __m512 b = _mm512_setzero_ps(), amax = _mm512_setzero_ps();
      for (int i = 0; i < NV; ++i) {
        const __m512 qv = _mm512_loadu_ps(q + 16 * i);
        const __m512 t = _mm512_mul_ps(qv, _mm512_load_ps(kscale + 16 * i));
        _mm512_store_ps(qt[h] + 16 * i, t);
        b = _mm512_fmadd_ps(qv, _mm512_load_ps(kzero + 16 * i), b);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(t));
      }
      if (!integer) {
        bias[h] = _mm512_reduce_add_ps(b);
        continue;
      }
      // Centred codes (reference.hpp): bias q.(zero + mid * scale), codes counted from mid.
      const float mid = reference::mid_code(k.spec);
      __m512 qs = _mm512_setzero_ps();
      const float m = _mm512_reduce_max_ps(amax);
      const __m512 inv = _mm512_set1_ps(inverse_step(127.0f, m));
      alpha[h] = m / 127.0f;
      for (int i = 0; i < NV; ++i) {
        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_load_ps(qt[h] + 16 * i), inv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_store_si128(reinterpret_cast<__m128i*>(qi[h] + 16 * i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
        qs = _mm512_add_ps(qs, r);
        b = _mm512_fmadd_ps(_mm512_load_ps(qt[h] + 16 * i), _mm512_set1_ps(mid), b);
      }
      bias[h] = _mm512_reduce_add_ps(b) - alpha[h] * mid * _mm512_reduce_add_ps(qs);
    }
  }

  /// Scores of tile [a, b) into scores[h][0 .. b - a).
  KVQ_TARGET_AVX512_ATTENTION void key_scores(std::size_t a, std::size_t b) noexcept {
    std::size_t loaded = ~std::size_t(0);  // key block whose parameters are loaded
    for (std::size_t s0 = a; s0 < b; s0 += 16) {
      const std::size_t n = b - s0 < 16 ? b - s0 : 16;
      // A tile holds whole key blocks of a multiple of 16 positions (tile_tokens), or none.
      const bool block = key_fast && quantized_key_block(k, s0, s0 + n);
      const bool folded = block && task.rope == nullptr;
      const bool integer = folded && task.tier == Tier::integer;
      if (block && (s0 - k.first_quantized) / k.spec.group != loaded) {
        loaded = (s0 - k.first_quantized) / k.spec.group;
        load_key_block(s0);
        if (folded) fold_queries(integer);
      }
      for (std::size_t t = 0; t < n; ++t) {
        const std::size_t p = s0 + t;
        __m512 x[NV];
        if (!block) {
          load_key_row(p, x);
          dot_heads(x, task.queries, t);
          continue;
        }
        const std::uint8_t* row = k.code_row(p);
        const __m512i packed = ku.load(row);
        __m512i c[NU];
        for (unsigned u = 0; u < NU; ++u) c[u] = ku.codes(row, packed, u);
        if (integer) {
          for (std::size_t h = 0; h < task.group; ++h) {
            __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], _mm512_load_si512(qi[h]));
            for (unsigned u = 1; u < NU; ++u) acc = _mm512_dpbusd_epi32(acc, c[u], _mm512_load_si512(qi[h] + 64 * u));
            _mm512_store_si512(part[h][t], acc);
          }
          continue;
        }
        for (unsigned u = 0; u < NU; ++u) code_floats(c[u], x + 4 * u, key_map);
        if (folded) {
          for (std::size_t h = 0; h < task.group; ++h) {
            __m512 acc = _mm512_mul_ps(x[0], _mm512_load_ps(qt[h]));
            for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(x[i], _mm512_load_ps(qt[h] + 16 * i), acc);
            _mm512_store_ps(part[h][t], acc);
          }
          continue;
        }
        for (int i = 0; i < NV; ++i)
          x[i] = _mm512_fmadd_ps(x[i], _mm512_load_ps(kscale + 16 * i), _mm512_load_ps(kzero + 16 * i));
        if (task.unrotate != nullptr) unrotate(x);
        rotate(x, p);
        dot_heads(x, task.queries, t);
      }
      for (std::size_t h = 0; h < task.group; ++h) {
        for (std::size_t t = n; t < 16; ++t) _mm512_store_ps(part[h][t], _mm512_setzero_ps());
        __m512 s;
        if (integer)
          s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(reduce16_epi32(part[h][0])), _mm512_set1_ps(alpha[h]),
                              _mm512_set1_ps(bias[h]));
        else if (folded)
          s = _mm512_add_ps(reduce16(part[h][0]), _mm512_set1_ps(bias[h]));
        else
          s = reduce16(part[h][0]);
        _mm512_mask_storeu_ps(scores[h] + (s0 - a), __mmask16((1u << n) - 1u), s);
      }
    }
  }

  // ---- values -------------------------------------------------------------------------------

  /// Channels [64u, 64u + 64) of value row p as 4 vectors (residual or fast-packed rows).
  KVQ_TARGET_AVX512_ATTENTION void value_quarter(std::size_t p, unsigned u, __m512* x) const noexcept {
    if (v.residual_at(p)) {
      const std::uint8_t* row = v.residual_row(p);
      for (unsigned i = 0; i < 4; ++i) x[i] = load16(v.residual, row, 64 * u + 16 * i);
      return;
    }
    token_quarter(v, vu, value_groups, value_group_of, value_map, p, u, x);
  }

  /// Channels [64u, 64u + 64) of row p of a stream packed per token in groups of a multiple of 16
  /// channels (fast codes, unpacked by `un`, standing for what `map` says; token_groups),
  /// dequantized: 4 vectors.
  KVQ_TARGET_AVX512_ATTENTION static void token_quarter(const StreamView& s, const Unpacker& un, std::size_t groups,
                                                        const std::uint8_t* group_of, const CodeMap& map, std::size_t p,
                                                        unsigned u, __m512* x) noexcept {
    const std::uint8_t* row = s.code_row(p);
    code_floats(un.codes(row, un.load(row), u), x, map);
    // The row's parameters (at most 8 groups: 16 channels or more each) converted at once.
    const std::size_t pi = (p - s.first_quantized) * groups;  // StreamView::param_index without its division
    alignas(64) float scale[16], zero[16];
    const __m512 sv = load_n(s.spec.param, s.scales, pi, groups);
    _mm512_store_ps(scale, _mm512_mul_ps(sv, _mm512_set1_ps(map.unit)));
    _mm512_store_ps(zero, s.zeros != nullptr ? load_n(s.spec.param, s.zeros, pi, groups)
                                             : _mm512_mul_ps(sv, _mm512_set1_ps(reference::implied_zero(s.spec))));
    for (unsigned i = 0; i < 4; ++i) {
      const std::size_t g = group_of[4 * u + i];
      x[i] = _mm512_fmadd_ps(x[i], _mm512_set1_ps(scale[g]), _mm512_set1_ps(zero[g]));
    }
  }

  /// acc += weights * rows for rows [a, b) of the tile starting at `tile`, HB heads at a time.
  template <int HB>
  KVQ_TARGET_AVX512_ATTENTION void value_rows_heads(std::size_t tile, std::size_t a, std::size_t b, std::size_t h0,
                                                    std::size_t skip_a, std::size_t skip_b) noexcept {
    for (unsigned u = 0; u < NU; ++u) {
      __m512 acc[HB][4];
      for (int h = 0; h < HB; ++h)
        for (int i = 0; i < 4; ++i)
          acc[h][i] = _mm512_loadu_ps(task.acc + (h0 + std::size_t(h)) * dim + 64 * u + 16 * std::size_t(i));
      for (std::size_t p = a; p < b; ++p) {
        if (p >= skip_a && p < skip_b) continue;
        __m512 x[4];
        value_quarter(p, u, x);
        for (int h = 0; h < HB; ++h) {
          const __m512 w = _mm512_set1_ps(scores[h0 + std::size_t(h)][p - tile]);
          for (int i = 0; i < 4; ++i) acc[h][i] = _mm512_fmadd_ps(x[i], w, acc[h][i]);
        }
      }
      for (int h = 0; h < HB; ++h)
        for (int i = 0; i < 4; ++i)
          _mm512_storeu_ps(task.acc + (h0 + std::size_t(h)) * dim + 64 * u + 16 * std::size_t(i), acc[h][i]);
    }
  }

  KVQ_TARGET_AVX512_ATTENTION void value_rows(std::size_t tile, std::size_t a, std::size_t b, std::size_t skip_a,
                                              std::size_t skip_b) noexcept {
    for (std::size_t h0 = 0; h0 < task.group; h0 += register_heads)
      with_heads(task.group - h0, [&]<int HB>() { value_rows_heads<HB>(tile, a, b, h0, skip_a, skip_b); });
  }

  /// Integer tier: rows [a, b) hold fast-packed per-token values.
  KVQ_TARGET_AVX512_ATTENTION void integer_values(std::size_t tile, std::size_t a, std::size_t b) noexcept {
    const std::size_t G = groups_per_row(v.spec, dim), rows = b - a, quads = (rows + 3) / 4;
    const std::size_t per_vec = 16 / G;  // rows per 16 parameters
    const bool wide = v.spec.bits == 8;  // 8-bit codes need the unsigned side: weights become s8
    const float levels = weight_levels(v.spec.bits);
    const float mid = reference::mid_code(v.spec);
    alignas(64) float sv[max_tile * 16], zv[max_tile * 16];
    const std::size_t pi = v.param_index(a), np = rows * G;
    for (std::size_t i = 0; i < np; i += 16) {
      const std::size_t n = np - i < 16 ? np - i : 16;
      const __m512 s = load_n(v.spec.param, v.scales, pi + i, n);
      _mm512_store_ps(sv + i, s);
      // zero + mid * scale: the value of the centre code (see reference.hpp)
      _mm512_store_ps(zv + i, v.zeros != nullptr
                                  ? _mm512_fmadd_ps(s, _mm512_set1_ps(mid), load_n(v.spec.param, v.zeros, pi + i, n))
                                  : _mm512_setzero_ps());
    }
    // Lane i of a parameter vector belongs to row i / G of its 16 / G rows.
    alignas(64) int tok[16], gidx[2][16];
    for (int i = 0; i < 16; ++i) tok[i] = i / int(G);
    // Interleaved lane (L, j) of quarter u holds channel 64u + 16L + 4k + j: group (64u + 16L) / group.
    for (unsigned u = 0; u < 2; ++u)
      for (int i = 0; i < 16; ++i) gidx[u][i] = int((64 * u + 16 * unsigned(i / 4)) / v.spec.group);
    alignas(64) std::uint8_t trb[64];
    for (std::size_t g = 0; g < 16; ++g)
      for (std::size_t j = 0; j < 4; ++j) trb[4 * g + j] = std::uint8_t(g < G ? j * G + g : 0);
    const __m512i tokv = _mm512_load_si512(tok), trv = _mm512_load_si512(trb);
    alignas(64) static constexpr std::uint8_t zero_row[128] = {};
    alignas(64) std::uint8_t wq[max_tile * 16 + 64];
    alignas(64) float zs[16];

    for (std::size_t h = 0; h < task.group; ++h) {
      const float* p = scores[h] + (a - tile);
      // weights w = p * scale per (row, group); their maximum sets the quantization step
      __m512 wmax = _mm512_setzero_ps();
      for (std::size_t i = 0; i < np; i += 16) {
        const __mmask16 m = np - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (np - i)) - 1u);
        const __m512 pv =
            _mm512_permutexvar_ps(tokv, _mm512_maskz_loadu_ps(__mmask16((1u << per_vec) - 1u), p + i / G));
        wmax = _mm512_max_ps(wmax, _mm512_maskz_mul_ps(m, pv, _mm512_load_ps(sv + i)));
      }
      const float wm = _mm512_reduce_max_ps(wmax);
      const __m512 inv = _mm512_set1_ps(inverse_step(levels, wm));
      __m512 zacc = _mm512_setzero_ps(), wacc = _mm512_setzero_ps();
      for (std::size_t i = 0; i < np; i += 16) {
        const __mmask16 m = np - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (np - i)) - 1u);
        const __m512 pv =
            _mm512_maskz_permutexvar_ps(m, tokv, _mm512_maskz_loadu_ps(__mmask16((1u << per_vec) - 1u), p + i / G));
        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_mul_ps(pv, _mm512_load_ps(sv + i)), inv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(wq + i), _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(r)));
        wacc = _mm512_add_ps(wacc, r);
        zacc = _mm512_fmadd_ps(pv, _mm512_load_ps(zv + i), zacc);
      }
      std::memset(wq + np, 0, 16 * 4);  // padding rows of the last quad weigh nothing
      // per group: sum p * (zero + mid * scale) - beta * mid * sum wq, so codes count centred
      alignas(64) float ws[16];
      _mm512_store_ps(zs, zacc);
      _mm512_store_ps(ws, wacc);
      float zsum[16] = {};
      for (std::size_t i = 0; i < 16; ++i) zsum[i % G] += zs[i] - wm / levels * mid * ws[i];

      float* acc = task.acc + h * dim;
      for (unsigned u = 0; u < NU; ++u) {
        const __m512i gv = _mm512_load_si512(gidx[u]);
        __m512i ai[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                         _mm512_setzero_si512()};
        for (std::size_t qd = 0; qd < quads; ++qd) {
          __m512i r[4];
          for (std::size_t j = 0; j < 4; ++j) {
            const std::size_t row = a + 4 * qd + j;
            const std::uint8_t* src = row < b ? v.code_row(row) : zero_row;
            r[j] = vu.codes(src, vu.load(src), u);
          }
          const __m512i lo01 = _mm512_unpacklo_epi8(r[0], r[1]), hi01 = _mm512_unpackhi_epi8(r[0], r[1]);
          const __m512i lo23 = _mm512_unpacklo_epi8(r[2], r[3]), hi23 = _mm512_unpackhi_epi8(r[2], r[3]);
          const __m512i x[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                                _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
          const __m512i W =
              _mm512_permutexvar_epi8(trv, _mm512_maskz_loadu_epi8((__mmask64(1) << (4 * G)) - 1, wq + 4 * qd * G));
          const __m512i wv = _mm512_permutexvar_epi32(gv, W);
          for (int kk = 0; kk < 4; ++kk)
            ai[kk] = wide ? _mm512_dpbusd_epi32(ai[kk], x[kk], wv) : _mm512_dpbusd_epi32(ai[kk], wv, x[kk]);
        }
        // ai[k] lane (L, j) = channel 64u + 16L + 4k + j: transpose the 128-bit blocks back.
        const __m512 beta = _mm512_set1_ps(wm / levels);
        __m512 f[4];
        for (int kk = 0; kk < 4; ++kk) f[kk] = _mm512_cvtepi32_ps(ai[kk]);
        const __m512 t0 = _mm512_shuffle_f32x4(f[0], f[1], 0x44), t1 = _mm512_shuffle_f32x4(f[0], f[1], 0xEE);
        const __m512 t2 = _mm512_shuffle_f32x4(f[2], f[3], 0x44), t3 = _mm512_shuffle_f32x4(f[2], f[3], 0xEE);
        const __m512 n[4] = {_mm512_shuffle_f32x4(t0, t2, 0x88), _mm512_shuffle_f32x4(t0, t2, 0xDD),
                             _mm512_shuffle_f32x4(t1, t3, 0x88), _mm512_shuffle_f32x4(t1, t3, 0xDD)};
        for (unsigned L = 0; L < 4; ++L) {
          float* o = acc + 64 * u + 16 * L;
          const __m512 z = _mm512_set1_ps(zsum[(64 * u + 16 * L) / v.spec.group]);
          _mm512_storeu_ps(o, _mm512_add_ps(_mm512_fmadd_ps(n[L], beta, _mm512_loadu_ps(o)), z));
        }
      }
    }
  }

  KVQ_TARGET_AVX512_ATTENTION void run(bool generic_only) noexcept {
    start_state(task);
    const Kernel kind = generic_only ? Kernel::generic : kernel_for(task);
    if (kind == Kernel::dense) {
      dense_span<NV>(task, task.begin, task.end);
      return;
    }
    const bool int_path = kind == Kernel::integer, exact_path = kind == Kernel::exact;
    if (int_path || exact_path) {
      // Packed span on the integer or exact kernel; sinks and the window here.
      // Whole tiles from the start (a sliding window can begin inside one) and whole 16-position
      // steps at the end (an older query position can end the range inside a block), where keys
      // and values are both packed (keys that flush their window can be packed beyond the values).
      const std::size_t fq = k.first_quantized, tile = tile_tokens(k);
      const std::size_t qa = task.begin <= fq                ? fq
                             : (task.begin - fq) % tile == 0 ? task.begin
                                                             : tile_end(k, task.begin, k.end_quantized);
      const std::size_t qe = std::min({task.end, k.end_quantized, v.end_quantized});
      const std::size_t qb = qe > qa ? qa + (qe - qa) / 16 * 16 : qa;
      if (qa < qb) {
        run_range(task.begin, qa);
        if (int_path)
          int_span<NV>(task, qa, qb);
        else
          exact_span<NV>(task, qa, qb);
        run_range(qb, task.end);
        return;
      }
    }
    run_range(task.begin, task.end);
  }

  KVQ_TARGET_AVX512_ATTENTION void run_range(std::size_t begin, std::size_t end) noexcept {
    for (std::size_t a = begin; a < end;) {
      const std::size_t b = tile_end(k, a, end);
      key_scores(a, b);
      for (std::size_t h = 0; h < task.group; ++h) Vector::softmax_head(task, h, scores[h], b - a);
      // Values: fast-packed quantized rows (integer tier), register-blocked rows, generic rows.
      std::size_t qa = a, qb = a;  // quantized value rows of the tile, whatever their axis
      if (v.quantized && std::max(a, v.first_quantized) < std::min(b, v.end_quantized)) {
        qa = std::max(a, v.first_quantized);
        qb = std::min(b, v.end_quantized);
      }
      const bool generic = qa < qb && !value_fast;
      if (generic) {
        alignas(64) float row[dim];
        for (std::size_t p = qa; p < qb; ++p) {
          v.read_row(p, row);
          for (std::size_t h = 0; h < task.group; ++h) {
            const __m512 w = _mm512_set1_ps(scores[h][p - a]);
            float* acc = task.acc + h * dim;
            for (int i = 0; i < NV; ++i)
              _mm512_storeu_ps(acc + 16 * i,
                               _mm512_fmadd_ps(_mm512_load_ps(row + 16 * i), w, _mm512_loadu_ps(acc + 16 * i)));
          }
        }
        value_rows(a, a, b, qa, qb);
      } else if (qa < qb && task.tier == Tier::integer) {
        integer_values(a, qa, qb);
        value_rows(a, a, b, qa, qb);
      } else {
        value_rows(a, a, b, b, b);
      }
      a = b;
    }
  }
};

}  // namespace detail

/// The task on the kernel kernel_for picks, or, with generic_only, on the generic kernel alone.
KVQ_TARGET_AVX512_ATTENTION inline void decode_task(const DecodeTask& task, bool generic_only = false) noexcept {
  // The packed-span kernels keep their query tables across the segments of one task
  // (int_init); a task's first segment starts afresh whatever path ran before it.
  if (!task.resume) detail::int_state().queries = nullptr;
  if (computed_tier(task) != task.tier || (!generic_only && exact_for_integer(task))) {
    DecodeTask exact = task;
    exact.tier = Tier::exact;
    return avx512::decode_task(exact, generic_only);
  }
  if (task.keys.head_dim == 64) {
    detail::Kernels<4> kernel(task);
    kernel.run(generic_only);
  } else {
    detail::Kernels<8> kernel(task);
    kernel.run(generic_only);
  }
}

KVQ_TARGET_AVX512_ATTENTION inline void decode_task_generic(const DecodeTask& task) noexcept {
  decode_task(task, true);
}

}  // namespace kvq::inline v0::kernels::attention::avx512

KVQ_INTRINSIC_WARNINGS_ON
