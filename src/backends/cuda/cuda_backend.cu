// CudaBackend, part 1: construction, persistent memory (weights, experts, KV, LoRA tables),
// the step arena and per-step metadata.
#include "backends/cuda/cuda_backend.h"

#include <cuda_bf16.h>

#include <chrono>
#include <cstring>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/cuda_backend_internal.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_lora_placement.h"
#include "backends/cuda/device_info.h"
#include "backends/cuda/kernels/attention.cuh"
#include "backends/cuda/kernels/dense_gemm.cuh"
#include "backends/cuda/kernels/lora_dense.cuh"
#include "backends/cuda/kernels/mla_attention.cuh"
#include "backends/cuda/kernels/moe_align.cuh"
#include "backends/cuda/kernels/moe_gemm.cuh"
#include "backends/cuda/kernels/moe_lora.cuh"
#include "backends/cuda/kernels/random_fill.cuh"
#include "backends/cuda_plan/moe_choices.h"
#include "backends/cuda_plan/nvfp4_layout.h"
#include "backends/cuda_plan/shape_limits.h"

namespace moelora {

CudaBackend::CudaBackend(const CudaBackendOptions& opts) : opts_(opts), meta_(std::make_unique<StepMeta>()) {
  // Streams and events exist before any capture (creating them inside one is not allowed).
  MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&main_, cudaStreamNonBlocking));
  MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&concurrent_, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&ev_ids_, &ev_gu_, &ev_act_, &ev_d_, &ev_fork_, &ev_join_})
    MOELORA_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  // Kernel attributes (shared-memory limits) are set once here, never during a capture.
  cuda::lora_dense_prepare();
  cuda::attention_prepare();
  cuda::mla_prepare();
  cuda::moe_gemm_init();
  dense_ = std::make_unique<cuda::DenseGemmContext>();
  lora_ = std::make_unique<cuda::LoraContext>();
  attn_plan_ = std::make_unique<cuda::AttentionPlan>();
  arena_bytes_ = opts.arena_bytes;
  MOELORA_CUDA_CHECK(cudaMalloc(&arena_, arena_bytes_));
}

// The host-side mirror of the kernels' limits must agree with the constants the kernels export.
static_assert(cuda_plan::kMaxLoraRank == cuda::kLoraMaxRank && cuda_plan::kMaxLoraRank == cuda::kMoeLoraMaxRank,
              "shape_limits.h mirrors the LoRA kernels' rank limit");
static_assert(cuda_plan::kMoeMaxLoraBuckets == cuda::kMoeMaxLoraBuckets,
              "shape_limits.h mirrors moe_align's LoRA bucket limit");

Status CudaBackend::check_model_shapes(const ModelShapes& shapes) const {
  // The attention kernels' choice (cuda_plan::choose_attention_kernel) is the one attention_plan and
  // the launch checks follow, so this refusal and the kernels cannot disagree.
  return cuda_plan::check_shape_limits(shapes);
}

int CudaBackend::max_lora_rank() const { return cuda_plan::kMaxLoraRank; }

CudaBackend::~CudaBackend() {
  cudaStreamSynchronize(main_);
  cudaStreamSynchronize(side_);
  cudaStreamSynchronize(concurrent_);
  // Placements may outlive the backend (a tool's slot pool): their frees stop waiting for main_.
  if (copier_) copier_->detach_main();
  if (meta_ && meta_->pinned) cudaFreeHost(meta_->pinned);
  if (meta_ && meta_->plan_pinned) cudaFreeHost(meta_->plan_pinned);
  if (arena_) cudaFree(arena_);
  for (const Spill& sp : spills_) cudaFree(sp.ptr);
  for (cudaEvent_t e : {ev_ids_, ev_gu_, ev_act_, ev_d_, ev_fork_, ev_join_, timer_begin_, timer_end_})
    if (e) cudaEventDestroy(e);
  if (concurrent_) cudaStreamDestroy(concurrent_);
  if (side_) cudaStreamDestroy(side_);
  if (main_) cudaStreamDestroy(main_);
}

Tensor CudaBackend::device_tensor(DType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const size_t bytes = std::max<size_t>(16, static_cast<size_t>(n) * dtype_size(dtype));
  void* p = nullptr;
  MOELORA_CUDA_CHECK(cudaMalloc(&p, bytes));
  MOELORA_CUDA_CHECK(cudaMemset(p, 0, bytes));
  std::shared_ptr<void> owner(p, [](void* q) { cudaFree(q); });
  return Tensor(p, dtype, shape, Device::kCuda, std::move(owner));
}

Tensor CudaBackend::upload(const Tensor& host, DType dtype) {
  MOELORA_CHECK(host.device() == Device::kCpu && host.contiguous());
  Tensor out = device_tensor(dtype, host.shape());
  const int64_t n = host.numel();
  if (dtype == host.dtype()) {
    MOELORA_CUDA_CHECK(cudaMemcpy(out.data(), host.data(), host.nbytes(), cudaMemcpyHostToDevice));
  } else if (dtype == DType::kBF16) {
    std::vector<uint16_t> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = f32_to_bf16(read_as_f32(host, i));
    MOELORA_CUDA_CHECK(cudaMemcpy(out.data(), v.data(), n * 2, cudaMemcpyHostToDevice));
  } else if (dtype == DType::kF32) {
    Tensor f = to_f32(host);
    MOELORA_CUDA_CHECK(cudaMemcpy(out.data(), f.data(), n * 4, cudaMemcpyHostToDevice));
  } else {
    MOELORA_CHECK_MSG(false, "CUDA upload from {} to {}", dtype_name(host.dtype()), dtype_name(dtype));
  }
  return out;
}

// FP8 stays FP8 (the kernels read it with its block scales); dense weights become bf16. NVFP4
// stays 4-bit wherever a 4-bit kernel takes the shape (nvfp4_experts_ok, nvfp4_linear_ok); other
// NVFP4 weights are dequantised on the host (e2m1 x e4m3 x global, f32) and served as bf16: exact to
// one bf16 rounding, at 16-bit bandwidth (docs/gpu.md).
namespace {
Tensor dense_source(const StoredWeight& w) { return w.format.is_nvfp4() ? dequantize_to_f32(w) : w.data; }

// NVFP4 experts the 4-bit MoE GEMMs take: H and I in whole 64-wide chunks (the layout's 16-row
// tiles follow).
bool nvfp4_experts_ok(const WeightFormat& f, int H, int I) {
  return f.is_nvfp4() && f.block_in == cuda_plan::kNvfp4Group && cuda_plan::moe_mma_shape_ok(H, I);
}
// A dense NVFP4 projection the small-M kernel takes 4-bit.
bool nvfp4_linear_ok(const WeightFormat& f, int in) {
  return f.is_nvfp4() && f.block_in == cuda_plan::kNvfp4Group && in % cuda_plan::kDenseSmallMInMultiple == 0;
}
// An expert part (gate [I, H], up [I, H] or down [H, I]): the test is symmetric in H and I.
bool keeps_nvfp4_experts(const StoredWeight& w) { return nvfp4_experts_ok(w.format, w.in, w.out); }
bool keeps_nvfp4_linear(const StoredWeight& w) { return nvfp4_linear_ok(w.format, w.in); }

// Bytes of the 4-bit form of one expert part: codes, group scales, one global scale.
size_t nvfp4_expert_part_bytes(const StoredWeight& w) {
  const size_t n = static_cast<size_t>(w.out) * w.in;
  return n / 2 + n / cuda_plan::kNvfp4Group + sizeof(float);
}
}  // namespace

size_t CudaBackend::upload_bytes(DType dtype, int64_t numel) const {
  // device_tensor: at least 16 bytes; cudaMalloc hands out 256-byte aligned blocks.
  const size_t bytes = std::max<size_t>(16, static_cast<size_t>(numel) * dtype_size(dtype));
  return (bytes + 255) / 256 * 256;
}

size_t CudaBackend::expert_part_bytes(const StoredWeight& w) const {
  return keeps_nvfp4_experts(w) ? nvfp4_expert_part_bytes(w) : linear_bytes(w);
}

// Absorbed MLA's kv_b copies (mla_absorbed_weights), made in the first step.
size_t CudaBackend::derived_weight_bytes(const ModelShapes& s) const {
  if (s.kv_lora_rank <= 0 || !s.mla_absorbed) return 0;
  return cuda_plan::mla_absorbed_weight_bytes(s.num_layers, s.heads, s.k_head_dim - s.rope_dim, s.v_head_dim,
                                              s.kv_lora_rank);
}

size_t CudaBackend::linear_bytes(const StoredWeight& w) const {
  const int64_t n = int64_t{w.out} * w.in;
  if (keeps_nvfp4_linear(w))
    return upload_bytes(DType::kU8, n / 2) + upload_bytes(DType::kU8, n / cuda_plan::kNvfp4Group) +
           upload_bytes(DType::kF32, w.out);
  if (!w.format.is_fp8()) return upload_bytes(DType::kBF16, n);
  const auto s = w.format.scale_shape(w.out, w.in);
  return upload_bytes(DType::kF8E4M3, n) + upload_bytes(DType::kF32, s[0] * s[1]);
}

LinearWeight CudaBackend::upload_linear(const StoredWeight& sw) {
  LinearWeight lw;
  lw.out = sw.out;
  lw.in = sw.in;
  if (sw.format.is_fp8()) {
    lw.block_out = sw.format.block_out;
    lw.block_in = sw.format.block_in;
    lw.w = upload(sw.data, DType::kF8E4M3);
    lw.scale_inv = upload(sw.scale, DType::kF32);
  } else if (keeps_nvfp4_linear(sw)) {
    // Codes in the kernels' order, group scales as stored ([out, in / 16]), the global scale
    // times 2^26 on every row (fused parts keep their own).
    MOELORA_CHECK(sw.data.contiguous() && sw.scale.contiguous());
    std::vector<uint8_t> codes(int64_t{sw.out} * sw.in / 2);
    cuda_plan::nvfp4_pack_codes(sw.data.ptr<uint8_t>(), sw.out, sw.in, codes.data());
    lw = nvfp4_device_weight(sw.out, sw.in, codes, sw.scale.ptr<uint8_t>(),
                             std::vector<float>(sw.out, sw.global_scale * cuda_plan::kNvfp4GlobalFactor));
  } else {
    lw.w = upload(dense_source(sw), DType::kBF16);
  }
  return lw;
}

// Device copies of the parts' rows (and FP8 scale rows) one after the other. FP8 parts concatenate
// only where fused_split_rows allows: their scale rows then follow each other too, the last
// boundary inside a block becoming split_rows (which dense_gemm.cu honours).
LinearWeight CudaBackend::fuse_linear_rows(const std::vector<const LinearWeight*>& parts) {
  if (parts.empty()) return {};
  const DType dt = parts[0]->w.dtype();
  if (dt == DType::kU8) return fuse_nvfp4_rows(parts);
  const bool fp8 = dt == DType::kF8E4M3;
  if (!fp8 && dt != DType::kBF16) return {};
  for (const LinearWeight* p : parts)
    if (p->w.dtype() != dt || !p->w.contiguous() || fp8 != p->scale_inv.defined() ||
        (fp8 && !p->scale_inv.contiguous()))
      return {};
  const int split = fused_split_rows(parts, fp8);
  if (split < 0) return {};
  LinearWeight f = *parts[0];
  int64_t rows = 0, scale_rows = 0;
  for (const LinearWeight* p : parts) {
    rows += p->out;
    if (fp8) scale_rows += p->scale_inv.dim(0);
  }
  f.out = static_cast<int>(rows);
  f.split_rows = split;
  f.w = device_tensor(dt, {rows, f.in});
  if (fp8) f.scale_inv = device_tensor(DType::kF32, {scale_rows, parts[0]->scale_inv.dim(1)});
  size_t w_off = 0, s_off = 0;
  for (const LinearWeight* p : parts) {
    MOELORA_CUDA_CHECK(cudaMemcpy(static_cast<char*>(f.w.data()) + w_off, p->w.data(), p->w.nbytes(),
                                  cudaMemcpyDeviceToDevice));
    w_off += p->w.nbytes();
    if (!fp8) continue;
    MOELORA_CHECK(p->scale_inv.dim(1) == f.scale_inv.dim(1) && p->scale_inv.dtype() == DType::kF32);
    MOELORA_CUDA_CHECK(cudaMemcpy(static_cast<char*>(f.scale_inv.data()) + s_off, p->scale_inv.data(),
                                  p->scale_inv.nbytes(), cudaMemcpyDeviceToDevice));
    s_off += p->scale_inv.nbytes();
  }
  return f;
}

// A 4-bit weight on the device from its host arrays, already in the kernels' order: codes
// [rows, cols / 2], group scales (rows * cols / 16 bytes), global scales (times 2^26).
LinearWeight CudaBackend::nvfp4_device_weight(int64_t rows, int cols, const std::vector<uint8_t>& codes,
                                              const uint8_t* group_scales, const std::vector<float>& globals) {
  const int64_t scale_bytes = rows * (cols / cuda_plan::kNvfp4Group);
  MOELORA_CHECK(static_cast<int64_t>(codes.size()) == rows * (cols / 2));
  LinearWeight lw;
  lw.out = static_cast<int>(rows);
  lw.in = cols;
  lw.w = device_tensor(DType::kU8, {rows, cols / 2});
  lw.group_scale = device_tensor(DType::kU8, {scale_bytes});
  lw.global_scale = device_tensor(DType::kF32, {static_cast<int64_t>(globals.size())});
  MOELORA_CUDA_CHECK(cudaMemcpy(lw.w.data(), codes.data(), codes.size(), cudaMemcpyHostToDevice));
  MOELORA_CUDA_CHECK(cudaMemcpy(lw.group_scale.data(), group_scales, scale_bytes, cudaMemcpyHostToDevice));
  MOELORA_CUDA_CHECK(
      cudaMemcpy(lw.global_scale.data(), globals.data(), globals.size() * sizeof(float), cudaMemcpyHostToDevice));
  return lw;
}

// NVFP4 parts (upload_linear's 4-bit form): their rows of codes, group scales and per-row global
// scales one after the other; no alignment rule, every row carries its own scales.
LinearWeight CudaBackend::fuse_nvfp4_rows(const std::vector<const LinearWeight*>& parts) {
  for (const LinearWeight* p : parts)
    if (p->w.dtype() != DType::kU8 || p->in != parts[0]->in || !p->w.contiguous() || !p->group_scale.defined() ||
        !p->global_scale.defined() || p->split_rows != 0)
      return {};
  LinearWeight f = *parts[0];
  int64_t rows = 0;
  for (const LinearWeight* p : parts) rows += p->out;
  f.out = static_cast<int>(rows);
  f.split_rows = 0;
  f.w = device_tensor(DType::kU8, {rows, f.in / 2});
  f.group_scale = device_tensor(DType::kU8, {rows * (f.in / cuda_plan::kNvfp4Group)});
  f.global_scale = device_tensor(DType::kF32, {rows});
  size_t off[3] = {0, 0, 0};
  for (const LinearWeight* p : parts) {
    const Tensor* src[3] = {&p->w, &p->group_scale, &p->global_scale};
    Tensor* dst[3] = {&f.w, &f.group_scale, &f.global_scale};
    for (int i = 0; i < 3; ++i) {
      MOELORA_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst[i]->data()) + off[i], src[i]->data(), src[i]->nbytes(),
                                    cudaMemcpyDeviceToDevice));
      off[i] += src[i]->nbytes();
    }
  }
  return f;
}

ExpertWeights CudaBackend::upload_experts(const std::vector<StoredWeight>& gate_w, const std::vector<StoredWeight>& up_w,
                                          const std::vector<StoredWeight>& down_w) {
  const WeightFormat fmt = gate_w[0].format;
  if (keeps_nvfp4_experts(gate_w[0])) return upload_nvfp4_experts(gate_w, up_w, down_w);
  const bool fp8 = fmt.is_fp8();
  const int block_out = fp8 ? fmt.block_out : 128, block_in = fp8 ? fmt.block_in : 128;
  std::vector<Tensor> gate, gate_scale, up, up_scale, down, down_scale;
  for (size_t e = 0; e < gate_w.size(); ++e) {
    gate.push_back(fp8 ? gate_w[e].data : dense_source(gate_w[e]));
    up.push_back(fp8 ? up_w[e].data : dense_source(up_w[e]));
    down.push_back(fp8 ? down_w[e].data : dense_source(down_w[e]));
    if (fp8) {
      gate_scale.push_back(gate_w[e].scale);
      up_scale.push_back(up_w[e].scale);
      down_scale.push_back(down_w[e].scale);
    }
  }
  ExpertWeights ew;
  const int E = static_cast<int>(gate.size());
  const int I = static_cast<int>(gate[0].dim(0)), H = static_cast<int>(gate[0].dim(1));
  ew.num_experts = E;
  ew.hidden = H;
  ew.intermediate = I;
  // Packed expert-major: gate then up rows per expert; per-expert scale blocks likewise
  // (kernels/moe_gemm.cuh "Layouts").
  auto pack = [&](const std::vector<const std::vector<Tensor>*>& parts, int64_t rows_per_expert, int64_t cols,
                  DType dt) {
    const size_t esz = dtype_size(dt);
    std::vector<uint8_t> host(static_cast<size_t>(E) * rows_per_expert * cols * esz);
    size_t off = 0;
    for (int e = 0; e < E; ++e)
      for (const auto* part : parts) {
        const Tensor& t = (*part)[e];
        if (dt == t.dtype()) {
          std::memcpy(host.data() + off, t.data(), t.nbytes());
        } else if (dt == DType::kBF16) {
          auto* d = reinterpret_cast<uint16_t*>(host.data() + off);
          for (int64_t i = 0; i < t.numel(); ++i) d[i] = f32_to_bf16(read_as_f32(t, i));
        } else {  // f32 scales
          auto* d = reinterpret_cast<float*>(host.data() + off);
          for (int64_t i = 0; i < t.numel(); ++i) d[i] = read_as_f32(t, i);
        }
        off += static_cast<size_t>(t.numel()) * esz;
      }
    Tensor out = device_tensor(dt, {static_cast<int64_t>(E) * rows_per_expert, cols});
    MOELORA_CUDA_CHECK(cudaMemcpy(out.data(), host.data(), host.size(), cudaMemcpyHostToDevice));
    return out;
  };
  const DType wt = fp8 ? DType::kF8E4M3 : DType::kBF16;
  ew.gate_up.w = pack({&gate, &up}, 2 * I, H, wt);
  ew.gate_up.out = E * 2 * I;
  ew.gate_up.in = H;
  ew.gate_up.split_rows = I;
  ew.down.w = pack({&down}, H, I, wt);
  ew.down.out = E * H;
  ew.down.in = I;
  if (fp8) {
    const int64_t ib = (I + block_out - 1) / block_out, hb = (H + block_in - 1) / block_in;
    ew.gate_up.scale_inv = pack({&gate_scale, &up_scale}, 2 * ib, hb, DType::kF32);
    ew.down.scale_inv = pack({&down_scale}, (H + block_out - 1) / block_out, (I + block_in - 1) / block_in,
                             DType::kF32);
  }
  for (LinearWeight* lw : {&ew.gate_up, &ew.down}) {
    lw->block_out = block_out;
    lw->block_in = block_in;
  }
  return ew;
}

// NVFP4 experts in the grouped GEMMs' 4-bit layout (moe_gemm.cuh "Layouts", cuda_plan/nvfp4_layout.h):
// expert-major rows (gate then up per expert; down), codes and group scales repacked, the global
// scales times 2^26 (the kernels' products carry 2^-26) per expert and part.
ExpertWeights CudaBackend::upload_nvfp4_experts(const std::vector<StoredWeight>& gate_w,
                                                const std::vector<StoredWeight>& up_w,
                                                const std::vector<StoredWeight>& down_w) {
  const int E = static_cast<int>(gate_w.size());
  const int I = gate_w[0].out, H = gate_w[0].in;
  auto pack = [&](const std::vector<const std::vector<StoredWeight>*>& parts, int rows, int cols) {
    const int64_t total = static_cast<int64_t>(E) * static_cast<int64_t>(parts.size()) * rows;
    const int64_t code_row = cols / 2, scale_row = cols / cuda_plan::kNvfp4Group;
    std::vector<uint8_t> codes(total * code_row), scales(total * scale_row), packed(total * scale_row);
    std::vector<float> globals;
    int64_t r = 0;
    for (int e = 0; e < E; ++e)
      for (const auto* part : parts) {
        const StoredWeight& w = (*part)[e];
        MOELORA_CHECK(w.out == rows && w.in == cols && w.data.contiguous() && w.scale.contiguous());
        cuda_plan::nvfp4_pack_codes(w.data.ptr<uint8_t>(), rows, cols, codes.data() + r * code_row);
        std::memcpy(scales.data() + r * scale_row, w.scale.ptr<uint8_t>(), static_cast<size_t>(rows) * scale_row);
        globals.push_back(w.global_scale * cuda_plan::kNvfp4GlobalFactor);
        r += rows;
      }
    cuda_plan::nvfp4_pack_scales(scales.data(), total, cols, packed.data());
    return nvfp4_device_weight(total, cols, codes, packed.data(), globals);
  };
  ExpertWeights ew;
  ew.num_experts = E;
  ew.hidden = H;
  ew.intermediate = I;
  ew.gate_up = pack({&gate_w, &up_w}, I, H);
  ew.gate_up.split_rows = I;
  ew.down = pack({&down_w}, H, I);
  return ew;
}

Tensor CudaBackend::random_tensor(DType dtype, const std::vector<int64_t>& shape, uint64_t seed, float scale) {
  Tensor t = device_tensor(dtype, shape);
  cuda::RandomFillParams p;
  p.out = t.data();
  p.n = t.numel();
  p.seed = seed;
  p.scale = scale;
  switch (dtype) {
    case DType::kF32: p.type = cuda::RandomFillType::kF32; break;
    case DType::kBF16: p.type = cuda::RandomFillType::kBF16; break;
    case DType::kF8E4M3: p.type = cuda::RandomFillType::kFP8; break;
    case DType::kU8: p.type = cuda::RandomFillType::kFP8; break;  // bytes: any finite e4m3 pattern
    default: MOELORA_CHECK_MSG(false, "random_tensor of {}", dtype_name(dtype));
  }
  cuda::launch_random_fill(p, main_);
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_));
  return t;
}

// NVFP4 weights for `bench --random-weights`, in the 4-bit forms above: random codes (any byte is
// two e2m1 codes), random e4m3 group scales (any finite code, up to 448) and `globals` global
// scales that keep weights ~1e-2 like trained ones (|e2m1 * e4m3| <= 2688, times 2^-26 in the
// kernels, times the stored global). The layout of random values does not matter; the sizes do.
LinearWeight CudaBackend::random_nvfp4_weight(int64_t rows, int cols, int64_t globals, uint64_t& seed) {
  LinearWeight w;
  w.out = static_cast<int>(rows);
  w.in = cols;
  w.w = random_tensor(DType::kU8, {rows, cols / 2}, ++seed, 1.0f);
  w.group_scale = random_tensor(DType::kU8, {rows * (cols / cuda_plan::kNvfp4Group)}, ++seed, 1.0f);
  w.global_scale = random_tensor(DType::kF32, {globals}, ++seed, 4e-6f * cuda_plan::kNvfp4GlobalFactor);
  return w;
}

// A dense projection: a global scale per row, as upload_linear keeps them.
LinearWeight CudaBackend::random_linear(int out, int in, const WeightFormat& fmt, uint64_t seed) {
  if (!nvfp4_linear_ok(fmt, in)) return {};
  return random_nvfp4_weight(out, in, out, seed);
}

// Experts: a global scale per expert and part, as upload_nvfp4_experts keeps them.
ExpertWeights CudaBackend::random_experts(int E, int H, int I, const WeightFormat& fmt, uint64_t seed) {
  if (!nvfp4_experts_ok(fmt, H, I)) return {};
  ExpertWeights ew;
  ew.num_experts = E;
  ew.hidden = H;
  ew.intermediate = I;
  ew.gate_up = random_nvfp4_weight(int64_t{E} * 2 * I, H, int64_t{E} * 2, seed);
  ew.gate_up.split_rows = I;
  ew.down = random_nvfp4_weight(int64_t{E} * H, I, E, seed);
  return ew;
}

KvLayer CudaBackend::alloc_kv_layer(int num_pages, int page_size, int kv_heads, int k_head_dim, int v_head_dim) {
  KvLayer kv;
  kv.page_size = page_size;
  kv.kv_heads = kv_heads;
  kv.k_head_dim = k_head_dim;
  kv.v_head_dim = v_head_dim;
  // One extra page at the end takes the writes of the padding tokens of graph-replayed steps.
  kv.k = device_tensor(DType::kBF16, {num_pages + 1, page_size, static_cast<int64_t>(kv_heads) * k_head_dim});
  kv.v = device_tensor(DType::kBF16, {num_pages + 1, page_size, static_cast<int64_t>(kv_heads) * v_head_dim});
  pad_page_ = num_pages;
  page_size_ = page_size;
  return kv;
}

LoraModuleTable CudaBackend::alloc_lora_table(int num_slots, int in, int out) {
  return make_lora_table(num_slots, in, out, [this](DType dt, int64_t n) { return device_tensor(dt, {n}); });
}

MoeLoraTable CudaBackend::alloc_moe_lora_table(int num_slots, int num_experts, int hidden, int intermediate) {
  return make_moe_lora_table(num_slots, num_experts, hidden, intermediate, [this](DType dt, int64_t n) { return device_tensor(dt, {n}); });
}

namespace {
// Table writes happen between steps on the main stream's order (the caller owns both), so a
// running step never sees a half-written slot. A writer queues every entry of one slot (values
// kept alive in the writer) and synchronises once. (The engine places adapters with
// begin_lora_placement instead: cuda_lora_placement.cu, off its thread.)
class TableWriter {
 public:
  explicit TableWriter(cudaStream_t s) : s_(s) {}
  ~TableWriter() { MOELORA_CUDA_CHECK(cudaStreamSynchronize(s_)); }
  void put_i64(const Tensor& table, int slot, int64_t v) { put(table, slot, &(i64_[n64_++] = v), 8); }
  void put_i32(const Tensor& table, int slot, int32_t v) { put(table, slot, &(i32_[n32_++] = v), 4); }

 private:
  void put(const Tensor& table, int slot, const void* v, size_t bytes) {
    MOELORA_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(table.data()) + slot * bytes, v, bytes,
                                       cudaMemcpyHostToDevice, s_));
  }
  cudaStream_t s_;
  int64_t i64_[8];
  int32_t i32_[2];
  int n64_ = 0, n32_ = 0;
};
int64_t addr(const Tensor& t, int rank) { return rank ? reinterpret_cast<int64_t>(t.data()) : 0; }
}  // namespace

void CudaBackend::set_lora_slot(LoraModuleTable& t, int slot, const Tensor& a, const Tensor& b, int rank) {
  MOELORA_CHECK(slot >= 0 && slot < t.num_slots);
  MOELORA_CHECK_MSG(rank <= cuda::kLoraMaxRank, "LoRA rank {} above the CUDA kernels' {}", rank, cuda::kLoraMaxRank);
  {
    TableWriter w(main_);
    w.put_i64(t.a_ptrs, slot, addr(a, rank));
    w.put_i64(t.b_ptrs, slot, addr(b, rank));
    w.put_i32(t.ranks, slot, rank);
  }
  t.host_rank[slot] = rank;
  raise_rank_ceiling(rank);
}

void CudaBackend::set_moe_lora_slot(MoeLoraTable& t, int slot, const MoeLoraSlot& s) {
  MOELORA_CHECK(slot >= 0 && slot < t.num_slots);
  {
    TableWriter w(main_);
    w.put_i64(t.gu_a, slot, addr(s.gu_a, s.gu_rank));
    w.put_i64(t.gu_b, slot, addr(s.gu_b, s.gu_rank));
    w.put_i64(t.gu_a_expert_stride, slot, s.gu_a_stride);
    w.put_i64(t.gu_b_expert_stride, slot, s.gu_b_stride);
    w.put_i64(t.d_a, slot, addr(s.d_a, s.d_rank));
    w.put_i64(t.d_b, slot, addr(s.d_b, s.d_rank));
    w.put_i64(t.d_a_expert_stride, slot, s.d_a_stride);
    w.put_i64(t.d_b_expert_stride, slot, s.d_b_stride);
    w.put_i32(t.gu_rank, slot, s.gu_rank);
    w.put_i32(t.d_rank, slot, s.d_rank);
  }
  t.host_gu_rank[slot] = s.gu_rank;
  t.host_d_rank[slot] = s.d_rank;
  raise_rank_ceiling(std::max(s.gu_rank, s.d_rank));
}

void* CudaBackend::arena_alloc(size_t bytes) {
  const size_t aligned = (bytes + 255) / 256 * 256;
  void* p = nullptr;
  if (arena_used_ + aligned <= arena_bytes_) {
    p = static_cast<char*>(arena_) + arena_used_;
  } else {
    // A step larger than any the arena was sized for (the engine sizes it with a warm-up of its
    // largest step; benchmarks and tests may go beyond): an eager step takes the rest from its
    // own allocations, freed at the next begin_step, which also grows the arena to the peak. A
    // capture cannot allocate, but it never comes first: the same shape ran eagerly before.
    MOELORA_CHECK_MSG(mode_ != StepMode::kCapture,
                      "a captured step needs more scratch than the {} byte arena holds", arena_bytes_);
    // Layers repeat the same allocations at the same (logical) offsets after scratch_release:
    // reuse this step's spill made at that offset, so a step holds about its peak, not one spill
    // per layer. Two live allocations never share an offset, so a reused spill is free.
    for (const Spill& sp : spills_)
      if (sp.offset == arena_used_ && sp.bytes >= aligned) p = sp.ptr;
    if (!p) {
      MOELORA_CUDA_CHECK(cudaMalloc(&p, aligned));
      spills_.push_back({arena_used_, aligned, p});
    }
  }
  arena_used_ += aligned;
  arena_peak_ = std::max(arena_peak_, arena_used_);
  return p;
}

void CudaBackend::fit_scratch(size_t bytes) {
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_));
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(side_));
  for (const Spill& sp : spills_) MOELORA_CUDA_CHECK(cudaFree(sp.ptr));
  spills_.clear();
  arena_peak_ = 0;
  if (bytes == arena_bytes_) return;
  if (graphs_) graphs_->clear();  // their kernels read addresses in the old arena
  MOELORA_CUDA_CHECK(cudaFree(arena_));
  arena_ = nullptr;
  arena_bytes_ = bytes;
  MOELORA_CUDA_CHECK(cudaMalloc(&arena_, arena_bytes_));
}

void CudaBackend::sync_main() {
  const auto t0 = std::chrono::steady_clock::now();
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(main_));
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string CudaBackend::device_description() const {
  const cuda::DeviceInfo d = cuda::query_device();
  return d.available ? d.name : "cuda";
}

void CudaBackend::device_timer_begin() {
  if (!timer_begin_) {
    MOELORA_CUDA_CHECK(cudaEventCreate(&timer_begin_));
    MOELORA_CUDA_CHECK(cudaEventCreate(&timer_end_));
  }
  MOELORA_CUDA_CHECK(cudaEventRecord(timer_begin_, main_));
}

double CudaBackend::device_timer_end_us() {
  MOELORA_CHECK_MSG(timer_begin_ != nullptr, "device_timer_end_us without device_timer_begin");
  MOELORA_CUDA_CHECK(cudaEventRecord(timer_end_, main_));
  MOELORA_CUDA_CHECK(cudaEventSynchronize(timer_end_));
  float ms = 0;
  MOELORA_CUDA_CHECK(cudaEventElapsedTime(&ms, timer_begin_, timer_end_));
  return ms * 1000.0;
}

bool CudaBackend::device_memory(size_t* free, size_t* total) {
  return cudaMemGetInfo(free, total) == cudaSuccess;
}

Tensor CudaBackend::alloc(int64_t rows, int64_t cols, DType dtype) {
  void* p = arena_alloc(static_cast<size_t>(rows * cols) * dtype_size(dtype));
  return Tensor(p, dtype, {rows, cols}, Device::kCuda);
}

void* CudaBackend::StepMeta::plan_alloc(size_t bytes) {
  const size_t aligned = (bytes + 255) / 256 * 256;
  MOELORA_CHECK_MSG(plan_used + aligned <= plan_bytes, "step plans exceed their {} byte region", plan_bytes);
  void* p = plan_region + plan_used;
  plan_used += aligned;
  return p;
}

const float* CudaBackend::device_inv_freq(const RopeTable& rope) {
  auto it = inv_freq_.find(rope.inv_freq.data());
  if (it != inv_freq_.end()) return static_cast<const float*>(it->second.get());
  void* p = nullptr;
  MOELORA_CUDA_CHECK(cudaMalloc(&p, rope.inv_freq.size() * 4));
  MOELORA_CUDA_CHECK(cudaMemcpy(p, rope.inv_freq.data(), rope.inv_freq.size() * 4, cudaMemcpyHostToDevice));
  std::shared_ptr<void> owner(p, [](void* q) { cudaFree(q); });
  inv_freq_[rope.inv_freq.data()] = owner;
  return static_cast<const float*>(p);
}

Tensor CudaBackend::to_host_f32(const Tensor& t) {
  flush_route();
  Tensor out = Tensor::empty_host(DType::kF32, {t.rows(), t.cols()});
  if (t.dtype() == DType::kF32) {
    MOELORA_CUDA_CHECK(cudaMemcpy2DAsync(out.data(), t.cols() * 4, t.data(), t.ld() * 4, t.cols() * 4, t.rows(),
                                         cudaMemcpyDeviceToHost, main_));
    sync_main();
    return out;
  }
  MOELORA_CHECK(t.dtype() == DType::kBF16);
  std::vector<uint16_t> tmp(static_cast<size_t>(t.rows() * t.cols()));
  MOELORA_CUDA_CHECK(cudaMemcpy2DAsync(tmp.data(), t.cols() * 2, t.data(), t.ld() * 2, t.cols() * 2, t.rows(),
                                       cudaMemcpyDeviceToHost, main_));
  sync_main();
  for (size_t i = 0; i < tmp.size(); ++i) out.ptr<float>()[i] = bf16_to_f32(tmp[i]);
  return out;
}

}  // namespace moelora
