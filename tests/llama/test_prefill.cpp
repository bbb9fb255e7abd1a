// Chunked prefill on the real model: Model::forward_chunk against token-by-token forward with the
// fp32 backend and lossless kvq caches (pre- and post-RoPE, every attention routine), quantized
// caches that attend to each chunk exactly before storing it, and bad input.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "eval/cache_backend.hpp"
#include "llama/full_precision_backend.hpp"
#include "llama/inference.hpp"
#include "llama/llama_test_support.hpp"
#include "llama/model.hpp"
#include "llama/tokenizer.hpp"

namespace kvq::llama {
namespace {

using testing::error_text;
using testing::relative_difference;

class Prefill : public ::testing::Test {
 protected:
  void SetUp() override {
    KVQ_REQUIRE_LLAMA_DATA();
    const GgufFile file = GgufFile::load(default_model_path());
    model_ = std::make_unique<Model>(file);
    // 150 tokens of held-out text.
    tokens_ = testing::joined_stories(Tokenizer(file), kTokens);
    ASSERT_EQ(tokens_.size(), kTokens);
  }

  std::vector<float> logits_fp32(std::size_t chunk) const {
    FullPrecisionBackend kv(*model_, tokens_.size());
    return prefill_logits(*model_, kv, tokens_, chunk);
  }
  std::vector<float> logits_cache(const char* config, const char* attention, std::size_t chunk) const {
    eval::CacheBackend kv(*model_, parse_cache_config(config), tokens_.size(), eval::attention_fn(attention));
    return prefill_logits(*model_, kv, tokens_, chunk);
  }

  // Mean KL(p || q) of the next-token distributions given as logits, nats per position.
  double mean_kl(const std::vector<float>& p, const std::vector<float>& q) const {
    const std::size_t vocab = model_->config().vocab;
    std::vector<float> lp(vocab), lq(vocab);
    double total = 0;
    for (std::size_t pos = 0; pos < tokens_.size(); ++pos) {
      log_softmax(std::span(p).subspan(pos * vocab, vocab), lp);
      log_softmax(std::span(q).subspan(pos * vocab, vocab), lq);
      for (std::size_t i = 0; i < vocab; ++i) total += std::exp(double(lp[i])) * (double(lp[i]) - lq[i]);
    }
    return total / double(tokens_.size());
  }

  static constexpr std::size_t kTokens = 150;
  std::unique_ptr<Model> model_;
  std::vector<int> tokens_;
};

// The same model function either way: only the order of float sums differs.
TEST_F(Prefill, FullPrecisionChunksGiveTheTokenByTokenLogits) {
  const auto one_by_one = logits_fp32(0);
  for (const std::size_t chunk : {1u, 7u, 64u, 150u}) {
    const auto chunked = logits_fp32(chunk);
    ASSERT_EQ(chunked.size(), one_by_one.size());
    const double difference = relative_difference(chunked, one_by_one);
    std::printf("fp32 backend, chunks of %3zu: largest logit difference %.2e of the largest logit\n", chunk,
                difference);
    EXPECT_LT(difference, 1e-5) << "chunk " << chunk;  // measured 0 (one token: the same products), 1.1e-6
  }
}

// A cache that stores fp32 rows loses nothing, so attending to a chunk's new rows instead of its
// stored rows changes nothing either: pre- and post-RoPE keys (the new keys follow the cache's
// key_rope), decode attention's exact and integer tiers and the Eigen oracle.
TEST_F(Prefill, LosslessCachesGiveTheTokenByTokenLogitsForEveryAttention) {
  const auto fp32 = logits_fp32(0);
  for (const char* config : {"k16-v16-r0-s0-f32", "k16-v16-r0-s0-post-f32"})
    for (const char* attention : {"reference", "exact", "integer"}) {
      const double one_by_one = relative_difference(logits_cache(config, attention, 0), fp32);
      const double chunk7 = relative_difference(logits_cache(config, attention, 7), fp32);
      const double chunk64 = relative_difference(logits_cache(config, attention, 64), fp32);
      std::printf("%-24s %-9s largest logit difference from fp32: token by token %.2e, chunks of 7 %.2e, of 64 %.2e\n",
                  config, attention, one_by_one, chunk7, chunk64);
      EXPECT_LT(one_by_one, 1e-5) << config << " " << attention;  // measured at most 1.4e-6
      EXPECT_LT(chunk7, 1e-5) << config << " " << attention;
      EXPECT_LT(chunk64, 1e-5) << config << " " << attention;
    }
}

// A quantizing cache: in chunks, a position attends to its chunk's keys and values exactly
// instead of quantized, so the next-token distribution is at least as close to fp32's.
TEST_F(Prefill, QuantizedChunksAreNoFurtherFromFp32ThanTokenByToken) {
  const auto fp32 = logits_fp32(0);
  for (const char* config : {"k4c32-v2t8-r0-s0", "k4c32-v2t8-r0-s0-post", "k2c32-v2t8-r0-s0"}) {
    const double one_by_one = mean_kl(fp32, logits_cache(config, "exact", 0));
    const double chunk16 = mean_kl(fp32, logits_cache(config, "exact", 16));
    const double chunk64 = mean_kl(fp32, logits_cache(config, "exact", 64));
    const double reference64 = mean_kl(fp32, logits_cache(config, "reference", 64));
    std::printf("%-24s KL token by token %.5f, chunks of 16 %.5f, of 64 %.5f (oracle %.5f)\n", config, one_by_one,
                chunk16, chunk64, reference64);
    EXPECT_GT(one_by_one, 1e-4) << config;  // the cache does quantize
    EXPECT_LE(chunk16, one_by_one * 1.05) << config;
    EXPECT_LE(chunk64, one_by_one * 1.05) << config;
    // The oracle in double and the exact tier read the same rows: the same KL to rounding.
    EXPECT_NEAR(reference64, chunk64, 1e-3 * chunk64 + 1e-7) << config;
  }
  // The integer tier reads the stored rows on int8 dot products and the chunk's rows exactly.
  const char* k4v2 = "k4c32-v2t8-r0-s0";
  const double integer_one_by_one = mean_kl(fp32, logits_cache(k4v2, "integer", 0));
  const double integer64 = mean_kl(fp32, logits_cache(k4v2, "integer", 64));
  const double exact64 = mean_kl(fp32, logits_cache(k4v2, "exact", 64));
  std::printf("%-24s integer tier: KL token by token %.5f, chunks of 64 %.5f (exact tier %.5f)\n", k4v2,
              integer_one_by_one, integer64, exact64);
  EXPECT_LE(integer64, integer_one_by_one * 1.05);
  EXPECT_NEAR(integer64, exact64, 0.1 * exact64);
}

// Chunk sizes change only which rows a query reads exactly: with lossless rows, chunks of 16 and
// 64 agree to attend's exact-tier accuracy (1e-5 relative per attention output, compounded over
// 5 layers); with K4V2 rows a larger chunk lets more queries read their neighbours exactly, so
// it is closer to fp32, and the two chunkings are closer to each other than to token by token.
TEST_F(Prefill, ChunkSizesAgree) {
  for (const char* config : {"k16-v16-r0-s0-f32", "k16-v16-r0-s0-post-f32"}) {
    const auto c16 = logits_cache(config, "exact", 16), c64 = logits_cache(config, "exact", 64);
    const double difference = relative_difference(c16, c64);
    std::printf("%-24s chunks of 16 vs 64: largest logit difference %.2e of the largest logit\n", config, difference);
    EXPECT_LT(difference, 1e-5) << config;  // measured 1.0e-6
  }
  const auto fp32 = logits_fp32(0);
  const char* k4v2 = "k4c32-v2t8-r0-s0";
  const auto c1 = logits_cache(k4v2, "exact", 0), c16 = logits_cache(k4v2, "exact", 16),
             c64 = logits_cache(k4v2, "exact", 64);
  const double kl1 = mean_kl(fp32, c1), kl16 = mean_kl(fp32, c16), kl64 = mean_kl(fp32, c64);
  const double between = mean_kl(c64, c16);
  std::printf("%s: KL to fp32 token by token %.5f, chunks of 16 %.5f, of 64 %.5f; chunks 64 to 16 %.5f\n", k4v2, kl1,
              kl16, kl64, between);
  EXPECT_LT(kl64, kl16);
  EXPECT_LT(kl16, kl1);
  EXPECT_LT(between, kl1);
}

// Chunks carry the position they start at: a chunk after token-by-token positions continues the
// sequence, and a chunk at a position the backend does not stand at is refused before anything
// is stored.
// Generation after a chunked prompt (llama-generate's default) continues as after a prompt fed
// one token at a time.
TEST_F(Prefill, GreedyGenerationAfterAChunkedPromptIsTheSame) {
  const std::vector<int> prompt(tokens_.begin(), tokens_.begin() + 40);
  FullPrecisionBackend one(*model_, 72), chunked(*model_, 72);
  const auto expected = greedy_generate(*model_, one, 72, prompt);
  EXPECT_EQ(greedy_generate(*model_, chunked, 72, prompt, -1, 16), expected);
  EXPECT_EQ(expected.size(), 73u);
  EXPECT_EQ(chunked.length(0), 72u);
}

TEST_F(Prefill, MixedFeedingAndBadChunks) {
  const std::size_t vocab = model_->config().vocab;
  const auto fp32 = logits_fp32(0);
  for (const char* config : {"k16-v16-r0-s0-f32", "k16-v16-r0-s0-post-f32"}) {
    eval::CacheBackend kv(*model_, parse_cache_config(config), tokens_.size(), eval::attention_fn("exact"));
    std::vector<float> logits(tokens_.size() * vocab);
    for (std::size_t p = 0; p < 10; ++p)
      model_->forward(tokens_[p], p, kv, std::span(logits).subspan(p * vocab, vocab));
    model_->forward_chunk(std::span(tokens_).subspan(10, 30), 10, kv,
                          std::span(logits).subspan(10 * vocab, 30 * vocab));
    for (std::size_t p = 40; p < tokens_.size(); ++p)
      model_->forward(tokens_[p], p, kv, std::span(logits).subspan(p * vocab, vocab));
    EXPECT_LT(relative_difference(logits, fp32), 1e-4) << config;
  }

  FullPrecisionBackend kv(*model_, 64);
  std::vector<float> logits(8 * vocab);
  const std::span<const int> eight(tokens_.data(), 8);
  EXPECT_NE(error_text([&] { model_->forward_chunk(eight, 3, kv, logits); }).find("position 3, expected 0"),
            std::string::npos);
  EXPECT_EQ(kv.length(0), 0u);
  EXPECT_NE(error_text([&] { model_->forward_chunk(eight.first(0), 0, kv, logits); }).find("zero tokens"),
            std::string::npos);
  EXPECT_NE(
      error_text([&] { model_->forward_chunk(eight, 0, kv, std::span(logits).first(7 * vocab)); }).find("8 tokens"),
      std::string::npos);
  const std::vector<int> bad = {1, 2, int(vocab)};
  EXPECT_NE(error_text([&] { model_->forward_chunk(bad, 0, kv, std::span(logits).first(3 * vocab)); }).find("(row 2)"),
            std::string::npos);
  EXPECT_EQ(kv.length(0), 0u);
  FullPrecisionBackend small(*model_, 4);
  EXPECT_NE(error_text([&] { model_->forward_chunk(eight, 0, small, logits); }).find("beyond the capacity of 4"),
            std::string::npos);
  EXPECT_EQ(small.length(0), 0u);
}

}  // namespace
}  // namespace kvq::llama
