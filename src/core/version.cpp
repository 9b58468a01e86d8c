#include "ferry/version.hpp"

namespace ferry {

char const* version() {
  return FERRY_VERSION;  // CMakeLists.txt's project(VERSION), a compile definition of the library
}

}  // namespace ferry
