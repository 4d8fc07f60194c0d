// libFuzzer target: arbitrary text as JSON, as a model config.json and as a PEFT
// adapter_config.json, and as ModelOpt's hf_quant_config.json. Errors are fine; crashes, leaks and
// hangs are not.
#include <cstddef>
#include <cstdint>
#include <string>

#include "io/json_util.h"
#include "lora/peft_config.h"
#include "model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto json = moelora::parse_json_strict(text, "fuzz.json");
  auto cfg = moelora::parse_model_config(text, "config.json");
  if (cfg.ok()) (void)cfg->quant_excluded("model.layers.0.mlp.experts.1.down_proj");
  // As ModelOpt's hf_quant_config.json.
  if (json.ok() && json->is_object())
    if (auto q = json->find("quantization"); q != json->end()) {
      moelora::ModelConfig c;
      if (moelora::apply_modelopt_quantization(*q, "hf_quant_config.json", c).ok())
        (void)c.quant_excluded("lm_head");
    }
  auto peft = moelora::parse_peft_config(text, "adapter_config.json");
  if (peft.ok()) {
    (void)peft->rank_for("model.layers.0.self_attn.q_proj");
    (void)peft->scale_for("model.layers.1.mlp.experts.gate_up_proj");
  }
  return 0;
}
