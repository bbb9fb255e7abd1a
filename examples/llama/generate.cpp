// llama-generate: greedy text from a GGUF Llama model with the full-precision KV cache.
//   llama-generate [--model PATH] [--steps N] [--prompt TEXT] [--prefill-chunk N]
// The prompt is fed in chunks of N tokens (default 64) that attend to each other exactly, as an
// engine prefills; --prefill-chunk 0 feeds it one token at a time.

#include <fmt/core.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>

#include "llama/data_dir.hpp"
#include "llama/full_precision_backend.hpp"
#include "llama/gguf.hpp"
#include "llama/inference.hpp"
#include "llama/model.hpp"
#include "llama/tokenizer.hpp"

namespace {

int run(int argc, char** argv) {
  std::string model_path = kvq::llama::default_model_path().string();
  std::size_t steps = 256;
  std::string prompt;
  std::size_t prefill_chunk = 64;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw kvq::Error(kvq::ErrorCode::invalid_argument, std::string(arg) + " needs a value");
      return argv[++i];
    };
    if (arg == "--model") {
      model_path = value();
    } else if (arg == "--steps" || arg == "-n" || arg == "--prefill-chunk") {
      const std::string v = value();
      std::size_t used = 0, n = 0;
      try {
        n = std::stoul(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != v.size() || v.empty() || v[0] == '-')
        throw kvq::Error(kvq::ErrorCode::invalid_argument,
                         std::string(arg) + " needs a non-negative integer, got '" + v + "'");
      (arg == "--prefill-chunk" ? prefill_chunk : steps) = n;
    } else if (arg == "--prompt") {
      prompt = value();
    } else if (arg == "--help" || arg == "-h") {
      fmt::print(
          "usage: llama-generate [--model PATH] [--steps N] [--prompt TEXT] [--prefill-chunk N]\n"
          "  default model: {}\n",
          model_path);
      return 0;
    } else {
      throw kvq::Error(kvq::ErrorCode::invalid_argument, "unknown argument '" + std::string(arg) + "' (try --help)");
    }
  }

  if (model_path == kvq::llama::default_model_path().string() && !std::filesystem::exists(model_path))
    throw kvq::Error(kvq::ErrorCode::io, kvq::llama::data_help() + " (or pass --model PATH)");
  auto file = kvq::llama::GgufFile::load(model_path);
  const kvq::llama::Model model = kvq::llama::Model::take_weights(file);  // the tokenizer reads the metadata
  const kvq::llama::Tokenizer tokenizer(file);
  const std::size_t context = model.config().context_length;
  if (steps > context) steps = context;
  // Sized by the positions that run, not by llama.context_length, which no tensor backs.
  kvq::llama::FullPrecisionBackend kv(model, std::max<std::size_t>(steps, 1));
  const auto prompt_tokens = tokenizer.encode(prompt);  // with BOS where the model expects it
  const auto tokens = kvq::llama::greedy_generate(model, kv, steps, prompt_tokens, tokenizer.bos(), prefill_chunk);
  fmt::print("{}\n", tokenizer.decode(tokens));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-generate: %s\n", e.what());
    return 1;
  }
}
