#include "server/api_error.h"

namespace moelora::server {

const char* error_type_for(int http_status) {
  switch (http_status) {
    case 400: return "BadRequestError";
    case 401: return "AuthenticationError";
    case 403: return "PermissionDeniedError";
    case 404: return "NotFoundError";
    case 405: return "MethodNotAllowedError";
    case 409: return "ConflictError";
    case 413: return "RequestTooLargeError";
    case 422: return "UnprocessableEntityError";
    case 429: return "RateLimitError";
    case 503: return "ServiceUnavailableError";
    default: return http_status >= 500 ? "InternalServerError" : "BadRequestError";
  }
}

OJson ApiError::to_json() const {
  OJson err = {{"message", message},
               {"type", type.empty() ? error_type_for(http_status) : type},
               {"param", param.empty() ? OJson(nullptr) : OJson(param)},
               {"code", http_status}};
  return OJson{{"error", std::move(err)}};
}

std::string ApiError::body() const { return dump_json(to_json()); }

ApiError bad_request(std::string message, std::string param) {
  return {400, "BadRequestError", std::move(message), std::move(param)};
}

ApiError model_not_found(const std::string& model) {
  // vLLM's wording: clients and routers match on it.
  return {404, "NotFoundError", "The model `" + model + "` does not exist.", "model"};
}

ApiError internal_error(std::string message) { return {500, "InternalServerError", std::move(message), ""}; }

ApiError from_status(const Status& status, std::string param) {
  int code = 500;
  switch (status.code()) {
    case ErrorCode::kOk:
    case ErrorCode::kInternal: code = 500; break;
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kUnsupported:
    case ErrorCode::kAlreadyExists: code = 400; break;
    case ErrorCode::kNotFound: code = 404; break;
    case ErrorCode::kResourceExhausted: code = 429; break;
    case ErrorCode::kFailedPrecondition:
    case ErrorCode::kCancelled: code = 503; break;
  }
  return {code, error_type_for(code), status.message(), std::move(param)};
}

std::string dump_json(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }
std::string dump_json(const OJson& j) { return j.dump(-1, ' ', false, OJson::error_handler_t::replace); }

}  // namespace moelora::server
