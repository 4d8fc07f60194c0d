#include "lora/adapter_registry.h"

#include <cctype>
#include <filesystem>

#include "core/log.h"

namespace moelora {

namespace fs = std::filesystem;

AdapterRegistry::AdapterRegistry(const ModelConfig& cfg, AdapterLoadOptions opts, int max_loaded, std::string root)
    : cfg_(cfg), opts_(opts), max_loaded_(max_loaded), root_(std::move(root)) {}

Result<std::string> AdapterRegistry::resolve_path(const std::string& path) const {
  std::error_code ec;
  if (root_.empty()) return path;
  // Relative paths are taken inside the root; the real path (symlinks resolved) must stay inside.
  const fs::path root = fs::weakly_canonical(root_, ec);
  const fs::path candidate = fs::path(path).is_absolute() ? fs::path(path) : root / path;
  const fs::path real = fs::weakly_canonical(candidate, ec);
  if (ec) return not_found("adapter path '{}' cannot be resolved", path);
  auto rel = real.lexically_relative(root);
  if (rel.empty() || *rel.begin() == "..")
    return make_error(ErrorCode::kInvalidArgument, "adapter path '{}' is outside --lora-root", path);
  return real.string();
}

Status AdapterRegistry::load(const std::string& name, const std::string& path, bool pinned) {
  if (name.empty() || name.size() > 128) return invalid_argument("adapter name must have 1 to 128 characters");
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' || c == '/'))
      return invalid_argument("adapter name '{}' may only contain letters, digits, '-', '_', '.', '/'", name);
  if (entries_.count(name))
    return make_error(ErrorCode::kAlreadyExists, "an adapter named '{}' is already loaded", name);
  MOELORA_ASSIGN_OR_RETURN(std::string real, resolve_path(path));
  MOELORA_ASSIGN_OR_RETURN(auto adapter, load_lora_adapter(real, name, cfg_, opts_));
  for (const std::string& note : adapter->notes) MOELORA_LOG_INFO("adapter '{}': {}", name, note);
  Entry e;
  e.path = real;
  e.pinned = pinned;
  e.generation = next_generation_++;
  e.last_used = ++clock_;
  e.adapter = adapter;
  entries_[name] = std::move(e);
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
    // Dropped from host memory by the cap: read it again (same generation: same files).
    MOELORA_ASSIGN_OR_RETURN(e.adapter, load_lora_adapter(e.path, name, cfg_, opts_));
    enforce_cap(name);
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
