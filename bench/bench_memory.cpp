#include "bench_memory.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>

#include "ferry/error.hpp"
#if FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>

#define BENCH_CHECK_CUDA(expr)                                                                                      \
  do {                                                                                                              \
    cudaError_t const bench_status = (expr);                                                                        \
    if (bench_status != cudaSuccess) FERRY_THROW(CudaError, "cuda", #expr, ": ", cudaGetErrorString(bench_status)); \
  } while (0)
#endif

namespace ferry::bench {

namespace {
[[noreturn]] void no_cuda() {
  FERRY_THROW(ConfigError, "config", "backend cuda is not compiled into this build; use --backend cpu");
}
double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

BenchMemory::BenchMemory(Backend backend) : backend_(backend) {
  if (backend_ == Backend::cuda) {
#if FERRY_HAVE_CUDA
    BENCH_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
#else
    no_cuda();
#endif
  }
}

BenchMemory::~BenchMemory() {
  for (void* ptr : allocations_) {
#if FERRY_HAVE_CUDA
    if (backend_ == Backend::cuda) {
      cudaFree(ptr);
      continue;
    }
#endif
    std::free(ptr);
  }
#if FERRY_HAVE_CUDA
  if (stream_) cudaStreamDestroy(stream_);
#endif
}

void* BenchMemory::alloc(std::size_t bytes) {
  void* ptr = nullptr;
  bytes = (bytes + 255) / 256 * 256;
  if (backend_ == Backend::cuda) {
#if FERRY_HAVE_CUDA
    BENCH_CHECK_CUDA(cudaMalloc(&ptr, bytes));
#endif
  } else {
    ptr = std::aligned_alloc(256, bytes);
    FERRY_CHECK(ptr != nullptr, "out of host memory allocating ", bytes, " bytes");
  }
  allocations_.push_back(ptr);
  return ptr;
}

void BenchMemory::upload(void* dst, void const* src, std::size_t bytes) {
  if (bytes == 0) return;
#if FERRY_HAVE_CUDA
  if (backend_ == Backend::cuda) {
    BENCH_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    BENCH_CHECK_CUDA(cudaStreamSynchronize(stream_));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

void BenchMemory::download(void* dst, void const* src, std::size_t bytes) {
  if (bytes == 0) return;
#if FERRY_HAVE_CUDA
  if (backend_ == Backend::cuda) {
    BENCH_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    BENCH_CHECK_CUDA(cudaStreamSynchronize(stream_));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

void BenchMemory::copy(void* dst, void const* src, std::size_t bytes) {
  if (bytes == 0) return;
#if FERRY_HAVE_CUDA
  if (backend_ == Backend::cuda) {
    BENCH_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

void BenchMemory::fill(void* dst, uint8_t byte, std::size_t bytes) {
  if (bytes == 0) return;
#if FERRY_HAVE_CUDA
  if (backend_ == Backend::cuda) {
    BENCH_CHECK_CUDA(cudaMemsetAsync(dst, byte, bytes, stream_));
    return;
  }
#endif
  std::memset(dst, byte, bytes);
}

void BenchMemory::synchronize() {
#if FERRY_HAVE_CUDA
  if (backend_ == Backend::cuda) BENCH_CHECK_CUDA(cudaStreamSynchronize(stream_));
#endif
}

LegTimer::LegTimer(BenchMemory& memory) : memory_(memory) {
#if FERRY_HAVE_CUDA
  if (memory_.backend() == Backend::cuda) {
    BENCH_CHECK_CUDA(cudaEventCreate(reinterpret_cast<cudaEvent_t*>(&start_event_)));
    BENCH_CHECK_CUDA(cudaEventCreate(reinterpret_cast<cudaEvent_t*>(&stop_event_)));
  }
#endif
}

LegTimer::~LegTimer() {
#if FERRY_HAVE_CUDA
  if (start_event_) cudaEventDestroy(static_cast<cudaEvent_t>(start_event_));
  if (stop_event_) cudaEventDestroy(static_cast<cudaEvent_t>(stop_event_));
#endif
}

void LegTimer::start() {
#if FERRY_HAVE_CUDA
  if (start_event_) {
    BENCH_CHECK_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(start_event_), memory_.stream()));
    return;
  }
#endif
  start_host_ = now_us();
}

void LegTimer::stop() {
#if FERRY_HAVE_CUDA
  if (stop_event_) {
    BENCH_CHECK_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(stop_event_), memory_.stream()));
    return;
  }
#endif
  stop_host_ = now_us();
}

double LegTimer::elapsed_us() {
#if FERRY_HAVE_CUDA
  if (stop_event_) {
    BENCH_CHECK_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(stop_event_)));
    float ms = 0;
    BENCH_CHECK_CUDA(
        cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start_event_), static_cast<cudaEvent_t>(stop_event_)));
    return ms * 1000.0;
  }
#endif
  return stop_host_ - start_host_;
}

LegGraph::LegGraph(BenchMemory& memory, std::function<void()> const& enqueue) : memory_(memory) {
#if FERRY_HAVE_CUDA
  FERRY_CHECK(memory_.backend() == Backend::cuda, "graph mode needs the cuda backend");
  cudaGraph_t graph = nullptr;
  BENCH_CHECK_CUDA(cudaStreamBeginCapture(memory_.stream(), cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (...) {
    cudaStreamEndCapture(memory_.stream(), &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  BENCH_CHECK_CUDA(cudaStreamEndCapture(memory_.stream(), &graph));
  graph_ = graph;
  cudaGraphExec_t exec = nullptr;
  BENCH_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  exec_ = exec;
#else
  (void)enqueue;
  no_cuda();
#endif
}

LegGraph::~LegGraph() {
#if FERRY_HAVE_CUDA
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
#endif
}

void LegGraph::replay() {
#if FERRY_HAVE_CUDA
  BENCH_CHECK_CUDA(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), memory_.stream()));
#endif
}

std::vector<double> time_leg(BenchMemory& memory, Communicator& comm, std::function<void()> const& enqueue, bool graph,
                             int warmup, int iters, int graph_calls) {
  FERRY_CHECK_CONFIG(graph_calls >= 1, "graph_calls=", graph_calls, " must be at least 1");
  int const calls = graph ? graph_calls : 1;
  // NOTE: the delay covers the host's launch latency (tens of us for barrier + events + graph launch): the timed
  // region then starts on a stream that already holds the leg, and measures the leg alone.
  constexpr double kHostCoverUs = 100.0;
  std::unique_ptr<LegGraph> leg_graph;
  if (graph)
    leg_graph = std::make_unique<LegGraph>(memory, [&] {
      for (int c = 0; c < calls; ++c) enqueue();
    });
  LegTimer timer(memory);
  std::vector<double> samples;
  for (int i = 0; i < warmup + iters; ++i) {
    enqueue_delay(memory, kHostCoverUs);
    comm.barrier(memory.stream());
    timer.start();
    if (leg_graph)
      leg_graph->replay();
    else
      enqueue();
    timer.stop();
    double const us = timer.elapsed_us() / calls;
    if (i >= warmup) samples.push_back(us);
  }
  comm.check_errors(memory.stream());
  return samples;
}

std::vector<double> host_time(BenchMemory& memory, Communicator& comm, std::function<void()> const& enqueue, int warmup,
                              int loops, int calls) {
  FERRY_CHECK_CONFIG(calls >= 1, "calls=", calls, " must be at least 1");
  std::vector<double> samples;
  for (int i = 0; i < warmup + loops; ++i) {
    comm.barrier(memory.stream());
    memory.synchronize();
    double const start = now_us();
    for (int c = 0; c < calls; ++c) enqueue();
    double const us = (now_us() - start) / calls;
    if (i >= warmup) samples.push_back(us);
  }
  memory.synchronize();
  comm.check_errors(memory.stream());
  return samples;
}

std::string device_name(Backend backend) {
#if FERRY_HAVE_CUDA
  if (backend == Backend::cuda) {
    int device = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&device) == cudaSuccess && cudaGetDeviceProperties(&prop, device) == cudaSuccess)
      return prop.name;
    return "unknown GPU";
  }
#endif
  (void)backend;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line))
    if (line.rfind("model name", 0) == 0) return "cpu: " + line.substr(line.find(':') + 2);
  return "cpu";
}

}  // namespace ferry::bench
