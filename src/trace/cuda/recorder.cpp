#include "trace/cuda/recorder.hpp"

#include <cuda_runtime_api.h>

#include "core/cuda_check.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"

namespace ferry::trace {
namespace {
// NOTE: a bound on the buffers one EpBuffer may ask for (1 GiB per kernel family at the largest grid), so a typo in
// FERRY_TRACE_EVENTS fails with a message instead of exhausting the GPU.
constexpr int kMaxEventsPerWarp = 1 << 20;
}  // namespace

int env_events_per_warp() {
  auto const value = env_optional_int("FERRY_TRACE_EVENTS");
  if (!value) return 0;
  FERRY_CHECK_CONFIG(*value >= 0 && *value <= kMaxEventsPerWarp, "FERRY_TRACE_EVENTS=", *value, " is outside [0, ",
                     kMaxEventsPerWarp, "] events per warp");
  return static_cast<int>(*value);
}

DeviceRecorder::~DeviceRecorder() {
  release();
}

void DeviceRecorder::release() noexcept {
  // NOTE: never throws; a failed free at teardown has no one to report to.
  for (Family& f : families_) {
    if (f.events) cudaFree(f.events);
    if (f.counts) cudaFree(f.counts);
    f = Family{};
  }
  capacity_ = 0;
}

void DeviceRecorder::enable(int rank, int max_warps, int events_per_warp) {
  FERRY_CHECK_CONFIG(trace_compiled_in() || events_per_warp == 0,
                     "in-kernel tracing is not compiled into this build; rebuild with -DFERRY_TRACE=ON");
  FERRY_CHECK_CONFIG(events_per_warp >= 0 && events_per_warp <= kMaxEventsPerWarp,
                     "max_events_per_warp=", events_per_warp, " is outside [0, ", kMaxEventsPerWarp, "]");
  FERRY_CHECK(max_warps > 0, "trace recorder for ", max_warps, " warps");
  release();
  rank_ = rank;
  max_warps_ = max_warps;
  if (events_per_warp == 0) return;
  std::size_t const warps = static_cast<std::size_t>(max_warps);
  for (Family& f : families_) {
    FERRY_CHECK_CUDA(cudaMalloc(&f.events, warps * events_per_warp * sizeof(TraceEvent)));
    FERRY_CHECK_CUDA(cudaMalloc(&f.counts, warps * sizeof(uint32_t)));
  }
  capacity_ = events_per_warp;
}

TraceView DeviceRecorder::launch(TraceKernel kernel, int ctas, int warps_per_cta) {
  Family& f = families_[static_cast<int>(kernel)];
  f.ctas = ctas;
  f.warps_per_cta = warps_per_cta;
#if FERRY_TRACE
  if (!enabled()) return TraceView{nullptr, nullptr, 0, 0};
  return TraceView{f.events, f.counts, static_cast<uint32_t>(capacity_), static_cast<uint32_t>(max_warps_)};
#else
  return TraceView{};
#endif
}

TraceBuffer DeviceRecorder::read(TraceKernel kernel, cudaStream_t stream) const {
  FERRY_CHECK_CONFIG(trace_compiled_in(),
                     "in-kernel tracing is not compiled into this build; rebuild with -DFERRY_TRACE=ON");
  FERRY_CHECK_CONFIG(enabled(),
                     "tracing is not enabled on this EpBuffer; call enable_trace(max_events_per_warp) (or "
                     "set FERRY_TRACE_EVENTS) before the calls to trace");
  Family const& f = families_[static_cast<int>(kernel)];
  FERRY_CHECK_CONFIG(f.ctas > 0, "no ", trace_kernel_name(kernel), " was launched since tracing was enabled");
  TraceBuffer out;
  out.rank = rank_;
  out.kernel = kernel;
  out.warps_per_cta = f.warps_per_cta;
  // NOTE: warps past the buffers (a grid larger than the recorder was sized for) record nothing; report those held.
  out.ctas = std::min(f.ctas, max_warps_ / std::max(1, f.warps_per_cta));
  out.capacity = capacity_;
  std::size_t const warps = static_cast<std::size_t>(out.num_warps());
  out.counts.resize(warps);
  out.events.resize(warps * capacity_);
  FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
  FERRY_CHECK_CUDA(cudaMemcpy(out.counts.data(), f.counts, warps * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  FERRY_CHECK_CUDA(
      cudaMemcpy(out.events.data(), f.events, out.events.size() * sizeof(TraceEvent), cudaMemcpyDeviceToHost));
  return out;
}

}  // namespace ferry::trace
