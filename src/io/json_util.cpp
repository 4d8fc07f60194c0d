#include "io/json_util.h"

#include <cmath>
#include <set>

namespace moelora {

Result<Json> parse_json_strict(std::string_view text, std::string_view what, int max_depth) {
  // One key set per open object; the parser callback sees keys in document order.
  std::vector<std::set<std::string>> open_objects;
  std::string problem;
  auto cb = [&](int depth, Json::parse_event_t event, Json& parsed) -> bool {
    if (!problem.empty()) return false;
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (depth >= max_depth) {
          problem = "nesting deeper than " + std::to_string(max_depth) + " levels";
          return false;
        }
        if (event == Json::parse_event_t::object_start) open_objects.emplace_back();
        return true;
      case Json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        return true;
      case Json::parse_event_t::key: {
        if (open_objects.empty()) return true;
        const std::string& k = parsed.get_ref<const std::string&>();
        if (!open_objects.back().insert(k).second) {
          problem = "duplicate key \"" + k + "\"";
          return false;
        }
        return true;
      }
      default:
        return true;
    }
  };
  Json j = Json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/false);
  if (!problem.empty()) return invalid_argument("{} is not acceptable JSON: {}", what, problem);
  if (j.is_discarded()) return invalid_argument("{} is not valid JSON", what);
  return j;
}

namespace {
const Json* field(const Json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}
}  // namespace

Result<std::optional<int64_t>> json_opt_int(const Json& obj, std::string_view key, std::string_view what) {
  const Json* f = field(obj, key);
  if (f == nullptr || f->is_null()) return std::optional<int64_t>();
  if (f->is_number_integer()) return std::optional<int64_t>(f->get<int64_t>());
  if (f->is_number_float()) {
    // 2.0 is an integer; 2.5, 1e300 and anything outside int64 are not (casting those is undefined).
    const double d = f->get<double>();
    if (d >= -9223372036854775808.0 && d < 9223372036854775808.0 && d == std::trunc(d))
      return std::optional<int64_t>(static_cast<int64_t>(d));
  }
  return invalid_argument("{}: field \"{}\" must be an integer, got {}", what, key, f->dump());
}

Result<std::optional<double>> json_opt_number(const Json& obj, std::string_view key, std::string_view what) {
  const Json* f = field(obj, key);
  if (f == nullptr || f->is_null()) return std::optional<double>();
  if (f->is_number()) return std::optional<double>(f->get<double>());
  return invalid_argument("{}: field \"{}\" must be a number, got {}", what, key, f->dump());
}

Result<std::optional<bool>> json_opt_bool(const Json& obj, std::string_view key, std::string_view what) {
  const Json* f = field(obj, key);
  if (f == nullptr || f->is_null()) return std::optional<bool>();
  if (f->is_boolean()) return std::optional<bool>(f->get<bool>());
  return invalid_argument("{}: field \"{}\" must be true or false, got {}", what, key, f->dump());
}

Result<std::optional<std::string>> json_opt_string(const Json& obj, std::string_view key, std::string_view what) {
  const Json* f = field(obj, key);
  if (f == nullptr || f->is_null()) return std::optional<std::string>();
  if (f->is_string()) return std::optional<std::string>(f->get<std::string>());
  return invalid_argument("{}: field \"{}\" must be a string, got {}", what, key, f->dump());
}

Result<int64_t> json_get_int(const Json& obj, std::string_view key, std::string_view what) {
  MOELORA_ASSIGN_OR_RETURN(auto v, json_opt_int(obj, key, what));
  if (!v) return invalid_argument("{}: required field \"{}\" is missing", what, key);
  return *v;
}

Result<std::string> json_get_string(const Json& obj, std::string_view key, std::string_view what) {
  MOELORA_ASSIGN_OR_RETURN(auto v, json_opt_string(obj, key, what));
  if (!v) return invalid_argument("{}: required field \"{}\" is missing", what, key);
  return *v;
}

const Json* json_find_any(const Json& obj, std::initializer_list<std::string_view> keys,
                          std::string_view* found_key) {
  for (std::string_view k : keys) {
    const Json* f = field(obj, k);
    if (f != nullptr && !f->is_null()) {
      if (found_key) *found_key = k;
      return f;
    }
  }
  return nullptr;
}

}  // namespace moelora
