// The seam between EpBuffer (host orchestration shared by both backends) and a backend's implementation.
#pragma once

#include <memory>
#include <string>

#include "ferry/ep.hpp"

namespace ferry::detail {

class EpBackendImpl {
 public:
  virtual ~EpBackendImpl() = default;
  // Arguments were validated by EpBuffer (shapes, counts, pointers); ids are checked by the backend (host on cpu,
  // device on cuda).
  virtual DispatchResult dispatch(DispatchArgs const& args, cudaStream_t stream) = 0;
  virtual void combine(CombineArgs const& args, cudaStream_t stream) = 0;
  virtual std::string explain() const = 0;
};

std::unique_ptr<EpBackendImpl> make_cpu_ep(Communicator& comm, EpConfig const& config);
#if FERRY_HAVE_CUDA
std::unique_ptr<EpBackendImpl> make_cuda_ep(Communicator& comm, EpConfig const& config);
#endif

// Host checks of a dispatch call that need no device data. Throws InputError naming the argument.
void validate_dispatch_args(EpConfig const& config, DispatchArgs const& args);
void validate_combine_args(EpConfig const& config, CombineArgs const& args, bool have_dispatch);

}  // namespace ferry::detail
