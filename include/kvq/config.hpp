#pragma once
// Build-time switches. Define before including any kvq header.
//
// KVQ_FORCE_REFERENCE  route every kernel to its scalar reference (debugging, bisecting).

#if defined(__GNUC__) || defined(__clang__)
#define KVQ_ALWAYS_INLINE inline __attribute__((always_inline))
#define KVQ_RESTRICT __restrict__
#else
#define KVQ_ALWAYS_INLINE inline
#define KVQ_RESTRICT
#endif

#if defined(NDEBUG)
#define KVQ_DEBUG_ASSERT(cond) ((void)0)
#else
#include <cassert>
#define KVQ_DEBUG_ASSERT(cond) assert(cond)
#endif
