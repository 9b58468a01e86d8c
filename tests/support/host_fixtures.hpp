// What the host tests share: a scratch folder, a scoped environment variable, file and text helpers, the check of an
// error's type and message, and a run of the ferry CLI (the ferry_unit_tests binary knows its path as FERRY_CLI_PATH).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ferry/error.hpp"

namespace ferry::test {

// Whether `bytes` bytes at a and b are equal; true for 0 bytes, where either pointer may be null (an empty vector's
// data()), which memcmp does not allow.
inline bool same_bytes(void const* a, void const* b, std::size_t bytes) {
  return bytes == 0 || std::memcmp(a, b, bytes) == 0;
}

// A fresh folder under the temp folder, removed (with what is in it) with the object.
class TempDir {
 public:
  TempDir() {
    std::random_device device;
    path_ = std::filesystem::temp_directory_path() /
            ("ferry_test_" + std::to_string(getpid()) + "_" + std::to_string(device()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(TempDir const&) = delete;
  TempDir& operator=(TempDir const&) = delete;
  std::string file(std::string const& name) const { return (path_ / name).string(); }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// Sets (or, for nullopt, unsets) an environment variable for the scope.
class ScopedEnv {
 public:
  ScopedEnv(char const* name, std::optional<std::string> const& value) : name_(name) {
    if (char const* old = std::getenv(name)) old_ = old;
    value ? setenv(name, value->c_str(), 1) : unsetenv(name);
  }
  ~ScopedEnv() { old_ ? setenv(name_, old_->c_str(), 1) : unsetenv(name_); }
  ScopedEnv(ScopedEnv const&) = delete;
  ScopedEnv& operator=(ScopedEnv const&) = delete;

 private:
  char const* name_;
  std::optional<std::string> old_;
};

inline void write_file(std::string const& path, std::string const& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

inline std::string read_file(std::string const& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline bool contains(std::string const& text, std::string const& part) {
  return text.find(part) != std::string::npos;
}

// "" when fn throws an ErrorType whose message holds every part; else what went wrong (for a rank case's list of
// problems: it runs where a gtest assertion cannot report). Another exception propagates.
template <typename ErrorType, typename Fn>
std::string expect_error(Fn&& fn, std::vector<std::string> const& parts) {
  try {
    fn();
    return "no error";
  } catch (ErrorType const& error) {
    for (auto const& part : parts)
      if (!contains(error.what(), part)) return std::string("'") + part + "' missing from: " + error.what();
    return "";
  }
}

template <typename Fn>
std::string expect_input_error(Fn&& fn, std::vector<std::string> const& parts) {
  return expect_error<InputError>(std::forward<Fn>(fn), parts);
}

struct CliRun {
  int code = -1;       // exit status (-1: did not exit normally)
  std::string output;  // stdout and stderr
};

// Runs a shell command line, stdout and stderr captured together.
inline CliRun run_shell(std::string const& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  CliRun run;
  if (!pipe) return run;
  std::array<char, 4096> buf;
  std::size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) run.output.append(buf.data(), n);
  int const status = pclose(pipe);
  run.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

#ifdef FERRY_CLI_PATH
// Runs `ferry ARGS` through the shell, stdout and stderr captured together.
inline CliRun run_ferry(std::string const& args) {
  return run_shell(std::string(FERRY_CLI_PATH) + " " + args);
}
#endif

}  // namespace ferry::test
