// Op suite: DeepSeek MLA in the absorbed form, CudaBackend::mla_attention_absorbed
// (kernels/mla_attention.cu) against the CPU reference op (CpuBackend, cpu_mla.cpp), both called
// through the Backend interface on the same inputs. Each case runs a few steps on one cache:
// sequences with positions already cached (random values, random non-contiguous pages), then the
// case's new tokens (prefill chunks and decode tokens mixed), then decode steps that read what the
// earlier steps wrote. Tokens carry adapter slots (-1, an adapter without kv_b LoRA, several ranks).
// Checked per step: the outputs, the cache rows written (exactly the token's c and k_pe), the output
// padding; at the end, that no cache row nobody wrote (NaN on the device) was touched. Graph cases
// run decode steps eagerly, then captured, then replayed with new inputs and other slots per token,
// and must equal, bit for bit, a twin backend that runs the same steps without graphs.
#include <cmath>
#include <memory>
#include <numeric>

#include "backends/cpu/cpu_backend.h"
#include "backends/cuda/cuda_backend.h"
#include "core/tensor.h"
#include "gpukit/dense.h"
#include "gpukit/paging.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

// Both sides compute with the same bf16 kv_b values (the reference gets the GPU copy's rounding of
// FP8) and inputs and cache are bf16-exact. The GPU's tensor-core kernels round four things to bf16
// that the reference keeps in float64: the absorbed query qc (the attention's Q operand), the
// probabilities P (its P V operand, as in the attention kernels), the latent output o (the output
// absorption's operand) and the output itself. Each is at most 2^-9 relative per value (RMS ~2^-9 /
// sqrt(3) = 1.1e-3) and passes through a sum that averages rather than adds it, so a row moves by
// about sqrt(4) x 1.1e-3 = 2.3e-3 RMS, its worst row of a few hundred ~5e-3; float32 vs float64 sums
// add ~1e-6. The bound is the attention kernels' 1e-2 (docs/numerics.md), which have the same roundings
// but the query's; the worst row measured over these cases is 3.4e-3 (H100, 2026-12-07,
// bench/logs/2026-12-07-h100-mla-mla_ops_shard*.log). A wrong head, page, mask, split merge or
// adapter moves a row by O(0.1-1) (the LoRA check below asserts that dropping the kv_b LoRA moves its rows by > 10x this bound).
constexpr double kMlaTol = 1e-2;
constexpr uint16_t kNanBits = 0x7fc0;

struct MlaCase {
  std::string label;
  int heads = 4, nope = 32, rope = 16, v = 32, R = 64;
  std::vector<int> cached, fresh, slot;  // per sequence: positions already cached, new tokens, adapter slot
  std::vector<int> ranks;                // kv_b LoRA rank of each adapter slot (0: the adapter has none on kv_b)
  bool fp8 = false;
  bool table = true;     // pass kv_b's LoRA table (false: nullptr)
  bool graph = false;    // decode only: step 0 eager, step 1 captured, later steps replayed
  int page_size = 16;
  int pass_tokens = 0;   // CudaBackendOptions::mla_max_pass_tokens
  int steps = 2;         // step 0 brings `fresh`, later steps one token per sequence
  std::string name() const {
    std::string s = "MLA(" + label + ",h=" + std::to_string(heads) + ",d=" + std::to_string(nope) + "/" +
                    std::to_string(rope) + "/" + std::to_string(v) + ",R=" + std::to_string(R);
    if (fp8) s += ",fp8";
    if (graph) s += ",graph";
    if (pass_tokens) s += ",pass=" + std::to_string(pass_tokens);
    return s + ")";
  }
};

void PrintTo(const MlaCase& c, std::ostream* os) { *os << c.name(); }

class MlaAbsorbed : public ::testing::TestWithParam<MlaCase> {};

float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

Tensor host_tensor(std::vector<float>& v, int64_t rows, int64_t cols) {
  return Tensor(v.data(), DType::kF32, {rows, cols});
}

int bucket_of(int n) {
  int b = 1;
  while (b < n) b <<= 1;
  return b;
}

TEST_P(MlaAbsorbed, MatchesCpu) {
  MOELORA_REQUIRE_GPU();
  const MlaCase c = GetParam();
  Rng rng(seed_of(c.name()));
  const int S = static_cast<int>(c.cached.size()), W = c.R + c.rope, F = c.nope + c.v;
  const int qw = c.heads * (c.nope + c.rope), ow = c.heads * c.v, ps = c.page_size;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.nope + c.rope));

  // Pages for every position the steps reach, from a shuffled pool with spares.
  std::vector<int> need(S);
  for (int s = 0; s < S; ++s) need[s] = pages_for(c.cached[s] + c.fresh[s] + c.steps - 1, ps);
  const PagedSequences paged = shuffled_pages(rng, need, 3);
  const int num_pages = paged.num_pages;
  const std::vector<std::vector<int32_t>>& pages = paged.pages;
  auto row_of = [&](int s, int pos) { return static_cast<int64_t>(pages[s][pos / ps]) * ps + pos % ps; };

  // kv_b: FP8 block-scaled (the reference gets its exact dequantisation rounded to bf16, which is what
  // the GPU's absorbed copy holds) or bf16.
  const int out_rows = c.heads * F;
  std::vector<float> w_ref(static_cast<size_t>(out_rows) * c.R);
  Fp8Weight f8;
  StoredWeight stored;
  std::vector<float> w_dense;
  if (c.fp8) {
    f8.generate(rng, out_rows, c.R);
    for (size_t i = 0; i < w_ref.size(); ++i) w_ref[i] = bf16_round(f8.deq[i]);
    stored.format = WeightFormat::fp8_block(128, 128);
    stored.data = Tensor(f8.q.data(), DType::kF8E4M3, {out_rows, c.R});
    stored.scale = Tensor(f8.scale.data(), DType::kF32, {f8.row_blocks(), f8.col_blocks()});
    stored.out = out_rows;
    stored.in = c.R;
  } else {
    for (auto& x : w_ref) x = bf16_round(rng.normal(1.0f / std::sqrt(static_cast<float>(c.R))));
    w_dense = w_ref;
    stored = dense_weight(host_tensor(w_dense, out_rows, c.R));
  }
  CpuBackend cpu;
  const LinearWeight w_cpu = cpu.upload_linear(dense_weight(host_tensor(w_ref, out_rows, c.R)));
  CudaBackendOptions opts;
  opts.graphs = c.graph;
  opts.arena_bytes = 64u << 20;
  opts.mla_max_pass_tokens = c.pass_tokens;
  CudaBackend gpu(opts);
  const LinearWeight w_gpu = gpu.upload_linear(stored);
  // Graph cases: a twin without graphs runs every step eagerly on the same inputs, and the graph's
  // steps (capture and replays included) must give its bits. A token's KV splits do not depend on
  // the grid (cuda_plan::mla_token_split; the cases' contexts stay under 128 positions per split of
  // either grid), so the twin's unpadded batch computes every real token exactly as the padded one.
  std::unique_ptr<CudaBackend> twin;
  LinearWeight w_twin;
  if (c.graph) {
    CudaBackendOptions eager_opts = opts;
    eager_opts.graphs = false;
    twin = std::make_unique<CudaBackend>(eager_opts);
    w_twin = twin->upload_linear(stored);
  }

  // kv_b LoRA per adapter slot (one slot more than the case uses, never referenced).
  const int slots = static_cast<int>(c.ranks.size()) + 1;
  LoraModuleTable tab_cpu = cpu.alloc_lora_table(slots, c.R, out_rows);
  LoraModuleTable tab_gpu = gpu.alloc_lora_table(slots, c.R, out_rows);
  LoraModuleTable tab_twin = twin ? twin->alloc_lora_table(slots, c.R, out_rows) : LoraModuleTable{};
  std::vector<std::vector<float>> factors;
  factors.reserve(2 * c.ranks.size());  // `a` below must stay valid while `b` is added
  std::vector<Tensor> keep;
  for (int s = 0; s < static_cast<int>(c.ranks.size()); ++s) {
    const int r = c.ranks[s];
    if (r == 0) {
      cpu.set_lora_slot(tab_cpu, s, Tensor(), Tensor(), 0);
      gpu.set_lora_slot(tab_gpu, s, Tensor(), Tensor(), 0);
      if (twin) twin->set_lora_slot(tab_twin, s, Tensor(), Tensor(), 0);
      continue;
    }
    // A ~ N(0, 1/sqrt(R)), B ~ N(0, 0.5/sqrt(r)): the LoRA moves qc and out by about half their size.
    std::vector<float>& a = factors.emplace_back(static_cast<size_t>(r) * c.R);
    for (auto& x : a) x = bf16_round(rng.normal(1.0f / std::sqrt(static_cast<float>(c.R))));
    std::vector<float>& b = factors.emplace_back(static_cast<size_t>(out_rows) * r);
    for (auto& x : b) x = bf16_round(rng.normal(0.5f / std::sqrt(static_cast<float>(r))));
    const Tensor ah = host_tensor(a, r, c.R), bh = host_tensor(b, out_rows, r);
    keep.push_back(cpu.upload(ah, DType::kF32));
    keep.push_back(cpu.upload(bh, DType::kF32));
    cpu.set_lora_slot(tab_cpu, s, keep[keep.size() - 2], keep.back(), r);
    keep.push_back(gpu.upload(ah, DType::kBF16));
    keep.push_back(gpu.upload(bh, DType::kBF16));
    gpu.set_lora_slot(tab_gpu, s, keep[keep.size() - 2], keep.back(), r);
    if (twin) {
      keep.push_back(twin->upload(ah, DType::kBF16));
      keep.push_back(twin->upload(bh, DType::kBF16));
      twin->set_lora_slot(tab_twin, s, keep[keep.size() - 2], keep.back(), r);
    }
  }
  const LoraModuleTable* lora_cpu = c.table ? &tab_cpu : nullptr;
  const LoraModuleTable* lora_gpu = c.table ? &tab_gpu : nullptr;

  // Latent caches: cached positions random (the same bf16 values on both sides), every other device
  // row NaN. The device cache has one more page, for the padding tokens of graph steps.
  KvLayer kv_cpu = cpu.alloc_kv_layer(num_pages, ps, 1, W, 0);
  KvLayer kv_gpu = gpu.alloc_kv_layer(num_pages, ps, 1, W, 0);
  const int64_t cache_rows = int64_t{num_pages + 1} * ps;
  std::vector<uint16_t> cache(static_cast<size_t>(cache_rows) * W, kNanBits);
  std::vector<char> written(cache_rows, 0);
  for (int s = 0; s < S; ++s)
    for (int pos = 0; pos < c.cached[s]; ++pos) {
      const int64_t row = row_of(s, pos);
      written[row] = 1;
      for (int i = 0; i < W; ++i) {
        const float f = bf16_round(rng.normal());
        kv_cpu.k.ptr<float>()[row * W + i] = f;
        cache[row * W + i] = f32_to_bf16(f);
      }
    }
  MOELORA_CUDA_CHECK(cudaMemcpy(kv_gpu.k.data(), cache.data(), cache.size() * 2, cudaMemcpyHostToDevice));
  KvLayer kv_twin = twin ? twin->alloc_kv_layer(num_pages, ps, 1, W, 0) : KvLayer{};
  if (twin) MOELORA_CUDA_CHECK(cudaMemcpy(kv_twin.k.data(), cache.data(), cache.size() * 2, cudaMemcpyHostToDevice));

  // Device inputs at fixed addresses (a replayed graph reads them there), rows for the largest step
  // (graph steps: padded to their bucket); q and out with row padding.
  const int max_tokens = std::max(S, std::accumulate(c.fresh.begin(), c.fresh.end(), 0));
  const int cap = c.graph ? bucket_of(max_tokens) : max_tokens;
  const int64_t ldq = qw + 8, ldo = ow + 8;
  DeviceArray<uint16_t> dq(cap * ldq), dckv(cap * W), dout(cap * ldo), dout_twin(cap * ldo);

  for (int step = 0; step < c.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Graph steps give each sequence another slot every step (same mix, so the same graph).
    const StepBatch b = multi_step_batch(pages, c.cached, c.fresh, step,
                                         [&](int s) { return c.graph ? c.slot[(s + step) % S] : c.slot[s]; });
    const int T = b.num_tokens();
    std::vector<float> q(static_cast<size_t>(T) * qw), ckv(static_cast<size_t>(T) * W);
    for (auto& x : q) x = bf16_round(rng.normal());
    for (auto& x : ckv) x = bf16_round(rng.normal());

    // Reference, with the case's LoRA and without any (the second call rewrites the same cache rows).
    cpu.begin_step(b);
    std::vector<float> ref(static_cast<size_t>(T) * ow), ref_base(ref.size());
    const Tensor qh = host_tensor(q, T, qw), ckvh = host_tensor(ckv, T, W);
    cpu.mla_attention_absorbed(qh, ckvh.slice_cols(0, c.R), ckvh.slice_cols(c.R, c.rope), w_cpu, lora_cpu, kv_cpu,
                               c.heads, c.nope, c.v, scale, host_tensor(ref, T, ow));
    cpu.mla_attention_absorbed(qh, ckvh.slice_cols(0, c.R), ckvh.slice_cols(c.R, c.rope), w_cpu, nullptr, kv_cpu,
                               c.heads, c.nope, c.v, scale, host_tensor(ref_base, T, ow));

    // Device: inputs first (a replay runs inside begin_step), padding rows zero.
    std::vector<uint16_t> hq(static_cast<size_t>(cap) * ldq, 0), hckv(static_cast<size_t>(cap) * W, 0);
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < qw; ++j) hq[t * ldq + j] = f32_to_bf16(q[t * qw + j]);
      for (int j = 0; j < W; ++j) hckv[t * W + j] = f32_to_bf16(ckv[t * W + j]);
    }
    dq.upload(hq);
    dckv.upload(hckv);
    // Uploads, poisoning and the cache fill ran on the legacy stream, which the backend's
    // non-blocking stream does not wait for.
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    const int Tp = gpu.begin_step(b).num_tokens();
    ASSERT_LE(Tp, cap);
    const Backend::StepMode mode = gpu.step_mode();
    if (c.graph) {
      EXPECT_EQ(mode, step == 0   ? Backend::StepMode::kEager
                      : step == 1 ? Backend::StepMode::kCapture
                                  : Backend::StepMode::kReplay);
    }
    if (mode != Backend::StepMode::kReplay) {
      const Tensor tq = Tensor(dq.get(), DType::kBF16, {Tp, ldq}, Device::kCuda).slice_cols(0, qw);
      const Tensor tckv(dckv.get(), DType::kBF16, {Tp, W}, Device::kCuda);
      const Tensor tout = Tensor(dout.get(), DType::kBF16, {Tp, ldo}, Device::kCuda).slice_cols(0, ow);
      gpu.mla_attention_absorbed(tq, tckv.slice_cols(0, c.R), tckv.slice_cols(c.R, c.rope), w_gpu, lora_gpu, kv_gpu,
                                 c.heads, c.nope, c.v, scale, tout);
      gpu.end_step_body(tout);  // a capture is closed and launched here
    }
    gpu.synchronize();

    const std::vector<uint16_t> got_bits = dout.download();
    std::vector<float> got(static_cast<size_t>(T) * ow);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < ow; ++j) got[t * ow + j] = bf16_to_f32(got_bits[t * ldo + j]);
    EXPECT_CLOSE_ROWS(got, ref, T, ow, kMlaTol);
    std::printf("[ MLA      ] step %d: worst row relative error %.2e (bound %.0e)\n", step,
                compare_rows(got, ref, T, ow).worst_rel, kMlaTol);
    if (twin) {  // the eager twin, on the same device inputs
      ASSERT_EQ(twin->begin_step(b).num_tokens(), T);
      const Tensor tq = Tensor(dq.get(), DType::kBF16, {T, ldq}, Device::kCuda).slice_cols(0, qw);
      const Tensor tckv(dckv.get(), DType::kBF16, {T, W}, Device::kCuda);
      const Tensor tout = Tensor(dout_twin.get(), DType::kBF16, {T, ldo}, Device::kCuda).slice_cols(0, ow);
      twin->mla_attention_absorbed(tq, tckv.slice_cols(0, c.R), tckv.slice_cols(c.R, c.rope), w_twin,
                                   c.table ? &tab_twin : nullptr, kv_twin, c.heads, c.nope, c.v, scale, tout);
      twin->end_step_body(tout);
      twin->synchronize();
      const std::vector<uint16_t> eager_bits = dout_twin.download();
      int differ = 0;
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < ow; ++j) differ += eager_bits[t * ldo + j] != got_bits[t * ldo + j];
      EXPECT_EQ(differ, 0) << "of " << T * ow << " values differ from the eager twin's (mode "
                           << static_cast<int>(mode) << ")";
    }
    bool padding_intact = dout.guard_intact();
    for (int t = 0; t < cap; ++t)
      for (int64_t j = ow; j < ldo; ++j) padding_intact = padding_intact && got_bits[t * ldo + j] == 0xA5A5;
    EXPECT_TRUE(padding_intact) << "the op wrote outside its output columns";

    // The kv_b LoRA must matter where a token has it, or the comparison above could not see it lost.
    for (int t = 0; t < T; ++t) {
      const int s = b.token_slot[t];
      if (!c.table || s < 0 || c.ranks[s] == 0) continue;
      const std::vector<float> r1(ref.begin() + t * ow, ref.begin() + (t + 1) * ow);
      const std::vector<float> r0(ref_base.begin() + t * ow, ref_base.begin() + (t + 1) * ow);
      EXPECT_GT(compare_rows(r0, r1, 1, ow).worst_rel, 10 * kMlaTol) << "token " << t;
    }

    // This step's cache rows hold exactly the tokens' (c, k_pe).
    const std::vector<uint16_t> cache_now = download(static_cast<const uint16_t*>(kv_gpu.k.data()), cache.size());
    for (int t = 0; t < T; ++t) {
      const int64_t row = row_of(b.token_seq[t], b.positions[t]);
      written[row] = 1;
      for (int i = 0; i < W; ++i)
        ASSERT_EQ(cache_now[row * W + i], f32_to_bf16(ckv[t * W + i])) << "token " << t << " value " << i;
    }
    if (step + 1 == c.steps) {  // rows nobody wrote (the padding page aside) were left alone
      for (int64_t row = 0; row < int64_t{num_pages} * ps; ++row) {
        if (written[row]) continue;
        for (int i = 0; i < W; ++i) ASSERT_EQ(cache_now[row * W + i], kNanBits) << "row " << row;
      }
    }
  }
  EXPECT_TRUE(dq.guard_intact() && dckv.guard_intact());
}

std::vector<MlaCase> mla_cases() {
  std::vector<MlaCase> v;
  auto add = [&](MlaCase c) { v.push_back(std::move(c)); };
  // The tiny DeepSeek fixture's shapes (4 heads, 32 + 16, v 32, R 64): decode over short and
  // page-crossing contexts, tokens without adapter, with an adapter lacking kv_b LoRA, and rank 4.
  add({.label = "decode", .cached = {0, 5, 40}, .fresh = {1, 1, 1}, .slot = {-1, 0, 1}, .ranks = {4, 0}});
  // Prefill chunks (from scratch and after a cached prefix) mixed with a decode token, ranks 8 / 3.
  add({.label = "prefill", .cached = {0, 20, 3}, .fresh = {37, 9, 1}, .slot = {0, -1, 1}, .ranks = {8, 3}});
  // The same through passes of 7 tokens (a pass boundary inside a prefill chunk).
  add({.label = "prefill", .cached = {0, 20, 3}, .fresh = {37, 9, 1}, .slot = {0, -1, 1}, .ranks = {8, 3},
       .pass_tokens = 7});
  // No LoRA table at all; long contexts split over KV positions; a page size that is not a power of 2.
  add({.label = "long", .cached = {2500, 700}, .fresh = {1, 1}, .slot = {-1, -1}, .ranks = {}, .table = false,
       .page_size = 5});
  // Odd shapes: 9 heads (a partial head group), cache rows of 71 + 10 = 81 values (odd: the scalar
  // tile path and a latent pair straddling c and k_pe), v 200 (two output passes), ranks 1 and 128.
  add({.label = "odd", .heads = 9, .nope = 24, .rope = 10, .v = 200, .R = 71, .cached = {13, 0, 64},
       .fresh = {2, 5, 1}, .slot = {1, 0, -1}, .ranks = {1, 128}, .page_size = 8});
  // DeepSeek-V3 per rank at tp 8 (16 heads, 128 + 64, v 128, R 512), FP8 kv_b, prefill and decode.
  add({.label = "v3-tp8", .heads = 16, .nope = 128, .rope = 64, .v = 128, .R = 512, .cached = {100, 1000, 0},
       .fresh = {1, 1, 70}, .slot = {0, 1, -1}, .ranks = {16, 64}, .fp8 = true});
  // DeepSeek-V3's 128 heads on one GPU: one decode token over 3000 positions (KV splits + merge).
  add({.label = "v3-long", .heads = 128, .nope = 128, .rope = 64, .v = 128, .R = 512, .cached = {3000},
       .fresh = {1}, .slot = {0}, .ranks = {16}, .fp8 = true});
  // DeepSeek-V3's 128 heads over a batch: a 150-token prefill chunk (three 64-token absorption
  // chunks, wide column chunks in both absorptions) beside decode tokens of other contexts.
  add({.label = "v3-batch", .heads = 128, .nope = 128, .rope = 64, .v = 128, .R = 512, .cached = {0, 300, 40, 1000},
       .fresh = {150, 1, 1, 1}, .slot = {0, -1, 1, 0}, .ranks = {16, 8}, .fp8 = true});
  // Cache rows of 512 + 256 values beside 64 heads: the query and two tiles do not fit, one tile at a time.
  add({.label = "wide-rows", .heads = 64, .nope = 32, .rope = 256, .v = 64, .R = 512, .cached = {70, 5},
       .fresh = {1, 3}, .slot = {-1, 0}, .ranks = {4}});
  // CUDA graphs: 3 sequences padded to 4, slots rotating over the replays, 6 steps.
  add({.label = "decode", .cached = {10, 300, 0}, .fresh = {1, 1, 1}, .slot = {0, -1, 1}, .ranks = {4, 16},
       .graph = true, .steps = 6});
  add({.label = "v3-tp8", .heads = 16, .nope = 128, .rope = 64, .v = 128, .R = 512, .cached = {50, 2000},
       .fresh = {1, 1}, .slot = {0, 1}, .ranks = {8, 32}, .fp8 = true, .graph = true, .steps = 4});
  return v;
}

std::string mla_name(const ::testing::TestParamInfo<MlaCase>& i) { return gtest_safe(i.param.name()); }
INSTANTIATE_TEST_SUITE_P(Mla, MlaAbsorbed, ::testing::ValuesIn(mla_cases()), mla_name);

std::vector<MlaCase> mla_sanitize_cases() {
  return {{.label = "san", .cached = {40, 0}, .fresh = {1, 9}, .slot = {0, -1}, .ranks = {4}, .pass_tokens = 4},
          {.label = "san-odd", .heads = 9, .nope = 24, .rope = 10, .v = 200, .R = 71, .cached = {300}, .fresh = {1},
           .slot = {0}, .ranks = {8}, .page_size = 8}};
}
INSTANTIATE_TEST_SUITE_P(SanitizeMla, MlaAbsorbed, ::testing::ValuesIn(mla_sanitize_cases()), mla_name);

}  // namespace
}  // namespace moelora::ops_test
