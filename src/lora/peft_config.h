// PEFT adapter_config.json for LoRA: ranks, alphas (with rank_pattern / alpha_pattern and PEFT's
// matching rule), rsLoRA, and a refusal, naming the field, for every variant that changes the
// inference math in a way moelora does not implement.
#pragma once

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
bool peft_pattern_matches(const std::string& key, const std::string& module);

}  // namespace moelora
