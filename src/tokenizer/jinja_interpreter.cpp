#include "tokenizer/jinja_interpreter.h"

#include <fmt/format.h>

#include "tokenizer/jinja_builtins.h"

namespace moelora::jinja {
namespace {

// Attaches the line of the statement being executed to an error that has none yet.
template <typename F>
auto with_line(int line, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (Error& e) {
    if (e.line == 0) e.line = line;
    throw;
  }
}

// The `loop` variable of one iteration.
Value loop_object(const ValueList& items, size_t i) {
  Value loop = Value::dict();
  Dict& d = loop.as_dict_mut();
  const auto n = static_cast<int64_t>(items.size());
  const auto k = static_cast<int64_t>(i);
  d.set(Value("index0"), Value(k));
  d.set(Value("index"), Value(k + 1));
  d.set(Value("revindex0"), Value(n - k - 1));
  d.set(Value("revindex"), Value(n - k));
  d.set(Value("first"), Value(k == 0));
  d.set(Value("last"), Value(k == n - 1));
  d.set(Value("length"), Value(n));
  d.set(Value("depth"), Value(int64_t{1}));
  d.set(Value("depth0"), Value(int64_t{0}));
  if (i > 0) d.set(Value("previtem"), items[i - 1]);
  if (i + 1 < items.size()) d.set(Value("nextitem"), items[i + 1]);
  d.set(Value("cycle"), Value::callable("loop.cycle", [k](CallArgs& args, Interpreter&) -> Value {
          if (args.positional.empty()) fail("no items for cycling given");
          return args.positional[static_cast<size_t>(k) % args.positional.size()];
        }));
  return loop;
}

}  // namespace

Interpreter::Interpreter(const Value& variables, RenderLimits limits) : limits_(limits), globals_(Value::dict()) {
  add_globals(globals_.as_dict_mut());
  if (variables.is_mapping()) {
    for (const auto& [k, v] : variables.as_dict().entries) globals_.as_dict_mut().set(k, v);
  }
}

Interpreter::~Interpreter() {
  for (Value& ns : namespaces_) {
    ns.as_dict_mut().entries.clear();
    ns.as_dict_mut().index.clear();
  }
}

std::string Interpreter::render(const Body& body) {
  std::string out;
  exec_body(body, out);
  return out;
}

void Interpreter::append(std::string& out, std::string_view text) {
  if (out.size() + text.size() > limits_.max_output_bytes) {
    fail(fmt::format("the rendered text exceeds {} bytes", limits_.max_output_bytes));
  }
  out.append(text);
}

Interpreter::Flow Interpreter::exec_body(const Body& body, std::string& out) {
  for (const StmtPtr& s : body) {
    const Flow flow = exec(*s, out);
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

std::string Interpreter::render_in_scope(const Body& body, Scope& scope) {
  Scope* saved = scope_;
  scope_ = &scope;
  std::string out;
  try {
    exec_body(body, out);
  } catch (...) {
    scope_ = saved;
    throw;
  }
  scope_ = saved;
  return out;
}

Interpreter::Flow Interpreter::exec(const Stmt& s, std::string& out) {
  return with_line(s.line, [&]() -> Flow {
    switch (s.kind) {
      case StmtKind::kText:
        append(out, s.text);
        return Flow::kNormal;
      case StmtKind::kOutput:
        append(out, eval(*s.expr).str());
        return Flow::kNormal;
      case StmtKind::kIf:
        for (const auto& [condition, body] : s.branches) {
          if (eval(*condition).truthy()) return exec_body(body, out);
        }
        return exec_body(s.else_body, out);
      case StmtKind::kFor:
        exec_for(s, out);
        return Flow::kNormal;
      case StmtKind::kSet:
        exec_set(s, out);
        return Flow::kNormal;
      case StmtKind::kMacro:
        define_macro(s);
        return Flow::kNormal;
      case StmtKind::kFilterBlock: {
        Scope scope{{}, scope_};
        append(out, apply_filters(s.filters, Value(render_in_scope(s.body, scope))).str());
        return Flow::kNormal;
      }
      case StmtKind::kWith: {
        Scope scope{{}, scope_};
        for (const auto& [name, expr] : s.params) scope.vars[name] = eval(*expr);
        append(out, render_in_scope(s.body, scope));
        return Flow::kNormal;
      }
      case StmtKind::kBreak:
        return Flow::kBreak;
      case StmtKind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  });
}

void Interpreter::exec_for(const Stmt& s, std::string& out) {
  ValueList items = iterate(eval(*s.expr));
  if (s.filter) {
    // `for x in xs if cond`: the loop variables (index, length...) count only what passes.
    ValueList kept;
    for (const Value& item : items) {
      Scope scope{{}, scope_};
      Scope* saved = scope_;
      scope_ = &scope;
      bool keep = false;
      try {
        assign(s.target, item, s.line);
        keep = eval(*s.filter).truthy();
      } catch (...) {
        scope_ = saved;
        throw;
      }
      scope_ = saved;
      if (keep) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    Scope scope{{}, scope_};
    append(out, render_in_scope(s.else_body, scope));
    return;
  }
  Scope* saved = scope_;
  for (size_t i = 0; i < items.size(); ++i) {
    Scope scope{{}, saved};
    scope_ = &scope;
    Flow flow;
    try {
      scope.vars["loop"] = loop_object(items, i);
      assign(s.target, items[i], s.line);
      flow = exec_body(s.body, out);
    } catch (...) {
      scope_ = saved;
      throw;
    }
    scope_ = saved;
    if (flow == Flow::kBreak) break;
  }
}

void Interpreter::assign(const Target& target, const Value& value, int line) {
  if (!target.is_tuple) {
    scope_->vars[target.names[0]] = value;
    return;
  }
  const ValueList items = iterate(value);
  if (items.size() != target.names.size()) {
    fail(fmt::format("cannot unpack {} values into {} names", items.size(), target.names.size()));
  }
  for (size_t i = 0; i < items.size(); ++i) scope_->vars[target.names[i]] = items[i];
}

void Interpreter::exec_set(const Stmt& s, std::string& out) {
  if (!s.target.namespace_attr.empty()) {
    Value ns = lookup(s.target.names[0]);
    if (!ns.is_namespace()) fail("cannot assign attribute on non-namespace object");
    ns.as_dict_mut().set(Value(s.target.namespace_attr), eval(*s.expr));
    return;
  }
  if (s.expr) {
    assign(s.target, eval(*s.expr), s.line);
    return;
  }
  // {% set x %}...{% endset %}: the rendered body, through the filters.
  std::string body;
  exec_body(s.body, body);
  assign(s.target, apply_filters(s.filters, Value(std::move(body))), s.line);
}

void Interpreter::define_macro(const Stmt& s) {
  const Stmt* macro = &s;
  const std::string display = fmt::format("macro '{}'", s.text);
  scope_->vars[s.text] = Value::callable(display, [this, macro, display](CallArgs& args, Interpreter&) -> Value {
    if (args.positional.size() > macro->params.size()) {
      fail(fmt::format("{} takes not more than {} argument(s)", display, macro->params.size()));
    }
    if (call_depth_ >= limits_.max_call_depth) fail(fmt::format("{} nests deeper than {} calls", display, limits_.max_call_depth));
    // The body sees the template's top-level variables and its arguments.
    Scope scope{{}, &root_};
    for (const auto& [key, value] : args.keyword) {
      bool known = false;
      for (const auto& p : macro->params) known |= p.first == key;
      if (!known) fail(fmt::format("{} takes no keyword argument '{}'", display, key));
    }
    Scope* saved = scope_;
    scope_ = &scope;
    ++call_depth_;
    std::string out;
    try {
      for (size_t i = 0; i < macro->params.size(); ++i) {
        const auto& [name, default_expr] = macro->params[i];
        Value v = Value::undefined(fmt::format("'{}' is undefined", name));
        if (i < args.positional.size()) {
          v = args.positional[i];
        } else {
          bool found = false;
          for (const auto& [key, value] : args.keyword) {
            if (key == name) {
              v = value;
              found = true;
            }
          }
          if (!found && default_expr) v = eval(*default_expr);
        }
        scope.vars[name] = v;
      }
      exec_body(macro->body, out);
    } catch (...) {
      scope_ = saved;
      --call_depth_;
      throw;
    }
    scope_ = saved;
    --call_depth_;
    return Value(std::move(out));
  });
}

Value Interpreter::apply_filters(const std::vector<FilterCall>& filters, Value v) {
  for (const FilterCall& f : filters) {
    CallArgs args = eval_args(f.args);
    v = apply_filter(*this, f.name, v, args);
  }
  return v;
}

Value Interpreter::lookup(const std::string& name) const {
  for (const Scope* s = scope_; s != nullptr; s = s->parent) {
    auto it = s->vars.find(name);
    if (it != s->vars.end()) return it->second;
  }
  if (const Value* v = globals_.as_dict().find(Value(name))) return *v;
  return Value::undefined(fmt::format("'{}' is undefined", name));
}

CallArgs Interpreter::eval_args(const Arguments& args) {
  CallArgs out;
  for (const ExprPtr& e : args.positional) out.positional.push_back(eval(*e));
  for (const auto& [name, e] : args.keyword) out.keyword.emplace_back(name, eval(*e));
  return out;
}

Value Interpreter::call(const Value& callee, CallArgs& args) {
  if (callee.is_undefined()) fail(callee.undefined_hint());
  if (!callee.is_callable()) fail(fmt::format("'{}' object is not callable", callee.type_name()));
  return callee.as_callable().fn(args, *this);
}

Value Interpreter::eval(const Expr& e) {
  switch (e.kind) {
    case ExprKind::kLiteral:
      return e.value;
    case ExprKind::kName:
      return lookup(e.name);
    case ExprKind::kList:
    case ExprKind::kTuple: {
      ValueList items;
      for (const ExprPtr& item : e.items) items.push_back(eval(*item));
      return e.kind == ExprKind::kList ? Value::list(std::move(items)) : Value::tuple(std::move(items));
    }
    case ExprKind::kDict: {
      Value d = Value::dict();
      for (const auto& [k, v] : e.pairs) {
        Value key = eval(*k);
        d.as_dict_mut().set(key, eval(*v));
      }
      return d;
    }
    case ExprKind::kGetAttr:
      return get_attribute(eval(*e.object), e.name);
    case ExprKind::kGetItem: {
      Value obj = eval(*e.object);
      return get_item(obj, eval(*e.other));
    }
    case ExprKind::kSlice: {
      Value obj = eval(*e.object);
      const auto part = [&](size_t i) { return e.items[i] ? eval(*e.items[i]) : Value::none(); };
      return slice(obj, part(0), part(1), part(2));
    }
    case ExprKind::kCall: {
      Value callee = eval(*e.object);
      CallArgs args = eval_args(e.args);
      return call(callee, args);
    }
    case ExprKind::kFilter: {
      Value input = eval(*e.object);
      CallArgs args = eval_args(e.args);
      return apply_filter(*this, e.name, input, args);
    }
    case ExprKind::kTest: {
      Value input = eval(*e.object);
      CallArgs args = eval_args(e.args);
      const bool result = apply_test(*this, e.name, input, args);
      return Value(e.negated ? !result : result);
    }
    case ExprKind::kUnary: {
      Value v = eval(*e.object);
      if (e.name == "not") return Value(!v.truthy());
      require_defined(v);
      if (!v.is_number()) fail(fmt::format("bad operand type for unary {}: '{}'", e.name, v.type_name()));
      if (e.name == "+") return v.is_float() ? v : Value(v.as_int());
      if (v.is_float()) return Value(-v.as_float());
      if (v.as_int() == INT64_MIN) fail("integer overflow");
      return Value(-v.as_int());
    }
    case ExprKind::kBinary:
      return eval_binary(e);
    case ExprKind::kCompare:
      return eval_compare(e);
    case ExprKind::kCondition:
      if (eval(*e.condition).truthy()) return eval(*e.object);
      return e.other ? eval(*e.other) : Value::undefined("the condition was false and there is no 'else'");
  }
  return Value();
}

Value Interpreter::eval_binary(const Expr& e) {
  if (e.name == "and") {
    Value left = eval(*e.object);
    return left.truthy() ? eval(*e.other) : left;
  }
  if (e.name == "or") {
    Value left = eval(*e.object);
    return left.truthy() ? left : eval(*e.other);
  }
  Value left = eval(*e.object);
  Value right = eval(*e.other);
  if (e.name == "~") return Value(left.str() + right.str());
  const Value result = binary_op(e.name, left, right);
  if (result.is_string() && result.as_string().size() > limits_.max_output_bytes) {
    fail(fmt::format("a string exceeds {} bytes", limits_.max_output_bytes));
  }
  return result;
}

Value Interpreter::eval_compare(const Expr& e) {
  Value left = eval(*e.object);
  for (const auto& [op, operand] : e.comparisons) {
    Value right = eval(*operand);
    bool ok;
    if (op == "==") {
      ok = equals(left, right);
    } else if (op == "!=") {
      ok = !equals(left, right);
    } else if (op == "in") {
      ok = contains(right, left);
    } else if (op == "not in") {
      ok = !contains(right, left);
    } else {
      require_defined(left);
      require_defined(right);
      const int c = compare(left, right, op);
      ok = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
    }
    if (!ok) return Value(false);
    left = std::move(right);
  }
  return Value(true);
}

}  // namespace moelora::jinja
