// The routed MoE layer on the GPU (moe_forward: routing, alignment, grouped FP8/bf16 GEMMs, MoE
// LoRA on a side stream, weighted sum) against cpu::moe. Besides the output, every stage is
// compared (act = SwiGLU input of down, both LoRA deltas) so a failure names its kernel.
//
// Tolerance (all families): 1e-2 on ||out - ref|| / ||ref|| per row. The GPU rounds act, both LoRA
// deltas and the output to bf16 (relative 2^-9 each, ~1e-3 RMS together); FP8 weights are
// dequantised exactly and every sum is f32, so 1e-2 leaves ~5x margin while any wrong expert,
// adapter, half or row is off by O(1). In the W8A8 regime the reference quantises the base GEMMs'
// inputs exactly as the GPU does (bit-identical e4m3 and scales), so the same bound holds; a
// reference without that quantisation would differ by ~3 % per row. NaN/inf never pass
// (workspace and output are poisoned).
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "gpukit/moe.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

enum Route { kRandom, kOneExpert, kHalfEmpty, kTies, kSentinel };
enum SlotPattern { kSlotRandom, kSlotOne, kSlotDistinct, kSlotNone, kSlotInvalid };

struct MoeCase {
  int T = 1, E = 8, k = 2, H = 128, I = 192;
  bool fp8 = true;
  bool nvfp4 = false;             // NVFP4 experts (fp8 ignored): the 4-bit mma.sync variant, or wgmma when forced
  Route route = kRandom;
  bool grouped = false;
  int n_group = 1, topk_group = 1;
  float scaling = 1.0f;
  int slots = 0;                  // 0 = no LoRA
  std::vector<int> ranks = {16};  // cycled over slots (gate_up rank i, down rank i+1)
  SlotPattern slot_pattern = kSlotRandom;
  int share = 0;                  // on even slots: 1 gate_up A, 2 gate_up B, 4 down A, 8 down B shared
  bool half_rank0 = false;        // slot 1 without gate_up LoRA, slot 2 without down LoRA
  int tile = -1;
  bool two_streams = true, pdl = true, fuse = true, graph = false;
  bool lora_fused = false;        // moe_lora_fused instead of shrink + expand
  int act8 = -1;                  // FP8 experts: -1 the heuristic's regime, 0 W8A16, 1 W8A8
  int wgmma = -1;                 // -1 the heuristic's GEMM kernel, 0 mma.sync, 1 TMA + wgmma (Hopper)
  int split = -1;                 // wgmma W8A16: -1 the heuristic's, 0 weights dequantised, 1 split activations
  int lora_gemm = -1;             // gate_up LoRA expand: -1 the heuristic's, 0 its own kernel, 1 in the GEMM epilogue
  int lora_reduce = -1;           // down LoRA expand: -1 the heuristic's, 0 its own kernel, 1 inside moe_reduce
  int lora_direct = -1;           // LoRA items: -1 the heuristic's, 0 moe_align's (slot, expert) groups, 1 per pair
  int lora_beside = -1;           // LoRA shrinks: -1 the heuristic's, 0 before the GEMMs / side stream, 1 beside them

  std::string name() const {
    std::string n = slots ? "MOE_LORA(" : "MOE(";
    n += "E=" + std::to_string(E) + ",k=" + std::to_string(k) + ",T=" + std::to_string(T) + ",H=" + std::to_string(H) +
         ",I=" + std::to_string(I) + (nvfp4 ? ",nvfp4" : fp8 ? ",fp8" : ",bf16");
    const char* routes[] = {"", ",one_expert", ",half_empty", ",ties", ",sentinel_ids"};
    n += routes[route];
    if (grouped) n += ",groups=" + std::to_string(n_group) + "/" + std::to_string(topk_group);
    if (slots) {
      n += ",slots=" + std::to_string(slots) + ",r=";
      for (size_t i = 0; i < ranks.size(); ++i) n += (i ? "/" : "") + std::to_string(ranks[i]);
      const char* pats[] = {",mixed", ",one_adapter", ",distinct", ",all_base", ",invalid_slots"};
      n += pats[slot_pattern];
      if (share) n += ",share=" + std::to_string(share);
      if (half_rank0) n += ",half_rank0";
    }
    if (tile >= 0) n += ",tile=" + std::to_string(cuda::moe_gemm_tile_rows(static_cast<cuda::MoeGemmTile>(tile)));
    if (!two_streams) n += ",1stream";
    if (!pdl) n += ",nopdl";
    if (!fuse) n += ",nofuse";
    if (graph) n += ",graph";
    if (lora_fused) n += ",fused_lora";
    if (act8 >= 0) n += act8 ? ",w8a8" : ",w8a16";
    if (wgmma >= 0) n += wgmma ? ",wgmma" : ",mma_sync";
    if (split >= 0) n += split ? ",split" : ",dequant";
    if (lora_gemm >= 0) n += lora_gemm ? ",lora_in_gemm" : ",lora_expand_kernel";
    if (lora_reduce >= 0) n += lora_reduce ? ",down_lora_in_reduce" : ",down_lora_expand_kernel";
    if (lora_direct >= 0) n += lora_direct ? ",lora_per_pair" : ",lora_grouped";
    if (lora_beside >= 0) n += lora_beside ? ",lora_beside_gemm" : ",lora_before_gemm";
    return n + ")";
  }
};

struct Harness {
  MoeCase c;
  Rng rng;
  HostExperts ex;
  DeviceExperts dex;
  std::vector<HostLoraSlot> lora;
  DeviceLora dlora;
  cuda::MoeShape shape;
  DeviceArray<uint8_t> wsbuf;
  cuda::MoeWorkspace ws;
  // inputs (host copies as the GPU sees them)
  std::vector<float> x, logits, bias;
  std::vector<int32_t> slot, given_ids;
  std::vector<float> given_w;
  DeviceArray<uint16_t> d_x, d_out;
  DeviceArray<float> d_logits, d_bias, d_w;
  DeviceArray<int32_t> d_ids, d_slot;
  cudaStream_t main = nullptr, side = nullptr;
  cudaEvent_t ev[4] = {};

  explicit Harness(const MoeCase& mc) : c(mc), rng(seed_of(mc.name())) {
    shape = {std::max(c.T, 1), c.k, c.E, c.H, c.I, /*fp8_activations=*/c.fp8,
             /*fp8_split=*/c.fp8};  // cases force either regime
    ex.shape = shape;
    ex.fp8 = c.fp8 && !c.nvfp4;
    ex.nvfp4 = c.nvfp4;
    ex.generate(seed_of(c.name()) ^ 0x5eedull);
    dex.upload(ex);
    FastRng b(seed_of(c.name()) ^ 0x10a4ull);
    for (int s = 0; s < c.slots; ++s) {
      HostLoraSlot l;
      l.gu_rank = c.ranks[s % c.ranks.size()];
      l.d_rank = c.ranks[(s + 1) % c.ranks.size()];
      if (c.half_rank0 && s == 1) l.gu_rank = 0;
      if (c.half_rank0 && s == 2) l.d_rank = 0;
      for (int w = 0; w < 4; ++w) l.share[w] = (s % 2 == 0) && ((c.share >> w) & 1);
      generate_lora(l, shape, b);
      lora.push_back(std::move(l));
    }
    cuda::MoeLoraShape ls;
    if (c.slots) {
      dlora.upload(lora, shape);
      ls = {c.slots, dlora.dev.max_rank};
    }
    wsbuf = DeviceArray<uint8_t>(cuda::moe_workspace_bytes(shape, c.slots ? &ls : nullptr));
    ws = cuda::moe_workspace_carve(wsbuf.get(), shape, c.slots ? &ls : nullptr);
    const size_t P = static_cast<size_t>(c.T) * c.k;
    d_x = DeviceArray<uint16_t>(static_cast<size_t>(c.T) * c.H);
    d_out = DeviceArray<uint16_t>(static_cast<size_t>(c.T) * c.H);
    d_logits = DeviceArray<float>(static_cast<size_t>(c.T) * c.E);
    d_bias = DeviceArray<float>(c.E);
    d_ids = DeviceArray<int32_t>(P);
    d_w = DeviceArray<float>(P);
    d_slot = DeviceArray<int32_t>(c.T);
    MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&main, cudaStreamNonBlocking));
    MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    for (auto& e : ev) MOELORA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~Harness() {
    cudaStreamDestroy(main);
    cudaStreamDestroy(side);
    for (auto& e : ev) cudaEventDestroy(e);
  }

  void make_inputs() {
    const int T = c.T, E = c.E;
    x = round_bf16(rng.normals(static_cast<size_t>(T) * c.H));
    logits.assign(static_cast<size_t>(T) * E, 0.0f);
    for (int t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) {
        float& l = logits[static_cast<size_t>(t) * E + e];
        l = c.route == kTies ? static_cast<float>(rng.integer(0, 3)) : rng.normal(2.0f);
        if (c.route == kOneExpert && e == 3 % E) l = 20.0f;
        if (c.route == kHalfEmpty && e >= E / 2) l = -50.0f;
      }
    bias.resize(E);
    for (auto& v : bias) v = rng.normal(0.1f);
    slot.assign(T, -1);
    for (int t = 0; t < T && c.slots; ++t) {
      switch (c.slot_pattern) {
        case kSlotRandom: slot[t] = rng.integer(-1, c.slots - 1); break;
        case kSlotOne: slot[t] = 0; break;
        case kSlotDistinct: slot[t] = t % c.slots; break;
        case kSlotNone: slot[t] = -1; break;
        case kSlotInvalid: slot[t] = rng.integer(-3, c.slots + 2); break;
      }
    }
    if (c.route == kSentinel) {
      given_ids.resize(static_cast<size_t>(T) * c.k);
      given_w.resize(given_ids.size());
      for (size_t i = 0; i < given_ids.size(); ++i) {
        const int r = rng.integer(0, 9);
        given_ids[i] = r == 0 ? -1 : r == 1 ? E : r == 2 ? E + 1000 : rng.integer(0, E - 1);
        given_w[i] = rng.uniform(0.05f, 1.0f);
      }
      d_ids.upload(given_ids);
      d_w.upload(given_w);
    }
    d_x.upload(to_bf16(x));
    d_logits.upload(logits);
    d_bias.upload(bias);
    d_slot.upload(slot);
  }

  cuda::MoeForwardArgs args() {
    cuda::MoeForwardArgs a;
    a.T = c.T;
    a.x = reinterpret_cast<const cuda::bf16*>(d_x.get());
    a.ldx = c.H;
    a.logits = c.route == kSentinel ? nullptr : d_logits.get();
    a.router.mode = c.grouped ? cuda::RouterMode::kSigmoidGrouped : cuda::RouterMode::kSoftmax;
    a.router.renormalize = true;
    a.router.bias = d_bias.get();
    a.router.n_group = c.n_group;
    a.router.topk_group = c.topk_group;
    a.router.scaling = c.scaling;
    a.ids = d_ids.get();
    a.weights = d_w.get();
    a.wtype = c.nvfp4 ? cuda::MoeWeightType::kNvfp4 : c.fp8 ? cuda::MoeWeightType::kFp8 : cuda::MoeWeightType::kBf16;
    a.w_gate_up = dex.gu.get();
    a.s_gate_up = ex.fp8 ? dex.gu_s.get() : nullptr;
    a.w_down = dex.d.get();
    a.s_down = ex.fp8 ? dex.d_s.get() : nullptr;
    if (c.nvfp4) {
      a.group_scale_gate_up = dex.gu_g.get();
      a.global_scale_gate_up = dex.gu_gs.get();
      a.group_scale_down = dex.d_g.get();
      a.global_scale_down = dex.d_gs.get();
    }
    a.shape = shape;
    a.lora = c.slots ? &dlora.dev : nullptr;
    a.token_slot = c.slots ? d_slot.get() : nullptr;
    a.out = reinterpret_cast<cuda::bf16*>(d_out.get());
    a.ldo = c.H;
    // The heuristic's choices, with what the case forces.
    a.tuning = cuda::moe_tuning(a);
    a.tuning->pdl = c.pdl;
    a.tuning->fuse_route = a.tuning->fuse_route && c.fuse;
    if (c.tile >= 0) a.tuning->tile = static_cast<cuda::MoeGemmTile>(c.tile);
    a.tuning->lora_fused = c.lora_fused;
    if (c.act8 >= 0) a.tuning->act_fp8 = c.act8 == 1;
    if (c.wgmma >= 0)
      a.tuning->wgmma = c.wgmma == 1;
    else if (a.tuning->act_fp8)
      a.tuning->wgmma = false;  // a forced W8A8 case on the heuristic's kernel: mma.sync
    if (c.split >= 0) a.tuning->act_split = c.split == 1;
    if (c.lora_gemm >= 0) a.tuning->lora_in_gemm = c.lora_gemm == 1;
    if (c.lora_reduce >= 0) a.tuning->lora_down_in_reduce = c.lora_reduce == 1;
    if (c.lora_direct >= 0) a.tuning->lora_direct = c.lora_direct == 1;
    if (c.lora_beside >= 0) a.tuning->lora_shrink_beside_gemm = c.lora_beside == 1;
    return a;
  }
  cuda::MoeStreams streams() {
    cuda::MoeStreams s;
    s.main = main;
    s.side = c.two_streams ? side : nullptr;
    s.ev_ids = ev[0];
    s.ev_gu = ev[1];
    s.ev_act = ev[2];
    s.ev_d = ev[3];
    return s;
  }

  // Compares everything the last run produced with the CPU reference.
  void check(const char* what) {
    SCOPED_TRACE(what);
    const int T = c.T, k = c.k, H = c.H, I = c.I;
    const size_t P = static_cast<size_t>(T) * k;
    const auto ids = d_ids.download();
    const auto w = d_w.download();
    if (c.route != kSentinel) {
      std::vector<int32_t> rid(P);
      std::vector<float> rw(P);
      if (c.grouped)
        cpu::topk_sigmoid_grouped(logits.data(), bias.data(), T, c.E, k, c.n_group, c.topk_group, true, c.scaling,
                                  rid.data(), rw.data());
      else
        cpu::topk_softmax(logits.data(), T, c.E, k, true, rid.data(), rw.data());
      int bad = 0;
      for (size_t i = 0; i < P; ++i) bad += ids[i] != rid[i];
      EXPECT_EQ(bad, 0) << "routing ids differ from cpu::topk";
    }
    std::vector<int32_t> ref_slot(slot);
    for (auto& s : ref_slot)
      if (s >= c.slots) s = -1;  // the GPU treats out-of-range slots as base-only
    auto dl = [](const void* p, size_t n) { return from_bf16(download(static_cast<const uint16_t*>(p), n)); };
    const auto act = dl(ws.act, P * I);
    const bool w8a8 = ex.fp8 && args().tuning->act_fp8;  // the regime the GPU ran
    const MoeReference ref = moe_reference(ex, x, T, ids, w, c.slots ? &ref_slot : nullptr,
                                           c.slots ? &lora : nullptr, &act, w8a8);
    const auto out = from_bf16(d_out.download());
    if (w8a8) {
      // e4m3 rounding amplifies bf16-level differences in act: ~1/64 of its elements flip one e4m3
      // step (2^-3), ~1.5 % per row (measured 1.0-4.4 % on the H200 with LoRA deltas as large as
      // the base). So the down stage is judged on the GPU's own act, gate_up on the act check below.
      SCOPED_TRACE("W8A8 output from the GPU's act");
      EXPECT_CLOSE_ROWS(out, ref.out_from_down_input, T, H, 1e-2);
    } else {
      EXPECT_CLOSE_ROWS(out, ref.out, T, H, 1e-2);
    }
    EXPECT_TRUE(d_out.guard_intact()) << "output guard overwritten";
    // Stage checks on the workspace (rows of valid pairs).
    std::vector<float> a_got, a_ref;
    for (size_t p = 0; p < P; ++p) {
      if (ids[p] < 0 || ids[p] >= c.E) continue;
      a_got.insert(a_got.end(), act.begin() + p * I, act.begin() + (p + 1) * I);
      a_ref.insert(a_ref.end(), ref.act.begin() + p * I, ref.act.begin() + (p + 1) * I);
    }
    {
      SCOPED_TRACE("act (gate_up + SwiGLU)");
      EXPECT_CLOSE_ROWS(a_got, a_ref, static_cast<int64_t>(a_got.size() / std::max(I, 1)), I, 1e-2);
    }
    if (c.slots) {
      if (!args().tuning->lora_in_gemm) {  // else no delta buffer: the GEMM's epilogue adds it (act above)
        SCOPED_TRACE("gate_up LoRA delta");
        EXPECT_CLOSE_ROWS(dl(ws.delta_gu, P * 2 * I), ref.delta_gu, static_cast<int64_t>(P), 2 * I, 1e-2);
      }
      if (!args().tuning->lora_down_in_reduce) {  // else no delta buffer: moe_reduce adds it (out above)
        SCOPED_TRACE("down LoRA delta (from the GPU's act)");
        EXPECT_CLOSE_ROWS(dl(ws.delta_d, P * H), ref.delta_d, static_cast<int64_t>(P), H, 1e-2);
      }
    }
  }

  // Runs the layer again on the same inputs with `flip` applied to the tuning of the last run and
  // expects the same output and act bits.
  template <typename Flip>
  void expect_same_bits(Flip flip, const char* what) {
    const size_t P = static_cast<size_t>(c.T) * c.k;
    const auto first = d_out.download();
    const auto first_act = download(reinterpret_cast<const uint16_t*>(ws.act), P * c.I);
    cuda::MoeForwardArgs a = args();
    flip(*a.tuning);
    poison();
    cuda::moe_forward(a, ws, streams());
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(main));
    MOELORA_CUDA_CHECK(cudaGetLastError());
    const auto second = d_out.download();
    const auto second_act = download(reinterpret_cast<const uint16_t*>(ws.act), first_act.size());
    const auto ids = d_ids.download();
    size_t diff = 0, diff_act = 0;
    for (size_t i = 0; i < first.size(); ++i) diff += first[i] != second[i];
    for (size_t p = 0; p < ids.size(); ++p)  // rows of routed pairs (others are never written)
      if (ids[p] >= 0 && ids[p] < c.E)
        for (int f = 0; f < c.I; ++f) diff_act += first_act[p * c.I + f] != second_act[p * c.I + f];
    EXPECT_EQ(diff, 0u) << what << ": output";
    EXPECT_EQ(diff_act, 0u) << what << ": act";
  }

  void poison() {
    wsbuf.poison(0xFF);  // NaN floats / bf16, -1 ints: reading unwritten scratch shows
    d_out.poison(0xFF);
    if (c.route != kSentinel) {
      d_ids.poison(0xFF);
      d_w.poison(0xFF);
    }
  }
};

class MoeLayer : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeLayer, MatchesCpu) {
  MOELORA_REQUIRE_GPU();
  Harness h(GetParam());
  h.make_inputs();
  h.poison();
  if (!h.c.graph) {
    cuda::moe_forward(h.args(), h.ws, h.streams());
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(h.main));
    MOELORA_CUDA_CHECK(cudaGetLastError());
    h.check("eager");
    // The other form of each LoRA expand (its own kernel / inside the GEMM epilogue or moe_reduce)
    // must give the same bits: same sums, same bf16 rounding of the delta.
    if (h.c.slots && h.c.lora_gemm < 0)
      h.expect_same_bits([](cuda_plan::MoeTuning& t) { t.lora_in_gemm = !t.lora_in_gemm; }, "gate_up LoRA expand in the GEMM vs its own kernel");
    if (h.c.slots && h.c.lora_reduce < 0)
      h.expect_same_bits([](cuda_plan::MoeTuning& t) { t.lora_down_in_reduce = !t.lora_down_in_reduce; },
                         "down LoRA expand in moe_reduce vs its own kernel");
    // Per-pair LoRA items against moe_align's (slot, expert) groups: the same row sums.
    if (h.c.slots && h.c.lora_direct < 0)
      h.expect_same_bits([](cuda_plan::MoeTuning& t) { t.lora_direct = !t.lora_direct; },
                         "LoRA per routed pair vs grouped by moe_align");
    // The LoRA kernels beside the GEMMs (one stream, the GEMMs waiting only before their
    // epilogues) against before them or on the side stream: a missed wait shows as other bits.
    if (h.c.slots && h.c.lora_beside < 0)
      h.expect_same_bits([](cuda_plan::MoeTuning& t) { t.lora_shrink_beside_gemm = !t.lora_shrink_beside_gemm; },
                         "LoRA beside the grouped GEMMs vs before them");
    return;
  }
  // Graph: captured once, replayed on new inputs written in place (static buffers), as the
  // engine does for each decode step.
  cuda::moe_gemm_init();
  cuda::moe_forward(h.args(), h.ws, h.streams());  // warm-up outside capture (lazy attributes)
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(h.main));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(h.main, cudaStreamCaptureModeThreadLocal));
  cuda::moe_forward(h.args(), h.ws, h.streams());
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(h.main, &g));
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int rep = 0; rep < 2; ++rep) {
    if (rep) h.make_inputs();
    h.poison();
    MOELORA_CUDA_CHECK(cudaGraphLaunch(ge, h.main));
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(h.main));
    h.check(rep ? "graph replay, new inputs" : "graph replay");
  }
  MOELORA_CUDA_CHECK(cudaGraphExecDestroy(ge));
  MOELORA_CUDA_CHECK(cudaGraphDestroy(g));
}

MoeCase base(int T, int E, int k, int H, int I) {
  MoeCase c;
  c.T = T;
  c.E = E;
  c.k = k;
  c.H = H;
  c.I = I;
  return c;
}
MoeCase with_lora(MoeCase c, int slots, std::vector<int> ranks, SlotPattern pat = kSlotRandom) {
  c.slots = slots;
  c.ranks = std::move(ranks);
  c.slot_pattern = pat;
  return c;
}

std::vector<MoeCase> moe_cases() {
  std::vector<MoeCase> v;
  // Base, fixture sizes (H 128, I 192: K not a multiple of 128), FP8 and bf16 experts.
  for (bool fp8 : {true, false}) {
    for (int T : {0, 1, 5, 13}) {
      MoeCase c = base(T, T == 13 ? 8 : 4, 2, 128, 192);
      c.fp8 = fp8;
      v.push_back(c);
    }
  }
  { MoeCase c = base(40, 8, 2, 128, 192); c.route = kOneExpert; v.push_back(c); }   // one expert gets all 40
  { MoeCase c = base(24, 8, 2, 128, 192); c.route = kHalfEmpty; v.push_back(c); }   // 4 experts get none
  { MoeCase c = base(33, 8, 2, 128, 192); c.route = kTies; v.push_back(c); }
  { MoeCase c = base(19, 8, 2, 128, 192); c.route = kSentinel; v.push_back(c); }    // ids -1, E, E+1000
  // Every GEMM tile on one batch (several tiles per expert, partial tiles): FP8 in both regimes
  // (W8A16, W8A8) and bf16.
  for (int t = 0; t < 4; ++t)
    for (int mode = 0; mode < 3; ++mode) {
      MoeCase c = base(100, 8, 2, 256, 128);
      c.tile = t;
      c.fp8 = mode < 2;
      if (c.fp8) c.act8 = mode;
      v.push_back(c);
    }
  // W8A8 with a partial last 128-channel group in both GEMMs (H 128 + 64, I 192), sentinel ids,
  // and every tile on it.
  for (int t = 0; t < 3; ++t) {  // (the 64-row tile needs H % 128 == 0)
    MoeCase c = base(37, 8, 2, 192, 192);
    c.tile = t;
    c.act8 = 1;
    v.push_back(c);
  }
  { MoeCase c = base(19, 8, 2, 128, 192); c.route = kSentinel; c.act8 = 1; c.tile = 1; v.push_back(c); }
  v.push_back(base(512, 8, 2, 256, 256));  // prefill-shaped: auto-picks the 64-row tile
  // Qwen3-30B-A3B shapes (H 2048, E 128, top-8, I 768): decode (W8A16) and 128 tokens (W8A8).
  v.push_back(base(3, 128, 8, 2048, 768));
  v.push_back(base(128, 128, 8, 2048, 768));
  // DeepSeek-V3 routing (sigmoid + bias, groups) on small experts: E 8 (2 groups, keep 1), E 256.
  { MoeCase c = base(11, 8, 2, 128, 128); c.grouped = true; c.n_group = 2; c.topk_group = 1; v.push_back(c); }
  { MoeCase c = base(6, 256, 8, 128, 128); c.grouped = true; c.n_group = 8; c.topk_group = 4; c.scaling = 2.5f; v.push_back(c); }
  { MoeCase c = base(70, 256, 8, 128, 128); c.grouped = true; c.n_group = 8; c.topk_group = 4; c.scaling = 2.5f; c.fuse = false; v.push_back(c); }
  // LoRA: mixed ranks 1..128 with base-only tokens, every token a different adapter, one adapter,
  // all base with LoRA on, invalid slots, shared A / shared B / all shared, half-disabled slots.
  v.push_back(with_lora(base(24, 8, 2, 128, 192), 4, {1, 16, 128, 5}));
  v.push_back(with_lora(base(16, 8, 2, 128, 192), 16, {16, 8, 32}, kSlotDistinct));
  v.push_back(with_lora(base(12, 8, 2, 128, 192), 1, {16}, kSlotOne));
  v.push_back(with_lora(base(9, 8, 2, 128, 192), 3, {16}, kSlotNone));
  v.push_back(with_lora(base(20, 8, 2, 128, 192), 3, {16, 4}, kSlotInvalid));
  for (int share : {1, 8, 9, 15}) {
    MoeCase c = with_lora(base(21, 8, 2, 128, 192), 4, {16, 7});
    c.share = share;
    v.push_back(c);
  }
  { MoeCase c = with_lora(base(18, 8, 2, 128, 192), 4, {16}); c.half_rank0 = true; v.push_back(c); }
  { MoeCase c = with_lora(base(14, 8, 2, 128, 192), 3, {16}); c.fp8 = false; v.push_back(c); }
  { MoeCase c = with_lora(base(15, 8, 2, 128, 192), 3, {16, 64}); c.two_streams = false; v.push_back(c); }
  { MoeCase c = with_lora(base(15, 8, 2, 128, 192), 3, {16, 64}); c.pdl = false; c.fuse = false; v.push_back(c); }
  { MoeCase c = with_lora(base(6, 256, 8, 128, 128), 3, {16}); c.grouped = true; c.n_group = 8; c.topk_group = 4;
    c.scaling = 2.5f; v.push_back(c); }  // routing weight x LoRA with routed_scaling_factor 2.5
  v.push_back(with_lora(base(3, 128, 8, 2048, 768), 4, {16}));  // Qwen3 shapes with LoRA
  { MoeCase c = with_lora(base(40, 128, 8, 2048, 768), 8, {16, 64}); c.act8 = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(24, 8, 2, 128, 192), 4, {1, 16, 128, 5}); c.act8 = 1; c.tile = 2; v.push_back(c); }
  // The largest captured batch: 256 tokens, top-8 of 128, 8 adapters, mixed ranks.
  v.push_back(with_lora(base(256, 128, 8, 256, 128), 8, {16, 32, 8, 128}));
  // CUDA graph capture + replay with new inputs (two streams, PDL), decode and mid sizes.
  { MoeCase c = with_lora(base(16, 8, 2, 128, 192), 4, {16, 1, 128}); c.graph = true; v.push_back(c); }
  { MoeCase c = with_lora(base(64, 128, 8, 256, 128), 8, {16}); c.graph = true; c.share = 9; v.push_back(c); }
  { MoeCase c = base(2, 128, 8, 256, 128); c.graph = true; v.push_back(c); }
  { MoeCase c = with_lora(base(48, 8, 2, 256, 192), 4, {16}); c.graph = true; c.act8 = 1; c.tile = 1; v.push_back(c); }
  // The Hopper grouped GEMM (TMA weight ring + wgmma; H and I multiples of 128): every tile,
  // partial and padded tiles, one expert with every token, sentinel ids, LoRA deltas before
  // SwiGLU, Qwen3 shapes, graph replay.
  for (int t = 0; t < 4; ++t) {
    MoeCase c = base(100, 8, 2, 256, 128);
    c.tile = t;
    c.wgmma = 1;
    v.push_back(c);
  }
  for (int T : {1, 5}) { MoeCase c = base(T, 8, 2, 128, 256); c.wgmma = 1; c.tile = 0; v.push_back(c); }
  { MoeCase c = base(40, 8, 2, 128, 256); c.route = kOneExpert; c.tile = 3; c.wgmma = 1; v.push_back(c); }
  { MoeCase c = base(19, 8, 2, 256, 128); c.route = kSentinel; c.tile = 1; c.wgmma = 1; v.push_back(c); }
  { MoeCase c = base(24, 8, 2, 256, 128); c.route = kHalfEmpty; c.tile = 2; c.wgmma = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(24, 8, 2, 256, 256), 4, {1, 16, 128, 5}); c.wgmma = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = base(3, 128, 8, 2048, 768); c.wgmma = 1; c.tile = 0; v.push_back(c); }
  { MoeCase c = base(128, 128, 8, 2048, 768); c.wgmma = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(40, 128, 8, 2048, 768), 8, {16, 64}); c.wgmma = 1; c.tile = 2; v.push_back(c); }
  { MoeCase c = with_lora(base(256, 128, 8, 256, 128), 8, {16, 32, 8, 128}); c.wgmma = 1; c.tile = 2; v.push_back(c); }
  { MoeCase c = with_lora(base(64, 128, 8, 256, 128), 8, {16}); c.graph = true; c.wgmma = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = base(512, 8, 2, 256, 256); c.wgmma = 1; c.tile = 3; v.push_back(c); }
  // The same GEMM with e4m3 x e4m3 wgmmas from shared memory: W8A8 (judged like the mma.sync W8A8
  // cases) and W8A16 with the activations in fp8_quant's split form (judged against the plain
  // W8A16 reference, like the dequantising kernel): every tile, the edges above, Qwen3 shapes.
  for (int t = 0; t < 4; ++t) {
    MoeCase c = base(100, 8, 2, 256, 128);
    c.tile = t;
    c.wgmma = 1;
    c.split = 1;
    v.push_back(c);
    MoeCase d = c;
    d.split = -1;
    d.act8 = 1;
    v.push_back(d);
  }
  { MoeCase c = base(1, 8, 2, 128, 256); c.wgmma = 1; c.split = 1; c.tile = 0; v.push_back(c); }
  { MoeCase c = base(40, 8, 2, 128, 256); c.route = kOneExpert; c.tile = 3; c.wgmma = 1; c.split = 1; v.push_back(c); }
  { MoeCase c = base(19, 8, 2, 256, 128); c.route = kSentinel; c.tile = 1; c.wgmma = 1; c.split = 1; v.push_back(c); }
  { MoeCase c = base(24, 8, 2, 256, 128); c.route = kHalfEmpty; c.tile = 2; c.wgmma = 1; c.split = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(24, 8, 2, 256, 256), 4, {1, 16, 128, 5}); c.wgmma = 1; c.split = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = base(3, 128, 8, 2048, 768); c.wgmma = 1; c.split = 1; c.tile = 0; v.push_back(c); }
  { MoeCase c = base(256, 128, 8, 2048, 768); c.wgmma = 1; c.split = 1; c.tile = 2; v.push_back(c); }
  { MoeCase c = base(256, 128, 8, 2048, 768); c.wgmma = 1; c.act8 = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(40, 128, 8, 2048, 768), 8, {16, 64}); c.wgmma = 1; c.split = 1; c.tile = 2; v.push_back(c); }
  { MoeCase c = with_lora(base(64, 128, 8, 256, 128), 8, {16}); c.graph = true; c.wgmma = 1; c.split = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = base(512, 8, 2, 256, 256); c.wgmma = 1; c.split = 1; c.tile = 3; v.push_back(c); }
  // Shapes no tensor-core tile takes (H or I a multiple of 16, not of 64): the generic GEMMs
  // (moe_gemm_generic.cu), chosen by the heuristic; partial FP8 blocks along both axes, bf16,
  // every route, LoRA with mixed ranks, groups, prefill-sized batches, graph replay.
  v.push_back(base(7, 8, 2, 80, 48));
  { MoeCase c = base(7, 8, 2, 80, 48); c.fp8 = false; v.push_back(c); }
  v.push_back(base(33, 8, 2, 208, 144));
  { MoeCase c = base(19, 8, 2, 208, 144); c.route = kSentinel; v.push_back(c); }
  { MoeCase c = base(24, 8, 2, 208, 144); c.route = kHalfEmpty; v.push_back(c); }
  v.push_back(base(300, 8, 2, 208, 144));
  v.push_back(base(5, 12, 4, 256, 96));  // the shapes of a Qwen3-MoE with moe_intermediate_size 96
  { MoeCase c = base(11, 16, 4, 128, 96); c.grouped = true; c.n_group = 4; c.topk_group = 2; c.scaling = 1.5f; v.push_back(c); }
  v.push_back(with_lora(base(24, 8, 2, 208, 144), 4, {1, 16, 128, 5}));
  { MoeCase c = with_lora(base(16, 8, 2, 80, 96), 3, {16, 8}); c.fp8 = false; v.push_back(c); }
  { MoeCase c = with_lora(base(16, 12, 4, 256, 96), 4, {16, 4}); c.graph = true; v.push_back(c); }
  // NVFP4 experts (W4A16 on the mma.sync kernels; cuda_plan/nvfp4_layout.h): every tile with
  // partial and padded tiles, the fixture sizes at 0..13 tokens, every route, LoRA with mixed ranks
  // and base-only tokens, DeepSeek groups, Qwen3 shapes, prefill-sized, graph replay.
  auto nvfp4 = [](MoeCase c) {
    c.nvfp4 = true;
    c.fp8 = false;
    return c;
  };
  for (int t = 0; t < 4; ++t) {
    MoeCase c = nvfp4(base(100, 8, 2, 256, 128));
    c.tile = t;
    v.push_back(c);
  }
  for (int T : {0, 1, 5, 13}) v.push_back(nvfp4(base(T, T == 13 ? 8 : 4, 2, 128, 192)));
  { MoeCase c = nvfp4(base(40, 8, 2, 128, 192)); c.route = kOneExpert; c.tile = 3; v.push_back(c); }
  { MoeCase c = nvfp4(base(19, 8, 2, 128, 192)); c.route = kSentinel; v.push_back(c); }
  { MoeCase c = nvfp4(base(24, 8, 2, 128, 192)); c.route = kHalfEmpty; c.tile = 1; v.push_back(c); }
  { MoeCase c = nvfp4(base(6, 256, 8, 128, 128)); c.grouped = true; c.n_group = 8; c.topk_group = 4; c.scaling = 2.5f;
    v.push_back(c); }
  v.push_back(nvfp4(base(1, 128, 8, 2048, 768)));
  v.push_back(nvfp4(base(64, 128, 8, 2048, 768)));
  v.push_back(nvfp4(base(512, 8, 2, 256, 256)));
  v.push_back(nvfp4(with_lora(base(24, 8, 2, 128, 192), 4, {1, 16, 128, 5})));
  v.push_back(nvfp4(with_lora(base(40, 128, 8, 2048, 768), 8, {16, 64})));
  { MoeCase c = nvfp4(with_lora(base(16, 8, 2, 128, 192), 4, {16, 1, 128})); c.graph = true; v.push_back(c); }
  { MoeCase c = nvfp4(base(2, 128, 8, 256, 128)); c.graph = true; v.push_back(c); }
  // NVFP4 on the wgmma GEMM (4-bit codes and group scales by TMA, decoded in registers; H and I
  // multiples of 128): every tile, one and five tokens, every route, LoRA, Qwen3 shapes, prefill-
  // sized, graph replay.
  for (int t = 0; t < 4; ++t) {
    MoeCase c = nvfp4(base(100, 8, 2, 256, 128));
    c.tile = t;
    c.wgmma = 1;
    v.push_back(c);
  }
  for (int T : {1, 5}) { MoeCase c = nvfp4(base(T, 8, 2, 128, 256)); c.wgmma = 1; c.tile = 0; v.push_back(c); }
  { MoeCase c = nvfp4(base(40, 8, 2, 128, 256)); c.route = kOneExpert; c.tile = 3; c.wgmma = 1; v.push_back(c); }
  { MoeCase c = nvfp4(base(19, 8, 2, 256, 128)); c.route = kSentinel; c.tile = 1; c.wgmma = 1; v.push_back(c); }
  { MoeCase c = nvfp4(base(24, 8, 2, 256, 128)); c.route = kHalfEmpty; c.tile = 2; c.wgmma = 1; v.push_back(c); }
  { MoeCase c = nvfp4(with_lora(base(24, 8, 2, 256, 256), 4, {1, 16, 128, 5})); c.wgmma = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = nvfp4(base(1, 128, 8, 2048, 768)); c.wgmma = 1; c.tile = 0; v.push_back(c); }
  { MoeCase c = nvfp4(base(64, 128, 8, 2048, 768)); c.wgmma = 1; c.tile = 0; v.push_back(c); }
  { MoeCase c = nvfp4(base(256, 128, 8, 2048, 768)); c.wgmma = 1; c.tile = 2; v.push_back(c); }
  { MoeCase c = nvfp4(with_lora(base(40, 128, 8, 2048, 768), 8, {16, 64})); c.wgmma = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = nvfp4(with_lora(base(64, 128, 8, 256, 128), 8, {16})); c.graph = true; c.wgmma = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = nvfp4(base(512, 8, 2, 256, 256)); c.wgmma = 1; c.tile = 3; v.push_back(c); }
  // The down LoRA expand inside moe_reduce (MoeTuning::lora_down_in_reduce; every eager LoRA case
  // also compares it bit for bit with the expand kernel): graph replay, one stream with the gate_up
  // expand in the GEMM too, Qwen3 shapes at one token with 8 adapters, NVFP4.
  { MoeCase c = with_lora(base(16, 8, 2, 128, 192), 4, {16, 1, 128}); c.graph = true; c.lora_reduce = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(15, 8, 2, 128, 192), 3, {16, 64}); c.two_streams = false; c.lora_gemm = 1; c.lora_reduce = 1;
    v.push_back(c); }
  { MoeCase c = with_lora(base(1, 128, 8, 2048, 768), 8, {16}, kSlotDistinct); c.lora_reduce = 1; v.push_back(c); }
  { MoeCase c = nvfp4(with_lora(base(24, 8, 2, 128, 192), 4, {1, 16, 128, 5})); c.graph = true; c.lora_reduce = 1;
    v.push_back(c); }
  // LoRA items per routed pair (MoeTuning::lora_direct; every eager LoRA case also compares it bit
  // for bit with moe_align's groups): sentinel expert ids with LoRA, invalid slots, shared factors
  // (a shared gate_up A: u once per token, by its first pair), half-disabled slots, the expand
  // kernels, graph replay with new inputs, Qwen3 shapes at 1 and 8 tokens with distinct adapters.
  { MoeCase c = with_lora(base(19, 8, 2, 128, 192), 3, {16, 4}); c.route = kSentinel; c.lora_direct = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(19, 8, 2, 128, 192), 3, {16, 4}, kSlotInvalid); c.route = kSentinel; c.lora_direct = 1;
    c.lora_gemm = 0; v.push_back(c); }
  for (int share : {1, 15}) {
    MoeCase c = with_lora(base(21, 8, 2, 128, 192), 4, {16, 7});
    c.share = share;
    c.lora_direct = 1;
    c.lora_gemm = 0;
    v.push_back(c);
  }
  { MoeCase c = with_lora(base(18, 8, 2, 128, 192), 4, {16}); c.half_rank0 = true; c.lora_direct = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(16, 8, 2, 128, 192), 4, {16, 1, 128}); c.graph = true; c.lora_direct = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(8, 128, 8, 2048, 768), 8, {16}, kSlotDistinct); c.graph = true; c.share = 9;
    c.lora_direct = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(1, 128, 8, 2048, 768), 8, {16}, kSlotDistinct); c.lora_direct = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(5, 8, 2, 128, 192), 3, {16, 64}); c.two_streams = false; c.lora_direct = 1; c.lora_reduce = 1;
    v.push_back(c); }
  // The LoRA shrinks beside the grouped GEMMs (MoeTuning::lora_shrink_beside_gemm; every eager LoRA
  // case also compares it bit for bit with the heuristic's placement): graph replay with new inputs
  // (per pair and grouped), Qwen3 shapes at 1 token (mma.sync) and 64 (wgmma, split-form act
  // quantised before the down shrink), W8A8 on mma.sync, both expand kernels (gate_up's epilogue
  // reads the delta the expand wrote), NVFP4.
  { MoeCase c = with_lora(base(16, 8, 2, 128, 192), 4, {16, 1, 128}); c.graph = true; c.lora_beside = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(16, 8, 2, 128, 192), 4, {16, 1, 128}); c.graph = true; c.lora_beside = 1;
    c.lora_direct = 0; c.lora_reduce = 0; v.push_back(c); }
  { MoeCase c = with_lora(base(1, 128, 8, 2048, 768), 8, {16}, kSlotDistinct); c.graph = true; c.lora_beside = 1;
    v.push_back(c); }
  { MoeCase c = with_lora(base(1, 128, 8, 2048, 768), 8, {16}, kSlotDistinct); c.graph = true; c.lora_beside = 0;
    v.push_back(c); }  // the placement before them, where the default is beside since 2026-12-07
  { MoeCase c = with_lora(base(64, 128, 8, 2048, 768), 8, {16}); c.lora_beside = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(64, 128, 8, 2048, 768), 8, {16}); c.graph = true; c.lora_beside = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(21, 8, 2, 128, 192), 3, {16}); c.act8 = 1; c.tile = 1; c.lora_beside = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(19, 8, 2, 128, 192), 3, {16, 4}, kSlotInvalid); c.route = kSentinel; c.lora_beside = 1;
    c.lora_gemm = 0; c.lora_reduce = 0; v.push_back(c); }
  { MoeCase c = nvfp4(with_lora(base(24, 8, 2, 128, 192), 4, {1, 16, 128, 5})); c.graph = true; c.lora_beside = 1;
    v.push_back(c); }
  // The fused LoRA kernel (shrink + expand in one launch) on the LoRA families above.
  std::vector<MoeCase> fused;
  for (const MoeCase& c : v)
    if (c.slots) {
      MoeCase f = c;
      f.lora_fused = true;
      f.lora_gemm = 0;  // both halves through the fused kernel
      fused.push_back(f);
    }
  v.insert(v.end(), fused.begin(), fused.end());
  return v;
}

std::string moe_test_name(const ::testing::TestParamInfo<MoeCase>& i) {
  return gtest_safe(i.param.name(), /*trim_trailing=*/false);
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeLayer, ::testing::ValuesIn(moe_cases()), moe_test_name);

// compute-sanitizer subset (memcheck, racecheck): small, every kernel and path once.
std::vector<MoeCase> moe_sanitize_cases() {
  std::vector<MoeCase> v;
  { MoeCase c = with_lora(base(7, 8, 2, 128, 192), 3, {1, 16, 128}); c.share = 1; v.push_back(c); }
  { MoeCase c = base(5, 4, 2, 128, 192); c.fp8 = false; v.push_back(c); }
  { MoeCase c = base(40, 8, 2, 128, 192); c.route = kOneExpert; c.tile = 3; v.push_back(c); }
  { MoeCase c = base(9, 8, 2, 128, 192); c.route = kSentinel; c.tile = 2; v.push_back(c); }
  { MoeCase c = with_lora(base(6, 8, 2, 128, 128), 2, {8}); c.grouped = true; c.n_group = 2; c.topk_group = 1;
    c.fuse = false; c.two_streams = false; v.push_back(c); }
  { MoeCase c = with_lora(base(7, 8, 2, 128, 192), 3, {1, 16, 128}); c.share = 9; c.lora_fused = true; v.push_back(c); }
  { MoeCase c = with_lora(base(21, 8, 2, 128, 192), 3, {16}); c.act8 = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = base(70, 8, 2, 256, 128); c.act8 = 1; c.tile = 3; v.push_back(c); }
  { MoeCase c = with_lora(base(21, 8, 2, 256, 128), 3, {16}); c.wgmma = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = base(9, 8, 2, 128, 256); c.route = kSentinel; c.wgmma = 1; c.tile = 0; v.push_back(c); }
  { MoeCase c = with_lora(base(21, 8, 2, 256, 128), 3, {16}); c.wgmma = 1; c.split = 1; c.tile = 1; v.push_back(c); }
  { MoeCase c = base(9, 8, 2, 128, 256); c.route = kSentinel; c.wgmma = 1; c.act8 = 1; c.tile = 0; v.push_back(c); }
  { MoeCase c = with_lora(base(7, 8, 2, 80, 48), 3, {1, 16}); v.push_back(c); }  // the generic GEMMs
  { MoeCase c = with_lora(base(9, 8, 2, 128, 192), 3, {1, 16}); c.nvfp4 = true; c.fp8 = false; c.route = kSentinel;
    v.push_back(c); }  // NVFP4
  { MoeCase c = base(40, 8, 2, 128, 192); c.nvfp4 = true; c.fp8 = false; c.tile = 3; v.push_back(c); }
  { MoeCase c = with_lora(base(21, 8, 2, 256, 128), 3, {16}); c.nvfp4 = true; c.fp8 = false; c.wgmma = 1; c.tile = 1;
    v.push_back(c); }  // NVFP4 on wgmma
  { MoeCase c = with_lora(base(7, 8, 2, 128, 192), 3, {1, 16, 128}); c.lora_gemm = 1; c.lora_reduce = 1; v.push_back(c); }
  { MoeCase c = with_lora(base(9, 8, 2, 128, 192), 3, {1, 16}); c.route = kSentinel; c.share = 1; c.lora_direct = 1;
    c.lora_gemm = 0; v.push_back(c); }  // per-pair LoRA items, both expand kernels
  { MoeCase c = with_lora(base(7, 8, 2, 128, 192), 3, {1, 16, 128}); c.share = 9; c.lora_direct = 1; c.lora_fused = true;
    v.push_back(c); }
  { MoeCase c = with_lora(base(9, 8, 2, 128, 256), 3, {1, 16}); c.lora_beside = 1; c.wgmma = 1; c.tile = 0; v.push_back(c); }
  { MoeCase c = with_lora(base(7, 8, 2, 128, 192), 3, {1, 16, 128}); c.lora_beside = 1; c.lora_direct = 1; v.push_back(c); }
  return v;
}
INSTANTIATE_TEST_SUITE_P(MoeSanitize, MoeLayer, ::testing::ValuesIn(moe_sanitize_cases()), moe_test_name);

}  // namespace
}  // namespace moelora::ops_test
