// safetensors reader: memory-mapped, validated exactly as the reference implementation does
// (header size cap, JSON, dtypes, contiguous non-overlapping offsets that cover the whole data
// area, byte size == numel * dtype size, no trailing bytes) plus duplicate-name detection.
// A malformed file is a clear error, never a crash or a huge allocation.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "io/mapped_file.h"

namespace moelora {

constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

struct SafetensorsEntry {
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offset in the data area
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  // Maps and validates a file.
  static Result<std::shared_ptr<SafetensorsFile>> open(const std::string& path);
  // Validates an in-memory buffer (used by the fuzz target and tests); `buffer` must outlive the file.
  static Result<std::shared_ptr<SafetensorsFile>> parse(std::shared_ptr<const std::string> buffer,
                                                        const std::string& name);

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // A host view into the mapping; it keeps the mapping alive.
  Result<Tensor> tensor(const std::string& name) const;

 private:
  static Result<std::shared_ptr<SafetensorsFile>> validate(const uint8_t* data, size_t size,
                                                           std::shared_ptr<void> keepalive,
                                                           const std::string& path);
  std::string path_;
  std::shared_ptr<void> keepalive_;
  const uint8_t* data_area_ = nullptr;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moelora
