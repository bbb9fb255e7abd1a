#pragma once
// Decode attention over the packed cache: all query heads of one new position attend to sink
// tokens, packed groups and the full-precision window without a dequantized copy of the cache.
//
//   q (heads, d) --rotate (pre-RoPE) & scale 1/sqrt(d)--> tasks (KV head x context chunk)
//     --kernel per task: online softmax over tiles, each K/V tile read once for the GQA group-->
//   partial (max, sum, acc) per task --merge in chunk order--> out (heads, d)
//
// Chunks are a fixed number of tiles (DecodeOptions::chunk_tokens), never derived from the
// thread count, and partials merge in a fixed order: the result is bit-identical for every
// executor and thread count. Different chunk sizes agree to floating-point rounding (~1e-7).
//
// Pre-RoPE keys: the kernels dequantize a key row, rotate it at its position (cos/sin from the
// cache's table) and dot it with every query head of the group. The pairwise form
// sum cos*(qa ka + qb kb) + sin*(qb ka - qa kb) costs three products per channel and head; rotating
// the row once costs about two per channel shared by the whole GQA group, so rotation wins for
// GQA >= 2 (avx512_rope.hpp splits the rotation into one per run of keys for the query and a
// small per-step one for each key). Post-RoPE keys fold the per-channel scales into the query
// instead (one scaled query per key block, q.zero as a per-block bias) and never dequantize,
// which is why they are the faster layout for decoding.
//
// Rotated keys (CacheConfig::key_rotation): post-RoPE, attention rotates the query once
// (q.k = Hq.Hk) and no kernel knows; pre-RoPE, RoPE stands between the rotation and the query,
// so the kernel rotates each dequantized key row back before RoPE (DecodeTask::unrotate), once
// for the whole GQA group. The generic AVX-512 kernel and the vector kernels do; the specialised
// AVX-512 kernels and the AVX2 kernel do not, so these caches run on the former.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/attention/options.hpp"
#include "kvq/attention/reference.hpp"
#include "kvq/attention/scores.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/core/scratch.hpp"
#include "kvq/error.hpp"
#include "kvq/kernels/attention/integer_range.hpp"
#include "kvq/kernels/attention/registry.hpp"
#include "kvq/kernels/attention/task.hpp"
#include "kvq/parallel/executor.hpp"

namespace kvq::inline v0 {

namespace detail {

/// The rotation attention applies to the queries: the key rotation of post-RoPE keys, or null.
inline const HadamardTransform* query_rotation(const BasicKVCache& cache) noexcept {
  return cache.config().key_rope == KeyRope::post ? cache.rotation(Tensor::keys) : nullptr;
}
/// The rotation kernels undo on each key row before RoPE: the key rotation of pre-RoPE keys, or null.
inline const HadamardTransform* key_unrotation(const BasicKVCache& cache) noexcept {
  return cache.config().key_rope == KeyRope::pre ? cache.rotation(Tensor::keys) : nullptr;
}

/// The tier the kernels compute for this cache (kernels::attention::computed_tier: the exact one
/// for streams the integer tier does not read), answered ahead of the kernels for the outlier scan
/// and decode_kernel. The AVX-512 kernels compute the exact tier of 3-bit codes too
/// (avx512::exact_for_integer), after the scan.
inline Tier kernel_tier(const BasicKVCache& cache, Tier requested) noexcept {
  using kernels::attention::integer_tier_reads;
  return integer_tier_reads(cache.keys(0, 0, 0)) && integer_tier_reads(cache.values(0, 0, 0)) ? requested : Tier::exact;
}

struct DecodePlan {
  std::size_t dim = 0, heads = 0, group = 0, kv_heads = 0, tokens = 0, chunk = 0;
  std::size_t first = 0;                    // the first position the query sees (window, chunk)
  std::size_t first_chunk = 0, chunks = 0;  // the chunks covering [first, tokens)
};

/// Context chunk j covers [start(j), start(j + 1)) with start(j) = sinks + j * chunk (chunk 0 from
/// 0): a fixed grid, so a chunk's bits do not depend on where a range or window begins.
struct ChunkGrid {
  std::size_t sinks = 0, chunk = 0;
  std::size_t index(std::size_t p) const noexcept { return p < sinks ? 0 : (p - sinks) / chunk; }
  /// Chunk j's part of [begin, end).
  std::pair<std::size_t, std::size_t> range(std::size_t j, std::size_t begin, std::size_t end) const noexcept {
    // sinks may be up to SIZE_MAX; j * chunk stays within the capacity's tiles
    return {std::max(begin, j == 0 ? 0 : saturating_add(sinks, j * chunk)),
            std::min(end, saturating_add(sinks, (j + 1) * chunk))};
  }
};

/// Positions per context chunk: chunk_tokens rounded up to whole tiles (at least one), and at
/// most the tiles that cover the capacity, so that no chunk boundary (sinks + j * chunk) wraps.
inline std::size_t chunk_positions(const BasicKVCache& cache, std::size_t layer, std::size_t chunk_tokens) {
  const std::size_t tile = kernels::attention::tile_tokens(cache.keys(layer, 0, 0));
  const std::size_t most = cache.capacity() / tile + 1;
  return std::clamp<std::size_t>(chunk_tokens / tile + (chunk_tokens % tile != 0), 1, most) * tile;
}

/// Throws unless `heads` query heads are a positive multiple of the cache's KV heads, at most
/// max_group per KV head: the groups the decode kernels take.
inline void check_decode_heads(const BasicKVCache& cache, std::size_t heads) {
  const std::size_t kv_heads = cache.shape().kv_heads;
  if (heads == 0 || heads % kv_heads != 0)
    throw Error(ErrorCode::shape_mismatch, "decode attention: " + std::to_string(heads) +
                                               " query heads are not a positive multiple of " +
                                               std::to_string(kv_heads) + " KV heads");
  if (heads / kv_heads > kernels::attention::max_group)
    throw Error(ErrorCode::unsupported,
                "decode attention: " + std::to_string(heads / kv_heads) + " query heads per KV head exceed " +
                    std::to_string(kernels::attention::max_group) + " (attend() takes more, in batches)");
}

inline DecodePlan plan_decode(const BasicKVCache& cache, std::size_t layer, std::size_t position,
                              std::span<const float> q, std::size_t out_size, const DecodeOptions& options) {
  check_attention_args(cache, layer, position, 1, q, out_size, -1.0f, options.scores);
  const std::size_t q_size = q.size();
  DecodePlan p;
  p.dim = cache.shape().head_dim;
  p.kv_heads = cache.shape().kv_heads;
  p.heads = q_size / p.dim;
  p.group = p.heads / p.kv_heads;
  check_decode_heads(cache, p.heads);
  if (p.dim > max_head_dim)
    throw Error(ErrorCode::unsupported,
                "decode attention: head_dim " + std::to_string(p.dim) + " exceeds " + std::to_string(max_head_dim));
  p.tokens = position + 1;
  p.chunk = chunk_positions(cache, layer, options.chunk_tokens);
  const ChunkGrid grid{cache.config().sinks, p.chunk};
  p.first = window_start(options.scores, position);
  p.first_chunk = grid.index(p.first);
  p.chunks = grid.index(position) + 1 - p.first_chunk;
  return p;
}

/// Query rows of one KV head, prepared: rotated to their positions (pre-RoPE) and scaled.
struct QueryRows {
  const float* data = nullptr;  // (rows, head_dim)
  std::size_t rows = 0;
  const RopeTable* rope = nullptr;              // non-null: keys are stored pre-RoPE
  const HadamardTransform* unrotate = nullptr;  // non-null: pre-RoPE keys are stored rotated by it
};
/// Online-softmax state of query rows: max (rows), sum (rows), acc (rows, head_dim).
struct PartialState {
  float *max, *sum, *acc;
};

/// The kernel over positions [begin, end) of one KV head, one segment (block) at a time, each
/// continuing the state the previous one left. The integer tier falls back to exact for the whole
/// range when its scales have outliers the tier cannot carry (integer_range.hpp).
inline void run_range(const BasicKVCache& cache, std::size_t layer, std::size_t kvh, std::size_t begin, std::size_t end,
                      const QueryRows& q, const kernels::attention::KernelEntry& kernel, const DecodeOptions& options,
                      const PartialState& state) {
  const std::size_t sinks = cache.config().sinks, block = cache.block_tokens();
  auto segment_of = [&](std::size_t p) { return p < sinks ? 0 : (p - sinks) / block; };
  const std::size_t first = segment_of(begin), last = segment_of(end - 1);
  kernels::attention::DecodeTask t;
  t.rope = q.rope;
  t.unrotate = q.unrotate;
  t.queries = q.data;
  t.group = q.rows;
  t.max = state.max;
  t.sum = state.sum;
  t.acc = state.acc;
  auto rows_of = [](const StreamView& v) { return v.quantized ? v.codes : v.ring; };
  auto at_segment = [&](std::size_t k) {
    t.keys = cache.keys(layer, kvh, k);
    t.values = cache.values(layer, kvh, k);
    t.next_keys = k < last ? rows_of(cache.keys(layer, kvh, k + 1)) : nullptr;
    t.next_values = k < last ? rows_of(cache.values(layer, kvh, k + 1)) : nullptr;
    t.begin = std::max(begin, cache.segment_begin(k));
    t.end = std::min(end, saturating_add(sinks, (k + 1) * block));  // sinks may be up to SIZE_MAX
    t.resume = k != first;
  };
  t.tier = options.tier;  // a kernel computes the exact tier where the streams ask it to (computed_tier)
  t.softcap = softcap_or_zero(options.scores);
  // The scan decides between the tiers; a kernel that computes the exact tier for both needs none.
  if (kernel.integer_tier && kernel_tier(cache, options.tier) == Tier::integer && options.guard_outliers) {
    kernels::attention::ScaleSpread spread;
    for (std::size_t k = first; k <= last; ++k) at_segment(k), spread.add(t);
    if (!spread.integer_tier_carries()) t.tier = Tier::exact;
  }
  for (std::size_t k = first; k <= last; ++k) {
    at_segment(k);
    kernel.run(t);
  }
}

/// Merges n partial states of one query row, in order (part j: max[j * stride], sum[j * stride],
/// acc + j * stride), into the normalised output o (dim), with the row's sink logit in the
/// denominator (-inf: none), and writes the log of that denominator to *lse unless lse is null.
/// The order is fixed, so the result does not depend on which thread computed which part. A row
/// that saw nothing (AttentionRequest::stored_only) gets zeros and -inf (its sink logit with one).
inline void merge_parts(const float* max, const float* sum, const float* acc, std::size_t n, std::size_t stride,
                        std::size_t dim, float sink, float* o, float* lse = nullptr) noexcept {
  float m = sink;
  for (std::size_t j = 0; j < n; ++j) m = std::max(m, max[j * stride]);
  std::fill(o, o + dim, 0.0f);
  float total = 0.0f;
  for (std::size_t j = 0; j < n; ++j) {
    if (max[j * stride] == -std::numeric_limits<float>::infinity()) continue;
    const float w = std::exp(max[j * stride] - m);
    total += w * sum[j * stride];
    const float* a = acc + j * stride;
    for (std::size_t c = 0; c < dim; ++c) o[c] += w * a[c];
  }
  if (sink != -std::numeric_limits<float>::infinity()) total += std::exp(sink - m);
  if (total == 0.0f) {
    if (lse != nullptr) *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  const float inv = 1.0f / total;
  for (std::size_t c = 0; c < dim; ++c) o[c] *= inv;
  if (lse != nullptr) *lse = m + std::log(total);
}

/// decode_attention, and with a non-empty `lse` (heads; checked by attend) each head's
/// log-sum-exp as AttentionRequest::lse describes it.
inline void decode_with_lse(const BasicKVCache& cache, std::size_t layer, std::size_t position,
                            std::span<const float> q, std::span<float> out, std::span<float> lse,
                            const DecodeOptions& options) {
  const detail::DecodePlan plan = detail::plan_decode(cache, layer, position, q, out.size(), options);
  detail::check_sink_logits_apart(options.scores, out);
  const bool pre = cache.config().key_rope == KeyRope::pre;
  const RopeTable* rope = pre ? &cache.rope() : nullptr;
  const HadamardTransform* unrotate = detail::key_unrotation(cache);
  const kernels::attention::KernelEntry& kernel = kernels::attention::select_kernel(
      cache.keys(layer, 0, 0), cache.values(layer, 0, 0), plan.group, rope, unrotate != nullptr, options.kernel);
  OwnScratch<DecodeWorkspace> own(options.workspace == nullptr);
  DecodeWorkspace& ws = options.workspace != nullptr ? *options.workspace : own.get();
  const std::size_t dim = plan.dim, stride = plan.group * (dim + 2);
  checked_resize(ws.queries, plan.heads * dim, "decode attention's queries");
  checked_resize(ws.partial, plan.kv_heads * plan.chunks * stride, "decode attention's partial results");

  const float scale = detail::score_scale(options.scores, dim);
  std::copy(q.begin(), q.end(), ws.queries.begin());
  for (std::size_t h = 0; h < plan.heads; ++h) {
    float* x = ws.queries.data() + h * dim;
    if (pre) cache.rope().rotate_query(x, position);  // kernels rotate keys without the factor
    for (std::size_t c = 0; c < dim; ++c) x[c] *= scale;
  }
  if (const auto r = detail::query_rotation(cache))  // q.k = Hq.Hk; sums within |q|_1 (check_attention_args)
    r->forward_unchecked(ws.queries);

  const detail::ChunkGrid grid{cache.config().sinks, plan.chunk};
  auto task_at = [&](std::size_t i) {
    const std::size_t kvh = i / plan.chunks, j = plan.first_chunk + i % plan.chunks;
    const auto [begin, end] = grid.range(j, plan.first, plan.tokens);
    float* base = ws.partial.data() + i * stride;
    detail::run_range(cache, layer, kvh, begin, end,
                      {ws.queries.data() + kvh * plan.group * dim, plan.group, rope, unrotate}, kernel, options,
                      {base, base + plan.group, base + 2 * plan.group});
  };
  const std::size_t n = plan.kv_heads * plan.chunks;
  if (options.executor != nullptr && n > 1)
    options.executor->parallel_for(n, task_at);
  else
    for (std::size_t i = 0; i < n; ++i) task_at(i);

  for (std::size_t kvh = 0; kvh < plan.kv_heads; ++kvh) {
    const float* parts = ws.partial.data() + kvh * plan.chunks * stride;
    for (std::size_t g = 0; g < plan.group; ++g)
      detail::merge_parts(parts + g, parts + plan.group + g, parts + 2 * plan.group + g * dim, plan.chunks, stride, dim,
                          detail::sink_logit(options.scores, kvh * plan.group + g),
                          out.data() + (kvh * plan.group + g) * dim,
                          lse.empty() ? nullptr : lse.data() + kvh * plan.group + g);
  }
  if (const auto r = cache.rotation(Tensor::values)) r->inverse_unchecked(out);  // sum p Hv = H sum p v
}

}  // namespace detail

/// Decode attention for one position: q, out (heads, head_dim); queries follow the cache's
/// key_rope (pre-RoPE queries are rotated to `position` here). Query head h reads KV head
/// h / (heads / kv_heads). Attends to positions [0, position], or those of them options.scores
/// lets it see (a sliding window, its attention chunk). Throws kvq::Error on bad shapes or
/// options, a layer outside the cache or a position the layer does not hold yet.
inline void decode_attention(const BasicKVCache& cache, std::size_t layer, std::size_t position,
                             std::span<const float> q, std::span<float> out, const DecodeOptions& options = {}) {
  detail::decode_with_lse(cache, layer, position, q, out, {}, options);
}

namespace detail {
/// The task decode_kernel and decode_tier ask about (the cache's first segment stands for all:
/// every segment has its layout) and the kernel it runs on.
struct KernelChoice {
  kernels::attention::DecodeTask task;
  const kernels::attention::KernelEntry* kernel = nullptr;
};
inline KernelChoice choose_kernel(const BasicKVCache& cache, std::size_t heads, const DecodeOptions& options) {
  check_decode_heads(cache, heads);
  KernelChoice c;
  c.task.keys = cache.keys(0, 0, 0);
  c.task.values = cache.values(0, 0, 0);
  c.task.group = heads / cache.shape().kv_heads;
  c.task.rope = cache.config().key_rope == KeyRope::pre ? &cache.rope() : nullptr;
  c.task.unrotate = key_unrotation(cache);
  c.task.tier = kernel_tier(cache, options.tier);
  c.kernel = &kernels::attention::select_kernel(c.task.keys, c.task.values, c.task.group, c.task.rope,
                                                c.task.unrotate != nullptr, options.kernel);
  return c;
}
}  // namespace detail

/// The kernel decode_attention runs on the packed rows of this cache, by name: its registry
/// entry's (kernels/attention/registry.hpp), and for "avx512" the AVX-512 kernel its rows take
/// ("avx512-dense", "avx512-integer", "avx512-exact" or "avx512-generic"; avx512::Kernel). The
/// integer tier's outlier guard may still run a chunk on the exact kernel
/// (DecodeOptions::guard_outliers). Throws kvq::Error as decode_attention does for a kernel the
/// options name that cannot run here.
inline const char* decode_kernel(const BasicKVCache& cache, std::size_t heads, const DecodeOptions& options = {}) {
  const detail::KernelChoice c = detail::choose_kernel(cache, heads, options);
#if defined(KVQ_HAVE_X86_KERNELS)
  if (std::string_view(c.kernel->name) == "avx512") return to_string(kernels::attention::avx512::kernel_for(c.task));
#endif
  return c.kernel->name;
}

/// The tier decode_attention computes on the packed rows of this cache with these options (and
/// attend on a stored prefix; the positions it reads row by row are exact in both tiers):
/// options.tier, or exact where the integer tier was asked for and the streams or the kernel
/// compute the exact one instead (Tier's comment lists where), so an engine can tell before it
/// relies on the speed or the bound. The outlier guard (DecodeOptions::guard_outliers) may also
/// run a chunk of the integer tier exactly, as its data requires. Throws as decode_kernel does.
inline Tier decode_tier(const BasicKVCache& cache, std::size_t heads, const DecodeOptions& options = {}) {
  const detail::KernelChoice c = detail::choose_kernel(cache, heads, options);
  if (c.task.tier == Tier::exact || !c.kernel->integer_tier) return Tier::exact;
  // The integer tier reads packed values, and packed keys whose scales fold into the query; rows
  // in full precision, and pre-RoPE keys (rotated per position), are read exactly in both.
  if (!c.task.values.quantized && !(c.task.keys.quantized && c.task.rope == nullptr)) return Tier::exact;
#if defined(KVQ_HAVE_X86_KERNELS)
  if (std::string_view(c.kernel->name) == "avx512" && kernels::attention::avx512::exact_for_integer(c.task))
    return Tier::exact;
#endif
  return Tier::integer;
}

}  // namespace kvq::inline v0
