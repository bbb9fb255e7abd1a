// Metrics: zero for identical tensors, each partial error isolates its tensor, KL is a KL.
#include <gtest/gtest.h>

#include <cmath>

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
