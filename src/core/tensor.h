// Tensor: a typed, shaped view of memory on one device, optionally keeping that memory alive.
// Row-major; 2-D tensors may have a row stride (`ld`) larger than their width so that a column
// slice (q_nope / q_pe, a gate half) is a view, not a copy.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"

namespace moelora {

enum class Device : uint8_t { kCpu, kCuda };

class Tensor {
 public:
  static constexpr int kMaxDims = 4;

  Tensor() = default;
  // A view of `data` (not owned unless `owner` is given).
  Tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::kCpu,
         std::shared_ptr<void> owner = nullptr);
  Tensor(void* data, DType dtype, const std::vector<int64_t>& shape, Device device = Device::kCpu,
         std::shared_ptr<void> owner = nullptr);

  // Allocates zeroed, 64-byte aligned host memory.
  static Tensor empty_host(DType dtype, const std::vector<int64_t>& shape);

  bool defined() const { return data_ != nullptr || ndim_ > 0; }
  void* data() const { return data_; }
  template <typename T> T* ptr() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int ndim() const { return ndim_; }
  int64_t dim(int i) const {
    MOELORA_CHECK(i >= 0 && i < ndim_);
    return shape_[i];
  }
  std::vector<int64_t> shape() const { return {shape_.begin(), shape_.begin() + ndim_}; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }

  // 2-D helpers.
  int64_t rows() const { return ndim_ == 2 ? shape_[0] : numel() / cols(); }
  int64_t cols() const { return ndim_ == 0 ? 1 : shape_[ndim_ - 1]; }
  int64_t ld() const { return ld_ ? ld_ : cols(); }
  bool contiguous() const { return ld_ == 0 || ld_ == cols(); }

  // Views sharing memory and ownership.
  Tensor reshape(const std::vector<int64_t>& shape) const;
  // Rows [begin, begin+count) of the leading dimension.
  Tensor slice_rows(int64_t begin, int64_t count) const;
  // Columns [begin, begin+count) of a 2-D tensor (a strided view).
  Tensor slice_cols(int64_t begin, int64_t count) const;

  std::string shape_string() const;
  const std::shared_ptr<void>& owner() const { return owner_; }

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCpu;
  std::array<int64_t, kMaxDims> shape_{};
  int ndim_ = 0;
  int64_t ld_ = 0;  // row stride in elements for 2-D views; 0 = contiguous
  std::shared_ptr<void> owner_;
};

// Reads element i of a host tensor of any float dtype as float32 (exact for bf16/f16/fp8).
float read_as_f32(const Tensor& t, int64_t i);
// Reads element i of a host integer tensor (I64, I32, I16, I8, U8).
int64_t read_as_i64(const Tensor& t, int64_t i);
// Copies a host tensor of any float dtype into a new contiguous float32 tensor.
Tensor to_f32(const Tensor& t);

}  // namespace moelora
