#pragma once
// Instruction sets the kernels are compiled for, and the one runtime check that picks among them.
// Kernels carry per-function target attributes, so a user who builds for generic x86-64 still
// gets the AVX2 and AVX-512 paths on a CPU that has them. KVQ_FORCE_REFERENCE pins the scalar path.

#include "kvq/config.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(KVQ_FORCE_REFERENCE)
#define KVQ_HAVE_X86_KERNELS 1
#include <cpuid.h>
#endif
#if defined(__aarch64__) && !defined(KVQ_FORCE_REFERENCE)
#define KVQ_HAVE_NEON_KERNELS 1
#endif

// GCC 12 warns on its own intrinsic headers (_mm*_undefined_* placeholders) when inlined through
// target attributes, and about vector arguments of functions a kernel template shares with
// targets it is not compiled for (inlined into a target entry point, never called across it);
// the warnings are about GCC's code and ABI notes, not ours. Kernel headers turn them off for
// their own code.
#if defined(__clang__)  // -Wmaybe-uninitialized and -Wpsabi are GCC's; clang warns about unknown names
#define KVQ_INTRINSIC_WARNINGS_OFF _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#else
#define KVQ_INTRINSIC_WARNINGS_OFF                                                           \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wuninitialized\"") _Pragma("GCC diagnostic ignored \"-Wpsabi\"")
#endif
#define KVQ_INTRINSIC_WARNINGS_ON _Pragma("GCC diagnostic pop")

namespace kvq::inline v0::isa {

enum class Level : unsigned char { scalar, avx2, avx512 };

constexpr const char* to_string(Level l) noexcept {
  return l == Level::scalar ? "scalar" : l == Level::avx2 ? "avx2" : "avx512";
}

#if defined(KVQ_HAVE_X86_KERNELS)
// clang 14 knows no "f16c" for __builtin_cpu_supports; ask cpuid directly.
inline bool has_f16c() noexcept {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}
#endif

/// The best level this CPU supports (computed once).
inline Level detected() noexcept {
#if defined(KVQ_HAVE_X86_KERNELS)
  static const Level level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("bmi2") &&
        has_f16c() && __builtin_cpu_supports("fma"))
      return Level::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c()) return Level::avx2;
    return Level::scalar;
  }();
  return level;
#else
  return Level::scalar;
#endif
}

}  // namespace kvq::inline v0::isa
