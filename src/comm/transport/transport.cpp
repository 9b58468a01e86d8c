#include "comm/transport/transport.hpp"

#include "ferry/env.hpp"

namespace ferry::transport {

EmulatedOptions emulated_options_from_env() {
  EmulatedOptions options;
  options.seed = static_cast<uint64_t>(env_int("FERRY_EMULATED_SEED"));
  options.max_delay_ns = static_cast<uint32_t>(env_int("FERRY_EMULATED_DELAY_NS"));
  options.reorder = env_string("FERRY_EMULATED_REORDER") == "1";
  return options;
}

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
