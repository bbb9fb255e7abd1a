#pragma once
// Synthetic keys, values and queries with the structure the literature reports, for measuring
// quantization error without a model. Every knob is documented and seeded.
//
//   keys    pre-RoPE; a few fixed outlier channels (a large constant offset in every token)
//   sink    token 0: its key points along the queries' shared direction, so it draws a large
//           share of attention, and its value is small (as sink tokens carry)
//   values  per-channel scales spread log-uniformly, so per-channel grouping reconstructs them
//           slightly better, as KIVI measured
//   queries a shared direction in the lowest-frequency RoPE pairs (nearly position-free) plus
//           noise, scaled so attention is sparse

#include <cmath>
#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"

namespace kvq::eval {

struct SyntheticSpec {
  std::size_t head_dim = 128;
  std::size_t tokens = 512;           // keys and values per head (a multiple of the key group)
  std::size_t query_heads = 4;        // query heads sharing the KV head (GQA)
  std::size_t outlier_channels = 4;   // fixed outlier channels in pre-RoPE keys
  float outlier_offset = 12.0f;       // their offset, in units of the keys' noise
  float sink_logit = 9.0f;            // the sink's score q.k/sqrt(d) (others score ~N(0, query_scale^2))
  float sink_value_scale = 0.05f;     // sink value magnitude relative to other tokens
  float value_channel_spread = 2.0f;  // channel scales span [1/spread, spread]
  float query_scale = 2.5f;           // |q| / sqrt(d); larger = sparser attention
  unsigned seed = 1;
};

struct SyntheticData {
  MatrixD keys_pre;              // (tokens, d) pre-RoPE
  MatrixD keys;                  // (tokens, d) rotated
  MatrixD values;                // (tokens, d)
  std::vector<MatrixD> queries;  // query_heads x (tokens, d), rotated, query t at position t
};

inline SyntheticData make_synthetic(const SyntheticSpec& s, const RopeTable& rope) {
  const std::size_t d = s.head_dim, T = s.tokens;
  std::mt19937 rng(s.seed);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);

  // The shared query direction lives in the last (lowest-frequency) quarter of the channels.
  Eigen::VectorXd direction = Eigen::VectorXd::Zero(Eigen::Index(d));
  for (std::size_t c = d - d / 4; c < d; ++c) direction(Eigen::Index(c)) = normal(rng);
  direction.normalize();

  SyntheticData out{MatrixD(T, d), MatrixD(T, d), MatrixD(T, d), {}};
  std::vector<double> value_scale(d);
  for (double& v : value_scale) v = std::pow(double(s.value_channel_spread), uniform(rng));
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t c = 0; c < d; ++c) {
      out.keys_pre(Eigen::Index(t), Eigen::Index(c)) =
          normal(rng) + (c % (d / s.outlier_channels) == d / s.outlier_channels / 2 ? s.outlier_offset : 0.0);
      out.values(Eigen::Index(t), Eigen::Index(c)) = value_scale[c] * normal(rng);
    }
  // Sink: its key adds the shared direction so that q . k0 / sqrt(d) = sink_logit.
  const double query_norm = s.query_scale * std::sqrt(double(d));
  out.keys_pre.row(0) += double(s.sink_logit) * std::sqrt(double(d)) / (0.8 * query_norm) * direction.transpose();
  out.values.row(0) *= s.sink_value_scale;

  std::vector<float> row(d);
  auto rotated = [&](const Eigen::VectorXd& v, std::size_t position) {
    for (std::size_t c = 0; c < d; ++c) row[c] = float(v(Eigen::Index(c)));
    rope.rotate(row.data(), position);
    Eigen::RowVectorXd r(static_cast<Eigen::Index>(d));
    for (std::size_t c = 0; c < d; ++c) r(Eigen::Index(c)) = row[c];
    return r;
  };
  for (std::size_t t = 0; t < T; ++t)
    out.keys.row(Eigen::Index(t)) = rotated(out.keys_pre.row(Eigen::Index(t)).transpose(), t);
  for (std::size_t h = 0; h < s.query_heads; ++h) {
    MatrixD q(T, d);
    for (std::size_t t = 0; t < T; ++t) {
      Eigen::VectorXd v(static_cast<Eigen::Index>(d));
      for (std::size_t c = 0; c < d; ++c) v(Eigen::Index(c)) = normal(rng);
      v = 0.6 * v.normalized() + 0.8 * direction;  // unit norm; 0.8 along the shared direction
      q.row(Eigen::Index(t)) = rotated(v * query_norm, t);
    }
    out.queries.push_back(std::move(q));
  }
  return out;
}

/// Quantize the synthetic tensors with `config` (as a cache would store them after all tokens
/// arrived) and measure the error at the attention output.
inline AttentionErrors synthetic_errors(const SyntheticSpec& s, const CacheConfig& config) {
  const CacheShape shape{1, 1, s.head_dim, s.tokens};
  BasicKVCache cache(shape, config);
  const SyntheticData data = make_synthetic(s, cache.rope());
  const MatrixD& stored_keys = config.key_rope == KeyRope::pre ? data.keys_pre : data.keys;
  std::vector<float> k(s.tokens * s.head_dim), v(k.size());
  for (std::size_t t = 0; t < s.tokens; ++t)
    for (std::size_t c = 0; c < s.head_dim; ++c) {
      k[t * s.head_dim + c] = float(stored_keys(Eigen::Index(t), Eigen::Index(c)));
      v[t * s.head_dim + c] = float(data.values(Eigen::Index(t), Eigen::Index(c)));
    }
  cache.append(0, 0, k, v);
  AttentionErrorAccumulator acc;
  add_head_errors(acc, cache, 0, 0, data.keys, data.values, data.queries, 0);
  return acc.errors();
}

}  // namespace kvq::eval
