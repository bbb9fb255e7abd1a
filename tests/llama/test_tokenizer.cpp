// SentencePiece BPE tokenizer: ids as llama2.c produces them, decoding, and round trips.

#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "llama/gguf.hpp"
#include "llama/llama_test_support.hpp"
#include "llama/sentencepiece_tokenizer.hpp"

namespace kvq::llama {
namespace {

using testing::GgufWriter;

SentencePieceTokenizer real_tokenizer() { return SentencePieceTokenizer(GgufFile::load(default_model_path())); }

TEST(Tokenizer, KnownIdsFromGoldenOutput) {
  KVQ_REQUIRE_LLAMA_DATA();
  const SentencePieceTokenizer tok = real_tokenizer();
  EXPECT_EQ(tok.size(), 512u);
  EXPECT_EQ(tok.bos(), 1);
  EXPECT_EQ(tok.eos(), 2);
  // The golden output's first sentence, as the model generated it.
  EXPECT_EQ(tok.encode("Once upon a time, there was a little girl named Lily."),
            (std::vector<int>{1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426}));
  EXPECT_EQ(tok.encode("Lily", false), (std::vector<int>{317}));    // "▁Lily"
  EXPECT_EQ(tok.encode("\n", false), (std::vector<int>{410, 13}));  // dummy prefix, <0x0A>
  EXPECT_EQ(tok.encode("", true), (std::vector<int>{1}));
  EXPECT_EQ(tok.encode("", false), (std::vector<int>{}));
  EXPECT_EQ(tok.encode("hi", true, true).back(), 2);
}

TEST(Tokenizer, DecodesGoldenTokensToGoldenText) {
  KVQ_REQUIRE_LLAMA_DATA();
  const SentencePieceTokenizer tok = real_tokenizer();
  const auto golden = testing::read_golden();
  ASSERT_EQ(golden.tokens.size(), 257u);
  EXPECT_TRUE(golden.text.starts_with("Once upon a time, there was a little girl named Lily."));
  EXPECT_EQ(tok.decode(golden.tokens), golden.text);
  EXPECT_EQ(tok.encode(golden.text), golden.tokens);
}

TEST(Tokenizer, RoundTripsHeldOutText) {
  KVQ_REQUIRE_LLAMA_DATA();
  const SentencePieceTokenizer tok = real_tokenizer();
  const auto text = testing::read_text(data_dir() / "text" / "tinystories_valid_excerpt.txt");
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
  const auto stories = testing::read_stories();
  ASSERT_EQ(stories.size(), 12u);
  for (const auto& story : stories) {
    const auto ids = tok.encode(story);
    EXPECT_LT(ids.size(), story.size() * 3 / 4) << "BPE should merge most characters";
    EXPECT_EQ(tok.decode(ids), story);
  }
  // Byte fallback for characters outside the vocabulary, and spaces at the edges.
  for (const std::string s : {"caf\xC3\xA9 \xF0\x9F\x98\x80!", " two  spaces ", "\t\r\n", "\xFF\xFE broken utf-8 \xC3"})
    EXPECT_EQ(tok.decode(tok.encode(s)), s) << s;
}

// llama2.c's merge loop verbatim (rescan all pairs per merge) over the real vocabulary.
std::vector<int> naive_encode(const SentencePieceTokenizer& tok, const std::vector<int>& initial) {
  std::vector<int> t = initial;
  while (true) {
    float best_score = -1e10f;
    int best_id = -1;
    std::size_t best_idx = 0;
    for (std::size_t i = 1; i + 1 < t.size(); ++i) {
      const std::string merged = tok.piece(t[i]) + tok.piece(t[i + 1]);
      for (int id = 0; id < static_cast<int>(tok.size()); ++id)
        if (tok.piece(id) == merged) {
          if (tok.score(id) > best_score) best_score = tok.score(id), best_id = id, best_idx = i;
          break;
        }
    }
    if (best_id < 0) return t;
    t[best_idx] = best_id;
    t.erase(t.begin() + static_cast<std::ptrdiff_t>(best_idx) + 1);
  }
}

int piece_id(const SentencePieceTokenizer& tok, const std::string& p) {
  for (int id = 0; id < static_cast<int>(tok.size()); ++id)
    if (tok.piece(id) == p) return id;
  ADD_FAILURE() << "no piece '" << p << "'";
  return 0;
}

// Unmerged start: BOS, dummy prefix "▁", one piece per character (all ASCII pieces exist here).
std::vector<int> unmerged(const SentencePieceTokenizer& tok, const std::string& text) {
  std::vector<int> initial = {tok.bos(), piece_id(tok, "\xE2\x96\x81")};
  for (const char c : text)
    initial.push_back(c == ' ' ? initial[1] : c == '\n' ? 13 : piece_id(tok, std::string(1, c)));
  return initial;
}

TEST(Tokenizer, MergesLikeLlama2c) {
  KVQ_REQUIRE_LLAMA_DATA();
  const SentencePieceTokenizer tok = real_tokenizer();
  for (const auto& story : testing::read_stories()) {
    const std::string text = story.substr(0, 160);
    EXPECT_EQ(tok.encode(text), naive_encode(tok, unmerged(tok, text))) << text;
  }
}

// Random texts over the letters the stories use most, merged by the heap and by llama2.c's scan.
TEST(Tokenizer, HeapMergeMatchesLlama2cOnRandomText) {
  KVQ_REQUIRE_LLAMA_DATA();
  const SentencePieceTokenizer tok = real_tokenizer();
  const std::string alphabet = "aehilnorstdy ";
  std::mt19937 rng(5);
  for (int trial = 0; trial < 40; ++trial) {
    std::string text;
    for (std::size_t n = 1 + rng() % 120; n > 0; --n) text += alphabet[rng() % alphabet.size()];
    EXPECT_EQ(tok.encode(text), naive_encode(tok, unmerged(tok, text))) << "'" << text << "'";
  }
}

TEST(Tokenizer, EqualScoresMergeLeftmostFirst) {
  std::vector<std::string> pieces = {"<unk>", "<s>", "</s>", "\xE2\x96\x81", "a", "aa", "b", "ab"};
  std::vector<float> scores = {0, 0, 0, 0, 0, -1.0f, 0, -1e10f};  // "ab" at llama2.c's floor: never merged
  const SentencePieceTokenizer tok(pieces, scores, 1, 2);
  EXPECT_EQ(tok.encode("aaa", false), (std::vector<int>{3, 5, 4}));       // ▁ aa a, not ▁ a aa
  EXPECT_EQ(tok.encode("aaaaa", false), (std::vector<int>{3, 5, 5, 4}));  // ▁ aa aa a
  EXPECT_EQ(tok.encode("ab", false), (std::vector<int>{3, 4, 6}));
}

// A story with no separators used to take 104 s (every merge rescanned every pair); the heap
// merge is O(n log n). No timing assertion: a regression shows as a test that takes minutes.
TEST(Tokenizer, LongTextWithoutSeparatorsEncodes) {
  KVQ_REQUIRE_LLAMA_DATA();
  const SentencePieceTokenizer tok = real_tokenizer();
  std::string text;
  for (const auto& story : testing::read_stories()) text += story + " ";
  while (text.size() < 320 * 1024) text += text;
  text.resize(320 * 1024);
  const auto ids = tok.encode(text);
  EXPECT_LT(ids.size(), text.size() * 3 / 4);
  EXPECT_EQ(tok.decode(ids), text);
}

TEST(Tokenizer, SyntheticVocabularies) {
  // llama2.c's own vocab files store " " for a space; GGUF stores "▁". Both must work.
  for (const std::string& space : {std::string(" "), std::string("\xE2\x96\x81")}) {
    std::vector<std::string> pieces = {"<unk>", "<s>", "</s>"};
    for (int b = 0; b < 256; ++b) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "<0x%02X>", b);
      pieces.push_back(buf);
    }
    const int first = static_cast<int>(pieces.size());
    for (const std::string& p :
         {space, std::string("a"), std::string("b"), std::string("ab"), space + "ab", std::string("ba")})
      pieces.push_back(p);
    std::vector<float> scores(pieces.size(), 0.0f);
    scores[first + 3] = -1.0f;  // "ab"
    scores[first + 4] = -0.5f;  // "▁ab" beats "ab"
    scores[first + 5] = -2.0f;  // "ba"
    const SentencePieceTokenizer tok(pieces, scores, 1, 2);
    // "ab ba": ▁ a b ▁ b a -> ▁ab ▁ ba (▁ab merges first; "ba" outscores nothing else)
    const auto ids = tok.encode("ab ba");
    EXPECT_EQ(ids, (std::vector<int>{1, first + 4, first, first + 5}));
    EXPECT_EQ(tok.decode(ids), "ab ba");
    EXPECT_EQ(tok.encode("c", false), (std::vector<int>{first, 'c' + 3}));  // byte fallback
    EXPECT_EQ(tok.decode(tok.encode("c")), "c");
  }
}

TEST(Tokenizer, Errors) {
  EXPECT_THROW(SentencePieceTokenizer({"a"}, {}, 0, 0), Error);
  EXPECT_THROW(SentencePieceTokenizer({"a", "b"}, {0.0f, 0.0f}, 5, 1), Error);
  const SentencePieceTokenizer tok({"<unk>", "<s>", "</s>", " ", "a"}, {0, 0, 0, 0, 0}, 1, 2);
  EXPECT_EQ(tok.encode("a a"), (std::vector<int>{1, 3, 4, 3, 4}));
  EXPECT_THROW((void)tok.encode("b"), Error);  // no byte-fallback piece for 'b'
  EXPECT_THROW((void)tok.decode(std::vector<int>{7}), Error);
  EXPECT_THROW((void)tok.piece(-1), Error);
  GgufWriter w;
  w.str("tokenizer.ggml.model", "gpt2").strings("tokenizer.ggml.tokens", {"a"}).floats("tokenizer.ggml.scores", {0.0f});
  EXPECT_THROW(SentencePieceTokenizer{GgufFile::parse(w.bytes())}, Error);
}

}  // namespace
}  // namespace kvq::llama
