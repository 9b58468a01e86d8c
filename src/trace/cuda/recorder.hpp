// Host side of the device trace buffers of one EpBuffer (cuda backend): allocates them when tracing is enabled,
// hands each launch its TraceView, and copies a kernel family's last traced launch out.
#pragma once

#include <cuda_runtime_api.h>

#include <array>

#include "ferry/trace.hpp"
#include "trace/trace_format.hpp"

namespace ferry::trace {

// Events per warp of FERRY_TRACE_EVENTS (0 when unset: tracing starts disabled).
int env_events_per_warp();

class DeviceRecorder {
 public:
  DeviceRecorder() = default;
  ~DeviceRecorder();
  DeviceRecorder(DeviceRecorder const&) = delete;
  DeviceRecorder& operator=(DeviceRecorder const&) = delete;

  // Allocates events_per_warp events for each of max_warps warps of every kernel family on the current device
  // (0: frees them, tracing off). Throws ConfigError when tracing is not compiled in (FERRY_TRACE=ON) or the size is
  // out of range, CudaError when the allocation fails.
  void enable(int rank, int max_warps, int events_per_warp);
  bool enabled() const { return capacity_ > 0; }

  // The view a launch of `kernel` with this geometry records into (empty when tracing is off); remembers the geometry
  // for read(). Each warp resets its own count when the kernel starts, so no memset is needed per launch.
  TraceView launch(TraceKernel kernel, int ctas, int warps_per_cta);

  // Copies the last traced launch of `kernel` out (synchronises `stream` first). Throws ConfigError when tracing is
  // off or that kernel has not been launched since it was enabled.
  TraceBuffer read(TraceKernel kernel, cudaStream_t stream) const;

 private:
  void release() noexcept;

  struct Family {
    TraceEvent* events = nullptr;
    uint32_t* counts = nullptr;
    int ctas = 0;
    int warps_per_cta = 0;
  };
  std::array<Family, kNumTraceKernels> families_{};
  int rank_ = 0;
  int max_warps_ = 0;
  int capacity_ = 0;
};

}  // namespace ferry::trace
