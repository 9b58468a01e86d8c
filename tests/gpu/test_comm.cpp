// Multi-GPU tests of the cuda communicator: symmetric memory through LSA pointers, the device barrier (eager and in a
// CUDA graph), bounded waits that name the missing rank, input errors from the device, teardown without leaks, and
// the NCCL version check. Each TEST starts one process per rank; below 2 GPUs (or without the cuda backend) every
// test skips with a message.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>

#include "ferry/communicator.hpp"
#include "support/rank_case.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "core/cuda_check.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/error.hpp"
#include "test_comm_kernels.hpp"
#endif

namespace ferry::test {
namespace {

// A fresh seed per run, printed so a failure can be replayed (FERRY_TEST_SEED=<seed> reuses one).
std::string fresh_seed() {
  if (char const* fixed = std::getenv("FERRY_TEST_SEED"); fixed && *fixed) return fixed;
  std::random_device device;
  uint64_t const seed = (static_cast<uint64_t>(device()) << 32) | device();
  return std::to_string(seed);
}

void expect_ok(LaunchResult const& result) {
  EXPECT_TRUE(result.ok()) << result.describe();
}

#if FERRY_HAVE_CUDA

std::unique_ptr<Communicator> make_comm() {
  return Communicator::create(make_socket_bootstrap(socket_bootstrap_options_from_env()),
                              CommunicatorOptions{Backend::cuda, -1});
}

// A Bootstrap that forwards to one owned elsewhere: lets many communicators share one rendezvous.
class BorrowedBootstrap final : public Bootstrap {
 public:
  explicit BorrowedBootstrap(Bootstrap& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world() const override { return inner_.world(); }
  int local_rank() const override { return inner_.local_rank(); }
  int local_world() const override { return inner_.local_world(); }
  void allgather(void const* send, void* recv, std::size_t bytes) override { inner_.allgather(send, recv, bytes); }
  void broadcast(void* data, std::size_t bytes, int root) override { inner_.broadcast(data, bytes, root); }
  void barrier() override { inner_.barrier(); }

 private:
  Bootstrap& inner_;
};

std::vector<uint32_t> random_words(uint64_t seed, int rank, std::size_t count) {
  std::mt19937_64 engine(seed * 1000003u + static_cast<uint64_t>(rank));
  std::vector<uint32_t> out(count);
  for (auto& word : out) word = static_cast<uint32_t>(engine());
  return out;
}

void check_words(std::vector<uint32_t> const& got, std::vector<uint32_t> const& want, char const* what) {
  for (std::size_t i = 0; i < want.size(); ++i)
    FERRY_CHECK(got[i] == want[i], what, ": element ", i, " is ", got[i], ", expected ", want[i]);
}

// Symmetric memory: each rank pushes random words into its peer's copy through the LSA pointer, checks what the
// peer pushed into its own copy, then pulls its words back from the peer. Every element is compared.
FERRY_RANK_CASE(symmetric_peer_rw) {
  auto comm = make_comm();
  int const rank = comm->rank();
  int const peer = (rank + 1) % comm->world();
  int const source = (rank + comm->world() - 1) % comm->world();
  uint64_t const seed = std::stoull(rank_case_args().at(0));
  constexpr std::size_t kCount = 1'000'004;  // 4 MB + 16 B: not a multiple of the window granularity
  constexpr std::size_t kBytes = kCount * sizeof(uint32_t);
  cudaStream_t stream = nullptr;
  FERRY_CHECK_CUDA(cudaStreamCreate(&stream));

  // 1. the region: rounded up, ptr[rank] aliases the local buffer, zeroed
  SymmetricRegion region = comm->alloc_symmetric(kBytes);
  FERRY_CHECK(region.view.bytes >= kBytes && region.view.bytes % 4096 == 0, "region of ", region.view.bytes,
              " bytes for ", kBytes, " requested");
  // ptr[rank] is NCCL's flat LSA alias of the local buffer (another address, the same memory)
  uint32_t const probe = 0xc0ffee00u + static_cast<uint32_t>(rank);
  uint32_t seen = 0;
  FERRY_CHECK_CUDA(cudaMemcpy(region.view.peer(rank) + 64, &probe, sizeof(probe), cudaMemcpyHostToDevice));
  FERRY_CHECK_CUDA(cudaMemcpy(&seen, static_cast<char*>(region.local) + 64, sizeof(seen), cudaMemcpyDeviceToHost));
  FERRY_CHECK(seen == probe, "a word written through ptr[rank] reads back as ", seen, " through local, expected ",
              probe, ": ptr[rank] does not alias this rank's buffer");
  FERRY_CHECK_CUDA(cudaMemset(static_cast<char*>(region.local) + 64, 0, sizeof(probe)));
  std::vector<uint32_t> host(kCount, 1);
  FERRY_CHECK_CUDA(cudaMemcpy(host.data(), region.local, kBytes, cudaMemcpyDeviceToHost));
  check_words(host, std::vector<uint32_t>(kCount, 0), "fresh region");

  // 2. push our words into the peer's copy, barrier, check what our source pushed into ours
  std::vector<uint32_t> const mine = random_words(seed, rank, kCount);
  void* staging = nullptr;
  FERRY_CHECK_CUDA(cudaMalloc(&staging, kBytes));
  FERRY_CHECK_CUDA(cudaMemcpy(staging, mine.data(), kBytes, cudaMemcpyHostToDevice));
  launch_copy(region.view.peer(peer), staging, kBytes, stream);
  comm->barrier(stream);
  comm->check_errors(stream);
  FERRY_CHECK_CUDA(cudaMemcpy(host.data(), region.local, kBytes, cudaMemcpyDeviceToHost));
  check_words(host, random_words(seed, source, kCount), "words pushed by the source rank");

  // 3. pull our words back from the peer's copy
  FERRY_CHECK_CUDA(cudaMemset(staging, 0xff, kBytes));
  launch_copy(staging, region.view.peer(peer), kBytes, stream);
  FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
  FERRY_CHECK_CUDA(cudaMemcpy(host.data(), staging, kBytes, cudaMemcpyDeviceToHost));
  check_words(host, mine, "words pulled back from the peer");
  comm->barrier(stream);  // the peer is done reading our copy
  comm->check_errors(stream);

  // 4. unequal sizes are refused on every rank, and the communicator stays usable
  bool refused = false;
  try {
    comm->alloc_symmetric(rank == 0 ? 4096 : 8192);
  } catch (ConfigError const& error) {
    refused = std::string(error.what()).find("same size") != std::string::npos;
  }
  FERRY_CHECK(refused, "alloc_symmetric with unequal sizes was not refused with a ConfigError");
  SymmetricRegion small = comm->alloc_symmetric(1000);
  FERRY_CHECK(small.view.bytes >= 1000, "small region of ", small.view.bytes, " bytes");
  comm->barrier(stream);
  comm->check_errors(stream);

  FERRY_CHECK_CUDA(cudaFree(staging));
  FERRY_CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("rank %d: %zu words pushed, checked and pulled back (seed %llu)\n", rank, kCount,
              static_cast<unsigned long long>(seed));
  return 0;
}

// The barrier orders data: each round stamps a counter into the peer, barriers, checks the peer's stamp, barriers
// again (so no stamp of the next round lands before the check). 500 rounds eagerly (1000 barriers), then one round
// captured in a CUDA graph and replayed 100 times.
FERRY_RANK_CASE(barrier_many) {
  auto comm = make_comm();
  int const rank = comm->rank();
  int const peer = (rank + 1) % comm->world();
  cudaStream_t stream = nullptr;
  FERRY_CHECK_CUDA(cudaStreamCreate(&stream));
  SymmetricRegion slots = comm->alloc_symmetric(4096);
  auto* own_slot = reinterpret_cast<uint64_t*>(slots.view.peer(rank));
  auto* peer_slot = reinterpret_cast<uint64_t*>(slots.view.peer(peer));
  uint64_t* counter = nullptr;
  uint32_t* mismatches = nullptr;
  FERRY_CHECK_CUDA(cudaMalloc(&counter, sizeof(uint64_t)));
  FERRY_CHECK_CUDA(cudaMalloc(&mismatches, sizeof(uint32_t)));
  FERRY_CHECK_CUDA(cudaMemset(counter, 0, sizeof(uint64_t)));
  FERRY_CHECK_CUDA(cudaMemset(mismatches, 0, sizeof(uint32_t)));
  auto round = [&] {
    launch_stamp(peer_slot, counter, stream);
    comm->barrier(stream);
    launch_verify(own_slot, counter, mismatches, stream);
    comm->barrier(stream);
  };

  // 1. eager: 1000 barriers
  for (int i = 0; i < 500; ++i) round();
  comm->check_errors(stream);
  uint32_t bad = 0;
  FERRY_CHECK_CUDA(cudaMemcpy(&bad, mismatches, sizeof(bad), cudaMemcpyDeviceToHost));
  FERRY_CHECK(bad == 0, bad, " of 500 eager rounds saw a stale stamp from rank ", peer);

  // 2. barrier-only loop, timed (informational)
  cudaEvent_t start, stop;
  FERRY_CHECK_CUDA(cudaEventCreate(&start));
  FERRY_CHECK_CUDA(cudaEventCreate(&stop));
  comm->barrier(stream);
  FERRY_CHECK_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < 1000; ++i) comm->barrier(stream);
  FERRY_CHECK_CUDA(cudaEventRecord(stop, stream));
  comm->check_errors(stream);
  float ms = 0;
  FERRY_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));

  // 3. graph: the epoch lives on the device, so replays need no host help
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FERRY_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  round();
  FERRY_CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  FERRY_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 100; ++i) FERRY_CHECK_CUDA(cudaGraphLaunch(exec, stream));
  comm->check_errors(stream);
  uint64_t stamps = 0;
  FERRY_CHECK_CUDA(cudaMemcpy(&bad, mismatches, sizeof(bad), cudaMemcpyDeviceToHost));
  FERRY_CHECK_CUDA(cudaMemcpy(&stamps, counter, sizeof(stamps), cudaMemcpyDeviceToHost));
  FERRY_CHECK(bad == 0, bad, " of 100 graph replays saw a stale stamp from rank ", peer);
  FERRY_CHECK(stamps == 600, "the stamp counter is ", stamps, " after 500 eager rounds and 100 replays, expected 600");

  // 4. eager again after the replays
  round();
  comm->check_errors(stream);
  FERRY_CHECK_CUDA(cudaMemcpy(&bad, mismatches, sizeof(bad), cudaMemcpyDeviceToHost));
  FERRY_CHECK(bad == 0, "an eager round after the graph replays saw a stale stamp");

  FERRY_CHECK_CUDA(cudaGraphExecDestroy(exec));
  FERRY_CHECK_CUDA(cudaGraphDestroy(graph));
  FERRY_CHECK_CUDA(cudaEventDestroy(start));
  FERRY_CHECK_CUDA(cudaEventDestroy(stop));
  FERRY_CHECK_CUDA(cudaFree(counter));
  FERRY_CHECK_CUDA(cudaFree(mismatches));
  FERRY_CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("rank %d: 1201 data-checked barriers + 100 graph replays ok; barrier alone %.2f us\n", rank, ms);
  return 0;
}

// Rank 1 never enters the barrier: rank 0 must get a TimeoutError naming rank 1 within FERRY_TIMEOUT_S (+ margin),
// and the communicator must then refuse every call.
FERRY_RANK_CASE(barrier_timeout) {
  auto comm = make_comm();
  int const rank = comm->rank();
  double const timeout_s = std::stod(rank_case_args().at(0));
  if (rank != 0) {
    // Sleep past rank 0's timeout and leave without the collective teardown: rank 0 has aborted its communicator,
    // so a collective destroy here could only wait for it.
    std::this_thread::sleep_for(std::chrono::duration<double>(timeout_s + 2.0));
    std::fflush(nullptr);
    _exit(0);
  }
  cudaStream_t stream = nullptr;
  FERRY_CHECK_CUDA(cudaStreamCreate(&stream));
  auto const start = std::chrono::steady_clock::now();
  comm->barrier(stream);
  std::string message;
  try {
    comm->check_errors(stream);
  } catch (TimeoutError const& error) {
    message = error.what();
  }
  double const elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  FERRY_CHECK(!message.empty(), "the barrier without rank 1 ended without a TimeoutError");
  FERRY_CHECK(message.find("waiting for rank 1") != std::string::npos,
              "the TimeoutError does not name rank 1: ", message);
  FERRY_CHECK(elapsed >= 0.9 * timeout_s && elapsed <= timeout_s + 3.0, "the TimeoutError came after ", elapsed,
              " s; FERRY_TIMEOUT_S=", timeout_s);
  FERRY_CHECK(comm->failed(), "failed() is false after a timeout");
  std::string later;
  try {
    comm->ensure_usable();
  } catch (Error const& error) {
    later = error.what();
  }
  FERRY_CHECK(later.find("failed earlier") != std::string::npos && later.find("rank 1") != std::string::npos,
              "ensure_usable() after the timeout said: '", later, "'");
  bool refused = false;
  try {
    comm->barrier(stream);
  } catch (Error const&) {
    refused = true;
  }
  FERRY_CHECK(refused, "barrier() on a failed communicator did not throw");
  comm.reset();  // the abort path: local only
  FERRY_CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("rank 0: TimeoutError after %.2f s: %s\n", elapsed, message.c_str());
  return 0;
}

// Ids dropped on the device come back as InputError naming the first bad value; the counters reset and the
// communicator stays usable.
FERRY_RANK_CASE(device_input_errors) {
  auto comm = make_comm();
  cudaStream_t stream = nullptr;
  FERRY_CHECK_CUDA(cudaStreamCreate(&stream));
  launch_record_input_errors(comm->device_view(), 4242, 3, 2, stream);
  std::string message;
  try {
    comm->check_errors(stream);
  } catch (InputError const& error) {
    message = error.what();
  }
  FERRY_CHECK(message.find("4242") != std::string::npos && message.find("3 id(s)") != std::string::npos &&
                  message.find("2 row(s)") != std::string::npos,
              "the InputError said: '", message, "'");
  comm->check_errors(stream);  // reset: no second report
  FERRY_CHECK(!comm->failed(), "an input error marked the communicator failed");
  comm->barrier(stream);
  comm->check_errors(stream);
  FERRY_CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

// 100 create/destroy cycles (one rendezvous shared by all) leave the free device memory where it was.
FERRY_RANK_CASE(create_destroy_cycles) {
  int const cycles = std::stoi(rank_case_args().at(0));
  auto shared = make_socket_bootstrap(socket_bootstrap_options_from_env());
  FERRY_CHECK_CUDA(cudaSetDevice(shared->local_rank()));
  cudaStream_t stream = nullptr;
  FERRY_CHECK_CUDA(cudaStreamCreate(&stream));
  auto cycle = [&] {
    auto comm = Communicator::create(std::make_unique<BorrowedBootstrap>(*shared), CommunicatorOptions{Backend::cuda});
    comm->alloc_symmetric(8 << 20);
    comm->barrier(stream);
    comm->check_errors(stream);
  };
  // 1. warm up (NCCL and the driver keep some memory for the process's lifetime)
  for (int i = 0; i < 3; ++i) cycle();
  std::size_t free_before = 0, free_after = 0, total = 0;
  FERRY_CHECK_CUDA(cudaMemGetInfo(&free_before, &total));
  auto const start = std::chrono::steady_clock::now();
  for (int i = 0; i < cycles; ++i) cycle();
  double const seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  FERRY_CHECK_CUDA(cudaMemGetInfo(&free_after, &total));
  double const lost_mib = (static_cast<double>(free_before) - static_cast<double>(free_after)) / (1 << 20);
  std::printf("rank %d: %d cycles in %.1f s, free device memory changed by %.1f MiB\n", shared->rank(), cycles, seconds,
              -lost_mib);
  // NOTE: one leaked cycle would cost at least the 8 MiB region (plus NCCL's buffers); allow allocator noise only.
  FERRY_CHECK(lost_mib < 64, cycles, " create/destroy cycles lost ", lost_mib, " MiB of device memory");
  FERRY_CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

#endif  // FERRY_HAVE_CUDA

TEST(CudaComm, SymmetricPeerWriteRead) {
  FERRY_REQUIRE_GPUS(2);
  std::string const seed = fresh_seed();
  std::printf("seed %s (FERRY_TEST_SEED=%s replays it)\n", seed.c_str(), seed.c_str());
  RankCaseOptions options;
  options.args = {seed};
  expect_ok(run_rank_case("symmetric_peer_rw", 2, options));
}

TEST(CudaComm, BarrierManyAndInGraph) {
  FERRY_REQUIRE_GPUS(2);
  expect_ok(run_rank_case("barrier_many", 2));
}

TEST(CudaComm, BarrierTimeoutNamesMissingRank) {
  FERRY_REQUIRE_GPUS(2);
  RankCaseOptions options;
  options.args = {"2"};
  options.env = {{"FERRY_TIMEOUT_S", "2"}};
  options.timeout = std::chrono::seconds(60);
  expect_ok(run_rank_case("barrier_timeout", 2, options));
}

TEST(CudaComm, DeviceInputErrors) {
  FERRY_REQUIRE_GPUS(2);
  expect_ok(run_rank_case("device_input_errors", 2));
}

TEST(CudaComm, CreateDestroyCyclesDoNotLeak) {
  FERRY_REQUIRE_GPUS(2);
  RankCaseOptions options;
  options.args = {"100"};
  options.timeout = std::chrono::seconds(400);
  expect_ok(run_rank_case("create_destroy_cycles", 2, options));
}

TEST(CudaComm, NcclVersionMatchesHeaders) {
  FERRY_REQUIRE_GPUS(1);
#if FERRY_HAVE_CUDA
  int loaded = 0;
  ASSERT_EQ(ncclGetVersion(&loaded), ncclSuccess);
  EXPECT_EQ(loaded, NCCL_VERSION_CODE) << "the loaded NCCL differs from the headers Ferry was built with; the "
                                          "communicator refuses to start (FERRY_NCCL_VERSION_CHECK)";
#endif
}

}  // namespace
}  // namespace ferry::test
