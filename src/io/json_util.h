// Strict JSON parsing for files and requests that come from outside: duplicate keys, excessive
// nesting and wrong types are clear errors (nlohmann silently keeps the last duplicate).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace moelora {

using Json = nlohmann::json;

// `what` names the document in error messages ("config.json of /models/x").
Result<Json> parse_json_strict(std::string_view text, std::string_view what, int max_depth = 64);

// Typed field access with messages that name the field and the document.
// get_*: the field must exist; opt_*: absent or null gives nullopt; a wrong type is an error.
Result<int64_t> json_get_int(const Json& obj, std::string_view key, std::string_view what);
Result<std::string> json_get_string(const Json& obj, std::string_view key, std::string_view what);
Result<std::optional<int64_t>> json_opt_int(const Json& obj, std::string_view key, std::string_view what);
Result<std::optional<double>> json_opt_number(const Json& obj, std::string_view key, std::string_view what);
Result<std::optional<bool>> json_opt_bool(const Json& obj, std::string_view key, std::string_view what);
Result<std::optional<std::string>> json_opt_string(const Json& obj, std::string_view key, std::string_view what);

// First present key among spellings (e.g. {"num_experts", "num_local_experts"}).
const Json* json_find_any(const Json& obj, std::initializer_list<std::string_view> keys,
                          std::string_view* found_key = nullptr);

}  // namespace moelora
