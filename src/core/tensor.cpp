#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

namespace moelora {

Tensor::Tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device,
               std::shared_ptr<void> owner)
    : Tensor(data, dtype, std::vector<int64_t>(shape), device, std::move(owner)) {}

Tensor::Tensor(void* data, DType dtype, const std::vector<int64_t>& shape, Device device,
               std::shared_ptr<void> owner)
    : data_(data), dtype_(dtype), device_(device), owner_(std::move(owner)) {
  MOELORA_CHECK_MSG(static_cast<int>(shape.size()) <= kMaxDims, "tensor rank {} > {}", shape.size(),
                    kMaxDims);
  ndim_ = static_cast<int>(shape.size());
  for (int i = 0; i < ndim_; ++i) {
    MOELORA_CHECK(shape[i] >= 0);
    shape_[i] = shape[i];
  }
}

Tensor Tensor::empty_host(DType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
  size_t alloc = (bytes + 63) / 64 * 64;
  if (alloc == 0) alloc = 64;
  void* p = std::aligned_alloc(64, alloc);
  MOELORA_CHECK_MSG(p != nullptr, "host allocation of {} bytes failed", alloc);
  std::memset(p, 0, alloc);
  std::shared_ptr<void> owner(p, [](void* q) { std::free(q); });
  return Tensor(p, dtype, shape, Device::kCpu, std::move(owner));
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= shape_[i];
  return n;
}

Tensor Tensor::reshape(const std::vector<int64_t>& shape) const {
  MOELORA_CHECK_MSG(contiguous(), "reshape of a strided view");
  Tensor t(data_, dtype_, shape, device_, owner_);
  MOELORA_CHECK_MSG(t.numel() == numel(), "reshape {} -> {} changes the element count",
                    shape_string(), t.shape_string());
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t count) const {
  MOELORA_CHECK(ndim_ >= 1 && begin >= 0 && count >= 0 && begin + count <= shape_[0]);
  int64_t row_elems = 1;
  if (ndim_ == 2) {
    row_elems = ld();
  } else {
    for (int i = 1; i < ndim_; ++i) row_elems *= shape_[i];
  }
  Tensor t = *this;
  t.data_ = static_cast<char*>(data_) + begin * row_elems * static_cast<int64_t>(dtype_size(dtype_));
  t.shape_[0] = count;
  return t;
}

Tensor Tensor::slice_cols(int64_t begin, int64_t count) const {
  MOELORA_CHECK(ndim_ == 2 && begin >= 0 && count >= 0 && begin + count <= shape_[1]);
  Tensor t = *this;
  t.ld_ = ld();
  t.data_ = static_cast<char*>(data_) + begin * static_cast<int64_t>(dtype_size(dtype_));
  t.shape_[1] = count;
  return t;
}

std::string Tensor::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim_; ++i) s += fmt::format("{}{}", i ? ", " : "", shape_[i]);
  return s + "]";
}

float read_as_f32(const Tensor& t, int64_t i) {
  MOELORA_CHECK(t.device() == Device::kCpu && t.contiguous());
  switch (t.dtype()) {
    case DType::kF32: return t.ptr<float>()[i];
    case DType::kF64: return static_cast<float>(t.ptr<double>()[i]);
    case DType::kBF16: return bf16_to_f32(t.ptr<uint16_t>()[i]);
    case DType::kF16: return f16_to_f32(t.ptr<uint16_t>()[i]);
    case DType::kF8E4M3: return fp8e4m3_to_f32(t.ptr<uint8_t>()[i]);
    default: MOELORA_CHECK_MSG(false, "read_as_f32 of {}", dtype_name(t.dtype()));
  }
  return 0.0f;
}

int64_t read_as_i64(const Tensor& t, int64_t i) {
  MOELORA_CHECK(t.device() == Device::kCpu && t.contiguous());
  switch (t.dtype()) {
    case DType::kI64: return t.ptr<int64_t>()[i];
    case DType::kI32: return t.ptr<int32_t>()[i];
    case DType::kI16: return t.ptr<int16_t>()[i];
    case DType::kI8: return t.ptr<int8_t>()[i];
    case DType::kU8: return t.ptr<uint8_t>()[i];
    default: MOELORA_CHECK_MSG(false, "read_as_i64 of {}", dtype_name(t.dtype()));
  }
  return 0;
}

Tensor to_f32(const Tensor& t) {
  Tensor out = Tensor::empty_host(DType::kF32, t.shape());
  const int64_t n = t.numel();
  float* o = out.ptr<float>();
  if (t.dtype() == DType::kF32) {
    std::memcpy(o, t.data(), n * 4);
    return out;
  }
  for (int64_t i = 0; i < n; ++i) o[i] = read_as_f32(t, i);
  return out;
}

}  // namespace moelora
