#include "tokenizer/bpe_model.h"

#include <algorithm>
#include <queue>

#include "tokenizer/utf8.h"

namespace moelora {
namespace {

// The optional string fields of the BPE model are sometimes null, sometimes "".
Result<std::string> optional_string(const Json& obj, std::string_view key, std::string_view what) {
  MOELORA_ASSIGN_OR_RETURN(auto value, json_opt_string(obj, key, what));
  return value.value_or("");
}

}  // namespace

Result<BpeModel> BpeModel::from_json(const Json& model, std::string_view what) {
  if (!model.is_object()) return invalid_argument("{}: \"model\" must be an object", what);
  MOELORA_ASSIGN_OR_RETURN(auto type, json_opt_string(model, "type", what));
  if (type && *type != "BPE") {
    return unsupported("{}: tokenizer model type '{}' is not supported (only BPE)", what, *type);
  }
  const auto vocab_it = model.find("vocab");
  const auto merges_it = model.find("merges");
  if (vocab_it == model.end() || !vocab_it->is_object()) {
    return invalid_argument("{}: model.vocab must be an object of token -> id", what);
  }
  if (merges_it == model.end() || !merges_it->is_array()) {
    return invalid_argument("{}: model.merges must be an array", what);
  }
  // "dropout" only matters for training: inference applies every merge.

  BpeModel m;
  m.vocab_.reserve(vocab_it->size() * 2);
  int64_t max_id = -1;
  for (const auto& [token, id_json] : vocab_it->items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 || id_json.get<int64_t>() > INT32_MAX) {
      return invalid_argument("{}: id of vocabulary token '{}' must be a non-negative integer", what, token);
    }
    const int64_t id = id_json.get<int64_t>();
    m.vocab_.emplace(token, static_cast<int32_t>(id));
    max_id = std::max(max_id, id);
  }
  m.id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [token, id] : m.vocab_) m.id_to_token_[static_cast<size_t>(id)] = token;

  MOELORA_ASSIGN_OR_RETURN(auto unk, json_opt_string(model, "unk_token", what));
  if (unk) {
    if (auto it = m.vocab_.find(*unk); it != m.vocab_.end()) m.unk_id_ = it->second;
  }
  MOELORA_ASSIGN_OR_RETURN(auto fuse_unk, json_opt_bool(model, "fuse_unk", what));
  MOELORA_ASSIGN_OR_RETURN(auto byte_fallback, json_opt_bool(model, "byte_fallback", what));
  MOELORA_ASSIGN_OR_RETURN(auto ignore_merges, json_opt_bool(model, "ignore_merges", what));
  m.fuse_unk_ = fuse_unk.value_or(false);
  m.byte_fallback_ = byte_fallback.value_or(false);
  m.ignore_merges_ = ignore_merges.value_or(false);
  MOELORA_ASSIGN_OR_RETURN(m.continuing_subword_prefix_, optional_string(model, "continuing_subword_prefix", what));
  MOELORA_ASSIGN_OR_RETURN(m.end_of_word_suffix_, optional_string(model, "end_of_word_suffix", what));
  for (int b = 0; b < 256; ++b) {
    auto it = m.vocab_.find(fmt::format("<0x{:02X}>", b));
    m.byte_fallback_ids_[b] = it == m.vocab_.end() ? -1 : it->second;
  }

  m.merges_.reserve(merges_it->size() * 2);
  int32_t rank = 0;
  for (const Json& merge : *merges_it) {
    std::string left, right;
    if (merge.is_string()) {
      const std::string& text = merge.get_ref<const std::string&>();
      const size_t space = text.find(' ');
      if (space == std::string::npos) {
        return invalid_argument("{}: merge #{} '{}' is not two tokens separated by a space", what, rank, text);
      }
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      return invalid_argument("{}: merge #{} must be \"a b\" or [\"a\", \"b\"]", what, rank);
    }
    const auto l = m.vocab_.find(left);
    const auto r = m.vocab_.find(right);
    // With a continuing-subword prefix ("##"), the right part carries it but the merge does not.
    std::string merged = left;
    if (!m.continuing_subword_prefix_.empty() && right.starts_with(m.continuing_subword_prefix_)) {
      merged += right.substr(m.continuing_subword_prefix_.size());
    } else {
      merged += right;
    }
    const auto mid = m.vocab_.find(merged);
    if (l == m.vocab_.end() || r == m.vocab_.end() || mid == m.vocab_.end()) {
      return invalid_argument("{}: merge #{} ('{}' + '{}') uses a token that is not in the vocabulary", what,
                              rank, left, right);
    }
    // A repeated merge keeps its last rank, as both Rust tokenizers and transformers.js do.
    m.merges_[pair_key(l->second, r->second)] = Merge{rank, mid->second};
    ++rank;
  }
  return m;
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size() || id_to_token_[id].empty()) return nullptr;
  return &id_to_token_[id];
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t>& symbols) const {
  std::string key;
  size_t pos = 0;
  bool last_was_unk = false;
  while (pos < word.size()) {
    const size_t begin = pos;
    utf8::decode_valid(word, pos);
    key.clear();
    if (begin > 0) key += continuing_subword_prefix_;
    key.append(word.substr(begin, pos - begin));
    if (pos == word.size()) key += end_of_word_suffix_;
    if (auto it = vocab_.find(key); it != vocab_.end()) {
      symbols.push_back(it->second);
      last_was_unk = false;
      continue;
    }
    if (byte_fallback_) {
      bool all_bytes = true;
      for (size_t i = begin; i < pos; ++i) all_bytes &= byte_fallback_ids_[static_cast<uint8_t>(word[i])] >= 0;
      if (all_bytes) {
        for (size_t i = begin; i < pos; ++i) symbols.push_back(byte_fallback_ids_[static_cast<uint8_t>(word[i])]);
        last_was_unk = false;
        continue;
      }
    }
    // Without an unknown token the character is dropped, as Rust tokenizers does.
    if (unk_id_) {
      if (!(fuse_unk_ && last_was_unk)) symbols.push_back(*unk_id_);
      last_was_unk = true;
    }
  }
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(std::string(word)); it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  thread_local std::vector<int32_t> symbols;
  symbols.clear();
  initial_symbols(word, symbols);
  const int n = static_cast<int>(symbols.size());
  if (n <= 1) {
    ids.insert(ids.end(), symbols.begin(), symbols.end());
    return;
  }

  // A doubly linked list over the symbols; merged-away symbols are marked dead (-1 id).
  thread_local std::vector<int> prev, next;
  prev.resize(n);
  next.resize(n);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    int32_t rank;
    int pos;  // index of the left symbol: equal ranks merge leftmost first
    int32_t merged_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto push_pair = [&](int left) {
    const int right = next[left];
    if (right < 0) return;
    auto it = merges_.find(pair_key(symbols[left], symbols[right]));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.merged_id});
  };
  for (int i = 0; i + 1 < n; ++i) push_pair(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    const int left = top.pos;
    if (symbols[left] < 0) continue;
    const int right = next[left];
    if (right < 0) continue;
    // The pair may have changed since this candidate was queued.
    auto it = merges_.find(pair_key(symbols[left], symbols[right]));
    if (it == merges_.end() || it->second.merged_id != top.merged_id || it->second.rank != top.rank) continue;
    symbols[left] = top.merged_id;
    symbols[right] = -1;
    next[left] = next[right];
    if (next[right] >= 0) prev[next[right]] = left;
    if (prev[left] >= 0) push_pair(prev[left]);
    push_pair(left);
  }
  for (int i = 0; i >= 0; i = next[i]) ids.push_back(symbols[i]);
}

}  // namespace moelora
