// kvq-eval end to end on a model of the size people run: a synthetic GGUF of Llama 3.2 1B's shape
// (Q4_K weights, Llama 3's RoPE divisors, a byte-level BPE tokenizer of 128256 tokens; see
// llama/synthetic_llama.hpp) at a short context: tokenizer, weights, RoPE scaling, evaluation,
// generation and the advisor. Its weights are random, so this checks that every path runs and
// agrees with itself; quality is checked on the trained model in test_eval.cpp. Release builds
// only (tests/CMakeLists.txt): under the sanitizers a 1.2B-parameter model takes too long, and the
// same code runs there on the small models of the other tests.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "eval/cli.hpp"
#include "eval/printed_advice.hpp"
#include "kvq/kvq.hpp"
#include "llama/full_precision_backend.hpp"
#include "llama/inference.hpp"
#include "llama/model.hpp"
#include "llama/synthetic_llama.hpp"
#include "llama/tokenizer.hpp"

namespace {

namespace fs = std::filesystem;

const kvq::llama::testing::SyntheticLlamaShape shape;

class LlamaShape : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("kvq-llama-shape-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    kvq::llama::testing::write_synthetic_llama(model_path());
    std::ofstream(text_path()) << "Once upon a time, there was a little girl named Lily. She liked to play in the park "
                                  "with her dog.\n<|endoftext|>\nTom had a red ball. He threw it high and his friend "
                                  "caught it, and they laughed all day long.\n";
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static fs::path model_path() { return dir_ / "llama-3.2-1b-shape.gguf"; }
  static fs::path text_path() { return dir_ / "stories.txt"; }

  static int run(std::vector<std::string> args, std::string& out, std::string& err) {
    args.insert(args.end(), {"--model", model_path().string(), "--text", text_path().string(), "--out",
                             (dir_ / "results").string()});
    std::ostringstream o, e;
    const int rc = kvq::eval::run_eval(args, o, e);
    out = o.str(), err = e.str();
    return rc;
  }

  static inline fs::path dir_;
};

TEST_F(LlamaShape, LoadsTokenizerWeightsAndRopeScaling) {
  auto file = kvq::llama::GgufFile::load(model_path());
  const kvq::llama::Tokenizer tokenizer(file);
  EXPECT_EQ(tokenizer.kind(), "gpt2");
  const std::string text = "Once upon a time, Lily saw 3 cats!";
  const std::vector<int> ids = tokenizer.encode(text);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), 128000);      // llama-bpe adds <|begin_of_text|>
  EXPECT_LT(ids.size(), text.size());  // the letter-pair merges applied
  EXPECT_EQ(tokenizer.decode(std::span<const int>(ids).subspan(1)), text);

  const kvq::llama::Model model = kvq::llama::Model::take_weights(file);
  const kvq::llama::LlamaConfig& c = model.config();
  EXPECT_EQ(c.layers, 16u);
  EXPECT_EQ(c.heads, 32u);
  EXPECT_EQ(c.kv_heads, 8u);
  EXPECT_EQ(c.head_dim, 64u);
  EXPECT_EQ(c.ffn_dim, 8192u);
  EXPECT_EQ(c.vocab, 128256u);
  EXPECT_TRUE(file.tensor("blk.15.ffn_down.weight").data.empty());  // taken, not copied
  EXPECT_EQ(file.tensor("blk.15.ffn_down.weight").dims, (std::vector<std::uint64_t>{8192, 2048}));

  // The divisors the file carries rotate as the library's own Llama 3 rule does.
  kvq::RopeConfig llama3;
  llama3.head_dim = 64;
  llama3.theta = shape.rope_base;
  llama3.scaling.type = kvq::RopeScalingType::llama3;
  llama3.scaling.factor = shape.rope_factor;
  llama3.scaling.original_context = shape.original_context;
  llama3.scaling.low_freq_factor = shape.low_freq_factor;
  llama3.scaling.high_freq_factor = shape.high_freq_factor;
  const std::vector<double> expected = kvq::rope_frequencies(llama3), got = kvq::rope_frequencies(model.rope_config());
  ASSERT_EQ(got.size(), 32u);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i] / expected[i], 1.0, 1e-6) << "pair " << i;
  EXPECT_NEAR(got.back() / kvq::rope_frequencies(kvq::RopeConfig{.head_dim = 64, .theta = shape.rope_base}).back(),
              1.0 / shape.rope_factor, 1e-6);

  // Prompt chunks and single tokens give the same logits, all finite.
  const std::vector<int> tokens(ids.begin(), ids.begin() + 12);
  auto fp32 = [&] { return kvq::llama::FullPrecisionBackend(model, tokens.size()); };
  const auto tokenwise = kvq::llama::teacher_forced(model, fp32, tokens, 0);
  const auto chunked = kvq::llama::teacher_forced(model, fp32, tokens, 5);
  double max_diff = 0;
  for (std::size_t i = 0; i < tokenwise.log_probs.size(); ++i) {
    ASSERT_TRUE(std::isfinite(tokenwise.log_probs[i]));
    max_diff = std::max(max_diff, double(std::abs(tokenwise.log_probs[i] - chunked.log_probs[i])));
  }
  EXPECT_LT(max_diff, 1e-3);
}

// Two configurations (post-RoPE keys included, so the scaled rotation runs in the cache) are
// evaluated, generate from their own caches and write the CSV: one row per configuration and
// one per layer of it.
TEST_F(LlamaShape, EvaluatesAndGeneratesFromQuantizedCaches) {
  std::string out, err;
  ASSERT_EQ(run({"--context", "40", "--stories", "1", "--configs", "k4c32-v2t32-r0-s0,k2c32-v2t32-r0-s0-post",
                 "--generate", "2", "--prompt", "8", "--metric-stories", "1", "--prefill-chunk", "8"},
                out, err),
            0)
      << err;
  EXPECT_NE(out.find("(llama, 16 layers, 32 heads, 8 KV heads, head_dim 64)"), std::string::npos) << out;
  EXPECT_NE(out.find("1 stories, 39 predictions"), std::string::npos) << out;
  for (const char* config : {"k4c32-v2t32-r0-s0", "k2c32-v2t32-r0-s0-post"})
    EXPECT_NE(out.find(config), std::string::npos) << config << "\n" << out;
  const std::string csv = [&] {
    std::ifstream in(dir_ / "results" / "kvq-eval.csv");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 1 + 2 * (1 + 16)) << csv;
}

// The advisor chooses per layer among the candidates given, within the budget, and prints a
// configuration the library loads for all 16 layers.
TEST_F(LlamaShape, AdvisesAPerLayerConfigurationTheLibraryLoads) {
  std::string out, err;
  ASSERT_EQ(run({"--context", "8", "--stories", "1", "--prefill-chunk", "8", "--advise", "--configs",
                 "k8t32-v8t32-r0-s0,k2t32-v2t32-r0-s0", "--budget", "6"},
                out, err),
            0)
      << err;
  EXPECT_NE(out.find("(2 candidates per layer"), std::string::npos) << out;
  const std::vector<kvq::CacheConfig> layers = kvq::test::printed_advice(out, 16);
  for (const kvq::CacheConfig& c : layers)
    EXPECT_TRUE(c == kvq::parse_cache_config("k8t32-v8t32-r0-s0") || c == kvq::parse_cache_config("k2t32-v2t32-r0-s0"))
        << kvq::to_string(c);
  const kvq::LayeredKVCache cache(kvq::CacheShape{16, 8, 64, 64}, layers);
  EXPECT_EQ(cache.layers(), 16u);
}

}  // namespace
