// Loading a tokenizer directory: the bundled demo tokenizer, tokenizer_config.json variants
// (special tokens as strings or AddedToken objects, add_bos_token, named templates, broken
// templates), chat_template.jinja, generation_config.json, and errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include <nlohmann/json.hpp>

#include "tests/tokenizer/test_support.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/tokenizer_dir.h"
#include "tokenizer/utf8.h"

namespace moelora {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;
using Ids = std::vector<int32_t>;

const std::string kDemoDir = test::source_path("models/tiny-qwen3moe");

std::shared_ptr<Tokenizer> load_ok(const std::string& dir) {
  auto t = Tokenizer::load(dir);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? *t : nullptr;
}

// A scratch tokenizer directory: the demo tokenizer.json plus the given extra files.
std::string make_dir(const std::string& name, const std::vector<std::pair<std::string, std::string>>& files) {
  const std::string dir = test::scratch_dir() + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto tokenizer = json::parse(test::read_file(kDemoDir + "/tokenizer.json"));
  tokenizer["added_tokens"] = json::array({{{"id", 256}, {"content", "<s>"}, {"special", true}},
                                           {{"id", 257}, {"content", "</s>"}, {"special", true}}});
  test::write_file(dir + "/tokenizer.json", tokenizer.dump());
  for (const auto& [file, content] : files) test::write_file(dir + "/" + file, content);
  return dir;
}

TEST(DemoTokenizer, HasTheByteSymbolsInGpt2Order) {
  auto t = load_ok(kDemoDir);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->vocab_size(), 256);
  const auto& order = byte_level::bytes_in_symbol_order();
  for (int id = 0; id < 256; ++id) {
    EXPECT_EQ(t->decode(Ids{id}), utf8::sanitize(std::string(1, static_cast<char>(order[id])))) << id;
  }
  EXPECT_EQ(t->id_to_token(220), "Ġ");
  EXPECT_EQ(t->id_to_token(198), "Ċ");
  EXPECT_EQ(t->encode("hi"), (Ids{71, 72}));
  EXPECT_FALSE(t->eos_token_id().has_value());
  EXPECT_FALSE(t->bos_token_id().has_value());
  EXPECT_TRUE(t->eos_token_ids().empty());
}

TEST(DemoTokenizer, EveryByteStringRoundTrips) {
  auto t = load_ok(kDemoDir);
  ASSERT_NE(t, nullptr);
  std::mt19937 rng(7);
  for (int round = 0; round < 500; ++round) {
    std::string text;
    const size_t n = rng() % 64;
    for (size_t i = 0; i < n; ++i) text += "aé中😀 \n\t<|>"[rng() % 16];  // random bytes of these
    const Ids ids = t->encode(text);
    EXPECT_EQ(ids.size(), utf8::sanitize(text).size());  // one id per byte once made valid
    EXPECT_EQ(t->decode(ids), utf8::sanitize(text));
  }
}

TEST(DemoTokenizer, RendersChatMlAsPlainText) {
  auto t = load_ok(kDemoDir);
  ASSERT_NE(t, nullptr);
  ASSERT_TRUE(t->has_chat_template());
  const auto messages = ordered_json::parse(R"([{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Hi"}])");
  auto text = t->apply_chat_template(messages, /*add_generation_prompt=*/true);
  ASSERT_TRUE(text.ok()) << text.status().to_string();
  EXPECT_EQ(*text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  // A sorted-key nlohmann::json works too (it converts; only tojson key order can differ).
  auto same = t->apply_chat_template(nlohmann::json::parse(messages.dump()), true);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(*same, *text);
  auto ids = t->encode_chat(messages);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(), std::string("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n").size());
}

TEST(TokenizerDir, SpecialTokensAndAddBosToken) {
  const std::string dir = make_dir("bos_eos", {{"tokenizer_config.json", R"({
      "add_bos_token": true, "add_eos_token": false,
      "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false, "normalized": true},
      "eos_token": "</s>", "pad_token": null,
      "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"})"},
                                               {"generation_config.json", R"({"eos_token_id": [257, 10]})"}});
  auto t = load_ok(dir);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->bos_token(), "<s>");
  EXPECT_EQ(t->bos_token_id(), 256);
  EXPECT_EQ(t->eos_token_id(), 257);
  EXPECT_EQ(t->eos_token_ids(), (Ids{257, 10}));
  EXPECT_EQ(t->encode("hi", true), (Ids{256, 71, 72}));
  EXPECT_EQ(t->encode("hi", false), (Ids{71, 72}));
  EXPECT_EQ(t->decode(Ids{256, 71, 72, 257}, true), "hi");
  EXPECT_EQ(t->decode(Ids{256, 71, 72, 257}, false), "<s>hi</s>");
  auto text = t->apply_chat_template(ordered_json::parse(R"([{"role": "user", "content": "x"}])"), false);
  ASSERT_TRUE(text.ok()) << text.status().to_string();
  EXPECT_EQ(*text, "<s>x</s>");
  auto ids = t->encode_chat(ordered_json::parse(R"([{"role": "user", "content": "x"}])"));
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (Ids{256, 87, 257}));  // the template's BOS, not a second one
}

TEST(TokenizerDir, NamedTemplatesAndTheJinjaFile) {
  const std::string dir = make_dir("named", {{"tokenizer_config.json", R"({"chat_template": [
      {"name": "default", "template": "default:{{ messages | length }}"},
      {"name": "tool_use", "template": "tools:{{ tools | length }}"}]})"}});
  auto t = load_ok(dir);
  ASSERT_NE(t, nullptr);
  const auto one = ordered_json::parse(R"([{"role": "user", "content": "x"}])");
  EXPECT_EQ(*t->apply_chat_template(one, false), "default:1");
  EXPECT_EQ(*t->apply_chat_template(one, false, ordered_json::parse(R"([{"type": "function"}])")), "tools:1");
  ChatTemplateArgs args;
  args.template_name = "nope";
  EXPECT_FALSE(t->apply_chat_template(one, args).ok());

  const std::string jdir = make_dir("jinja_file", {{"tokenizer_config.json", R"({"chat_template": "from config"})"},
                                                   {"chat_template.jinja", "from file {{ add_generation_prompt }}\n"}});
  auto j = load_ok(jdir);
  ASSERT_NE(j, nullptr);
  EXPECT_EQ(*j->apply_chat_template(one, true), "from file True");
}

TEST(TokenizerDir, ABrokenTemplateFailsChatRequestsOnly) {
  const std::string dir = make_dir("broken", {{"tokenizer_config.json", R"({"chat_template": "ok\n{% include 'x' %}"})"}});
  auto t = load_ok(dir);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->encode("hi", false), (Ids{71, 72}));
  EXPECT_TRUE(t->has_chat_template());
  auto r = t->apply_chat_template(ordered_json::array(), true);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("line 2"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("include"), std::string::npos) << r.status().message();
}

TEST(TokenizerDir, ErrorsAreClear) {
  auto r = Tokenizer::load(test::scratch_dir() + "/does-not-exist");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kNotFound);
  const std::string empty = test::scratch_dir() + "/empty_dir";
  std::filesystem::create_directories(empty);
  r = Tokenizer::load(empty);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tokenizer.json"), std::string::npos);
  const std::string bad = make_dir("bad_config", {{"tokenizer_config.json", R"({"bos_token": 5})"}});
  r = Tokenizer::load(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("bos_token"), std::string::npos);

  auto t = load_ok(kDemoDir);
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(t->validate_ids(Ids{0, 255}).ok());
  const Status s = t->validate_ids(Ids{0, 256});
  EXPECT_EQ(s.message(), "token id 256 (at position 1) is not in the vocabulary of 256 ids");
  const auto no_template = make_dir("no_template", {});
  auto nt = load_ok(no_template);
  ASSERT_NE(nt, nullptr);
  EXPECT_FALSE(nt->has_chat_template());
  EXPECT_EQ(nt->apply_chat_template(ordered_json::array(), true).status().code(), ErrorCode::kFailedPrecondition);
}

// DeepSeek-V3's tokenizer_config.json asks for a BOS (add_bos_token), as transformers adds it.
TEST(TokenizerDir, DeepSeekV3AddsItsBos) {
  if (!test::have_node_modules()) GTEST_SKIP() << test::kNoOracleMessage;
  ASSERT_EQ(test::missing_oracle_packages(), "");
  auto t = load_ok(test::npm_model_dir("tokenizer-deepseek_v3"));
  ASSERT_NE(t, nullptr);
  const Ids plain = t->encode("Hello", false);
  Ids with_bos = {0};
  with_bos.insert(with_bos.end(), plain.begin(), plain.end());
  EXPECT_EQ(t->encode("Hello", true), with_bos);
  EXPECT_EQ(t->eos_token_id(), 1);
  auto q = load_ok(test::npm_model_dir("tokenizer-qwen3"));
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->encode("Hello", true), q->encode("Hello", false));  // Qwen adds nothing
  EXPECT_EQ(q->eos_token_id(), 151645);
  EXPECT_EQ(q->encode("Hello, world!", false), (Ids{9707, 11, 1879, 0}));
}

}  // namespace
}  // namespace moelora
