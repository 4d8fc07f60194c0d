#include "model/weight_loader.h"

#include <cmath>

#include <fmt/format.h>

#include "model/archs.h"

namespace moelora {

namespace {

struct Loader {
  const Checkpoint& ck;
  const ModelConfig& cfg;
  Backend& backend;
  // Sizing pass: every tensor is read and checked as for real, but instead of being uploaded its
  // backend bytes are added here (and empty weights returned).
  size_t* sizing = nullptr;

  // Every tensor of the model, in load order.
  Result<ModelWeights> run();

  // validate_stored_weight, once per load: the sizing pass always runs first (load_model_weights)
  // and has checked the same mapped tensors, so the upload pass does not scan every scale again.
  Status checked(const StoredWeight& w, const std::string& name) const {
    if (!sizing) return {};
    return validate_stored_weight(w, fmt::format("checkpoint {}: '{}'", ck.dir(), name));
  }

  Tensor put(const Tensor& host, DType dtype) {
    if (!sizing) return backend.upload(host, dtype);
    *sizing += backend.upload_bytes(dtype, host.numel());
    return Tensor();
  }
  LinearWeight put_linear(const StoredWeight& w) {
    if (!sizing) return backend.upload_linear(w);
    *sizing += backend.linear_bytes(w);
    return LinearWeight();
  }
  ExpertWeights put_experts(const std::vector<StoredWeight>& g, const std::vector<StoredWeight>& u,
                            const std::vector<StoredWeight>& d) {
    if (!sizing) return backend.upload_experts(g, u, d);
    for (const auto* part : {&g, &u, &d})
      for (const StoredWeight& w : *part) *sizing += backend.expert_part_bytes(w);
    return ExpertWeights();
  }

  Result<Tensor> get(const std::string& name, const std::vector<int64_t>& shape) {
    MOELORA_ASSIGN_OR_RETURN(Tensor t, ck.tensor(name));
    if (t.shape() != shape)
      return invalid_argument("checkpoint {}: tensor '{}' has shape {} but the config implies [{}]", ck.dir(), name,
                              t.shape_string(), fmt::join(shape, ", "));
    if (!is_float_dtype(t.dtype()))
      return invalid_argument("checkpoint {}: tensor '{}' has dtype {}, not a float type", ck.dir(), name,
                              dtype_name(t.dtype()));
    return t;
  }

  // A linear's weight as the file stores it: dense, FP8 with block scales, or NVFP4 (packed U8 with
  // group scales and a global scale). The stored dtype decides, as in the exports; the config must
  // declare the NVFP4 format and may name modules it keeps unquantised.
  Result<StoredWeight> stored_linear(const std::string& prefix, int out, int in) {
    const std::string wname = prefix + ".weight";
    const SafetensorsEntry* e = ck.entry(wname);
    if (e && e->dtype == DType::kU8) return nvfp4_linear(prefix, out, in, Nvfp4Naming::kModelOpt);
    if (ck.contains(prefix + ".weight_packed")) {
      if (e) return invalid_argument("checkpoint {}: both '{}' and '{}.weight_packed' exist", ck.dir(), wname, prefix);
      return nvfp4_linear(prefix, out, in, Nvfp4Naming::kCompressedTensors);
    }
    StoredWeight r;
    r.out = out;
    r.in = in;
    MOELORA_ASSIGN_OR_RETURN(r.data, get(wname, {out, in}));
    const std::string sname = prefix + ".weight_scale_inv";
    if (r.data.dtype() == DType::kF8E4M3) {
      if (!ck.contains(sname))
        return invalid_argument("checkpoint {}: FP8 tensor '{}.weight' has no '{}'", ck.dir(), prefix, sname);
      const WeightFormat& declared = cfg.weight_format;
      r.format = declared.is_fp8() ? declared : WeightFormat::fp8_block(128, 128);
      const auto sshape = r.format.scale_shape(out, in);
      MOELORA_ASSIGN_OR_RETURN(r.scale, get(sname, sshape));
      MOELORA_RETURN_IF_ERROR(checked(r, sname));
    } else {
      for (const std::string& stray :
           {sname, prefix + ".weight_scale", prefix + ".weight_scale_2", prefix + ".weight_global_scale"})
        if (ck.contains(stray))
          return invalid_argument("checkpoint {}: '{}' exists but '{}.weight' is {}, not a quantised weight",
                                  ck.dir(), stray, prefix, dtype_name(r.data.dtype()));
    }
    return r;
  }

  // ModelOpt: <m>.weight, <m>.weight_scale, <m>.weight_scale_2 (W = q * scale * weight_scale_2).
  // compressed-tensors: <m>.weight_packed, <m>.weight_scale, <m>.weight_global_scale, the reciprocal
  // (W = q * scale / weight_global_scale; taken as q * scale * (1 / g), within 1 f32 ulp of it).
  enum class Nvfp4Naming { kModelOpt, kCompressedTensors };
  Result<StoredWeight> nvfp4_linear(const std::string& prefix, int out, int in, Nvfp4Naming naming) {
    const bool ct = naming == Nvfp4Naming::kCompressedTensors;
    const std::string wname = prefix + (ct ? ".weight_packed" : ".weight");
    if (!cfg.weight_format.is_nvfp4())
      return invalid_argument("checkpoint {}: '{}' is U8 (packed 4-bit) but the config declares no NVFP4 "
                              "quantisation (quantization_config quant_method \"modelopt\" or \"compressed-tensors\", or "
                              "hf_quant_config.json)",
                              ck.dir(), wname);
    if (cfg.quant_excluded(prefix))
      return invalid_argument("checkpoint {}: '{}' is stored as NVFP4 but the quantisation config excludes '{}'",
                              ck.dir(), wname, prefix);
    StoredWeight r;
    r.format = cfg.weight_format;
    r.out = out;
    r.in = in;
    MOELORA_ASSIGN_OR_RETURN(r.data, ck.tensor(wname));
    const std::string sname = prefix + ".weight_scale";
    const std::string gname = prefix + (ct ? ".weight_global_scale" : ".weight_scale_2");
    for (const std::string& n : {sname, gname})
      if (!ck.contains(n))
        return invalid_argument("checkpoint {}: NVFP4 tensor '{}' has no '{}'", ck.dir(), wname, n);
    MOELORA_ASSIGN_OR_RETURN(r.scale, ck.tensor(sname));
    MOELORA_ASSIGN_OR_RETURN(Tensor global, ck.tensor(gname));
    if (global.numel() != 1 || (global.dtype() != DType::kF32 && global.dtype() != DType::kBF16))
      return invalid_argument("checkpoint {}: '{}' must be one F32 value (the per-tensor scale), got {} {}", ck.dir(),
                              gname, dtype_name(global.dtype()), global.shape_string());
    const float g = read_as_f32(global, 0);
    r.global_scale = ct ? 1.0f / g : g;
    if (ct && !(std::isfinite(g) && g > 0.0f))
      return invalid_argument("checkpoint {}: '{}' is {}, must be finite and > 0", ck.dir(), gname, g);
    // input_scale (the static activation scale of Blackwell's FP4 x FP4 GEMMs) is not used: on this
    // engine activations stay in the compute dtype (weight-only 4-bit, docs/numerics.md).
    MOELORA_RETURN_IF_ERROR(checked(r, wname));
    return r;
  }

  Result<LinearWeight> linear(const std::string& prefix, int out, int in) {
    MOELORA_ASSIGN_OR_RETURN(StoredWeight r, stored_linear(prefix, out, in));
    return put_linear(r);
  }

  // Norm weights in the activation dtype (what the norm kernels read); biases in f32.
  Result<Tensor> vec(const std::string& name, int n, DType dtype) {
    MOELORA_ASSIGN_OR_RETURN(Tensor t, get(name, {n}));
    return put(t, dtype);
  }
  Result<Tensor> norm(const std::string& name, int n) { return vec(name, n, backend.act_dtype()); }

  Result<MlpWeights> mlp(const std::string& prefix, int inter) {
    MlpWeights m;
    const int H = cfg.hidden_size;
    MOELORA_ASSIGN_OR_RETURN(m.gate, linear(prefix + ".gate_proj", inter, H));
    MOELORA_ASSIGN_OR_RETURN(m.up, linear(prefix + ".up_proj", inter, H));
    MOELORA_ASSIGN_OR_RETURN(m.down, linear(prefix + ".down_proj", H, inter));
    return m;
  }

  Status attention(const std::string& p, AttentionWeights& a) {
    const ModelConfig& c = cfg;
    const int H = c.hidden_size;
    if (!c.is_mla()) {
      MOELORA_ASSIGN_OR_RETURN(a.q, linear(p + "q_proj", c.num_heads * c.head_dim, H));
      MOELORA_ASSIGN_OR_RETURN(a.k, linear(p + "k_proj", c.num_kv_heads * c.head_dim, H));
      MOELORA_ASSIGN_OR_RETURN(a.v, linear(p + "v_proj", c.num_kv_heads * c.head_dim, H));
      MOELORA_ASSIGN_OR_RETURN(a.o, linear(p + "o_proj", H, c.num_heads * c.head_dim));
      if (arch_naming(c.arch).qk_norm) {
        MOELORA_ASSIGN_OR_RETURN(a.q_norm, norm(p + "q_norm.weight", c.head_dim));
        MOELORA_ASSIGN_OR_RETURN(a.k_norm, norm(p + "k_norm.weight", c.head_dim));
      }
      return {};
    }
    const int qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    if (c.q_lora_rank > 0) {
      MOELORA_ASSIGN_OR_RETURN(a.q_a, linear(p + "q_a_proj", c.q_lora_rank, H));
      MOELORA_ASSIGN_OR_RETURN(a.q_a_norm, norm(p + "q_a_layernorm.weight", c.q_lora_rank));
      MOELORA_ASSIGN_OR_RETURN(a.q_b, linear(p + "q_b_proj", c.num_heads * qk, c.q_lora_rank));
    } else {
      MOELORA_ASSIGN_OR_RETURN(a.q, linear(p + "q_proj", c.num_heads * qk, H));
    }
    MOELORA_ASSIGN_OR_RETURN(a.kv_a, linear(p + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, H));
    MOELORA_ASSIGN_OR_RETURN(a.kv_a_norm, norm(p + "kv_a_layernorm.weight", c.kv_lora_rank));
    MOELORA_ASSIGN_OR_RETURN(a.kv_b, linear(p + "kv_b_proj", c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                            c.kv_lora_rank));
    MOELORA_ASSIGN_OR_RETURN(a.o, linear(p + "o_proj", H, c.num_heads * c.v_head_dim));
    return {};
  }

  Status moe(const std::string& layer_prefix, int l, LayerWeights& lw) {
    const ModelConfig& c = cfg;
    const ArchNaming& nm = arch_naming(c.arch);
    std::string block;
    for (const std::string& b : nm.moe_blocks)
      if (ck.contains(layer_prefix + b + ".gate.weight")) {
        block = layer_prefix + b;
        break;
      }
    if (block.empty())
      return invalid_argument("checkpoint {}: layer {} is a MoE layer but has no router '{}{}.gate.weight'", ck.dir(),
                              l, layer_prefix, nm.moe_blocks.front());
    const int H = c.hidden_size, I = c.moe_intermediate_size, E = c.num_experts;
    MOELORA_ASSIGN_OR_RETURN(Tensor router, get(block + ".gate.weight", {E, H}));
    lw.router = put_linear(dense_weight(router));
    if (c.router == RouterKind::kSigmoidGroupTopK) {
      const std::string bias = block + ".gate.e_score_correction_bias";
      if (ck.contains(bias)) {
        MOELORA_ASSIGN_OR_RETURN(lw.router_bias, vec(bias, E, DType::kF32));
      } else {
        lw.router_bias = put(Tensor::empty_host(DType::kF32, {E}), DType::kF32);
      }
    }
    std::vector<StoredWeight> g(E), u(E), d(E);
    for (int e = 0; e < E; ++e) {
      const std::string ep = fmt::format("{}.experts.{}.", block, e);
      MOELORA_ASSIGN_OR_RETURN(g[e], stored_linear(ep + nm.expert_proj[0], I, H));
      MOELORA_ASSIGN_OR_RETURN(u[e], stored_linear(ep + nm.expert_proj[1], I, H));
      MOELORA_ASSIGN_OR_RETURN(d[e], stored_linear(ep + nm.expert_proj[2], H, I));
      // The expert kernels take one format per layer (one weight pointer table, one scale layout).
      for (const StoredWeight* x : {&g[e], &u[e], &d[e]})
        if (!(x->format == g[0].format))
          return invalid_argument("checkpoint {}: layer {} mixes weight formats in its experts ({} and {})", ck.dir(),
                                  l, g[0].format.describe(), x->format.describe());
    }
    lw.experts = put_experts(g, u, d);
    if (c.n_shared_experts > 0) {
      lw.has_shared = true;
      MOELORA_ASSIGN_OR_RETURN(lw.shared, mlp(block + ".shared_experts", I * c.n_shared_experts));
    }
    return {};
  }
};

Result<ModelWeights> Loader::run() {
  ModelWeights w;
  const int H = cfg.hidden_size, V = cfg.vocab_size;
  MOELORA_ASSIGN_OR_RETURN(Tensor embed, get("model.embed_tokens.weight", {V, H}));
  w.embed = put(embed, backend.act_dtype());
  MOELORA_ASSIGN_OR_RETURN(w.final_norm, norm("model.norm.weight", H));
  if (ck.contains("lm_head.weight")) {
    MOELORA_ASSIGN_OR_RETURN(w.lm_head, linear("lm_head", V, H));
  } else if (cfg.tie_word_embeddings) {
    w.lm_head = put_linear(dense_weight(embed));
  } else {
    return invalid_argument("checkpoint {}: no lm_head.weight and tie_word_embeddings is false", ck.dir());
  }
  w.layers.resize(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l) {
    LayerWeights& lw = w.layers[l];
    const std::string p = fmt::format("model.layers.{}.", l);
    MOELORA_ASSIGN_OR_RETURN(lw.input_norm, norm(p + "input_layernorm.weight", H));
    MOELORA_ASSIGN_OR_RETURN(lw.post_attention_norm, norm(p + "post_attention_layernorm.weight", H));
    MOELORA_RETURN_IF_ERROR(attention(p + "self_attn.", lw.attn));
    lw.is_moe = cfg.layer_is_moe[l];
    if (lw.is_moe) {
      MOELORA_RETURN_IF_ERROR(moe(p, l, lw));
    } else {
      MOELORA_ASSIGN_OR_RETURN(lw.mlp, mlp(p + "mlp", cfg.intermediate_size));
    }
  }
  return w;
}

}  // namespace

Result<size_t> device_weight_bytes(const Checkpoint& ck, const ModelConfig& cfg, Backend& backend) {
  size_t need = 0;
  Loader sizing{ck, cfg, backend, &need};
  MOELORA_RETURN_IF_ERROR(sizing.run().status());
  return need;
}

Result<ModelWeights> load_model_weights(const Checkpoint& ck, const ModelConfig& cfg, Backend& backend,
                                        size_t derived_bytes) {
  // First every tensor is checked and its device bytes summed, then everything is uploaded: a
  // malformed or oversized checkpoint is refused before any memory is taken.
  MOELORA_ASSIGN_OR_RETURN(const size_t weights, device_weight_bytes(ck, cfg, backend));
  const size_t need = weights + derived_bytes;
  size_t free = 0, total = 0;
  if (backend.device_memory(&free, &total) && need > free) {
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const std::string derived =
        derived_bytes ? fmt::format(", {:.2f} GiB of it derived by the backend on first use (absorbed MLA's kv_b copies)",
                                    derived_bytes / gib)
                      : "";
    return make_error(ErrorCode::kResourceExhausted,
                      "checkpoint {}: the weights take {:.2f} GiB on this device ({}{}{}) but {:.2f} GiB of {:.2f} GiB "
                      "are free; use a GPU with more memory, spread the model over GPUs (--tp/--ep), or a smaller "
                      "checkpoint",
                      ck.dir(), need / gib, cfg.weight_format.describe(),
                      cfg.weight_format.is_nvfp4() ? "; NVFP4 is held as bf16 on the GPU until its 4-bit kernels exist" : "",
                      derived, free / gib, total / gib);
  }
  Loader upload{ck, cfg, backend};
  return upload.run();
}

}  // namespace moelora
