// kvq-conversations: several conversations that share a system prompt, held in one KVPool on a
// real model. Prints the memory per conversation with the prompt's blocks shared (fork) and with
// each conversation holding its own copy, checks that both give the same text, and rolls back
// rejected speculative tokens exactly. Prompts and drafts are fed as an engine feeds them: in
// chunks through kvq::attend, each chunk attending to its own keys and values exactly before
// the pool stores them; the conversations then generate together, a batch of one token each per
// step (Model::forward_batch), whose attention reads the prompt they share once.
//   kvq-conversations [--model PATH] [--config TEXT] [--conversations N] [--steps N] [--prefill-chunk N]

#include <fmt/core.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/kvq.hpp"
#include "llama/data_dir.hpp"
#include "llama/gguf.hpp"
#include "llama/inference.hpp"
#include "llama/model.hpp"
#include "llama/pool_backend.hpp"
#include "llama/tokenizer.hpp"

namespace {

/// Feeds tokens[from, size) in chunks of `chunk` tokens.
void feed_chunks(const kvq::llama::Model& model, kvq::llama::PoolBackend kv, std::span<const int> tokens,
                 std::size_t from, std::size_t chunk) {
  const std::size_t vocab = model.config().vocab;
  std::vector<float> chunk_logits(chunk * vocab);
  for (std::size_t pos = from; pos < tokens.size(); pos += chunk) {
    const std::size_t n = std::min(chunk, tokens.size() - pos);
    model.forward_chunk(tokens.subspan(pos, n), pos, kv, std::span<float>(chunk_logits).first(n * vocab));
  }
}

/// Feeds tokens[from, size): with `chunk` > 0 all but the last in chunks of that many tokens,
/// then one token at a time (the last for its logits); then generates `steps` greedy tokens.
std::vector<int> continue_greedy(const kvq::llama::Model& model, kvq::llama::PoolBackend kv, std::vector<int> tokens,
                                 std::size_t from, std::size_t steps, std::size_t chunk) {
  std::vector<float> logits(model.config().vocab);
  std::size_t pos = from;
  if (chunk > 0 && pos + 1 < tokens.size()) {
    feed_chunks(model, kv, std::span<const int>(tokens).first(tokens.size() - 1), pos, chunk);
    pos = tokens.size() - 1;
  }
  for (; pos < tokens.size(); ++pos) model.forward(tokens[pos], pos, kv, logits);
  for (std::size_t i = 0; i < steps; ++i) {
    tokens.push_back(kvq::llama::argmax(logits));
    model.forward(tokens.back(), tokens.size() - 1, kv, logits);
  }
  return tokens;
}

/// Greedy decoding of many sequences together: each of `texts` (fed but its last token) goes on by
/// `steps` tokens, one Model::forward_batch for all of them per step.
std::vector<std::vector<int>> generate_together(const kvq::llama::Model& model, kvq::llama::PoolBatchBackend& kv,
                                                std::vector<std::vector<int>> texts, std::size_t steps) {
  const std::size_t vocab = model.config().vocab, batch = texts.size();
  std::vector<float> logits(batch * vocab);
  std::vector<int> tokens(batch);
  std::vector<std::size_t> positions(batch);
  for (std::size_t i = 0; i < steps; ++i) {
    for (std::size_t b = 0; b < batch; ++b) {
      tokens[b] = texts[b].back();
      positions[b] = texts[b].size() - 1;
    }
    model.forward_batch(tokens, positions, kv, logits);
    for (std::size_t b = 0; b < batch; ++b)
      texts[b].push_back(kvq::llama::argmax(std::span<const float>(logits).subspan(b * vocab, vocab)));
  }
  return texts;
}

std::size_t parse_count(std::string_view flag, const std::string& v) {
  std::size_t used = 0, n = 0;
  try {
    n = std::stoul(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty() || v[0] == '-' || n == 0)
    throw kvq::Error(kvq::ErrorCode::invalid_argument,
                     std::string(flag) + " needs a positive integer, got '" + v + "'");
  return n;
}

int run(int argc, char** argv) {
  std::string model_path = kvq::llama::default_model_path().string(), config_text = "k4c32-v2t8-r32-s1";
  std::size_t conversations = 6, steps = 32, chunk = 64;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw kvq::Error(kvq::ErrorCode::invalid_argument, std::string(arg) + " needs a value");
      return argv[++i];
    };
    if (arg == "--model")
      model_path = value();
    else if (arg == "--config")
      config_text = value();
    else if (arg == "--conversations")
      conversations = parse_count(arg, value());
    else if (arg == "--steps")
      steps = parse_count(arg, value());
    else if (arg == "--prefill-chunk")
      chunk = parse_count(arg, value());
    else if (arg == "--help" || arg == "-h") {
      fmt::print(
          "usage: kvq-conversations [--model PATH] [--config TEXT] [--conversations N] [--steps N] "
          "[--prefill-chunk N (default 64)]\n");
      return 0;
    } else {
      throw kvq::Error(kvq::ErrorCode::invalid_argument, "unknown argument '" + std::string(arg) + "' (try --help)");
    }
  }
  if (model_path == kvq::llama::default_model_path().string() && !std::filesystem::exists(model_path))
    throw kvq::Error(kvq::ErrorCode::io, kvq::llama::data_help() + " (or pass --model PATH)");
  const kvq::CacheConfig config = kvq::parse_cache_config(config_text);
  if (config.key_rope != kvq::KeyRope::pre)
    throw kvq::Error(kvq::ErrorCode::unsupported,
                     "kvq-conversations hands the cache pre-RoPE keys: drop -post from '" + config_text + "'");
  auto file = kvq::llama::GgufFile::load(model_path);
  const kvq::llama::Model model = kvq::llama::Model::take_weights(file);  // the tokenizer reads the metadata
  const kvq::llama::Tokenizer tokenizer(file);
  const kvq::llama::LlamaConfig& m = model.config();

  // The shared system prompt: the held-out text's first paragraphs, up to 3/4 of the context;
  // one opening per conversation.
  std::ifstream text_file(kvq::llama::data_dir() / "text" / "tinystories_valid_excerpt.txt");
  std::string system_prompt, line;
  while (std::getline(text_file, line)) {
    const std::string longer = system_prompt.empty() ? line : system_prompt + "\n" + line;
    if (tokenizer.encode(longer, true).size() > m.context_length * 3 / 4) break;
    system_prompt = longer;
  }
  if (system_prompt.empty()) throw kvq::Error(kvq::ErrorCode::io, kvq::llama::data_help());
  const std::vector<std::string> openings = {" Then Roxy said,", " The next day,",   " Billy flew to",
                                             " Suddenly, a",     " Roxy smiled and", " Far away,"};
  const std::vector<int> prompt = tokenizer.encode(system_prompt, true);

  const kvq::PoolShape shape = kvq::llama::pool_shape(model, config, 4096);
  kvq::KVPool shared(shape, config), separate(shape, config);

  const kvq::SequenceId base = shared.add_sequence();
  (void)continue_greedy(model, kvq::llama::PoolBackend(shared, base), prompt, 0, 0, chunk);
  // Each conversation forks the prompt and is fed its opening but the last token; then all of
  // them generate together.
  std::vector<std::vector<int>> texts(conversations);
  std::vector<kvq::SequenceId> ids;
  for (std::size_t c = 0; c < conversations; ++c) {
    texts[c] = prompt;
    for (const int t : tokenizer.encode(openings[c % openings.size()], false)) texts[c].push_back(t);
    if (texts[c].size() + steps > m.context_length)
      throw kvq::Error(kvq::ErrorCode::invalid_argument, "--steps " + std::to_string(steps) +
                                                             " runs past the model's " +
                                                             std::to_string(m.context_length) + " positions");
    ids.push_back(shared.fork(base, prompt.size()));
    feed_chunks(model, kvq::llama::PoolBackend(shared, ids.back()),
                std::span<const int>(texts[c]).first(texts[c].size() - 1), prompt.size(), chunk);
  }
  kvq::llama::PoolBatchBackend together(shared, ids);
  const std::vector<std::vector<int>> starts = texts;
  texts = generate_together(model, together, texts, steps);
  // Each on its own: its own copy of the prompt, and its opening, fed in the same pieces (chunk
  // boundaries change the keys and values a model computes: a chunk sees its own exact, the rest
  // quantized), its tokens generated one at a time. Its bits differ in the last places (a batch's
  // matrix products and the cascade sum in other orders), and a window of fp16 rows may round
  // that to another value, so the text is what is compared.
  bool same_text = true;
  for (std::size_t c = 0; c < conversations; ++c) {
    const kvq::SequenceId own = separate.add_sequence();
    (void)continue_greedy(model, kvq::llama::PoolBackend(separate, own), prompt, 0, 0, chunk);
    const std::vector<int> alone =
        continue_greedy(model, kvq::llama::PoolBackend(separate, own), starts[c], prompt.size(), steps, chunk);
    same_text = same_text && alone == texts[c];
  }

  const kvq::PoolMemory with = shared.memory(), without = separate.memory();
  const double kib = 1024.0;
  fmt::print("{} conversations: a {}-token prompt, an opening, {} tokens generated; prompts in chunks of {}\n",
             conversations, prompt.size(), steps, chunk);
  fmt::print("{} ({} layers, {} KV heads x {}), {}, blocks of {} positions\n",
             std::filesystem::path(model_path).filename().string(), m.layers, m.kv_heads, m.head_dim, config_text,
             shape.block_tokens);
  fmt::print(
      "  prompt shared by fork:   {:8.1f} KiB used, {:6.1f} KiB per conversation ({:.1f} KiB of blocks shared;\n"
      "                           the prompt's own sequence counted too)\n",
      double(with.used) / kib, double(with.used) / kib / double(conversations), double(with.shared) / kib);
  fmt::print("  each its own prompt:     {:8.1f} KiB used, {:6.1f} KiB per conversation\n", double(without.used) / kib,
             double(without.used) / kib / double(conversations));
  fmt::print(
      "  generated together:      a batch of {} per step, whose attention read {} positions per layer\n"
      "                           once for all of them (the prompt's blocks they share)\n",
      conversations, together.last.shared_positions);
  fmt::print("  same text either way:    {}\n", same_text ? "yes" : "NO");

  // Speculative decoding: draft tokens the verifier rejects, rolled back; the conversation then
  // continues exactly as a fork taken before drafting does (a block it shares is copied before a
  // draft writes to it).
  const kvq::SequenceId id = ids.front();
  const std::size_t length = shared.length(id, 0);  // all but its last token, not fed yet
  const kvq::SequenceId plain = shared.fork(id, length);
  std::vector<int> drafted = texts.front();
  for (const int t : tokenizer.encode(" and the and the and the", false)) drafted.push_back(t);
  // Verified in a chunk, the last draft alone.
  (void)continue_greedy(model, kvq::llama::PoolBackend(shared, id), drafted, length, 0, chunk);
  shared.truncate(id, length);  // the drafts and the last token, which runs again for its logits
  const std::vector<int> after =
      continue_greedy(model, kvq::llama::PoolBackend(shared, id), texts.front(), length, 16, chunk);
  const std::vector<int> reference =
      continue_greedy(model, kvq::llama::PoolBackend(shared, plain), texts.front(), length, 16, chunk);
  fmt::print("  rollback of {} drafts:    {}\n", drafted.size() - texts.front().size(),
             after == reference ? "exact (same tokens as never drafting)" : "DIFFERS");
  fmt::print("\nconversation 0 after the prompt:{}\n",
             tokenizer.decode(std::span<const int>(texts.front()).subspan(prompt.size())));
  return same_text && after == reference ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq-conversations: %s\n", e.what());
    return 1;
  }
}
