#include "lora/adapter.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "core/log.h"
#include "io/json_util.h"
#include "io/safetensors.h"
#include "lora/peft_config.h"
#include "model/archs.h"

namespace moelora {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kPrefix = "base_model.model.";

// Bounds checked after the scale is folded into lora_B. Real adapters have scales of ~0.1..10
// and factors well below 1; a huge lora_alpha (1e39 is a valid JSON number) would turn finite
// factors into values that overflow in the backend's half-precision copies or its GEMMs.
constexpr double kMaxLoraScale = 1.0e4;
constexpr double kMaxScaledValue = 65504.0;  // the largest finite fp16 value

bool inside(const std::string& real, const std::string& root) {
  return real == root || (real.size() > root.size() && real.compare(0, root.size(), root) == 0 &&
                          (root.back() == '/' || real[root.size()] == '/'));
}

// Reads one adapter file safely (see AdapterLoadOptions::root): the real path must lie inside
// `root` (when set) before the open and, read back from the open descriptor, after it; the open
// neither follows a final symlink nor blocks; only a regular file of at most `max_bytes` is read.
// `identity` accumulates size, mtime and a content hash. Errors name the path, never contents.
Result<std::string> read_adapter_file(const std::string& path, const std::string& root, size_t max_bytes,
                                      AdapterFilesIdentity* identity) {
  char real[PATH_MAX];
  if (::realpath(path.c_str(), real) == nullptr) {
    if (errno == ENOENT) return not_found("'{}' does not exist", path);
    return invalid_argument("cannot resolve '{}': {}", path, std::strerror(errno));
  }
  if (!root.empty() && !inside(real, root))
    return invalid_argument("'{}' resolves outside --lora-root", path);
  const int fd = ::open(real, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ELOOP) return invalid_argument("'{}' was replaced by a symbolic link while being opened", path);
    return invalid_argument("cannot open '{}': {}", path, std::strerror(errno));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return invalid_argument("'{}' is not a regular file", path);
  if (!root.empty()) {
    // A folder on the way may have been swapped for a symlink between realpath() and open():
    // what the descriptor actually refers to must still be inside the root.
    char opened[PATH_MAX];
    const std::string link = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t n = ::readlink(link.c_str(), opened, sizeof(opened) - 1);
    if (n <= 0) return invalid_argument("cannot verify where '{}' lives", path);
    opened[n] = '\0';
    if (!inside(opened, root)) return invalid_argument("'{}' resolves outside --lora-root", path);
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes)
    return invalid_argument("'{}' is {} bytes, over the {} byte limit", path, st.st_size, max_bytes);
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::pread(fd, out.data() + got, out.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return invalid_argument("cannot read '{}'", path);
    got += static_cast<size_t>(n);
  }
  identity->bytes += out.size();
  identity->mtime_ns = std::max<int64_t>(identity->mtime_ns, static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 +
                                                                 st.st_mtim.tv_nsec);
  // 64-bit FNV-1a over 8-byte words (then the tail): fast enough for large adapters and only
  // used to tell whether files changed, not as a security boundary.
  uint64_t h = identity->hash ^ 0xcbf29ce484222325ull;
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, out.data() + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
  }
  for (; i < out.size(); ++i) h = (h ^ static_cast<unsigned char>(out[i])) * 0x100000001b3ull;
  identity->hash = h;
  return out;
}

struct ModuleTensors {
  Tensor a, b;
  std::string a_key, b_key;
};

// "base_model.model.<module>.lora_A[.<adapter>].weight" -> (module, 'A').
Status parse_key(const std::string& key, const std::string& file, std::string* module, char* which) {
  if (key.compare(0, kPrefix.size(), kPrefix) != 0)
    return invalid_argument("{}: tensor '{}' is not a PEFT LoRA tensor (expected base_model.model.<module>.lora_A.weight)",
                            file, key);
  if (key.find("lora_magnitude_vector") != std::string::npos)
    return unsupported("{}: tensor '{}' is a DoRA magnitude vector; DoRA is not supported", file, key);
  if (key.find("lora_embedding_") != std::string::npos)
    return unsupported("{}: tensor '{}': embedding LoRA is not supported", file, key);
  for (char w : {'A', 'B'}) {
    const std::string marker = std::string(".lora_") + w + ".";
    const size_t pos = key.rfind(marker);
    if (pos == std::string::npos) continue;
    const std::string tail = key.substr(pos + marker.size());
    const bool weight = tail == "weight" || (tail.size() > 7 && tail.compare(tail.size() - 7, 7, ".weight") == 0 &&
                                             tail.find('.') == tail.size() - 7);
    if (!weight) {
      if (tail == "bias" || tail.find("bias") != std::string::npos)
        return unsupported("{}: tensor '{}': LoRA with a bias (lora_bias) is not supported", file, key);
      return invalid_argument("{}: tensor '{}' is not a LoRA weight", file, key);
    }
    *module = key.substr(kPrefix.size(), pos - kPrefix.size());
    *which = w;
    return {};
  }
  return unsupported("{}: tensor '{}' is not a LoRA factor: full weights (modules_to_save) are not supported", file,
                     key);
}

// Float32 copy of a factor, with a clear error for non-float dtypes and non-finite values.
Result<Tensor> factor_to_f32(const Tensor& t, const std::string& key, const std::string& file) {
  if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16 && t.dtype() != DType::kF16)
    return invalid_argument("{}: tensor '{}' has dtype {}; LoRA weights must be F32, BF16 or F16", file, key,
                            dtype_name(t.dtype()));
  if (t.ndim() != 2) return invalid_argument("{}: tensor '{}' must be 2-D, has shape {}", file, key, t.shape_string());
  Tensor f = to_f32(t);
  const float* p = f.ptr<float>();
  for (int64_t i = 0; i < f.numel(); ++i)
    if (!std::isfinite(p[i]))
      return invalid_argument("{}: tensor '{}' contains NaN or inf (element {})", file, key, i);
  return f;
}

struct ExpertParts {  // per-expert layout, one layer
  std::map<int, std::array<LoraFactor, 3>> by_expert;  // expert -> gate, up, down
};

struct FusedPart {
  int depth = 0;  // number of ".base_layer" wrappers
  std::string module;
  Tensor a, b;    // f32, unscaled
};

class AdapterBuilder {
 public:
  AdapterBuilder(const ModelConfig& cfg, const PeftConfig& peft, const AdapterLoadOptions& opts, std::string file)
      : cfg_(cfg), peft_(peft), opts_(opts), file_(std::move(file)) {}

  Status add_module(const std::string& module, const ModuleTensors& mt) {
    if (!mt.a.defined() || !mt.b.defined())
      return invalid_argument("{}: module '{}' has lora_{} but no lora_{}", file_, module, mt.a.defined() ? "A" : "B",
                              mt.a.defined() ? "B" : "A");
    MOELORA_ASSIGN_OR_RETURN(Tensor a, factor_to_f32(mt.a, mt.a_key, file_));
    MOELORA_ASSIGN_OR_RETURN(Tensor b, factor_to_f32(mt.b, mt.b_key, file_));
    if (a.dim(0) != b.dim(1))
      return invalid_argument("{}: module '{}': lora_A has rank {} but lora_B has rank {}", file_, module, a.dim(0),
                              b.dim(1));
    std::string base = module;
    int depth = 0;
    while (base.size() > 11 && base.compare(base.size() - 11, 11, ".base_layer") == 0) {
      base.resize(base.size() - 11);
      ++depth;
    }
    std::string why;
    auto ref = resolve_module(cfg_, base, &why);
    if (!ref) return invalid_argument("{}: adapter targets module '{}', but {}", file_, base, why);
    if (ref->kind == ModuleRef::Kind::kFusedExperts) {
      fused_[ref->layer].push_back(FusedPart{depth, base, a, b});
      return {};
    }
    if (depth != 0) return invalid_argument("{}: unexpected base_layer wrapper on module '{}'", file_, module);
    const int rank = static_cast<int>(a.dim(0));
    MOELORA_RETURN_IF_ERROR(check_rank(base, rank));
    int in = 0, out = 0;
    if (ref->kind == ModuleRef::Kind::kDense) {
      std::tie(in, out) = lora_target_shape(cfg_, ref->layer, ref->target);
    } else {
      const bool down = ref->expert_proj == 2;
      in = down ? cfg_.moe_intermediate_size : cfg_.hidden_size;
      out = down ? cfg_.hidden_size : cfg_.moe_intermediate_size;
    }
    if (a.dim(1) != in || b.dim(0) != out)
      return invalid_argument("{}: module '{}': lora_A {} and lora_B {} do not fit the base [{}, {}] (out, in)", file_,
                              base, a.shape_string(), b.shape_string(), out, in);
    MOELORA_ASSIGN_OR_RETURN(Tensor sb, scaled(b, peft_.scale_for(base), base));
    LoraFactor f{a, sb, rank};
    if (ref->kind == ModuleRef::Kind::kDense) {
      adapter_->dense[ref->layer][static_cast<int>(ref->target)] = f;
    } else {
      per_expert_[ref->layer].by_expert[ref->expert][ref->expert_proj] = f;
    }
    return {};
  }

  Result<std::shared_ptr<LoraAdapter>> finish() {
    for (auto& [layer, parts] : per_expert_) {
      if (fused_.count(layer))
        return invalid_argument("{}: layer {} mixes per-expert and fused expert LoRA tensors", file_, layer);
      adapter_->experts[layer] = stack_per_expert(parts);
    }
    for (auto& [layer, parts] : fused_) {
      MOELORA_ASSIGN_OR_RETURN(adapter_->experts[layer], build_fused(layer, parts));
    }
    size_t bytes = 0;
    int max_rank = 0;
    for (const auto& layer : adapter_->dense)
      for (const LoraFactor& f : layer) {
        if (f.rank == 0) continue;
        bytes += f.a.nbytes() + f.b.nbytes();
        max_rank = std::max(max_rank, f.rank);
      }
    for (const ExpertLora& e : adapter_->experts) {
      for (const Tensor* t : {&e.gu_a, &e.gu_b, &e.d_a, &e.d_b})
        if (t->defined()) bytes += t->nbytes();
      max_rank = std::max({max_rank, e.gu_rank, e.d_rank});
    }
    adapter_->bytes = bytes;
    adapter_->max_rank = max_rank;
    return adapter_;
  }

  void init(const std::string& name, const std::string& path) {
    adapter_ = std::make_shared<LoraAdapter>();
    adapter_->name = name;
    adapter_->path = path;
    adapter_->dense.resize(cfg_.num_layers);
    adapter_->experts.resize(cfg_.num_layers);
  }

 private:
  Status check_rank(const std::string& module, int tensor_rank) {
    if (tensor_rank > opts_.max_rank)
      return invalid_argument("{}: module '{}' has rank {}, above the configured maximum {} (--max-lora-rank)", file_,
                              module, tensor_rank, opts_.max_rank);
    const int cfg_rank = peft_.rank_for(module);
    if (cfg_rank != tensor_rank)
      return invalid_argument("{}: module '{}': adapter_config.json gives rank {} but the tensors have rank {}", file_,
                              module, cfg_rank, tensor_rank);
    return {};
  }

  // lora_B with the scale folded in. Checked after scaling: a huge lora_alpha (1e39 is a valid
  // JSON number) would otherwise turn finite weights into inf in float32.
  Result<Tensor> scaled(const Tensor& b, double s, const std::string& module) const {
    MOELORA_RETURN_IF_ERROR(check_scale(s, module));
    Tensor out = Tensor::empty_host(DType::kF32, b.shape());
    for (int64_t i = 0; i < b.numel(); ++i) {
      const double v = b.ptr<float>()[i] * s;
      if (!(std::fabs(v) <= kMaxScaledValue))
        return invalid_argument("{}: module '{}': lora_B times the scale {} reaches {} (element {}), beyond {}", file_,
                                module, s, v, i, kMaxScaledValue);
      out.ptr<float>()[i] = static_cast<float>(v);
    }
    return out;
  }

  Status check_scale(double s, const std::string& module) const {
    if (!(std::fabs(s) <= kMaxLoraScale))
      return invalid_argument("{}: module '{}': the LoRA scale (lora_alpha / r{}) is {}, beyond {}", file_, module,
                              peft_.use_rslora ? ", rsLoRA: / sqrt(r)" : "", s, kMaxLoraScale);
    return {};
  }

  // Stacks per-expert gate/up/down LoRAs into the fused layout (see ExpertLora).
  ExpertLora stack_per_expert(const ExpertParts& parts) {
    const int E = cfg_.num_experts, H = cfg_.hidden_size, I = cfg_.moe_intermediate_size;
    int rg = 0, ru = 0, rd = 0;
    bool same_a = true;  // gate and up share A in every expert (a fused adapter rewritten per expert)
    for (const auto& [e, f] : parts.by_expert) {
      rg = std::max(rg, f[0].rank);
      ru = std::max(ru, f[1].rank);
      rd = std::max(rd, f[2].rank);
      same_a = same_a && f[0].rank == f[1].rank && f[0].rank > 0 &&
               std::memcmp(f[0].a.data(), f[1].a.data(), f[0].a.nbytes()) == 0;
    }
    same_a = same_a && static_cast<int>(parts.by_expert.size()) > 0;
    ExpertLora x;
    if (rg + ru > 0) {
      x.gu_rank = same_a ? rg : rg + ru;
      x.gu_a = Tensor::empty_host(DType::kF32, {E, x.gu_rank, H});
      x.gu_b = Tensor::empty_host(DType::kF32, {E, 2 * I, x.gu_rank});
      for (const auto& [e, f] : parts.by_expert) {
        float* A = x.gu_a.ptr<float>() + static_cast<int64_t>(e) * x.gu_rank * H;
        float* B = x.gu_b.ptr<float>() + static_cast<int64_t>(e) * 2 * I * x.gu_rank;
        for (int half = 0; half < 2; ++half) {
          const LoraFactor& lf = f[half];
          if (lf.rank == 0) continue;
          const int col0 = same_a ? 0 : (half == 0 ? 0 : rg);
          if (!same_a || half == 0)
            std::memcpy(A + static_cast<int64_t>(col0) * H, lf.a.data(), lf.a.nbytes());
          for (int o = 0; o < I; ++o)
            for (int k = 0; k < lf.rank; ++k)
              B[static_cast<int64_t>(half * I + o) * x.gu_rank + col0 + k] = lf.b.ptr<float>()[o * lf.rank + k];
        }
      }
      if (same_a) adapter_->notes.push_back("per-expert gate/up LoRAs share A: stacked at rank " + std::to_string(rg));
    }
    if (rd > 0) {
      x.d_rank = rd;
      x.d_a = Tensor::empty_host(DType::kF32, {E, rd, I});
      x.d_b = Tensor::empty_host(DType::kF32, {E, H, rd});
      for (const auto& [e, f] : parts.by_expert) {
        const LoraFactor& lf = f[2];
        if (lf.rank == 0) continue;
        std::memcpy(x.d_a.ptr<float>() + static_cast<int64_t>(e) * rd * I, lf.a.data(), lf.a.nbytes());
        float* B = x.d_b.ptr<float>() + static_cast<int64_t>(e) * H * rd;
        for (int o = 0; o < H; ++o)
          for (int k = 0; k < lf.rank; ++k) B[static_cast<int64_t>(o) * rd + k] = lf.b.ptr<float>()[o * lf.rank + k];
      }
    }
    return x;
  }

  // PEFT ParamWrapper factors: A [r*E, in] expert-major, B [out, r*E] expert-minor.
  Result<ExpertLora> build_fused(int layer, const std::vector<FusedPart>& parts) {
    const int E = cfg_.num_experts, H = cfg_.hidden_size, I = cfg_.moe_intermediate_size;
    if (!cfg_.layer_is_moe[layer]) return invalid_argument("{}: layer {} has no routed experts", file_, layer);
    enum Param { kGateUp = 0, kDown = 1, kNone = -1 };
    auto fits = [&](const FusedPart& p, Param what) {
      const int64_t in = p.a.dim(1), out = p.b.dim(0);
      return what == kGateUp ? (in == H && out == 2 * I) : (in == I && out == H);
    };
    std::vector<Param> assigned(parts.size(), kNone);
    bool ambiguous = false;
    for (size_t i = 0; i < parts.size(); ++i) {
      const bool gu = fits(parts[i], kGateUp), dn = fits(parts[i], kDown);
      if (gu && dn) ambiguous = true;
      else if (gu) assigned[i] = kGateUp;
      else if (dn) assigned[i] = kDown;
      else
        return invalid_argument("{}: fused expert LoRA '{}' (lora_A {}, lora_B {}) fits neither gate_up_proj [{}, {}] nor "
                                "down_proj [{}, {}]", file_, parts[i].module, parts[i].a.shape_string(),
                                parts[i].b.shape_string(), 2 * I, H, H, I);
    }
    if (parts.size() == 2 && !ambiguous && assigned[0] == assigned[1]) ambiguous = true;
    if (ambiguous) {
      // Shapes cannot tell: PEFT nests one wrapper per target parameter, the last listed outermost.
      const auto& tp = peft_.target_parameters;
      if (tp.empty())
        return invalid_argument("{}: layer {}: fused expert LoRA shapes are ambiguous and target_parameters is empty",
                                file_, layer);
      for (size_t i = 0; i < parts.size(); ++i) {
        const int idx = static_cast<int>(tp.size()) - 1 - parts[i].depth;
        if (idx < 0) return invalid_argument("{}: layer {}: more wrappers than target_parameters", file_, layer);
        const std::string& name = tp[idx];
        const bool gu = name.size() >= 12 && name.compare(name.size() - 12, 12, "gate_up_proj") == 0;
        assigned[i] = gu ? kGateUp : kDown;
        if (!fits(parts[i], assigned[i]))
          return invalid_argument("{}: layer {}: target_parameters order assigns '{}' to {}, which its shapes do not fit",
                                  file_, layer, parts[i].module, name);
      }
      adapter_->notes.push_back(fmt::format("layer {}: fused expert LoRA shapes are ambiguous (2*I == H); assigned by "
                                            "the order of target_parameters", layer));
    }
    ExpertLora x;
    bool seen[2] = {false, false};
    for (size_t i = 0; i < parts.size(); ++i) {
      const FusedPart& p = parts[i];
      const Param what = assigned[i];
      if (seen[what]) return invalid_argument("{}: layer {} has two fused LoRAs for the same expert parameter", file_, layer);
      seen[what] = true;
      const int64_t rows = p.a.dim(0);
      if (rows % E != 0)
        return invalid_argument("{}: fused expert LoRA '{}': lora_A has {} rows, not a multiple of {} experts", file_,
                                p.module, rows, E);
      const int r = static_cast<int>(rows / E);
      const std::string pname = p.module + (what == kGateUp ? ".gate_up_proj" : ".down_proj");
      MOELORA_RETURN_IF_ERROR(check_rank(pname, r));
      const double s = peft_.scale_for(pname);
      MOELORA_RETURN_IF_ERROR(check_scale(s, pname));
      const int in = static_cast<int>(p.a.dim(1)), out = static_cast<int>(p.b.dim(0));
      Tensor A = Tensor::empty_host(DType::kF32, {E, r, in});
      std::memcpy(A.data(), p.a.data(), p.a.nbytes());  // expert-major rows: already [E][r][in]
      Tensor B = Tensor::empty_host(DType::kF32, {E, out, r});
      const float* src = p.b.ptr<float>();
      for (int e = 0; e < E; ++e)
        for (int o = 0; o < out; ++o)
          for (int k = 0; k < r; ++k) {  // expert-minor columns: expert e owns columns e, e+E, ...
            const double v = src[static_cast<int64_t>(o) * r * E + static_cast<int64_t>(k) * E + e] * s;
            if (!(std::fabs(v) <= kMaxScaledValue))
              return invalid_argument("{}: '{}': lora_B times the scale {} reaches {}, beyond {}", file_, pname, s, v,
                                      kMaxScaledValue);
            B.ptr<float>()[(static_cast<int64_t>(e) * out + o) * r + k] = static_cast<float>(v);
          }
      if (what == kGateUp) {
        x.gu_a = A, x.gu_b = B, x.gu_rank = r;
      } else {
        x.d_a = A, x.d_b = B, x.d_rank = r;
      }
    }
    return x;
  }

  const ModelConfig& cfg_;
  const PeftConfig& peft_;
  const AdapterLoadOptions& opts_;
  std::string file_;
  std::shared_ptr<LoraAdapter> adapter_;
  std::map<int, ExpertParts> per_expert_;
  std::map<int, std::vector<FusedPart>> fused_;
};

Status check_added_tokens(const std::string& dir, const ModelConfig& cfg, const std::string& root,
                          AdapterFilesIdentity* identity) {
  const fs::path p = fs::path(dir) / "added_tokens.json";
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(p, ec))) return {};
  MOELORA_ASSIGN_OR_RETURN(std::string text, read_adapter_file(p.string(), root, 16u << 20, identity));
  MOELORA_ASSIGN_OR_RETURN(Json j, parse_json_strict(text, p.string()));
  if (!j.is_object()) return invalid_argument("{} is not an object", p.string());
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!it.value().is_number_integer() || it.value().get<int64_t>() >= cfg.vocab_size)
      return unsupported("{}: the adapter adds token '{}' to the vocabulary; adapters that add tokens are not supported",
                         p.string(), it.key());
  return {};
}

}  // namespace

Result<std::shared_ptr<const LoraAdapter>> load_lora_adapter(const std::string& dir, const std::string& name,
                                                             const ModelConfig& cfg, const AdapterLoadOptions& opts) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return not_found("adapter directory '{}' does not exist", dir);
  const std::string cfg_path = (fs::path(dir) / "adapter_config.json").string();
  const std::string st_path = (fs::path(dir) / "adapter_model.safetensors").string();
  if (!fs::exists(fs::symlink_status(cfg_path, ec)))
    return not_found("adapter directory '{}' has no adapter_config.json", dir);
  if (!fs::exists(fs::symlink_status(st_path, ec))) {
    if (fs::exists(fs::path(dir) / "adapter_model.bin", ec))
      return unsupported("{} holds only adapter_model.bin: pickle files are code and are never loaded; save the "
                         "adapter as safetensors", dir);
    return not_found("adapter directory '{}' has no adapter_model.safetensors", dir);
  }
  std::string root;
  if (!opts.root.empty()) {
    char real_root[PATH_MAX];
    if (::realpath(opts.root.c_str(), real_root) == nullptr)
      return not_found("--lora-root '{}' cannot be resolved", opts.root);
    root = real_root;
  }
  AdapterFilesIdentity identity;
  MOELORA_ASSIGN_OR_RETURN(std::string text, read_adapter_file(cfg_path, root, 16u << 20, &identity));
  MOELORA_ASSIGN_OR_RETURN(PeftConfig peft, parse_peft_config(text, cfg_path));
  MOELORA_RETURN_IF_ERROR(check_added_tokens(dir, cfg, root, &identity));
  MOELORA_ASSIGN_OR_RETURN(std::string weights, read_adapter_file(st_path, root, 64ull << 30, &identity));
  auto parsed = SafetensorsFile::parse(std::make_shared<const std::string>(std::move(weights)), st_path);
  if (!parsed.ok()) {
    // The parser's messages quote values read from the file (a "header length" is its first
    // eight bytes): the operator's log gets them, the caller only the verdict.
    MOELORA_LOG_WARN("adapter '{}': {}", name, parsed.status().message());
    return invalid_argument("{} is not a valid safetensors file", st_path);
  }
  std::shared_ptr<SafetensorsFile> file = std::move(parsed).value();

  std::map<std::string, ModuleTensors> modules;
  for (const auto& [key, entry] : file->entries()) {
    std::string module;
    char which = 0;
    MOELORA_RETURN_IF_ERROR(parse_key(key, st_path, &module, &which));
    MOELORA_ASSIGN_OR_RETURN(Tensor t, file->tensor(key));
    ModuleTensors& mt = modules[module];
    (which == 'A' ? mt.a : mt.b) = t;
    (which == 'A' ? mt.a_key : mt.b_key) = key;
  }
  if (modules.empty()) return invalid_argument("{} holds no LoRA tensors", st_path);
  AdapterBuilder builder(cfg, peft, opts, st_path);
  builder.init(name, dir);
  for (const auto& [module, mt] : modules) {
    Status added = builder.add_module(module, mt);
    // A pattern that hit the match limit was treated as not matching: that, not the rank
    // mismatch it may have caused, is the error to report.
    if (!peft.pattern_error.empty()) return invalid_argument("{}: {}", cfg_path, peft.pattern_error);
    MOELORA_RETURN_IF_ERROR(added);
  }
  MOELORA_ASSIGN_OR_RETURN(auto adapter, builder.finish());
  if (!peft.pattern_error.empty()) return invalid_argument("{}: {}", cfg_path, peft.pattern_error);
  adapter->identity = identity;
  convert_adapter_factors(*adapter, opts.factor_dtype);
  return std::shared_ptr<const LoraAdapter>(adapter);
}

namespace {

Tensor converted(const Tensor& t, DType dtype) {
  if (!t.defined() || t.dtype() == dtype) return t;
  MOELORA_CHECK(t.dtype() == DType::kF32 && dtype == DType::kBF16 && t.contiguous());
  Tensor out = Tensor::empty_host(dtype, t.shape());
  const float* src = t.ptr<float>();
  uint16_t* dst = out.ptr<uint16_t>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  return out;
}

}  // namespace

bool factors_are(const LoraAdapter& a, DType dtype) {
  for (const auto& layer : a.dense)
    for (const LoraFactor& f : layer)
      if (f.rank && (f.a.dtype() != dtype || f.b.dtype() != dtype)) return false;
  for (const ExpertLora& x : a.experts)
    for (const Tensor* t : {&x.gu_a, &x.gu_b, &x.d_a, &x.d_b})
      if (t->defined() && t->dtype() != dtype) return false;
  return true;
}

void convert_adapter_factors(LoraAdapter& a, DType dtype) {
  MOELORA_CHECK_MSG(dtype == DType::kF32 || dtype == DType::kBF16, "adapter factors in {}", dtype_name(dtype));
  size_t bytes = 0;
  for (auto& layer : a.dense)
    for (LoraFactor& f : layer) {
      if (f.rank == 0) continue;
      f.a = converted(f.a, dtype);
      f.b = converted(f.b, dtype);
      bytes += f.a.nbytes() + f.b.nbytes();
    }
  for (ExpertLora& x : a.experts)
    for (Tensor* t : {&x.gu_a, &x.gu_b, &x.d_a, &x.d_b}) {
      *t = converted(*t, dtype);
      if (t->defined()) bytes += t->nbytes();
    }
  a.bytes = bytes;
}

}  // namespace moelora
