#pragma once
// A decode step of many sequences of one KVPool in one call, reading what they share once.
// Sequences forked from one prompt (parallel sampling, beams, a system prompt that
// share_prefixes found) refer to the same first block. Such a group reads the positions all its
// sequences store alike (KVPool::common_prefix) in one stored_only request for all its queries,
// each sequence its own positions in a request of its own, and the two parts merge by their
// log-sum-exps (cascade attention, merge.hpp). Every request of the step goes to one attend
// call (two with sink logits and a group), so an executor spreads many sequences' work as it
// spreads one sequence's.

#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvq/attention/attend.hpp"
#include "kvq/attention/merge.hpp"
#include "kvq/cache/serialize.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/core/scratch.hpp"
#include "kvq/error.hpp"
#include "kvq/pool/kv_pool.hpp"

namespace kvq::inline v0 {

/// What a pool decode step shared: the groups that read a prefix once, the entries of `ids` in
/// them (a sequence named twice counts twice), and the prefixes' ends (seen_end), summed over the
/// groups (with a window or attention chunks the queries read fewer of those positions).
struct PoolDecodeSummary {
  std::size_t groups = 0, sequences = 0, shared_positions = 0;
};

namespace detail {

/// A pool decode step's scratch, kept per thread between calls (core/scratch.hpp).
struct PoolStepScratch {
  /// Sequences members[members_begin, members_end) read positions [0, seen_end) once, from the
  /// cache of ids[lead].
  struct Group {
    std::size_t members_begin, members_end, seen_end, lead;
  };
  std::vector<std::pair<BlockId, std::size_t>> first_blocks;  // (first block, index in ids)
  std::vector<Group> groups;
  std::vector<std::size_t> members, positions;  // the groups' indices and positions
  std::vector<SequenceId> group_ids;
  std::vector<AttentionRequest> requests;
  std::vector<float> lse, queries, shared_out, shared_lse;
};

inline void trim_scratch(PoolStepScratch& s) noexcept {
  kvq::trim_scratch(s.first_blocks);
  kvq::trim_scratch(s.groups);
  kvq::trim_scratch(s.members);
  kvq::trim_scratch(s.positions);
  kvq::trim_scratch(s.group_ids);
  kvq::trim_scratch(s.requests);
  kvq::trim_scratch(s.lse);
  kvq::trim_scratch(s.queries);
  kvq::trim_scratch(s.shared_out);
  kvq::trim_scratch(s.shared_lse);
}

/// decode_attention over a pool, its memory errors not translated yet.
inline PoolDecodeSummary pool_decode_step(const KVPool& pool, std::span<const SequenceId> ids, std::size_t layer,
                                          std::span<const std::size_t> positions, std::span<const float> queries,
                                          std::span<float> out, const DecodeOptions& options) {
  const std::size_t n = ids.size(), dim = pool.shape().head_dim;
  if (positions.size() != n)
    throw Error(ErrorCode::shape_mismatch, "decode_attention: " + std::to_string(positions.size()) + " positions for " +
                                               std::to_string(n) + " sequences");
  if (queries.size() != out.size() ||
      (n == 0 ? !queries.empty() : queries.size() % n != 0 || queries.size() / n % dim != 0))
    throw Error(ErrorCode::shape_mismatch, "decode_attention: queries of " + std::to_string(queries.size()) +
                                               " floats and outputs of " + std::to_string(out.size()) + " are not " +
                                               std::to_string(n) + " sequences x heads x " + std::to_string(dim));
  const std::size_t min_shared_end = saturating_add(pool.config(layer).sinks, pool.shape().block_tokens);
  if (n == 0) return {};
  const std::size_t row = queries.size() / n, heads = row / dim;
  OwnScratch<PoolStepScratch> scratch;
  PoolStepScratch& s = scratch.get();

  // Each sequence's own request first, so that attend's errors name request i for ids[i].
  s.requests.clear();
  s.first_blocks.clear();
  for (std::size_t i = 0; i < n; ++i) {
    const KVPool::LayerView view = pool.layer(ids[i], layer);
    s.requests.push_back({.cache = &view.cache,
                          .layer = view.layer,
                          .first_position = positions[i],
                          .queries = queries.subspan(i * row, row),
                          .out = out.subspan(i * row, row)});
    const std::vector<BlockId>& table = CacheAccess::table(view.cache, view.layer);
    if (!table.empty()) s.first_blocks.push_back({table.front(), i});
  }
  std::sort(s.first_blocks.begin(), s.first_blocks.end());

  // The groups worth a shared part: at least a block beyond the sinks. Their shared request reads
  // the cache whose key peak is smallest, so that attend's check of scores against it refuses no
  // query its own sequence's check lets through.
  s.groups.clear();
  s.members.clear();
  for (std::size_t a = 0, b = 0; a < s.first_blocks.size(); a = b) {
    while (b < s.first_blocks.size() && s.first_blocks[b].first == s.first_blocks[a].first) ++b;
    if (b - a < 2) continue;
    s.group_ids.clear();
    std::size_t seen_end = std::numeric_limits<std::size_t>::max(), lead = s.first_blocks[a].second;
    for (std::size_t k = a; k < b; ++k) {
      const std::size_t i = s.first_blocks[k].second;
      s.group_ids.push_back(ids[i]);
      seen_end = std::min(seen_end, positions[i]);
      const AttentionRequest &candidate = s.requests[i], &best = s.requests[lead];
      if (candidate.cache->key_peak(candidate.layer) < best.cache->key_peak(best.layer)) lead = i;
    }
    seen_end = std::min(seen_end, pool.common_prefix(s.group_ids, layer));
    if (seen_end < min_shared_end) continue;
    s.groups.push_back({s.members.size(), s.members.size() + (b - a), seen_end, lead});
    for (std::size_t k = a; k < b; ++k) s.members.push_back(s.first_blocks[k].second);
  }

  // Each group's queries in one stored_only request; its sequences' own requests from seen_end.
  const std::size_t grouped = s.members.size();
  s.lse.assign(n * heads, 0.0f);
  s.queries.resize(grouped * row);
  s.shared_out.resize(grouped * row);
  s.shared_lse.resize(grouped * heads);
  s.positions.resize(grouped);
  PoolDecodeSummary summary;
  for (const PoolStepScratch::Group& g : s.groups) {
    for (std::size_t m = g.members_begin; m < g.members_end; ++m) {
      const std::size_t i = s.members[m];
      std::copy_n(queries.begin() + std::ptrdiff_t(i * row), row, s.queries.begin() + std::ptrdiff_t(m * row));
      s.positions[m] = positions[i];
      s.requests[i].lse = std::span(s.lse).subspan(i * heads, heads);
      s.requests[i].seen_begin = g.seen_end;
    }
    const std::size_t count = g.members_end - g.members_begin;
    const auto group_positions = std::span<const std::size_t>(s.positions).subspan(g.members_begin, count);
    s.requests.push_back({.cache = s.requests[g.lead].cache,
                          .layer = s.requests[g.lead].layer,
                          .first_position = *std::min_element(group_positions.begin(), group_positions.end()),
                          .tokens = count,
                          .queries = std::span<const float>(s.queries).subspan(g.members_begin * row, count * row),
                          .out = std::span(s.shared_out).subspan(g.members_begin * row, count * row),
                          .lse = std::span(s.shared_lse).subspan(g.members_begin * heads, count * heads),
                          .stored_only = true,
                          .positions = group_positions,
                          .seen_end = g.seen_end});
    ++summary.groups;
    summary.sequences += count;
    summary.shared_positions += g.seen_end;
  }

  const std::span<const AttentionRequest> own = std::span<const AttentionRequest>(s.requests).first(n);
  if (options.scores.sink_logits.empty() || s.groups.empty()) {
    attend(s.requests, options);
  } else {  // the own parts checked, the shared parts run: a failing call leaves `out` as it was
    check_requests(own, options);
    DecodeOptions without_sinks = options;
    without_sinks.scores.sink_logits = {};
    attend(std::span<const AttentionRequest>(s.requests).subspan(n), without_sinks);
    attend(own, options);
  }
  for (std::size_t m = 0; m < grouped; ++m) {
    const std::size_t i = s.members[m];
    merge_attention(out.subspan(i * row, row), std::span(s.lse).subspan(i * heads, heads),
                    std::span<const float>(s.shared_out).subspan(m * row, row),
                    std::span<const float>(s.shared_lse).subspan(m * heads, heads));
  }
  return summary;
}

}  // namespace detail

/// One decode step of layer `layer` of the sequences `ids`: query i, (heads, head_dim) at
/// `queries` row i (following the pool's key_rope, as decode_attention takes it), attends the
/// positions 0 .. positions[i] of sequence ids[i] into `out` row i. As decode_attention on each
/// sequence: bit for bit where a sequence reads nothing shared, else within 1e-5 relative in the
/// exact tier and within the integer tier's bound in that one (with a window, the positions only
/// some of a group's queries see run exact), in one attend call (two with sink logits and a group).
///
/// A group of sequences with the same first block reads the positions they all store alike once,
/// when that is at least a block beyond the sinks: up to their common prefix, and no further than
/// the smallest of their positions. Sequences may come in any order, one named twice attends
/// twice; sink logits (ScoreOptions::sink_logits) go to each sequence's own part, in an attend
/// call of their own after the shared parts. Throws kvq::Error before `out` is written: an unknown
/// sequence or layer, spans of other sizes, refused memory (out_of_memory), and every error attend
/// finds (its messages name request i for ids[i]).
inline PoolDecodeSummary decode_attention(const KVPool& pool, std::span<const SequenceId> ids, std::size_t layer,
                                          std::span<const std::size_t> positions, std::span<const float> queries,
                                          std::span<float> out, const DecodeOptions& options = {}) {
  return with_memory_errors(
      "decode_attention", [&] { return detail::pool_decode_step(pool, ids, layer, positions, queries, out, options); });
}

}  // namespace kvq::inline v0
