// Text in and out for the command-line tools: the model folder's tokenizer.json when it has one.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace moelora {
class Tokenizer;
}

namespace moelora::tools {

class TextCodec {
 public:
  explicit TextCodec(const std::string& model_dir);
  bool has_tokenizer() const { return tok_ != nullptr; }
  Result<std::vector<int32_t>> encode(const std::string& text) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  // A printable, quoted form (control characters escaped).
  static std::string quote(const std::string& text);

 private:
  std::shared_ptr<Tokenizer> tok_;
  std::string error_;
};

}  // namespace moelora::tools
