#pragma once
// Shared helpers for the llama engine tests: the shared data folder (skip when absent), the
// golden greedy output, the held-out stories, and a tiny random model.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/error.hpp"
#include "llama/data_dir.hpp"
#include "llama/gguf.hpp"
#include "llama/gguf_writer.hpp"
#include "llama/tokenizer.hpp"

namespace kvq::llama::testing {

// Skips the calling test (with how to obtain the data) when the shared data folder is absent.
#define KVQ_REQUIRE_LLAMA_DATA()                                                                                 \
  do {                                                                                                           \
    if (!std::filesystem::exists(::kvq::llama::default_model_path())) GTEST_SKIP() << ::kvq::llama::data_help(); \
  } while (0)

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::vector<std::uint8_t> read_bytes(const std::filesystem::path& path) {
  const std::string s = read_text(path);
  return {s.begin(), s.end()};
}

struct Golden {
  std::vector<int> tokens;
  std::string text;
};

// Just enough JSON for golden_greedy_256.json: the "tokens" integer array and the "text" string.
inline Golden read_golden() {
  const std::string json = read_text(data_dir() / "stories260K" / "golden_greedy_256.json");
  Golden g;
  std::size_t p = json.find('[', json.find("\"tokens\""));
  const std::size_t end = json.find(']', p);
  for (++p; p < end;) {
    while (p < end && (json[p] < '0' || json[p] > '9')) ++p;
    if (p >= end) break;
    int v = 0;
    while (p < end && json[p] >= '0' && json[p] <= '9') v = v * 10 + (json[p++] - '0');
    g.tokens.push_back(v);
  }
  p = json.find('"', json.find(':', json.find("\"text\""))) + 1;
  for (; p < json.size() && json[p] != '"'; ++p) {
    if (json[p] != '\\') {
      g.text += json[p];
      continue;
    }
    const char e = json[++p];
    g.text += e == 'n' ? '\n' : e == 't' ? '\t' : e;  // \" \\ \/ stand for themselves
  }
  return g;
}

/// The held-out stories, split at <|endoftext|> and trimmed.
inline std::vector<std::string> read_stories() {
  const std::string text = read_text(data_dir() / "text" / "tinystories_valid_excerpt.txt");
  std::vector<std::string> stories;
  constexpr std::string_view sep = "<|endoftext|>";
  for (std::size_t start = 0; start <= text.size();) {
    std::size_t stop = text.find(sep, start);
    if (stop == std::string::npos) stop = text.size();
    std::string story = text.substr(start, stop - start);
    const auto first = story.find_first_not_of(" \n\r\t");
    const auto last = story.find_last_not_of(" \n\r\t");
    if (first != std::string::npos) stories.push_back(story.substr(first, last - first + 1));
    start = stop + sep.size();
  }
  return stories;
}

/// The first `n` tokens of the held-out stories, each from BOS, joined (fewer if there are not n).
inline std::vector<int> joined_stories(const Tokenizer& tokenizer, std::size_t n) {
  std::vector<int> tokens;
  for (const auto& story : read_stories()) {
    const auto ids = tokenizer.encode(story);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    if (tokens.size() >= n) break;
  }
  tokens.resize(std::min(tokens.size(), n));
  return tokens;
}

struct TinyShape {
  std::uint64_t dim = 4, layers = 1, heads = 2, kv_heads = 1, ffn = 3, vocab = 5, context = 16;
};

// Largest difference between two logit arrays relative to the largest magnitude of the second.
inline double relative_difference(std::span<const float> a, std::span<const float> b) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(double(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(double(b[i])));
  }
  return diff / scale;
}

// What `call` throws as kvq::Error, or "no error".
template <class Call>
std::string error_text(Call&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

/// A small random model of `arch` (dim 4, 1 layer, 2 heads, 1 kv head, ffn 3, vocab 5 unless
/// `shape` says otherwise; no tokenizer), with a hook to rename or reshape tensors and one to add
/// metadata or tensors.
inline std::vector<std::uint8_t> tiny_model(
    const std::string& arch, const TinyShape& shape = {},
    const std::function<void(std::string&, std::vector<std::uint64_t>&)>& tweak = {},
    const std::function<void(GgufWriter&)>& extra = {}) {
  const TinyShape& s = shape;
  const std::uint64_t head_dim = s.dim / s.heads, kv = s.kv_heads * head_dim;
  GgufWriter w;
  w.str("general.architecture", arch)
      .u32(arch + ".embedding_length", std::uint32_t(s.dim))
      .u32(arch + ".block_count", std::uint32_t(s.layers))
      .u32(arch + ".attention.head_count", std::uint32_t(s.heads))
      .u32(arch + ".attention.head_count_kv", std::uint32_t(s.kv_heads))
      .u32(arch + ".feed_forward_length", std::uint32_t(s.ffn))
      .u32(arch + ".context_length", std::uint32_t(s.context))
      .f32(arch + ".attention.layer_norm_rms_epsilon", 1e-5f);
  std::vector<std::pair<std::string, std::vector<std::uint64_t>>> tensors = {{"token_embd.weight", {s.dim, s.vocab}},
                                                                             {"output_norm.weight", {s.dim}}};
  for (std::uint64_t l = 0; l < s.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    for (auto t :
         std::vector<std::pair<std::string, std::vector<std::uint64_t>>>{{p + "attn_norm.weight", {s.dim}},
                                                                         {p + "attn_q.weight", {s.dim, s.dim}},
                                                                         {p + "attn_k.weight", {s.dim, kv}},
                                                                         {p + "attn_v.weight", {s.dim, kv}},
                                                                         {p + "attn_output.weight", {s.dim, s.dim}},
                                                                         {p + "ffn_norm.weight", {s.dim}},
                                                                         {p + "ffn_gate.weight", {s.dim, s.ffn}},
                                                                         {p + "ffn_up.weight", {s.dim, s.ffn}},
                                                                         {p + "ffn_down.weight", {s.ffn, s.dim}}})
      tensors.push_back(std::move(t));
  }
  float seed = 0.1f;
  for (auto [name, dims] : tensors) {
    if (tweak) tweak(name, dims);
    std::size_t n = 1;
    for (const auto d : dims) n *= d;
    std::vector<float> values(n);
    for (auto& v : values) v = seed = std::fmod(seed * 7.31f + 0.37f, 2.0f) - 1.0f;
    w.tensor_f32(name, dims, values);
  }
  if (extra) extra(w);
  return w.bytes();
}

}  // namespace kvq::llama::testing
