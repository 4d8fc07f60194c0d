// Jinja2's built-in filters (jinja2/filters.py) with their defaults, plus transformers' tojson.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "tokenizer/jinja_builtins.h"
#include "tokenizer/python_str.h"
#include "tokenizer/utf8.h"

namespace moelora::jinja {
namespace {

// Jinja's ignore_case: strings compare lowercased unless case_sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  return !case_sensitive && v.is_string() ? Value(pystr::lower(v.as_string())) : v;
}

// Item attribute lookup for attribute= arguments: "a.b" or "0" paths, as Jinja's make_attrgetter.
Value attribute_of(const Value& item, const Value& attribute) {
  if (attribute.is_int()) return get_item(item, attribute);
  Value v = item;
  for (const std::string& part : pystr::split(to_str_arg(attribute, "attribute"), std::string("."), -1)) {
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    v = digits ? get_item(v, Value(static_cast<int64_t>(std::stoll(part)))) : get_item(v, Value(part));
  }
  return v;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// Python's round(x, ndigits) on a float: correctly rounded, ties to even.
double python_round(double x, int64_t digits) {
  if (!std::isfinite(x)) return x;
  if (digits == 0) return std::nearbyint(x);
  if (digits > 300 || digits < -300) return digits > 0 ? x : 0.0 * x;
  if (digits < 0) {
    const double p = std::pow(10.0, static_cast<double>(-digits));
    return std::nearbyint(x / p) * p;
  }
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(digits), x);  // exact decimal rounding
  return std::strtod(buf, nullptr);
}

std::string do_indent(std::string s, const Value& width, bool first, bool blank) {
  const std::string indention = width.is_string() ? width.as_string() : std::string(static_cast<size_t>(std::max<int64_t>(0, to_int_arg(width, "width"))), ' ');
  s += "\n";  // Jinja's quirk, so that splitlines keeps a trailing empty line
  std::vector<std::string> lines = pystr::splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + indention : "") + lines[i];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : indention + lines[i]);
  }
  if (first) rv = indention + rv;
  return rv;
}

// select/reject/selectattr/rejectattr: keep items whose test (or truthiness) gives `keep`.
Value select_items(Interpreter& in, const Value& input, CallArgs& args, bool keep, bool by_attribute,
                   const std::string& filter) {
  if (by_attribute && args.positional.empty()) fail(fmt::format("{} needs an attribute name", filter));
  const Value attribute = by_attribute ? args.positional[0] : Value();
  const size_t test_at = by_attribute ? 1 : 0;
  std::string test;
  CallArgs test_args;
  if (args.positional.size() > test_at) {
    test = to_str_arg(args.positional[test_at], "test name");
    test_args.positional.assign(args.positional.begin() + static_cast<long>(test_at) + 1, args.positional.end());
  }
  ValueList out;
  for (const Value& item : iterate(input)) {
    const Value probe = by_attribute ? attribute_of(item, attribute) : item;
    const bool result = test.empty() ? probe.truthy() : apply_test(in, test, probe, test_args);
    if (result == keep) out.push_back(item);
  }
  return Value::list(std::move(out));
}

Value min_max(const Value& input, CallArgs& args, bool want_max, const char* name) {
  BoundArgs a(args, name, {"case_sensitive", "attribute"});
  const bool case_sensitive = a.get(0, Value(false)).truthy();
  const ValueList items = iterate(input);
  if (items.empty()) return Value::undefined(fmt::format("No aggregated item, sequence was empty."));
  const Value attribute = a.get(1);
  const auto key = [&](const Value& v) {
    return sort_key(attribute.is_undefined() || attribute.is_none() ? v : attribute_of(v, attribute), case_sensitive);
  };
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    const int c = compare(key(items[i]), key(items[best]), want_max ? ">" : "<");
    if (want_max ? c > 0 : c < 0) best = i;
  }
  return items[best];
}

}  // namespace

Value apply_filter(Interpreter& in, const std::string& name, const Value& input, CallArgs& args) {
  // Filters that accept an undefined input.
  if (name == "default" || name == "d") {
    BoundArgs a(args, name, {"default_value", "boolean"});
    const bool boolean = a.get(1, Value(false)).truthy();
    if (input.is_undefined() || (boolean && !input.truthy())) return a.get(0, Value(std::string()));
    return input;
  }
  if (name == "length" || name == "count") {
    if (input.is_undefined()) return Value(int64_t{0});
    if (input.is_string()) return Value(static_cast<int64_t>(pystr::length(input.as_string())));
    if (input.is_sequence()) return Value(static_cast<int64_t>(input.items().size()));
    if (input.is_mapping()) return Value(static_cast<int64_t>(input.as_dict().size()));
    fail(fmt::format("object of type '{}' has no len()", input.type_name()));
  }
  if (name == "tojson") {
    // transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
    BoundArgs a(args, name, {"ensure_ascii", "indent", "separators", "sort_keys"});
    JsonDumpOptions o;
    o.ensure_ascii = a.get(0, Value(false)).truthy();
    const Value indent = a.get(1, Value::none());
    if (!indent.is_none() && !indent.is_undefined()) {
      o.indent = indent.is_string() ? indent.as_string() : std::string(static_cast<size_t>(std::max<int64_t>(0, to_int_arg(indent, "indent"))), ' ');
      o.item_separator = ",";
    }
    const Value separators = a.get(2, Value::none());
    if (separators.is_sequence()) {
      if (separators.items().size() != 2) fail("separators must be an (item_separator, key_separator) pair");
      o.item_separator = to_str_arg(separators.items()[0], "item separator");
      o.key_separator = to_str_arg(separators.items()[1], "key separator");
    }
    o.sort_keys = a.get(3, Value(false)).truthy();
    return Value(to_json(input, o));
  }
  if (name == "string") return Value(input.str());
  if (name == "list") return Value::list(iterate(input));
  if (name == "items") {
    if (input.is_undefined()) return Value::list();
    if (!input.is_mapping()) fail(fmt::format("the items filter needs a mapping, not '{}'", input.type_name()));
    ValueList out;
    for (const auto& [k, v] : input.as_dict().entries) out.push_back(Value::tuple({k, v}));
    return Value::list(std::move(out));
  }
  if (name == "first" || name == "last") {
    ValueList items = iterate(input);
    if (items.empty()) return Value::undefined(fmt::format("No {} item, sequence was empty.", name));
    return name == "first" ? items.front() : items.back();
  }
  if (name == "select" || name == "reject") return select_items(in, input, args, name == "select", false, name);
  if (name == "selectattr" || name == "rejectattr") return select_items(in, input, args, name == "selectattr", true, name);
  if (name == "map") {
    ValueList out;
    const auto attr = std::find_if(args.keyword.begin(), args.keyword.end(), [](const auto& kv) { return kv.first == "attribute"; });
    if (attr != args.keyword.end()) {
      const auto def = std::find_if(args.keyword.begin(), args.keyword.end(), [](const auto& kv) { return kv.first == "default"; });
      for (const Value& item : iterate(input)) {
        Value v = attribute_of(item, attr->second);
        if (v.is_undefined() && def != args.keyword.end()) v = def->second;
        out.push_back(v);
      }
      return Value::list(std::move(out));
    }
    if (args.positional.empty()) fail("map needs a filter name or attribute=");
    const std::string filter = to_str_arg(args.positional[0], "filter name");
    CallArgs rest;
    rest.positional.assign(args.positional.begin() + 1, args.positional.end());
    rest.keyword = args.keyword;
    for (const Value& item : iterate(input)) {
      CallArgs copy = rest;
      out.push_back(apply_filter(in, filter, item, copy));
    }
    return Value::list(std::move(out));
  }

  require_defined(input);
  if (name == "safe") return input;
  if (name == "escape" || name == "e" || name == "forceescape") return Value(html_escape(input.str()));
  if (name == "upper") return Value(pystr::upper(input.str()));
  if (name == "lower") return Value(pystr::lower(input.str()));
  if (name == "capitalize") return Value(pystr::capitalize(input.str()));
  if (name == "title") {
    // Jinja's title: upper-case the first letter of each piece after - ( { [ < or white space.
    const std::string s = input.str();
    std::string out;
    bool at_start = true;
    size_t pos = 0;
    while (pos < s.size()) {
      const size_t begin = pos;
      const char32_t c = utf8::decode_valid(s, pos);
      const std::string ch = s.substr(begin, pos - begin);
      const bool delimiter = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || pystr::is_space(ch);
      if (delimiter) {
        out += ch;
        at_start = true;
      } else {
        out += at_start ? pystr::upper(ch) : pystr::lower(ch);
        at_start = false;
      }
    }
    return Value(out);
  }
  if (name == "trim") {
    BoundArgs a(args, name, {"chars"});
    const Value chars = a.get(0, Value::none());
    return Value(pystr::strip(input.str(), chars.is_none() ? std::nullopt : std::optional<std::string>(to_str_arg(chars, "chars")),
                              pystr::StripSide::kBoth));
  }
  if (name == "replace") {
    BoundArgs a(args, name, {"old", "new", "count"});
    const Value count = a.get(2, Value::none());
    return Value(pystr::replace(input.str(), to_str_arg(a.get(0), "old"), to_str_arg(a.get(1), "new"),
                                count.is_none() ? -1 : to_int_arg(count, "count")));
  }
  if (name == "indent") {
    BoundArgs a(args, name, {"width", "first", "blank"});
    return Value(do_indent(input.str(), a.get(0, Value(int64_t{4})), a.get(1, Value(false)).truthy(), a.get(2, Value(false)).truthy()));
  }
  if (name == "center") {
    BoundArgs a(args, name, {"width"});
    return Value(pystr::center(input.str(), to_int_arg(a.get(0, Value(int64_t{80})), "width"), " "));
  }
  if (name == "wordcount") {
    int64_t words = 0;
    bool in_word = false;
    const std::u32string cps = utf8::to_code_points(input.str());
    for (char32_t c : cps) {
      const bool word_char = !pystr::is_space(utf8::from_code_points(std::u32string(1, c))) &&
                             std::u32string_view(U"!\"#$%&'()*+,-./:;<=>?@[\\]^`{|}~").find(c) == std::u32string_view::npos;
      if (word_char && !in_word) ++words;
      in_word = word_char;
    }
    return Value(words);
  }
  if (name == "join") {
    BoundArgs a(args, name, {"d", "attribute"});
    const std::string sep = a.has(0) ? to_str_arg(a.get(0), "separator") : "";
    const Value attribute = a.get(1, Value::none());
    std::string out;
    bool first = true;
    for (const Value& item : iterate(input)) {
      if (!first) out += sep;
      out += (attribute.is_none() ? item : attribute_of(item, attribute)).str();
      first = false;
    }
    return Value(out);
  }
  if (name == "reverse") {
    if (input.is_string()) {
      std::u32string cps = utf8::to_code_points(input.as_string());
      std::reverse(cps.begin(), cps.end());
      return Value(utf8::from_code_points(cps));
    }
    ValueList items = iterate(input);
    std::reverse(items.begin(), items.end());
    return Value::list(std::move(items));
  }
  if (name == "sort") {
    BoundArgs a(args, name, {"reverse", "case_sensitive", "attribute"});
    const bool reverse = a.get(0, Value(false)).truthy();
    const bool case_sensitive = a.get(1, Value(false)).truthy();
    const Value attribute = a.get(2, Value::none());
    ValueList items = iterate(input);
    const auto key = [&](const Value& v) { return sort_key(attribute.is_none() ? v : attribute_of(v, attribute), case_sensitive); };
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      return reverse ? compare(key(y), key(x), "<") < 0 : compare(key(x), key(y), "<") < 0;
    });
    return Value::list(std::move(items));
  }
  if (name == "dictsort") {
    BoundArgs a(args, name, {"case_sensitive", "by", "reverse"});
    if (!input.is_mapping()) fail("dictsort needs a mapping");
    const bool case_sensitive = a.get(0, Value(false)).truthy();
    const bool by_value = a.has(1) && to_str_arg(a.get(1), "by") == "value";
    const bool reverse = a.get(2, Value(false)).truthy();
    ValueList items;
    for (const auto& [k, v] : input.as_dict().entries) items.push_back(Value::tuple({k, v}));
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      const Value kx = sort_key(x.items()[by_value ? 1 : 0], case_sensitive);
      const Value ky = sort_key(y.items()[by_value ? 1 : 0], case_sensitive);
      return reverse ? compare(ky, kx, "<") < 0 : compare(kx, ky, "<") < 0;
    });
    return Value::list(std::move(items));
  }
  if (name == "unique") {
    BoundArgs a(args, name, {"case_sensitive", "attribute"});
    const bool case_sensitive = a.get(0, Value(false)).truthy();
    const Value attribute = a.get(1, Value::none());
    ValueList out, seen;
    for (const Value& item : iterate(input)) {
      const Value k = sort_key(attribute.is_none() ? item : attribute_of(item, attribute), case_sensitive);
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, k); })) {
        seen.push_back(k);
        out.push_back(item);
      }
    }
    return Value::list(std::move(out));
  }
  if (name == "max" || name == "min") return min_max(input, args, name == "max", name.c_str());
  if (name == "sum") {
    BoundArgs a(args, name, {"attribute", "start"});
    const Value attribute = a.get(0, Value::none());
    Value total = a.get(1, Value(int64_t{0}));
    for (const Value& item : iterate(input)) total = binary_op("+", total, attribute.is_none() ? item : attribute_of(item, attribute));
    return total;
  }
  if (name == "abs") {
    if (!input.is_number()) fail(fmt::format("bad operand type for abs(): '{}'", input.type_name()));
    if (input.is_float()) return Value(std::fabs(input.as_float()));
    if (input.as_int() == INT64_MIN) fail("integer overflow");
    return Value(input.as_int() < 0 ? -input.as_int() : input.as_int());
  }
  if (name == "int") {
    BoundArgs a(args, name, {"default", "base"});
    const Value fallback = a.get(0, Value(int64_t{0}));
    if (input.is_number()) return input.is_float() ? Value(static_cast<int64_t>(std::trunc(input.as_float()))) : Value(input.as_int());
    if (input.is_string()) {
      const std::string s = pystr::strip(input.as_string(), std::nullopt, pystr::StripSide::kBoth);
      const int base = static_cast<int>(to_int_arg(a.get(1, Value(int64_t{10})), "base"));
      try {
        size_t used = 0;
        const long long v = std::stoll(s, &used, base);
        if (used == s.size()) return Value(static_cast<int64_t>(v));
        const double d = std::stod(s, &used);
        if (used == s.size() && std::isfinite(d)) return Value(static_cast<int64_t>(std::trunc(d)));
      } catch (...) {
      }
    }
    return fallback;
  }
  if (name == "float") {
    BoundArgs a(args, name, {"default"});
    if (input.is_number()) return Value(input.as_float());
    if (input.is_string()) {
      try {
        const std::string s = pystr::strip(input.as_string(), std::nullopt, pystr::StripSide::kBoth);
        size_t used = 0;
        const double d = std::stod(s, &used);
        if (used == s.size()) return Value(d);
      } catch (...) {
      }
    }
    return a.get(0, Value(0.0));
  }
  if (name == "round") {
    BoundArgs a(args, name, {"precision", "method"});
    const int64_t precision = to_int_arg(a.get(0, Value(int64_t{0})), "precision");
    const std::string method = a.has(1) ? to_str_arg(a.get(1), "method") : "common";
    if (!input.is_number()) fail(fmt::format("type {} doesn't define __round__ method", input.type_name()));
    if (method == "common") {
      if (!input.is_float()) return Value(input.as_int());
      return Value(python_round(input.as_float(), precision));
    }
    if (method != "ceil" && method != "floor") fail("method must be common, ceil or floor");
    const double p = std::pow(10.0, static_cast<double>(precision));
    const double x = input.as_float() * p;
    return Value((method == "ceil" ? std::ceil(x) : std::floor(x)) / p);
  }
  if (name == "attr") {
    BoundArgs a(args, name, {"name"});
    return get_attribute(input, to_str_arg(a.get(0), "attribute name"));
  }
  fail(fmt::format("unsupported filter '{}' (not in moelora's Jinja subset)", name));
}

}  // namespace moelora::jinja
