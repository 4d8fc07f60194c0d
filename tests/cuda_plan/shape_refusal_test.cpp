// The refusal reaches the caller as a Status, before any weight is read: Model::load,
// Model::random and Engine::create on a CPU backend that enforces the CUDA kernels' limits
// exactly as CudaBackend does (cuda_plan::check_shape_limits and its rank cap), so no GPU is needed.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "backends/cpu/cpu_backend.h"
#include "backends/cuda_plan/shape_limits.h"
#include "lora/random_adapter.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "tests/testutil/forwarding_backend.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

namespace fs = std::filesystem;

// The CPU backend's ops behind the CUDA backend's start-up checks. `rank_cap` stands for the
// kernels' rank ceiling.
class CudaLimitsBackend final : public testutil::ForwardingCpuBackend {
 public:
  explicit CudaLimitsBackend(int rank_cap = cuda_plan::kMaxLoraRank) : rank_cap_(rank_cap) {}
  mutable int checks = 0;  // calls to check_model_shapes

  Status check_model_shapes(const ModelShapes& s) const override {
    ++checks;
    return cuda_plan::check_shape_limits(s);
  }
  int max_lora_rank() const override { return rank_cap_; }

  std::string name() const override { return "cuda-limits"; }

 private:
  int rank_cap_;
};

// ... which also declares the absorbed MLA op, as CudaBackend does.
class AbsorbingCudaLimitsBackend final : public testutil::ForwardingCpuBackend {
 public:
  Status check_model_shapes(const ModelShapes& s) const override { return cuda_plan::check_shape_limits(s); }
  std::string name() const override { return "cuda-limits-absorbed"; }
  bool supports_mla_absorbed() const override { return true; }
  void mla_attention_absorbed(const Tensor& q, const Tensor& latent, const Tensor& k_pe, const LinearWeight& kv_b,
                              const LoraModuleTable* lora, KvLayer& kv, int heads, int nope, int v_dim, float scale,
                              Tensor out) override {
    cpu_.mla_attention_absorbed(q, latent, k_pe, kv_b, lora, kv, heads, nope, v_dim, scale, out);
  }
};

const fs::path kTiny = fs::path(MOELORA_SOURCE_DIR) / "models" / "tiny-qwen3moe";
const fs::path kDeepseek = fs::path(MOELORA_SOURCE_DIR) / "tests" / "fixtures" / "deepseekv3" / "model-bf16";

nlohmann::json tiny_config() {
  std::ifstream f(kTiny / "config.json");
  return nlohmann::json::parse(f);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(ShapeRefusal, ModelLoadRefusesBeforeReadingAnyWeight) {
  // A folder with only a config.json: if the check did not come first, the error would be the
  // missing checkpoint.
  testutil::TempDir dir;
  nlohmann::json j = tiny_config();
  j["head_dim"] = 36;  // (36, 36): no attention kernel (the generic one reads 8-value pieces)
  testutil::write_file(dir.sub("config.json"), j.dump());
  CudaLimitsBackend cuda_like;
  auto refused = Model::load(dir.str(), cuda_like);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kUnsupported);
  const std::string msg = refused.status().message();
  EXPECT_TRUE(contains(msg, dir.str())) << msg;
  EXPECT_TRUE(contains(msg, "head dims k=36, v=36")) << msg;
  EXPECT_TRUE(contains(msg, "multiple of 8")) << msg;
  // The CPU reference takes the shapes: it gets as far as the (missing) checkpoint.
  CpuBackend cpu;
  auto on_cpu = Model::load(dir.str(), cpu);
  ASSERT_FALSE(on_cpu.ok());
  EXPECT_FALSE(contains(on_cpu.status().message(), "head dims")) << on_cpu.status().message();
}

TEST(ShapeRefusal, AModelTheKernelsTakeLoadsAndRuns) {
  CudaLimitsBackend cuda_like;
  auto model = Model::load(kTiny.string(), cuda_like);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  EXPECT_EQ(cuda_like.checks, 1);
}

TEST(ShapeRefusal, RandomWeightsAreRefusedLikeACheckpoint) {
  nlohmann::json j = tiny_config();
  j["moe_intermediate_size"] = 200;
  auto cfg = parse_model_config(j.dump(), "edited config.json");
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  CudaLimitsBackend cuda_like;
  auto refused = Model::random(*cfg, cuda_like, 7);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(contains(refused.status().message(), "intermediate size 200")) << refused.status().message();
  CpuBackend cpu;
  EXPECT_TRUE(Model::random(*cfg, cpu, 7).ok());
}

TEST(ShapeRefusal, TheEngineRefusesMoreAdapterSlotsThanTheMoeAlignmentSorts) {
  auto backend = std::make_unique<CudaLimitsBackend>();
  auto model = Model::load(kTiny.string(), *backend);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  EngineOptions o;
  o.max_model_len = 64;
  o.max_loras_per_batch = cuda_plan::moe_lora_max_slots(8) + 1;  // the tiny model has 8 experts
  o.max_loaded_loras = o.max_loras_per_batch;
  auto engine = Engine::create(std::move(backend), std::move(model).value(), o);
  ASSERT_FALSE(engine.ok());
  const std::string msg = engine.status().message();
  EXPECT_TRUE(contains(msg, "max_loras_per_batch 1463")) << msg;
  EXPECT_TRUE(contains(msg, "at most 1462 slots")) << msg;
}

TEST(ShapeRefusal, TheEngineLowersItsRankCeilingToTheKernelsAndRefusesAdaptersAboveIt) {
  auto backend = std::make_unique<CudaLimitsBackend>(/*rank_cap=*/8);
  auto model = Model::load(kTiny.string(), *backend);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const ModelConfig cfg = (*model)->config();
  EngineOptions o;  // max_lora_rank 256 by default
  o.max_model_len = 64;
  o.max_loras_per_batch = 2;
  o.max_loaded_loras = 4;
  ASSERT_GT(o.max_lora_rank, 8);
  auto engine = Engine::create(std::move(backend), std::move(model).value(), o);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Engine& e = **engine;
  EXPECT_EQ(e.options().max_lora_rank, 8);
  EXPECT_TRUE(e.load_adapter("r8", (kTiny / "adapters" / "attn-r8").string()).ok());
  const Status r16 = e.load_adapter("r16", (kTiny / "adapters" / "full-r16").string());
  EXPECT_FALSE(r16.ok());
  EXPECT_TRUE(contains(r16.message(), "rank 16")) << r16.message();
  // In-memory adapters meet the same ceiling.
  const Status rnd = e.add_adapter("rnd", make_random_adapter(cfg, "rnd", 16, 1));
  EXPECT_FALSE(rnd.ok());
  EXPECT_TRUE(contains(rnd.message(), "above the engine's maximum 8")) << rnd.message();
  EXPECT_TRUE(e.add_adapter("rnd8", make_random_adapter(cfg, "rnd8", 8, 1)).ok());
}

// The MLA form is chosen before the check, so the kernels that will run are the ones judged: a
// DeepSeek model with head dims no attention kernel takes loads absorbed and is refused
// decompressed; one with a latent row wider than the latent kernels take, the other way round.
TEST(ShapeRefusal, MlaModelsAreJudgedInTheFormTheyWillRun) {
  auto try_load = [](const nlohmann::json& cfg, MlaMode mode) {
    testutil::TempDir dir;
    testutil::write_file(dir.sub("config.json"), cfg.dump());
    AbsorbingCudaLimitsBackend cuda_like;
    ModelOptions o;
    o.mla = mode;
    auto m = Model::load(dir.str(), cuda_like, o);
    EXPECT_FALSE(m.ok());  // no checkpoint in the folder: at best it fails there
    return m.ok() ? std::string() : m.status().message();
  };
  std::ifstream f(kDeepseek / "config.json");
  const nlohmann::json base = nlohmann::json::parse(f);
  nlohmann::json odd_heads = base;
  odd_heads["v_head_dim"] = 264;  // (48, 264): no attention kernel
  EXPECT_TRUE(contains(try_load(odd_heads, MlaMode::kDecompressed), "head dims k=48, v=264"));
  const std::string absorbed = try_load(odd_heads, MlaMode::kAuto);
  EXPECT_FALSE(contains(absorbed, "head dims")) << absorbed;
  EXPECT_FALSE(contains(absorbed, "cannot run")) << absorbed;
  nlohmann::json wide = base;
  wide["kv_lora_rank"] = 768;  // + rope 16 > 768 values per cache row
  EXPECT_TRUE(contains(try_load(wide, MlaMode::kAuto), "MLA (absorbed): kv_lora_rank 768 + rope 16"));
  EXPECT_FALSE(contains(try_load(wide, MlaMode::kDecompressed), "cannot run"));
}

TEST(ShapeRefusal, TheDefaultBackendCheckAcceptsAnyShape) {
  ModelShapes s;
  s.k_head_dim = 40;
  s.v_head_dim = 24;
  s.num_experts = 5000;
  s.max_lora_rank = 4096;
  CpuBackend cpu;
  EXPECT_TRUE(cpu.check_model_shapes(s).ok());
  EXPECT_EQ(cpu.max_lora_rank(), 0);
  EXPECT_FALSE(cuda_plan::check_shape_limits(s).ok());
}

}  // namespace
}  // namespace moelora
