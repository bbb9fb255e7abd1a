#pragma once
// kvq-eval --advise: a cache configuration per layer, chosen for the user's model.
//
// Layers differ in how much quantization they tolerate, and rules of thumb do not transfer
// between models. The advisor measures instead:
//   1. every candidate configuration on every layer alone (the other layers full precision):
//      the KL of the next-token distribution it costs, that layer's sensitivity;
//   2. every candidate on all layers (the uniform configurations): their bits per value;
//   3. the per-layer choice minimising the summed sensitivities with the layers' average bits
//      per value within the budget (exact, over the Pareto frontier of partial choices);
//   4. the few best such choices on all layers at once, which is what they are judged by; the
//      best of them, or the best uniform configuration within the budget where that measures
//      better, is the advice.
// Layers of one model have one shape, so a layer's bits under a configuration are the uniform
// run's bits per value: codes, scales, zero points and full-precision tokens all counted.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "eval/model_eval.hpp"
#include "kvq/kvq.hpp"

namespace kvq::eval {

/// The configurations the advisor chooses among for a model of `head_dim`: keys and values each
/// per channel (groups of 32 tokens; keys pre-RoPE) or per token (groups of up to 32 channels),
/// at 2, 3, 4 or 8 bits, and the unquantized fp16 cache (65); and the same at 2 to 4 bits with
/// the first 4 tokens kept in fp16 (36). Four sinks cost about 0.1 bits per value at 512 tokens
/// and spare a layer whose attention rests on its first tokens (on stories260K, layer 0 takes
/// them); no window, which at a few hundred tokens costs more bits than it saves.
inline std::vector<CacheConfig> advisor_candidates(std::size_t head_dim) {
  const std::string t = "t" + std::to_string(std::min<std::size_t>(32, head_dim));
  std::vector<CacheConfig> out{parse_cache_config("k16-v16-r0-s0")};
  const auto add = [&](std::initializer_list<int> bits, int sinks) {
    for (const char* k_axis : {"c32", "t"})
      for (const char* v_axis : {"t", "c32"})
        for (const int k : bits)
          for (const int v : bits) {
            const std::string ka = k_axis[0] == 't' ? t : k_axis, va = v_axis[0] == 't' ? t : v_axis;
            out.push_back(parse_cache_config(fmt::format("k{}{}-v{}{}-r0-s{}", k, ka, v, va, sinks)));
          }
  };
  add({2, 3, 4, 8}, 0);
  add({2, 3, 4}, 4);
  return out;
}

struct Advice {
  double budget = 0;  // average bits per value allowed
  std::vector<CacheConfig> candidates;
  std::vector<ConfigResult> uniform;        // each candidate on every layer
  std::vector<std::vector<double>> alone;   // [layer][candidate]: KL with only that layer quantized
  std::vector<std::size_t> choice;          // [layer]: index into candidates
  double predicted_kl = 0;                  // the chosen layers' summed sensitivities
  ConfigResult advised;                     // the choice on every layer at once
  std::size_t verified = 0;                 // per-layer choices measured on all layers
  bool uniform_won = false;                 // the best uniform configuration measured better than all
  std::optional<std::size_t> best_uniform;  // lowest-KL uniform candidate within the budget
  std::vector<ModelEvaluation::LayerGeometry> geometry;

  std::vector<CacheConfig> configs() const {
    std::vector<CacheConfig> out;
    for (const std::size_t c : choice) out.push_back(candidates[c]);
    return out;
  }
};

/// Step 3: one candidate per layer minimising the summed sensitivities, their mean bits within
/// `budget`. Exact: partial choices are kept on their Pareto frontier (bits against KL). Returns
/// the `keep` lowest-KL choices of the final frontier, best first; none when even the cheapest
/// choice is over the budget.
inline std::vector<std::vector<std::size_t>> choose_layers(const std::vector<std::vector<double>>& alone,
                                                           const std::vector<double>& bits, double budget,
                                                           std::size_t keep = 1) {
  struct Partial {
    double bits = 0, kl = 0;
    std::vector<std::size_t> choice;
  };
  const double limit = budget * double(alone.size()) * (1 + 1e-12);
  std::vector<Partial> frontier{Partial{}};
  for (const std::vector<double>& layer : alone) {
    std::vector<Partial> next;
    for (const Partial& p : frontier)
      for (std::size_t c = 0; c < layer.size(); ++c)
        if (p.bits + bits[c] <= limit) {
          Partial q = p;
          q.bits += bits[c];
          q.kl += layer[c];
          q.choice.push_back(c);
          next.push_back(std::move(q));
        }
    std::sort(next.begin(), next.end(),
              [](const Partial& a, const Partial& b) { return a.bits != b.bits ? a.bits < b.bits : a.kl < b.kl; });
    frontier.clear();
    for (Partial& p : next)  // keep a point only if it beats every cheaper one
      if (frontier.empty() || p.kl < frontier.back().kl) frontier.push_back(std::move(p));
    if (frontier.empty()) return {};
  }
  std::vector<std::vector<std::size_t>> best;  // the frontier's KL falls as bits rise: best last
  for (auto p = frontier.rbegin(); p != frontier.rend() && best.size() < keep; ++p) best.push_back(p->choice);
  return best;
}

/// Steps 1 to 4 on `evaluation`'s model and stories, running `parallel(n, job)` to spread the
/// n measurements over threads. The additive model is only a model: the `verify` lowest-KL
/// choices are each measured on all layers, and the best of them and of the uniform
/// configurations within the budget is the advice. Throws kvq::Error when the budget is below
/// every candidate.
template <class Parallel>
Advice advise(const ModelEvaluation& evaluation, std::size_t layers, std::vector<CacheConfig> candidates, double budget,
              Parallel parallel, std::size_t verify = 4) {
  if (!(budget > 0) || !std::isfinite(budget))
    throw Error(ErrorCode::invalid_argument,
                "--budget must be a positive number of bits per value, got " + std::to_string(budget));
  if (candidates.empty() || layers == 0) throw Error(ErrorCode::invalid_argument, "advise: no candidates or no layers");
  Advice a;
  a.budget = budget;
  a.candidates = std::move(candidates);
  const std::size_t n = a.candidates.size();
  a.uniform.resize(n);
  a.alone.assign(layers, std::vector<double>(n));
  parallel(n + layers * n, [&](std::size_t job) {
    if (job < n) {
      a.uniform[job] = evaluation.evaluate_layers(std::vector<CacheConfig>(layers, a.candidates[job]));
      return;
    }
    const std::size_t l = (job - n) / n, c = (job - n) % n;
    std::vector<CacheConfig> configs(layers, full_precision_config());
    configs[l] = a.candidates[c];
    a.alone[l][c] = evaluation.evaluate_layers(configs).mean_kl;
  });
  std::vector<double> bits(n);
  for (std::size_t c = 0; c < n; ++c) bits[c] = a.uniform[c].bits_per_value;
  const std::vector<std::vector<std::size_t>> choices =
      choose_layers(a.alone, bits, budget, std::max<std::size_t>(verify, 1));
  if (choices.empty())
    throw Error(ErrorCode::invalid_argument, "--budget " + fmt::format("{:g}", budget) +
                                                 " bits per value is below the smallest configuration's " +
                                                 fmt::format("{:.3f}", *std::min_element(bits.begin(), bits.end())));
  std::vector<ConfigResult> measured(choices.size());
  parallel(choices.size(), [&](std::size_t i) {
    std::vector<CacheConfig> configs;
    for (const std::size_t c : choices[i]) configs.push_back(a.candidates[c]);
    measured[i] = evaluation.evaluate_layers(configs);
  });
  std::size_t best = 0;
  for (std::size_t i = 1; i < choices.size(); ++i)
    if (measured[i].mean_kl < measured[best].mean_kl) best = i;
  a.choice = choices[best];
  a.advised = measured[best];
  a.verified = choices.size();
  for (std::size_t c = 0; c < n; ++c)
    if (bits[c] <= budget && (!a.best_uniform || a.uniform[c].mean_kl < a.uniform[*a.best_uniform].mean_kl))
      a.best_uniform = c;
  if (a.best_uniform && a.uniform[*a.best_uniform].mean_kl < a.advised.mean_kl) {  // uniform measured better
    a.choice.assign(layers, *a.best_uniform);
    a.advised = a.uniform[*a.best_uniform];
    a.uniform_won = true;
  }
  for (std::size_t l = 0; l < layers; ++l) a.predicted_kl += a.alone[l][a.choice[l]];
  a.geometry = evaluation.layer_geometry();
  return a;
}

/// The advice as kvq-eval prints it: the per-layer table, the advised and the best uniform
/// configuration measured on all layers, and the text parse_layer_configs loads.
inline void print_advice(std::ostream& out, const Advice& a) {
  out << fmt::format(
      "per-layer advice for at most {:g} bits per value ({} candidates per layer, each measured on "
      "one layer alone, the others fp32):\n\n",
      a.budget, a.candidates.size());
  out << fmt::format("{:>5}  {:<22} {:>6} {:>10}   {:>9} {:>10} {:>12}\n", "layer", "configuration", "bits", "KL alone",
                     "key norm", "value norm", "key outliers");
  for (std::size_t l = 0; l < a.choice.size(); ++l) {
    const std::size_t c = a.choice[l];
    const ModelEvaluation::LayerGeometry& g = a.geometry[l];
    out << fmt::format("{:>5}  {:<22} {:>6.3f} {:>10.6f}   {:>9.3f} {:>10.3f} {:>11.2f}x\n", l,
                       to_string(a.candidates[c]), a.uniform[c].bits_per_value, a.alone[l][c], g.key_norm, g.value_norm,
                       g.key_outliers);
  }
  out << "\n(key outliers: the largest key channel's mean magnitude over the median channel's)\n\n";
  auto row = [&](const std::string& name, const ConfigResult& r) {
    out << fmt::format("{:<14} {:<26} bits/value {:>6.3f}  KL {:>9.6f}  top-1 {:>6.2f}%  perplexity {:.4f}\n",
                       name + ":", name == "advised" ? std::string("per layer (above)") : to_string(r.config),
                       r.bits_per_value, r.mean_kl, 100 * r.top1, r.perplexity);
  };
  row("advised", a.advised);
  if (a.best_uniform) {
    const ConfigResult& u = a.uniform[*a.best_uniform];
    row("best uniform", u);
    out << fmt::format(
        "advised KL / best uniform KL: {:.3f} (summed single-layer KLs predicted {:.6f}; {} per-layer "
        "choices measured on all layers)\n",
        u.mean_kl > 0 ? a.advised.mean_kl / u.mean_kl : 0.0, a.predicted_kl, a.verified);
    if (a.uniform_won)
      out << "no per-layer choice measured better than the best uniform configuration at this budget: the advice is "
             "it\n";
  } else {
    out << "no uniform configuration fits this budget: only a per-layer choice does\n";
  }
  out << "\nper-layer configuration (kvq::parse_layer_configs, kvq::LayeredKVCache):\n  "
      << to_string(std::span<const CacheConfig>(a.configs())) << "\n";
}

}  // namespace kvq::eval
