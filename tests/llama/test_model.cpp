// Llama forward pass with the full-precision backend: exact golden greedy tokens, held-out
// perplexity, and clear errors for models this engine cannot run.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <functional>
#include <numbers>
#include <span>
#include <variant>
#include <string>
#include <vector>

#include "eval/cache_backend.hpp"
#include "llama/full_precision_backend.hpp"
#include "kvq/core/half.hpp"
#include "llama/ggml_blocks.hpp"
#include "llama/gguf.hpp"
#include "llama/inference.hpp"
#include "llama/llama_test_support.hpp"
#include "llama/model.hpp"
#include "llama/tokenizer.hpp"

namespace kvq::llama {
namespace {

using testing::GgufWriter;

TEST(Model, HyperParametersOfStories260K) {
  KVQ_REQUIRE_LLAMA_DATA();
  const Model model = Model::load(default_model_path());
  const LlamaConfig& c = model.config();
  EXPECT_EQ(c.dim, 64u);
  EXPECT_EQ(c.layers, 5u);
  EXPECT_EQ(c.heads, 8u);
  EXPECT_EQ(c.kv_heads, 4u);
  EXPECT_EQ(c.head_dim, 8u);
  EXPECT_EQ(c.ffn_dim, 172u);
  EXPECT_EQ(c.vocab, 512u);
  EXPECT_EQ(c.context_length, 2048u);  // the GGUF says 2048; llama2.c trained it with 512
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
  EXPECT_EQ(c.bos, 1);
  EXPECT_EQ(c.eos, 2);
  const RopeConfig rope = model.rope_config();
  EXPECT_EQ(rope.style, RopeStyle::adjacent_pairs);
  EXPECT_EQ(rope.head_dim, 8u);
  EXPECT_EQ(rope.dims(), 8u);
  EXPECT_EQ(rope.theta, 10000.0f);
}

TEST(Model, GreedyDecodingReproducesGoldenTokens) {
  KVQ_REQUIRE_LLAMA_DATA();
  const Model model = Model::load(default_model_path());
  const auto golden = testing::read_golden();
  ASSERT_EQ(golden.tokens.size(), 257u);
  FullPrecisionBackend kv(model, 512);
  const auto tokens = greedy_generate(model, kv, 256);
  EXPECT_EQ(tokens, golden.tokens);
  EXPECT_EQ(kv.length(0), 256u);
  EXPECT_EQ(kv.keys(4).size(), 256u * model.config().kv_dim());

  // Teacher forcing the golden tokens must agree: each position's argmax is the next token.
  const auto tf = teacher_forced(
      model, [&] { return FullPrecisionBackend(model, 512); }, golden.tokens);
  ASSERT_EQ(tf.log_probs.size(), 257u * 512u);
  ASSERT_EQ(tf.nll.size(), 256u);
  for (std::size_t i = 0; i + 1 < golden.tokens.size(); ++i) EXPECT_EQ(argmax(tf.row(i)), golden.tokens[i + 1]) << i;
}

TEST(Model, HeldOutPerplexity) {
  KVQ_REQUIRE_LLAMA_DATA();
  const auto file = GgufFile::load(default_model_path());
  const Model model(file);
  const Tokenizer tok(file);
  const std::size_t context = 512;  // llama2.c's training context for stories260K
  double total = 0.0;
  std::size_t count = 0;
  for (const auto& story : testing::read_stories()) {
    auto tokens = tok.encode(story);
    if (tokens.size() > context) tokens.resize(context);
    const auto tf = teacher_forced(
        model, [&] { return FullPrecisionBackend(model, context); }, tokens);
    total += tf.total_nll();
    count += tf.nll.size();
  }
  const double nats = total / static_cast<double>(count);
  std::printf("held-out: %zu tokens, %.4f nats/token, perplexity %.4f\n", count, nats, std::exp(nats));
  EXPECT_GT(count, 2000u);
  EXPECT_GT(nats, 1.10);
  EXPECT_LT(nats, 1.18);
}

TEST(Model, BackendRejectsMisuse) {
  KVQ_REQUIRE_LLAMA_DATA();
  const Model model = Model::load(default_model_path());
  FullPrecisionBackend kv(model, 2);
  std::vector<float> logits(512), small(3);
  EXPECT_THROW(model.forward(1, 1, kv, logits), Error);  // position 1 before position 0
  model.forward(1, 0, kv, logits);
  model.forward(403, 1, kv, logits);
  EXPECT_THROW(model.forward(407, 2, kv, logits), Error);  // capacity 2
  EXPECT_THROW(model.forward(600, 2, kv, logits), Error);  // token outside the vocabulary
  EXPECT_THROW(model.forward(1, 2, kv, small), Error);     // logits buffer size
  const std::vector<float> k(32), q(64);
  std::vector<float> out(64);
  EXPECT_THROW(kv.append(5, 0, k, k), Error);                      // layer
  EXPECT_THROW(kv.append(0, 2, std::span(k).first(8), k), Error);  // shape
  EXPECT_THROW(kv.attend(0, 2, q, out), Error);                    // not stored
  kv.clear();
  EXPECT_EQ(kv.length(0), 0u);
  model.forward(1, 0, kv, logits);
  EXPECT_EQ(argmax(logits), 403);
}

std::vector<std::uint8_t> tiny_llama(std::string arch,
                                     std::function<void(std::string&, std::vector<std::uint64_t>&)> tweak = {},
                                     const std::function<void(GgufWriter&)>& extra = {}) {
  return testing::tiny_model(std::move(arch), {}, std::move(tweak), extra);
}

std::string model_error(const std::vector<std::uint8_t>& bytes) {
  try {
    (void)Model(GgufFile::parse(bytes, "tiny.gguf"));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Model, TinySyntheticModelRuns) {
  const Model model(GgufFile::parse(tiny_llama("llama")));
  EXPECT_EQ(model.config().head_dim, 2u);
  FullPrecisionBackend kv(model, 10);
  const auto tokens = greedy_generate(model, kv, 10, std::vector<int>{1, 2, 3});
  EXPECT_EQ(tokens.size(), 11u);
  EXPECT_EQ(std::vector<int>(tokens.begin(), tokens.begin() + 3), (std::vector<int>{1, 2, 3}));
  for (const int t : tokens) EXPECT_LT(t, 5);
  EXPECT_EQ(kv.length(0), 10u);
}

TEST(Model, RejectsOtherArchitecturesAndWrongShapes) {
  const std::string gpt2 = model_error(tiny_llama("gpt2"));
  EXPECT_NE(gpt2.find("'gpt2'"), std::string::npos) << gpt2;
  EXPECT_NE(gpt2.find("llama"), std::string::npos) << gpt2;

  const std::string shape = model_error(tiny_llama("llama", [](std::string& name, std::vector<std::uint64_t>& dims) {
    if (name == "blk.0.attn_k.weight") dims = {4, 4};
  }));
  EXPECT_NE(shape.find("blk.0.attn_k.weight"), std::string::npos) << shape;
  EXPECT_NE(shape.find("[4, 4]"), std::string::npos) << shape;
  EXPECT_NE(shape.find("[4, 2]"), std::string::npos) << shape;

  const std::string missing = model_error(tiny_llama("llama", [](std::string& name, std::vector<std::uint64_t>&) {
    if (name == "blk.0.ffn_up.weight") name = "blk.0.ffn_upp.weight";
  }));
  EXPECT_NE(missing.find("blk.0.ffn_up.weight"), std::string::npos) << missing;
  EXPECT_NE(missing.find("tiny.gguf"), std::string::npos) << missing;
}

// Records layer 0's q, k and v on their way into a full-precision backend.
class Layer0Recorder {
 public:
  Layer0Recorder(const Model& model, std::size_t positions) : inner_(model, positions) {}
  void append(std::size_t layer, std::size_t position, std::span<const float> k, std::span<const float> v) {
    if (layer == 0) k_.insert(k_.end(), k.begin(), k.end()), v_.insert(v_.end(), v.begin(), v.end());
    inner_.append(layer, position, k, v);
  }
  void attend(std::size_t layer, std::size_t position, std::span<const float> q, std::span<float> out) {
    if (layer == 0) q_.insert(q_.end(), q.begin(), q.end());
    inner_.attend(layer, position, q, out);
  }
  std::vector<float> q_, k_, v_;

 private:
  FullPrecisionBackend inner_;
};

struct Qwen2Run {
  Layer0Recorder recorded;
  std::vector<float> logits;  // every position's, concatenated
};

Qwen2Run run_tokens(const Model& model, const std::vector<int>& tokens) {
  Qwen2Run r{Layer0Recorder(model, tokens.size()), {}};
  std::vector<float> logits(model.config().vocab);
  for (std::size_t p = 0; p < tokens.size(); ++p) {
    model.forward(tokens[p], p, r.recorded, logits);
    r.logits.insert(r.logits.end(), logits.begin(), logits.end());
  }
  return r;
}

std::vector<std::uint8_t> tiny_qwen2(const std::vector<float>& bq, const std::vector<float>& bk,
                                     const std::vector<float>& bv) {
  return tiny_llama("qwen2", {}, [&](GgufWriter& w) {
    w.tensor_f32("blk.0.attn_q.bias", {4}, bq)
        .tensor_f32("blk.0.attn_k.bias", {2}, bk)
        .tensor_f32("blk.0.attn_v.bias", {2}, bv);
  });
}

// qwen2 is the llama block plus biases on q, k and v, with NeoX RoPE. Layer 0's inputs do not
// depend on attention, so its q, k, v must be the bias-free model's plus the biases, exactly;
// with zero biases the logits must be the llama model's (head_dim 2 has one rotation pair, which
// both RoPE conventions rotate alike).
TEST(Model, Qwen2AddsQkvBiasesAndRotatesHalves) {
  const std::vector<float> bq{0.5f, -0.25f, 0.125f, 1.0f}, bk{-1.0f, 0.75f}, bv{0.3f, -0.6f};
  const Model llama(GgufFile::parse(tiny_llama("llama")));
  const Model qwen(GgufFile::parse(tiny_qwen2(bq, bk, bv)));
  EXPECT_EQ(qwen.rope_config().style, RopeStyle::half_split);
  EXPECT_EQ(llama.rope_config().style, RopeStyle::adjacent_pairs);
  EXPECT_TRUE(qwen.config().qkv_bias);
  EXPECT_FALSE(llama.config().qkv_bias);
  const std::vector<int> tokens{1, 4, 2, 0, 3};
  const Qwen2Run plain = run_tokens(llama, tokens), biased = run_tokens(qwen, tokens);
  ASSERT_EQ(biased.recorded.q_.size(), tokens.size() * 4);
  for (std::size_t p = 0; p < tokens.size(); ++p) {
    for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(biased.recorded.q_[p * 4 + i], plain.recorded.q_[p * 4 + i] + bq[i]);
    for (std::size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(biased.recorded.k_[p * 2 + i], plain.recorded.k_[p * 2 + i] + bk[i]);
      EXPECT_EQ(biased.recorded.v_[p * 2 + i], plain.recorded.v_[p * 2 + i] + bv[i]);
    }
  }
  EXPECT_NE(biased.logits, plain.logits);
  const Model zero(GgufFile::parse(tiny_qwen2({0, 0, 0, 0}, {0, 0}, {0, 0})));
  EXPECT_EQ(run_tokens(zero, tokens).logits, plain.logits);
}

TEST(Model, Qwen2NeedsItsBiasesAndUnusedTensorsAreRefused) {
  const std::string missing = model_error(tiny_llama("qwen2"));
  EXPECT_NE(missing.find("blk.0.attn_q.bias"), std::string::npos) << missing;
  EXPECT_NE(missing.find("qwen2.block_count"), std::string::npos) << missing;
  EXPECT_EQ(model_error(tiny_llama("llama", {}, [](GgufWriter& w) { w.str("llama.rope.scaling.type", "none"); })), "");
  // A tensor the block does not use is refused, not ignored.
  const std::string extra = model_error(tiny_llama("llama", {}, [](GgufWriter& w) {
    w.tensor_f32("blk.0.attn_output.bias", {4}, {1, 2, 3, 4});
  }));
  EXPECT_NE(extra.find("tensor 'blk.0.attn_output.bias' is not part of the llama block"), std::string::npos) << extra;
}

// The real model with one uint32 metadata value replaced.
std::vector<std::uint8_t> real_model_with(std::string_view key, std::uint32_t value) {
  auto bytes = testing::read_bytes(default_model_path());
  std::vector<std::uint8_t> needle;
  GgufWriter::put_string(needle, key);
  GgufWriter::put<std::uint32_t>(needle, static_cast<std::uint32_t>(GgufType::uint32));
  const auto it = std::search(bytes.begin(), bytes.end(), needle.begin(), needle.end());
  if (it == bytes.end()) throw std::runtime_error(std::string(key) + " is not a uint32 in the real model");
  std::memcpy(&*(it + static_cast<std::ptrdiff_t>(needle.size())), &value, 4);
  return bytes;
}

// Issue "no allocation a file did not pay for": llama.block_count = 2^24 in the real model sized
// 16M empty layers (3.28 GB, 12-19 s) before "tensor missing". Counts are checked against the
// tensors first, and the message names the key.
TEST(Model, MetadataCountsMustBeBackedByTensors) {
  KVQ_REQUIRE_LLAMA_DATA();
  const auto error_of = [](std::string_view key, std::uint32_t value) {
    try {
      (void)Model(GgufFile::parse(real_model_with(key, value), "patched.gguf"));
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::io) << e.what();
      return std::string(e.what());
    }
    return std::string();
  };
  for (const std::uint32_t blocks : {1u << 24, 6u}) {
    const std::string e = error_of("llama.block_count", blocks);
    EXPECT_NE(e.find("llama.block_count = " + std::to_string(blocks)), std::string::npos) << e;
    EXPECT_NE(e.find("holds only 48 tensors"), std::string::npos) << e;
    EXPECT_NE(e.find("patched.gguf"), std::string::npos) << e;
  }
  const std::string kv = error_of("llama.attention.head_count_kv", 2);
  EXPECT_NE(kv.find("llama.attention.head_count_kv"), std::string::npos) << kv;
  EXPECT_NE(kv.find("attn_k.weight"), std::string::npos) << kv;
  const std::string heads = error_of("llama.attention.head_count", 1u << 24);
  EXPECT_NE(heads.find("head counts"), std::string::npos) << heads;
  const std::string dim = error_of("llama.embedding_length", 128);
  EXPECT_NE(dim.find("llama.embedding_length"), std::string::npos) << dim;
  const std::string ffn = error_of("llama.feed_forward_length", 1u << 24);
  EXPECT_NE(ffn.find("llama.feed_forward_length"), std::string::npos) << ffn;
  const std::string ctx = error_of("llama.context_length", (1u << 24) + 1);
  EXPECT_NE(ctx.find("llama.context_length"), std::string::npos) << ctx;
}

TEST(Model, TensorsOfOneBlockMissingNamesBlockCount) {
  // Block 1 of 2 is absent while the tensor count could hold it (extra tensors pad the count).
  GgufWriter w;
  auto bytes = tiny_llama("llama");
  const auto one_block = GgufFile::parse(bytes);
  w.str("general.architecture", "llama")
      .u32("llama.embedding_length", 4)
      .u32("llama.block_count", 2)
      .u32("llama.attention.head_count", 2)
      .u32("llama.attention.head_count_kv", 1)
      .u32("llama.feed_forward_length", 3)
      .u32("llama.context_length", 16)
      .f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  for (const GgufTensor& t : one_block.tensors()) w.tensor_f32(t.name, t.dims, t.data);
  for (int i = 0; i < 9; ++i) w.tensor_f32("pad." + std::to_string(i), {1}, {0.0f});
  const std::string e = model_error(w.bytes());
  EXPECT_NE(e.find("llama.block_count = 2"), std::string::npos) << e;
  EXPECT_NE(e.find("blk.1.attn_norm.weight"), std::string::npos) << e;
}

// The real model re-written with every tensor whose rows are whole Q8_0 blocks in Q8_0 (ggml's
// reference quantizer: d = amax / 127, codes rounded): it loads through the quantized path and
// predicts as the F32 model does, within what 8-bit weights cost.
TEST(Model, Q8_0WeightsRunEndToEnd) {
  KVQ_REQUIRE_LLAMA_DATA();
  const auto original = GgufFile::load(default_model_path());
  GgufWriter w;
  for (const auto& [key, value] : original.metadata()) {
    if (value.type == GgufType::array) continue;  // only the tokenizer's arrays; the model needs none
    if (const auto* s = std::get_if<std::string>(&value.data))
      w.str(key, *s);
    else if (value.type == GgufType::float32)
      w.f32(key, static_cast<float>(std::get<double>(value.data)));
    else if (value.type == GgufType::uint32)
      w.u32(key, static_cast<std::uint32_t>(std::get<std::uint64_t>(value.data)));
  }
  std::size_t quantized = 0;
  for (const GgufTensor& t : original.tensors()) {
    if (t.dims[0] % 32 != 0) {
      w.tensor_f32(t.name, t.dims, t.data);
      continue;
    }
    std::vector<std::uint8_t> blocks;
    for (std::size_t b = 0; b < t.data.size(); b += 32) {
      float amax = 0.0f;
      for (std::size_t j = 0; j < 32; ++j) amax = std::max(amax, std::abs(t.data[b + j]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      GgufWriter::put(blocks, to_fp16(d).bits);
      for (std::size_t j = 0; j < 32; ++j)
        blocks.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(std::lround(t.data[b + j] * id))));
    }
    w.tensor(t.name, t.dims, ggml_type_q8_0, blocks);
    ++quantized;
  }
  EXPECT_GE(quantized, 40u);
  const auto file = GgufFile::parse(w.bytes(), "q8_0.gguf");
  EXPECT_EQ(file.tensor("blk.0.attn_q.weight").type, ggml_type_q8_0);
  const Model q8(file), f32(original);
  const auto tokens = Tokenizer(original).encode(testing::read_stories()[0]);
  const auto run = [&](const Model& m) {
    return teacher_forced(
        m, [&] { return FullPrecisionBackend(m, tokens.size()); }, tokens);
  };
  const auto a = run(f32), b = run(q8);
  const double nll_a = a.total_nll() / double(a.nll.size()), nll_b = b.total_nll() / double(b.nll.size());
  EXPECT_NEAR(nll_b, nll_a, 0.02 * nll_a);
  std::size_t agree = 0;
  for (std::size_t i = 0; i + 1 < tokens.size(); ++i) agree += argmax(a.row(i)) == argmax(b.row(i));
  EXPECT_GT(double(agree), 0.95 * double(tokens.size() - 1));
  EXPECT_NE(nll_a, nll_b);  // the weights really were quantized
}

std::string model_error_of(const std::vector<std::uint8_t>& bytes, ErrorCode expected) {
  try {
    (void)Model(GgufFile::parse(bytes, "patched.gguf"));
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), expected) << e.what();
    return e.what();
  }
  return "accepted";
}

// Partial RoPE (llama.rope.dimension_count < head_dim) reaches the cache: a pre-RoPE kvq cache
// (fp32 rows, exact attention) predicts what the full-precision backend does, and both differ
// from the model rotating every channel.
TEST(Model, PartialRopeRunsThroughTheCache) {
  KVQ_REQUIRE_LLAMA_DATA();
  const Model full = Model::load(default_model_path());
  const Model partial(GgufFile::parse(real_model_with("llama.rope.dimension_count", 4)));
  EXPECT_EQ(partial.config().rope_dims, 4u);
  EXPECT_EQ(partial.rope_config().dims(), 4u);
  auto tokens = Tokenizer(GgufFile::load(default_model_path())).encode(testing::read_stories()[0]);
  tokens.resize(std::min<std::size_t>(tokens.size(), 80));
  const auto run_full_precision = [&](const Model& m) {
    return teacher_forced(
        m, [&] { return FullPrecisionBackend(m, tokens.size()); }, tokens);
  };
  const auto reference = run_full_precision(partial), rotated_fully = run_full_precision(full);
  const auto cached = teacher_forced(
      partial,
      [&] {
        return eval::CacheBackend(partial, parse_cache_config("k16-v16-r0-s0-f32"), tokens.size(),
                                  eval::decode_attention_fn(Tier::exact));
      },
      tokens);
  double largest = 0.0, rope_effect = 0.0;
  for (std::size_t i = 0; i < reference.log_probs.size(); ++i) {
    largest = std::max(largest, std::abs(double(cached.log_probs[i]) - reference.log_probs[i]));
    rope_effect = std::max(rope_effect, std::abs(double(rotated_fully.log_probs[i]) - reference.log_probs[i]));
  }
  EXPECT_LT(largest, 1e-3);
  EXPECT_GT(rope_effect, 0.1);

  for (const std::uint32_t bad : {5u, 10u}) {  // odd, wider than the head
    const std::string e = model_error_of(real_model_with("llama.rope.dimension_count", bad), ErrorCode::io);
    EXPECT_NE(e.find("rotary_dims"), std::string::npos) << e;
    EXPECT_NE(e.find("patched.gguf"), std::string::npos) << e;
  }
}

// The real model's metadata and tensors copied (arrays left out: only the tokenizer has them),
// plus what `extra` adds.
std::vector<std::uint8_t> real_model_plus(const std::function<void(GgufWriter&)>& extra) {
  const auto original = GgufFile::load(default_model_path());
  GgufWriter w;
  for (const auto& [key, value] : original.metadata()) {
    if (const auto* s = std::get_if<std::string>(&value.data))
      w.str(key, *s);
    else if (value.type == GgufType::float32)
      w.f32(key, static_cast<float>(std::get<double>(value.data)));
    else if (value.type == GgufType::uint32)
      w.u32(key, static_cast<std::uint32_t>(std::get<std::uint64_t>(value.data)));
  }
  extra(w);
  for (const GgufTensor& t : original.tensors()) w.tensor_f32(t.name, t.dims, t.data);
  return w.bytes();
}

TEST(Model, RopeScalingFromMetadata) {
  KVQ_REQUIRE_LLAMA_DATA();
  const Model linear(GgufFile::parse(real_model_plus(
      [](GgufWriter& w) { w.str("llama.rope.scaling.type", "linear").f32("llama.rope.scaling.factor", 4.0f); })));
  EXPECT_EQ(linear.rope_config().scaling.type, RopeScalingType::linear);
  EXPECT_EQ(linear.rope_config().scaling.factor, 4.0f);
  const Model legacy(GgufFile::parse(real_model_plus([](GgufWriter& w) { w.f32("llama.rope.scale_linear", 2.0f); })));
  EXPECT_EQ(legacy.rope_config().scaling.type, RopeScalingType::linear);
  EXPECT_EQ(legacy.rope_config().scaling.factor, 2.0f);
  const Model yarn(GgufFile::parse(real_model_plus([](GgufWriter& w) {
    w.str("llama.rope.scaling.type", "yarn")
        .f32("llama.rope.scaling.factor", 4.0f)
        .u32("llama.rope.scaling.original_context_length", 512);
  })));
  const RopeScaling& s = yarn.rope_config().scaling;
  EXPECT_EQ(s.type, RopeScalingType::yarn);
  EXPECT_EQ(s.factor, 4.0f);
  EXPECT_EQ(s.original_context, 512u);
  EXPECT_FLOAT_EQ(RopeTable(yarn.rope_config(), 4).attention_factor(), float(1.0 + 0.1 * std::log(4.0)));
  FullPrecisionBackend kv(yarn, 8);  // the engine's own RoPE takes the scaling too
  EXPECT_EQ(kv.rope().config().scaling, s);

  const std::string unknown = model_error_of(
      real_model_plus([](GgufWriter& w) { w.str("llama.rope.scaling.type", "longrope"); }), ErrorCode::unsupported);
  EXPECT_NE(unknown.find("llama.rope.scaling.type = 'longrope'"), std::string::npos) << unknown;
  const std::string no_context =
      model_error_of(real_model_plus([](GgufWriter& w) {
                       w.str("llama.rope.scaling.type", "yarn").f32("llama.rope.scaling.factor", 4.0f);
                     }),
                     ErrorCode::io);
  EXPECT_NE(no_context.find("original_context"), std::string::npos) << no_context;
  const std::string shrink =
      model_error_of(real_model_plus([](GgufWriter& w) {
                       w.str("llama.rope.scaling.type", "linear").f32("llama.rope.scaling.factor", 0.5f);
                     }),
                     ErrorCode::io);
  EXPECT_NE(shrink.find("factor"), std::string::npos) << shrink;
}

// llama.cpp stores Llama-3 scaling as rope_freqs.weight, the divisor of each pair's frequency
// (its converter: 1 where the wavelength is short, factor where long, 1 / ((1 - smooth) / factor
// + smooth) between). The model's RoPE then has Meta's llama3 frequencies.
TEST(Model, RopeFreqsTensorGivesLlama3Frequencies) {
  KVQ_REQUIRE_LLAMA_DATA();
  const double factor = 8.0, low = 1.0, high = 4.0, context = 1024.0;  // every regime at head_dim 8
  std::vector<float> divisors;
  for (std::size_t i = 0; i < 4; ++i) {
    const double wavelen = 2 * std::numbers::pi * std::pow(10000.0, double(2 * i) / 8.0);
    if (wavelen < context / high)
      divisors.push_back(1.0f);
    else if (wavelen > context / low)
      divisors.push_back(float(factor));
    else {
      const double smooth = (context / wavelen - low) / (high - low);
      divisors.push_back(float(1.0 / ((1 - smooth) / factor + smooth)));
    }
  }
  const Model model(
      GgufFile::parse(real_model_plus([&](GgufWriter& w) { w.tensor_f32("rope_freqs.weight", {4}, divisors); })));
  EXPECT_EQ(model.rope_config().scaling.frequency_divisors, divisors);
  RopeConfig llama3 = model.rope_config();
  llama3.scaling = {};
  llama3.scaling.type = RopeScalingType::llama3;
  llama3.scaling.factor = float(factor), llama3.scaling.original_context = std::size_t(context);
  const auto got = rope_frequencies(model.rope_config()), want = rope_frequencies(llama3);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_NEAR(got[i] / want[i], 1.0, 1e-6) << "pair " << i;
  EXPECT_NE(divisors[2], 1.0f);  // the smooth region is exercised
  EXPECT_NE(divisors[2], float(factor));

  const std::string wrong = model_error_of(real_model_plus([&](GgufWriter& w) {
                                             w.tensor_f32("rope_freqs.weight", {3}, {1.0f, 1.0f, 1.0f});
                                           }),
                                           ErrorCode::io);
  EXPECT_NE(wrong.find("rope_freqs.weight"), std::string::npos) << wrong;
  const std::string zero = model_error_of(real_model_plus([&](GgufWriter& w) {
                                            w.tensor_f32("rope_freqs.weight", {4}, {1.0f, 0.0f, 1.0f, 1.0f});
                                          }),
                                          ErrorCode::io);
  EXPECT_NE(zero.find("frequency_divisors[1]"), std::string::npos) << zero;
}

}  // namespace
}  // namespace kvq::llama
