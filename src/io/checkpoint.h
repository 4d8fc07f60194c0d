// A checkpoint directory: one model.safetensors, or shards listed by model.safetensors.index.json.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "io/safetensors.h"

namespace moelora {

class Checkpoint {
 public:
  // Opens `dir`. Every shard is mapped and validated; names in the index must exist in their shard.
  static Result<Checkpoint> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  Result<Tensor> tensor(const std::string& name) const;
  const SafetensorsEntry* entry(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> shards_;
  std::map<std::string, const SafetensorsFile*> where_;
};

}  // namespace moelora
