// Ferry's error family. Every failure the library reports is one of these types; the message is formatted
// "subsystem error (file:line): what happened; what to do".
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace ferry {

// Base of every Ferry error. what() holds the full formatted message.
class Error : public std::runtime_error {
 public:
  explicit Error(std::string const& message) : std::runtime_error(message) {}
};

// An EpConfig / Communicator option that can never work (checked once, at construction).
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A call argument that is wrong (shape, dtype, expert id, token count, pointer).
class InputError : public Error {
 public:
  using Error::Error;
};

// A CUDA runtime or driver call failed.
class CudaError : public Error {
 public:
  using Error::Error;
};

// An NCCL call failed, or the loaded NCCL does not match the headers Ferry was built with.
class NcclError : public Error {
 public:
  using Error::Error;
};

// A bounded wait expired (on the host or in a kernel); the message names the rank that did not arrive.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// The bootstrap (rendezvous between ranks) failed: a rank is missing, died, or sent garbage.
class BootstrapError : public Error {
 public:
  using Error::Error;
};

// A host wait was ended early because the interrupt check asked (set_interrupt_check, include/ferry/interrupt.hpp;
// Python's Ctrl-C): the message says what was waited for and what is left usable (docs/errors.md).
class Interrupted : public Error {
 public:
  using Error::Error;
};

namespace detail {

// Streams every argument into one string ("a", 3, "b" -> "a3b").
template <typename... Args>
std::string concat(Args const&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// "subsystem error (file:line): message". Strips the directory part of file.
std::string format_error(char const* subsystem, char const* file, int line, std::string const& message);

template <typename E>
[[noreturn]] void raise(char const* subsystem, char const* file, int line, std::string const& message) {
  throw E(format_error(subsystem, file, line, message));
}

}  // namespace detail
}  // namespace ferry

// Throws ErrorType with a formatted message when cond is false. The message arguments are streamed together.
#define FERRY_CHECK_AS(ErrorType, subsystem, cond, ...)                                                       \
  do {                                                                                                        \
    if (!(cond))                                                                                              \
      ::ferry::detail::raise<ErrorType>(subsystem, __FILE__, __LINE__, ::ferry::detail::concat(__VA_ARGS__)); \
  } while (0)

#define FERRY_CHECK(cond, ...) FERRY_CHECK_AS(::ferry::Error, "ferry", cond, __VA_ARGS__)
#define FERRY_CHECK_CONFIG(cond, ...) FERRY_CHECK_AS(::ferry::ConfigError, "config", cond, __VA_ARGS__)
#define FERRY_CHECK_INPUT(cond, ...) FERRY_CHECK_AS(::ferry::InputError, "input", cond, __VA_ARGS__)
#define FERRY_THROW(ErrorType, subsystem, ...) \
  ::ferry::detail::raise<ErrorType>(subsystem, __FILE__, __LINE__, ::ferry::detail::concat(__VA_ARGS__))
