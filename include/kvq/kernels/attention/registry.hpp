#pragma once
// The table of decode-attention kernels: each with its name, the CPU features it needs, the
// shapes it takes, the layouts it reads at speed and its entry point. Attention runs the first
// automatic kernel this CPU has that takes the cache and reads it at speed (else the first that
// takes it), or the one named in the options (DecodeOptions::kernel), so a test or a benchmark
// can run every kernel directly. Order is preference: hand-tuned kernels first, the vector
// kernels, then the reference kernel, which takes everything, last.
//
// The table reaches every kernel, so a translation unit that runs attention compiles them all
// (85 of a test unit's 110 s and 3 of its 4 MB, GCC 12 -O3). A program of many units can compile
// them once: define KVQ_EXTERN_KERNELS in every unit, and KVQ_KERNELS_IMPLEMENTATION as well in
// exactly one that includes this header; the others then only declare `registry()`.

#include <span>
#include <string>
#include <string_view>

#include "kvq/error.hpp"
#include "kvq/isa.hpp"
#include "kvq/kernels/attention/task.hpp"
#include "kvq/kernels/attention/vector.hpp"
#if defined(KVQ_HAVE_X86_KERNELS)
#include "kvq/kernels/attention/avx2.hpp"
#include "kvq/kernels/attention/avx512.hpp"
#endif

namespace kvq::inline v0::kernels::attention {

/// When a kernel runs without being named.
enum class Choice : unsigned char {
  automatic,  // whenever it takes the cache (and no kernel before it takes it at speed)
  by_name,    // only named (tests, benchmarks, bisecting)
};

namespace detail {
inline bool always() noexcept { return true; }
#if defined(KVQ_HAVE_X86_KERNELS)
inline bool avx512_level() noexcept { return isa::detected() == isa::Level::avx512; }
#endif
}  // namespace detail

struct KernelEntry {
  const char* name;
  const char* needs;  // the CPU features it is compiled for and checks at run time
  Choice choice = Choice::automatic;
  // What it reads beyond affine and level-table codes (false unless the entry says so, so a new
  // kernel is given no cache it was not written for):
  bool outliers = false;   // dense-and-sparse outliers (QuantizerSpec::outliers)
  bool unrotates = false;  // pre-RoPE keys stored rotated, rotated back (DecodeTask::unrotate)
  // Computes the integer tier of the streams that have one (computed_tier) where it is asked
  // for; false: the exact tier for both (the vector kernels, whose exact tier is the faster one,
  // VectorKernel::computes_integer_tier).
  bool integer_tier = true;
  bool (*available)() noexcept = detail::always;
  bool (*accepts)(const StreamView& keys, const StreamView& values, std::size_t group, const RopeTable* rope) noexcept;
  // Whether it reads these streams at speed; null: every stream it takes. A hand-tuned kernel reads
  // some layouts only row by row, 2-9x slower than the next kernel that unpacks them (AVX2 or a
  // vector kernel; bench/RESULTS.md).
  bool (*at_speed)(const StreamView& keys, const StreamView& values, const RopeTable* rope) noexcept = nullptr;
  void (*run)(const DecodeTask& task) noexcept;
};

#if defined(KVQ_EXTERN_KERNELS) && !defined(KVQ_KERNELS_IMPLEMENTATION)
/// Every kernel of this build (defined in the unit with KVQ_KERNELS_IMPLEMENTATION).
std::span<const KernelEntry> registry() noexcept;
#else
#if defined(KVQ_EXTERN_KERNELS)
#define KVQ_REGISTRY_LINKAGE  // one definition for the program, declared alike in every unit
#else
#define KVQ_REGISTRY_LINKAGE inline
#endif
/// Every kernel of this build, in order of preference.
KVQ_REGISTRY_LINKAGE std::span<const KernelEntry> registry() noexcept {
  static constexpr KernelEntry table[] = {
#if defined(KVQ_HAVE_X86_KERNELS)
    {.name = "avx512",
     .needs = "avx512f avx512bw avx512vl avx512dq avx512vnni avx512vbmi bmi2 f16c fma",
     .unrotates = true,
     .available = avx512::supported,
     .accepts = avx512::supports,
     .at_speed = avx512::at_speed,
     .run = [](const DecodeTask& t) noexcept { avx512::decode_task(t); }},
    {.name = "avx512-generic",
     .needs = "avx512f avx512bw avx512vl avx512dq avx512vnni avx512vbmi bmi2 f16c fma",
     .choice = Choice::by_name,
     .unrotates = true,
     .available = avx512::supported,
     .accepts = avx512::supports,
     .run = avx512::decode_task_generic},
    {.name = "avx2",
     .needs = "avx2 fma f16c",
     .available = avx2::supported,
     .accepts = avx2::supports,
     .at_speed = avx2::at_speed,
     .run = avx2::decode_task},
    {.name = "vector-avx512",
     .needs = "avx512f avx512bw avx512vl avx512dq avx512vnni bmi2 f16c fma",
     .outliers = true,
     .unrotates = true,
     .integer_tier = x86_avx512::VectorKernel<ops::Avx512>::computes_integer_tier,
     .available = detail::avx512_level,
     .accepts = vector_kernel_accepts<ops::Avx512::width>,
     .run = vector_avx512_task},
    {.name = "vector-avx2",
     .needs = "avx2 fma f16c",
     .outliers = true,
     .unrotates = true,
     .integer_tier = x86_avx2::VectorKernel<ops::Avx2>::computes_integer_tier,
     .available = avx2::supported,
     .accepts = vector_kernel_accepts<ops::Avx2::width>,
     .run = vector_avx2_task},
#endif
#if defined(KVQ_HAVE_NEON_KERNELS)
    {.name = "vector-neon",
     .needs = "asimd",
     .outliers = true,
     .unrotates = true,
     .integer_tier = portable::VectorKernel<ops::Neon>::computes_integer_tier,
     .accepts = vector_kernel_accepts<ops::Neon::width>,
     .run = vector_neon_task},
#endif
    {.name = "reference",
     .needs = "",
     .outliers = true,
     .unrotates = true,
     .integer_tier = portable::VectorKernel<ops::Scalar>::computes_integer_tier,
     .accepts = vector_kernel_accepts<ops::Scalar::width>,
     .run = decode_task},
  };
  return table;
}
#undef KVQ_REGISTRY_LINKAGE
#endif

/// Whether kernel `e` takes these streams (shapes and codecs; not whether this CPU runs it);
/// `unrotate`: pre-RoPE keys are stored rotated (DecodeTask::unrotate).
inline bool kernel_takes(const KernelEntry& e, const StreamView& keys, const StreamView& values, std::size_t group,
                         const RopeTable* rope, bool unrotate) noexcept {
  return e.accepts(keys, values, group, rope) && (e.outliers || (!has_outliers(keys) && !has_outliers(values))) &&
         (e.unrotates || !unrotate);
}

/// The kernel for these streams: the first automatic kernel this CPU runs that takes them at
/// speed (else the first that takes them), or the one called `name`. Throws kvq::Error when `name`
/// is unknown, or this CPU or these streams rule it out.
inline const KernelEntry& select_kernel(const StreamView& keys, const StreamView& values, std::size_t group,
                                        const RopeTable* rope, bool unrotate, std::string_view name = {}) {
  if (name.empty()) {
    const KernelEntry* first = nullptr;  // the first that takes them, at speed or not
    for (const KernelEntry& e : registry()) {
      if (e.choice != Choice::automatic || !e.available() || !kernel_takes(e, keys, values, group, rope, unrotate))
        continue;
      if (first == nullptr) first = &e;
      // The reference kernel (last, scalar) is slower than a hand-tuned one reading row by row.
      if ((e.at_speed == nullptr || e.at_speed(keys, values, rope)) && &e != &registry().back()) return e;
    }
    return first != nullptr ? *first : registry().back();  // the reference kernel takes every shape
  }
  const bool outliers = has_outliers(keys) || has_outliers(values);
  const bool tables = has_level_table(keys) || has_level_table(values);
  for (const KernelEntry& e : registry()) {
    if (name != e.name) continue;
    if (!e.available())
      throw Error(ErrorCode::unsupported,
                  "attention kernel '" + std::string(name) + "' needs " + e.needs + ", which this CPU lacks");
    if (kernel_takes(e, keys, values, group, rope, unrotate)) return e;
    throw Error(ErrorCode::unsupported, "attention kernel '" + std::string(name) + "' does not take head_dim " +
                                            std::to_string(keys.head_dim) + " with " + std::to_string(group) +
                                            " query heads per KV head" +
                                            (outliers ? " and dense-and-sparse outliers" : "") +
                                            (tables ? " and levels read through a table" : "") +
                                            (unrotate ? " and pre-RoPE keys stored rotated" : ""));
  }
  std::string known;
  for (const KernelEntry& e : registry()) known += std::string(known.empty() ? "" : ", ") + e.name;
  throw Error(ErrorCode::invalid_argument,
              "unknown attention kernel '" + std::string(name) + "' (this build has " + known + ")");
}

}  // namespace kvq::inline v0::kernels::attention
