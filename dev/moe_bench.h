// The MoE workbench's shared pieces (dev/moe_bench.cu, dev/moe_bench_lora.cu): the layer's
// shapes, the versions a run forces on moe_forward's tuning, the rotated copies of weights,
// adapters and inputs, the bench that launches one version on one copy, and the modes and helpers
// one file calls in the other. CUDA sources only (gpukit/moe.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "gpukit/device_array.h"
#include "gpukit/moe.h"
#include "gpukit/numeric.h"
#include "gpukit/random.h"

namespace moelora::dev_moe_bench {

using namespace moelora::cuda;
using namespace moelora::gpukit;

inline constexpr int kH = 2048, kE = 128, kK = 8, kI = 768, kRank = 16, kSlots = 8, kMaxT = 256;
inline constexpr int kTokens[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};

struct Version {
  const char* name;
  bool pdl, fuse;
  bool lora_fused = false;
  int tile = -1;
  bool one_stream = false;
  int act8 = -1;  // -1: the heuristic's FP8 regime; 0: W8A16; 1: W8A8
  int wgmma = -1;  // -1: the heuristic's kernel; 0: mma.sync; 1: the Hopper TMA + wgmma GEMM
  int split = -1;  // wgmma W8A16: -1 the heuristic's; 0 weights dequantised; 1 split-form activations
  int lora_gemm = -1;  // gate_up LoRA expand: -1 the heuristic's; 0 its own kernel; 1 in the GEMM epilogue
  int lora_reduce = -1;  // down LoRA expand: -1 the heuristic's; 0 its own kernel; 1 inside moe_reduce
  int lora_direct = -1;  // LoRA items: -1 the heuristic's; 0 moe_align's (slot, expert) groups; 1 one per pair
  int lora_beside = -1;  // LoRA shrinks: -1 the heuristic's; 0 before the GEMMs / side stream; 1 beside the GEMMs
  // The workspace carved for kMaxT tokens whatever T (this workbench before 2026-12-06: LoRA grids
  // sized for 256 tokens); otherwise for the step's T, as CudaBackend::moe carves it.
  bool max_workspace = false;
};
inline constexpr Version kV1{"v1", false, false}, kV2{"v2", true, true}, kV3{"v3", true, true, true},
    kV4{"v4", true, true, true, -1, true};

struct Copy {
  DeviceExperts ex;
  DeviceLora lora;
  DeviceArray<uint16_t> x, out;
  DeviceArray<float> logits, w;
  DeviceArray<int32_t> ids, slot1, slot8;
};

struct Bench {
  MoeShape shape{kMaxT, kK, kE, kH, kI, /*fp8_activations=*/true, /*fp8_split=*/true};  // versions run every regime
  HostExperts hex;
  std::vector<HostLoraSlot> hl;
  std::vector<Copy> copies;
  std::vector<std::vector<float>> hx, hlogits;
  DeviceArray<uint8_t> wsbuf;
  MoeWorkspace ws;
  cudaStream_t side;
  cudaEvent_t ev[4];

  void init(int ncopies, bool nvfp4 = false) {
    hex.shape = shape;
    hex.fp8 = !nvfp4;
    hex.nvfp4 = nvfp4;
    hex.generate(1234);
    FastRng b(99);
    for (int s = 0; s < kSlots; ++s) {
      HostLoraSlot l;
      l.gu_rank = l.d_rank = kRank;
      generate_lora(l, shape, b);
      hl.push_back(std::move(l));
    }
    copies.resize(ncopies);
    std::vector<int32_t> s1(kMaxT, 0), s8(kMaxT);
    for (int t = 0; t < kMaxT; ++t) s8[t] = t % kSlots;
    for (int c = 0; c < ncopies; ++c) {
      Copy& cp = copies[c];
      cp.ex.upload(hex);
      cp.lora.upload(hl, shape);
      FastRng r(1000 + c);
      std::vector<float> x(static_cast<size_t>(kMaxT) * kH), lg(static_cast<size_t>(kMaxT) * kE);
      for (auto& v : x) v = bf16_to_f32(f32_to_bf16(r.normal()));
      for (auto& v : lg) v = 2.0f * r.normal();
      cp.x = DeviceArray<uint16_t>(to_bf16(x));
      cp.out = DeviceArray<uint16_t>(static_cast<size_t>(kMaxT) * kH);
      cp.logits = DeviceArray<float>(lg);
      cp.ids = DeviceArray<int32_t>(static_cast<size_t>(kMaxT) * kK);
      cp.w = DeviceArray<float>(static_cast<size_t>(kMaxT) * kK);
      cp.slot1 = DeviceArray<int32_t>(s1);
      cp.slot8 = DeviceArray<int32_t>(s8);
      hx.push_back(std::move(x));
      hlogits.push_back(std::move(lg));
    }
    MoeLoraShape ls{kSlots, kRank};
    wsbuf = DeviceArray<uint8_t>(moe_workspace_bytes(shape, &ls));
    ws = moe_workspace_carve(wsbuf.get(), shape, &ls);
    MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    for (auto& e : ev) MOELORA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    moe_gemm_init();
  }

  // adapters: 0 = base, 1 = every token on slot 0, 8 = token t on slot t % 8.
  void launch(cudaStream_t s, int c, int T, const Version& v, int adapters, MoeStage last = MoeStage::kAll) {
    Copy& cp = copies[c];
    MoeForwardArgs a;
    a.T = T;
    a.x = reinterpret_cast<const bf16*>(cp.x.get());
    a.ldx = kH;
    a.logits = cp.logits.get();
    a.router.mode = RouterMode::kSoftmax;
    a.router.renormalize = true;  // Qwen3-MoE norm_topk_prob
    a.ids = cp.ids.get();
    a.weights = cp.w.get();
    a.wtype = hex.nvfp4 ? MoeWeightType::kNvfp4 : MoeWeightType::kFp8;
    a.w_gate_up = cp.ex.gu.get();
    a.s_gate_up = cp.ex.gu_s.get();
    a.w_down = cp.ex.d.get();
    a.s_down = cp.ex.d_s.get();
    a.group_scale_gate_up = cp.ex.gu_g.get();
    a.global_scale_gate_up = cp.ex.gu_gs.get();
    a.group_scale_down = cp.ex.d_g.get();
    a.global_scale_down = cp.ex.d_gs.get();
    MoeShape step_shape = shape;
    if (!v.max_workspace) step_shape.max_tokens = std::max(T, 1);
    const MoeLoraShape ls{kSlots, kRank};
    ws = moe_workspace_carve(wsbuf.get(), step_shape, &ls);  // fits: wsbuf is sized for kMaxT
    a.shape = step_shape;
    a.lora = adapters ? &cp.lora.dev : nullptr;
    a.token_slot = adapters == 1 ? cp.slot1.get() : adapters == 8 ? cp.slot8.get() : nullptr;
    a.out = reinterpret_cast<bf16*>(cp.out.get());
    a.ldo = kH;
    a.tuning = moe_tuning(a);  // the product's choices, with what the version forces
    a.tuning->pdl = v.pdl;
    a.tuning->fuse_route = a.tuning->fuse_route && v.fuse;
    a.tuning->lora_fused = v.lora_fused;
    if (v.tile >= 0) a.tuning->tile = static_cast<MoeGemmTile>(v.tile);
    if (v.act8 >= 0) a.tuning->act_fp8 = v.act8 == 1;
    if (v.wgmma >= 0) a.tuning->wgmma = v.wgmma == 1;
    else if (a.tuning->act_fp8) a.tuning->wgmma = false;  // a forced W8A8 version on the mma.sync kernels
    if (v.split >= 0) a.tuning->act_split = v.split == 1;
    if (v.lora_gemm >= 0) a.tuning->lora_in_gemm = v.lora_gemm == 1;
    if (v.lora_reduce >= 0) a.tuning->lora_down_in_reduce = v.lora_reduce == 1;
    if (v.lora_direct >= 0) a.tuning->lora_direct = v.lora_direct == 1;
    if (v.lora_beside >= 0) a.tuning->lora_shrink_beside_gemm = v.lora_beside == 1;
    MoeStreams st{s, v.one_stream ? nullptr : side, ev[0], ev[1], ev[2], ev[3]};
    moe_forward_prefix(a, ws, st, last);
  }

  std::vector<float> out_of(int c, int T) { return from_bf16(copies[c].out.download(static_cast<size_t>(T) * kH)); }
};

// Worst row error of copy 0's output of T tokens (`out`) against cpu::moe on the same routing.
double worst_vs_cpu(Bench& b, int T, int adapters, const std::vector<float>& out);

// `dev_moe_bench lora`, `direct` and `beside` (dev/moe_bench_lora.cu): true when every check passed.
bool lora_mode(Bench& b, int ncopies, double bw);
bool direct_mode(Bench& b, int ncopies, double bw);
bool beside_mode(Bench& b, int ncopies, double bw);

}  // namespace moelora::dev_moe_bench
