// PEFT adapter_config.json for LoRA: ranks, alphas (with rank_pattern / alpha_pattern and PEFT's
// matching rule), rsLoRA, and a refusal, naming the field, for every variant that changes the
// inference math in a way moelora does not implement.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace moelora {

struct PeftConfig {
  int r = 8;
  double lora_alpha = 8.0;
  bool use_rslora = false;
  // In file order: the first key whose regex matches a module decides (PEFT's rule).
  std::vector<std::pair<std::string, int>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;
  std::vector<std::string> target_parameters;  // PEFT >= 0.17 fused expert parameters, in order
  // Set when a pattern hit PCRE2's match or depth limit while rank_for / alpha_for ran (the
  // pattern is then treated as not matching); the loader refuses the adapter when it is set.
  mutable std::string pattern_error;

  // Rank and alpha for a module's full name ("model.layers.0.self_attn.q_proj", or for a fused
  // expert parameter "model.layers.0.mlp.experts.gate_up_proj").
  int rank_for(const std::string& module) const;
  double alpha_for(const std::string& module) const;
  // The scale folded into lora_B: alpha / r, or alpha / sqrt(r) with rsLoRA.
  double scale_for(const std::string& module) const;
};

Result<PeftConfig> parse_peft_config(const std::string& text, const std::string& what);

// PEFT's pattern rule: does `key` (a Python-style regex) match the whole module name, optionally
// preceded by "<anything>."? Invalid regexes are an error (reported by parse_peft_config).
// Matching is bounded (kPeftMatchLimit backtracking steps, kPeftDepthLimit nesting): a
// pathological pattern fails fast instead of running for minutes. `limit_hit` (optional) tells.
bool peft_pattern_matches(const std::string& key, const std::string& module, bool* limit_hit = nullptr);

inline constexpr uint32_t kPeftMatchLimit = 100000;
inline constexpr uint32_t kPeftDepthLimit = 1000;
inline constexpr size_t kPeftMaxPatternBytes = 1024;
inline constexpr size_t kPeftMaxPatterns = 4096;

}  // namespace moelora
