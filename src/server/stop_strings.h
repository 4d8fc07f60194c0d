// Stop strings, applied to the streamed text of one choice. The engine stops on token ids; text
// stops are the server's job because only the detokenized text knows them (a stop string may
// span tokens, or end in the middle of one). Text that could still be the start of a stop
// string is held back, so a streamed response never shows text that the stop later cuts off.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moelora::server {

class StopStringMatcher {
 public:
  // Empty strings in `stops` are ignored. With `include_stop` the matched stop string is part
  // of the output (vLLM's include_stop_str_in_output).
  StopStringMatcher(std::vector<std::string> stops, bool include_stop);

  struct Output {
    std::string text;      // safe to emit now
    bool stopped = false;  // a stop string matched: the choice is finished
    std::string matched;   // which one
  };
  // Appends `text` (valid UTF-8) and returns what can be emitted. After a stop, feeds are ignored.
  Output feed(std::string_view text);
  // End of generation: everything still held back.
  std::string flush();

  bool stopped() const { return stopped_; }
  bool active() const { return !stops_.empty(); }

 private:
  std::vector<std::string> stops_;
  bool include_stop_;
  bool stopped_ = false;
  std::string held_;
};

}  // namespace moelora::server
