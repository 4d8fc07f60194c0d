// Jinja2's built-in filters, tests and globals, and the Python operations they rest on
// (attribute and item lookup, slicing, arithmetic, str and dict methods), with Python semantics.
// Internal to the renderer (jinja_interpreter.cpp).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/jinja_interpreter.h"
#include "tokenizer/jinja_value.h"

namespace moelora::jinja {

// obj.name: for dicts and strs a method of that name wins (as in Jinja2), else the item; an
// undefined value carries the message used if it is then used.
Value get_attribute(const Value& obj, const std::string& name);
// obj[key]: the item wins, then a method of that name.
Value get_item(const Value& obj, const Value& key);
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// + - * / // % ** ~ on two values.
Value binary_op(const std::string& op, const Value& a, const Value& b);
bool contains(const Value& container, const Value& item);
// The items a for loop visits: list items, dict keys, characters of a str; nothing for undefined.
ValueList iterate(const Value& v);

Value apply_filter(Interpreter& in, const std::string& name, const Value& input, CallArgs& args);
bool apply_test(Interpreter& in, const std::string& name, const Value& input, CallArgs& args);

// Adds namespace, range, dict, raise_exception and strftime_now.
void add_globals(Dict& globals);

// Fails with the undefined value's message when `v` is undefined (for operations on it).
void require_defined(const Value& v);

// Python-style binding of call arguments to parameter names, for built-ins:
// BoundArgs a(args, "indent", {"width", "first", "blank"}); a.get(0, Value(4)).
class BoundArgs {
 public:
  BoundArgs(CallArgs& args, std::string function, std::vector<std::string> params);
  // The argument for parameter i (positional i or keyword params[i]), or `fallback`.
  Value get(size_t i, Value fallback = Value()) const;
  bool has(size_t i) const;
  // Extra positional arguments beyond the named parameters (for map('filter', args...)).
  std::vector<Value> rest() const;

 private:
  CallArgs& args_;
  std::string function_;
  std::vector<std::string> params_;
};

// Coercions with Python's error messages.
int64_t to_int_arg(const Value& v, std::string_view what);
std::string to_str_arg(const Value& v, std::string_view what);

}  // namespace moelora::jinja
