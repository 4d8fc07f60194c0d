#include "model/model_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string_view>

#include "io/mapped_file.h"

namespace moelora {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::kQwen3Moe: return "qwen3_moe";
    case Arch::kMixtral: return "mixtral";
    case Arch::kDeepseekV3: return "deepseek_v3";
  }
  return "?";
}

namespace {

double yarn_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

Status read_int(const Json& j, std::string_view key, const std::string& what, int* out, bool required,
                int min_value = 1) {
  MOELORA_ASSIGN_OR_RETURN(auto v, json_opt_int(j, key, what));
  if (!v) {
    if (required) return invalid_argument("{}: required field \"{}\" is missing", what, key);
    return {};
  }
  if (*v < min_value || *v > (1 << 30))
    return invalid_argument("{}: \"{}\" = {} is out of range", what, key, *v);
  *out = static_cast<int>(*v);
  return {};
}

Status read_ids(const Json& j, std::string_view key, std::vector<int>* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  std::vector<int> ids;
  if (it->is_number_integer()) {
    ids.push_back(it->get<int>());
  } else if (it->is_array()) {
    for (const Json& v : *it) {
      if (!v.is_number_integer()) return invalid_argument("\"{}\" must hold integers", key);
      ids.push_back(v.get<int>());
    }
  } else {
    return invalid_argument("\"{}\" must be an integer or a list of integers", key);
  }
  *out = ids;
  return {};
}

Status parse_rope(const Json& j, const std::string& what, RopeConfig* rope) {
  // transformers 5: rope_parameters {rope_theta, rope_type, factor, ...};
  // hub: rope_theta at top level and rope_scaling {type|rope_type, factor, ...} or null.
  const Json* params = json_find_any(j, {"rope_parameters"});
  const Json* scaling = json_find_any(j, {"rope_scaling"});
  const Json empty = Json::object();
  const Json& p = params && params->is_object() ? *params : (scaling && scaling->is_object() ? *scaling : empty);
  if (params && !params->is_object()) return invalid_argument("{}: rope_parameters must be an object", what);
  if (scaling && !scaling->is_object()) return invalid_argument("{}: rope_scaling must be an object or null", what);

  std::optional<double> theta;
  MOELORA_ASSIGN_OR_RETURN(theta, json_opt_number(p, "rope_theta", what));
  if (!theta) {
    MOELORA_ASSIGN_OR_RETURN(theta, json_opt_number(j, "rope_theta", what));
  }
  rope->theta = theta.value_or(10000.0);
  if (!(rope->theta > 0)) return invalid_argument("{}: rope_theta must be positive", what);

  std::optional<std::string> type;
  MOELORA_ASSIGN_OR_RETURN(type, json_opt_string(p, "rope_type", what));
  if (!type) {
    MOELORA_ASSIGN_OR_RETURN(type, json_opt_string(p, "type", what));
  }
  rope->type = type.value_or("default");
  if (rope->type != "default" && rope->type != "yarn" && rope->type != "linear")
    return unsupported("{}: rope type \"{}\" is not supported (default, linear, yarn are)", what, rope->type);
  MOELORA_ASSIGN_OR_RETURN(auto factor, json_opt_number(p, "factor", what));
  rope->factor = factor.value_or(1.0);
  MOELORA_ASSIGN_OR_RETURN(auto bf, json_opt_number(p, "beta_fast", what));
  MOELORA_ASSIGN_OR_RETURN(auto bs, json_opt_number(p, "beta_slow", what));
  if (bf && *bf != 0) rope->beta_fast = *bf;
  if (bs && *bs != 0) rope->beta_slow = *bs;
  MOELORA_ASSIGN_OR_RETURN(rope->mscale, json_opt_number(p, "mscale", what));
  MOELORA_ASSIGN_OR_RETURN(rope->mscale_all_dim, json_opt_number(p, "mscale_all_dim", what));
  MOELORA_ASSIGN_OR_RETURN(rope->attention_factor, json_opt_number(p, "attention_factor", what));
  MOELORA_ASSIGN_OR_RETURN(auto omp, json_opt_int(p, "original_max_position_embeddings", what));
  rope->original_max_position_embeddings = static_cast<int>(omp.value_or(0));
  MOELORA_ASSIGN_OR_RETURN(auto trunc, json_opt_bool(p, "truncate", what));
  rope->truncate = trunc.value_or(true);
  if (rope->type == "yarn" && rope->original_max_position_embeddings <= 0)
    return invalid_argument("{}: yarn rope scaling needs original_max_position_embeddings", what);
  if (rope->type == "yarn" && !factor)
    return invalid_argument("{}: yarn rope scaling needs a factor", what);
  return {};
}

}  // namespace

double ModelConfig::attention_scale() const {
  double s = 1.0 / std::sqrt(static_cast<double>(attn_k_head_dim()));
  // DeepSeek-V3 folds YaRN's mscale(all_dim)^2 into the softmax scale.
  if (is_mla() && rope.type == "yarn" && rope.mscale_all_dim && *rope.mscale_all_dim != 0) {
    double m = yarn_mscale(rope.factor, *rope.mscale_all_dim);
    s *= m * m;
  }
  return s;
}

Result<ModelConfig> parse_model_config(const std::string& text, const std::string& what) {
  MOELORA_ASSIGN_OR_RETURN(Json j, parse_json_strict(text, what));
  if (!j.is_object()) return invalid_argument("{} is not a JSON object", what);
  ModelConfig c;
  MOELORA_ASSIGN_OR_RETURN(c.model_type, json_get_string(j, "model_type", what));
  if (c.model_type == "qwen3_moe") c.arch = Arch::kQwen3Moe;
  else if (c.model_type == "mixtral") c.arch = Arch::kMixtral;
  else if (c.model_type == "deepseek_v3") c.arch = Arch::kDeepseekV3;
  else
    return unsupported("{}: model_type \"{}\" is not supported; moelora serves qwen3_moe, mixtral and "
                       "deepseek_v3", what, c.model_type);

  MOELORA_RETURN_IF_ERROR(read_int(j, "vocab_size", what, &c.vocab_size, true));
  MOELORA_RETURN_IF_ERROR(read_int(j, "hidden_size", what, &c.hidden_size, true));
  MOELORA_RETURN_IF_ERROR(read_int(j, "num_hidden_layers", what, &c.num_layers, true));
  MOELORA_RETURN_IF_ERROR(read_int(j, "num_attention_heads", what, &c.num_heads, true));
  c.num_kv_heads = c.num_heads;
  MOELORA_RETURN_IF_ERROR(read_int(j, "num_key_value_heads", what, &c.num_kv_heads, false));
  if (c.num_heads % c.num_kv_heads != 0)
    return invalid_argument("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", what,
                            c.num_heads, c.num_kv_heads);
  c.head_dim = c.hidden_size / c.num_heads;
  MOELORA_RETURN_IF_ERROR(read_int(j, "head_dim", what, &c.head_dim, false));
  MOELORA_ASSIGN_OR_RETURN(auto eps, json_opt_number(j, "rms_norm_eps", what));
  c.rms_norm_eps = eps.value_or(1e-6);
  c.max_position_embeddings = 4096;
  MOELORA_RETURN_IF_ERROR(read_int(j, "max_position_embeddings", what, &c.max_position_embeddings, false));
  MOELORA_ASSIGN_OR_RETURN(auto tie, json_opt_bool(j, "tie_word_embeddings", what));
  c.tie_word_embeddings = tie.value_or(false);
  MOELORA_RETURN_IF_ERROR(read_int(j, "intermediate_size", what, &c.intermediate_size, false));
  MOELORA_RETURN_IF_ERROR(read_int(j, "num_experts_per_tok", what, &c.top_k, true));
  MOELORA_ASSIGN_OR_RETURN(auto norm_topk, json_opt_bool(j, "norm_topk_prob", what));
  MOELORA_RETURN_IF_ERROR(parse_rope(j, what, &c.rope));
  c.rope.rot_dim = c.head_dim;
  if (const Json* act = json_find_any(j, {"hidden_act"}); act && (!act->is_string() || act->get<std::string>() != "silu"))
    return unsupported("{}: hidden_act {} is not supported (silu is)", what, act->dump());

  c.layer_is_moe.assign(c.num_layers, true);
  switch (c.arch) {
    case Arch::kQwen3Moe: {
      std::string_view key;
      const Json* ne = json_find_any(j, {"num_experts", "num_local_experts"}, &key);
      if (!ne) return invalid_argument("{}: needs num_experts (or num_local_experts)", what);
      MOELORA_RETURN_IF_ERROR(read_int(j, key, what, &c.num_experts, true));
      MOELORA_RETURN_IF_ERROR(read_int(j, "moe_intermediate_size", what, &c.moe_intermediate_size, true));
      c.norm_topk_prob = norm_topk.value_or(false);
      int step = 1;
      MOELORA_RETURN_IF_ERROR(read_int(j, "decoder_sparse_step", what, &step, false));
      std::vector<int> mlp_only;
      MOELORA_RETURN_IF_ERROR(read_ids(j, "mlp_only_layers", &mlp_only));
      for (int l = 0; l < c.num_layers; ++l) c.layer_is_moe[l] = (l + 1) % step == 0;
      for (int l : mlp_only)
        if (l >= 0 && l < c.num_layers) c.layer_is_moe[l] = false;
      break;
    }
    case Arch::kMixtral:
      MOELORA_RETURN_IF_ERROR(read_int(j, "num_local_experts", what, &c.num_experts, true));
      c.moe_intermediate_size = c.intermediate_size;  // Mixtral's intermediate_size is the expert width
      c.norm_topk_prob = true;
      break;
    case Arch::kDeepseekV3: {
      c.router = RouterKind::kSigmoidGroupTopK;
      MOELORA_RETURN_IF_ERROR(read_int(j, "n_routed_experts", what, &c.num_experts, true));
      MOELORA_RETURN_IF_ERROR(read_int(j, "moe_intermediate_size", what, &c.moe_intermediate_size, true));
      MOELORA_RETURN_IF_ERROR(read_int(j, "n_shared_experts", what, &c.n_shared_experts, false, 0));
      MOELORA_RETURN_IF_ERROR(read_int(j, "n_group", what, &c.n_group, false));
      MOELORA_RETURN_IF_ERROR(read_int(j, "topk_group", what, &c.topk_group, false));
      MOELORA_ASSIGN_OR_RETURN(auto rsf, json_opt_number(j, "routed_scaling_factor", what));
      c.routed_scaling_factor = rsf.value_or(1.0);
      c.norm_topk_prob = norm_topk.value_or(true);
      int first_dense = 0, freq = 1;
      MOELORA_RETURN_IF_ERROR(read_int(j, "first_k_dense_replace", what, &first_dense, false, 0));
      MOELORA_RETURN_IF_ERROR(read_int(j, "moe_layer_freq", what, &freq, false));
      for (int l = 0; l < c.num_layers; ++l) c.layer_is_moe[l] = l >= first_dense && l % freq == 0;
      MOELORA_RETURN_IF_ERROR(read_int(j, "q_lora_rank", what, &c.q_lora_rank, false, 0));
      MOELORA_RETURN_IF_ERROR(read_int(j, "kv_lora_rank", what, &c.kv_lora_rank, true));
      MOELORA_RETURN_IF_ERROR(read_int(j, "qk_nope_head_dim", what, &c.qk_nope_head_dim, true));
      MOELORA_RETURN_IF_ERROR(read_int(j, "qk_rope_head_dim", what, &c.qk_rope_head_dim, true));
      MOELORA_RETURN_IF_ERROR(read_int(j, "v_head_dim", what, &c.v_head_dim, true));
      MOELORA_ASSIGN_OR_RETURN(auto inter, json_opt_bool(j, "rope_interleave", what));
      c.rope.interleaved = inter.value_or(true);  // transformers' DeepseekV3Config default
      c.rope.rot_dim = c.qk_rope_head_dim;
      if (c.qk_rope_head_dim % 2) return invalid_argument("{}: qk_rope_head_dim must be even", what);
      if (c.num_experts % c.n_group != 0 || c.topk_group > c.n_group)
        return invalid_argument("{}: n_routed_experts {} must split into n_group {} groups (topk_group {})",
                                what, c.num_experts, c.n_group, c.topk_group);
      if (c.num_experts / c.n_group < 2 && c.n_group > 1)
        return invalid_argument("{}: group-limited routing needs at least 2 experts per group", what);
      if (c.n_shared_experts > 0 && c.moe_intermediate_size <= 0)
        return invalid_argument("{}: shared experts need moe_intermediate_size", what);
      break;
    }
  }
  if (c.num_experts < 1 || c.top_k > c.num_experts)
    return invalid_argument("{}: num_experts_per_tok {} must be within 1..{} experts", what, c.top_k,
                            c.num_experts);
  for (int l = 0; l < c.num_layers; ++l)
    if (!c.layer_is_moe[l] && c.intermediate_size <= 0)
      return invalid_argument("{}: layer {} is a dense MLP but intermediate_size is missing", what, l);
  if (c.rope.rot_dim % 2) return invalid_argument("{}: the rotary dimension must be even", what);

  if (auto q = j.find("quantization_config"); q != j.end() && !q->is_null()) {
    if (!q->is_object()) return invalid_argument("{}: quantization_config must be an object", what);
    MOELORA_ASSIGN_OR_RETURN(auto method, json_opt_string(*q, "quant_method", what));
    if (method.value_or("") == "modelopt") {
      MOELORA_RETURN_IF_ERROR(apply_modelopt_quantization(*q, what + ": quantization_config", c));
    } else if (method.value_or("") == "compressed-tensors") {
      MOELORA_RETURN_IF_ERROR(apply_compressed_tensors_quantization(*q, what + ": quantization_config", c));
    } else if (method.value_or("") == "fp8") {
      int bo = 128, bi = 128;
      auto bs = q->find("weight_block_size");
      if (bs != q->end() && !bs->is_null()) {
        if (!bs->is_array() || bs->size() != 2 || !(*bs)[0].is_number_integer() || !(*bs)[1].is_number_integer() ||
            (*bs)[0].get<int64_t>() <= 0 || (*bs)[1].get<int64_t>() <= 0 || (*bs)[0].get<int64_t>() > (1 << 20) ||
            (*bs)[1].get<int64_t>() > (1 << 20))
          return invalid_argument("{}: weight_block_size must be two positive integers", what);
        bo = (*bs)[0].get<int>();
        bi = (*bs)[1].get<int>();
      }
      MOELORA_ASSIGN_OR_RETURN(auto scheme, json_opt_string(*q, "activation_scheme", what));
      if (scheme && *scheme != "dynamic")
        return unsupported("{}: activation_scheme \"{}\" is not supported (dynamic is)", what, *scheme);
      c.weight_format = WeightFormat::fp8_block(bo, bi);
    } else {
      return unsupported("{}: quantization_config.quant_method \"{}\" is not supported (fp8 block scaling and "
                         "NVFP4 from modelopt or compressed-tensors are)", what, method.value_or(""));
    }
  }
  Status s = read_ids(j, "eos_token_id", &c.eos_token_ids);
  if (!s.ok()) return s.with_context(what + ": ");
  if (auto b = j.find("bos_token_id"); b != j.end() && b->is_number_integer()) c.bos_token_id = b->get<int>();
  return c;
}

namespace {

// fnmatch-style '*' and '?' (ModelOpt's exclude patterns use '*': "model.layers.*.mlp.gate").
bool glob_match(std::string_view pattern, std::string_view text) {
  size_t p = 0, t = 0, star = std::string_view::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == text[t])) {
      ++p, ++t;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++, mark = t;
    } else if (star != std::string_view::npos) {
      p = star + 1, t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

// ModelOpt's exclude_modules / ignore and compressed-tensors' ignore: lists of module names.
Result<std::vector<std::string>> exclude_list(const Json& q, const std::string& what) {
  std::vector<std::string> exclude;
  for (const char* key : {"exclude_modules", "ignore"}) {
    auto e = q.find(key);
    if (e == q.end() || e->is_null()) continue;
    if (!e->is_array()) return invalid_argument("{}: \"{}\" must be a list of module names", what, key);
    for (const auto& m : *e) {
      if (!m.is_string()) return invalid_argument("{}: \"{}\" must be a list of module names", what, key);
      exclude.push_back(m.get<std::string>());
    }
  }
  return exclude;
}

}  // namespace

bool ModelConfig::quant_excluded(const std::string& module) const {
  for (const std::string& pat : quant_exclude) {
    // compressed-tensors' "re:" regexes are not evaluated: the check is a consistency check (the
    // stored dtype decides), and a config's regex is not worth a matcher that can blow up.
    if (pat.starts_with("re:")) continue;
    if (glob_match(pat, module)) return true;
    // A pattern naming a parent module excludes everything inside it.
    for (size_t dot = module.find('.'); dot != std::string::npos; dot = module.find('.', dot + 1))
      if (glob_match(pat, std::string_view(module).substr(0, dot))) return true;
  }
  return false;
}

Status apply_modelopt_quantization(const Json& q, const std::string& what, ModelConfig& c) {
  if (!q.is_object()) return invalid_argument("{}: the ModelOpt quantisation description must be an object", what);
  MOELORA_ASSIGN_OR_RETURN(auto algo, json_opt_string(q, "quant_algo", what));
  if (!algo) return invalid_argument("{}: \"quant_algo\" is missing", what);
  if (*algo != "NVFP4")
    return unsupported("{}: ModelOpt quant_algo \"{}\" is not supported (NVFP4 is; FP8 checkpoints load with "
                       "quant_method \"fp8\" block scales)", what, *algo);
  // group_size at the top (hf_quant_config.json) or in config_groups.*.weights (newer config.json).
  MOELORA_ASSIGN_OR_RETURN(auto group, json_opt_int(q, "group_size", what));
  if (!group)
    if (auto cg = q.find("config_groups"); cg != q.end() && cg->is_object())
      for (const auto& [name, g] : cg->items())
        if (g.is_object())
          if (auto w = g.find("weights"); w != g.end() && w->is_object()) {
            MOELORA_ASSIGN_OR_RETURN(auto gs, json_opt_int(*w, "group_size", what + ".config_groups." + name));
            if (gs) group = gs;
          }
  if (group.value_or(16) != 16)
    return unsupported("{}: NVFP4 group_size {} is not supported (NVFP4 groups are 16 values)", what, *group);
  MOELORA_ASSIGN_OR_RETURN(c.quant_exclude, exclude_list(q, what));
  c.weight_format = WeightFormat::nvfp4(16);
  return {};
}

Status apply_compressed_tensors_quantization(const Json& q, const std::string& what, ModelConfig& c) {
  // llm-compressor's NVFP4: every config group "nvfp4-pack-quantized" with 4-bit float weights in
  // groups of 16. Other compressed-tensors schemes (int4/int8, FP8 per channel, ...) are refused.
  MOELORA_ASSIGN_OR_RETURN(auto format, json_opt_string(q, "format", what));
  auto cg = q.find("config_groups");
  if (cg == q.end() || !cg->is_object() || cg->empty())
    return invalid_argument("{}: compressed-tensors needs \"config_groups\"", what);
  for (const auto& [name, g] : cg->items()) {
    const std::string gwhat = what + ".config_groups." + name;
    if (!g.is_object()) return invalid_argument("{} must be an object", gwhat);
    MOELORA_ASSIGN_OR_RETURN(auto gformat, json_opt_string(g, "format", gwhat));
    const std::string f = gformat.value_or(format.value_or(""));
    if (f != "nvfp4-pack-quantized")
      return unsupported("{}: compressed-tensors format \"{}\" is not supported (nvfp4-pack-quantized is)", gwhat, f);
    auto w = g.find("weights");
    if (w == g.end() || !w->is_object()) return invalid_argument("{}: \"weights\" is missing", gwhat);
    MOELORA_ASSIGN_OR_RETURN(auto bits, json_opt_int(*w, "num_bits", gwhat + ".weights"));
    MOELORA_ASSIGN_OR_RETURN(auto type, json_opt_string(*w, "type", gwhat + ".weights"));
    MOELORA_ASSIGN_OR_RETURN(auto group, json_opt_int(*w, "group_size", gwhat + ".weights"));
    if (bits.value_or(0) != 4 || type.value_or("") != "float" || group.value_or(0) != 16)
      return unsupported("{}: weights of {} bits, type \"{}\", group size {} are not NVFP4 (4-bit float, groups of "
                         "16)", gwhat, bits.value_or(0), type.value_or(""), group.value_or(0));
  }
  MOELORA_ASSIGN_OR_RETURN(c.quant_exclude, exclude_list(q, what));
  c.weight_format = WeightFormat::nvfp4(16);
  return {};
}

Result<ModelConfig> load_model_config(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(dir) / "config.json").string();
  MOELORA_ASSIGN_OR_RETURN(std::string text, read_text_file(path, 16u << 20));
  MOELORA_ASSIGN_OR_RETURN(ModelConfig c, parse_model_config(text, path));
  std::error_code ec;
  // ModelOpt exports describe their quantisation in hf_quant_config.json; config.json may repeat it.
  const std::string hq = (fs::path(dir) / "hf_quant_config.json").string();
  if (fs::exists(hq, ec)) {
    MOELORA_ASSIGN_OR_RETURN(std::string qtext, read_text_file(hq, 1u << 20));
    MOELORA_ASSIGN_OR_RETURN(Json qj, parse_json_strict(qtext, hq));
    auto quant = qj.is_object() ? qj.find("quantization") : qj.end();
    if (!qj.is_object() || quant == qj.end())
      return invalid_argument("{}: expected an object with a \"quantization\" object", hq);
    ModelConfig from_file = c;
    MOELORA_RETURN_IF_ERROR(apply_modelopt_quantization(*quant, hq, from_file));
    if (!c.weight_format.is_dense() && !(c.weight_format == from_file.weight_format))
      return invalid_argument("{}: declares {} but config.json's quantization_config declares {}", hq,
                              from_file.weight_format.describe(), c.weight_format.describe());
    c.weight_format = from_file.weight_format;
    for (std::string& m : from_file.quant_exclude)
      if (std::find(c.quant_exclude.begin(), c.quant_exclude.end(), m) == c.quant_exclude.end())
        c.quant_exclude.push_back(std::move(m));
  }
  const std::string gen = (fs::path(dir) / "generation_config.json").string();
  if (fs::exists(gen, ec)) {
    MOELORA_ASSIGN_OR_RETURN(std::string gtext, read_text_file(gen, 1u << 20));
    MOELORA_ASSIGN_OR_RETURN(Json g, parse_json_strict(gtext, gen));
    std::vector<int> ids;
    Status s = read_ids(g, "eos_token_id", &ids);
    if (!s.ok()) return s.with_context(gen + ": ");
    for (int id : ids)
      if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end())
        c.eos_token_ids.push_back(id);
  }
  return c;
}

}  // namespace moelora
