#pragma once
// The level tables of the cache's non-uniform modes (NormalFloat, Lloyd-Max, iq4_nl, fp8), as
// stored-format constants: a code indexes its table and decodes to scale * level. They are
// quant/levels.hpp's level sets rounded to float (a test checks each against the computation),
// fixed here so a cache file decodes alike on every build and libm; fp8's 256 values are
// codecs/fp8.hpp's.

#include <array>
#include <cstddef>

#include "kvq/codecs/fp8.hpp"
#include "kvq/quant/spec.hpp"

namespace kvq::inline v0 {

namespace detail {
// NormalFloat, 2..4 bits (QLoRA's construction; within a few float ulps of bitsandbytes' NF4).
inline constexpr std::array<float, 4> nf2 = {-1.0f, 0.0f, 0x1.be471ep-2f, 1.0f};
inline constexpr std::array<float, 8> nf3 = {-1.0f,          -0x1.11ee8p-1f, -0x1.f9b73p-3f, 0.0f,
                                             0x1.7779a4p-3f, 0x1.87296cp-2f, 0x1.3ef7fcp-1f, 1.0f};
inline constexpr std::array<float, 16> nf4 = {-1.0f,           -0x1.647362p-1f, -0x1.0cd65cp-1f, -0x1.94653cp-2f,
                                              -0x1.234496p-2f, -0x1.7a6a7ap-3f, -0x1.74f0d2p-4f, 0.0f,
                                              0x1.45f602p-4f,  0x1.4995bep-3f,  0x1.f809b4p-3f,  0x1.5a066cp-2f,
                                              0x1.c3496ap-2f,  0x1.200f52p-1f,  0x1.72276p-1f,   1.0f};
// Lloyd-Max levels of N(0, 1), 1..4 bits.
inline constexpr std::array<float, 2> lm1 = {-0x1.988454p-1f, 0x1.988454p-1f};
inline constexpr std::array<float, 4> lm2 = {-0x1.82aabap+0f, -0x1.cfa592p-2f, 0x1.cfa592p-2f, 0x1.82aabap+0f};
inline constexpr std::array<float, 8> lm3 = {-0x1.1372f4p+1f, -0x1.580a7p+0f, -0x1.83132p-1f, -0x1.f5f3fp-3f,
                                             0x1.f5f3fp-3f,   0x1.83132p-1f,  0x1.580a7p+0f,  0x1.1372f4p+1f};
inline constexpr std::array<float, 16> lm4 = {-0x1.5dc57ep+1f, -0x1.08d58ep+1f, -0x1.9e384ap+0f, -0x1.41985ep+0f,
                                              -0x1.e27a72p-1f, -0x1.5042bcp-1f, -0x1.8d5c88p-2f, -0x1.06f3fap-3f,
                                              0x1.06f3fap-3f,  0x1.8d5c88p-2f,  0x1.5042bcp-1f,  0x1.e27a72p-1f,
                                              0x1.41985ep+0f,  0x1.9e384ap+0f,  0x1.08d58ep+1f,  0x1.5dc57ep+1f};
// llama.cpp's iq4_nl levels (ggml's kvalues_iq4nl).
inline constexpr std::array<float, 16> iq4_nl = {-127.0f, -104.0f, -83.0f, -65.0f, -49.0f, -35.0f, -22.0f, -10.0f,
                                                 1.0f,    13.0f,   25.0f,  38.0f,  53.0f,  69.0f,  89.0f,  113.0f};
}  // namespace detail

/// The fp8 format of an fp8 mode.
constexpr Fp8Format fp8_format(Mode m) noexcept { return m == Mode::fp8_e5m2 ? Fp8Format::e5m2 : Fp8Format::e4m3fn; }
constexpr bool is_fp8(Mode m) noexcept { return m == Mode::fp8_e4m3 || m == Mode::fp8_e5m2; }

/// The 2^bits levels a spec's codes index (ascending, but fp8's, which are in code order), or
/// null for the affine modes (and for a width the mode does not take, which validate refuses). A
/// codebook's levels live in the spec: the pointer is valid while `spec` is.
constexpr const float* code_levels(const QuantizerSpec& spec) noexcept {
  if (spec.mode == Mode::codebook) return spec.codebook.data();
  if (is_fp8(spec.mode)) return spec.bits == 8 ? fp8_table(fp8_format(spec.mode)) : nullptr;
  if (spec.mode == Mode::iq4_nl) return spec.bits == 4 ? detail::iq4_nl.data() : nullptr;
  if (spec.mode == Mode::normal_float)
    return spec.bits == 2   ? detail::nf2.data()
           : spec.bits == 3 ? detail::nf3.data()
           : spec.bits == 4 ? detail::nf4.data()
                            : nullptr;
  if (spec.mode == Mode::lloyd_max)
    return spec.bits == 1   ? detail::lm1.data()
           : spec.bits == 2 ? detail::lm2.data()
           : spec.bits == 3 ? detail::lm3.data()
           : spec.bits == 4 ? detail::lm4.data()
                            : nullptr;
  return nullptr;
}

}  // namespace kvq::inline v0
