// Adapters known to the server, by name. Loaded adapters live on the host up to a cap
// (--max-loaded-loras); past it the least recently used unpinned adapter that no request uses is
// dropped from host memory and transparently re-read from its path on its next request.
// Not thread-safe: the engine serialises access.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "lora/adapter.h"
#include "model/model_config.h"

namespace moelora {

class AdapterRegistry {
 public:
  AdapterRegistry(const ModelConfig& cfg, AdapterLoadOptions opts, int max_loaded, std::string root);

  // Validates and loads `path` under `name`. AlreadyExists if the name is taken; paths outside
  // `root` (when set) are refused. A failed load changes nothing.
  Status load(const std::string& name, const std::string& path, bool pinned);
  // Forgets `name`. The caller checks that no request uses it.
  Status remove(const std::string& name);
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // The adapter's weights (re-reading them if they were dropped from host memory).
  Result<std::shared_ptr<const LoraAdapter>> get(const std::string& name);
  void mark_used(const std::string& name);

  struct Info {
    std::string name, path;
    bool pinned = false;
    bool on_host = false;
    uint64_t generation = 0;
    int max_rank = 0;
  };
  std::vector<Info> list() const;
  uint64_t generation(const std::string& name) const;
  // Users per adapter, maintained by the engine (requests holding it).
  void add_user(const std::string& name, int delta);
  int users(const std::string& name) const;

 private:
  struct Entry {
    std::string path;
    bool pinned = false;
    uint64_t generation = 0;
    uint64_t last_used = 0;
    int users = 0;
    std::shared_ptr<const LoraAdapter> adapter;  // null when dropped from host memory
  };
  Result<std::string> resolve_path(const std::string& path) const;
  void enforce_cap(const std::string& keep);

  const ModelConfig& cfg_;
  AdapterLoadOptions opts_;
  int max_loaded_;
  std::string root_;
  std::map<std::string, Entry> entries_;
  uint64_t clock_ = 0;
  uint64_t next_generation_ = 1;
};

}  // namespace moelora
