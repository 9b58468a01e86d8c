// The tuning tables compiled into the library: the bytes of src/tuning/tables/*.json, embedded at build time by
// cmake/EmbedTables.cmake (so an installed library needs no source tree). Defined in the generated
// tuning_tables_embedded.cpp.
#pragma once

#include <cstddef>
#include <span>

namespace ferry::tuning {

struct EmbeddedFile {
  char const* name;           // file name, e.g. "h200.json"
  unsigned char const* data;  // its bytes (not NUL-terminated)
  std::size_t size;
};

// Every embedded table, in file-name order.
std::span<EmbeddedFile const> embedded_tables();

}  // namespace ferry::tuning
