// PLACEHOLDER (cpu helper replaces this file)
#include "comm/comm_impl.hpp"
#include "ferry/error.hpp"
namespace ferry::detail {
std::unique_ptr<Communicator> make_cpu_communicator(std::unique_ptr<Bootstrap>, CommunicatorOptions const&) {
  FERRY_THROW(Error, "ferry", "placeholder");
}
}  // namespace ferry::detail
