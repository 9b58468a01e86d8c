// PLACEHOLDER (bootstrap helper replaces this file)
#include "ferry/bootstrap.hpp"
#include "ferry/error.hpp"
namespace ferry {
std::unique_ptr<Bootstrap> make_socket_bootstrap(SocketBootstrapOptions const&) {
  FERRY_THROW(Error, "ferry", "placeholder");
}
SocketBootstrapOptions socket_bootstrap_options_from_env() {
  FERRY_THROW(Error, "ferry", "placeholder");
}
}  // namespace ferry
