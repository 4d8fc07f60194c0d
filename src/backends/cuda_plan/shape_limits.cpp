#include "backends/cuda_plan/shape_limits.h"

#include <fmt/format.h>

namespace moelora::cuda_plan {

namespace {

// moe_align.cu align_smem_bytes with LoRA grouping: 4 int arrays over the S*E+1 buckets plus 3
// over the slots.
size_t moe_align_lora_smem(int slots, int num_experts) {
  const size_t buckets = static_cast<size_t>(slots) * num_experts + 1;
  return sizeof(int) * (4 * buckets + 3 * static_cast<size_t>(slots));
}

bool moe_lora_slots_fit(int slots, int num_experts) {
  return static_cast<long long>(slots) * num_experts + 1 <= kMoeMaxLoraBuckets &&
         moe_align_lora_smem(slots, num_experts) <= kMoeAlignMaxSmem;
}

}  // namespace

int moe_lora_max_slots(int num_experts) {
  if (num_experts < 1) return 0;
  int slots = (kMoeMaxLoraBuckets - 1) / num_experts;  // the bucket bound; smem may bind first
  while (slots > 0 && !moe_lora_slots_fit(slots, num_experts)) --slots;
  return slots;
}

std::vector<std::string> shape_limit_violations(const ModelShapes& s) {
  std::vector<std::string> v;

  if (s.kv_lora_rank > 0 && s.mla_absorbed) {
    // MLA in the absorbed form runs kernels/mla_attention.cu instead of the attention kernels:
    // launch_mla_absorbed (and CudaBackend::mla_attention_absorbed) checks the latent width (half of
    // O's columns per warp in registers) and the cache row width (the block's query and a tile of
    // 64 rows in shared memory). Heads, nope and v_dim are free.
    if (s.kv_lora_rank > kMlaMaxLatent || s.kv_lora_rank + s.rope_dim > kMlaMaxLatentWidth)
      v.push_back(fmt::format("MLA (absorbed): kv_lora_rank {} + rope {} = {} cached values per token, the CUDA "
                              "latent attention takes a kv_lora_rank of at most {} and at most {} values (use --mla "
                              "decompressed, if its head dims are supported)",
                              s.kv_lora_rank, s.rope_dim, s.kv_lora_rank + s.rope_dim, kMlaMaxLatent,
                              kMlaMaxLatentWidth));
  } else {
    // Attention. kernels/attention.cu: the tensor-core kernels for the pairs they are built for,
    // the generic kernel for the rest up to its limit (choose_attention_kernel, which
    // attention_plan and check_params follow), query head h reading kv head h / (heads / kv_heads).
    if (!attention_head_dims_supported(s.k_head_dim, s.v_head_dim))
      v.push_back(fmt::format("attention: head dims k={}, v={} are not supported by the CUDA attention kernels "
                              "(k must be a multiple of 8, both at most {})",
                              s.k_head_dim, s.v_head_dim, kGenericAttentionMaxDim));
    if (s.kv_heads < 1 || s.heads % s.kv_heads != 0)
      v.push_back(fmt::format("attention: {} query heads are not a whole multiple of {} kv heads (the kernels "
                              "share each kv head among heads / kv_heads query heads)",
                              s.heads, s.kv_heads));
  }

  // Rotary embedding. kernels/elementwise.cu launch_rope: rotated dims come in pairs and must lie
  // inside the head.
  if (s.rope_dim % 2 != 0 || s.rope_dim < 0 || s.rope_offset < 0 || s.rope_offset + s.rope_dim > s.k_head_dim)
    v.push_back(fmt::format("rope: {} rotary dims at offset {} must be even and fit in the {}-dim head", s.rope_dim,
                            s.rope_offset, s.k_head_dim));

  if (s.num_experts > 0) {
    // kernels/moe_gemm.cu (tensor cores: 64-wide K chunks) or moe_gemm_generic.cu (any multiple of
    // 16; cuda_plan::choose_moe_tuning picks), moe_lora.cu's 16-byte rows and moe_reduce's 4-wide
    // rows: moe_shape_supported.
    if (s.hidden % kMoeShapeMultiple != 0)
      v.push_back(fmt::format("MoE experts: hidden_size {} is not a multiple of {} (the CUDA expert GEMMs and MoE "
                              "LoRA read rows in {}-value pieces)",
                              s.hidden, kMoeShapeMultiple, kMoeShapeMultiple));
    if (s.moe_intermediate % kMoeShapeMultiple != 0)
      v.push_back(fmt::format("MoE experts: the expert intermediate size {} is not a multiple of {} (the CUDA "
                              "expert GEMMs and MoE LoRA read rows in {}-value pieces)",
                              s.moe_intermediate, kMoeShapeMultiple, kMoeShapeMultiple));
    // kernels/router.cu router_topk: one warp routes a token, E / 32 experts per lane in
    // registers (E <= 1024), lane j keeps choice j (k <= 32), lane g scores group g (<= 32).
    if (s.num_experts > kRouterMaxExperts)
      v.push_back(fmt::format("router: {} routed experts, the CUDA router takes at most {}", s.num_experts,
                              kRouterMaxExperts));
    if (s.top_k < 1 || s.top_k > kRouterMaxTopK || s.top_k > s.num_experts)
      v.push_back(fmt::format("router: {} experts per token, the CUDA router takes 1..{} (and at most the {} "
                              "experts)",
                              s.top_k, kRouterMaxTopK, s.num_experts));
    if (s.grouped_router && (s.n_group < 1 || s.n_group > kRouterMaxGroups || s.num_experts % s.n_group != 0 ||
                             s.topk_group < 1 || s.topk_group > s.n_group))
      v.push_back(fmt::format("router: group-limited routing with n_group {} and topk_group {} over {} experts, "
                              "the CUDA router takes 1..{} equal groups and 1 <= topk_group <= n_group",
                              s.n_group, s.topk_group, s.num_experts, kRouterMaxGroups));
    // kernels/moe_align.cu moe_align: one CTA counting-sorts the pairs into (slot, expert)
    // groups in shared memory (num_slots * E + 1 <= kMoeMaxLoraBuckets, and the smem bound).
    if (s.lora_slots > 0 && !moe_lora_slots_fit(s.lora_slots, s.num_experts))
      v.push_back(fmt::format("MoE LoRA: {} adapter slots x {} experts are more (slot, expert) groups than the CUDA "
                              "MoE alignment sorts in one block (at most {} slots with {} experts)",
                              s.lora_slots, s.num_experts, moe_lora_max_slots(s.num_experts), s.num_experts));
  }

  // FP8 weights. kernels/dense_gemm.cu to_params: dense projections need 128-wide column blocks
  // (block_in); kernels/moe_gemm.cu computes expert scale rows and columns as index / 128 (no
  // check there: other blocks would read the wrong scales silently).
  const WeightFormat& wf = s.weight_format;
  if (wf.is_fp8()) {
    const bool dense_ok = wf.block_in == kFp8Block;
    const bool experts_ok = s.num_experts == 0 || (wf.block_out == kFp8Block && wf.block_in == kFp8Block);
    if (!dense_ok || !experts_ok)
      v.push_back(fmt::format("FP8: weight_block_size [{}, {}] is not supported, the CUDA kernels take [{}, {}] "
                              "(dense projections need {}-wide column blocks, the expert GEMMs {} x {} blocks)",
                              wf.block_out, wf.block_in, s.num_experts > 0 ? "128" : "any", kFp8Block,
                              kFp8Block, kFp8Block, kFp8Block));
  }

  // kernels/sampling.cu launch_sample: ties are broken by a radix selection over 3 bytes of the
  // token id.
  if (s.vocab >= kSamplingVocabLimit)
    v.push_back(fmt::format("sampling: vocab_size {} is not below 2^24 = {} (the CUDA sampler selects token ids "
                            "in 3 bytes)",
                            s.vocab, kSamplingVocabLimit));

  // kernels/lora_dense.cu lora_plan: the dense LoRA shrink reads the input in 8-value (16-byte)
  // pieces. Every target gets pointer tables at start-up, so an adapter on it could reach the kernel.
  for (const ModelShapes::LoraInput& in : s.lora_inputs)
    if (in.in % kLoraInMultiple != 0)
      v.push_back(fmt::format("LoRA: {} has input width {}, not a multiple of {} (the CUDA LoRA shrink reads "
                              "{}-value pieces)",
                              in.name, in.in, kLoraInMultiple, kLoraInMultiple));

  // kernels/lora_dense.cu lora_plan and CudaBackend::set_lora_slot (dense), moe_forward.cu /
  // moe_lora.cu (experts): the shrink keeps rank-r partial sums of at most 128 in registers and
  // shared memory.
  if (s.max_lora_rank > kMaxLoraRank)
    v.push_back(fmt::format("LoRA: adapters of rank up to {} requested, the CUDA LoRA kernels take ranks up to {}",
                            s.max_lora_rank, kMaxLoraRank));
  return v;
}

Status check_shape_limits(const ModelShapes& s) {
  const std::vector<std::string> v = shape_limit_violations(s);
  if (v.empty()) return {};
  return unsupported("the CUDA kernels cannot run this {}model: {}", s.arch.empty() ? "" : s.arch + " ",
                     fmt::join(v, "; "));
}

}  // namespace moelora::cuda_plan
