// Element types and exact scalar conversions. Everything here is host code usable from CUDA
// translation units too (no device intrinsics): the CPU reference decodes bf16/f16/fp8 exactly.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace moelora {

enum class DType : uint8_t { kF32, kF64, kBF16, kF16, kF8E4M3, kI64, kI32, kI16, kI8, kU8, kBool };

// Bytes per element.
size_t dtype_size(DType t);
// The safetensors spelling ("F32", "BF16", "F8_E4M3", ...).
const char* dtype_name(DType t);
// Parses a safetensors dtype name; nullopt for names moelora does not read (F8_E5M2, C64, ...).
std::optional<DType> parse_safetensors_dtype(std::string_view name);
bool is_float_dtype(DType t);

inline float bits_to_f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// bfloat16 is the upper half of a float32: decoding is exact.
inline float bf16_to_f32(uint16_t v) { return bits_to_f32(static_cast<uint32_t>(v) << 16); }
// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t b = f32_to_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>((b + rounding) >> 16);
}

// IEEE half: exact decode including subnormals, inf and NaN.
float f16_to_f32(uint16_t v);
uint16_t f32_to_f16(float f);

// float8 e4m3fn (OCP "FN" variant used by torch.float8_e4m3fn and safetensors F8_E4M3):
// 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN; max 448.
float fp8e4m3_to_f32(uint8_t v);
// Round to nearest even with saturation to +-448 (how torch casts after clamping).
uint8_t f32_to_fp8e4m3(float f);

constexpr float kFp8E4M3Max = 448.0f;

// float4 e2m1 (NVFP4's element type), the low 4 bits of `nibble`: 1 sign, 2 exponent (bias 1),
// 1 mantissa bit; no infinities or NaN; values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
float fp4e2m1_to_f32(uint8_t nibble);

}  // namespace moelora
