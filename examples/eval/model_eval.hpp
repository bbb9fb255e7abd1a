#pragma once
// Teacher-forced evaluation of a real model with one cache configuration (or one per layer)
// against the full-precision run: what the next-token distribution loses (KL, top-1,
// perplexity) and what each layer's attention loses (errors measured at the attention output).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "eval/cache_backend.hpp"
#include "eval/generation_eval.hpp"
#include "eval/engine_formats.hpp"
#include "kvq/kvq.hpp"
#include "llama/full_precision_backend.hpp"
#include "llama/inference.hpp"
#include "llama/model.hpp"

namespace kvq::eval {

/// A configuration per layer, as parse_layer_configs reads it ("k8c32-v4t8-r0-s0;k4c32-v2t8-r0-s0*4").
struct LayerConfigs {
  std::vector<CacheConfig> configs;
};

/// What kvq-eval measures: one of kvq's cache configurations, one per layer, or another engine's
/// format simulated.
using Candidate = std::variant<CacheConfig, EngineFormat, LayerConfigs>;

/// Whether a --configs entry is per-layer text (it holds a ';' or a '*').
inline bool is_layer_text(const std::string& text) { return text.find_first_of(";*") != std::string::npos; }

/// "k4c32-v2t8-r0-s0", "ggml-q4_0" or per-layer text: engine format names are told apart by their
/// prefix. Per-layer text is checked against the model's layer count when it is evaluated.
inline Candidate parse_candidate(const std::string& text) {
  if (is_engine_format_name(text)) return parse_engine_format(text);
  if (is_layer_text(text)) return LayerConfigs{parse_layer_configs(text)};
  return parse_cache_config(text);
}

/// Per-layer configurations against the model's layer count, refused as parse_layer_configs does.
inline void check_layer_count(const std::vector<CacheConfig>& configs, std::size_t layers) {
  if (configs.size() != layers)
    throw Error(ErrorCode::invalid_argument, "per-layer configuration '" + to_string(configs) + "': names " +
                                                 std::to_string(configs.size()) + " layers; the model has " +
                                                 std::to_string(layers));
}

inline std::string name_of(const Candidate& c) {
  if (const auto* config = std::get_if<CacheConfig>(&c)) return to_string(*config);
  if (const auto* layers = std::get_if<LayerConfigs>(&c)) return to_string(layers->configs);
  return std::get<EngineFormat>(c).name;
}

struct ConfigResult {
  CacheConfig config;                      // kvq configurations (layer 0's for a per-layer candidate)
  std::vector<CacheConfig> layer_configs;  // a per-layer candidate's, one per layer
  std::optional<EngineFormat> engine;      // engine formats (config is then unused)
  double mean_nll = 0;                     // nats per predicted token
  double perplexity = 0;
  double mean_kl = 0;           // KL(full precision || this cache) of the next-token distribution, nats
  double top1 = 0;              // fraction of positions whose argmax matches the full-precision run
  double bits_per_value = 0;    // cache bits per K/V element at the end of each story, all counted
  std::size_t cache_bytes = 0;  // summed over stories at their end
  std::size_t predictions = 0;
  std::vector<AttentionErrors> layers;         // per layer, all heads and metric stories pooled
  AttentionErrors all;                         // all layers pooled
  std::optional<GenerationResult> generation;  // free-running generation, when asked for
};

/// The configuration string, per-layer text or engine format name of a result.
inline std::string name_of(const ConfigResult& r) {
  if (r.engine) return r.engine->name;
  return r.layer_configs.empty() ? to_string(r.config) : to_string(r.layer_configs);
}

class ModelEvaluation {
 public:
  /// `stories`: token sequences starting with BOS; `metric_stories`: how many of them feed the
  /// per-layer attention metrics (they cost O(T^2) per head). `prefill_chunk`: 0 feeds every
  /// story one token at a time (each token is stored, quantized, before it attends to itself);
  /// N feeds it in chunks of N tokens that attend to their own keys and values exactly. The fp32
  /// run is fed the same way.
  ModelEvaluation(const llama::Model& model, std::vector<std::vector<int>> stories, std::size_t metric_stories,
                  AttentionFn attention = reference_attention_fn(), std::size_t prefill_chunk = 0)
      : model_(model),
        stories_(std::move(stories)),
        metric_stories_(std::min(metric_stories, stories_.size())),
        attention_(std::move(attention)),
        prefill_chunk_(prefill_chunk) {
    for (const auto& tokens : stories_) {
      RecordingBackend<llama::FullPrecisionBackend> kv(llama::FullPrecisionBackend(model_, tokens.size()),
                                                       model_.config().layers);
      Run run;
      run.log_probs = forward_all(kv, tokens);
      run.nll = nll_of(run.log_probs, tokens);
      for (std::size_t l = 0; l < model_.config().layers; ++l) {
        run.q.push_back(kv.queries(l));
        run.k.push_back(kv.keys(l));
        run.v.push_back(kv.values(l));
      }
      exact_.push_back(std::move(run));
    }
  }

  std::size_t predictions() const {
    std::size_t n = 0;
    for (const auto& s : stories_) n += s.size() - 1;
    return n;
  }

  /// Full-precision (fp32 cache) negative log-likelihood per token.
  double baseline_nll() const {
    double total = 0;
    for (const Run& r : exact_) total += sum(r.nll);
    return total / double(predictions());
  }

  ConfigResult evaluate(const Candidate& candidate) const {
    if (const auto* config = std::get_if<CacheConfig>(&candidate)) return evaluate(*config);
    if (const auto* layers = std::get_if<LayerConfigs>(&candidate)) return evaluate(*layers);
    return evaluate(std::get<EngineFormat>(candidate));
  }

  ConfigResult evaluate(const CacheConfig& config) const {
    const std::vector<CacheConfig> configs(model_.config().layers, config);
    ConfigResult r = evaluate_layers(configs);
    if (metric_stories_ > 0) attention_metrics(configs, r);
    return r;
  }

  /// A configuration per layer, with each layer's attention metrics measured on its own configuration.
  ConfigResult evaluate(const LayerConfigs& layers) const {
    check_layer_count(layers.configs, model_.config().layers);
    ConfigResult r = evaluate_layers(layers.configs);
    r.layer_configs = layers.configs;
    if (metric_stories_ > 0) attention_metrics(layers.configs, r);
    return r;
  }

  /// One configuration per layer (a LayeredKVCache): NLL, KL, top-1 and bits, without the
  /// per-layer attention metrics. `config` of the result is layer 0's.
  ConfigResult evaluate_layers(const std::vector<CacheConfig>& configs) const {
    ConfigResult r;
    r.config = configs.at(0);
    score(r, [&](const std::vector<int>& tokens, std::size_t& bytes, std::size_t& values) {
      CacheBackend kv(model_, configs, tokens.size(), attention_);
      std::vector<float> log_probs = forward_all(kv, tokens);
      const MemoryUsage m = kv.cache().memory();
      bytes += m.total_bytes();
      values += m.values;
      return log_probs;
    });
    return r;
  }

  /// What each layer's keys and values look like in the full-precision run (pre-RoPE, all
  /// stories): why one layer tolerates fewer bits than another.
  struct LayerGeometry {
    double key_norm = 0;      // mean L2 norm of a head's key row
    double value_norm = 0;    // mean L2 norm of a head's value row
    double key_outliers = 0;  // largest channel's mean |k| over the median channel's, mean over KV heads
  };
  std::vector<LayerGeometry> layer_geometry() const {
    const llama::LlamaConfig& m = model_.config();
    const std::size_t d = m.head_dim;
    std::vector<LayerGeometry> out(m.layers);
    for (std::size_t l = 0; l < m.layers; ++l) {
      std::size_t rows = 0;
      std::vector<double> channel(m.kv_heads * d, 0.0);
      for (const Run& run : exact_) {
        const std::vector<float>&k = run.k[l], &v = run.v[l];
        for (std::size_t r = 0; r * d < k.size(); ++r, ++rows) {
          double kk = 0, vv = 0;
          for (std::size_t c = 0; c < d; ++c) {
            kk += double(k[r * d + c]) * k[r * d + c];
            vv += double(v[r * d + c]) * v[r * d + c];
            channel[(r % m.kv_heads) * d + c] += std::abs(double(k[r * d + c]));
          }
          out[l].key_norm += std::sqrt(kk);
          out[l].value_norm += std::sqrt(vv);
        }
      }
      out[l].key_norm /= double(rows);
      out[l].value_norm /= double(rows);
      for (std::size_t h = 0; h < m.kv_heads; ++h) {
        std::vector<double> c(channel.begin() + std::ptrdiff_t(h * d), channel.begin() + std::ptrdiff_t((h + 1) * d));
        std::nth_element(c.begin(), c.begin() + std::ptrdiff_t(d / 2), c.end());
        const double median = c[d / 2], largest = *std::max_element(c.begin(), c.end());
        out[l].key_outliers += (median > 0 ? largest / median : 0.0) / double(m.kv_heads);
      }
    }
    return out;
  }

  /// An engine format, simulated: the fp32 backend storing each row as the engine would. Its
  /// bytes are the format's blocks or codes and scales (fp8: a 4-byte scale per layer for K and
  /// for V besides; a residual's rows not yet quantized at the story's end: fp16);
  /// the per-layer attention metrics are not measured for these.
  ConfigResult evaluate(const EngineFormat& format) const {
    ConfigResult r;
    r.engine = format;
    const llama::LlamaConfig& m = model_.config();
    score(r, [&](const std::vector<int>& tokens, std::size_t& bytes, std::size_t& values) {
      llama::FullPrecisionBackend kv(model_, tokens.size(), EngineRowCodec(format, m.kv_heads, m.head_dim),
                                     format.residual());
      std::vector<float> log_probs = forward_all(kv, tokens);
      std::size_t exact_rows = 0;
      for (std::size_t l = 0; l < m.layers; ++l) exact_rows += kv.unfiltered(l);
      const std::size_t n = 2 * m.layers * tokens.size() * m.kv_dim(), exact = 2 * exact_rows * m.kv_dim();
      values += n;
      bytes += std::size_t(double(n - exact) * format.bits_per_value(m.head_dim) / 8.0) + 2 * exact +
               (format.block || format.turbo() || format.hf() ? 0 : 2 * m.layers * 4);
      return log_probs;
    });
    return r;
  }

 private:
  // Runs every story through the backend `run` builds, accumulating NLL, KL, top-1 and bytes.
  template <class RunStory>
  void score(ConfigResult& r, RunStory run) const {
    double nll = 0, kl = 0, agree = 0;
    std::size_t values = 0;
    for (std::size_t s = 0; s < stories_.size(); ++s) {
      const std::vector<int>& tokens = stories_[s];
      const std::vector<float> log_probs = run(tokens, r.cache_bytes, values);
      nll += sum(nll_of(log_probs, tokens));
      const std::size_t vocab = model_.config().vocab;
      for (std::size_t p = 0; p + 1 < tokens.size(); ++p) {
        const float* exact = exact_[s].log_probs.data() + p * vocab;
        const float* ours = log_probs.data() + p * vocab;
        double d = 0;
        for (std::size_t i = 0; i < vocab; ++i) d += std::exp(double(exact[i])) * (double(exact[i]) - ours[i]);
        kl += std::max(d, 0.0);
        agree += std::max_element(exact, exact + vocab) - exact == std::max_element(ours, ours + vocab) - ours ? 1 : 0;
      }
    }
    r.predictions = predictions();
    r.mean_nll = nll / double(r.predictions);
    r.perplexity = std::exp(r.mean_nll);
    r.mean_kl = kl / double(r.predictions);
    r.top1 = agree / double(r.predictions);
    r.bits_per_value = 8.0 * double(r.cache_bytes) / double(values);
  }

  struct Run {
    std::vector<float> log_probs;  // (T, vocab)
    std::vector<double> nll;
    std::vector<std::vector<float>> q, k, v;  // per layer, pre-RoPE
  };

  template <class Backend>
  std::vector<float> forward_all(Backend& kv, const std::vector<int>& tokens) const {
    const std::size_t vocab = model_.config().vocab;
    std::vector<float> out = llama::prefill_logits(model_, kv, tokens, prefill_chunk_);
    for (std::size_t p = 0; p < tokens.size(); ++p) {
      const std::span<float> row(out.data() + p * vocab, vocab);
      llama::log_softmax(row, row);
    }
    return out;
  }

  std::vector<double> nll_of(const std::vector<float>& log_probs, const std::vector<int>& tokens) const {
    std::vector<double> nll;
    for (std::size_t p = 0; p + 1 < tokens.size(); ++p)
      nll.push_back(-double(log_probs[p * model_.config().vocab + std::size_t(tokens[p + 1])]));
    return nll;
  }

  static double sum(const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return s;
  }

  // Each layer's exact q, k, v go into a one-layer cache with its configuration; errors are measured
  // against the exact tensors with the cache as it stands after the whole story.
  void attention_metrics(const std::vector<CacheConfig>& configs, ConfigResult& r) const {
    const llama::LlamaConfig& m = model_.config();
    const std::size_t d = m.head_dim, group = m.heads / m.kv_heads;
    std::vector<AttentionErrorAccumulator> per_layer(m.layers);
    AttentionErrorAccumulator all;
    for (std::size_t s = 0; s < metric_stories_; ++s) {
      const std::size_t T = stories_[s].size();
      for (std::size_t l = 0; l < m.layers; ++l) {
        const CacheConfig& config = configs.at(l);
        CacheShape shape = cache_shape(model_, T);
        shape.layers = 1;
        BasicKVCache cache(shape, config);
        std::vector<float> keys = exact_[s].k[l], queries = exact_[s].q[l];
        for (std::size_t t = 0; t < T; ++t) {
          cache.rope().rotate_heads(std::span(queries).subspan(t * m.q_dim(), m.q_dim()), t);
          if (config.key_rope == KeyRope::post)
            cache.rope().rotate_heads(std::span(keys).subspan(t * m.kv_dim(), m.kv_dim()), t);
        }
        cache.append(0, 0, keys, exact_[s].v[l]);
        for (std::size_t h = 0; h < m.kv_heads; ++h) {
          MatrixD k(T, d), v(T, d);
          std::vector<float> row(d);
          for (std::size_t t = 0; t < T; ++t) {
            const float* src = exact_[s].k[l].data() + (t * m.kv_heads + h) * d;
            row.assign(src, src + d);
            cache.rope().rotate(row.data(), t);
            for (std::size_t c = 0; c < d; ++c) {
              k(t, c) = row[c];
              v(t, c) = exact_[s].v[l][(t * m.kv_heads + h) * d + c];
            }
          }
          std::vector<MatrixD> q(group, MatrixD(T, d));
          for (std::size_t g = 0; g < group; ++g)
            for (std::size_t t = 0; t < T; ++t)
              for (std::size_t c = 0; c < d; ++c) q[g](t, c) = queries[(t * m.heads + h * group + g) * d + c];
          add_head_errors(per_layer[l], cache, 0, h, k, v, q, 0);
        }
      }
    }
    for (const auto& acc : per_layer) {
      r.layers.push_back(acc.errors());
      all += acc;
    }
    r.all = all.errors();
  }

  const llama::Model& model_;
  std::vector<std::vector<int>> stories_;
  std::size_t metric_stories_;
  AttentionFn attention_;
  std::size_t prefill_chunk_;
  std::vector<Run> exact_;
};

}  // namespace kvq::eval
