// Workbench: paged attention (src/backends/cuda/kernels/attention.*), Qwen3-30B-A3B heads
// (32 q / 4 kv x 128, bf16 KV, 16-position pages scattered over the cache).
// Decode versions: v1 the split-KV decode kernel as planned (split count for 2 blocks per SM wanted,
// pipeline depth by cuda_plan's wave model), v2 fewer splits (planned for 66 SMs), v3 more splits
// (264), v4 the prefill kernel on decode tokens, v5-v7 the plan's splits at 2, 3 and 4 stages.
// (The kernel with the query heads as the MMA's rows that this one replaced: bench/RESULTS.md.) Every version is checked against cpu::attention on a small batch first.
// Decode metric: bytes of K and V read / time, against the copy ceiling (target >= 70 %).
// Prefill: causal attention of a 4096-token prompt, of a 512-token chunk after 4096 cached and of a
// 1024-token prompt and 4096 tokens after 4096 cached, in TFLOP/s, on the mma.sync kernel and on the wgmma kernel (the attention
// issue's target: >= 300 TFLOP/s for a 4k causal prompt).
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/kernels/attention.cuh"
#include "core/tensor.h"
#include "gpukit/device_array.h"
#include "gpukit/numeric.h"
#include "gpukit/random.h"
#include "gpukit/timing.h"

using namespace moelora;
using namespace moelora::cuda;
using namespace moelora::gpukit;

namespace {

constexpr int kHeads = 32, kKvHeads = 4, kDim = 128, kPage = 16;

// Non-zero pseudo-random bf16 in [-1, 1) from the index (2 GB of cache is too much for the host).
__global__ void fill_kernel(uint16_t* p, size_t n, uint32_t salt) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ salt;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float f = (h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    p[i] = __bfloat16_as_ushort(__float2bfloat16(f));
  }
}

struct Batch {
  int B = 0, ctx = 0, pages = 0;
  std::vector<int32_t> pos, seq, indptr, indices;
  DeviceArray<int32_t> dpos, dseq, dptr, dind;
  void build(FastRng& r, int B_, int ctx_, int new_tokens, bool shuffle = true) {
    B = B_, ctx = ctx_;
    const int per = (ctx + new_tokens + kPage - 1) / kPage;
    pages = B * per;
    std::vector<int32_t> pool(pages);
    std::iota(pool.begin(), pool.end(), 0);
    if (shuffle)
      for (int i = pages - 1; i > 0; --i) std::swap(pool[i], pool[r.integer(0, i)]);
    indptr = {0};
    for (int b = 0; b < B; ++b) {
      indices.insert(indices.end(), pool.begin() + b * per, pool.begin() + (b + 1) * per);
      indptr.push_back(static_cast<int32_t>(indices.size()));
      for (int t = 0; t < new_tokens; ++t) {
        pos.push_back(ctx + t);
        seq.push_back(b);
      }
    }
    dpos = DeviceArray<int32_t>(pos), dseq = DeviceArray<int32_t>(seq), dptr = DeviceArray<int32_t>(indptr),
    dind = DeviceArray<int32_t>(indices);
  }
};

AttentionParams params(const Batch& b, const __nv_bfloat16* q, __nv_bfloat16* out, uint16_t* kc, uint16_t* vc) {
  AttentionParams p;
  p.q = q, p.ld_q = kHeads * kDim;
  p.k = q, p.ld_k = kHeads * kDim;  // unused by the no-write launch
  p.v = q, p.ld_v = kHeads * kDim;
  p.out = out, p.ld_out = kHeads * kDim;
  p.T = static_cast<int>(b.pos.size());
  p.heads = kHeads;
  p.scale = 1.0f / std::sqrt(float(kDim));
  p.k_cache = reinterpret_cast<__nv_bfloat16*>(kc);
  p.v_cache = reinterpret_cast<__nv_bfloat16*>(vc);
  p.page_size = kPage, p.kv_heads = kKvHeads, p.k_head_dim = kDim, p.v_head_dim = kDim;
  p.positions = b.dpos.get(), p.token_seq = b.dseq.get(), p.page_indptr = b.dptr.get(), p.page_indices = b.dind.get();
  return p;
}

struct Version {
  const char* name;
  int sms;
  int mode;
  int stages = 0;  // AttentionPlanOptions::decode_stages (0: the plan's)
};
const Version kVersions[] = {{"v1 decode (plan)", 132, 1},     {"v2 decode 66-SM plan", 66, 1},
                             {"v3 decode 264-SM plan", 264, 1}, {"v4 prefill kernel", 132, 2},
                             {"v5 decode, 2 stages", 132, 1, 2}, {"v6 decode, 3 stages", 132, 1, 3},
                             {"v7 decode, 4 stages", 132, 1, 4}};

}  // namespace

int main(int argc, char** argv) {
  // `dev_attention prefill`: the prefill rows only (scripts/device_run.sh unrun).
  const bool prefill_only = argc > 1 && std::string(argv[1]) == "prefill";
  attention_prepare();  // kernel attributes before any graph capture
  const double copy = print_ceilings("attention");
  FastRng rng(11);
  const size_t row = size_t(kKvHeads) * kDim;  // elements per cache row, K or V
  const DeviceArray<uint16_t> qbuf(random_bf16(rng, size_t(4096) * kHeads * kDim, 0.5f));
  const DeviceArray<uint16_t> outbuf(size_t(4096) * kHeads * kDim);
  const DeviceArray<uint8_t> metabuf(1 << 20);
  const size_t ws_bytes = size_t(512) << 20;
  const DeviceArray<uint8_t> wsbuf(ws_bytes);
  __nv_bfloat16* q = reinterpret_cast<__nv_bfloat16*>(qbuf.get());
  __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(outbuf.get());
  void* meta = metabuf.get();
  void* ws = wsbuf.get();

  if (!prefill_only) {
    // ---- check every version against the CPU on 3 sequences of 300..1200 positions
    {
      Batch b;
      b.build(rng, 3, 1200, 1);
      b.pos = {299, 1199, 700};
      b.dpos.upload(b.pos);
      const size_t n = size_t(b.pages) * kPage * row;
      std::vector<float> kf, vf;
      const DeviceArray<uint16_t> kbuf(random_bf16(rng, n, 1.0f, &kf));
      const DeviceArray<uint16_t> vbuf(random_bf16(rng, n, 1.0f, &vf));
      uint16_t* kc = kbuf.get();
      uint16_t* vc = vbuf.get();
      std::vector<float> qf = from_bf16(qbuf.download(size_t(3) * kHeads * kDim));
      StepBatch sb;
      sb.positions = b.pos, sb.token_seq = b.seq;
      for (int s = 0; s < 3; ++s) sb.seq_pages.emplace_back(b.indices.begin() + b.indptr[s], b.indices.begin() + b.indptr[s + 1]);
      KvLayer kv;
      kv.page_size = kPage, kv.kv_heads = kKvHeads, kv.k_head_dim = kDim, kv.v_head_dim = kDim;
      kv.k = Tensor(kf.data(), DType::kF32, {b.pages, kPage, static_cast<int64_t>(row)});
      kv.v = Tensor(vf.data(), DType::kF32, {b.pages, kPage, static_cast<int64_t>(row)});
      // cpu::attention writes k/v of the step's tokens first: give it the values already cached.
      std::vector<float> kn(3 * row), vn(3 * row);
      for (int t = 0; t < 3; ++t) {
        const int64_t r = int64_t(b.indices[b.indptr[t] + b.pos[t] / kPage]) * kPage + b.pos[t] % kPage;
        std::copy(kf.begin() + r * row, kf.begin() + (r + 1) * row, kn.begin() + t * row);
        std::copy(vf.begin() + r * row, vf.begin() + (r + 1) * row, vn.begin() + t * row);
      }
      std::vector<float> ref(size_t(3) * kHeads * kDim);
      cpu::AttentionArgs aa{qf.data(), kHeads * kDim, kn.data(), static_cast<int64_t>(row), vn.data(),
                            static_cast<int64_t>(row), ref.data(), kHeads * kDim, 3, kHeads, 1.0f / std::sqrt(float(kDim)),
                            b.pos.data(), b.seq.data(), &sb};
      cpu::attention(aa, kv);
      for (const Version& v : kVersions) {
        AttentionPlanOptions o;
        o.num_sms = v.sms, o.force_mode = v.mode, o.decode_stages = v.stages;
        const AttentionPlan plan = attention_plan(b.pos.data(), b.seq.data(), 3, kHeads, kKvHeads, kDim, kDim, o);
        attention_upload_plan(plan, meta, 1 << 20, nullptr);
        MOELORA_CUDA_CHECK(cudaMemset(out, 0xff, size_t(3) * kHeads * kDim * 2));
        launch_attention_no_cache_write(params(b, q, out, kc, vc), plan, meta, ws, ws_bytes, nullptr);
        MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
        const auto got = from_bf16(outbuf.download(size_t(3) * kHeads * kDim));
        std::printf("# check %s: splits %d, max row rel err %.2e\n", v.name, plan.max_splits,
                    max_row_rel(got, ref, 3, kHeads * kDim));
      }
    }

    // ---- decode timing
    std::printf("\n%5s %6s %-22s %6s %9s %9s %8s\n", "B", "ctx", "version", "splits", "us", "KV GB/s", "%copy");
    for (int ctx : {512, 1024, 4096, 16384}) {
      for (int B : {1, 8, 32, 64, 128, 256}) {
        const double kv_bytes = double(B) * ctx * row * 2 * 2;
        if (kv_bytes > 4.5e9) continue;
        Batch b;
        b.build(rng, B, ctx - 1, 1);  // each sequence's token sits at position ctx - 1: ctx keys
        const size_t n = size_t(b.pages) * kPage * row;
        const int copies = rotation_copies(static_cast<size_t>(2 * n * 2));
        std::vector<DeviceArray<uint16_t>> kbuf, vbuf;
        std::vector<uint16_t*> kc(copies), vc(copies);
        for (int c = 0; c < copies; ++c) {
          kc[c] = kbuf.emplace_back(n).get();
          vc[c] = vbuf.emplace_back(n).get();
          fill_kernel<<<1024, 256>>>(kc[c], n, 17u * c + 1);
          fill_kernel<<<1024, 256>>>(vc[c], n, 31u * c + 7);
        }
        MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
        for (const Version& v : kVersions) {
          if (v.mode == 2 && ctx > 1024) continue;  // a known-slow path: one size is enough to show it
          AttentionPlanOptions o;
          o.num_sms = v.sms, o.force_mode = v.mode, o.decode_stages = v.stages;
          const AttentionPlan plan = attention_plan(b.pos.data(), b.seq.data(), B, kHeads, kKvHeads, kDim, kDim, o);
          attention_upload_plan(plan, meta, 1 << 20, nullptr);
          MOELORA_CHECK(attention_workspace_bytes(plan, B, kHeads, kDim) <= ws_bytes);
          const double us = time_graph_us(
              [&](cudaStream_t s, int c) {
                launch_attention_no_cache_write(params(b, q, out, kc[c], vc[c]), plan, meta, ws, ws_bytes, s);
              },
              copies);
          const double gbs = kv_bytes / (us * 1e-6) / 1e9;
          std::printf("%5d %6d %-22s %6d %9.2f %9.0f %7.1f%%\n", B, ctx, v.name, plan.decode ? plan.max_splits : 0, us, gbs,
                      100.0 * gbs / copy);
        }
        if (ctx == 4096 && B == 64) {
          // The same KV bytes as 4x the sequences with 8 query heads on 1 kv head x 128: every cache
          // row is one contiguous 256-byte piece. Does interleaving 4 kv heads in a row cost bandwidth?
          Batch b1;
          b1.build(rng, 4 * B, ctx - 1, 1);
          AttentionParams p1 = params(b1, q, out, kc[0], vc[0]);
          p1.heads = 8, p1.kv_heads = 1, p1.ld_q = 8 * kDim, p1.ld_out = 8 * kDim;
          const AttentionPlan plan = attention_plan(b1.pos.data(), b1.seq.data(), 4 * B, 8, 1, kDim, kDim, {});
          const double us = time_graph_us(
              [&](cudaStream_t s, int c) {
                AttentionParams pc = p1;
                pc.k_cache = reinterpret_cast<__nv_bfloat16*>(kc[c]);
                pc.v_cache = reinterpret_cast<__nv_bfloat16*>(vc[c]);
                launch_attention_no_cache_write(pc, plan, meta, ws, ws_bytes, s);
              },
              copies);
          const double gbs = kv_bytes / (us * 1e-6) / 1e9;
          std::printf("%5d %6d %-22s %6d %9.2f %9.0f %7.1f%%\n", 4 * B, ctx, "v8 decode, 8/1 heads", plan.max_splits, us,
                      gbs, 100.0 * gbs / copy);
        }
        if (ctx == 4096) {
          // The same batch with every sequence's pages in order: does scattering pages cost bandwidth?
          Batch bo;
          bo.build(rng, B, ctx - 1, 1, false);
          const AttentionPlan plan = attention_plan(bo.pos.data(), bo.seq.data(), B, kHeads, kKvHeads, kDim, kDim, {});
          const double us = time_graph_us(
              [&](cudaStream_t s, int c) {
                launch_attention_no_cache_write(params(bo, q, out, kc[c], vc[c]), plan, meta, ws, ws_bytes, s);
              },
              copies);
          const double gbs = kv_bytes / (us * 1e-6) / 1e9;
          std::printf("%5d %6d %-22s %6d %9.2f %9.0f %7.1f%%\n", B, ctx, "v9 decode, pages in order", plan.max_splits,
                      us, gbs, 100.0 * gbs / copy);
        }
      }
    }
  }

  // ---- prefill timing: the mma.sync kernel and the wgmma kernel (AttentionPlanOptions::prefill_kernel
  // 1 and 2) on the same inputs; the wgmma output is checked against the mma.sync one (both are
  // checked against cpu::attention by the op suite): worst row-relative rms difference.
  std::printf("\n# prefill (causal, 32/4 heads x 128)\n");
  const DeviceArray<uint16_t> out2buf(size_t(4096) * kHeads * kDim);
  for (auto [cached, fresh] : {std::pair{0, 4096}, std::pair{4096, 512}, std::pair{0, 1024}, std::pair{4096, 4096}}) {
    Batch b;
    b.build(rng, 1, cached, fresh);
    const size_t n = size_t(b.pages) * kPage * row;
    const DeviceArray<uint16_t> kbuf(n), vbuf(n);
    uint16_t* kc = kbuf.get();
    uint16_t* vc = vbuf.get();
    fill_kernel<<<1024, 256>>>(kc, n, 3u);
    fill_kernel<<<1024, 256>>>(vc, n, 5u);
    double flops = 0;
    for (int t = 0; t < fresh; ++t) flops += 2.0 * kHeads * (cached + t + 1) * (2 * kDim);
    std::vector<float> first_out;
    for (int kernel : {1, 2}) {
      AttentionPlanOptions o;
      o.prefill_kernel = kernel;
      const AttentionPlan plan = attention_plan(b.pos.data(), b.seq.data(), fresh, kHeads, kKvHeads, kDim, kDim, o);
      attention_upload_plan(plan, meta, 1 << 20, nullptr);
      __nv_bfloat16* dst = kernel == 1 ? out : reinterpret_cast<__nv_bfloat16*>(out2buf.get());
      const double us = time_graph_us(
          [&](cudaStream_t s, int) { launch_attention_no_cache_write(params(b, q, dst, kc, vc), plan, meta, ws, ws_bytes, s); },
          1, 5);
      const std::vector<float> got =
          from_bf16((kernel == 1 ? outbuf : out2buf).download(size_t(fresh) * kHeads * kDim));
      double worst = 0;
      if (kernel == 1) {
        first_out = got;
      } else {
        for (size_t r = 0; r < size_t(fresh) * kHeads; ++r) {
          double d2 = 0, n2 = 0;
          for (int c = 0; c < kDim; ++c) {
            const double a = first_out[r * kDim + c], d = got[r * kDim + c] - a;
            d2 += d * d, n2 += a * a;
          }
          worst = std::max(worst, std::sqrt(d2 / std::max(n2, 1e-30)));
        }
      }
      std::printf("cached %5d new %5d %-8s: %9.1f us, %6.1f TFLOP/s%s\n", cached, fresh,
                  kernel == 1 ? "mma.sync" : "wgmma", us, flops / (us * 1e-6) / 1e12,
                  kernel == 2 ? (" (vs mma.sync: worst row rms " + std::to_string(worst) + (worst < 1e-2 ? ", ok)" : ", MISMATCH)")).c_str() : "");
    }
  }
  return 0;
}
