#include "tokenizer/jinja_builtins.h"

#include <cmath>
#include <ctime>

#include <fmt/format.h>

#include "tokenizer/python_str.h"
#include "tokenizer/utf8.h"

namespace moelora::jinja {

// ---------------------------------------------------------------------------------------------
// Argument binding and coercion

BoundArgs::BoundArgs(CallArgs& args, std::string function, std::vector<std::string> params)
    : args_(args), function_(std::move(function)), params_(std::move(params)) {
  for (const auto& [name, value] : args_.keyword) {
    bool known = false;
    for (const std::string& p : params_) known |= p == name;
    if (!known) fail(fmt::format("{}() got an unexpected keyword argument '{}'", function_, name));
  }
}

bool BoundArgs::has(size_t i) const {
  if (i < args_.positional.size()) return true;
  for (const auto& [name, value] : args_.keyword) {
    if (i < params_.size() && name == params_[i]) return true;
  }
  return false;
}

Value BoundArgs::get(size_t i, Value fallback) const {
  if (i < args_.positional.size()) return args_.positional[i];
  for (const auto& [name, value] : args_.keyword) {
    if (i < params_.size() && name == params_[i]) return value;
  }
  return fallback;
}

std::vector<Value> BoundArgs::rest() const {
  std::vector<Value> out;
  for (size_t i = params_.size(); i < args_.positional.size(); ++i) out.push_back(args_.positional[i]);
  return out;
}

void require_defined(const Value& v) {
  if (v.is_undefined()) fail(v.undefined_hint().empty() ? "a value is undefined" : v.undefined_hint());
}

int64_t to_int_arg(const Value& v, std::string_view what) {
  require_defined(v);
  if (v.is_int() || v.is_bool()) return v.as_int();
  if (v.is_float() && std::floor(v.as_float()) == v.as_float()) return static_cast<int64_t>(v.as_float());
  fail(fmt::format("{} must be an integer, not '{}'", what, v.type_name()));
}

std::string to_str_arg(const Value& v, std::string_view what) {
  require_defined(v);
  if (!v.is_string()) fail(fmt::format("{} must be str, not '{}'", what, v.type_name()));
  return v.as_string();
}

namespace {

Value str_list(const std::vector<std::string>& parts) {
  ValueList items;
  items.reserve(parts.size());
  for (const std::string& p : parts) items.emplace_back(p);
  return Value::list(std::move(items));
}

std::optional<std::string> optional_str(const Value& v, std::string_view what) {
  if (v.is_undefined() || v.is_none()) return std::nullopt;
  return to_str_arg(v, what);
}

// Normalizes a Python index (negative counts from the end); false if out of range.
bool normalize_index(int64_t& i, size_t size) {
  if (i < 0) i += static_cast<int64_t>(size);
  return i >= 0 && i < static_cast<int64_t>(size);
}

bool starts_or_ends_with(const std::string& s, const Value& arg, bool starts) {
  const auto test = [&](const std::string& x) { return starts ? s.starts_with(x) : s.ends_with(x); };
  if (arg.is_tuple()) {
    for (const Value& v : arg.items()) {
      if (test(to_str_arg(v, "tuple item"))) return true;
    }
    return false;
  }
  return test(to_str_arg(arg, starts ? "startswith argument" : "endswith argument"));
}

bool all_chars(const std::string& s, bool (*pred)(char32_t)) {
  if (s.empty()) return false;
  size_t pos = 0;
  while (pos < s.size()) {
    if (!pred(utf8::decode_valid(s, pos))) return false;
  }
  return true;
}

// A bound str method, or an undefined value if there is none of that name.
Value string_method(const Value& self, const std::string& name) {
  const std::string full = "str." + name;
  const auto method = [&](std::vector<std::string> params, auto fn) {
    return Value::callable(full, [self, full, params, fn](CallArgs& args, Interpreter&) -> Value {
      BoundArgs a(args, full, params);
      if (args.positional.size() > params.size()) fail(fmt::format("{}() takes at most {} arguments", full, params.size()));
      return fn(self.as_string(), a);
    });
  };
  using pystr::StripSide;
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const StripSide side = name == "strip" ? StripSide::kBoth : (name == "lstrip" ? StripSide::kLeft : StripSide::kRight);
    return method({"chars"}, [side](const std::string& s, const BoundArgs& a) {
      return Value(pystr::strip(s, optional_str(a.get(0), "chars"), side));
    });
  }
  if (name == "split" || name == "rsplit") {
    const bool right = name == "rsplit";
    return method({"sep", "maxsplit"}, [right](const std::string& s, const BoundArgs& a) {
      const auto sep = optional_str(a.get(0), "sep");
      if (sep && sep->empty()) fail("empty separator");
      const int64_t maxsplit = a.has(1) ? to_int_arg(a.get(1), "maxsplit") : -1;
      return str_list(right ? pystr::rsplit(s, sep, maxsplit) : pystr::split(s, sep, maxsplit));
    });
  }
  if (name == "splitlines") {
    return method({"keepends"}, [](const std::string& s, const BoundArgs& a) {
      return str_list(pystr::splitlines(s, a.get(0, Value(false)).truthy()));
    });
  }
  if (name == "startswith" || name == "endswith") {
    const bool starts = name == "startswith";
    return method({"prefix"}, [starts](const std::string& s, const BoundArgs& a) {
      return Value(starts_or_ends_with(s, a.get(0), starts));
    });
  }
  using StrFn = std::string (*)(std::string_view);
  StrFn simple = nullptr;
  if (name == "upper") simple = &pystr::upper;
  if (name == "lower") simple = &pystr::lower;
  if (name == "title") simple = &pystr::title;
  if (name == "capitalize") simple = &pystr::capitalize;
  if (name == "swapcase") simple = &pystr::swapcase;
  if (simple) return method({}, [simple](const std::string& s, const BoundArgs&) { return Value(simple(s)); });
  if (name == "replace") {
    return method({"old", "new", "count"}, [](const std::string& s, const BoundArgs& a) {
      const int64_t count = a.has(2) ? to_int_arg(a.get(2), "count") : -1;
      return Value(pystr::replace(s, to_str_arg(a.get(0), "old"), to_str_arg(a.get(1), "new"), count));
    });
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    return method({"sub"}, [name](const std::string& s, const BoundArgs& a) {
      const std::string sub = to_str_arg(a.get(0), "substring");
      if (name == "count") return Value(pystr::count(s, sub));
      const int64_t at = name[0] == 'r' ? pystr::rfind(s, sub) : pystr::find(s, sub);
      if (at < 0 && name.ends_with("index")) fail("substring not found");
      return Value(at);
    });
  }
  if (name == "join") {
    return method({"iterable"}, [](const std::string& s, const BoundArgs& a) {
      std::string out;
      bool first = true;
      for (const Value& v : iterate(a.get(0))) {
        if (!first) out += s;
        out += to_str_arg(v, "sequence item");
        first = false;
      }
      return Value(out);
    });
  }
  if (name == "center") {
    return method({"width", "fillchar"}, [](const std::string& s, const BoundArgs& a) {
      return Value(pystr::center(s, to_int_arg(a.get(0), "width"), a.has(1) ? to_str_arg(a.get(1), "fillchar") : " "));
    });
  }
  if (name == "isspace") return method({}, [](const std::string& s, const BoundArgs&) { return Value(pystr::is_space(s)); });
  if (name == "islower") return method({}, [](const std::string& s, const BoundArgs&) { return Value(pystr::is_lower(s)); });
  if (name == "isupper") return method({}, [](const std::string& s, const BoundArgs&) { return Value(pystr::is_upper(s)); });
  if (name == "isdigit" || name == "isnumeric" || name == "isdecimal") {
    return method({}, [](const std::string& s, const BoundArgs&) {
      return Value(all_chars(s, [](char32_t c) { return c >= '0' && c <= '9'; }));
    });
  }
  if (name == "isalpha" || name == "isalnum") {
    const bool digits = name == "isalnum";
    return method({}, [digits](const std::string& s, const BoundArgs&) {
      // ASCII letters (and digits) only: templates use these on role names and keys.
      const auto letter = [](char32_t c) { return (c | 0x20) >= 'a' && (c | 0x20) <= 'z'; };
      return Value(digits ? all_chars(s, [](char32_t c) { return ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') || (c >= '0' && c <= '9'); })
                          : all_chars(s, letter));
    });
  }
  if (name == "format" || name == "format_map" || name == "encode" || name == "translate") {
    return Value::callable(full, [full](CallArgs&, Interpreter&) -> Value {
      fail(fmt::format("unsupported: {}() in a chat template", full));
    });
  }
  return Value::undefined(fmt::format("'str object' has no attribute '{}'", name));
}

Value dict_method(const Value& self, const std::string& name) {
  const std::string full = "dict." + name;
  if (name == "items" || name == "keys" || name == "values") {
    return Value::callable(full, [self, name](CallArgs&, Interpreter&) -> Value {
      ValueList out;
      for (const auto& [k, v] : self.as_dict().entries) {
        if (name == "items") out.push_back(Value::tuple({k, v}));
        else out.push_back(name == "keys" ? k : v);
      }
      return Value::list(std::move(out));
    });
  }
  if (name == "get") {
    return Value::callable(full, [self, full](CallArgs& args, Interpreter&) -> Value {
      BoundArgs a(args, full, {"key", "default"});
      const Value* v = self.as_dict().find(a.get(0));
      return v ? *v : a.get(1, Value::none());
    });
  }
  if (name == "copy") {
    return Value::callable(full, [self](CallArgs&, Interpreter&) -> Value {
      Value d = Value::dict();
      for (const auto& [k, v] : self.as_dict().entries) d.as_dict_mut().set(k, v);
      return d;
    });
  }
  static constexpr std::string_view kUnsafe[] = {"pop", "popitem", "setdefault", "update", "clear", "fromkeys"};
  for (std::string_view u : kUnsafe) {
    if (name == u) {
      return Value::callable(full, [name](CallArgs&, Interpreter&) -> Value {
        fail(fmt::format("access to attribute '{}' of 'dict' object is unsafe (the sandbox forbids changing it)", name));
      });
    }
  }
  return Value();  // not a method
}

Value list_method(const Value& self, const std::string& name) {
  const std::string full = "list." + name;
  if (name == "index" || name == "count") {
    return Value::callable(full, [self, name](CallArgs& args, Interpreter&) -> Value {
      if (args.positional.size() != 1) fail(fmt::format("list.{}() takes exactly one argument", name));
      int64_t n = 0;
      const ValueList& items = self.items();
      for (size_t i = 0; i < items.size(); ++i) {
        if (!equals(items[i], args.positional[0])) continue;
        if (name == "index") return Value(static_cast<int64_t>(i));
        ++n;
      }
      if (name == "index") fail("value is not in list");
      return Value(n);
    });
  }
  static constexpr std::string_view kUnsafe[] = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"};
  for (std::string_view u : kUnsafe) {
    if (name == u) {
      return Value::undefined(
          fmt::format("access to attribute '{}' of '{}' object is unsafe (the sandbox forbids changing it)", name,
                      self.type_name()));
    }
  }
  return Value::undefined(fmt::format("'{} object' has no attribute '{}'", self.type_name(), name));
}

std::string describe_for_undefined(const Value& obj) {
  if (obj.is_none()) return "None";
  return fmt::format("{} object", obj.type_name());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Attribute, item and slice access

Value get_attribute(const Value& obj, const std::string& name) {
  require_defined(obj);
  switch (obj.kind()) {
    case Value::Kind::kDict: {
      Value m = dict_method(obj, name);
      if (!m.is_undefined()) return m;
      if (const Value* v = obj.as_dict().find(Value(name))) return *v;
      return Value::undefined(fmt::format("'dict object' has no attribute '{}'", name));
    }
    case Value::Kind::kNamespace:
      if (const Value* v = obj.as_dict().find(Value(name))) return *v;
      return Value::undefined(fmt::format("'Namespace' object has no attribute '{}'", name));
    case Value::Kind::kString:
      return string_method(obj, name);
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return list_method(obj, name);
    default:
      return Value::undefined(fmt::format("'{}' has no attribute '{}'", describe_for_undefined(obj), name));
  }
}

Value get_item(const Value& obj, const Value& key) {
  require_defined(obj);
  if (obj.is_mapping()) {
    if (const Value* v = obj.as_dict().find(key)) return *v;
    if (key.is_string() && obj.is_dict()) {
      Value m = dict_method(obj, key.as_string());
      if (!m.is_undefined()) return m;
    }
    return Value::undefined(fmt::format("'{}' has no attribute '{}'", describe_for_undefined(obj), key.str()));
  }
  if ((obj.is_sequence() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    int64_t i = key.as_int();
    if (obj.is_string()) {
      const std::string& s = obj.as_string();
      if (!normalize_index(i, pystr::length(s))) {
        return Value::undefined(fmt::format("'str object' has no attribute '{}'", key.as_int()));
      }
      const size_t begin = pystr::byte_offset(s, static_cast<size_t>(i));
      size_t end = begin;
      utf8::decode_valid(s, end);
      return Value(s.substr(begin, end - begin));
    }
    if (!normalize_index(i, obj.items().size())) {
      return Value::undefined(fmt::format("'{} object' has no element {}", obj.type_name(), key.as_int()));
    }
    return obj.items()[static_cast<size_t>(i)];
  }
  if (key.is_string()) return get_attribute(obj, key.as_string());
  return Value::undefined(fmt::format("'{}' has no attribute '{}'", describe_for_undefined(obj), key.str()));
}

Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  require_defined(obj);
  if (!obj.is_sequence() && !obj.is_string()) fail(fmt::format("'{}' object is not subscriptable", obj.type_name()));
  const std::u32string cps = obj.is_string() ? utf8::to_code_points(obj.as_string()) : std::u32string();
  const auto n = static_cast<int64_t>(obj.is_string() ? cps.size() : obj.items().size());
  const int64_t step = step_v.is_none() ? 1 : to_int_arg(step_v, "slice step");
  if (step == 0) fail("slice step cannot be zero");
  // Python's slice.indices().
  const auto clamp = [&](const Value& v, int64_t fallback) -> int64_t {
    if (v.is_none()) return fallback;
    int64_t i = to_int_arg(v, "slice index");
    if (i < 0) i += n;
    if (step > 0) return std::clamp<int64_t>(i, 0, n);
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t start = clamp(start_v, step > 0 ? 0 : n - 1);
  const int64_t stop = clamp(stop_v, step > 0 ? n : -1);
  std::vector<int64_t> picked;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) picked.push_back(i);
  if (obj.is_string()) {
    std::u32string out;
    for (int64_t i : picked) out.push_back(cps[static_cast<size_t>(i)]);
    return Value(utf8::from_code_points(out));
  }
  ValueList out;
  for (int64_t i : picked) out.push_back(obj.items()[static_cast<size_t>(i)]);
  return obj.is_tuple() ? Value::tuple(std::move(out)) : Value::list(std::move(out));
}

// ---------------------------------------------------------------------------------------------
// Operators

namespace {

void check_overflow(bool overflow) {
  if (overflow) fail("integer overflow (values beyond 64 bits are not supported)");
}

Value repeat(const Value& seq, int64_t times) {
  if (times <= 0) return seq.is_string() ? Value(std::string()) : (seq.is_tuple() ? Value::tuple({}) : Value::list());
  const size_t unit = seq.is_string() ? seq.as_string().size() : seq.items().size();
  if (unit * static_cast<size_t>(times) > (size_t{64} << 20)) fail("the repeated sequence would be too large");
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += seq.as_string();
    return Value(std::move(out));
  }
  ValueList out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), seq.items().begin(), seq.items().end());
  return seq.is_tuple() ? Value::tuple(std::move(out)) : Value::list(std::move(out));
}

// Python's printf-style `str % args`, for %s, %r, %d, %i and %%.
Value percent_format(const std::string& format, const Value& args) {
  const ValueList values = args.is_tuple() ? args.items() : ValueList{args};
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out += format[i];
      continue;
    }
    if (++i == format.size()) fail("incomplete format");
    const char spec = format[i];
    if (spec == '%') {
      out += '%';
      continue;
    }
    if (next >= values.size()) fail("not enough arguments for format string");
    const Value& v = values[next++];
    if (spec == 's') out += v.str();
    else if (spec == 'r') out += v.repr();
    else if (spec == 'd' || spec == 'i') out += std::to_string(v.is_float() ? static_cast<int64_t>(v.as_float()) : to_int_arg(v, "%d format"));
    else fail(fmt::format("unsupported format character '{}' (moelora supports %s, %r, %d, %i)", spec));
  }
  if (next < values.size()) fail("not all arguments converted during string formatting");
  return Value(std::move(out));
}

}  // namespace

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  require_defined(a);
  require_defined(b);
  const auto unsupported_types = [&]() -> Value {
    fail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, a.type_name(), b.type_name()));
  };
  if (op == "+") {
    if (a.is_string() && b.is_string()) return Value(a.as_string() + b.as_string());
    if (a.is_string() || b.is_string()) {
      fail(fmt::format("can only concatenate str (not \"{}\") to str", a.is_string() ? b.type_name() : a.type_name()));
    }
    if (a.kind() == b.kind() && a.is_sequence()) {
      ValueList out = a.items();
      out.insert(out.end(), b.items().begin(), b.items().end());
      return a.is_tuple() ? Value::tuple(std::move(out)) : Value::list(std::move(out));
    }
  }
  if (op == "*") {
    if ((a.is_string() || a.is_sequence()) && (b.is_int() || b.is_bool())) return repeat(a, b.as_int());
    if ((b.is_string() || b.is_sequence()) && (a.is_int() || a.is_bool())) return repeat(b, a.as_int());
  }
  if (op == "%" && a.is_string()) return percent_format(a.as_string(), b);
  if (!a.is_number() || !b.is_number()) return unsupported_types();

  const bool floats = a.is_float() || b.is_float();
  if (op == "/") {
    if (b.as_float() == 0) fail("division by zero");
    return Value(a.as_float() / b.as_float());
  }
  if (op == "**") {
    if (!floats && b.as_int() >= 0) {
      int64_t result = 1;
      for (int64_t i = 0; i < b.as_int(); ++i) check_overflow(__builtin_mul_overflow(result, a.as_int(), &result));
      return Value(result);
    }
    return Value(std::pow(a.as_float(), b.as_float()));
  }
  if (floats) {
    const double x = a.as_float(), y = b.as_float();
    if (op == "+") return Value(x + y);
    if (op == "-") return Value(x - y);
    if (op == "*") return Value(x * y);
    if (y == 0) fail(op == "%" ? "float modulo" : "float floor division by zero");
    if (op == "//") return Value(std::floor(x / y));
    if (op == "%") {
      double m = std::fmod(x, y);
      if (m != 0 && ((m < 0) != (y < 0))) m += y;
      return Value(m);
    }
    return unsupported_types();
  }
  const int64_t x = a.as_int(), y = b.as_int();
  int64_t r = 0;
  if (op == "+" || op == "-" || op == "*") {
    check_overflow(op == "+" ? __builtin_add_overflow(x, y, &r)
                             : (op == "-" ? __builtin_sub_overflow(x, y, &r) : __builtin_mul_overflow(x, y, &r)));
    return Value(r);
  }
  if (y == 0) fail(op == "%" ? "integer modulo by zero" : "integer division or modulo by zero");
  int64_t q = x / y, m = x % y;
  if (m != 0 && ((m < 0) != (y < 0))) {  // Python floors toward negative infinity
    --q;
    m += y;
  }
  if (op == "//") return Value(q);
  if (op == "%") return Value(m);
  return unsupported_types();
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kString:
      if (!item.is_string()) fail(fmt::format("'in <string>' requires string as left operand, not {}", item.type_name()));
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      for (const Value& v : container.items()) {
        if (equals(v, item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      return container.as_dict().find(item) != nullptr;
    default:
      fail(fmt::format("argument of type '{}' is not iterable", container.type_name()));
  }
}

ValueList iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return v.items();
    case Value::Kind::kDict: {
      ValueList keys;
      for (const auto& [k, value] : v.as_dict().entries) keys.push_back(k);
      return keys;
    }
    case Value::Kind::kString: {
      ValueList chars;
      const std::string& s = v.as_string();
      size_t pos = 0;
      while (pos < s.size()) {
        const size_t begin = pos;
        utf8::decode_valid(s, pos);
        chars.emplace_back(s.substr(begin, pos - begin));
      }
      return chars;
    }
    default:
      fail(fmt::format("'{}' object is not iterable", v.type_name()));
  }
}

// ---------------------------------------------------------------------------------------------
// Tests

bool apply_test(Interpreter& in, const std::string& name, const Value& v, CallArgs& args) {
  const auto arg = [&]() -> const Value& {
    if (args.positional.empty()) fail(fmt::format("test '{}' needs an argument", name));
    return args.positional[0];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && v.as_bool();
  if (name == "false") return v.is_bool() && !v.as_bool();
  if (name == "integer") return v.is_int();
  if (name == "float") return v.is_float();
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict();
  if (name == "iterable") return v.is_undefined() || v.is_sequence() || v.is_dict() || v.is_string();
  if (name == "sequence") return v.is_undefined() || v.is_sequence() || v.is_dict() || v.is_string();
  if (name == "callable") return v.is_callable() || v.is_undefined();
  if (name == "escaped") return false;
  if (name == "lower") return pystr::is_lower(v.str());
  if (name == "upper") return pystr::is_upper(v.str());
  if (name == "sameas") return v.same_object(arg());
  if (name == "in") return contains(arg(), v);
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, arg());
  if (name == "ne" || name == "!=") return !equals(v, arg());
  if (name == "lt" || name == "lessthan" || name == "<") return compare(v, arg(), "<") < 0;
  if (name == "le" || name == "<=") return compare(v, arg(), "<=") <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, arg(), ">") > 0;
  if (name == "ge" || name == ">=") return compare(v, arg(), ">=") >= 0;
  if (name == "even" || name == "odd" || name == "divisibleby") {
    const int64_t x = to_int_arg(v, fmt::format("the value of test '{}'", name));
    if (name == "even") return x % 2 == 0;
    if (name == "odd") return x % 2 != 0;
    const int64_t d = to_int_arg(arg(), "divisibleby argument");
    if (d == 0) fail("integer division or modulo by zero");
    return x % d == 0;
  }
  (void)in;
  fail(fmt::format("no test named '{}'", name));
}

// ---------------------------------------------------------------------------------------------
// Globals

void add_globals(Dict& globals) {
  globals.set(Value("raise_exception"), Value::callable("raise_exception", [](CallArgs& args, Interpreter&) -> Value {
                BoundArgs a(args, "raise_exception", {"message"});
                fail(a.get(0).str());
              }));
  globals.set(Value("namespace"), Value::callable("namespace", [](CallArgs& args, Interpreter& in) -> Value {
                Value ns = Value::ns();
                in.track_namespace(ns);
                for (const Value& init : args.positional) {
                  if (!init.is_mapping()) fail("namespace() takes mappings and keyword arguments");
                  for (const auto& [k, v] : init.as_dict().entries) ns.as_dict_mut().set(k, v);
                }
                for (const auto& [k, v] : args.keyword) ns.as_dict_mut().set(Value(k), v);
                return ns;
              }));
  globals.set(Value("dict"), Value::callable("dict", [](CallArgs& args, Interpreter&) -> Value {
                Value d = Value::dict();
                for (const Value& init : args.positional) {
                  if (!init.is_mapping()) fail("dict() takes a mapping and keyword arguments");
                  for (const auto& [k, v] : init.as_dict().entries) d.as_dict_mut().set(k, v);
                }
                for (const auto& [k, v] : args.keyword) d.as_dict_mut().set(Value(k), v);
                return d;
              }));
  globals.set(Value("range"), Value::callable("range", [](CallArgs& args, Interpreter& in) -> Value {
                if (args.positional.empty() || args.positional.size() > 3) fail("range expected 1 to 3 arguments");
                int64_t start = 0, stop, step = 1;
                if (args.positional.size() == 1) {
                  stop = to_int_arg(args.positional[0], "range() argument");
                } else {
                  start = to_int_arg(args.positional[0], "range() argument");
                  stop = to_int_arg(args.positional[1], "range() argument");
                  if (args.positional.size() == 3) step = to_int_arg(args.positional[2], "range() argument");
                }
                if (step == 0) fail("range() arg 3 must not be zero");
                // Python's len(range(...)), checked before anything is built.
                const long double span = step > 0 ? static_cast<long double>(stop) - start : static_cast<long double>(start) - stop;
                const long double count = span <= 0 ? 0 : std::ceil(span / std::abs(static_cast<long double>(step)));
                if (count > static_cast<long double>(in.limits().max_range)) {
                  fail(fmt::format("range() of more than {} items", in.limits().max_range));
                }
                ValueList out;
                out.reserve(static_cast<size_t>(count));
                for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.emplace_back(i);
                return Value::list(std::move(out));
              }));
  // transformers passes strftime_now for templates that print today's date.
  globals.set(Value("strftime_now"), Value::callable("strftime_now", [](CallArgs& args, Interpreter&) -> Value {
                BoundArgs a(args, "strftime_now", {"format"});
                const std::string format = to_str_arg(a.get(0), "format");
                const std::time_t now = std::time(nullptr);
                std::tm local{};
                localtime_r(&now, &local);
                char buf[512];
                const size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &local);
                return Value(std::string(buf, n));
              }));
}

}  // namespace moelora::jinja
