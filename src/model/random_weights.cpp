// Model::random: full-size shapes without a checkpoint, for `moelora bench`. Values are
// pseudo-random (made on the backend's device), chosen only to keep activations finite.
#include "model/model.h"

namespace moelora {

Result<std::unique_ptr<Model>> Model::random(const ModelConfig& cfg, Backend& b, uint64_t seed,
                                             const ModelOptions& opts) {
  std::unique_ptr<Model> m(new Model(cfg, "(random weights)", b));
  MOELORA_RETURN_IF_ERROR(m->choose_mla_form(opts));
  MOELORA_RETURN_IF_ERROR(b.check_model_shapes(m->shapes()));
  // FP8 configs get random FP8 codes with block scales on devices that keep FP8; NVFP4 configs get
  // 4-bit weights where the backend keeps them (Backend::random_experts / random_linear: CUDA) and
  // dense weights elsewhere, as a loaded NVFP4 checkpoint would; everything else gets dense weights.
  const bool fp8 = cfg.weight_format.is_fp8() && b.device() != Device::kCpu;
  const DType act = b.act_dtype();
  const DType dense = b.device() == Device::kCpu ? DType::kF32 : DType::kBF16;
  uint64_t s = seed;
  const int bo = fp8 ? cfg.weight_format.block_out : 128, bi = fp8 ? cfg.weight_format.block_in : 128;
  auto blocks = [](int64_t n, int b) { return (n + b - 1) / b; };
  // `packed_4bit`: the backend's 4-bit dense form may serve (not for experts, whose 4-bit layout
  // is random_experts' own).
  auto linear = [&](int64_t out, int64_t in, int64_t row_blocks = -1, int split = 0, bool packed_4bit = true) {
    LinearWeight w;
    w.out = static_cast<int>(out);
    w.in = static_cast<int>(in);
    w.block_out = bo;
    w.block_in = bi;
    w.split_rows = split;
    if (fp8) {
      w.w = b.random_tensor(DType::kF8E4M3, {out, in}, ++s, 1.0f);
      // e4m3 codes reach 448: a scale near 1e-4 keeps weights ~1e-2 like trained ones.
      w.scale_inv = b.random_tensor(DType::kF32, {row_blocks >= 0 ? row_blocks : blocks(out, bo), blocks(in, bi)}, ++s,
                                    1e-4f);
    } else {
      // NVFP4 where the backend keeps it 4-bit (its own seed stream: the dense seeds stay put).
      LinearWeight f = packed_4bit ? b.random_linear(static_cast<int>(out), static_cast<int>(in), cfg.weight_format,
                                                     (s + 1) ^ 0x5851f42d4c957f2dull)
                                   : LinearWeight();
      ++s;
      if (f.defined()) {
        f.block_out = bo;
        f.block_in = bi;
        return f;
      }
      w.w = b.random_tensor(dense, {out, in}, s, 0.02f);
    }
    return w;
  };
  auto norm = [&](int64_t n) { return b.random_tensor(act, {n}, ++s, 1.0f); };
  const int H = cfg.hidden_size;
  ModelWeights& w = m->weights_;
  w.embed = b.random_tensor(act, {cfg.vocab_size, H}, ++s, 0.02f);
  w.final_norm = norm(H);
  w.lm_head.w = b.random_tensor(dense, {cfg.vocab_size, H}, ++s, 0.02f);
  w.lm_head.out = cfg.vocab_size;
  w.lm_head.in = H;
  w.layers.resize(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l) {
    LayerWeights& lw = w.layers[l];
    lw.input_norm = norm(H);
    lw.post_attention_norm = norm(H);
    AttentionWeights& a = lw.attn;
    if (!cfg.is_mla()) {
      a.q = linear(cfg.num_heads * cfg.head_dim, H);
      a.k = linear(cfg.num_kv_heads * cfg.head_dim, H);
      a.v = linear(cfg.num_kv_heads * cfg.head_dim, H);
      a.o = linear(H, cfg.num_heads * cfg.head_dim);
      if (cfg.arch == Arch::kQwen3Moe) {
        a.q_norm = norm(cfg.head_dim);
        a.k_norm = norm(cfg.head_dim);
      }
    } else {
      const int qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim;
      if (cfg.q_lora_rank > 0) {
        a.q_a = linear(cfg.q_lora_rank, H);
        a.q_a_norm = norm(cfg.q_lora_rank);
        a.q_b = linear(cfg.num_heads * qk, cfg.q_lora_rank);
      } else {
        a.q = linear(cfg.num_heads * qk, H);
      }
      a.kv_a = linear(cfg.kv_lora_rank + cfg.qk_rope_head_dim, H);
      a.kv_a_norm = norm(cfg.kv_lora_rank);
      a.kv_b = linear(cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank);
      a.o = linear(H, cfg.num_heads * cfg.v_head_dim);
    }
    lw.is_moe = cfg.layer_is_moe[l];
    if (!lw.is_moe) {
      lw.mlp = {linear(cfg.intermediate_size, H), linear(cfg.intermediate_size, H), linear(H, cfg.intermediate_size)};
      continue;
    }
    const int64_t E = cfg.num_experts, I = cfg.moe_intermediate_size;
    lw.router.w = b.random_tensor(dense, {E, H}, ++s, 0.05f);
    lw.router.out = static_cast<int>(E);
    lw.router.in = H;
    if (cfg.router == RouterKind::kSigmoidGroupTopK) lw.router_bias = b.random_tensor(DType::kF32, {E}, ++s, 0.01f);
    ExpertWeights& x = lw.experts;
    // (A seed stream of its own: the dense path's seeds stay what they were.)
    x = b.random_experts(static_cast<int>(E), H, static_cast<int>(I), cfg.weight_format, s ^ 0x9e3779b97f4a7c15ull);
    if (x.num_experts == 0) {
      x.num_experts = static_cast<int>(E);
      x.hidden = H;
      x.intermediate = static_cast<int>(I);
      // Same packing as Backend::upload_experts: per expert gate then up rows, halves blocked apart.
      x.gate_up = linear(E * 2 * I, H, E * 2 * blocks(I, bo), static_cast<int>(I), /*packed_4bit=*/false);
      x.down = linear(E * H, I, E * blocks(H, bo), 0, /*packed_4bit=*/false);
    }
    if (cfg.n_shared_experts > 0) {
      const int64_t si = I * cfg.n_shared_experts;
      lw.has_shared = true;
      lw.shared = {linear(si, H), linear(si, H), linear(H, si)};
    }
  }
  m->rope_ = make_rope_table(cfg);
  m->fuse_projections();
  return m;
}

}  // namespace moelora
