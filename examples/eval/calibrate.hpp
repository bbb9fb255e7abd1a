#pragma once
// Calibrated codebooks for kvq-eval: a configuration whose key or value quantizer ends in a bare
// 'b' ("k3c32b-v4t8-r0-s0") asks for codebook levels fitted to the model (CodebookCalibration).
// The calibration text is the model's own greedy continuation from BOS with the fp32 cache, so it
// shares no token with the evaluation text; the levels are pooled over layers and KV heads (one
// codebook per tensor, so the result is one configuration string that --configs reads back).

#include <cstddef>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "eval/cache_backend.hpp"
#include "eval/engine_formats.hpp"
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

/// The request's configuration with its codebooks fitted to the model's keys and values on its
/// own greedy text (pre-RoPE keys, as the cache stores them).
inline CacheConfig calibrate_codebooks(const llama::Model& model, const CodebookRequest& request) {
  const llama::LlamaConfig& m = model.config();
  const std::size_t steps = std::min(calibration_tokens, m.context_length) - 1;
  RecordingBackend<llama::FullPrecisionBackend> kv(llama::FullPrecisionBackend(model, steps + 1), m.layers);
  (void)llama::greedy_generate(model, kv, steps);
  CacheConfig out = request.config;
  auto fit = [&](QuantizerSpec& spec, bool keys) {
    CodebookCalibration calibration(spec, m.head_dim);
    std::vector<float> rows;
    for (std::size_t l = 0; l < m.layers; ++l) {
      const std::vector<float>& all = keys ? kv.keys(l) : kv.values(l);  // (T, kv_heads, d)
      const std::size_t tokens = all.size() / (m.kv_heads * m.head_dim);
      for (std::size_t h = 0; h < m.kv_heads; ++h) {
        rows.clear();
        for (std::size_t t = 0; t < tokens; ++t) {
          const float* row = all.data() + (t * m.kv_heads + h) * m.head_dim;
          rows.insert(rows.end(), row, row + m.head_dim);
        }
        calibration.add(rows);
      }
    }
    spec = calibration.fit();
  };
  if (request.keys) fit(out.key, true);
  if (request.values) fit(out.value, false);
  return out;
}

}  // namespace kvq::eval
