// The CUDA backend: the Backend interface on the H200 kernels in kernels/*.cu.
//
// Memory: weights, adapters, KV pages and LoRA pointer tables are cudaMalloc'd once and live as
// long as their tensors; everything a step needs (activations, routing scratch, kernel plans)
// comes from one arena reserved up front and reset by begin_step, so a step allocates nothing
// and, for the same batch shape, gets the same addresses (what CUDA-graph replay needs).
// Formats: activations, KV cache and LoRA factors bf16; FP8 weights stay FP8 (e4m3 + f32 block
// scales); bf16/f16/f32 checkpoint weights become bf16; norms f32 on the host side are uploaded as
// the dtype the loader asks for.
// Streams: the main stream runs the forward pass; MoE LoRA work runs on a side stream created
// with its events at construction (before any capture) and joined by events (kernels/moe_forward).
// Adapter placements copy on a stream of their own from the slot pool's worker thread, into
// stream-ordered pool memory (cuda_lora_placement.h).
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <vector>

#include "backends/cuda/kernels/router.cuh"
#include "ops/backend.h"

namespace moelora::cuda {
class DenseGemmContext;
class LoraContext;
class LoraCopier;
struct AttentionPlan;
struct HeadNormRopeParams;
struct RopeParams;
}  // namespace moelora::cuda

namespace moelora {

struct CudaBackendOptions {
  bool overlap = true;            // MoE LoRA on a side stream
  bool moe_fp8_activations = false;  // FP8 experts may run W8A8 (cuda_plan::MoeProblem)
  bool graphs = true;             // replay captured decode graphs (see CudaGraphCache)
  // First size of the step arena: the engine refits it to its largest step after a warm-up, and
  // a larger eager step grows it (CudaBackend::arena_alloc).
  size_t arena_bytes = 1ull << 30;
  int max_step_tokens = 4096;     // sizes the step metadata buffers; larger steps grow them
  int max_step_seqs = 512;
  // Absorbed MLA: at most this many tokens per pass of its kernels (0 = cuda_plan's choice). Tests
  // set it low to run several passes at small sizes.
  int mla_max_pass_tokens = 0;
  // Dense LoRA inside the small-M projection GEMM (CudaBackend::linear_lora_in_gemm) at decode
  // sizes instead of the GEMM then the segmented LoRA kernel (`--no-dense-lora-in-gemm` turns it
  // off). H100, 2026-12-05 (dev_lora_dense ingemm): q|k|v 0.59-0.71x, o_proj 0.78-0.85x the
  // separate kernels' time up to 8 tokens (1.03x at 8 tokens x 8 adapters on o_proj); decode step
  // with 8 adapters -2.1 % at 1 token and -2.0 % at 8 (bench/RESULTS.md).
  bool dense_lora_in_gemm = true;
  // GQA attention after a fused q|k|v projection (Backend::rotary_attention): this step's k and v
  // go into the KV cache from the rotation's launch (Qwen3's head norm + RoPE, or RoPE alone)
  // instead of a cache-write launch before attention (`--no-kv-write-in-head-pass` turns it off).
  // H100, 2026-12-05: op suite and verify pass with it; decode step -0.2 to -2.3 % at 1 and 8 tokens.
  bool kv_write_in_head_pass = true;
  // A MoE layer's shared experts (DeepSeek) on a stream of their own, beside the routed experts
  // (Backend::concurrently; `--shared-experts-concurrent`). H100, 2026-12-07 (dev_moe_block): faster
  // at every batch, but with LoRA from 64 tokens not bit-identical to the serial form
  // (docs/numerics.md): off until that is understood.
  bool shared_experts_concurrent = false;
  // MoE LoRA: the shrinks on the main stream beside the grouped GEMMs, which wait for them only
  // before their epilogues, where cuda_plan::choose_moe_tuning picks it (MoeTuning::
  // lora_shrink_beside_gemm: up to half a pair per expert; `--no-moe-lora-beside-gemm` turns it off).
  // H100, 2026-12-07: MoE layer with 8 adapters at 1 token 57.2 -> 46.2 us; decode step with 8
  // adapters 5535.8 -> 4986.2 us at 1 token, 9997.1 -> 9696.1 at 8 (bench/RESULTS.md).
  bool moe_lora_shrink_beside_gemm = true;
  // Dense LoRA inside the GEMM (dense_lora_in_gemm): the small-M GEMM launched behind the shrink
  // streams its weights beside it and waits for it only before its epilogue, as the MoE GEMMs do
  // (`--no-dense-lora-beside-gemm` turns it off: the GEMM then waits for the shrink first). H100,
  // 2026-12-07 (dev_attention_block --ab, Qwen3-30B-A3B, 8 adapters): attention block 44.2 -> 40.1 us
  // at 1 token, 57.5 -> 51.3 at 8, the same bits (bench/RESULTS.md).
  bool dense_lora_shrink_beside_gemm = true;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaBackendOptions& opts = {});
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::kCuda; }
  DType act_dtype() const override { return DType::kBF16; }
  // The kernels' limits on model shapes (backends/cuda_plan/shape_limits.h).
  Status check_model_shapes(const ModelShapes& shapes) const override;
  int max_lora_rank() const override;

  Tensor upload(const Tensor& host, DType dtype) override;
  LinearWeight upload_linear(const StoredWeight& w) override;
  size_t upload_bytes(DType dtype, int64_t numel) const override;
  size_t linear_bytes(const StoredWeight& w) const override;
  size_t derived_weight_bytes(const ModelShapes& shapes) const override;
  size_t expert_part_bytes(const StoredWeight& w) const override;
  ExpertWeights upload_experts(const std::vector<StoredWeight>& gate, const std::vector<StoredWeight>& up,
                               const std::vector<StoredWeight>& down) override;
  Tensor random_tensor(DType dtype, const std::vector<int64_t>& shape, uint64_t seed, float scale) override;
  ExpertWeights random_experts(int num_experts, int hidden, int intermediate, const WeightFormat& fmt,
                               uint64_t seed) override;
  LinearWeight random_linear(int out, int in, const WeightFormat& fmt, uint64_t seed) override;
  KvLayer alloc_kv_layer(int num_pages, int page_size, int kv_heads, int k_head_dim, int v_head_dim) override;
  DType lora_dtype() const override { return DType::kBF16; }
  LoraModuleTable alloc_lora_table(int num_slots, int in, int out) override;
  MoeLoraTable alloc_moe_lora_table(int num_slots, int num_experts, int hidden, int intermediate) override;
  void set_lora_slot(LoraModuleTable& t, int slot, const Tensor& a, const Tensor& b, int rank) override;
  void set_moe_lora_slot(MoeLoraTable& t, int slot, const MoeLoraSlot& s) override;
  // Copy stream, pinned staging, pool memory (cuda_lora_placement.h).
  std::unique_ptr<LoraPlacement> begin_lora_placement(int slot, size_t bytes) override;

  const StepBatch& begin_step(const StepBatch& batch) override;
  StepMode step_mode() override { return mode_; }
  void end_step_body(const Tensor& logits) override;
  Tensor step_output() override;
  Tensor alloc(int64_t rows, int64_t cols, DType dtype) override;
  size_t scratch_mark() override { return arena_used_; }
  void scratch_release(size_t mark) override { arena_used_ = mark; }
  void embed(const Tensor& table, Tensor out) override;
  void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor out) override;
  void linear(const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora, Tensor out) override;
  void linear_parts(const Tensor& x, const LinearWeight& w, const std::vector<LinearPart>& parts, Tensor out) override;
  LinearWeight fuse_linear_rows(const std::vector<const LinearWeight*>& parts) override;
  void rope(Tensor x, int heads, int head_stride, int rot_offset, const RopeTable& rope) override;
  void attention(const Tensor& q, const Tensor& k, const Tensor& v, KvLayer& kv, int heads, float scale,
                 Tensor out) override;
  void silu_mul(const Tensor& gate, const Tensor& up, Tensor out) override;
  void add(const Tensor& x, Tensor inout) override;
  void add_rmsnorm(const Tensor& x, Tensor inout, const Tensor& w, float eps, Tensor out) override;
  void head_norm_rope(Tensor x, int q_heads, int kv_heads, int head_dim, const Tensor& q_norm, const Tensor& k_norm,
                      float eps, const RopeTable& rope) override;
  void rotary_attention(Tensor q_and_k, const Tensor& v, int heads, int kv_heads, int head_dim, const Tensor& q_norm,
                        const Tensor& k_norm, float eps, const RopeTable& rope, KvLayer& kv, float scale,
                        Tensor out) override;
  void router_logits(const Tensor& x, const LinearWeight& gate, Tensor out) override;
  void topk_softmax(const Tensor& logits, int k, bool renormalize, Tensor ids, Tensor weights) override;
  void topk_sigmoid_grouped(const Tensor& logits, const Tensor& bias, int k, int n_group, int topk_group,
                            bool renormalize, float scaling, Tensor ids, Tensor weights) override;
  void moe(const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts,
           const MoeLoraTable* lora, Tensor out) override;
  void concurrently(const std::function<void()>& first, const std::function<void()>& second) override;
  void gather_logit_rows(const Tensor& x, Tensor out) override;
  void mla_split_kv(const Tensor& kv, const Tensor& k_pe, int heads, int nope, int v_dim, Tensor k,
                    Tensor v) override;
  // DeepSeek MLA over the latent cache (kernels/mla_attention.cuh; cuda_backend_ops.cu).
  bool supports_mla_absorbed() const override { return true; }
  void mla_attention_absorbed(const Tensor& q, const Tensor& latent, const Tensor& k_pe, const LinearWeight& kv_b,
                              const LoraModuleTable* kv_b_lora, KvLayer& kv, int heads, int nope, int v_dim,
                              float scale, Tensor out) override;
  Tensor to_host_f32(const Tensor& t) override;
  std::vector<SampleOutput> sample(const Tensor& logits, const std::vector<SampleRow>& rows) override;
  void reserve_sampling(int rows, int vocab) override;
  void reserve_penalty_slots(int n, int vocab) override;
  int penalty_slots() const override;
  void penalty_reset(int slot, const std::vector<int32_t>& tokens, int prompt_len) override;
  size_t scratch_peak_bytes() const override { return arena_peak_; }
  void fit_scratch(size_t bytes) override;
  bool device_memory(size_t* free, size_t* total) override;
  std::string device_description() const override;
  void synchronize() override {
    flush_route();
    sync_main();
  }
  void device_timer_begin() override;
  double device_timer_end_us() override;
  double take_device_wait_seconds() override {
    const double w = wait_s_;
    wait_s_ = 0;
    return w;
  }

  cudaStream_t stream() const { return main_; }

 private:
  LinearWeight nvfp4_device_weight(int64_t rows, int cols, const std::vector<uint8_t>& codes,
                                   const uint8_t* group_scales, const std::vector<float>& globals);
  LinearWeight random_nvfp4_weight(int64_t rows, int cols, int64_t globals, uint64_t& seed);
  LinearWeight fuse_nvfp4_rows(const std::vector<const LinearWeight*>& parts);
  ExpertWeights upload_nvfp4_experts(const std::vector<StoredWeight>& gate, const std::vector<StoredWeight>& up,
                                     const std::vector<StoredWeight>& down);
  friend class CudaLoraPlacement;  // commit(): main_, raise_rank_ceiling
  struct StepMeta;  // device copies of the step's token/page arrays
  struct Graphs;    // captured decode graphs (cuda_graphs.cu)
  struct Sampler;   // sampling buffers (cuda_sampler.cu)
  // Where a captured graph reads a LoRA grouping plan that depends on the batch: one plan for the
  // projections of one launch (up to cuda::kLoraMaxProblems, each with its table).
  struct LoraRecipe {
    std::vector<const LoraModuleTable*> tables;
    void* dev_meta;
    size_t bytes;
    int capacity;
  };
  void replan_lora(const std::vector<LoraRecipe>& recipes);
  // One projection's LoRA output: y (the projection's output or a column slice of it) += B_s A_s x.
  struct LoraOutput {
    Tensor y;
    const LoraModuleTable* table;
  };
  void capture_lora(const Tensor& x, const std::vector<LoraOutput>& outs);
  // linear() in two halves: the base GEMM into out, then the LoRA deltas of the projections that
  // read x, all in one launch of the LoRA kernel.
  void base_linear(const Tensor& x, const LinearWeight& w, Tensor out);
  bool linear_lora_in_gemm(const Tensor& x, const LinearWeight& w, const std::vector<LinearPart>& parts, Tensor out);
  // Whether a token of this step uses a slot with a non-zero rank in one of `ranks` (host mirrors of
  // LoRA tables, one rank per slot), and the widest rank a slot holds; in a capture, what any replay
  // may bring (lora_active_, lora_rank_ceiling_). The MoE, MLA and dense LoRA paths size by it.
  struct StepLora {
    bool any = false;
    int max_rank = 0;
  };
  StepLora step_lora(const std::vector<const std::vector<int>*>& ranks) const;
  void add_lora(const Tensor& x, const std::vector<LoraOutput>& outs);
  // topk_softmax / topk_sigmoid_grouped record their routing for the moe() that reads the ids
  // (cuda_backend_ops.cu); flush_route launches a recorded routing on its own.
  void defer_route(const cuda::RouterParams& p);
  void flush_route();
  cuda::RouterParams pending_route_;
  bool route_pending_ = false;
  std::vector<LoraRecipe> capture_recipes_;
  static constexpr int kGraphMaxPositions = 16384;
  void upload_step_metadata();
  void raise_rank_ceiling(int rank);
  bool graph_lora() const { return mode_ == StepMode::kCapture && lora_active_; }
  void* arena_alloc(size_t bytes);
  Tensor device_tensor(DType dtype, const std::vector<int64_t>& shape);  // persistent, zeroed
  const float* device_inv_freq(const RopeTable& rope);
  // attention(), with (`write_cache`) or without the cache write of this step's k and v.
  void run_attention(const Tensor& q, const Tensor& k, const Tensor& v, KvLayer& kv, int heads, float scale, Tensor out,
                     bool write_cache);
  cuda::RopeParams rope_params(Tensor x, int heads, int head_stride, int rot_offset, const RopeTable& rope);
  cuda::HeadNormRopeParams head_norm_rope_params(Tensor x, int q_heads, int kv_heads, int head_dim, const Tensor& q_norm,
                                                 const Tensor& k_norm, float eps, const RopeTable& rope);

  CudaBackendOptions opts_;
  cudaStream_t main_ = nullptr, side_ = nullptr;
  cudaEvent_t ev_ids_ = nullptr, ev_gu_ = nullptr, ev_act_ = nullptr, ev_d_ = nullptr;
  // Backend::concurrently's stream and its fork / join events.
  cudaStream_t concurrent_ = nullptr;
  cudaEvent_t ev_fork_ = nullptr, ev_join_ = nullptr;
  std::unique_ptr<cuda::DenseGemmContext> dense_;
  std::unique_ptr<cuda::LoraContext> lora_;
  // Arena.
  void* arena_ = nullptr;
  size_t arena_bytes_ = 0, arena_used_ = 0;
  size_t arena_peak_ = 0;        // largest arena_used_ since the last fit_scratch
  struct Spill {
    size_t offset, bytes;  // logical arena offset it stands for
    void* ptr;
  };
  std::vector<Spill> spills_;    // this step's scratch beyond the arena (eager steps only)
  // Step.
  StepBatch batch_;
  std::unique_ptr<StepMeta> meta_;
  std::unique_ptr<cuda::AttentionPlan> attn_plan_;
  void* attn_meta_ = nullptr;
  size_t attn_meta_bytes_ = 0;
  bool attn_planned_ = false;
  int step_max_positions_ = 0;  // longest context of the step's tokens (0: not computed yet this step)
  std::map<const float*, std::shared_ptr<void>> inv_freq_;  // rope tables on the device, by host address
  // CUDA graphs for decode steps.
  StepMode mode_ = StepMode::kEager;
  std::unique_ptr<Graphs> graphs_;
  std::unique_ptr<Sampler> sampler_;
  cudaEvent_t timer_begin_ = nullptr, timer_end_ = nullptr;
  double wait_s_ = 0;  // time blocked in sync_main() since take_device_wait_seconds()
  void sync_main();    // waits for the main stream, adding the wait to wait_s_
  void apply_penalty_resets();  // the penalty resets queued since the last sample() (cuda_sampler.cu)
  int pad_page_ = -1, page_size_ = 0;
  bool lora_active_ = false;     // a token of this (graph) step uses an adapter
  int lora_rank_ceiling_ = 0;    // power of two >= every rank ever placed in a slot
  std::shared_ptr<cuda::LoraCopier> copier_;  // adapter placements; made by the first one
  // Absorbed MLA: each kv_b as the kernels read it, a bf16 copy made on its first use (an eager
  // step: the first step of any graph key runs eagerly) and kept for the backend's life. Keyed by
  // the weight's device address; `source` holds the weight so that the address is never reused
  // while the entry exists. Costs heads x (nope + v_dim) x kv_lora_rank x 2 bytes per layer on top
  // of the checkpoint's kv_b (DeepSeek-V3: 32 MiB per layer, 1.9 GiB over 61 layers at 128 heads,
  // 244 MiB per GPU at tp 8), counted by the loader's fits-in-memory check through
  // derived_weight_bytes; it is made during the engine's warm-up step, before the KV cache is sized
  // from the memory left.
  struct MlaAbsorbedWeights {
    Tensor source;  // kv_b.w
    Tensor w_uk_t;  // bf16 [heads, R, nope]
    Tensor w_uv;    // bf16 [heads, v_dim, R]
    int heads = 0, nope = 0, v_dim = 0;
  };
  const MlaAbsorbedWeights& mla_absorbed_weights(const LinearWeight& kv_b, int heads, int nope, int v_dim);
  std::map<const void*, MlaAbsorbedWeights> mla_weights_;
};

}  // namespace moelora
