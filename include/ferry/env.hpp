// Environment parameters: every FERRY_* variable is declared once, in one table, with its default and meaning.
// `ferry env` prints the table with the value in force.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace ferry {

struct EnvParam {
  char const* name;           // e.g. "FERRY_TIMEOUT_S"
  char const* default_value;  // as text; "" means unset / automatic
  char const* meaning;        // one line for `ferry env` and the README
};

// The table of every parameter Ferry reads.
std::span<EnvParam const> env_params();

// Value of a declared parameter: the environment's if set and non-empty, else the table's default.
// Throws ConfigError for a name missing from the table (a programming error caught by tests) and for a value
// that does not parse (naming the variable, the value and what is allowed).
std::string env_string(char const* name);
int64_t env_int(char const* name);
double env_double(char const* name);
// Unset (or empty) with an empty default gives nullopt.
std::optional<int64_t> env_optional_int(char const* name);

}  // namespace ferry
