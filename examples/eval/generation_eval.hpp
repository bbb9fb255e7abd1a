#pragma once
// Free-running generation from a quantized cache: from each story's first P tokens the model
// continues greedily for M tokens, once with the fp32 cache and once per configuration. Teacher
// forcing feeds the true text at every step; here the cache's own choices come back as input, so
// its errors compound, and the measure is how long the continuation stays the fp32 one.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "eval/cache_backend.hpp"
#include "kvq/error.hpp"
#include "llama/full_precision_backend.hpp"
#include "llama/inference.hpp"
#include "llama/model.hpp"

namespace kvq::eval {

struct GenerationResult {
  std::size_t runs = 0, steps = 0;  // prompts, and greedy tokens generated from each
  double mean_identical = 0;        // leading generated tokens equal to fp32's, mean over runs
  double identical_share = 0;       // share of runs whose whole continuation is fp32's
  double token_agreement = 0;       // share of generated positions holding fp32's token there
  // KL(fp32 || this cache) of the next-token distribution at each generated step, along this
  // cache's own continuation (the fp32 model is fed the same tokens), nats per step.
  double mean_kl = 0;
};

class GenerationEvaluation {
 public:
  /// Prompts are the first `prompt` tokens of each story that is at least that long. With
  /// `prefill_chunk` N > 0 every prompt but its last token is fed in chunks of N (see
  /// llama::prefill_logits); the last prompt token and the generated ones run one at a time.
  GenerationEvaluation(const llama::Model& model, const std::vector<std::vector<int>>& stories, std::size_t prompt,
                       std::size_t steps, AttentionFn attention = reference_attention_fn(),
                       std::size_t prefill_chunk = 0)
      : model_(model), steps_(steps), attention_(std::move(attention)), prefill_chunk_(prefill_chunk) {
    if (prompt == 0 || steps == 0)
      throw Error(ErrorCode::invalid_argument, "generation needs a prompt of at least one token and at least one step");
    if (prompt + steps > model.config().context_length)
      throw Error(ErrorCode::invalid_argument, "a prompt of " + std::to_string(prompt) + " tokens and " +
                                                   std::to_string(steps) +
                                                   " generated tokens exceed the model's context length of " +
                                                   std::to_string(model.config().context_length));
    for (const auto& s : stories)
      if (s.size() >= prompt) prompts_.emplace_back(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(prompt));
    if (prompts_.empty())
      throw Error(ErrorCode::invalid_argument, "no story holds a prompt of " + std::to_string(prompt) + " tokens");
    for (const auto& p : prompts_) reference_.push_back(run(p, nullptr).continuation);
  }

  /// The fp32 cache's greedy continuation of each prompt.
  const std::vector<std::vector<int>>& reference() const noexcept { return reference_; }
  const std::vector<std::vector<int>>& prompts() const noexcept { return prompts_; }

  GenerationResult evaluate(const CacheConfig& config) const {
    return evaluate(std::vector<CacheConfig>(model_.config().layers, config));
  }

  /// One configuration per layer.
  GenerationResult evaluate(const std::vector<CacheConfig>& configs) const {
    GenerationResult r;
    r.runs = prompts_.size();
    r.steps = steps_;
    double identical = 0, whole = 0, agree = 0, kl = 0;
    for (std::size_t i = 0; i < prompts_.size(); ++i) {
      const Run ours = run(prompts_[i], &configs);
      const std::vector<int>& ref = reference_[i];
      const auto first_difference = std::mismatch(ours.continuation.begin(), ours.continuation.end(), ref.begin());
      identical += double(first_difference.first - ours.continuation.begin());
      whole += first_difference.first == ours.continuation.end() ? 1 : 0;
      for (std::size_t t = 0; t < steps_; ++t) agree += ours.continuation[t] == ref[t] ? 1 : 0;
      kl += ours.kl;
    }
    r.mean_identical = identical / double(r.runs);
    r.identical_share = whole / double(r.runs);
    r.token_agreement = agree / double(r.runs * steps_);
    r.mean_kl = kl / double(r.runs * steps_);
    return r;
  }

 private:
  struct Run {
    std::vector<int> continuation;
    double kl = 0;  // summed over steps
  };

  // Greedy continuation from a cache of `configs` (the fp32 backend when null), with an fp32 run
  // fed the same tokens alongside for the KL.
  Run run(const std::vector<int>& prompt, const std::vector<CacheConfig>* configs) const {
    const std::size_t positions = prompt.size() + steps_, vocab = model_.config().vocab;
    llama::FullPrecisionBackend exact(model_, positions);
    std::optional<CacheBackend> quantized;
    if (configs != nullptr) quantized.emplace(model_, *configs, positions, attention_);
    std::vector<float> logits(vocab), exact_logits(vocab), lp(vocab), exact_lp(vocab);
    std::vector<int> tokens = prompt;
    Run r;
    std::size_t pos = 0;
    if (prefill_chunk_ > 0) {
      pos = prompt.size() - 1;
      const std::span<const int> head(prompt.data(), pos);
      (void)llama::prefill_logits(model_, exact, head, prefill_chunk_);
      if (quantized) (void)llama::prefill_logits(model_, *quantized, head, prefill_chunk_);
    }
    for (; pos + 1 < positions; ++pos) {
      model_.forward(tokens[pos], pos, exact, exact_logits);
      if (quantized) model_.forward(tokens[pos], pos, *quantized, logits);
      if (pos + 1 < prompt.size()) continue;
      const std::vector<float>& chosen = quantized ? logits : exact_logits;
      tokens.push_back(llama::argmax(chosen));
      if (!quantized) continue;
      llama::log_softmax(logits, lp);
      llama::log_softmax(exact_logits, exact_lp);
      double d = 0;
      for (std::size_t v = 0; v < vocab; ++v) d += std::exp(double(exact_lp[v])) * (double(exact_lp[v]) - lp[v]);
      r.kl += std::max(d, 0.0);
    }
    r.continuation.assign(tokens.begin() + static_cast<std::ptrdiff_t>(prompt.size()), tokens.end());
    return r;
  }

  const llama::Model& model_;
  std::size_t steps_;
  AttentionFn attention_;
  std::size_t prefill_chunk_;
  std::vector<std::vector<int>> prompts_, reference_;
};

}  // namespace kvq::eval
