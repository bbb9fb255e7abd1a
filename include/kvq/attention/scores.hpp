#pragma once
// How query-key products become softmax logits, for every attention routine (the Eigen oracle,
// decode_attention, attend): a scale, an optional sliding window or chunked local attention,
// optional logit soft-capping and optional learned sink logits, as the models that need them
// define them.
//
//   logit(q, k_j) = cap * tanh(scale * q.k_j / cap)   (without a cap: scale * q.k_j)
//   a query at position p sees positions max(0, p - window + 1) .. p, and with chunked
//   attention from floor(p / chunk) * chunk only
//   weights = softmax(logits, sink_h) without the sink's own column: out = sum_j w_j v_j
//
// The window and the attention chunks are masks on positions, so the planners apply them by
// cutting ranges and no kernel sees them; the cap is applied to each tile's scores before its
// softmax (cap_scores); a sink adds exp(sink_h) to query head h's denominator where the context
// chunks' partial states merge (decode.hpp's merge_parts), so no kernel sees it either.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>

#include "kvq/error.hpp"

namespace kvq::inline v0 {

struct ScoreOptions {
  /// Multiplies q.k; unset: 1 / sqrt(head_dim). Gemma 2 uses 1 / sqrt(query_pre_attn_scalar).
  std::optional<float> scale{};
  /// Sliding-window attention (Mistral; Gemma 2's local layers): a query sees only the `window`
  /// newest positions up to its own. Unset: every position up to its own.
  std::optional<std::size_t> window{};
  /// Chunked local attention (Llama 4's local layers, attention_chunk_size 8192): positions fall
  /// in blocks of `attention_chunk`, and a query sees only its own block up to its position.
  /// Unset: no blocks. With a window too, a query sees what both allow.
  std::optional<std::size_t> attention_chunk{};
  /// Logit soft-capping (Gemma 2: 50 for attention): logits become cap * tanh(logit / cap).
  std::optional<float> softcap{};
  /// Learned attention sinks (gpt-oss), not to be confused with the sink tokens a cache keeps
  /// exact: empty, or one finite logit per query head, a softmax column that takes weight and
  /// carries no value, so a head may attend to nothing. Not scaled or capped: the model's logit.
  /// The caller keeps the array alive during the call; they are one layer's, so an attend() call
  /// with sink logits takes requests of that layer (and its query head count) only.
  std::span<const float> sink_logits{};
};

namespace detail {

inline void check_score_options(const ScoreOptions& o) {
  if (o.scale && !(std::isfinite(*o.scale) && *o.scale > 0.0f))
    throw Error(ErrorCode::invalid_argument,
                "attention: softmax scale " + std::to_string(*o.scale) + " is not a finite positive number");
  if (o.window && *o.window == 0)
    throw Error(ErrorCode::invalid_argument, "attention: a sliding window of 0 positions lets a query see nothing");
  if (o.attention_chunk && *o.attention_chunk == 0)
    throw Error(ErrorCode::invalid_argument, "attention: chunks of 0 positions let a query see nothing");
  // cap_scores multiplies by 1 / cap: a cap whose reciprocal overflows (2^-128 and below) would turn
  // a score of 0 into 0 * inf = NaN.
  if (o.softcap && !(std::isfinite(*o.softcap) && *o.softcap > 0.0f && std::isfinite(1.0f / *o.softcap)))
    throw Error(ErrorCode::invalid_argument, "attention: soft-cap " + std::to_string(*o.softcap) +
                                                 " is not a finite positive number with a finite reciprocal");
}

inline float score_scale(const ScoreOptions& o, std::size_t head_dim) noexcept {
  return o.scale ? *o.scale : 1.0f / std::sqrt(float(head_dim));
}

/// The first position a query at `position` sees; never decreasing in `position`, which the
/// planners rely on (attend.hpp's positions every query of a request sees).
inline std::size_t window_start(const ScoreOptions& o, std::size_t position) noexcept {
  const std::size_t window = o.window && position >= *o.window ? position - *o.window + 1 : 0;
  return o.attention_chunk ? std::max(window, position / *o.attention_chunk * *o.attention_chunk) : window;
}

/// 0 when there is no cap: the kernels' DecodeTask::softcap.
inline float softcap_or_zero(const ScoreOptions& o) noexcept { return o.softcap ? *o.softcap : 0.0f; }

/// Query head h's sink logit; -inf, which weighs nothing, without sink logits.
inline float sink_logit(const ScoreOptions& o, std::size_t h) noexcept {
  return o.sink_logits.empty() ? -std::numeric_limits<float>::infinity() : o.sink_logits[h];
}

/// Whether two spans share a float.
inline bool overlaps(std::span<const float> a, std::span<const float> b) noexcept {
  if (a.empty() || b.empty()) return false;
  const std::less<const float*> before;
  return before(a.data(), b.data() + b.size()) && before(b.data(), a.data() + a.size());
}

/// Throws if an output (`what`: the output, the log-sum-exp) overlaps the sink logits: the merge
/// reads them while it writes the outputs.
inline void check_sink_logits_apart(const ScoreOptions& o, std::span<const float> out, const char* what = "output") {
  if (overlaps(o.sink_logits, out))
    throw Error(ErrorCode::invalid_argument, std::string("attention: the ") + what + " overlaps the sink logits");
}

/// Throws unless the sink logits are absent or one finite logit for each of `heads` query heads.
inline void check_sink_logits(const ScoreOptions& o, std::size_t heads) {
  if (o.sink_logits.empty()) return;
  if (o.sink_logits.size() != heads)
    throw Error(ErrorCode::shape_mismatch, "attention: " + std::to_string(o.sink_logits.size()) + " sink logits for " +
                                               std::to_string(heads) + " query heads");
  for (std::size_t h = 0; h < heads; ++h)
    if (!std::isfinite(o.sink_logits[h]))
      throw Error(ErrorCode::invalid_argument, "attention: the sink logit of query head " + std::to_string(h) + " is " +
                                                   std::to_string(o.sink_logits[h]));
}

}  // namespace detail

/// Soft-caps n scores in place (cap > 0; cap 0: unchanged). -inf, the kernels' padding of a
/// partial tile, stays -inf so that it still weighs nothing. Eigen's vectorized tanh (a rational
/// approximation within a few ulp): a scalar tanh per score would cost more than the whole step.
inline void cap_scores(float* scores, std::size_t n, float cap) noexcept {
  if (cap == 0.0f) return;
  Eigen::Map<Eigen::ArrayXf> s(scores, Eigen::Index(n));
  s = (s == -std::numeric_limits<float>::infinity()).select(s, cap * (s * (1.0f / cap)).tanh());
}

}  // namespace kvq::inline v0
