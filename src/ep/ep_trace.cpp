// EpBuffer's tracing entry points (include/ferry/ep.hpp) and the backend defaults for backends that record nothing.
// In ep/, not trace/: they are EpBuffer's methods, and trace/ (the recorder, decoder and files) is below ep/.
#include "ep/ep_impl.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/trace.hpp"

namespace ferry {
namespace detail {

namespace {
[[noreturn]] void refuse(EpConfig const& config) {
  FERRY_CHECK_CONFIG(trace_compiled_in(),
                     "in-kernel tracing is not compiled into this build; rebuild with -DFERRY_TRACE=ON");
  FERRY_THROW(ConfigError, "config", "in-kernel tracing records the normal-mode kernels of the cuda backend; this ",
              "EpBuffer runs mode=", mode_name(config.mode), " (use mode=normal and backend cuda to trace)");
}
}  // namespace

void EpBackendImpl::enable_trace(EpConfig const& config, int) {
  refuse(config);
}

TraceBuffer EpBackendImpl::read_trace(EpConfig const& config, TraceKernel, cudaStream_t) {
  refuse(config);
}

}  // namespace detail

void EpBuffer::enable_trace(int max_events_per_warp) {
  comm_->ensure_usable();
  impl_->enable_trace(config_, max_events_per_warp);
}

TraceBuffer EpBuffer::read_trace(TraceKernel kernel, cudaStream_t stream) const {
  comm_->ensure_usable();
  return impl_->read_trace(config_, kernel, stream);
}

}  // namespace ferry
