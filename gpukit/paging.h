// Page tables of a paged KV cache for tests and workbenches: sequences that need need[s] pages
// each, drawn in order from a shuffled pool of sum(need) + spare pages, so that no sequence's
// pages are contiguous or in order (as a serving cache fragments).
#pragma once

#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace moelora::gpukit {

struct PagedSequences {
  int num_pages = 0;
  std::vector<std::vector<int32_t>> pages;  // per sequence
  std::vector<int32_t> indptr{0}, indices;  // the same in CSR form (attention.cuh's page tables)
};

// Pages for a sequence holding `positions` positions.
inline int pages_for(int positions, int page_size) { return (positions + page_size - 1) / page_size; }

// R: Rng or FastRng (gpukit/random.h); one integer(0, i) draw per pool entry, last to first.
template <class R>
PagedSequences shuffled_pages(R& rng, const std::vector<int>& need, int spare) {
  PagedSequences p;
  p.num_pages = std::accumulate(need.begin(), need.end(), 0) + spare;
  std::vector<int32_t> pool(p.num_pages);
  std::iota(pool.begin(), pool.end(), 0);
  for (int i = p.num_pages - 1; i > 0; --i) std::swap(pool[i], pool[rng.integer(0, i)]);
  p.pages.resize(need.size());
  for (size_t s = 0, next = 0; s < need.size(); ++s) {
    for (int i = 0; i < need[s]; ++i) p.pages[s].push_back(pool[next++]);
    p.indices.insert(p.indices.end(), p.pages[s].begin(), p.pages[s].end());
    p.indptr.push_back(static_cast<int32_t>(p.indices.size()));
  }
  return p;
}

}  // namespace moelora::gpukit
