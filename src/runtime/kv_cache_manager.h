// KV pages: a fixed pool of pages (page_size positions each), reference counted so that several
// sequences can share the pages of a common prefix. The prefix cache maps a chain of full pages
// to the page holding them, keyed by the adapter's identity (name and load generation) as well as
// the tokens: KV computed under one adapter is never served to another, nor to a reloaded
// adapter of the same name. Cached pages nobody uses are reclaimed least recently used first.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace moelora {

// The prefix-cache namespace of a request: its adapter's load generation (0 = base model) and,
// with vLLM's cache_salt, the salt. Requests share cached pages only within one namespace, so a
// tenant that salts its requests cannot learn from cached_tokens what other tenants sent.
// Salted namespaces are keyed hashes (a per-process random key, top bit set): they cannot be
// computed offline nor equal an unsalted generation.
uint64_t prefix_namespace(uint64_t adapter_generation, const std::string& cache_salt);

class KvCacheManager {
 public:
  KvCacheManager(int num_pages, int page_size, bool enable_prefix_cache);

  int page_size() const { return page_size_; }
  int total_pages() const { return static_cast<int>(refs_.size()); }
  // Pages a new allocation can get: free ones plus cached ones nobody uses.
  int available_pages() const { return static_cast<int>(free_.size() + lru_.size()); }
  int used_pages() const;         // pages referenced by sequences
  int cached_only_pages() const { return static_cast<int>(lru_.size()); }

  std::optional<int> allocate();
  void release(int page);

  // Identity of a full page's contents: the previous page's key, the adapter and the tokens.
  static uint64_t block_key(uint64_t parent, uint64_t adapter_id, const int32_t* tokens, int n);
  // Pages caching the longest prefix of `tokens` (full pages only, at most max_pages); each
  // returned page gains a reference.
  std::vector<int> match_prefix(uint64_t adapter_id, const std::vector<int32_t>& tokens, int max_pages);
  // Offers a sequence's full pages to the cache (pages[i] holds tokens [i*P, (i+1)*P)).
  void insert_prefix(uint64_t adapter_id, const std::vector<int32_t>& tokens, const std::vector<int>& pages,
                     int full_pages);

 private:
  struct Entry {
    int page;
    uint64_t parent;
    uint64_t adapter_id;
    std::vector<int32_t> tokens;  // verified on lookup: a hash collision never shares KV
  };
  void drop_cached(int page);

  int page_size_;
  bool enable_;
  std::vector<int> refs_;               // per page: sequence references (+1 while cached)
  std::vector<int> free_;
  std::unordered_map<uint64_t, Entry> cache_;  // key -> entry
  std::vector<std::optional<uint64_t>> page_key_;  // page -> its cache key
  std::list<int> lru_;                  // cached pages with no sequence reference, oldest first
  std::vector<std::list<int>::iterator> lru_pos_;
  std::vector<bool> in_lru_;
};

}  // namespace moelora
