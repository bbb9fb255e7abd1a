#pragma once
// Build-time switches. Define before including any kvq header.
//
// KVQ_FORCE_REFERENCE  route every kernel to its scalar reference (debugging, bisecting).

#if defined(__GNUC__) || defined(__clang__)
#define KVQ_RESTRICT __restrict__
#else
#define KVQ_RESTRICT
#endif
