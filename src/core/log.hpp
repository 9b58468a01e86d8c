// Minimal logging to stderr, filtered by FERRY_LOG (error, warn, info, debug). For what cannot be thrown: failures
// in destructors and teardown, and notices.
#pragma once

#include <string>

#include "ferry/error.hpp"

namespace ferry {

enum class LogLevel { error = 0, warn = 1, info = 2, debug = 3 };

bool log_enabled(LogLevel level);
void log_message(LogLevel level, std::string const& message);

}  // namespace ferry

#define FERRY_LOG(level, ...)                                                                           \
  do {                                                                                                  \
    if (::ferry::log_enabled(level)) ::ferry::log_message(level, ::ferry::detail::concat(__VA_ARGS__)); \
  } while (0)
#define FERRY_LOG_ERROR(...) FERRY_LOG(::ferry::LogLevel::error, __VA_ARGS__)
#define FERRY_LOG_WARN(...) FERRY_LOG(::ferry::LogLevel::warn, __VA_ARGS__)
#define FERRY_LOG_INFO(...) FERRY_LOG(::ferry::LogLevel::info, __VA_ARGS__)
#define FERRY_LOG_DEBUG(...) FERRY_LOG(::ferry::LogLevel::debug, __VA_ARGS__)
