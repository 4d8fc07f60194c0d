// Workbench: dense projections (src/backends/cuda/kernels/dense_gemm.*) on Qwen3-30B-A3B shapes.
// Versions: v1 naive (one warp per output), v2 small-M kernel with the dispatcher's tiling,
// v3/v4/v5 the small-M kernel with fixed tilings (row groups x K warps = 1x8, 2x4, 4x2), v6
// cuBLASLt (FP8: per-token quantisation + block-scaled GEMM; bf16: GEMM). Every version is checked
// against the CPU reference at M = 8 (W8A8 versions against the quantised-activation reference),
// then timed under graph replay with the weights rotated past L2. Floor = bytes / copy ceiling.
#include <cstdio>
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "ops/weight_format.h"
#include "backends/cuda/kernels/dense_gemm.cuh"
#include "backends/cuda/kernels/fp8_quant.cuh"
#include "gpukit/dense.h"
#include "gpukit/device_array.h"
#include "gpukit/numeric.h"
#include "gpukit/random.h"
#include "gpukit/timing.h"

using namespace moelora;
using namespace moelora::cuda;
using namespace moelora::gpukit;

namespace {

struct Shape {
  const char* name;
  int out, in;
};

// One weight and its rotation copies (same values at other addresses).
struct Weights {
  bool fp8;
  int out, in, copies;
  std::vector<DeviceArray<uint8_t>> q;   // fp8 codes
  std::vector<DeviceArray<float>> s;     // fp8 block scales
  std::vector<DeviceArray<uint16_t>> b;  // bf16 weights
  std::vector<float> deq;  // exact floats
  const void* w(int c) const { return fp8 ? static_cast<const void*>(q[c].get()) : b[c].get(); }
  float* scale(int c) const { return fp8 ? s[c].get() : nullptr; }
};

Weights make_weights(FastRng& r, bool fp8, int out, int in) {
  Weights W{fp8, out, in, 0, {}, {}, {}, {}};
  W.copies = rotation_copies(static_cast<size_t>(out) * in * (fp8 ? 1 : 2));
  if (fp8) {
    std::vector<uint8_t> q;
    std::vector<float> s(static_cast<size_t>((out + 127) / 128) * ((in + 127) / 128));
    random_fp8(r, q, s, out, in);
    W.deq.resize(q.size());
    dequantize_fp8_block(q.data(), out, in, s.data(), 128, 128, 0, W.deq.data());
    W.q.emplace_back(q);
    W.s.emplace_back(s);
    for (int c = 1; c < W.copies; ++c) {
      W.q.push_back(W.q[0].clone());
      W.s.push_back(W.s[0].clone());
    }
  } else {
    W.b.emplace_back(random_bf16(r, static_cast<size_t>(out) * in, 1.0f / std::sqrt(float(in)), &W.deq));
    for (int c = 1; c < W.copies; ++c) W.b.push_back(W.b[0].clone());
  }
  return W;
}

DenseArgs args_for(const Weights& W, int c, const __nv_bfloat16* x, int M, __nv_bfloat16* y) {
  DenseArgs a;
  a.x = x;
  a.ld_x = W.in;
  a.M = M;
  a.w = DenseWeight{W.w(c), W.fp8 ? WeightType::kFP8E4M3 : WeightType::kBF16, W.out, W.in, W.scale(c)};
  a.y = y;
  a.ld_y = W.out;
  return a;
}

enum Version { kNaive, kSmallHeur, kSmall18, kSmall24, kSmall42, kLt, kVersions };
const char* kVersionName[] = {"v1 naive", "v2 small-M", "v3 small 1x8", "v4 small 2x4", "v5 small 4x2", "v6 cuBLASLt"};

// Launches one version; false when it does not apply (cuBLASLt below M = 8 / shape refused).
bool launch(Version v, DenseGemmContext& ctx, const DenseArgs& a, uint8_t* xq, float* xs, cudaStream_t s) {
  switch (v) {
    case kNaive: launch_dense_naive(a, s); return true;
    case kSmallHeur: launch_dense_small_m(a, s); return true;
    case kSmall18: launch_dense_small_m(a, s, {1, 8}); return true;
    case kSmall24: launch_dense_small_m(a, s, {2, 4}); return true;
    case kSmall42: launch_dense_small_m(a, s, {4, 2}); return true;
    case kLt: {
      if (a.M < 8) return false;
      if (a.w.type == WeightType::kBF16) return ctx.gemm_bf16(a, s);
      Fp8QuantParams q;
      q.x = a.x, q.ld_x = a.ld_x, q.M = a.M, q.K = a.w.in, q.q = xq, q.ld_q = a.w.in, q.scales = xs, q.scale_ld = a.M;
      q.layout = Fp8ScaleLayout::kGroupMajor;
      launch_fp8_quant_per_token(q, s);
      return ctx.gemm_fp8(a, xq, a.w.in, xs, s);
    }
    default: return false;
  }
}

}  // namespace

int main() {
  const double copy = print_ceilings("dense_gemm");
  DenseGemmContext ctx;
  FastRng rng(2026);
  const int kMaxM = 4096;
  std::vector<float> xv;
  const DeviceArray<uint16_t> xbuf(random_bf16(rng, size_t(kMaxM) * 4096, 1.0f, &xv));
  const DeviceArray<uint16_t> ybuf(size_t(kMaxM) * 8192);
  const DeviceArray<uint8_t> xqbuf(size_t(kMaxM) * 8192);
  const DeviceArray<float> xsbuf(size_t(kMaxM) * 64);
  const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(xbuf.get());
  __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(ybuf.get());
  uint8_t* xq = xqbuf.get();
  float* xs = xsbuf.get();

  // Matrix-unit ceilings through cuBLASLt at 4096 x 4096 x 4096.
  {
    for (bool fp8 : {false, true}) {
      Weights W = make_weights(rng, fp8, 4096, 4096);
      const DenseArgs a = args_for(W, 0, x, 4096, y);
      const double us = time_graph_us([&](cudaStream_t s, int) { launch(kLt, ctx, a, xq, xs, s); }, 1, 10);
      std::printf("# cuBLASLt %s 4096^3 (incl. activation quantisation for fp8): %.1f us = %.0f TFLOP/s\n",
                  fp8 ? "fp8 block-scaled" : "bf16", us, 2.0 * 4096.0 * 4096 * 4096 / (us * 1e-6) / 1e12);
    }
  }

  const Shape shapes[] = {{"q_proj", 4096, 2048}, {"k/v_proj", 512, 2048}, {"o_proj", 2048, 4096}};
  std::printf("\n%-9s %-5s %5s %-14s %9s %9s %8s %8s %7s\n", "shape", "w", "M", "version", "us", "GB/s", "%copy",
              "floor_us", "x_floor");
  for (const Shape& sh : shapes) {
    for (bool fp8 : {true, false}) {
      Weights W = make_weights(rng, fp8, sh.out, sh.in);
      // Check every version at M = 8 against the CPU reference.
      {
        const int M = 8;
        std::vector<float> ref(size_t(M) * sh.out), refq(size_t(M) * sh.out);
        cpu::linear(xv.data(), 4096, M, W.deq.data(), sh.out, sh.in, ref.data(), sh.out);
        // What W8A8 multiplies: activations quantised per token per 128 channels.
        const std::vector<float> xq_ref = fp8_activation_round_trip(xv.data(), 4096, M, sh.in);
        cpu::linear(xq_ref.data(), sh.in, M, W.deq.data(), sh.out, sh.in, refq.data(), sh.out);
        DenseArgs a = args_for(W, 0, x, M, y);
        a.ld_x = 4096;
        for (int v = 0; v < kVersions; ++v) {
          MOELORA_CUDA_CHECK(cudaMemset(y, 0xff, size_t(M) * sh.out * 2));
          if (!launch(Version(v), ctx, a, xq, xs, nullptr)) continue;
          MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
          const auto got = from_bf16(ybuf.download(size_t(M) * sh.out));
          const bool w8a8 = fp8 && v == kLt;
          std::printf("# check %s %s %s M=8: max row rel err %.2e (vs %s reference)\n", sh.name, fp8 ? "fp8" : "bf16",
                      kVersionName[v], max_row_rel(got, w8a8 ? refq : ref, M, sh.out), w8a8 ? "W8A8" : "exact");
        }
      }
      const double wbytes = double(sh.out) * sh.in * (fp8 ? 1.0 : 2.0) + (fp8 ? double(sh.out / 128) * (sh.in / 128) * 4 : 0);
      for (int M : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
        const double bytes = wbytes + double(M) * sh.in * 2 + double(M) * sh.out * 2;
        const double floor_us = bytes / (copy * 1e9) * 1e6;
        for (int v = 0; v < kVersions; ++v) {
          if (v == kNaive && M > 8) continue;
          if (v != kLt && v != kSmallHeur && M > 64) continue;
          if (v == kLt && M < 8) continue;
          bool ok = true;
          const double us = time_graph_us(
              [&](cudaStream_t s, int c) { ok = launch(Version(v), ctx, args_for(W, c, x, M, y), xq, xs, s) && ok; },
              W.copies);
          if (!ok) continue;
          std::printf("%-9s %-5s %5d %-14s %9.2f %9.0f %7.1f%% %8.2f %7.2f\n", sh.name, fp8 ? "fp8" : "bf16", M,
                      kVersionName[v], us, bytes / (us * 1e-6) / 1e9, 100.0 * bytes / (us * 1e-6) / 1e9 / copy, floor_us,
                      us / floor_us);
        }
      }
    }
  }
  // Prefill sizes: the dispatcher (cuBLASLt) in TFLOP/s.
  std::printf("\n# prefill (dispatcher -> cuBLASLt)\n");
  for (bool fp8 : {true, false}) {
    Weights W = make_weights(rng, fp8, 4096, 2048);
    for (int M : {512, 4096}) {
      const double us = time_graph_us([&](cudaStream_t s, int c) { launch(kLt, ctx, args_for(W, c, x, M, y), xq, xs, s); },
                                      W.copies);
      std::printf("q_proj %-5s M=%5d %9.2f us %7.0f TFLOP/s\n", fp8 ? "fp8" : "bf16", M, us,
                  2.0 * M * 4096.0 * 2048 / (us * 1e-6) / 1e12);
    }
  }
  return 0;
}
