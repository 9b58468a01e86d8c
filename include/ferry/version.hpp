// The version of the Ferry library linked into this program. It is written in one place, CMakeLists.txt's
// project(ferry VERSION ...), which also gives the CMake package's FerryConfigVersion.cmake, the Python wheel's
// version, `ferry --version` and `ferry.__version__`. The compile definition FERRY_VERSION (of the Ferry::ferry
// target) holds the same text for code that needs it at compile time.
#pragma once

namespace ferry {

// "MAJOR.MINOR.PATCH" of the library this program is linked with, e.g. "0.1.0". Never null; static storage.
char const* version();

}  // namespace ferry
