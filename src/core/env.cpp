#include "ferry/env.hpp"

#include <array>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "ferry/error.hpp"

namespace ferry {
namespace {

// A launch-geometry pin (choose.cpp reads it; 0 or unset: the tuning tables choose).
constexpr EnvParam geometry_pin(char const* name, char const* meaning) {
  return {.name = name,
          .default_value = "",
          .meaning = meaning,
          .kind = EnvKind::integer,
          .allowed = "a count (0: the tuning tables choose)",
          .min = 0,
          .max = 1 << 16};
}

constexpr std::array kParams = {
    // NOTE: the waits add the bound to a clock in signed 64-bit nanoseconds, which holds about 9.2e9 s: a larger
    // bound wrapped around and every wait timed out at once. kMaxTimeoutSeconds (about 31 years) stays far below.
    EnvParam{.name = "FERRY_TIMEOUT_S",
             .default_value = "30",
             .meaning = "bound of every device and host wait, in seconds (a hang becomes TimeoutError)",
             .kind = EnvKind::number,
             .allowed = "a positive number of seconds, at most 1e9 (every wait is bounded)",
             .min = 0,
             .max = kMaxTimeoutSeconds},
    EnvParam{.name = "FERRY_BOOTSTRAP_TIMEOUT_S",
             .default_value = "60",
             .meaning = "deadline for the rendezvous of all ranks (connect retries, first exchange)",
             .kind = EnvKind::integer,
             .allowed = "a positive number of seconds, a whole number (every bootstrap wait is bounded)",
             .min = 1,
             .max = kMaxTimeoutSeconds,
             .rendezvous = true},
    EnvParam{.name = "FERRY_LOG",
             .default_value = "warn",
             .meaning = "log level: error, warn, info, debug",
             .kind = EnvKind::choice,
             .allowed = "error, warn, info, debug"},
    geometry_pin("FERRY_DISPATCH_BLOCKS",
                 "pin the number of CTAs of the dispatch kernels (experiments; overrides tuning)"),
    geometry_pin("FERRY_COMBINE_BLOCKS", "pin the number of CTAs of the combine kernels"),
    EnvParam{.name = "FERRY_NORMAL_LANDING",
             .default_value = "auto",
             .meaning = "normal-mode dispatch protocol: auto (landing zone while world * max_tokens_per_rank <= 1024), "
                        "on, off; same on every rank",
             .kind = EnvKind::choice,
             .allowed = "auto, on, off, 1, 0"},
    EnvParam{.name = "FERRY_LL_OWN_ROWS",
             .default_value = "landing",
             .meaning = "low-latency bf16 dispatch: a rank's own rows staged in its landing zone (landing), or copied "
                        "from x into their slots by the send half while the peers' rows are on the wire (direct; "
                        "slower on 2 x H200 at 1-512 tokens; docs/design-notes.md, \"Own rows direct\")",
             .kind = EnvKind::choice,
             .allowed = "landing, direct"},
    EnvParam{.name = "FERRY_TUNING_DIR",
             .default_value = "",
             .meaning = "folder of tuning tables (*.json) used instead of the compiled-in ones (docs/tuning.md)"},
    EnvParam{.name = "FERRY_TRACE_EVENTS",
             .default_value = "",
             .meaning = "builds with FERRY_TRACE=ON: trace every EpBuffer from construction, this many events per warp",
             .kind = EnvKind::integer,
             .allowed = "a count of events per warp (0: off)",
             .min = 0,
             .max = 1 << 20},
    EnvParam{.name = "FERRY_NETWORK",
             .default_value = "auto",
             .meaning = "cuda backend, peers NVLink does not reach: auto (GIN when the world is larger than the NVLink "
                        "team), emulated (never GIN), gin (set GIN up at construction, even at world 1)",
             .kind = EnvKind::choice,
             .allowed = "auto, emulated, gin"},
    EnvParam{.name = "FERRY_EMULATED_SEED",
             .default_value = "1",
             .meaning = "emulated nodes on one host (cuda, FERRY_TOPOLOGY without GIN): the seed of the emulated "
                        "network's delays and delivery orders (rank r draws from seed ^ r), to replay a run",
             .kind = EnvKind::integer,
             .allowed = "a seed, 0 or more",
             .min = 0,
             .max = 9007199254740992.0},
    EnvParam{
        .name = "FERRY_EMULATED_DELAY_NS",
        .default_value = "20000",
        .meaning = "emulated nodes on one host: the most a batch of the emulated network's deliveries waits, in ns",
        .kind = EnvKind::integer,
        .allowed = "nanoseconds, 0 to 1000000000",
        .min = 0,
        .max = 1e9},
    EnvParam{.name = "FERRY_EMULATED_REORDER",
             .default_value = "1",
             .meaning = "emulated nodes on one host: deliver each batch of the emulated network's puts in a seeded "
                        "order (1) or in issue order (0)",
             .kind = EnvKind::choice,
             .allowed = "1, 0"},
    EnvParam{.name = "FERRY_NCCL_VERSION_CHECK",
             .default_value = "1",
             .meaning = "refuse to start when the loaded NCCL differs from the headers (0 disables; unsafe)",
             .kind = EnvKind::integer,
             .allowed = "1 (check) or 0 (do not; unsafe)",
             .min = 0,
             .max = 1},
    EnvParam{.name = "MASTER_ADDR",
             .default_value = "127.0.0.1",
             .meaning = "torchrun rendezvous host (rank 0 listens there)",
             .rendezvous = true},
    EnvParam{.name = "MASTER_PORT",
             .default_value = "29500",
             .meaning = "torchrun rendezvous port",
             .kind = EnvKind::integer,
             .allowed = "the TCP port rank 0 listens on",
             .rendezvous = true},
    EnvParam{.name = "RANK",
             .default_value = "",
             .meaning = "global rank of this process (torchrun)",
             .kind = EnvKind::integer,
             .allowed = "this process's rank in [0, WORLD_SIZE)",
             .rendezvous = true},
    EnvParam{.name = "WORLD_SIZE",
             .default_value = "",
             .meaning = "number of ranks (torchrun)",
             .kind = EnvKind::integer,
             .allowed = "the number of ranks",
             .rendezvous = true},
    EnvParam{.name = "LOCAL_RANK",
             .default_value = "",
             .meaning = "rank within this host; selects the GPU (torchrun)",
             .kind = EnvKind::integer,
             .allowed = "this process's rank on its host",
             .rendezvous = true},
    EnvParam{.name = "TORCHELASTIC_RUN_ID",
             .default_value = "",
             .meaning = "the job's run id (torchrun sets it): rank 0 refuses a rank of another run id on its port",
             .rendezvous = true},
    EnvParam{.name = "FERRY_TOPOLOGY",
             .default_value = "",
             .meaning = "the world as NxM (N nodes of M ranks); set on one host to emulate nodes (default: from "
                        "LOCAL_WORLD_SIZE)",
             .kind = EnvKind::text,
             .allowed = "NxM with N x M = the world size, e.g. 2x4"},
    EnvParam{.name = "LOCAL_WORLD_SIZE",
             .default_value = "",
             .meaning = "ranks on this host (torchrun; default WORLD_SIZE: one host)",
             .kind = EnvKind::integer,
             .allowed = "the number of ranks on this host",
             .rendezvous = true},
};

constexpr char kNoWarps[] = "warps per CTA are not a setting (every kernel is compiled for 16 warps)";
constexpr std::array kRemoved = {
    RemovedEnvParam{.name = "FERRY_DISPATCH_WARPS", .why = kNoWarps},
    RemovedEnvParam{.name = "FERRY_COMBINE_WARPS", .why = kNoWarps},
};

std::optional<int64_t> parse_whole(std::string const& text) {
  errno = 0;
  char* end = nullptr;
  long long const value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || end == text.c_str() || *end != '\0') return std::nullopt;
  return value;
}

std::optional<double> parse_number(std::string const& text) {
  errno = 0;
  char* end = nullptr;
  double const value = std::strtod(text.c_str(), &end);
  if (text.empty() || errno != 0 || end == text.c_str() || *end != '\0' || !std::isfinite(value)) return std::nullopt;
  return value;
}

bool is_choice(std::string_view allowed, std::string_view value) {
  for (std::size_t begin = 0; begin <= allowed.size();) {
    std::size_t const end = std::min(allowed.find(", ", begin), allowed.size());
    if (allowed.substr(begin, end - begin) == value) return true;
    begin = end + 2;
  }
  return false;
}

// The accessors' refusal of `param`'s value in the environment, if it breaks the rule.
void refuse_if_bad(EnvParam const& param, std::string const& value) {
  std::string const problem = env_problem(param, value);
  if (problem.empty()) return;
  if (param.rendezvous) FERRY_THROW(BootstrapError, "env", problem);
  FERRY_THROW(ConfigError, "env", problem);
}

}  // namespace

std::span<EnvParam const> env_params() {
  return kParams;
}

EnvParam const& env_param(char const* name) {
  for (auto const& param : kParams)
    if (std::strcmp(param.name, name) == 0) return param;
  FERRY_THROW(ConfigError, "env", "parameter ", name, " is not declared in the env table (src/core/env.cpp)");
}

std::string env_problem(EnvParam const& param, std::string const& value) {
  if (value.empty()) return "";
  std::string const what = detail::concat(param.name, "=", value);
  std::string const otherwise =
      *param.default_value ? detail::concat("; change it, or unset it for the default (", param.default_value, ")")
                           : std::string("; change it, or unset it");
  switch (param.kind) {
    case EnvKind::text:
      return "";
    case EnvKind::integer: {
      std::optional<int64_t> const got = parse_whole(value);
      if (!got) return detail::concat(what, " is not a whole number; it must be ", param.allowed, otherwise);
      if (static_cast<double>(*got) < param.min || static_cast<double>(*got) > param.max)
        return std::isfinite(param.max)
                   ? detail::concat(what, " is outside [", static_cast<int64_t>(param.min), ", ",
                                    static_cast<int64_t>(param.max), "]: it must be ", param.allowed, otherwise)
                   : detail::concat(what, " must be ", param.allowed, otherwise);
      return "";
    }
    case EnvKind::number: {
      std::optional<double> const got = parse_number(value);
      if (!got) return detail::concat(what, " is not a number; it must be ", param.allowed, otherwise);
      if (*got <= param.min || *got > param.max) return detail::concat(what, " must be ", param.allowed, otherwise);
      return "";
    }
    case EnvKind::choice:
      return is_choice(param.allowed, value) ? "" : detail::concat(what, " is not one of ", param.allowed, otherwise);
  }
  return "";
}

std::string env_string(char const* name) {
  EnvParam const& param = env_param(name);
  char const* value = std::getenv(name);
  if (!value || !*value) return param.default_value;
  refuse_if_bad(param, value);
  return value;
}

std::optional<int64_t> env_optional_int(char const* name) {
  std::string const text = env_string(name);
  if (text.empty()) return std::nullopt;
  std::optional<int64_t> const value = parse_whole(text);
  FERRY_CHECK_AS(ConfigError, "env", value.has_value(), name, "=", text,
                 " is not an integer; set it to a whole number or unset it");
  return value;
}

int64_t env_int(char const* name) {
  auto const value = env_optional_int(name);
  FERRY_CHECK_AS(ConfigError, "env", value.has_value(), name, " is unset and has no default");
  return *value;
}

double env_double(char const* name) {
  std::string const text = env_string(name);
  std::optional<double> const value = parse_number(text);
  FERRY_CHECK_AS(ConfigError, "env", value.has_value(), name, "=", text,
                 " is not a number; set it to a decimal number or unset it");
  return *value;
}

std::span<RemovedEnvParam const> removed_env_params() {
  return kRemoved;
}

std::string removed_env_problem(RemovedEnvParam const& param, std::string const& value) {
  if (value.empty()) return "";
  return detail::concat(param.name, "=", value, " is no longer read: ", param.why, "; unset it");
}

namespace detail {
void warn_unknown_env_names();  // env_names.cpp
}  // namespace detail

void check_env() {
  detail::warn_unknown_env_names();
  for (EnvParam const& param : kParams) env_string(param.name);
  for (RemovedEnvParam const& param : kRemoved) {
    char const* value = std::getenv(param.name);
    if (std::string const problem = removed_env_problem(param, value ? value : ""); !problem.empty())
      FERRY_THROW(ConfigError, "env", problem);
  }
}

}  // namespace ferry
