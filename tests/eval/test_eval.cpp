// kvq-eval: the thesis on synthetic data, the orderings the real model shows, the exactness of
// the cache integration, and clear failures on bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "eval/cli.hpp"
#include "eval/printed_advice.hpp"
#include "llama/llama_test_support.hpp"

namespace {

using kvq::eval::synthetic_errors;
using kvq::eval::SyntheticSpec;

kvq::AttentionErrors synthetic(const char* config) {
  return synthetic_errors(SyntheticSpec{}, kvq::parse_cache_config(config));
}

// KIVI's error table, row by row: per-token vs per-channel.
TEST(EvalSynthetic, ReproducesTheDirectionOfEveryRowOfKivisErrorTable) {
  const auto token = synthetic("k2t32-v2t32-r0-s0"), channel = synthetic("k2c32-v2c32-r0-s0");
  EXPECT_GT(token.key_error, channel.key_error);                      // 13.67 > 4.55
  EXPECT_GT(token.score_error, channel.score_error);                  // 47.00 > 9.60
  EXPECT_GT(token.value_error, channel.value_error);                  // 4.57 > 3.73: reconstruction lies
  EXPECT_LT(token.output_error_values, channel.output_error_values);  // 3.55 < 49.89
}

TEST(EvalSynthetic, PerChannelValuesCollapseWhenSinksDominate) {
  const auto right = synthetic("k2c32-v2t32-r0-s0"), wrong_values = synthetic("k2c32-v2c32-r0-s0");
  const auto keys_per_token = synthetic("k2t32-v2t32-r0-s0"), both_wrong = synthetic("k2t32-v2c32-r0-s0");
  EXPECT_GT(wrong_values.output_error_values, 1.5 * right.output_error_values);
  EXPECT_LT(right.output_error, wrong_values.output_error);
  EXPECT_LT(right.output_error, keys_per_token.output_error);
  EXPECT_LT(right.output_error, both_wrong.output_error);
  // Without a sink the per-channel penalty on values shrinks: the sink is what collapses it.
  SyntheticSpec no_sink;
  no_sink.sink_logit = 0.0f;
  const double ratio_no_sink =
      synthetic_errors(no_sink, kvq::parse_cache_config("k2c32-v2c32-r0-s0")).output_error_values /
      synthetic_errors(no_sink, kvq::parse_cache_config("k2c32-v2t32-r0-s0")).output_error_values;
  EXPECT_LT(ratio_no_sink, wrong_values.output_error_values / right.output_error_values);
}

TEST(EvalSynthetic, ModeSaysItIsSynthetic) {
  std::ostringstream out, err;
  EXPECT_EQ(kvq::eval::run_eval({"--synthetic"}, out, err), 0);
  EXPECT_NE(out.str().find("SYNTHETIC"), std::string::npos);
  // KIVI's CoQA order is stated as KIVI's, never claimed for the synthetic error.
  EXPECT_NE(out.str().find("ranked by KIVI's CoQA accuracy (best first):  K-chan/V-tok > K-tok/V-tok > "
                           "K-chan/V-chan > K-tok/V-chan"),
            std::string::npos)
      << out.str();
  EXPECT_EQ(out.str().find("ranks the same"), std::string::npos) << out.str();
  // The synthetic ranking printed is the one its errors give.
  const auto error = [](const char* c) { return synthetic(c).output_error; };
  std::vector<std::pair<double, std::string>> order = {{error("k2t32-v2t32-r0-s0"), "K-tok/V-tok"},
                                                       {error("k2c32-v2c32-r0-s0"), "K-chan/V-chan"},
                                                       {error("k2t32-v2c32-r0-s0"), "K-tok/V-chan"},
                                                       {error("k2c32-v2t32-r0-s0"), "K-chan/V-tok"}};
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  const std::string expected = "ranked by this synthetic error (best first): " + order[0].second + " > " +
                               order[1].second + " > " + order[2].second + " > " + order[3].second + "\n";
  EXPECT_NE(out.str().find(expected), std::string::npos) << out.str();
}

class EvalModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(kvq::llama::default_model_path())) return;
    file_ = new kvq::llama::GgufFile(kvq::llama::GgufFile::load(kvq::llama::default_model_path()));
    model_ = new kvq::llama::Model(*file_);
    const kvq::llama::Tokenizer tok(*file_);
    const std::string text =
        kvq::eval::read_file(kvq::llama::data_dir() / "text" / "tinystories_valid_excerpt.txt", "text");
    eval_stories_ = kvq::eval::tokenize_stories(text, tok, 160, 4);
    eval_ = new kvq::eval::ModelEvaluation(*model_, eval_stories_, 2);
  }
  static void TearDownTestSuite() {
    delete eval_;
    delete model_;
    delete file_;
  }
  void SetUp() override { KVQ_REQUIRE_LLAMA_DATA(); }

  kvq::eval::ConfigResult run(const char* config) { return eval_->evaluate(kvq::parse_cache_config(config)); }

  static inline kvq::llama::GgufFile* file_ = nullptr;
  static inline kvq::llama::Model* model_ = nullptr;
  static inline kvq::eval::ModelEvaluation* eval_ = nullptr;
  static inline std::vector<std::vector<int>> eval_stories_;
};

TEST_F(EvalModel, PerChannelPreRopeKeysBeatPostRopeWhichBeatPerTokenKeys) {
  for (const char* b : {"2", "4"}) {
    const std::string s(b);
    const auto pre = run(("k" + s + "c32-v8t8-r0-s0").c_str()), post = run(("k" + s + "c32-v8t8-r0-s0-post").c_str());
    const auto token = run(("k" + s + "t8-v8t8-r0-s0").c_str());
    EXPECT_LT(pre.mean_kl, post.mean_kl) << b << " bits";
    EXPECT_LT(post.mean_kl, token.mean_kl) << b << " bits";
    EXPECT_LT(pre.all.score_error, post.all.score_error) << b << " bits";
    EXPECT_LT(post.all.score_error, token.all.score_error) << b << " bits";
  }
}

// Dense-and-sparse keys on the real model: one outlier per channel and group of 32 tokens cuts
// the KL of 2- and 3-bit keys (all 12 stories: 0.053 -> 0.036 and 0.0079 -> 0.0054) for half a
// bit per value (a 16-bit slot and an fp16 correction per 32 key values).
TEST_F(EvalModel, OutlierKeysCutTheKlOfNarrowKeys) {
  for (const char* b : {"2", "3"}) {
    const std::string s(b);
    const auto plain = run(("k" + s + "c32-v4t8-r0-s0").c_str()), sparse = run(("k" + s + "c32o1-v4t8-r0-s0").c_str());
    EXPECT_LT(sparse.mean_kl, 0.85 * plain.mean_kl) << b << " bits";
    EXPECT_LT(sparse.all.key_error, plain.all.key_error) << b << " bits";
    EXPECT_GT(sparse.bits_per_value - plain.bits_per_value, 0.3) << b << " bits";
    EXPECT_LE(sparse.bits_per_value - plain.bits_per_value, 0.5) << b << " bits";
  }
}

// Calibrated codebooks (a bare 'b'): fitted on the model's own greedy text, they cut the key and
// value errors they are fitted for (all 12 stories: 2-bit keys 0.110 -> 0.090, 2-bit values
// 0.249 -> 0.230); KL does not follow on this model (bench/RESULTS.md), so it is not asserted.
TEST_F(EvalModel, CalibratedCodebooksCutTheErrorsTheyAreFittedFor) {
  const auto keys = kvq::eval::codebook_request("k2c32b-v4t8-r0-s0");
  ASSERT_TRUE(keys.has_value());
  const kvq::CacheConfig fitted = kvq::eval::calibrate_codebooks(*model_, *keys);
  EXPECT_EQ(fitted, kvq::eval::calibrate_codebooks(*model_, *keys));  // deterministic
  EXPECT_EQ(kvq::parse_cache_config(kvq::to_string(fitted)), fitted);
  EXPECT_EQ(fitted.key.mode, kvq::Mode::codebook);
  EXPECT_EQ(fitted.value, kvq::parse_cache_config("k2c32-v4t8-r0-s0").value);
  EXPECT_LT(eval_->evaluate(fitted).all.key_error, 0.9 * run("k2c32-v4t8-r0-s0").all.key_error);
  const auto values = kvq::eval::codebook_request("k4c32-v2t8b-r0-s0");
  ASSERT_TRUE(values.has_value());
  EXPECT_LT(eval_->evaluate(kvq::eval::calibrate_codebooks(*model_, *values)).all.value_error,
            0.95 * run("k4c32-v2t8-r0-s0").all.value_error);
}

TEST(EvalCli, CodebookRequestsAreBareBs) {
  const auto r = kvq::eval::codebook_request("k3c32b-v2t8b.bf16-r0-s0");
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->keys && r->values);
  EXPECT_EQ(r->config.key.mode, kvq::Mode::codebook);
  EXPECT_EQ(r->config.value.param, kvq::Scalar::bf16);
  EXPECT_FALSE(r->key_heads || r->value_heads);
  const auto h = kvq::eval::codebook_request("k3c32bh-v2t8b-r0-s0");
  ASSERT_TRUE(h.has_value());
  EXPECT_TRUE(h->key_heads && !h->value_heads);
  EXPECT_EQ(h->config.key, r->config.key);  // the uniform grid until calibrated
  EXPECT_FALSE(h->key_weighted || h->value_weighted);
  const auto w = kvq::eval::codebook_request("k3c32bhw-v2t8bw.bf16-r0-s0");
  ASSERT_TRUE(w.has_value());
  EXPECT_TRUE(w->key_heads && w->key_weighted && !w->value_heads && w->value_weighted);
  EXPECT_EQ(w->config.value.param, kvq::Scalar::bf16);
  EXPECT_FALSE(kvq::eval::codebook_request("k3c32bwh-v2t8-r0-s0").has_value());       // 'w' comes last: no request,
  EXPECT_THROW((void)kvq::eval::parse_candidate("k3c32bwh-v2t8-r0-s0"), kvq::Error);  // and no configuration
  EXPECT_FALSE(kvq::eval::codebook_request("k4c32-v2t8-r0-s0").has_value());
  EXPECT_FALSE(kvq::eval::codebook_request("ggml-q4_0").has_value());
  // Spelled levels are no request, even when the last hex digit is a 'b'.
  EXPECT_FALSE(kvq::eval::codebook_request("k1c32bb800380b-v2t8-r0-s0").has_value());
  EXPECT_THROW((void)kvq::eval::codebook_request("k3c32b-v2t8-r0-s0-post"), kvq::Error);  // pre-RoPE keys only
  EXPECT_THROW((void)kvq::eval::codebook_request("k3c32o1b-v2t8-r0-s0"), kvq::Error);
  EXPECT_THROW((void)kvq::eval::codebook_request("k5c32b-v2t8-r0-s0"), kvq::Error);
}

// Per-layer text is one candidate: each layer's cache and attention metrics use its own
// configuration, and per-layer codebook requests fit each layer alone.
TEST(EvalCli, PerLayerTextIsOneCandidate) {
  const auto c = kvq::eval::parse_candidate("k8c32-v4t8-r0-s0;k4c32-v2t8-r0-s0*4");
  const auto* layers = std::get_if<kvq::eval::LayerConfigs>(&c);
  ASSERT_NE(layers, nullptr);
  ASSERT_EQ(layers->configs.size(), 5u);
  EXPECT_EQ(layers->configs[0], kvq::parse_cache_config("k8c32-v4t8-r0-s0"));
  EXPECT_EQ(layers->configs[4], kvq::parse_cache_config("k4c32-v2t8-r0-s0"));
  EXPECT_EQ(kvq::eval::name_of(c), "k8c32-v4t8-r0-s0;k4c32-v2t8-r0-s0*4");
  EXPECT_THROW((void)kvq::eval::parse_candidate("k8c32-v4t8-r0-s0;;k4c32-v2t8-r0-s0"), kvq::Error);

  const auto r = kvq::eval::layer_codebook_request("k4c32-v4t8-r0-s0;k3c32b-v2t8b-r0-s0*2");
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->layers.size(), 3u);
  EXPECT_FALSE(r->layers[0].keys || r->layers[0].values);
  EXPECT_EQ(r->layers[0].config, kvq::parse_cache_config("k4c32-v4t8-r0-s0"));
  EXPECT_TRUE(r->layers[2].keys && r->layers[2].values);
  EXPECT_EQ(r->layers[1].config.key.mode, kvq::Mode::codebook);
  EXPECT_FALSE(kvq::eval::layer_codebook_request("k4c32-v4t8-r0-s0*5").has_value());
  try {
    (void)kvq::eval::layer_codebook_request("k3c32b-v2t8-r0-s0;k9x");
    ADD_FAILURE() << "a bad item was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(e.message().find("item 2"), std::string::npos) << e.message();
  }
  EXPECT_THROW(kvq::eval::check_candidate_text("k3c32b-v2t8-r0-s0*0"), kvq::Error);
  EXPECT_THROW(kvq::eval::check_candidate_text("k3c32b-v2t8-r0-s0-post*2"), kvq::Error);  // pre-RoPE keys only
  EXPECT_NO_THROW(kvq::eval::check_candidate_text("k3c32b-v2t8-r0-s0*2"));

  std::ostringstream out, err;
  EXPECT_NE(kvq::eval::run_eval({"--advise", "--configs", "k4c32-v4t8-r0-s0*5"}, out, err), 0);
  EXPECT_NE(err.str().find("per-layer text"), std::string::npos) << err.str();
}

TEST_F(EvalModel, PerLayerTextMeasuresEachLayersOwnConfiguration) {
  const std::size_t layers = model_->config().layers;
  ASSERT_GE(layers, 2u);
  const std::string one = "k4c32-v2t8-r0-s0", rest = one + "*" + std::to_string(layers - 1);
  const auto uniform = run(one.c_str());
  const auto same = eval_->evaluate(kvq::eval::parse_candidate(one + "*" + std::to_string(layers)));
  EXPECT_EQ(same.mean_kl, uniform.mean_kl);
  EXPECT_EQ(same.bits_per_value, uniform.bits_per_value);
  EXPECT_EQ(same.all.output_error, uniform.all.output_error);
  EXPECT_EQ(kvq::eval::name_of(same), one + "*" + std::to_string(layers));
  const auto mixed = eval_->evaluate(kvq::eval::parse_candidate("k8c32-v8t8-r0-s0;" + rest));
  EXPECT_EQ(kvq::eval::name_of(mixed), "k8c32-v8t8-r0-s0;" + rest);
  ASSERT_EQ(mixed.layers.size(), layers);
  EXPECT_LT(mixed.layers[0].output_error, 0.5 * uniform.layers[0].output_error);
  EXPECT_EQ(mixed.layers[1].output_error, uniform.layers[1].output_error);  // each layer on its own cache
  EXPECT_GT(mixed.bits_per_value, uniform.bits_per_value);
  EXPECT_LT(mixed.mean_kl, uniform.mean_kl);
  EXPECT_THROW((void)eval_->evaluate(kvq::eval::parse_candidate(one + "*" + std::to_string(layers + 1))), kvq::Error);
  EXPECT_THROW((void)kvq::eval::resolve_candidate(*model_, one + "*" + std::to_string(layers - 1)), kvq::Error);
  EXPECT_EQ(kvq::eval::name_of(kvq::eval::resolve_candidate(*model_, "k8c32-v8t8-r0-s0;" + rest)),
            kvq::eval::name_of(mixed));
}

TEST_F(EvalModel, PerLayerCodebooksAreFittedToEachLayer) {
  const std::size_t layers = model_->config().layers;
  const std::string first = "k4c32-v4t8-r0-s0";
  const auto request = kvq::eval::layer_codebook_request(first + ";k2c32b-v2t8b-r0-s0*" + std::to_string(layers - 1));
  ASSERT_TRUE(request.has_value());
  const std::vector<kvq::CacheConfig> fitted = kvq::eval::calibrate_codebooks(*model_, *request);
  ASSERT_EQ(fitted.size(), layers);
  EXPECT_EQ(fitted[0], kvq::parse_cache_config(first));  // no bare 'b': as written
  const kvq::CacheConfig pooled =
      kvq::eval::calibrate_codebooks(*model_, *kvq::eval::codebook_request("k2c32b-v2t8b-r0-s0"));
  std::size_t keys_differ = 0, values_differ = 0;
  for (std::size_t l = 1; l < layers; ++l) {
    EXPECT_EQ(fitted[l].key.mode, kvq::Mode::codebook);
    EXPECT_EQ(fitted[l].value.mode, kvq::Mode::codebook);
    keys_differ += fitted[l].key.codebook != pooled.key.codebook ? 1 : 0;
    values_differ += fitted[l].value.codebook != pooled.value.codebook ? 1 : 0;
  }
  EXPECT_GE(keys_differ, 2u);  // the layers' keys differ, so do their codebooks
  EXPECT_GE(values_differ, 2u);
  const kvq::eval::Candidate read_back = kvq::eval::parse_candidate(kvq::to_string(fitted));
  const auto* back = std::get_if<kvq::eval::LayerConfigs>(&read_back);
  ASSERT_NE(back, nullptr);
  EXPECT_EQ(back->configs, fitted);
  // Layer l's levels are the fit to layer l's keys and values alone, not to a neighbour's.
  const kvq::eval::CalibrationText calibration(*model_);
  for (std::size_t l = 1; l < layers; ++l) {
    const kvq::CacheConfig& asked = request->layers[l].config;
    EXPECT_EQ(fitted[l].key, calibration.fit(asked.key, true, l, l + 1)) << "layer " << l;
    EXPECT_NE(fitted[l].key, calibration.fit(asked.key, true, l - 1, l)) << "layer " << l;
    EXPECT_EQ(fitted[l].value, calibration.fit(asked.value, false, l, l + 1)) << "layer " << l;
    EXPECT_NE(fitted[l].value, calibration.fit(asked.value, false, l - 1, l)) << "layer " << l;
  }
  EXPECT_THROW((void)calibration.fit(request->layers[1].config.key, true, layers, layers + 1), kvq::Error);
  // Text for another layer count is refused before any calibration, as parse_layer_configs refuses it.
  try {
    (void)kvq::eval::calibrate_codebooks(*model_, *kvq::eval::layer_codebook_request("k2c32b-v4t8-r0-s0*2"));
    ADD_FAILURE() << "two layers accepted for a model of " << layers;
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::ErrorCode::invalid_argument);
    EXPECT_NE(e.message().find("names 2 layers"), std::string::npos) << e.message();
  }
  // Key error and KL barely move on this model (bench/RESULTS.md), so neither is asserted.
}

// A 'w' weighs the fit by what each value's error costs: key channels by their queries' energy
// (the same within a RoPE pair), value rows by the squared attention weights they receive (between
// 1/(s+1) and 1 per query), and the fitted levels differ from the unweighted ones.
TEST_F(EvalModel, SensitivityWeightsFollowTheQueriesAndTheAttention) {
  const kvq::eval::CalibrationText calibration(*model_);
  const auto& m = model_->config();
  const std::size_t group = m.heads / m.kv_heads;
  for (std::size_t l = 0; l < m.layers; ++l)
    for (std::size_t h = 0; h < m.kv_heads; ++h) {
      const std::vector<float> k = calibration.key_channel_weights(l, h);
      ASSERT_EQ(k.size(), m.head_dim);
      for (std::size_t i = 0; i < m.head_dim / 2; ++i) {  // adjacent pairs (llama)
        EXPECT_EQ(k[2 * i], k[2 * i + 1]) << "layer " << l << ", head " << h << ", pair " << i;
        EXPECT_GT(k[2 * i], 0.0f);
      }
      const std::vector<float> v = calibration.value_row_weights(l, h);
      double total = 0.0, least = 0.0;
      for (std::size_t t = 0; t < v.size(); ++t) {
        EXPECT_TRUE(std::isfinite(v[t]) && v[t] >= 0.0f);
        total += v[t];
      }
      // Every position but perhaps the last attends; each query's squared weights sum to 1/(s+1)..1.
      for (std::size_t s = 0; s + 1 < v.size(); ++s) least += double(group) / double(s + 1);
      EXPECT_GE(total, 0.999 * least) << "layer " << l << ", head " << h;
      EXPECT_LE(total, 1.001 * double(group * v.size())) << "layer " << l << ", head " << h;
    }
  const auto plain = kvq::eval::codebook_request("k3c32b-v2t8b-r0-s0");
  const auto weighted = kvq::eval::codebook_request("k3c32bw-v2t8bw-r0-s0");
  const kvq::CacheConfig a = kvq::eval::calibrate_codebooks(*model_, *plain),
                         b = kvq::eval::calibrate_codebooks(*model_, *weighted);
  EXPECT_NE(a.key.codebook, b.key.codebook);
  EXPECT_NE(a.value.codebook, b.value.codebook);
  EXPECT_EQ(kvq::parse_cache_config(kvq::to_string(b)), b);
  EXPECT_TRUE(std::isfinite(eval_->evaluate(b).mean_kl));
}

// A bare "bh" fits one codebook per KV head, to that head's rows alone; in per-layer text, one per
// layer, head and tensor. The result runs as a cache configuration and reads back as itself.
TEST_F(EvalModel, PerHeadCodebooksAreFittedToEachHead) {
  const std::size_t layers = model_->config().layers, heads = model_->config().kv_heads;
  ASSERT_GE(heads, 2u);
  const auto request = kvq::eval::layer_codebook_request("k2c32bh-v2t8b-r0-s0*" + std::to_string(layers));
  ASSERT_TRUE(request.has_value());
  const std::vector<kvq::CacheConfig> fitted = kvq::eval::calibrate_codebooks(*model_, *request);
  ASSERT_EQ(fitted.size(), layers);
  const kvq::eval::CalibrationText calibration(*model_);
  for (std::size_t l = 0; l < layers; ++l) {
    const kvq::CacheConfig& asked = request->layers[l].config;
    ASSERT_EQ(fitted[l].key_head_codebooks.size(), heads) << "layer " << l;
    EXPECT_TRUE(fitted[l].value_head_codebooks.empty()) << "layer " << l;  // "b": one per tensor
    EXPECT_EQ(fitted[l].value, calibration.fit(asked.value, false, l, l + 1)) << "layer " << l;
    for (std::size_t h = 0; h < heads; ++h)
      EXPECT_EQ(fitted[l].key_head_codebooks[h], calibration.fit(asked.key, true, l, l + 1, h).codebook)
          << "layer " << l << ", head " << h;
    EXPECT_NE(fitted[l].key_head_codebooks[0], fitted[l].key_head_codebooks[1]) << "layer " << l;
  }
  EXPECT_THROW((void)calibration.fit(request->layers[0].config.key, true, 0, 1, heads), kvq::Error);
  const kvq::eval::Candidate read_back = kvq::eval::parse_candidate(kvq::to_string(fitted));
  const auto* back = std::get_if<kvq::eval::LayerConfigs>(&read_back);
  ASSERT_NE(back, nullptr);
  EXPECT_EQ(back->configs, fitted);
  const kvq::CacheConfig pooled =
      kvq::eval::calibrate_codebooks(*model_, *kvq::eval::codebook_request("k2c32bh-v2t8-r0-s0"));
  EXPECT_EQ(pooled.key_head_codebooks.size(), heads);  // over every layer, per head
  EXPECT_TRUE(std::isfinite(eval_->evaluate(pooled).mean_kl));
}

// The report of a per-layer result: its text as the name, one axes label where the layers agree,
// the window flag over the layers that quantize, and no point among the uniform series.
TEST(EvalReport, PerLayerResults) {
  kvq::eval::ConfigResult r;
  r.layer_configs = {kvq::parse_cache_config("k2c32-v2t8-r0-s0"), kvq::parse_cache_config("k4c32-v4t8-r0-s0")};
  r.config = r.layer_configs[0];
  EXPECT_EQ(kvq::eval::name_of(r), "k2c32-v2t8-r0-s0;k4c32-v4t8-r0-s0");
  EXPECT_EQ(kvq::eval::axes_label(r), "K chan / V tok");
  EXPECT_EQ(kvq::eval::svg_chart({r}, "t"), kvq::eval::svg_chart({}, "t"));
  r.layer_configs = {kvq::parse_cache_config("k16-v16-r0-s0"), kvq::parse_cache_config("k2c32-v2t8-r64-s0")};
  r.config = r.layer_configs[0];
  EXPECT_EQ(kvq::eval::axes_label(r), "per layer");
  EXPECT_TRUE(kvq::eval::window_covers(r, 48));  // the one layer that quantizes holds 64 tokens exact
  EXPECT_FALSE(kvq::eval::window_covers(r, 65));
  r.layer_configs[1] = r.layer_configs[0];
  EXPECT_FALSE(kvq::eval::window_covers(r, 48));  // nothing quantizes: no quantizer to flag
}

TEST_F(EvalModel, EightBitsAreNearlyLossless) {
  const auto r = run("k8c32-v8t8-r0-s0");
  EXPECT_LT(r.mean_kl, 1e-4);  // measured 1e-5 on the whole excerpt
  EXPECT_GT(r.top1, 0.99);
  EXPECT_LT(std::abs(r.mean_nll - eval_->baseline_nll()), 2e-3);
  EXPECT_LT(r.all.output_error, 0.02);
}

TEST_F(EvalModel, FullPrecisionCacheReproducesTheBaselineAndWindowsHelp) {
  const auto exact = run("k16-v16-r0-s0-f32");
  EXPECT_LT(exact.mean_kl, 1e-7);  // double vs float accumulation only
  EXPECT_EQ(exact.top1, 1.0);
  const auto no_window = run("k2c32-v2t8-r0-s0"), window = run("k2c32-v2t8-r64-s0");
  EXPECT_LT(window.mean_kl, no_window.mean_kl);
  EXPECT_GT(window.bits_per_value, no_window.bits_per_value);
}

// Decode attention replaces the reference without changing what the model measures.
TEST_F(EvalModel, DecodeAttentionTiersLeaveModelQualityUnchanged) {
  const auto config = kvq::parse_cache_config("k4c32-v2t8-r16-s1");
  const auto reference = eval_->evaluate(config);
  const kvq::eval::ModelEvaluation exact_eval(*model_, eval_stories_, 0, kvq::eval::attention_fn("exact"));
  const kvq::eval::ModelEvaluation integer_eval(*model_, eval_stories_, 0, kvq::eval::attention_fn("integer"));
  const auto exact = exact_eval.evaluate(config), integer = integer_eval.evaluate(config);
  EXPECT_NEAR(exact.mean_kl, reference.mean_kl, 1e-6);
  EXPECT_NEAR(exact.mean_nll, reference.mean_nll, 1e-4);  // fp32 vs double accumulation: measured 8e-6
  EXPECT_NEAR(integer.mean_kl, reference.mean_kl, 0.1 * reference.mean_kl);  // integer tier: measured change
  EXPECT_GT(integer.top1, reference.top1 - 0.02);
}

TEST_F(EvalModel, GreedyDecodingThroughTheCacheReproducesTheGoldenTokens) {
  const auto golden = kvq::llama::testing::read_golden();
  kvq::eval::CacheBackend kv(*model_, kvq::full_precision_config(), golden.tokens.size());
  const auto tokens = kvq::llama::greedy_generate(*model_, kv, golden.tokens.size() - 1);
  EXPECT_EQ(tokens, golden.tokens);
}

// Other engines' formats on the same model and text: 8 bits nearly lossless, fewer bits worse,
// llama.cpp's Hadamard rotation helping its 4-bit rows, e4m3 beating e5m2 at scale 1.
TEST_F(EvalModel, EngineFormatsRankAsTheirBitsSay) {
  auto engine = [&](const char* name) { return eval_->evaluate(kvq::eval::parse_candidate(name)); };
  const auto q8 = engine("ggml-q8_0"), q5 = engine("ggml-q5_0"), q4 = engine("ggml-q4_0");
  const auto q4h = engine("ggml-q4_0-hadamard"), e4m3 = engine("fp8-e4m3"), e5m2 = engine("fp8-e5m2");
  EXPECT_LT(q8.mean_kl, 0.01);  // measured 0.0022 on 12 stories
  EXPECT_GT(q8.top1, 0.95);
  EXPECT_LT(q8.mean_kl, q5.mean_kl);
  EXPECT_LT(q5.mean_kl, q4.mean_kl);
  EXPECT_LT(q4h.mean_kl, q4.mean_kl);  // measured 0.60 vs 1.17
  EXPECT_LT(e4m3.mean_kl, e5m2.mean_kl);
  EXPECT_DOUBLE_EQ(q8.bits_per_value, 8.5);  // 34 bytes per 32 values
  EXPECT_DOUBLE_EQ(q4.bits_per_value, 4.5);
  EXPECT_GT(e4m3.bits_per_value, 8.0);  // the per-tensor scales, counted
  EXPECT_LT(e4m3.bits_per_value, 8.01);
  EXPECT_TRUE(q8.layers.empty());  // no per-layer metrics for simulated formats
  EXPECT_EQ(kvq::eval::name_of(q4h), "ggml-q4_0-hadamard");
  // TurboQuant-style rows: 8-bit keys near lossless, fewer key bits worse. Rotating heads of 8
  // channels spreads this model's key outlier channels over every coordinate, and one scale per
  // token cannot follow them: kvq's per-channel keys at about the same bits lose far less
  // (measured KL 0.0038 / 0.87 / 2.02 for k8v4 / k4v2 / k3v4; k4c32-v2t8 0.024 at 5.79 bits).
  const auto t84 = engine("turbo-k8v4"), t42 = engine("turbo-k4v2"), t34 = engine("turbo-k3v4");
  EXPECT_LT(t84.mean_kl, 0.01);
  EXPECT_LT(t84.mean_kl, t42.mean_kl);
  EXPECT_LT(t42.mean_kl, t34.mean_kl);
  EXPECT_DOUBLE_EQ(t42.bits_per_value, 3.0 + 2.0);  // an fp16 scale per head vector of 8
  const auto kivi = eval_->evaluate(kvq::eval::parse_candidate("k4c32-v2t8-r0-s0"));
  EXPECT_LT(10.0 * kivi.mean_kl, t42.mean_kl);
  // fp8 in kvq's cache, a scale per token's head vector (the engines set's rows): at 2 more bits
  // per value each beats vLLM's per-tensor scale 1 (measured 0.0104 vs 0.0281, 0.0444 vs 0.142),
  // and e4m3's mantissa still beats e5m2's range.
  const auto c4 = engine("k8t8e4m3-v8t8e4m3-r0-s0-post"), c5 = engine("k8t8e5m2-v8t8e5m2-r0-s0-post");
  EXPECT_LT(c4.mean_kl, e4m3.mean_kl);
  EXPECT_LT(c5.mean_kl, e5m2.mean_kl);
  EXPECT_LT(c4.mean_kl, c5.mean_kl);
  EXPECT_DOUBLE_EQ(c4.bits_per_value, 8.0 + 2.0);  // an fp16 scale per 8 values
  // TurboQuant's layout as a kvq cache (the engines set's rows): a random-sign rotation (the
  // cache's signs), the same bits and a scale per head vector, but Lloyd-Max levels scaled by the
  // absmax instead of the RMS, which clips nothing (12 stories: KL 0.0023 against 0.0038 for
  // k8v4, 0.52 against 0.87 for k4v2).
  const auto k84 = engine("k8t8s-v4t8l-r0-s0-post-hsk-hsv"), k42 = engine("k4t8l-v2t8l-r0-s0-post-hsk-hsv");
  EXPECT_LT(k84.mean_kl, t84.mean_kl);
  EXPECT_LT(k42.mean_kl, t42.mean_kl);
  EXPECT_DOUBLE_EQ(k42.bits_per_value, t42.bits_per_value);
  // HF's layout: kvq's window always holds the newest 128 tokens exact, HF's 0 to 127 between
  // flushes; more bits, less KL (12 stories: 0.00011 at 11.1 bits against 0.0047 at 9.7).
  const auto hf4 = engine("hf-int4"), w4 = engine("k4t8-v4t8-r128-s0-post");
  EXPECT_LT(w4.mean_kl, hf4.mean_kl);
  EXPECT_GT(w4.bits_per_value, hf4.bits_per_value);
  // --set engines lists each of these beside the simulated formats.
  const auto set = kvq::eval::config_set("engines", 8);
  for (const std::string name :
       {"turbo-k3v4", "hf-int2", "k8t8e5m2-v8t8e5m2-r0-s0-post", "k3t8l-v4t8l-r0-s0-post-hsk-hsv",
        "k8t8s-v4t8l-r0-s0-post-hsk-hsv", "k2t8-v2t8-r128-s0-post"})
    EXPECT_EQ(std::count_if(set.begin(), set.end(), [&](const auto& c) { return kvq::eval::name_of(c) == name; }), 1)
        << name;
}

// Runs kvq-eval; `message` gets what it wrote to stderr.
int run_cli(std::vector<std::string> args, std::string& message) {
  std::ostringstream out, err;
  const int rc = kvq::eval::run_eval(args, out, err);
  message = err.str();
  return rc;
}

// Free-running generation (the seeds' rule 5) from BOS reproduces llama2.c's golden 256 tokens
// with the fp32 cache; near-lossless caches keep the whole continuation, 2-bit ones drift.
TEST_F(EvalModel, FreeRunningGenerationFromBos) {
  const auto golden = kvq::llama::testing::read_golden();
  const kvq::eval::GenerationEvaluation generation(*model_, {{golden.tokens[0]}}, 1, golden.tokens.size() - 1,
                                                   kvq::eval::attention_fn("exact"));
  ASSERT_EQ(generation.reference().size(), 1u);
  EXPECT_EQ(generation.reference()[0], std::vector<int>(golden.tokens.begin() + 1, golden.tokens.end()));
  for (const char* lossless : {"k16-v16-r0-s0-f32", "k16-v16-r0-s0", "k8c32-v8t8-r0-s0"}) {
    const auto g = generation.evaluate(kvq::parse_cache_config(lossless));
    EXPECT_EQ(g.mean_identical, 256.0) << lossless;
    EXPECT_EQ(g.identical_share, 1.0) << lossless;
    EXPECT_EQ(g.token_agreement, 1.0) << lossless;
    EXPECT_LT(g.mean_kl, 1e-4) << lossless;
  }
  EXPECT_LT(generation.evaluate(kvq::parse_cache_config("k16-v16-r0-s0-f32")).mean_kl, 1e-7);
  // Measured: 2-bit per-token keys keep 5 tokens (KL 2.6 nats/step), 2-bit per-channel keys 27
  // (KL 0.053), 4 bits 61 (KL 0.0012). Asserted: both 2-bit caches drift, in the order the
  // teacher-forced table gives, by wide margins.
  const auto keys_per_token = generation.evaluate(kvq::parse_cache_config("k2t8-v2t8-r0-s0"));
  const auto keys_per_channel = generation.evaluate(kvq::parse_cache_config("k2c32-v2t8-r0-s0"));
  const auto four_bits = generation.evaluate(kvq::parse_cache_config("k4c32-v4t8-r0-s0"));
  for (const auto* g : {&keys_per_token, &keys_per_channel}) {
    EXPECT_LT(g->mean_identical, 256.0);
    EXPECT_EQ(g->identical_share, 0.0);
    EXPECT_LT(g->token_agreement, 0.9);
  }
  EXPECT_GT(keys_per_token.mean_kl, 10 * keys_per_channel.mean_kl);
  EXPECT_GT(keys_per_channel.mean_kl, 10 * four_bits.mean_kl);
}

TEST_F(EvalModel, GenerationColumnsEndToEnd) {
  const auto dir = std::filesystem::temp_directory_path() / "kvq_eval_test_generate";
  std::ostringstream out, err;
  ASSERT_EQ(
      kvq::eval::run_eval({"--context", "64", "--stories", "2", "--metric-stories", "0", "--generate", "16", "--prompt",
                           "8", "--configs", "k16-v16-r0-s0-f32,k2t8-v2t8-r0-s0", "--out", dir.string()},
                          out, err),
      0)
      << err.str();
  EXPECT_NE(out.str().find("free-running generation: 2 prompts, 16 greedy tokens each"), std::string::npos)
      << out.str();
  // fp32 storage keeps every continuation: 16 identical tokens, all runs, all positions.
  EXPECT_NE(out.str().find(fmt::format("{:<28} {:>10.1f} {:>10.3f} {:>10.4f}", "k16-v16-r0-s0-f32", 16.0, 1.0, 1.0)),
            std::string::npos)
      << out.str();
  const std::string csv = kvq::eval::read_file(dir / "kvq-eval.csv", "csv");
  EXPECT_NE(csv.find(",gen_identical_tokens,gen_identical_share,gen_token_agreement,gen_kl\n"), std::string::npos);
  EXPECT_NE(csv.find("k16-v16-r0-s0-f32,K full / V full,all,"), std::string::npos);
  EXPECT_NE(csv.find(",16.0000,1.0000,1.000000,"), std::string::npos) << csv;
  const std::string svg = kvq::eval::read_file(dir / "kvq-eval.svg", "svg");
  EXPECT_NE(svg.find("generated tokens identical to fp32's (of 16)"), std::string::npos);
  std::string msg;
  EXPECT_EQ(run_cli({"--generate", "2048", "--prompt", "8", "--configs", "k8c32-v8t8-r0-s0"}, msg), 1);
  EXPECT_NE(msg.find("exceed the model's context length of 2048"), std::string::npos) << msg;
  EXPECT_EQ(run_cli({"--generate", "8", "--prompt", "600", "--configs", "k8c32-v8t8-r0-s0"}, msg), 1);
  EXPECT_NE(msg.find("no story holds a prompt of 600 tokens"), std::string::npos) << msg;
}

// A prompt fed in chunks: the fp32 continuations are the token-by-token ones, and fp32 storage
// keeps them whole.
TEST_F(EvalModel, GenerationAfterAChunkedPrompt) {
  const kvq::eval::GenerationEvaluation one_by_one(*model_, eval_stories_, 40, 24, kvq::eval::attention_fn("exact"));
  const kvq::eval::GenerationEvaluation chunked(*model_, eval_stories_, 40, 24, kvq::eval::attention_fn("exact"), 16);
  EXPECT_EQ(chunked.reference(), one_by_one.reference());
  const auto lossless = chunked.evaluate(kvq::parse_cache_config("k16-v16-r0-s0-f32"));
  EXPECT_DOUBLE_EQ(lossless.identical_share, 1.0);
  EXPECT_LT(lossless.mean_kl, 1e-6);
  const auto k2 = chunked.evaluate(kvq::parse_cache_config("k2t8-v2t8-r0-s0"));
  EXPECT_LT(k2.identical_share, 1.0);  // the quantized prompt rows still change later tokens
}

// --tokens feeds ids directly: the same ids as the tokenized text give the same numbers.
TEST_F(EvalModel, TokenFileMatchesTheText) {
  const auto dir = std::filesystem::temp_directory_path() / "kvq_eval_test_tokens";
  std::filesystem::create_directories(dir);
  const std::vector<int>& story = eval_stories_[0];
  {
    std::ofstream ids(dir / "ids.txt");
    for (std::size_t i = 0; i < 64; ++i) ids << story[i] << (i % 10 == 9 ? "\n" : "  ");
  }
  const auto run_with = [&](const std::string& flag, const std::string& path) {
    std::ostringstream out, err;
    EXPECT_EQ(kvq::eval::run_eval({flag, path, "--context", "64", "--stories", "1", "--metric-stories", "0",
                                   "--configs", "k4c32-v2t8-r0-s0", "--out", (dir / "out").string()},
                                  out, err),
              0)
        << err.str();
    const std::string s = out.str();
    return s.substr(s.find("full-precision"));  // the header names the input file
  };
  const std::string from_text =
      run_with("--text", (kvq::llama::data_dir() / "text" / "tinystories_valid_excerpt.txt").string());
  EXPECT_EQ(run_with("--tokens", (dir / "ids.txt").string()), from_text);
}

// A qwen2 model (q/k/v biases, NeoX RoPE, no tokenizer) runs end to end on token ids.
TEST(EvalCli, Qwen2ModelRunsOnTokenIds) {
  const auto dir = std::filesystem::temp_directory_path() / "kvq_eval_test_qwen2";
  std::filesystem::create_directories(dir);
  kvq::llama::testing::TinyShape shape;
  shape.dim = 32, shape.layers = 2, shape.heads = 2, shape.kv_heads = 1, shape.ffn = 24, shape.vocab = 40,
  shape.context = 64;
  const auto bytes = kvq::llama::testing::tiny_model("qwen2", shape, {}, [](kvq::llama::testing::GgufWriter& w) {
    for (const char* layer : {"blk.0.", "blk.1."})
      for (const auto& [name, n] : {std::pair{"attn_q.bias", 32}, {"attn_k.bias", 16}, {"attn_v.bias", 16}}) {
        std::vector<float> bias(static_cast<std::size_t>(n));
        for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = 0.05f * float(int(i % 7) - 3);
        w.tensor_f32(std::string(layer) + name, {std::uint64_t(n)}, bias);
      }
  });
  std::ofstream(dir / "tiny-qwen2.gguf", std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), long(bytes.size()));
  {
    std::ofstream ids(dir / "ids.txt");
    for (int i = 0; i < 96; ++i) ids << (i * 17 + 3) % 40 << ' ';
  }
  std::ostringstream out, err;
  ASSERT_EQ(kvq::eval::run_eval({"--model", (dir / "tiny-qwen2.gguf").string(), "--tokens", (dir / "ids.txt").string(),
                                 "--context", "48", "--configs", "k16-v16-r0-s0-f32,k4c32-v4t16-r0-s0", "--generate",
                                 "8", "--prompt", "4", "--out", (dir / "out").string()},
                                out, err),
            0)
      << err.str();
  const std::string s = out.str();
  EXPECT_NE(s.find("(qwen2, 2 layers, 2 heads, 1 KV heads, head_dim 16), text ids.txt: 2 stories, 94 predictions"),
            std::string::npos)
      << s;
  // fp32 storage through the library's cache and attention agrees with the engine's fp32 run.
  EXPECT_NE(s.find(fmt::format("{:<28} {:>10.1f} {:>10.3f} {:>10.4f}", "k16-v16-r0-s0-f32", 8.0, 1.0, 1.0)),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("k16-v16-r0-s0-f32            K full / V full   32.00  +0.0000   0.00000  1.0000"),
            std::string::npos)
      << s;
}

TEST(EvalCli, TokenFileErrors) {
  const auto dir = std::filesystem::temp_directory_path() / "kvq_eval_test_token_errors";
  std::filesystem::create_directories(dir);
  const auto write = [&](const char* name, const char* text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  const auto error_of = [&](const std::string& path) {
    try {
      (void)kvq::eval::read_token_stories(path, 512, 4, 0);
    } catch (const kvq::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of(write("big.txt", "1 2\n512 3")).find("token 3 of"), std::string::npos);
  EXPECT_NE(error_of(write("big.txt", "1 2\n512 3")).find("512, is outside the model's vocabulary of 512"),
            std::string::npos);
  EXPECT_NE(error_of(write("huge.txt", "1 99999999999999999999999")).find("outside"), std::string::npos);
  EXPECT_NE(error_of(write("word.txt", "1 2 x3")).find("'x3', is not a token id"), std::string::npos);
  EXPECT_NE(error_of(write("neg.txt", "1 -2")).find("'-2', is not a token id"), std::string::npos);
  EXPECT_NE(error_of(write("one.txt", " 7 \n")).find("fewer than two"), std::string::npos);
  EXPECT_NE(error_of((dir / "absent.txt").string()).find("absent.txt"), std::string::npos);
  // Cut into sequences of --context ids; a last lone id is dropped; --stories limits.
  const std::string nine = write("nine.txt", "0 1 2 3\t4 5\n6 7 8");
  EXPECT_EQ(kvq::eval::read_token_stories(nine, 512, 4, 0),
            (std::vector<std::vector<int>>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(kvq::eval::read_token_stories(write("ten.txt", "0 1 2 3 4 5 6 7 8 9"), 512, 4, 0).back(),
            (std::vector<int>{8, 9}));
  EXPECT_EQ(kvq::eval::read_token_stories(nine, 512, 4, 1).size(), 1u);
  std::string msg;
  EXPECT_EQ(run_cli({"--text", "a.txt", "--tokens", nine}, msg), 1);
  EXPECT_NE(msg.find("not both"), std::string::npos) << msg;
}

// Bad input: one clear message and a non-zero exit, never a crash.

TEST(EvalCli, BadInputGivesOneClearMessage) {
  const auto dir = std::filesystem::temp_directory_path() / "kvq_eval_test";
  std::filesystem::create_directories(dir);
  std::string msg;
  EXPECT_EQ(run_cli({"--model", (dir / "missing.gguf").string()}, msg), 1);
  EXPECT_NE(msg.find("missing.gguf"), std::string::npos) << msg;
  EXPECT_EQ(run_cli({"--configs", "k4x32-v2t8"}, msg), 1);
  EXPECT_NE(msg.find("k4x32"), std::string::npos) << msg;
  EXPECT_EQ(run_cli({"--model", dir.string()}, msg), 1);  // a directory's size read as 2^63-1: bad_alloc
  EXPECT_NE(msg.find("is a directory"), std::string::npos) << msg;
  EXPECT_EQ(run_cli({"--frobnicate"}, msg), 1);
  EXPECT_NE(msg.find("--frobnicate"), std::string::npos) << msg;
  EXPECT_EQ(run_cli({"--stories", "-3"}, msg), 1);
  EXPECT_EQ(run_cli({"--set", "everything"}, msg), 1);
  EXPECT_EQ(run_cli({"--attention", "fast"}, msg), 1);
  EXPECT_NE(msg.find("fast"), std::string::npos) << msg;
  EXPECT_EQ(run_cli({"--configs", "k4c32-v4t8-r0-s0,ggml-q3_0"}, msg), 1);
  EXPECT_NE(msg.find("unknown ggml cache type 'q3_0'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl"), std::string::npos) << msg;
  EXPECT_EQ(run_cli({"--configs", "fp8-e4m3fn"}, msg), 1);
  EXPECT_NE(msg.find("unknown engine format 'fp8-e4m3fn'"), std::string::npos) << msg;
  EXPECT_EQ(run_cli({"--configs", "ggml-q8_0-hadamrd"}, msg), 1);
  EXPECT_NE(msg.find("q8_0-hadamrd"), std::string::npos) << msg;

  // A GGUF of another architecture, and a truncated one.
  kvq::llama::testing::GgufWriter w;
  w.str("general.architecture", "gpt2");
  const auto bytes = w.bytes();
  std::ofstream(dir / "gpt2.gguf", std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), long(bytes.size()));
  EXPECT_EQ(run_cli({"--model", (dir / "gpt2.gguf").string()}, msg), 1);
  EXPECT_NE(msg.find("gpt2"), std::string::npos) << msg;
  std::ofstream(dir / "short.gguf", std::ios::binary).write("GGUF\3\0\0\0", 8);
  EXPECT_EQ(run_cli({"--model", (dir / "short.gguf").string()}, msg), 1);
  EXPECT_NE(msg.find("short.gguf"), std::string::npos) << msg;

  if (std::filesystem::exists(kvq::llama::default_model_path())) {
    EXPECT_EQ(run_cli({"--text", (dir / "no-such-text.txt").string()}, msg), 1);
    EXPECT_NE(msg.find("no-such-text.txt"), std::string::npos) << msg;
  }
  std::ostringstream out, err;
  EXPECT_EQ(kvq::eval::run_eval({"--help"}, out, err), 0);
  EXPECT_NE(out.str().find("usage"), std::string::npos);
}

// ' 5', '+5' and '05' were accepted by std::stoul; every count option takes plain digits only.
TEST(EvalCli, CountsArePlainDigits) {
  std::string msg;
  for (const char* option : {"--context", "--stories", "--metric-stories", "--prefill-chunk"})
    for (const char* bad : {" 5", "+5", "05", "5 ", "-0", "0x10", "", "1e3", "5,", "99999999999999999999999"}) {
      EXPECT_EQ(run_cli({option, bad}, msg), 1) << option << " '" << bad << "'";
      EXPECT_NE(msg.find(option), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::string("'") + bad + "'"), std::string::npos) << msg;
    }
  EXPECT_NE((run_cli({"--stories", "99999999999999999999999"}, msg), msg).find("too large"), std::string::npos) << msg;
  for (const char* tiny : {"0", "1"}) {
    EXPECT_EQ(run_cli({"--context", tiny}, msg), 1);
    EXPECT_NE(msg.find("at least 2"), std::string::npos) << msg;
  }
  EXPECT_EQ(run_cli({"--prefill-chunk", "0"}, msg), 1);
  EXPECT_NE(msg.find("--prefill-chunk must be at least 1"), std::string::npos) << msg;
  EXPECT_EQ(run_cli({"--prefill-chunk", "sixty"}, msg), 1);
  EXPECT_NE(msg.find("--prefill-chunk needs a non-negative whole number in plain digits, got 'sixty'"),
            std::string::npos)
      << msg;
  EXPECT_EQ(kvq::eval::parse_options({}).prefill_chunk, 0u);  // token by token unless asked
  EXPECT_EQ(kvq::eval::parse_options({"--prefill-chunk", "64"}).prefill_chunk, 64u);
  const auto o = kvq::eval::parse_options({"--context", "64", "--stories", "0", "--metric-stories", "10"});
  EXPECT_EQ(o.context, 64u);
  EXPECT_EQ(o.stories, 0u);
  EXPECT_EQ(o.metric_stories, 10u);
}

// The report says how the stories were fed; in chunks a quantized cache is no further from fp32.
TEST(EvalCli, PrefillChunksAreStatedAndNoWorse) {
  if (!std::filesystem::exists(kvq::llama::default_model_path())) GTEST_SKIP() << kvq::llama::data_help();
  const auto kl_of = [](const std::string& text) {  // the KL column of the one configuration's row
    std::istringstream row(text.substr(text.find("\nk4c32-v2t8-r0-s0 ") + 1));
    std::string name, axis1, axis2, axis3, axis4, axis5, bits, dppl;
    double kl = -1;
    row >> name >> axis1 >> axis2 >> axis3 >> axis4 >> axis5 >> bits >> dppl >> kl;
    return kl;
  };
  const std::vector<std::string> common = {"--configs",
                                           "k4c32-v2t8-r0-s0",
                                           "--stories",
                                           "2",
                                           "--context",
                                           "128",
                                           "--metric-stories",
                                           "0",
                                           "--out",
                                           (std::filesystem::temp_directory_path() / "kvq_eval_prefill").string()};
  std::ostringstream token_by_token, chunked, err;
  ASSERT_EQ(kvq::eval::run_eval(common, token_by_token, err), 0) << err.str();
  auto args = common;
  args.insert(args.end(), {"--prefill-chunk", "32"});
  ASSERT_EQ(kvq::eval::run_eval(args, chunked, err), 0) << err.str();
  EXPECT_NE(token_by_token.str().find("stories fed one token at a time"), std::string::npos) << token_by_token.str();
  EXPECT_NE(chunked.str().find("stories fed in prefill chunks of 32 tokens"), std::string::npos) << chunked.str();
  const double kl_token = kl_of(token_by_token.str()), kl_chunk = kl_of(chunked.str());
  EXPECT_GT(kl_token, 0.0) << token_by_token.str();
  EXPECT_GT(kl_chunk, 0.0) << chunked.str();
  EXPECT_LE(kl_chunk, kl_token * 1.05);
}

TEST(EvalCli, ContextDefaultsTo512CappedAtTheModelAndRefusesMore) {
  kvq::eval::EvalOptions o;
  std::ostringstream note;
  EXPECT_EQ(kvq::eval::resolve_context(o, 2048, note), 512u);
  EXPECT_EQ(note.str(), "");
  EXPECT_EQ(kvq::eval::resolve_context(o, 256, note), 256u);
  EXPECT_NE(note.str().find("capped at the model's context length of 256"), std::string::npos) << note.str();
  o.context = 2048;
  EXPECT_EQ(kvq::eval::resolve_context(o, 2048, note), 2048u);
  o.context = 2049;
  EXPECT_THROW((void)kvq::eval::resolve_context(o, 2048, note), kvq::Error);

  if (!std::filesystem::exists(kvq::llama::default_model_path())) return;
  std::string msg;
  EXPECT_EQ(run_cli({"--context", "4096"}, msg), 1);
  EXPECT_NE(msg.find("--context 4096"), std::string::npos) << msg;
  EXPECT_NE(msg.find("context length of 2048"), std::string::npos) << msg;
}

kvq::eval::ConfigResult result_of(const char* config) {
  kvq::eval::ConfigResult r;
  r.config = kvq::parse_cache_config(config);
  return r;
}

// The chart gains a linear third panel only when generation ran; points sit at their value.
TEST(EvalReport, ChartShowsGenerationWhenMeasured) {
  std::vector<kvq::eval::ConfigResult> results = {result_of("k2c32-v2t8-r0-s0"), result_of("k4c32-v4t8-r0-s0")};
  results[0].bits_per_value = 4, results[1].bits_per_value = 8;
  results[0].mean_kl = 0.1, results[1].mean_kl = 0.01;
  const std::string without = kvq::eval::svg_chart(results, "t");
  EXPECT_EQ(without.find("generated tokens"), std::string::npos);
  EXPECT_NE(without.find("width=\"920\""), std::string::npos);
  for (auto& r : results) r.generation = kvq::eval::GenerationResult{1, 100, 0, 0, 0, 0};
  results[0].generation->mean_identical = 25, results[1].generation->mean_identical = 100;
  const std::string with = kvq::eval::svg_chart(results, "t");
  EXPECT_NE(with.find("generated tokens identical to fp32's (of 100)"), std::string::npos);
  EXPECT_NE(with.find("width=\"1380\""), std::string::npos);
  // Panel 3 spans x 980..1360 for 0..8 bits; 25 of 100 sits 3/4 down the 230-pixel height from 40.
  EXPECT_NE(with.find("<circle cx=\"1170\" cy=\"212.5\""), std::string::npos) << with;
  EXPECT_NE(with.find("<circle cx=\"1360\" cy=\"40\""), std::string::npos) << with;
}

// A window (plus sinks) as long as the story quantizes nothing: such rows are flagged.
TEST(EvalReport, FlagsConfigurationsWhoseWindowCoversTheLongestStory) {
  const std::vector<kvq::eval::ConfigResult> results = {result_of("k2c32-v2t8-r128-s0"), result_of("k2c32-v2t8-r32-s0"),
                                                        result_of("k2c32-v2t8-r96-s4"), result_of("k16-v16-r0-s0")};
  std::ostringstream covered, longer, unknown;
  kvq::eval::print_table(covered, results, 1.0, 100);
  EXPECT_NE(covered.str().find("k2c32-v2t8-r128-s0* "), std::string::npos) << covered.str();
  EXPECT_NE(covered.str().find("k2c32-v2t8-r96-s4* "), std::string::npos) << covered.str();  // 96 + 4 sinks
  EXPECT_NE(covered.str().find("k2c32-v2t8-r32-s0 "), std::string::npos) << covered.str();
  EXPECT_NE(covered.str().find("k16-v16-r0-s0 "), std::string::npos) << covered.str();  // nothing to quantize anyway
  EXPECT_NE(covered.str().find("* sinks + window cover the longest story (100 tokens)"), std::string::npos)
      << covered.str();
  kvq::eval::print_table(longer, results, 1.0, 101);
  EXPECT_NE(longer.str().find("r128-s0*"), std::string::npos);
  EXPECT_EQ(longer.str().find("r96-s4*"), std::string::npos) << longer.str();
  kvq::eval::print_table(unknown, results, 1.0);
  EXPECT_EQ(unknown.str().find('*'), std::string::npos) << unknown.str();
}

TEST(EvalCli, ShortContextFlagsTheWindowEndToEnd) {
  if (!std::filesystem::exists(kvq::llama::default_model_path())) GTEST_SKIP() << kvq::llama::data_help();
  const auto dir = std::filesystem::temp_directory_path() / "kvq_eval_test_flag";
  std::ostringstream out, err;
  ASSERT_EQ(kvq::eval::run_eval({"--context", "48", "--stories", "1", "--metric-stories", "0", "--configs",
                                 "k2c32-v2t8-r64-s0,k2c32-v2t8-r16-s0", "--out", dir.string()},
                                out, err),
            0)
      << err.str();
  EXPECT_NE(out.str().find("k2c32-v2t8-r64-s0*"), std::string::npos) << out.str();
  EXPECT_EQ(out.str().find("k2c32-v2t8-r16-s0*"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("longest story (48 tokens)"), std::string::npos) << out.str();
}

TEST(EvalCli, PerLayerTextRunsEndToEnd) {
  if (!std::filesystem::exists(kvq::llama::default_model_path())) GTEST_SKIP() << kvq::llama::data_help();
  const auto dir = std::filesystem::temp_directory_path() / "kvq_eval_test_layers";
  std::ostringstream out, err;
  ASSERT_EQ(kvq::eval::run_eval(
                {"--context", "48", "--stories", "1", "--metric-stories", "1", "--generate", "8", "--prompt", "24",
                 "--configs", "k16-v16-r0-s0;k2c32-v2t8-r0-s0*4,k2c32b-v2t8-r0-s0*5", "--out", dir.string()},
                out, err),
            0)
      << err.str();
  const std::string text = out.str();
  EXPECT_NE(text.find("k16-v16-r0-s0;k2c32-v2t8-r0-s0*4 per layer"), std::string::npos) << text;
  // The calibrated text: five layers, each with its own spelled levels, and a generation row.
  const std::size_t fitted = text.find("k2c32bb");
  ASSERT_NE(fitted, std::string::npos) << text;
  EXPECT_EQ(
      std::count(text.begin() + std::ptrdiff_t(fitted), text.begin() + std::ptrdiff_t(text.find(' ', fitted)), ';'), 4);
  // Both candidates also have a generation row, under the same names.
  const std::size_t generation = text.find("free-running generation");
  ASSERT_NE(generation, std::string::npos) << text;
  EXPECT_NE(text.find("k16-v16-r0-s0;k2c32-v2t8-r0-s0*4", generation), std::string::npos) << text;
  EXPECT_NE(text.find(text.substr(fitted, 40), generation), std::string::npos) << text;
}

// The advisor: its choice is exact under its additive model, within the budget, never worse
// than the best uniform configuration it measured, and written in a form the library loads.

TEST(EvalAdvisor, ChoiceMatchesExhaustiveSearch) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> kl(0.0, 1.0), b(2.0, 9.0);
  for (int trial = 0; trial < 50; ++trial) {
    const std::size_t layers = 1 + trial % 4, n = 2 + trial % 5;
    std::vector<double> bits(n);
    for (double& x : bits) x = b(rng);
    std::vector<std::vector<double>> alone(layers, std::vector<double>(n));
    for (auto& row : alone)
      for (double& x : row) x = kl(rng);
    const double budget = b(rng);
    double best = std::numeric_limits<double>::infinity();
    std::vector<std::size_t> pick(layers, 0);
    for (std::size_t code = 0, total = std::size_t(std::pow(double(n), double(layers))); code < total; ++code) {
      double sum_bits = 0, sum_kl = 0;
      for (std::size_t l = 0, c = code; l < layers; ++l, c /= n) sum_bits += bits[c % n], sum_kl += alone[l][c % n];
      if (sum_bits <= budget * double(layers)) best = std::min(best, sum_kl);
    }
    const auto choices = kvq::eval::choose_layers(alone, bits, budget, 3);
    if (!std::isfinite(best)) {
      EXPECT_TRUE(choices.empty()) << "trial " << trial;
      continue;
    }
    ASSERT_FALSE(choices.empty()) << "trial " << trial;
    double sum_bits = 0, sum_kl = 0;
    for (std::size_t l = 0; l < layers; ++l) sum_bits += bits[choices[0][l]], sum_kl += alone[l][choices[0][l]];
    EXPECT_LE(sum_bits, budget * double(layers) * (1 + 1e-9)) << "trial " << trial;
    EXPECT_NEAR(sum_kl, best, 1e-12) << "trial " << trial;
  }
}

TEST_F(EvalModel, AdvisorBeatsOrMatchesTheBestUniformConfigurationWithinItsBudget) {
  std::vector<kvq::CacheConfig> candidates;
  for (const char* c : {"k16-v16-r0-s0", "k2c32-v2c32-r0-s0", "k3c32-v2c32-r0-s0", "k4c32-v2c32-r0-s0",
                        "k2c32-v4c32-r0-s0", "k4c32-v4c32-r0-s0", "k8c32-v8c32-r0-s0", "k2t8-v2t8-r0-s0"})
    candidates.push_back(kvq::parse_cache_config(c));
  const std::size_t layers = model_->config().layers;
  const auto serial = [](std::size_t n, auto job) {
    for (std::size_t i = 0; i < n; ++i) job(i);
  };
  // Two stories of 96 tokens: three whole key groups each, so 2-bit keys and values cost 3 bits.
  const std::vector<std::vector<int>> stories(eval_stories_.begin(), eval_stories_.begin() + 2);
  std::vector<std::vector<int>> short_stories;
  for (const auto& s : stories)
    short_stories.emplace_back(s.begin(), s.begin() + std::min<std::ptrdiff_t>(96, std::ssize(s)));
  const kvq::eval::ModelEvaluation evaluation(*model_, short_stories, 0);
  const double budget = 3.4;
  const kvq::eval::Advice a = kvq::eval::advise(evaluation, layers, candidates, budget, serial);
  ASSERT_EQ(a.choice.size(), layers);
  EXPECT_LE(a.advised.bits_per_value, budget + 1e-9);
  ASSERT_TRUE(a.best_uniform.has_value());
  EXPECT_LE(a.advised.mean_kl, a.uniform[*a.best_uniform].mean_kl);
  // A layer alone costs less than every layer at once, and fp16 alone next to nothing.
  for (std::size_t l = 0; l < layers; ++l) {
    EXPECT_LT(a.alone[l][0], 1e-4) << "layer " << l;
    EXPECT_LT(a.alone[l][1], a.uniform[1].mean_kl) << "layer " << l;
  }
  // The printed configuration is what the library loads, and loads back as the choice.
  std::ostringstream out;
  kvq::eval::print_advice(out, a);
  const std::string text = kvq::to_string(std::span<const kvq::CacheConfig>(a.configs()));
  EXPECT_NE(out.str().find(text), std::string::npos) << out.str();
  EXPECT_EQ(kvq::parse_layer_configs(text, layers), a.configs());
  // The advised bits are the mean of the chosen layers' uniform bits: layers have one shape.
  double mean_bits = 0;
  for (const std::size_t c : a.choice) mean_bits += a.uniform[c].bits_per_value / double(layers);
  EXPECT_NEAR(a.advised.bits_per_value, mean_bits, 1e-9);
}

TEST(EvalCli, AdviseOptions) {
  std::string msg;
  EXPECT_EQ(run_cli({"--budget", "4"}, msg), 1);
  EXPECT_NE(msg.find("--budget applies to --advise only"), std::string::npos) << msg;
  for (const char* bad : {"0", "-1", "abc", "4x", "nan", "inf", ""}) {
    EXPECT_EQ(run_cli({"--advise", "--budget", bad}, msg), 1) << bad;
    EXPECT_NE(msg.find("--budget needs a positive number"), std::string::npos) << msg;
  }
  EXPECT_EQ(run_cli({"--advise", "--set", "full"}, msg), 1);
  EXPECT_NE(msg.find("does not combine"), std::string::npos) << msg;
  EXPECT_EQ(run_cli({"--advise", "--configs", "k4c32-v2t8-r0-s0,ggml-q4_0"}, msg), 1);
  EXPECT_NE(msg.find("'ggml-q4_0' is an engine format"), std::string::npos) << msg;
  if (std::filesystem::exists(kvq::llama::default_model_path())) {
    EXPECT_EQ(run_cli({"--advise", "--budget", "1.5", "--stories", "1", "--context", "16"}, msg), 1);
    EXPECT_NE(msg.find("below the smallest configuration"), std::string::npos) << msg;
  }
}

// The advisor's own candidates: fp16, the 64 bit and axis combinations without sinks, and the 36
// at 2 to 4 bits with 4 sinks; all distinct, none with a window.
TEST(EvalCli, AdvisorCandidates) {
  const std::vector<kvq::CacheConfig> candidates = kvq::eval::advisor_candidates(64);
  ASSERT_EQ(candidates.size(), 101u);
  std::size_t with_sinks = 0;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const kvq::CacheConfig& c = candidates[i];
    EXPECT_EQ(c.window, 0u) << kvq::to_string(c);
    if (c.sinks != 0) {
      ++with_sinks;
      EXPECT_EQ(c.sinks, 4u);
      EXPECT_LE(c.key.bits, 4);
      EXPECT_LE(c.value.bits, 4);
    }
    for (std::size_t j = 0; j < i; ++j) EXPECT_FALSE(candidates[j] == c) << kvq::to_string(c);
  }
  EXPECT_EQ(with_sinks, 36u);
}

// --configs gives the advisor its candidates: the advice is made of them alone, and a budget
// below all of them names the smallest of theirs.
TEST(EvalCli, AdvisesAmongGivenCandidates) {
  KVQ_REQUIRE_LLAMA_DATA();
  const std::string candidates = "k4c32-v4c32-r0-s0,k2c32-v2c32-r0-s0";
  std::ostringstream printed, errors;
  ASSERT_EQ(
      kvq::eval::run_eval({"--advise", "--configs", candidates, "--budget", "4", "--stories", "2", "--context", "96"},
                          printed, errors),
      0)
      << errors.str();
  std::string out = printed.str();
  EXPECT_NE(out.find("(2 candidates per layer"), std::string::npos) << out;
  const std::vector<kvq::CacheConfig> layers = kvq::test::printed_advice(out, 5);
  for (const kvq::CacheConfig& c : layers)
    EXPECT_TRUE(c == kvq::parse_cache_config("k4c32-v4c32-r0-s0") || c == kvq::parse_cache_config("k2c32-v2c32-r0-s0"))
        << kvq::to_string(c);
  EXPECT_EQ(run_cli({"--advise", "--configs", candidates, "--budget", "2", "--stories", "1", "--context", "96"}, out),
            1);
  EXPECT_NE(out.find("below the smallest configuration"), std::string::npos) << out;
}

}  // namespace
