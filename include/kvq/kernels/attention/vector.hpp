#pragma once
// Decode attention written once over a vector-ops type (kernels/ops/): the tile loop, key scores,
// online softmax, RoPE and value accumulation of task.hpp, with the dot products and the value
// updates in vectors of Ops::width lanes. On scalar ops (fp64 products) it is the reference
// kernel, which takes every configuration; on NEON it is the AArch64 kernel; on AVX2 and AVX-512
// ops it runs after the hand-tuned x86 kernels (registry.hpp), for caches they refuse or read
// only row by row, and is measured against them. A new instruction set is one ops file and one
// registry entry, plus a copy of the algorithm below where the set needs a target attribute.
//
// Rows are read as floats block_rows at a time, then used from there: keys dotted with the GQA
// group's queries two rows and up to four heads at a time (each query vector loaded once for two
// rows), values added into sums that stay in registers for up to four heads and two vectors of
// channels (each row loaded once for the heads). A packed per-channel key block (post-RoPE) folds
// its scales into the queries and reads its codes as floats; every other key row is dequantized
// (in vectors where packed per channel, or per token in groups of whole vectors; else through
// StreamView::read_row), rotated back when stored rotated (DecodeTask::unrotate) and RoPE'd when
// pre-RoPE. Dense-and-sparse outliers add their corrections: q . e to a folded key's score, e to
// a dequantized row. Ops of more than one lane have `exp`, `max` and `largest` for the online
// softmax (softmax_head, which the AVX2 kernel and the generic AVX-512 kernel call too; the
// AVX2 kernel calls rope_row as well). Optional ops members, found with `requires`, speed the steps that pay:
// `codes<bits>` unpacks a vector of codes in registers, `load_scalar` converts fp16 parameters in
// hardware, `doubled` spreads RoPE's table over adjacent pairs (half-split pairs need no
// member). The integer tier runs on scalar ops only (computes_integer_tier), as task.hpp's
// definitions; vector kernels compute the exact tier for both tiers.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>

#include "kvq/attention/scores.hpp"
#include "kvq/isa.hpp"
#include "kvq/kernels/attention/task.hpp"
#include "kvq/kernels/ops/scalar.hpp"
#if defined(KVQ_HAVE_X86_KERNELS)
#include "kvq/kernels/ops/avx2.hpp"
#include "kvq/kernels/ops/avx512.hpp"
#endif
#if defined(KVQ_HAVE_NEON_KERNELS)
#include "kvq/kernels/ops/neon.hpp"
#endif

KVQ_INTRINSIC_WARNINGS_OFF

namespace kvq::inline v0::kernels::attention {

/// Shapes a vector kernel of `width` lanes takes: head_dim a multiple of the width (outside the
/// copies below, so the registry asks it without running code compiled for another CPU).
template <std::size_t width>
bool vector_kernel_accepts(const StreamView& keys, const StreamView& values, std::size_t group,
                           const RopeTable*) noexcept {
  const std::size_t d = keys.head_dim;
  return d > 0 && d % width == 0 && d <= max_head_dim && values.head_dim == d && group > 0 && group <= max_group;
}

}  // namespace kvq::inline v0::kernels::attention

// One copy of the algorithm per instruction set, each in its own namespace with every function
// compiled for that set (the x86 ones under a target pragma, so GCC and clang alike; clang
// refuses vector arguments in functions compiled without the set): `portable` for scalar ops
// (the reference kernel) and NEON, `x86_avx2` and `x86_avx512`.
#define KVQ_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define KVQ_PUSH_TARGET(set) KVQ_PRAGMA(clang attribute push(__attribute__((target(set))), apply_to = function))
#define KVQ_POP_TARGET KVQ_PRAGMA(clang attribute pop)
#else
#define KVQ_PUSH_TARGET(set) KVQ_PRAGMA(GCC push_options) KVQ_PRAGMA(GCC target(set))
#define KVQ_POP_TARGET KVQ_PRAGMA(GCC pop_options)
#endif

#define KVQ_VECTOR_COPY portable
#include "kvq/kernels/attention/vector_kernel.inc"
#undef KVQ_VECTOR_COPY
#if defined(KVQ_HAVE_X86_KERNELS)
KVQ_PUSH_TARGET(KVQ_AVX2_OPS_FEATURES)
#define KVQ_VECTOR_COPY x86_avx2
#include "kvq/kernels/attention/vector_kernel.inc"
#undef KVQ_VECTOR_COPY
KVQ_POP_TARGET
KVQ_PUSH_TARGET(KVQ_AVX512_OPS_FEATURES)
#define KVQ_VECTOR_COPY x86_avx512
#include "kvq/kernels/attention/vector_kernel.inc"
#undef KVQ_VECTOR_COPY
KVQ_POP_TARGET
#endif
#undef KVQ_PUSH_TARGET
#undef KVQ_POP_TARGET
#undef KVQ_PRAGMA

namespace kvq::inline v0::kernels::attention {

/// The reference kernel: any width, group, axis, parameter and residual type, any head_dim.
inline void decode_task(const DecodeTask& task) noexcept { portable::VectorKernel<ops::Scalar>::run(task); }

// Entry points of the vector kernel per instruction set; on x86 `flatten` inlines the whole copy
// into the entry, as one function compiled for its set.
#if defined(KVQ_HAVE_X86_KERNELS)
__attribute__((target(KVQ_AVX2_OPS_FEATURES), flatten)) inline void vector_avx2_task(const DecodeTask& task) noexcept {
  x86_avx2::VectorKernel<ops::Avx2>::run(task);
}
__attribute__((target(KVQ_AVX512_OPS_FEATURES), flatten)) inline void vector_avx512_task(
    const DecodeTask& task) noexcept {
  x86_avx512::VectorKernel<ops::Avx512>::run(task);
}
#endif
#if defined(KVQ_HAVE_NEON_KERNELS)
inline void vector_neon_task(const DecodeTask& task) noexcept { portable::VectorKernel<ops::Neon>::run(task); }
#endif

}  // namespace kvq::inline v0::kernels::attention

KVQ_INTRINSIC_WARNINGS_ON
