// The MoE workbench's LoRA modes (dev/moe_bench.cu runs them): `dev_moe_bench lora`, the LoRA
// expands inside the base kernels against their own kernels, and `dev_moe_bench direct`, the LoRA
// kernels per routed pair against moe_align's (slot, expert) groups.
#include <cstdio>
#include <initializer_list>
#include <vector>

#include "dev/moe_bench.h"
#include "gpukit/timing.h"

namespace moelora::dev_moe_bench {

// Each of `forms` against `ref` at T = 1, 3, 8, 64, 256 with 1 and 8 adapters: the output bit for
// bit, and with 8 adapters up to 64 tokens the CPU reference (it is slow beyond; 1 adapter is a
// subset). Prints one line per check and the verdict; true when every check passed.
bool check_same_bits(Bench& b, const Version& ref_version, const char* ref_name,
                     std::initializer_list<std::pair<const Version*, const char*>> forms) {
  bool ok = true;
  for (int T : {1, 3, 8, 64, 256})
    for (int adapters : {1, 8}) {
      b.launch(nullptr, 0, T, ref_version, adapters);
      MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
      const auto ref = b.out_of(0, T);
      const bool cpu_checked = T <= 64 && adapters == 8;
      for (const auto& [v, name] : forms) {
        b.launch(nullptr, 0, T, *v, adapters);
        MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
        const auto out = b.out_of(0, T);
        size_t diff = 0;
        for (size_t i = 0; i < out.size(); ++i) diff += out[i] != ref[i];
        const double vs_cpu = cpu_checked ? worst_vs_cpu(b, T, adapters, out) : 0.0;
        const bool pass = diff == 0 && vs_cpu <= 1e-2;
        ok &= pass;
        char cpu[32] = "not checked";
        if (cpu_checked) std::snprintf(cpu, sizeof cpu, "%.2e", vs_cpu);
        std::printf("check %s, %d adapters, T=%3d: %zu elements differ from the %s; vs CPU %s %s\n", name, adapters, T,
                    diff, ref_name, cpu, pass ? "ok" : "FAIL");
      }
    }
  std::printf("checks %s\n", ok ? "passed" : "FAILED");
  return ok;
}

// `dev_moe_bench lora`: the LoRA expands inside the base kernels (the gate_up half in the GEMM
// epilogue, MoeTuning::lora_in_gemm; the down half inside moe_reduce, lora_down_in_reduce) against
// their own kernels on the side stream: bit for bit at every T with the tile the heuristic picks,
// the CPU reference with 8 adapters up to 64 tokens, then timed at every batch with 1 and 8
// adapters (and with every LoRA kernel on the main stream).
bool lora_mode(Bench& b, int ncopies, double bw) {
  Version in_gemm = kV2, separate = kV2;
  in_gemm.lora_gemm = 1;
  in_gemm.lora_reduce = 0;
  separate.lora_gemm = 0;
  separate.lora_reduce = 0;
  Version both_in = in_gemm;  // gate_up expand in the GEMM, down expand in moe_reduce
  both_in.lora_reduce = 1;
  Version in_gemm_1s = in_gemm, both_in_1s = both_in;  // every LoRA kernel on the main stream: no event joins
  in_gemm_1s.one_stream = both_in_1s.one_stream = true;
  const bool ok = check_same_bits(b, separate, "expand kernels'",
                                  {{&in_gemm, "gate_up in gemm"}, {&both_in, "gate_up in gemm + down in reduce"}});
  std::printf("\nMoE LoRA r=%d, graph replay, %d copies, median of 30, us (copy bandwidth %.0f GB/s); columns: both expand "
              "kernels | gate_up in the GEMM | + down in moe_reduce, each with 1 and 8 adapters; then 8 adapters on one "
              "stream\n   T |   base | 1 ad: kernels | in gemm | + reduce | 8 ad: kernels | in gemm | + reduce | "
              "1 stream: in gemm | + reduce\n", kRank, ncopies, bw);
  for (int T : kTokens) {
    auto timed = [&](const Version& v, int adapters) {
      return time_graph_us([&](cudaStream_t st, int c) { b.launch(st, c, T, v, adapters); }, ncopies, 30);
    };
    const double base = timed(kV2, 0);
    const double t[8] = {timed(separate, 1), timed(in_gemm, 1), timed(both_in, 1), timed(separate, 8),
                         timed(in_gemm, 8), timed(both_in, 8), timed(in_gemm_1s, 8), timed(both_in_1s, 8)};
    std::printf("%4d | %6.1f", T, base);
    for (double x : t) std::printf(" | %6.1f (+%4.1f%%)", x, 100.0 * (x / base - 1.0));
    std::printf("\n");
  }
  return ok;
}

// `dev_moe_bench direct`: the LoRA kernels on one item per routed pair (MoeTuning::lora_direct)
// against moe_align's (slot, expert) groups: bit for bit at every T with 1 and 8 adapters (the CPU
// reference with 8 adapters up to 64 tokens), then timed with 1 and 8 adapters: both item forms,
// each with the down expand in its own kernel or inside moe_reduce, and the heuristic's default.
bool direct_mode(Bench& b, int ncopies, double bw) {
  Version grouped = kV2, direct = kV2;
  grouped.lora_direct = 0;
  direct.lora_direct = 1;
  grouped.lora_reduce = direct.lora_reduce = 0;  // the down expand in its own kernel unless named
  Version grouped_max = grouped, direct_fused = direct, direct_reduce = direct;
  grouped_max.max_workspace = true;
  direct_fused.lora_fused = true;  // the down half's shrink + expand in one launch (gate_up stays as chosen)
  direct_reduce.lora_reduce = 1;
  const bool ok = check_same_bits(b, grouped, "grouped kernels'",
                                  {{&direct, "per pair"}, {&direct_fused, "per pair + fused down"},
                                   {&direct_reduce, "per pair + down in reduce"}});
  // Every (items, down expand) combination with 1 and 8 adapters, then the heuristic's choice
  // (kV2: choose_moe_tuning) for each; grouped on the 256-token workspace is this workbench before
  // 2026-12-06 and is timed with 8 adapters only.
  Version grouped_reduce = grouped;
  grouped_reduce.lora_reduce = 1;
  std::printf("\nMoE LoRA r=%d items, graph replay, %d copies, median of 30, us (copy bandwidth %.0f GB/s); "
              "reduce = the down expand inside moe_reduce, default = choose_moe_tuning's\n   T |   base | 1 ad: "
              "grouped | grouped+reduce | per pair | per pair+reduce | default | 8 ad: grouped256 | grouped | "
              "grouped+reduce | per pair | per pair+reduce | per pair+fused down | default\n",
              kRank, ncopies, bw);
  for (int T : kTokens) {
    auto timed = [&](const Version& v, int adapters) {
      return time_graph_us([&](cudaStream_t st, int c) { b.launch(st, c, T, v, adapters); }, ncopies, 30);
    };
    const double base = timed(kV2, 0);
    const double t[12] = {timed(grouped, 1),         timed(grouped_reduce, 1), timed(direct, 1),
                          timed(direct_reduce, 1),   timed(kV2, 1),            timed(grouped_max, 8),
                          timed(grouped, 8),         timed(grouped_reduce, 8), timed(direct, 8),
                          timed(direct_reduce, 8),   timed(direct_fused, 8),   timed(kV2, 8)};
    std::printf("%4d | %6.1f", T, base);
    for (double x : t) std::printf(" | %6.1f (+%4.1f%%)", x, 100.0 * (x / base - 1.0));
    std::printf("\n");
  }
  return ok;
}

// `dev_moe_bench beside`: the LoRA shrinks beside the grouped GEMMs (MoeTuning::lora_shrink_beside_gemm:
// every LoRA kernel on the main stream, each GEMM waiting for its half's LoRA kernels only before
// its epilogue) against the placement before it (gate_up shrink before the GEMM, the down half on
// the side stream) and against that placement on one stream: bit for bit at every T with 1 and 8
// adapters (and the CPU reference with 8 adapters up to 64 tokens), then timed, with
// choose_moe_tuning's default (beside up to half a pair per expert since 2026-12-07).
bool beside_mode(Bench& b, int ncopies, double bw) {
  Version before = kV2, beside = kV2, one_stream = kV2;
  before.lora_beside = one_stream.lora_beside = 0;
  beside.lora_beside = 1;
  one_stream.one_stream = true;
  const bool ok = check_same_bits(b, before, "placement before the GEMMs'", {{&beside, "beside"}});
  std::printf("\nMoE LoRA r=%d placement, graph replay, %d copies, median of 30, us (copy bandwidth %.0f GB/s); "
              "before = gate_up shrink before its GEMM, down LoRA on the side stream; 1 stream = the same on the main "
              "stream; beside = the shrinks beside the GEMMs; default = choose_moe_tuning's\n   T |   base | 1 ad: "
              "before | beside | 8 ad: before | 1 stream | beside | default\n",
              kRank, ncopies, bw);
  for (int T : kTokens) {
    auto timed = [&](const Version& v, int adapters) {
      return time_graph_us([&](cudaStream_t st, int c) { b.launch(st, c, T, v, adapters); }, ncopies, 30);
    };
    const double base = timed(kV2, 0);
    const double t[6] = {timed(before, 1),     timed(beside, 1), timed(before, 8),
                         timed(one_stream, 8), timed(beside, 8), timed(kV2, 8)};
    std::printf("%4d | %6.1f", T, base);
    for (double x : t) std::printf(" | %6.1f (+%4.1f%%)", x, 100.0 * (x / base - 1.0));
    std::printf("\n");
  }
  return ok;
}

}  // namespace moelora::dev_moe_bench
