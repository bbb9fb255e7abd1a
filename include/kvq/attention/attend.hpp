#pragma once
// Attention for engines: many requests in one call, each a block of T query positions of one
// sequence and layer: a prefill chunk (with its T new keys and values, not stored yet, attended
// exactly and causally), T speculative tokens to verify, or one decode step; or, over stored
// positions only, the queries of many sequences over a prefix they share (cascade attention).
//
//   request r: queries (T, heads, d) at positions p0 .. p0 + T - 1
//     stored prefix [S, P): seen by every query of the request, read once by the kernels for all
//       T x GQA query rows of a KV head (P = p0 with new tokens, p0 + 1 without; S = 0, or with a
//       sliding window the first position the last (a tree's deepest) query sees)
//     exact part: query t also sees new tokens 0 .. t (full precision) or stored positions
//       p0 + 1 .. p0 + t, and with a window the stored positions before S inside its own window
//   a draft tree (AttentionRequest::parents): query t sits at p0 + depth(t) and its exact part
//     holds the new tokens on its path from a root, not every new token before it
//   stored positions only (AttentionRequest::stored_only, a part of attention merged by its
//     log-sum-exp): P = the stored length (or seen_end where less) <= p0, no exact tail; with
//     `positions` query t sits at positions[t], so queries of many sequences read a prefix they
//     share once
//   a range of positions (AttentionRequest::seen_begin, seen_end): the queries see no key outside
//     it; S and P are clipped to it, and so is each query's exact part
//   a request that crosses an attention chunk boundary (ScoreOptions::attention_chunk) runs as
//   one request per chunk: no query sees across the boundary, so S stays each part's own start
//   (a draft tree or a request with positions runs whole: the stored positions of the chunk
//   before the boundary then run in each query's exact part, scalar, where the kernels would
//   read them once)
//   work items (request, KV head, rows batch, context chunk) run on the executor; the parts
//   merge in a fixed order, so results are bit-identical for every thread count.
//
// Prefill through append quantizes the prompt before the prompt attends to it; here a chunk's
// queries see its own keys and values exactly, as KIVI and engines do, and the engine appends
// them afterwards for later queries. A request of one position without new tokens (not
// stored_only, its range of positions not cut) is exactly decode_attention.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kvq/attention/decode.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/checked.hpp"
#include "kvq/core/scratch.hpp"
#include "kvq/error.hpp"

namespace kvq::inline v0 {

struct AttentionRequest {
  const BasicKVCache* cache = nullptr;
  std::size_t layer = 0;
  std::size_t first_position = 0;    // p0: the first query's position (with `positions`, the smallest)
  std::size_t tokens = 1;            // T: query positions p0 .. p0 + T - 1 (a draft tree, `positions`: below)
  std::span<const float> queries{};  // (T, heads, head_dim), following the cache's key_rope
  /// Empty, or (T, kv_heads, head_dim) each: the keys (pre-RoPE when the cache stores them so)
  /// and values of the query positions, attended exactly; the cache's stored positions from p0
  /// on are then not read.
  std::span<const float> new_keys{}, new_values{};
  std::span<float> out{};  // (T, heads, head_dim)
  /// Empty: the new tokens form a chain, each after those before it. Otherwise a draft tree, as
  /// speculative decoding with Medusa, EAGLE or SpecInfer drafts verifies in one pass: for each
  /// new token the index of its parent among the new tokens (smaller than its own), or -1 for a
  /// token that follows the stored prefix. Token t sits at position p0 + depth(t) (a root at p0)
  /// and sees the stored positions before p0 and the tokens on its path from a root, itself
  /// included (post-RoPE queries and keys arrive rotated to those positions). Needs new keys and
  /// values and room in the capacity for the deepest token; the engine appends the path it
  /// accepts afterwards.
  std::span<const std::int32_t> parents{};
  /// Empty, or (T, heads): each query row's log-sum-exp, log(sum_j exp(logit_j)) over the
  /// positions it saw (and its sink logit, ScoreOptions::sink_logits), natural log, the logits
  /// as scores.hpp defines them. With it an engine merges this output with attention over other
  /// keys (a prefix shared in another cache, tokens it holds itself): merge_attention (merge.hpp).
  std::span<float> lse{};
  /// The queries see stored positions only: one part of attention whose other positions the
  /// engine attends elsewhere and merges by lse, as cascade attention keeps a prefix shared by
  /// many sequences in one cache and each sequence's own tokens in another. p0 is then at or after
  /// the stored length, or seen_end where that is less (the queries' positions within the
  /// capacity, where RoPE rotates them), query t sees the stored positions its window and
  /// attention chunk let it see, and there are no new keys or values. A query that sees none
  /// writes zeros and lse -inf (merge_attention's empty row), or its sink logit where
  /// ScoreOptions::sink_logits are given.
  bool stored_only = false;
  /// With stored_only: empty (query t at p0 + t), or each query's own position, in any order, p0
  /// the smallest: the queries of many sequences over a prefix they share in one cache, which the
  /// kernels then read once for all of them (cascade attention's batch). With a window or
  /// attention chunks the kernels read only what every query sees and the rest runs scalar per
  /// query: group sequences whose windows reach the same part of the prefix.
  std::span<const std::size_t> positions{};
  /// The queries see only key positions in [seen_begin, seen_end) (not reversed), and of those
  /// what causality, the window and attention chunks allow. With lse and merge_attention an
  /// engine splits a sequence's attention by positions, as cascade attention over sequences that
  /// share blocks does (KVPool::common_prefix: one stored_only request with seen_end for the
  /// prefix they share, then one request each with seen_begin for their own positions). A query
  /// that sees nothing writes zeros and lse -inf, or its sink logit: every part adds the sink
  /// logits, so give them to one part only.
  std::size_t seen_begin = 0;
  std::size_t seen_end = std::numeric_limits<std::size_t>::max();
};

namespace detail {

/// One request, checked and laid out for the kernels.
struct RequestPlan {
  const AttentionRequest* request = nullptr;
  std::size_t tokens = 0, heads = 0, group = 0, rows = 0, batches = 0, chunk = 0;
  std::size_t batch_rows = 0;               // rows of the largest batch: min(rows, max_group)
  std::size_t shared = 0, prefix = 0;       // [shared, prefix): stored positions every query sees
  std::size_t tail_begin = 0;               // the exact tail's rows sit at tail_begin + offset(t)
  std::size_t ragged = 0;                   // [ragged, shared): stored positions some queries see
  std::size_t first_chunk = 0, chunks = 0;  // the chunks (ChunkGrid) covering [shared, prefix)
  const kernels::attention::KernelEntry* kernel = nullptr;
  std::size_t query_offset = 0, partial_offset = 0;  // into the workspace
  std::vector<std::size_t> offsets;                  // query_offsets: a draft tree's depths, or positions less p0

  /// Query t's position less p0.
  std::size_t offset(std::size_t t) const noexcept { return offsets.empty() ? t : offsets[t]; }
};

/// Each token's depth in a checked draft tree (check_request): a root's is 0.
inline std::vector<std::size_t> tree_depths(std::span<const std::int32_t> parents) {
  std::vector<std::size_t> depth(parents.size());
  for (std::size_t t = 0; t < parents.size(); ++t) depth[t] = parents[t] < 0 ? 0 : depth[std::size_t(parents[t])] + 1;
  return depth;
}

/// Each query's position less p0 where the request gives them otherwise than p0 + t (a draft
/// tree's depths, AttentionRequest::positions), else empty. The request is checked first.
inline std::vector<std::size_t> query_offsets(const AttentionRequest& r) {
  if (!r.parents.empty()) return tree_depths(r.parents);
  std::vector<std::size_t> offsets(r.positions.size());
  for (std::size_t t = 0; t < offsets.size(); ++t) offsets[t] = r.positions[t] - r.first_position;
  return offsets;
}

inline void check_request(const AttentionRequest& r, std::size_t index) {
  const std::string which = "attention request " + std::to_string(index) + ": ";
  if (r.cache == nullptr) throw Error(ErrorCode::invalid_argument, which + "no cache");
  const CacheShape& s = r.cache->shape();
  const bool fresh = !r.new_keys.empty() || !r.new_values.empty();
  const std::size_t per_token = s.kv_heads * s.head_dim;
  if (r.tokens == 0) throw Error(ErrorCode::invalid_argument, which + "zero query tokens");
  if (fresh && (r.new_keys.size() != r.new_values.size() || r.new_keys.size() / per_token != r.tokens ||
                r.new_keys.size() % per_token != 0))
    throw Error(ErrorCode::shape_mismatch,
                which + "new keys of " + std::to_string(r.new_keys.size()) + " and values of " +
                    std::to_string(r.new_values.size()) + " floats are not " + std::to_string(r.tokens) + " tokens x " +
                    std::to_string(s.kv_heads) + " KV heads x " + std::to_string(s.head_dim));
  if (r.stored_only && fresh)
    throw Error(ErrorCode::invalid_argument, which + "a request of stored positions only takes no new keys or values");
  if (r.seen_begin > r.seen_end)
    throw Error(ErrorCode::invalid_argument, which + "seen_begin " + std::to_string(r.seen_begin) +
                                                 " is after seen_end " + std::to_string(r.seen_end));
  if (!r.positions.empty()) {
    if (!r.stored_only)
      throw Error(ErrorCode::invalid_argument, which + "query positions are for requests of stored positions only");
    if (r.positions.size() != r.tokens)
      throw Error(ErrorCode::shape_mismatch, which + std::to_string(r.positions.size()) + " positions for " +
                                                 std::to_string(r.tokens) + " query tokens");
    const auto [first, last] = std::minmax_element(r.positions.begin(), r.positions.end());
    if (*first != r.first_position)
      throw Error(ErrorCode::invalid_argument, which + "first_position " + std::to_string(r.first_position) +
                                                   " is not the smallest of the positions, " + std::to_string(*first));
    if (*last >= r.cache->capacity())
      throw Error(ErrorCode::invalid_argument, which + "query position " + std::to_string(*last) +
                                                   " is beyond the capacity of " + std::to_string(r.cache->capacity()));
  }
  if (!r.parents.empty()) {
    if (!fresh)
      throw Error(ErrorCode::invalid_argument, which + "a draft tree (parents) needs its new keys and values");
    if (r.parents.size() != r.tokens)
      throw Error(ErrorCode::shape_mismatch, which + std::to_string(r.parents.size()) + " parents for " +
                                                 std::to_string(r.tokens) + " new tokens");
    for (std::size_t t = 0; t < r.tokens; ++t)
      if (r.parents[t] < -1 || r.parents[t] >= std::int64_t(t))
        throw Error(ErrorCode::invalid_argument, which + "the parent of new token " + std::to_string(t) + " is " +
                                                     std::to_string(r.parents[t]) +
                                                     ", neither -1 (the stored prefix) nor an earlier new token");
  }
  // New rows are held to what an append of them would store (a rotated tensor rotates them here).
  for (const Tensor t : {Tensor::keys, Tensor::values}) {
    const std::span<const float> span = t == Tensor::keys ? r.new_keys : r.new_values;
    const std::size_t at = r.cache->first_unstorable(t, span);
    if (at == span.size()) continue;
    const std::string place =
        which + (t == Tensor::keys ? "new keys" : "new values") + " of token " + std::to_string(at / per_token) +
        ", KV head " + std::to_string(at % per_token / s.head_dim) + ", channel " + std::to_string(at % s.head_dim);
    if (!std::isfinite(span[at])) throw Error(ErrorCode::non_finite_input, place + " is not finite");
    throw Error(ErrorCode::unrepresentable,
                place + ": value " + std::to_string(span[at]) + ": " + r.cache->unstorable_text(t));
  }
  for (const auto& [output, name] : {std::pair{r.out, "output"}, std::pair{r.lse, "log-sum-exp"}})
    for (const auto& [span, what] :
         {std::pair{r.queries, "queries"}, std::pair{r.new_keys, "new keys"}, std::pair{r.new_values, "new values"}})
      if (overlaps(std::span<const float>(output.data(), output.size()), span))
        throw Error(ErrorCode::invalid_argument, which + "the " + name + " overlaps the " + what);
  if (overlaps(std::span<const float>(r.out.data(), r.out.size()), std::span<const float>(r.lse.data(), r.lse.size())))
    throw Error(ErrorCode::invalid_argument, which + "the output overlaps the log-sum-exp");
}

/// Throws if a request's output or log-sum-exp overlaps another request's inputs or outputs
/// (check_request has refused them over their own request's). The outputs are sorted by address
/// once, so a batch of n requests costs O(n log n) per call rather than n^2 pairs.
inline void check_requests_apart(std::span<const AttentionRequest> requests) {
  struct Output {
    const float *begin, *end;
    std::size_t request;
    const char* what;
  };
  const std::less<const float*> before;
  std::vector<Output> outs;  // every output and log-sum-exp
  for (std::size_t i = 0; i < requests.size(); ++i)
    for (const auto& [span, what] : {std::pair{requests[i].out, "output"}, std::pair{requests[i].lse, "log-sum-exp"}})
      if (!span.empty()) outs.push_back({span.data(), span.data() + span.size(), i, what});
  std::sort(outs.begin(), outs.end(), [&](const Output& a, const Output& b) { return before(a.begin, b.begin); });
  std::vector<std::size_t> reach(outs.size());  // reach[k]: the output among outs[0..k] that ends last
  for (std::size_t k = 0; k < outs.size(); ++k) {
    if (k > 0 && before(outs[k].begin, outs[reach[k - 1]].end)) {
      const Output& x = outs[k].request < outs[reach[k - 1]].request ? outs[k] : outs[reach[k - 1]];
      const Output& y = &x == &outs[k] ? outs[reach[k - 1]] : outs[k];
      throw Error(ErrorCode::invalid_argument, "attention requests " + std::to_string(x.request) + " and " +
                                                   std::to_string(y.request) + " write overlapping outputs (the " +
                                                   x.what + " and the " + y.what + ")");
    }
    reach[k] = k > 0 && !before(outs[reach[k - 1]].end, outs[k].end) ? reach[k - 1] : k;
  }
  for (std::size_t j = 0; j < requests.size(); ++j) {
    const AttentionRequest& r = requests[j];
    for (const auto& [span, what] :
         {std::pair{r.queries, "queries"}, std::pair{r.new_keys, "new keys"}, std::pair{r.new_values, "new values"}}) {
      if (span.empty()) continue;
      const float* const input_begin = span.data();
      const float* const input_end = input_begin + span.size();
      // The outputs that begin before the input ends; one of them overlaps it if the furthest does.
      const auto m = std::size_t(
          std::partition_point(outs.begin(), outs.end(), [&](const Output& o) { return before(o.begin, input_end); }) -
          outs.begin());
      if (m > 0 && before(input_begin, outs[reach[m - 1]].end))
        throw Error(ErrorCode::invalid_argument, "attention request " + std::to_string(outs[reach[m - 1]].request) +
                                                     ": the " + outs[reach[m - 1]].what + " overlaps request " +
                                                     std::to_string(j) + "'s " + what);
    }
  }
}

/// Every check attend() makes before it writes anything, with errors naming the request: each
/// request's shapes, positions and values, and outputs overlapping inputs or each other.
inline void check_requests(std::span<const AttentionRequest> requests, const DecodeOptions& options) {
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const AttentionRequest& r = requests[i];
    check_request(r, i);
    try {
      const float peak = r.new_keys.empty() ? -1.0f : largest_magnitude(r.new_keys.data(), r.new_keys.size());
      check_attention_args(*r.cache, r.layer, r.first_position, r.tokens, r.queries, r.out.size(), peak, options.scores,
                           query_offsets(r), r.stored_only, r.seen_end);
      check_sink_logits_apart(options.scores, std::span<const float>(r.out.data(), r.out.size()));
      check_sink_logits_apart(options.scores, std::span<const float>(r.lse.data(), r.lse.size()), "log-sum-exp");
      const std::size_t heads = r.queries.size() / r.tokens / r.cache->shape().head_dim;
      if (!r.lse.empty() && r.lse.size() != r.tokens * heads)
        throw Error(ErrorCode::shape_mismatch, "a log-sum-exp of " + std::to_string(r.lse.size()) + " floats is not " +
                                                   std::to_string(r.tokens) + " x " + std::to_string(heads) +
                                                   " (tokens x query heads)");
    } catch (const Error& e) {
      throw Error(e.code(), "attention request " + std::to_string(i) + ": " + e.message());
    }
  }
  check_requests_apart(requests);
}

/// The (checked) requests, each cut where its positions cross a boundary of attention chunks of
/// `chunk` positions (ScoreOptions::attention_chunk). No query sees across one, so each part is
/// planned as a request of its own, and the stored positions before a boundary stay on the kernels
/// for the queries before it, where one request would have sent them to its exact part for every
/// query.
inline std::vector<AttentionRequest> split_at_attention_chunks(std::span<const AttentionRequest> requests,
                                                               std::size_t chunk) {
  std::vector<AttentionRequest> parts;
  for (const AttentionRequest& r : requests) {
    if (!r.parents.empty() || !r.positions.empty()) {  // whole: the planner cuts per query
      parts.push_back(r);
      continue;
    }
    const std::size_t q_row = r.queries.size() / r.tokens, kv_row = r.new_keys.size() / r.tokens,
                      lse_row = r.lse.size() / r.tokens;
    for (std::size_t t = 0; t < r.tokens;) {
      const std::size_t p = r.first_position + t, n = std::min(r.tokens - t, chunk - p % chunk);
      AttentionRequest part = r;
      part.first_position = p;
      part.tokens = n;
      part.queries = r.queries.subspan(t * q_row, n * q_row);
      part.out = r.out.subspan(t * q_row, n * q_row);
      part.lse = r.lse.subspan(t * lse_row, n * lse_row);
      if (kv_row != 0) {
        part.new_keys = r.new_keys.subspan(t * kv_row, n * kv_row);
        part.new_values = r.new_values.subspan(t * kv_row, n * kv_row);
      }
      parts.push_back(part);
      t += n;
    }
  }
  return parts;
}

/// attend() without its translation of refused memory.
inline void attend_requests(std::span<const AttentionRequest> original, const DecodeOptions& options) {
  using kernels::attention::max_group;
  detail::check_requests(original, options);
  // One position without new tokens, seeing every position up to its own: decode_attention, bit for
  // bit (for the GQA groups it takes).
  if (original.size() == 1 && original[0].tokens == 1 && original[0].new_keys.empty() && !original[0].stored_only &&
      original[0].seen_begin == 0 && original[0].seen_end > original[0].first_position &&
      original[0].queries.size() / original[0].cache->shape().head_dim / original[0].cache->shape().kv_heads <=
          max_group)
    return decode_with_lse(*original[0].cache, original[0].layer, original[0].first_position, original[0].queries,
                           original[0].out, original[0].lse, options);

  std::vector<AttentionRequest> cut;  // without attention chunks the requests run as given
  if (options.scores.attention_chunk)
    cut = detail::split_at_attention_chunks(original, *options.scores.attention_chunk);
  const std::span<const AttentionRequest> requests =
      options.scores.attention_chunk ? std::span<const AttentionRequest>(cut) : original;
  std::vector<detail::RequestPlan> plans(requests.size());
  std::size_t query_floats = 0, partial_floats = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const AttentionRequest& r = requests[i];
    const BasicKVCache& cache = *r.cache;
    const std::size_t dim = cache.shape().head_dim, kv_heads = cache.shape().kv_heads;
    const bool fresh = !r.new_keys.empty();
    detail::RequestPlan& p = plans[i];
    p.request = &r;
    p.tokens = r.tokens;
    p.heads = r.queries.size() / p.tokens / dim;
    p.group = p.heads / kv_heads;
    p.rows = p.tokens * p.group;
    p.batches = (p.rows + max_group - 1) / max_group;
    p.batch_rows = std::min(p.rows, max_group);
    p.tail_begin = r.stored_only ? cache.length(r.layer) : fresh ? r.first_position : r.first_position + 1;
    p.prefix = std::min(p.tail_begin, r.seen_end);
    p.chunk = detail::chunk_positions(cache, r.layer, options.chunk_tokens);
    p.offsets = detail::query_offsets(r);
    const std::size_t last = p.offsets.empty() ? p.tokens - 1 : *std::max_element(p.offsets.begin(), p.offsets.end());
    p.shared =
        std::min(p.prefix, std::max(r.seen_begin, detail::window_start(options.scores, r.first_position + last)));
    p.ragged = std::min(p.shared, std::max(r.seen_begin, detail::window_start(options.scores, r.first_position)));
    const detail::ChunkGrid grid{cache.config().sinks, p.chunk};
    if (p.shared < p.prefix) {
      p.first_chunk = grid.index(p.shared);
      p.chunks = grid.index(p.prefix - 1) + 1 - p.first_chunk;
    }
    const RopeTable* rope = cache.config().key_rope == KeyRope::pre ? &cache.rope() : nullptr;
    p.kernel = &kernels::attention::select_kernel(cache.keys(r.layer, 0, 0), cache.values(r.layer, 0, 0), p.batch_rows,
                                                  rope, detail::key_unrotation(cache) != nullptr, options.kernel);
    p.query_offset = query_floats;
    query_floats += kv_heads * p.rows * dim;
    p.partial_offset = partial_floats;
    // Partial states at the batch's own row count: a decode step's GQA group of 4 takes 4 rows, not 64.
    partial_floats += kv_heads * p.batches * (p.chunks + 1) * p.batch_rows * (dim + 2);
  }

  // The caller's workspace (options.workspace, else this thread's), captured by reference: tasks
  // on other threads must not see their own. A 512-token chunk over 32K takes about 80 MB.
  OwnScratch<DecodeWorkspace> own(options.workspace == nullptr);
  DecodeWorkspace& ws = options.workspace != nullptr ? *options.workspace : own.get();
  std::vector<float>& own_queries = ws.queries;
  std::vector<float>& own_partial = ws.partial;
  checked_resize(own_queries, query_floats, "attend's queries");
  checked_resize(own_partial, partial_floats, "attend's partial results");
  // Queries per KV head as rows (t, g): rotated to their own positions and scaled.
  for (const detail::RequestPlan& p : plans) {
    const AttentionRequest& r = *p.request;
    const BasicKVCache& cache = *r.cache;
    const std::size_t dim = cache.shape().head_dim;
    const bool pre = cache.config().key_rope == KeyRope::pre;
    const float scale = detail::score_scale(options.scores, dim);
    for (std::size_t t = 0; t < p.tokens; ++t)
      for (std::size_t h = 0; h < p.heads; ++h) {
        const std::size_t kvh = h / p.group, row = t * p.group + h % p.group;
        float* x = own_queries.data() + p.query_offset + (kvh * p.rows + row) * dim;
        std::copy_n(r.queries.data() + (t * p.heads + h) * dim, dim, x);
        if (pre) cache.rope().rotate_query(x, r.first_position + p.offset(t));
        for (std::size_t c = 0; c < dim; ++c) x[c] *= scale;
      }
    if (const auto rotation = detail::query_rotation(cache))  // q.k = Hq.Hk; sums within |q|_1 (check_attention_args)
      rotation->forward_unchecked(
          std::span(own_queries.data() + p.query_offset, cache.shape().kv_heads * p.rows * dim));
  }

  // Work items: (request, KV head, batch) x (prefix chunks + the exact tail).
  struct Item {
    std::size_t plan, kvh, batch, part;
  };
  std::vector<Item> items;
  for (std::size_t i = 0; i < plans.size(); ++i)
    for (std::size_t kvh = 0; kvh < requests[i].cache->shape().kv_heads; ++kvh)
      for (std::size_t b = 0; b < plans[i].batches; ++b)
        for (std::size_t part = 0; part <= plans[i].chunks; ++part) items.push_back({i, kvh, b, part});

  auto run_item = [&](std::size_t index) {
    const Item& it = items[index];
    const detail::RequestPlan& p = plans[it.plan];
    const AttentionRequest& r = *p.request;
    const BasicKVCache& cache = *r.cache;
    const std::size_t dim = cache.shape().head_dim, stride = p.batch_rows * (dim + 2);
    const std::size_t row0 = it.batch * max_group, rows = std::min(max_group, p.rows - row0);
    const float* q = own_queries.data() + p.query_offset + (it.kvh * p.rows + row0) * dim;
    float* base =
        own_partial.data() + p.partial_offset + ((it.kvh * p.batches + it.batch) * (p.chunks + 1) + it.part) * stride;
    const detail::PartialState state{base, base + p.batch_rows, base + 2 * p.batch_rows};
    if (it.part < p.chunks) {  // a chunk of the shared prefix, read once for every row of the batch
      const auto [begin, end] =
          detail::ChunkGrid{cache.config().sinks, p.chunk}.range(p.first_chunk + it.part, p.shared, p.prefix);
      const RopeTable* rope = cache.config().key_rope == KeyRope::pre ? &cache.rope() : nullptr;
      detail::run_range(cache, r.layer, it.kvh, begin, end, {q, rows, rope, detail::key_unrotation(cache)}, *p.kernel,
                        options, state);
      return;
    }
    // The exact part: rows j < R are the ragged stored positions p.ragged + j, then the tail
    // (positions p.tail_begin + offset(j - R)): new tokens, or the stored positions after p0 (none
    // where the request sees stored positions only).
    const bool fresh = !r.new_keys.empty(), pre = cache.config().key_rope == KeyRope::pre;
    const std::size_t R = p.shared - p.ragged,
                      tail = r.stored_only ? 0
                             : fresh       ? p.tokens
                                           : p.tokens - 1,
                      kv_heads = cache.shape().kv_heads;
    // this task's thread: no allocation once warm (up to kept_scratch_bytes a vector)
    thread_local std::vector<float> keys, values;
    thread_local std::vector<std::size_t> visible;  // one row's exact rows, in order
    const ScratchTrim trim(keys, values, visible);
    checked_resize(keys, (R + tail) * dim, "attend's exact keys");
    checked_resize(values, (R + tail) * dim, "attend's exact values");
    // Keys in the queries' space: rotated as the cache stores them when the queries are
    // (post-RoPE), in the model's space when RoPE comes first (pre-RoPE).
    const auto key_rotation = detail::query_rotation(cache), key_unrotation = detail::key_unrotation(cache);
    const auto value_rotation = cache.rotation(Tensor::values);
    for (std::size_t j = 0; j < R + tail; ++j) {
      const std::size_t position = j < R ? p.ragged + j : p.tail_begin + p.offset(j - R);
      float* k = keys.data() + j * dim;
      float* v = values.data() + j * dim;
      if (fresh && j >= R) {
        std::copy_n(r.new_keys.data() + ((j - R) * kv_heads + it.kvh) * dim, dim, k);
        std::copy_n(r.new_values.data() + ((j - R) * kv_heads + it.kvh) * dim, dim, v);
        if (key_rotation) key_rotation->forward_unchecked(std::span(k, dim));  // within range: check_request
        if (value_rotation) value_rotation->forward_unchecked(std::span(v, dim));
      } else {
        cache.read_stored_row(Tensor::keys, r.layer, it.kvh, position, k);
        cache.read_stored_row(Tensor::values, r.layer, it.kvh, position, v);
        if (key_unrotation) key_unrotation->inverse_head(k);
      }
      if (pre) cache.rope().rotate_unscaled(k, position);  // kernels' convention: queries carry the scaling
    }
    const float softcap = detail::softcap_or_zero(options.scores);
    for (std::size_t row = 0; row < rows; ++row) {
      const std::size_t t = (row0 + row) / p.group;
      // Row t sees positions [lo, p0 + offset(t)] before seen_end: the ragged rows from lo, then
      // its tail: the tokens before it (a chain) or its path from a root (a draft tree), from lo.
      // One list serves the rows of t's GQA group.
      if (row == 0 || t != (row0 + row - 1) / p.group) {
        const std::size_t lo =
            std::max(r.seen_begin, detail::window_start(options.scores, r.first_position + p.offset(t)));
        visible.clear();
        for (std::size_t j = lo <= p.ragged ? 0 : std::min(lo - p.ragged, R); j < R; ++j) visible.push_back(j);
        if (p.offsets.empty()) {
          const std::size_t seen = std::min(r.stored_only ? 0
                                            : fresh       ? t + 1
                                                          : t,  // tail rows up to its own position
                                            r.seen_end > p.tail_begin ? r.seen_end - p.tail_begin : 0);
          for (std::size_t i = lo <= p.tail_begin ? 0 : lo - p.tail_begin; i < seen; ++i) visible.push_back(R + i);
        } else if (!r.parents.empty()) {  // (queries at `positions` have no tail)
          const std::size_t path = visible.size();
          for (std::int64_t a = std::int64_t(t); a >= 0 && r.first_position + p.offsets[std::size_t(a)] >= lo;
               a = r.parents[std::size_t(a)])
            if (r.first_position + p.offsets[std::size_t(a)] < r.seen_end) visible.push_back(R + std::size_t(a));
          std::reverse(visible.begin() + std::ptrdiff_t(path), visible.end());
        }
      }
      const float* x = q + row * dim;
      float* acc = state.acc + row * dim;
      float& m = state.max[row];
      float& sum = state.sum[row];
      m = -std::numeric_limits<float>::infinity();
      sum = 0.0f;
      std::fill(acc, acc + dim, 0.0f);
      float scores[max_tile_tokens];
      for (std::size_t a = 0; a < visible.size(); a += max_tile_tokens) {
        const std::size_t n = std::min(max_tile_tokens, visible.size() - a);
        for (std::size_t j = 0; j < n; ++j) {
          const float* k = keys.data() + visible[a + j] * dim;
          float s = 0.0f;
          for (std::size_t c = 0; c < dim; ++c) s += x[c] * k[c];
          scores[j] = s;
        }
        cap_scores(scores, n, softcap);
        kernels::attention::softmax_update(scores, n, m, sum, acc, dim);
        for (std::size_t j = 0; j < n; ++j) {
          const float* v = values.data() + visible[a + j] * dim;
          for (std::size_t c = 0; c < dim; ++c) acc[c] += scores[j] * v[c];
        }
      }
    }
  };
  if (options.executor != nullptr && items.size() > 1)
    options.executor->parallel_for(items.size(), run_item);
  else
    for (std::size_t i = 0; i < items.size(); ++i) run_item(i);

  for (const detail::RequestPlan& p : plans) {
    const AttentionRequest& r = *p.request;
    const std::size_t dim = r.cache->shape().head_dim, stride = p.batch_rows * (dim + 2);
    for (std::size_t kvh = 0; kvh < r.cache->shape().kv_heads; ++kvh)
      for (std::size_t row = 0; row < p.rows; ++row) {
        const std::size_t b = row / max_group, k = row % max_group, t = row / p.group, g = row % p.group;
        const float* parts = own_partial.data() + p.partial_offset + (kvh * p.batches + b) * (p.chunks + 1) * stride;
        detail::merge_parts(parts + k, parts + p.batch_rows + k, parts + 2 * p.batch_rows + k * dim, p.chunks + 1,
                            stride, dim, detail::sink_logit(options.scores, kvh * p.group + g),
                            r.out.data() + (t * p.heads + kvh * p.group + g) * dim,
                            r.lse.empty() ? nullptr : r.lse.data() + t * p.heads + kvh * p.group + g);
      }
    if (const auto rotation = r.cache->rotation(Tensor::values))
      rotation->inverse_unchecked(r.out);  // sum p Hv = H sum p v: within the bound v was stored under
  }
}

}  // namespace detail

/// Attention for a batch of requests (see the top of this file); every output is written only
/// after every request has been checked. Throws kvq::Error naming the request on bad shapes,
/// positions the cache does not hold, NaN/Inf queries or new tokens, outputs overlapping inputs
/// or each other, and queries whose scores would overflow float; refused memory is kvq::Error
/// (out_of_memory), workspaces and per-request lists alike.
inline void attend(std::span<const AttentionRequest> requests, const DecodeOptions& options = {}) {
  with_memory_errors("attend", [&] { detail::attend_requests(requests, options); });
}

/// One request: attend({&request, 1}, options).
inline void attend(const AttentionRequest& request, const DecodeOptions& options = {}) {
  attend(std::span<const AttentionRequest>(&request, 1), options);
}

}  // namespace kvq::inline v0
