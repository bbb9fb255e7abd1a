// Draft trees on the real model: Model::forward_tree verifies a tree of speculative tokens in one
// pass through kvq::attend (AttentionRequest::parents) over a kvq cache. Each token's logits are
// those of its path fed as a prompt chunk; the greedy path of a tree is accepted whole, and after
// its rows are appended (Model::append_path) generation goes on as if it had never been drafted.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "eval/cache_backend.hpp"
#include "llama/inference.hpp"
#include "llama/llama_test_support.hpp"
#include "llama/model.hpp"
#include "llama/tokenizer.hpp"

namespace kvq::llama {
namespace {

using testing::error_text;
using testing::relative_difference;

/// A kvq cache as the model's backend: decode steps, prompt chunks and draft trees, all through
/// kvq's attention in one tier. The cache stores pre-RoPE keys and rotates them as it attends.
class TreeBackend {
 public:
  TreeBackend(BasicKVCache& cache, Tier tier) : cache_(cache), tier_(tier) {}
  void append(std::size_t layer, std::size_t position, std::span<const float> k, std::span<const float> v) {
    cache_.append(layer, position, k, v);
  }
  void attend(std::size_t layer, std::size_t position, std::span<const float> q, std::span<float> out) {
    decode_attention(cache_, layer, position, q, out, {.tier = tier_});
  }
  void truncate(std::size_t length) { cache_.truncate(length); }
  void attend_chunk(std::size_t layer, std::size_t first_position, std::size_t tokens, std::span<const float> q,
                    std::span<const float> k, std::span<const float> v, std::span<float> out) {
    attend_new(layer, first_position, tokens, {}, q, k, v, out);
  }
  void attend_tree(std::size_t layer, std::size_t first_position, std::span<const std::int32_t> parents,
                   std::span<const float> q, std::span<const float> k, std::span<const float> v, std::span<float> out) {
    attend_new(layer, first_position, parents.size(), parents, q, k, v, out);
  }

 private:
  // New tokens not stored yet: a chain (no parents) or a draft tree.
  void attend_new(std::size_t layer, std::size_t first_position, std::size_t tokens,
                  std::span<const std::int32_t> parents, std::span<const float> q, std::span<const float> k,
                  std::span<const float> v, std::span<float> out) {
    kvq::attend({.cache = &cache_,
                 .layer = layer,
                 .first_position = first_position,
                 .tokens = tokens,
                 .queries = q,
                 .new_keys = k,
                 .new_values = v,
                 .out = out,
                 .parents = parents},
                {.tier = tier_});
  }

  BasicKVCache& cache_;
  Tier tier_;
};
static_assert(TreeKVBackend<TreeBackend>);

class DraftTree : public ::testing::Test {
 protected:
  void SetUp() override {
    KVQ_REQUIRE_LLAMA_DATA();
    const GgufFile file = GgufFile::load(default_model_path());
    model_ = std::make_unique<Model>(file);
    const Tokenizer tokenizer(file);
    tokens_ = tokenizer.encode(testing::read_stories().front());
    ASSERT_GE(tokens_.size(), 80u);
  }

  /// A cache holding the story's first kPrefix tokens, fed as one chunk.
  BasicKVCache prefilled(const char* config, Tier tier, std::vector<float>& last_logits) const {
    BasicKVCache cache(eval::cache_shape(*model_, 128), parse_cache_config(config));
    TreeBackend kv(cache, tier);
    std::vector<float> logits(kPrefix * vocab());
    model_->forward_chunk(std::span(tokens_).first(kPrefix), 0, kv, logits);
    last_logits.assign(logits.end() - std::ptrdiff_t(vocab()), logits.end());
    return cache;
  }
  std::size_t vocab() const { return model_->config().vocab; }

  static std::vector<std::size_t> path_to(std::span<const std::int32_t> parents, std::size_t t) {
    std::vector<std::size_t> path;
    for (std::int32_t a = std::int32_t(t); a >= 0; a = parents[std::size_t(a)])
      path.insert(path.begin(), std::size_t(a));
    return path;
  }

  static constexpr std::size_t kPrefix = 40;
  std::unique_ptr<Model> model_;
  std::vector<int> tokens_;
};

// The story's next five tokens as one branch, others hanging off it and off a second root. Every
// token's logits are its path's last logits fed as a chunk, on lossless and quantized caches in
// both tiers, and the pass stores nothing.
TEST_F(DraftTree, EachTokenGetsItsPathsChunkLogits) {
  const std::vector<std::int32_t> parents = {-1, 0, 1, 2, 3, 0, 5, -1, 7, 1, 9, 2};
  std::vector<int> drafts(tokens_.begin() + kPrefix, tokens_.begin() + kPrefix + 5);
  for (std::size_t i = drafts.size(); i < parents.size(); ++i) drafts.push_back(tokens_[kPrefix + 20 + i]);
  for (const char* config : {"k16-v16-r0-s0-f32", "k4c32-v2t8-r16-s0", "k2c32-v2c32-r0-s4"})
    for (const Tier tier : {Tier::exact, Tier::integer}) {
      const std::string what = std::string(config) + " " + to_string(tier);
      std::vector<float> last;
      const BasicKVCache base = prefilled(config, tier, last);
      BasicKVCache cache = base;
      TreeBackend kv(cache, tier);
      std::vector<float> logits(parents.size() * vocab());
      Model::DraftRows rows;
      model_->forward_tree(drafts, parents, kPrefix, kv, logits, rows);
      EXPECT_EQ(cache.length(0), kPrefix) << what;
      EXPECT_EQ(cache.stored_bytes(), base.stored_bytes()) << what;
      for (std::size_t t = 0; t < parents.size(); ++t) {
        const std::vector<std::size_t> path = path_to(parents, t);
        std::vector<int> path_tokens;
        for (const std::size_t a : path) path_tokens.push_back(drafts[a]);
        BasicKVCache chain = base;
        TreeBackend chain_kv(chain, tier);
        std::vector<float> chain_logits(path.size() * vocab());
        model_->forward_chunk(path_tokens, kPrefix, chain_kv, chain_logits);
        EXPECT_LT(
            relative_difference(std::span(logits).subspan(t * vocab(), vocab()), std::span(chain_logits).last(vocab())),
            1e-4)
            << what << " token " << t;
      }
    }
}

// Drafts that are the model's own greedy continuation, with a wrong sibling at each depth: the
// walk from the prefix's logits accepts the whole greedy branch and none of the others; its rows
// appended, the next 12 greedy tokens are those of never drafting.
TEST_F(DraftTree, TheGreedyBranchIsAcceptedAndContinuesAsNeverDrafted) {
  const char* config = "k16-v16-r0-s0-f32";
  std::vector<float> last;
  BasicKVCache plain = prefilled(config, Tier::exact, last);
  BasicKVCache cache = plain;
  TreeBackend plain_kv(plain, Tier::exact), kv(cache, Tier::exact);
  const std::vector<int> prefix(tokens_.begin(), tokens_.begin() + kPrefix);
  std::vector<int> expected = prefix;
  std::vector<float> logits(vocab());
  std::vector<float> next = last;
  for (std::size_t i = 0; i < 17; ++i) {
    expected.push_back(argmax(next));
    model_->forward(expected.back(), expected.size() - 1, plain_kv, next);
  }
  // Greedy tokens 0..3 at indices 0, 2, 4, 6; a wrong sibling beside each.
  const std::vector<std::int32_t> parents = {-1, -1, 0, 0, 2, 2, 4, 4};
  std::vector<int> drafts;
  for (std::size_t d = 0; d < 4; ++d) {
    const int right = expected[kPrefix + d];
    drafts.push_back(right);
    drafts.push_back((right + 1) % int(vocab()));
  }
  std::vector<float> tree_logits(parents.size() * vocab());
  Model::DraftRows rows;
  model_->forward_tree(drafts, parents, kPrefix, kv, tree_logits, rows);
  // Accept: the child of the current node whose token the current logits choose, while one is.
  std::vector<std::size_t> accepted;
  int chosen = argmax(last);
  for (std::int32_t node = -1;;) {
    std::int32_t child = -1;
    for (std::size_t t = 0; t < parents.size(); ++t)
      if (parents[t] == node && drafts[t] == chosen) child = std::int32_t(t);
    if (child < 0) break;
    accepted.push_back(std::size_t(child));
    chosen = argmax(std::span<const float>(tree_logits).subspan(std::size_t(child) * vocab(), vocab()));
    node = child;
  }
  EXPECT_EQ(accepted, (std::vector<std::size_t>{0, 2, 4, 6}));
  EXPECT_EQ(chosen, expected[kPrefix + 4]);  // the bonus token the last draft's logits give
  model_->append_path(rows, accepted, kv);
  ASSERT_EQ(cache.length(0), kPrefix + 4);
  std::vector<int> generated(expected.begin(), expected.begin() + std::ptrdiff_t(kPrefix + 5));
  for (std::size_t i = 0; i < 12; ++i) {
    model_->forward(generated.back(), generated.size() - 1, kv, logits);
    generated.push_back(argmax(logits));
  }
  EXPECT_EQ(generated, expected);
}

TEST_F(DraftTree, BadTreesAreRefusedBeforeAnythingIsStored) {
  std::vector<float> last;
  BasicKVCache cache = prefilled("k4c32-v2t8-r16-s0", Tier::exact, last);
  const std::vector<std::uint8_t> before = cache.stored_bytes();
  TreeBackend kv(cache, Tier::exact);
  const std::vector<int> drafts(tokens_.begin() + kPrefix, tokens_.begin() + kPrefix + 3);
  std::vector<float> logits(3 * vocab());
  Model::DraftRows rows;
  const std::vector<std::int32_t> two = {-1, 0}, ahead = {-1, 2, 0};
  EXPECT_NE(error_text([&] { model_->forward_tree(drafts, two, kPrefix, kv, logits, rows); }).find("2 parents for 3"),
            std::string::npos);
  EXPECT_NE(error_text([&] {
              model_->forward_tree(drafts, ahead, kPrefix, kv, logits, rows);
            }).find("the parent of new token 1 is 2"),
            std::string::npos);
  EXPECT_TRUE(rows.keys.empty() && rows.parents.empty());  // a failed pass leaves the rows as they were
  const std::vector<std::int32_t> chain = {-1, 0, 1};
  model_->forward_tree(drafts, chain, kPrefix, kv, logits, rows);
  const std::vector<std::size_t> beyond = {0, 3}, skips = {0, 2}, rootless = {1, 2};
  EXPECT_NE(
      error_text([&] { model_->append_path(rows, beyond, kv); }).find("token 3 at depth 1 is not in the tree of 3"),
      std::string::npos);
  EXPECT_NE(error_text([&] { model_->append_path(rows, skips, kv); }).find("token 2 at depth 1 is not a child of 0"),
            std::string::npos);
  EXPECT_NE(error_text([&] {
              model_->append_path(rows, rootless, kv);
            }).find("token 1 at depth 0 is not a child of the prefix"),
            std::string::npos);
  EXPECT_EQ(cache.stored_bytes(), before);
}

// An append that fails in a later layer (as a shared block store run dry would) is undone in
// the layers before it: every layer keeps the prefix only, byte for byte.
TEST_F(DraftTree, AnAppendFailingPartWayIsUndoneInEveryLayer) {
  std::vector<float> last;
  BasicKVCache cache = prefilled("k4c32-v2t8-r16-s0", Tier::exact, last);
  const std::vector<std::uint8_t> before = cache.stored_bytes();
  struct Failing : TreeBackend {
    using TreeBackend::TreeBackend;
    void append(std::size_t layer, std::size_t position, std::span<const float> k, std::span<const float> v) {
      if (layer == 1 && position == kPrefix + 1) throw Error(ErrorCode::out_of_memory, "no block left");
      TreeBackend::append(layer, position, k, v);
    }
  } kv(cache, Tier::exact);
  const std::vector<int> drafts(tokens_.begin() + kPrefix, tokens_.begin() + kPrefix + 3);
  std::vector<float> logits(3 * vocab());
  Model::DraftRows rows;
  const std::vector<std::int32_t> chain = {-1, 0, 1};
  model_->forward_tree(drafts, chain, kPrefix, kv, logits, rows);
  const std::vector<std::size_t> path = {0, 1, 2};
  EXPECT_NE(error_text([&] { model_->append_path(rows, path, kv); }).find("no block left"), std::string::npos);
  for (std::size_t l = 0; l < cache.shape().layers; ++l) EXPECT_EQ(cache.length(l), kPrefix) << "layer " << l;
  EXPECT_EQ(cache.stored_bytes(), before);
  model_->append_path(rows, std::span(path).first(1), kv);  // layer 1's failing position not reached
  EXPECT_EQ(cache.length(cache.shape().layers - 1), kPrefix + 1);
  // Rows of a pass before that append: the first append fails, and nothing is undone.
  const std::vector<std::uint8_t> appended = cache.stored_bytes();
  EXPECT_NE(error_text([&] { model_->append_path(rows, path, kv); }).find("position"), std::string::npos);
  EXPECT_EQ(cache.stored_bytes(), appended);
}

}  // namespace
}  // namespace kvq::llama
