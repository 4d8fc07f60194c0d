#include "tokenizer/jinja_parser.h"

#include <initializer_list>

#include <fmt/format.h>

#include "tokenizer/jinja_lexer.h"

namespace moelora::jinja {
namespace {

[[noreturn]] void fail_at(int line, std::string message) { throw Error{std::move(message), line}; }

std::string describe(const Token& t) {
  switch (t.type) {
    case TokenType::kData: return "template data";
    case TokenType::kVariableBegin: return "'{{'";
    case TokenType::kVariableEnd: return "end of print statement '}}'";
    case TokenType::kBlockBegin: return "'{%'";
    case TokenType::kBlockEnd: return "end of statement block '%}'";
    case TokenType::kName: return "'" + t.value + "'";
    case TokenType::kString: return "string";
    case TokenType::kInteger: return "integer";
    case TokenType::kFloat: return "float";
    case TokenType::kOperator: return "'" + t.value + "'";
    case TokenType::kEof: return "end of template";
  }
  return "token";
}

ExprPtr make(ExprKind kind, int line) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->line = line;
  return e;
}

// Nesting deeper than this (brackets, unary operators, blocks) is refused: the parser and the
// renderer recurse, and a hostile template must not exhaust the stack.
constexpr int kMaxNesting = 512;

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Body parse_template() {
    Body body = subparse({});
    if (cur().type != TokenType::kEof) fail_at(cur().line, fmt::format("unexpected {}", describe(cur())));
    return body;
  }

 private:
  // ---- token stream --------------------------------------------------------------------------
  const Token& cur() const { return toks_[i_]; }
  const Token& look() const { return toks_[i_ + 1 < toks_.size() ? i_ + 1 : i_]; }
  const Token& next() { return toks_[i_ < toks_.size() - 1 ? i_++ : i_]; }
  bool is_op(std::string_view op) const { return cur().type == TokenType::kOperator && cur().value == op; }
  bool is_name(std::string_view name) const { return cur().type == TokenType::kName && cur().value == name; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }
  void expect_op(std::string_view op) {
    if (!skip_op(op)) fail_at(cur().line, fmt::format("expected '{}', got {}", op, describe(cur())));
  }
  const Token& expect(TokenType type, std::string_view what) {
    if (cur().type != type) fail_at(cur().line, fmt::format("expected {}, got {}", what, describe(cur())));
    return next();
  }
  std::string expect_name() { return expect(TokenType::kName, "a name").value; }

  struct DepthGuard {
    explicit DepthGuard(Parser& p) : parser(p) {
      if (++parser.depth_ > kMaxNesting) {
        fail_at(parser.cur().line, fmt::format("the template nests deeper than {} levels", kMaxNesting));
      }
    }
    ~DepthGuard() { --parser.depth_; }
    Parser& parser;
  };

  // ---- statements ------------------------------------------------------------------------------
  // Parses template data and tags until `{% <one of end_tags>` (left at the tag name) or the end.
  Body subparse(std::initializer_list<std::string_view> end_tags) {
    Body body;
    while (cur().type != TokenType::kEof) {
      const Token& t = cur();
      if (t.type == TokenType::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kText;
        s->line = t.line;
        s->text = t.value;
        body.push_back(std::move(s));
        next();
      } else if (t.type == TokenType::kVariableBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kOutput;
        s->line = t.line;
        s->expr = parse_tuple(false, true, {}, false);
        expect(TokenType::kVariableEnd, "end of print statement '}}'");
        body.push_back(std::move(s));
      } else if (t.type == TokenType::kBlockBegin) {
        next();
        for (std::string_view end : end_tags) {
          if (is_name(end)) return body;
        }
        body.push_back(parse_statement());
        expect(TokenType::kBlockEnd, "end of statement block '%}'");
      } else {
        fail_at(t.line, fmt::format("unexpected {}", describe(t)));
      }
    }
    return body;
  }

  // `%}` then statements until one of `end_tags`; with drop_needle the end tag name is consumed.
  Body parse_statements(std::initializer_list<std::string_view> end_tags, bool drop_needle, int start_line) {
    skip_op(":");
    expect(TokenType::kBlockEnd, "end of statement block '%}'");
    Body body = subparse(end_tags);
    if (cur().type == TokenType::kEof) {
      std::string wanted;
      for (std::string_view e : end_tags) wanted += (wanted.empty() ? "'" : " or '") + std::string(e) + "'";
      fail_at(start_line, fmt::format("unexpected end of template: the block opened here needs {}", wanted));
    }
    if (drop_needle) next();
    return body;
  }

  StmtPtr parse_statement() {
    DepthGuard guard(*this);
    const Token& t = cur();
    if (t.type != TokenType::kName) fail_at(t.line, "tag name expected");
    const std::string tag = t.value;
    const int line = t.line;
    if (tag == "if") return parse_if();
    if (tag == "for") return parse_for();
    if (tag == "set") return parse_set();
    if (tag == "macro") return parse_macro();
    if (tag == "filter") return parse_filter_block();
    if (tag == "with" || tag == "generation") return parse_with(tag);
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail_at(line, fmt::format("'{}' outside of a loop", tag));
      next();
      auto s = std::make_unique<Stmt>();
      s->kind = tag == "break" ? StmtKind::kBreak : StmtKind::kContinue;
      s->line = line;
      return s;
    }
    static constexpr std::string_view kUnsupported[] = {"include", "import", "from", "extends", "block",
                                                          "call", "autoescape", "print", "trans"};
    for (std::string_view u : kUnsupported) {
      if (tag == u) fail_at(line, fmt::format("unsupported tag '{{% {} %}}': moelora's chat-template renderer covers a Jinja subset", tag));
    }
    fail_at(line, fmt::format("unknown tag '{}' (Jinja2 as configured by transformers does not know it either)", tag));
  }

  StmtPtr parse_if() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::kIf;
    s->line = next().line;
    while (true) {
      ExprPtr test = parse_tuple(false, false, {}, false);
      Body body = parse_statements({"elif", "else", "endif"}, false, s->line);
      s->branches.emplace_back(std::move(test), std::move(body));
      const Token& t = next();
      if (t.value == "elif") continue;
      if (t.value == "else") s->else_body = parse_statements({"endif"}, true, s->line);
      break;
    }
    return s;
  }

  StmtPtr parse_for() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::kFor;
    s->line = next().line;
    s->target = parse_assign_target(false, {"in"});
    if (!skip_name("in")) fail_at(cur().line, fmt::format("expected 'in', got {}", describe(cur())));
    s->expr = parse_tuple(false, false, {"recursive"}, false);
    if (skip_name("if")) s->filter = parse_expression(true);
    if (is_name("recursive")) fail_at(cur().line, "unsupported: recursive for loops");
    ++loop_depth_;
    s->body = parse_statements({"endfor", "else"}, false, s->line);
    --loop_depth_;
    if (next().value == "else") s->else_body = parse_statements({"endfor"}, true, s->line);
    return s;
  }

  StmtPtr parse_set() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::kSet;
    s->line = next().line;
    s->target = parse_assign_target(true, {});
    if (skip_op("=")) {
      s->expr = parse_tuple(false, true, {}, false);
      return s;
    }
    if (!s->target.namespace_attr.empty() || s->target.is_tuple) {
      fail_at(s->line, "a block {% set %} assigns a single name");
    }
    while (is_op("|")) {
      next();
      s->filters.push_back(parse_filter_call());
    }
    s->body = parse_statements({"endset"}, true, s->line);
    return s;
  }

  StmtPtr parse_macro() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::kMacro;
    s->line = next().line;
    s->text = expect_name();
    expect_op("(");
    bool seen_default = false;
    while (!is_op(")")) {
      if (!s->params.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string param = expect_name();
      ExprPtr def;
      if (skip_op("=")) {
        def = parse_expression(true);
        seen_default = true;
      } else if (seen_default) {
        fail_at(s->line, "non-default argument follows default argument");
      }
      s->params.emplace_back(std::move(param), std::move(def));
    }
    expect_op(")");
    const int saved_depth = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_statements({"endmacro"}, true, s->line);
    loop_depth_ = saved_depth;
    return s;
  }

  StmtPtr parse_filter_block() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::kFilterBlock;
    s->line = next().line;
    s->filters.push_back(parse_filter_call());
    while (is_op("|")) {
      next();
      s->filters.push_back(parse_filter_call());
    }
    s->body = parse_statements({"endfilter"}, true, s->line);
    return s;
  }

  // {% with a = 1, b = 2 %} and transformers' {% generation %}: a scope around the body.
  StmtPtr parse_with(const std::string& tag) {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::kWith;
    s->line = next().line;
    if (tag == "with") {
      while (cur().type != TokenType::kBlockEnd) {
        if (!s->params.empty()) expect_op(",");
        std::string name = expect_name();
        expect_op("=");
        s->params.emplace_back(std::move(name), parse_expression(true));
      }
    }
    s->body = parse_statements({tag == "with" ? "endwith" : "endgeneration"}, true, s->line);
    return s;
  }

  Target parse_assign_target(bool with_namespace, std::initializer_list<std::string_view> extra_end) {
    Target target;
    if (with_namespace && cur().type == TokenType::kName && look().type == TokenType::kOperator &&
        look().value == ".") {
      target.names.push_back(next().value);
      next();
      target.namespace_attr = expect_name();
      return target;
    }
    // A name or a tuple of names ("a, b" or "(a, b)").
    const bool paren = skip_op("(");
    while (true) {
      if (cur().type != TokenType::kName) fail_at(cur().line, fmt::format("can't assign to {}", describe(cur())));
      target.names.push_back(next().value);
      if (!is_op(",")) break;
      next();
      target.is_tuple = true;
      bool end = cur().type == TokenType::kBlockEnd || is_op(")") || is_op("=");
      for (std::string_view e : extra_end) end |= is_name(e);
      if (end) break;
    }
    if (paren) {
      expect_op(")");
      target.is_tuple = true;
    }
    return target;
  }

  FilterCall parse_filter_call() {
    FilterCall f;
    f.line = cur().line;
    f.name = expect_name();
    while (is_op(".")) {
      next();
      f.name += "." + expect_name();
    }
    if (is_op("(")) f.args = parse_call_args();
    return f;
  }

  // ---- expressions ---------------------------------------------------------------------------
  bool is_tuple_end(std::initializer_list<std::string_view> extra_end) const {
    if (cur().type == TokenType::kVariableEnd || cur().type == TokenType::kBlockEnd || is_op(")")) return true;
    for (std::string_view e : extra_end) {
      if (is_name(e)) return true;
    }
    return false;
  }

  ExprPtr parse_tuple(bool simplified, bool with_condexpr, std::initializer_list<std::string_view> extra_end,
                      bool explicit_parentheses) {
    const int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(simplified ? parse_primary() : parse_expression(with_condexpr));
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses) fail_at(line, fmt::format("expected an expression, got {}", describe(cur())));
    }
    auto e = make(ExprKind::kTuple, line);
    e->items = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      const int line = next().line;
      auto c = make(ExprKind::kCondition, line);
      c->condition = parse_or();
      c->object = std::move(expr);
      if (skip_name("else")) c->other = parse_condexpr();
      expr = std::move(c);
    }
    return expr;
  }

  ExprPtr binary(std::string op, ExprPtr left, ExprPtr right, int line) {
    auto e = make(ExprKind::kBinary, line);
    e->name = std::move(op);
    e->object = std::move(left);
    e->other = std::move(right);
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const int line = next().line;
      left = binary("or", std::move(left), parse_and(), line);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const int line = next().line;
      left = binary("and", std::move(left), parse_not(), line);
    }
    return left;
  }

  ExprPtr parse_not() {
    DepthGuard guard(*this);
    if (is_name("not")) {
      auto e = make(ExprKind::kUnary, next().line);
      e->name = "not";
      e->object = parse_not();
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = cur().line;
    ExprPtr expr = parse_math1();
    std::vector<std::pair<std::string, ExprPtr>> ops;
    while (true) {
      if (cur().type == TokenType::kOperator &&
          (cur().value == "==" || cur().value == "!=" || cur().value == "<" || cur().value == "<=" ||
           cur().value == ">" || cur().value == ">=")) {
        std::string op = next().value;
        ops.emplace_back(std::move(op), parse_math1());
      } else if (skip_name("in")) {
        ops.emplace_back("in", parse_math1());
      } else if (is_name("not") && look().type == TokenType::kName && look().value == "in") {
        next();
        next();
        ops.emplace_back("not in", parse_math1());
      } else {
        break;
      }
    }
    if (ops.empty()) return expr;
    auto e = make(ExprKind::kCompare, line);
    e->object = std::move(expr);
    e->comparisons = std::move(ops);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      left = binary(t.value, std::move(left), parse_concat(), t.line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      const int line = next().line;
      left = binary("~", std::move(left), parse_math2(), line);
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      left = binary(t.value, std::move(left), parse_pow(), t.line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const int line = next().line;
      left = binary("**", std::move(left), parse_unary(true), line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      node = make(ExprKind::kUnary, t.line);
      node->name = t.value;
      node->object = parse_unary(false);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    const int line = t.line;
    if (t.type == TokenType::kName) {
      auto e = make(ExprKind::kLiteral, line);
      if (t.value == "true" || t.value == "True") {
        e->value = Value(true);
      } else if (t.value == "false" || t.value == "False") {
        e->value = Value(false);
      } else if (t.value == "none" || t.value == "None") {
        e->value = Value::none();
      } else {
        e->kind = ExprKind::kName;
        e->name = t.value;
      }
      next();
      return e;
    }
    if (t.type == TokenType::kString) {
      std::string text;
      while (cur().type == TokenType::kString) text += next().value;  // adjacent literals join
      auto e = make(ExprKind::kLiteral, line);
      e->value = Value(std::move(text));
      return e;
    }
    if (t.type == TokenType::kInteger || t.type == TokenType::kFloat) {
      auto e = make(ExprKind::kLiteral, line);
      e->value = t.type == TokenType::kInteger ? Value(t.int_value) : Value(t.float_value);
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      ExprPtr e = parse_tuple(false, true, {}, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto e = make(ExprKind::kList, line);
      while (!is_op("]")) {
        if (!e->items.empty()) expect_op(",");
        if (is_op("]")) break;
        e->items.push_back(parse_expression(true));
      }
      expect_op("]");
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = make(ExprKind::kDict, line);
      while (!is_op("}")) {
        if (!e->pairs.empty()) expect_op(",");
        if (is_op("}")) break;
        ExprPtr key = parse_expression(true);
        expect_op(":");
        e->pairs.emplace_back(std::move(key), parse_expression(true));
      }
      expect_op("}");
      return e;
    }
    fail_at(line, fmt::format("unexpected {}", describe(t)));
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        next();
        auto e = make(ExprKind::kFilter, cur().line);
        FilterCall f = parse_filter_call();
        e->name = std::move(f.name);
        e->args = std::move(f.args);
        e->object = std::move(node);
        node = std::move(e);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const Token& t = next();
    if (t.value == ".") {
      const Token& attr = next();
      if (attr.type == TokenType::kName) {
        auto e = make(ExprKind::kGetAttr, t.line);
        e->object = std::move(node);
        e->name = attr.value;
        return e;
      }
      if (attr.type != TokenType::kInteger) fail_at(attr.line, "expected name or number after '.'");
      auto e = make(ExprKind::kGetItem, t.line);
      e->object = std::move(node);
      e->other = make(ExprKind::kLiteral, attr.line);
      e->other->value = Value(attr.int_value);
      return e;
    }
    std::vector<ExprPtr> args;
    while (!is_op("]")) {
      if (!args.empty()) expect_op(",");
      args.push_back(parse_subscribed());
    }
    expect_op("]");
    if (args.size() == 1 && args[0]->kind == ExprKind::kSlice) {
      args[0]->object = std::move(node);
      return std::move(args[0]);
    }
    auto e = make(ExprKind::kGetItem, t.line);
    e->object = std::move(node);
    if (args.size() == 1) {
      e->other = std::move(args[0]);
    } else {
      e->other = make(ExprKind::kTuple, t.line);
      e->other->items = std::move(args);
    }
    return e;
  }

  // An index or a slice [start:stop:step] (parts may be omitted).
  ExprPtr parse_subscribed() {
    const int line = cur().line;
    ExprPtr start;
    if (!is_op(":")) {
      start = parse_expression(true);
      if (!is_op(":")) return start;
    }
    next();  // ':'
    auto e = make(ExprKind::kSlice, line);
    ExprPtr stop, step;
    if (!is_op("]") && !is_op(",") && !is_op(":")) stop = parse_expression(true);
    if (skip_op(":")) {
      if (!is_op("]") && !is_op(",")) step = parse_expression(true);
    }
    e->items.push_back(std::move(start));
    e->items.push_back(std::move(stop));
    e->items.push_back(std::move(step));
    return e;
  }

  Arguments parse_call_args() {
    const int line = cur().line;
    expect_op("(");
    Arguments args;
    bool require_comma = false;
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) fail_at(line, "unsupported: *args / **kwargs in a call");
      if (cur().type == TokenType::kName && look().type == TokenType::kOperator && look().value == "=") {
        std::string key = next().value;
        next();
        args.keyword.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!args.keyword.empty()) fail_at(line, "positional argument follows keyword argument");
        args.positional.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
    return args;
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = make(ExprKind::kCall, cur().line);
    e->args = parse_call_args();
    e->object = std::move(node);
    return e;
  }

  ExprPtr parse_test(ExprPtr node) {
    const int line = next().line;  // 'is'
    auto e = make(ExprKind::kTest, line);
    e->negated = skip_name("not");
    e->name = expect_name();
    while (is_op(".")) {
      next();
      e->name += "." + expect_name();
    }
    if (is_op("(")) {
      e->args = parse_call_args();
    } else if ((cur().type == TokenType::kName || cur().type == TokenType::kString ||
                cur().type == TokenType::kInteger || cur().type == TokenType::kFloat || is_op("(") || is_op("[") ||
                is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail_at(cur().line, "you cannot chain multiple tests with 'is'");
      e->args.positional.push_back(parse_postfix(parse_primary()));
    }
    e->object = std::move(node);
    return e;
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  int loop_depth_ = 0;
  int depth_ = 0;
};

}  // namespace

Body parse(std::string_view source) { return Parser(tokenize(source)).parse_template(); }

}  // namespace moelora::jinja
