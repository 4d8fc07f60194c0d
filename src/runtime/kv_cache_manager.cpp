#include "runtime/kv_cache_manager.h"

#include <random>

#include <algorithm>

#include "core/check.h"

namespace moelora {

KvCacheManager::KvCacheManager(int num_pages, int page_size, bool enable_prefix_cache)
    : page_size_(page_size), enable_(enable_prefix_cache), refs_(num_pages, 0), page_key_(num_pages),
      lru_pos_(num_pages), in_lru_(num_pages, false) {
  for (int p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

int KvCacheManager::used_pages() const {
  int n = 0;
  for (int p = 0; p < total_pages(); ++p) n += refs_[p] > (page_key_[p] ? 1 : 0);
  return n;
}

std::optional<int> KvCacheManager::allocate() {
  if (free_.empty() && !lru_.empty()) drop_cached(lru_.front());
  if (free_.empty()) return std::nullopt;
  const int p = free_.back();
  free_.pop_back();
  refs_[p] = 1;
  return p;
}

void KvCacheManager::release(int page) {
  MOELORA_CHECK(page >= 0 && page < total_pages() && refs_[page] > 0);
  if (--refs_[page] == 0) {
    free_.push_back(page);
  } else if (refs_[page] == 1 && page_key_[page]) {
    // Only the cache holds it now: reclaimable, least recently used first.
    lru_.push_back(page);
    lru_pos_[page] = std::prev(lru_.end());
    in_lru_[page] = true;
  }
}

void KvCacheManager::drop_cached(int page) {
  MOELORA_CHECK(page_key_[page].has_value());
  cache_.erase(*page_key_[page]);
  page_key_[page].reset();
  if (in_lru_[page]) {
    lru_.erase(lru_pos_[page]);
    in_lru_[page] = false;
  }
  release(page);  // the cache's own reference
}

uint64_t prefix_namespace(uint64_t adapter_generation, const std::string& cache_salt) {
  if (cache_salt.empty()) return adapter_generation;
  static const uint64_t key = std::random_device{}() * 0x9e3779b97f4a7c15ull ^ std::random_device{}();
  uint64_t h = 1469598103934665603ull ^ key;
  auto mix = [&h](uint64_t v) {
    h ^= v;
    h *= 0x100000001b3ull;
    h ^= h >> 29;
  };
  mix(adapter_generation);
  for (unsigned char c : cache_salt) mix(c);
  mix(cache_salt.size());
  return h | (1ull << 63);
}

uint64_t KvCacheManager::block_key(uint64_t parent, uint64_t adapter_id, const int32_t* tokens, int n) {
  // FNV-1a over (parent, adapter, tokens); collisions are caught by comparing stored tokens.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(parent);
  mix(adapter_id);
  for (int i = 0; i < n; ++i) mix(static_cast<uint32_t>(tokens[i]));
  return h;
}

std::vector<int> KvCacheManager::match_prefix(uint64_t adapter_id, const std::vector<int32_t>& tokens, int max_pages) {
  std::vector<int> pages;
  if (!enable_) return pages;
  uint64_t parent = 0;
  for (int i = 0; i < max_pages && (i + 1) * page_size_ <= static_cast<int>(tokens.size()); ++i) {
    const int32_t* blk = tokens.data() + static_cast<size_t>(i) * page_size_;
    const uint64_t key = block_key(parent, adapter_id, blk, page_size_);
    auto it = cache_.find(key);
    if (it == cache_.end()) break;
    const Entry& e = it->second;
    if (e.parent != parent || e.adapter_id != adapter_id ||
        !std::equal(e.tokens.begin(), e.tokens.end(), blk))
      break;
    const int p = e.page;
    if (in_lru_[p]) {
      lru_.erase(lru_pos_[p]);
      in_lru_[p] = false;
    }
    refs_[p]++;
    pages.push_back(p);
    parent = key;
  }
  return pages;
}

void KvCacheManager::insert_prefix(uint64_t adapter_id, const std::vector<int32_t>& tokens, const std::vector<int>& pages,
                                   int full_pages) {
  if (!enable_) return;
  uint64_t parent = 0;
  for (int i = 0; i < full_pages && i < static_cast<int>(pages.size()); ++i) {
    const int32_t* blk = tokens.data() + static_cast<size_t>(i) * page_size_;
    const uint64_t key = block_key(parent, adapter_id, blk, page_size_);
    const int p = pages[i];
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      if (!page_key_[p]) {
        cache_[key] = Entry{p, parent, adapter_id, std::vector<int32_t>(blk, blk + page_size_)};
        page_key_[p] = key;
        refs_[p]++;  // the cache's reference
      }
    } else if (it->second.page != p) {
      // Same contents already cached in another page: keep the existing one, stop extending
      // the chain through this sequence's pages.
      parent = key;
      continue;
    }
    parent = key;
  }
}

}  // namespace moelora
