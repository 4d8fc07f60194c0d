// libFuzzer target: generated text through every tool-call parser, whole and streamed in chunks.
// Model output is not trusted: no crash, and the documented invariant must hold — the streamed
// content plus the streamed calls equal parse_tool_calls() of the whole text.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "server/tool_calls.h"

using moelora::server::ToolCallFormat;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // First byte: the format; second: the chunking seed.
  const ToolCallFormat formats[] = {ToolCallFormat::kHermes, ToolCallFormat::kDeepSeekV3, ToolCallFormat::kMistral};
  const ToolCallFormat format = formats[data[0] % 3];
  uint32_t seed = data[1] + 1;
  const std::string_view text(reinterpret_cast<const char*>(data) + 2, size - 2);

  const auto whole = moelora::server::parse_tool_calls(format, text);
  (void)moelora::server::tool_calls_json(whole.calls);

  moelora::server::ToolCallStreamParser parser(format);
  std::string content;
  std::vector<std::string> names, arguments;
  auto take = [&](const moelora::server::ToolCallStreamParser::Delta& d) {
    content += d.content;
    for (const auto& c : d.tool_calls) {
      const auto& f = c.at("function");
      if (f.contains("name")) {
        names.push_back(f.at("name").get<std::string>());
        arguments.emplace_back();
      } else if (!arguments.empty()) {
        arguments.back() += f.at("arguments").get<std::string>();
      }
    }
  };
  size_t pos = 0;
  while (pos < text.size()) {
    seed = seed * 1103515245u + 12345u;
    const size_t n = 1 + (seed >> 16) % 17;
    take(parser.feed(text.substr(pos, n)));
    pos += n;
  }
  take(parser.finish());

  bool same = content == whole.content && names.size() == whole.calls.size();
  for (size_t i = 0; same && i < names.size(); ++i)
    same = names[i] == whole.calls[i].name && arguments[i] == whole.calls[i].arguments;
  if (!same) std::abort();  // a finding: streaming and whole parsing disagree
  if (parser.called() != !whole.calls.empty()) std::abort();
  return 0;
}
