#include "tokenizer/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include <fmt/format.h>

#include "tokenizer/unicode.h"
#include "tokenizer/utf8.h"

namespace moelora::jinja {

void fail(std::string message) { throw Error{std::move(message), 0}; }

Value Value::undefined(std::string hint) {
  Value v;
  v.s_ = std::make_shared<const std::string>(std::move(hint));
  return v;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value::Value(bool b) : kind_(Kind::kBool), b_(b) {}
Value::Value(int64_t i) : kind_(Kind::kInt), i_(i) {}
Value::Value(double d) : kind_(Kind::kFloat), f_(d) {}
Value::Value(std::string s) : kind_(Kind::kString), s_(std::make_shared<const std::string>(std::move(s))) {}

Value Value::list(ValueList items) {
  Value v;
  v.kind_ = Kind::kList;
  v.list_ = std::make_shared<ValueList>(std::move(items));
  return v;
}

Value Value::tuple(ValueList items) {
  Value v = list(std::move(items));
  v.kind_ = Kind::kTuple;
  return v;
}

Value Value::dict() {
  Value v;
  v.kind_ = Kind::kDict;
  v.dict_ = std::make_shared<Dict>();
  return v;
}

Value Value::ns() {
  Value v = dict();
  v.kind_ = Kind::kNamespace;
  return v;
}

Value Value::callable(std::string name, std::function<Value(CallArgs&, Interpreter&)> fn) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.fn_ = std::make_shared<Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
      return i_ != 0;
    case Kind::kFloat:
      return f_ != 0.0;
    case Kind::kString:
      return !s_->empty();
    case Kind::kList:
    case Kind::kTuple:
      return !list_->empty();
    case Kind::kDict:
      return dict_->size() > 0;
    case Kind::kNamespace:
    case Kind::kCallable:
      return true;
  }
  return false;
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kList: return "list";
    case Kind::kTuple: return "tuple";
    case Kind::kDict: return "dict";
    case Kind::kNamespace: return "Namespace";
    case Kind::kCallable: return "function";
  }
  return "object";
}

bool Value::same_object(const Value& other) const {
  if (kind_ != other.kind_) return false;
  switch (kind_) {
    case Kind::kList:
    case Kind::kTuple:
      return list_ == other.list_;
    case Kind::kDict:
    case Kind::kNamespace:
      return dict_ == other.dict_;
    case Kind::kCallable:
      return fn_ == other.fn_;
    default:
      return equals(*this, other);
  }
}

namespace {

// Python's repr of a str: single quotes unless the text has ' and no ", escapes for
// backslashes, the quote and characters that str.isprintable() rejects.
std::string repr_string(const std::string& s) {
  const bool use_double = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char quote = use_double ? '"' : '\'';
  std::string out(1, quote);
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t begin = pos;
    const char32_t cp = utf8::decode_valid(s, pos);
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == static_cast<char32_t>(quote)) {
      out += '\\';
      out += quote;
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (!unicode::is_printable(cp)) {
      if (cp < 0x100) {
        out += fmt::format("\\x{:02x}", static_cast<uint32_t>(cp));
      } else if (cp < 0x10000) {
        out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
      } else {
        out += fmt::format("\\U{:08x}", static_cast<uint32_t>(cp));
      }
    } else {
      out.append(s, begin, pos - begin);
    }
  }
  out += quote;
  return out;
}

// Containers can hold themselves (a namespace assigned to its own attribute); printing them
// stops at this depth instead of recursing without end.
constexpr int kMaxPrintDepth = 200;
thread_local int g_print_depth = 0;

struct PrintDepthGuard {
  PrintDepthGuard() {
    if (++g_print_depth > kMaxPrintDepth) {
      --g_print_depth;
      fail("a value nests too deeply to print (does it contain itself?)");
    }
  }
  ~PrintDepthGuard() { --g_print_depth; }
};

std::string join_repr(const ValueList& items) {
  PrintDepthGuard guard;
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    out += items[i].repr();
  }
  return out;
}

std::string dict_repr(const Dict& d) {
  PrintDepthGuard guard;
  std::string out = "{";
  for (size_t i = 0; i < d.entries.size(); ++i) {
    if (i) out += ", ";
    out += d.entries[i].first.repr() + ": " + d.entries[i].second.repr();
  }
  return out + "}";
}

}  // namespace

std::string Value::str() const {
  switch (kind_) {
    case Kind::kUndefined: return "";
    case Kind::kNone: return "None";
    case Kind::kBool: return b_ ? "True" : "False";
    case Kind::kInt: return std::to_string(i_);
    case Kind::kFloat: return format_float(f_);
    case Kind::kString: return *s_;
    case Kind::kList: return "[" + join_repr(*list_) + "]";
    case Kind::kTuple: return "(" + join_repr(*list_) + (list_->size() == 1 ? ",)" : ")");
    case Kind::kDict: return dict_repr(*dict_);
    case Kind::kNamespace: return "<Namespace " + dict_repr(*dict_) + ">";
    case Kind::kCallable: return "<function " + fn_->name + ">";
  }
  return "";
}

std::string Value::repr() const { return kind_ == Kind::kString ? repr_string(*s_) : str(); }

const Value* Dict::find(const Value& key) const {
  auto it = index.find(hash_key(key));
  return it == index.end() ? nullptr : &entries[it->second].second;
}

void Dict::set(const Value& key, Value value) {
  std::string k = hash_key(key);
  auto it = index.find(k);
  if (it != index.end()) {
    entries[it->second].second = std::move(value);
    return;
  }
  index.emplace(std::move(k), entries.size());
  entries.emplace_back(key, std::move(value));
}

std::string hash_key(const Value& key) {
  switch (key.kind()) {
    case Value::Kind::kString:
      return "s" + key.as_string();
    case Value::Kind::kBool:
    case Value::Kind::kInt:
      return "n" + std::to_string(key.as_int());
    case Value::Kind::kFloat: {
      const double d = key.as_float();
      if (std::floor(d) == d && std::fabs(d) < 9.2e18) return "n" + std::to_string(static_cast<int64_t>(d));
      return "f" + format_float(d);
    }
    case Value::Kind::kNone:
      return "none";
    case Value::Kind::kTuple: {
      std::string k = "t(";
      for (const Value& v : key.items()) k += hash_key(v) + ",";
      return k + ")";
    }
    default:
      fail(fmt::format("unhashable type: '{}'", key.type_name()));
  }
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.as_string() == b.as_string();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      const ValueList& x = a.items();
      const ValueList& y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!equals(x[i], y[i])) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      const Dict& x = a.as_dict();
      const Dict& y = b.as_dict();
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* other = y.find(k);
        if (other == nullptr || !equals(v, *other)) return false;
      }
      return true;
    }
    default:
      return a.same_object(b);
  }
}

int compare(const Value& a, const Value& b, std::string_view op) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      const double x = a.as_float(), y = b.as_float();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    const int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    // UTF-8 byte order is code point order, which is Python's str order.
    const int c = a.as_string().compare(b.as_string());
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.kind() == b.kind() && a.is_sequence()) {
    const ValueList& x = a.items();
    const ValueList& y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return compare(x[i], y[i], op);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  fail(fmt::format("'{}' not supported between instances of '{}' and '{}'", op, a.type_name(), b.type_name()));
}

std::string format_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));
  std::string sign;
  if (sci.front() == '-') {
    sign = "-";
    sci.remove_prefix(1);
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e)) {
    if (c != '.') digits += c;
  }
  const int exponent = std::stoi(std::string(sci.substr(e + 1)));
  const int point = exponent + 1;  // digits before the decimal point
  std::string out = sign;
  if (exponent < -4 || exponent >= 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  } else if (point <= 0) {
    out += "0." + std::string(static_cast<size_t>(-point), '0') + digits;
  } else if (static_cast<size_t>(point) >= digits.size()) {
    out += digits + std::string(static_cast<size_t>(point) - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, static_cast<size_t>(point)) + "." + digits.substr(static_cast<size_t>(point));
  }
  return out;
}

namespace {

void json_string(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t begin = pos;
    const char32_t cp = utf8::decode_valid(s, pos);
    switch (cp) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (cp < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
    } else if (ensure_ascii && cp >= 0x80) {
      if (cp >= 0x10000) {
        const char32_t v = cp - 0x10000;
        out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      } else {
        out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
      }
    } else {
      out.append(s, begin, pos - begin);
    }
  }
  out += '"';
}

void json_value(const Value& v, const JsonDumpOptions& o, int depth, std::string& out) {
  if (depth > kMaxPrintDepth) fail("Circular reference detected (or nesting too deep for tojson)");
  const auto newline = [&](int level) {
    if (!o.indent) return;
    out += '\n';
    for (int i = 0; i < level; ++i) out += *o.indent;
  };
  switch (v.kind()) {
    case Value::Kind::kNone: out += "null"; return;
    case Value::Kind::kBool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::kInt: out += std::to_string(v.as_int()); return;
    case Value::Kind::kFloat: {
      const double d = v.as_float();
      if (std::isnan(d)) out += "NaN";
      else if (std::isinf(d)) out += d > 0 ? "Infinity" : "-Infinity";
      else out += format_float(d);
      return;
    }
    case Value::Kind::kString: json_string(v.as_string(), o.ensure_ascii, out); return;
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      const ValueList& items = v.items();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_separator;
        newline(depth + 1);
        json_value(items[i], o, depth + 1, out);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      std::vector<const std::pair<Value, Value>*> entries;
      for (const auto& e : v.as_dict().entries) entries.push_back(&e);
      if (entries.empty()) {
        out += "{}";
        return;
      }
      if (o.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [](const auto* a, const auto* b) { return compare(a->first, b->first, "<") < 0; });
      }
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += o.item_separator;
        newline(depth + 1);
        const Value& key = entries[i]->first;
        // Python's json converts non-string keys: numbers, booleans and None.
        if (key.is_string()) json_string(key.as_string(), o.ensure_ascii, out);
        else if (key.is_bool()) out += key.as_bool() ? "\"true\"" : "\"false\"";
        else if (key.is_none()) out += "\"null\"";
        else if (key.is_number()) json_string(key.str(), false, out);
        else fail(fmt::format("keys must be str, int, float, bool or None, not {}", key.type_name()));
        out += o.key_separator;
        json_value(entries[i]->second, o, depth + 1, out);
      }
      newline(depth);
      out += '}';
      return;
    }
    default:
      fail(fmt::format("Object of type {} is not JSON serializable", v.type_name()));
  }
}

template <typename J>
Value from_any_json(const J& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::none();
    case nlohmann::json::value_t::boolean: return Value(j.template get<bool>());
    case nlohmann::json::value_t::number_integer: return Value(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const uint64_t u = j.template get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<int64_t>(u));
      return Value(static_cast<double>(u));
    }
    case nlohmann::json::value_t::number_float: return Value(j.template get<double>());
    case nlohmann::json::value_t::string: {
      // Text built in memory (not parsed) may hold invalid UTF-8; the renderer needs it valid.
      const auto& s = j.template get_ref<const std::string&>();
      return Value(utf8::is_valid(s) ? s : utf8::sanitize(s));
    }
    case nlohmann::json::value_t::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_any_json(e));
      return Value::list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      Value d = Value::dict();
      for (const auto& [k, e] : j.items()) {
        d.as_dict_mut().set(Value(utf8::is_valid(k) ? k : utf8::sanitize(k)), from_any_json(e));
      }
      return d;
    }
    default:
      return Value::none();
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonDumpOptions& options) {
  std::string out;
  json_value(v, options, 0, out);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) { return from_any_json(j); }
Value from_json(const nlohmann::json& j) { return from_any_json(j); }

}  // namespace moelora::jinja
