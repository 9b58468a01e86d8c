#include "core/log.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "ferry/env.hpp"

namespace ferry {
namespace {

constexpr char const* kNames[] = {"error", "warn", "info", "debug"};

LogLevel configured_level() {
  static LogLevel const level = [] {
    std::string const text = env_string("FERRY_LOG");
    for (int i = 0; i < 4; ++i)
      if (text == kNames[i]) return static_cast<LogLevel>(i);
    std::fprintf(stderr, "ferry: FERRY_LOG=%s is unknown (use error, warn, info or debug); using warn\n", text.c_str());
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
