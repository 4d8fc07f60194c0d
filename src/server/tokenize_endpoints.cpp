// vLLM's POST /tokenize and POST /detokenize:
//   /tokenize   {"model"?, "prompt", "add_special_tokens"?=true, "return_token_strs"?=false}
//            or {"model"?, "messages", "tools"?, "add_generation_prompt"?=true, "continue_final_message"?}
//            -> {"count", "max_model_len", "tokens", "token_strs"}
//   /detokenize {"model"?, "tokens"} -> {"prompt"}
// The model field is checked like a generation request's (404 when unknown); every adapter
// shares the base model's tokenizer.
#include <fmt/format.h>

#include "server/server_state.h"

namespace moelora::server {

namespace {

void handle_tokenize(ServerState& st, const HttpRequest& req, HttpResponse& res) {
  Json body;
  if (auto e = parse_json_body(req.body, &body)) return st.send_error(res, *e);
  std::optional<std::string> model, prompt;
  std::optional<bool> add_special, return_strs, add_gen, cont;
  for (auto e : {read_opt_string(body, "model", &model), read_opt_bool(body, "add_special_tokens", &add_special),
                 read_opt_bool(body, "return_token_strs", &return_strs),
                 read_opt_bool(body, "add_generation_prompt", &add_gen),
                 read_opt_bool(body, "continue_final_message", &cont)})
    if (e) return st.send_error(res, *e);
  std::string adapter;
  if (auto e = st.resolve_model(model.value_or(""), std::nullopt, &adapter)) return st.send_error(res, *e);
  Result<std::vector<int32_t>> ids = std::vector<int32_t>{};
  auto m = body.find("messages");
  if (m != body.end() && !m->is_null()) {
    std::vector<ChatMessage> messages;
    if (auto e = parse_chat_messages(*m, &messages)) return st.send_error(res, *e);
    // vLLM's chat /tokenize takes the request's tools: the count then matches a chat request's
    // usage.prompt_tokens, tools included.
    OJson tools;
    if (auto e = parse_tools(body, &tools)) return st.send_error(res, *e);
    keep_client_key_order(req.body, &messages, &tools);
    ids = st.tokenizer->encode_chat(messages, add_gen.value_or(!cont.value_or(false)), cont.value_or(false), tools);
  } else {
    if (auto e = read_opt_string(body, "prompt", &prompt)) return st.send_error(res, *e);
    if (!prompt) return st.send_error(res, bad_request("'prompt' or 'messages' is required", "prompt"));
    ids = st.tokenizer->encode(*prompt, add_special.value_or(true));
  }
  if (!ids.ok()) return st.send_error(res, from_status(ids.status(), "prompt"));
  OJson out = {{"count", ids->size()}, {"max_model_len", st.engine().max_model_len()}, {"tokens", *ids}};
  if (return_strs.value_or(false)) {
    OJson strs = OJson::array();
    for (int32_t id : *ids) strs.push_back(st.tokenizer->token_bytes(id));
    out["token_strs"] = std::move(strs);
  } else {
    out["token_strs"] = nullptr;
  }
  st.send_json(res, 200, out);
}

void handle_detokenize(ServerState& st, const HttpRequest& req, HttpResponse& res) {
  Json body;
  if (auto e = parse_json_body(req.body, &body)) return st.send_error(res, *e);
  std::optional<std::string> model;
  if (auto e = read_opt_string(body, "model", &model)) return st.send_error(res, *e);
  std::string adapter;
  if (auto e = st.resolve_model(model.value_or(""), std::nullopt, &adapter)) return st.send_error(res, *e);
  auto t = body.find("tokens");
  if (t == body.end() || t->is_null()) return st.send_error(res, bad_request("'tokens' is required", "tokens"));
  std::vector<int32_t> ids;
  if (auto e = read_token_ids(*t, "tokens", &ids)) return st.send_error(res, *e);
  if (!st.tokenizer->has_tokenizer())
    return st.send_error(res, bad_request("this model has no tokenizer.json", "tokens"));
  for (int32_t id : ids)
    if (!st.tokenizer->is_valid_id(id))
      return st.send_error(res, bad_request(fmt::format("token id {} is not in the vocabulary", id), "tokens"));
  st.send_json(res, 200, Json{{"prompt", st.tokenizer->decode(ids, /*skip_special_tokens=*/false)}});
}

}  // namespace

void register_tokenize_routes(Router& router) {
  router.add("POST", "/tokenize", RouteKind::kApi, handle_tokenize);
  router.add("POST", "/detokenize", RouteKind::kApi, handle_detokenize);
}

}  // namespace moelora::server
