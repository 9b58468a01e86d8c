// How every ferry p2p measure is timed (p2p.cu's NVLink measures, p2p_seam.cu's seam measures): warm-up and timed
// runs on one stream, each after the ranks meet, between two CUDA events; the median of the timed runs; and the
// slowest rank's figure.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "core/cuda_check.hpp"
#include "ferry/communicator.hpp"
#include "p2p_settings.hpp"

namespace ferry::cli::p2p {

class TimedRuns {
 public:
  TimedRuns(int warmup, int iters) : warmup_(warmup), events_(2 * (warmup + iters), nullptr) {
    for (auto& event : events_) {
      if (cudaEventCreate(&event) == cudaSuccess) continue;
      release();
      FERRY_CHECK_CUDA(cudaGetLastError());
    }
  }
  ~TimedRuns() { release(); }
  TimedRuns(TimedRuns const&) = delete;
  TimedRuns& operator=(TimedRuns const&) = delete;

  // Enqueues every run on `stream`: meet() (the ranks' device barrier: no host round trip), then run() timed alone.
  template <class Meet, class Run>
  void enqueue(cudaStream_t stream, Meet const& meet, Run const& run) {
    for (std::size_t i = 0; i < events_.size() / 2; ++i) {
      meet();
      FERRY_CHECK_CUDA(cudaEventRecord(events_[2 * i], stream));
      run();
      FERRY_CHECK_CUDA(cudaEventRecord(events_[2 * i + 1], stream));
    }
  }

  // The median microseconds of the runs after the warm-up, once the stream has done them.
  double median_us() const {
    std::vector<double> times;
    for (std::size_t i = warmup_; i < events_.size() / 2; ++i) {
      float ms = 0;
      FERRY_CHECK_CUDA(cudaEventElapsedTime(&ms, events_[2 * i], events_[2 * i + 1]));
      times.push_back(1e3 * ms);
    }
    return median(times);
  }

 private:
  void release() noexcept {
    for (auto& event : events_)
      if (event) cudaEventDestroy(event);
    events_.assign(events_.size(), nullptr);
  }

  std::size_t warmup_;
  std::vector<cudaEvent_t> events_;
};

// A measure is as slow as its slowest rank (collective).
inline double slowest_rank(Communicator& comm, double mine) {
  std::vector<double> all(comm.world());
  comm.bootstrap().allgather(&mine, all.data(), sizeof(double));
  return *std::max_element(all.begin(), all.end());
}

}  // namespace ferry::cli::p2p
