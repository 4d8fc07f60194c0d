// Op suite: Backend::rotary_attention on CUDA with the cache write in the rotation's pass
// (CudaBackendOptions::kv_write_in_head_pass: Qwen3's head norm + RoPE, or RoPE alone) against the
// same backend without it (rotation, cache write, attention: three launches), bit for bit: output, rotated q|k, both caches; and against the
// CPU backend (the spec) within the attention tolerance. Steps of one case run in order on the same
// caches (a prefill chunk, then decode steps reading what the earlier steps wrote).
#include <cmath>
#include <numeric>

#include "backends/cpu/cpu_backend.h"
#include "backends/cuda/cuda_backend.h"
#include "core/tensor.h"
#include "gpukit/dense.h"
#include "gpukit/paging.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

constexpr double kAttnTol = 1e-2;  // attention_test.cpp says why
constexpr uint16_t kNanBits = 0x7fc0;

struct HeadPassCase {
  int heads = 32, kv_heads = 4, d = 128, page_size = 16;
  std::vector<int> cached;  // positions in the cache before the first step, per sequence
  std::vector<int> fresh;   // tokens of the first step, per sequence (later steps: one each)
  int steps = 3;
  bool norms = true;  // Qwen3's per-head q/k norms; false: RoPE alone (Mixtral)
  std::string name() const {
    std::string s = "HEADPASS(h=" + std::to_string(heads) + "/" + std::to_string(kv_heads) + ",d=" + std::to_string(d) +
                    ",ps=" + std::to_string(page_size) + ",new=";
    for (size_t i = 0; i < fresh.size(); ++i) s += (i ? "/" : "") + std::to_string(fresh[i]);
    return s + ",steps=" + std::to_string(steps) + (norms ? "" : ",no-norms") + ")";
  }
};
void PrintTo(const HeadPassCase& c, std::ostream* os) { *os << c.name(); }

float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

class HeadPassKv : public ::testing::TestWithParam<HeadPassCase> {};

TEST_P(HeadPassKv, SameBitsAsTheCacheWriteKernel) {
  MOELORA_REQUIRE_GPU();
  const HeadPassCase c = GetParam();
  Rng rng(seed_of(c.name()));
  const int S = static_cast<int>(c.cached.size()), d = c.d, ps = c.page_size;
  const int qn = c.heads * d, kn = c.kv_heads * d, width = qn + 2 * kn;
  std::vector<int> need(S);
  for (int s = 0; s < S; ++s) need[s] = pages_for(c.cached[s] + c.fresh[s] + c.steps - 1, ps);
  const PagedSequences paged = shuffled_pages(rng, need, 2);
  const int num_pages = paged.num_pages;
  const std::vector<std::vector<int32_t>>& pages = paged.pages;

  RopeTable rope;
  rope.rot_dim = d;
  for (int i = 0; i < d / 2; ++i) rope.inv_freq.push_back(static_cast<float>(1.0 / std::pow(1e6, 2.0 * i / d)));
  std::vector<float> wq(d), wk(d);
  for (auto& x : wq) x = bf16_round(1.0f + 0.2f * rng.normal());
  for (auto& x : wk) x = bf16_round(1.0f + 0.2f * rng.normal());

  CpuBackend cpu;
  CudaBackendOptions on_opts, off_opts;
  on_opts.graphs = off_opts.graphs = false;
  on_opts.arena_bytes = off_opts.arena_bytes = 64u << 20;
  on_opts.kv_write_in_head_pass = true;
  off_opts.kv_write_in_head_pass = false;
  CudaBackend on(on_opts), off(off_opts);
  const Tensor wq_h(wq.data(), DType::kF32, {d}), wk_h(wk.data(), DType::kF32, {d});
  const Tensor wq_cpu = cpu.upload(wq_h, DType::kF32), wk_cpu = cpu.upload(wk_h, DType::kF32);
  const Tensor wq_on = on.upload(wq_h, DType::kBF16), wk_on = on.upload(wk_h, DType::kBF16);
  const Tensor wq_off = off.upload(wq_h, DType::kBF16), wk_off = off.upload(wk_h, DType::kBF16);

  // Caches: cached positions random (the same bf16 on every side), every other device row NaN.
  KvLayer kv_cpu = cpu.alloc_kv_layer(num_pages, ps, c.kv_heads, d, d);
  KvLayer kv_on = on.alloc_kv_layer(num_pages, ps, c.kv_heads, d, d);
  KvLayer kv_off = off.alloc_kv_layer(num_pages, ps, c.kv_heads, d, d);
  const size_t cache_n = static_cast<size_t>(num_pages) * ps * kn;
  std::vector<uint16_t> kbits(cache_n, kNanBits), vbits(cache_n, kNanBits);
  for (int s = 0; s < S; ++s)
    for (int pos = 0; pos < c.cached[s]; ++pos) {
      const int64_t row = static_cast<int64_t>(pages[s][pos / ps]) * ps + pos % ps;
      for (int i = 0; i < kn; ++i) {
        const float fk = bf16_round(rng.normal()), fv = bf16_round(rng.normal());
        kv_cpu.k.ptr<float>()[row * kn + i] = fk;
        kv_cpu.v.ptr<float>()[row * kn + i] = fv;
        kbits[row * kn + i] = f32_to_bf16(fk);
        vbits[row * kn + i] = f32_to_bf16(fv);
      }
    }
  for (KvLayer* kv : {&kv_on, &kv_off}) {
    MOELORA_CUDA_CHECK(cudaMemcpy(kv->k.data(), kbits.data(), cache_n * 2, cudaMemcpyHostToDevice));
    MOELORA_CUDA_CHECK(cudaMemcpy(kv->v.data(), vbits.data(), cache_n * 2, cudaMemcpyHostToDevice));
  }

  for (int step = 0; step < c.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const StepBatch b = multi_step_batch(pages, c.cached, c.fresh, step, [](int) { return -1; });
    const int T = b.num_tokens();
    std::vector<float> qkv(static_cast<size_t>(T) * width);
    for (auto& x : qkv) x = bf16_round(rng.normal());
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));

    // The spec: the CPU backend's default (head_norm_rope, then attention).
    cpu.begin_step(b);
    std::vector<float> qkv_cpu = qkv, ref(static_cast<size_t>(T) * qn);
    const Tensor x_cpu(qkv_cpu.data(), DType::kF32, {T, width});
    cpu.rotary_attention(x_cpu.slice_cols(0, qn + kn), x_cpu.slice_cols(qn + kn, kn), c.heads, c.kv_heads, d,
                         c.norms ? wq_cpu : Tensor(), c.norms ? wk_cpu : Tensor(), 1e-6f, rope, kv_cpu, scale,
                         Tensor(ref.data(), DType::kF32, {T, qn}));

    std::vector<std::vector<uint16_t>> out_bits, x_bits;
    for (CudaBackend* gpu : {&on, &off}) {
      const Tensor x = gpu->upload(Tensor(qkv.data(), DType::kF32, {T, width}), DType::kBF16);
      MOELORA_CUDA_CHECK(cudaDeviceSynchronize());  // the upload and the cache fill ran on other streams
      ASSERT_EQ(gpu->begin_step(b).num_tokens(), T);  // eager: no padding
      const Tensor out = gpu->alloc_act(T, qn);
      KvLayer& kv = gpu == &on ? kv_on : kv_off;
      const Tensor wq_dev = gpu == &on ? wq_on : wq_off, wk_dev = gpu == &on ? wk_on : wk_off;
      gpu->rotary_attention(x.slice_cols(0, qn + kn), x.slice_cols(qn + kn, kn), c.heads, c.kv_heads, d,
                            c.norms ? wq_dev : Tensor(), c.norms ? wk_dev : Tensor(), 1e-6f, rope, kv, scale, out);
      gpu->end_step_body(out);
      gpu->synchronize();
      std::vector<uint16_t> o(static_cast<size_t>(T) * qn), xb(static_cast<size_t>(T) * width);
      for (int t = 0; t < T; ++t) {
        const std::vector<uint16_t> row = download(static_cast<const uint16_t*>(out.data()) + t * out.ld(), qn);
        std::copy(row.begin(), row.end(), o.begin() + static_cast<size_t>(t) * qn);
      }
      if (T > 0) xb = download(static_cast<const uint16_t*>(x.data()), xb.size());
      out_bits.push_back(std::move(o));
      x_bits.push_back(std::move(xb));
    }
    EXPECT_EQ(out_bits[0], out_bits[1]) << "attention output differs with the cache write in the head pass";
    EXPECT_EQ(x_bits[0], x_bits[1]) << "rotated q|k differ";
    EXPECT_EQ(download(static_cast<const uint16_t*>(kv_on.k.data()), cache_n),
              download(static_cast<const uint16_t*>(kv_off.k.data()), cache_n))
        << "k cache differs";
    EXPECT_EQ(download(static_cast<const uint16_t*>(kv_on.v.data()), cache_n),
              download(static_cast<const uint16_t*>(kv_off.v.data()), cache_n))
        << "v cache differs";
    std::vector<float> got(out_bits[0].size());
    for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_f32(out_bits[0][i]);
    EXPECT_CLOSE_ROWS(got, ref, T, qn, kAttnTol);
  }
}

std::vector<HeadPassCase> head_pass_cases() {
  return {
      // Qwen3-30B-A3B heads: a prefill chunk beside a cached prefix and a fresh sequence, then decode.
      {32, 4, 128, 16, {40, 0, 7}, {20, 33, 1}, 3},
      // 64-dim heads, an odd page size, one sequence.
      {8, 2, 64, 5, {0}, {9}, 4},
      // 192-dim heads (16 q per kv head), decode only.
      {16, 1, 192, 16, {100, 3}, {1, 1}, 2},
      // RoPE alone: Mixtral's heads (32 / 8 x 128), then 32-dim heads (no head-norm kernel for them).
      {32, 8, 128, 16, {0, 17}, {24, 5}, 3, false},
      {4, 2, 32, 7, {3}, {12}, 3, false},
  };
}
std::string head_pass_name(const ::testing::TestParamInfo<HeadPassCase>& i) { return gtest_safe(i.param.name()); }
INSTANTIATE_TEST_SUITE_P(HeadPass, HeadPassKv, ::testing::ValuesIn(head_pass_cases()), head_pass_name);

}  // namespace
}  // namespace moelora::ops_test
