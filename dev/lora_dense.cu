// Workbench: multi-adapter dense LoRA (src/backends/cuda/kernels/lora_dense.*) on Qwen3-30B-A3B
// shapes: q,k,v in one launch (in 2048 -> 4096, 512, 512) and o_proj (4096 -> 2048), tokens
// 1..256, adapters 1..64 (token t on adapter t % N), ranks 16 and 64.
// Versions: v1 the fused segmented kernel, all projections in one launch; v2 the same kernel one
// launch per projection; v3 the single-adapter cuBLAS path (N = 1 only). Checked against
// cpu::lora_add, timed under graph replay with the adapter pool rotated past L2.
// Floor = (A and B of the adapters used + x + y read and written) / copy ceiling.
// Target (issue): <= 3 us per projection, or <= 1.4x the floor where that is larger.
// `dev_lora_dense ingemm`: instead, the FP8 projection with its LoRA as the engine runs it (the
// small-M GEMM, then the segmented kernel) against the LoRA inside the GEMM (the shrink, then the
// GEMM adding u . B in its epilogue: kernels/dense_lora_epilogue.cuh), both checked against the CPU.
#include <cstdio>
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/kernels/dense_gemm.cuh"
#include "backends/cuda/kernels/dense_lora_epilogue.cuh"
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

// `ingemm` mode (see the top): q|k|v (2048 -> 4096 + 512 + 512) and o (4096 -> 2048), FP8 weights,
// r 16, tokens 1..8 on 1 or 8 adapters; the weights and adapter pools rotated past L2.
int ingemm_mode() {
  print_ceilings("lora_dense ingemm");
  FastRng rng(11);
  Rng wrng(12);
  const int r = 16, kMaxT = 8;
  std::vector<float> xv;
  const DeviceArray<uint16_t> xbuf(random_bf16(rng, size_t(kMaxT) * 4096, 1.0f, &xv));
  auto* x = reinterpret_cast<__nv_bfloat16*>(xbuf.get());
  DenseGemmContext dctx;
  LoraContext lctx;
  const DeviceArray<uint8_t> metabuf(lora_meta_bytes(4096, kMaxT));
  std::printf("\n%-4s %3s %3s %12s %12s %8s %s\n", "set", "T", "N", "gemm+lora_us", "in_gemm_us", "ratio", "check (max row rel err vs CPU)");
  struct Set {
    const char* name;
    int in;
    std::vector<int> outs;
  };
  for (const Set& set : {Set{"qkv", 2048, {4096, 512, 512}}, Set{"o", 4096, {2048}}}) {
    const int P = static_cast<int>(set.outs.size());
    int N_out = 0;
    for (int o : set.outs) N_out += o;
    Fp8Weight fw;
    fw.generate(wrng, N_out, set.in);
    const double wbytes = double(N_out) * set.in;
    for (int N : {1, 8}) {
      std::vector<ProjShape> proj;
      for (int o : set.outs) proj.push_back({set.in, o});
      double pool_bytes = wbytes;
      for (auto& ps : proj) pool_bytes += double(N) * r * (ps.in + ps.out) * 2;
      const int copies = rotation_copies(static_cast<size_t>(pool_bytes));
      std::vector<std::vector<Pool>> pools(copies);
      for (auto& cp : pools) cp.resize(P);
      std::vector<DeviceArray<uint8_t>> wq;
      std::vector<DeviceArray<float>> ws;
      for (int c = 0; c < copies; ++c) {
        wq.emplace_back(fw.q);
        ws.emplace_back(fw.scale);
        for (int p = 0; p < P; ++p) {
          if (c == 0) {
            pools[0][p] = make_pool(rng, N, r, proj[p]);
            set_tables(pools[0][p], N, r, proj[p]);
          } else {
            pools[c][p] = clone_pool(pools[0][p], N, r, proj[p]);
          }
        }
      }
      std::vector<std::vector<int>> host_rank(P, std::vector<int>(N, r));
      for (int T : {1, 2, 4, 8}) {
        if (N > T && N != 8) continue;
        std::vector<int32_t> slot(T);
        for (int t = 0; t < T; ++t) slot[t] = t % N;
        const DeviceArray<int32_t> dslot(slot);
        DeviceArray<uint16_t> ybuf(size_t(T) * N_out), ybuf2(size_t(T) * N_out);
        auto* y = reinterpret_cast<__nv_bfloat16*>(ybuf.get());
        auto* y2 = reinterpret_cast<__nv_bfloat16*>(ybuf2.get());
        DeviceArray<float> u(size_t(P) * T * r);
        auto dense_args = [&](int c, __nv_bfloat16* out) {
          DenseArgs a;
          a.x = x, a.ld_x = set.in, a.M = T;
          a.w.w = wq[c].get(), a.w.type = WeightType::kFP8E4M3, a.w.out = N_out, a.w.in = set.in, a.w.scale_inv = ws[c].get();
          a.y = out, a.ld_y = N_out;
          return a;
        };
        auto problems = [&](int c) {
          std::vector<LoraProblem> v(P);
          for (int p = 0, begin = 0; p < P; begin += set.outs[p], ++p)
            v[p] = LoraProblem{x, set.in, y + begin, N_out, set.in, set.outs[p], N, pools[c][p].a_ptrs.get(),
                               pools[c][p].b_ptrs.get(), pools[c][p].ranks.get(), host_rank[p].data()};
          return v;
        };
        auto epilogue = [&](int c) {
          DenseLoraEpilogue l;
          l.u = u.get(), l.ldu = r, l.M = T, l.num_parts = P, l.token_slot = dslot.get(), l.num_slots = N;
          for (int p = 0, begin = 0; p < P; begin += set.outs[p], ++p)
            l.parts[p] = {begin, set.outs[p], pools[c][p].a_ptrs.get(), pools[c][p].b_ptrs.get(), pools[c][p].ranks.get()};
          return l;
        };
        auto probs0 = problems(0);
        LoraPlanOptions seg_only;
        seg_only.single_adapter_gemm = false;
        const LoraPlan seg = lora_plan(slot.data(), T, probs0.data(), P, seg_only);
        lora_upload_plan(seg, metabuf.get(), metabuf.size(), nullptr);
        auto separate = [&](cudaStream_t st, int c) {
          launch_dense_small_m(dense_args(c, y), st);
          auto pr = problems(c);
          launch_lora_segmented(pr.data(), P, seg.cluster, metabuf.get(), seg.num_items, st);
        };
        auto in_gemm = [&](cudaStream_t st, int c) {
          DenseLoraShrinkParams sp;
          sp.x = x, sp.ld_x = set.in, sp.in = set.in, sp.lora = epilogue(c), sp.max_rank = r, sp.pdl = true;
          launch_dense_lora_shrink(sp, st);
          DenseArgs a = dense_args(c, y2);
          a.lora = epilogue(c);
          launch_dense_small_m(a, st);
        };
        // Check both against the CPU (base GEMM on the dequantised weight + each part's LoRA).
        separate(nullptr, 0);
        in_gemm(nullptr, 0);
        MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> xin(size_t(T) * set.in), ref(size_t(T) * N_out);
        for (size_t i = 0; i < xin.size(); ++i) xin[i] = xv[i];
        cpu::linear(xin.data(), set.in, T, fw.deq.data(), N_out, set.in, ref.data(), N_out);
        for (int p = 0, begin = 0; p < P; begin += set.outs[p], ++p) {
          std::vector<const float*> ah, bh;
          for (int s = 0; s < N; ++s) ah.push_back(pools[0][p].a[s].data()), bh.push_back(pools[0][p].b[s].data());
          const LoraModuleTable tab = host_lora_table(set.in, set.outs[p], ah, bh, host_rank[p]);
          cpu::lora_add(xin.data(), set.in, T, slot.data(), tab, ref.data() + begin, N_out);
        }
        const double e1 = max_row_rel(from_bf16(ybuf.download()), ref, T, N_out);
        const double e2 = max_row_rel(from_bf16(ybuf2.download()), ref, T, N_out);
        const double t1 = time_graph_us(separate, copies), t2 = time_graph_us(in_gemm, copies);
        std::printf("%-4s %3d %3d %12.2f %12.2f %8.2f separate %.2e, in gemm %.2e %s\n", set.name, T, N, t1, t2, t2 / t1,
                    e1, e2, e1 <= 4e-3 && e2 <= 4e-3 ? "ok" : "FAIL");
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "ingemm") return ingemm_mode();
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
