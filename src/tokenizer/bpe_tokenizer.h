// A Hugging Face tokenizer.json with a BPE model: byte-level (Qwen, DeepSeek, GPT-2, Llama 3...)
// or SentencePiece-style with byte fallback (Llama 2, Mistral, Mixtral): added tokens,
// normalizer, pre-tokenizer, BPE model, post-processor and decoder (token_decoder.h).
//
// encode: bytes -> valid UTF-8 (ill-formed sequences become U+FFFD) -> added tokens split out
//   -> normalize -> pre-tokenize (regex splits, byte-level symbols) -> BPE merges -> ids
//   -> post-processor (special tokens around the sequence, when asked).
// decode: ids -> bytes of each token (added tokens verbatim; the first token and the start of
//   the text by the decoder's rules, e.g. SentencePiece's prefix space removed) -> text, where
//   bytes that do not form valid UTF-8 become U+FFFD. StreamDecoder does the same incrementally.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "io/json_util.h"
#include "tokenizer/added_vocabulary.h"
#include "tokenizer/bpe_model.h"
#include "tokenizer/pretokenizer_regex.h"
#include "tokenizer/text_pipeline.h"
#include "tokenizer/token_decoder.h"

namespace moelora {

struct BpeTokenizerOptions {
  TokenizerCompat compat = TokenizerCompat::kHuggingFace;
};

class BpeTokenizer {
 public:
  // `json_text` is the content of a tokenizer.json; `what` names it in error messages.
  static Result<std::shared_ptr<BpeTokenizer>> from_json_text(std::string_view json_text, std::string_view what,
                                                              const BpeTokenizerOptions& options = {});
  static Result<std::shared_ptr<BpeTokenizer>> from_file(const std::string& path,
                                                         const BpeTokenizerOptions& options = {});

  // Ids of `text` (any bytes). With add_special_tokens, the post-processor's special tokens
  // (e.g. a BOS) are added around them.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;

  // The text of `ids`; ids outside the vocabulary are skipped (as Hugging Face does).
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // What one token contributes to decoded text: bytes of the byte-level text (that may end in
  // the middle of a UTF-8 character), or the verbatim content of an added token.
  struct Piece {
    enum Kind : uint8_t { kNone, kBytes, kAddedToken };
    Kind kind = kNone;
    bool special = false;
    std::string_view text;
  };
  Piece piece(int32_t id) const;
  // What a vocabulary token contributes when it is the first token of a text (differs from
  // piece(id).text only under a Metaspace decoder, which drops the prefix space).
  std::string first_piece_bytes(int32_t id) const;
  const TokenDecoder& token_decoder() const { return decoder_; }

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token string of an id as in the vocabulary ("Ġhello", "<|im_end|>"), if the id exists.
  std::optional<std::string> id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  bool is_valid_id(int32_t id) const { return piece(id).kind != Piece::kNone; }
  // One past the highest id (vocabulary and added tokens).
  int32_t vocab_size() const { return vocab_size_; }
  const std::vector<AddedToken>& added_tokens() const { return added_tokens_; }

  // Special tokens that encode(add_special_tokens=true) puts before and after the text; set
  // from the post-processor, and overridden by tokenizer_config.json's add_bos_token /
  // add_eos_token (see Tokenizer).
  const std::vector<int32_t>& prefix_ids() const { return prefix_ids_; }
  const std::vector<int32_t>& suffix_ids() const { return suffix_ids_; }
  void set_special_token_template(std::vector<int32_t> prefix, std::vector<int32_t> suffix);

 private:
  BpeTokenizer() = default;
  // `at_start`: the text begins at offset 0 of the input (Metaspace's prepend_scheme "first").
  void encode_ordinary(std::string text, bool at_start, std::vector<int32_t>& ids) const;
  void encode_normalized(std::string_view text, bool at_start, std::vector<int32_t>& ids) const;

  BpeTokenizerOptions options_;
  BpeModel model_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  TokenDecoder decoder_;
  std::vector<AddedToken> added_tokens_;
  std::unordered_map<std::string, int32_t> added_by_content_;
  AddedTokenMatcher raw_matcher_;         // added tokens matched before normalization
  AddedTokenMatcher normalized_matcher_;  // added tokens matched in normalized text
  std::vector<int32_t> prefix_ids_, suffix_ids_;
  int32_t vocab_size_ = 0;
  // Decoding: the bytes of each vocabulary token, and the added tokens by id.
  std::vector<std::string> token_bytes_;
  std::unordered_map<int32_t, size_t> added_index_by_id_;
};

}  // namespace moelora
