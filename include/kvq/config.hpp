#pragma once
// Build-time switches. Define before including any kvq header.
//
// KVQ_FORCE_REFERENCE  route every kernel to its scalar reference (debugging, bisecting).
// KVQ_EXTERN_KERNELS   (in every unit of a program) the attention kernel table is defined once,
//                      in the unit that also defines KVQ_KERNELS_IMPLEMENTATION before including
//                      kvq/kernels/attention/registry.hpp. That unit decides what the table
//                      holds, so it is compiled with the same switches and target flags as the
//                      others.

#if defined(__GNUC__) || defined(__clang__)
#define KVQ_RESTRICT __restrict__
#else
#define KVQ_RESTRICT
#endif
