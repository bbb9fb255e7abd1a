// kvq-conversations: several conversations that share a system prompt, held in one KVPool on a
// real model. Prints the memory per conversation with the prompt's blocks shared (fork) and with
// each conversation holding its own copy, checks that both give the same text, and rolls back
// rejected speculative tokens exactly. Prompts and drafts are fed as an engine feeds them: in
// chunks through kvq::attend, each chunk attending to its own keys and values exactly before
// the pool stores them; generated tokens one at a time through decode attention.
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
#include "llama/tokenizer.hpp"

namespace {

/// One sequence of a pool as the engine's KV backend: the cache stores pre-RoPE keys, so the
/// engine hands them over as they are and attention rotates them.
class PoolBackend {
 public:
  PoolBackend(kvq::KVPool& pool, kvq::SequenceId id) : pool_(pool), id_(id) {}
  void append(std::size_t layer, std::size_t position, std::span<const float> k, std::span<const float> v) {
    pool_.append(id_, layer, position, k, v);
  }
  void attend(std::size_t layer, std::size_t position, std::span<const float> q, std::span<float> out) {
    kvq::decode_attention(pool_.sequence(id_), layer, position, q, out);
  }
  /// A chunk of new positions: the stored prefix and, causally and exactly, the chunk's own
  /// keys and values, which the model appends afterwards.
  void attend_chunk(std::size_t layer, std::size_t first_position, std::size_t tokens, std::span<const float> q,
                    std::span<const float> k, std::span<const float> v, std::span<float> out) {
    kvq::attend(kvq::AttentionRequest{.cache = &pool_.sequence(id_),
                                      .layer = layer,
                                      .first_position = first_position,
                                      .tokens = tokens,
                                      .queries = q,
                                      .new_keys = k,
                                      .new_values = v,
                                      .out = out});
  }

 private:
  kvq::KVPool& pool_;
  kvq::SequenceId id_;
};
static_assert(kvq::llama::ChunkedKVBackend<PoolBackend>);

/// Feeds tokens[from, size): with `chunk` > 0 all but the last in chunks of that many tokens,
/// then one token at a time (the last for its logits); then generates `steps` greedy tokens.
std::vector<int> continue_greedy(const kvq::llama::Model& model, PoolBackend kv, std::vector<int> tokens,
                                 std::size_t from, std::size_t steps, std::size_t chunk) {
  const std::size_t vocab = model.config().vocab;
  std::vector<float> logits(vocab), chunk_logits(chunk * vocab);
  std::size_t pos = from;
  while (chunk > 0 && pos + 1 < tokens.size()) {
    const std::size_t n = std::min(chunk, tokens.size() - 1 - pos);
    model.forward_chunk(std::span<const int>(tokens).subspan(pos, n), pos, kv,
                        std::span<float>(chunk_logits).first(n * vocab));
    pos += n;
  }
  for (; pos < tokens.size(); ++pos) model.forward(tokens[pos], pos, kv, logits);
  for (std::size_t i = 0; i < steps; ++i) {
    tokens.push_back(kvq::llama::argmax(logits));
    model.forward(tokens.back(), tokens.size() - 1, kv, logits);
  }
  return tokens;
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

  const kvq::RopeConfig rope = model.rope_config();
  kvq::PoolShape shape;
  shape.layers = m.layers;
  shape.kv_heads = m.kv_heads;
  shape.head_dim = m.head_dim;
  shape.max_tokens = m.context_length;
  shape.block_tokens = kvq::block_unit(config);
  shape.memory_blocks = 4096;
  shape.rope_style = rope.style;
  shape.rope_theta = rope.theta;
  shape.rope_dims = rope.rotary_dims;
  shape.rope_scaling = rope.scaling;
  kvq::KVPool shared(shape, config), separate(shape, config);

  const kvq::SequenceId base = shared.add_sequence();
  (void)continue_greedy(model, PoolBackend(shared, base), prompt, 0, 0, chunk);
  std::vector<std::vector<int>> texts(conversations);
  bool same_text = true;
  std::vector<kvq::SequenceId> ids;
  for (std::size_t c = 0; c < conversations; ++c) {
    std::vector<int> start = prompt;
    for (const int t : tokenizer.encode(openings[c % openings.size()], false)) start.push_back(t);
    if (start.size() + steps > m.context_length)
      throw kvq::Error(kvq::ErrorCode::invalid_argument, "--steps " + std::to_string(steps) +
                                                             " runs past the model's " +
                                                             std::to_string(m.context_length) + " positions");
    ids.push_back(shared.fork(base, prompt.size()));
    texts[c] = continue_greedy(model, PoolBackend(shared, ids.back()), start, prompt.size(), steps, chunk);
    // Its own copy of the prompt, fed in the same pieces: chunk boundaries change the keys and
    // values a model computes (a chunk sees its own exact, the rest quantized).
    const kvq::SequenceId own = separate.add_sequence();
    (void)continue_greedy(model, PoolBackend(separate, own), prompt, 0, 0, chunk);
    const std::vector<int> alone =
        continue_greedy(model, PoolBackend(separate, own), start, prompt.size(), steps, chunk);
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
  fmt::print("  same text either way:    {}\n", same_text ? "yes" : "NO");

  // Speculative decoding: 8 draft tokens the verifier rejects, rolled back; the conversation then
  // continues exactly as if they had never been appended.
  const kvq::SequenceId id = ids.front();
  const std::size_t length = shared.sequence(id).length(0);
  std::vector<int> drafted = texts.front();
  for (const int t : tokenizer.encode(" and the and the and the", false)) drafted.push_back(t);
  (void)continue_greedy(model, PoolBackend(shared, id), drafted, length, 0, chunk);  // verified in one chunk
  shared.truncate(id, length - 1);  // the drafts and the last token, which runs again for its logits
  const std::vector<int> after = continue_greedy(model, PoolBackend(shared, id), texts.front(), length - 1, 16, chunk);
  // Never drafting: the opening fed as conversation 0 fed it, its generated tokens one at a time.
  const kvq::SequenceId plain = shared.fork(base, prompt.size());
  const std::vector<int> opened(texts.front().begin(), texts.front().end() - std::ptrdiff_t(steps));
  (void)continue_greedy(model, PoolBackend(shared, plain), opened, prompt.size(), 0, chunk);
  const std::vector<int> reference =
      continue_greedy(model, PoolBackend(shared, plain), texts.front(), opened.size(), 16, 0);
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
