#include "core/log.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "ferry/env.hpp"

namespace ferry {
namespace {

constexpr char const* kNames[] = {"error", "warn", "info", "debug"};

// NOTE: never throws (logging runs in destructors and teardown). A refused FERRY_LOG is refused where a job starts
// (check_env); a process that logs without starting one says so once and logs at warn.
LogLevel configured_level() {
  static LogLevel const level = [] {
    EnvParam const& param = env_param("FERRY_LOG");
    char const* set = std::getenv(param.name);
    std::string const text = set && *set ? set : param.default_value;
    for (int i = 0; i < 4; ++i)
      if (text == kNames[i]) return static_cast<LogLevel>(i);
    std::fprintf(stderr, "ferry: %s (logging at warn)\n", env_problem(param, text).c_str());
    return LogLevel::warn;
  }();
  return level;
}

}  // namespace

bool log_enabled(LogLevel level) {
  return static_cast<int>(level) <= static_cast<int>(configured_level());
}

void log_message(LogLevel level, std::string const& message) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  char const* rank = std::getenv("RANK");
  std::fprintf(stderr, "ferry %s [rank %s]: %s\n", kNames[static_cast<int>(level)], rank ? rank : "-", message.c_str());
}

}  // namespace ferry
