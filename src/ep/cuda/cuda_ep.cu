// PLACEHOLDER (kernels helper replaces this file)
#include "ep/ep_impl.hpp"
#include "ferry/error.hpp"
namespace ferry::detail {
std::unique_ptr<EpBackendImpl> make_cuda_ep(Communicator&, EpConfig const&) {
  FERRY_THROW(Error, "ferry", "placeholder");
}
}  // namespace ferry::detail
