// Host cost of the sampler's per-step rows (runtime/sampler.h) for penalised requests: the
// recount from the whole context, the incremental PenaltyCounts the engine keeps for a sequence
// without a penalty slot, and the rows of sequences whose counts a penalty slot keeps. This
// runs on the engine thread before every Backend::sample, so it is host time on the step's
// critical path. Run: build/bench/host/moelora_bench_sample_rows (Google Benchmark flags apply).
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "runtime/sampler.h"

namespace moelora {
namespace {

constexpr int kVocab = 151936;  // Qwen3

struct Rows {
  SamplingParams p;
  std::vector<std::vector<int32_t>> tokens;
  std::vector<PenaltyCounts> counts;
  int prompt = 0;
  Rows(int rows, int prompt_len) : tokens(rows), counts(rows), prompt(prompt_len) {
    p.repetition_penalty = 1.1f;
    p.frequency_penalty = 0.2f;
    std::mt19937 g(1);
    for (auto& t : tokens) {
      t.resize(prompt_len);
      for (auto& v : t) v = std::uniform_int_distribution<int>(0, kVocab - 1)(g);
    }
    for (int r = 0; r < rows; ++r) counts[r].sync(p, tokens[r], prompt);  // the prompt, once
  }
};

// One step = one row per sequence; each step appends one token to every sequence.
void BM_RecountEveryStep(benchmark::State& st) {
  Rows rows(static_cast<int>(st.range(0)), static_cast<int>(st.range(1)));
  size_t edits = 0;
  for (auto _ : st) {
    for (auto& t : rows.tokens) edits += make_sample_row(rows.p, 1, t, rows.prompt, {0}, kVocab).edits.size();
    st.PauseTiming();
    for (auto& t : rows.tokens) t.push_back(static_cast<int32_t>(edits % kVocab));
    st.ResumeTiming();
  }
  st.counters["edits_per_step"] = static_cast<double>(edits) / static_cast<double>(st.iterations());
}

void BM_IncrementalCounts(benchmark::State& st) {
  Rows rows(static_cast<int>(st.range(0)), static_cast<int>(st.range(1)));
  size_t edits = 0;
  for (auto _ : st) {
    for (size_t r = 0; r < rows.tokens.size(); ++r) {
      rows.counts[r].sync(rows.p, rows.tokens[r], rows.prompt);
      edits += make_sample_row(rows.p, 1, rows.tokens[r], rows.prompt, {0}, kVocab, rows.counts[r]).edits.size();
    }
    st.PauseTiming();
    for (auto& t : rows.tokens) t.push_back(static_cast<int32_t>(edits % kVocab));
    st.ResumeTiming();
  }
  st.counters["edits_per_step"] = static_cast<double>(edits) / static_cast<double>(st.iterations());
}

// Rows of sequences whose counts the backend keeps in penalty slots (ops/sampling.h): only the
// per-step edits are built on the host (none here), whatever the context.
void BM_PenaltySlotRows(benchmark::State& st) {
  Rows rows(static_cast<int>(st.range(0)), static_cast<int>(st.range(1)));
  size_t edits = 0;
  for (auto _ : st) {
    for (size_t r = 0; r < rows.tokens.size(); ++r)
      edits += make_slot_sample_row(rows.p, 1, rows.tokens[r], rows.prompt, {0}, kVocab, static_cast<int>(r)).edits.size();
    st.PauseTiming();
    for (auto& t : rows.tokens) t.push_back(static_cast<int32_t>(edits % kVocab));
    st.ResumeTiming();
  }
  st.counters["edits_per_step"] = static_cast<double>(edits) / static_cast<double>(st.iterations());
}

BENCHMARK(BM_RecountEveryStep)->Args({256, 4096})->Args({64, 512})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_IncrementalCounts)->Args({256, 4096})->Args({64, 512})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PenaltySlotRows)->Args({256, 4096})->Args({64, 512})->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace moelora

BENCHMARK_MAIN();
