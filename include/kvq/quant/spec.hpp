#pragma once
// QuantizerSpec: the runtime description of one quantizer (bits, group, axis, mode, parameter
// type). Compiled policies (policies.hpp) expose theirs as a constexpr `spec`; tools build one
// from a short string such as "k4c32" so that command lines and logs name configurations alike.

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/error.hpp"

namespace kvq::inline v0 {

/// Which elements share one scale and zero point.
enum class Axis : std::uint8_t {
  per_channel,  // one pair per channel per run of `group` consecutive tokens (keys)
  per_token,    // one pair per `group` consecutive channels of one token (values)
};

enum class Mode : std::uint8_t {
  asymmetric,  // zero point = group minimum, step = (max - min) / (2^b - 1)
  symmetric,   // levels symmetric about 0: step = 2 absmax / (2^b - 1), no stored zero point
  // llama.cpp's cache blocks: levels (code - 2^(b-1)) x d, no stored zero point; d = absmax / 127
  // at 8 bits (q8_0), else the group's value of largest magnitude over -2^(b-1) (q4_0, q5_0), so
  // that value is the bottom level. kernels/quantize/reference.hpp defines the rounding.
  ggml,
  // Non-uniform levels read through a table (quant/code_levels.hpp), x = scale * level[code],
  // scale = absmax / the largest level magnitude, no zero point:
  normal_float,  // NormalFloat levels (QLoRA's NF4 construction), 2..4 bits
  lloyd_max,     // Lloyd-Max levels of a unit Gaussian, 1..4 bits
  // Calibrated levels (QuantizerSpec::codebook, fitted to a model's activations, KVQuant's
  // non-uniform datatype) within the group's range: x = zero + scale * level[code] with
  // zero = the range's midpoint, scale = (max - min) / 2 and levels in [-1, 1], 1..4 bits.
  codebook,
  // llama.cpp's iq4_nl cache type: 4-bit codes name its 16 fixed non-uniform levels (-127..113),
  // x = scale * level[code], scale the least-squares fit of ggml's reference quantizer
  // (kernels/quantize/reference.hpp), no zero point.
  iq4_nl,
  // 8-bit floats (OCP FP8, codecs/fp8.hpp) with a scale per group: x = scale * fp8(code),
  // scale = absmax / the format's largest finite value (448, 57344), rounded up to the parameter
  // type, no zero point, 8 bits only.
  // vLLM's fp8 caches with one scale per group instead of one per tensor.
  fp8_e4m3,
  fp8_e5m2,
};

constexpr const char* to_string(Axis a) noexcept { return a == Axis::per_channel ? "per_channel" : "per_token"; }

namespace detail {
/// What names and validation know of a mode, one entry per Mode in the enum's order.
struct ModeTraits {
  Mode mode;
  const char* name;         // to_string
  std::string_view suffix;  // after the group in a quantizer string (none for the default)
  int min_bits, max_bits;   // the code widths the mode takes
};
inline constexpr ModeTraits mode_traits[] = {
    {Mode::asymmetric, "asymmetric", "", 1, 8},
    {Mode::symmetric, "symmetric", "s", 1, 8},
    {Mode::ggml, "ggml", "g", 1, 8},
    {Mode::normal_float, "normal_float", "n", 2, 4},
    {Mode::lloyd_max, "lloyd_max", "l", 1, 4},
    {Mode::codebook, "codebook", "b", 1, 4},
    {Mode::iq4_nl, "iq4_nl", "i", 4, 4},
    {Mode::fp8_e4m3, "fp8_e4m3", "e4m3", 8, 8},
    {Mode::fp8_e5m2, "fp8_e5m2", "e5m2", 8, 8},
};
consteval bool mode_traits_in_enum_order() {
  for (std::size_t i = 0; i < std::size(mode_traits); ++i)
    if (std::size_t(mode_traits[i].mode) != i) return false;
  return true;
}
static_assert(mode_traits_in_enum_order());

/// The traits of m, or null for a value that names no Mode.
constexpr const ModeTraits* traits(Mode m) noexcept {
  return std::size_t(m) < std::size(mode_traits) ? &mode_traits[std::size_t(m)] : nullptr;
}
}  // namespace detail

constexpr const char* to_string(Mode m) noexcept {
  const detail::ModeTraits* t = detail::traits(m);
  return t != nullptr ? t->name : "unknown";
}

/// Whether a mode is kvq's own min-max levels (asymmetric or symmetric): the only ones that keep
/// outliers and that the integer tier reads.
constexpr bool min_max_levels(Mode m) noexcept { return m == Mode::asymmetric || m == Mode::symmetric; }

/// Whether a mode decodes as zero + scale * code (every kernel reads these; level tables the
/// vector kernels, and the AVX-512 ones at 2 and 4 bits).
constexpr bool affine_levels(Mode m) noexcept { return min_max_levels(m) || m == Mode::ggml; }

/// The suffix naming a mode in a quantizer string (empty for the default, asymmetric).
constexpr std::string_view mode_suffix(Mode m) noexcept {
  const detail::ModeTraits* t = detail::traits(m);
  return t != nullptr ? t->suffix : "";
}

/// The fixed width of a mode's codes, or 0 where the spec chooses (iq4_nl 4, fp8 8).
constexpr int mode_bits(Mode m) noexcept {
  const detail::ModeTraits* t = detail::traits(m);
  return t != nullptr && t->min_bits == t->max_bits ? t->min_bits : 0;
}

/// "normal_float levels take 2..4 bits, got 5" or "iq4_nl levels take 4 bits, got 3" when `bits`
/// is not a width mode m takes, "mode 9 is not a Mode" for no Mode, else empty.
inline std::string mode_width_error(Mode m, int bits) {
  const detail::ModeTraits* found = detail::traits(m);
  if (found == nullptr) return "mode " + std::to_string(int(m)) + " is not a Mode";
  const detail::ModeTraits& t = *found;
  if (bits >= t.min_bits && bits <= t.max_bits) return {};
  const std::string widths = t.min_bits == t.max_bits ? std::to_string(t.min_bits)
                                                      : std::to_string(t.min_bits) + ".." + std::to_string(t.max_bits);
  return std::string(t.name) + " levels take " + widths + " bits, got " + std::to_string(bits);
}

inline constexpr int min_bits = 1;
inline constexpr int max_bits = 8;
/// Longest head vector the kernels accept; bounds their stack scratch.
inline constexpr std::size_t max_head_dim = 1024;
/// Most tokens in one per-channel group. A due group is quantized from a scratch block of
/// group x head_dim floats, so the group bounds that allocation (16 MiB at the limits).
inline constexpr std::size_t max_group_tokens = 4096;

/// Most values per group a quantizer keeps exact (dense-and-sparse outliers).
inline constexpr std::size_t max_outliers = 64;

/// Most levels a table mode names (4 bits): the kernels' code tables hold 16 entries.
inline constexpr std::size_t max_table_levels = 16;

/// The levels of a Mode::codebook quantizer (QuantizerSpec::codebook's form).
using Codebook = std::array<float, max_table_levels>;

struct QuantizerSpec {
  int bits = 4;
  std::size_t group = 32;
  Axis axis = Axis::per_token;
  Mode mode = Mode::asymmetric;
  Scalar param = Scalar::f16;
  /// Dense-and-sparse (KVQuant): the `outliers` values of each group farthest out are left out
  /// of its range and stored as corrections (kernels/quantize/reference.hpp defines which).
  std::size_t outliers = 0;
  /// Mode::codebook: the 2^bits levels, ascending, in [-1, 1], each an f16 value (the form the
  /// quantizer string spells); every other entry, and every entry of other modes, is 0.
  Codebook codebook{};

  constexpr int levels() const noexcept { return 1 << bits; }
  constexpr bool has_zero_point() const noexcept { return mode == Mode::asymmetric || mode == Mode::codebook; }
  constexpr bool operator==(const QuantizerSpec&) const = default;
};

/// Throws unless spec.codebook is what spec.mode needs: for Mode::codebook, 2^bits finite f16
/// values in [-1, 1], strictly ascending, then zeros; for other modes, all zeros.
inline void validate_codebook(const QuantizerSpec& spec, const std::string& prefix) {
  const std::size_t used = spec.mode == Mode::codebook ? std::size_t(spec.levels()) : 0;
  for (std::size_t i = 0; i < spec.codebook.size(); ++i) {
    const float level = spec.codebook[i];
    const std::string where = prefix + "codebook level " + std::to_string(i) + " (" + std::to_string(level) + ")";
    if (i >= used) {
      if (level != 0.0f || std::signbit(level))
        throw Error(
            ErrorCode::invalid_argument,
            where + (used == 0 ? " is set, but " + std::string(to_string(spec.mode)) + " levels read no codebook"
                               : " is beyond the " + std::to_string(used) + " levels of " + std::to_string(spec.bits) +
                                     " bits and must be 0"));
      continue;
    }
    if (!(level >= -1.0f && level <= 1.0f)) throw Error(ErrorCode::invalid_argument, where + " must lie in [-1, 1]");
    if (level == 0.0f && std::signbit(level))  // one spelling per codebook: +0 only
      throw Error(ErrorCode::invalid_argument, where + " is -0; write +0");
    if (round_to(Scalar::f16, level) != level) throw Error(ErrorCode::invalid_argument, where + " is not an f16 value");
    if (i > 0 && !(spec.codebook[i - 1] < level))
      throw Error(ErrorCode::invalid_argument, where + " must exceed the level before it (levels ascend)");
  }
}

/// Throws if the spec is not a quantizer kvq implements, whatever the shape.
inline void validate(const QuantizerSpec& spec, std::string_view what) {
  const std::string prefix = std::string(what) + ": ";
  if (spec.bits < min_bits || spec.bits > max_bits)
    throw Error(ErrorCode::invalid_argument, prefix + "bits must be in 1..8, got " + std::to_string(spec.bits));
  if (spec.axis != Axis::per_channel && spec.axis != Axis::per_token)
    throw Error(ErrorCode::invalid_argument, prefix + "axis " + std::to_string(int(spec.axis)) + " is not an Axis");
  if (const std::string wrong_width = mode_width_error(spec.mode, spec.bits); !wrong_width.empty())
    throw Error(ErrorCode::invalid_argument, prefix + wrong_width);  // also a value that names no Mode
  if (spec.outliers > 0 && !min_max_levels(spec.mode))
    throw Error(ErrorCode::invalid_argument, prefix + std::string(to_string(spec.mode)) +
                                                 " levels keep no outliers (got " + std::to_string(spec.outliers) +
                                                 " per group)");
  validate_codebook(spec, prefix);
  if (!is_valid(spec.param))
    throw Error(ErrorCode::invalid_argument,
                prefix + "parameter type " + std::to_string(int(spec.param)) + " is not a Scalar");
  if (spec.group == 0) throw Error(ErrorCode::invalid_argument, prefix + "group size must be positive");
  if (spec.axis == Axis::per_channel && spec.group > max_group_tokens)
    throw Error(ErrorCode::invalid_argument, prefix + "a per-channel group of " + std::to_string(spec.group) +
                                                 " tokens exceeds the limit of " + std::to_string(max_group_tokens));
  if (spec.outliers > max_outliers || (spec.outliers > 0 && spec.outliers >= spec.group))
    throw Error(ErrorCode::invalid_argument,
                prefix + std::to_string(spec.outliers) + " outliers per group must be fewer than the group's " +
                    std::to_string(spec.group) + " values and at most " + std::to_string(max_outliers));
}

/// Throws if the spec cannot be used with vectors of `head_dim` channels.
inline void validate(const QuantizerSpec& spec, std::size_t head_dim, std::string_view what) {
  validate(spec, what);
  const std::string prefix = std::string(what) + ": ";
  if (head_dim == 0 || head_dim > max_head_dim)
    throw Error(ErrorCode::invalid_argument, prefix + "head_dim must be in 1.." + std::to_string(max_head_dim) +
                                                 ", got " + std::to_string(head_dim));
  if (spec.axis == Axis::per_token && spec.group > head_dim)
    throw Error(ErrorCode::invalid_argument, prefix + "a per-token group of " + std::to_string(spec.group) +
                                                 " channels exceeds head_dim " + std::to_string(head_dim));
  if (spec.axis == Axis::per_token && spec.outliers > 0 && head_dim % spec.group != 0)
    throw Error(ErrorCode::invalid_argument, prefix + "outliers need per-token groups that divide head_dim " +
                                                 std::to_string(head_dim) + " (group " + std::to_string(spec.group) +
                                                 ")");
}

/// Parameter pairs per token row for per-token specs (the last group may be shorter).
constexpr std::size_t groups_per_row(const QuantizerSpec& spec, std::size_t head_dim) noexcept {
  return (head_dim + spec.group - 1) / spec.group;
}

/// Parameter pairs of the first `rows` packed rows of a stream (whole groups when per channel),
/// which is also the index of row `rows`' first pair: the one parameter layout of caches, views
/// and kernels.
constexpr std::size_t params_before(const QuantizerSpec& spec, std::size_t head_dim, std::size_t rows) noexcept {
  return spec.axis == Axis::per_channel ? rows / spec.group * head_dim : rows * groups_per_row(spec, head_dim);
}

/// "k4c32": tensor letter, bits, axis letter (c per channel, t per token), group; then optional
/// "o<n>" for n outliers per group, a mode suffix ("s" symmetric; "g" ggml's levels, so "k4t32g"
/// is llama.cpp's q4_0 and "k8t32g" its q8_0; "n" NormalFloat and "l" Lloyd-Max levels; "i"
/// llama.cpp's iq4_nl ("k4t32i"); "b" then the codebook's levels as f16 bit patterns, 4
/// lowercase hex digits each, and for a codebook per KV head (`heads`, the first spec.codebook)
/// "_" and the next head's levels per further head; "e4m3" / "e5m2" 8-bit floats, "k8t32e4m3")
/// and ".bf16" / ".f32" for the parameter type (default no outliers, asymmetric, f16).
inline std::string to_string(const QuantizerSpec& spec, char tensor, std::span<const Codebook> heads = {}) {
  std::string s(1, tensor);
  s += std::to_string(spec.bits);
  s += spec.axis == Axis::per_channel ? 'c' : 't';
  s += std::to_string(spec.group);
  if (spec.outliers > 0) s += 'o' + std::to_string(spec.outliers);
  s += mode_suffix(spec.mode);
  auto levels = [&](const Codebook& codebook) {
    for (int i = 0; i < spec.levels(); ++i) {
      const std::uint16_t bits = to_fp16(codebook[std::size_t(i)]).bits;
      for (int shift = 12; shift >= 0; shift -= 4) s += "0123456789abcdef"[(bits >> shift) & 15];
    }
  };
  if (spec.mode == Mode::codebook) {
    levels(spec.codebook);
    for (std::size_t h = 1; h < heads.size(); ++h) s += '_', levels(heads[h]);
  }
  if (spec.param != Scalar::f16) s += std::string(".") + to_string(spec.param);
  return s;
}

namespace detail {
/// Reads a decimal number of at most 9 digits from the front of `text`: no sign, no space, no
/// leading zero (so each number has one spelling, the one to_string writes).
inline bool parse_size(std::string_view& text, std::size_t& out) {
  std::size_t i = 0, value = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    if (i == 9 || (i == 1 && text[0] == '0')) return false;
    value = value * 10 + std::size_t(text[i++] - '0');
  }
  if (i == 0) return false;
  out = value;
  text.remove_prefix(i);
  return true;
}
}  // namespace detail

/// Parses exactly the form written by to_string (one spelling per spec: no leading zeros, no
/// suffix that names the default); `tensor` is 'k' or 'v'. Codebooks per KV head are read into
/// `heads` (the first spec.codebook), left empty for one codebook; without `heads` they are
/// refused. Throws naming the bad text.
inline QuantizerSpec parse_quantizer(std::string_view text, char tensor, std::vector<Codebook>* heads = nullptr) {
  const std::string original(text);
  auto fail = [&](const std::string& why) -> QuantizerSpec {
    throw Error(ErrorCode::invalid_argument, "quantizer '" + original + "': " + why + " (expected e.g. " + tensor +
                                                 "4c32, " + tensor + "2t64s, " + tensor + "4t32g, " + tensor +
                                                 "3c32o1, " + tensor + "8t128.bf16)");
  };
  QuantizerSpec spec;
  if (heads != nullptr) heads->clear();
  if (text.empty() || text.front() != tensor) return fail(std::string("must start with '") + tensor + "'");
  text.remove_prefix(1);
  std::size_t bits = 0;
  if (!detail::parse_size(text, bits) || bits < 1 || bits > 8) return fail("bits must be 1..8");
  spec.bits = int(bits);
  if (text.empty() || (text.front() != 'c' && text.front() != 't')) return fail("axis must be 'c' or 't'");
  spec.axis = text.front() == 'c' ? Axis::per_channel : Axis::per_token;
  text.remove_prefix(1);
  if (!detail::parse_size(text, spec.group) || spec.group == 0) return fail("group size must be a positive number");
  if (spec.axis == Axis::per_channel && spec.group > max_group_tokens)
    return fail("a per-channel group may hold at most " + std::to_string(max_group_tokens) + " tokens");
  if (!text.empty() && text.front() == 'o') {
    text.remove_prefix(1);
    if (!detail::parse_size(text, spec.outliers) || spec.outliers == 0 || spec.outliers > max_outliers ||
        spec.outliers >= spec.group)
      return fail("outliers per group must be 1.." + std::to_string(max_outliers) + " and fewer than the group");
  }
  for (const detail::ModeTraits& t : detail::mode_traits) {
    if (t.suffix.empty() || !text.starts_with(t.suffix)) continue;
    const Mode m = t.mode;
    spec.mode = m;
    text.remove_prefix(t.suffix.size());
    if (spec.outliers > 0 && m != Mode::symmetric) return fail(std::string(t.name) + " levels keep no outliers");
    if (const std::string wrong_width = mode_width_error(m, spec.bits); !wrong_width.empty()) return fail(wrong_width);
    if (m == Mode::codebook) {
      auto read_levels = [&](Codebook& out) {
        for (int i = 0; i < spec.levels(); ++i) {
          std::uint16_t half_bits = 0;
          for (int digit = 0; digit < 4; ++digit, text.remove_prefix(1)) {
            const char c = text.empty() ? '\0' : text.front();
            if ((c < '0' || c > '9') && (c < 'a' || c > 'f'))
              return fail("a codebook of " + std::to_string(spec.bits) + " bits is " + std::to_string(spec.levels()) +
                          " levels of 4 lowercase hex digits (f16 bits) after 'b'" +
                          (heads != nullptr && !heads->empty() ? " and after each '_'" : ""));
            half_bits = std::uint16_t(half_bits * 16 + (c <= '9' ? c - '0' : c - 'a' + 10));
          }
          out[std::size_t(i)] = to_float(fp16{half_bits});
        }
        QuantizerSpec level_check = spec;
        level_check.codebook = out;
        try {
          validate_codebook(level_check, heads != nullptr && !heads->empty()
                                             ? "KV head " + std::to_string(heads->size() - 1) + "'s "
                                             : std::string());
        } catch (const Error& e) {
          return fail(e.message());
        }
        return spec;
      };
      read_levels(spec.codebook);
      if (!text.empty() && text.front() == '_') {
        if (heads == nullptr) return fail("a codebook per KV head ('_') belongs to a cache configuration");
        heads->push_back(spec.codebook);
        while (!text.empty() && text.front() == '_') {
          text.remove_prefix(1);
          read_levels(heads->emplace_back());
        }
      }
    }
    break;
  }
  if (!text.empty()) {
    if (text == ".f32")
      spec.param = Scalar::f32;
    else if (text == ".bf16")
      spec.param = Scalar::bf16;
    else
      return fail("unknown suffix '" + std::string(text) + "'");
  }
  return spec;
}

}  // namespace kvq::inline v0
