// Op suite: paged attention (attention.cuh) against cpu::attention. Each case builds sequences with
// earlier positions already in the cache (random pages, non-contiguous), this step's tokens
// (decode: one per sequence; prefill: chunks, possibly after cached prefixes), runs cache write +
// attention, and checks the outputs, the cache rows written, and that cache rows nobody wrote
// (filled with NaN on the device) never leak into any output.
#include <numeric>

#include "backends/cuda/kernels/attention.cuh"
#include "core/tensor.h"
#include "gpukit/dense.h"
#include "gpukit/paging.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

// P is rounded to bf16 for the P.V product (relative 2^-9 per weight, as FlashAttention) and the
// output once more to bf16: ~3e-3 row-relative rms in the worst layouts seen (one dominant key
// or flat softmax); 1e-2 keeps a 3x margin while a wrong page, head or mask moves a row by O(1).
constexpr double kAttnTol = 1e-2;

struct AttnCase {
  std::vector<int> cached;  // positions already in the cache, per sequence
  std::vector<int> fresh;   // new tokens this step, per sequence
  int heads = 4, kv_heads = 2, dk = 32, dv = 32, page_size = 16;
  int force_mode = 0, num_sms = 132;
  bool graph = false;
  int stages = 0;  // decode pipeline depth forced (0: the plan's)
  int prefill_kernel = 0;  // AttentionPlanOptions::prefill_kernel (2: the wgmma kernel)
  std::string name() const {
    auto list = [](const std::vector<int>& v) {
      if (v.size() > 4) {  // large batches: count and range, not every length
        const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
        return std::to_string(v.size()) + "x" + std::to_string(*lo) + ".." + std::to_string(*hi);
      }
      std::string s;
      for (size_t i = 0; i < v.size(); ++i) s += (i ? "/" : "") + std::to_string(v[i]);
      return s;
    };
    return "ATTN(cached=" + list(cached) + ",new=" + list(fresh) + ",h=" + std::to_string(heads) + "/" +
           std::to_string(kv_heads) + ",d=" + std::to_string(dk) + "/" + std::to_string(dv) +
           ",ps=" + std::to_string(page_size) + (force_mode == 1 ? ",force-decode" : force_mode == 2 ? ",force-prefill" : "") +
           (num_sms != 132 ? ",sms=" + std::to_string(num_sms) : "") + (graph ? ",graph" : "") +
           (stages ? ",stages=" + std::to_string(stages) : "") + (prefill_kernel == 2 ? ",wgmma" : "") + ")";
  }
};

void PrintTo(const AttnCase& c, std::ostream* os) { *os << c.name(); }

class Attention : public ::testing::TestWithParam<AttnCase> {};

TEST_P(Attention, MatchesCpu) {
  MOELORA_REQUIRE_GPU();
  const AttnCase c = GetParam();
  Rng rng(seed_of(c.name()));
  const int S = static_cast<int>(c.cached.size());
  const int kw = c.kv_heads * c.dk, vw = c.kv_heads * c.dv;
  // Pages: every sequence gets enough for cached + fresh, drawn from a shuffled pool with spares.
  StepBatch b;
  std::vector<int> need(S);
  for (int s = 0; s < S; ++s) need[s] = pages_for(c.cached[s] + c.fresh[s], c.page_size);
  const PagedSequences paged = shuffled_pages(rng, need, 3);
  const int num_pages = paged.num_pages;
  b.seq_pages = paged.pages;
  const std::vector<int32_t>& indptr = paged.indptr;
  const std::vector<int32_t>& indices = paged.indices;
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < c.fresh[s]; ++i) {
      b.token_ids.push_back(0);
      b.positions.push_back(c.cached[s] + i);
      b.token_seq.push_back(s);
      b.token_slot.push_back(-1);
    }
  const int T = b.num_tokens();
  // Host (f32) and device (bf16) caches: cached positions random, everything else NaN on the device.
  KvLayer kv;
  kv.page_size = c.page_size, kv.kv_heads = c.kv_heads, kv.k_head_dim = c.dk, kv.v_head_dim = c.dv;
  kv.k = Tensor::empty_host(DType::kF32, {num_pages, c.page_size, kw});
  kv.v = Tensor::empty_host(DType::kF32, {num_pages, c.page_size, vw});
  std::vector<uint16_t> kc(static_cast<size_t>(num_pages) * c.page_size * kw, 0x7fc0);
  std::vector<uint16_t> vc(static_cast<size_t>(num_pages) * c.page_size * vw, 0x7fc0);
  for (int s = 0; s < S; ++s)
    for (int pos = 0; pos < c.cached[s]; ++pos) {
      const int64_t row = static_cast<int64_t>(b.seq_pages[s][pos / c.page_size]) * c.page_size + pos % c.page_size;
      for (int i = 0; i < kw; ++i) {
        const float f = bf16_to_f32(f32_to_bf16(rng.normal()));
        kv.k.ptr<float>()[row * kw + i] = f;
        kc[row * kw + i] = f32_to_bf16(f);
      }
      for (int i = 0; i < vw; ++i) {
        const float f = bf16_to_f32(f32_to_bf16(rng.normal()));
        kv.v.ptr<float>()[row * vw + i] = f;
        vc[row * vw + i] = f32_to_bf16(f);
      }
    }
  DeviceArray<uint16_t> dkc(kc), dvc(vc);
  DevMat q(T, c.heads * c.dk, c.heads * c.dk + 8), k(T, kw), v(T, vw), out(T, c.heads * c.dv, c.heads * c.dv + 8);
  q.randomize(rng, 0.5f);  // scores of a few units: neither flat nor one-hot softmax
  k.randomize(rng);
  v.randomize(rng);
  DeviceArray<int32_t> dpos(std::max<size_t>(T, 1)), dseq(std::max<size_t>(T, 1)), dptr(indptr),
      dind(std::max<size_t>(indices.size(), 1));
  dpos.upload(b.positions);
  dseq.upload(b.token_seq);
  dind.upload(indices);

  const float scale = 1.0f / std::sqrt(static_cast<float>(c.dk));
  std::vector<float> ref(static_cast<size_t>(T) * c.heads * c.dv);
  cpu::AttentionArgs aa{q.host.data(), q.cols, k.host.data(), kw, v.host.data(), vw, ref.data(), c.heads * c.dv,
                        T, c.heads, scale, b.positions.data(), b.token_seq.data(), &b};
  cpu::attention(aa, kv);

  cuda::AttentionParams p;
  p.q = q.ptr(), p.ld_q = q.ld, p.k = k.ptr(), p.ld_k = kw, p.v = v.ptr(), p.ld_v = vw;
  p.out = out.ptr(), p.ld_out = out.ld, p.T = T, p.heads = c.heads, p.scale = scale;
  p.k_cache = reinterpret_cast<__nv_bfloat16*>(dkc.get());
  p.v_cache = reinterpret_cast<__nv_bfloat16*>(dvc.get());
  p.page_size = c.page_size, p.kv_heads = c.kv_heads, p.k_head_dim = c.dk, p.v_head_dim = c.dv;
  p.positions = dpos.get(), p.token_seq = dseq.get(), p.page_indptr = dptr.get(), p.page_indices = dind.get();
  cuda::AttentionPlanOptions opt;
  opt.num_sms = c.num_sms;
  opt.force_mode = c.force_mode;
  opt.decode_stages = c.stages;
  opt.prefill_kernel = c.prefill_kernel;
  if (c.graph) opt.max_positions = 4096;
  const cuda::AttentionPlan plan = cuda::attention_plan(b.positions.data(), b.token_seq.data(), T, c.heads, c.kv_heads, c.dk, c.dv, opt);
  // A forced kernel must be the one that runs (else the case would test the other one).
  if (c.prefill_kernel != 0 && T > 0 && !plan.decode) {
    ASSERT_EQ(plan.prefill_wgmma, c.prefill_kernel == 2);
  }
  DeviceArray<uint8_t> meta(std::max<size_t>(cuda::attention_meta_bytes(plan), 4));
  const size_t wsb = cuda::attention_workspace_bytes(plan, T, c.heads, c.dv);
  DeviceArray<uint8_t> ws(std::max<size_t>(wsb, 4));
  // The buffers were poisoned on the legacy stream; a non-blocking stream does not wait for that.
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t st;
  MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cuda::attention_upload_plan(plan, meta.get(), meta.size(), st);
  if (c.graph) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    MOELORA_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    cuda::launch_attention(p, plan, meta.get(), ws.get(), wsb, st);
    MOELORA_CUDA_CHECK(cudaStreamEndCapture(st, &g));
    MOELORA_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    MOELORA_CUDA_CHECK(cudaGraphLaunch(ge, st));
    MOELORA_CUDA_CHECK(cudaGraphLaunch(ge, st));  // replay twice: same result (idempotent cache write)
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(st));
    MOELORA_CUDA_CHECK(cudaGraphExecDestroy(ge));
    MOELORA_CUDA_CHECK(cudaGraphDestroy(g));
  } else {
    cuda::launch_attention(p, plan, meta.get(), ws.get(), wsb, st);
  }
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(st));
  MOELORA_CUDA_CHECK(cudaStreamDestroy(st));
  EXPECT_CLOSE_ROWS(out.download(), ref, T, c.heads * c.dv, kAttnTol);
  EXPECT_TRUE(out.padding_intact());
  // The cache rows of this step's tokens hold exactly their k / v.
  const std::vector<uint16_t> kgot = dkc.download(), vgot = dvc.download();
  for (int t = 0; t < T; ++t) {
    const int s = b.token_seq[t], pos = b.positions[t];
    const int64_t row = static_cast<int64_t>(b.seq_pages[s][pos / c.page_size]) * c.page_size + pos % c.page_size;
    for (int i = 0; i < kw; ++i) ASSERT_EQ(bf16_to_f32(kgot[row * kw + i]), k.host[t * kw + i]);
    for (int i = 0; i < vw; ++i) ASSERT_EQ(bf16_to_f32(vgot[row * vw + i]), v.host[t * vw + i]);
  }
  EXPECT_TRUE(dkc.guard_intact() && dvc.guard_intact() && ws.guard_intact() && meta.guard_intact());
}

std::vector<AttnCase> attn_cases() {
  std::vector<AttnCase> v;
  auto add = [&](AttnCase c) { v.push_back(c); };
  // Decode, tiny Qwen3/Mixtral heads (4 q / 2 kv x 32): first token, short and page-crossing contexts.
  add({{0}, {1}});
  add({{4, 16, 199}, {1, 1, 1}});
  add({{0}, {0}});  // no tokens at all
  // Largest captured batch: 256 sequences, Qwen3-30B heads (32 / 4 x 128).
  {
    AttnCase c{std::vector<int>(256), std::vector<int>(256, 1), 32, 4, 128, 128, 16};
    Rng r(7);
    for (auto& x : c.cached) x = r.integer(0, 300);
    add(c);
  }
  // Long contexts split over KV (flash-decoding), non-power-of-two pages too.
  add({{3000, 1200}, {1, 1}, 32, 4, 128, 128, 16});
  add({{2500}, {1}, 8, 1, 64, 64, 5, 0, 16});
  // Head dims: DeepSeek MLA tiny (48/32, MHA), 48/48, 192/128 with 16 heads per kv head, 20 per kv head.
  add({{30, 7}, {1, 1}, 4, 4, 48, 32, 16});
  add({{65}, {1}, 6, 2, 48, 48, 8});
  add({{500, 33}, {1, 1}, 16, 1, 192, 128, 16, 0, 8});
  add({{77}, {1}, 20, 1, 64, 64, 16});
  // Prefill: from scratch, after a cached prefix (chunked prefill), mixed with decode tokens.
  add({{0}, {37}});
  add({{20, 0}, {30, 9}, 16, 2, 128, 128, 16});
  add({{50, 3, 0}, {1, 17, 1}, 4, 4, 48, 32, 16});
  add({{10}, {70}, 20, 1, 64, 64, 7});
  add({{0, 40}, {64, 64}, 32, 4, 128, 128, 16});
  add({{100}, {5}, 8, 8, 192, 128, 16});
  // The decode kernel on multi-token sequences, the prefill kernel on decode tokens.
  add({{20, 0}, {30, 9}, 16, 2, 128, 128, 16, 1, 4});
  add({{4, 16, 199}, {1, 1, 1}, 4, 2, 32, 32, 16, 2});
  // Every pipeline depth the decode kernel takes, on contexts that end mid-tile and cross pages,
  // with splits; one with 16 query heads per block.
  for (int st : {2, 3, 4}) {
    AttnCase c{{700, 20, 129, 0}, {1, 1, 1, 1}, 32, 4, 128, 128, 16, 0, 16};
    c.stages = st;
    add(c);
    AttnCase d{{333, 64}, {1, 1}, 16, 1, 192, 128, 16, 0, 8};
    d.stages = st;
    add(d);
  }
  // CUDA graph: plan sized for 4096 positions, replayed.
  {
    AttnCase c{{700, 20}, {1, 1}, 32, 4, 128, 128, 16};
    c.graph = true;
    add(c);
  }
  // The wgmma prefill kernel (head dims multiples of 64): 128 rows a block, 64-position tiles.
  // Qwen3 heads from scratch over many tiles (last one partial), after a long cached prefix
  // (chunked prefill), beside decode tokens, odd page sizes; group 20 (120 of a block's 128 rows,
  // the second warpgroup part-empty), a group of 4 with 3 tokens (one warp's rows), MHA with 128
  // tokens a block, DeepSeek's 192/128, 64/64; a graph replay.
  auto wg = [&](AttnCase c) {
    c.prefill_kernel = 2;
    add(c);
  };
  wg({{0}, {300}, 32, 4, 128, 128, 16});
  wg({{0, 40}, {64, 64}, 32, 4, 128, 128, 16});
  wg({{1000}, {77}, 32, 4, 128, 128, 16});
  wg({{20, 0, 5}, {30, 9, 1}, 16, 2, 128, 128, 16});
  wg({{10}, {70}, 20, 1, 64, 64, 7});
  wg({{33}, {3}, 4, 1, 64, 64, 5});
  wg({{0}, {130}, 16, 16, 192, 128, 16});
  wg({{100, 0}, {5, 200}, 8, 8, 192, 128, 16});
  wg({{129, 63}, {65, 1}, 8, 1, 192, 128, 3});
  {
    AttnCase c{{64, 0}, {20, 33}, 32, 4, 128, 128, 16};
    c.graph = true;
    wg(c);
  }
  // Head dims without a tensor-core instance: the generic kernel (attention_generic.cu), decode,
  // prefill after a cached prefix and mixed steps; k != v both ways, k a multiple of 8 but not 16,
  // the 256 limit, odd page sizes, contexts past one 32-position chunk and long ones, a graph.
  add({{30, 7, 0}, {1, 1, 1}, 4, 2, 80, 48, 16});
  add({{50, 3, 0}, {1, 17, 1}, 4, 2, 80, 48, 16});
  add({{0}, {45}, 6, 3, 16, 16, 5});
  add({{33}, {20}, 2, 2, 96, 160, 8});
  add({{65, 0}, {1, 31}, 3, 1, 40, 24, 7});
  add({{70, 200}, {1, 1}, 8, 1, 256, 256, 16});
  add({{3000}, {1}, 4, 2, 80, 48, 16});
  add({{64, 63}, {1, 1}, 4, 4, 64, 48, 16});  // DeepSeek-shaped decompressed MLA (nope + rope 64, v 48)
  add({{25, 0}, {1, 6}, 2, 1, 32, 20, 16});   // v not a multiple of 8: scalar V reads and stores
  {
    AttnCase c{{0, 45}, {9, 1}, 4, 1, 64, 32, 16};
    c.graph = true;
    add(c);
  }
  return v;
}

std::string attn_name(const ::testing::TestParamInfo<AttnCase>& i) { return gtest_safe(i.param.name()); }
INSTANTIATE_TEST_SUITE_P(Attn, Attention, ::testing::ValuesIn(attn_cases()), attn_name);

std::vector<AttnCase> attn_sanitize_cases() {
  return {{{300, 40}, {1, 1}, 4, 2, 32, 32, 16, 0, 8},  // decode with splits + combine
          {{10, 0}, {9, 5}, 4, 2, 48, 32, 5},             // prefill, odd page size
          {{30}, {1}, 16, 1, 192, 128, 16},
          {{40, 0}, {1, 12}, 4, 2, 80, 48, 7},           // the generic kernel
          {{10, 0}, {9, 70}, 8, 2, 64, 64, 16, 0, 132, false, 0, 2}};  // the wgmma prefill kernel
}
INSTANTIATE_TEST_SUITE_P(SanitizeAttn, Attention, ::testing::ValuesIn(attn_sanitize_cases()), attn_name);

}  // namespace
}  // namespace moelora::ops_test
