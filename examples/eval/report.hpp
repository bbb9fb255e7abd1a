#pragma once
// kvq-eval's output: an aligned terminal table, a CSV with per-layer rows, and an SVG chart of
// model KL divergence and attention-output error against bits per value.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "eval/model_eval.hpp"

namespace kvq::eval {

/// "K chan / V tok", the axis combination a configuration uses.
inline std::string axes_label(const CacheConfig& c) {
  auto axis = [](bool quantized, Axis a) { return !quantized ? "full" : a == Axis::per_channel ? "chan" : "tok"; };
  return fmt::format("K {} / V {}", axis(c.quantize_keys, c.key.axis), axis(c.quantize_values, c.value.axis));
}

/// The axes column of a result: kvq's axes, or an engine format's storage granularity.
inline std::string axes_label(const ConfigResult& r) {
  if (!r.layer_configs.empty()) {  // one label when every layer uses the same axes
    const std::string first = axes_label(r.layer_configs.front());
    for (const CacheConfig& c : r.layer_configs)
      if (axes_label(c) != first) return "per layer";
    return first;
  }
  if (!r.engine) return axes_label(r.config);
  if (r.engine->turbo()) return "heads + RH";  // per head vector, after the random-sign rotation
  if (r.engine->hf()) return "tok/64 + R128";  // 64 values of a head vector; residual of 128
  return r.engine->block ? (r.engine->hadamard ? "rows/32 + H" : "rows/32") : "per tensor";
}

/// True when sinks and the full-precision window hold every position of a story of `length`
/// tokens: such a cache quantizes nothing, and its row measures fp16 storage, not the quantizer.
inline bool window_covers(const CacheConfig& c, std::size_t length) noexcept {
  const std::size_t reach = c.flush == WindowFlush::none ? c.window : c.window - 1;  // a flush quantizes at R
  return (c.quantize_keys || c.quantize_values) && c.sinks + reach >= length;
}

/// window_covers for a result; for a per-layer candidate: some layer quantizes, and every layer
/// that does is covered.
inline bool window_covers(const ConfigResult& r, std::size_t length) noexcept {
  if (r.engine) return false;
  if (r.layer_configs.empty()) return window_covers(r.config, length);
  bool quantizes = false;
  for (const CacheConfig& c : r.layer_configs) {
    if (!c.quantize_keys && !c.quantize_values) continue;
    if (!window_covers(c, length)) return false;
    quantizes = true;
  }
  return quantizes;
}

/// `longest_story` (tokens) flags with a '*' the configurations whose window covers it; 0 flags none.
inline void print_table(std::ostream& out, const std::vector<ConfigResult>& results, double baseline_nll,
                        std::size_t longest_story = 0) {
  out << fmt::format("{:<28} {:<16} {:>6} {:>8} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8}\n", "config", "axes", "bits",
                     "dPPL", "KL", "top-1", "key err", "val err", "score", "output");
  out << fmt::format("{:<28} {:<16} {:>6} {:>8} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8}\n", "", "", "/value", "", "nats",
                     "", "", "", "err", "err");
  const double base_ppl = std::exp(baseline_nll);
  bool flagged = false;
  for (const ConfigResult& r : results) {
    const bool measured = !r.layers.empty();  // --metric-stories 0 skips the attention metrics
    auto metric = [&](double v) { return measured ? fmt::format("{:>8.4f}", v) : fmt::format("{:>8}", "-"); };
    const bool covers = longest_story != 0 && window_covers(r, longest_story);
    flagged = flagged || covers;
    out << fmt::format("{:<28} {:<16} {:>6.2f} {:>+8.4f} {:>9.5f} {:>7.4f} {} {} {} {}\n",
                       name_of(r) + (covers ? "*" : ""), axes_label(r), r.bits_per_value, r.perplexity - base_ppl,
                       r.mean_kl, r.top1, metric(r.all.key_error), metric(r.all.value_error), metric(r.all.score_error),
                       metric(r.all.output_error));
  }
  if (flagged)
    out << fmt::format(
        "* sinks + window cover the longest story ({} tokens): nothing was quantized, so the row\n"
        "  measures full-precision storage, not the quantizer; use a longer --context or a shorter -r.\n",
        longest_story);
}

/// The free-running generation columns, for the configurations that ran them.
inline void print_generation_table(std::ostream& out, const std::vector<ConfigResult>& results) {
  const auto first =
      std::find_if(results.begin(), results.end(), [](const ConfigResult& r) { return r.generation.has_value(); });
  if (first == results.end()) return;
  out << fmt::format("\nfree-running generation: {} prompts, {} greedy tokens each, compared with the fp32 cache's\n",
                     first->generation->runs, first->generation->steps);
  out << fmt::format("{:<28} {:>10} {:>10} {:>10} {:>10}\n", "config", "identical", "identical", "same token",
                     "KL own");
  out << fmt::format("{:<28} {:>10} {:>10} {:>10} {:>10}\n", "", "tokens", "runs", "share", "path nats");
  for (const ConfigResult& r : results) {
    if (!r.generation) continue;
    const GenerationResult& g = *r.generation;
    out << fmt::format("{:<28} {:>10.1f} {:>10.3f} {:>10.4f} {:>10.3g}\n", name_of(r), g.mean_identical,
                       g.identical_share, g.token_agreement, g.mean_kl);
  }
  out << "identical tokens: leading generated tokens equal to fp32's (mean); identical runs: share of whole\n"
         "continuations equal to fp32's; KL own path: KL(fp32 || cache) along the cache's own continuation.\n";
}

inline void write_csv(std::FILE* f, const std::vector<ConfigResult>& results, double baseline_nll) {
  fmt::print(f,
             "config,axes,layer,bits_per_value,cache_bytes,perplexity,baseline_perplexity,mean_kl,top1,key_error,"
             "value_error,score_error,output_error,output_error_keys_only,output_error_values_only,attention_kl,"
             "sparsity,gen_identical_tokens,gen_identical_share,gen_token_agreement,gen_kl\n");
  for (const ConfigResult& r : results) {
    for (std::size_t l = 0; l <= r.layers.size(); ++l) {
      const AttentionErrors& e = l < r.layers.size() ? r.layers[l] : r.all;
      const std::string generation =
          r.generation
              ? fmt::format("{:.4f},{:.4f},{:.6f},{:.6g}", r.generation->mean_identical, r.generation->identical_share,
                            r.generation->token_agreement, r.generation->mean_kl)
              : std::string(",,,");
      fmt::print(
          f,
          "{},{},{},{:.4f},{},{:.6f},{:.6f},{:.6g},{:.6f},{:.6g},{:.6g},{:.6g},{:.6g},{:.6g},{:.6g},{:.6g},{:.4f},{}\n",
          name_of(r), axes_label(r), l < r.layers.size() ? std::to_string(l) : "all", r.bits_per_value, r.cache_bytes,
          r.perplexity, std::exp(baseline_nll), r.mean_kl, r.top1, e.key_error, e.value_error, e.score_error,
          e.output_error, e.output_error_keys, e.output_error_values, e.attention_kl, e.sparsity, generation);
    }
  }
}

struct ChartPoint {
  double bits, kl, output_error;
  double identical = 0;  // mean leading generated tokens equal to fp32's (with --generate)
};

/// Two log-scale panels (model KL, attention-output error) against bits per value, one line per
/// axis combination: configurations with no window, no sinks, pre-RoPE keys and no rotation (not
/// per-layer ones). Engine formats are labelled squares on the KL panel (their attention errors
/// are not measured). With generation results a third, linear panel shows how many generated
/// tokens stay the fp32 ones.
inline std::string svg_chart(const std::vector<ConfigResult>& results, const std::string& title) {
  std::map<std::string, std::vector<ChartPoint>> series;
  std::vector<std::pair<std::string, ChartPoint>> engines;
  std::size_t steps = 0;  // generated tokens per run; 0: no generation panel
  for (const ConfigResult& r : results)
    if (r.generation) steps = r.generation->steps;
  for (const ConfigResult& r : results) {
    const CacheConfig& c = r.config;
    if (r.engine) {
      engines.push_back({r.engine->name, {r.bits_per_value, std::max(r.mean_kl, 1e-6), 0.0}});
      continue;
    }
    if (!r.layer_configs.empty()) continue;  // the series are uniform configurations
    if (!c.quantize_keys || !c.quantize_values || c.window != 0 || c.sinks != 0 || c.key_rope != KeyRope::pre ||
        c.key.bits != c.value.bits || c.key_rotation != Rotation::none || c.value_rotation != Rotation::none)
      continue;
    series[axes_label(c)].push_back({r.bits_per_value, std::max(r.mean_kl, 1e-6), std::max(r.all.output_error, 1e-6),
                                     r.generation ? r.generation->mean_identical : 0.0});
  }
  const char* colors[] = {"#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02"};
  const double W = 460, H = 320, left = 60, top = 40, pw = 380, ph = 230;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"20\" font-size=\"14\">{}</text>\n",
      (steps > 0 ? 3 : 2) * W, H + 40, left, title);
  double max_bits = 1;
  for (auto& [name, pts] : series) {
    std::sort(pts.begin(), pts.end(), [](auto& a, auto& b) { return a.bits < b.bits; });
    for (auto& p : pts) max_bits = std::max(max_bits, p.bits);
  }
  for (auto& e : engines) max_bits = std::max(max_bits, e.second.bits);
  max_bits = std::ceil(max_bits);
  for (int panel = 0; panel < (steps > 0 ? 3 : 2); ++panel) {
    const double x0 = left + panel * W;
    const auto value = [&](const ChartPoint& p) {
      return panel == 0 ? p.kl : panel == 1 ? p.output_error : p.identical;
    };
    double lo = 1e9, hi = 1e-9;
    if (panel == 0)
      for (auto& e : engines) lo = std::min(lo, e.second.kl), hi = std::max(hi, e.second.kl);
    for (auto& [name, pts] : series)
      for (auto& p : pts) {
        const double y = value(p);
        lo = std::min(lo, y);
        hi = std::max(hi, y);
      }
    if (lo > hi) lo = 1e-3, hi = 1;
    const double llo = std::floor(std::log10(lo)), lhi = std::ceil(std::log10(hi)) + (lo == hi ? 1 : 0);
    auto X = [&](double bits) { return x0 + pw * bits / max_bits; };
    const bool linear = panel == 2;  // identical tokens: 0..steps
    auto Y = [&](double v) {
      return linear ? top + ph * (1.0 - v / double(steps)) : top + ph * (lhi - std::log10(v)) / (lhi - llo);
    };
    svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>\n", x0, top,
                       pw, ph);
    const auto grid = [&](double v, const std::string& label) {
      svg += fmt::format(
          "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2}\" y2=\"{2}\" stroke=\"#ddd\"/><text x=\"{3}\" y=\"{4}\" "
          "text-anchor=\"end\">{5}</text>\n",
          x0, x0 + pw, Y(v), x0 - 4, Y(v) + 4, label);
    };
    if (linear)
      for (int q = 0; q <= 4; ++q) grid(double(steps) * q / 4, fmt::format("{:g}", double(steps) * q / 4));
    else
      for (double e = llo; e <= lhi; e += 1) grid(std::pow(10.0, e), fmt::format("1e{}", int(e)));
    for (double b = 0; b <= max_bits; b += 2)
      svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", X(b), top + ph + 16, int(b));
    svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">bits per value (all metadata counted)</text>\n",
                       x0 + pw / 2, top + ph + 34);
    svg += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", x0, top - 6,
                       panel == 0   ? "next-token KL divergence (nats, log)"
                       : panel == 1 ? "attention-output error (relative L2, log)"
                                    : fmt::format("generated tokens identical to fp32's (of {})", steps));
    int color = 0;
    for (auto& [name, pts] : series) {
      std::string path;
      for (auto& p : pts) path += fmt::format("{},{} ", X(p.bits), Y(value(p)));
      const char* col = colors[color++ % 6];
      svg += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>\n", path, col);
      for (auto& p : pts)
        svg += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"3\" fill=\"{}\"/>\n", X(p.bits), Y(value(p)), col);
      if (panel == 1)
        svg +=
            fmt::format("<text x=\"{}\" y=\"{}\" fill=\"{}\">{}</text>\n", x0 + pw - 110, top + 16 * color, col, name);
    }
    if (panel == 0)
      for (auto& [name, p] : engines)
        svg += fmt::format(
            "<rect x=\"{}\" y=\"{}\" width=\"6\" height=\"6\" fill=\"#333\"/><text x=\"{}\" y=\"{}\" "
            "font-size=\"9\" fill=\"#333\">{}</text>\n",
            X(p.bits) - 3, Y(p.kl) - 3, X(p.bits) + 5, Y(p.kl) + 3, name);
  }
  return svg + "</svg>\n";
}

}  // namespace kvq::eval
