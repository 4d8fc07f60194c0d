// Values of the Jinja renderer. They follow Python's semantics, because chat templates are
// written against Jinja2 (Python): str() of a float is Python's repr, dicts keep insertion order,
// `1 == 1.0 == true`, strings index by code point, printing None gives "None" and an undefined
// variable prints as nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace moelora::jinja {

// A rendering error: thrown inside the renderer, turned into a Status at its API boundary
// (chat_template.h). `line` is the template line, 0 when unknown.
struct Error {
  std::string message;
  int line = 0;
};
[[noreturn]] void fail(std::string message);

class Value;
class Interpreter;
using ValueList = std::vector<Value>;

// Arguments of a call, a filter or a test (positional, then keyword).
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

struct Callable {
  std::string name;  // for messages: "raise_exception", "macro 'render'", "str.split"
  std::function<Value(CallArgs&, Interpreter&)> fn;
};

struct Dict;

class Value {
 public:
  enum class Kind : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kTuple, kDict, kNamespace, kCallable };

  Value() = default;  // undefined
  static Value undefined(std::string hint = {});
  static Value none();
  Value(bool b);                       // NOLINT
  Value(int64_t i);                    // NOLINT
  Value(int i) : Value(int64_t{i}) {}  // NOLINT
  Value(double d);                     // NOLINT
  Value(std::string s);                // NOLINT
  Value(const char* s) : Value(std::string(s)) {}  // NOLINT
  static Value list(ValueList items = {});
  static Value tuple(ValueList items);
  static Value dict();
  static Value ns();  // a namespace() object: a dict whose attributes can be assigned
  static Value callable(std::string name, std::function<Value(CallArgs&, Interpreter&)> fn);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_tuple() const { return kind_ == Kind::kTuple; }
  bool is_sequence() const { return kind_ == Kind::kList || kind_ == Kind::kTuple; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_mapping() const { return kind_ == Kind::kDict || kind_ == Kind::kNamespace; }
  bool is_callable() const { return kind_ == Kind::kCallable; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return kind_ == Kind::kBool ? (b_ ? 1 : 0) : i_; }
  double as_float() const { return kind_ == Kind::kFloat ? f_ : static_cast<double>(as_int()); }
  const std::string& as_string() const { return *s_; }
  // The undefined value's hint: what was looked up ("'x' is undefined").
  const std::string& undefined_hint() const { return *s_; }
  const ValueList& items() const { return *list_; }
  ValueList& items_mut() { return *list_; }
  const Dict& as_dict() const { return *dict_; }
  Dict& as_dict_mut() { return *dict_; }
  const Callable& as_callable() const { return *fn_; }

  // Python truthiness.
  bool truthy() const;
  // Python's type name for messages ("str", "dict", "NoneType").
  std::string type_name() const;

  // Python str() (what {{ }} prints) and repr() (how str() shows items of a container).
  std::string str() const;
  std::string repr() const;

  // Shares the object: copies of a list or dict value see the same items, as in Python.
  bool same_object(const Value& other) const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<ValueList> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Callable> fn_;
};

// A dict that keeps insertion order (like Python's). Keys are strings, numbers, None or tuples
// of those.
struct Dict {
  std::vector<std::pair<Value, Value>> entries;
  std::unordered_map<std::string, size_t> index;  // hash_key(key) -> position in entries

  const Value* find(const Value& key) const;
  void set(const Value& key, Value value);
  size_t size() const { return entries.size(); }
};

// Equality, ordering and hashing with Python's rules (1 == 1.0 == True; [1] != (1,)).
bool equals(const Value& a, const Value& b);
// -1, 0, 1; fails like Python for types that do not order ('<' between str and int).
int compare(const Value& a, const Value& b, std::string_view op);
std::string hash_key(const Value& key);

// Python's float repr: shortest round-trip digits, exponent outside [1e-4, 1e16).
std::string format_float(double d);

// json.dumps with transformers' defaults for the tojson filter (ensure_ascii=False, key order
// kept). indent < 0: single line with `item_sep` / `key_sep`.
struct JsonDumpOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // the string for one level of indentation
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonDumpOptions& options);

// Conversions from parsed JSON (requests, configs). ordered_json keeps the client's key order,
// which tojson then reproduces.
Value from_json(const nlohmann::ordered_json& j);
Value from_json(const nlohmann::json& j);

}  // namespace moelora::jinja
