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
  // With args.return_recv_hook the backend runs the send half only; EpBuffer then guarantees exactly one matching
  // complete_* call before anything else.
  virtual DispatchResult dispatch(DispatchArgs const& args, cudaStream_t stream) = 0;
  virtual void combine(CombineArgs const& args, cudaStream_t stream) = 0;
  virtual std::string explain() const = 0;
  // The receive halves (low-latency mode). EpBuffer refuses hooks in modes whose backend does not override these.
  virtual DispatchResult complete_dispatch(cudaStream_t stream);
  virtual void complete_combine(cudaStream_t stream);
  // In-kernel tracing (src/trace/): backends whose kernels record override these; the defaults throw ConfigError.
  virtual void enable_trace(EpConfig const& config, int max_events_per_warp);
  virtual TraceBuffer read_trace(EpConfig const& config, TraceKernel kernel, cudaStream_t stream);
};

std::unique_ptr<EpBackendImpl> make_cpu_ep(Communicator& comm, EpConfig const& config);
#if FERRY_HAVE_CUDA
std::unique_ptr<EpBackendImpl> make_cuda_ep(Communicator& comm, EpConfig const& config);
// Low-latency mode (src/ep/cuda/ll_ep.cu); config is resolved (EpConfig::resolved).
std::unique_ptr<EpBackendImpl> make_cuda_ll_ep(Communicator& comm, EpConfig const& config);
#endif

// Host checks of a dispatch call that need no device data. Throws InputError naming the argument.
void validate_dispatch_args(EpConfig const& config, DispatchArgs const& args);
void validate_combine_args(EpConfig const& config, CombineArgs const& args, bool have_dispatch);

}  // namespace ferry::detail
