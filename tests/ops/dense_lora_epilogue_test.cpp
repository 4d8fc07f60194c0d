// Op suite: dense LoRA inside the small-M GEMM (dense_lora_epilogue.cuh: launch_dense_lora_shrink,
// then the GEMM adds u . B in its epilogue) against cpu::linear + cpu::lora_add on the same values,
// part by part (q, k, v of a fused projection with their own factors), with per-token adapters
// (-1 and out-of-range slots: none), mixed ranks 0..128, FP8 / bf16 / NVFP4 weights, the small-M
// and naive kernels and the dispatcher. Rows of tokens without an adapter are bit for bit the GEMM
// without LoRA. Beside cases also launch the GEMM behind the shrink with programmatic dependent
// launch, waiting for it only before its epilogue (DenseLoraEpilogue::wait_before_epilogue, the
// backend's default): its output must be the waiting GEMM's bit for bit.
//
// Tolerance 4e-3 row-relative, as every single-rounding op: f32 shrink and expand over bf16 factors
// and inputs, added to the f32 base sum before y's one bf16 rounding (the separate LoRA kernel
// rounds y twice). The cases make the delta about as large as the base output, so a dropped,
// misplaced or wrong-adapter delta is off by O(1).
#include <cmath>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/kernels/dense_gemm.cuh"
#include "backends/cuda/kernels/dense_lora_epilogue.cuh"
#include "gpukit/dense.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

constexpr double kTol = 4e-3;

enum class Kernel { kSmall, kNaive, kDispatch };

struct EpilogueCase {
  int M = 1, in = 256;
  std::vector<int> outs{128};  // parts, in column order
  int slots = 4;
  std::string weights = "fp8";  // fp8 | bf16 | nvfp4
  Kernel kernel = Kernel::kSmall;
  bool beside = false;
  std::string name() const {
    std::string o;
    for (size_t i = 0; i < outs.size(); ++i) o += (i ? "+" : "") + std::to_string(outs[i]);
    const char* k = kernel == Kernel::kSmall ? "small" : kernel == Kernel::kNaive ? "naive" : "dispatch";
    return "DENSE_LORA_EPILOGUE(M=" + std::to_string(M) + ",in=" + std::to_string(in) + ",out=" + o +
           ",slots=" + std::to_string(slots) + "," + weights + "," + k + (beside ? ",beside" : "") + ")";
  }
};
void PrintTo(const EpilogueCase& c, std::ostream* os) { *os << c.name(); }

struct PartFactors {
  std::vector<std::vector<float>> a, b;  // per slot: [r, in], [out, r] (bf16 values)
  std::vector<DeviceArray<uint16_t>> da, db;
  std::vector<int> rank;
  DeviceArray<int64_t> a_ptrs, b_ptrs;
  DeviceArray<int32_t> ranks;
};

class DenseLoraEpilogueTest : public ::testing::TestWithParam<EpilogueCase> {};

TEST_P(DenseLoraEpilogueTest, MatchesCpu) {
  MOELORA_REQUIRE_GPU();
  const EpilogueCase c = GetParam();
  Rng rng(seed_of(c.name()));
  const int P = static_cast<int>(c.outs.size());
  int N = 0;
  for (int o : c.outs) N += o;
  DevMat x(c.M, c.in, c.in + 8);
  x.randomize(rng);
  // Token slots: random with -1 (no adapter) and one out-of-range slot (treated as none).
  std::vector<int32_t> slot(c.M);
  for (int t = 0; t < c.M; ++t) slot[t] = rng.integer(-1, c.slots - 1);
  if (c.M > 2) slot[1] = c.slots + 3;
  // Factors per part and slot; ranks mixed, slot 1 of part 0 without the module (rank 0).
  const int mixed[] = {1, 4, 8, 16, 17, 64, 128};
  std::vector<PartFactors> f(P);
  int max_rank = 0;
  for (int q = 0; q < P; ++q) {
    std::vector<int64_t> ap(c.slots, 0), bp(c.slots, 0);
    f[q].a.resize(c.slots), f[q].b.resize(c.slots), f[q].da.resize(c.slots), f[q].db.resize(c.slots);
    for (int s = 0; s < c.slots; ++s) {
      const int r = (q == 0 && s == 1) ? 0 : mixed[rng.integer(0, 6)];
      f[q].rank.push_back(r);
      max_rank = std::max(max_rank, r);
      f[q].a[s] = round_bf16(rng.normals(static_cast<size_t>(r) * c.in, 1.0f / std::sqrt(static_cast<float>(c.in))));
      f[q].b[s] = round_bf16(rng.normals(static_cast<size_t>(c.outs[q]) * r, r ? 1.0f / std::sqrt(static_cast<float>(r)) : 1.0f));
      if (r == 0) continue;
      f[q].da[s] = DeviceArray<uint16_t>(to_bf16(f[q].a[s]));
      f[q].db[s] = DeviceArray<uint16_t>(to_bf16(f[q].b[s]));
      ap[s] = reinterpret_cast<int64_t>(f[q].da[s].get());
      bp[s] = reinterpret_cast<int64_t>(f[q].db[s].get());
    }
    f[q].a_ptrs = DeviceArray<int64_t>(ap);
    f[q].b_ptrs = DeviceArray<int64_t>(bp);
    f[q].ranks = DeviceArray<int32_t>(std::vector<int32_t>(f[q].rank.begin(), f[q].rank.end()));
  }

  // The weight [N, in] of the fused projection and its exact dequantisation.
  cuda::DenseArgs a;
  a.x = x.ptr(), a.ld_x = x.ld, a.M = c.M, a.w.out = N, a.w.in = c.in;
  Fp8Weight fw;
  Nvfp4Weight nw;
  DevMat wb;
  DeviceArray<uint8_t> wq, wgs;
  DeviceArray<float> ws;
  std::vector<float> wref;
  if (c.weights == "fp8") {
    fw.generate(rng, N, c.in, 0);
    wq = DeviceArray<uint8_t>(fw.q);
    ws = DeviceArray<float>(fw.scale);
    a.w.w = wq.get(), a.w.type = cuda::WeightType::kFP8E4M3, a.w.scale_inv = ws.get();
    wref = fw.deq;
  } else if (c.weights == "nvfp4") {
    nw.generate(rng, N, c.in, 0);
    wq = DeviceArray<uint8_t>(nw.codes_packed);
    wgs = DeviceArray<uint8_t>(nw.scale);
    ws = DeviceArray<float>(nw.global_rows);
    a.w.w = wq.get(), a.w.type = cuda::WeightType::kNvfp4, a.w.group_scale = wgs.get(), a.w.global_scale = ws.get();
    wref = nw.deq;
  } else {
    wb = DevMat(N, c.in);
    wb.randomize(rng, 1.0f / std::sqrt(static_cast<float>(c.in)));
    a.w.w = wb.ptr(), a.w.type = cuda::WeightType::kBF16;
    wref = wb.host;
  }

  // Reference: the base GEMM, then each part's LoRA on its columns (cpu::lora_add on a [M, out_q] view).
  std::vector<float> ref(static_cast<size_t>(c.M) * N);
  cpu::linear(x.host.data(), c.in, c.M, wref.data(), N, c.in, ref.data(), N);
  std::vector<int32_t> ref_slot(slot);
  for (auto& s : ref_slot)
    if (s >= c.slots) s = -1;
  for (int q = 0, begin = 0; q < P; begin += c.outs[q], ++q) {
    std::vector<const float*> ah, bh;
    for (int s = 0; s < c.slots; ++s) ah.push_back(f[q].a[s].data()), bh.push_back(f[q].b[s].data());
    const LoraModuleTable tab = host_lora_table(c.in, c.outs[q], ah, bh, f[q].rank);
    std::vector<float> part(static_cast<size_t>(c.M) * c.outs[q]);
    for (int t = 0; t < c.M; ++t)
      for (int n = 0; n < c.outs[q]; ++n) part[t * c.outs[q] + n] = ref[static_cast<size_t>(t) * N + begin + n];
    cpu::lora_add(x.host.data(), c.in, c.M, ref_slot.data(), tab, part.data(), c.outs[q]);
    for (int t = 0; t < c.M; ++t)
      for (int n = 0; n < c.outs[q]; ++n) ref[static_cast<size_t>(t) * N + begin + n] = part[t * c.outs[q] + n];
  }

  // The GPU: shrink into u, then the GEMM with the epilogue; and the GEMM alone for the base-only rows.
  DeviceArray<int32_t> dslot(slot);
  const int ldu = std::max(max_rank, 1);
  DeviceArray<float> u(static_cast<size_t>(P) * std::max(c.M, 1) * ldu);
  u.poison(0xFF);  // entries the shrink must not need stay NaN
  cuda::DenseLoraEpilogue l;
  l.u = u.get(), l.ldu = ldu, l.M = c.M, l.num_parts = P, l.token_slot = dslot.get(), l.num_slots = c.slots;
  for (int q = 0, begin = 0; q < P; begin += c.outs[q], ++q)
    l.parts[q] = {begin, c.outs[q], f[q].a_ptrs.get(), f[q].b_ptrs.get(), f[q].ranks.get()};
  cuda::DenseLoraShrinkParams sp;
  sp.x = x.ptr(), sp.ld_x = x.ld, sp.in = c.in, sp.lora = l, sp.max_rank = max_rank;
  DevMat y(c.M, N, N + 8), y_base(c.M, N, N + 8);
  cuda::DenseArgs base = a;
  base.y = y_base.ptr(), base.ld_y = y_base.ld;
  a.y = y.ptr(), a.ld_y = y.ld, a.lora = l;
  cuda::DenseGemmContext ctx;
  cuda::launch_dense_lora_shrink(sp, nullptr);
  switch (c.kernel) {
    case Kernel::kSmall:
      cuda::launch_dense_small_m(a, nullptr);
      cuda::launch_dense_small_m(base, nullptr);
      break;
    case Kernel::kNaive:
      cuda::launch_dense_naive(a, nullptr);
      cuda::launch_dense_naive(base, nullptr);
      break;
    case Kernel::kDispatch:  // must keep the epilogue on our kernels whatever M is
      cuda::dense_linear(ctx, a, {}, nullptr);
      cuda::launch_dense_small_m(base, nullptr);
      break;
  }
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = y.download(), got_base = y_base.download();
  if (c.beside) {  // the shrink then the GEMM behind it, as CudaBackend::linear_lora_in_gemm runs them
    cudaStream_t st = nullptr;
    MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    DevMat y2(c.M, N, N + 8);
    u.poison(0xFF);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    cuda::DenseArgs b = a;
    b.y = y2.ptr(), b.ld_y = y2.ld;
    cuda::DenseLoraShrinkParams bsp = sp;
    bsp.pdl = true;
    b.lora.wait_before_epilogue = cuda::launch_dense_lora_shrink(bsp, st);
    ASSERT_TRUE(b.lora.wait_before_epilogue);
    cuda::launch_dense_small_m(b, st);
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(st));
    MOELORA_CUDA_CHECK(cudaStreamDestroy(st));
    EXPECT_TRUE(y2.download() == got) << "the GEMM beside the shrink differs from the one waiting for it";
    EXPECT_TRUE(y2.padding_intact()) << "output padding or guard overwritten (beside)";
  }
  EXPECT_CLOSE_ROWS(got, ref, c.M, N, kTol);
  for (int t = 0; t < c.M; ++t) {
    if (ref_slot[t] >= 0) continue;
    int diff = 0;
    for (int n = 0; n < N; ++n) diff += got[static_cast<size_t>(t) * N + n] != got_base[static_cast<size_t>(t) * N + n];
    EXPECT_EQ(diff, 0) << "token " << t << " has no adapter: its row must be the GEMM's alone";
  }
  EXPECT_TRUE(y.padding_intact()) << "output padding or guard overwritten";
}

std::vector<EpilogueCase> epilogue_cases() {
  std::vector<EpilogueCase> v;
  // Decode sizes on the small-M kernel, one part (o_proj-like) and three (q|k|v), every weight type.
  for (const char* w : {"fp8", "bf16", "nvfp4"})
    for (int M : {1, 3, 8}) {
      v.push_back({M, 256, {128}, 4, w, Kernel::kSmall});
      v.push_back({M, 256, {128, 32, 32}, 4, w, Kernel::kSmall});
    }
  // More tokens than one tile, 16 slots (every token its own), the naive kernel, the dispatcher above
  // the small-M range (it must not hand the epilogue to cuBLASLt).
  v.push_back({13, 384, {256, 64, 64}, 16, "fp8", Kernel::kSmall});
  v.push_back({5, 256, {128, 32, 32}, 4, "fp8", Kernel::kNaive});
  v.push_back({5, 256, {96, 32}, 4, "nvfp4", Kernel::kNaive});
  v.push_back({40, 256, {128, 64}, 4, "fp8", Kernel::kDispatch});
  v.push_back({300, 256, {128}, 4, "bf16", Kernel::kDispatch});
  // Qwen3-30B-A3B's q|k|v at one token: in 2048, out 4096 + 512 + 512.
  v.push_back({1, 2048, {4096, 512, 512}, 8, "fp8", Kernel::kSmall});
  // The GEMM beside the shrink: q|k|v and o_proj at Qwen3 shapes, 1 and 8 tokens, and odd sizes.
  v.push_back({1, 2048, {4096, 512, 512}, 8, "fp8", Kernel::kSmall, true});
  v.push_back({8, 2048, {4096, 512, 512}, 8, "fp8", Kernel::kSmall, true});
  v.push_back({1, 4096, {2048}, 8, "fp8", Kernel::kSmall, true});
  v.push_back({3, 256, {128, 32, 32}, 4, "bf16", Kernel::kSmall, true});
  v.push_back({5, 256, {96, 32}, 4, "nvfp4", Kernel::kSmall, true});
  return v;
}
std::string epilogue_name(const ::testing::TestParamInfo<EpilogueCase>& i) { return gtest_safe(i.param.name()); }
INSTANTIATE_TEST_SUITE_P(DenseLoraEpilogue, DenseLoraEpilogueTest, ::testing::ValuesIn(epilogue_cases()), epilogue_name);

}  // namespace
}  // namespace moelora::ops_test
