// Which instructions compete with vpdpbusd for the same execution pipes: the cost model behind
// the integer tier's floor in bench/RESULTS.md. A loop of 8 independent vpdpbusd (the baseline)
// is timed alone and with 4 independent instructions of one kind mixed in. The counter
// `dpbusd_slots` is what one added instruction costs in units of one vpdpbusd:
//   (time with the 4 added - baseline) / baseline * 8 / 4
// about 0 for an instruction that issues on other pipes, about 1 for one that takes the
// vpdpbusd's pipe for a full slot. Frequency-independent, so comparable across runs on a shared
// machine. Needs AVX-512 VNNI and VBMI; skipped with a message elsewhere.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>

#include "kvq/isa.hpp"

#if defined(KVQ_HAVE_X86_KERNELS)
#include <immintrin.h>

#include "kvq/kernels/attention/avx512.hpp"

// The instructions measured: name, then the asm template, output constraint, output registers (f:
// float, i: integer) and inputs of one copy. One list makes the enum, the loop body and the
// benchmarks, so an instruction is added in one place.
#define KVQ_PIPE_MIXES(X)                                                 \
  X(vmulps, "vmulps %1, %2, %0", "=v", f, "v"(fa), "v"(fb))               \
  X(vfmadd231ps, "vfmadd231ps %1, %2, %0", "+v", f, "v"(fa), "v"(fb))     \
  X(vpermt2b, "vpermt2b %1, %2, %0", "+v", i, "v"(u), "v"(s))             \
  X(vpmultishiftqb, "vpmultishiftqb %1, %2, %0", "=v", i, "v"(u), "v"(s)) \
  X(vpmaddubsw, "vpmaddubsw %1, %2, %0", "=v", i, "v"(u), "v"(s))         \
  X(vpmaddwd, "vpmaddwd %1, %2, %0", "=v", i, "v"(u), "v"(s))             \
  X(vpermb, "vpermb %1, %2, %0", "=v", i, "v"(u), "v"(s))                 \
  X(vpmovdb, "vpmovdb %1, %x0", "=v", i, "v"(u))                          \
  X(vaddps, "vaddps %1, %2, %0", "=v", f, "v"(fa), "v"(fb))               \
  X(vmaxps, "vmaxps %1, %2, %0", "=v", f, "v"(fa), "v"(fb))               \
  X(vcvtps2dq, "vcvtps2dq %1, %0", "=v", i, "v"(fa))                      \
  X(vcvtdq2ps, "vcvtdq2ps %1, %0", "=v", f, "v"(u))                       \
  X(vcvtph2ps, "vcvtph2ps %t1, %0", "=v", f, "v"(u))                      \
  X(vpermps, "vpermps %1, %2, %0", "=v", f, "v"(fa), "v"(u))              \
  X(vpermd, "vpermd %1, %2, %0", "=v", i, "v"(u), "v"(s))                 \
  X(vpackssdw, "vpackssdw %1, %2, %0", "=v", i, "v"(u), "v"(s))           \
  X(vpandd, "vpandd %1, %2, %0", "=v", i, "v"(u), "v"(s))                 \
  X(vpsrld, "vpsrld $4, %1, %0", "=v", i, "v"(u))                         \
  X(vpsrlvd, "vpsrlvd %1, %2, %0", "=v", i, "v"(u), "v"(s))               \
  X(vpsrlvq, "vpsrlvq %1, %2, %0", "=v", i, "v"(u), "v"(s))               \
  X(vpshufb, "vpshufb %1, %2, %0", "=v", i, "v"(u), "v"(s))               \
  X(vpmovzxbd, "vpmovzxbd %x1, %0", "=v", i, "v"(u))                      \
  X(vshufi32x4, "vshufi32x4 $0x44, %1, %2, %0", "=v", i, "v"(u), "v"(s))  \
  X(vpunpckldq, "vpunpckldq %1, %2, %0", "=v", i, "v"(u), "v"(s))         \
  X(vscalefps, "vscalefps %1, %2, %0", "=v", f, "v"(fa), "v"(fb))         \
  X(vrndscaleps, "vrndscaleps $8, %1, %0", "=v", f, "v"(fa))              \
  X(vrangeps, "vrangeps $11, %1, %2, %0", "=v", f, "v"(fa), "v"(fb))      \
  X(vpbroadcastq_load, "vpbroadcastq %1, %0", "=v", i, "m"(word[J]))

namespace {

#define KVQ_PIPES_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi"), noinline))

#define KVQ_NAME(name, ...) name,
enum class Mix { none, KVQ_PIPE_MIXES(KVQ_NAME) };
#undef KVQ_NAME

constexpr long kRounds = 1 << 16;

// 4 instructions writing independent registers from loop-invariant sources, so that only
// throughput counts. The 8 vpdpbusd accumulate into independent registers (latency hidden).
template <Mix M>
KVQ_PIPES_TARGET std::int32_t rounds(long n) {
  __m512i a0 = _mm512_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const __m512i u = _mm512_set1_epi32(0x01020304), s = _mm512_set1_epi32(0x05060708);
  const __m512 fa = _mm512_set1_ps(1.5f), fb = _mm512_set1_ps(0.75f);
  __m512i i0 = u, i1 = u, i2 = u, i3 = u;
  __m512 f0 = fa, f1 = fa, f2 = fa, f3 = fa;
  alignas(64) static const std::uint64_t word[4] = {1, 2, 3, 4};
  for (long r = 0; r < n; ++r) {
#define KVQ_DP(acc) __asm__ volatile("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))
    KVQ_DP(a0);
    KVQ_DP(a1);
    KVQ_DP(a2);
    KVQ_DP(a3);
    KVQ_DP(a4);
    KVQ_DP(a5);
    KVQ_DP(a6);
    KVQ_DP(a7);
#undef KVQ_DP
// The added instruction into out0 .. out3 (out: f for float, i for integer registers); J numbers
// the copy for the memory operand.
#define KVQ_ONE(fmt, cons, out, j, ...) __asm__ volatile(fmt : cons(out##j) : __VA_ARGS__);
#define KVQ_MIX(mix, fmt, cons, out, ...)     \
  if constexpr (M == Mix::mix) {              \
    {                                         \
      [[maybe_unused]] constexpr int J = 0;   \
      KVQ_ONE(fmt, cons, out, 0, __VA_ARGS__) \
    }                                         \
    {                                         \
      [[maybe_unused]] constexpr int J = 1;   \
      KVQ_ONE(fmt, cons, out, 1, __VA_ARGS__) \
    }                                         \
    {                                         \
      [[maybe_unused]] constexpr int J = 2;   \
      KVQ_ONE(fmt, cons, out, 2, __VA_ARGS__) \
    }                                         \
    {                                         \
      [[maybe_unused]] constexpr int J = 3;   \
      KVQ_ONE(fmt, cons, out, 3, __VA_ARGS__) \
    }                                         \
  }
    KVQ_PIPE_MIXES(KVQ_MIX)
#undef KVQ_MIX
#undef KVQ_ONE
  }
  const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                       _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
  const __m512i side = _mm512_add_epi32(_mm512_add_epi32(i0, i1), _mm512_add_epi32(i2, i3));
  const __m512 fside = _mm512_add_ps(_mm512_add_ps(f0, f1), _mm512_add_ps(f2, f3));
  alignas(64) std::int32_t lanes[16];
  _mm512_store_si512(lanes, _mm512_add_epi32(_mm512_add_epi32(sum, side), _mm512_castps_si512(fside)));
  return lanes[0] + lanes[15];
}

// Seconds for `rounds` of the loop, the best of 5 (the minimum is the figure least disturbed by
// other tenants of a shared machine).
template <Mix M>
double best_seconds() {
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(rounds<M>(kRounds));
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = t < best ? t : best;
  }
  return best;
}

template <Mix M>
void mix(benchmark::State& state) {
  if (!kvq::kernels::attention::avx512::supported()) {
    state.SkipWithError("needs AVX-512 with VNNI and VBMI");
    return;
  }
  double base = 0, with = 0;
  for (auto _ : state) {
    base = best_seconds<Mix::none>();
    with = best_seconds<M>();
  }
  state.counters["dpbusd_slots"] = (with - base) / base * 8.0 / 4.0;
  state.counters["ns_per_dpbusd"] = base / double(8 * kRounds) * 1e9;
}

}  // namespace

#define KVQ_PIPES(name, ...) \
  BENCHMARK(mix<Mix::name>)->Name("pipes/" #name)->Iterations(3)->Unit(benchmark::kMillisecond);
KVQ_PIPE_MIXES(KVQ_PIPES)
#undef KVQ_PIPES
#undef KVQ_PIPE_MIXES
#endif

BENCHMARK_MAIN();
