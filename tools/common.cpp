#include "tools/common.h"

#include <algorithm>
#include <charconv>
#include <filesystem>

#include "tools/commands.h"

namespace moelora::tools {

namespace fs = std::filesystem;

std::string default_model_dir() {
  // The source tree's copy (this binary was built from it), else next to the executable.
  std::error_code ec;
  const fs::path src = fs::path(MOELORA_SOURCE_DIR) / "models" / "tiny-qwen3moe";
  if (fs::exists(src / "config.json", ec)) return src.string();
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (fs::path p : {exe.parent_path() / "models" / "tiny-qwen3moe",
                       exe.parent_path().parent_path() / "share" / "moelora" / "models" / "tiny-qwen3moe"})
      if (fs::exists(p / "config.json", ec)) return p.string();
  }
  return "";
}

Result<std::pair<std::string, std::string>> parse_name_path(const std::string& spec) {
  const size_t eq = spec.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size())
    return invalid_argument("expected NAME=PATH, got '{}'", spec);
  return std::make_pair(spec.substr(0, eq), spec.substr(eq + 1));
}

Result<std::vector<int32_t>> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && (text[i] == ',' || text[i] == ' ')) ++i;
    if (i == text.size()) break;
    int32_t v = 0;
    auto [p, ec] = std::from_chars(text.data() + i, text.data() + text.size(), v);
    if (ec != std::errc() || v < 0) return invalid_argument("'{}' is not a list of token ids", text);
    ids.push_back(v);
    i = static_cast<size_t>(p - text.data());
  }
  return ids;
}

std::vector<std::pair<std::string, std::string>> bundled_adapters(const std::string& model_dir) {
  std::vector<std::pair<std::string, std::string>> out;
  std::error_code ec;
  const fs::path root = fs::path(model_dir) / "adapters";
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.is_directory() && fs::exists(e.path() / "adapter_config.json", ec))
      out.emplace_back(e.path().filename().string(), e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

void add_cuda_backend_flags(CLI::App* cmd, BackendOptions& o) {
  cmd->add_flag("!--no-graphs", o.cuda_graphs, "CUDA: run decode steps eagerly instead of replaying captured graphs");
  cmd->add_flag("!--no-overlap", o.cuda_overlap, "CUDA: run LoRA work on the main stream, not a side stream");
  cmd->add_flag("--moe-fp8-activations", o.cuda_moe_fp8_activations,
                "CUDA: FP8 experts quantise activations per token per 128 channels (W8A8) where that measured "
                "faster (2-24 tokens per expert): MoE layer 6-18 % faster at 64-256 tokens on the H200, "
                "rows ~2-3 % less exact (docs/numerics.md)");
  cmd->add_flag("!--no-dense-lora-in-gemm", o.cuda_dense_lora_in_gemm,
                "CUDA: run the projections' LoRA as a kernel after their GEMM at decode sizes too, instead of inside "
                "the GEMM (a shrink, then the GEMM's epilogue; the default up to 8 tokens)");
  cmd->add_flag("!--no-kv-write-in-head-pass", o.cuda_kv_write_in_head_pass,
                "CUDA: write this step's k and v into the KV cache with a launch of their own before attention, "
                "instead of from the RoPE (or head-norm + RoPE) launch");
  cmd->add_flag("--shared-experts-concurrent", o.cuda_shared_experts_concurrent,
                "CUDA: run a MoE layer's shared experts (DeepSeek) on a stream of their own, beside the routed "
                "experts, instead of after them (off by default: faster on the H100, but with LoRA from 64 tokens "
                "not bit-identical to the serial form)");
  cmd->add_flag("!--no-moe-lora-beside-gemm", o.cuda_moe_lora_beside_gemm,
                "CUDA: never run the MoE LoRA shrinks beside the expert GEMMs (one stream, the GEMMs waiting for them "
                "only before their epilogues; the default up to half a routed pair per expert) but before them or on "
                "a side stream");
  cmd->add_flag("!--no-dense-lora-beside-gemm", o.cuda_dense_lora_beside_gemm,
                "CUDA: with the projections' LoRA inside their GEMM, let the GEMM wait for the LoRA shrink before "
                "it starts instead of streaming its weights beside it and waiting only before its epilogue");
}

}  // namespace moelora::tools
