#pragma once
// The model's KV backends over a kvq::KVPool: one sequence (decode steps, prompt chunks), and
// many sequences decoding together (Model::forward_batch), whose attention reads what they
// share once. The pool stores pre-RoPE keys, so the model hands them over as they are and
// attention rotates them.

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvq/kvq.hpp"
#include "llama/model.hpp"

namespace kvq::llama {

/// A pool shape for `model`'s layers and heads, its context and RoPE, blocks of the
/// configuration's unit, and `blocks` blocks of memory.
inline PoolShape pool_shape(const Model& model, const CacheConfig& config, std::size_t blocks) {
  const LlamaConfig& m = model.config();
  const RopeConfig rope = model.rope_config();
  PoolShape shape;
  shape.layers = m.layers;
  shape.kv_heads = m.kv_heads;
  shape.head_dim = m.head_dim;
  shape.max_tokens = m.context_length;
  shape.block_tokens = block_unit(config);
  shape.memory_blocks = blocks;
  shape.rope_style = rope.style;
  shape.rope_theta = rope.theta;
  shape.rope_dims = rope.rotary_dims;
  shape.rope_scaling = rope.scaling;
  return shape;
}

/// One sequence of a pool.
class PoolBackend {
 public:
  PoolBackend(KVPool& pool, SequenceId id) : pool_(pool), id_(id) {}
  void append(std::size_t layer, std::size_t position, std::span<const float> k, std::span<const float> v) {
    pool_.append(id_, layer, position, k, v);
  }
  void attend(std::size_t layer, std::size_t position, std::span<const float> q, std::span<float> out) {
    decode_attention(pool_.sequence(id_), layer, position, q, out);
  }
  /// A chunk of new positions: the stored prefix and, causally and exactly, the chunk's own
  /// keys and values, which the model appends afterwards.
  void attend_chunk(std::size_t layer, std::size_t first_position, std::size_t tokens, std::span<const float> q,
                    std::span<const float> k, std::span<const float> v, std::span<float> out) {
    kvq::attend(AttentionRequest{.cache = &pool_.sequence(id_),
                                 .layer = layer,
                                 .first_position = first_position,
                                 .tokens = tokens,
                                 .queries = q,
                                 .new_keys = k,
                                 .new_values = v,
                                 .out = out});
  }

 private:
  KVPool& pool_;
  SequenceId id_;
};
static_assert(ChunkedKVBackend<PoolBackend>);

/// Sequences ids[0], ids[1], ... (each once) of a pool as the rows of Model::forward_batch: each
/// layer's attention is one pool decode step (pool/pool_attention.hpp), so forks of one prompt
/// read its blocks once. `last` holds what the last step read once.
class PoolBatchBackend {
 public:
  PoolBatchBackend(KVPool& pool, std::vector<SequenceId> ids) : pool_(pool), ids_(std::move(ids)) {
    if (ids_.empty()) throw Error(ErrorCode::invalid_argument, "a batch of no sequences");
  }
  /// Row b to sequence ids[b]. A failing append leaves the rows before it appended: the engine
  /// rolls their sequences back (KVPool::truncate) to go on.
  void append_batch(std::size_t layer, std::span<const std::size_t> positions, std::span<const float> k,
                    std::span<const float> v) {
    if (positions.size() != ids_.size() || k.size() != v.size() || k.size() % ids_.size() != 0)
      throw Error(ErrorCode::shape_mismatch, "a batch of " + std::to_string(positions.size()) + " rows, " +
                                                 std::to_string(k.size()) + " key and " + std::to_string(v.size()) +
                                                 " value floats for " + std::to_string(ids_.size()) + " sequences");
    const std::size_t row = k.size() / ids_.size();
    for (std::size_t b = 0; b < ids_.size(); ++b)
      pool_.append(ids_[b], layer, positions[b], k.subspan(b * row, row), v.subspan(b * row, row));
  }
  void attend_batch(std::size_t layer, std::span<const std::size_t> positions, std::span<const float> q,
                    std::span<float> out) {
    last = decode_attention(pool_, ids_, layer, positions, q, out);
  }
  PoolDecodeSummary last;

 private:
  KVPool& pool_;
  std::vector<SequenceId> ids_;
};
static_assert(BatchKVBackend<PoolBatchBackend>);

}  // namespace kvq::llama
