// CudaBackend, part 2: the ops of a forward pass, each mapped onto kernels/*.cu launches on the
// main stream (MoE LoRA on the side stream when overlap is on). Plans that depend only on the
// step's batch (LoRA grouping, attention splits) are made once per step and reused by every layer.
#include <cuda_bf16.h>

#include <algorithm>

#include <fmt/format.h>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_backend_internal.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/device_info.h"
#include "backends/cuda/kernels/attention.cuh"
#include "backends/cuda/kernels/dense_gemm.cuh"
#include "backends/cuda/kernels/dense_lora_epilogue.cuh"
#include "backends/cuda/kernels/elementwise.cuh"
#include "backends/cuda/kernels/lora_dense.cuh"
#include "backends/cuda/kernels/mla_attention.cuh"
#include "backends/cuda/kernels/moe_forward.cuh"
#include "backends/cuda/kernels/router.cuh"
#include "backends/cuda_plan/dense_choices.h"

namespace moelora {

namespace {

using bf16 = __nv_bfloat16;

bf16* act(const Tensor& t) {
  MOELORA_CHECK_MSG(t.dtype() == DType::kBF16 && t.device() == Device::kCuda, "expected a bf16 device tensor, got {} {}",
                    dtype_name(t.dtype()), t.shape_string());
  return static_cast<bf16*>(t.data());
}

cuda::DenseWeight dense_weight(const LinearWeight& w) {
  cuda::DenseWeight d;
  d.w = w.w.data();
  // upload_linear: FP8 stays F8, NVFP4 kept 4-bit is U8 codes, everything else bf16.
  d.type = w.w.dtype() == DType::kF8E4M3 ? cuda::WeightType::kFP8E4M3
           : w.w.dtype() == DType::kU8   ? cuda::WeightType::kNvfp4
                                         : cuda::WeightType::kBF16;
  d.out = w.out;
  d.in = w.in;
  d.scale_inv = w.scale_inv.defined() ? w.scale_inv.ptr<float>() : nullptr;
  d.block_out = w.block_out;
  d.block_in = w.block_in;
  d.split_rows = w.split_rows;
  if (d.type == cuda::WeightType::kNvfp4) {
    d.group_scale = w.group_scale.ptr<uint8_t>();
    d.global_scale = w.global_scale.ptr<float>();
  }
  return d;
}

// One projection's LoRA as the dense-LoRA kernels see it.
cuda::LoraProblem lora_problem(const Tensor& x, bf16* y, int64_t ld_y, const LoraModuleTable& t) {
  cuda::LoraProblem pr;
  pr.x = act(x);
  pr.ld_x = x.ld();
  pr.y = y;
  pr.ld_y = ld_y;
  pr.in = t.in;
  pr.out = t.out;
  pr.num_slots = t.num_slots;
  pr.a_ptrs = t.a_ptrs.ptr<int64_t>();
  pr.b_ptrs = t.b_ptrs.ptr<int64_t>();
  pr.ranks = t.ranks.ptr<int32_t>();
  pr.host_rank = t.host_rank.data();
  return pr;
}

}  // namespace

void CudaBackend::embed(const Tensor& table, Tensor out) {
  cuda::EmbedParams p;
  p.table = act(table);
  p.vocab = table.dim(0);
  p.hidden = static_cast<int>(table.dim(1));
  p.ids = meta_->token_ids;
  p.T = batch_.num_tokens();
  p.out = act(out);
  p.ld_out = out.ld();
  cuda::launch_embed(p, main_);
}

namespace {
cuda::RmsNormParams rmsnorm_params(const Tensor& x, const Tensor& w, float eps, Tensor out) {
  cuda::RmsNormParams p;
  p.x = act(x);
  p.ld_x = x.ld();
  p.w = act(w);
  p.group = static_cast<int>(w.numel());
  p.cols = static_cast<int>(x.cols());
  p.T = static_cast<int>(x.rows());
  p.eps = eps;
  p.out = act(out);
  p.ld_out = out.ld();
  return p;
}
}  // namespace

void CudaBackend::rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor out) {
  cuda::launch_rmsnorm(rmsnorm_params(x, w, eps, out), main_);
}

// One launch: the residual add's rounded sum is written back to inout and normalised into out
// (elementwise.cuh: bit for bit add() then rmsnorm()).
void CudaBackend::add_rmsnorm(const Tensor& x, Tensor inout, const Tensor& w, float eps, Tensor out) {
  MOELORA_CHECK_MSG(x.rows() == inout.rows() && x.cols() == inout.cols() && out.rows() == inout.rows() &&
                        out.cols() == inout.cols(),
                    "add_rmsnorm: x {} inout {} out {}", x.shape_string(), inout.shape_string(), out.shape_string());
  cuda::RmsNormParams p = rmsnorm_params(inout, w, eps, out);
  p.add = act(x);
  p.ld_add = x.ld();
  p.sum = act(inout);
  p.ld_sum = inout.ld();
  cuda::launch_rmsnorm(p, main_);
}

void CudaBackend::linear(const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora, Tensor out) {
  if (lora != nullptr && linear_lora_in_gemm(x, w, {{0, w.out, lora}}, out)) return;
  base_linear(x, w, out);
  if (lora != nullptr) add_lora(x, {{out, lora}});
}

// The parts' LoRA deltas go in one launch of the segmented kernel (it takes up to kLoraMaxProblems
// projections of one input): q,k,v at one token measured 9.7 us in one launch against 22.1 us in
// three (bench/RESULTS.md, dense multi-LoRA).
void CudaBackend::linear_parts(const Tensor& x, const LinearWeight& w, const std::vector<LinearPart>& parts,
                               Tensor out) {
  if (linear_lora_in_gemm(x, w, parts, out)) return;
  base_linear(x, w, out);
  std::vector<LoraOutput> outs;
  for (const LinearPart& p : parts) {
    MOELORA_CHECK_MSG(p.begin >= 0 && p.out > 0 && p.begin + p.out <= w.out, "linear_parts: part [{}, +{}) of {}",
                      p.begin, p.out, w.out);
    if (p.lora != nullptr) outs.push_back({out.slice_cols(p.begin, p.out), p.lora});
  }
  MOELORA_CHECK(static_cast<int>(outs.size()) <= cuda::kLoraMaxProblems);
  if (!outs.empty()) add_lora(x, outs);
}

CudaBackend::StepLora CudaBackend::step_lora(const std::vector<const std::vector<int>*>& ranks) const {
  StepLora use;
  if (mode_ == StepMode::kCapture) {  // a replay may bring any adapter, up to the rank ceiling
    use.any = lora_active_;
    use.max_rank = lora_rank_ceiling_;
    return use;
  }
  for (const std::vector<int>* r : ranks) {
    const int n = static_cast<int>(r->size());
    for (int32_t s : batch_.token_slot) use.any = use.any || (s >= 0 && s < n && (*r)[s] > 0);
    for (int x : *r) use.max_rank = std::max(use.max_rank, x);
  }
  return use;
}

// CudaBackendOptions::dense_lora_in_gemm: the parts' LoRA inside the small-M GEMM (a shrink launch,
// then the GEMM adds u . B in its epilogue; kernels/dense_lora_epilogue.cuh) instead of the GEMM and
// then the segmented kernel. Decode-sized steps on the small-M path only; false (nothing launched)
// where it does not apply, and the caller runs the usual two launches.
bool CudaBackend::linear_lora_in_gemm(const Tensor& x, const LinearWeight& w, const std::vector<LinearPart>& parts,
                                      Tensor out) {
  constexpr int kMaxTokens = 8;  // the shrink's CUDA-core MACs grow with the tokens (dense_lora_epilogue.cuh)
  const int M = static_cast<int>(x.rows());
  if (!opts_.dense_lora_in_gemm || M == 0 || M > kMaxTokens || out.dtype() != DType::kBF16) return false;
  const cuda::DenseWeight dw = dense_weight(w);
  if (cuda::dense_path(M, dw.type) != cuda_plan::DensePath::kSmallM) return false;
  if (w.in % 8 != 0 || x.ld() % 8 != 0 || (reinterpret_cast<uintptr_t>(act(x)) & 15) != 0) return false;
  std::vector<const LinearPart*> with_lora;
  for (const LinearPart& p : parts)
    if (p.lora != nullptr) with_lora.push_back(&p);
  if (with_lora.empty() || static_cast<int>(with_lora.size()) > cuda::kDenseLoraMaxParts) return false;
  std::vector<const std::vector<int>*> ranks;
  for (const LinearPart* p : with_lora) {
    if (p->lora->num_slots != with_lora[0]->lora->num_slots) return false;
    ranks.push_back(&p->lora->host_rank);
  }
  const StepLora use = step_lora(ranks);
  if (!use.any || use.max_rank > cuda::kDenseLoraMaxRank) return false;
  const int max_rank = std::max(use.max_rank, 1);
  const size_t mark = scratch_mark();
  cuda::DenseLoraEpilogue l;
  l.ldu = max_rank;
  l.M = M;
  l.num_parts = static_cast<int>(with_lora.size());
  l.u = static_cast<float*>(arena_alloc(static_cast<size_t>(l.num_parts) * M * max_rank * sizeof(float)));
  l.token_slot = meta_->token_slot;
  l.num_slots = with_lora[0]->lora->num_slots;
  for (int q = 0; q < l.num_parts; ++q) {
    const LoraModuleTable& t = *with_lora[q]->lora;
    MOELORA_CHECK_MSG(t.in == w.in && t.out == with_lora[q]->out, "LoRA [{} -> {}] on part [{}, +{}) of [{} -> {}]", t.in,
                      t.out, with_lora[q]->begin, with_lora[q]->out, w.in, w.out);
    l.parts[q] = {with_lora[q]->begin, with_lora[q]->out, t.a_ptrs.ptr<int64_t>(), t.b_ptrs.ptr<int64_t>(),
                  t.ranks.ptr<int32_t>()};
  }
  cuda::DenseLoraShrinkParams sp;
  sp.x = act(x);
  sp.ld_x = x.ld();
  sp.in = w.in;
  sp.lora = l;
  sp.max_rank = max_rank;
  sp.pdl = true;
  // The GEMM behind the shrink runs its weight streaming beside it where the shrink launched
  // (CudaBackendOptions::dense_lora_shrink_beside_gemm).
  l.wait_before_epilogue = cuda::launch_dense_lora_shrink(sp, main_) && opts_.dense_lora_shrink_beside_gemm;
  cuda::DenseArgs a;
  a.x = act(x);
  a.ld_x = x.ld();
  a.M = M;
  a.w = dw;
  a.y = act(out);
  a.ld_y = out.ld();
  a.lora = l;
  cuda::dense_linear(*dense_, a, cuda::DenseScratch{}, main_);
  scratch_release(mark);
  return true;
}

void CudaBackend::base_linear(const Tensor& x, const LinearWeight& w, Tensor out) {
  MOELORA_CHECK_MSG(x.cols() == w.in && out.cols() == w.out && x.rows() == out.rows(), "linear: x {} W [{}, {}] out {}",
                    x.shape_string(), w.out, w.in, out.shape_string());
  const int M = static_cast<int>(x.rows());
  cuda::DenseArgs a;
  a.x = act(x);
  a.ld_x = x.ld();
  a.M = M;
  a.w = dense_weight(w);
  if (out.dtype() == DType::kF32) a.y_f32 = out.ptr<float>();
  else a.y = act(out);
  a.ld_y = out.ld();
  cuda::DenseScratch scratch;
  // Scratch for the activation quantisation whenever the heuristic sends FP8 to cuBLASLt (it used
  // to be carved only above the small-M kernel's design limit, 64 tokens, so from 33 to 64 tokens
  // dense_linear found none and fell back to the small-M kernel, which measured 1.2-1.8x slower
  // there: bench/RESULTS.md, dense projection table, M = 64).
  const bool fp8_lt = a.w.type == cuda::WeightType::kFP8E4M3 && cuda::dense_path(M, a.w.type) == cuda_plan::DensePath::kCublasLt;
  // NVFP4 beyond the small-M range: the weight dequantised to bf16 for cuBLASLt.
  const bool nvfp4_lt = a.w.type == cuda::WeightType::kNvfp4 && cuda::dense_path(M, a.w.type) == cuda_plan::DensePath::kCublasLt;
  // The scratch is given back once the launches are queued: everything that reuses it runs after
  // them on the same stream (a DeepSeek dense layer would otherwise hold one 64 MiB NVFP4 pass per
  // projection until the layer ends).
  const size_t mark = scratch_mark();
  if (fp8_lt || nvfp4_lt) {
    scratch.bytes = fp8_lt ? cuda::dense_fp8_scratch_bytes(M, w.in) : cuda::dense_nvfp4_scratch_bytes(w.out, w.in);
    scratch.ptr = arena_alloc(scratch.bytes);
  }
  cuda::dense_linear(*dense_, a, scratch, main_);
  scratch_release(mark);
}

// Every output's y += its per-token LoRA delta (y: a projection's output, or a column slice of it).
void CudaBackend::add_lora(const Tensor& x, const std::vector<LoraOutput>& outs) {
  const int M = static_cast<int>(x.rows());
  if (M == 0 || outs.empty()) return;
  for (const LoraOutput& o : outs)
    MOELORA_CHECK_MSG(o.y.dtype() == DType::kBF16 && o.y.rows() == M && o.y.cols() == o.table->out &&
                          x.cols() == o.table->in && o.table->num_slots == outs[0].table->num_slots,
                      "LoRA [{} -> {}] on x {} into {}", o.table->in, o.table->out, x.shape_string(),
                      o.y.shape_string());
  if (mode_ == StepMode::kCapture) {
    if (lora_active_) capture_lora(x, outs);
    return;
  }
  // Only the projections that some token of the step uses with a non-zero rank.
  std::vector<cuda::LoraProblem> prs;
  std::string key;
  for (const LoraOutput& o : outs) {
    bool any = false;
    for (int32_t s : batch_.token_slot) any = any || (s >= 0 && o.table->host_rank[s] > 0);
    if (!any) continue;
    prs.push_back(lora_problem(x, act(o.y), o.y.ld(), *o.table));
    key += fmt::format("{}x{}:{};", o.table->in, o.table->out, fmt::join(o.table->host_rank, ","));
  }
  if (prs.empty()) return;
  const int n = static_cast<int>(prs.size());
  auto it = meta_->lora_plans.find(key);
  if (it == meta_->lora_plans.end()) {
    StepMeta::PlannedLora pl;
    pl.plan = cuda::lora_plan(batch_.token_slot.data(), M, prs.data(), n);
    const size_t bytes = cuda::lora_meta_bytes(pl.plan.capacity, M);
    pl.dev_meta = meta_->plan_alloc(bytes);
    cuda::lora_upload_plan(pl.plan, pl.dev_meta, bytes, main_);
    it = meta_->lora_plans.emplace(key, std::move(pl)).first;
  }
  cuda::LoraScratch ls;
  ls.bytes = cuda::lora_single_scratch_bytes(M, prs.data(), n);
  ls.ptr = arena_alloc(ls.bytes);
  cuda::lora_run(*lora_, prs.data(), n, it->second.plan, it->second.dev_meta, ls, main_);
}

// Inside a capture: the segmented kernel over a fixed number of work items, its plan written to
// a recipe address before every launch of the graph (see cuda_graphs.cu).
void CudaBackend::capture_lora(const Tensor& x, const std::vector<LoraOutput>& outs) {
  const int M = static_cast<int>(x.rows());
  std::vector<cuda::LoraProblem> prs;
  LoraRecipe recipe;
  for (const LoraOutput& o : outs) {
    prs.push_back(lora_problem(x, act(o.y), o.y.ld(), *o.table));
    recipe.tables.push_back(o.table);
  }
  const int n = static_cast<int>(prs.size());
  recipe.capacity = cuda::lora_max_items(M, outs[0].table->num_slots, n);
  cuda::LoraPlanOptions po;
  po.single_adapter_gemm = false;
  cuda::LoraPlan plan = cuda::lora_plan(batch_.token_slot.data(), M, prs.data(), n, po, recipe.capacity);
  recipe.bytes = cuda::lora_meta_bytes(recipe.capacity, M);
  recipe.dev_meta = meta_->plan_alloc(recipe.bytes);
  capture_recipes_.push_back(recipe);
  cuda::LoraScratch none;
  cuda::lora_run(*lora_, prs.data(), n, plan, recipe.dev_meta, none, main_, recipe.capacity);
}

cuda::RopeParams CudaBackend::rope_params(Tensor x, int heads, int head_stride, int rot_offset, const RopeTable& rope) {
  cuda::RopeParams p;
  p.x = act(x);
  p.ld_x = x.ld();
  p.T = static_cast<int>(x.rows());
  p.positions = meta_->positions;
  p.heads = heads;
  p.head_stride = head_stride;
  p.rot_offset = rot_offset;
  p.rot_dim = rope.rot_dim;
  p.interleaved = rope.interleaved;
  p.inv_freq = device_inv_freq(rope);
  p.attention_factor = rope.attention_factor;
  return p;
}

void CudaBackend::rope(Tensor x, int heads, int head_stride, int rot_offset, const RopeTable& rope) {
  cuda::launch_rope(rope_params(x, heads, head_stride, rot_offset, rope), main_);
}

cuda::HeadNormRopeParams CudaBackend::head_norm_rope_params(Tensor x, int q_heads, int kv_heads, int head_dim,
                                                           const Tensor& q_norm, const Tensor& k_norm, float eps,
                                                           const RopeTable& rope) {
  MOELORA_CHECK_MSG(x.cols() == int64_t{q_heads + kv_heads} * head_dim && q_norm.numel() == head_dim &&
                        k_norm.numel() == head_dim,
                    "head_norm_rope: x {} for {} + {} heads of {}", x.shape_string(), q_heads, kv_heads, head_dim);
  cuda::HeadNormRopeParams p;
  p.x = act(x);
  p.ld_x = x.ld();
  p.T = static_cast<int>(x.rows());
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.q_norm = act(q_norm);
  p.k_norm = act(k_norm);
  p.eps = eps;
  p.positions = meta_->positions;
  p.inv_freq = device_inv_freq(rope);
  p.attention_factor = rope.attention_factor;
  return p;
}

// One launch where the head fits a warp's registers and the rotation covers it (Qwen3); otherwise
// the three calls it stands for.
void CudaBackend::head_norm_rope(Tensor x, int q_heads, int kv_heads, int head_dim, const Tensor& q_norm,
                                 const Tensor& k_norm, float eps, const RopeTable& rope) {
  if (!cuda::head_norm_rope_supported(head_dim, rope.rot_dim, rope.interleaved))
    return Backend::head_norm_rope(x, q_heads, kv_heads, head_dim, q_norm, k_norm, eps, rope);
  cuda::launch_head_norm_rope(head_norm_rope_params(x, q_heads, kv_heads, head_dim, q_norm, k_norm, eps, rope), main_);
}

// The cache write moves into the rotation's launch (CudaBackendOptions::kv_write_in_head_pass):
// Qwen3's head norm + RoPE where that is one launch, or RoPE alone over whole heads (Mixtral), with
// the cache's heads the projection's (k and v head dims both head_dim): one launch fewer per layer
// (the KV write kernel), the same bits in the cache and in the output.
void CudaBackend::rotary_attention(Tensor q_and_k, const Tensor& v, int heads, int kv_heads, int head_dim,
                                   const Tensor& q_norm, const Tensor& k_norm, float eps, const RopeTable& rope,
                                   KvLayer& kv, float scale, Tensor out) {
  const Tensor q = q_and_k.slice_cols(0, int64_t{heads} * head_dim);
  const Tensor k = q_and_k.slice_cols(int64_t{heads} * head_dim, int64_t{kv_heads} * head_dim);
  MOELORA_CHECK_MSG(q_and_k.cols() == int64_t{heads + kv_heads} * head_dim, "rotary_attention: q|k {} for {} + {} heads of {}",
                    q_and_k.shape_string(), heads, kv_heads, head_dim);
  const bool norms = q_norm.defined();
  const bool fused_pass = norms ? cuda::head_norm_rope_supported(head_dim, rope.rot_dim, rope.interleaved)
                                : rope.rot_dim == head_dim;
  if (!opts_.kv_write_in_head_pass || !fused_pass || kv.k_head_dim != head_dim || kv.v_head_dim != head_dim ||
      kv.kv_heads != kv_heads || v.cols() != int64_t{kv_heads} * head_dim || v.dtype() != DType::kBF16)
    return Backend::rotary_attention(q_and_k, v, heads, kv_heads, head_dim, q_norm, k_norm, eps, rope, kv, scale, out);
  cuda::KvCacheWrite w;
  w.k_cache = act(kv.k);
  w.v_cache = act(kv.v);
  w.v = act(v);
  w.ld_v = v.ld();
  w.page_size = kv.page_size;
  w.token_seq = meta_->token_seq;
  w.page_indptr = meta_->page_indptr;
  w.page_indices = meta_->page_indices;
  if (norms) {
    cuda::HeadNormRopeParams p = head_norm_rope_params(q_and_k, heads, kv_heads, head_dim, q_norm, k_norm, eps, rope);
    p.cache = w;
    cuda::launch_head_norm_rope(p, main_);
  } else {
    cuda::RopeParams p = rope_params(q_and_k, heads + kv_heads, head_dim, 0, rope);
    p.kv_first_head = heads;
    p.cache = w;
    cuda::launch_rope(p, main_);
  }
  run_attention(q, k, v, kv, heads, scale, out, false);
}

void CudaBackend::attention(const Tensor& q, const Tensor& k, const Tensor& v, KvLayer& kv, int heads, float scale,
                            Tensor out) {
  run_attention(q, k, v, kv, heads, scale, out, true);
}

void CudaBackend::run_attention(const Tensor& q, const Tensor& k, const Tensor& v, KvLayer& kv, int heads, float scale,
                                Tensor out, bool write_cache) {
  MOELORA_CHECK_MSG(cuda_plan::attention_head_dims_supported(kv.k_head_dim, kv.v_head_dim),
                    "the CUDA attention kernels do not support head dims (k {}, v {})", kv.k_head_dim, kv.v_head_dim);
  const int T = static_cast<int>(q.rows());
  if (!attn_planned_) {  // same for every layer of the step
    static const int sms = cuda::query_device().num_sms;
    cuda::AttentionPlanOptions o;
    o.num_sms = sms;
    if (mode_ == StepMode::kCapture) {  // a fixed grid for every replay of this graph
      o.force_mode = 1;
      o.max_positions = kGraphMaxPositions;
    }
    *attn_plan_ = cuda::attention_plan(batch_.positions.data(), batch_.token_seq.data(), T, heads, kv.kv_heads,
                                      kv.k_head_dim, kv.v_head_dim, o);
    attn_meta_bytes_ = cuda::attention_meta_bytes(*attn_plan_);
    attn_meta_ = attn_meta_bytes_ ? meta_->plan_alloc(attn_meta_bytes_) : nullptr;
    MOELORA_CHECK_MSG(attn_meta_bytes_ == 0 || mode_ != StepMode::kCapture, "decode attention plans carry no metadata");
    if (attn_meta_bytes_) cuda::attention_upload_plan(*attn_plan_, attn_meta_, attn_meta_bytes_, main_);
    attn_planned_ = true;
  }
  cuda::AttentionParams p;
  p.q = act(q);
  p.ld_q = q.ld();
  p.k = act(k);
  p.ld_k = k.ld();
  p.v = act(v);
  p.ld_v = v.ld();
  p.out = act(out);
  p.ld_out = out.ld();
  p.T = T;
  p.heads = heads;
  p.scale = scale;
  p.k_cache = act(kv.k);
  p.v_cache = act(kv.v);
  p.page_size = kv.page_size;
  p.kv_heads = kv.kv_heads;
  p.k_head_dim = kv.k_head_dim;
  p.v_head_dim = kv.v_head_dim;
  p.positions = meta_->positions;
  p.token_seq = meta_->token_seq;
  p.page_indptr = meta_->page_indptr;
  p.page_indices = meta_->page_indices;
  const size_t ws = cuda::attention_workspace_bytes(*attn_plan_, T, heads, kv.v_head_dim);
  void* w = ws ? arena_alloc(ws) : nullptr;
  if (write_cache) cuda::launch_kv_cache_write(p, main_);
  cuda::launch_attention_no_cache_write(p, *attn_plan_, attn_meta_, w, ws, main_);
}

void CudaBackend::silu_mul(const Tensor& gate, const Tensor& up, Tensor out) {
  cuda::SiluMulParams p;
  p.gate = act(gate);
  p.ld_gate = gate.ld();
  p.up = act(up);
  p.ld_up = up.ld();
  p.T = static_cast<int>(gate.rows());
  p.cols = static_cast<int>(gate.cols());
  p.out = act(out);
  p.ld_out = out.ld();
  cuda::launch_silu_mul(p, main_);
}

void CudaBackend::add(const Tensor& x, Tensor inout) {
  cuda::AddParams p;
  p.x = act(x);
  p.ld_x = x.ld();
  p.inout = act(inout);
  p.ld_inout = inout.ld();
  p.T = static_cast<int>(x.rows());
  p.cols = static_cast<int>(x.cols());
  cuda::launch_add(p, main_);
}

void CudaBackend::router_logits(const Tensor& x, const LinearWeight& gate, Tensor out) {
  linear(x, gate, nullptr, out);  // out is f32: dense_linear writes f32 logits
}

// Routing is recorded here and run by the moe() that consumes these ids and weights, together with
// the layer's alignment: moe_forward routes inside moe_align at small batches (one launch less per
// MoE layer, cuda_plan::choose_moe_tuning's fuse_route) and launches the router kernel itself
// otherwise. Nothing reads the ids in between in a forward pass; flush_route() runs a recorded
// routing on its own wherever something else might (another routing, a host copy, the step's end).
void CudaBackend::topk_softmax(const Tensor& logits, int k, bool renormalize, Tensor ids, Tensor weights) {
  cuda::RouterParams p;
  p.logits = logits.ptr<float>();
  p.T = static_cast<int>(logits.rows());
  p.E = static_cast<int>(logits.cols());
  p.k = k;
  p.mode = cuda::RouterMode::kSoftmax;
  p.renormalize = renormalize;
  p.ids = ids.ptr<int32_t>();
  p.weights = weights.ptr<float>();
  defer_route(p);
}

void CudaBackend::topk_sigmoid_grouped(const Tensor& logits, const Tensor& bias, int k, int n_group, int topk_group,
                                       bool renormalize, float scaling, Tensor ids, Tensor weights) {
  cuda::RouterParams p;
  p.logits = logits.ptr<float>();
  p.bias = bias.ptr<float>();
  p.T = static_cast<int>(logits.rows());
  p.E = static_cast<int>(logits.cols());
  p.k = k;
  p.mode = cuda::RouterMode::kSigmoidGrouped;
  p.renormalize = renormalize;
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.scaling = scaling;
  p.ids = ids.ptr<int32_t>();
  p.weights = weights.ptr<float>();
  defer_route(p);
}

void CudaBackend::defer_route(const cuda::RouterParams& p) {
  flush_route();
  pending_route_ = p;
  route_pending_ = true;
}

void CudaBackend::flush_route() {
  if (!route_pending_) return;
  route_pending_ = false;
  cuda::router_topk(pending_route_, main_);
}

void CudaBackend::moe(const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts,
                      const MoeLoraTable* lora, Tensor out) {
  const int T = static_cast<int>(x.rows());
  cuda::MoeForwardArgs a;
  a.T = T;
  a.x = act(x);
  a.ldx = x.ld();
  a.ids = ids.ptr<int32_t>();
  a.weights = weights.ptr<float>();
  const DType wdt = experts.gate_up.w.dtype();  // upload_experts: F8 FP8, U8 NVFP4 codes, else bf16
  a.wtype = wdt == DType::kF8E4M3 ? cuda::MoeWeightType::kFp8
            : wdt == DType::kU8   ? cuda::MoeWeightType::kNvfp4
                                  : cuda::MoeWeightType::kBf16;
  a.w_gate_up = experts.gate_up.w.data();
  a.s_gate_up = experts.gate_up.scale_inv.defined() ? experts.gate_up.scale_inv.ptr<float>() : nullptr;
  a.w_down = experts.down.w.data();
  a.s_down = experts.down.scale_inv.defined() ? experts.down.scale_inv.ptr<float>() : nullptr;
  if (a.wtype == cuda::MoeWeightType::kNvfp4) {
    a.group_scale_gate_up = experts.gate_up.group_scale.ptr<uint8_t>();
    a.global_scale_gate_up = experts.gate_up.global_scale.ptr<float>();
    a.group_scale_down = experts.down.group_scale.ptr<uint8_t>();
    a.global_scale_down = experts.down.global_scale.ptr<float>();
  }
  a.shape = {T, static_cast<int>(ids.cols()), experts.num_experts, experts.hidden, experts.intermediate};
  a.out = act(out);
  a.ldo = out.ld();
  a.allow_fp8_activations = opts_.moe_fp8_activations;
  // The routing recorded for these ids runs inside moe_forward (with moe_align at small batches).
  if (route_pending_ && pending_route_.ids == a.ids && pending_route_.weights == a.weights && pending_route_.T == T &&
      pending_route_.k == static_cast<int>(ids.cols())) {
    route_pending_ = false;
    a.logits = pending_route_.logits;
    a.router = pending_route_;
  } else {
    flush_route();
  }
  // The kernels for this batch, chosen once here so that the workspace carves only the e4m3
  // activation buffers that regime reads (at a prefill chunk they are ~0.1 GB of arena).
  a.tuning = cuda::moe_tuning(a);
  if (!opts_.moe_lora_shrink_beside_gemm) a.tuning->lora_shrink_beside_gemm = false;
  a.shape.fp8_activations = a.tuning->act_fp8;
  a.shape.fp8_split = a.tuning->act_split && a.tuning->wgmma;
  // LoRA only when some token of the step uses a slot with expert LoRA here.
  cuda::MoeLoraDevice dev;
  cuda::MoeLoraShape lshape;
  if (lora) {
    const StepLora use = step_lora({&lora->host_gu_rank, &lora->host_d_rank});
    const bool any = use.any;
    const int max_rank = use.max_rank;
    if (any) {
      dev.num_slots = lora->num_slots;
      dev.max_rank = max_rank;
      dev.gu_a = {lora->gu_a.ptr<int64_t>(), lora->gu_a_expert_stride.ptr<int64_t>(), lora->gu_rank.ptr<int32_t>()};
      dev.gu_b = {lora->gu_b.ptr<int64_t>(), lora->gu_b_expert_stride.ptr<int64_t>(), lora->gu_rank.ptr<int32_t>()};
      dev.d_a = {lora->d_a.ptr<int64_t>(), lora->d_a_expert_stride.ptr<int64_t>(), lora->d_rank.ptr<int32_t>()};
      dev.d_b = {lora->d_b.ptr<int64_t>(), lora->d_b_expert_stride.ptr<int64_t>(), lora->d_rank.ptr<int32_t>()};
      lshape = {lora->num_slots, max_rank};
      a.lora = &dev;
      a.token_slot = meta_->token_slot;
    }
  }
  const size_t bytes = cuda::moe_workspace_bytes(a.shape, a.lora ? &lshape : nullptr);
  cuda::MoeWorkspace ws = cuda::moe_workspace_carve(arena_alloc(bytes), a.shape, a.lora ? &lshape : nullptr);
  cuda::MoeStreams st;
  st.main = main_;
  if (a.lora && opts_.overlap) {
    st.side = side_;
    st.ev_ids = ev_ids_;
    st.ev_gu = ev_gu_;
    st.ev_act = ev_act_;
    st.ev_d = ev_d_;
  }
  cuda::moe_forward(a, ws, st);
}

void CudaBackend::gather_logit_rows(const Tensor& x, Tensor out) {
  cuda::GatherRowsParams p;
  p.x = x.data();
  p.ld_x = x.ld();
  p.rows = meta_->logit_rows;
  p.R = static_cast<int>(batch_.logit_rows.size());
  p.cols = static_cast<int>(x.cols());
  p.elem_bytes = static_cast<int>(dtype_size(x.dtype()));
  p.out = out.data();
  p.ld_out = out.ld();
  cuda::launch_gather_rows(p, main_);
}

void CudaBackend::mla_split_kv(const Tensor& kv, const Tensor& k_pe, int heads, int nope, int v_dim, Tensor k,
                               Tensor v) {
  cuda::MlaSplitKvParams p;
  p.kv = act(kv);
  p.ld_kv = kv.ld();
  p.k_pe = act(k_pe);
  p.ld_k_pe = k_pe.ld();
  p.T = static_cast<int>(kv.rows());
  p.heads = heads;
  p.nope = nope;
  p.rope = static_cast<int>(k_pe.cols());
  p.v_dim = v_dim;
  p.k = act(k);
  p.ld_k = k.ld();
  p.v = act(v);
  p.ld_v = v.ld();
  cuda::launch_mla_split_kv(p, main_);
}

// ---- DeepSeek MLA, absorbed form.

const CudaBackend::MlaAbsorbedWeights& CudaBackend::mla_absorbed_weights(const LinearWeight& kv_b, int heads,
                                                                        int nope, int v_dim) {
  auto it = mla_weights_.find(kv_b.w.data());
  if (it != mla_weights_.end()) {
    const MlaAbsorbedWeights& w = it->second;
    MOELORA_CHECK_MSG(w.heads == heads && w.nope == nope && w.v_dim == v_dim,
                      "absorbed MLA: kv_b used as {} heads x ({} + {}), prepared as {} x ({} + {})", heads, nope, v_dim,
                      w.heads, w.nope, w.v_dim);
    return w;
  }
  // The copy is made once, outside any capture: a capture cannot allocate (and always follows an
  // eager step of the same shape, which made it).
  MOELORA_CHECK_MSG(mode_ != StepMode::kCapture, "absorbed MLA: kv_b first seen inside a CUDA-graph capture");
  const bool fp8 = kv_b.w.dtype() == DType::kF8E4M3, nvfp4 = kv_b.w.dtype() == DType::kU8;
  MOELORA_CHECK_MSG(fp8 || nvfp4 || kv_b.w.dtype() == DType::kBF16, "absorbed MLA: kv_b of {}",
                    dtype_name(kv_b.w.dtype()));
  MOELORA_CHECK_MSG(kv_b.w.contiguous() && (!fp8 || kv_b.scale_inv.defined()), "absorbed MLA: kv_b {} {}",
                    kv_b.w.shape_string(), fp8 ? "without its scales" : "");
  const int R = kv_b.in;
  // Not device_tensor: its zeroing memset runs on the legacy stream, which the non-blocking main
  // stream does not wait for, and the conversion below writes every element anyway.
  auto bf16_tensor = [](std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    void* p = nullptr;
    MOELORA_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(16, static_cast<size_t>(n) * 2)));
    std::shared_ptr<void> owner(p, [](void* q) { cudaFree(q); });
    return Tensor(p, DType::kBF16, shape, Device::kCuda, std::move(owner));
  };
  MlaAbsorbedWeights w;
  w.source = kv_b.w;
  w.heads = heads, w.nope = nope, w.v_dim = v_dim;
  w.w_uk_t = bf16_tensor({heads, R, nope});
  w.w_uv = bf16_tensor({heads, v_dim, R});
  // NVFP4 kv_b (kept 4-bit): its bf16 dequantisation, as a bf16 upload would hold it, feeds the
  // same preparation; freed once the copies exist.
  Tensor kv_b_bf16;
  if (nvfp4) {
    kv_b_bf16 = bf16_tensor({kv_b.out, R});
    cuda::launch_nvfp4_dequant(dense_weight(kv_b), static_cast<bf16*>(kv_b_bf16.data()), main_);
  }
  cuda::MlaWeightPrep prep;
  prep.w = nvfp4 ? kv_b_bf16.data() : kv_b.w.data();
  prep.fp8 = fp8;
  prep.scale_inv = fp8 ? kv_b.scale_inv.ptr<float>() : nullptr;
  prep.block_out = kv_b.block_out;
  prep.block_in = kv_b.block_in;
  prep.split_rows = kv_b.split_rows;
  prep.heads = heads, prep.nope = nope, prep.v_dim = v_dim, prep.R = R;
  prep.w_uk_t = static_cast<bf16*>(w.w_uk_t.data());
  prep.w_uv = static_cast<bf16*>(w.w_uv.data());
  cuda::launch_mla_prepare_weights(prep, main_);
  if (nvfp4) MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_));  // before kv_b_bf16 is freed
  return mla_weights_.emplace(kv_b.w.data(), std::move(w)).first->second;
}

void CudaBackend::mla_attention_absorbed(const Tensor& q, const Tensor& latent, const Tensor& k_pe,
                                         const LinearWeight& kv_b, const LoraModuleTable* kv_b_lora, KvLayer& kv,
                                         int heads, int nope, int v_dim, float scale, Tensor out) {
  const int T = static_cast<int>(q.rows()), R = static_cast<int>(latent.cols()), rope = static_cast<int>(k_pe.cols());
  check_mla_absorbed_shapes(batch_.num_tokens(), q, latent, k_pe, kv_b, kv_b_lora, kv, heads, nope, v_dim, out);
  MOELORA_CHECK_MSG(R <= cuda_plan::kMlaMaxLatent && R + rope <= cuda_plan::kMlaMaxLatentWidth,
                    "absorbed MLA: kv_lora_rank {} + rope {} above the kernels' {} latent values and {} per cache row "
                    "(cuda_plan::check_shape_limits refuses such a model at load)",
                    R, rope, cuda_plan::kMlaMaxLatent, cuda_plan::kMlaMaxLatentWidth);
  const MlaAbsorbedWeights& w = mla_absorbed_weights(kv_b, heads, nope, v_dim);
  if (T == 0) return;

  // LoRA, and the widest rank its scratch must hold. A capture serves every later batch of its key:
  // it takes LoRA whenever the batch has an adapter token and the rank ceiling of every placement
  // (a placement above it drops the graphs), as the dense LoRA does.
  int rank_stride = 0;
  if (kv_b_lora) {
    if (mode_ != StepMode::kCapture)
      for (int32_t s : batch_.token_slot)
        MOELORA_CHECK_MSG(s < kv_b_lora->num_slots, "token slot {} outside {} slots", s, kv_b_lora->num_slots);
    const StepLora use = step_lora({&kv_b_lora->host_rank});
    rank_stride = use.any ? use.max_rank : 0;
  }
  static const int sms = cuda::query_device().num_sms;
  cuda_plan::MlaProblem pr;
  pr.tokens = T;
  pr.heads = heads;
  pr.latent = R;
  pr.v_dim = v_dim;
  pr.lora_rank_stride = rank_stride;
  pr.num_sms = sms;
  pr.max_chunk_tokens = opts_.mla_max_pass_tokens;
  // A capture sizes the KV splits for the longest context its replays may bring (the begin_step
  // bound), so the grid stays the same for every replay; an eager step plans with the same bound
  // (or its own longer context), so it runs the splits its graph would: each token divides its
  // context over them on the device (cuda_plan::mla_token_split), and replay gives eager's bits.
  if (mode_ == StepMode::kCapture) {
    pr.max_positions = kGraphMaxPositions;
  } else {
    if (step_max_positions_ == 0) {  // the same for every layer of the step
      step_max_positions_ = 1;
      for (int32_t pos : batch_.positions) step_max_positions_ = std::max(step_max_positions_, pos + 1);
    }
    pr.max_positions = std::max(step_max_positions_, kGraphMaxPositions);
  }
  const cuda_plan::MlaPlan plan = cuda_plan::choose_mla_plan(pr);

  cuda::MlaAbsorbedParams p;
  p.q = act(q);
  p.ld_q = q.ld();
  p.latent = act(latent);
  p.ld_latent = latent.ld();
  p.k_pe = act(k_pe);
  p.ld_k_pe = k_pe.ld();
  p.out = act(out);
  p.ld_out = out.ld();
  p.T = T;
  p.heads = heads;
  p.nope = nope;
  p.rope = rope;
  p.v_dim = v_dim;
  p.R = R;
  p.scale = scale;
  p.w_uk_t = static_cast<const bf16*>(w.w_uk_t.data());
  p.w_uv = static_cast<const bf16*>(w.w_uv.data());
  if (rank_stride > 0) {
    p.lora_a = kv_b_lora->a_ptrs.ptr<int64_t>();
    p.lora_b = kv_b_lora->b_ptrs.ptr<int64_t>();
    p.lora_rank = kv_b_lora->ranks.ptr<int32_t>();
    p.lora_slots = kv_b_lora->num_slots;
    p.lora_rank_stride = rank_stride;
  }
  p.cache = act(kv.k);
  p.page_size = kv.page_size;
  p.positions = meta_->positions;
  p.token_seq = meta_->token_seq;
  p.token_slot = meta_->token_slot;
  p.page_indptr = meta_->page_indptr;
  p.page_indices = meta_->page_indices;
  const size_t bytes = plan.scratch_bytes();
  cuda::launch_mla_absorbed(p, plan, arena_alloc(bytes), bytes, main_);
}

}  // namespace moelora
