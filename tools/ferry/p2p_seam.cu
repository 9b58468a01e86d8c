#include "p2p_seam.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/cuda/cuda_communicator.hpp"
#include "comm/device_error.hpp"
#include "comm/transport/emulated.cuh"
#include "comm/transport/lsa.cuh"
#include "core/cuda_check.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"
#include "p2p_seam.cuh"
#include "p2p_timing.cuh"

namespace ferry::cli::p2p {
namespace {

template <class T>
T* device_zeroed(std::size_t count) {
  T* ptr = nullptr;
  FERRY_CHECK_CUDA(cudaMalloc(&ptr, count * sizeof(T)));
  FERRY_CHECK_CUDA(cudaMemset(ptr, 0, count * sizeof(T)));
  return ptr;
}

template <class Net>
class Seam final : public SeamMeasures {
 public:
  Seam(Communicator* comm, Settings const& s) : comm_(comm), s_(s), runs_(s.warmup, s.iters) {
    world_ = comm ? comm->world() : s.nproc;
    sides_ = comm ? 1 : world_;
    FERRY_CHECK_CONFIG(sides_ <= kSides<Net>, "ferry p2p: ", sides_, " ranks in one process: the ",
                       transport::kind_name(Net::kKind), " transport runs one per process");
    std::size_t const max_bytes = *std::max_element(s.sizes.begin(), s.sizes.end());
    std::size_t const slices = s.wants(Direction::alltoall) ? static_cast<std::size_t>(world_) : 2;
    params_.layout.dst_off = max_bytes;
    params_.layout.signals_off = max_bytes + slices * max_bytes;
    params_.world = world_;
    std::size_t const window_bytes = params_.layout.signals_off + kSeamCounters * sizeof(uint64_t);
    try {
      FERRY_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      // 1. the windows: the communicator's symmetric region (zeroed: the counters start at 0), or one per virtual rank
      char* windows[kMaxCudaWorld] = {};
      if (comm_) {
        region_ = comm_->alloc_symmetric(window_bytes);
        for (int r = 0; r < world_; ++r) windows[r] = region_.view.peer(r);
      } else {
        for (int r = 0; r < world_; ++r) {
          windows[r] = device_zeroed<char>(window_bytes);
          virtual_windows_.push_back(windows[r]);
          DeviceErrorBlock* block = nullptr;
          FERRY_CHECK_CUDA(
              cudaHostAlloc(reinterpret_cast<void**>(&block), sizeof(DeviceErrorBlock), cudaHostAllocMapped));
          std::memset(block, 0, sizeof(DeviceErrorBlock));
          errors_.push_back(block);
        }
      }
      // 2. each rank of a launch: its transport, its view, the counts it has waited for
      for (int i = 0; i < sides_; ++i) {
        Side<Net>& side = params_.side[i];
        side.rank = comm_ ? comm_->rank() : i;
        side.view = comm_ ? comm_->device_view() : virtual_view(i);
        side.seen = device_zeroed<uint64_t>(kSeamCounters);
        owned_.push_back(side.seen);
        side.net = make_net(windows, side.rank);
      }
      elapsed_ = device_zeroed<uint64_t>(1);
      params_.elapsed_ns = elapsed_;
      FERRY_CHECK_CUDA(cudaDeviceSynchronize());
    } catch (...) {
      release();
      throw;
    }
  }

  ~Seam() override { release(); }
  Seam(Seam const&) = delete;
  Seam& operator=(Seam const&) = delete;

  int world() const override { return world_; }

  bool fits(int ctas) const override {
    if (comm_) return true;
    int device = 0, sms = 0, per_sm = 0;
    FERRY_CHECK_CUDA(cudaGetDevice(&device));
    FERRY_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    FERRY_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, put_signal_kernel<Net>, s_.threads, 0));
    return static_cast<int64_t>(ctas) * sides_ <= static_cast<int64_t>(per_sm) * sms;
  }

  double time_put_signal(Direction direction, std::size_t bytes, int ctas) override {
    SeamParams<Net> params = params_;
    params.layout.bytes = bytes;
    params.alltoall = direction == Direction::alltoall;
    bool active = false;
    for (int i = 0; i < sides_; ++i) {
      // the pair: rank 0 sends (bidir: rank 1 too), rank 1 receives (bidir: rank 0 too); alltoall: every rank both
      Side<Net>& side = params.side[i];
      bool const pair = side.rank <= 1;
      bool const bidir = direction == Direction::bidir;
      side.sends = params.alltoall || (pair && (side.rank == 0 || bidir));
      side.receives = params.alltoall || (pair && (side.rank == 1 || bidir));
      active |= side.sends || side.receives;
    }
    // 1. meet the peers on the device before every run (one launch holds every virtual rank), then time it alone
    runs_.enqueue(
        stream_,
        [&] {
          if (comm_) comm_->barrier(stream_);
        },
        [&] {
          if (active) put_signal_kernel<Net><<<dim3(ctas, sides_), s_.threads, 0, stream_>>>(params);
          FERRY_CHECK_CUDA(cudaGetLastError());
        });
    check_errors();
    // 2. as slow as the slowest rank
    double const mine = active ? runs_.median_us() : 0;
    return comm_ ? slowest_rank(*comm_, mine) : mine;
  }

  double time_latency() override {
    constexpr int kWarmupRounds = 100;
    SeamParams<Net> params = params_;
    params.warmup = kWarmupRounds;
    params.rounds = s_.latency_rounds;
    bool const plays = !comm_ || comm_->rank() <= 1;
    std::vector<double> samples;
    for (int i = 0; i < s_.iters; ++i) {
      if (comm_) comm_->barrier(stream_);
      if (plays) signal_ping_pong_kernel<Net><<<dim3(1, sides_), 1, 0, stream_>>>(params);
      FERRY_CHECK_CUDA(cudaGetLastError());
      check_errors();
      uint64_t elapsed = 0;
      FERRY_CHECK_CUDA(cudaMemcpy(&elapsed, elapsed_, sizeof(elapsed), cudaMemcpyDeviceToHost));
      samples.push_back(1e-3 * static_cast<double>(elapsed) / s_.latency_rounds / 2);
    }
    double result = !comm_ || comm_->rank() == 0 ? median(samples) : 0;
    if (comm_) comm_->bootstrap().broadcast(&result, sizeof(result), 0);
    return result;
  }

 private:
  Net make_net(char* const* windows, int rank) {
    Net net{};
    if constexpr (Net::kKind == transport::Kind::gin) {
      net = detail::gin_transport(*comm_, region_, params_.layout.signals_off, kSeamCounters);
    } else {
      for (int r = 0; r < world_; ++r) net.windows[r] = windows[r];
      net.rank = rank;
      net.world = world_;
    }
    if constexpr (Net::kKind == transport::Kind::emulated) {
      // one endpoint per CTA index and the ping-pong's, with the settings printed above the table
      net.areas = device_zeroed<transport::EmulatedArea>(kSeamCounters);
      owned_.push_back(net.areas);
      net.num_areas = kSeamCounters;
      net.seed = s_.emulated.seed ^ static_cast<uint64_t>(rank);
      net.max_delay_ns = s_.emulated.max_delay_ns;
      net.reorder = s_.emulated.reorder ? 1u : 0u;
    }
    return net;
  }

  DeviceView virtual_view(int rank) const {
    DeviceView view{};
    view.rank = rank;
    view.world = world_;
    view.timeout_ns = static_cast<uint64_t>(env_double("FERRY_TIMEOUT_S") * 1e9);
    FERRY_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&view.error), errors_[rank], 0));
    return view;
  }

  // The first failure any rank of this process recorded, as the communicator raises it (a TimeoutError naming the
  // rank, the peer and what it waited for).
  void check_errors() {
    if (comm_) return comm_->check_errors(stream_);
    FERRY_CHECK_CUDA(cudaStreamSynchronize(stream_));
    for (DeviceErrorBlock const* block : errors_)
      if (block->status != 0)
        FERRY_THROW(TimeoutError, "p2p", detail::describe_device_error(*block, env_double("FERRY_TIMEOUT_S")));
  }

  // Best effort (a destructor, or a constructor that threw): the communicator's teardown reports anything serious.
  void release() noexcept {
    if (stream_) cudaStreamSynchronize(stream_);
    for (void* ptr : owned_) cudaFree(ptr);
    owned_.clear();
    for (void* ptr : virtual_windows_) cudaFree(ptr);
    virtual_windows_.clear();
    for (DeviceErrorBlock* block : errors_) cudaFreeHost(block);
    errors_.clear();
    if (elapsed_) cudaFree(elapsed_);
    elapsed_ = nullptr;
    if (region_.local && comm_) comm_->release_symmetric(region_);
    region_ = {};
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  Communicator* comm_;
  Settings const& s_;
  int world_ = 0;
  int sides_ = 1;
  SeamParams<Net> params_{};
  SymmetricRegion region_{};
  std::vector<void*> virtual_windows_;
  std::vector<DeviceErrorBlock*> errors_;  // virtual ranks: host addresses of their mapped error blocks
  std::vector<void*> owned_;               // counters waited for, emulated endpoints
  cudaStream_t stream_ = nullptr;
  TimedRuns runs_;
  uint64_t* elapsed_ = nullptr;
};

}  // namespace

std::unique_ptr<SeamMeasures> make_seam_measures(Communicator* comm, Settings const& settings) {
  switch (settings.transport) {
    case transport::Kind::lsa:
      return std::make_unique<Seam<transport::Lsa>>(comm, settings);
    case transport::Kind::emulated:
      return std::make_unique<Seam<transport::Emulated>>(comm, settings);
    case transport::Kind::gin:
      return std::make_unique<Seam<transport::Gin>>(comm, settings);
  }
  FERRY_THROW(ConfigError, "config", "ferry p2p: no seam measure for transport ",
              transport::kind_name(settings.transport));
}

}  // namespace ferry::cli::p2p
