// SentencePiece-style tokenizer.json files written by hand: the legacy Llama 2 / Mixtral layout
// (Prepend + Replace normalizer; Replace, ByteFallback, Fuse, Strip decoder) and the Metaspace
// layout (pre-tokenizer with prepend_scheme and split; Metaspace decoder), byte fallback, the
// first-token and leading-space rules of decoding, streaming, and the chains we refuse.
#include <gtest/gtest.h>

#include <random>

#include <nlohmann/json.hpp>

#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/stream_decoder.h"

namespace moelora {
namespace {

using json = nlohmann::json;
const std::string kMeta = "\xE2\x96\x81";  // '▁'

// <unk> <s> </s>, the 256 byte tokens, then a few '▁'-words.
json vocab_model() {
  json vocab = json::object();
  vocab["<unk>"] = 0;
  vocab["<s>"] = 1;
  vocab["</s>"] = 2;
  for (int b = 0; b < 256; ++b) vocab[fmt::format("<0x{:02X}>", b)] = 3 + b;
  int id = 259;
  for (const std::string& t : {kMeta, std::string("a"), std::string("b"), kMeta + "a", kMeta + "b", std::string("ab"),
                               kMeta + "ab", kMeta + kMeta}) {
    vocab[t] = id++;
  }
  json merges = json::array({kMeta + " a", kMeta + " b", "a b", kMeta + "a b", kMeta + " " + kMeta});
  return {{"type", "BPE"},        {"vocab", vocab},          {"merges", merges},   {"unk_token", "<unk>"},
          {"fuse_unk", true},     {"byte_fallback", true},   {"dropout", nullptr}};
}

json added_tokens() {
  json list = json::array();
  for (int id = 0; id < 3; ++id) {
    const char* content[] = {"<unk>", "<s>", "</s>"};
    list.push_back({{"id", id}, {"content", content[id]}, {"special", true}, {"normalized", false},
                    {"lstrip", false}, {"rstrip", false}, {"single_word", false}});
  }
  return list;
}

json legacy_tokenizer() {
  return {{"added_tokens", added_tokens()},
          {"normalizer", {{"type", "Sequence"}, {"normalizers", json::array({
              {{"type", "Prepend"}, {"prepend", kMeta}},
              {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMeta}}})}}},
          {"pre_tokenizer", nullptr},
          {"post_processor", nullptr},
          {"decoder", {{"type", "Sequence"}, {"decoders", json::array({
              {{"type", "Replace"}, {"pattern", {{"String", kMeta}}}, {"content", " "}},
              {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
              {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
          {"model", vocab_model()}};
}

json metaspace(const char* scheme, bool split) {
  return {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", scheme}, {"split", split}};
}

json metaspace_tokenizer(const char* scheme, bool split) {
  json t = legacy_tokenizer();
  t["normalizer"] = nullptr;
  t["pre_tokenizer"] = metaspace(scheme, split);
  t["decoder"] = {{"type", "Sequence"},
                  {"decoders", json::array({metaspace(scheme, split), {{"type", "ByteFallback"}}, {{"type", "Fuse"}}})}};
  return t;
}

std::shared_ptr<BpeTokenizer> load(const json& t, TokenizerCompat compat = TokenizerCompat::kHuggingFace) {
  BpeTokenizerOptions options;
  options.compat = compat;
  auto r = BpeTokenizer::from_json_text(t.dump(), "sp.json", options);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : nullptr;
}

std::vector<int32_t> ids_of(const BpeTokenizer& tok, std::initializer_list<std::string> tokens) {
  std::vector<int32_t> ids;
  for (const std::string& t : tokens) ids.push_back(*tok.token_to_id(t));
  return ids;
}

std::string stream(const BpeTokenizer& tok, const std::vector<int32_t>& ids, bool skip, bool continues = false) {
  StreamDecoder d(std::shared_ptr<const BpeTokenizer>(&tok, [](const BpeTokenizer*) {}), skip, continues);
  std::string out;
  for (int32_t id : ids) out += d.push(id);
  return out + d.finish();
}

TEST(SentencePiece, LegacyLayoutEncodesWordsWithPrefixSpaceAndByteFallback) {
  const auto tok = load(legacy_tokenizer());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->encode("ab a", false), ids_of(*tok, {kMeta + "ab", kMeta + "a"}));
  // 'ü' is not in the vocabulary: its two UTF-8 bytes.
  EXPECT_EQ(tok->encode("a\xC3\xBC", false), ids_of(*tok, {kMeta + "a", "<0xC3>", "<0xBC>"}));
  // The normalizer runs on each text between added tokens: each gets its own '▁'.
  EXPECT_EQ(tok->encode("a<s>b", false), ids_of(*tok, {kMeta + "a", "<s>", kMeta + "b"}));
}

TEST(SentencePiece, LegacyDecoderStripsOneLeadingSpaceOfTheWholeText) {
  const auto tok = load(legacy_tokenizer());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->decode(ids_of(*tok, {kMeta + "ab", kMeta + "a"}), false), "ab a");
  EXPECT_EQ(tok->decode(ids_of(*tok, {kMeta + kMeta, kMeta + "a"}), false), "  a");  // 3 spaces, 1 stripped
  EXPECT_EQ(tok->decode(ids_of(*tok, {"<s>", kMeta + "a"}), false), "<s> a");
  EXPECT_EQ(tok->decode(ids_of(*tok, {"<s>", kMeta + "a"}), true), "a");
  EXPECT_EQ(tok->decode(ids_of(*tok, {kMeta + "a", "<0xC3>", "<0xBC>"}), false), "a\xC3\xBC");
  // An unfinished character: U+FFFD, as TextDecoder gives for the byte run.
  EXPECT_EQ(tok->decode(ids_of(*tok, {kMeta + "a", "<0xC3>", kMeta + "b"}), false), "a\xEF\xBF\xBD b");
}

TEST(SentencePiece, MetaspaceSplitDecidesWhetherSpaceRunsMerge) {
  const auto split = load(metaspace_tokenizer("always", true));
  const auto whole = load(metaspace_tokenizer("always", false));
  ASSERT_NE(split, nullptr);
  ASSERT_NE(whole, nullptr);
  // "   a" -> "▁▁▁a" (no '▁' is prepended to a text that starts with one): split cuts before
  // every '▁'; without split the BPE sees one word and merges the first two.
  EXPECT_EQ(split->encode("   a", false), ids_of(*split, {kMeta, kMeta, kMeta + "a"}));
  EXPECT_EQ(whole->encode("   a", false), ids_of(*whole, {kMeta + kMeta, kMeta + "a"}));
}

TEST(SentencePiece, PrependSchemeFirstOnlyPrefixesTheStartOfTheInput) {
  const auto first = load(metaspace_tokenizer("first", false));
  const auto always = load(metaspace_tokenizer("always", false));
  const auto never = load(metaspace_tokenizer("never", false));
  EXPECT_EQ(first->encode("<s>a", false), ids_of(*first, {"<s>", "a"}));
  EXPECT_EQ(always->encode("<s>a", false), ids_of(*always, {"<s>", kMeta + "a"}));
  EXPECT_EQ(first->encode("a<s>b", false), ids_of(*first, {kMeta + "a", "<s>", "b"}));
  EXPECT_EQ(never->encode("a b", false), ids_of(*never, {"a", kMeta + "b"}));
}

TEST(SentencePiece, MetaspaceDecoderFirstTokenRuleFollowsTheChosenLibrary) {
  const auto ids = [](const BpeTokenizer& t) { return ids_of(t, {kMeta + kMeta, kMeta + "a"}); };
  // Rust drops every '▁' of token 0; transformers.js one leading space (with add_prefix_space).
  json t = metaspace_tokenizer("first", false);
  const auto rust = load(t);
  EXPECT_EQ(rust->decode(ids(*rust), false), " a");
  for (json& d : t["decoder"]["decoders"])
    if (d["type"] == "Metaspace") d["add_prefix_space"] = true;
  const auto js = load(t, TokenizerCompat::kTransformersJs);
  EXPECT_EQ(js->decode(ids(*js), false), "  a");
  // Not the first token: every '▁' is a space.
  EXPECT_EQ(rust->decode(ids_of(*rust, {"a", kMeta + kMeta}), false), "a  ");
  const auto never = load(metaspace_tokenizer("never", false));
  EXPECT_EQ(never->decode(ids(*never), false), "   a");
}

TEST(SentencePiece, StreamingEqualsDecodeOnRandomIds) {
  std::mt19937 rng(7);
  for (const json& t : {legacy_tokenizer(), metaspace_tokenizer("first", false), metaspace_tokenizer("always", true)}) {
    const auto tok = load(t);
    ASSERT_NE(tok, nullptr);
    for (int iter = 0; iter < 2000; ++iter) {
      std::vector<int32_t> ids(rng() % 12);
      // Mostly words and spaces, some byte tokens (half characters included) and specials.
      for (int32_t& id : ids) id = rng() % 3 == 0 ? static_cast<int32_t>(rng() % 262) : 259 + static_cast<int32_t>(rng() % 8);
      for (bool skip : {false, true}) {
        ASSERT_EQ(stream(*tok, ids, skip), tok->decode(ids, skip)) << nlohmann::json(ids).dump();
      }
    }
  }
}

TEST(SentencePiece, ContinuationStreamKeepsTheFirstSpace) {
  const auto tok = load(legacy_tokenizer());
  const auto ids = ids_of(*tok, {kMeta + "ab", kMeta + "a"});
  EXPECT_EQ(stream(*tok, ids, true), "ab a");
  EXPECT_EQ(stream(*tok, ids, true, /*continues=*/true), " ab a");
  const auto meta = load(metaspace_tokenizer("first", false));
  EXPECT_EQ(stream(*meta, ids_of(*meta, {kMeta + "b"}), true, true), " b");
}

TEST(SentencePiece, UnstreamableDecoderChainsAreRefused) {
  const auto refused = [](json decoders, const std::string& expected) {
    json t = legacy_tokenizer();
    t["decoder"] = {{"type", "Sequence"}, {"decoders", decoders}};
    auto r = BpeTokenizer::from_json_text(t.dump(), "sp.json");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), ErrorCode::kUnsupported);
    EXPECT_NE(r.status().message().find(expected), std::string::npos) << r.status().message();
  };
  refused(json::array({{{"type", "Fuse"}}, {{"type", "Strip"}, {"content", " "}, {"start", 0}, {"stop", 1}}}),
          "stop > 0 after Fuse");
  refused(json::array({{{"type", "Fuse"}}, {{"type", "Replace"}, {"pattern", {{"String", "a"}}}, {"content", "b"}}}),
          "'Replace' after Fuse");
  refused(json::array({{{"type", "WordPiece"}}}), "decoder type 'WordPiece'");
  json t = legacy_tokenizer();
  t["decoder"] = nullptr;
  auto r = BpeTokenizer::from_json_text(t.dump(), "sp.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("a decoder is required"), std::string::npos);
  t["decoder"] = legacy_tokenizer()["decoder"];
  t["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "sometimes"}};
  r = BpeTokenizer::from_json_text(t.dump(), "sp.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("prepend_scheme 'sometimes'"), std::string::npos);
}

}  // namespace
}  // namespace moelora
