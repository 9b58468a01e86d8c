#include "ferry/error.hpp"

#include <cstring>

namespace ferry::detail {

std::string format_error(char const* subsystem, char const* file, int line, std::string const& message) {
  char const* base = std::strrchr(file, '/');
  return concat(subsystem, " error (", base ? base + 1 : file, ":", line, "): ", message);
}

}  // namespace ferry::detail
