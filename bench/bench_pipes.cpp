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

namespace {

#define KVQ_PIPES_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi"), noinline))

enum class Mix { none, vmulps, vfmadd231ps, vpermt2b, vpmultishiftqb, vpmaddubsw, vpmaddwd, vpermb, vpmovdb,
                 vaddps, vmaxps, vcvtps2dq, vcvtdq2ps, vcvtph2ps, vpermps, vpermd, vpackssdw, vpandd, vpsrld,
                 vpsrlvd, vpsrlvq, vpshufb, vpmovzxbd, vshufi32x4, vpunpckldq, vscalefps, vrndscaleps, vrangeps,
                 vpbroadcastq_load };

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
#define KVQ_DP(acc) __asm__ volatile("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    KVQ_DP(a0) KVQ_DP(a1) KVQ_DP(a2) KVQ_DP(a3) KVQ_DP(a4) KVQ_DP(a5) KVQ_DP(a6) KVQ_DP(a7)
#undef KVQ_DP
// The added instruction into out0 .. out3 (out: f for float, i for integer registers); J numbers
// the copy for the memory operand.
#define KVQ_ONE(fmt, cons, out, j, ...) __asm__ volatile(fmt : cons(out##j) : __VA_ARGS__);
#define KVQ_MIX(mix, fmt, cons, out, ...)                                             \
  if constexpr (M == Mix::mix) {                                                      \
    { [[maybe_unused]] constexpr int J = 0; KVQ_ONE(fmt, cons, out, 0, __VA_ARGS__) } \
    { [[maybe_unused]] constexpr int J = 1; KVQ_ONE(fmt, cons, out, 1, __VA_ARGS__) } \
    { [[maybe_unused]] constexpr int J = 2; KVQ_ONE(fmt, cons, out, 2, __VA_ARGS__) } \
    { [[maybe_unused]] constexpr int J = 3; KVQ_ONE(fmt, cons, out, 3, __VA_ARGS__) } \
  }
    KVQ_MIX(vmulps, "vmulps %1, %2, %0", "=v", f, "v"(fa), "v"(fb))
    KVQ_MIX(vfmadd231ps, "vfmadd231ps %1, %2, %0", "+v", f, "v"(fa), "v"(fb))
    KVQ_MIX(vpermt2b, "vpermt2b %1, %2, %0", "+v", i, "v"(u), "v"(s))
    KVQ_MIX(vpmultishiftqb, "vpmultishiftqb %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpmaddubsw, "vpmaddubsw %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpmaddwd, "vpmaddwd %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpermb, "vpermb %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpmovdb, "vpmovdb %1, %x0", "=v", i, "v"(u))
    KVQ_MIX(vaddps, "vaddps %1, %2, %0", "=v", f, "v"(fa), "v"(fb))
    KVQ_MIX(vmaxps, "vmaxps %1, %2, %0", "=v", f, "v"(fa), "v"(fb))
    KVQ_MIX(vcvtps2dq, "vcvtps2dq %1, %0", "=v", i, "v"(fa))
    KVQ_MIX(vcvtdq2ps, "vcvtdq2ps %1, %0", "=v", f, "v"(u))
    KVQ_MIX(vcvtph2ps, "vcvtph2ps %t1, %0", "=v", f, "v"(u))
    KVQ_MIX(vpermps, "vpermps %1, %2, %0", "=v", f, "v"(fa), "v"(u))
    KVQ_MIX(vpermd, "vpermd %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpackssdw, "vpackssdw %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpandd, "vpandd %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpsrld, "vpsrld $4, %1, %0", "=v", i, "v"(u))
    KVQ_MIX(vpsrlvd, "vpsrlvd %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpsrlvq, "vpsrlvq %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpshufb, "vpshufb %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpmovzxbd, "vpmovzxbd %x1, %0", "=v", i, "v"(u))
    KVQ_MIX(vshufi32x4, "vshufi32x4 $0x44, %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vpunpckldq, "vpunpckldq %1, %2, %0", "=v", i, "v"(u), "v"(s))
    KVQ_MIX(vscalefps, "vscalefps %1, %2, %0", "=v", f, "v"(fa), "v"(fb))
    KVQ_MIX(vrndscaleps, "vrndscaleps $8, %1, %0", "=v", f, "v"(fa))
    KVQ_MIX(vrangeps, "vrangeps $11, %1, %2, %0", "=v", f, "v"(fa), "v"(fb))
    KVQ_MIX(vpbroadcastq_load, "vpbroadcastq %1, %0", "=v", i, "m"(word[J]))
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

#define KVQ_PIPES(M) BENCHMARK(mix<Mix::M>)->Name("pipes/" #M)->Iterations(3)->Unit(benchmark::kMillisecond)
KVQ_PIPES(vmulps);
KVQ_PIPES(vfmadd231ps);
KVQ_PIPES(vpermt2b);
KVQ_PIPES(vpmultishiftqb);
KVQ_PIPES(vpmaddubsw);
KVQ_PIPES(vpmaddwd);
KVQ_PIPES(vpermb);
KVQ_PIPES(vpmovdb);
KVQ_PIPES(vaddps);
KVQ_PIPES(vmaxps);
KVQ_PIPES(vcvtps2dq);
KVQ_PIPES(vcvtdq2ps);
KVQ_PIPES(vcvtph2ps);
KVQ_PIPES(vpermps);
KVQ_PIPES(vpermd);
KVQ_PIPES(vpackssdw);
KVQ_PIPES(vpandd);
KVQ_PIPES(vpsrld);
KVQ_PIPES(vpsrlvd);
KVQ_PIPES(vpsrlvq);
KVQ_PIPES(vpshufb);
KVQ_PIPES(vpmovzxbd);
KVQ_PIPES(vshufi32x4);
KVQ_PIPES(vpunpckldq);
KVQ_PIPES(vscalefps);
KVQ_PIPES(vrndscaleps);
KVQ_PIPES(vrangeps);
KVQ_PIPES(vpbroadcastq_load);
#endif

BENCHMARK_MAIN();
