// moelora verify --fixtures DIR [--backend cpu|cuda] [--tp N --ep M] [--mla MODE]: runs the reference
// fixtures, every case of a checkpoint in one batch that mixes all adapters and the base model. With
// tp x ep > 1 on the CPU the batch runs through the sharded forward (src/parallel: tp x ep ranks
// as threads), which must meet the same bounds as the single-device path. --mla picks DeepSeek's
// attention form (model.h MlaMode; auto = absorbed on the CPU and on CUDA).
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "model/model.h"
#include "parallel/sharded_forward.h"
#include "runtime/backend_factory.h"
#include "runtime/fixture_verifier.h"
#include "tools/commands.h"
#include "tools/common.h"

namespace moelora::tools {

namespace {

// The fixtures' steps on tp x ep simulated ranks (threads + FakeCommunicator).
class ShardedStepRunner final : public StepRunner {
 public:
  explicit ShardedStepRunner(std::unique_ptr<ShardedModel> m) : m_(std::move(m)) {}
  Result<int> acquire(const std::shared_ptr<const LoraAdapter>& adapter) override { return m_->acquire(adapter); }
  void alloc_kv_cache(int num_pages, int page_size) override { m_->alloc_kv_cache(num_pages, page_size); }
  Tensor forward(const StepBatch& batch) override { return m_->forward(batch); }

 private:
  std::unique_ptr<ShardedModel> m_;
};

}  // namespace

void register_verify(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("verify", "Check outputs against reference fixtures (Hugging Face + PEFT, float64)");
  struct Args {
    std::string fixtures;
    BackendOptions backend;
    double tol = -1;
    double min_top1 = -1;
    int tp = 1;
    int ep = 1;
    std::string mla = "auto";
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--fixtures", args->fixtures, "a model folder with cases.json, or a root with manifest.json")
      ->required();
  cmd->add_option("--backend", args->backend.name, "cpu or cuda")->capture_default_str();
  add_cuda_backend_flags(cmd, args->backend);
  cmd->add_option("--max-rel-error", args->tol,
                  "per-row relative error bound (default: 1e-4 on cpu; 3e-2 for bf16 paths, see docs/numerics.md)");
  cmd->add_option("--min-top1", args->min_top1, "bf16 paths: top-1 agreement a checkpoint needs");
  cmd->add_option("--tp", args->tp, "tensor-parallel ranks (attention, dense MLPs, each expert's intermediate)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--ep", args->ep, "expert-parallel ranks (routed experts); tp x ep ranks in all")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--mla", args->mla,
                  "MLA attention (DeepSeek-V3): auto (absorbed where the backend has it), decompressed or absorbed")
      ->capture_default_str();
  cmd->callback([args, &exit_code] {
    const int ranks = args->tp * args->ep;
    auto mla = parse_mla_mode(args->mla);
    if (!mla.ok()) {
      std::fprintf(stderr, "moelora verify: --mla: %s\n", mla.status().message().c_str());
      exit_code = 2;
      return;
    }
    if (ranks > 1 && args->backend.name != "cpu" && args->backend.name != "cuda") {
      std::fprintf(stderr, "moelora verify: --tp/--ep > 1 run the sharded forward on --backend cpu (float32), not on '%s'\n",
                   args->backend.name.c_str());
      exit_code = 2;
      return;
    }
    if (ranks > 1 && args->backend.name == "cuda") {
      // The GPU path needs one process per GPU joined by NCCL (docs/multi_gpu.md); this build has
      // neither the NCCL communicator nor the launcher.
      std::fprintf(stderr,
                   "moelora verify: --tp %d --ep %d needs %d GPUs and a moelora built with NCCL, which this build is "
                   "not; --backend cpu runs the same sharding on %d simulated ranks\n",
                   args->tp, args->ep, ranks, ranks);
      exit_code = 2;
      return;
    }
    VerifyOptions opts;
    // Paths that store activations in bf16 are judged statistically (docs/numerics.md).
    if (args->backend.name != "cpu") opts = VerifyOptions::for_bf16();
    if (args->tol > 0) opts.max_rel_error = args->tol;
    if (args->min_top1 >= 0) opts.ckpt_min_top1 = args->min_top1;
    opts.model.mla = *mla;
    if (ranks > 1) {
      const int tp = args->tp, ep = args->ep;
      opts.make_runner = [tp, ep](Model& model, int num_slots) -> Result<std::unique_ptr<StepRunner>> {
        MOELORA_ASSIGN_OR_RETURN(auto sharded, ShardedModel::create(model, tp, ep, num_slots));
        return std::unique_ptr<StepRunner>(std::make_unique<ShardedStepRunner>(std::move(sharded)));
      };
    }
    std::string backend_error;
    auto make = [&]() -> std::unique_ptr<Backend> {
      auto b = make_backend(args->backend);
      if (!b.ok()) {
        backend_error = b.status().message();
        return nullptr;
      }
      return std::move(b).value();
    };
    if (!make()) {
      std::fprintf(stderr, "moelora verify: %s\n", backend_error.c_str());
      exit_code = 2;
      return;
    }
    auto print = [](const CaseResult& r) {
      std::printf("%-16s %-28s %-22s len %2d  prefill %.2e  decode %.2e  median %.1e  within %d/%d  top1 %d/%d  %s\n",
                  r.model.c_str(), r.case_id.c_str(), r.adapter.empty() ? "(base)" : r.adapter.c_str(), r.prompt_len,
                  r.prefill_rel, r.decode_rel, r.median_rel, r.rows_within, r.rows, r.top1_match, r.top1_rows,
                  r.passed ? "PASS" : "FAIL");
      std::fflush(stdout);
    };
    auto print_ck = [](const CheckpointResult& c) {
      std::printf("%-16s all cases: %d rows, %d within bound (%.1f%%), median %.1e, top1 %d/%d  %s\n", c.model.c_str(),
                  c.rows, c.rows_within, 100.0 * c.rows_within / std::max(1, c.rows), c.median_rel, c.top1_match,
                  c.top1_rows, c.passed ? "PASS" : "FAIL");
      std::fflush(stdout);
    };
    Result<VerifySummary> res = Status(ErrorCode::kInternal, "not run");
    try {
      res = verify_fixtures(args->fixtures, make, opts, print, print_ck);
    } catch (const nlohmann::json::exception& e) {
      res = invalid_argument("malformed fixture file: {}", e.what());
    }
    if (!res.ok()) {
      std::fprintf(stderr, "moelora verify: %s\n", res.status().message().c_str());
      exit_code = 2;
      return;
    }
    const VerifySummary& s = *res;
    const std::string sharding = ranks > 1 ? fmt::format(", tp {} x ep {}", args->tp, args->ep) : "";
    std::printf(
        "%d passed, %d failed (backend %s%s, MLA %s, worst relative error %.2e, top-1 agreement %d/%d, tolerance "
        "%.1e)\n",
        s.passed, s.failed, args->backend.name.c_str(), sharding.c_str(), mla_mode_name(*mla), s.worst_rel,
        s.top1_match, s.top1_rows, opts.max_rel_error);
    exit_code = s.failed == 0 && s.passed > 0 ? 0 : 1;
  });
}

}  // namespace moelora::tools
