// Metrics: zero for identical tensors, each partial error isolates its tensor, KL is a KL.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvq/metrics/attention_error.hpp"

namespace {

kvq::MatrixD random_matrix(long rows, long cols, unsigned seed) {
  std::srand(seed);
  return kvq::MatrixD::Random(rows, cols);
}

TEST(AttentionErrors, ZeroWhenNothingChanges) {
  const auto q = random_matrix(10, 8, 1), k = random_matrix(10, 8, 2), v = random_matrix(10, 8, 3);
  kvq::AttentionErrorAccumulator acc;
  acc.add(q, k, v, k, v, 0);
  const auto e = acc.errors();
  EXPECT_EQ(e.key_error, 0.0);
  EXPECT_EQ(e.output_error, 0.0);
  EXPECT_NEAR(e.attention_kl, 0.0, 1e-15);
  EXPECT_EQ(e.value_error, 0.0);
  EXPECT_EQ(e.score_error, 0.0);
  EXPECT_EQ(e.output_error_values, 0.0);
}

// Mismatched shapes, a query past the last key and non-finite values are refused by name, and
// the accumulator keeps what it had.
TEST(AttentionErrors, BadInputIsRefusedAndAddsNothing) {
  const auto q = random_matrix(4, 8, 1), k = random_matrix(10, 8, 2), v = random_matrix(10, 8, 3);
  kvq::AttentionErrorAccumulator acc;
  acc.add(q, k, v, k + 0.1 * random_matrix(10, 8, 4), v, 2);
  const double kl = acc.errors().attention_kl, key_error = acc.errors().key_error;
  kvq::MatrixD nan_keys = k;
  nan_keys(3, 5) = std::nan("");
  const struct {
    kvq::MatrixD q, k, v, k_hat, v_hat;
    std::size_t first;
    kvq::ErrorCode code;
    const char* says;
  } cases[] = {
      {q, k, v, k.topRows(9), v, 0, kvq::ErrorCode::shape_mismatch, "quantized keys 9 x 8"},
      {q, k, v, k, v.leftCols(7), 0, kvq::ErrorCode::shape_mismatch, "values 10 x 7"},
      {random_matrix(4, 6, 5), k, v, k, v, 0, kvq::ErrorCode::shape_mismatch, "queries 4 x 6"},
      {q, k, v, k, v, 7, kvq::ErrorCode::shape_mismatch, "4 queries from position 7 over 10 keys"},
      {q, k, v, k, v, SIZE_MAX, kvq::ErrorCode::shape_mismatch, "over 10 keys"},
      {q, k, v, nan_keys, v, 0, kvq::ErrorCode::non_finite_input, "quantized keys hold"},
  };
  for (const auto& c : cases) {
    try {
      acc.add(c.q, c.k, c.v, c.k_hat, c.v_hat, c.first);
      ADD_FAILURE() << "accepted: " << c.says;
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), c.code) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(acc.errors().attention_kl, kl);
  EXPECT_EQ(acc.errors().key_error, key_error);
}

TEST(AttentionErrors, PartialErrorsIsolateTheirTensor) {
  const kvq::MatrixD q = random_matrix(12, 8, 4) * 3.0, k = random_matrix(12, 8, 5), v = random_matrix(12, 8, 6);
  const kvq::MatrixD k_hat = k + 0.1 * random_matrix(12, 8, 7), v_hat = v + 0.1 * random_matrix(12, 8, 8);
  kvq::AttentionErrorAccumulator only_k, only_v, both;
  only_k.add(q, k, v, k_hat, v, 0);
  only_v.add(q, k, v, k, v_hat, 0);
  both.add(q, k, v, k_hat, v_hat, 0);
  EXPECT_DOUBLE_EQ(only_k.errors().output_error, only_k.errors().output_error_keys);
  EXPECT_EQ(only_k.errors().output_error_values, 0.0);
  EXPECT_EQ(only_k.errors().value_error, 0.0);
  EXPECT_GT(only_k.errors().score_error, 0.0);
  EXPECT_GT(only_k.errors().attention_kl, 0.0);
  EXPECT_DOUBLE_EQ(only_v.errors().output_error, only_v.errors().output_error_values);
  EXPECT_EQ(only_v.errors().score_error, 0.0);
  EXPECT_NEAR(both.errors().output_error_keys, only_k.errors().output_error, 1e-15);
  EXPECT_NEAR(both.errors().key_error, (k - k_hat).norm() / k.norm(), 1e-12);
}

TEST(AttentionErrors, SparsityCountsWeightsFarBelowTheRowMaximum) {
  kvq::MatrixD k = kvq::MatrixD::Zero(4, 2), v = kvq::MatrixD::Ones(4, 2), q(1, 2);
  k(0, 0) = 100.0;  // one key dominates a query pointing at it
  q << 1.0, 0.0;
  kvq::AttentionErrorAccumulator acc;
  acc.add(q, k, v, k, v, 3);
  EXPECT_DOUBLE_EQ(acc.errors().sparsity, 0.75);
}

}  // namespace
