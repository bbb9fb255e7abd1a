#pragma once
// How query-key products become softmax logits, for every attention routine (the Eigen oracle,
// decode_attention, attend): a scale, an optional sliding window and optional logit
// soft-capping, as the models that need them define them.
//
//   logit(q, k_j) = cap * tanh(scale * q.k_j / cap)   (without a cap: scale * q.k_j)
//   a query at position p sees positions max(0, p - window + 1) .. p
//
// The window is a mask on positions, so the planners apply it by cutting ranges and no kernel
// sees it; the cap is applied to each tile's scores before its softmax (cap_scores).

#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <string>

#include "kvq/error.hpp"

namespace kvq::inline v0 {

struct ScoreOptions {
  /// Multiplies q.k; unset: 1 / sqrt(head_dim). Gemma 2 uses 1 / sqrt(query_pre_attn_scalar).
  std::optional<float> scale;
  /// Sliding-window attention (Mistral; Gemma 2's local layers): a query sees only the `window`
  /// newest positions up to its own. Unset: every position up to its own.
  std::optional<std::size_t> window;
  /// Logit soft-capping (Gemma 2: 50 for attention): logits become cap * tanh(logit / cap).
  std::optional<float> softcap;
};

namespace detail {

inline void check_score_options(const ScoreOptions& o) {
  if (o.scale && !(std::isfinite(*o.scale) && *o.scale > 0.0f))
    throw Error(ErrorCode::invalid_argument,
                "attention: softmax scale " + std::to_string(*o.scale) + " is not a finite positive number");
  if (o.window && *o.window == 0)
    throw Error(ErrorCode::invalid_argument, "attention: a sliding window of 0 positions lets a query see nothing");
  if (o.softcap && !(std::isfinite(*o.softcap) && *o.softcap > 0.0f))
    throw Error(ErrorCode::invalid_argument,
                "attention: soft-cap " + std::to_string(*o.softcap) + " is not a finite positive number");
}

inline float score_scale(const ScoreOptions& o, std::size_t head_dim) noexcept {
  return o.scale ? *o.scale : 1.0f / std::sqrt(float(head_dim));
}

/// The first position a query at `position` sees.
inline std::size_t window_start(const ScoreOptions& o, std::size_t position) noexcept {
  return o.window && position >= *o.window ? position - *o.window + 1 : 0;
}

/// 0 when there is no cap: the kernels' DecodeTask::softcap.
inline float softcap_or_zero(const ScoreOptions& o) noexcept { return o.softcap ? *o.softcap : 0.0f; }

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
