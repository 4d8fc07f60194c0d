// Workspace layout and launch sequence of one MoE layer (see moe_forward.cuh).
#include "backends/cuda/kernels/moe_forward.cuh"

#include "backends/cuda/kernels/fp8_quant.cuh"

#include <algorithm>

namespace moelora::cuda {

namespace {

constexpr size_t kAlign = 256;
constexpr int kMinTileRows = 8;      // smallest GEMM tile: sizes the base tile list for every config

size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Walks the layout once; with base == nullptr it only measures.
struct Carver {
  uint8_t* base;
  size_t off = 0;
  template <typename T>
  T* take(size_t n) {
    T* p = base ? reinterpret_cast<T*>(base + off) : nullptr;
    off += align_up(n * sizeof(T));
    return p;
  }
};

MoeWorkspace layout(void* base, const MoeShape& s, const MoeLoraShape* lora, size_t* bytes) {
  Carver c{static_cast<uint8_t*>(base)};
  MoeWorkspace w;
  const size_t P = static_cast<size_t>(s.max_tokens) * s.k;
  w.counters = c.take<int32_t>(kMoeNumCounters);
  w.sorted = c.take<int32_t>(std::max<size_t>(P, 1));
  w.max_tiles = moe_max_tiles(static_cast<int>(P), s.E, kMinTileRows);
  w.tiles = c.take<MoeTile>(std::max(w.max_tiles, 1));
  // [tiles, rows] for any GEMM tile: sum_e ceil(n_e / rows) * rows <= P + rows * min(E, P), rows <= 64.
  w.tile_pairs = c.take<int32_t>(P + 64 * std::min<size_t>(s.E, P) + 1);
  w.act = c.take<bf16>(std::max<size_t>(P * s.I, 1));
  w.y = c.take<float>(std::max<size_t>(P * s.H, 1));
  if (s.fp8_activations || s.fp8_split) {
    w.xq = c.take<uint8_t>(std::max<size_t>(static_cast<size_t>(s.max_tokens) * s.H, 1));
    w.xs = c.take<float>(std::max<size_t>(static_cast<size_t>(s.max_tokens) * ((s.H + 127) / 128), 1));
    w.aq = c.take<uint8_t>(std::max<size_t>(P * s.I, 1));
    w.as = c.take<float>(std::max<size_t>(P * ((s.I + 127) / 128), 1));
  }
  if (s.fp8_split) {
    w.xq_lo = c.take<uint8_t>(std::max<size_t>(static_cast<size_t>(s.max_tokens) * s.H, 1));
    w.aq_lo = c.take<uint8_t>(std::max<size_t>(P * s.I, 1));
  }
  if (lora) {
    const int nb = lora->num_slots * s.E + 1;
    w.l_sorted = c.take<int32_t>(std::max<size_t>(P, 1));
    w.max_l_tiles = moe_max_tiles(static_cast<int>(P), nb, kMoeLoraTileRows);
    w.l_tiles = c.take<MoeTile>(std::max(w.max_l_tiles, 1));
    w.t_sorted = c.take<int32_t>(std::max(s.max_tokens, 1));
    w.max_g_tiles = w.max_l_tiles + moe_max_tiles(s.max_tokens, lora->num_slots, kMoeLoraTileRows);
    w.g_tiles = c.take<MoeTile>(std::max(w.max_g_tiles, 1));
    w.ldu = std::max(lora->max_rank, 1);
    w.u_gu_pair = c.take<float>(std::max<size_t>(P * w.ldu, 1));
    w.u_gu_tok = c.take<float>(std::max<size_t>(static_cast<size_t>(s.max_tokens) * w.ldu, 1));
    w.u_d = c.take<float>(std::max<size_t>(P * w.ldu, 1));
    w.delta_gu = c.take<bf16>(std::max<size_t>(P * 2 * s.I, 1));
    w.delta_d = c.take<bf16>(std::max<size_t>(P * s.H, 1));
  }
  *bytes = c.off;
  return w;
}

// What a LoRA half reads and writes: gate_up from x (row p / top_k of pair p) into the [P, 2I]
// pre-activation delta, down from act (row p) into the [P, H] delta; its factors and u rows.
struct LoraHalf {
  const bf16* x;
  int64_t ldx;
  int K, x_row_div, N;
  MoeLoraFactors a, b;
  bf16* delta;
  float* u_pair;
  float* u_tok;  // gate_up only: u of shared-A slots, once per token
};
LoraHalf lora_half(const MoeForwardArgs& a, const MoeWorkspace& ws, bool gate_up) {
  const MoeShape& s = a.shape;
  if (gate_up) return {a.x, a.ldx, s.H, s.k, 2 * s.I, a.lora->gu_a, a.lora->gu_b, ws.delta_gu, ws.u_gu_pair, ws.u_gu_tok};
  return {ws.act, s.I, s.I, 1, s.H, a.lora->d_a, a.lora->d_b, ws.delta_d, ws.u_d, nullptr};
}

// The per-pair form's items (MoeTuning::lora_direct), or the grouped form's (ids null).
MoeLoraPairs lora_pairs(const MoeForwardArgs& a, bool direct) {
  if (!direct) return {};
  return {a.ids, a.token_slot, a.T * a.shape.k, a.shape.k, a.shape.E};
}

// One LoRA half as one shrink + expand launch over l_tiles (or per pair).
MoeLoraFusedParams fused_params(const MoeForwardArgs& a, const MoeWorkspace& ws, bool gate_up, bool pdl, bool direct) {
  const LoraHalf h = lora_half(a, ws, gate_up);
  MoeLoraFusedParams f;
  f.x = h.x;
  f.ldx = h.ldx;
  f.K = h.K;
  f.x_row_div = h.x_row_div;
  f.tiles = ws.l_tiles;
  f.num_tiles = ws.counters + kMoeCntLoraTiles;
  f.max_tiles = ws.max_l_tiles;
  f.sorted_pairs = ws.l_sorted;
  f.a = h.a;
  f.b = h.b;
  f.num_slots = a.lora->num_slots;
  f.N = h.N;
  f.out = h.delta;
  f.direct = lora_pairs(a, direct);
  f.pdl = pdl;
  return f;
}

// One LoRA half's shrink. gate_up: u rows per pair (per-expert A) or per token (shared A) over
// g_tiles, from x; down: u rows per pair over l_tiles, from act.
MoeLoraShrinkParams shrink_params(const MoeForwardArgs& a, const MoeWorkspace& ws, bool gate_up, bool pdl,
                                  bool direct) {
  const LoraHalf h = lora_half(a, ws, gate_up);
  MoeLoraShrinkParams sh;
  sh.x = h.x;
  sh.ldx = h.ldx;
  sh.K = h.K;
  sh.x_row_div = h.x_row_div;
  sh.tiles = gate_up ? ws.g_tiles : ws.l_tiles;
  sh.num_tiles = ws.counters + (gate_up ? kMoeCntLoraGuTiles : kMoeCntLoraTiles);
  sh.max_tiles = gate_up ? ws.max_g_tiles : ws.max_l_tiles;
  sh.sorted_pairs = ws.l_sorted;
  sh.sorted_tokens = gate_up ? ws.t_sorted : nullptr;
  sh.a = h.a;
  sh.num_slots = a.lora->num_slots;
  sh.max_rank = a.lora->max_rank;
  sh.u_pair = h.u_pair;
  sh.u_tok = h.u_tok;
  sh.ldu = ws.ldu;
  sh.direct = lora_pairs(a, direct);
  sh.pdl = pdl;
  return sh;
}

// One LoRA half's expand over l_tiles into its delta buffer.
MoeLoraExpandParams expand_params(const MoeForwardArgs& a, const MoeWorkspace& ws, bool gate_up, bool pdl,
                                  bool direct) {
  const LoraHalf h = lora_half(a, ws, gate_up);
  MoeLoraExpandParams ex;
  ex.u_pair = h.u_pair;
  ex.u_tok = h.u_tok;
  ex.ldu = ws.ldu;
  ex.top_k = a.shape.k;
  ex.a_stride = gate_up ? h.a.stride : nullptr;  // a slot with a shared gate_up A reads u_tok
  ex.tiles = ws.l_tiles;
  ex.num_tiles = ws.counters + kMoeCntLoraTiles;
  ex.max_tiles = ws.max_l_tiles;
  ex.sorted_pairs = ws.l_sorted;
  ex.b = h.b;
  ex.num_slots = a.lora->num_slots;
  ex.N = h.N;
  ex.out = h.delta;
  ex.direct = lora_pairs(a, direct);
  ex.pdl = pdl;
  return ex;
}

// W8A8: rows [M, K] of `x` to e4m3 `q` [M, K] with token-major scales [M, ceil(K / 128)]; with
// q_lo, the split form (two terms).
void quantize_rows(const bf16* x, int64_t ldx, int M, int K, uint8_t* q, float* scales, cudaStream_t stream,
                   uint8_t* q_lo = nullptr) {
  Fp8QuantParams p;
  p.q_lo = q_lo;
  p.x = x;
  p.ld_x = ldx;
  p.M = M;
  p.K = K;
  p.q = q;
  p.ld_q = K;
  p.scales = scales;
  p.scale_ld = (K + kFp8Group - 1) / kFp8Group;
  launch_fp8_quant_per_token(p, stream);
}

}  // namespace

size_t moe_workspace_bytes(const MoeShape& s, const MoeLoraShape* lora) {
  size_t b = 0;
  layout(nullptr, s, lora, &b);
  return b;
}

MoeWorkspace moe_workspace_carve(void* base, const MoeShape& s, const MoeLoraShape* lora) {
  MOELORA_CHECK(base && (reinterpret_cast<uintptr_t>(base) % kAlign) == 0);
  MOELORA_CHECK(!lora || (lora->max_rank >= 0 && lora->max_rank <= kMoeLoraMaxRank));
  size_t b = 0;
  return layout(base, s, lora, &b);
}

cuda_plan::MoeTuning moe_tuning(const MoeForwardArgs& a) {
  if (a.tuning) return *a.tuning;
  const MoeShape& s = a.shape;
  return cuda_plan::choose_moe_tuning(
      cuda_plan::MoeProblem{.T = a.T, .k = s.k, .E = s.E, .H = s.H, .I = s.I, .has_logits = a.logits != nullptr,
                            .allow_fp8_activations = a.allow_fp8_activations,
                            .fp8_experts = a.wtype == MoeWeightType::kFp8,
                            .nvfp4_experts = a.wtype == MoeWeightType::kNvfp4});
}

void moe_forward(const MoeForwardArgs& a, const MoeWorkspace& ws, const MoeStreams& st) {
  moe_forward_prefix(a, ws, st, MoeStage::kAll);
}

void moe_forward_prefix(const MoeForwardArgs& a, const MoeWorkspace& ws, const MoeStreams& st, MoeStage last) {
  const MoeShape& s = a.shape;
  MOELORA_CHECK(a.T >= 0 && a.T <= s.max_tokens && a.x && a.ids && a.weights && a.out);
  if (a.T == 0) return;
  const bool lora = a.lora != nullptr && a.token_slot != nullptr;
  MOELORA_CHECK(!lora || (ws.l_tiles && ws.ldu >= a.lora->max_rank));
  MOELORA_CHECK(!lora || !st.side || (st.ev_ids && st.ev_gu && st.ev_act && st.ev_d));
  // The LoRA shrinks beside the grouped GEMMs (MoeTuning::lora_shrink_beside_gemm): every LoRA
  // kernel on M, each GEMM right behind its half's LoRA kernels and waiting for them only before
  // its epilogue, so the shrink runs beside the GEMM's main loop without a second stream.
  const cuda_plan::MoeTuning tune = moe_tuning(a);
  const bool beside = lora && tune.lora_shrink_beside_gemm;
  const bool two_streams = lora && st.side && !beside;
  MOELORA_CHECK_MSG(last == MoeStage::kAll || !lora, "MoE stage prefixes are timed without LoRA");
  cudaStream_t M = st.main, S = two_streams ? st.side : st.main;
  const int P = a.T * s.k;

  const MoeGemmTile tile = tune.tile;
  const bool pdl = tune.pdl;
  MOELORA_CHECK_MSG(a.wtype != MoeWeightType::kNvfp4 || !tune.generic,
                    "NVFP4 experts run on the tensor-core grouped GEMMs (mma.sync or wgmma) only");
  const bool act_fp8 = tune.act_fp8 && a.wtype == MoeWeightType::kFp8;
  MOELORA_CHECK_MSG(!act_fp8 || ws.xq, "W8A8 MoE needs a workspace carved with MoeShape::fp8_activations");
  // W8A16 on the wgmma GEMM with the activations in the split form (two e4m3 terms).
  const bool split = !act_fp8 && tune.act_split && tune.wgmma && a.wtype == MoeWeightType::kFp8;
  MOELORA_CHECK_MSG(!split || ws.xq_lo, "the split-form MoE GEMM needs a workspace carved with MoeShape::fp8_split");
  const int H_groups = (s.H + 127) / 128, I_groups = (s.I + 127) / 128;
  if (act_fp8 || split)  // first of the layer: it reads only x (the router that follows waits for it)
    quantize_rows(a.x, a.ldx, a.T, s.H, ws.xq, ws.xs, M, split ? ws.xq_lo : nullptr);

  // ---- Routing + alignment (one launch when routing is fused).
  RouterParams rp = a.router;
  rp.logits = a.logits;
  rp.T = a.T;
  rp.E = s.E;
  rp.k = s.k;
  rp.ids = a.ids;
  rp.weights = a.weights;
  const bool fuse = a.logits && tune.fuse_route && s.E <= 256 && s.k <= 32;  // what moe_align can route
  if (a.logits && !fuse) {
    rp.pdl = pdl;
    router_topk(rp, M);
  }
  MoeAlignParams al;
  if (fuse) al.route = rp;
  al.route.logits = fuse ? a.logits : nullptr;
  al.ids = a.ids;
  al.T = a.T;
  al.k = s.k;
  al.E = s.E;
  al.tile_rows = moe_gemm_tile_rows(tile);
  al.sorted = ws.sorted;
  al.tile_pairs = ws.tile_pairs;
  al.tiles = ws.tiles;
  al.max_tiles = ws.max_tiles;
  al.counters = ws.counters;
  const bool direct = lora && tune.lora_direct;  // per-pair LoRA items: no LoRA grouping in moe_align
  if (lora && !direct) {
    al.token_slot = a.token_slot;
    al.num_slots = a.lora->num_slots;
    al.gu_rank = a.lora->gu_a.rank;
    al.d_rank = a.lora->d_a.rank;
    al.gu_a_stride = a.lora->gu_a.stride;
    al.l_sorted = ws.l_sorted;
    al.l_tiles = ws.l_tiles;
    al.max_l_tiles = ws.max_l_tiles;
    al.t_sorted = ws.t_sorted;
    al.g_tiles = ws.g_tiles;
    al.max_g_tiles = ws.max_g_tiles;
  }
  al.pdl = pdl && a.logits && !fuse;  // PDL only behind our own router kernel (else: first of the layer)
  moe_align(al, M);
  if (last == MoeStage::kRouteAlign) return;

  // ---- gate_up LoRA. In the GEMM (tune.lora_in_gemm): only the shrink, on the main stream
  // between moe_align and gate_up (PDL chain), whose epilogue then adds u . B itself. Otherwise
  // shrink + expand into delta_gu on the side stream, joined before gate_up.
  const bool gu_in_gemm = lora && tune.lora_in_gemm;
  if (gu_in_gemm) {
    moe_lora_shrink(shrink_params(a, ws, /*gate_up=*/true, pdl, direct), M);
  } else if (lora) {
    if (two_streams) {
      MOELORA_CUDA_CHECK(cudaEventRecord(st.ev_ids, M));
      MOELORA_CUDA_CHECK(cudaStreamWaitEvent(S, st.ev_ids, 0));
    }
    if (tune.lora_fused) {
      moe_lora_fused(fused_params(a, ws, /*gate_up=*/true, pdl && !two_streams, direct), S);
    } else {
      moe_lora_shrink(shrink_params(a, ws, /*gate_up=*/true, pdl && !two_streams, direct), S);  // behind moe_align on one stream
      moe_lora_expand(expand_params(a, ws, /*gate_up=*/true, pdl, direct), S);
    }
    if (two_streams) {
      MOELORA_CUDA_CHECK(cudaEventRecord(st.ev_gu, S));
      MOELORA_CUDA_CHECK(cudaStreamWaitEvent(M, st.ev_gu, 0));
    }
  }

  // ---- Base gate_up (+ delta before SwiGLU).
  MoeGemmParams g;
  g.wtype = a.wtype;
  g.tile = tile;
  g.E = s.E;
  g.H = s.H;
  g.I = s.I;
  g.top_k = s.k;
  g.w = a.w_gate_up;
  g.w_scale = a.s_gate_up;
  g.w_group_scale = a.group_scale_gate_up;
  g.w_global_scale = a.global_scale_gate_up;
  g.x = a.x;
  g.ldx = a.ldx;
  g.tile_pairs = ws.tile_pairs;
  g.align_tile_rows = al.tile_rows;
  g.tiles = ws.tiles;
  g.counters = ws.counters;
  g.max_tiles = moe_max_tiles(P, s.E, moe_gemm_tile_rows(tile));
  g.act_fp8 = act_fp8 || split;
  g.generic = tune.generic;
  g.wgmma = tune.wgmma;  // moe_gate_up_wgmma refuses problems it does not take (FP8 weights, shape)
  g.xq = ws.xq;
  g.xq_lo = split ? ws.xq_lo : nullptr;
  g.ldxq = s.H;
  g.xs = ws.xs;
  g.ldxs = H_groups;
  g.lora_delta = lora && !gu_in_gemm ? ws.delta_gu : nullptr;
  if (gu_in_gemm) {
    const LoraHalf h = lora_half(a, ws, /*gate_up=*/true);
    g.lora_gu.token_slot = a.token_slot;
    g.lora_gu.num_slots = a.lora->num_slots;
    g.lora_gu.top_k = s.k;
    g.lora_gu.u_pair = h.u_pair;
    g.lora_gu.u_tok = h.u_tok;
    g.lora_gu.ldu = ws.ldu;
    g.lora_gu.a_stride = h.a.stride;
    g.lora_gu.b = h.b;
  }
  g.act = ws.act;
  g.pdl = pdl && (!two_streams || gu_in_gemm);  // an event wait precedes it when the side stream made the delta
  g.wait_before_epilogue = beside && pdl;        // behind this half's LoRA kernels on M, which wait first
  moe_gate_up(g, M);
  if (last == MoeStage::kGateUp) return;
  // act rows of every pair (rows of skipped pairs are never read by moe_down), in the W8A8 and split
  // regimes: right before moe_down, or beside, before the down LoRA kernels, so that these directly
  // precede moe_down.
  const bool quantize_act = act_fp8 || split;
  auto quantize_act_rows = [&] { quantize_rows(ws.act, s.I, P, s.I, ws.aq, ws.as, M, split ? ws.aq_lo : nullptr); };
  if (quantize_act && beside) quantize_act_rows();

  // ---- down LoRA (side stream, concurrent with the base down GEMM): shrink + expand into
  // delta_d, or only the shrink when moe_reduce adds u . B itself (tune.lora_down_in_reduce).
  const bool d_in_reduce = lora && tune.lora_down_in_reduce;
  if (lora) {
    if (two_streams) {
      MOELORA_CUDA_CHECK(cudaEventRecord(st.ev_act, M));
      MOELORA_CUDA_CHECK(cudaStreamWaitEvent(S, st.ev_act, 0));
    }
    if (d_in_reduce) {
      moe_lora_shrink(shrink_params(a, ws, /*gate_up=*/false, pdl && !two_streams, direct), S);
    } else if (tune.lora_fused) {
      moe_lora_fused(fused_params(a, ws, /*gate_up=*/false, pdl && !two_streams, direct), S);
    } else {
      // Behind gate_up on one stream; behind an event wait otherwise.
      moe_lora_shrink(shrink_params(a, ws, /*gate_up=*/false, pdl && !two_streams, direct), S);
      moe_lora_expand(expand_params(a, ws, /*gate_up=*/false, pdl, direct), S);
    }
    if (two_streams) MOELORA_CUDA_CHECK(cudaEventRecord(st.ev_d, S));
  }

  // ---- Base down, then the weighted sum over k.
  MoeGemmParams d = g;
  d.w = a.w_down;
  d.w_scale = a.s_down;
  d.w_group_scale = a.group_scale_down;
  d.w_global_scale = a.global_scale_down;
  d.x = ws.act;
  d.ldx = s.I;
  d.xq = ws.aq;
  d.ldxq = s.I;
  d.xs = ws.as;
  d.ldxs = I_groups;
  d.xq_lo = split ? ws.aq_lo : nullptr;
  if (quantize_act && !beside) quantize_act_rows();
  d.lora_delta = nullptr;
  d.act = nullptr;
  d.y = ws.y;
  // Its stream predecessor is one of our kernels (gate_up, or on one stream the down LoRA expand or,
  // with the expand inside moe_reduce, the down shrink), which triggers only after its own wait:
  // moe_align is complete when down starts early.
  d.pdl = pdl;
  d.early_prefetch = pdl;
  // Beside: behind the down LoRA kernels, which wait first (act and aq are complete when it starts);
  // its wait then makes its completion imply theirs, which moe_reduce relies on for u.
  d.wait_before_epilogue = beside && pdl;
  moe_down(d, M);
  if (last == MoeStage::kDown) return;
  if (two_streams) MOELORA_CUDA_CHECK(cudaStreamWaitEvent(M, st.ev_d, 0));

  MoeReduceParams r;
  r.y = ws.y;
  r.lora_delta = lora && !d_in_reduce ? ws.delta_d : nullptr;
  if (d_in_reduce) {
    const LoraHalf h = lora_half(a, ws, /*gate_up=*/false);
    r.lora_d.token_slot = a.token_slot;
    r.lora_d.num_slots = a.lora->num_slots;
    r.lora_d.u = h.u_pair;
    r.lora_d.ldu = ws.ldu;
    r.lora_d.b = h.b;
  }
  r.ids = a.ids;
  r.weights = a.weights;
  r.T = a.T;
  r.k = s.k;
  r.E = s.E;
  r.H = s.H;
  r.out = a.out;
  r.ldo = a.ldo;
  r.pdl = pdl && !two_streams;
  moe_reduce(r, M);
}

}  // namespace moelora::cuda
