#include "lora/peft_config.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cmath>
#include <memory>

#include <nlohmann/json.hpp>

namespace moelora {

namespace {

using OrderedJson = nlohmann::ordered_json;

struct Pcre2Code {
  pcre2_code* code = nullptr;
  ~Pcre2Code() {
    if (code) pcre2_code_free(code);
  }
};

// Compiles "(.*\.)?(<key>)$" anchored at the start, as Python's re.match would apply it.
std::unique_ptr<Pcre2Code> compile_pattern(const std::string& key, std::string* error) {
  const std::string pattern = "(.*\\.)?(" + key + ")$";
  int err = 0;
  PCRE2_SIZE offset = 0;
  auto c = std::make_unique<Pcre2Code>();
  c->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                          PCRE2_ANCHORED | PCRE2_UTF | PCRE2_DOLLAR_ENDONLY, &err, &offset, nullptr);
  if (c->code == nullptr) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof(buf));
    if (error) *error = reinterpret_cast<char*>(buf);
    return nullptr;
  }
  return c;
}

// Fields whose presence (non-null, non-false, non-empty) changes inference math we do not do.
Status refuse_variants(const OrderedJson& j, const std::string& what) {
  auto truthy = [](const OrderedJson& v) {
    if (v.is_null()) return false;
    if (v.is_boolean()) return v.get<bool>();
    if (v.is_array() || v.is_object() || v.is_string()) return !v.empty();
    return true;
  };
  struct Field {
    const char* name;
    const char* reason;
  };
  static const Field fields[] = {
      {"use_dora", "DoRA (weight-decomposed LoRA) is not supported"},
      {"lora_bias", "LoRA with a bias on lora_B is not supported"},
      {"fan_in_fan_out", "fan_in_fan_out (transposed Conv1D base weights) is not supported"},
      {"modules_to_save", "modules_to_save replaces base weights; only LoRA deltas are served"},
      {"layer_replication", "layer_replication is not supported"},
      {"alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"},
      {"trainable_token_indices", "trainable_token_indices (embedding deltas) is not supported"},
      {"use_qalora", "QA-LoRA is not supported"},
      {"use_bdlora", "BD-LoRA is not supported"},
      {"kasa_config", "KaSA is not supported"},
      {"velora_config", "VeLoRA is not supported"},
      {"monteclora_config", "MonteCLoRA is not supported"},
      {"arrow_config", "Arrow routing is not supported"},
  };
  for (const Field& f : fields) {
    auto it = j.find(f.name);
    if (it != j.end() && truthy(*it)) return unsupported("{}: field \"{}\": {}", what, f.name, f.reason);
  }
  if (auto b = j.find("bias"); b != j.end() && !b->is_null() && !(b->is_string() && b->get<std::string>() == "none"))
    return unsupported("{}: field \"bias\" = {}: adapters that train biases are not supported", what, b->dump());
  return {};
}

}  // namespace

bool peft_pattern_matches(const std::string& key, const std::string& module, bool* limit_hit) {
  if (limit_hit) *limit_hit = false;
  auto c = compile_pattern(key, nullptr);
  if (!c) return false;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(c->code, nullptr);
  pcre2_match_context* ctx = pcre2_match_context_create(nullptr);
  pcre2_set_match_limit(ctx, kPeftMatchLimit);
  pcre2_set_depth_limit(ctx, kPeftDepthLimit);
  const int rc = pcre2_match(c->code, reinterpret_cast<PCRE2_SPTR>(module.c_str()), module.size(), 0, 0, md, ctx);
  pcre2_match_context_free(ctx);
  pcre2_match_data_free(md);
  if (limit_hit && (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT))
    *limit_hit = true;
  return rc >= 0;
}

namespace {
template <typename Patterns>
bool first_match(const Patterns& patterns, const char* field, const std::string& module, std::string* error,
                 size_t* index) {
  for (size_t i = 0; i < patterns.size(); ++i) {
    bool limit = false;
    if (peft_pattern_matches(patterns[i].first, module, &limit)) {
      *index = i;
      return true;
    }
    if (limit && error->empty())
      *error = std::string(field) + " key \"" + patterns[i].first +
               "\" is too costly to match (PCRE2 match limit reached on module '" + module + "')";
  }
  return false;
}
}  // namespace

int PeftConfig::rank_for(const std::string& module) const {
  size_t i = 0;
  if (first_match(rank_pattern, "rank_pattern", module, &pattern_error, &i)) return rank_pattern[i].second;
  return r;
}

double PeftConfig::alpha_for(const std::string& module) const {
  size_t i = 0;
  if (first_match(alpha_pattern, "alpha_pattern", module, &pattern_error, &i)) return alpha_pattern[i].second;
  return lora_alpha;
}

double PeftConfig::scale_for(const std::string& module) const {
  const double rank = rank_for(module);
  const double alpha = alpha_for(module);
  return use_rslora ? alpha / std::sqrt(rank) : alpha / rank;
}

Result<PeftConfig> parse_peft_config(const std::string& text, const std::string& what) {
  // ordered_json keeps the file order of rank_pattern / alpha_pattern keys, which PEFT's
  // first-match rule depends on. Duplicate keys are rejected by a callback like parse_json_strict.
  bool duplicate = false;
  std::vector<std::vector<std::string>> keys;
  auto cb = [&](int depth, OrderedJson::parse_event_t ev, OrderedJson& parsed) -> bool {
    if (ev == OrderedJson::parse_event_t::object_start) keys.emplace_back();
    if (ev == OrderedJson::parse_event_t::object_end && !keys.empty()) keys.pop_back();
    if (ev == OrderedJson::parse_event_t::key && !keys.empty()) {
      const auto& k = parsed.get_ref<const std::string&>();
      for (const auto& seen : keys.back())
        if (seen == k) duplicate = true;
      keys.back().push_back(k);
    }
    return depth < 64;
  };
  OrderedJson j = OrderedJson::parse(text, cb, false);
  if (duplicate) return invalid_argument("{}: duplicate keys", what);
  if (j.is_discarded() || !j.is_object()) return invalid_argument("{} is not a valid JSON object", what);

  PeftConfig c;
  if (auto pt = j.find("peft_type"); pt != j.end() && !pt->is_null()) {
    if (!pt->is_string() || (pt->get<std::string>() != "LORA" && pt->get<std::string>() != "lora"))
      return unsupported("{}: peft_type {} is not LORA", what, pt->dump());
  }
  MOELORA_RETURN_IF_ERROR(refuse_variants(j, what));
  auto r = j.find("r");
  if (r == j.end() || !r->is_number_integer() || r->get<int64_t>() <= 0 || r->get<int64_t>() > 65536)
    return invalid_argument("{}: field \"r\" must be a positive integer", what);
  c.r = r->get<int>();
  auto alpha = j.find("lora_alpha");
  if (alpha == j.end() || !alpha->is_number())
    return invalid_argument("{}: field \"lora_alpha\" must be a number", what);
  c.lora_alpha = alpha->get<double>();
  if (!std::isfinite(c.lora_alpha)) return invalid_argument("{}: field \"lora_alpha\" must be finite", what);
  if (auto rs = j.find("use_rslora"); rs != j.end() && !rs->is_null()) {
    if (!rs->is_boolean()) return invalid_argument("{}: field \"use_rslora\" must be true or false", what);
    c.use_rslora = rs->get<bool>();
  }
  auto read_patterns = [&](const char* field, auto& out, bool integer) -> Status {
    auto p = j.find(field);
    if (p == j.end() || p->is_null()) return {};
    if (!p->is_object()) return invalid_argument("{}: field \"{}\" must be an object", what, field);
    if (p->size() > kPeftMaxPatterns)
      return invalid_argument("{}: field \"{}\" has {} keys; at most {} are accepted", what, field, p->size(),
                              kPeftMaxPatterns);
    for (auto it = p->begin(); it != p->end(); ++it) {
      std::string err;
      if (it.key().size() > kPeftMaxPatternBytes)
        return invalid_argument("{}: a {} key is {} bytes long; at most {} are accepted", what, field, it.key().size(),
                                kPeftMaxPatternBytes);
      if (!compile_pattern(it.key(), &err))
        return invalid_argument("{}: {} key \"{}\" is not a valid regex: {}", what, field, it.key(), err);
      if (integer) {
        if (!it.value().is_number() || it.value().get<double>() <= 0 || it.value().get<double>() > 65536 ||
            it.value().get<double>() != std::floor(it.value().get<double>()))
          return invalid_argument("{}: {}[\"{}\"] must be a positive integer", what, field, it.key());
      } else if (!it.value().is_number() || !std::isfinite(it.value().get<double>())) {
        return invalid_argument("{}: {}[\"{}\"] must be a finite number", what, field, it.key());
      }
      out.emplace_back(it.key(), it.value().template get<double>());
    }
    return {};
  };
  std::vector<std::pair<std::string, double>> ranks;
  MOELORA_RETURN_IF_ERROR(read_patterns("rank_pattern", ranks, true));
  for (const auto& [k, v] : ranks) c.rank_pattern.emplace_back(k, static_cast<int>(v));
  MOELORA_RETURN_IF_ERROR(read_patterns("alpha_pattern", c.alpha_pattern, false));
  if (auto tp = j.find("target_parameters"); tp != j.end() && !tp->is_null()) {
    if (!tp->is_array()) return invalid_argument("{}: field \"target_parameters\" must be a list", what);
    for (const auto& v : *tp) {
      if (!v.is_string()) return invalid_argument("{}: target_parameters must hold strings", what);
      c.target_parameters.push_back(v.get<std::string>());
    }
  }
  return c;
}

}  // namespace moelora
