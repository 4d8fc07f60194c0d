// The MoE builders and reference of gpukit/moe.h. A .cu because moe_forward.cuh (the device
// tables these fill) needs nvcc; everything here runs on the host.
#include "gpukit/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda_plan/nvfp4_layout.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "gpukit/dense.h"

namespace moelora::gpukit {
namespace {

int cdiv(int a, int b) { return (a + b - 1) / b; }

const int64_t* ptrs_of(const MoeLoraTable& t, int w) {
  const Tensor* p[4] = {&t.gu_a, &t.gu_b, &t.d_a, &t.d_b};
  return p[w]->ptr<int64_t>();
}

}  // namespace

void HostExperts::generate(uint64_t seed) {
  const auto& sh = shape;
  const size_t E = sh.E, H = sh.H, I = sh.I;
  FastRng b(seed);
  if (nvfp4) {
    // Codes: any byte is two valid e2m1 codes. Group scales e4m3 in [16, 64), global scale such that
    // weights average about 1/sqrt(K) in size (|e2m1| averages ~2.3).
    auto make = [&](std::vector<uint8_t>& q, std::vector<uint8_t>& g, std::vector<float>& gs, size_t rows, int K,
                    size_t parts) {
      q.resize(rows * K / 2);
      for (auto& x : q) x = static_cast<uint8_t>(b.next());
      g.resize(rows * K / 16);
      for (auto& x : g) x = f32_to_fp8e4m3(16.0f + 48.0f * b.uniform());
      gs.resize(parts);
      for (auto& x : gs) x = (0.75f + 0.5f * b.uniform()) / (2.3f * 32.0f * std::sqrt(static_cast<float>(K)));
    };
    make(gu_q, gu_g, gu_gs, E * 2 * I, sh.H, E * 2);
    make(d_q, d_g, d_gs, E * H, sh.I, E);
  } else if (fp8) {
    gu_s.resize(E * 2 * cdiv(sh.I, 128) * cdiv(sh.H, 128));
    d_s.resize(E * cdiv(sh.H, 128) * cdiv(sh.I, 128));
    random_fp8(b, gu_q, gu_s, E * 2 * I, sh.H);
    random_fp8(b, d_q, d_s, E * H, sh.I);
  } else {
    gu_b.resize(E * 2 * I * H);
    d_b.resize(E * H * I);
    // Divided, not random_bf16's multiply by sd: these exact values are what the cases were
    // recorded with.
    for (auto& x : gu_b) x = f32_to_bf16(b.normal() / std::sqrt(static_cast<float>(H)));
    for (auto& x : d_b) x = f32_to_bf16(b.normal() / std::sqrt(static_cast<float>(I)));
  }
}

void HostExperts::dequant(int e, float* gu, float* d) const {
  const int H = shape.H, I = shape.I;
  if (nvfp4) {  // the executable spec (ops/weight_format.h); gate and up have their own global scales
    const size_t gu_rows = static_cast<size_t>(e) * 2 * I, d_rows = static_cast<size_t>(e) * H;
    for (int half = 0; half < 2; ++half) {
      const size_t r0 = gu_rows + static_cast<size_t>(half) * I;
      dequantize_nvfp4(gu_q.data() + r0 * H / 2, I, H, gu_g.data() + r0 * H / 16, gu_gs[2 * e + half],
                       gu + static_cast<size_t>(half) * I * H);
    }
    dequantize_nvfp4(d_q.data() + d_rows * I / 2, H, I, d_g.data() + d_rows * I / 16, d_gs[e], d);
  } else if (fp8) {
    const int hb = cdiv(H, 128), ib = cdiv(I, 128);
    // gate_up: split_rows = I within the expert, its own 2*ceil(I/128) scale rows.
    dequantize_fp8_block(gu_q.data() + static_cast<size_t>(e) * 2 * I * H, 2 * I, H,
                              gu_s.data() + static_cast<size_t>(e) * 2 * ib * hb, 128, 128, I, gu);
    dequantize_fp8_block(d_q.data() + static_cast<size_t>(e) * H * I, H, I,
                              d_s.data() + static_cast<size_t>(e) * hb * ib, 128, 128, 0, d);
  } else {
    for (size_t i = 0; i < static_cast<size_t>(2) * I * H; ++i) gu[i] = bf16_to_f32(gu_b[static_cast<size_t>(e) * 2 * I * H + i]);
    for (size_t i = 0; i < static_cast<size_t>(H) * I; ++i) d[i] = bf16_to_f32(d_b[static_cast<size_t>(e) * H * I + i]);
  }
}

void DeviceExperts::upload(const HostExperts& h) {
  if (h.nvfp4) {  // as CudaBackend::upload_nvfp4_experts packs a checkpoint's experts
    const auto& s = h.shape;
    auto pack = [](const std::vector<uint8_t>& q, const std::vector<uint8_t>& g, const std::vector<float>& gs,
                   int64_t rows, int K, DeviceArray<uint8_t>& dq, DeviceArray<uint8_t>& dg, DeviceArray<float>& dgs) {
      std::vector<uint8_t> pq(q.size()), pg(g.size());
      cuda_plan::nvfp4_pack_codes(q.data(), rows, K, pq.data());
      cuda_plan::nvfp4_pack_scales(g.data(), rows, K, pg.data());
      std::vector<float> f(gs);
      for (auto& x : f) x *= cuda_plan::kNvfp4GlobalFactor;
      dq = DeviceArray<uint8_t>(pq);
      dg = DeviceArray<uint8_t>(pg);
      dgs = DeviceArray<float>(f);
    };
    pack(h.gu_q, h.gu_g, h.gu_gs, static_cast<int64_t>(s.E) * 2 * s.I, s.H, gu, gu_g, gu_gs);
    pack(h.d_q, h.d_g, h.d_gs, static_cast<int64_t>(s.E) * s.H, s.I, d, d_g, d_gs);
  } else if (h.fp8) {
    gu = DeviceArray<uint8_t>(h.gu_q);
    d = DeviceArray<uint8_t>(h.d_q);
    gu_s = DeviceArray<float>(h.gu_s);
    d_s = DeviceArray<float>(h.d_s);
  } else {
    std::vector<uint8_t> a(h.gu_b.size() * 2), b(h.d_b.size() * 2);
    std::memcpy(a.data(), h.gu_b.data(), a.size());
    std::memcpy(b.data(), h.d_b.data(), b.size());
    gu = DeviceArray<uint8_t>(a);
    d = DeviceArray<uint8_t>(b);
  }
}

void lora_factor_dims(const cuda::MoeShape& s, const HostLoraSlot& l, int which, int* rows, int* cols) {
  switch (which) {
    case 0: *rows = l.gu_rank; *cols = s.H; break;     // A [r, H]
    case 1: *rows = 2 * s.I; *cols = l.gu_rank; break;  // B [2I, r]
    case 2: *rows = l.d_rank; *cols = s.I; break;       // A [r, I]
    default: *rows = s.H; *cols = l.d_rank; break;      // B [H, r]
  }
}

void generate_lora(HostLoraSlot& l, const cuda::MoeShape& s, FastRng& b) {
  for (int w = 0; w < 4; ++w) {
    int rows, cols;
    lora_factor_dims(s, l, w, &rows, &cols);
    const size_t n = static_cast<size_t>(rows) * cols * (l.share[w] ? 1 : s.E);
    const bool is_a = w == 0 || w == 2;
    const float sd = is_a ? 1.0f / std::sqrt(static_cast<float>(cols)) : 0.5f / std::sqrt(static_cast<float>(std::max(cols, 1)));
    l.f[w] = random_bf16(b, n, sd);
  }
}

void DeviceLora::upload(const std::vector<HostLoraSlot>& slots, const cuda::MoeShape& s) {
  const int S = static_cast<int>(slots.size());
  std::vector<int64_t> p[4], st[4];
  std::vector<int32_t> gr(S), dr(S);
  int max_rank = 0;
  for (int i = 0; i < S; ++i) {
    const HostLoraSlot& l = slots[i];
    gr[i] = l.gu_rank;
    dr[i] = l.d_rank;
    max_rank = std::max({max_rank, l.gu_rank, l.d_rank});
    for (int w = 0; w < 4; ++w) {
      int rows, cols;
      lora_factor_dims(s, l, w, &rows, &cols);
      if (l.f[w].empty()) {
        p[w].push_back(0);
        st[w].push_back(0);
        continue;
      }
      bufs.emplace_back(l.f[w]);
      p[w].push_back(reinterpret_cast<int64_t>(bufs.back().get()));
      st[w].push_back(l.share[w] ? 0 : static_cast<int64_t>(rows) * cols);
    }
  }
  for (int w = 0; w < 4; ++w) {
    ptr[w] = DeviceArray<int64_t>(p[w]);
    stride[w] = DeviceArray<int64_t>(st[w]);
  }
  gu_rank = DeviceArray<int32_t>(gr);
  d_rank = DeviceArray<int32_t>(dr);
  dev.num_slots = S;
  dev.max_rank = max_rank;
  dev.gu_a = {ptr[0].get(), stride[0].get(), gu_rank.get()};
  dev.gu_b = {ptr[1].get(), stride[1].get(), gu_rank.get()};
  dev.d_a = {ptr[2].get(), stride[2].get(), d_rank.get()};
  dev.d_b = {ptr[3].get(), stride[3].get(), d_rank.get()};
}

MoeReference moe_reference(const HostExperts& ex, const std::vector<float>& x, int T, const std::vector<int32_t>& ids,
                           const std::vector<float>& weights, const std::vector<int32_t>* slot,
                           const std::vector<HostLoraSlot>* lora, const std::vector<float>* down_input,
                           bool fp8_activations) {
  const cuda::MoeShape& s = ex.shape;
  const int k = s.k, H = s.H, I = s.I, E = s.E;
  std::map<int, int> remap;  // expert -> compact index
  for (int i = 0; i < T * k; ++i)
    if (ids[i] >= 0 && ids[i] < E) remap.emplace(ids[i], 0);
  if (remap.empty()) remap.emplace(0, 0);
  std::vector<int> used;
  for (auto& [e, c] : remap) {
    c = static_cast<int>(used.size());
    used.push_back(e);
  }
  const int U = static_cast<int>(used.size());
  std::vector<float> wgu(static_cast<size_t>(U) * 2 * I * H), wd(static_cast<size_t>(U) * H * I);
  for (int u = 0; u < U; ++u)
    ex.dequant(used[u], wgu.data() + static_cast<size_t>(u) * 2 * I * H, wd.data() + static_cast<size_t>(u) * H * I);
  std::vector<int32_t> rids(T * k);
  std::vector<float> rw(T * k);
  for (int i = 0; i < T * k; ++i) {
    const bool ok = ids[i] >= 0 && ids[i] < E;
    rids[i] = ok ? remap[ids[i]] : 0;
    rw[i] = ok ? weights[i] : 0.0f;
  }
  // Compact f32 LoRA tables (host pointers) over the used experts.
  std::vector<std::vector<float>> keep;
  MoeLoraTable tab;
  if (lora) {
    const int S = static_cast<int>(lora->size());
    tab.num_slots = S;
    tab.num_experts = U;
    tab.hidden = H;
    tab.intermediate = I;
    Tensor* ptrs[4] = {&tab.gu_a, &tab.gu_b, &tab.d_a, &tab.d_b};
    Tensor* strides[4] = {&tab.gu_a_expert_stride, &tab.gu_b_expert_stride, &tab.d_a_expert_stride,
                          &tab.d_b_expert_stride};
    for (int w = 0; w < 4; ++w) {
      *ptrs[w] = Tensor::empty_host(DType::kI64, {S});
      *strides[w] = Tensor::empty_host(DType::kI64, {S});
    }
    tab.gu_rank = Tensor::empty_host(DType::kI32, {S});
    tab.d_rank = Tensor::empty_host(DType::kI32, {S});
    for (int sl = 0; sl < S; ++sl) {
      const HostLoraSlot& l = (*lora)[sl];
      tab.gu_rank.ptr<int32_t>()[sl] = l.gu_rank;
      tab.d_rank.ptr<int32_t>()[sl] = l.d_rank;
      for (int w = 0; w < 4; ++w) {
        int rows, cols;
        lora_factor_dims(s, l, w, &rows, &cols);
        const size_t mat = static_cast<size_t>(rows) * cols;
        std::vector<float> f;
        if (!l.f[w].empty()) {
          const int n = l.share[w] ? 1 : U;
          f.resize(mat * n);
          for (int u = 0; u < n; ++u) {
            const size_t src = l.share[w] ? 0 : static_cast<size_t>(used[u]) * mat;
            for (size_t i = 0; i < mat; ++i) f[u * mat + i] = bf16_to_f32(l.f[w][src + i]);
          }
        }
        keep.push_back(std::move(f));
        ptrs[w]->ptr<int64_t>()[sl] = reinterpret_cast<int64_t>(keep.back().data());
        strides[w]->ptr<int64_t>()[sl] = l.share[w] ? 0 : static_cast<int64_t>(mat);
      }
    }
  }
  MoeReference ref;
  ref.out.assign(static_cast<size_t>(T) * H, 0.0f);
  cpu::MoeArgs a;
  a.x = x.data();
  a.ldx = H;
  a.T = T;
  a.k = k;
  a.ids = rids.data();
  a.weights = rw.data();
  a.slot = slot ? slot->data() : nullptr;
  a.w_gate_up = wgu.data();
  a.w_down = wd.data();
  a.E = U;
  a.H = H;
  a.I = I;
  a.lora = lora ? &tab : nullptr;
  a.out = ref.out.data();
  a.ldo = H;
  a.fp8_activations = fp8_activations;
  cpu::moe(a);
  // W8A8: the base GEMMs see x (and act, below) through e4m3 with per-token 1x128 scales.
  auto fp8_round_trip = [](const float* in, int n) { return fp8_activation_round_trip(in, n, 1, n); };

  // Per-pair stages (diagnostics: which kernel is wrong), computed directly in f64.
  ref.act.assign(static_cast<size_t>(T) * k * I, 0.0f);
  ref.delta_gu.assign(static_cast<size_t>(T) * k * 2 * I, 0.0f);
  ref.delta_d.assign(static_cast<size_t>(T) * k * H, 0.0f);
  std::vector<double> out_dd;
  if (down_input) out_dd.assign(static_cast<size_t>(T) * H, 0.0);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int pr = t * k + j;
      if (ids[pr] < 0 || ids[pr] >= E) continue;
      const int u = rids[pr];
      const float* xr = x.data() + static_cast<size_t>(t) * H;
      const std::vector<float> xq = fp8_activations ? fp8_round_trip(xr, H) : std::vector<float>();
      const float* xb = fp8_activations ? xq.data() : xr;  // the base GEMM's input
      std::vector<double> g(2 * I), act(I);
      for (int o = 0; o < 2 * I; ++o) {
        double acc = 0;
        const float* wr = wgu.data() + (static_cast<size_t>(u) * 2 * I + o) * H;
        for (int h = 0; h < H; ++h) acc += static_cast<double>(xb[h]) * wr[h];
        g[o] = acc;
      }
      const int sl = slot ? (*slot)[t] : -1;
      const HostLoraSlot* l = (lora && sl >= 0 && sl < static_cast<int>(lora->size())) ? &(*lora)[sl] : nullptr;
      auto apply = [&](int wa, int wb, int r, const double* in, int nin, int nout, float* dst) {
        if (!l || r == 0) return;
        const float* A = reinterpret_cast<const float*>(ptrs_of(tab, wa)[sl]) + (l->share[wa] ? 0 : static_cast<size_t>(u) * r * nin);
        const float* B = reinterpret_cast<const float*>(ptrs_of(tab, wb)[sl]) + (l->share[wb] ? 0 : static_cast<size_t>(u) * nout * r);
        std::vector<double> uu(r, 0.0);
        for (int q = 0; q < r; ++q)
          for (int i = 0; i < nin; ++i) uu[q] += in[i] * A[static_cast<size_t>(q) * nin + i];
        for (int o = 0; o < nout; ++o) {
          double acc = 0;
          for (int q = 0; q < r; ++q) acc += uu[q] * B[static_cast<size_t>(o) * r + q];
          dst[o] = static_cast<float>(acc);
        }
      };
      std::vector<double> xd(xr, xr + H);
      float* dgu = ref.delta_gu.data() + static_cast<size_t>(pr) * 2 * I;
      apply(0, 1, l ? l->gu_rank : 0, xd.data(), H, 2 * I, dgu);
      for (int i = 0; i < I; ++i) {
        const double gg = g[i] + dgu[i], uu = g[I + i] + dgu[I + i];
        act[i] = gg / (1.0 + std::exp(-gg)) * uu;
        ref.act[static_cast<size_t>(pr) * I + i] = static_cast<float>(act[i]);
      }
      if (down_input)
        for (int i = 0; i < I; ++i) act[i] = (*down_input)[static_cast<size_t>(pr) * I + i];
      float* dd = ref.delta_d.data() + static_cast<size_t>(pr) * H;
      apply(2, 3, l ? l->d_rank : 0, act.data(), I, H, dd);
      if (!down_input) continue;
      std::vector<float> af(act.begin(), act.end());
      if (fp8_activations) {
        for (float& v : af) v = bf16_to_f32(f32_to_bf16(v));  // as the GPU stores act
        af = fp8_round_trip(af.data(), I);
      }
      for (int o = 0; o < H; ++o) {
        double acc = 0;
        const float* wr = wd.data() + (static_cast<size_t>(u) * H + o) * I;
        for (int i = 0; i < I; ++i) acc += static_cast<double>(af[i]) * wr[i];
        out_dd[static_cast<size_t>(t) * H + o] += static_cast<double>(rw[pr]) * (acc + dd[o]);
      }
    }
  ref.out_from_down_input.assign(out_dd.begin(), out_dd.end());
  return ref;
}

}  // namespace moelora::gpukit
