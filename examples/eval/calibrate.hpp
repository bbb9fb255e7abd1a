#pragma once
// Calibrated codebooks for kvq-eval: a configuration whose key or value quantizer ends in a bare
// 'b' ("k3c32b-v4t8-r0-s0") asks for codebook levels fitted to the model (CodebookCalibration).
// The calibration text is the model's own greedy continuation from BOS with the fp32 cache, so it
// shares no token with the evaluation text. One configuration pools the levels over layers and KV
// heads (one codebook per tensor); per-layer text ("k3c32b-v4t8-r0-s0*5") fits each layer's
// codebooks to that layer's keys and values alone. Either way the result is text that --configs
// reads back.

#include <algorithm>
#include <cstddef>
#include <optional>
#include <regex>
#include <string>
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
    static const std::regex bare(R"([kv][0-9]+[ct][0-9]+(o[0-9]+)?b(\.[a-z0-9]+)?)");
    const std::size_t dot = std::min(q.find('.'), q.size());
    if (std::regex_match(q, bare)) {
      QuantizerSpec spec = parse_quantizer(q.substr(0, dot - 1) + q.substr(dot), q[0]);  // the same, affine
      spec.mode = Mode::codebook;
      if (spec.bits > 4)  // before the levels: the codebook holds 16
        throw Error(ErrorCode::invalid_argument,
                    "'" + text + "': codebook levels take 1..4 bits, got " + std::to_string(spec.bits));
      for (int j = 0; j < spec.levels(); ++j)
        spec.codebook[std::size_t(j)] = round_to(Scalar::f16, -1.0f + 2.0f * float(j) / float(spec.levels() - 1));
      const std::string full = to_string(spec, q[0]);
      spelled.replace(start, end - start, full);
      (part == 0 ? r.keys : r.values) = true;
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
      r.layers.push_back({c, requests[i] && requests[i]->keys, requests[i] && requests[i]->values});
  return r;
}

/// The keys and values of the calibration text, per layer (pre-RoPE keys, as the cache stores them).
class CalibrationText {
 public:
  explicit CalibrationText(const llama::Model& model)
      : m_(model.config()),
        kv_(llama::FullPrecisionBackend(model, std::min(calibration_tokens, m_.context_length)), m_.layers) {
    (void)llama::greedy_generate(model, kv_, std::min(calibration_tokens, m_.context_length) - 1);
  }

  /// `spec`'s codebook fitted to the keys (or values) of layers [first, last), every KV head.
  QuantizerSpec fit(const QuantizerSpec& spec, bool keys, std::size_t first, std::size_t last) const {
    if (first >= last || last > m_.layers)
      throw Error(ErrorCode::invalid_argument, "codebook calibration: layers [" + std::to_string(first) + ", " +
                                                   std::to_string(last) + ") of a model of " +
                                                   std::to_string(m_.layers));
    CodebookCalibration calibration(spec, m_.head_dim);
    std::vector<float> rows;
    for (std::size_t l = first; l < last; ++l) {
      const std::vector<float>& all = keys ? kv_.keys(l) : kv_.values(l);  // (T, kv_heads, d)
      const std::size_t tokens = all.size() / (m_.kv_heads * m_.head_dim);
      for (std::size_t h = 0; h < m_.kv_heads; ++h) {
        rows.clear();
        for (std::size_t t = 0; t < tokens; ++t) {
          const float* row = all.data() + (t * m_.kv_heads + h) * m_.head_dim;
          rows.insert(rows.end(), row, row + m_.head_dim);
        }
        calibration.add(rows);
      }
    }
    return calibration.fit();
  }

  /// `request`'s configuration with the codebooks it asks for fitted to layers [first, last).
  CacheConfig calibrate(const CodebookRequest& request, std::size_t first, std::size_t last) const {
    CacheConfig out = request.config;
    if (request.keys) out.key = fit(out.key, true, first, last);
    if (request.values) out.value = fit(out.value, false, first, last);
    return out;
  }

 private:
  const llama::LlamaConfig& m_;
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
