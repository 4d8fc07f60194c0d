#include "io/checkpoint.h"

#include <filesystem>
#include <set>

#include "io/json_util.h"

namespace moelora {

namespace fs = std::filesystem;

Result<Checkpoint> Checkpoint::open(const std::string& dir) {
  Checkpoint ck;
  ck.dir_ = dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return not_found("model directory '{}' does not exist", dir);
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  if (fs::exists(index, ec)) {
    MOELORA_ASSIGN_OR_RETURN(std::string text, read_text_file(index.string()));
    MOELORA_ASSIGN_OR_RETURN(Json j, parse_json_strict(text, index.string()));
    auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object())
      return invalid_argument("{}: no \"weight_map\" object", index.string());
    std::map<std::string, const SafetensorsFile*> opened;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string())
        return invalid_argument("{}: weight_map entry '{}' is not a file name", index.string(), it.key());
      const std::string shard = it.value().get<std::string>();
      if (shard.find('/') != std::string::npos || shard == ".." || shard.empty())
        return invalid_argument("{}: shard name '{}' must be a plain file name", index.string(), shard);
      if (!opened.count(shard)) {
        MOELORA_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open((fs::path(dir) / shard).string()));
        ck.shards_.push_back(f);
        opened[shard] = f.get();
      }
      const SafetensorsFile* f = opened[shard];
      if (!f->contains(it.key()))
        return invalid_argument("{}: index says '{}' is in {}, which has no such tensor", index.string(),
                                it.key(), shard);
      ck.where_[it.key()] = f;
    }
    return ck;
  }
  if (!fs::exists(single, ec)) {
    if (fs::exists(fs::path(dir) / "pytorch_model.bin", ec))
      return unsupported("{} holds only pytorch_model.bin: pickle checkpoints are code and are never "
                         "loaded; convert it to safetensors", dir);
    return not_found("{} has neither model.safetensors nor model.safetensors.index.json", dir);
  }
  MOELORA_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(single.string()));
  ck.shards_.push_back(f);
  for (const auto& [name, e] : f->entries()) ck.where_[name] = f.get();
  return ck;
}

Result<Tensor> Checkpoint::tensor(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) return not_found("checkpoint {} has no tensor '{}'", dir_, name);
  return it->second->tensor(name);
}

const SafetensorsEntry* Checkpoint::entry(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) return nullptr;
  return &it->second->entries().at(name);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [n, f] : where_) out.push_back(n);
  return out;
}

}  // namespace moelora
