// The syntax tree of a parsed Jinja template (see jinja_parser.h for the grammar covered).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace moelora::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

enum class ExprKind {
  kLiteral,    // value
  kName,       // name
  kList,       // items
  kTuple,      // items
  kDict,       // pairs
  kGetAttr,    // object.name
  kGetItem,    // object[index]
  kSlice,      // object[start:stop:step] (null parts are omitted)
  kCall,       // callee(args...)
  kFilter,     // object | name(args...)
  kTest,       // object is [not] name(args...)
  kUnary,      // op: "not", "-", "+"
  kBinary,     // op: + - * / // % ** ~ and or
  kCompare,    // first op1 x op2 y ... (chained)
  kCondition,  // a if cond else b
};

struct Arguments {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keyword;
};

struct Expr {
  ExprKind kind;
  int line = 0;
  Value value;                  // kLiteral
  std::string name;             // kName, kGetAttr, kFilter, kTest, kUnary/kBinary operator
  ExprPtr object;               // kGetAttr, kGetItem, kSlice, kCall (callee), kFilter, kTest, kUnary, kBinary left
  ExprPtr other;                // kGetItem index, kBinary right, kCondition "else" part (may be null)
  ExprPtr condition;            // kCondition
  std::vector<ExprPtr> items;   // kList, kTuple, kSlice [start, stop, step]
  std::vector<std::pair<ExprPtr, ExprPtr>> pairs;                // kDict
  std::vector<std::pair<std::string, ExprPtr>> comparisons;      // kCompare: (op, operand)
  Arguments args;               // kCall, kFilter, kTest
  bool negated = false;         // kTest: "is not"
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

enum class StmtKind {
  kText,        // text
  kOutput,      // {{ expr }}
  kIf,          // branches (condition, body), else_body
  kFor,         // target, iterable, filter, body, else_body
  kSet,         // target = value  |  {% set target %}body{% endset %} with filters
  kMacro,       // name(params) body
  kFilterBlock, // {% filter f %}body{% endfilter %}
  kWith,        // {% with a = x %}body{% endwith %}
  kBreak,
  kContinue,
};

// A name, a tuple of names, or (for set) a namespace attribute "ns.attr".
struct Target {
  std::vector<std::string> names;  // one name, or several for tuple unpacking
  bool is_tuple = false;
  std::string namespace_attr;      // set when the target is names[0].namespace_attr
};

struct FilterCall {
  std::string name;
  Arguments args;
  int line = 0;
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;                                 // kText; kMacro name
  ExprPtr expr;                                     // kOutput, kSet value, kFor iterable
  ExprPtr filter;                                   // kFor "if" filter
  Target target;                                    // kSet, kFor
  std::vector<std::pair<ExprPtr, Body>> branches;   // kIf
  Body body;                                        // kFor, kSet block, kMacro, kFilterBlock, kWith
  Body else_body;                                   // kIf, kFor
  std::vector<FilterCall> filters;                  // kSet block, kFilterBlock
  std::vector<std::pair<std::string, ExprPtr>> params;  // kMacro (default may be null), kWith assignments
};

}  // namespace moelora::jinja
