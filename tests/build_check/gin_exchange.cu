// Build check: an all-to-all written once against the transport seam, instantiated over the gin transport (and over
// lsa, to show it is the same code), so that every call of the seam is compiled for sm_90a against the NCCL device
// API. The normal build compiles it against the installed NCCL headers (tests/CMakeLists.txt, objects only);
// scripts/check-gin-headers.sh against the newest nvidia-nccl-cu13 wheel's. Nothing runs it: a multi-node run needs
// GIN, which the GPU machines of CI do not have (docs/gin.md).
#include <cstddef>
#include <cstdint>

#include "comm/transport/gin.cuh"
#include "comm/transport/lsa.cuh"

namespace ferry::build_check {

constexpr int kRows = 8;                 // rows from each rank to each rank
constexpr std::size_t kRowBytes = 1024;  // a multiple of 16 (the seam's puts)

// Window of every rank: send rows [peer][row], receive rows [source][row], one counter per source.
struct Layout {
  std::size_t recv_base;
  std::size_t signals;  // kMaxCudaWorld counters, 8 bytes apart: the Gin's signal range
  __host__ __device__ static constexpr std::size_t send(int peer, int row) {
    return (static_cast<std::size_t>(peer) * kRows + row) * kRowBytes;
  }
  __host__ __device__ std::size_t recv(int source, int row) const {
    return recv_base + (static_cast<std::size_t>(source) * kRows + row) * kRowBytes;
  }
  __host__ __device__ std::size_t counter(int source) const {
    return signals + static_cast<std::size_t>(source) * sizeof(uint64_t);
  }
};

template <class Net>
struct ExchangeParams {
  Net net;
  DeviceView view;
  Layout layout;
  uint64_t call;  // 1, 2, ...: the counters only grow
};

// A warp per peer: its rows for the peer into the own window, their puts, a flush before the sources are reused,
// the one signal that covers them; then the rows from that peer once its signal says they are here.
template <class Net>
__global__ void exchange_kernel(ExchangeParams<Net> const p) {
  int const warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  int const lane = static_cast<int>(threadIdx.x % 32);
  if (warp >= p.view.world) return;  // whole warps only
  int const peer = warp;
  auto const endpoint = p.net.open(transport::Warp{}, warp);
  char* const own = p.net.local();

  // 1. the rows, then their puts and the signal that covers them (strong over gin: after the puts of this context)
  for (int row = 0; row < kRows; ++row) {
    auto* words = reinterpret_cast<uint64_t*>(own + Layout::send(peer, row));
    for (std::size_t i = lane; i < kRowBytes / 8; i += 32) words[i] = p.call ^ (uint64_t(p.view.rank) << 32) ^ i;
  }
  for (int row = 0; row + 1 < kRows; ++row)
    endpoint.put(peer, p.layout.recv(p.view.rank, row), Layout::send(peer, row), kRowBytes);
  endpoint.put_signal(peer, p.layout.recv(p.view.rank, kRows - 1), Layout::send(peer, kRows - 1), kRowBytes,
                      p.layout.counter(p.view.rank), 1);
  endpoint.put_value(peer, p.layout.recv(p.view.rank, 0), p.call);  // unordered: nobody reads it before a signal
  endpoint.signal(peer, p.layout.counter(p.view.rank), 1);
  // 2. the sources may be reused only after the flush
  endpoint.flush();
  // 3. two signals per call from every source
  if (!endpoint.wait(p.view, p.layout.counter(peer), 2 * p.call, peer, WaitPhase::test)) return;
  endpoint.close();
}

template __global__ void exchange_kernel<transport::Gin>(ExchangeParams<transport::Gin> const);
template __global__ void exchange_kernel<transport::Lsa>(ExchangeParams<transport::Lsa> const);

static_assert(!transport::Gin::kLoadStore && transport::Gin::kKind == transport::Kind::gin,
              "the gin transport reaches peers through the network only");

}  // namespace ferry::build_check
