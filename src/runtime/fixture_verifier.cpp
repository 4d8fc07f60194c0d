#include "runtime/fixture_verifier.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include <fmt/format.h>

#include "io/json_util.h"
#include "io/mapped_file.h"
#include "io/safetensors.h"
#include "lora/adapter.h"
#include "lora/slot_pool.h"
#include "model/model.h"

namespace moelora {

namespace fs = std::filesystem;

namespace {

struct FixtureCase {
  std::string id;        // id in the expected file
  std::string label;     // printed id
  std::string adapter;   // "" = base
  std::vector<int32_t> prompt;
  int new_tokens = 0;
};

struct RowStats {
  double worst_rel = 0;
  std::vector<double> rels;
  int top1_match = 0;
  int top1_rows = 0;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Compares one logits row with its float64-derived reference.
void compare_row(const float* out, const float* ref, int V, double tie_margin, RowStats* s) {
  double num = 0, den = 0;
  int best_o = 0, best_r = 0;
  for (int i = 0; i < V; ++i) {
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
    if (out[i] > out[best_o]) best_o = i;
    if (ref[i] > ref[best_r]) best_r = i;
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  const double r = std::isfinite(rel) ? rel : INFINITY;
  s->worst_rel = std::max(s->worst_rel, r);
  s->rels.push_back(r);
  double second = -INFINITY;
  for (int i = 0; i < V; ++i)
    if (i != best_r) second = std::max(second, static_cast<double>(ref[i]));
  const double rms = std::sqrt(den / V);
  if (ref[best_r] - second >= tie_margin * rms) {
    s->top1_rows++;
    s->top1_match += best_o == best_r;
  }
}

// The single-device runner: the model's own forward with a slot pool on its backend.
class ModelStepRunner final : public StepRunner {
 public:
  ModelStepRunner(Model& model, int num_slots)
      : model_(model), pool_(model.config(), model.backend(), num_slots) {}
  Result<int> acquire(const std::shared_ptr<const LoraAdapter>& adapter) override { return pool_.acquire(adapter); }
  void alloc_kv_cache(int num_pages, int page_size) override { kv_ = model_.alloc_kv_cache(num_pages, page_size); }
  Tensor forward(const StepBatch& batch) override { return model_.forward(batch, kv_, &pool_.tables()); }

 private:
  Model& model_;
  LoraSlotPool pool_;
  std::vector<KvLayer> kv_;
};

Result<Tensor> expected_tensor(const SafetensorsFile& f, const std::string& name, int64_t rows, int64_t cols) {
  MOELORA_ASSIGN_OR_RETURN(Tensor t, f.tensor(name));
  if (t.dtype() != DType::kF32 || t.ndim() != 2 || t.dim(0) != rows || t.dim(1) != cols)
    return invalid_argument("{}: '{}' should be F32 [{}, {}], is {} {}", f.path(), name, rows, cols,
                            dtype_name(t.dtype()), t.shape_string());
  return to_f32(t);
}

Status verify_checkpoint(const fs::path& folder, const std::string& model_name, const std::string& tag,
                         const Json& ck, const Json& cases_json, Backend& backend, const VerifyOptions& opts,
                         VerifySummary* summary, const std::function<void(const CaseResult&)>& on_case,
                         const std::function<void(const CheckpointResult&)>& on_checkpoint) {
  const std::string what = (folder / "cases.json").string();
  MOELORA_ASSIGN_OR_RETURN(std::string model_dir, json_get_string(ck, "model_dir", what));
  MOELORA_ASSIGN_OR_RETURN(std::string expected_file, json_get_string(ck, "expected", what));
  MOELORA_ASSIGN_OR_RETURN(auto model, Model::load((folder / model_dir).string(), backend, opts.model));
  const ModelConfig& cfg = model->config();
  MOELORA_ASSIGN_OR_RETURN(auto expected, SafetensorsFile::open((folder / expected_file).string()));

  // Adapters: the listed ones plus same_outputs_as aliases (same weights, another layout).
  std::map<std::string, std::string> alias_of;  // alias -> target
  if (auto it = cases_json.find("same_outputs_as"); it != cases_json.end() && it->is_object())
    for (auto a = it->begin(); a != it->end(); ++a) alias_of[a.key()] = a.value().get<std::string>();
  std::vector<std::string> adapter_names;
  for (const Json& n : cases_json.value("adapters", Json::array())) adapter_names.push_back(n.get<std::string>());
  for (const auto& [alias, target] : alias_of) adapter_names.push_back(alias);
  const int num_slots = std::max<int>(1, static_cast<int>(adapter_names.size()));
  std::unique_ptr<StepRunner> runner;
  if (opts.make_runner) {
    MOELORA_ASSIGN_OR_RETURN(runner, opts.make_runner(*model, num_slots));
  } else {
    runner = std::make_unique<ModelStepRunner>(*model, num_slots);
  }
  std::map<std::string, int> slot_of;
  for (const std::string& name : adapter_names) {
    MOELORA_ASSIGN_OR_RETURN(auto adapter, load_lora_adapter((folder / "adapters" / name).string(), name, cfg));
    MOELORA_ASSIGN_OR_RETURN(slot_of[name], runner->acquire(adapter));
  }

  std::vector<FixtureCase> cases;
  for (const Json& c : ck.at("cases")) {
    FixtureCase fc;
    fc.id = c.at("id").get<std::string>();
    fc.label = fc.id;
    fc.adapter = c.at("adapter").is_null() ? "" : c.at("adapter").get<std::string>();
    fc.prompt = c.at("prompt_ids").get<std::vector<int32_t>>();
    fc.new_tokens = c.at("new_tokens").get<int>();
    if (fc.prompt.empty()) return invalid_argument("{}: case {} has an empty prompt", what, fc.id);
    cases.push_back(fc);
    for (const auto& [alias, target] : alias_of)
      if (fc.adapter == target) {
        FixtureCase ac = fc;
        ac.adapter = alias;
        ac.label = fc.id + "@" + alias;
        cases.push_back(ac);
      }
  }

  // One batch: every case is a sequence with its own pages.
  const int page_size = 16;
  StepBatch prefill;
  std::vector<std::vector<int32_t>> pages(cases.size());
  int next_page = 0;
  for (size_t s = 0; s < cases.size(); ++s) {
    const int len = static_cast<int>(cases[s].prompt.size()) + cases[s].new_tokens;
    for (int p = 0; p < (len + page_size - 1) / page_size; ++p) pages[s].push_back(next_page++);
  }
  runner->alloc_kv_cache(next_page, page_size);
  prefill.seq_pages = pages;
  for (size_t s = 0; s < cases.size(); ++s) {
    const int slot = cases[s].adapter.empty() ? -1 : slot_of.at(cases[s].adapter);
    for (size_t i = 0; i < cases[s].prompt.size(); ++i) {
      prefill.logit_rows.push_back(prefill.num_tokens());
      prefill.token_ids.push_back(cases[s].prompt[i]);
      prefill.positions.push_back(static_cast<int32_t>(i));
      prefill.token_seq.push_back(static_cast<int32_t>(s));
      prefill.token_slot.push_back(slot);
    }
  }
  Tensor logits = runner->forward(prefill);
  const int V = cfg.vocab_size;
  std::vector<RowStats> pre(cases.size()), dec(cases.size());
  std::vector<Tensor> gen_ids(cases.size()), gen_logits(cases.size());
  int row = 0;
  for (size_t s = 0; s < cases.size(); ++s) {
    const FixtureCase& c = cases[s];
    const int L = static_cast<int>(c.prompt.size());
    MOELORA_ASSIGN_OR_RETURN(Tensor ref, expected_tensor(*expected, c.id + ".prefill_logits", L, V));
    MOELORA_ASSIGN_OR_RETURN(gen_logits[s], expected_tensor(*expected, c.id + ".gen_logits", c.new_tokens, V));
    MOELORA_ASSIGN_OR_RETURN(Tensor ids, expected->tensor(c.id + ".gen_ids"));
    if (ids.numel() != c.new_tokens) return invalid_argument("{}: {}.gen_ids has {} ids", expected_file, c.id, ids.numel());
    gen_ids[s] = ids;
    for (int i = 0; i < L; ++i, ++row)
      compare_row(logits.ptr<float>() + static_cast<int64_t>(row) * V, ref.ptr<float>() + static_cast<int64_t>(i) * V, V,
                  opts.tie_margin, &pre[s]);
    // The last prompt position's logits chose the first generated token.
    compare_row(logits.ptr<float>() + static_cast<int64_t>(row - 1) * V, gen_logits[s].ptr<float>(), V, opts.tie_margin,
                &dec[s]);
  }
  // Teacher-forced decode: feed the reference's greedy tokens, compare the next logits.
  auto gen_id = [&](size_t s, int i) { return static_cast<int32_t>(read_as_i64(gen_ids[s], i)); };
  int max_new = 0;
  for (const auto& c : cases) max_new = std::max(max_new, c.new_tokens);
  for (int i = 1; i < max_new; ++i) {
    StepBatch step;
    step.seq_pages = pages;
    std::vector<size_t> in_step;
    for (size_t s = 0; s < cases.size(); ++s) {
      if (i >= cases[s].new_tokens) continue;
      step.logit_rows.push_back(step.num_tokens());
      step.token_ids.push_back(gen_id(s, i - 1));
      step.positions.push_back(static_cast<int32_t>(cases[s].prompt.size()) + i - 1);
      step.token_seq.push_back(static_cast<int32_t>(s));
      step.token_slot.push_back(cases[s].adapter.empty() ? -1 : slot_of.at(cases[s].adapter));
      in_step.push_back(s);
    }
    Tensor out = runner->forward(step);
    for (size_t r = 0; r < in_step.size(); ++r) {
      const size_t s = in_step[r];
      compare_row(out.ptr<float>() + static_cast<int64_t>(r) * V, gen_logits[s].ptr<float>() + static_cast<int64_t>(i) * V,
                  V, opts.tie_margin, &dec[s]);
    }
  }
  CheckpointResult ckr;
  ckr.model = model_name + "/" + tag;
  std::vector<double> all_rels;
  for (size_t s = 0; s < cases.size(); ++s) {
    CaseResult r;
    r.model = model_name + "/" + tag;
    r.case_id = cases[s].label;
    r.adapter = cases[s].adapter;
    r.prompt_len = static_cast<int>(cases[s].prompt.size());
    r.prefill_rel = pre[s].worst_rel;
    r.decode_rel = dec[s].worst_rel;
    r.top1_match = pre[s].top1_match + dec[s].top1_match;
    r.top1_rows = pre[s].top1_rows + dec[s].top1_rows;
    std::vector<double> rels = pre[s].rels;
    rels.insert(rels.end(), dec[s].rels.begin(), dec[s].rels.end());
    r.rows = static_cast<int>(rels.size());
    for (double e : rels) r.rows_within += e <= opts.max_rel_error;
    r.median_rel = median(rels);
    all_rels.insert(all_rels.end(), rels.begin(), rels.end());
    const double top1 = r.top1_rows ? static_cast<double>(r.top1_match) / r.top1_rows : 1.0;
    r.passed = opts.exact ? r.rows_within == r.rows && r.top1_match == r.top1_rows
                          : r.median_rel <= opts.case_max_median && top1 >= opts.case_min_top1;
    ckr.rows += r.rows;
    ckr.rows_within += r.rows_within;
    ckr.top1_match += r.top1_match;
    ckr.top1_rows += r.top1_rows;
    summary->cases.push_back(r);
    (r.passed ? summary->passed : summary->failed)++;
    summary->worst_rel = std::max({summary->worst_rel, r.prefill_rel, r.decode_rel});
    summary->top1_match += r.top1_match;
    summary->top1_rows += r.top1_rows;
    if (on_case) on_case(r);
  }
  ckr.median_rel = median(all_rels);
  ckr.passed = opts.exact ? ckr.rows_within == ckr.rows && ckr.top1_match == ckr.top1_rows
                          : ckr.median_rel <= opts.ckpt_max_median && ckr.top1_match >= opts.ckpt_min_top1 * ckr.top1_rows;
  if (!ckr.passed) summary->failed++;  // a checkpoint below its aggregate bounds is a failure too
  summary->checkpoints.push_back(ckr);
  if (on_checkpoint) on_checkpoint(ckr);
  return {};
}

Status verify_model_folder(const fs::path& folder, const std::string& name,
                           const std::function<std::unique_ptr<Backend>()>& make_backend, const VerifyOptions& opts,
                           VerifySummary* summary, const std::function<void(const CaseResult&)>& on_case,
                           const std::function<void(const CheckpointResult&)>& on_checkpoint) {
  const std::string path = (folder / "cases.json").string();
  MOELORA_ASSIGN_OR_RETURN(std::string text, read_text_file(path));
  MOELORA_ASSIGN_OR_RETURN(Json j, parse_json_strict(text, path));
  auto cks = j.find("checkpoints");
  if (cks == j.end() || !cks->is_object()) return invalid_argument("{}: no \"checkpoints\" object", path);
  for (auto it = cks->begin(); it != cks->end(); ++it) {
    auto backend = make_backend();
    Status s = verify_checkpoint(folder, name, it.key(), it.value(), j, *backend, opts, summary, on_case, on_checkpoint);
    if (!s.ok()) return s.with_context(fmt::format("{} ({}): ", name, it.key()));
  }
  return {};
}

}  // namespace

Result<VerifySummary> verify_fixtures(const std::string& root, const std::function<std::unique_ptr<Backend>()>& make_backend,
                                      const VerifyOptions& opts, const std::function<void(const CaseResult&)>& on_case,
                                      const std::function<void(const CheckpointResult&)>& on_checkpoint) {
  VerifySummary summary;
  const fs::path r(root);
  std::error_code ec;
  if (fs::exists(r / "cases.json", ec)) {
    MOELORA_RETURN_IF_ERROR(verify_model_folder(r, r.filename().string(), make_backend, opts, &summary, on_case, on_checkpoint));
    return summary;
  }
  const std::string manifest = (r / "manifest.json").string();
  if (!fs::exists(manifest, ec)) return not_found("{} has neither cases.json nor manifest.json", root);
  MOELORA_ASSIGN_OR_RETURN(std::string text, read_text_file(manifest));
  MOELORA_ASSIGN_OR_RETURN(Json j, parse_json_strict(text, manifest));
  auto models = j.find("models");
  if (models == j.end() || !models->is_object()) return invalid_argument("{}: no \"models\" object", manifest);
  for (auto it = models->begin(); it != models->end(); ++it)
    MOELORA_RETURN_IF_ERROR(
        verify_model_folder(r / it.value().get<std::string>(), it.key(), make_backend, opts, &summary, on_case,
                            on_checkpoint));
  return summary;
}

}  // namespace moelora
