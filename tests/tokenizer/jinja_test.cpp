// The Jinja renderer's own behaviour and error messages (the oracle test compares it with
// Jinja2 on many more cases): errors name the construct and the line, limits hold.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tokenizer/chat_template.h"
#include "tokenizer/jinja_value.h"

namespace moelora {
namespace {

using ordered_json = nlohmann::ordered_json;

Result<std::string> render(const std::string& source, const ordered_json& vars = ordered_json::object(),
                           const jinja::RenderLimits& limits = {}) {
  auto t = JinjaTemplate::compile(source, "template");
  if (!t.ok()) return t.status();
  return (*t)->render(vars, limits);
}

std::string error_of(const std::string& source, const ordered_json& vars = ordered_json::object()) {
  auto r = render(source, vars);
  EXPECT_FALSE(r.ok()) << "expected an error, rendered: " << *r;
  return r.ok() ? "" : r.status().message();
}

TEST(Jinja, RendersTheQwenStyleHeader) {
  const ordered_json vars = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"add_generation_prompt", true}};
  auto r = render(
      "{%- for message in messages %}\n"
      "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
      "{%- endfor %}\n"
      "{%- if add_generation_prompt %}\n"
      "    {{- '<|im_start|>assistant\\n' }}\n"
      "{%- endif %}\n",
      vars);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(Jinja, KeyOrderOfJsonIsKept) {
  const auto tool = ordered_json::parse(R"({"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}}})");
  auto r = render("{{ tool | tojson }}", {{"tool", tool}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, R"({"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}}})");
}

TEST(Jinja, SyntaxErrorsNameTheLine) {
  EXPECT_EQ(error_of("line one\n{{ 'x' "), "template line 2: unexpected end of template: unclosed variable tag '{{'");
  const std::string m = error_of("a\nb\n{% if x %}\nnever closed");
  EXPECT_NE(m.find("line 3"), std::string::npos) << m;
  EXPECT_NE(m.find("'endif'"), std::string::npos) << m;
  EXPECT_NE(error_of("{{ (1 }}").find("line 1"), std::string::npos);
  EXPECT_NE(error_of("{# never closed").find("missing end of comment tag"), std::string::npos);
}

TEST(Jinja, UnsupportedConstructsAreNamed) {
  std::string m = error_of("ok\n{% include 'other.jinja' %}");
  EXPECT_NE(m.find("line 2"), std::string::npos) << m;
  EXPECT_NE(m.find("{% include %}"), std::string::npos) << m;
  m = error_of("{% extends 'base' %}");
  EXPECT_NE(m.find("{% extends %}"), std::string::npos) << m;
  m = error_of("{% for x in xs recursive %}{% endfor %}");
  EXPECT_NE(m.find("recursive"), std::string::npos) << m;
  m = error_of("{% do x %}");
  EXPECT_NE(m.find("unknown tag 'do'"), std::string::npos) << m;
  m = error_of("{{ f(*args) }}");
  EXPECT_NE(m.find("*args"), std::string::npos) << m;
  m = error_of("\n\n{{ 1 | truncate(3) }}");
  EXPECT_EQ(m, "template line 3: unsupported filter 'truncate' (not in moelora's Jinja subset)");
  m = error_of("{{ 'a'.format(1) }}");
  EXPECT_NE(m.find("str.format"), std::string::npos) << m;
  m = error_of("{% break %}");
  EXPECT_NE(m.find("'break' outside of a loop"), std::string::npos) << m;
}

TEST(Jinja, RuntimeErrorsCarryTheirMessage) {
  EXPECT_EQ(error_of("\n{{ raise_exception('Only user and assistant roles are supported!') }}"),
            "template line 2: Only user and assistant roles are supported!");
  EXPECT_EQ(error_of("{{ missing.attr }}"), "template line 1: 'missing' is undefined");
  EXPECT_EQ(error_of("{{ d.nope + 1 }}", {{"d", ordered_json::object()}}),
            "template line 1: 'dict object' has no attribute 'nope'");
  EXPECT_EQ(error_of("{{ 'a' + 1 }}"), "template line 1: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(error_of("{{ 1 // 0 }}"), "template line 1: integer division or modulo by zero");
  EXPECT_EQ(error_of("{% set d = {} %}{% set d.x = 1 %}"), "template line 1: cannot assign attribute on non-namespace object");
  EXPECT_NE(error_of("{{ [].append(1) }}").find("unsafe"), std::string::npos);
}

TEST(Jinja, LimitsStopRunawayTemplates) {
  jinja::RenderLimits limits;
  limits.max_output_bytes = 1000;
  auto r = render("{% for i in range(100) %}{{ 'x' * 50 }}{% endfor %}", ordered_json::object(), limits);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("exceeds 1000 bytes"), std::string::npos);
  r = render("{{ range(100000000) | length }}");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("range()"), std::string::npos);
  r = render("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("nests deeper"), std::string::npos);
}

TEST(Jinja, HostileNestingIsAnErrorNotACrash) {
  const std::string deep = std::string(5000, '(') + "1" + std::string(5000, ')');
  EXPECT_NE(error_of("{{ " + deep + " }}").find("nests deeper"), std::string::npos);
  std::string blocks;
  for (int i = 0; i < 2000; ++i) blocks += "{% if true %}";
  EXPECT_NE(error_of(blocks).find("nests deeper"), std::string::npos);
  EXPECT_NE(error_of("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}").find("contain itself"), std::string::npos);
  EXPECT_NE(error_of("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns | tojson }}").find("not JSON serializable"),
            std::string::npos);
}

TEST(Jinja, PythonFloatRepr) {
  EXPECT_EQ(jinja::format_float(1.0), "1.0");
  EXPECT_EQ(jinja::format_float(0.1), "0.1");
  EXPECT_EQ(jinja::format_float(1e16), "1e+16");
  EXPECT_EQ(jinja::format_float(1e15), "1000000000000000.0");
  EXPECT_EQ(jinja::format_float(1.5e-5), "1.5e-05");
  EXPECT_EQ(jinja::format_float(0.0001), "0.0001");
  EXPECT_EQ(jinja::format_float(-0.0), "-0.0");
  EXPECT_EQ(jinja::format_float(123456789012345678.0), "1.2345678901234568e+17");
  EXPECT_EQ(jinja::format_float(5e-324), "5e-324");
}

TEST(ChatTemplate, ReservedNamesCannotBeOverridden) {
  auto t = ChatTemplate::compile("{{ messages | length }}", ordered_json::object());
  ASSERT_TRUE(t.ok());
  ChatTemplateArgs args;
  args.extra = {{"messages", 1}};
  auto r = (*t)->render(ordered_json::array(), args);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'messages'"), std::string::npos);
  EXPECT_FALSE((*t)->render(ordered_json::object()).ok());  // messages must be a list
  EXPECT_FALSE((*t)->render(ordered_json::array({1})).ok());  // of objects
}

}  // namespace
}  // namespace moelora
