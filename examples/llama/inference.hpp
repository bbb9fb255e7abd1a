#pragma once
// Drivers over Model::forward and Model::forward_chunk: greedy decoding, and teacher forcing
// (token by token or in prompt chunks) that keeps every position's log-probabilities so an
// evaluator can compute perplexity, KL divergence and top-1 agreement.

#include <algorithm>
#include <cmath>
#include <string>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "kvq/error.hpp"
#include "llama/model.hpp"

namespace kvq::llama {

/// Index of the largest logit (the first one on ties, as llama2.c's argmax).
inline int argmax(std::span<const float> logits) {
  std::size_t best = 0;
  for (std::size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<int>(best);
}

/// log-softmax computed in double, so that differences between nearby distributions are not
/// rounding noise; returns log(sum(exp(logits))).
inline double log_softmax(std::span<const float> logits, std::span<float> out) {
  double max = logits.empty() ? 0.0 : logits[0];
  for (const float l : logits) max = std::max(max, double{l});
  double sum = 0.0;
  for (const float l : logits) sum += std::exp(double{l} - max);
  const double log_sum = max + std::log(sum);
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<float>(double{logits[i]} - log_sum);
  return log_sum;
}

/// The next-token logits of every position of `tokens` (tokens x vocab), fed from position 0 into
/// an empty backend: one token at a time through Model::forward when `chunk` is 0, else in chunks
/// of `chunk` tokens through Model::forward_chunk (a chunk attends to its own keys and values
/// exactly, before the backend stores them).
template <KVBackend Backend>
std::vector<float> prefill_logits(const Model& model, Backend& kv, std::span<const int> tokens, std::size_t chunk = 0) {
  const std::size_t vocab = model.config().vocab;
  std::vector<float> logits(tokens.size() * vocab);
  if (chunk == 0) {
    for (std::size_t pos = 0; pos < tokens.size(); ++pos)
      model.forward(tokens[pos], pos, kv, std::span<float>(logits).subspan(pos * vocab, vocab));
    return logits;
  }
  if constexpr (ChunkedKVBackend<Backend>) {
    for (std::size_t pos = 0; pos < tokens.size(); pos += chunk) {
      const std::size_t n = std::min(chunk, tokens.size() - pos);
      model.forward_chunk(tokens.subspan(pos, n), pos, kv, std::span<float>(logits).subspan(pos * vocab, n * vocab));
    }
    return logits;
  } else {
    throw Error(ErrorCode::unsupported,
                "this KV backend takes one token at a time, not chunks of " + std::to_string(chunk));
  }
}

/// Feed `prompt` (BOS alone when empty), then append greedy tokens until `n_steps` positions have
/// run or `stop_token` is produced. Returns prompt followed by the generated tokens; with the
/// default prompt that is n_steps + 1 tokens, as llama2.c's `-n n_steps` prints them. With
/// `prompt_chunk` > 0 the prompt but its last token is fed in chunks (prefill_logits), then
/// decoding goes on one token at a time.
template <KVBackend Backend>
std::vector<int> greedy_generate(const Model& model, Backend& kv, std::size_t n_steps, std::span<const int> prompt = {},
                                 int stop_token = -1, std::size_t prompt_chunk = 0) {
  std::vector<int> tokens(prompt.begin(), prompt.end());
  if (tokens.empty()) tokens.push_back(model.config().bos);
  std::vector<float> logits(model.config().vocab);
  std::size_t pos = 0;
  if (prompt_chunk > 0 && tokens.size() > 1) {
    pos = std::min(n_steps, tokens.size() - 1);
    (void)prefill_logits(model, kv, std::span<const int>(tokens).first(pos), prompt_chunk);
  }
  for (; pos < n_steps && pos < tokens.size(); ++pos) {
    model.forward(tokens[pos], pos, kv, logits);
    if (pos + 1 < tokens.size()) continue;  // still inside the prompt
    tokens.push_back(argmax(logits));
    if (tokens.back() == stop_token) break;
  }
  return tokens;
}

/// Per-position output of teacher forcing over one sequence.
struct TeacherForced {
  std::size_t vocab = 0;
  std::vector<float> log_probs;  // (tokens, vocab): log-softmax after feeding tokens[0..i]
  std::vector<double> nll;       // nll[i] = -log p(tokens[i+1] | tokens[0..i]), tokens - 1 entries

  std::span<const float> row(std::size_t position) const {
    return std::span<const float>(log_probs).subspan(position * vocab, vocab);
  }
  double total_nll() const {
    double s = 0.0;
    for (const double x : nll) s += x;
    return s;
  }
  double mean_nll() const { return nll.empty() ? 0.0 : total_nll() / static_cast<double>(nll.size()); }
  double perplexity() const { return std::exp(mean_nll()); }
};

/// Run `tokens` through the model with a fresh backend from `make_backend()` (called once), one
/// token at a time or in chunks of `chunk` tokens (see prefill_logits).
template <class MakeBackend>
requires KVBackend<std::invoke_result_t<MakeBackend&>> TeacherForced teacher_forced(const Model& model,
                                                                                    MakeBackend&& make_backend,
                                                                                    std::span<const int> tokens,
                                                                                    std::size_t chunk = 0) {
  for (const int t : tokens)
    if (t < 0 || static_cast<std::size_t>(t) >= model.config().vocab)
      throw Error(ErrorCode::invalid_argument, "token " + std::to_string(t) + " is outside the vocabulary");
  auto kv = make_backend();
  TeacherForced r;
  r.vocab = model.config().vocab;
  r.log_probs.resize(tokens.size() * r.vocab);
  r.nll.reserve(tokens.empty() ? 0 : tokens.size() - 1);
  const std::vector<float> logits = prefill_logits(model, kv, tokens, chunk);
  for (std::size_t pos = 0; pos < tokens.size(); ++pos) {
    const std::span<const float> these(logits.data() + pos * r.vocab, r.vocab);
    const double log_sum = log_softmax(these, std::span<float>(r.log_probs.data() + pos * r.vocab, r.vocab));
    if (pos + 1 < tokens.size()) r.nll.push_back(log_sum - double{these[static_cast<std::size_t>(tokens[pos + 1])]});
  }
  return r;
}

}  // namespace kvq::llama
