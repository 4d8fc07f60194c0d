// Op contracts, part 2: the operations a model's forward pass is written in. A Backend
// implements each on its device; the model code (src/model) is written once against this
// interface. The math of every op is stated here; backends/cpu is its executable form.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/model_shapes.h"
#include "ops/sampling.h"
#include "ops/types.h"
#include "ops/weight_format.h"

namespace moelora {

class LoraPlacement;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;
  // dtype of activations the backend allocates (CPU: f32).
  virtual DType act_dtype() const = 0;

  // ---- What the kernels can take. A model (or an adapter capacity) whose shapes the backend's
  // kernels cannot run is refused here with a message naming each limit, before any weight is
  // loaded: Model::load and Model::random call it with the model's shapes, Engine::create again
  // with its adapter slots and rank. A kernel launcher that still meets such a shape aborts
  // (MOELORA_CHECK), so every limit a launcher asserts on a model shape belongs here.
  // Default: everything (the CPU reference runs any shape).
  virtual Status check_model_shapes(const ModelShapes& shapes) const { return {}; }
  // Largest LoRA rank the kernels take (0 = any). The engine lowers its max_lora_rank to it, so
  // an adapter above it is refused when it loads.
  virtual int max_lora_rank() const { return 0; }

  // ---- Persistent memory (weights, adapters, KV pages): lives until the returned tensor dies.
  // Copies a host tensor to the backend, converting float dtypes to `dtype`.
  virtual Tensor upload(const Tensor& host, DType dtype) = 0;
  // A linear weight as the checkpoint stores it (any WeightFormat; validated by the loader).
  virtual LinearWeight upload_linear(const StoredWeight& w) = 0;
  // Bytes the backend will hold for upload(host of `numel` elements, dtype) and upload_linear(w)
  // (allocation granularity included): the loader sums them before uploading anything, so weights
  // that cannot fit are refused with a message instead of failing an allocation half-way.
  // Defaults: exactly the elements' bytes; a linear in f32 (the CPU reference).
  virtual size_t upload_bytes(DType dtype, int64_t numel) const { return static_cast<size_t>(numel) * dtype_size(dtype); }
  virtual size_t linear_bytes(const StoredWeight& w) const { return upload_bytes(DType::kF32, int64_t{w.out} * w.in); }
  // Bytes the backend will derive from a model's weights on their first use and keep (CUDA:
  // absorbed MLA's bf16 copies of kv_b in its kernels' layouts): the loader's fits-in-memory check
  // counts them with the weights, so a model that only just fits is refused at load instead of
  // failing an allocation in its first step. Default: none.
  virtual size_t derived_weight_bytes(const ModelShapes&) const { return 0; }
  // Bytes upload_experts will hold for one expert part (gate[e], up[e] or down[e]), allocation
  // granularity not included (the parts are packed together). Default: linear_bytes.
  virtual size_t expert_part_bytes(const StoredWeight& w) const { return linear_bytes(w); }
  // Routed experts from per-expert checkpoint weights (gate[e], up[e]: [I, H]; down[e]: [H, I]),
  // all of one format.
  virtual ExpertWeights upload_experts(const std::vector<StoredWeight>& gate, const std::vector<StoredWeight>& up,
                                       const std::vector<StoredWeight>& down) = 0;
  // Random routed experts / a random projection in a form only this backend's kernels read (CUDA:
  // NVFP4 in its 4-bit layouts), for benchmarks at full size; num_experts == 0 / an undefined
  // weight when the backend has no such form for `fmt` and these shapes (Model::random then makes
  // them from random_tensor).
  virtual LinearWeight random_linear(int /*out*/, int /*in*/, const WeightFormat& /*fmt*/, uint64_t /*seed*/) {
    return {};
  }
  virtual ExpertWeights random_experts(int /*num_experts*/, int /*hidden*/, int /*intermediate*/,
                                       const WeightFormat& /*fmt*/, uint64_t /*seed*/) {
    return {};
  }
  // A new persistent tensor of deterministic pseudo-random values (benchmarks with random
  // weights): floats uniform in [-scale, scale]; F8_E4M3 any finite code (scale ignored).
  virtual Tensor random_tensor(DType dtype, const std::vector<int64_t>& shape, uint64_t seed, float scale) = 0;
  virtual KvLayer alloc_kv_layer(int num_pages, int page_size, int kv_heads, int k_head_dim,
                                 int v_head_dim) = 0;
  // dtype of LoRA factors on this backend and pointer-table writes (see LoraModuleTable).
  virtual DType lora_dtype() const = 0;
  // Allocates zeroed pointer tables for `num_slots` slots.
  virtual LoraModuleTable alloc_lora_table(int num_slots, int in, int out) = 0;
  virtual MoeLoraTable alloc_moe_lora_table(int num_slots, int num_experts, int hidden, int intermediate) = 0;
  // Writes slot entries (pointers are element addresses of tensors from upload()).
  virtual void set_lora_slot(LoraModuleTable& t, int slot, const Tensor& a, const Tensor& b, int rank) = 0;
  struct MoeLoraSlot {
    Tensor gu_a, gu_b, d_a, d_b;  // uploaded factors (undefined = none)
    int64_t gu_a_stride = 0, gu_b_stride = 0, d_a_stride = 0, d_b_stride = 0;
    int gu_rank = 0, d_rank = 0;
  };
  virtual void set_moe_lora_slot(MoeLoraTable& t, int slot, const MoeLoraSlot& s) = 0;
  // Placing an adapter in a slot off the engine thread (lora/slot_pool.h; LoraPlacement below says
  // which thread calls what). Called on the engine thread between steps; `bytes` is the sum of
  // upload_bytes(lora_dtype(), numel) over the factors the placement will upload. The default
  // (HostLoraPlacement, ops/backend.cpp) uploads each factor with upload() on the placement worker
  // and writes the table entries with set_lora_slot / set_moe_lora_slot in commit(), on the engine
  // thread: a backend that keeps it must make upload() safe to run while a step runs (CpuBackend:
  // upload touches no member). CudaBackend overrides it (copy stream, pinned staging); its
  // placements call only the backend's const queries (upload_bytes, max_lora_rank) from the
  // worker. No other Backend method is called off the engine thread.
  virtual std::unique_ptr<LoraPlacement> begin_lora_placement(int slot, size_t bytes);

  // ---- One forward step.
  // Makes the step's metadata (token ids, positions, slots, page tables) available to ops and
  // resets the step's scratch memory. Returns the batch the ops will see: the same, or padded to
  // a captured graph's size (extra tokens on no adapter, their logit rows after the real ones).
  virtual const StepBatch& begin_step(const StepBatch& batch) = 0;
  // How the step's forward body runs. kReplay: the backend already ran the whole step from a
  // captured graph (skip the body; step_output() holds the logits). kCapture / kEager: run the
  // body, then call end_step_body with the logits tensor (a capture is closed and launched there).
  enum class StepMode { kEager, kCapture, kReplay };
  virtual StepMode step_mode() { return StepMode::kEager; }
  virtual void end_step_body(const Tensor& logits) {}
  virtual Tensor step_output() { return {}; }
  // Scratch activation [rows, cols] valid until the next begin_step (or scratch_release).
  virtual Tensor alloc(int64_t rows, int64_t cols, DType dtype) = 0;
  // Scratch taken after a mark is given back by releasing it (the forward pass does this per
  // layer, so a step needs one layer's scratch, not all of them).
  virtual size_t scratch_mark() = 0;
  virtual void scratch_release(size_t mark) = 0;
  // An activation (stored in act_dtype()); ops writing into activations round to that type.
  virtual Tensor alloc_act(int64_t rows, int64_t cols) { return alloc(rows, cols, act_dtype()); }

  // out[t] = table[token_ids[t]]   (table [vocab, H] from upload())
  virtual void embed(const Tensor& table, Tensor out) = 0;
  // Root-mean-square norm of each group of w.numel() consecutive values in each row of x:
  //   y = x / sqrt(mean(x^2) + eps) * w        (x and out may alias)
  virtual void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor out) = 0;
  // out = x W^T + per-token LoRA:  out[t] += B_s (A_s x[t])  for s = token_slot[t] >= 0 with a
  // non-zero rank in `lora` (nullptr = no LoRA on this projection). out may be a column slice.
  virtual void linear(const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora, Tensor out) = 0;
  // Several projections of the same input in one GEMM, their weights fused row-wise at load
  // (fuse_linear_rows): out = x W^T, then part i's LoRA delta on its own columns
  // [begin, begin + out) of out, exactly as linear() on that part into that column slice.
  struct LinearPart {
    int begin = 0;
    int out = 0;
    const LoraModuleTable* lora = nullptr;
  };
  virtual void linear_parts(const Tensor& x, const LinearWeight& w, const std::vector<LinearPart>& parts, Tensor out);
  // The row-wise concatenation of `parts` (same input width and format; none already split) as one
  // weight that linear_parts reads, or an undefined weight when this backend does not fuse them
  // (the default) or their format forbids it (FP8: only the last boundary between parts may fall
  // inside a 128-row scale block; it becomes the fused weight's split_rows).
  virtual LinearWeight fuse_linear_rows(const std::vector<const LinearWeight*>& parts);
  // In place on x [T, heads * head_stride]: rotates dims [rot_offset, rot_offset + rope.rot_dim)
  // of every head by position-dependent angles pos * inv_freq[i], cos/sin scaled by
  // rope.attention_factor. Neox pairing (i, i + rot_dim/2) or, if interleaved, (2i, 2i + 1).
  virtual void rope(Tensor x, int heads, int head_stride, int rot_offset, const RopeTable& rope) = 0;
  // Qwen3's per-head q/k norms and the rotation after them, on the adjacent q | k heads of x
  // [T, (q_heads + kv_heads) * head_dim]: exactly rmsnorm(q heads, q_norm), rmsnorm(k heads,
  // k_norm), rope(x, q_heads + kv_heads, head_dim, 0, rope). A backend may do it in one pass (CUDA:
  // one launch, bit for bit the same).
  virtual void head_norm_rope(Tensor x, int q_heads, int kv_heads, int head_dim, const Tensor& q_norm,
                              const Tensor& k_norm, float eps, const RopeTable& rope) {
    rmsnorm(x.slice_cols(0, int64_t{q_heads} * head_dim), q_norm, eps, x.slice_cols(0, int64_t{q_heads} * head_dim));
    rmsnorm(x.slice_cols(int64_t{q_heads} * head_dim, int64_t{kv_heads} * head_dim), k_norm, eps,
            x.slice_cols(int64_t{q_heads} * head_dim, int64_t{kv_heads} * head_dim));
    this->rope(x, q_heads + kv_heads, head_dim, 0, rope);
  }
  // GQA attention after a fused q|k|v projection, on the adjacent q | k heads of q_and_k: with
  // per-head norms (q_norm defined, Qwen3) head_norm_rope(q_and_k, heads, kv_heads, head_dim,
  // q_norm, k_norm, eps, rope), without them (Mixtral) rope(q_and_k, heads + kv_heads, head_dim, 0,
  // rope); then attention(q, k, v, kv, heads, scale, out) with q and k the column slices of
  // q_and_k: exactly those calls (the default). A backend may write the rotated k and v into the
  // cache in the rotation's pass instead of in attention (CUDA: one launch fewer per layer, the
  // same bits).
  virtual void rotary_attention(Tensor q_and_k, const Tensor& v, int heads, int kv_heads, int head_dim,
                                const Tensor& q_norm, const Tensor& k_norm, float eps, const RopeTable& rope, KvLayer& kv,
                                float scale, Tensor out) {
    if (q_norm.defined())
      head_norm_rope(q_and_k, heads, kv_heads, head_dim, q_norm, k_norm, eps, rope);
    else
      this->rope(q_and_k, heads + kv_heads, head_dim, 0, rope);
    attention(q_and_k.slice_cols(0, int64_t{heads} * head_dim),
              q_and_k.slice_cols(int64_t{heads} * head_dim, int64_t{kv_heads} * head_dim), v, kv, heads, scale, out);
  }
  // Writes each token's k [T, kv_heads*k_head_dim] and v [T, kv_heads*v_head_dim] into the
  // cache at its (sequence, position), then causal attention over positions 0..pos of its
  // sequence for every query head h (kv head h / (heads / kv_heads)):
  //   out[t, h] = sum_j softmax_j(scale * q[t, h] . K[j]) V[j]          out [T, heads * v_head_dim]
  virtual void attention(const Tensor& q, const Tensor& k, const Tensor& v, KvLayer& kv, int heads,
                         float scale, Tensor out) = 0;
  // out[t, i] = silu(gate[t, i]) * up[t, i]
  virtual void silu_mul(const Tensor& gate, const Tensor& up, Tensor out) = 0;
  // inout += x
  virtual void add(const Tensor& x, Tensor inout) = 0;
  // The residual step between two blocks: inout += x (rounded to inout's dtype), then
  // out = rmsnorm(inout) of that rounded sum, exactly add() then rmsnorm(). A backend may do both in
  // one pass (CUDA: one launch and one read of the residual instead of two); the result must be the
  // same bit for bit. out may not alias x or inout.
  virtual void add_rmsnorm(const Tensor& x, Tensor inout, const Tensor& w, float eps, Tensor out) {
    add(x, inout);
    rmsnorm(inout, w, eps, out);
  }
  // Router scores: out [T, E] f32 = x Wg^T computed in f32.
  virtual void router_logits(const Tensor& x, const LinearWeight& gate, Tensor out) = 0;
  // Softmax over experts, top-k (ties: lower expert index first), optional renormalisation.
  virtual void topk_softmax(const Tensor& logits, int k, bool renormalize, Tensor ids, Tensor weights) = 0;
  // DeepSeek-V3: s = sigmoid(logits); choice = s + bias; group score = sum of the top-2 choice
  // values in each of n_group groups; keep the topk_group best groups (others' choice := 0, as
  // transformers does); top-k of choice; weights = s of the chosen, / (sum + 1e-20) if
  // renormalize, x scaling.
  virtual void topk_sigmoid_grouped(const Tensor& logits, const Tensor& bias, int k, int n_group,
                                    int topk_group, bool renormalize, float scaling, Tensor ids,
                                    Tensor weights) = 0;
  // Routed experts with per-token LoRA (LoRA added before the activation on gate_up, and on
  // the activated input of down; routing weights scale base and LoRA alike):
  //   g = x Wgu[e]^T + Bgu (Agu x);  a = silu(g[:I]) * g[I:];  d = a Wd[e]^T + Bd (Ad a)
  //   out[t] = sum_j weights[t, j] * d(e = ids[t, j])                    (out overwritten)
  virtual void moe(const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts,
                   const MoeLoraTable* lora, Tensor out) = 0;
  // Issues `first`, then `second`, two pieces of work of which neither reads what the other
  // writes (the forward pass: a MoE layer's shared experts, then its routed ones): both see
  // everything issued before, everything issued after sees both. A backend may run them
  // concurrently (CudaBackend with shared_experts_concurrent: `first` on a stream of its own).
  virtual void concurrently(const std::function<void()>& first, const std::function<void()>& second) {
    first();
    second();
  }
  // out[r] = x[batch.logit_rows[r]]
  virtual void gather_logit_rows(const Tensor& x, Tensor out) = 0;
  // DeepSeek MLA: from kv_b output [T, heads*(nope+v)] and the rotated k_pe [T, rope] build
  // k [T, heads*(nope+rope)] = per head (k_nope, k_pe) and v [T, heads*v].
  virtual void mla_split_kv(const Tensor& kv, const Tensor& k_pe, int heads, int nope, int v_dim,
                            Tensor k, Tensor v) = 0;
  // DeepSeek MLA, absorbed form: the cache holds each token's latent, not per-head K and V.
  // Whether the backend has it; a model asking for it on a backend without it is refused at load
  // (Model::load), and `auto` keeps the decompressed form there (attention + mla_split_kv).
  virtual bool supports_mla_absorbed() const { return false; }
  // Inputs: q [T, heads*(nope+rope)] with the rope dims already rotated; latent c [T, R] (after
  // kv_a_norm, R = kv_lora_rank); k_pe [T, rope] rotated; kv_b the decompression weight
  // [heads*(nope+v_dim), R] (FP8 block-scaled as for linear) and its LoRA table (nullptr = none).
  // The cache `kv` holds one head of R + rope values per position (c, then k_pe) and no V
  // (kv_heads 1, k_head_dim R + rope, v_head_dim 0). Each token's (c, k_pe) is written at its
  // (sequence, position) first, then causal attention over positions 0..pos of its sequence, as
  // in `attention`. With W_UK_h / W_UV_h the k_nope / v rows of kv_b for head h, and B_UK_h /
  // B_UV_h the same rows of B (scale folded in) and A the token's adapter's kv_b LoRA factors
  // (token_slot; slot -1 or rank 0: W only):
  //   qc_h    = W_UK_h^T q_nope_h + A^T (B_UK_h^T q_nope_h)                     [R]
  //   s_j     = scale * (qc_h . c_j + q_pe_h . k_pe_j)
  //   o_h     = sum_j softmax_j(s) c_j                                          [R]
  //   out[t, h] = W_UV_h o_h + B_UV_h (A o_h)                                    out [T, heads*v_dim]
  // This equals `attention` on the decompressed k_nope_j = (W_UK_h + B_UK_h A) c_j and
  // v_j = (W_UV_h + B_UV_h A) c_j because every token of a sequence carries the same adapter,
  // so the keys and values the query sees were all decompressed with its own LoRA.
  virtual void mla_attention_absorbed(const Tensor& q, const Tensor& latent, const Tensor& k_pe,
                                      const LinearWeight& kv_b, const LoraModuleTable* kv_b_lora, KvLayer& kv,
                                      int heads, int nope, int v_dim, float scale, Tensor out) {
    MOELORA_CHECK_MSG(false, "mla_attention_absorbed is not supported by the {} backend (supports_mla_absorbed)",
                      name());
  }
  // Copies a backend tensor to a new host f32 tensor (synchronous).
  virtual Tensor to_host_f32(const Tensor& t) = 0;

  // ---- Sampling (after a step, outside graphs; synchronous: returns the host results).
  // One token for each row r of `logits` [rows.size(), vocab] f32 (ops/sampling.h has the math):
  //  1. processed logits p_i = apply_edit(raw_i, edit) for tokens with an edit, raw_i otherwise;
  //     with restrict_to_allowed, tokens without an `allowed` edit are -inf.
  //  2. the order: tokens by (order_key(p_i) desc, id asc); `first` is its first token.
  //  3. temperature <= 0: token = first. Otherwise, with T = temperature, pmax = the largest finite
  //     p_i (none: token = first), q_i = mass_q32(p_i, pmax, 1/T) (0 for non-finite p_i): keep the
  //     first top_k tokens of the order (top_k > 0); then the shortest prefix of those whose q-sum
  //     S has (double)S >= (double)top_p * (double)Z, Z = their q-sum (top_p < 1). Each kept token
  //     weighs w_i = q_i, or 0 where (double)q_i < (double)min_p * 2^32 (min_p > 0). With M = the
  //     kept tokens' w-sum (0: token = first) and t = draw_target(draw_bits(seed, step), M), token =
  //     the first kept token of the order whose cumulative w-sum exceeds t (inverse CDF).
  //  4. logprob = raw_token - logsumexp(raw); top_logprobs = the first `logprobs` tokens by
  //     (raw desc, id asc) with their log-softmax (raw: before processing and temperature).
  //  5. a row with penalty_slot >= 0 samples with the edits penalty_slot_edits(row, slot's cells)
  //     (ops/sampling.h), and its drawn token is then counted into the slot: cell =
  //     penalty_count(cell, /*generated=*/true). No two rows of a call share a slot.
  virtual std::vector<SampleOutput> sample(const Tensor& logits, const std::vector<SampleRow>& rows) = 0;
  // ---- Penalty slots (ops/sampling.h): `penalty_slots()` slots of `vocab` cells each, allocated
  // (zeroed) by reserve_penalty_slots at start-up (0 slots: the backend keeps none and penalised
  // rows carry their counts as edits). penalty_reset(slot, tokens, prompt_len) makes the slot
  // count `tokens` (prompt first): every cell zero, then penalty_count(cell, i >= prompt_len) for
  // each token i. Ordered with sample() as calls on the engine thread are.
  virtual void reserve_penalty_slots(int n, int vocab) {}
  virtual int penalty_slots() const { return 0; }
  virtual void penalty_reset(int slot, const std::vector<int32_t>& tokens, int prompt_len) {
    MOELORA_CHECK_MSG(false, "the {} backend keeps no penalty slots", name());
  }
  // Seconds the calling thread spent blocked on the device since the last call (0 on the CPU):
  // a step's wall time minus this is its host time.
  virtual double take_device_wait_seconds() { return 0.0; }

  // ---- Start-up memory sizing (runtime/memory_plan.h). Backends without device memory keep the
  // defaults (no device memory to report, nothing to fit).
  virtual bool device_memory(size_t* free, size_t* total) { return false; }
  // Largest scratch a step has taken since the last fit_scratch, and resizing the scratch to
  // `bytes` (between steps; drops anything captured against the old one).
  virtual size_t scratch_peak_bytes() const { return 0; }
  virtual void fit_scratch(size_t bytes) {}
  // Allocates now the sampling buffers `rows` rows of `vocab` logits need.
  virtual void reserve_sampling(int rows, int vocab) {}

  // ---- Measuring (benchmarks): what the device is, waiting for it, and timing device work
  // between two marks on the device's own clock (< 0 where the backend has none).
  virtual std::string device_description() const { return name(); }
  virtual void synchronize() {}
  virtual void device_timer_begin() {}
  virtual double device_timer_end_us() { return -1.0; }
};

// Backend::sample's preconditions, checked by every backend: logprobs in [0, kMaxTopLogprobs];
// edits sorted by token, one per token, inside the vocabulary; penalty slots below
// `penalty_slots`, with the slots' vocabulary, and no slot in two rows of a call (the device counts
// a drawn token into its slot with a plain read-modify-write).
void check_sample_rows(const std::vector<SampleRow>& rows, int vocab, int penalty_slots, int penalty_vocab);

// The shapes Backend::mla_attention_absorbed's contract states, checked once for every backend:
// q [T, heads*(nope+rope)], latent [T, R], k_pe [T, rope], out [T, heads*v_dim] with T the step's
// tokens; kv_b [heads*(nope+v_dim), R] and its LoRA table the same; the latent cache (1 head of
// R + rope values, no V). A mismatch is a broken invariant (MOELORA_CHECK), not bad input.
void check_mla_absorbed_shapes(int step_tokens, const Tensor& q, const Tensor& latent, const Tensor& k_pe,
                               const LinearWeight& kv_b, const LoraModuleTable* kv_b_lora, const KvLayer& kv,
                               int heads, int nope, int v_dim, const Tensor& out);

// One adapter being copied into one slot (Backend::begin_lora_placement). Threads:
// - the slot pool's placement worker, while the engine thread runs steps: upload, set_lora,
//   set_moe_lora, then finish, one call at a time;
// - the engine thread, between steps: ready, commit and the destructor.
// Why writing a slot while steps run is safe: from begin_lora_placement until commit returns, no
// token of any step uses the slot (the pool zeroes the slot's host rank mirrors when it reserves
// it, and the scheduler hands the slot to no request before commit), and kernels read a slot's
// table entries only for the tokens that carry it (CUDA: also inside replayed graphs, which index
// the tables by the step's token_slot). So entries the worker writes are never read half-written.
// The host mirrors that planning reads for every slot (host_rank, host_gu_rank, host_d_rank, and
// the CUDA rank ceiling of captured graphs) change only in commit, on the engine thread.
// The placement owns the slot's copies of the factors until it is destroyed.
class LoraPlacement {
 public:
  virtual ~LoraPlacement() = default;
  // Worker. A copy of `host` (f32 or the backend's lora_dtype) in the backend's lora_dtype; an
  // error (e.g. out of device memory) fails the placement and only the requests waiting for it.
  virtual Result<Tensor> upload(const Tensor& host) = 0;
  // Worker. This slot's entries of one table (tensors from upload; rank 0 = none). Every table of
  // the pool is given exactly once per placement, so no entry of a previous adapter survives.
  virtual void set_lora(LoraModuleTable& t, const Tensor& a, const Tensor& b, int rank) = 0;
  virtual void set_moe_lora(MoeLoraTable& t, const Backend::MoeLoraSlot& s) = 0;
  // Worker. Everything is queued; returns when the copies and entry writes are complete on the
  // device (blocking only the worker), or the first error.
  virtual Status finish() = 0;
  // Engine thread, non-blocking: the device has completed the placement's work.
  virtual bool ready() = 0;
  // Engine thread, after ready(): the slot's entries become visible to planning.
  virtual void commit() = 0;
};

}  // namespace moelora
