#pragma once
// Llama forward pass for one token at one position, for a prompt chunk of T positions, or for a
// draft tree of T speculative tokens verified at once, with the KV cache behind a backend. Runs
// the GGUF architectures `llama` (Llama 2/3, Mistral, SmolLM, TinyLlama) and `qwen2` (the same
// block with biases on q, k and v, and RoPE over the two halves of each head). The model never
// applies RoPE itself: it hands the backend pre-RoPE keys and queries, so a cache may store keys
// before rotation (where their outlier channels are stable) and rotate when it attends.

#include <Eigen/Dense>

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/error.hpp"
#include "kvq/rope/rope.hpp"
#include "llama/gguf.hpp"

namespace kvq::llama {

/// What the model needs from a KV cache. k, v: (kv_heads * head_dim), q, out: (heads * head_dim),
/// all pre-RoPE. `attend` computes softmax(q_rot K_rot^T / sqrt(head_dim)) V over positions
/// 0..position, query head h reading kv head h / (heads / kv_heads). A backend sees every layer's
/// q, k and v, so an evaluator that wants to inspect them wraps a backend.
template <class B>
concept KVBackend = requires(B& kv, std::size_t index, std::span<const float> in, std::span<float> out) {
  kv.append(index, index, in, in);   // (layer, position, k, v)
  kv.attend(index, index, in, out);  // (layer, position, q, out)
};

/// A backend that also takes prompt chunks. `attend_chunk(layer, p0, T, q, k, v, out)`: q and out
/// (T, heads * head_dim), k and v (T, kv_heads * head_dim), all pre-RoPE, for positions
/// p0 .. p0 + T - 1 that are not stored yet (the backend holds exactly 0 .. p0 - 1). Query t
/// attends to the stored positions and, exactly, to the chunk's own keys and values 0 .. t: a
/// quantizing cache does not quantize a chunk before the chunk attends to it. The model appends
/// the T keys and values afterwards.
template <class B>
concept ChunkedKVBackend = KVBackend<B> &&
    requires(B& kv, std::size_t index, std::span<const float> in, std::span<float> out) {
  kv.attend_chunk(index, index, index, in, in, in, out);  // (layer, first_position, tokens, q, k, v, out)
};

/// A backend that also verifies draft trees (speculative decoding). `attend_tree(layer, p0,
/// parents, q, k, v, out)`: as attend_chunk, but new token t sits at p0 + depth(t) and sees the
/// stored positions and its own path from a root: parents[t] is -1 or an earlier token
/// (kvq::AttentionRequest::parents). The model appends nothing; the engine appends the path it
/// accepts (Model::append_path).
template <class B>
concept TreeKVBackend = KVBackend<B> && requires(B& kv, std::size_t index, std::span<const std::int32_t> parents,
                                                 std::span<const float> in, std::span<float> out) {
  kv.attend_tree(index, index, parents, in, in, in, out);  // (layer, first_position, parents, q, k, v, out)
};

/// A backend over many sequences, for a decode step of all of them at once (Model::forward_batch):
/// row b of a batch belongs to the backend's sequence b, at positions[b].
/// `append_batch(layer, positions, k, v)` stores k and v, (B, kv_heads * head_dim) pre-RoPE;
/// `attend_batch(layer, positions, q, out)`, q and out (B, heads * head_dim), attends as
/// KVBackend::attend does for each row, sequence b over its positions 0 .. positions[b].
template <class B>
concept BatchKVBackend = requires(B& kv, std::size_t index, std::span<const std::size_t> positions,
                                  std::span<const float> in, std::span<float> out) {
  kv.append_batch(index, positions, in, in);   // (layer, positions, k, v)
  kv.attend_batch(index, positions, in, out);  // (layer, positions, q, out)
};

struct LlamaConfig {
  std::string arch = "llama";      // general.architecture: the prefix of the keys below
  std::size_t dim = 0;             // <arch>.embedding_length
  std::size_t layers = 0;          // <arch>.block_count
  std::size_t heads = 0;           // <arch>.attention.head_count
  std::size_t kv_heads = 0;        // <arch>.attention.head_count_kv
  std::size_t head_dim = 0;        // dim / heads
  std::size_t ffn_dim = 0;         // <arch>.feed_forward_length
  std::size_t vocab = 0;           // rows of token_embd.weight
  std::size_t context_length = 0;  // <arch>.context_length
  float norm_eps = 1e-5f;          // <arch>.attention.layer_norm_rms_epsilon
  float rope_theta = 10000.0f;     // <arch>.rope.freq_base
  std::size_t rope_dims = 0;       // <arch>.rope.dimension_count: rotated channels; 0 = head_dim
  RopeScaling rope_scaling{};      // <arch>.rope.scaling.* and the rope_freqs.weight tensor
  // llama.cpp's rope type by architecture: "normal" (adjacent pairs) for llama, NeoX for qwen2.
  RopeStyle rope_style = RopeStyle::adjacent_pairs;
  bool qkv_bias = false;  // blk.N.attn_{q,k,v}.bias present (required for qwen2)
  int bos = 1, eos = 2;   // tokenizer.ggml.{bos,eos}_token_id

  std::size_t q_dim() const noexcept { return heads * head_dim; }
  std::size_t kv_dim() const noexcept { return kv_heads * head_dim; }
};

class Model {
 public:
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Vector = Eigen::VectorXf;

  static Model load(const std::filesystem::path& path) {
    GgufFile file = GgufFile::load(path);
    return take_weights(file);
  }

  /// A model of `file`'s converted weights, copied: the file stays whole.
  explicit Model(const GgufFile& file) : Model(file, nullptr) {}

  /// A model that takes `file`'s converted weights instead of copying them, so a model's
  /// gigabytes are held once; the file keeps its metadata (a tokenizer reads it) and its tensor
  /// list, with the taken tensors' data empty.
  static Model take_weights(GgufFile& file) { return Model(file, &file); }

 private:
  // The model of `file`; with `take_from` (the same file) its weights are moved, not copied.
  Model(const GgufFile& file, GgufFile* take_from) {
    const std::string arch = file.find("general.architecture") ? file.get_string("general.architecture") : "";
    if (arch != "llama" && arch != "qwen2")
      throw Error(ErrorCode::unsupported, file.source() + ": general.architecture is '" + arch +
                                              "', this engine runs only 'llama' and 'qwen2' models");
    LlamaConfig& c = config_;
    c.arch = arch;
    const auto key = [&](const char* name) { return arch + "." + name; };
    c.dim = hyper(file, key("embedding_length"));
    c.layers = hyper(file, key("block_count"));
    c.heads = hyper(file, key("attention.head_count"));
    c.kv_heads = file.find(key("attention.head_count_kv")) ? hyper(file, key("attention.head_count_kv")) : c.heads;
    c.ffn_dim = hyper(file, key("feed_forward_length"));
    c.context_length = hyper(file, key("context_length"));
    c.norm_eps = static_cast<float>(file.get_float(key("attention.layer_norm_rms_epsilon")));
    if (file.find(key("rope.freq_base"))) c.rope_theta = static_cast<float>(file.get_float(key("rope.freq_base")));
    c.rope_style = arch == "qwen2" ? RopeStyle::half_split : RopeStyle::adjacent_pairs;
    c.qkv_bias = arch == "qwen2" || file.find_tensor("blk.0.attn_q.bias") != nullptr;
    if (c.dim % c.heads != 0 || c.heads % c.kv_heads != 0)
      file.fail("head counts (" + std::to_string(c.heads) + " query, " + std::to_string(c.kv_heads) +
                " kv) do not divide embedding length " + std::to_string(c.dim) + " and each other");
    if (!(c.norm_eps > 0.0f) || !std::isfinite(c.norm_eps)) file.fail("RMSNorm epsilon must be positive");
    c.head_dim = c.dim / c.heads;
    if (file.find("tokenizer.ggml.bos_token_id"))
      c.bos = static_cast<int>(hyper(file, "tokenizer.ggml.bos_token_id", 0));
    if (file.find("tokenizer.ggml.eos_token_id"))
      c.eos = static_cast<int>(hyper(file, "tokenizer.ggml.eos_token_id", 0));
    if (file.find(key("rope.dimension_count"))) c.rope_dims = hyper(file, key("rope.dimension_count"));
    c.rope_scaling = read_rope_scaling(file, arch + ".rope.");
    validate_rope(file);

    const GgufTensor& embd = file.tensor("token_embd.weight");
    if (embd.dims.size() != 2) file.fail("token_embd.weight must have 2 dimensions");
    c.vocab = static_cast<std::size_t>(embd.dims[1]);
    check_tensors_back_metadata(file);  // before anything is sized by the metadata
    if (file.find_tensor("rope_freqs.weight")) {
      // llama.cpp's form of Llama-3 scaling: one divisor of each rotated pair's frequency.
      const Vector divisors = load_vector(file, "rope_freqs.weight", rope_config().dims() / 2);
      c.rope_scaling.frequency_divisors.assign(divisors.data(), divisors.data() + divisors.size());
      validate_rope(file);
    }

    const auto matrix = [&](const std::string& name, std::size_t ne0, std::size_t ne1) {
      return load_matrix(file, take_from, name, ne0, ne1);
    };
    embedding_ = matrix("token_embd.weight", c.dim, c.vocab);
    tied_output_ = file.find_tensor("output.weight") == nullptr;
    if (!tied_output_) output_ = matrix("output.weight", c.dim, c.vocab);
    output_norm_ = load_vector(file, "output_norm.weight", c.dim);
    layers_.resize(c.layers);
    for (std::size_t l = 0; l < c.layers; ++l) {
      const std::string p = block_prefix(l);
      Layer& L = layers_[l];
      L.attn_norm = load_vector(file, p + "attn_norm.weight", c.dim);
      L.wq = matrix(p + "attn_q.weight", c.dim, c.q_dim());
      L.wk = matrix(p + "attn_k.weight", c.dim, c.kv_dim());
      L.wv = matrix(p + "attn_v.weight", c.dim, c.kv_dim());
      L.wo = matrix(p + "attn_output.weight", c.q_dim(), c.dim);
      if (c.qkv_bias) {
        L.bq = load_vector(file, p + "attn_q.bias", c.q_dim());
        L.bk = load_vector(file, p + "attn_k.bias", c.kv_dim());
        L.bv = load_vector(file, p + "attn_v.bias", c.kv_dim());
      }
      L.ffn_norm = load_vector(file, p + "ffn_norm.weight", c.dim);
      L.w_gate = matrix(p + "ffn_gate.weight", c.dim, c.ffn_dim);
      L.w_up = matrix(p + "ffn_up.weight", c.dim, c.ffn_dim);
      L.w_down = matrix(p + "ffn_down.weight", c.ffn_dim, c.dim);
    }
  }

 public:
  const LlamaConfig& config() const noexcept { return config_; }

  /// RoPE as this model's weights expect it: llama.cpp's "normal" mode (adjacent pairs) for llama,
  /// whose converter permutes q and k to suit it; NeoX mode (halves) for qwen2.
  RopeConfig rope_config() const {
    RopeConfig r;
    r.head_dim = config_.head_dim;
    r.style = config_.rope_style;
    r.theta = config_.rope_theta;
    r.rotary_dims = config_.rope_dims;
    r.scaling = config_.rope_scaling;
    return r;
  }

  /// One decode step: feed `token` at `position` (the backend must hold positions 0..position-1)
  /// and write the next-token logits (vocab). Thread-safe: all scratch is local.
  template <KVBackend Backend>
  void forward(int token, std::size_t position, Backend& kv, std::span<float> logits) const {
    const LlamaConfig& c = config_;
    if (token < 0 || static_cast<std::size_t>(token) >= c.vocab)
      throw Error(ErrorCode::invalid_argument,
                  "token " + std::to_string(token) + " is outside the vocabulary of " + std::to_string(c.vocab));
    if (logits.size() != c.vocab)
      throw Error(ErrorCode::shape_mismatch, "logits buffer has " + std::to_string(logits.size()) +
                                                 " entries, the vocabulary " + std::to_string(c.vocab));
    Vector x = embedding_().row(token).transpose();
    Vector xb(c.dim), q(c.q_dim()), k(c.kv_dim()), v(c.kv_dim()), att(c.q_dim());
    Vector gate(c.ffn_dim), up(c.ffn_dim);
    for (std::size_t l = 0; l < c.layers; ++l) {
      const Layer& L = layers_[l];
      rms_norm(x, L.attn_norm, xb);
      q.noalias() = L.wq() * xb;
      k.noalias() = L.wk() * xb;
      v.noalias() = L.wv() * xb;
      if (c.qkv_bias) {
        q += L.bq;
        k += L.bk;
        v += L.bv;
      }
      kv.append(l, position, std::span<const float>(k.data(), c.kv_dim()),
                std::span<const float>(v.data(), c.kv_dim()));
      kv.attend(l, position, std::span<const float>(q.data(), c.q_dim()), std::span<float>(att.data(), c.q_dim()));
      x.noalias() += L.wo() * att;

      rms_norm(x, L.ffn_norm, xb);
      gate.noalias() = L.w_gate() * xb;
      up.noalias() = L.w_up() * xb;
      for (Eigen::Index i = 0; i < gate.size(); ++i) gate[i] = gate[i] * (1.0f / (1.0f + std::exp(-gate[i]))) * up[i];
      x.noalias() += L.w_down() * gate;
    }
    rms_norm(x, output_norm_, xb);
    Eigen::Map<Vector>(logits.data(), static_cast<Eigen::Index>(c.vocab)).noalias() = output()() * xb;
  }

  /// Chunked prefill: feed `tokens` at positions first_position .. first_position + T - 1 (the
  /// backend must hold positions 0..first_position-1) and write the next-token logits of every one
  /// of them, (T, vocab) row-major. Each layer runs its matrix products over the T rows at once,
  /// attends through the backend's attend_chunk, then appends the T keys and values.
  template <ChunkedKVBackend Backend>
  void forward_chunk(std::span<const int> tokens, std::size_t first_position, Backend& kv,
                     std::span<float> logits) const {
    forward_rows("forward_chunk", tokens, logits,
                 [&](std::size_t l, const Matrix& q, const Matrix& k, const Matrix& v, std::span<float> att) {
                   kv.attend_chunk(l, first_position, tokens.size(), all(q), all(k), all(v), att);
                   for (Eigen::Index t = 0; t < k.rows(); ++t)
                     kv.append(l, first_position + static_cast<std::size_t>(t), row(k, t), row(v, t));
                 });
  }

  /// A decode step of B sequences at once, as an engine batches its running requests: token b at
  /// positions[b] of the backend's sequence b, which holds positions 0 .. positions[b] - 1; writes
  /// the next-token logits of every sequence, (B, vocab) row-major. The matrix products run over
  /// the B rows together (each weight read once for the batch), each layer appends the B keys and
  /// values and attends through the backend's attend_batch. As forward, a failure part way leaves
  /// what was appended before it: earlier layers, and in the failing one the rows the backend
  /// stored.
  template <BatchKVBackend Backend>
  void forward_batch(std::span<const int> tokens, std::span<const std::size_t> positions, Backend& kv,
                     std::span<float> logits) const {
    if (positions.size() != tokens.size())
      throw Error(ErrorCode::shape_mismatch, "forward_batch: " + std::to_string(positions.size()) + " positions for " +
                                                 std::to_string(tokens.size()) + " tokens");
    forward_rows("forward_batch", tokens, logits,
                 [&](std::size_t l, const Matrix& q, const Matrix& k, const Matrix& v, std::span<float> att) {
                   kv.append_batch(l, positions, all(k), all(v));
                   kv.attend_batch(l, positions, all(q), att);
                 });
  }

  /// The keys and values a draft tree's pass computed: per layer, (T, kv_heads * head_dim) each,
  /// with the tree and the position it was verified at.
  struct DraftRows {
    std::vector<Matrix> keys, values;
    std::vector<std::int32_t> parents;
    std::size_t first_position = 0;
  };

  /// Verifies a draft tree in one pass: token t (a child of parents[t], or of the stored prefix
  /// where that is -1) at position first_position + depth(t), the backend holding 0 ..
  /// first_position - 1; writes the next-token logits of every token, (T, vocab), and each layer's
  /// keys and values into `rows` (as they were if the pass throws). Nothing is appended:
  /// append_path stores the accepted path.
  template <TreeKVBackend Backend>
  void forward_tree(std::span<const int> tokens, std::span<const std::int32_t> parents, std::size_t first_position,
                    Backend& kv, std::span<float> logits, DraftRows& rows) const {
    if (parents.size() != tokens.size())
      throw Error(ErrorCode::shape_mismatch, "forward_tree: " + std::to_string(parents.size()) + " parents for " +
                                                 std::to_string(tokens.size()) + " tokens");
    DraftRows pass{std::vector<Matrix>(config_.layers), std::vector<Matrix>(config_.layers),
                   std::vector<std::int32_t>(parents.begin(), parents.end()), first_position};
    forward_rows("forward_tree", tokens, logits,
                 [&](std::size_t l, const Matrix& q, const Matrix& k, const Matrix& v, std::span<float> att) {
                   kv.attend_tree(l, first_position, parents, all(q), all(k), all(v), att);
                   pass.keys[l] = k;
                   pass.values[l] = v;
                 });
    rows = std::move(pass);
  }

  /// Appends the draft rows of `path` (token indices from a root down, each the child of the one
  /// before) at the tree's positions: the tokens forward_tree verified and the engine accepted.
  /// A path that is not one throws before anything is appended. An append that fails part way (a
  /// shared block store run dry) is undone where the backend has `truncate(length)` (a kvq
  /// cache's `truncate` drops the tokens from `length` on in every layer), so no layer is left
  /// longer than another.
  template <KVBackend Backend>
  void append_path(const DraftRows& rows, std::span<const std::size_t> path, Backend& kv) const {
    if (rows.keys.size() != config_.layers)
      throw Error(ErrorCode::invalid_argument, "append_path: the draft rows are not from a forward_tree pass");
    for (std::size_t i = 0; i < path.size(); ++i) {
      const std::string token = "append_path: token " + std::to_string(path[i]) + " at depth " + std::to_string(i);
      if (path[i] >= rows.parents.size())
        throw Error(ErrorCode::invalid_argument,
                    token + " is not in the tree of " + std::to_string(rows.parents.size()));
      if (rows.parents[path[i]] != (i == 0 ? -1 : std::int64_t(path[i - 1])))
        throw Error(ErrorCode::invalid_argument,
                    token + " is not a child of " + (i == 0 ? std::string("the prefix") : std::to_string(path[i - 1])));
    }
    bool appended = false;  // nothing to undo when the first append fails (rows not at the end)
    try {
      for (std::size_t l = 0; l < config_.layers; ++l)
        for (std::size_t i = 0; i < path.size(); ++i) {
          const auto t = static_cast<Eigen::Index>(path[i]);
          kv.append(l, rows.first_position + i, row(rows.keys[l], t), row(rows.values[l], t));
          appended = true;
        }
    } catch (...) {
      if constexpr (requires { kv.truncate(rows.first_position); }) {
        if (appended) try {
            kv.truncate(rows.first_position);
          } catch (...) {  // the append's error is the one to report
          }
      }
      throw;
    }
  }

 private:
  static std::span<const float> all(const Matrix& m) {
    return std::span<const float>(m.data(), static_cast<std::size_t>(m.size()));
  }
  static std::span<const float> row(const Matrix& m, Eigen::Index t) {
    return std::span<const float>(m.data() + t * m.cols(), static_cast<std::size_t>(m.cols()));
  }

  /// The forward pass of T tokens at once: `attend(layer, q, k, v, att)` attends each layer's
  /// rows, (T, ...) each, writing att (T, heads * head_dim), and stores or keeps the keys and values.
  template <class Attend>
  void forward_rows(std::string_view what, std::span<const int> tokens, std::span<float> logits,
                    Attend&& attend) const {
    const LlamaConfig& c = config_;
    const std::string name(what);
    if (tokens.empty()) throw Error(ErrorCode::invalid_argument, name + ": a chunk of zero tokens");
    for (std::size_t t = 0; t < tokens.size(); ++t)
      if (tokens[t] < 0 || static_cast<std::size_t>(tokens[t]) >= c.vocab)
        throw Error(ErrorCode::invalid_argument, name + ": token " + std::to_string(tokens[t]) + " (row " +
                                                     std::to_string(t) + ") is outside the vocabulary of " +
                                                     std::to_string(c.vocab));
    if (logits.size() / c.vocab != tokens.size() || logits.size() % c.vocab != 0)
      throw Error(ErrorCode::shape_mismatch, name + ": logits buffer has " + std::to_string(logits.size()) +
                                                 " entries, " + std::to_string(tokens.size()) +
                                                 " tokens x vocabulary " + std::to_string(c.vocab) + " needed");
    const auto T = static_cast<Eigen::Index>(tokens.size());
    const auto dim = static_cast<Eigen::Index>(c.dim);
    Matrix x(T, dim), xb(T, dim), q(T, c.q_dim()), k(T, c.kv_dim()), v(T, c.kv_dim()), att(T, c.q_dim());
    Matrix gate(T, c.ffn_dim), up(T, c.ffn_dim);
    for (Eigen::Index t = 0; t < T; ++t) x.row(t) = embedding_().row(tokens[static_cast<std::size_t>(t)]);
    for (std::size_t l = 0; l < c.layers; ++l) {
      const Layer& L = layers_[l];
      rms_norm_rows(x, L.attn_norm, xb);
      q.noalias() = xb * L.wq().transpose();
      k.noalias() = xb * L.wk().transpose();
      v.noalias() = xb * L.wv().transpose();
      if (c.qkv_bias) {
        q.rowwise() += L.bq.transpose();
        k.rowwise() += L.bk.transpose();
        v.rowwise() += L.bv.transpose();
      }
      attend(l, q, k, v, std::span<float>(att.data(), static_cast<std::size_t>(att.size())));
      x.noalias() += att * L.wo().transpose();

      rms_norm_rows(x, L.ffn_norm, xb);
      gate.noalias() = xb * L.w_gate().transpose();
      up.noalias() = xb * L.w_up().transpose();
      for (Eigen::Index i = 0; i < gate.size(); ++i) {
        float& g = gate.data()[i];
        g = g * (1.0f / (1.0f + std::exp(-g))) * up.data()[i];
      }
      x.noalias() += gate * L.w_down().transpose();
    }
    rms_norm_rows(x, output_norm_, xb);
    Eigen::Map<Matrix>(logits.data(), T, static_cast<Eigen::Index>(c.vocab)).noalias() = xb * output()().transpose();
  }

  // A weight matrix kept as the file's converted floats, (rows x cols) row-major, read in place.
  struct Weights {
    std::vector<float> data;
    Eigen::Index rows = 0, cols = 0;
    Eigen::Map<const Matrix> operator()() const { return {data.data(), rows, cols}; }
  };

  struct Layer {
    Vector attn_norm, ffn_norm, bq, bk, bv;  // biases: empty unless config().qkv_bias
    Weights wq, wk, wv, wo, w_gate, w_up, w_down;
  };

  // <prefix>scaling.{type, factor, original_context_length} as llama.cpp writes them (and the
  // older <prefix>scale_linear). yarn's beta_fast, beta_slow and attention factor take llama.cpp's
  // defaults (32, 1, 0.1 ln(factor) + 1).
  static RopeScaling read_rope_scaling(const GgufFile& file, const std::string& prefix) {
    RopeScaling s;
    const std::string type_key = prefix + "scaling.type", factor_key = prefix + "scaling.factor";
    const std::string context_key = prefix + "scaling.original_context_length", legacy_key = prefix + "scale_linear";
    const std::string type = file.find(type_key)     ? file.get_string(type_key)
                             : file.find(legacy_key) ? "linear"
                                                     : "none";
    if (type == "linear")
      s.type = RopeScalingType::linear;
    else if (type == "yarn")
      s.type = RopeScalingType::yarn;
    else if (type != "none")
      throw Error(ErrorCode::unsupported,
                  file.source() + ": " + type_key + " = '" + type + "'; this engine knows none, linear and yarn");
    if (s.type == RopeScalingType::none) return s;
    const std::string& key = file.find(factor_key) ? factor_key : legacy_key;
    if (file.find(key)) s.factor = static_cast<float>(file.get_float(key));
    if (file.find(context_key)) s.original_context = hyper(file, context_key.c_str());
    return s;
  }

  void validate_rope(const GgufFile& file) const {
    try {
      validate(rope_config());
    } catch (const Error& e) {
      file.fail(std::string("RoPE parameters: ") + e.what());
    }
  }

  // Bounded so that no buffer sized from metadata can be absurd.
  static std::size_t hyper(const GgufFile& file, const std::string& key, std::uint64_t min = 1) {
    const std::uint64_t v = file.get_uint(key);
    if (v < min || v > (std::uint64_t{1} << 24))
      file.fail(key + " = " + std::to_string(v) + " is outside " + std::to_string(min) + "..2^24");
    return static_cast<std::size_t>(v);
  }

  static constexpr std::size_t kTensorsPerBlock = 9;

  static std::string block_prefix(std::size_t layer) { return "blk." + std::to_string(layer) + "."; }

  // Every hyper-parameter that sizes a buffer must be backed by the tensors the file holds:
  // a block count or head count the weights do not have is refused, naming the key, before any
  // allocation (a corrupt llama.block_count of 2^24 would otherwise size 16M empty layers).
  void check_tensors_back_metadata(const GgufFile& file) const {
    const LlamaConfig& c = config_;
    const auto key = [&](const char* name) { return c.arch + "." + name; };
    const std::size_t held = file.tensors().size();
    if (c.layers > held / kTensorsPerBlock)
      file.fail(key("block_count") + " = " + std::to_string(c.layers) + " needs " + std::to_string(kTensorsPerBlock) +
                " tensors per block, but the file holds only " + std::to_string(held) + " tensors");
    shaped(file, "token_embd.weight", {c.dim, c.vocab}, key("embedding_length"));
    if (file.find_tensor("output.weight")) shaped(file, "output.weight", {c.dim, c.vocab}, key("embedding_length"));
    shaped(file, "output_norm.weight", {c.dim}, key("embedding_length"));
    // rope_freqs.weight: llama.cpp's Llama-3 frequency divisors, shape-checked where they are read.
    std::set<std::string, std::less<>> used = {"token_embd.weight", "output.weight", "output_norm.weight",
                                               "rope_freqs.weight"};
    for (std::size_t l = 0; l < c.layers; ++l) {
      const std::string p = block_prefix(l);
      const auto need = [&](const char* name, std::vector<std::uint64_t> dims, const std::string& meta) {
        used.insert(p + name);
        if (file.find_tensor(p + name) == nullptr)
          file.fail(key("block_count") + " = " + std::to_string(c.layers) + " but tensor '" + p + name +
                    "' is missing");
        shaped(file, p + name, std::move(dims), meta);
      };
      need("attn_norm.weight", {c.dim}, key("embedding_length"));
      need("attn_q.weight", {c.dim, c.q_dim()}, key("attention.head_count"));
      need("attn_k.weight", {c.dim, c.kv_dim()}, key("attention.head_count_kv"));
      need("attn_v.weight", {c.dim, c.kv_dim()}, key("attention.head_count_kv"));
      need("attn_output.weight", {c.q_dim(), c.dim}, key("attention.head_count"));
      need("ffn_norm.weight", {c.dim}, key("embedding_length"));
      need("ffn_gate.weight", {c.dim, c.ffn_dim}, key("feed_forward_length"));
      need("ffn_up.weight", {c.dim, c.ffn_dim}, key("feed_forward_length"));
      need("ffn_down.weight", {c.ffn_dim, c.dim}, key("feed_forward_length"));
      if (c.qkv_bias) {
        need("attn_q.bias", {c.q_dim()}, key("attention.head_count"));
        need("attn_k.bias", {c.kv_dim()}, key("attention.head_count_kv"));
        need("attn_v.bias", {c.kv_dim()}, key("attention.head_count_kv"));
      }
    }
    // A tensor this block does not use (an output bias, a q/k norm, experts) changes the model:
    // refused by name rather than ignored.
    for (const GgufTensor& t : file.tensors())
      if (!used.contains(t.name))
        throw Error(ErrorCode::unsupported, file.source() + ": tensor '" + t.name + "' is not part of the " + c.arch +
                                                " block this engine runs");
    if (file.find("tokenizer.ggml.tokens")) {
      const std::size_t n = file.get_array("tokenizer.ggml.tokens", GgufType::string).size();
      if (n != c.vocab)
        file.fail("tokenizer has " + std::to_string(n) + " tokens but token_embd.weight has " +
                  std::to_string(c.vocab) + " rows");
    }
  }

  // `key`, where given, names the metadata that set the expected shape.
  static const GgufTensor& shaped(const GgufFile& file, const std::string& name, std::vector<std::uint64_t> dims,
                                  const std::string& key = {}) {
    const GgufTensor& t = file.tensor(name);
    if (t.dims != dims) {
      const auto show = [](const std::vector<std::uint64_t>& d) {
        std::string s = "[";
        for (std::size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
        return s + "]";
      };
      file.fail("tensor '" + name + "' has dims " + show(t.dims) + ", the hyper-parameters require " + show(dims) +
                (key.empty() ? std::string() : " (see " + key + ")"));
    }
    return t;
  }

  // GGUF [ne0, ne1] is ne1 rows of ne0 floats: a row-major (ne1 x ne0) matrix, y = W x.
  static Weights load_matrix(const GgufFile& file, GgufFile* take_from, const std::string& name, std::size_t ne0,
                             std::size_t ne1) {
    const GgufTensor& t = shaped(file, name, {ne0, ne1});
    Weights w{take_from ? take_from->take_data(name) : t.data, static_cast<Eigen::Index>(ne1),
              static_cast<Eigen::Index>(ne0)};
    if (w.data.size() != ne0 * ne1) file.fail("tensor '" + name + "' holds no data (its weights were taken already)");
    return w;
  }
  const Weights& output() const noexcept { return tied_output_ ? embedding_ : output_; }

  static Vector load_vector(const GgufFile& file, const std::string& name, std::size_t n) {
    const GgufTensor& t = shaped(file, name, {n});
    return Eigen::Map<const Vector>(t.data.data(), static_cast<Eigen::Index>(n));
  }

  // As llama2.c computes it (float, eps inside the root), so greedy decoding matches its tokens.
  void rms_norm(const Vector& x, const Vector& weight, Vector& out) const { rms_norm(x.data(), weight, out.data()); }
  void rms_norm(const float* x, const Vector& weight, float* out) const {
    const Eigen::Index n = weight.size();
    float ss = 0.0f;
    for (Eigen::Index i = 0; i < n; ++i) ss += x[i] * x[i];
    ss = 1.0f / std::sqrt(ss / static_cast<float>(n) + config_.norm_eps);
    for (Eigen::Index i = 0; i < n; ++i) out[i] = weight[i] * (ss * x[i]);
  }
  void rms_norm_rows(const Matrix& x, const Vector& weight, Matrix& out) const {
    for (Eigen::Index t = 0; t < x.rows(); ++t) rms_norm(x.data() + t * x.cols(), weight, out.data() + t * out.cols());
  }

  LlamaConfig config_;
  Weights embedding_, output_;  // output_ is empty when tied to the embedding
  bool tied_output_ = false;
  Vector output_norm_;
  std::vector<Layer> layers_;
};

}  // namespace kvq::llama
