#include "lora/adapter_registry.h"

#include <cctype>
#include <filesystem>

#include "core/log.h"

namespace moelora {

namespace fs = std::filesystem;

AdapterRegistry::AdapterRegistry(const ModelConfig& cfg, AdapterLoadOptions opts, int max_loaded, std::string root)
    : cfg_(cfg), opts_(opts), max_loaded_(max_loaded), root_(std::move(root)) {}

Result<std::string> AdapterRegistry::resolve_path(const std::string& path, const std::string& root_dir) const {
  std::error_code ec;
  if (root_dir.empty()) return path;
  // Relative paths are taken inside the root; the real path (symlinks resolved) must stay inside.
  const fs::path root = fs::weakly_canonical(root_dir, ec);
  const fs::path candidate = fs::path(path).is_absolute() ? fs::path(path) : root / path;
  const fs::path real = fs::weakly_canonical(candidate, ec);
  if (ec) return not_found("adapter path '{}' cannot be resolved", path);
  auto rel = real.lexically_relative(root);
  if (rel.empty() || *rel.begin() == "..")
    return make_error(ErrorCode::kInvalidArgument, "adapter path '{}' is outside --lora-root", path);
  return real.string();
}

Result<AdapterRegistry::Prepared> AdapterRegistry::prepare(const std::string& name, const std::string& path,
                                                           const std::string& root) const {
  if (name.empty() || name.size() > 128) return invalid_argument("adapter name must have 1 to 128 characters");
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' || c == '/'))
      return invalid_argument("adapter name '{}' may only contain letters, digits, '-', '_', '.', '/'", name);
  Prepared p;
  MOELORA_ASSIGN_OR_RETURN(p.path, resolve_path(path, root));
  p.root = root;
  AdapterLoadOptions opts = opts_;
  opts.root = root;  // every file, not only the folder, must resolve inside it
  MOELORA_ASSIGN_OR_RETURN(p.adapter, load_lora_adapter(p.path, name, cfg_, opts));
  return p;
}

Status AdapterRegistry::commit(const std::string& name, Prepared prepared, bool pinned, bool replace) {
  auto it = entries_.find(name);
  if (it != entries_.end() && !replace)
    return make_error(ErrorCode::kAlreadyExists, "an adapter named '{}' is already loaded", name);
  for (const std::string& note : prepared.adapter->notes) MOELORA_LOG_INFO("adapter '{}': {}", name, note);
  Entry& e = entries_[name];  // a replaced entry keeps its users: they hold the old weights
  e.path = prepared.path;
  e.root = prepared.root;
  e.identity = prepared.adapter->identity;
  e.pinned = pinned;
  e.generation = next_generation_++;
  e.last_used = ++clock_;
  e.adapter = std::move(prepared.adapter);
  enforce_cap(name);
  return {};
}

Status AdapterRegistry::load(const std::string& name, const std::string& path, bool pinned) {
  if (entries_.count(name))
    return make_error(ErrorCode::kAlreadyExists, "an adapter named '{}' is already loaded", name);
  MOELORA_ASSIGN_OR_RETURN(Prepared p, prepare(name, path, root_));
  return commit(name, std::move(p), pinned, /*replace=*/false);
}

std::optional<AdapterRegistry::RereadTicket> AdapterRegistry::needs_reread(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end() || it->second.adapter) return std::nullopt;
  return RereadTicket{it->second.path, it->second.root, it->second.generation};
}

Result<std::shared_ptr<const LoraAdapter>> AdapterRegistry::reread(const std::string& name,
                                                                   const RereadTicket& ticket) const {
  AdapterLoadOptions opts = opts_;
  opts.root = ticket.root;  // confined again: the folder may have been replaced since the load
  return load_lora_adapter(ticket.path, name, cfg_, opts);
}

void AdapterRegistry::install_reread(const std::string& name, Entry& e, std::shared_ptr<const LoraAdapter> adapter) {
  if (!(adapter->identity == e.identity)) {
    // Different files behind the same name: new contents get a new generation (prefix-cache
    // keys), or requests would reuse KV computed with the old weights.
    MOELORA_LOG_WARN("adapter '{}': its files changed since it was loaded ({} -> {} bytes); serving the new contents "
                     "as a new version",
                     name, e.identity.bytes, adapter->identity.bytes);
    e.identity = adapter->identity;
    e.generation = next_generation_++;
  }
  e.adapter = std::move(adapter);
  enforce_cap(name);
}

Status AdapterRegistry::finish_reread(const std::string& name, const RereadTicket& ticket,
                                      Result<std::shared_ptr<const LoraAdapter>> result) {
  auto it = entries_.find(name);
  // Unloaded or replaced meanwhile, or another caller already put it back: nothing to do.
  if (it == entries_.end() || it->second.generation != ticket.generation || it->second.adapter) return {};
  if (!result.ok()) return result.status();
  install_reread(name, it->second, std::move(result).value());
  return {};
}

Status AdapterRegistry::add_in_memory(const std::string& name, std::shared_ptr<const LoraAdapter> adapter) {
  if (entries_.count(name))
    return make_error(ErrorCode::kAlreadyExists, "an adapter named '{}' is already loaded", name);
  // The ceiling files meet when they load (a backend's kernels may abort on a rank above it).
  if (adapter->max_rank > opts_.max_rank)
    return invalid_argument("adapter '{}' has rank {}, above the engine's maximum {} (--max-lora-rank; the engine "
                            "lowers it to the backend kernels' limit)",
                            name, adapter->max_rank, opts_.max_rank);
  Entry& e = entries_[name];
  e.path = adapter->path;
  e.identity = adapter->identity;
  e.pinned = true;  // no files to read it back from
  e.generation = next_generation_++;
  e.last_used = ++clock_;
  e.adapter = std::move(adapter);
  enforce_cap(name);
  return {};
}

Status AdapterRegistry::remove(const std::string& name) {
  auto it = entries_.find(name);
  if (it == entries_.end()) return not_found("no adapter named '{}' is loaded", name);
  entries_.erase(it);
  return {};
}

Result<std::shared_ptr<const LoraAdapter>> AdapterRegistry::get(const std::string& name) {
  auto it = entries_.find(name);
  if (it == entries_.end()) return not_found("no adapter named '{}' is loaded", name);
  Entry& e = it->second;
  if (!e.adapter) {
    // Dropped from host memory by the cap and not re-read by Engine::submit (evicted again in
    // between): read it here, with the same confinement and identity check.
    MOELORA_ASSIGN_OR_RETURN(auto adapter, reread(name, RereadTicket{e.path, e.root, e.generation}));
    install_reread(name, e, std::move(adapter));
  }
  e.last_used = ++clock_;
  return e.adapter;
}

void AdapterRegistry::mark_used(const std::string& name) {
  auto it = entries_.find(name);
  if (it != entries_.end()) it->second.last_used = ++clock_;
}

void AdapterRegistry::enforce_cap(const std::string& keep) {
  for (;;) {
    int on_host = 0;
    for (const auto& [n, e] : entries_) on_host += e.adapter != nullptr;
    if (on_host <= max_loaded_) return;
    Entry* victim = nullptr;
    for (auto& [n, e] : entries_)
      if (e.adapter && !e.pinned && e.users == 0 && n != keep && (!victim || e.last_used < victim->last_used))
        victim = &e;
    if (!victim) return;  // everything else is pinned or in use: allow going over the cap
    victim->adapter.reset();
  }
}

std::vector<AdapterRegistry::Info> AdapterRegistry::list() const {
  std::vector<Info> out;
  for (const auto& [n, e] : entries_)
    out.push_back({n, e.path, e.pinned, e.adapter != nullptr, e.generation, e.adapter ? e.adapter->max_rank : 0});
  return out;
}

uint64_t AdapterRegistry::generation(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? 0 : it->second.generation;
}

void AdapterRegistry::add_user(const std::string& name, int delta) {
  auto it = entries_.find(name);
  if (it != entries_.end()) it->second.users += delta;
}

int AdapterRegistry::users(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? 0 : it->second.users;
}

}  // namespace moelora
