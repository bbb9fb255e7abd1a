#pragma once
// Merging attention computed over disjoint sets of keys. Softmax attention over keys A u B is
// the two partial outputs weighted by their softmax denominators, which their log-sum-exps carry:
//
//   m = max(lse_a, lse_b),  w_a = exp(lse_a - m),  w_b = exp(lse_b - m)
//   out = (w_a out_a + w_b out_b) / (w_a + w_b),  lse = m + log(w_a + w_b)
//
// so an engine can keep a shared prefix in one cache and each sequence's own tokens in another
// (cascade attention: AttentionRequest::stored_only), read the prefix its KVPool's forks share
// once (AttentionRequest::seen_begin, seen_end), or attend to tokens it holds itself, and merge
// the results with those of attend (AttentionRequest::lse). Give a learned sink logit
// (ScoreOptions::sink_logits) to one part only: given to both, it is counted twice.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <utility>

#include "kvq/attention/scores.hpp"
#include "kvq/error.hpp"

namespace kvq::inline v0 {

/// Merges the attention state (other_out, other_lse) into (out, lse), row by row: out and
/// other_out are (rows, head_dim), lse and other_lse (rows), as attend writes them. A row whose
/// log-sum-exp is -inf saw no position and weighs nothing, whatever its output holds (an empty
/// state to merge into: any output, lse -inf). Throws kvq::Error, changing nothing, on mismatched
/// sizes, a NaN or +inf log-sum-exp, the two states sharing memory, or an output over its own
/// log-sum-exp.
inline void merge_attention(std::span<float> out, std::span<float> lse, std::span<const float> other_out,
                            std::span<const float> other_lse) {
  const std::size_t rows = lse.size();
  if (other_lse.size() != rows || other_out.size() != out.size())
    throw Error(ErrorCode::shape_mismatch, "merge_attention: outputs of " + std::to_string(out.size()) + " and " +
                                               std::to_string(other_out.size()) + " floats with log-sum-exps of " +
                                               std::to_string(rows) + " and " + std::to_string(other_lse.size()) +
                                               " rows");
  if (rows == 0 ? !out.empty() : out.size() % rows != 0)
    throw Error(ErrorCode::shape_mismatch, "merge_attention: outputs of " + std::to_string(out.size()) +
                                               " floats are not " + std::to_string(rows) + " rows of one head each");
  const std::span<const float> own_out = out, own_lse = lse;
  for (const auto mine : {own_out, own_lse})
    for (const auto theirs : {other_out, other_lse})
      if (detail::overlaps(mine, theirs))
        throw Error(ErrorCode::invalid_argument, "merge_attention: the two states overlap");
  if (detail::overlaps(own_out, own_lse))
    throw Error(ErrorCode::invalid_argument, "merge_attention: the output overlaps its log-sum-exp");
  for (const auto& [span, which] : {std::pair{own_lse, "first"}, std::pair{other_lse, "second"}})
    for (std::size_t i = 0; i < rows; ++i)
      if (std::isnan(span[i]) || span[i] == std::numeric_limits<float>::infinity())
        throw Error(ErrorCode::non_finite_input, std::string("merge_attention: the ") + which +
                                                     " state's log-sum-exp of row " + std::to_string(i) + " is " +
                                                     std::to_string(span[i]));
  const std::size_t dim = rows == 0 ? 0 : out.size() / rows;
  constexpr float none = -std::numeric_limits<float>::infinity();
  for (std::size_t i = 0; i < rows; ++i) {
    float* o = out.data() + i * dim;
    const float* p = other_out.data() + i * dim;
    if (other_lse[i] == none) continue;  // an empty row adds nothing, whatever its output holds
    if (lse[i] == none) {
      std::copy_n(p, dim, o);
      lse[i] = other_lse[i];
      continue;
    }
    const float m = std::max(lse[i], other_lse[i]);
    const float wa = std::exp(lse[i] - m), wb = std::exp(other_lse[i] - m), inv = 1.0f / (wa + wb);
    for (std::size_t c = 0; c < dim; ++c) o[c] = (wa * o[c] + wb * p[c]) * inv;
    lse[i] = m + std::log(wa + wb);
  }
}

}  // namespace kvq::inline v0
