#pragma once
// Reference KV backend: fp32 keys and values, attention computed as llama2.c does it (float,
// sequential sums), so greedy decoding reproduces the reference tokens. It is the baseline that
// quantized caches are measured against.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <span>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kvq/error.hpp"
#include "kvq/rope/rope.hpp"
#include "llama/model.hpp"

namespace kvq::llama {

/// What a cache does to each row it stores, for simulating another engine's cache format: the
/// post-RoPE key and the value of one position (kv_heads * head_dim each), edited in place.
using StoredRowFilter = std::function<void(std::span<float> rotated_key, std::span<float> value)>;

class FullPrecisionBackend {
 public:
  /// `max_positions` bounds the sequence. It is the caller's to choose, never llama.context_length:
  /// no tensor backs that number, and a corrupt 2^24 would size gigabytes of RoPE table.
  /// `filter`, if any, is applied to every row attention reads (keys() and values() stay as appended).
  /// With `filter_delay` > 0, rows stay exact until that many are unfiltered; the next append
  /// filters them all at once (Hugging Face's quantized cache flushes its residual rows so).
  FullPrecisionBackend(const Model& model, std::size_t max_positions, StoredRowFilter filter = {},
                       std::size_t filter_delay = 0)
      : FullPrecisionBackend(model.config().layers, model.config().heads, model.config().kv_heads, model.rope_config(),
                             max_positions, std::move(filter), filter_delay) {}

  FullPrecisionBackend(std::size_t layers, std::size_t heads, std::size_t kv_heads, const RopeConfig& rope,
                       std::size_t max_positions, StoredRowFilter filter = {}, std::size_t filter_delay = 0)
      : heads_(heads),
        kv_heads_(kv_heads),
        head_dim_(rope.head_dim),
        rope_(rope, max_positions),
        layers_(layers),
        filter_(std::move(filter)),
        filter_delay_(filter_delay) {
    if (layers == 0 || heads == 0 || kv_heads == 0 || heads % kv_heads != 0)
      throw Error(ErrorCode::invalid_argument,
                  "backend needs layers > 0 and heads a positive multiple of kv_heads (got " + std::to_string(heads) +
                      " and " + std::to_string(kv_heads) + ")");
  }

  void append(std::size_t layer, std::size_t position, std::span<const float> k, std::span<const float> v) {
    Layer& L = layer_at(layer);
    const std::size_t kv_dim = kv_heads_ * head_dim_;
    if (k.size() != kv_dim || v.size() != kv_dim)
      throw Error(ErrorCode::shape_mismatch, "layer " + std::to_string(layer) + ": k/v have " +
                                                 std::to_string(k.size()) + "/" + std::to_string(v.size()) +
                                                 " values, expected " + std::to_string(kv_dim));
    if (position != L.length)
      throw Error(ErrorCode::out_of_order, "layer " + std::to_string(layer) + ": append at position " +
                                               std::to_string(position) + ", expected " + std::to_string(L.length));
    if (position >= rope_.max_positions())
      throw Error(ErrorCode::capacity_exceeded, "layer " + std::to_string(layer) + ": position " +
                                                    std::to_string(position) + " is beyond the capacity of " +
                                                    std::to_string(rope_.max_positions()));
    rotated_.assign(k.begin(), k.end());  // rotated and filtered first: a throwing filter stores nothing
    rope_.rotate_heads(rotated_, position);
    stored_.assign(v.begin(), v.end());
    if (filter_ && filter_delay_ == 0) filter_(rotated_, stored_);
    if (filter_ && filter_delay_ > 0 && L.length - L.filtered >= filter_delay_) {
      for (std::size_t row = L.filtered; row < L.length; ++row)
        filter_(std::span<float>(L.rotated_keys).subspan(row * kv_dim, kv_dim),
                std::span<float>(L.stored_values).subspan(row * kv_dim, kv_dim));
      L.filtered = L.length;
    }
    L.keys.insert(L.keys.end(), k.begin(), k.end());
    L.rotated_keys.insert(L.rotated_keys.end(), rotated_.begin(), rotated_.end());
    L.values.insert(L.values.end(), v.begin(), v.end());
    if (filter_) L.stored_values.insert(L.stored_values.end(), stored_.begin(), stored_.end());
    ++L.length;
  }

  void attend(std::size_t layer, std::size_t position, std::span<const float> q, std::span<float> out) {
    const Layer& L = layer_at(layer);
    const std::size_t q_dim = heads_ * head_dim_;
    if (q.size() != q_dim || out.size() != q_dim)
      throw Error(ErrorCode::shape_mismatch, "layer " + std::to_string(layer) + ": q/out have " +
                                                 std::to_string(q.size()) + "/" + std::to_string(out.size()) +
                                                 " values, expected " + std::to_string(q_dim));
    if (position >= L.length)
      throw Error(ErrorCode::out_of_order, "layer " + std::to_string(layer) + ": attend at position " +
                                               std::to_string(position) + " but only " + std::to_string(L.length) +
                                               " positions are stored");
    query_.assign(q.begin(), q.end());
    rope_.rotate_heads(query_, position);
    const float* values = (filter_ ? L.stored_values : L.values).data();
    attend_rows(query_.data(), position + 1, L.rotated_keys.data(), values, position + 1, nullptr, nullptr, out.data());
  }

  /// A prompt chunk (see llama::ChunkedKVBackend): positions p0 .. p0 + T - 1, not stored yet,
  /// attend to the stored rows (through the filter, when there is one) and to the chunk's own rows
  /// 0 .. t as given: the chunk is what the engine holds in full precision before it stores it.
  void attend_chunk(std::size_t layer, std::size_t first_position, std::size_t tokens, std::span<const float> q,
                    std::span<const float> k, std::span<const float> v, std::span<float> out) {
    const Layer& L = layer_at(layer);
    const std::size_t q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
    if (tokens == 0 || q.size() != tokens * q_dim || out.size() != q.size() || k.size() != tokens * kv_dim ||
        v.size() != k.size())
      throw Error(ErrorCode::shape_mismatch,
                  "layer " + std::to_string(layer) + ": a chunk of " + std::to_string(tokens) +
                      " tokens needs q/out of " + std::to_string(tokens * q_dim) + " and k/v of " +
                      std::to_string(tokens * kv_dim) + " values, got " + std::to_string(q.size()) + "/" +
                      std::to_string(out.size()) + " and " + std::to_string(k.size()) + "/" + std::to_string(v.size()));
    if (first_position != L.length)
      throw Error(ErrorCode::out_of_order, "layer " + std::to_string(layer) + ": a chunk at position " +
                                               std::to_string(first_position) + ", expected " +
                                               std::to_string(L.length));
    if (tokens > rope_.max_positions() - first_position)
      throw Error(ErrorCode::capacity_exceeded, "layer " + std::to_string(layer) + ": a chunk of " +
                                                    std::to_string(tokens) + " tokens at position " +
                                                    std::to_string(first_position) + " is beyond the capacity of " +
                                                    std::to_string(rope_.max_positions()));
    chunk_keys_.assign(k.begin(), k.end());
    for (std::size_t t = 0; t < tokens; ++t)
      rope_.rotate_heads(std::span<float>(chunk_keys_).subspan(t * kv_dim, kv_dim), first_position + t);
    const float* values = (filter_ ? L.stored_values : L.values).data();
    for (std::size_t t = 0; t < tokens; ++t) {
      query_.assign(q.begin() + static_cast<std::ptrdiff_t>(t * q_dim),
                    q.begin() + static_cast<std::ptrdiff_t>((t + 1) * q_dim));
      rope_.rotate_heads(query_, first_position + t);
      attend_rows(query_.data(), first_position + t + 1, L.rotated_keys.data(), values, first_position,
                  chunk_keys_.data(), v.data(), out.data() + t * q_dim);
    }
  }

  /// Forget every position (start a new sequence).
  void clear() {
    for (Layer& L : layers_) L = Layer{};
  }

  std::size_t length(std::size_t layer) const { return layer_at(layer).length; }

  /// Rows of a layer that a delayed filter has not reached yet (0 without a delay).
  std::size_t unfiltered(std::size_t layer) const {
    const Layer& L = layer_at(layer);
    return filter_delay_ > 0 ? L.length - L.filtered : 0;
  }

  /// Stored pre-RoPE keys / values of a layer: (length, kv_heads * head_dim) row-major.
  std::span<const float> keys(std::size_t layer) const { return layer_at(layer).keys; }
  std::span<const float> values(std::size_t layer) const { return layer_at(layer).values; }

  const RopeTable& rope() const noexcept { return rope_; }

 private:
  struct Layer {
    std::vector<float> keys, rotated_keys, values;  // rotated copy so attention never re-rotates
    std::vector<float> stored_values;               // values through the filter, when there is one
    std::size_t length = 0;
    std::size_t filtered = 0;  // rows 0 .. filtered - 1 went through a delayed filter
  };

  // All heads of one rotated query over `visible` positions: the first `stored` rows from the
  // stored keys and values, the rest from the chunk's (kv_heads * head_dim rows each).
  void attend_rows(const float* query, std::size_t visible, const float* keys, const float* values, std::size_t stored,
                   const float* chunk_keys, const float* chunk_values, float* out) {
    const std::size_t kv_dim = kv_heads_ * head_dim_, group = heads_ / kv_heads_;
    const auto key = [&](std::size_t t) { return t < stored ? keys + t * kv_dim : chunk_keys + (t - stored) * kv_dim; };
    const auto value = [&](std::size_t t) {
      return t < stored ? values + t * kv_dim : chunk_values + (t - stored) * kv_dim;
    };
    scores_.resize(visible);
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
    for (std::size_t h = 0; h < heads_; ++h) {
      const float* qh = query + h * head_dim_;
      const std::size_t kv_offset = (h / group) * head_dim_;
      float max_score = -std::numeric_limits<float>::infinity();
      for (std::size_t t = 0; t < visible; ++t) {
        const float* kt = key(t) + kv_offset;
        float dot = 0.0f;
        for (std::size_t i = 0; i < head_dim_; ++i) dot += qh[i] * kt[i];
        scores_[t] = dot * scale;
        max_score = std::max(max_score, scores_[t]);
      }
      float sum = 0.0f;
      for (std::size_t t = 0; t < visible; ++t) sum += (scores_[t] = std::exp(scores_[t] - max_score));
      float* oh = out + h * head_dim_;
      std::fill(oh, oh + head_dim_, 0.0f);
      for (std::size_t t = 0; t < visible; ++t) {
        const float a = scores_[t] / sum;
        const float* vt = value(t) + kv_offset;
        for (std::size_t i = 0; i < head_dim_; ++i) oh[i] += a * vt[i];
      }
    }
  }

  Layer& layer_at(std::size_t layer) { return const_cast<Layer&>(std::as_const(*this).layer_at(layer)); }
  const Layer& layer_at(std::size_t layer) const {
    if (layer >= layers_.size())
      throw Error(ErrorCode::invalid_argument,
                  "layer " + std::to_string(layer) + " is beyond the " + std::to_string(layers_.size()) + " layers");
    return layers_[layer];
  }

  std::size_t heads_, kv_heads_, head_dim_;
  RopeTable rope_;
  std::vector<Layer> layers_;
  StoredRowFilter filter_;
  std::size_t filter_delay_ = 0;
  std::vector<float> query_, scores_, rotated_, stored_, chunk_keys_;
};

static_assert(ChunkedKVBackend<FullPrecisionBackend>);

}  // namespace kvq::llama
