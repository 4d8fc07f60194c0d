// Parses Jinja templates into a syntax tree, with the grammar and operator precedence of Jinja2's
// parser (what chat templates are tested against).
//
// Covered: {{ }} expressions; {% if/elif/else %}, {% for x[, y] in ... [if cond] %} with
// {% else %}, loop.*, {% break %}/{% continue %}; {% set %} (names, tuples, namespace attributes,
// block form with filters); {% macro %} and calls; {% filter %}; {% with %}; {% raw %};
// {% generation %} (transformers' assistant-mask tag, rendered as its body); literals (str, int,
// float, bool, none, list, tuple, dict), attribute and item access, slices, calls with keyword
// arguments, filters, tests (is / is not), `not`, `and`, `or`, `in`, `not in`, comparisons
// (chained), + - * / // % ** ~, and `a if b else c`.
// Not covered, each a clear error naming the construct and its line: {% include %}, {% import %},
// {% extends %}, {% block %}, {% call %}, {% autoescape %}, recursive loops, *args/**kwargs in
// calls, and tags Jinja2 itself does not know without extensions ({% do %}).
#pragma once

#include <string_view>

#include "tokenizer/jinja_ast.h"

namespace moelora::jinja {

// Throws jinja::Error with the line of the problem.
Body parse(std::string_view source);

}  // namespace moelora::jinja
