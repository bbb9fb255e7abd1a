// Decoding many sequences together on the real model: Model::forward_batch runs a decode step of
// a batch through one pool decode step per layer (kvq::decode_attention over a KVPool), which
// reads the prompt that forks share once. Parallel sampling (forks of one prompt, each from
// another first token) beside a sequence of another prompt gives, token for token, what each
// sequence decoded alone gives.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "llama/inference.hpp"
#include "llama/llama_test_support.hpp"
#include "llama/model.hpp"
#include "llama/pool_backend.hpp"
#include "llama/tokenizer.hpp"

namespace kvq::llama {
namespace {

using testing::error_text;
using testing::relative_difference;

class BatchDecode : public ::testing::Test {
 protected:
  void SetUp() override {
    KVQ_REQUIRE_LLAMA_DATA();
    const GgufFile file = GgufFile::load(default_model_path());
    model_ = std::make_unique<Model>(file);
    const Tokenizer tokenizer(file);
    // A prompt of 300 tokens (stories joined) and another of the last story.
    prompt_ = testing::joined_stories(tokenizer, 300);
    ASSERT_EQ(prompt_.size(), 300u);
    other_ = tokenizer.encode(testing::read_stories().back());
    ASSERT_GE(other_.size(), 40u);
  }

  /// Feeds tokens[from, size - 1) in chunks of 64 and the last one alone; its logits.
  std::vector<float> feed(PoolBackend kv, std::span<const int> tokens, std::size_t from) const {
    const std::size_t vocab = model_->config().vocab;
    std::vector<float> logits(64 * vocab);
    for (std::size_t pos = from; pos + 1 < tokens.size(); pos += 64) {
      const std::size_t n = std::min<std::size_t>(64, tokens.size() - 1 - pos);
      model_->forward_chunk(tokens.subspan(pos, n), pos, kv, std::span(logits).first(n * vocab));
    }
    logits.resize(vocab);
    model_->forward(tokens.back(), tokens.size() - 1, kv, logits);
    return logits;
  }

  std::unique_ptr<Model> model_;
  std::vector<int> prompt_, other_;
};

TEST_F(BatchDecode, ForksOfAPromptDecodeTogetherAsEachAlone) {
  const std::size_t vocab = model_->config().vocab, forks = 4, steps = 40;
  // The batch's matrix products sum in another order than one token's, so keys and values differ
  // in their last bits; a window of fp16 rows may round them to neighbouring fp16 values, which
  // moves the logits ~200x more than float rows do. Largest seen: 1.6e-6 and 1.3e-6 (rows kept as
  // floats, -f32), 3.2e-4 (fp16 rows).
  for (const auto& [text, bound] : {std::pair{"k2c32-v4t8-r16-s4-f32", 1e-5}, std::pair{"k16-v16-r0-s1-f32", 1e-5},
                                    std::pair{"k4c32-v2t8-r32-s1", 2e-3}}) {
    SCOPED_TRACE(text);
    const CacheConfig config = parse_cache_config(text);
    KVPool together(pool_shape(*model_, config, 1024), config), apart(pool_shape(*model_, config, 1024), config);
    // Parallel sampling: the prompt once, then a fork per first token (the prompt's four likeliest
    // next tokens), and a sequence of another prompt.
    const SequenceId base = together.add_sequence();
    const std::vector<float> first = feed(PoolBackend(together, base), prompt_, 0);
    std::vector<int> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + forks, order.end(),
                      [&](int a, int b) { return first[std::size_t(a)] > first[std::size_t(b)]; });
    std::vector<std::vector<int>> texts;
    std::vector<SequenceId> ids;
    for (std::size_t f = 0; f < forks; ++f) {
      ids.push_back(together.fork(base, prompt_.size()));
      texts.push_back(prompt_);
      texts.back().push_back(order[f]);
    }
    const std::vector<int> other_prompt(other_.begin(), other_.begin() + 40);
    ids.push_back(together.add_sequence());
    (void)feed(PoolBackend(together, ids.back()), std::span(other_prompt).first(39), 0);
    texts.push_back(other_prompt);

    // Together: a batch per step; each sequence's newest token is not fed yet.
    PoolBatchBackend batch(together, ids);
    std::vector<std::vector<float>> logits_together(steps, std::vector<float>(ids.size() * vocab));
    std::vector<int> tokens(ids.size());
    std::vector<std::size_t> positions(ids.size());
    for (std::size_t i = 0; i < steps; ++i) {
      for (std::size_t b = 0; b < ids.size(); ++b) {
        tokens[b] = texts[b].back();
        positions[b] = texts[b].size() - 1;
      }
      model_->forward_batch(tokens, positions, batch, logits_together[i]);
      // The forks read the prompt's blocks once: one group of them, the other prompt alone.
      EXPECT_EQ(batch.last.groups, 1u) << "step " << i;
      EXPECT_EQ(batch.last.sequences, forks) << "step " << i;
      EXPECT_GE(batch.last.shared_positions, 256u) << "step " << i;
      for (std::size_t b = 0; b < ids.size(); ++b)
        texts[b].push_back(argmax(std::span(logits_together[i]).subspan(b * vocab, vocab)));
    }

    // Apart: each its own prompt, fed in the same pieces, its tokens one at a time.
    double largest = 0;
    for (std::size_t b = 0; b < ids.size(); ++b) {
      const SequenceId own = apart.add_sequence();
      const std::size_t start = texts[b].size() - steps;  // the first token the batch generated
      (void)feed(PoolBackend(apart, own), std::span(texts[b]).first(start - 1), 0);
      std::vector<float> logits(vocab);
      PoolBackend kv(apart, own);
      for (std::size_t i = 0; i < steps; ++i) {
        model_->forward(texts[b][start - 1 + i], start - 1 + i, kv, logits);
        const auto row = std::span<const float>(logits_together[i]).subspan(b * vocab, vocab);
        largest = std::max(largest, relative_difference(row, logits));
        ASSERT_EQ(argmax(logits), texts[b][start + i]) << "sequence " << b << ", step " << i;
      }
    }
    std::printf("%s: largest logit difference %.2e of the largest logit\n", text, largest);
    EXPECT_LT(largest, bound);
  }
}

TEST_F(BatchDecode, BadBatchesThrow) {
  const CacheConfig config = parse_cache_config("k4c32-v2t8-r32-s1");
  KVPool pool(pool_shape(*model_, config, 256), config);
  const std::vector<SequenceId> ids = {pool.add_sequence(), pool.add_sequence()};
  PoolBatchBackend batch(pool, ids);
  const std::size_t vocab = model_->config().vocab;
  std::vector<float> logits(2 * vocab);
  const std::vector<int> two = {1, 2};
  const std::vector<std::size_t> at_zero = {0, 0};
  EXPECT_NE(error_text([&] {
              model_->forward_batch(two, std::span(at_zero).first(1), batch, logits);
            }).find("1 positions for 2 tokens"),
            std::string::npos);
  const std::vector<int> three = {1, 2, 3};
  const std::vector<std::size_t> three_at_zero = {0, 0, 0};
  std::vector<float> three_logits(3 * vocab);
  EXPECT_NE(
      error_text([&] { model_->forward_batch(three, three_at_zero, batch, three_logits); }).find("a batch of 3 rows"),
      std::string::npos);
  EXPECT_NE(error_text([&] {
              model_->forward_batch(std::vector<int>{1, int(vocab)}, at_zero, batch, logits);
            }).find("(row 1)"),
            std::string::npos);
  EXPECT_EQ(pool.length(ids[0], 0), 0u);
  model_->forward_batch(two, at_zero, batch, logits);
  // A position sequence 1 does not reach: its append refuses it after sequence 0's, which the
  // engine rolls back.
  const std::vector<std::size_t> gap = {1, 5};
  EXPECT_NE(error_text([&] { model_->forward_batch(two, gap, batch, logits); }), "no error");
  EXPECT_EQ(pool.length(ids[0], 0), 2u);
  EXPECT_EQ(pool.length(ids[1], 0), 1u);
  pool.truncate(ids[0], 1);
  for (std::size_t l = 0; l < model_->config().layers; ++l) EXPECT_EQ(pool.length(ids[0], l), 1u) << "layer " << l;
  model_->forward_batch(two, std::vector<std::size_t>{1, 1}, batch, logits);
  EXPECT_EQ(pool.length(ids[1], 0), 2u);
}

}  // namespace
}  // namespace kvq::llama
