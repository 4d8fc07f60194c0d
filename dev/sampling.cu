// Workbench: the device sampler (src/backends/cuda/kernels/sampling.cu) on Qwen3's vocabulary
// (151,936), rows 1..256, each thread-block cluster size (2, 4, 8, 16 blocks per row) and the size
// cuda_plan::choose_sample_cluster picks. The engine's bench setting: temperature 0.8, top-p 0.9,
// a seed per row, no logprobs; a second setting adds top-k 50 and 5 top logprobs.
// Two kinds of logits: "peaked" (normal sd 2 plus a few strong tokens, like a trained model) and
// "flat" (normal sd 0.3, like a random-weight model: top-p then keeps most of the vocabulary).
// Checks, for every row count before anything is timed: every cluster size gives the same bytes as 8
// (the kernel's contract), and up to 64 rows the tokens and top-logprob ids are the CPU reference
// sampler's (cpu::sample; logprobs within 1e-4). Timed under graph replay, logits rotated past L2,
// median of 20.
// `dev_sampling profile ROWS CLUSTER [flat] [full]`: three launches of one setting and nothing else,
// for ncu (--launch-skip 2 --launch-count 1); `full` adds top-k 50 and 5 logprobs.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/kernels/sampling.cuh"
#include "backends/cuda_plan/sample_choices.h"
#include "gpukit/device_array.h"
#include "gpukit/random.h"
#include "gpukit/timing.h"

using namespace moelora;
using namespace moelora::cuda;
using namespace moelora::gpukit;

namespace {

constexpr int kVocab = 151936;

std::vector<float> make_logits(FastRng& rng, int rows, bool flat) {
  std::vector<float> x(static_cast<size_t>(rows) * kVocab);
  for (int r = 0; r < rows; ++r) {
    float* row = x.data() + static_cast<size_t>(r) * kVocab;
    for (int i = 0; i < kVocab; ++i) row[i] = rng.normal(flat ? 0.3f : 2.0f);
    if (!flat)
      for (int j = 0; j < 8; ++j) row[rng.next() % kVocab] += 4.0f + static_cast<float>(rng.next() % 8);
  }
  return x;
}

std::vector<DeviceSampleRow> make_rows(int rows, int top_k, int logprobs) {
  std::vector<DeviceSampleRow> p(rows);
  for (int r = 0; r < rows; ++r) {
    p[r] = DeviceSampleRow{};
    p[r].temperature = 0.8f, p[r].top_p = 0.9f, p[r].top_k = top_k, p[r].repetition = 1.0f;
    p[r].logprobs = logprobs, p[r].seed = 1000 + r, p[r].step = 7, p[r].processed = -1;
  }
  return p;
}

// The reference's view of the same rows (no edits).
std::vector<SampleRow> host_rows(const std::vector<DeviceSampleRow>& d) {
  std::vector<SampleRow> rows(d.size());
  for (size_t r = 0; r < d.size(); ++r) {
    rows[r].temperature = d[r].temperature, rows[r].top_k = d[r].top_k, rows[r].top_p = d[r].top_p;
    rows[r].min_p = d[r].min_p, rows[r].seed = d[r].seed, rows[r].step = d[r].step, rows[r].logprobs = d[r].logprobs;
  }
  return rows;
}

// Rows whose token, top-logprob ids or logprobs (1e-4) differ from the CPU reference.
int reference_mismatches(const std::vector<float>& x, int rows, const std::vector<DeviceSampleRow>& params,
                         const std::vector<uint8_t>& got_bytes) {
  const std::vector<SampleOutput> want = cpu::sample(x.data(), kVocab, kVocab, host_rows(params));
  const auto* got = reinterpret_cast<const DeviceSampleResult*>(got_bytes.data());
  int bad = 0;
  for (int r = 0; r < rows; ++r) {
    bool ok = got[r].token == want[r].token && std::fabs(got[r].logprob - want[r].logprob) <= 1e-4f;
    for (size_t j = 0; j < want[r].top_logprobs.size(); ++j)
      ok = ok && got[r].top_ids[j] == want[r].top_logprobs[j].first &&
           std::fabs(got[r].top_logprobs[j] - want[r].top_logprobs[j].second) <= 1e-4f;
    bad += !ok;
  }
  return bad;
}

std::vector<uint8_t> run_once(const SampleParams& base, int cluster) {
  DeviceArray<DeviceSampleResult> out(base.rows);
  out.poison(0);
  SampleParams p = base;
  p.out = out.get(), p.cluster = cluster;
  launch_sample(p, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const auto res = out.download();
  const auto* b = reinterpret_cast<const uint8_t*>(res.data());
  return std::vector<uint8_t>(b, b + res.size() * sizeof(DeviceSampleResult));
}

// Three launches of one configuration, for a profiler.
int profile(int rows, int cluster, bool flat, bool full) {
  FastRng rng(42);
  const std::vector<float> x = make_logits(rng, rows, flat);
  DeviceArray<float> dx(x);
  const std::vector<DeviceSampleRow> params = make_rows(rows, full ? 50 : 0, full ? 5 : 0);
  DeviceArray<DeviceSampleRow> dp(params);
  SampleParams base;
  base.ld = kVocab, base.rows = rows, base.vocab = kVocab, base.params = dp.get(), base.logits = dx.get();
  for (int i = 0; i < 3; ++i) run_once(base, cluster);
  std::printf("profiled %d rows, cluster %d, %s logits%s\n", rows, cluster, flat ? "flat" : "peaked",
              full ? ", top-k 50, 5 logprobs" : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 4 && std::strcmp(argv[1], "profile") == 0) {
    bool flat = false, full = false;
    for (int a = 4; a < argc; ++a) flat |= std::strcmp(argv[a], "flat") == 0, full |= std::strcmp(argv[a], "full") == 0;
    return profile(std::atoi(argv[2]), std::atoi(argv[3]), flat, full);
  }
  print_ceilings("sampling");
  const std::array<int, 5> active = sample_max_active_clusters();
  std::printf("resident clusters of 2/4/8/16 blocks: %d %d %d %d\n", active[1], active[2], active[3], active[4]);
  FastRng rng(42);
  bool all_ok = true;
  for (bool flat : {false, true}) {
    for (int setting = 0; setting < 2; ++setting) {
      const int top_k = setting ? 50 : 0, logprobs = setting ? 5 : 0;
      std::printf("\n%s logits, temperature 0.8 top-p 0.9%s; us per call (graph replay):\n", flat ? "flat" : "peaked",
                  setting ? " top-k 50, 5 logprobs" : "");
      std::printf("%5s %9s %9s %9s %9s %7s %9s\n", "rows", "C=2", "C=4", "C=8", "C=16", "chosen", "chosen_us");
      for (int rows : {1, 8, 32, 64, 128, 256}) {
        const std::vector<float> x = make_logits(rng, rows, flat);
        const size_t bytes = x.size() * sizeof(float);
        const int copies = rotation_copies(bytes);
        std::vector<DeviceArray<float>> dx;
        for (int c = 0; c < copies; ++c) dx.emplace_back(x);
        const std::vector<DeviceSampleRow> params = make_rows(rows, top_k, logprobs);
        DeviceArray<DeviceSampleRow> dp(params);
        DeviceArray<DeviceSampleResult> out(rows);
        SampleParams base;
        base.ld = kVocab, base.rows = rows, base.vocab = kVocab, base.params = dp.get();
        base.logits = dx[0].get();
        // Every check before any timing.
        const std::vector<uint8_t> want = run_once(base, 8);
        for (int ci = 0; ci < 4; ++ci) {
          const int c = 2 << ci;
          if (active[ci + 1] == 0 || c == 8) continue;  // a size this GPU cannot run; the baseline
          if (run_once(base, c) != want) {
            std::printf("CHECK FAILED: rows %d cluster %d differs from cluster 8\n", rows, c);
            all_ok = false;
          }
        }
        if (rows <= 64) {
          const int bad = reference_mismatches(x, rows, params, want);
          if (bad) {
            std::printf("CHECK FAILED: rows %d: %d rows differ from the CPU reference\n", rows, bad);
            all_ok = false;
          }
        }
        double us[4] = {0, 0, 0, 0};
        for (int ci = 0; ci < 4; ++ci) {
          const int c = 2 << ci;
          if (active[ci + 1] == 0) continue;  // a size this GPU cannot run
          us[ci] = time_graph_us(
              [&](cudaStream_t s, int copy) {
                SampleParams p = base;
                p.logits = dx[copy].get(), p.out = out.get(), p.cluster = c;
                launch_sample(p, s);
              },
              copies);
        }
        const int chosen = cuda_plan::choose_sample_cluster(rows, active);
        int ci = 0;
        while ((2 << ci) != chosen) ++ci;
        std::printf("%5d %9.1f %9.1f %9.1f %9.1f %7d %9.1f\n", rows, us[0], us[1], us[2], us[3], chosen, us[ci]);
      }
    }
  }
  std::printf("\ncheck: %s\n", all_ok ? "every cluster size gave the same bytes; rows <= 64 match the CPU reference"
                                       : "FAILED");
  return all_ok ? 0 : 1;
}
