#include "core/dtype.h"

#include <cmath>

namespace moelora {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF64: case DType::kI64: return 8;
    case DType::kF32: case DType::kI32: return 4;
    case DType::kBF16: case DType::kF16: case DType::kI16: return 2;
    case DType::kF8E4M3: case DType::kI8: case DType::kU8: case DType::kBool: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
    case DType::kI16: return "I16";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

std::optional<DType> parse_safetensors_dtype(std::string_view n) {
  if (n == "F32") return DType::kF32;
  if (n == "F64") return DType::kF64;
  if (n == "BF16") return DType::kBF16;
  if (n == "F16") return DType::kF16;
  if (n == "F8_E4M3") return DType::kF8E4M3;
  if (n == "I64") return DType::kI64;
  if (n == "I32") return DType::kI32;
  if (n == "I16") return DType::kI16;
  if (n == "I8") return DType::kI8;
  if (n == "U8") return DType::kU8;
  if (n == "BOOL") return DType::kBool;
  return std::nullopt;
}

bool is_float_dtype(DType t) {
  return t == DType::kF32 || t == DType::kF64 || t == DType::kBF16 || t == DType::kF16 ||
         t == DType::kF8E4M3;
}

float f16_to_f32(uint16_t v) {
  const uint32_t sign = (v >> 15) & 1u;
  const uint32_t exp = (v >> 10) & 0x1fu;
  const uint32_t mant = v & 0x3ffu;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(mant), -24);  // subnormal: mant * 2^-14 / 1024
  } else if (exp == 31) {
    mag = mant ? NAN : INFINITY;
  } else {
    mag = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -mag : mag;
}

uint16_t f32_to_f16(float f) {
  const uint32_t b = f32_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  if (std::isnan(f)) return sign | 0x7e00u;
  float a = std::fabs(f);
  if (a >= 65520.0f) return sign | 0x7c00u;  // rounds to inf
  if (a < std::ldexp(1.0f, -25)) return sign;  // rounds to zero (ties to even at 2^-25)
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp16 = e - 1 + 15;
  if (exp16 <= 0) {  // subnormal: quantum 2^-24
    float q = std::nearbyint(std::ldexp(a, 24));
    return sign | static_cast<uint16_t>(q);
  }
  float q = std::nearbyint(std::ldexp(a, 10 - (e - 1)));  // 11-bit significand in [1024, 2048]
  uint32_t sig = static_cast<uint32_t>(q);
  if (sig == 2048) { sig = 1024; ++exp16; }
  if (exp16 >= 31) return sign | 0x7c00u;
  return sign | static_cast<uint16_t>((exp16 << 10) | (sig & 0x3ffu));
}

float fp8e4m3_to_f32(uint8_t v) {
  const uint32_t sign = (v >> 7) & 1u;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t mant = v & 0x7u;
  float mag;
  if (exp == 0xf && mant == 0x7) {
    mag = NAN;
  } else if (exp == 0) {
    mag = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant/8 * 2^-6
  } else {
    mag = std::ldexp(static_cast<float>(mant | 0x8u), static_cast<int>(exp) - 10);
  }
  return sign ? -mag : mag;
}

float fp4e2m1_to_f32(uint8_t nibble) {
  const uint32_t sign = (nibble >> 3) & 1u;
  const uint32_t exp = (nibble >> 1) & 0x3u;
  const uint32_t mant = nibble & 0x1u;
  // exp 0 is subnormal: mant * 2^-1; otherwise (2 + mant) * 2^(exp - 2), i.e. (1 + mant/2) * 2^(exp - 1).
  const float mag = exp == 0 ? 0.5f * static_cast<float>(mant) : std::ldexp(static_cast<float>(2 + mant), static_cast<int>(exp) - 2);
  return sign ? -mag : mag;
}

uint8_t f32_to_fp8e4m3(float f) {
  const uint8_t sign = (f32_to_bits(f) >> 24) & 0x80u;
  if (std::isnan(f)) return sign | 0x7f;
  float a = std::fabs(f);
  if (a >= kFp8E4M3Max) return sign | 0x7e;  // saturate to 448
  if (a < std::ldexp(1.0f, -10)) return sign;  // below half the smallest subnormal (ties to 0)
  int e;
  std::frexp(a, &e);
  int exp8 = e - 1 + 7;
  if (exp8 <= 0) {  // subnormal: quantum 2^-9
    float q = std::nearbyint(std::ldexp(a, 9));
    if (q >= 8.0f) return sign | 0x08;  // rounded up into the first normal
    return sign | static_cast<uint8_t>(q);
  }
  float q = std::nearbyint(std::ldexp(a, 3 - (e - 1)));  // 4-bit significand in [8, 16]
  uint32_t sig = static_cast<uint32_t>(q);
  if (sig == 16) { sig = 8; ++exp8; }
  if (exp8 > 15 || (exp8 == 15 && (sig & 7u) == 7u)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((exp8 << 3) | (sig & 7u));
}

}  // namespace moelora
