// A small strict JSON reader (RFC 8259) and string quoting, standard library only; used by the tuning tables, the
// trace files and the result files (util/result_file.hpp). Unlike most readers it refuses an object that names a key
// twice: a duplicate key silently shadowing an earlier tuning row is the bug this guards against. Every value
// remembers where it started, so the table loader can point at the line and column it rejects.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ferry::util::json {

struct Position {
  int line = 1;    // 1-based
  int column = 1;  // 1-based, in bytes
};

struct Value;
using Member = std::pair<std::string, Value>;

struct Value {
  enum class Kind { null, boolean, number, string, array, object };
  Kind kind = Kind::null;
  Position at;
  bool boolean = false;
  double number = 0;
  std::string text;  // string: the decoded text; number: the literal as written (integers are checked on it)
  std::vector<Value> items;
  std::vector<Member> members;  // in file order, keys unique

  bool is(Kind k) const { return kind == k; }
  // The member named key, or nullptr.
  Value const* find(std::string_view key) const;
  // True for a number written without fraction or exponent that fits in int64.
  bool is_integer() const;
  int64_t integer() const;  // only when is_integer()
};

char const* kind_name(Value::Kind kind);

// Parses one JSON document (trailing whitespace only after it). `source` names the text in errors ("h200.json").
// Throws ConfigError "SOURCE:LINE:COLUMN: what is wrong" for a syntax error, a control character in a string, a
// nesting deeper than 64, or a key repeated in one object (naming where it first appeared).
Value parse(std::string_view text, std::string const& source);

// JSON string literal of text (quotes and escapes added).
std::string quote(std::string_view text);

}  // namespace ferry::util::json
