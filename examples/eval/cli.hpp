#pragma once
// kvq-eval's command line: which configurations to measure on which model and text, and where
// to write the results. run_eval() is main() without the process, so tests can drive it.

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "eval/advisor.hpp"
#include "eval/calibrate.hpp"
#include "eval/distortion.hpp"
#include "eval/model_eval.hpp"
#include "eval/report.hpp"
#include "eval/synthetic.hpp"
#include "llama/data_dir.hpp"
#include "llama/gguf.hpp"
#include "llama/tokenizer.hpp"

namespace kvq::eval {

inline constexpr std::string_view usage =
    R"(kvq-eval: which KV-cache configuration can you trust for your model, and what does it cost?

Teacher-forces a text through a GGUF model (architectures llama and qwen2; SentencePiece or
byte-level BPE tokenizers) once with a full-precision cache and once per cache configuration,
and reports perplexity, KL divergence of the next-token distribution, top-1 agreement,
per-layer attention errors and bits per value. With --generate, each configuration also
continues prompts greedily from its own cache and is compared with the fp32 continuation.

usage: kvq-eval [options]
  --model PATH         GGUF model (default: $KVQ_DATA_DIR/stories260K/stories260K.gguf)
  --text PATH          text, stories separated by <|endoftext|>
                       (default: $KVQ_DATA_DIR/text/tinystories_valid_excerpt.txt)
  --tokens PATH        token ids instead of text, separated by white space, cut into
                       sequences of --context ids (no BOS is added; no tokenizer is needed)
  --set NAME           configuration set: default, axes, full, engines (default: default);
                       engines = the default set plus every engine format below, and
                       kvq caches in the engines' layouts (fp8, TurboQuant-style, HF)
  --configs A,B,...    explicit configurations, e.g. k4c32-v2t8-r0-s0,ggml-q4_0 (overrides --set),
                       or one per layer ('k8c32-v4t8-r0-s0;k4c32-v2t8-r0-s0*4', quoted);
                       a quantizer ending in a bare 'b' (k3c32b-v4t8-r0-s0) gets codebook levels
                       fitted to the model's own greedy text from BOS (pre-RoPE keys, values;
                       one codebook per tensor over layers and heads, or, in per-layer text
                       such as 'k3c32b-v4t8-r0-s0*5', per layer), printed in the table;
                       a bare 'bh' (k3c32bh-v4t8-r0-s0) fits one codebook per KV head, and a
                       'w' after either ('bw', 'bhw') weighs each value by what its error costs
                       (keys: squared queries per channel; values: squared attention weights)
  --stories N          evaluate the first N stories (default: all)
  --context N          truncate each story to N tokens (default: 512, or the model's
                       context length if shorter; more than that length is an error)
  --metric-stories N   stories that feed the per-layer attention metrics (default: 3)
  --attention NAME     what reads the quantized cache: exact (decode attention, fp32),
                       integer (decode attention on int8 dot products) or reference
                       (dequantize, then Eigen in double) (default: exact)
  --prefill-chunk N    feed each story (and each --generate prompt) in chunks of N tokens
                       through kvq::attend: a chunk attends to its own keys and values exactly,
                       then the cache stores them (default: one token at a time, each stored
                       before it attends to itself)
  --generate M         also generate M greedy tokens per story from each cache (default: 0, off)
  --prompt P           tokens of each story that prompt the generation (default: 64)
  --out DIR            where kvq-eval.csv and kvq-eval.svg go (default: kvq-eval-results)
  --advise             choose a configuration per layer instead: measure each candidate on each
                       layer alone, pick per layer the lowest summed KL within --budget, verify
                       it on all layers and compare it with the best uniform configuration;
                       the candidates are its 101, or the kvq configurations --configs lists
                       (each costs a run per layer: a few keep a large model's advice short)
  --budget B           average bits per value the advice may use, all counted (default: 4)
  --synthetic          run the synthetic mode (no model needed)
  --distortion         print the scalar-quantizer distortion table on synthetic head vectors
                       (affine, NormalFloat, Lloyd-Max, Hadamard; no model needed)
  --help               this text

Configuration strings: k<bits><c|t><group>[o<n>][s|g|n|l|i|e4m3|e5m2|b<levels>][.bf16|.f32]-v...
                      -r<window>-s<sinks>[-fk][-fv][-post][-hk|-hsk][-hv|-hsv][-f32]
  c = per channel (one scale per channel per run of <group> tokens), t = per token,
  o<n> = keep the n values of each group farthest out exact (dense-and-sparse outliers),
  s = symmetric, g = ggml's levels (k4t32g is llama.cpp's q4_0, k8t32g its q8_0; in the cache,
  read by kvq's kernels), n / l = NormalFloat / Lloyd-Max levels read through a table,
  i = llama.cpp's iq4_nl levels (4 bits), e4m3 / e5m2 = 8-bit floats with a scale per group
  (vLLM's fp8 cache with k8t<group>e4m3), b<levels> = a codebook (4 hex digits of f16 per level),
  k16/v16 = unquantized, -fk/-fv = keys/values leave the window R at a time once R have
  gathered (-fk: KIVI's keys; -fk-fv: Hugging Face's window), not as each group or token is due,
  -post = the cache receives post-RoPE keys,
  -hk/-hv = store keys/values rotated by a Hadamard transform per head (-hsk/-hsv: with random
  signs; pre-RoPE keys are rotated back before RoPE when attention reads them).

Engine formats, simulated (each stored key and value quantized and dequantized as the engine
stores it; attention reads them in fp32; bits/value counts the format's scales):
  ggml-<type>          llama.cpp's cache type <type>: q8_0, q4_0, q4_1, q5_0, q5_1 or iq4_nl;
                       post-RoPE K and V, each token's row in blocks of 32 values
  ggml-<type>-hadamard the same with llama.cpp's normalized Hadamard rotation of each K and V head
  fp8-e4m3, fp8-e5m2   vLLM's fp8 cache, per-tensor scale 1 (e4m3 saturates at 448)
  turbo-k<K>v<V>       TurboQuant-style (K, V in 2, 3, 4, 8): random-sign Hadamard per head,
                       Lloyd-Max levels (int8 at 8 bits), one fp16 scale per head vector
  hf-int4, hf-int2     Hugging Face's QuantizedCache defaults: post-RoPE K and V per 64 values
                       of a head vector, affine; the newest rows exact until 128 gather
The same layouts as kvq caches (in --set engines; <d> = head_dim):
  k8t<d>e4m3-v8t<d>e4m3-r0-s0-post and e5m2      vLLM's fp8 with a scale per head vector
  k<K>t<d>l-v<V>t<d>l-r0-s0-post-hsk-hsv          TurboQuant's layout (int8 symmetric at 8 bits)
  k<B>t64-v<B>t64-r128-s0-post                    HF's, the newest 128 tokens always exact
                                                  (-fk-fv after -s0: HF's window, flushed)
)";

struct EvalOptions {
  std::filesystem::path model, text, tokens, out = "kvq-eval-results";
  bool model_given = false, text_given = false, synthetic = false, distortion = false, help = false, advise = false;
  double budget = 4.0;  // --advise: average bits per value
  std::string set = "default", attention = "exact";
  std::vector<std::string> configs;
  std::size_t stories = 0, metric_stories = 3;
  std::size_t context = 0;                // 0: default_context, capped at the model's context length
  std::size_t generate = 0, prompt = 64;  // free-running generation: steps (0: off) and prompt tokens
  std::size_t prefill_chunk = 0;          // 0: one token at a time
};

inline constexpr std::size_t default_context = 512;

/// Tokens per story: --context if given (an error above the model's context length: positions it
/// was never trained on would be measured as if they were), else 512 capped at that length.
inline std::size_t resolve_context(const EvalOptions& o, std::size_t model_context, std::ostream& note) {
  if (o.context != 0) {
    if (o.context > model_context)
      throw Error(ErrorCode::invalid_argument, "--context " + std::to_string(o.context) +
                                                   " exceeds the model's context length of " +
                                                   std::to_string(model_context) + " tokens (llama.context_length)");
    return o.context;
  }
  if (model_context >= default_context) return default_context;
  note << "kvq-eval: note: --context defaults to " << default_context
       << " tokens; capped at the model's context length of " << model_context << "\n";
  return model_context;
}

/// A count written in plain digits: a sign, a space or a leading zero (' 5', '+5', '05') is a typo
/// that std::stoul would accept, and a value past size_t is refused rather than wrapped.
inline std::size_t parse_count(std::string_view flag, const std::string& text) {
  const bool plain = !text.empty() && (text.size() == 1 || text[0] != '0') &&
                     std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!plain)
    throw Error(ErrorCode::invalid_argument,
                std::string(flag) + " needs a non-negative whole number in plain digits, got '" + text + "'");
  std::size_t value = 0;
  if (std::from_chars(text.data(), text.data() + text.size(), value).ec != std::errc())
    throw Error(ErrorCode::invalid_argument, std::string(flag) + " value '" + text + "' is too large");
  return value;
}

/// A positive, finite number of bits per value ("4", "3.5"), the whole text a number.
inline double parse_bits(std::string_view flag, const std::string& text) {
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || !(value > 0) || !std::isfinite(value))
    throw Error(ErrorCode::invalid_argument,
                std::string(flag) + " needs a positive number of bits per value, got '" + text + "'");
  return value;
}

inline EvalOptions parse_options(const std::vector<std::string>& args) {
  EvalOptions o;
  o.model = llama::default_model_path();
  o.text = llama::data_dir() / "text" / "tinystories_valid_excerpt.txt";
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) throw Error(ErrorCode::invalid_argument, a + " needs a value");
      return args[++i];
    };
    if (a == "--model")
      o.model = value(), o.model_given = true;
    else if (a == "--text")
      o.text = value(), o.text_given = true;
    else if (a == "--tokens")
      o.tokens = value();
    else if (a == "--generate")
      o.generate = parse_count(a, value());
    else if (a == "--prompt") {
      o.prompt = parse_count(a, value());
      if (o.prompt == 0) throw Error(ErrorCode::invalid_argument, "--prompt must be at least 1 token");
    } else if (a == "--prefill-chunk") {
      o.prefill_chunk = parse_count(a, value());
      if (o.prefill_chunk == 0) throw Error(ErrorCode::invalid_argument, "--prefill-chunk must be at least 1 token");
    } else if (a == "--set")
      o.set = value();
    else if (a == "--attention")
      o.attention = value();
    else if (a == "--out")
      o.out = value();
    else if (a == "--stories")
      o.stories = parse_count(a, value());
    else if (a == "--context") {
      o.context = parse_count(a, value());
      if (o.context < 2) throw Error(ErrorCode::invalid_argument, "--context must be at least 2 tokens");
    } else if (a == "--metric-stories")
      o.metric_stories = parse_count(a, value());
    else if (a == "--synthetic")
      o.synthetic = true;
    else if (a == "--advise")
      o.advise = true;
    else if (a == "--budget")
      o.budget = parse_bits(a, value());
    else if (a == "--distortion")
      o.distortion = true;
    else if (a == "--help" || a == "-h")
      o.help = true;
    else if (a == "--configs") {
      std::stringstream list(value());
      for (std::string item; std::getline(list, item, ',');)
        if (!item.empty()) o.configs.push_back(item);
    } else {
      throw Error(ErrorCode::invalid_argument, "unknown option '" + a + "' (see --help)");
    }
  }
  const bool budget_given = std::find(args.begin(), args.end(), "--budget") != args.end();
  if (budget_given && !o.advise) throw Error(ErrorCode::invalid_argument, "--budget applies to --advise only");
  if (o.advise && (o.set != "default" || o.generate > 0 || o.synthetic || o.distortion))
    throw Error(ErrorCode::invalid_argument,
                "--advise chooses among its candidates (its own, or those --configs lists): it does not combine with "
                "--set, --generate, --synthetic or --distortion");
  if (o.advise)
    for (const std::string& c : o.configs) {
      if (is_engine_format_name(c))
        throw Error(ErrorCode::invalid_argument, "--advise candidate '" + c +
                                                     "' is an engine format, simulated for comparison; a per-layer "
                                                     "configuration holds kvq cache configurations only");
      if (is_layer_text(c))
        throw Error(ErrorCode::invalid_argument, "--advise candidate '" + c +
                                                     "' is per-layer text; --advise takes one configuration per "
                                                     "candidate and chooses one per layer itself");
      if (codebook_request(c))
        throw Error(ErrorCode::invalid_argument, "--advise candidate '" + c +
                                                     "' asks for calibrated codebooks; --advise takes configurations "
                                                     "as written (spell the levels as kvq-eval prints them)");
    }
  if (o.text_given && !o.tokens.empty()) throw Error(ErrorCode::invalid_argument, "give --text or --tokens, not both");
  if (o.set != "default" && o.set != "axes" && o.set != "full" && o.set != "engines")
    throw Error(ErrorCode::invalid_argument, "unknown --set '" + o.set + "': expected default, axes, full or engines");
  (void)attention_fn(o.attention);  // rejects unknown names here
  return o;
}

/// The configurations of a named set for a model of `head_dim`: per-token groups are capped at
/// the head dimension; per-channel groups run over 32 tokens. "engines" is "default" plus every
/// engine format.
inline std::vector<Candidate> config_set(const std::string& set, std::size_t head_dim) {
  const std::string t = std::to_string(std::min<std::size_t>(32, head_dim));
  std::vector<std::string> names = {"k16-v16-r0-s0"};
  auto axes = [&](int bits) {
    const std::string b = std::to_string(bits);
    for (const char* k : {"c32", "t"})
      for (const char* v : {"t", "c32"}) {
        const std::string kg = k[0] == 't' ? "t" + t : k, vg = v[0] == 't' ? "t" + t : v;
        names.push_back("k" + b + kg + "-v" + b + vg + "-r0-s0");
      }
  };
  for (int bits : {2, 3, 4, 8}) axes(bits);
  if (set != "axes") {
    for (const char* b : {"2", "4"}) names.push_back(std::string("k") + b + "c32-v" + b + "t" + t + "-r0-s0-post");
    for (const char* w : {"r32-s0", "r128-s0", "r0-s1", "r0-s4", "r128-s1"}) names.push_back("k2c32-v2t" + t + "-" + w);
    for (const char* kv : {"k4c32-v2t", "k2c32-v4t", "k8c32-v4t"}) names.push_back(std::string(kv) + t + "-r0-s0");
  }
  if (set == "full") {
    for (const char* b : {"2", "4"}) {
      names.push_back(std::string("k") + b + "c32s-v" + b + "t" + t + "s-r0-s0");
      names.push_back(std::string("k") + b + "c32-v" + b + "t" + t + "-r0-s0-f32");
      names.push_back(std::string("k") + b + "c32.bf16-v" + b + "t" + t + ".bf16-r0-s0");
      names.push_back(std::string("k") + b + "c16-v" + b + "t" + t + "-r0-s0");
      names.push_back(std::string("k") + b + "c64-v" + b + "t" + t + "-r0-s0");
    }
  }
  if (set == "engines") {
    for (const std::string& n : engine_format_names()) names.push_back(n);
    // The engines' layouts as kvq caches, with kvq's own scale rules. vLLM's fp8: a scale per
    // token's head vector instead of per tensor.
    const std::string h = std::to_string(head_dim);
    for (const char* f : {"e4m3", "e5m2"}) names.push_back("k8t" + h + f + "-v8t" + h + f + "-r0-s0-post");
    // TurboQuant-style: each head rotated (Hadamard with random signs) and coded per head vector,
    // Lloyd-Max levels scaled by the absmax (the simulated rows scale by the RMS), int8 symmetric.
    const auto turbo = [&](char tensor, int bits) {
      return tensor + std::to_string(bits) + "t" + h + (bits == 8 ? "s" : "l");
    };
    for (const auto& [k, v] : turbo_bit_pairs)
      names.push_back(turbo('k', k) + "-" + turbo('v', v) + "-r0-s0-post-hsk-hsv");
    // Hugging Face's QuantizedCache: groups of 64 channels (the head where it is shorter), the
    // newest 128 tokens exact (always 128 here; HF holds 0 to 127 between its flushes, which
    // -fk-fv reproduces).
    const std::string hf = "t" + std::to_string(EngineFormat::hf_group_of(head_dim));
    for (const char* b : {"4", "2"})
      names.push_back(std::string("k") + b + hf + "-v" + b + hf + "-r" + std::to_string(EngineFormat::hf_residual) +
                      "-s0-post");
  }
  std::vector<Candidate> configs;
  for (const std::string& n : names) configs.push_back(parse_candidate(n));
  return configs;
}

inline std::string read_file(const std::filesystem::path& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::io, "cannot read " + std::string(what) + " '" + path.string() + "'");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error(ErrorCode::io, "error reading " + std::string(what) + " '" + path.string() + "'");
  return text;
}

/// Stories split at <|endoftext|>, trimmed, tokenized with BOS, truncated to `context`.
inline std::vector<std::vector<int>> tokenize_stories(const std::string& text, const llama::Tokenizer& tok,
                                                      std::size_t context, std::size_t limit) {
  std::vector<std::vector<int>> stories;
  constexpr std::string_view sep = "<|endoftext|>";
  std::size_t begin = 0;
  while (begin <= text.size()) {
    const std::size_t end = std::min(text.find(sep, begin), text.size());
    const std::string story = text.substr(begin, end - begin);
    const std::size_t first = story.find_first_not_of(" \t\r\n"), last = story.find_last_not_of(" \t\r\n");
    if (first != std::string::npos) {
      std::vector<int> ids = tok.encode(story.substr(first, last - first + 1), tok.adds_bos(), false);
      if (ids.size() > context) ids.resize(context);
      if (ids.size() >= 2) stories.push_back(std::move(ids));
    }
    if (limit != 0 && stories.size() == limit) break;
    begin = end + sep.size();
  }
  return stories;
}

/// Token ids separated by white space, cut into consecutive sequences of `context` ids (a last
/// one shorter than two ids is dropped); at most `limit` sequences when limit != 0.
inline std::vector<std::vector<int>> read_token_stories(const std::filesystem::path& path, std::size_t vocab,
                                                        std::size_t context, std::size_t limit) {
  const std::string text = read_file(path, "token file");
  std::vector<int> ids;
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  for (std::size_t i = 0; i < text.size();) {
    if (space(text[i])) {
      ++i;
      continue;
    }
    std::size_t end = i;
    while (end < text.size() && !space(text[end])) ++end;
    const std::string_view word(text.data() + i, end - i);
    const std::string where = "token " + std::to_string(ids.size() + 1) + " of '" + path.string() + "'";
    std::size_t id = 0;
    const auto [stop, ec] = std::from_chars(word.data(), word.data() + word.size(), id);
    if (ec == std::errc::result_out_of_range || (ec == std::errc() && stop == word.data() + word.size() && id >= vocab))
      throw Error(ErrorCode::invalid_argument, where + ", id " + std::string(word) +
                                                   ", is outside the model's vocabulary of " + std::to_string(vocab) +
                                                   " tokens");
    if (ec != std::errc() || stop != word.data() + word.size())
      throw Error(ErrorCode::invalid_argument,
                  where + ", '" + std::string(word) + "', is not a token id (plain digits)");
    ids.push_back(static_cast<int>(id));
    i = end;
  }
  if (ids.size() < 2)
    throw Error(ErrorCode::invalid_argument, "token file '" + path.string() + "' holds fewer than two token ids");
  std::vector<std::vector<int>> stories;
  for (std::size_t begin = 0; begin + 2 <= ids.size() && (limit == 0 || stories.size() < limit); begin += context)
    stories.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(begin),
                         ids.begin() + static_cast<std::ptrdiff_t>(std::min(ids.size(), begin + context)));
  return stories;
}

inline void write_outputs(const EvalOptions& o, const std::vector<ConfigResult>& results, double baseline_nll,
                          const std::string& title, std::ostream& out) {
  std::filesystem::create_directories(o.out);
  const std::filesystem::path csv = o.out / "kvq-eval.csv", svg = o.out / "kvq-eval.svg";
  std::FILE* f = std::fopen(csv.string().c_str(), "w");
  if (f == nullptr) throw Error(ErrorCode::io, "cannot write '" + csv.string() + "'");
  write_csv(f, results, baseline_nll);
  std::fclose(f);
  std::ofstream(svg) << svg_chart(results, title);
  out << "wrote " << csv.string() << " and " << svg.string() << "\n";
}

/// The synthetic mode: KIVI's error table on structured random tensors at head dimension 128.
inline int run_synthetic(std::ostream& out) {
  out << "SYNTHETIC DATA (no model): keys with fixed outlier channels, a sink token that draws much of the\n"
         "attention and carries small values, head_dim 128, 512 tokens, 2 bits, group 32, no window.\n\n";
  const SyntheticSpec spec;
  auto run = [&](const char* c) { return synthetic_errors(spec, parse_cache_config(c)); };
  const AttentionErrors tt = run("k2t32-v2t32-r0-s0"), cc = run("k2c32-v2c32-r0-s0"), tc = run("k2t32-v2c32-r0-s0"),
                        ct = run("k2c32-v2t32-r0-s0");
  out << fmt::format("{:<44} {:>10} {:>12}   KIVI (Llama-2-13B): per-token / per-channel\n", "relative error",
                     "per-token", "per-channel");
  out << fmt::format("{:<44} {:>10.4f} {:>12.4f}   13.67 / 4.55\n", "key reconstruction ||K-K^||/||K||", tt.key_error,
                     cc.key_error);
  out << fmt::format("{:<44} {:>10.4f} {:>12.4f}   47.00 / 9.60\n", "attention score ||A-A^||/||A|| (K quantized)",
                     tt.score_error, cc.score_error);
  out << fmt::format("{:<44} {:>10.4f} {:>12.4f}   4.57 / 3.73\n", "value reconstruction ||V-V^||/||V||",
                     tt.value_error, cc.value_error);
  out << fmt::format("{:<44} {:>10.4f} {:>12.4f}   3.55 / 49.89\n", "attention output (V quantized)",
                     tt.output_error_values, cc.output_error_values);
  // What this mode measures is an attention-output error on synthetic tensors, not a task score:
  // KIVI's CoQA accuracies are shown beside it, and the two rankings are printed, not equated.
  struct Row {
    const char *name, *tag;
    double error, coqa;
  };
  const std::vector<Row> rows = {{"K per-token   / V per-token  ", "K-tok/V-tok", tt.output_error, 52.93},
                                 {"K per-channel / V per-channel", "K-chan/V-chan", cc.output_error, 2.88},
                                 {"K per-token   / V per-channel", "K-tok/V-chan", tc.output_error, 2.80},
                                 {"K per-channel / V per-token  ", "K-chan/V-tok", ct.output_error, 63.53}};
  out << fmt::format("\nboth quantized                   {:>12}   {}\n", "output error",
                     "KIVI CoQA accuracy (Llama-2-13B)");
  for (const Row& r : rows) out << fmt::format("  {}  {:>12.4f}   {:.2f}\n", r.name, r.error, r.coqa);
  const auto ranking = [&](auto better) {
    std::vector<Row> sorted = rows;
    std::stable_sort(sorted.begin(), sorted.end(), better);
    std::string s;
    for (const Row& r : sorted) s += (s.empty() ? "" : " > ") + std::string(r.tag);
    return s;
  };
  out << "ranked by this synthetic error (best first): "
      << ranking([](const Row& a, const Row& b) { return a.error < b.error; })
      << "\nranked by KIVI's CoQA accuracy (best first):  "
      << ranking([](const Row& a, const Row& b) { return a.coqa > b.coqa; })
      << "\nThe first measures one attention layer on made-up tensors, the second a whole model answering\n"
         "questions; only the first is measured here.\n";
  // The rotation llama.cpp applies to every quantized cache, on kvq's axes (post-RoPE keys, as
  // llama.cpp stores them): attention output error without it, with values rotated, with both.
  out << fmt::format("\nHadamard rotation of each head (post-RoPE keys)   output error: {:>8} {:>8} {:>8}\n", "plain",
                     "-hv", "-hk-hv");
  for (const char* c :
       {"k2t32-v2t32-r0-s0-post", "k4t128-v4t128-r0-s0-post", "k2c32-v2t32-r0-s0-post", "k4c32-v2t32-r0-s0-post"}) {
    CacheConfig config = parse_cache_config(c);
    const double plain = synthetic_errors(spec, config).output_error;
    config.value_rotation = Rotation::hadamard;
    const double values = synthetic_errors(spec, config).output_error;
    config.key_rotation = Rotation::hadamard;
    out << fmt::format("  {:<61} {:>8.4f} {:>8.4f} {:>8.4f}\n", c, plain, values,
                       synthetic_errors(spec, config).output_error);
  }
  return 0;
}

/// Runs job(0) .. job(n - 1) on all cores (at most 8 threads); the first error is rethrown
/// once every job has finished.
template <class Job>
void run_jobs(std::size_t n, Job job) {
  std::vector<std::exception_ptr> errors(n);
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    for (std::size_t i; (i = next++) < n;) {
      try {
        job(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> threads(std::max(1u, std::min(std::thread::hardware_concurrency(), 8u)) - 1);
  for (auto& t : threads) t = std::thread(worker);
  worker();
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

/// Evaluates configurations on all cores (the model and the baseline are read-only).
inline std::vector<ConfigResult> evaluate_all(const ModelEvaluation& evaluation, const std::vector<Candidate>& configs,
                                              std::ostream& progress,
                                              const GenerationEvaluation* generation = nullptr) {
  std::vector<ConfigResult> results(configs.size());
  std::atomic<std::size_t> done{0};
  std::mutex print;
  run_jobs(configs.size(), [&](std::size_t i) {
    results[i] = evaluation.evaluate(configs[i]);
    // Engine formats are simulated on the fp32 backend, which does not generate: no row for them.
    if (const auto* config = std::get_if<CacheConfig>(&configs[i]); generation != nullptr && config != nullptr)
      results[i].generation = generation->evaluate(*config);
    if (const auto* layers = std::get_if<LayerConfigs>(&configs[i]); generation != nullptr && layers != nullptr)
      results[i].generation = generation->evaluate(layers->configs);
    const std::lock_guard lock(print);
    progress << fmt::format("[{}/{}] {}\n", ++done, configs.size(), name_of(configs[i])) << std::flush;
  });
  return results;
}

inline int run_eval(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  try {
    const EvalOptions o = parse_options(args);
    if (o.help) {
      out << usage;
      return 0;
    }
    for (const std::string& c : o.configs) check_candidate_text(c);  // reject typos before any work
    if (o.distortion) {
      print_distortion_table(out);
      return 0;
    }
    if (o.synthetic) return run_synthetic(out);
    if (!o.model_given && !std::filesystem::exists(o.model)) {
      err << "kvq-eval: " << llama::data_help() << "\nrunning the synthetic mode instead.\n\n";
      return run_synthetic(out);
    }
    llama::GgufFile file = llama::GgufFile::load(o.model);
    const llama::Model model = llama::Model::take_weights(file);  // the file keeps the tokenizer's metadata
    const std::size_t context = resolve_context(o, model.config().context_length, err);
    const std::filesystem::path& source = o.tokens.empty() ? o.text : o.tokens;
    // Token ids need no tokenizer: a model whose tokenizer is not supported still runs on them.
    const auto stories = o.tokens.empty()
                             ? tokenize_stories(read_file(o.text, "text"), llama::Tokenizer(file), context, o.stories)
                             : read_token_stories(o.tokens, model.config().vocab, context, o.stories);
    if (stories.empty()) throw Error(ErrorCode::invalid_argument, "'" + source.string() + "' holds no story");
    std::vector<Candidate> configs;
    for (const std::string& c : o.configs) configs.push_back(resolve_candidate(model, c));
    if (configs.empty()) configs = config_set(o.set, model.config().head_dim);

    ModelEvaluation evaluation(model, stories, o.metric_stories, attention_fn(o.attention), o.prefill_chunk);
    std::optional<GenerationEvaluation> generation;
    if (o.generate > 0)
      generation.emplace(model, stories, o.prompt, o.generate, attention_fn(o.attention), o.prefill_chunk);
    const double base = evaluation.baseline_nll();
    out << fmt::format(
        "model {} ({}, {} layers, {} heads, {} KV heads, head_dim {}), text {}: {} stories, {} predictions\n",
        o.model.filename().string(), model.config().arch, model.config().layers, model.config().heads,
        model.config().kv_heads, model.config().head_dim, source.filename().string(), stories.size(),
        evaluation.predictions());
    out << fmt::format(
        "full-precision (fp32) cache: {:.4f} nats/token, perplexity {:.4f}; quantized caches read by {} attention\n",
        base, std::exp(base), o.attention);
    out << (o.prefill_chunk == 0
                ? std::string("stories fed one token at a time: each token is stored, quantized, before it attends to "
                              "itself\n\n")
                : fmt::format(
                      "stories fed in prefill chunks of {} tokens: a chunk attends to its own keys and values exactly, "
                      "then the cache stores them\n\n",
                      o.prefill_chunk));
    if (o.advise) {
      std::vector<CacheConfig> candidates;
      if (o.configs.empty()) candidates = advisor_candidates(model.config().head_dim);
      for (const std::string& c : o.configs)
        candidates.push_back(parse_cache_config(c));  // engine formats refused above
      const Advice advice = advise(evaluation, model.config().layers, std::move(candidates), o.budget,
                                   [](std::size_t n, auto job) { run_jobs(n, job); });
      print_advice(out, advice);
      return 0;
    }
    const std::vector<ConfigResult> results =
        evaluate_all(evaluation, configs, err, generation ? &*generation : nullptr);
    std::size_t longest = 0;
    for (const auto& s : stories) longest = std::max(longest, s.size());
    print_table(out, results, base, longest);
    out << "\nbits/value counts codes, scales, zero points and full-precision tokens at each story's length;\n"
           "KL and top-1 compare next-token distributions with the fp32 run; errors are relative L2 norms\n"
           "pooled over layers and heads, with each layer's exact q, k, v quantized on their own.\n";
    print_generation_table(out, results);
    write_outputs(o, results, base, "kvq-eval: " + o.model.filename().string(), out);
    return 0;
  } catch (const std::exception& e) {
    err << "kvq-eval: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace kvq::eval
