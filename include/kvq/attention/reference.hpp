#pragma once
// Reference attention: the oracle every faster path is measured against. Plain Eigen in double:
// dequantize, rotate keys (pre-RoPE storage), softmax(q k^T / sqrt(d)), weighted sum of values;
// the score options (scale, sliding window, attention chunks, soft-cap, sink logits) as
// ScoreOptions (scores.hpp) defines them.
//
// Queries follow the cache's key_rope: with KeyRope::pre they arrive pre-RoPE and are rotated
// here at their position; with KeyRope::post the engine has rotated them already.

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kvq/attention/scores.hpp"
#include "kvq/cache/kv_cache.hpp"

namespace kvq::inline v0 {

using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Keys and values of one (layer, KV head) as attention sees them: (length, head_dim) each,
/// keys rotated to their positions.
struct HeadTensors {
  MatrixD keys;
  MatrixD values;
};

inline HeadTensors read_head(const BasicKVCache& cache, std::size_t layer, std::size_t head) {
  const std::size_t n = cache.length(layer), dim = cache.shape().head_dim;
  HeadTensors out{MatrixD(n, dim), MatrixD(n, dim)};
  std::vector<float> row(dim);
  for (std::size_t p = 0; p < n; ++p) {
    cache.read_row(Tensor::keys, layer, head, p, row.data());
    if (cache.config().key_rope == KeyRope::pre) cache.rope().rotate(row.data(), p);
    for (std::size_t c = 0; c < dim; ++c) out.keys(p, c) = row[c];
    cache.read_row(Tensor::values, layer, head, p, row.data());
    for (std::size_t c = 0; c < dim; ++c) out.values(p, c) = row[c];
  }
  return out;
}

/// Causal attention of one head's queries over given keys and values.
/// queries (T, d) at positions first_position + t; keys, values (n, d) with n > last position.
/// Returns the output (T, d); `weights`, when given, receives the attention rows (T, n), zero
/// outside each query's window. `sink`: this head's sink logit (ScoreOptions::sink_logits; -inf:
/// none).
inline MatrixD attend(const MatrixD& queries, const MatrixD& keys, const MatrixD& values, std::size_t first_position,
                      MatrixD* weights = nullptr, const ScoreOptions& rule = {},
                      double sink = -std::numeric_limits<double>::infinity()) {
  const auto T = queries.rows();
  const auto n = keys.rows();
  const double scale = rule.scale ? double(*rule.scale) : 1.0 / std::sqrt(double(queries.cols()));
  MatrixD out = MatrixD::Zero(T, values.cols());
  if (weights != nullptr) *weights = MatrixD::Zero(T, n);
  Eigen::VectorXd row(n);
  for (Eigen::Index t = 0; t < T; ++t) {
    const Eigen::Index first = Eigen::Index(detail::window_start(rule, first_position + std::size_t(t)));
    const Eigen::Index visible = Eigen::Index(first_position) + t + 1 - first;
    auto r = row.segment(first, visible);
    r = keys.middleRows(first, visible) * queries.row(t).transpose() * scale;
    if (rule.softcap) r = double(*rule.softcap) * (r.array() / double(*rule.softcap)).tanh();
    const double top = std::max(r.maxCoeff(), sink);
    r = (r.array() - top).exp();
    r /= r.sum() + std::exp(sink - top);
    out.row(t) = r.transpose() * values.middleRows(first, visible);
    if (weights != nullptr) weights->row(t).segment(first, visible) = r.transpose();
  }
  return out;
}

namespace detail {
/// Checks attention of `tokens` query positions from first_position: the positions are stored in
/// the cache, or (new_keys_peak >= 0) they are new tokens given beside it, attending to the stored
/// positions before first_position and to each other, with keys up to new_keys_peak in magnitude.
/// Query t sits at first_position + t, or + offsets[t] where offsets are given (a draft tree's
/// depths, AttentionRequest::positions). With `beyond_stored` the positions follow the stored
/// ones they see (those before seen_end), and are held elsewhere (AttentionRequest::stored_only).
inline void check_attention_args(const BasicKVCache& cache, std::size_t layer, std::size_t first_position,
                                 std::size_t tokens, std::span<const float> q, std::size_t out_size,
                                 float new_keys_peak = -1.0f, const ScoreOptions& rule = {},
                                 std::span<const std::size_t> offsets = {}, bool beyond_stored = false,
                                 std::size_t seen_end = std::numeric_limits<std::size_t>::max()) {
  check_score_options(rule);
  const CacheShape& s = cache.shape();
  const std::size_t q_size = q.size();
  if (layer >= s.layers)
    throw Error(ErrorCode::invalid_argument, "attention: layer " + std::to_string(layer) + " is outside the cache");
  const std::size_t per_token = tokens == 0 ? 0 : q_size / tokens;
  if (tokens == 0 || q_size % tokens != 0 || per_token % s.head_dim != 0 || out_size != q_size)
    throw Error(ErrorCode::shape_mismatch, "attention: queries of " + std::to_string(q_size) +
                                               " floats and output of " + std::to_string(out_size) +
                                               " floats do not form (tokens, heads, " + std::to_string(s.head_dim) +
                                               ")");
  const std::size_t heads = per_token / s.head_dim;
  if (heads == 0 || heads % s.kv_heads != 0)
    throw Error(ErrorCode::shape_mismatch, "attention: " + std::to_string(heads) +
                                               " query heads are not a multiple of " + std::to_string(s.kv_heads) +
                                               " KV heads");
  check_sink_logits(rule, heads);
  const bool stored = new_keys_peak < 0.0f && !beyond_stored;
  // Positions from first_position the queries take: a draft tree's depth + 1, say.
  const std::size_t reach = offsets.empty() ? tokens : *std::max_element(offsets.begin(), offsets.end()) + 1;
  if (beyond_stored && (first_position < std::min(cache.length(layer), seen_end) || first_position > cache.capacity() ||
                        reach > cache.capacity() - first_position))
    throw Error(ErrorCode::invalid_argument,
                "attention: layer " + std::to_string(layer) + " holds " + std::to_string(cache.length(layer)) +
                    " tokens of a capacity of " + std::to_string(cache.capacity()) + "; queries of stored positions " +
                    "only over " + std::to_string(reach) + " positions from " + std::to_string(first_position) +
                    " must follow the stored tokens they see" +
                    (seen_end < cache.length(layer) ? " (before " + std::to_string(seen_end) + ")" : "") +
                    " within the capacity");
  if (stored &&
      (tokens > cache.length(layer) || first_position > cache.length(layer) - tokens))  // no sum that could wrap
    throw Error(ErrorCode::invalid_argument,
                "attention: layer " + std::to_string(layer) + " holds " + std::to_string(cache.length(layer)) +
                    " tokens; query positions up to " + std::to_string(first_position + tokens - 1) +
                    " need them appended first");
  if (!stored && !beyond_stored && (first_position > cache.length(layer) || reach > cache.capacity() - first_position))
    throw Error(ErrorCode::invalid_argument,
                "attention: layer " + std::to_string(layer) + " holds " + std::to_string(cache.length(layer)) +
                    " tokens of a capacity of " + std::to_string(cache.capacity()) + "; " + std::to_string(tokens) +
                    " new tokens" + (reach == tokens ? "" : " (a draft tree " + std::to_string(reach) + " deep)") +
                    " from position " + std::to_string(first_position) +
                    " need the positions before them stored and room after");
  // Sums of up to capacity values with weights up to 1 overflow past FLT_MAX / capacity. Appends
  // keep values below half that (value_limit()) and keys finite; a file's may decode beyond.
  if (!(double(cache.value_peak(layer)) < 2.0 * double(cache.value_limit())))
    throw Error(ErrorCode::unrepresentable,
                "attention: layer " + std::to_string(layer) + " holds stored values up to " +
                    std::to_string(cache.value_peak(layer)) + ", beyond FLT_MAX / capacity " +
                    std::to_string(cache.capacity()) + ", past which attention's sums overflow (appends refuse " +
                    "such values: these came from a file)");
  if (!std::isfinite(cache.key_peak(layer)))
    throw Error(ErrorCode::unrepresentable, "attention: layer " + std::to_string(layer) +
                                                " holds stored keys that decode beyond float's range (from a file)");
  if (!all_below(q.data(), q.size(), std::numeric_limits<float>::infinity())) {
    const std::size_t at =
        std::size_t(std::find_if(q.begin(), q.end(), [](float x) { return !std::isfinite(x); }) - q.begin());
    throw Error(ErrorCode::non_finite_input, "attention: layer " + std::to_string(layer) + ", query head " +
                                                 std::to_string(at / s.head_dim % (q_size / tokens / s.head_dim)) +
                                                 ", channel " + std::to_string(at % s.head_dim) + " is not finite");
  }
  // Scores |q.k| x scale <= sum|q| x (largest |key|) x sqrt(2) (a RoPE pair rotates into one
  // channel) must stay finite in float with room for the kernels' sums and the dequantized keys'
  // rounding; past that an fp32 kernel would produce inf - inf = NaN where the oracle is finite.
  // Rotated keys meet the rotated query Hq (post-RoPE) or are rotated back (pre-RoPE); either
  // way |q.k| <= |q|_2 |k|_2 and keys of either space have |k|_2 <= sqrt(d) x their peak, so
  // sqrt(d) |q|_2 stands in for |q|_1 there. Whatever the keys (all-zero keys bound nothing),
  // attention scales the query by the score scale, RoPE grows a channel by up to sqrt(2) and a
  // post-RoPE key rotation's butterflies sum up to the whole |q|_1 before they normalise:
  // sqrt(2) x scale x |q|_1 must stay finite too. Pre-RoPE, the butterflies that rotate a key
  // back sum up to d x its peak.
  const double key_peak = std::max(cache.key_peak(layer), new_keys_peak);
  const double limit = double(std::numeric_limits<float>::max()) / 64;
  const bool rotated = cache.config().key_rotation != Rotation::none;
  // (New keys of a prefill chunk are attended as given, in the model's space: only stored ones.)
  if (rotated && cache.config().key_rope == KeyRope::pre && double(cache.key_peak(layer)) * double(s.head_dim) > limit)
    throw Error(ErrorCode::unrepresentable,
                "attention: layer " + std::to_string(layer) + " holds stored (rotated) keys up to " +
                    std::to_string(cache.key_peak(layer)) + ", beyond float's range once rotated back over " +
                    std::to_string(s.head_dim) + " channels");
  const auto position_of = [&](std::size_t t) { return first_position + (offsets.empty() ? t : offsets[t]); };
  for (std::size_t row = 0; row < q_size / s.head_dim; ++row) {
    double l1 = 0, squares = 0;
    for (std::size_t c = 0; c < s.head_dim; ++c) {
      const double x = q[row * s.head_dim + c];
      l1 += std::fabs(x);
      squares += x * x;
    }
    if (l1 * std::sqrt(2.0) * double(score_scale(rule, s.head_dim)) > limit)
      throw Error(ErrorCode::unrepresentable,
                  "attention: layer " + std::to_string(layer) + ", query head " + std::to_string(row % heads) +
                      " at position " + std::to_string(position_of(row / heads)) + ": |q|_1 = " + std::to_string(l1) +
                      " is beyond float's range once scaled" +
                      (rotated && cache.config().key_rope == KeyRope::post ? " and rotated" : ""));
    if (rotated) l1 = std::sqrt(squares * double(s.head_dim));
    if (l1 * key_peak * 2 * std::sqrt(2.0) * double(score_scale(rule, s.head_dim)) > limit)
      throw Error(ErrorCode::unrepresentable,
                  "attention: layer " + std::to_string(layer) + ", query head " + std::to_string(row % heads) +
                      " at position " + std::to_string(position_of(row / heads)) +
                      (rotated ? ": sqrt(d) |q|_2 = " : ": |q|_1 = ") + std::to_string(l1) + " against keys up to " +
                      std::to_string(key_peak) + " gives scores beyond float's range");
  }
}
}  // namespace detail

/// Causal attention for a block of query positions over the cache as it stands:
/// q (tokens, heads, head_dim) at positions first_position + t, out of the same shape.
/// Query head h reads KV head h / (heads / kv_heads) (GQA; MQA when kv_heads is 1).
inline void reference_attention_block(const BasicKVCache& cache, std::size_t layer, std::size_t first_position,
                                      std::size_t tokens, std::span<const float> q, std::span<float> out,
                                      const ScoreOptions& rule = {}) {
  detail::check_attention_args(cache, layer, first_position, tokens, q, out.size(), -1.0f, rule);
  const std::size_t dim = cache.shape().head_dim, heads = q.size() / tokens / dim;
  const std::size_t group = heads / cache.shape().kv_heads;
  std::vector<float> rotated(dim);
  for (std::size_t kvh = 0; kvh < cache.shape().kv_heads; ++kvh) {
    const HeadTensors kv = read_head(cache, layer, kvh);
    for (std::size_t h = kvh * group; h < (kvh + 1) * group; ++h) {
      MatrixD queries(tokens, dim);
      for (std::size_t t = 0; t < tokens; ++t) {
        const float* src = q.data() + (t * heads + h) * dim;
        rotated.assign(src, src + dim);
        if (cache.config().key_rope == KeyRope::pre) cache.rope().rotate(rotated.data(), first_position + t);
        for (std::size_t c = 0; c < dim; ++c) queries(t, c) = rotated[c];
      }
      const MatrixD o = attend(queries, kv.keys, kv.values, first_position, nullptr, rule, detail::sink_logit(rule, h));
      for (std::size_t t = 0; t < tokens; ++t)
        for (std::size_t c = 0; c < dim; ++c) out[(t * heads + h) * dim + c] = float(o(t, c));
    }
  }
}

/// The oracle of a prefill chunk (kvq::attend with new tokens): q (tokens, heads, head_dim) at
/// positions first_position + t over the cache's positions before first_position as stored and
/// `tokens` new keys and values (tokens, kv_heads, head_dim), exact, causal among themselves; new
/// keys follow the cache's key_rope as queries do. out (tokens, heads, head_dim).
inline void reference_prefill_attention(const BasicKVCache& cache, std::size_t layer, std::size_t first_position,
                                        std::size_t tokens, std::span<const float> q, std::span<const float> new_keys,
                                        std::span<const float> new_values, std::span<float> out,
                                        const ScoreOptions& rule = {}) {
  const std::size_t dim = cache.shape().head_dim, kv_heads = cache.shape().kv_heads;
  if (new_keys.size() != tokens * kv_heads * dim || new_values.size() != new_keys.size())
    throw Error(ErrorCode::shape_mismatch,
                "reference prefill attention: new keys and values of " + std::to_string(new_keys.size()) + " and " +
                    std::to_string(new_values.size()) + " floats are not " + std::to_string(tokens) + " tokens x " +
                    std::to_string(kv_heads) + " KV heads x " + std::to_string(dim));
  detail::check_attention_args(cache, layer, first_position, tokens, q, out.size(),
                               largest_magnitude(new_keys.data(), new_keys.size()), rule);
  const std::size_t heads = q.size() / tokens / dim, group = heads / kv_heads, n = first_position + tokens;
  const bool pre = cache.config().key_rope == KeyRope::pre;
  std::vector<float> row(dim);
  // Row t of head `head` of rows laid out (t, heads of `stride` floats), rotated to its position.
  const auto load = [&](std::span<const float> rows, std::size_t t, std::size_t stride, std::size_t head, bool rotate) {
    row.assign(rows.begin() + std::ptrdiff_t(t * stride + head * dim),
               rows.begin() + std::ptrdiff_t(t * stride + (head + 1) * dim));
    if (rotate) cache.rope().rotate(row.data(), first_position + t);
    return Eigen::RowVectorXd(Eigen::Map<const Eigen::RowVectorXf>(row.data(), Eigen::Index(dim)).cast<double>());
  };
  for (std::size_t kvh = 0; kvh < kv_heads; ++kvh) {
    const HeadTensors stored = read_head(cache, layer, kvh);
    MatrixD keys(n, dim), values(n, dim);
    keys.topRows(first_position) = stored.keys.topRows(first_position);
    values.topRows(first_position) = stored.values.topRows(first_position);
    for (std::size_t t = 0; t < tokens; ++t) {
      keys.row(first_position + t) = load(new_keys, t, kv_heads * dim, kvh, pre);
      values.row(first_position + t) = load(new_values, t, kv_heads * dim, kvh, false);
    }
    for (std::size_t h = kvh * group; h < (kvh + 1) * group; ++h) {
      MatrixD queries(tokens, dim);
      for (std::size_t t = 0; t < tokens; ++t) queries.row(t) = load(q, t, heads * dim, h, pre);
      const MatrixD o = attend(queries, keys, values, first_position, nullptr, rule, detail::sink_logit(rule, h));
      for (std::size_t t = 0; t < tokens; ++t)
        for (std::size_t c = 0; c < dim; ++c) out[(t * heads + h) * dim + c] = float(o(t, c));
    }
  }
}

/// Decode: all query heads of one position. q, out: (heads, head_dim).
inline void reference_attention(const BasicKVCache& cache, std::size_t layer, std::size_t position,
                                std::span<const float> q, std::span<float> out, const ScoreOptions& rule = {}) {
  reference_attention_block(cache, layer, position, 1, q, out, rule);
}

}  // namespace kvq::inline v0
