// The transport seam's contract (src/comm/transport/transport.hpp), checked on virtual ranks (worlds 2, 4, 8 on one
// GPU) over both transports of this build: lsa (NVLink load/store) and emulated (the network's semantics: puts queue,
// a signal delivers what it covers after a seeded delay and in a seeded order, a flush snapshots sources).
//
// The exchange: every rank sends `kRows` rows to every rank (itself included), a warp per (peer, slice of rows):
// it writes the rows into its own window, puts them into the peer's receive area, flushes, overwrites its sources
// (a reuse the flush allows), then signals; each receiving warp waits for its source's signals and checks every row
// against the bytes the source meant to send (fresh per call and per run: seed printed). Three test-only switches
// remove one thing the contract requires (the wait, the flush before the reuse, the order "puts, then signal"); over
// the emulated transport each one must produce wrong rows, which shows that the checks can fail and that the
// emulated transport turns a missing wait into a failure instead of a race that passes.
#include <gtest/gtest.h>

#include "ferry/communicator.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "comm/transport/emulated.cuh"
#include "comm/transport/lsa.cuh"
#include "support/gpu_case.hpp"
#include "support/virtual_ranks.hpp"
#endif

namespace ferry::test {
namespace test_transport {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

#if FERRY_HAVE_CUDA

constexpr int kRows = 48;                // rows from each source to each destination, per call
constexpr std::size_t kRowBytes = 1040;  // 65 vectors: not a power of two
constexpr int kWarpsPerPeer = 4;         // warps sending to (and receiving from) one peer
constexpr int kWarpsPerCta = 8;

// What a call leaves out of the contract (test-only switches).
enum class Omit { nothing, wait, flush, order };

char const* omit_name(Omit omit) {
  switch (omit) {
    case Omit::nothing:
      return "nothing";
    case Omit::wait:
      return "the receiver's wait";
    case Omit::flush:
      return "the flush before the source is reused";
    case Omit::order:
      return "puts before the signal (signals first)";
  }
  return "?";
}

// Window of every rank: send rows [peer][row], receive rows [parity][source][row], signals [source].
struct Layout {
  __host__ __device__ static constexpr std::size_t send(int peer, int row) {
    return (static_cast<std::size_t>(peer) * kRows + row) * kRowBytes;
  }
  std::size_t recv_base;
  std::size_t signals;
  __host__ __device__ std::size_t recv(int parity, int source, int row, int world) const {
    return recv_base + ((static_cast<std::size_t>(parity) * world + source) * kRows + row) * kRowBytes;
  }
};

template <class Net>
struct ExchangeParams {
  Net net;
  DeviceView view;
  Layout layout;
  uint64_t seed;  // of the call's bytes
  uint64_t call;  // 1, 2, ...
  Omit omit;
  unsigned long long* wrong_words;  // this rank's count of words that differ from what their source sent
};

// Word i of the row (source -> destination, row) in call `call`.
__device__ __forceinline__ uint32_t expected_word(uint64_t seed, uint64_t call, int source, int dest, int row, int i) {
  uint64_t const key = (((call * 64 + static_cast<uint64_t>(source)) * 64 + static_cast<uint64_t>(dest)) * kRows +
                        static_cast<uint64_t>(row)) *
                           kRowBytes +
                       static_cast<uint64_t>(i);
  return static_cast<uint32_t>(transport::mix64(seed ^ key));
}

template <class Net>
__global__ void exchange_kernel(ExchangeParams<Net> p) {
  int const world = p.view.world;
  int const rank = p.view.rank;
  int const warp = static_cast<int>(blockIdx.x) * kWarpsPerCta + static_cast<int>(threadIdx.x / 32);
  int const lane = static_cast<int>(threadIdx.x % 32);
  if (warp >= world * kWarpsPerPeer) return;  // whole warps only: every lane of a warp takes the same branch
  int const peer = warp / kWarpsPerPeer;      // destination of this warp's rows, and source of the rows it checks
  int const slice = warp % kWarpsPerPeer;
  int const parity = static_cast<int>(p.call & 1);
  constexpr int kWords = static_cast<int>(kRowBytes / 4);
  auto endpoint = p.net.open(transport::Warp{}, warp);

  // 1. this warp's rows for `peer` into the own window, then their puts (after the signal when told to omit the order)
  char* const own = p.net.windows[rank];
  for (int row = slice; row < kRows; row += kWarpsPerPeer) {
    auto* words = reinterpret_cast<uint32_t*>(own + Layout::send(peer, row));
    for (int i = lane; i < kWords; i += 32) words[i] = expected_word(p.seed, p.call, rank, peer, row, i);
  }
  std::size_t const signal = p.layout.signals + static_cast<std::size_t>(rank) * sizeof(uint64_t);
  if (p.omit == Omit::order) endpoint.signal(peer, signal, 1);
  for (int row = slice; row < kRows; row += kWarpsPerPeer)
    endpoint.put(peer, p.layout.recv(parity, rank, row, world), Layout::send(peer, row), kRowBytes);
  // 2. reuse of the sources: allowed after a flush only
  if (p.omit != Omit::flush) endpoint.flush();
  __syncwarp();
  for (int row = slice; row < kRows; row += kWarpsPerPeer) {
    auto* words = reinterpret_cast<uint32_t*>(own + Layout::send(peer, row));
    for (int i = lane; i < kWords; i += 32) words[i] = 0xdeadbeefu;
  }
  __syncwarp();
  // 3. the signal that covers this warp's puts to `peer` (one per warp and call: the counter reaches
  // call x kWarpsPerPeer once every warp of the source sent its slice)
  if (p.omit != Omit::order) endpoint.signal(peer, signal, 1);

  // 4. the rows from source `peer`, once its signals say they are here
  if (p.omit != Omit::wait &&
      !endpoint.wait(p.view, p.layout.signals + static_cast<std::size_t>(peer) * sizeof(uint64_t),
                     p.call * kWarpsPerPeer, peer, WaitPhase::test)) {
    endpoint.close();
    return;
  }
  unsigned long long wrong = 0;
  for (int row = slice; row < kRows; row += kWarpsPerPeer) {
    auto const* words = reinterpret_cast<uint32_t const volatile*>(own + p.layout.recv(parity, peer, row, world));
    for (int i = lane; i < kWords; i += 32) wrong += words[i] != expected_word(p.seed, p.call, peer, rank, row, i);
  }
  endpoint.close();
  if (wrong != 0) atomicAdd(p.wrong_words, wrong);
}

// Rank r's transport of kind `Net` over the virtual world.
template <class Net>
Net make_net(VirtualWorld const& vw, std::size_t bytes, int r, uint64_t seed, transport::EmulatedArea* areas);

template <>
transport::Lsa make_net<transport::Lsa>(VirtualWorld const& vw, std::size_t bytes, int r, uint64_t,
                                        transport::EmulatedArea*) {
  return transport::make_lsa(vw.sym(bytes), r, vw.world());
}

template <>
transport::Emulated make_net<transport::Emulated>(VirtualWorld const& vw, std::size_t bytes, int r, uint64_t seed,
                                                  transport::EmulatedArea* areas) {
  transport::Emulated net{};
  SymmetricView const sym = vw.sym(bytes);
  for (int peer = 0; peer < vw.world(); ++peer) net.windows[peer] = sym.peer(peer);
  net.rank = r;
  net.world = vw.world();
  net.areas = areas;
  net.num_areas = vw.world() * kWarpsPerPeer;
  net.max_delay_ns = 20000;
  net.seed = seed;
  net.reorder = 1;
  return net;
}

struct Outcome {
  unsigned long long wrong_words = 0;
  std::string errors;  // what the error blocks recorded
  uint32_t left_open = 0;
};

// `calls` exchanges at `world` ranks over Net, every rank's grid side by side; what the receivers found.
template <class Net>
Outcome run_exchange(int world, int calls, uint64_t seed, Omit omit) {
  Layout layout{};
  layout.recv_base = Layout::send(world, 0);
  layout.signals = layout.recv(2, 0, 0, world);
  std::size_t const bytes = layout.signals + static_cast<std::size_t>(world) * sizeof(uint64_t);
  // omitted waits end in a timeout or wrong rows: keep the bound short
  VirtualWorld vw(world, bytes, omit == Omit::nothing ? kVirtualTimeoutS : kAbsentTimeoutS);
  int const areas_per_rank = world * kWarpsPerPeer;
  std::vector<transport::EmulatedArea*> areas(world, nullptr);
  unsigned long long* wrong = nullptr;
  CK(cudaMalloc(&wrong, world * sizeof(unsigned long long)));
  CK(cudaMemset(wrong, 0, world * sizeof(unsigned long long)));
  for (int r = 0; r < world; ++r) {
    CK(cudaMalloc(&areas[r], areas_per_rank * sizeof(transport::EmulatedArea)));
    CK(cudaMemset(areas[r], 0, areas_per_rank * sizeof(transport::EmulatedArea)));
  }
  int const ctas = (areas_per_rank + kWarpsPerCta - 1) / kWarpsPerCta;
  for (int call = 1; call <= calls; ++call) {
    for (int r = 0; r < world; ++r) {
      ExchangeParams<Net> p{};
      p.net = make_net<Net>(vw, bytes, r, seed + 1000003ull * r, areas[r]);
      p.view = vw.view(r);
      p.layout = layout;
      p.seed = seed;
      p.call = static_cast<uint64_t>(call);
      p.omit = omit;
      p.wrong_words = wrong + r;
      exchange_kernel<Net><<<ctas, kWarpsPerCta * 32, 0, vw.stream(r)>>>(p);
      CK(cudaGetLastError());
    }
  }
  Outcome out;
  std::vector<DeviceErrorBlock> const blocks = vw.take_errors();
  for (int r = 0; r < world; ++r)
    if (blocks[r].status != 0)
      out.errors +=
          "rank " + std::to_string(r) + ": " + detail::describe_device_error(blocks[r], vw.timeout_s()) + "\n";
  std::vector<unsigned long long> host(world);
  CK(cudaMemcpy(host.data(), wrong, world * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  for (auto w : host) out.wrong_words += w;
  for (int r = 0; r < world; ++r) {
    std::vector<transport::EmulatedArea> state(areas_per_rank);
    CK(cudaMemcpy(state.data(), areas[r], state.size() * sizeof(transport::EmulatedArea), cudaMemcpyDeviceToHost));
    for (auto const& a : state) out.left_open += a.left_open + a.pending;
    CK(cudaFree(areas[r]));
  }
  CK(cudaFree(wrong));
  return out;
}

bool skip_without_gpu() {
  return cuda_device_count() < 1;
}

// GPU 0 for the virtual ranks, and a fresh seed for the case (printed).
uint64_t start_case() {
  CK(cudaSetDevice(0));
  uint64_t const seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

#endif  // FERRY_HAVE_CUDA

// Over both transports, with every requirement kept: every row of every call exact at worlds 2, 4 and 8.
TEST(TransportVirtualRanks, EveryRowArrivesOverBothTransports) {
#if !FERRY_HAVE_CUDA
  GTEST_SKIP() << "needs the cuda backend (built with FERRY_ENABLE_CUDA=OFF)";
#else
  if (skip_without_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks share it)";
  uint64_t const seed = start_case();
  for (int world : {2, 4, 8}) {
    Outcome const lsa = run_exchange<transport::Lsa>(world, 5, seed + world, Omit::nothing);
    EXPECT_EQ(lsa.errors, "") << "lsa, world " << world;
    EXPECT_EQ(lsa.wrong_words, 0u) << "lsa, world " << world;
    Outcome const emulated = run_exchange<transport::Emulated>(world, 5, seed + world, Omit::nothing);
    EXPECT_EQ(emulated.errors, "") << "emulated, world " << world;
    EXPECT_EQ(emulated.wrong_words, 0u) << "emulated, world " << world;
    EXPECT_EQ(emulated.left_open, 0u) << "emulated, world " << world << ": endpoints left with puts queued";
  }
#endif
}

// Over the emulated transport, leaving out any one requirement makes rows wrong (or a wait time out): the checks
// fail, and the emulated transport shows what would be a race on NVLink.
TEST(TransportVirtualRanks, EmulatedTransportCatchesEachMissingRequirement) {
#if !FERRY_HAVE_CUDA
  GTEST_SKIP() << "needs the cuda backend (built with FERRY_ENABLE_CUDA=OFF)";
#else
  if (skip_without_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks share it)";
  uint64_t const seed = start_case();
  for (Omit omit : {Omit::wait, Omit::flush, Omit::order}) {
    Outcome const out = run_exchange<transport::Emulated>(4, 1, seed, omit);
    std::printf("emulated, world 4, without %s: %llu wrong words%s\n", omit_name(omit), out.wrong_words,
                out.errors.empty() ? "" : ", and a wait failed");
    EXPECT_TRUE(out.wrong_words > 0 || !out.errors.empty())
        << "without " << omit_name(omit) << " every row still arrived: the emulated transport did not expose it";
  }
#endif
}

}  // namespace test_transport
}  // namespace ferry::test
