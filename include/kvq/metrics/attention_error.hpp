#pragma once
// Error where the tensor is consumed (DESIGN.md section 4). Every figure is a relative Frobenius
// norm ||X - X^|| / ||X|| accumulated over whatever heads and positions are added, as KIVI
// reports them; KL divergences are means over attention rows.

#include <cmath>
#include <cstddef>
#include <string>
#include <utility>

#include "kvq/attention/reference.hpp"

namespace kvq::inline v0 {

struct AttentionErrors {
  double key_error = 0;            // ||K - K^|| / ||K||
  double value_error = 0;          // ||V - V^|| / ||V||
  double score_error = 0;          // ||A - A^|| / ||A||, A = softmax(q K^T / sqrt d), K alone quantized
  double output_error = 0;         // ||AV - A^V^|| / ||AV||
  double output_error_keys = 0;    // ||AV - A^V|| / ||AV||   (only keys quantized)
  double output_error_values = 0;  // ||AV - AV^|| / ||AV||   (only values quantized)
  double attention_kl = 0;         // mean over rows of KL(A || A^), nats
  double sparsity = 0;             // fraction of weights below 1% of their row's largest weight
};

/// Accumulates squared norms over heads and layers; errors() turns them into ratios.
class AttentionErrorAccumulator {
 public:
  /// One query head: queries (T, d) at positions first_position + t, rotated as attention uses
  /// them; exact and quantized keys and values (n, d), keys rotated. Throws kvq::Error, adding
  /// nothing: shape_mismatch for other shapes or a query past the last key, non_finite_input.
  void add(const MatrixD& queries, const MatrixD& keys, const MatrixD& values, const MatrixD& keys_hat,
           const MatrixD& values_hat, std::size_t first_position) {
    check(queries, keys, values, keys_hat, values_hat, first_position);
    add_checked(queries, keys, values, keys_hat, values_hat, first_position);
  }

  /// add() of inputs check() has passed.
  void add_checked(const MatrixD& queries, const MatrixD& keys, const MatrixD& values, const MatrixD& keys_hat,
                   const MatrixD& values_hat, std::size_t first_position) {
    MatrixD a, a_hat;  // attention weights, zero beyond each position
    (void)attend(queries, keys, values, first_position, &a);
    (void)attend(queries, keys_hat, values_hat, first_position, &a_hat);
    // The four outputs as one kind of product each, so a tensor left unchanged contributes exactly
    // zero on every architecture: attend's row-by-row products round differently from a matrix
    // product where the compiler fuses multiply-adds (AArch64).
    const MatrixD exact = a * values, both = a_hat * values_hat, keys_only = a_hat * values,
                  values_only = a * values_hat;
    key_diff_ += (keys - keys_hat).squaredNorm();
    key_norm_ += keys.squaredNorm();
    value_diff_ += (values - values_hat).squaredNorm();
    value_norm_ += values.squaredNorm();
    score_diff_ += (a - a_hat).squaredNorm();
    score_norm_ += a.squaredNorm();
    out_norm_ += exact.squaredNorm();
    out_diff_ += (exact - both).squaredNorm();
    out_diff_keys_ += (exact - keys_only).squaredNorm();
    out_diff_values_ += (exact - values_only).squaredNorm();
    for (Eigen::Index t = 0; t < a.rows(); ++t) {
      const Eigen::Index visible = Eigen::Index(first_position) + t + 1;
      const double top = a.row(t).head(visible).maxCoeff();
      for (Eigen::Index j = 0; j < visible; ++j) {
        const double p = a(t, j), p_hat = std::max(a_hat(t, j), 1e-300);
        if (p > 0) kl_sum_ += p * std::log(p / p_hat);
        small_ += p < 0.01 * top ? 1 : 0;
      }
      weights_ += double(visible);
    }
    rows_ += double(a.rows());
  }

  /// Throws what add() throws for these inputs, and nothing else.
  static void check(const MatrixD& queries, const MatrixD& keys, const MatrixD& values, const MatrixD& keys_hat,
                    const MatrixD& values_hat, std::size_t first_position) {
    auto shape = [](const MatrixD& m) { return std::to_string(m.rows()) + " x " + std::to_string(m.cols()); };
    if (keys.cols() != queries.cols() || values.rows() != keys.rows() || keys_hat.rows() != keys.rows() ||
        keys_hat.cols() != keys.cols() || values_hat.rows() != values.rows() || values_hat.cols() != values.cols())
      throw Error(ErrorCode::shape_mismatch, "attention error: queries " + shape(queries) + ", keys " + shape(keys) +
                                                 ", values " + shape(values) + ", quantized keys " + shape(keys_hat) +
                                                 " and values " + shape(values_hat) +
                                                 " (keys and values need one shape each, keys the queries' width)");
    if (const auto T = std::size_t(queries.rows()), n = std::size_t(keys.rows());
        T > 0 && (T > n || first_position > n - T))
      throw Error(ErrorCode::shape_mismatch, "attention error: " + std::to_string(T) + " queries from position " +
                                                 std::to_string(first_position) + " over " + std::to_string(n) +
                                                 " keys (a query needs its own position's key)");
    const std::pair<const MatrixD*, const char*> inputs[] = {{&queries, "queries"},
                                                             {&keys, "keys"},
                                                             {&values, "values"},
                                                             {&keys_hat, "quantized keys"},
                                                             {&values_hat, "quantized values"}};
    for (const auto& [m, name] : inputs)
      if (!m->allFinite())
        throw Error(ErrorCode::non_finite_input,
                    std::string("attention error: ") + name + " hold a value that is not finite");
  }

  /// Pools another accumulator's sums into this one.
  AttentionErrorAccumulator& operator+=(const AttentionErrorAccumulator& o) noexcept {
    key_diff_ += o.key_diff_, key_norm_ += o.key_norm_, value_diff_ += o.value_diff_, value_norm_ += o.value_norm_;
    score_diff_ += o.score_diff_, score_norm_ += o.score_norm_, out_norm_ += o.out_norm_, out_diff_ += o.out_diff_;
    out_diff_keys_ += o.out_diff_keys_, out_diff_values_ += o.out_diff_values_;
    kl_sum_ += o.kl_sum_, rows_ += o.rows_, small_ += o.small_, weights_ += o.weights_;
    return *this;
  }

  AttentionErrors errors() const noexcept {
    auto ratio = [](double diff, double norm) { return norm > 0 ? std::sqrt(diff / norm) : 0.0; };
    AttentionErrors e;
    e.key_error = ratio(key_diff_, key_norm_);
    e.value_error = ratio(value_diff_, value_norm_);
    e.score_error = ratio(score_diff_, score_norm_);
    e.output_error = ratio(out_diff_, out_norm_);
    e.output_error_keys = ratio(out_diff_keys_, out_norm_);
    e.output_error_values = ratio(out_diff_values_, out_norm_);
    e.attention_kl = rows_ > 0 ? kl_sum_ / rows_ : 0.0;
    e.sparsity = weights_ > 0 ? small_ / weights_ : 0.0;
    return e;
  }

 private:
  double key_diff_ = 0, key_norm_ = 0, value_diff_ = 0, value_norm_ = 0, score_diff_ = 0, score_norm_ = 0;
  double out_norm_ = 0, out_diff_ = 0, out_diff_keys_ = 0, out_diff_values_ = 0;
  double kl_sum_ = 0, rows_ = 0, small_ = 0, weights_ = 0;
};

/// Errors of one (layer, KV head) of `cache` against exact keys and values (n, d), keys rotated,
/// for queries (heads_in_group x (T, d)) rotated, at positions first_position + t.
inline void add_head_errors(AttentionErrorAccumulator& acc, const BasicKVCache& cache, std::size_t layer,
                            std::size_t kv_head, const MatrixD& keys, const MatrixD& values,
                            std::span<const MatrixD> queries, std::size_t first_position) {
  const HeadTensors stored = read_head(cache, layer, kv_head);
  for (const MatrixD& q : queries)  // every query head checked before acc changes
    AttentionErrorAccumulator::check(q, keys, values, stored.keys, stored.values, first_position);
  for (const MatrixD& q : queries) acc.add_checked(q, keys, values, stored.keys, stored.values, first_position);
}

}  // namespace kvq::inline v0
