// GET /v1/models and vLLM's runtime adapter management:
//   POST /v1/load_lora_adapter   {"lora_name", "lora_path", "load_inplace"?, "pinned"? (sglang)}
//   POST /v1/unload_lora_adapter {"lora_name"}
// Loading needs --lora-root: every file of a runtime-loaded adapter must resolve inside it
// (checked again on every re-read), so a client can never make the server read other files.
// load_inplace validates the new version first and swaps it in atomically: requests never see
// the name missing, and a failed reload leaves the old version serving.
#include <chrono>

#include <fmt/format.h>

#include "core/log.h"
#include "server/server_state.h"

namespace moelora::server {

namespace {

OJson model_card(const std::string& id, const std::string& root, const OJson& parent, int max_model_len, int64_t created) {
  OJson card = {{"id", id},          {"object", "model"}, {"created", created},          {"owned_by", "moelora"},
               {"root", root},      {"parent", parent},  {"max_model_len", max_model_len}, {"permission", OJson::array()}};
  return card;
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::optional<ApiError> runtime_lora_allowed(const ServerState& st) {
  if (st.options.allow_runtime_lora && !st.options.lora_root.empty()) return std::nullopt;
  return ApiError{403, "PermissionDeniedError",
                  "loading and unloading adapters at runtime is disabled; start the server with --lora-root DIR "
                  "(adapters are then loaded from inside DIR only)",
                  ""};
}

void handle_load(ServerState& st, const HttpRequest& req, HttpResponse& res) {
  if (auto e = runtime_lora_allowed(st)) return st.send_error(res, *e);
  Json body;
  if (auto e = parse_json_body(req.body, &body)) return st.send_error(res, *e);
  std::optional<std::string> name, path;
  std::optional<bool> inplace, pinned;
  for (auto e : {read_opt_string(body, "lora_name", &name), read_opt_string(body, "lora_path", &path),
                 read_opt_bool(body, "load_inplace", &inplace), read_opt_bool(body, "pinned", &pinned)})
    if (e) return st.send_error(res, *e);
  if (!name || name->empty() || !path || path->empty())
    return st.send_error(res, {400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.",
                               !name || name->empty() ? "lora_name" : "lora_path"});
  if (*name == st.options.served_model_name)
    return st.send_error(res, bad_request(fmt::format("'{}' is the base model's name", *name), "lora_name"));
  const bool replace = inplace.value_or(false);
  if (!replace && st.engine().has_adapter(*name))
    return st.send_error(res, {400, "InvalidUserInput",
                               fmt::format("The lora adapter '{}' has already been loaded.", *name), "lora_name"});
  AdapterLoadSpec spec;
  spec.pinned = pinned.value_or(false);
  spec.replace = replace;
  spec.root = st.options.lora_root;
  Status s = st.engine().load_adapter(*name, *path, spec);
  if (!s.ok()) {
    ApiError e = from_status(s, s.code() == ErrorCode::kNotFound ? "lora_path" : "");
    if (s.code() == ErrorCode::kFailedPrecondition) e = {409, "ConflictError", s.message(), "lora_name"};
    if (s.code() == ErrorCode::kAlreadyExists) e = {400, "InvalidUserInput", s.message(), "lora_name"};
    MOELORA_LOG_WARN("server: loading adapter '{}' from '{}' failed: {}", *name, *path, s.message());
    return st.send_error(res, e);
  }
  MOELORA_LOG_INFO("server: {} adapter '{}' from '{}'", replace ? "loaded (in place)" : "loaded", *name, *path);
  res.status = 200;
  res.set_content(fmt::format("Success: LoRA adapter '{}' added successfully.", *name), "text/plain");
}

void handle_unload(ServerState& st, const HttpRequest& req, HttpResponse& res) {
  if (auto e = runtime_lora_allowed(st)) return st.send_error(res, *e);
  Json body;
  if (auto e = parse_json_body(req.body, &body)) return st.send_error(res, *e);
  std::optional<std::string> name;
  if (auto e = read_opt_string(body, "lora_name", &name)) return st.send_error(res, *e);
  if (!name || name->empty())
    return st.send_error(res, {400, "InvalidUserInput", "'lora_name' must be provided.", "lora_name"});
  if (!st.engine().has_adapter(*name))
    return st.send_error(res, {404, "NotFoundError", fmt::format("The lora adapter '{}' cannot be found.", *name),
                               "lora_name"});
  // Requests already using it finish first; new ones are refused meanwhile (404).
  Status s = st.engine().unload_adapter(*name, /*wait=*/true);
  if (!s.ok()) return st.send_error(res, from_status(s, "lora_name"));
  MOELORA_LOG_INFO("server: unloaded adapter '{}'", *name);
  res.status = 200;
  res.set_content(fmt::format("Success: LoRA adapter '{}' removed successfully.", *name), "text/plain");
}

void handle_models(ServerState& st, const HttpRequest&, HttpResponse& res) {
  const int64_t now = unix_now();
  const int max_len = st.engine().max_model_len();
  OJson data = OJson::array();
  data.push_back(model_card(st.options.served_model_name, st.options.model_path, nullptr, max_len, now));
  for (const AdapterInfo& a : st.engine().adapters())
    if (st.engine().has_adapter(a.name))
      data.push_back(model_card(a.name, a.path, st.options.served_model_name, max_len, now));
  st.send_json(res, 200, OJson{{"object", "list"}, {"data", std::move(data)}});
}

}  // namespace

void register_model_routes(Router& router) {
  router.add("GET", "/v1/models", RouteKind::kApi, handle_models);
  router.add("POST", "/v1/load_lora_adapter", RouteKind::kAdapterAdmin, handle_load);
  router.add("POST", "/v1/unload_lora_adapter", RouteKind::kAdapterAdmin, handle_unload);
}

}  // namespace moelora::server
