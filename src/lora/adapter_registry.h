// Adapters known to the server, by name. Loaded adapters live on the host up to a cap
// (--max-loaded-loras); past it the least recently used unpinned adapter that no request uses is
// dropped from host memory and re-read from its path on its next request.
// Reading files is split from changing the registry: prepare() and reread() touch no entry and
// may run on any thread while the engine uses the registry (so files are never read under the
// engine's lock); commit() and finish_reread() install the result. Everything else is not
// thread-safe: the engine serialises access.
//
// Every adapter keeps the folder its files must stay in (`root`: --lora-root for runtime loads,
// or none for the operator's startup adapters), checked again on every re-read, and the identity
// of the files it was read from: a re-read that finds different files gets a new generation, so
// prefix-cache entries of the old contents are never served for the new ones.
#pragma once

#include <map>
#include <memory>
#include <optional>
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

  struct Prepared {
    std::shared_ptr<const LoraAdapter> adapter;
    std::string path;  // resolved
    std::string root;  // where re-reads must stay ("" = anywhere)
  };
  // Reads and validates without touching the registry (any thread). `root` confines the files.
  Result<Prepared> prepare(const std::string& name, const std::string& path, const std::string& root) const;
  // Installs a prepared adapter with a new generation. Without `replace`, AlreadyExists if the
  // name is taken; with it, the old version is swapped out in one step (requests that hold it
  // keep it until they finish).
  Status commit(const std::string& name, Prepared prepared, bool pinned, bool replace);

  // Re-reading an adapter that was dropped from host memory, off the engine thread.
  struct RereadTicket {
    std::string path, root;
    uint64_t generation = 0;
  };
  std::optional<RereadTicket> needs_reread(const std::string& name) const;  // nullopt: on host or unknown
  Result<std::shared_ptr<const LoraAdapter>> reread(const std::string& name, const RereadTicket& ticket) const;
  // Installs a re-read (a no-op when the entry changed meanwhile). Changed files: new generation.
  Status finish_reread(const std::string& name, const RereadTicket& ticket,
                       Result<std::shared_ptr<const LoraAdapter>> result);
  // Registers an adapter made in memory (benchmarks: lora/random_adapter.h). It has no files, so
  // it is pinned: never dropped from host memory. Above the rank ceiling: InvalidArgument.
  Status add_in_memory(const std::string& name, std::shared_ptr<const LoraAdapter> adapter);
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
    std::string root;
    AdapterFilesIdentity identity;
    bool pinned = false;
    uint64_t generation = 0;
    uint64_t last_used = 0;
    int users = 0;
    std::shared_ptr<const LoraAdapter> adapter;  // null when dropped from host memory
  };
  Result<std::string> resolve_path(const std::string& path, const std::string& root) const;
  void enforce_cap(const std::string& keep);
  // Installs re-read contents into `e` (identity check and generation bump).
  void install_reread(const std::string& name, Entry& e, std::shared_ptr<const LoraAdapter> adapter);

  const ModelConfig& cfg_;
  AdapterLoadOptions opts_;
  int max_loaded_;
  std::string root_;
  std::map<std::string, Entry> entries_;
  uint64_t clock_ = 0;
  uint64_t next_generation_ = 1;
};

}  // namespace moelora
