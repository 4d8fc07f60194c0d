// Tool calling: the model writes its calls as text in its family's format, and these parsers turn
// that text into OpenAI `tool_calls`, whole (a response) or incrementally (SSE deltas):
//  - kHermes (Qwen2.5/Qwen3, Hermes): <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
//  - kDeepSeekV3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n
//    ARGS\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
//  - kMistral: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
// Text before the first call is the message's content. Output that does not parse (an unclosed
// call, broken JSON, a call without a name) is never an error: the whole text stays content and
// no tool call is reported, as vLLM's parsers do.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/json_util.h"
#include "server/api_error.h"  // OJson

namespace moelora::server {

enum class ToolCallFormat { kNone, kHermes, kDeepSeekV3, kMistral };

const char* tool_call_format_name(ToolCallFormat f);

// The format of a model: its vocabulary's marker tokens decide (`has_token`), then the chat
// template's text (`template_mentions`, e.g. the bundled demo model writes <tool_call> as text).
ToolCallFormat detect_tool_call_format(const std::function<bool(std::string_view)>& has_token,
                                       const std::function<bool(std::string_view)>& template_mentions);

// Whether the format's markers are special tokens that skip_special_tokens would remove from
// the text (they must then be decoded for the parser to see them).
bool tool_markers_are_special(ToolCallFormat f);

struct ToolCall {
  std::string id;         // call_<24 hex> (Mistral: 9 alphanumerics, as its templates require)
  std::string name;
  std::string arguments;  // a JSON text (compact), as OpenAI sends it
};

struct ParsedToolCalls {
  std::string content;  // the text that is not a call (all of it when nothing parsed)
  std::vector<ToolCall> calls;
};

// The whole generated text of a choice.
ParsedToolCalls parse_tool_calls(ToolCallFormat format, std::string_view text);

// A fresh call id in the format's style.
std::string make_tool_call_id(ToolCallFormat format);

// OpenAI's objects: [{"id", "type": "function", "function": {"name", "arguments"}}].
OJson tool_calls_json(const std::vector<ToolCall>& calls);

// Incremental parsing for streams. Content streams as it arrives, except a possible start of
// the first marker, which is held back until it is decided. Once the marker is seen, text is
// collected until a call is complete; each complete call gives two deltas, as OpenAI streams
// them: {index, id, type, function: {name, arguments: ""}}, then {index, function: {arguments}}.
// finish() settles the rest: calls that never parsed come out as content, so the streamed
// content plus calls always equal parse_tool_calls() of the whole text.
class ToolCallStreamParser {
 public:
  explicit ToolCallStreamParser(ToolCallFormat format) : format_(format) {}

  struct Delta {
    std::string content;
    OJson tool_calls = OJson::array();  // delta objects, as they go into a chunk's delta
  };
  Delta feed(std::string_view text);
  Delta finish();
  // Whether at least one call was reported (finish_reason "tool_calls").
  bool called() const { return next_index_ > 0; }

 private:
  void emit_calls(Delta& d, bool at_end);

  ToolCallFormat format_;
  std::string held_;      // content that may be the start of the marker
  std::string calls_;     // text from the first marker on
  bool in_calls_ = false;
  size_t consumed_ = 0;   // bytes of calls_ already turned into reported calls
  int next_index_ = 0;
};

}  // namespace moelora::server
