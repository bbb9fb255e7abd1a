// RoPE: both pairings, inverse, and the property attention relies on: a rotated dot product
// depends only on the distance between positions. Scalings (linear, llama3, yarn, per-frequency
// divisors) and partial rotary against the published formulas written out here in double.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "kvq/rope/rope.hpp"
#include "support/random.hpp"

namespace {

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

TEST(Rope, PairsFollowTheConvention) {
  EXPECT_EQ(kvq::rope_pair(kvq::RopeStyle::adjacent_pairs, 8, 1), (std::pair<std::size_t, std::size_t>{2, 3}));
  EXPECT_EQ(kvq::rope_pair(kvq::RopeStyle::half_split, 8, 1), (std::pair<std::size_t, std::size_t>{1, 5}));
}

TEST(Rope, MatchesTheFormulaWrittenOut) {
  for (auto style : {kvq::RopeStyle::adjacent_pairs, kvq::RopeStyle::half_split}) {
    const std::size_t d = 10;
    kvq::RopeTable table({d, style, 500.0f}, 64);
    auto x = kvq::test::normal_vector(d, 1);
    auto y = x;
    table.rotate(y.data(), 37);
    for (std::size_t i = 0; i < d / 2; ++i) {
      const std::size_t a = style == kvq::RopeStyle::adjacent_pairs ? 2 * i : i;
      const std::size_t b = style == kvq::RopeStyle::adjacent_pairs ? 2 * i + 1 : i + d / 2;
      const double angle = 37.0 * std::pow(500.0, -double(2 * i) / double(d));
      EXPECT_NEAR(y[a], x[a] * std::cos(angle) - x[b] * std::sin(angle), 1e-4);
      EXPECT_NEAR(y[b], x[a] * std::sin(angle) + x[b] * std::cos(angle), 1e-4);
    }
  }
}

TEST(Rope, UnrotateInvertsAndNormsArePreserved) {
  kvq::RopeTable table({16, kvq::RopeStyle::half_split, 10000.0f}, 300);
  auto x = kvq::test::normal_vector(16, 2);
  auto y = x;
  table.rotate(y.data(), 299);
  EXPECT_NEAR(dot(y, y), dot(x, x), 1e-4);
  table.unrotate(y.data(), 299);
  for (std::size_t i = 0; i < 16; ++i) EXPECT_NEAR(y[i], x[i], 1e-5);
}

TEST(Rope, RotatedDotProductDependsOnlyOnDistance) {
  for (auto style : {kvq::RopeStyle::adjacent_pairs, kvq::RopeStyle::half_split}) {
    kvq::RopeTable table({32, style, 10000.0f}, 200);
    const auto q = kvq::test::normal_vector(32, 3), k = kvq::test::normal_vector(32, 4);
    auto score = [&](std::size_t m, std::size_t n) {
      auto qm = q, kn = k;
      table.rotate(qm.data(), m);
      table.rotate(kn.data(), n);
      return dot(qm, kn);
    };
    EXPECT_NEAR(score(50, 20), score(130, 100), 1e-3);
    EXPECT_GT(std::abs(score(50, 20) - score(50, 21)), 1e-4);
  }
}

TEST(Rope, PartialRotaryDimsAndOffsets) {
  kvq::RopeConfig c{12, kvq::RopeStyle::adjacent_pairs, 10000.0f, 8, 5};
  kvq::RopeTable shifted(c, 20), plain({12, kvq::RopeStyle::adjacent_pairs, 10000.0f, 8, 0}, 40);
  auto x = kvq::test::normal_vector(12, 5);
  auto a = x, b = x;
  shifted.rotate(a.data(), 3);
  plain.rotate(b.data(), 8);
  for (std::size_t i = 0; i < 12; ++i) EXPECT_NEAR(a[i], b[i], 1e-5);
  EXPECT_EQ(a[9], x[9]);  // channels past rotary_dims are untouched
}

TEST(Rope, TableIsAccurateAtLongPositionsAndStepsCompose) {
  // Kernels rotate by the row of a run's first position and then by a step from the step table;
  // that agrees with the row of the position itself only if every entry is the exact cos/sin
  // rounded once (a float angle is off by ~1e-3 rad near position 30000).
  const std::size_t d = 128, n = 40000;
  const kvq::RopeTable t({d, kvq::RopeStyle::half_split, 500000.0f, 0, 3}, n);
  for (const std::size_t p : {std::size_t(0), std::size_t(31), std::size_t(20011), n - 1}) {
    for (std::size_t i = 0; i < t.pairs(); ++i) {
      const double angle = double(p + 3) * std::pow(500000.0, -double(2 * i) / double(d));
      EXPECT_NEAR(t.cos_row(p)[i], std::cos(angle), 1e-7) << p << " " << i;
      EXPECT_NEAR(t.sin_row(p)[i], std::sin(angle), 1e-7) << p << " " << i;
    }
  }
  for (const std::size_t u : {std::size_t(0), std::size_t(32000), n - kvq::RopeTable::steps}) {
    for (std::size_t s = 0; s < kvq::RopeTable::steps; ++s) {
      for (std::size_t i = 0; i < t.pairs(); ++i) {
        const double c = double(t.cos_row(u)[i]) * t.step_cos(i)[s] - double(t.sin_row(u)[i]) * t.step_sin(i)[s];
        const double sn = double(t.sin_row(u)[i]) * t.step_cos(i)[s] + double(t.cos_row(u)[i]) * t.step_sin(i)[s];
        EXPECT_NEAR(c, t.cos_row(u + s)[i], 3e-7) << u << "+" << s << " pair " << i;
        EXPECT_NEAR(sn, t.sin_row(u + s)[i], 3e-7) << u << "+" << s << " pair " << i;
      }
    }
  }
}

TEST(Rope, BadConfigurationsAreRejected) {
  EXPECT_THROW(kvq::RopeTable({7, kvq::RopeStyle::adjacent_pairs}, 4), kvq::Error);
  EXPECT_THROW(kvq::RopeTable({8, kvq::RopeStyle::adjacent_pairs, 10000.0f, 10}, 4), kvq::Error);
  EXPECT_THROW(kvq::RopeTable({8, kvq::RopeStyle::adjacent_pairs, 0.5f}, 4), kvq::Error);
  kvq::RopeTable t({8}, 4);
  std::vector<float> x(8);
  EXPECT_THROW(t.rotate(x.data(), 4), kvq::Error);
  std::vector<float> odd(9);
  EXPECT_THROW(t.rotate_heads(odd, 0), kvq::Error);
}

// The frequency of pair i as the models' reference code computes it, written out independently:
// linear and yarn from Hugging Face transformers (_compute_*_parameters, yarn with truncate),
// llama3 from Meta's apply_scaling.
double published_frequency(const kvq::RopeConfig& c, std::size_t i) {
  const double dims = double(c.dims()), base = c.theta, pi = std::numbers::pi;
  const kvq::RopeScaling& s = c.scaling;
  const double inv_freq = 1.0 / std::pow(base, double(2 * i) / dims);
  double f = inv_freq;
  if (s.type == kvq::RopeScalingType::linear) f = inv_freq / s.factor;
  if (s.type == kvq::RopeScalingType::llama3) {
    const double old_context = double(s.original_context);
    const double low_freq_wavelen = old_context / s.low_freq_factor,
                 high_freq_wavelen = old_context / s.high_freq_factor;
    const double wavelen = 2 * pi / inv_freq;
    if (wavelen < high_freq_wavelen)
      f = inv_freq;
    else if (wavelen > low_freq_wavelen)
      f = inv_freq / s.factor;
    else {
      const double smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      f = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq;
    }
  }
  if (s.type == kvq::RopeScalingType::yarn) {
    auto find_correction_dim = [&](double num_rotations) {
      return dims * std::log(double(s.original_context) / (num_rotations * 2 * pi)) / (2 * std::log(base));
    };
    const double low = std::max(std::floor(find_correction_dim(s.beta_fast)), 0.0);
    double high = std::min(std::ceil(find_correction_dim(s.beta_slow)), dims - 1);
    if (low == high) high += 0.001;
    const double linear = (double(i) - low) / (high - low);
    const double extrapolation_factor = 1 - std::min(std::max(linear, 0.0), 1.0);
    f = inv_freq / s.factor * (1 - extrapolation_factor) + inv_freq * extrapolation_factor;
  }
  if (!s.frequency_divisors.empty()) f /= s.frequency_divisors[i];
  return f;
}

// cos and sin times yarn's attention factor (get_mscale: 0.1 ln(factor) + 1 unless given).
double published_magnitude(const kvq::RopeConfig& c) {
  const kvq::RopeScaling& s = c.scaling;
  if (s.type != kvq::RopeScalingType::yarn) return 1.0;
  return s.attention_factor != 0.0f ? s.attention_factor : 0.1 * std::log(double(s.factor)) + 1.0;
}

kvq::RopeScaling scaling(kvq::RopeScalingType type, float factor, std::size_t context = 0) {
  kvq::RopeScaling s;
  s.type = type, s.factor = factor, s.original_context = context;
  return s;
}
kvq::RopeScaling linear_scaling(float factor) { return scaling(kvq::RopeScalingType::linear, factor); }
kvq::RopeScaling llama3_scaling(float factor, std::size_t context, float low = 1.0f, float high = 4.0f) {
  kvq::RopeScaling s = scaling(kvq::RopeScalingType::llama3, factor, context);
  s.low_freq_factor = low, s.high_freq_factor = high;
  return s;
}
kvq::RopeScaling yarn_scaling(float factor, std::size_t context, float fast = 32.0f, float slow = 1.0f,
                              float attention = 0.0f) {
  kvq::RopeScaling s = scaling(kvq::RopeScalingType::yarn, factor, context);
  s.beta_fast = fast, s.beta_slow = slow, s.attention_factor = attention;
  return s;
}

std::vector<kvq::RopeConfig> scaled_configs() {
  std::vector<kvq::RopeConfig> all;
  for (const auto style : {kvq::RopeStyle::adjacent_pairs, kvq::RopeStyle::half_split}) {
    for (const std::size_t rotary : {std::size_t(0), std::size_t(48)}) {  // 48 of 64: partial
      kvq::RopeConfig c{64, style, 500000.0f, rotary};
      c.scaling = linear_scaling(4.0f);
      all.push_back(c);
      // Llama 3.1's parameters on a shorter head: every regime (kept, interpolated, divided) occurs.
      c.scaling = llama3_scaling(8.0f, 8192);
      all.push_back(c);
      c.scaling = yarn_scaling(4.0f, 4096);
      all.push_back(c);
      c.scaling = yarn_scaling(4.0f, 4096, 16.0f, 2.0f, 1.25f);
      all.push_back(c);
      c.scaling = {};  // per-frequency divisors alone, as llama.cpp stores Llama-3 scaling
      for (std::size_t i = 0; i < c.dims() / 2; ++i)
        c.scaling.frequency_divisors.push_back(1.0f + 0.25f * float(i % 5));
      all.push_back(c);
      c.scaling.type = kvq::RopeScalingType::linear, c.scaling.factor = 2.0f;  // both
      all.push_back(c);
    }
  }
  return all;
}

std::string describe(const kvq::RopeConfig& c) {
  return std::string(kvq::to_string(c.style)) + " dims " + std::to_string(c.dims()) + " " +
         kvq::to_string(c.scaling.type) + (c.scaling.frequency_divisors.empty() ? "" : " with divisors");
}

TEST(RopeScaling, EveryScalingMatchesThePublishedFormulas) {
  const std::size_t n = 20000;
  for (const kvq::RopeConfig& c : scaled_configs()) {
    SCOPED_TRACE(describe(c));
    const kvq::RopeTable table(c, n);
    const double m = published_magnitude(c);
    EXPECT_NEAR(table.attention_factor(), m, 1e-7);
    const auto x = kvq::test::normal_vector(c.head_dim, 11);
    for (const std::size_t p : {std::size_t(1), std::size_t(300), std::size_t(5000), std::size_t(19999)}) {
      auto y = x;
      table.rotate(y.data(), p);
      for (std::size_t i = 0; i < c.dims() / 2; ++i) {
        const std::size_t a = c.style == kvq::RopeStyle::adjacent_pairs ? 2 * i : i;
        const std::size_t b = c.style == kvq::RopeStyle::adjacent_pairs ? 2 * i + 1 : i + c.dims() / 2;
        const double angle = double(p) * published_frequency(c, i);
        EXPECT_NEAR(y[a], m * (x[a] * std::cos(angle) - x[b] * std::sin(angle)), 2e-5)
            << "position " << p << " pair " << i;
        EXPECT_NEAR(y[b], m * (x[a] * std::sin(angle) + x[b] * std::cos(angle)), 2e-5)
            << "position " << p << " pair " << i;
      }
      for (std::size_t ch = c.dims(); ch < c.head_dim; ++ch) EXPECT_EQ(y[ch], x[ch]) << "tail channel " << ch;
      table.unrotate(y.data(), p);
      for (std::size_t ch = 0; ch < c.head_dim; ++ch) EXPECT_NEAR(y[ch], x[ch], 2e-5);
    }
  }
}

TEST(RopeScaling, EachScalingChangesWhatItShould) {
  const auto x = kvq::test::normal_vector(64, 12);
  auto rotated = [&](const kvq::RopeConfig& c, std::size_t p) {
    auto y = x;
    kvq::RopeTable(c, 4096).rotate(y.data(), p);
    return y;
  };
  const kvq::RopeConfig plain{64, kvq::RopeStyle::half_split, 10000.0f};
  // linear: position 4p scaled is position p unscaled.
  kvq::RopeConfig linear = plain;
  linear.scaling = linear_scaling(4.0f);
  const auto a = rotated(linear, 4 * 777), b = rotated(plain, 777);
  for (std::size_t i = 0; i < 64; ++i) EXPECT_NEAR(a[i], b[i], 1e-5);
  // llama3: the fastest pair keeps its frequency, the slowest is divided by the factor.
  kvq::RopeConfig llama3 = plain;
  llama3.scaling = llama3_scaling(8.0f, 1024);
  const auto f = kvq::rope_frequencies(llama3), f0 = kvq::rope_frequencies(plain);
  EXPECT_EQ(f.front(), f0.front());
  EXPECT_DOUBLE_EQ(f.back(), f0.back() / 8.0);
  EXPECT_TRUE(std::is_sorted(f.rbegin(), f.rend()));  // still decreasing through the smooth region
  // yarn: the same ends, and rotated channels grow by the attention factor.
  kvq::RopeConfig yarn = plain;
  yarn.scaling = yarn_scaling(16.0f, 512);
  const auto g = kvq::rope_frequencies(yarn);
  EXPECT_EQ(g.front(), f0.front());
  EXPECT_DOUBLE_EQ(g.back(), f0.back() / 16.0);
  const kvq::RopeTable t(yarn, 16);
  EXPECT_FLOAT_EQ(t.attention_factor(), float(0.1 * std::log(16.0) + 1.0));
  auto y = x, u = x, q = x;
  t.rotate(y.data(), 5);
  t.rotate_unscaled(u.data(), 5);
  t.rotate_query(q.data(), 5);
  EXPECT_NEAR(dot(y, y), dot(x, x) * std::pow(t.attention_factor(), 2), 1e-3);
  EXPECT_NEAR(dot(u, u), dot(x, x), 1e-3);
  for (std::size_t i = 0; i < 64; ++i) {
    EXPECT_FLOAT_EQ(y[i], u[i] * t.attention_factor());
    EXPECT_FLOAT_EQ(q[i], u[i] * t.attention_factor() * t.attention_factor());
  }
  // Without yarn the three rotations are the same bits.
  const kvq::RopeTable p(plain, 16);
  auto r1 = x, r2 = x, r3 = x;
  p.rotate(r1.data(), 9), p.rotate_unscaled(r2.data(), 9), p.rotate_query(r3.data(), 9);
  EXPECT_EQ(r1, r2);
  EXPECT_EQ(r1, r3);
}

// A scaling type reads its own fields (rope_frequencies, rope_attention_factor): one it does not
// read, left over from another type, changes neither the table, nor same_rotation (which layer
// groups, shared tables and file checks go by), nor the spelling files record; every field it
// reads changes all three.
TEST(RopeScaling, OnlyTheFieldsATypeReadsTellRotationsApart) {
  const kvq::RopeConfig plain{64, kvq::RopeStyle::half_split, 10000.0f};
  kvq::RopeConfig linear = plain, llama3 = plain, yarn = plain;
  linear.scaling = linear_scaling(4.0f);
  llama3.scaling = llama3_scaling(8.0f, 1024);
  yarn.scaling = yarn_scaling(16.0f, 512);
  using Edit = void (*)(kvq::RopeScaling&);
  const std::vector<std::pair<const char*, Edit>> edits = {
      {"factor", [](kvq::RopeScaling& s) { s.factor = 3.0f; }},
      {"original_context", [](kvq::RopeScaling& s) { s.original_context = 4096; }},
      {"low_freq_factor", [](kvq::RopeScaling& s) { s.low_freq_factor = 0.5f; }},
      {"high_freq_factor", [](kvq::RopeScaling& s) { s.high_freq_factor = 6.0f; }},
      {"beta_fast", [](kvq::RopeScaling& s) { s.beta_fast = 40.0f; }},
      {"beta_slow", [](kvq::RopeScaling& s) { s.beta_slow = 2.0f; }},
      {"attention_factor", [](kvq::RopeScaling& s) { s.attention_factor = 1.5f; }},
      {"frequency_divisors", [](kvq::RopeScaling& s) { s.frequency_divisors.assign(32, 2.0f); }},
  };
  // Per type, whether it reads each field above.
  const std::vector<std::pair<kvq::RopeConfig, std::vector<bool>>> types = {
      {plain, {false, false, false, false, false, false, false, true}},
      {linear, {true, false, false, false, false, false, false, true}},
      {llama3, {true, true, true, true, false, false, false, true}},
      {yarn, {true, true, false, false, true, true, true, true}},
  };
  auto table = [](const kvq::RopeConfig& c) {  // the rotation at one position and the factor
    const kvq::RopeTable t(c, 600);
    std::vector<float> v(t.cos_row(599), t.cos_row(599) + 32);
    v.insert(v.end(), t.sin_row(599), t.sin_row(599) + 32);
    v.push_back(t.attention_factor());
    return v;
  };
  for (const auto& [base, reads] : types) {
    for (std::size_t i = 0; i < edits.size(); ++i) {
      SCOPED_TRACE(std::string(kvq::to_string(base.scaling.type)) + " scaling, " + edits[i].first);
      kvq::RopeConfig edited = base;
      edits[i].second(edited.scaling);
      kvq::validate(edited);
      EXPECT_EQ(kvq::same_rotation(base, edited), !reads[i]);
      EXPECT_EQ(kvq::canonical(base.scaling) == kvq::canonical(edited.scaling), !reads[i]) << "as files spell it";
      EXPECT_EQ(table(base) == table(edited), !reads[i]);
    }
  }
}

TEST(RopeScaling, BadParametersAreRejectedByName) {
  auto error_of = [](const kvq::RopeScaling& s, std::size_t rotary = 0) {
    kvq::RopeConfig c{64, kvq::RopeStyle::adjacent_pairs, 10000.0f, rotary};
    c.scaling = s;
    try {
      kvq::validate(c);
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(error_of(linear_scaling(0.5f)).find("factor"), std::string::npos);
  EXPECT_NE(error_of(linear_scaling(std::numeric_limits<float>::quiet_NaN())).find("factor"), std::string::npos);
  EXPECT_NE(error_of(llama3_scaling(8.0f, 0)).find("original_context"), std::string::npos);
  EXPECT_NE(error_of(llama3_scaling(8.0f, 8192, 4.0f, 1.0f)).find("low_freq_factor < high_freq_factor"),
            std::string::npos);
  EXPECT_NE(error_of(llama3_scaling(8.0f, 8192, 0.0f, 4.0f)).find("low_freq_factor"), std::string::npos);
  EXPECT_NE(error_of(yarn_scaling(4.0f, 0)).find("original_context"), std::string::npos);
  EXPECT_NE(error_of(yarn_scaling(4.0f, 4096, 1.0f, 32.0f)).find("beta_slow < beta_fast"), std::string::npos);
  EXPECT_NE(error_of(yarn_scaling(4.0f, 4096, 32.0f, 1.0f, -1.0f)).find("attention_factor"), std::string::npos);
  EXPECT_NE(error_of(scaling(kvq::RopeScalingType(9), 1.0f)).find("not a RopeScalingType"), std::string::npos);
  kvq::RopeScaling divisors;
  divisors.frequency_divisors.assign(31, 1.0f);
  EXPECT_NE(error_of(divisors).find("31 values for 32 rotated pairs"), std::string::npos);
  EXPECT_EQ(error_of(divisors, 62), "accepted");
  divisors.frequency_divisors.assign(32, 1.0f);
  divisors.frequency_divisors[7] = 0.0f;
  EXPECT_NE(error_of(divisors).find("frequency_divisors[7]"), std::string::npos);
  EXPECT_EQ(error_of(yarn_scaling(4.0f, 4096)), "accepted");
  EXPECT_EQ(error_of(scaling(kvq::RopeScalingType::none, 0.0f)), "accepted");  // fields a type does not use are ignored
}

}  // namespace
