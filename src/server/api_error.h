// Errors as the OpenAI-compatible API reports them: vLLM's envelope
//   {"error": {"message": "...", "type": "BadRequestError", "param": "model", "code": 400}}
// where `code` repeats the HTTP status as an integer (OpenAI's own clients accept both forms).
// Every failure the server answers goes through ApiError, so status codes stay consistent:
// 400 bad request, 403 runtime LoRA disabled, 404 unknown model/adapter/route, 413 body too
// large, 429 queue full, 503 shutting down, 500 a bug.
#pragma once

#include <string>

#include "core/status.h"
#include "io/json_util.h"

#include <nlohmann/json.hpp>

namespace moelora::server {

// Responses keep their fields in the order OpenAI writes them (id, object, created, model...):
// nlohmann's default json would sort keys alphabetically.
using OJson = nlohmann::ordered_json;

struct ApiError {
  int http_status = 500;
  std::string type;     // "BadRequestError", "NotFoundError", ...
  std::string message;
  std::string param;    // the request field at fault; empty = null

  OJson to_json() const;  // the envelope
  std::string body() const;
};

ApiError bad_request(std::string message, std::string param = "");
ApiError model_not_found(const std::string& model);
ApiError internal_error(std::string message);

// Maps an engine/runtime Status to the API's status code and type.
ApiError from_status(const Status& status, std::string param = "");

// The error type vLLM and OpenAI's clients associate with an HTTP status.
const char* error_type_for(int http_status);

// JSON text that never throws on invalid UTF-8 (it is replaced by U+FFFD).
std::string dump_json(const Json& j);
std::string dump_json(const OJson& j);

}  // namespace moelora::server
