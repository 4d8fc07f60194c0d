#include "tests/testutil/test_files.h"

#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "core/dtype.h"
#include "core/check.h"
#include "io/safetensors.h"

namespace moelora::testutil {

namespace fs = std::filesystem;

TempDir::TempDir() {
  static std::mt19937_64 rng{std::random_device{}()};
  path_ = fs::temp_directory_path() / ("moelora-test-" + std::to_string(rng()));
  fs::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

std::string make_raw_safetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string make_safetensors(const std::map<std::string, StTensor>& tensors) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  std::string data;
  for (const auto& [name, t] : tensors) {
    h[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  }
  std::string header = h.dump();
  while (header.size() % 8) header += ' ';
  return make_raw_safetensors(header, data);
}

StTensor f32_tensor(const std::vector<int64_t>& shape, const std::vector<float>& values) {
  StTensor t{"F32", shape, std::vector<uint8_t>(values.size() * 4)};
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

StTensor bf16_tensor(const std::vector<int64_t>& shape, const std::vector<float>& values) {
  StTensor t{"BF16", shape, std::vector<uint8_t>(values.size() * 2)};
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t b = f32_to_bf16(values[i]);
    std::memcpy(t.bytes.data() + 2 * i, &b, 2);
  }
  return t;
}

std::vector<float> random_values(size_t n, uint32_t seed, float scale) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

void write_file(const std::string& path, const std::string& content) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(content.data(), static_cast<std::streamsize>(content.size()));
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void copy_dir(const std::string& from, const std::string& to) {
  fs::create_directories(to);
  fs::copy(from, to, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  for (const auto& e : fs::recursive_directory_iterator(to))
    fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
}

std::string fixture_path(const std::string& rel) {
  return (fs::path(MOELORA_SOURCE_DIR) / "tests" / "fixtures" / rel).string();
}

}  // namespace moelora::testutil

namespace moelora::testutil {

std::map<std::string, StTensor> read_safetensors(const std::string& path) {
  auto f = SafetensorsFile::open(path);
  MOELORA_CHECK_MSG(f.ok(), "{}", f.ok() ? "" : f.status().message());
  std::map<std::string, StTensor> t;
  for (const auto& [n, e] : (*f)->entries()) {
    Tensor x = *(*f)->tensor(n);
    StTensor s{dtype_name(e.dtype), e.shape, std::vector<uint8_t>(x.nbytes())};
    std::memcpy(s.bytes.data(), x.data(), x.nbytes());
    t[n] = s;
  }
  return t;
}

std::unique_ptr<TempDir> edited_checkpoint(const std::string& src,
                                           const std::function<void(std::map<std::string, StTensor>&)>& edit) {
  auto dir = std::make_unique<TempDir>();
  copy_dir(src, dir->str());
  auto t = read_safetensors(dir->sub("model.safetensors"));
  edit(t);
  write_file(dir->sub("model.safetensors"), make_safetensors(t));
  return dir;
}

}  // namespace moelora::testutil
