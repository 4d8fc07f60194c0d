// Op suite: elementwise kernels (elementwise.cuh) and FP8 activation quantisation (fp8_quant.cuh)
// against the CPU reference. Inputs are bf16 values the CPU sees exactly.
#include <cstring>

#include "backends/cuda/kernels/attention.cuh"
#include "backends/cuda/kernels/elementwise.cuh"
#include "backends/cuda/kernels/fp8_quant.cuh"
#include "gpukit/dense.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

// One bf16 rounding of each output (relative 2^-9 = 2.0e-3 at worst per element) on top of f32 vs
// f64 arithmetic differences (~1e-7): row-relative L2 errors stay under 3e-3; 4e-3 leaves margin
// and still catches any wrong element (an index or pairing bug moves a row by O(1)).
constexpr double kOneRounding = 4e-3;

struct EltCase {
  std::string op;
  int T = 1, cols = 128, group = 128, ld_pad = 0;
  int heads = 1, stride = 0, rot_off = 0, rot = 0;
  bool inter = false;
  int add_pad = 0;  // ADD_RMSNORM: row padding of the added tensor (its own alignment)
  int kv_heads = 0;  // HEAD_NORM_ROPE(_KV): k heads after the `heads` q heads (head_dim = stride)
  int page_size = 16;  // HEAD_NORM_ROPE_KV: the paged cache's
  std::string name() const {
    std::string s = op + "(T=" + std::to_string(T) + ",cols=" + std::to_string(cols);
    if (op == "RMSNORM" || op == "ADD_RMSNORM") s += ",group=" + std::to_string(group);
    if (op == "ROPE")
      s += ",heads=" + std::to_string(heads) + ",stride=" + std::to_string(stride) + ",off=" + std::to_string(rot_off) +
           ",rot=" + std::to_string(rot) + (inter ? ",interleaved" : ",neox");
    if (ld_pad) s += ",ld+" + std::to_string(ld_pad);
    if (add_pad) s += ",add_ld+" + std::to_string(add_pad);
    if (op == "HEAD_NORM_ROPE" || op == "HEAD_NORM_ROPE_KV" || op == "ROPE_KV")
      s += ",heads=" + std::to_string(heads) + "+" + std::to_string(kv_heads) + ",d=" + std::to_string(stride);
    if (op == "HEAD_NORM_ROPE_KV" || op == "ROPE_KV") s += ",ps=" + std::to_string(page_size);
    return s + ")";
  }
};

void PrintTo(const EltCase& c, std::ostream* os) { *os << c.name(); }

class Elementwise : public ::testing::TestWithParam<EltCase> {};

// fp8_quant over the case's rows x [T, cols] (row stride ld) into q [T, cols] and scales s.
cuda::Fp8QuantParams quant_params(DevMat& x, int ld, const EltCase& c, uint8_t* q, float* scales) {
  cuda::Fp8QuantParams p;
  p.x = x.ptr();
  p.ld_x = ld;
  p.M = c.T;
  p.K = c.cols;
  p.q = q;
  p.ld_q = c.cols;
  p.scales = scales;
  return p;
}

void run_case(const EltCase& c) {
  Rng rng(seed_of(c.name()));
  cudaStream_t st = nullptr;
  const int ld = c.cols + c.ld_pad;
  if (c.op == "EMBED") {
    const int vocab = 300;
    DevMat table(vocab, c.cols);
    table.randomize(rng);
    std::vector<int32_t> ids(c.T);
    for (int t = 0; t < c.T; ++t) ids[t] = rng.integer(0, vocab - 1);
    if (c.T > 2) ids[1] = vocab + 5;  // out of range: a zero row, no out-of-bounds read
    DeviceArray<int32_t> dids(std::max<size_t>(ids.size(), 1));
    dids.upload(ids);
    DevMat out(c.T, c.cols, ld);
    cuda::EmbedParams p{table.ptr(), vocab, c.cols, dids.get(), c.T, out.ptr(), ld};
    cuda::launch_embed(p, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ref(c.T * static_cast<size_t>(c.cols), 0.0f);
    for (int t = 0; t < c.T; ++t)
      if (ids[t] < vocab) std::memcpy(&ref[t * c.cols], &table.host[ids[t] * c.cols], c.cols * sizeof(float));
    EXPECT_EQ(out.download(), ref);  // a copy: exact
    EXPECT_TRUE(out.padding_intact());
  } else if (c.op == "RMSNORM" || c.op == "RMSNORM_INPLACE") {
    DevMat x(c.T, c.cols, ld), w(1, c.group);
    x.randomize(rng, 2.0f);
    w.randomize(rng);
    DevMat out(c.T, c.cols, ld);
    const bool inplace = c.op == "RMSNORM_INPLACE";
    cuda::RmsNormParams p{x.ptr(), ld, w.ptr(), c.group, c.cols, c.T, 1e-6f, inplace ? x.ptr() : out.ptr(), ld};
    cuda::launch_rmsnorm(p, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ref(x.host.size());
    cpu::rmsnorm(x.host.data(), c.cols, c.T, c.cols, w.host.data(), c.group, 1e-6f, ref.data(), c.cols);
    const DevMat& o = inplace ? x : out;
    EXPECT_CLOSE_ROWS(o.download(), ref, c.T, c.cols, kOneRounding);
    EXPECT_TRUE(o.padding_intact());
  } else if (c.op == "ADD_RMSNORM") {
    // The fused residual step (Backend::add_rmsnorm) against launch_add then launch_rmsnorm on the
    // same inputs: bit for bit, the written-back sum and the normed output; and the CPU reference.
    const int lda = c.cols + c.add_pad;
    DevMat h(c.T, c.cols, ld), h2(c.T, c.cols, ld), a(c.T, c.cols, lda), w(1, c.group);
    h.randomize(rng, 2.0f);
    h2.host = h.host;
    h2.upload();
    a.randomize(rng, 2.0f);
    w.randomize(rng);
    DevMat out(c.T, c.cols, ld), out2(c.T, c.cols, ld);
    cuda::RmsNormParams p{h.ptr(), ld, w.ptr(), c.group, c.cols, c.T, 1e-6f, out.ptr(), ld};
    p.add = a.ptr();
    p.ld_add = lda;
    p.sum = h.ptr();
    p.ld_sum = ld;
    cuda::launch_rmsnorm(p, st);
    cuda::launch_add(cuda::AddParams{a.ptr(), lda, h2.ptr(), ld, c.T, c.cols}, st);
    cuda::launch_rmsnorm(cuda::RmsNormParams{h2.ptr(), ld, w.ptr(), c.group, c.cols, c.T, 1e-6f, out2.ptr(), ld}, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out_v = out.download();
    EXPECT_EQ(h.dev.download(), h2.dev.download()) << "residual sum's bits differ from launch_add's";
    EXPECT_EQ(out.dev.download(), out2.dev.download()) << "normed output's bits differ from launch_rmsnorm's";
    std::vector<float> ref_sum(h.host.size()), ref(h.host.size());
    for (size_t i = 0; i < ref_sum.size(); ++i) ref_sum[i] = bf16_to_f32(f32_to_bf16(h.host[i] + a.host[i]));
    cpu::rmsnorm(ref_sum.data(), c.cols, c.T, c.cols, w.host.data(), c.group, 1e-6f, ref.data(), c.cols);
    EXPECT_CLOSE_ROWS(out_v, ref, c.T, c.cols, kOneRounding);
    EXPECT_TRUE(h.padding_intact() && out.padding_intact());
  } else if (c.op == "HEAD_NORM_ROPE") {
    // Qwen3's q/k norms + rotation in one launch against launch_rmsnorm (q heads, k heads) then
    // launch_rope over both: bit for bit; and against the CPU reference.
    const int d = c.stride, heads = c.heads + c.kv_heads, cols = heads * d;
    DevMat x(c.T, cols, cols + c.ld_pad), wq(1, d), wk(1, d);
    x.randomize(rng, 2.0f);
    DevMat x2(c.T, cols, cols + c.ld_pad);
    x2.host = x.host;
    x2.upload();
    wq.randomize(rng);
    wk.randomize(rng);
    std::vector<int32_t> pos(c.T);
    for (int t = 0; t < c.T; ++t) pos[t] = t < 3 ? t : rng.integer(0, 200000);
    RopeTable rt;
    rt.rot_dim = d;
    rt.attention_factor = c.ld_pad ? 1.25f : 1.0f;
    for (int i = 0; i < d / 2; ++i) rt.inv_freq.push_back(static_cast<float>(1.0 / std::pow(1e6, 2.0 * i / d)));
    DeviceArray<int32_t> dpos(std::max<size_t>(pos.size(), 1));
    dpos.upload(pos);
    DeviceArray<float> dinv(rt.inv_freq);
    cuda::HeadNormRopeParams p;
    p.x = x.ptr();
    p.ld_x = x.ld;
    p.T = c.T;
    p.q_heads = c.heads;
    p.kv_heads = c.kv_heads;
    p.head_dim = d;
    p.q_norm = wq.ptr();
    p.k_norm = wk.ptr();
    p.eps = 1e-6f;
    p.positions = dpos.get();
    p.inv_freq = dinv.get();
    p.attention_factor = rt.attention_factor;
    cuda::launch_head_norm_rope(p, st);
    const int qc = c.heads * d;
    cuda::launch_rmsnorm(cuda::RmsNormParams{x2.ptr(), x2.ld, wq.ptr(), d, qc, c.T, 1e-6f, x2.ptr(), x2.ld}, st);
    cuda::launch_rmsnorm(
        cuda::RmsNormParams{x2.ptr() + qc, x2.ld, wk.ptr(), d, c.kv_heads * d, c.T, 1e-6f, x2.ptr() + qc, x2.ld}, st);
    cuda::launch_rope(cuda::RopeParams{x2.ptr(), x2.ld, c.T, dpos.get(), heads, d, 0, d, false, dinv.get(),
                                       rt.attention_factor},
                      st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = x.download();
    EXPECT_EQ(x.dev.download(), x2.dev.download()) << "bits differ from rmsnorm + rmsnorm + rope";
    std::vector<float> ref(x.host.size());
    cpu::rmsnorm(x.host.data(), cols, c.T, qc, wq.host.data(), d, 1e-6f, ref.data(), cols);
    cpu::rmsnorm(x.host.data() + qc, cols, c.T, c.kv_heads * d, wk.host.data(), d, 1e-6f, ref.data() + qc, cols);
    for (auto& r : ref) r = bf16_to_f32(f32_to_bf16(r));  // the norm's bf16 output feeds the rotation
    cpu::rope(ref.data(), cols, c.T, pos.data(), heads, d, 0, rt);
    EXPECT_CLOSE_ROWS(got, ref, c.T, cols, kOneRounding);
    EXPECT_TRUE(x.padding_intact());
  } else if (c.op == "HEAD_NORM_ROPE_KV" || c.op == "ROPE_KV") {
    // A rotation pass with the cache write (CudaBackend::rotary_attention): Qwen3's head norm +
    // RoPE, or RoPE alone (Mixtral) over the q | k heads. x's bits are the plain pass's, and the
    // cache rows of the step's tokens hold exactly what launch_kv_cache_write stores from them (the
    // rotated k heads, v); no other row is touched. Tokens of 3 sequences at scattered positions,
    // pages shuffled.
    const bool norms = c.op == "HEAD_NORM_ROPE_KV";
    const int d = c.stride, heads = c.heads + c.kv_heads, cols = heads * d, kvw = c.kv_heads * d, qc = c.heads * d;
    DevMat x(c.T, cols, cols + c.ld_pad), x2(c.T, cols, cols + c.ld_pad), v(c.T, kvw, kvw + 8), wq(1, d), wk(1, d);
    x.randomize(rng, 2.0f);
    x2.host = x.host;
    x2.upload();
    v.randomize(rng);
    wq.randomize(rng);
    wk.randomize(rng);
    constexpr int kSeqs = 3, kMaxPos = 300;
    const int pages_per_seq = (kMaxPos + c.page_size - 1) / c.page_size, num_pages = kSeqs * pages_per_seq + 2;
    std::vector<int32_t> pool(num_pages), indptr{0}, indices, pos(c.T), seq(c.T);
    for (int i = 0; i < num_pages; ++i) pool[i] = i;
    for (int i = num_pages - 1; i > 0; --i) std::swap(pool[i], pool[rng.integer(0, i)]);
    for (int s = 0; s < kSeqs; ++s) {
      indices.insert(indices.end(), pool.begin() + s * pages_per_seq, pool.begin() + (s + 1) * pages_per_seq);
      indptr.push_back(static_cast<int32_t>(indices.size()));
    }
    std::vector<std::vector<bool>> taken(kSeqs, std::vector<bool>(kMaxPos, false));
    for (int t = 0; t < c.T; ++t) {  // distinct positions per sequence, as a step has them
      seq[t] = t % kSeqs;
      do pos[t] = rng.integer(0, kMaxPos - 1);
      while (taken[seq[t]][pos[t]]);
      taken[seq[t]][pos[t]] = true;
    }
    RopeTable rt;
    rt.rot_dim = d;
    for (int i = 0; i < d / 2; ++i) rt.inv_freq.push_back(static_cast<float>(1.0 / std::pow(1e6, 2.0 * i / d)));
    DeviceArray<int32_t> dpos(std::max<size_t>(pos.size(), 1)), dseq(std::max<size_t>(seq.size(), 1)), dptr(indptr),
        dind(indices);
    dpos.upload(pos);
    dseq.upload(seq);
    DeviceArray<float> dinv(rt.inv_freq);
    const size_t cache_n = static_cast<size_t>(num_pages) * c.page_size * kvw;
    DeviceArray<uint16_t> kc(std::vector<uint16_t>(cache_n, 0x7fc0)), vc(std::vector<uint16_t>(cache_n, 0x7fc0));
    DeviceArray<uint16_t> kc2(std::vector<uint16_t>(cache_n, 0x7fc0)), vc2(std::vector<uint16_t>(cache_n, 0x7fc0));
    cuda::KvCacheWrite w;
    w.k_cache = reinterpret_cast<__nv_bfloat16*>(kc.get());
    w.v_cache = reinterpret_cast<__nv_bfloat16*>(vc.get());
    w.v = v.ptr(), w.ld_v = v.ld, w.page_size = c.page_size;
    w.token_seq = dseq.get(), w.page_indptr = dptr.get(), w.page_indices = dind.get();
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    // Then the reference: the plain pass, then the attention's cache write.
    if (norms) {
      cuda::HeadNormRopeParams p;
      p.x = x.ptr(), p.ld_x = x.ld, p.T = c.T, p.q_heads = c.heads, p.kv_heads = c.kv_heads, p.head_dim = d;
      p.q_norm = wq.ptr(), p.k_norm = wk.ptr(), p.eps = 1e-6f, p.positions = dpos.get(), p.inv_freq = dinv.get();
      cuda::HeadNormRopeParams p2 = p;
      p2.x = x2.ptr();
      p.cache = w;
      cuda::launch_head_norm_rope(p, st);
      cuda::launch_head_norm_rope(p2, st);
    } else {
      cuda::RopeParams p{x.ptr(), x.ld, c.T, dpos.get(), heads, d, 0, d, false, dinv.get(), 1.0f};
      cuda::RopeParams p2 = p;
      p2.x = x2.ptr();
      p.kv_first_head = c.heads;
      p.cache = w;
      cuda::launch_rope(p, st);
      cuda::launch_rope(p2, st);
    }
    cuda::AttentionParams a;
    a.k = x2.ptr() + qc, a.ld_k = x2.ld, a.v = v.ptr(), a.ld_v = v.ld, a.T = c.T;
    a.k_cache = reinterpret_cast<__nv_bfloat16*>(kc2.get());
    a.v_cache = reinterpret_cast<__nv_bfloat16*>(vc2.get());
    a.page_size = c.page_size, a.kv_heads = c.kv_heads, a.k_head_dim = d, a.v_head_dim = d;
    a.positions = dpos.get(), a.token_seq = dseq.get(), a.page_indptr = dptr.get(), a.page_indices = dind.get();
    cuda::launch_kv_cache_write(a, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(x.dev.download(), x2.dev.download()) << "the head pass's bits changed with the cache write";
    EXPECT_EQ(kc.download(), kc2.download()) << "k cache differs from launch_kv_cache_write's";
    EXPECT_EQ(vc.download(), vc2.download()) << "v cache differs from launch_kv_cache_write's";
    // And the rows written are the step's (so the comparison above is not NaN against NaN only).
    size_t written = 0;
    for (uint16_t b : kc.download()) written += b != 0x7fc0;
    EXPECT_GE(written, static_cast<size_t>(c.T) * kvw * 9 / 10);  // a bf16 equal to the poison is rare
    EXPECT_TRUE(x.padding_intact() && kc.guard_intact() && vc.guard_intact());
  } else if (c.op == "ROPE") {
    const int cols = c.heads * c.stride;
    DevMat x(c.T, cols, cols + c.ld_pad);
    x.randomize(rng);
    std::vector<int32_t> pos(c.T);
    for (int t = 0; t < c.T; ++t) pos[t] = t < 3 ? t : rng.integer(0, 200000);
    RopeTable rt;
    rt.rot_dim = c.rot;
    rt.interleaved = c.inter;
    rt.attention_factor = c.inter ? 1.25f : 1.0f;
    for (int i = 0; i < c.rot / 2; ++i)
      rt.inv_freq.push_back(static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / c.rot)));
    DeviceArray<int32_t> dpos(std::max<size_t>(pos.size(), 1));
    dpos.upload(pos);
    DeviceArray<float> dinv(rt.inv_freq);
    cuda::RopeParams p{x.ptr(), x.ld, c.T, dpos.get(), c.heads, c.stride, c.rot_off, c.rot, c.inter, dinv.get(),
                       rt.attention_factor};
    cuda::launch_rope(p, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ref = x.host;
    cpu::rope(ref.data(), cols, c.T, pos.data(), c.heads, c.stride, c.rot_off, rt);
    EXPECT_CLOSE_ROWS(x.download(), ref, c.T, cols, kOneRounding);
    EXPECT_TRUE(x.padding_intact());
  } else if (c.op == "SILU_MUL") {
    DevMat gu(c.T, 2 * c.cols, 2 * c.cols + c.ld_pad);  // gate | up halves of one tensor, as the model has them
    gu.randomize(rng, 2.0f);
    DevMat out(c.T, c.cols, ld);
    cuda::SiluMulParams p{gu.ptr(), gu.ld, gu.ptr() + c.cols, gu.ld, c.T, c.cols, out.ptr(), ld};
    cuda::launch_silu_mul(p, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ref(c.T * static_cast<size_t>(c.cols));
    cpu::silu_mul(gu.host.data(), 2 * c.cols, gu.host.data() + c.cols, 2 * c.cols, c.T, c.cols, ref.data(), c.cols);
    EXPECT_CLOSE_ROWS(out.download(), ref, c.T, c.cols, kOneRounding);
    EXPECT_TRUE(out.padding_intact());
  } else if (c.op == "ADD") {
    DevMat x(c.T, c.cols, ld), io(c.T, c.cols, ld);
    x.randomize(rng);
    io.randomize(rng);
    cuda::AddParams p{x.ptr(), ld, io.ptr(), ld, c.T, c.cols};
    cuda::launch_add(p, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ref(io.host.size());
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = x.host[i] + io.host[i];
    EXPECT_CLOSE_ROWS(io.download(), ref, c.T, c.cols, kOneRounding);
    EXPECT_TRUE(io.padding_intact());
  } else if (c.op == "GATHER_BF16" || c.op == "GATHER_F32") {
    const bool f32 = c.op == "GATHER_F32";
    const int src_rows = c.T + 5;
    std::vector<int32_t> rows(c.T);
    for (int r = 0; r < c.T; ++r) rows[r] = rng.integer(0, src_rows - 1);
    DeviceArray<int32_t> drows(std::max<size_t>(rows.size(), 1));
    drows.upload(rows);
    if (f32) {
      std::vector<float> x(src_rows * static_cast<size_t>(ld));
      for (auto& v : x) v = rng.normal();
      DeviceArray<float> dx(x), dout(c.T * static_cast<size_t>(c.cols) + 1);
      cuda::GatherRowsParams p{dx.get(), ld, drows.get(), c.T, c.cols, 4, dout.get(), c.cols};
      cuda::launch_gather_rows(p, st);
      MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> got = dout.download();
      for (int r = 0; r < c.T; ++r)
        for (int j = 0; j < c.cols; ++j) ASSERT_EQ(got[r * c.cols + j], x[rows[r] * ld + j]);
      EXPECT_TRUE(dout.guard_intact());
    } else {
      DevMat x(src_rows, c.cols, ld), out(c.T, c.cols, ld);
      x.randomize(rng);
      cuda::GatherRowsParams p{x.ptr(), ld, drows.get(), c.T, c.cols, 2, out.ptr(), ld};
      cuda::launch_gather_rows(p, st);
      MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> ref(c.T * static_cast<size_t>(c.cols));
      for (int r = 0; r < c.T; ++r) std::memcpy(&ref[r * c.cols], &x.host[rows[r] * c.cols], c.cols * sizeof(float));
      EXPECT_EQ(out.download(), ref);
      EXPECT_TRUE(out.padding_intact());
    }
  } else if (c.op == "MLA_SPLIT") {
    const int heads = c.heads, nope = 32, rope = 16, vd = 32;
    DevMat kv(c.T, heads * (nope + vd)), pe(c.T, rope), k(c.T, heads * (nope + rope), heads * (nope + rope) + c.ld_pad),
        v(c.T, heads * vd);
    kv.randomize(rng);
    pe.randomize(rng);
    cuda::MlaSplitKvParams p{kv.ptr(), kv.ld, pe.ptr(), pe.ld, c.T, heads, nope, rope, vd, k.ptr(), k.ld, v.ptr(), v.ld};
    cuda::launch_mla_split_kv(p, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> rk(k.host.size()), rv(v.host.size());
    for (int t = 0; t < c.T; ++t)
      for (int h = 0; h < heads; ++h) {
        for (int d = 0; d < nope; ++d) rk[t * k.cols + h * (nope + rope) + d] = kv.host[t * kv.cols + h * (nope + vd) + d];
        for (int d = 0; d < rope; ++d) rk[t * k.cols + h * (nope + rope) + nope + d] = pe.host[t * rope + d];
        for (int d = 0; d < vd; ++d) rv[t * v.cols + h * vd + d] = kv.host[t * kv.cols + h * (nope + vd) + nope + d];
      }
    EXPECT_EQ(k.download(), rk);
    EXPECT_EQ(v.download(), rv);
    EXPECT_TRUE(k.padding_intact() && v.padding_intact());
  } else if (c.op == "CONVERT") {
    DevMat x(c.T, c.cols, ld);
    x.randomize(rng, 3.0f);
    DeviceArray<float> f(std::max<size_t>(c.T * static_cast<size_t>(c.cols), 1));
    cuda::ConvertParams p1{x.ptr(), ld, f.get(), c.cols, c.T, c.cols};
    cuda::launch_bf16_to_f32(p1, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> fh = f.download();
    fh.resize(x.host.size());
    EXPECT_EQ(fh, x.host);
    // f32 -> bf16 rounds like core/dtype.h (nearest even).
    std::vector<float> src(x.host.size());
    for (auto& v : src) v = rng.normal(5.0f);
    f.upload(src);
    DevMat back(c.T, c.cols, ld);
    cuda::ConvertParams p2{f.get(), c.cols, back.ptr(), ld, c.T, c.cols};
    cuda::launch_f32_to_bf16(p2, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(back.download(), round_bf16(src));
    EXPECT_TRUE(back.padding_intact() && f.guard_intact());
  } else if (c.op == "FP8_QUANT") {
    // Bit-exact with cpu::quantize_fp8_per_token_group, both scale layouts.
    DevMat x(c.T, c.cols, ld);
    x.randomize(rng, 3.0f);
    if (c.T > 1) std::fill(x.host.begin() + c.cols, x.host.begin() + c.cols + std::min(c.cols, 128), 0.0f);  // a zero group
    x.upload();
    const int groups = (c.cols + 127) / 128;
    std::vector<uint8_t> qref(c.T * static_cast<size_t>(c.cols));
    std::vector<float> sref(c.T * static_cast<size_t>(groups));
    cpu::quantize_fp8_per_token_group(x.host.data(), c.T, c.cols, 128, qref.data(), sref.data());
    for (int layout = 0; layout < 2; ++layout) {
      DeviceArray<uint8_t> q(std::max<size_t>(qref.size(), 1));
      DeviceArray<float> s(std::max<size_t>(sref.size(), 1));
      cuda::Fp8QuantParams p = quant_params(x, ld, c, q.get(), s.get());
      p.layout = layout ? cuda::Fp8ScaleLayout::kGroupMajor : cuda::Fp8ScaleLayout::kTokenMajor;
      p.scale_ld = layout ? c.T : groups;
      cuda::launch_fp8_quant_per_token(p, st);
      MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<uint8_t> qg = q.download();
      std::vector<float> sg = s.download();
      qg.resize(qref.size());
      EXPECT_EQ(qg, qref) << "layout " << layout;
      for (int t = 0; t < c.T; ++t)
        for (int g = 0; g < groups; ++g)
          ASSERT_EQ(sg[layout ? g * c.T + t : t * groups + g], sref[t * groups + g]) << "t " << t << " g " << g;
      EXPECT_TRUE(q.guard_intact() && s.guard_intact());
    }
  } else if (c.op == "FP8_SPLIT") {
    // The split form (fp8_quant.cuh): scale is the power of two putting each group's amax in
    // [128, 256), and x = scale * (e4m3(q) + e4m3(q_lo)) exactly for every element within 2^9 of
    // the amax; smaller elements are off by at most 2^-10 * scale. Values over many binades.
    DevMat x(c.T, c.cols, ld);
    for (auto& v : x.host) v = bf16_to_f32(f32_to_bf16(rng.normal(1.0f) * std::ldexp(1.0f, rng.integer(-14, 6))));
    if (c.T > 1) std::fill(x.host.begin() + c.cols, x.host.begin() + c.cols + std::min(c.cols, 128), 0.0f);  // a zero group
    x.upload();
    const int groups = (c.cols + 127) / 128;
    DeviceArray<uint8_t> q(std::max<size_t>(c.T * static_cast<size_t>(c.cols), 1)), ql(q.size());
    DeviceArray<float> s(std::max<size_t>(c.T * static_cast<size_t>(groups), 1));
    cuda::Fp8QuantParams p = quant_params(x, ld, c, q.get(), s.get());
    p.q_lo = ql.get();
    p.scale_ld = groups;
    cuda::launch_fp8_quant_per_token(p, st);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint8_t> hi = q.download(), lo = ql.download();
    const std::vector<float> sc = s.download();
    int exact = 0, small = 0;
    for (int t = 0; t < c.T; ++t)
      for (int g = 0; g < groups; ++g) {
        const int c0 = g * 128, c1 = std::min(c.cols, c0 + 128);
        float amax = 0.0f;
        for (int i = c0; i < c1; ++i) amax = std::max(amax, std::fabs(x.host[t * static_cast<size_t>(c.cols) + i]));
        const float scale = sc[t * groups + g];
        if (amax == 0.0f) {
          ASSERT_EQ(scale, 1.0f);
        } else {
          int e = 0;
          ASSERT_EQ(std::frexp(scale, &e), 0.5f) << "a power of two";
          ASSERT_GE(amax / scale, 128.0f);
          ASSERT_LT(amax / scale, 256.0f);
        }
        for (int i = c0; i < c1; ++i) {
          const size_t k = t * static_cast<size_t>(c.cols) + i;
          const double xv = x.host[k];
          const double back = static_cast<double>(scale) * (static_cast<double>(fp8e4m3_to_f32(hi[k])) + fp8e4m3_to_f32(lo[k]));
          if (std::fabs(xv) * 512.0 >= amax) {
            ASSERT_EQ(back, xv) << "t " << t << " i " << i;
            ++exact;
          } else {
            ASSERT_LE(std::fabs(back - xv), std::ldexp(static_cast<double>(scale), -10)) << "t " << t << " i " << i;
            ++small;
          }
        }
      }
    if (c.T > 0) EXPECT_GT(exact, 0);
    EXPECT_TRUE(q.guard_intact() && ql.guard_intact() && s.guard_intact());
    ::testing::Test::RecordProperty("below_2^-9_of_amax", small);
  } else {
    FAIL() << "unknown op " << c.op;
  }
}

TEST_P(Elementwise, MatchesCpu) {
  MOELORA_REQUIRE_GPU();
  run_case(GetParam());
}

std::vector<EltCase> elt_cases() {
  std::vector<EltCase> v;
  for (int T : {0, 1, 7, 256}) {
    v.push_back({"EMBED", T, 2048});
    v.push_back({"RMSNORM", T, 2048, 2048});
    v.push_back({"ADD", T, 2048});
    v.push_back({"SILU_MUL", T, 768});
    v.push_back({"FP8_QUANT", T, 2048});
    v.push_back({"FP8_SPLIT", T, 2048});
  }
  v.push_back({"FP8_SPLIT", 3, 768, 0, 8});  // Qwen3's expert width, padded rows
  v.push_back({"EMBED", 5, 100, 0, 3});  // odd width: scalar path
  v.push_back({"RMSNORM", 5, 4096, 128, 8});      // Qwen3 per-head q norm, padded rows
  v.push_back({"RMSNORM", 3, 96, 32});            // small groups
  v.push_back({"RMSNORM", 2, 1000, 1000});        // large group, scalar path
  v.push_back({"RMSNORM_INPLACE", 9, 2048, 2048, 8});
  v.push_back({"RMSNORM_INPLACE", 9, 512, 128});
  for (int T : {0, 1, 7, 256}) v.push_back({"ADD_RMSNORM", T, 2048, 2048, T == 7 ? 8 : 0});  // block kernel, vector
  v.push_back({"ADD_RMSNORM", 5, 1000, 1000, 3});  // block kernel, scalar (rows not 16-byte aligned)
  {
    EltCase c{"ADD_RMSNORM", 4, 2048, 2048};
    c.add_pad = 3;  // only the added tensor misaligned: the two launches, still bit for bit
    v.push_back(c);
  }
  v.push_back({"ADD_RMSNORM", 9, 128, 128, 8});  // warp kernel (the tiny models' hidden 128)
  v.push_back({"ADD_RMSNORM", 3, 208, 208});     // warp kernel, odd width
  for (int T : {0, 1, 7, 256}) {  // Qwen3-30B-A3B (32 + 4 heads of 128); then 4 + 2 heads of 64, 192, 256
    EltCase h{"HEAD_NORM_ROPE", T, 0};
    h.heads = 32, h.kv_heads = 4, h.stride = 128, h.ld_pad = T == 7 ? 8 : 0;
    v.push_back(h);
  }
  {
    EltCase h{"HEAD_NORM_ROPE", 5, 0};
    h.heads = 4, h.kv_heads = 2, h.stride = 64;
    v.push_back(h);
    h.heads = 2, h.kv_heads = 1, h.stride = 256, h.ld_pad = 8;
    v.push_back(h);
    h.heads = 8, h.kv_heads = 2, h.stride = 192, h.T = 9;  // D / 2 = 96: partners three registers apart
    v.push_back(h);
  }
  for (int T : {1, 7, 64}) {  // RoPE alone with the cache write: Mixtral (32 + 8 heads of 128), then 32 dims
    EltCase h{"ROPE_KV", T, 0};
    h.heads = 32, h.kv_heads = 8, h.stride = 128, h.ld_pad = T == 7 ? 8 : 0, h.page_size = T == 7 ? 5 : 16;
    v.push_back(h);
    h.heads = 4, h.kv_heads = 2, h.stride = 32, h.page_size = 3;
    v.push_back(h);
  }
  for (int T : {0, 1, 7, 200}) {  // the head pass with the cache write: Qwen3-30B-A3B, then 64 and 192 dims
    EltCase h{"HEAD_NORM_ROPE_KV", T, 0};
    h.heads = 32, h.kv_heads = 4, h.stride = 128, h.ld_pad = T == 7 ? 8 : 0, h.page_size = T == 7 ? 5 : 16;
    v.push_back(h);
  }
  {
    EltCase h{"HEAD_NORM_ROPE_KV", 9, 0};
    h.heads = 4, h.kv_heads = 2, h.stride = 64, h.page_size = 3;
    v.push_back(h);
    h.heads = 8, h.kv_heads = 2, h.stride = 192, h.page_size = 16;
    v.push_back(h);
  }
  v.push_back({"SILU_MUL", 3, 192, 0, 8});
  v.push_back({"SILU_MUL", 4, 100});
  v.push_back({"ADD", 3, 100, 0, 3});
  EltCase r{"ROPE", 7, 0};
  r.heads = 4, r.stride = 32, r.rot = 32;
  v.push_back(r);                                   // Qwen3/Mixtral tiny, neox
  r.heads = 32, r.stride = 128, r.rot = 128, r.T = 256;
  v.push_back(r);                                   // Qwen3-30B q
  r.heads = 4, r.stride = 48, r.rot_off = 32, r.rot = 16, r.inter = true, r.T = 5, r.ld_pad = 8;
  v.push_back(r);                                   // DeepSeek q_pe: rotate the tail of each head, interleaved
  r.heads = 1, r.stride = 16, r.rot_off = 0, r.rot = 16, r.T = 1, r.ld_pad = 0;
  v.push_back(r);                                   // DeepSeek k_pe
  for (int T : {1, 6}) {
    v.push_back({"GATHER_BF16", T, 2048});
    v.push_back({"GATHER_F32", T, 256});
    v.push_back({"GATHER_BF16", T, 100, 0, 2});
    v.push_back({"CONVERT", T, 200, 0, 4});
  }
  EltCase m{"MLA_SPLIT", 5, 0};
  m.heads = 4, m.ld_pad = 8;
  v.push_back(m);
  v.push_back({"FP8_QUANT", 3, 192, 0, 8});  // partial last group
  v.push_back({"FP8_QUANT", 2, 96});
  return v;
}

std::string elt_name(const ::testing::TestParamInfo<EltCase>& i) { return gtest_safe(i.param.name()); }

INSTANTIATE_TEST_SUITE_P(Elt, Elementwise, ::testing::ValuesIn(elt_cases()), elt_name);

// Reduced list for compute-sanitizer (memcheck / racecheck): one small case per op.
std::vector<EltCase> elt_sanitize_cases() {
  EltCase r{"ROPE", 3, 0};
  r.heads = 2, r.stride = 48, r.rot_off = 32, r.rot = 16, r.inter = true;
  EltCase m{"MLA_SPLIT", 2, 0};
  m.heads = 2;
  return {{"EMBED", 3, 100}, {"RMSNORM", 3, 2048, 2048, 8}, {"RMSNORM", 2, 256, 128}, {"SILU_MUL", 2, 192, 0, 8},
          {"ADD", 2, 100}, {"ADD_RMSNORM", 3, 2048, 2048, 8}, {"ADD_RMSNORM", 2, 128, 128}, {"GATHER_BF16", 2, 100}, {"CONVERT", 2, 40}, {"FP8_QUANT", 3, 192}, r, m};
}
INSTANTIATE_TEST_SUITE_P(SanitizeElt, Elementwise, ::testing::ValuesIn(elt_sanitize_cases()), elt_name);

}  // namespace
}  // namespace moelora::ops_test
