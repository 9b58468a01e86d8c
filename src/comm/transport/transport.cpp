#include "comm/transport/transport.hpp"

namespace ferry::transport {

char const* kind_name(Kind kind) {
  switch (kind) {
    case Kind::lsa:
      return "lsa";
    case Kind::emulated:
      return "emulated";
    case Kind::gin:
      return "gin";
  }
  return "unknown";
}

}  // namespace ferry::transport
