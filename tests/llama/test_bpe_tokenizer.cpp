// Byte-level BPE: GPT-2's byte map, the pre-tokenizer splits of llama-bpe, qwen2, smollm and gpt2,
// merge order on hand-worked vocabularies, added tokens, GGUF loading and its errors.

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "llama/bpe_tokenizer.hpp"
#include "llama/gguf.hpp"
#include "llama/llama_test_support.hpp"
#include "llama/pre_tokenizer.hpp"
#include "llama/tokenizer.hpp"

namespace kvq::llama {
namespace {

using testing::GgufWriter;
using Words = std::vector<std::string_view>;

std::string utf8(char32_t c) {
  std::string s;
  unicode::append_utf8(s, c);
  return s;
}

// The byte-level spelling of raw bytes.
std::string spell(std::string_view bytes) {
  constexpr auto map = byte_to_unicode();
  std::string s;
  for (const char b : bytes) s += utf8(map[static_cast<unsigned char>(b)]);
  return s;
}

TEST(ByteToUnicode, IsGpt2sMap) {
  constexpr auto map = byte_to_unicode();
  // Published values of GPT-2's bytes_to_unicode (encoder.py): printable bytes stay, ' ' is 'Ġ',
  // '\n' 'Ċ', '\t' 'ĉ', NUL 'Ā', DEL 'ġ', NBSP 'ł', soft hyphen 'Ń'.
  EXPECT_EQ(map['A'], U'A');
  EXPECT_EQ(map['!'], U'!');
  EXPECT_EQ(map['~'], U'~');
  EXPECT_EQ(map[0xE9], U'\u00E9');
  EXPECT_EQ(map[' '], U'\u0120');
  EXPECT_EQ(map['\n'], U'\u010A');
  EXPECT_EQ(map['\t'], U'\u0109');
  EXPECT_EQ(map[0x00], U'\u0100');
  EXPECT_EQ(map[0x7F], U'\u0121');
  EXPECT_EQ(map[0xA0], U'\u0142');
  EXPECT_EQ(map[0xAD], U'\u0143');
  const std::set<char32_t> distinct(map.begin(), map.end());
  EXPECT_EQ(distinct.size(), 256u);
  EXPECT_EQ(*distinct.rbegin(), U'\u0143');  // 68 remapped bytes: U+0100..U+0143
}

Words split(std::string_view pre, std::string_view text) { return pre_tokenize(pre_tokenizer_named(pre), text); }

TEST(PreTokenizer, Gpt2Splits) {
  // Hugging Face's GPT-2 pre-tokenizer on this sentence (the tokenizers course's example):
  // Hello , Ġhow Ġare Ġ Ġyou ? — a double space leaves one space on its own.
  EXPECT_EQ(split("gpt2", "Hello, how are  you?"), (Words{"Hello", ",", " how", " are", " ", " you", "?"}));
  EXPECT_EQ(split("gpt2", "I'm can't we'LL"), (Words{"I", "'m", " can", "'t", " we", "'", "LL"}));  // case-sensitive
  EXPECT_EQ(split("gpt2", "123456 x"), (Words{"123456", " x"}));
  EXPECT_EQ(split("gpt2", "a\n\nb  "), (Words{"a", "\n", "\n", "b", "  "}));
  EXPECT_EQ(split("gpt2", " \t\tx"), (Words{" \t", "\t", "x"}));
  EXPECT_EQ(split("gpt2", "caf\u00e9 \u4e2d\u6587!!"), (Words{"caf\u00e9", " \u4e2d\u6587", "!!"}));
  EXPECT_EQ(split("gpt2", ""), Words{});
}

TEST(PreTokenizer, Llama3Splits) {
  // Numbers in runs of at most three digits; contractions in any case; a letter word takes one
  // leading non-letter; punctuation takes the line breaks after it; line breaks group.
  EXPECT_EQ(split("llama-bpe", "1234567 apples"), (Words{"123", "456", "7", " apples"}));
  EXPECT_EQ(split("llama-bpe", "I'M we'll"), (Words{"I", "'M", " we", "'ll"}));
  EXPECT_EQ(split("llama-bpe", "(hello) world!\n\nNext"), (Words{"(hello", ")", " world", "!\n\n", "Next"}));
  EXPECT_EQ(split("llama-bpe", "a \n\n  b"), (Words{"a", " \n\n", " ", " b"}));
  EXPECT_EQ(split("llama-bpe", "x  7"), (Words{"x", " ", " ", "7"}));
  EXPECT_EQ(split("llama-bpe", "3.14"), (Words{"3", ".", "14"}));
  EXPECT_EQ(split("llama-bpe", "\u0663\u0664\u0665\u0666 \u00bd"),
            (Words{"\u0663\u0664\u0665", "\u0666", " ", "\u00bd"}));
  EXPECT_EQ(split("llama-bpe", "tail  "), (Words{"tail", "  "}));
}

TEST(PreTokenizer, Qwen2AndSmolLMIsolateDigits) {
  EXPECT_EQ(split("qwen2", "1234 apples"), (Words{"1", "2", "3", "4", " apples"}));
  EXPECT_EQ(split("qwen2", "(hello)"), (Words{"(hello", ")"}));  // the llama-bpe rules otherwise
  EXPECT_EQ(split("smollm", "in 2024, x1"), (Words{"in", " ", "2", "0", "2", "4", ",", " x", "1"}));
  EXPECT_EQ(split("smollm", "(hello)"), (Words{"(", "hello", ")"}));  // the gpt2 rules otherwise
}

TEST(PreTokenizer, WordsCoverTheTextOnRandomBytes) {
  std::mt19937 rng(11);
  const std::vector<std::string> pieces = {"a",
                                           "Z",
                                           "7",
                                           " ",
                                           "  ",
                                           "\n",
                                           "\r\n",
                                           "\t",
                                           "'",
                                           "'s",
                                           "!",
                                           "\u00e9",
                                           "\u4e2d",
                                           "\u0663",
                                           "\u00a0",
                                           "\u3000",
                                           "\xF0\x9F\x98\x80",
                                           "\xFF",
                                           "\xC3"};
  for (const char* name : {"gpt2", "llama-bpe", "qwen2", "smollm"}) {
    for (int trial = 0; trial < 300; ++trial) {
      std::string text;
      for (int i = std::uniform_int_distribution<int>(0, 25)(rng); i > 0; --i) text += pieces[rng() % pieces.size()];
      std::string joined;
      for (const auto w : split(name, text)) {
        EXPECT_FALSE(w.empty()) << name;
        joined += w;
      }
      EXPECT_EQ(joined, text) << name;
    }
  }
}

TEST(PreTokenizer, UnknownSchemeRefusedByName) {
  try {
    (void)pre_tokenizer_named("deepseek-llm");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'deepseek-llm'"), std::string::npos) << e.what();
  }
}

// A vocabulary of the 256 byte-level characters, in byte order, followed by `extra` pieces.
std::vector<std::string> byte_vocabulary(const std::vector<std::string>& extra) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(spell(std::string(1, static_cast<char>(b))));
  tokens.insert(tokens.end(), extra.begin(), extra.end());
  return tokens;
}

BpeTokenizer tiny(const std::vector<std::string>& extra, const std::vector<std::string>& merges,
                  BpeTokenizer::Options options = {}) {
  return BpeTokenizer(byte_vocabulary(extra), {}, merges, options);
}

TEST(BpeTokenizer, LowestRankMergesFirst) {
  // "abc" with a+b ranked before b+c gives ab|c; the other order gives a|bc.
  const BpeTokenizer ab_first = tiny({"ab", "bc"}, {"a b", "b c"});
  EXPECT_EQ(ab_first.encode("abc", false), (std::vector<int>{256, 'c'}));
  const BpeTokenizer bc_first = tiny({"ab", "bc"}, {"b c", "a b"});
  EXPECT_EQ(bc_first.encode("abc", false), (std::vector<int>{'a', 257}));
  // Equal pairs merge leftmost first: aaa -> aa|a, and aaaa -> aa|aa -> aaaa.
  const BpeTokenizer a = tiny({"aa", "aaaa"}, {"a a", "aa aa"});
  EXPECT_EQ(a.encode("aaa", false), (std::vector<int>{256, 'a'}));
  EXPECT_EQ(a.encode("aaaa", false), (std::vector<int>{257}));
  EXPECT_EQ(a.encode("aaaaa", false), (std::vector<int>{257, 'a'}));
}

TEST(BpeTokenizer, SpacesAreByteLevelCharactersAndWordsNeverMergeAcross) {
  // " the" spells as "Ġthe": Ġ+t, h+e, Ġt+he.
  const std::string G = utf8(U'\u0120');
  const BpeTokenizer tok = tiny({G + "t", "he", G + "the", "the"}, {G + " t", "h e", G + "t he", "t he"});
  EXPECT_EQ(tok.encode("the the", false), (std::vector<int>{259, 258}));
  EXPECT_EQ(tok.piece(258), G + "the");
  EXPECT_EQ(tok.decode(tok.encode("the the", false)), "the the");
  // "thethe" is one word: t he t he -> the the? only if "the the" were a merge; it is not.
  EXPECT_EQ(tok.encode("thethe", false), (std::vector<int>{259, 259}));
  // A newline is byte 0x0A, spelled 'Ċ'; no merge joins it to the next word.
  EXPECT_EQ(tok.encode("the\nthe", false), (std::vector<int>{259, '\n', 259}));
}

// Merges by rescanning all pairs for the lowest rank each step: the definition, slowly.
std::vector<std::string> naive_bpe(std::vector<std::string> symbols, const std::vector<std::string>& merges) {
  for (;;) {
    std::size_t best = merges.size(), at = 0;
    for (std::size_t i = 0; i + 1 < symbols.size(); ++i)
      for (std::size_t r = 0; r < best; ++r)
        if (merges[r] == symbols[i] + " " + symbols[i + 1]) best = r, at = i;
    if (best == merges.size()) return symbols;
    symbols[at] += symbols[at + 1];
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
}

TEST(BpeTokenizer, HeapMergesMatchTheDefinitionOnRandomText) {
  // Random merges over a 4-letter alphabet, applied to random words.
  std::mt19937 rng(5);
  std::vector<std::string> pieces = {"a", "b", "c", "d"}, merges, extra;
  std::set<std::string> seen(pieces.begin(), pieces.end());
  while (merges.size() < 40) {
    const std::string l = pieces[rng() % pieces.size()], r = pieces[rng() % pieces.size()];
    if (l.size() + r.size() > 6 || seen.contains(l + r)) continue;
    merges.push_back(l + " " + r);
    pieces.push_back(l + r);
    extra.push_back(l + r);
    seen.insert(l + r);
  }
  const BpeTokenizer tok = tiny(extra, merges);
  for (int trial = 0; trial < 500; ++trial) {
    std::string word;
    std::vector<std::string> chars;
    for (int i = std::uniform_int_distribution<int>(1, 24)(rng); i > 0; --i) {
      word += static_cast<char>('a' + rng() % 4);
      chars.emplace_back(1, word.back());
    }
    std::vector<int> expected;
    for (const std::string& s : naive_bpe(chars, merges)) {
      const auto it = std::find(extra.begin(), extra.end(), s);
      expected.push_back(s.size() == 1 ? s[0] : 256 + static_cast<int>(it - extra.begin()));
    }
    EXPECT_EQ(tok.encode(word, false), expected) << word;
  }
}

TEST(BpeTokenizer, RoundTripsAnyBytes) {
  const std::string G = utf8(U'\u0120');
  const BpeTokenizer tok = tiny({G + "t", "he"}, {G + " t", "h e"});
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text;
    for (int i = std::uniform_int_distribution<int>(0, 40)(rng); i > 0; --i)
      text += trial % 2 ? static_cast<char>(rng() % 256) : " the\n\u00e9\u4e2d"[rng() % 11];
    EXPECT_EQ(tok.decode(tok.encode(text, false)), text);
  }
}

TEST(BpeTokenizer, Llama3TakesVocabularyWordsWhole) {
  // "hello" is in the vocabulary but no merge builds it: llama-bpe takes it whole, gpt2 cannot.
  BpeTokenizer::Options llama3;
  llama3.pre = PreTokenizer::llama3;
  llama3.ignore_merges = true;
  EXPECT_EQ(tiny({"hello", "he"}, {"h e"}, llama3).encode("hello", false), (std::vector<int>{256}));
  EXPECT_EQ(tiny({"hello", "he"}, {"h e"}).encode("hello", false), (std::vector<int>{257, 'l', 'l', 'o'}));
}

TEST(BpeTokenizer, AddedAndControlTokens) {
  BpeTokenizer::Options o;
  o.bos = 256;
  o.eos = 257;
  std::vector<std::string> tokens = byte_vocabulary({"<|begin|>", "<|end|>", "<tool>", "ab"});
  std::vector<TokenType> types(tokens.size(), TokenType::normal);
  types[256] = types[257] = TokenType::control;
  types[258] = TokenType::user_defined;
  const BpeTokenizer tok(tokens, types, {"a b"}, o);
  // A user-defined token is always cut out; a control token only when special tokens are parsed.
  EXPECT_EQ(tok.encode("ab<tool>ab", false), (std::vector<int>{259, 258, 259}));
  EXPECT_EQ(tok.encode("x<|end|>", false, false, true), (std::vector<int>{'x', 257}));
  const std::vector<int> plain = tok.encode("x<|end|>", false);
  EXPECT_EQ(plain, (std::vector<int>{'x', '<', '|', 'e', 'n', 'd', '|', '>'}));  // no merges apply
  EXPECT_EQ(tok.decode(plain), "x<|end|>");
  EXPECT_EQ(tok.encode("ab", true, true), (std::vector<int>{256, 259, 257}));
  EXPECT_EQ(tok.decode(std::vector<int>{256, 259, 258, 257}), "ab<tool>");  // control tokens print nothing
  // Many special tokens in one text, interleaved and adjacent.
  std::string text;
  std::vector<int> expected;
  for (int i = 0; i < 200; ++i) {
    text += i % 3 == 0 ? "<tool>ab" : i % 3 == 1 ? "<|begin|><tool>" : "ab<|end|>";
    for (const int id : i % 3 == 0   ? std::vector<int>{258, 259}
                        : i % 3 == 1 ? std::vector<int>{256, 258}
                                     : std::vector<int>{259, 257})
      expected.push_back(id);
  }
  EXPECT_EQ(tok.encode(text, false, false, true), expected);
  EXPECT_EQ(tok.decode(tok.encode(text, false)), text);
}

TEST(BpeTokenizer, ConstructionErrors) {
  EXPECT_THROW(tiny({}, {}), Error);                       // no merges
  EXPECT_THROW(tiny({}, {"ab"}), Error);                   // a merge without its space
  EXPECT_THROW(BpeTokenizer({}, {}, {"a b"}, {}), Error);  // empty vocabulary
  BpeTokenizer::Options o;
  o.add_bos = true;  // but no BOS id
  EXPECT_THROW(tiny({}, {"a b"}, o), Error);
  o.bos = 999;
  EXPECT_THROW(tiny({}, {"a b"}, o), Error);
  EXPECT_THROW(BpeTokenizer(byte_vocabulary({}), {TokenType::normal}, {"a b"}, {}), Error);  // types count
  EXPECT_THROW((void)tiny({}, {"a b"}).encode("x", true), Error);                            // BOS asked, none exists
  EXPECT_THROW((void)tiny({}, {"a b"}).decode(std::vector<int>{256}), Error);
}

// A GGUF holding just a byte-level BPE tokenizer.
GgufWriter bpe_gguf(std::string_view pre, bool with_merges = true) {
  GgufWriter w;
  std::vector<std::string> tokens = byte_vocabulary({"<|begin_of_text|>", "ab"});
  std::vector<std::uint8_t> types;
  GgufWriter::put<std::uint32_t>(types, static_cast<std::uint32_t>(GgufType::int32));
  GgufWriter::put<std::uint64_t>(types, tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) GgufWriter::put<std::int32_t>(types, i == 256 ? 3 : 1);
  w.str("tokenizer.ggml.model", "gpt2").strings("tokenizer.ggml.tokens", tokens);
  w.raw("tokenizer.ggml.token_type", GgufType::array, types);
  if (with_merges) w.strings("tokenizer.ggml.merges", {"a b"});
  if (!pre.empty()) w.str("tokenizer.ggml.pre", pre);
  w.u32("tokenizer.ggml.bos_token_id", 256);
  return w;
}

TEST(BpeTokenizer, LoadsFromGguf) {
  const Tokenizer llama3(GgufFile::parse(bpe_gguf("llama-bpe").bytes()));
  EXPECT_EQ(llama3.kind(), "gpt2");
  EXPECT_TRUE(llama3.adds_bos());  // llama-bpe's default when the file does not say
  EXPECT_EQ(llama3.encode("ab 1234", llama3.adds_bos()), (std::vector<int>{256, 257, ' ', '1', '2', '3', '4'}));
  EXPECT_EQ(llama3.decode(llama3.encode("ab 1234", true)), "ab 1234");
  const Tokenizer qwen2(GgufFile::parse(bpe_gguf("qwen2").bytes()));
  EXPECT_FALSE(qwen2.adds_bos());
  GgufWriter no_bos = bpe_gguf("llama-bpe");
  no_bos.scalar("tokenizer.ggml.add_bos_token", GgufType::boolean, std::uint8_t{0});
  EXPECT_FALSE(Tokenizer(GgufFile::parse(no_bos.bytes())).adds_bos());
}

TEST(BpeTokenizer, GgufErrorsNameTheProblem) {
  const auto message = [](const GgufWriter& w) {
    try {
      (void)Tokenizer(GgufFile::parse(w.bytes()));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(bpe_gguf("llama-bpe", false)).find("merges"), std::string::npos);
  EXPECT_NE(message(bpe_gguf("")).find("tokenizer.ggml.pre"), std::string::npos);
  EXPECT_NE(message(bpe_gguf("falcon")).find("'falcon'"), std::string::npos);
  GgufWriter other;
  other.str("tokenizer.ggml.model", "t5").strings("tokenizer.ggml.tokens", {"a"});
  EXPECT_NE(message(other).find("'t5'"), std::string::npos);
}

}  // namespace
}  // namespace kvq::llama
