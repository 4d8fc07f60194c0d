// Streaming detokenization: characters split across tokens are held back, never cut; what
// cannot become valid UTF-8 is U+FFFD at once; the chunks add up to decode().
#include <gtest/gtest.h>

#include <random>

#include <nlohmann/json.hpp>

#include "tests/tokenizer/test_support.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/utf8.h"

namespace moelora {
namespace {

// The bundled demo tokenizer: one token per byte, plus two added tokens for these tests.
std::shared_ptr<BpeTokenizer> byte_tokenizer() {
  auto j = nlohmann::json::parse(test::read_file(test::source_path("models/tiny-qwen3moe/tokenizer.json")));
  j["added_tokens"] = nlohmann::json::array({{{"id", 256}, {"content", "<|end|>"}, {"special", true}},
                                             {{"id", 257}, {"content", "<tool>"}, {"special", false}}});
  auto t = BpeTokenizer::from_json_text(j.dump(), "demo tokenizer.json");
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return *t;
}

std::vector<int32_t> ids_of_bytes(const BpeTokenizer& t, std::string_view bytes) {
  std::vector<int32_t> ids;
  for (char c : bytes) {
    std::string symbol;
    byte_level::encode(std::string(1, c), symbol);
    ids.push_back(*t.token_to_id(symbol));
  }
  return ids;
}

TEST(StreamDecoder, HoldsBackAMultiByteCharacterUntilItIsComplete) {
  auto t = byte_tokenizer();
  StreamDecoder d(t, false);
  const auto ids = ids_of_bytes(*t, "a😀b");  // 😀 is F0 9F 98 80
  EXPECT_EQ(d.push(ids[0]), "a");
  EXPECT_EQ(d.push(ids[1]), "");
  EXPECT_EQ(d.pending_bytes(), 1u);
  EXPECT_EQ(d.push(ids[2]), "");
  EXPECT_EQ(d.push(ids[3]), "");
  EXPECT_EQ(d.pending_bytes(), 3u);
  EXPECT_EQ(d.push(ids[4]), "😀");
  EXPECT_EQ(d.push(ids[5]), "b");
  EXPECT_EQ(d.finish(), "");
}

TEST(StreamDecoder, BytesThatCannotCompleteBecomeReplacementCharacters) {
  auto t = byte_tokenizer();
  StreamDecoder d(t, false);
  const auto ids = ids_of_bytes(*t, "\xE4\xBD" "A" "\xFF" "\xED\xA0");
  EXPECT_EQ(d.push(ids[0]), "");
  EXPECT_EQ(d.push(ids[1]), "");
  EXPECT_EQ(d.push(ids[2]), "\uFFFDA");  // E4 BD then 'A': one replacement, then A
  EXPECT_EQ(d.push(ids[3]), "\uFFFD");
  EXPECT_EQ(d.push(ids[4]), "");         // ED could still start a character
  EXPECT_EQ(d.push(ids[5]), "\uFFFD\uFFFD");  // ED A0 is a surrogate: never valid
  EXPECT_EQ(d.finish(), "");
}

TEST(StreamDecoder, FinishFlushesAnUnfinishedCharacter) {
  auto t = byte_tokenizer();
  StreamDecoder d(t, false);
  for (int32_t id : ids_of_bytes(*t, "x\xE4\xBD")) d.push(id);
  EXPECT_EQ(d.finish(), "\uFFFD");
  EXPECT_EQ(d.pending_bytes(), 0u);
}

TEST(StreamDecoder, AddedTokensEndPendingBytesAndCanBeSkipped) {
  auto t = byte_tokenizer();
  const auto ids = ids_of_bytes(*t, "\xE4\xBD");
  StreamDecoder keep(t, false);
  keep.push(ids[0]);
  EXPECT_EQ(keep.push(256), "\uFFFD<|end|>");
  StreamDecoder skip(t, true);
  EXPECT_EQ(skip.push(256), "");
  EXPECT_EQ(skip.push(257), "<tool>");  // not special: kept
  EXPECT_EQ(skip.push(999999), "");     // unknown id: nothing
}

// Random token streams: every chunk is valid UTF-8 and the chunks add up to decode().
TEST(StreamDecoder, ChunksAreValidAndAddUpToDecode) {
  auto t = byte_tokenizer();
  std::mt19937 rng(1234);
  const std::string samples[] = {"héllo", "中文字", "😀👍🏽", "\xF0\x9F", "\xE4", "\x80", "<", "ok", "\xC3\xA9"};
  for (int round = 0; round < 2000; ++round) {
    std::vector<int32_t> ids;
    const int parts = 1 + static_cast<int>(rng() % 12);
    for (int p = 0; p < parts; ++p) {
      const int kind = static_cast<int>(rng() % 10);
      if (kind == 0) {
        ids.push_back(256 + static_cast<int32_t>(rng() % 2));
      } else if (kind == 1) {
        ids.push_back(static_cast<int32_t>(rng() % 256));  // any byte
      } else {
        for (int32_t id : ids_of_bytes(*t, samples[rng() % std::size(samples)])) ids.push_back(id);
      }
    }
    for (bool skip : {false, true}) {
      StreamDecoder d(t, skip);
      std::string streamed;
      for (int32_t id : ids) {
        const std::string chunk = d.push(id);
        ASSERT_TRUE(utf8::is_valid(chunk));
        streamed += chunk;
      }
      streamed += d.finish();
      ASSERT_EQ(streamed, t->decode(ids, skip)) << "round " << round;
    }
  }
}

}  // namespace
}  // namespace moelora
