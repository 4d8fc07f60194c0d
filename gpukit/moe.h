// Host-side builders for the MoE op-suite cases (tests/ops/moe_test.cu) and the MoE workbench
// (dev/moe_bench.cu): random experts (FP8 with 128x128 block scales, or bf16), per-slot MoE LoRA
// factors in every layout the table allows (per-expert or shared A/B via stride 0, mixed ranks),
// their device copies, and the CPU reference (cpu::moe) run on exactly what the GPU sees
// (bf16-rounded inputs, FP8 dequantised exactly). Experts the batch does not touch are left out
// of the reference (ids are remapped), so full-size shapes stay cheap on the CPU.
// CUDA sources only: moe_forward.cuh declares device helpers (the kit's moe.cu holds the code).
#pragma once

#include <cstdint>
#include <vector>

#include "backends/cuda/kernels/moe_forward.cuh"
#include "gpukit/device_array.h"
#include "gpukit/random.h"

namespace moelora::gpukit {

struct HostExperts {
  cuda::MoeShape shape;
  bool fp8 = true;
  bool nvfp4 = false;               // NVFP4 experts (then fp8 is false)
  std::vector<uint8_t> gu_q, d_q;   // fp8 codes [E*2I, H], [E*H, I]; NVFP4: [E*2I, H/2], [E*H, I/2]
  std::vector<float> gu_s, d_s;     // [E*2*ceil(I/128), ceil(H/128)], [E*ceil(H/128), ceil(I/128)]
  std::vector<uint16_t> gu_b, d_b;  // bf16 weights (when neither)
  // NVFP4, as a checkpoint holds them: e4m3 group scales [rows, K/16], global scales per expert
  // and part (gate, up) / per expert.
  std::vector<uint8_t> gu_g, d_g;
  std::vector<float> gu_gs, d_gs;

  // FP8: random_fp8 codes and scales; NVFP4: random codes, group scales and global scales with
  // weights of about N(0, 1/sqrt(K))'s size; bf16: N(0, 1/sqrt(K)) (FastRng, from `seed`).
  void generate(uint64_t seed);
  // Exact f32 copies of expert e: gu [2I, H], d [H, I].
  void dequant(int e, float* gu, float* d) const;
};

struct DeviceExperts {
  DeviceArray<uint8_t> gu, d;  // FP8 codes, NVFP4 codes in the kernels' order, or the bf16 weights' bytes
  DeviceArray<float> gu_s, d_s;
  DeviceArray<uint8_t> gu_g, d_g;     // NVFP4 group scales in the kernels' order (cuda_plan/nvfp4_layout.h)
  DeviceArray<float> gu_gs, d_gs;     // NVFP4 global scales * 2^26
  void upload(const HostExperts& h);
};

// One adapter slot's MoE LoRA. Factor f in {gu_a, gu_b, d_a, d_b} is either per expert
// ([E, rows, cols], stride rows*cols) or shared (one [rows, cols], stride 0).
struct HostLoraSlot {
  int gu_rank = 0, d_rank = 0;
  bool share[4] = {false, false, false, false};  // gu_a, gu_b, d_a, d_b
  std::vector<uint16_t> f[4];
};

// Rows and columns of factor `which` (0 gu_a [r, H], 1 gu_b [2I, r], 2 d_a [r, I], 3 d_b [H, r]).
void lora_factor_dims(const cuda::MoeShape& s, const HostLoraSlot& l, int which, int* rows, int* cols);

// A ~ N(0, 1/in) rows, B ~ N(0, 0.25/r): the delta is about half the base pre-activation, large
// enough that a wrong adapter, half or expert fails the tolerance by far.
void generate_lora(HostLoraSlot& l, const cuda::MoeShape& s, FastRng& b);

// The slots' factors on the device and the pointer / stride / rank tables moe_forward reads.
struct DeviceLora {
  std::vector<DeviceArray<uint16_t>> bufs;
  DeviceArray<int64_t> ptr[4], stride[4];
  DeviceArray<int32_t> gu_rank, d_rank;
  cuda::MoeLoraDevice dev;

  void upload(const std::vector<HostLoraSlot>& slots, const cuda::MoeShape& s);
};

// CPU reference of the routed MoE on the experts the batch touches. `ids` may hold ids outside
// [0, E): such pairs contribute nothing (the GPU drops them), which the reference expresses as
// weight 0 on expert 0.
struct MoeReference {
  std::vector<float> out;  // [T, H]
  std::vector<float> act;  // [T*k, I] per pair (valid pairs only)
  std::vector<float> delta_gu, delta_d;  // [T*k, 2I], [T*k, H] LoRA deltas per pair (zeros without)
  // With `down_input`: the layer's output from down + weighted sum applied to that input (base
  // down through e4m3 when fp8_activations, LoRA down on it as given).
  std::vector<float> out_from_down_input;  // [T, H]
};

// `down_input`, when given ([T*k, I], e.g. the GPU's bf16 act), feeds the per-pair down-LoRA
// stage instead of the reference's own act: a rank-1 delta is one dot product whose relative error
// from the bf16 rounding of act is unbounded under cancellation, so the stage is checked on the
// input the kernel actually had (the final output is still checked end to end against cpu::moe).
// `fp8_activations`: the W8A8 regime (cpu::MoeArgs::fp8_activations) for out, act and
// out_from_down_input.
MoeReference moe_reference(const HostExperts& ex, const std::vector<float>& x, int T, const std::vector<int32_t>& ids,
                           const std::vector<float>& weights, const std::vector<int32_t>* slot,
                           const std::vector<HostLoraSlot>* lora, const std::vector<float>* down_input = nullptr,
                           bool fp8_activations = false);

}  // namespace moelora::gpukit
