// Memory, streams, timers and graphs for `ferry bench`, for either backend: device memory and CUDA events on cuda,
// host memory and a steady clock on cpu. Keeps the bench itself free of backend branches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "ferry/communicator.hpp"

namespace ferry::bench {

class BenchMemory {
 public:
  explicit BenchMemory(Backend backend);
  ~BenchMemory();
  BenchMemory(BenchMemory const&) = delete;
  BenchMemory& operator=(BenchMemory const&) = delete;

  Backend backend() const { return backend_; }
  cudaStream_t stream() const { return stream_; }
  void* alloc(std::size_t bytes);  // freed with the BenchMemory
  void upload(void* dst, void const* src, std::size_t bytes);
  void download(void* dst, void const* src, std::size_t bytes);
  void copy(void* dst, void const* src, std::size_t bytes);
  void fill(void* dst, uint8_t byte, std::size_t bytes);  // poison
  void synchronize();

 private:
  Backend backend_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocations_;
};

// Times one region per call: start() and stop() around it; elapsed_us() after the fact.
class LegTimer {
 public:
  explicit LegTimer(BenchMemory& memory);
  ~LegTimer();
  void start();
  void stop();
  double elapsed_us();  // synchronises

 private:
  BenchMemory& memory_;
  void* start_event_ = nullptr;
  void* stop_event_ = nullptr;
  double start_host_ = 0, stop_host_ = 0;
};

// A CUDA graph of one leg (cuda only): captured from a function enqueuing on the stream, then replayed.
class LegGraph {
 public:
  LegGraph(BenchMemory& memory, std::function<void()> const& enqueue);
  ~LegGraph();
  void replay();

 private:
  BenchMemory& memory_;
  void* graph_ = nullptr;
  void* exec_ = nullptr;
};

// Enqueues a kernel that keeps the stream busy for `us` microseconds (cuda; nothing on cpu). Before a timed leg it
// lets the host queue the leg behind it, so the GPU never idles waiting for the host's launch.
// Enqueues an empty kernel of `ctas` x `threads` (cuda; nothing on cpu): `ferry bench --floor` times it like a leg,
// which gives the floor of the timer (event records, launch, graph replay) under a leg's numbers.
// The same with a kernel parameter of kLaunchParamBytes, the size of the largest EP kernel's Params (what the launch
// copies), launched with <<<>>> or through cudaLaunchKernelEx with or without the cooperative attribute.
inline constexpr std::size_t kLaunchParamBytes = 1296;
enum class LaunchApi { chevrons, launch_ex, launch_ex_cooperative };
#if FERRY_HAVE_CUDA
void enqueue_delay(BenchMemory& memory, double us);
void enqueue_empty(BenchMemory& memory, int ctas, int threads, bool cooperative);
void enqueue_empty_params(BenchMemory& memory, int ctas, int threads, LaunchApi api);
#else
inline void enqueue_delay(BenchMemory&, double) {}
inline void enqueue_empty(BenchMemory&, int, int, bool) {}
inline void enqueue_empty_params(BenchMemory&, int, int, LaunchApi) {}
#endif

// Times one leg warmup + iters times and returns the timed samples (us per call). Before each: a device-side delay
// (the host queues the leg behind it) and a barrier over the ranks (they start together). In graph mode `graph_calls`
// consecutive calls of the leg are captured into one graph, each sample is one replay divided by graph_calls: the
// time a leg takes inside a captured forward pass (kernel after kernel), without the event records and graph launch
// that a lone call adds (`ferry bench --floor` measures that floor; docs/design-notes.md, "Measuring a leg inside a
// graph"). graph_calls = 1 times one call per
// replay. Raises a device error recorded meanwhile (Communicator::check_errors).
std::vector<double> time_leg(BenchMemory& memory, Communicator& comm, std::function<void()> const& enqueue, bool graph,
                             int warmup, int iters, int graph_calls = 1);

// Host microseconds per call of `enqueue` (lazy calls: what the host spends to enqueue them, the device's time not
// included): warmup + loops loops of `calls` calls, each loop from an idle stream after a barrier over the ranks (so
// the launch queue never fills and the GPU never paces the host); one sample per loop, the loop's time / calls.
std::vector<double> host_time(BenchMemory& memory, Communicator& comm, std::function<void()> const& enqueue, int warmup,
                              int loops, int calls);

// Name of this rank's device ("NVIDIA H200", or the cpu model on the cpu backend).
std::string device_name(Backend backend);

}  // namespace ferry::bench
