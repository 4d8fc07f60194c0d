#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "io/json_util.h"

namespace moelora {

Result<std::shared_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  MOELORA_ASSIGN_OR_RETURN(auto mapped, MappedFile::open(path));
  const uint8_t* data = mapped->data();
  size_t size = mapped->size();
  return validate(data, size, mapped, path);
}

Result<std::shared_ptr<SafetensorsFile>> SafetensorsFile::parse(std::shared_ptr<const std::string> buffer,
                                                                const std::string& name) {
  const auto* data = reinterpret_cast<const uint8_t*>(buffer->data());
  size_t size = buffer->size();
  return validate(data, size, std::const_pointer_cast<std::string>(buffer), name);
}

namespace {

bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return false;
  *out = a * b;
  return true;
}

Result<uint64_t> read_offset(const Json& v, const std::string& tensor, const std::string& path) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
    return invalid_argument("{}: tensor '{}' has a data offset that is not a non-negative integer",
                            path, tensor);
  return v.get<uint64_t>();
}

}  // namespace

Result<std::shared_ptr<SafetensorsFile>> SafetensorsFile::validate(const uint8_t* data, size_t size,
                                                                   std::shared_ptr<void> keepalive,
                                                                   const std::string& path) {
  if (size < 8) return invalid_argument("{}: not a safetensors file ({} bytes, no header length)", path, size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];  // little-endian u64
  if (n > kSafetensorsMaxHeaderBytes)
    return invalid_argument("{}: safetensors header length {} is over the {} byte limit", path, n,
                            kSafetensorsMaxHeaderBytes);
  if (n + 8 > size)
    return invalid_argument("{}: safetensors header length {} runs past the end of the {} byte file",
                            path, n, size);
  std::string_view header(reinterpret_cast<const char*>(data + 8), n);
  if (header.empty() || header[0] != '{')
    return invalid_argument("{}: safetensors header does not begin with '{{'", path);
  // Trailing spaces are allowed padding.
  while (!header.empty() && header.back() == ' ') header.remove_suffix(1);
  MOELORA_ASSIGN_OR_RETURN(Json j, parse_json_strict(header, path + " (safetensors header)"));
  if (!j.is_object()) return invalid_argument("{}: safetensors header is not a JSON object", path);

  auto file = std::shared_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = path;
  file->keepalive_ = std::move(keepalive);
  file->data_area_ = data + 8 + n;
  const uint64_t data_size = size - 8 - n;

  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return invalid_argument("{}: __metadata__ is not an object", path);
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          return invalid_argument("{}: __metadata__ value of '{}' is not a string", path, m.key());
        file->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) return invalid_argument("{}: entry '{}' is not an object", path, name);
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string() || sh == v.end() || !sh->is_array() || off == v.end() ||
        !off->is_array() || off->size() != 2)
      return invalid_argument("{}: tensor '{}' lacks a string dtype, an array shape or two data_offsets",
                              path, name);
    auto dtype = parse_safetensors_dtype(dt->get<std::string>());
    if (!dtype)
      return invalid_argument("{}: tensor '{}' has dtype {} which moelora does not read", path, name,
                              dt->get<std::string>());
    SafetensorsEntry e;
    e.dtype = *dtype;
    uint64_t numel = 1;
    for (const Json& d : *sh) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        return invalid_argument("{}: tensor '{}' has a shape entry {} that is not a non-negative integer",
                                path, name, d.dump());
      uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) || !checked_mul(numel, dim, &numel))
        return invalid_argument("{}: tensor '{}' shape overflows", path, name);
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    if (e.shape.size() > static_cast<size_t>(Tensor::kMaxDims))
      return invalid_argument("{}: tensor '{}' has {} dimensions; at most {} are supported", path, name,
                              e.shape.size(), Tensor::kMaxDims);
    MOELORA_ASSIGN_OR_RETURN(e.begin, read_offset((*off)[0], name, path));
    MOELORA_ASSIGN_OR_RETURN(e.end, read_offset((*off)[1], name, path));
    uint64_t nbytes = 0;
    if (!checked_mul(numel, dtype_size(e.dtype), &nbytes))
      return invalid_argument("{}: tensor '{}' byte size overflows", path, name);
    if (e.end < e.begin)
      return invalid_argument("{}: tensor '{}' has data_offsets [{}, {}] that end before they begin",
                              path, name, e.begin, e.end);
    if (e.end - e.begin != nbytes)
      return invalid_argument("{}: tensor '{}' is {} bytes in the file but {} x {} needs {}", path, name,
                              e.end - e.begin, dtype_name(e.dtype),
                              fmt::format("[{}]", fmt::join(e.shape, ", ")), nbytes);
    file->entries_.emplace(name, std::move(e));
  }

  // Offsets must tile the data area exactly: sorted, each starting where the previous ended.
  std::vector<std::pair<const std::string*, const SafetensorsEntry*>> order;
  for (const auto& [name, e] : file->entries_) order.emplace_back(&name, &e);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.second->begin != b.second->begin ? a.second->begin < b.second->begin
                                              : a.second->end < b.second->end;
  });
  uint64_t expected = 0;
  for (const auto& [name, e] : order) {
    if (e->begin != expected)
      return invalid_argument("{}: tensor '{}' starts at byte {} of the data area, expected {} "
                              "(tensors overlap or leave a gap)",
                              path, *name, e->begin, expected);
    expected = e->end;
  }
  if (expected != data_size)
    return invalid_argument("{}: tensors cover {} bytes but the data area holds {} (truncated file or "
                            "trailing bytes)",
                            path, expected, data_size);
  return file;
}

Result<Tensor> SafetensorsFile::tensor(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return not_found("{}: no tensor named '{}'", path_, name);
  const SafetensorsEntry& e = it->second;
  // The mapping is read-only; ops never write weights, so dropping const here is safe.
  void* p = const_cast<uint8_t*>(data_area_ + e.begin);
  return Tensor(p, e.dtype, e.shape, Device::kCpu, keepalive_);
}

}  // namespace moelora
