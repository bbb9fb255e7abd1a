#pragma once
// The merge loop both BPE tokenizers share: repeatedly replace the best adjacent pair of symbols
// by its merge. Rescanning every pair per merge is quadratic (a 320 KB story without separators
// took 104 s); here a heap of candidate pairs, best first and leftmost on ties, runs over a linked
// list of symbols, and a candidate whose sides changed since it was pushed is stale and skipped.

#include <algorithm>
#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

namespace kvq::llama {

/// `find(left, right)` returns the merged symbol and its priority (lower merges first), or
/// nothing when the pair does not merge.
template <class Symbol, class Find>
void merge_adjacent_pairs(std::vector<Symbol>& symbols, Find&& find) {
  const std::size_t n = symbols.size();
  if (n < 2) return;
  std::vector<std::size_t> prev(n), next(n);  // neighbours; n means none
  for (std::size_t i = 0; i < n; ++i) prev[i] = i == 0 ? n : i - 1, next[i] = i + 1;
  struct Candidate {
    double priority;
    std::size_t left, right;
    Symbol left_symbol, right_symbol, merged;
  };
  const auto later = [](const Candidate& a, const Candidate& b) {  // heap order: best on top
    return a.priority != b.priority ? a.priority > b.priority : a.left > b.left;
  };
  std::vector<Candidate> heap;
  const auto push = [&](std::size_t left, std::size_t right) {
    std::optional<std::pair<double, Symbol>> m = find(symbols[left], symbols[right]);
    if (!m) return;
    heap.push_back({m->first, left, right, symbols[left], symbols[right], std::move(m->second)});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (std::size_t i = 0; i + 1 < n; ++i) push(i, i + 1);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    Candidate c = std::move(heap.back());
    heap.pop_back();
    if (next[c.left] != c.right || symbols[c.left] != c.left_symbol || symbols[c.right] != c.right_symbol) continue;
    symbols[c.left] = std::move(c.merged);
    next[c.left] = next[c.right];
    next[c.right] = n;  // merged away: any candidate starting there is now stale
    if (next[c.left] < n) prev[next[c.left]] = c.left;
    if (prev[c.left] < n) push(prev[c.left], c.left);
    if (next[c.left] < n) push(c.left, next[c.left]);
  }
  std::vector<Symbol> merged;
  for (std::size_t i = 0; i < n; i = next[i]) merged.push_back(std::move(symbols[i]));
  symbols = std::move(merged);
}

}  // namespace kvq::llama
