// Environment parameters: every FERRY_* variable is declared once, in one table, with its default, its meaning and
// the rule its value must follow. The accessors refuse a value that breaks the rule, and `ferry env` flags it with
// the same message.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace ferry {

// The largest bound any timeout takes (FERRY_TIMEOUT_S, FERRY_BOOTSTRAP_TIMEOUT_S, SocketBootstrapOptions::timeout),
// in seconds: about 31 years, far below the 9.2e9 s that signed 64-bit nanoseconds hold.
inline constexpr double kMaxTimeoutSeconds = 1e9;

// What a value must be (an unset or empty variable always passes: it means the default).
enum class EnvKind : uint8_t {
  text,     // anything (a path, an address)
  integer,  // a whole number in [min, max]
  number,   // a decimal number above min
  choice,   // one of the words listed in `allowed` ("error, warn, info, debug")
};

struct EnvParam {
  char const* name;           // e.g. "FERRY_TIMEOUT_S"
  char const* default_value;  // as text; "" means unset / automatic
  char const* meaning;        // one line for `ferry env` and the README
  EnvKind kind = EnvKind::text;
  char const* allowed = "";  // what a value must be, in the words of the refusal ("a positive number of seconds")
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool rendezvous = false;  // read by the socket bootstrap: a refusal is a BootstrapError (else ConfigError)
};

// The table of every parameter Ferry reads, and one entry of it (ConfigError for a name missing from the table).
std::span<EnvParam const> env_params();
EnvParam const& env_param(char const* name);

// "" when `value` follows the rule of `param` (an empty value: unset, always does); else the refusal, naming the
// variable, the value and what to do ("FERRY_TIMEOUT_S=-1 must be a positive number of seconds; ...").
std::string env_problem(EnvParam const& param, std::string const& value);

// Value of a declared parameter: the environment's if set and non-empty, else the table's default.
// Throws ConfigError (BootstrapError for a rendezvous variable) with env_problem's message for a value that breaks
// its rule, and ConfigError for a name missing from the table (a programming error caught by tests).
std::string env_string(char const* name);
int64_t env_int(char const* name);
double env_double(char const* name);
// Unset (or empty) with an empty default gives nullopt.
std::optional<int64_t> env_optional_int(char const* name);

// Variables Ferry no longer reads, each with the reason it went. One that is set is refused, never ignored: a pin that
// silently did nothing would mislead whoever set it.
struct RemovedEnvParam {
  char const* name;  // e.g. "FERRY_DISPATCH_WARPS"
  char const* why;   // why it is not read, in the words of the refusal
};
std::span<RemovedEnvParam const> removed_env_params();
// "" for an empty `value` (unset); else the refusal, naming the variable, the value, why and what to do
// ("FERRY_DISPATCH_WARPS=8 is no longer read: ...; unset it").
std::string removed_env_problem(RemovedEnvParam const& param, std::string const& value);

// Checks every declared variable set in this environment, and that no removed one is set; throws what env_string
// would for the first refused declared one, ConfigError with removed_env_problem's message for a removed one.
// Called where a job starts (communicator creation, every `ferry` command) so that a bad value is refused at once,
// not when (or if) the code that reads it runs.
void check_env();

// One warning per FERRY_* variable set in this environment that Ferry does not read (neither declared above, nor
// removed, nor one of the build and test scripts' own, nor a FERRY_TEST_* of the tests): a misspelt name
// (FERRY_TIMOUT_S=5) would otherwise change nothing, in silence. Each names the variable and, where one is close,
// the declared name it may have meant ("... did you mean FERRY_TIMEOUT_S?"). check_env() logs them (at warn, once per
// process, in the first process of each host: LOCAL_RANK unset or 0); `ferry env` prints them after its table.
std::vector<std::string> unknown_env_warnings();

}  // namespace ferry
