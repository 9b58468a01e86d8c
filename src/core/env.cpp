#include "ferry/env.hpp"

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "ferry/error.hpp"

namespace ferry {
namespace {

constexpr std::array kParams = {
    EnvParam{"FERRY_TIMEOUT_S", "30", "bound of every device and host wait, in seconds (a hang becomes TimeoutError)"},
    EnvParam{"FERRY_BOOTSTRAP_TIMEOUT_S", "60",
             "deadline for the rendezvous of all ranks (connect retries, first exchange)"},
    EnvParam{"FERRY_LOG", "warn", "log level: error, warn, info, debug"},
    EnvParam{"FERRY_DISPATCH_BLOCKS", "",
             "pin the number of CTAs of the dispatch kernels (experiments; overrides tuning)"},
    EnvParam{"FERRY_DISPATCH_WARPS", "", "pin the warps per CTA of the dispatch kernels"},
    EnvParam{"FERRY_COMBINE_BLOCKS", "", "pin the number of CTAs of the combine kernels"},
    EnvParam{"FERRY_COMBINE_WARPS", "", "pin the warps per CTA of the combine kernels"},
    EnvParam{"FERRY_NORMAL_LANDING", "auto",
             "normal-mode dispatch protocol: auto (landing zone while world * max_tokens_per_rank <= 1024), on, off; "
             "same on every rank"},
    EnvParam{"FERRY_LL_OWN_ROWS", "landing",
             "low-latency bf16 dispatch: a rank's own rows staged in its landing zone (landing), or copied from x into "
             "their slots by the send half while the peers' rows are on the wire (direct; slower on 2 x H200, "
             "docs/perf.md)"},
    EnvParam{"FERRY_TUNING_DIR", "",
             "folder of tuning tables (*.json) used instead of the compiled-in ones (docs/tuning.md)"},
    EnvParam{"FERRY_TRACE_EVENTS", "",
             "builds with FERRY_TRACE=ON: trace every EpBuffer from construction, this many events per warp"},
    EnvParam{"FERRY_NCCL_VERSION_CHECK", "1",
             "refuse to start when the loaded NCCL differs from the headers (0 disables; unsafe)"},
    EnvParam{"MASTER_ADDR", "127.0.0.1", "torchrun rendezvous host (rank 0 listens there)"},
    EnvParam{"MASTER_PORT", "29500", "torchrun rendezvous port"},
    EnvParam{"RANK", "", "global rank of this process (torchrun)"},
    EnvParam{"WORLD_SIZE", "", "number of ranks (torchrun)"},
    EnvParam{"LOCAL_RANK", "", "rank within this host; selects the GPU (torchrun)"},
    EnvParam{"LOCAL_WORLD_SIZE", "", "ranks on this host (torchrun; default WORLD_SIZE: one host)"},
};

EnvParam const& find(char const* name) {
  for (auto const& param : kParams)
    if (std::strcmp(param.name, name) == 0) return param;
  FERRY_THROW(ConfigError, "env", "parameter ", name, " is not declared in the env table (src/core/env.cpp)");
}

}  // namespace

std::span<EnvParam const> env_params() {
  return kParams;
}

std::string env_string(char const* name) {
  EnvParam const& param = find(name);
  char const* value = std::getenv(name);
  return (value && *value) ? std::string(value) : std::string(param.default_value);
}

std::optional<int64_t> env_optional_int(char const* name) {
  std::string const text = env_string(name);
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long long const value = std::strtoll(text.c_str(), &end, 10);
  FERRY_CHECK_AS(ConfigError, "env", errno == 0 && end && *end == '\0', name, "=", text,
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
  errno = 0;
  char* end = nullptr;
  double const value = std::strtod(text.c_str(), &end);
  FERRY_CHECK_AS(ConfigError, "env", !text.empty() && errno == 0 && end && *end == '\0', name, "=", text,
                 " is not a number; set it to a decimal number or unset it");
  return value;
}

}  // namespace ferry
