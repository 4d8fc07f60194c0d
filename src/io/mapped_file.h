// A read-only memory map of a whole file: checkpoints are read in place, never copied whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"

namespace moelora {

class MappedFile {
 public:
  static Result<std::shared_ptr<MappedFile>> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Reads a small text file (config.json, adapter_config.json). Refuses files over `max_bytes`.
Result<std::string> read_text_file(const std::string& path, size_t max_bytes = 64u << 20);

}  // namespace moelora
