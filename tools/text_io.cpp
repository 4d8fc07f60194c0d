#include "tools/text_io.h"

#include <filesystem>

#include <fmt/format.h>

#include "tokenizer/tokenizer_dir.h"

namespace moelora::tools {

TextCodec::TextCodec(const std::string& model_dir) {
  const std::string path = (std::filesystem::path(model_dir) / "tokenizer.json").string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    error_ = model_dir + " has no tokenizer.json: give prompts as ids (--prompt-ids)";
    return;
  }
  // The folder's tokenizer as the server uses it (tokenizer_config.json decides BOS and friends).
  auto t = Tokenizer::load(model_dir);
  if (t.ok()) tok_ = *t;
  else error_ = t.status().message();
}

Result<std::vector<int32_t>> TextCodec::encode(const std::string& text) const {
  if (!tok_) return invalid_argument("{}", error_);
  return tok_->encode(text, /*add_special_tokens=*/true);
}

std::string TextCodec::decode(const std::vector<int32_t>& ids) const {
  return tok_ ? tok_->decode(ids, /*skip_special_tokens=*/true) : std::string();
}

std::string TextCodec::quote(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') out += std::string("\\") + static_cast<char>(c);
    else if (c == '\n') out += "\\n";
    else if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  return out + "\"";
}

}  // namespace moelora::tools
