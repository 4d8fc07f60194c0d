// Helpers for tests that write model, adapter and safetensors files into a temporary folder.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moelora::testutil {

// A fresh folder under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }
  std::string sub(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

struct StTensor {
  std::string dtype;               // "F32", "BF16", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;      // raw little-endian data
};

// Serialises tensors into the safetensors format (in name order, contiguous).
std::string make_safetensors(const std::map<std::string, StTensor>& tensors);
// Raw file from a header string and a data area (for malformed-file tests).
std::string make_raw_safetensors(const std::string& header, const std::string& data);

StTensor f32_tensor(const std::vector<int64_t>& shape, const std::vector<float>& values);
StTensor bf16_tensor(const std::vector<int64_t>& shape, const std::vector<float>& values);
// Deterministic pseudo-random values in [-scale, scale].
std::vector<float> random_values(size_t n, uint32_t seed, float scale = 0.1f);

void write_file(const std::string& path, const std::string& content);
std::string read_file(const std::string& path);
// Recursively copies a folder (files made writable).
void copy_dir(const std::string& from, const std::string& to);

// Every tensor of a safetensors file, as editable bytes.
std::map<std::string, StTensor> read_safetensors(const std::string& path);
// A copy of the checkpoint folder `src` whose model.safetensors went through `edit` (tests that
// corrupt or convert a checkpoint). The folder lives as long as the returned object.
std::unique_ptr<TempDir> edited_checkpoint(const std::string& src,
                                           const std::function<void(std::map<std::string, StTensor>&)>& edit);

// Path of a fixture folder inside the repository (tests/fixtures/...).
std::string fixture_path(const std::string& rel);

}  // namespace moelora::testutil
