// Workbench: multi-adapter dense LoRA (src/backends/cuda/kernels/lora_dense.*) on Qwen3-30B-A3B
// shapes: q,k,v in one launch (in 2048 -> 4096, 512, 512) and o_proj (4096 -> 2048), tokens
// 1..256, adapters 1..64 (token t on adapter t % N), ranks 16 and 64.
// Versions: v1 the fused segmented kernel, all projections in one launch; v2 the same kernel one
// launch per projection; v3 the single-adapter cuBLAS path (N = 1 only). Checked against
// cpu::lora_add, timed under graph replay with the adapter pool rotated past L2.
// Floor = (A and B of the adapters used + x + y read and written) / copy ceiling.
// Target (issue): <= 3 us per projection, or <= 1.4x the floor where that is larger.
#include <cstdio>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/kernels/lora_dense.cuh"
#include "core/tensor.h"
#include "gpukit/dense.h"
#include "gpukit/device_array.h"
#include "gpukit/numeric.h"
#include "gpukit/random.h"
#include "gpukit/timing.h"

using namespace moelora;
using namespace moelora::cuda;
using namespace moelora::gpukit;

namespace {

struct ProjShape {
  int in, out;
};

// One rotation copy of the adapter pool of one projection: N slots of rank r.
struct Pool {
  std::vector<std::vector<float>> a, b;  // copy 0 only: host values per slot
  DeviceArray<uint16_t> da, db;          // the N slots' A and B, back to back
  DeviceArray<int64_t> a_ptrs, b_ptrs;
  DeviceArray<int32_t> ranks;
};

Pool make_pool(FastRng& rng, int N, int r, const ProjShape& ps) {
  Pool p;
  std::vector<uint16_t> A, B;
  const size_t sa = size_t(r) * ps.in, sb = size_t(ps.out) * r;
  for (int s = 0; s < N; ++s) {
    std::vector<float> av, bv;
    auto a = random_bf16(rng, sa, 1.0f / std::sqrt(float(ps.in)), &av);
    auto b = random_bf16(rng, sb, 1.0f / std::sqrt(float(r)), &bv);
    A.insert(A.end(), a.begin(), a.end());
    B.insert(B.end(), b.begin(), b.end());
    p.a.push_back(av);
    p.b.push_back(bv);
  }
  p.da = DeviceArray<uint16_t>(A);
  p.db = DeviceArray<uint16_t>(B);
  return p;
}

// Pointer tables of a pool whose factors live at da / db.
void set_tables(Pool& p, int N, int r, const ProjShape& ps) {
  const size_t sa = size_t(r) * ps.in, sb = size_t(ps.out) * r;
  std::vector<int64_t> ap(N), bp(N);
  for (int s = 0; s < N; ++s) {
    ap[s] = reinterpret_cast<int64_t>(p.da.get() + s * sa);
    bp[s] = reinterpret_cast<int64_t>(p.db.get() + s * sb);
  }
  p.a_ptrs = DeviceArray<int64_t>(ap);
  p.b_ptrs = DeviceArray<int64_t>(bp);
  p.ranks = DeviceArray<int32_t>(std::vector<int32_t>(N, r));
}

// Rotation copy: same values at other addresses.
Pool clone_pool(const Pool& src, int N, int r, const ProjShape& ps) {
  Pool p;
  p.da = src.da.clone();
  p.db = src.db.clone();
  set_tables(p, N, r, ps);
  return p;
}

}  // namespace

int main() {
  const double copy = print_ceilings("lora_dense");
  FastRng rng(7);
  LoraContext ctx;
  const int kMaxT = 256;
  std::vector<float> xv;
  const DeviceArray<uint16_t> xbuf(random_bf16(rng, size_t(kMaxT) * 4096, 1.0f, &xv));
  auto* x = reinterpret_cast<__nv_bfloat16*>(xbuf.get());
  struct Set {
    const char* name;
    std::vector<ProjShape> proj;
  };
  const Set sets[] = {{"qkv", {{2048, 4096}, {2048, 512}, {2048, 512}}}, {"q", {{2048, 4096}}}, {"o", {{4096, 2048}}}};
  std::vector<DeviceArray<uint16_t>> ybuf;
  std::vector<__nv_bfloat16*> y;
  for (int p = 0; p < 3; ++p) {
    ybuf.emplace_back(size_t(kMaxT) * 4096);
    y.push_back(reinterpret_cast<__nv_bfloat16*>(ybuf.back().get()));
  }
  const DeviceArray<uint8_t> metabuf(lora_meta_bytes(4096, kMaxT));
  void* meta = metabuf.get();
  const size_t scratch_bytes = size_t(8) << 20;
  const DeviceArray<uint8_t> scratchbuf(scratch_bytes);
  void* scratch = scratchbuf.get();

  std::printf("\n%-4s %4s %3s %3s %-22s %9s %9s %7s %9s %s\n", "set", "T", "N", "r", "version", "us", "floor_us",
              "x_floor", "us/proj", "target");
  for (const Set& set : sets) {
    const int P = static_cast<int>(set.proj.size());
    for (int r : {16, 64}) {
      for (int T : {1, 8, 64, 256}) {
        for (int N : {1, 8, 64}) {
          if (N > T && !(N == 8 && T == 1)) continue;
          const int Nu = std::min(N, T);  // adapters actually used
          // Pools: rotation copies of every projection's adapters.
          double pool_bytes = 0;
          for (auto& ps : set.proj) pool_bytes += double(N) * r * (ps.in + ps.out) * 2;
          const int copies = rotation_copies(static_cast<size_t>(pool_bytes));
          std::vector<std::vector<Pool>> pools(copies);
          for (auto& cp : pools) cp.resize(P);
          std::vector<std::vector<int>> host_rank(P, std::vector<int>(N, r));
          for (int p = 0; p < P; ++p) {
            pools[0][p] = make_pool(rng, N, r, set.proj[p]);
            set_tables(pools[0][p], N, r, set.proj[p]);
            for (int c = 1; c < copies; ++c) pools[c][p] = clone_pool(pools[0][p], N, r, set.proj[p]);
          }
          auto problems = [&](int c) {
            std::vector<LoraProblem> v(P);
            for (int p = 0; p < P; ++p)
              v[p] = LoraProblem{x, set.proj[p].in, y[p], set.proj[p].out, set.proj[p].in, set.proj[p].out, N,
                                 pools[c][p].a_ptrs.get(), pools[c][p].b_ptrs.get(), pools[c][p].ranks.get(),
                                 host_rank[p].data()};
            return v;
          };
          std::vector<int32_t> slot(T);
          for (int t = 0; t < T; ++t) slot[t] = t % N;
          auto probs0 = problems(0);
          LoraPlanOptions seg_only;
          seg_only.single_adapter_gemm = false;
          const LoraPlan seg = lora_plan(slot.data(), T, probs0.data(), P, seg_only);
          LoraPlanOptions any_size;
          any_size.single_adapter_min_tokens = 1;
          const LoraPlan single = lora_plan(slot.data(), T, probs0.data(), P, any_size);
          lora_upload_plan(seg, meta, lora_meta_bytes(4096, kMaxT), nullptr);
          std::vector<LoraPlan> per_proj;
          for (int p = 0; p < P; ++p) per_proj.push_back(lora_plan(slot.data(), T, &probs0[p], 1, seg_only));
          // Check at one configuration per set and rank.
          if (T == 8 && (N == 8 || N == 1)) {
            for (int p = 0; p < P; ++p)
              MOELORA_CUDA_CHECK(cudaMemset(y[p], 0, size_t(T) * set.proj[p].out * 2));
            const LoraPlan& plan = N == 1 ? single : seg;
            lora_run(ctx, probs0.data(), P, plan, meta, {scratch, scratch_bytes}, nullptr);
            MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
            for (int p = 0; p < P; ++p) {
              const auto& ps = set.proj[p];
              std::vector<const float*> ah, bh;
              for (int s = 0; s < N; ++s) ah.push_back(pools[0][p].a[s].data()), bh.push_back(pools[0][p].b[s].data());
              const LoraModuleTable tab = host_lora_table(ps.in, ps.out, ah, bh, std::vector<int>(N, r));
              std::vector<float> xin(size_t(T) * ps.in), ref(size_t(T) * ps.out, 0.0f);
              for (int t = 0; t < T; ++t)
                for (int k = 0; k < ps.in; ++k) xin[t * ps.in + k] = xv[size_t(t) * ps.in + k];
              cpu::lora_add(xin.data(), ps.in, T, slot.data(), tab, ref.data(), ps.out);
              const auto got = from_bf16(ybuf[p].download(size_t(T) * ps.out));
              std::printf("# check %s r=%d T=%d N=%d proj %d (%s): max row rel err %.2e\n", set.name, r, T, N, p,
                          plan.single_adapter ? "cuBLAS single" : "segmented", max_row_rel(got, ref, T, ps.out));
            }
            lora_upload_plan(seg, meta, lora_meta_bytes(4096, kMaxT), nullptr);
          }
          double bytes = double(T) * set.proj[0].in * 2;
          for (auto& ps : set.proj) bytes += double(Nu) * r * (ps.in + ps.out) * 2 + 2.0 * T * ps.out * 2;
          const double floor_us = bytes / (copy * 1e9) * 1e6;
          auto report = [&](const char* version, double us) {
            const double per = us / P;
            const bool met = per <= 3.0 || us <= 1.4 * floor_us;
            std::printf("%-4s %4d %3d %3d %-22s %9.2f %9.2f %7.2f %9.2f %s\n", set.name, T, N, r, version, us, floor_us,
                        us / floor_us, per, met ? "met" : "MISSED");
          };
          report("v1 segmented fused", time_graph_us(
                                           [&](cudaStream_t s, int c) {
                                             auto pr = problems(c);
                                             launch_lora_segmented(pr.data(), P, seg.cluster, meta, seg.num_items, s);
                                           },
                                           copies));
          // Cluster sizes other than the plan's (the kernel takes any 1..8): how much the K split
          // and the cluster exchange cost or save at this batch.
          for (int cs : {1, 2, 4}) {
            if (cs == seg.cluster) continue;
            char name[32];
            std::snprintf(name, sizeof(name), "v1 fused, cluster %d", cs);
            report(name, time_graph_us(
                             [&](cudaStream_t s, int c) {
                               auto pr = problems(c);
                               launch_lora_segmented(pr.data(), P, cs, meta, seg.num_items, s);
                             },
                             copies));
          }
          if (P > 1) {
            // Per-projection launches need their own metadata: upload them side by side.
            std::vector<DeviceArray<uint8_t>> metas;
            for (int p = 0; p < P; ++p) {
              metas.emplace_back(lora_meta_bytes(per_proj[p].capacity, T));
              lora_upload_plan(per_proj[p], metas[p].get(), metas[p].size(), nullptr);
            }
            report("v2 segmented per-proj", time_graph_us(
                                                [&](cudaStream_t s, int c) {
                                                  auto pr = problems(c);
                                                  for (int p = 0; p < P; ++p)
                                                    launch_lora_segmented(&pr[p], 1, per_proj[p].cluster, metas[p].get(),
                                                                          per_proj[p].num_items, s);
                                                },
                                                copies));
            MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
          }
          if (single.single_adapter) {
            report("v3 cuBLAS single", time_graph_us(
                                           [&](cudaStream_t s, int c) {
                                             auto pr = problems(c);
                                             lora_run(ctx, pr.data(), P, single, meta, {scratch, scratch_bytes}, s);
                                           },
                                           copies));
          }
        }
      }
    }
  }
  return 0;
}
