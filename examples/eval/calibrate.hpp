#pragma once
// Calibrated codebooks for kvq-eval: a configuration whose key or value quantizer ends in a bare
// 'b' ("k3c32b-v4t8-r0-s0") asks for codebook levels fitted to the model (CodebookCalibration).
// The calibration text is the model's own greedy continuation from BOS with the fp32 cache, so it
// shares no token with the evaluation text. One configuration pools the levels over layers and KV
// heads (one codebook per tensor); per-layer text ("k3c32b-v4t8-r0-s0*5") fits each layer's
// codebooks to that layer's keys and values alone. A bare "bh" ("k3c32bh-v4t8-r0-s0") fits one
// codebook per KV head, so per-layer text with it fits one per layer, head and tensor. A 'w' after
// either ("k3c32bw", "k3c32bhw") weighs each value by what its error costs where it is consumed
// (KVQuant weighs its k-means by sensitivity): a key channel by the squared queries that meet it,
// a value row by the squared attention weights it receives, on the same text. Either way the
// result is text that --configs reads back.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <regex>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "eval/cache_backend.hpp"
#include "eval/engine_formats.hpp"
#include "eval/model_eval.hpp"
#include "kvq/kvq.hpp"
#include "llama/full_precision_backend.hpp"
#include "llama/inference.hpp"
#include "llama/model.hpp"

namespace kvq::eval {

/// Positions of the calibration sequence (the model's context at most).
inline constexpr std::size_t calibration_tokens = 512;

struct CodebookRequest {
  CacheConfig config;  // the codebook streams hold the uniform grid until calibrated
  bool keys = false, values = false;
  bool key_heads = false, value_heads = false;        // a codebook per KV head ("bh")
  bool key_weighted = false, value_weighted = false;  // a sensitivity-weighted fit ("bw")
};

/// The request a configuration string makes, or nothing when no quantizer ends in a bare 'b'.
/// Throws on a string that is no configuration either way.
inline std::optional<CodebookRequest> codebook_request(const std::string& text) {
  if (is_engine_format_name(text)) return std::nullopt;
  CodebookRequest r;
  std::string spelled = text;
  std::size_t start = 0;
  for (int part = 0; part < 2 && start < spelled.size(); ++part) {
    const std::size_t end = std::min(spelled.find('-', start), spelled.size());
    const std::string q = spelled.substr(start, end - start);
    static const std::regex bare(R"([kv][0-9]+[ct][0-9]+(o[0-9]+)?bh?w?(\.[a-z0-9]+)?)");
    const std::size_t dot = std::min(q.find('.'), q.size());
    if (std::regex_match(q, bare)) {
      const bool weighted = q[dot - 1] == 'w';
      const bool per_head = q[dot - 1 - (weighted ? 1 : 0)] == 'h';
      const std::size_t suffix = 1 + (per_head ? 1 : 0) + (weighted ? 1 : 0);
      QuantizerSpec spec = parse_quantizer(q.substr(0, dot - suffix) + q.substr(dot), q[0]);  // the same, affine
      spec.mode = Mode::codebook;
      if (spec.bits > 4)  // before the levels: the codebook holds 16
        throw Error(ErrorCode::invalid_argument,
                    "'" + text + "': codebook levels take 1..4 bits, got " + std::to_string(spec.bits));
      for (int j = 0; j < spec.levels(); ++j)
        spec.codebook[std::size_t(j)] = round_to(Scalar::f16, -1.0f + 2.0f * float(j) / float(spec.levels() - 1));
      const std::string full = to_string(spec, q[0]);
      spelled.replace(start, end - start, full);
      (part == 0 ? r.keys : r.values) = true;
      (part == 0 ? r.key_heads : r.value_heads) = per_head;
      (part == 0 ? r.key_weighted : r.value_weighted) = weighted;
      start += full.size() + 1;
    } else {
      start = end + 1;
    }
  }
  if (!r.keys && !r.values) return std::nullopt;
  r.config = parse_cache_config(spelled);
  if ((r.keys && (r.config.key_rope != KeyRope::pre || r.config.key_rotation != Rotation::none)) ||
      (r.values && r.config.value_rotation != Rotation::none))
    throw Error(ErrorCode::invalid_argument,
                "'" + text + "': kvq-eval calibrates codebooks for pre-RoPE keys and for values, without rotations");
  return r;
}

/// Per-layer text whose items may end their quantizers in a bare 'b': one request per layer.
struct LayerCodebookRequest {
  std::vector<CodebookRequest> layers;
};

/// The request per-layer text makes, or nothing when no item holds a bare 'b'. Throws on text that
/// is no per-layer configuration either way.
inline std::optional<LayerCodebookRequest> layer_codebook_request(const std::string& text) {
  // Items with a bare 'b' are spelled with the uniform grid, then the whole text is parsed once, so
  // that its errors name the item as parse_layer_configs names it.
  std::vector<std::optional<CodebookRequest>> requests;
  std::vector<std::string> items;
  for (std::size_t start = 0;;) {
    const std::size_t end = std::min(text.find(';', start), text.size());
    const std::string part = text.substr(start, end - start);
    const std::size_t star = std::min(part.find('*'), part.size());
    try {
      requests.push_back(codebook_request(part.substr(0, star)));
    } catch (const Error& e) {
      throw Error(e.code(), "per-layer configuration '" + text + "', item " + std::to_string(items.size() + 1) + ": " +
                                e.message());
    }
    items.push_back(requests.back() ? to_string(requests.back()->config) + part.substr(star) : part);
    if (end == text.size()) break;
    start = end + 1;
  }
  if (std::none_of(requests.begin(), requests.end(), [](const auto& q) { return q.has_value(); })) return std::nullopt;
  std::string spelled;
  for (const std::string& item : items) spelled += (spelled.empty() ? "" : ";") + item;
  (void)parse_layer_configs(spelled);  // throws, naming the item, before anything below can
  LayerCodebookRequest r;
  for (std::size_t i = 0; i < items.size(); ++i)
    for (const CacheConfig& c : parse_layer_configs(items[i]))
      if (requests[i]) {
        CodebookRequest layer = *requests[i];
        layer.config = c;
        r.layers.push_back(layer);
      } else {
        r.layers.push_back({c});
      }
  return r;
}

/// The keys and values of the calibration text, per layer (pre-RoPE keys, as the cache stores them).
class CalibrationText {
 public:
  explicit CalibrationText(const llama::Model& model)
      : m_(model.config()),
        rope_(model.rope_config()),
        kv_(llama::FullPrecisionBackend(model, std::min(calibration_tokens, m_.context_length)), m_.layers) {
    (void)llama::greedy_generate(model, kv_, std::min(calibration_tokens, m_.context_length) - 1);
  }

  /// What an error in each channel of KV head h's (pre-RoPE) keys in layer l costs the scores:
  /// the mean squared query of the head's group, averaged over each RoPE pair, since an error
  /// turns with its pair by the angle between the key's position and the query's.
  std::vector<float> key_channel_weights(std::size_t l, std::size_t h) const {
    const std::vector<float>& q = kv_.queries(l);  // (T, heads, d)
    const std::size_t d = m_.head_dim, group = m_.heads / m_.kv_heads, tokens = q.size() / (m_.heads * d);
    std::vector<double> energy(d, 0.0);
    for (std::size_t t = 0; t < tokens; ++t)
      for (std::size_t g = h * group; g < (h + 1) * group; ++g)
        for (std::size_t c = 0; c < d; ++c)
          energy[c] += double(q[(t * m_.heads + g) * d + c]) * q[(t * m_.heads + g) * d + c];
    std::vector<float> w(d);
    for (std::size_t c = 0; c < d; ++c) w[c] = float(energy[c] / double(tokens * group));
    const std::size_t dims = rope_.dims();
    for (std::size_t i = 0; i < dims / 2; ++i) {
      const auto [a, b] = rope_pair(rope_.style, dims, i);
      w[a] = w[b] = 0.5f * (w[a] + w[b]);
    }
    return w;
  }

  /// What an error in each row of KV head h's values in layer l costs the attention outputs: the
  /// squared attention weights the row receives from the queries of the head's group (exact
  /// attention of the calibration text), summed.
  std::vector<float> value_row_weights(std::size_t l, std::size_t h) const {
    const std::vector<float>&q = kv_.queries(l), &k = kv_.keys(l);
    const std::size_t d = m_.head_dim, group = m_.heads / m_.kv_heads, tokens = k.size() / (m_.kv_heads * d);
    const RopeTable table(rope_, tokens);
    std::vector<float> keys(tokens * d), query(d), p(tokens);
    for (std::size_t t = 0; t < tokens; ++t) {
      std::copy_n(k.data() + (t * m_.kv_heads + h) * d, d, keys.data() + t * d);
      table.rotate(keys.data() + t * d, t);
    }
    std::vector<double> w(tokens, 0.0);
    const double scale = 1.0 / std::sqrt(double(d));
    for (std::size_t s = 0; s < std::min(tokens, q.size() / (m_.heads * d)); ++s)
      for (std::size_t g = h * group; g < (h + 1) * group; ++g) {
        std::copy_n(q.data() + (s * m_.heads + g) * d, d, query.data());
        table.rotate(query.data(), s);
        double top = -std::numeric_limits<double>::infinity(), sum = 0.0;
        for (std::size_t t = 0; t <= s; ++t) {
          double dot = 0.0;
          for (std::size_t c = 0; c < d; ++c) dot += double(query[c]) * keys[t * d + c];
          p[t] = float(dot * scale);
          top = std::max(top, double(p[t]));
        }
        for (std::size_t t = 0; t <= s; ++t) sum += std::exp(double(p[t]) - top);
        for (std::size_t t = 0; t <= s; ++t) {
          const double weight = std::exp(double(p[t]) - top) / sum;
          w[t] += weight * weight;
        }
      }
    return std::vector<float>(w.begin(), w.end());
  }

  /// `spec`'s codebook fitted to the keys (or values) of layers [first, last), of KV head `head`
  /// or, without one, every KV head; `weighted`: each value weighed by what its error costs
  /// (key_channel_weights, value_row_weights).
  QuantizerSpec fit(const QuantizerSpec& spec, bool keys, std::size_t first, std::size_t last,
                    std::optional<std::size_t> head = std::nullopt, bool weighted = false) const {
    if (first >= last || last > m_.layers)
      throw Error(ErrorCode::invalid_argument, "codebook calibration: layers [" + std::to_string(first) + ", " +
                                                   std::to_string(last) + ") of a model of " +
                                                   std::to_string(m_.layers));
    if (head && *head >= m_.kv_heads)
      throw Error(ErrorCode::invalid_argument, "codebook calibration: KV head " + std::to_string(*head) +
                                                   " of a model of " + std::to_string(m_.kv_heads));
    CodebookCalibration calibration(spec, m_.head_dim);
    std::vector<float> rows;
    for (std::size_t l = first; l < last; ++l) {
      const std::vector<float>& all = keys ? kv_.keys(l) : kv_.values(l);  // (T, kv_heads, d)
      const std::size_t tokens = all.size() / (m_.kv_heads * m_.head_dim);
      for (std::size_t h = head.value_or(0); h < (head ? *head + 1 : m_.kv_heads); ++h) {
        rows.clear();
        for (std::size_t t = 0; t < tokens; ++t) {
          const float* row = all.data() + (t * m_.kv_heads + h) * m_.head_dim;
          rows.insert(rows.end(), row, row + m_.head_dim);
        }
        if (!weighted) {
          calibration.add(rows);
        } else {
          const std::vector<float> w = keys ? key_channel_weights(l, h) : value_row_weights(l, h);
          calibration.add(rows, keys ? CodebookCalibration::Weights{.channels = w}
                                     : CodebookCalibration::Weights{.rows = std::span(w).first(tokens)});
        }
      }
    }
    return calibration.fit();
  }

  /// `request`'s configuration with the codebooks it asks for fitted to layers [first, last).
  CacheConfig calibrate(const CodebookRequest& request, std::size_t first, std::size_t last) const {
    CacheConfig out = request.config;
    for (const auto& [spec, heads, asked, per_head, weighted, keys] :
         {std::tuple{&out.key, &out.key_head_codebooks, request.keys, request.key_heads, request.key_weighted, true},
          std::tuple{&out.value, &out.value_head_codebooks, request.values, request.value_heads, request.value_weighted,
                     false}}) {
      if (!asked) continue;
      if (!per_head || m_.kv_heads == 1) {
        *spec = fit(*spec, keys, first, last, std::nullopt, weighted);
        continue;
      }
      for (std::size_t h = 0; h < m_.kv_heads; ++h)
        heads->push_back(fit(*spec, keys, first, last, h, weighted).codebook);
      spec->codebook = heads->front();
      const Codebook& first_head = heads->front();  // a name the lambda can capture (clang: no structured bindings)
      if (std::all_of(heads->begin(), heads->end(), [&first_head](const Codebook& c) { return c == first_head; }))
        heads->clear();  // one codebook after all: one spelling
    }
    return out;
  }

 private:
  const llama::LlamaConfig& m_;
  RopeConfig rope_;
  RecordingBackend<llama::FullPrecisionBackend> kv_;
};

/// The request's configuration with its codebooks fitted to the model's keys and values on its
/// own greedy text, pooled over every layer.
inline CacheConfig calibrate_codebooks(const llama::Model& model, const CodebookRequest& request) {
  return CalibrationText(model).calibrate(request, 0, model.config().layers);
}

/// One configuration per layer, each layer's codebooks fitted to that layer alone.
inline std::vector<CacheConfig> calibrate_codebooks(const llama::Model& model, const LayerCodebookRequest& request) {
  const std::size_t layers = model.config().layers;
  std::vector<CacheConfig> configs;
  for (const CodebookRequest& layer : request.layers) configs.push_back(layer.config);
  check_layer_count(configs, layers);
  const CalibrationText text(model);
  std::vector<CacheConfig> out;
  for (std::size_t l = 0; l < layers; ++l) out.push_back(text.calibrate(request.layers[l], l, l + 1));
  return out;
}

/// A --configs entry checked before the model loads: throws on text no candidate reads.
inline void check_candidate_text(const std::string& text) {
  if (is_layer_text(text)) {
    if (!layer_codebook_request(text)) (void)parse_candidate(text);
  } else if (!codebook_request(text)) {
    (void)parse_candidate(text);
  }
}

/// What a --configs entry measures: the candidate as written (per-layer text checked against the
/// model's layers), or with the codebooks it asks for calibrated on `model`.
inline Candidate resolve_candidate(const llama::Model& model, const std::string& text) {
  if (is_layer_text(text)) {
    if (const auto request = layer_codebook_request(text)) return LayerConfigs{calibrate_codebooks(model, *request)};
    return LayerConfigs{parse_layer_configs(text, model.config().layers)};
  }
  if (const auto request = codebook_request(text)) return calibrate_codebooks(model, *request);
  return parse_candidate(text);
}

}  // namespace kvq::eval
