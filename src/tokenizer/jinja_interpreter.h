// Renders a parsed template. Scoping follows Jinja2: each loop iteration, macro call and
// {% with %} body gets a fresh scope (a {% set %} inside does not leak out), {% if %} does not,
// and namespace() objects are how a loop carries state out.
#pragma once

#include <cstddef>
#include <string>
#include <unordered_map>
#include <vector>

#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_value.h"

namespace moelora::jinja {

// Bounds that keep a hostile template or request from exhausting the server.
struct RenderLimits {
  size_t max_output_bytes = size_t{64} << 20;
  int max_call_depth = 200;       // nested macro calls
  int64_t max_range = 1 << 20;    // items of one range()
};

class Interpreter {
 public:
  // `variables`: a dict of the names the template sees (messages, tools, bos_token...); the
  // built-in globals (namespace, range, dict, raise_exception, strftime_now) are added.
  Interpreter(const Value& variables, RenderLimits limits);
  ~Interpreter();
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;
  // Throws jinja::Error.
  std::string render(const Body& body);

  // namespace() objects are the only values a template can change after creating them, so the
  // only way to build a reference cycle ({% set ns.me = ns %}); the interpreter empties them
  // when it ends so that such a cycle does not leak.
  void track_namespace(const Value& ns) { namespaces_.push_back(ns); }

  // Calls a callable value (a macro, a built-in function, a bound method).
  Value call(const Value& callee, CallArgs& args);
  const RenderLimits& limits() const { return limits_; }

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  struct Scope {
    std::unordered_map<std::string, Value> vars;
    Scope* parent = nullptr;
  };

  Flow exec_body(const Body& body, std::string& out);
  Flow exec(const Stmt& s, std::string& out);
  void exec_for(const Stmt& s, std::string& out);
  void exec_set(const Stmt& s, std::string& out);
  void define_macro(const Stmt& s);
  std::string render_in_scope(const Body& body, Scope& scope);
  Value apply_filters(const std::vector<FilterCall>& filters, Value v);

  Value eval(const Expr& e);
  Value eval_binary(const Expr& e);
  Value eval_compare(const Expr& e);
  CallArgs eval_args(const Arguments& args);
  Value lookup(const std::string& name) const;
  void assign(const Target& target, const Value& value, int line);
  void append(std::string& out, std::string_view text);

  RenderLimits limits_;
  Value globals_;
  Scope root_;
  Scope* scope_ = &root_;
  int call_depth_ = 0;
  std::vector<Value> namespaces_;
};

}  // namespace moelora::jinja
