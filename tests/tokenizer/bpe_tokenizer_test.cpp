// BPE on small hand-written tokenizer.json files: merge order, both merge spellings, added
// tokens (special, lstrip/rstrip, longest match), post-processor, normalizer, invalid input and
// the errors for what is not supported.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include <nlohmann/json.hpp>

#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pretokenizer_regex.h"
#include "tokenizer/text_pipeline.h"

namespace moelora {
namespace {

using json = nlohmann::json;

// The 256 byte-level symbols (ids 0..255 in GPT-2 order) plus merged tokens from 256 on.
json byte_vocab() {
  json vocab = json::object();
  const auto& order = byte_level::bytes_in_symbol_order();
  for (int i = 0; i < 256; ++i) {
    std::string symbol;
    byte_level::encode(std::string(1, static_cast<char>(order[i])), symbol);
    vocab[symbol] = i;
  }
  return vocab;
}

int32_t byte_id(char c) {
  const auto& order = byte_level::bytes_in_symbol_order();
  for (int i = 0; i < 256; ++i) {
    if (order[i] == static_cast<uint8_t>(c)) return i;
  }
  return -1;
}

json small_tokenizer(bool pair_merges) {
  json vocab = byte_vocab();
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}, {"Ġw", "o"}, {"a", "a"}, {"b", "c"}, {"a", "b"}};
  int32_t next = 256;
  json merge_list = json::array();
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = next++;
    merge_list.push_back(pair_merges ? json::array({a, b}) : json(a + " " + b));
  }
  json t;
  t["version"] = "1.0";
  t["added_tokens"] = json::array({
      {{"id", 300}, {"content", "<|end|>"}, {"special", true}, {"normalized", false}},
      {{"id", 301}, {"content", "<tool>"}, {"special", false}, {"normalized", false}},
      {{"id", 302}, {"content", "[MASK]"}, {"special", true}, {"lstrip", true}, {"rstrip", true}, {"normalized", false}},
      {{"id", 303}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
      {{"id", 304}, {"content", "<tool>x"}, {"special", false}, {"normalized", false}},
  });
  t["normalizer"] = {{"type", "NFC"}};
  t["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         json::array({{{"type", "Split"},
                                       {"pattern", {{"Regex", R"( ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"}}},
                                       {"behavior", "Isolated"},
                                       {"invert", false}},
                                      {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  t["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                                 {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {303}}, {"tokens", {"<s>"}}}}}}};
  t["decoder"] = {{"type", "ByteLevel"}};
  t["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}, {"unk_token", nullptr}};
  return t;
}

std::shared_ptr<BpeTokenizer> load(const json& t) {
  auto r = BpeTokenizer::from_json_text(t.dump(), "test tokenizer.json");
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : nullptr;
}

using Ids = std::vector<int32_t>;

TEST(BpeTokenizer, MergesApplyByRankLeftmostFirst) {
  auto t = load(small_tokenizer(false));
  ASSERT_NE(t, nullptr);
  const int32_t hello = *t->token_to_id("hello");
  EXPECT_EQ(t->encode("hello", false), Ids{hello});
  EXPECT_EQ(t->encode("hello world", false), (Ids{hello, *t->token_to_id("Ġwo"), byte_id('r'), byte_id('l'), byte_id('d')}));
  // "a a" ranks before "a b": in "aab", the pair (a, a) merges first.
  EXPECT_EQ(t->encode("aab", false), (Ids{*t->token_to_id("aa"), byte_id('b')}));
  // Three equal symbols: the leftmost pair merges.
  EXPECT_EQ(t->encode("aaa", false), (Ids{*t->token_to_id("aa"), byte_id('a')}));
  // (b, c) ranks before (a, b): "abc" -> a + bc.
  EXPECT_EQ(t->encode("abc", false), (Ids{byte_id('a'), *t->token_to_id("bc")}));
}

TEST(BpeTokenizer, BothMergeSpellingsAgree) {
  auto a = load(small_tokenizer(false));
  auto b = load(small_tokenizer(true));
  ASSERT_TRUE(a && b);
  for (const char* text : {"hello world", "aabc abab", "xyz hell", "hellohello"}) {
    EXPECT_EQ(a->encode(text, false), b->encode(text, false)) << text;
  }
}

TEST(BpeTokenizer, AddedTokensAreSplitOutLongestFirst) {
  auto t = load(small_tokenizer(false));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->encode("<|end|>", false), Ids{300});
  EXPECT_EQ(t->encode("a<|end|><|end|>b", false), (Ids{byte_id('a'), 300, 300, byte_id('b')}));
  EXPECT_EQ(t->encode("<tool>x", false), Ids{304});  // the longest added token wins
  EXPECT_EQ(t->encode("<tool>y", false), (Ids{301, byte_id('y')}));
  EXPECT_EQ(t->encode("<|end", false).size(), 5u);   // a prefix is ordinary text
  // lstrip/rstrip: the white space around [MASK] goes into the token.
  EXPECT_EQ(t->encode("a  [MASK]  b", false), (Ids{byte_id('a'), 302, byte_id('b')}));
  EXPECT_TRUE(t->is_special(300));
  EXPECT_FALSE(t->is_special(301));
  EXPECT_EQ(t->id_to_token(300), "<|end|>");
  EXPECT_EQ(t->id_to_token(220), "Ġ");
  EXPECT_EQ(t->vocab_size(), 305);
}

TEST(BpeTokenizer, PostProcessorAddsSpecialTokensOnRequest) {
  auto t = load(small_tokenizer(false));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->encode("hello", true), (Ids{303, *t->token_to_id("hello")}));
  EXPECT_EQ(t->encode("", true), Ids{303});
  EXPECT_EQ(t->encode("", false), Ids{});
}

TEST(BpeTokenizer, NormalizerRunsOnOrdinaryText) {
  auto t = load(small_tokenizer(false));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->encode("e\u0301", false), t->encode("\u00e9", false));
}

TEST(BpeTokenizer, DecodeRoundTripsAndSkipsSpecialTokens) {
  auto t = load(small_tokenizer(false));
  ASSERT_NE(t, nullptr);
  const std::string text = "hello <tool> world<|end|> 中文 😀";
  const Ids ids = t->encode(text, false);
  EXPECT_EQ(t->decode(ids, false), text);
  EXPECT_EQ(t->decode(ids, true), "hello <tool> world 中文 😀");
  EXPECT_EQ(t->decode(Ids{999999, -1, *t->token_to_id("hello")}, false), "hello");  // unknown ids skipped
}

TEST(BpeTokenizer, InvalidUtf8BecomesReplacementCharacters) {
  auto t = load(small_tokenizer(false));
  ASSERT_NE(t, nullptr);
  const Ids ids = t->encode("a\xFF\xE4\xBD", false);
  EXPECT_EQ(t->decode(ids, false), "a\uFFFD\uFFFD");
  EXPECT_EQ(ids, t->encode("a\uFFFD\uFFFD", false));
  // Byte-level tokens that do not form UTF-8 decode to U+FFFD too.
  EXPECT_EQ(t->decode(Ids{byte_id('\xE4'), byte_id('x')}, false), "\uFFFDx");
}

TEST(BpeTokenizer, UnsupportedPartsAreClearErrors) {
  json t = small_tokenizer(false);
  t["decoder"] = {{"type", "CTC"}};
  auto r = BpeTokenizer::from_json_text(t.dump(), "x.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(r.status().message().find("decoder type 'CTC'"), std::string::npos) << r.status().message();

  t = small_tokenizer(false);
  t["pre_tokenizer"]["pretokenizers"][0]["type"] = "BertPreTokenizer";
  r = BpeTokenizer::from_json_text(t.dump(), "x.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("pre-tokenizer type 'BertPreTokenizer'"), std::string::npos);

  t = small_tokenizer(false);
  t["normalizer"] = {{"type", "NFKC"}};
  r = BpeTokenizer::from_json_text(t.dump(), "x.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("normalizer type 'NFKC'"), std::string::npos);

  t = small_tokenizer(false);
  t["model"]["merges"].push_back("zz qq");
  r = BpeTokenizer::from_json_text(t.dump(), "x.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not in the vocabulary"), std::string::npos);

  t = small_tokenizer(false);
  t["model"]["type"] = "WordPiece";
  r = BpeTokenizer::from_json_text(t.dump(), "x.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'WordPiece'"), std::string::npos);

  t = small_tokenizer(false);
  t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  r = BpeTokenizer::from_json_text(t.dump(), "x.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot compile regex"), std::string::npos);

  r = BpeTokenizer::from_json_text("{\"model\": 1", "x.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("x.json"), std::string::npos);
}

// One tokenizer serves many request threads: results do not depend on what else runs.
TEST(BpeTokenizer, ConcurrentEncodesAgree) {
  auto t = load(small_tokenizer(false));
  ASSERT_NE(t, nullptr);
  const std::vector<std::string> texts = {"hello world", "aab abc <|end|> x", "e\u0301 中文 😀", "  [MASK]  ", "\xFF\xE4"};
  std::vector<Ids> expected;
  for (const auto& text : texts) expected.push_back(t->encode(text, true));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int round = 0; round < 300; ++round) {
        const size_t i = static_cast<size_t>(round + k) % texts.size();
        if (t->encode(texts[i], true) != expected[i]) ++mismatches;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// \s means different things in the libraries we reproduce; see TokenizerCompat.
TEST(PretokenizerRegex, WhiteSpaceFollowsTheChosenLibrary) {
  const auto matches = [](const char* text, TokenizerCompat compat) {
    auto re = PretokenizerRegex::compile(R"(\s+)", compat, "test");
    EXPECT_TRUE(re.ok());
    std::vector<std::pair<size_t, size_t>> m;
    (*re)->find_all(text, m);
    return m.size();
  };
  EXPECT_EQ(matches("a\u0085b", TokenizerCompat::kHuggingFace), 1u);
  EXPECT_EQ(matches("a\u0085b", TokenizerCompat::kTransformersJs), 0u);
  EXPECT_EQ(matches("a\ufeffb", TokenizerCompat::kHuggingFace), 0u);
  EXPECT_EQ(matches("a\ufeffb", TokenizerCompat::kTransformersJs), 1u);
  EXPECT_EQ(matches("a\u180eb", TokenizerCompat::kHuggingFace), 0u);  // PCRE2's own \s has it
  EXPECT_EQ(matches("a\u3000b", TokenizerCompat::kHuggingFace), 1u);
}

TEST(PretokenizerRegex, CaseInsensitiveContractions) {
  const char* pattern = "(?i:'s|'t|'re|'ve|'m|'ll|'d)";
  for (auto [compat, expected] : {std::pair{TokenizerCompat::kHuggingFace, 2u}, {TokenizerCompat::kTransformersJs, 1u}}) {
    auto re = PretokenizerRegex::compile(pattern, compat, "test");
    ASSERT_TRUE(re.ok());
    std::vector<std::pair<size_t, size_t>> m;
    (*re)->find_all("'S '\u017f", m);  // 'ſ folds to 's in Oniguruma, not in JavaScript
    EXPECT_EQ(m.size(), expected);
  }
}

TEST(PretokenizerRegex, TranslationRejectsWhatItCannotExpress) {
  EXPECT_TRUE(translate_pattern(R"([^\s\p{L}])", TokenizerCompat::kHuggingFace).ok());
  auto r = translate_pattern(R"([^\S])", TokenizerCompat::kHuggingFace);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("inside a character class"), std::string::npos);
  EXPECT_EQ(*translate_pattern(R"([\]\s])", TokenizerCompat::kTransformersJs),
            R"([\])" + std::string(R"(\t\n\x0B\f\r\x20\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}])"));
}

TEST(SplitBehavior, AllBehaviorsFollowRustTokenizers) {
  using V = std::vector<std::string>;
  const std::string text = "a-b--c";
  const std::vector<std::pair<size_t, size_t>> dashes = {{1, 2}, {3, 4}, {4, 5}};
  EXPECT_EQ(split_by_matches(text, dashes, SplitBehavior::kRemoved, false), (V{"a", "b", "c"}));
  EXPECT_EQ(split_by_matches(text, dashes, SplitBehavior::kIsolated, false), (V{"a", "-", "b", "-", "-", "c"}));
  EXPECT_EQ(split_by_matches(text, dashes, SplitBehavior::kMergedWithPrevious, false), (V{"a-", "b-", "-", "c"}));
  EXPECT_EQ(split_by_matches(text, dashes, SplitBehavior::kMergedWithNext, false), (V{"a", "-b", "-", "-c"}));
  EXPECT_EQ(split_by_matches(text, dashes, SplitBehavior::kContiguous, false), (V{"a", "-", "b", "--", "c"}));
  EXPECT_EQ(split_by_matches(text, dashes, SplitBehavior::kRemoved, true), (V{"-", "-", "-"}));
}

}  // namespace
}  // namespace moelora
