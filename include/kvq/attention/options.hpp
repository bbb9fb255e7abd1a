#pragma once
// What a caller chooses for decode_attention and attend: the accuracy tier, the chunking, the
// executor and workspace, a kernel by name, the outlier guard and the score options. The
// kernels read the tier from here; nothing else in this header depends on a kernel.

#include <cstddef>
#include <string_view>
#include <vector>

#include "kvq/attention/scores.hpp"
#include "kvq/core/scratch.hpp"
#include "kvq/parallel/executor.hpp"

namespace kvq::inline v0 {

/// Accuracy tier of decode attention (definitions in kernels/attention/task.hpp). Caches with
/// dense-and-sparse outliers (QuantizerSpec::outliers), ggml's levels or level tables (any Mode
/// but asymmetric and symmetric) compute the exact tier for both; so do 3-bit codes on the AVX-512
/// exact span kernel, which reads them twice as fast as the generic kernel's integer tier, and
/// every cache on the vector kernels (vector-avx2, vector-avx512, vector-neon), where the exact
/// tier is the faster one (VectorKernel::computes_integer_tier).
enum class Tier : unsigned char {
  exact,    // fp32 arithmetic; within 1e-5 relative of reference_attention
  integer,  // int8 query and attention weights against the codes (vpdpbusd); within 2.5e-2 on random inputs
};

constexpr const char* to_string(Tier t) noexcept { return t == Tier::exact ? "exact" : "integer"; }

/// Scratch reused across calls so the hot path never allocates once warmed up.
class DecodeWorkspace {
 public:
  std::vector<float> queries;  // (heads, head_dim) rotated and scaled
  std::vector<float> partial;  // (tasks, group, head_dim + 2)
};

/// Releases what the library's own workspace holds beyond kept_scratch_bytes (OwnScratch).
inline void trim_scratch(DecodeWorkspace& w) noexcept {
  trim_scratch(w.queries);
  trim_scratch(w.partial);
}

struct DecodeOptions {
  Tier tier = Tier::exact;
  /// Context positions per work item, rounded up to whole tiles (key blocks). Fixed, never
  /// derived from the thread count, so results are identical for every executor.
  std::size_t chunk_tokens = 4096;
  /// nullptr: run on the calling thread.
  Executor* executor = nullptr;
  /// nullptr: a per-thread workspace of the library's own, kept between calls up to
  /// kept_scratch_bytes a vector (core/scratch.hpp). decode_attention and attend use it alike. A
  /// workspace serves one call at a time: calls that may overlap need one each.
  DecodeWorkspace* workspace = nullptr;
  /// The kernel to run, by its name in kernels/attention/registry.hpp ("reference", "avx2",
  /// "vector-neon", ...); empty: the best this CPU has for the cache. Tests, bisecting and
  /// benchmarks name one; a name this CPU or the cache's shapes rule out is a kvq::Error.
  std::string_view kernel{};
  /// Integer tier only: scan each chunk's scales first and run a chunk whose outliers int8 cannot
  /// carry in the exact tier (kernels/attention/integer_range.hpp), so the tier's bound holds on
  /// any data. The scan costs 5-15% of an integer-tier step at 32K; an engine that knows its
  /// keys and values have no outlier scales may turn it off.
  bool guard_outliers = true;
  /// Softmax scale, sliding window, attention chunks, logit soft-cap and learned sink logits
  /// (scores.hpp); the defaults are plain causal attention with scale 1 / sqrt(head_dim).
  ScoreOptions scores{};
};

}  // namespace kvq::inline v0
