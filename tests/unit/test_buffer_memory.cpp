// Sizes have a ceiling (src/ep/buffer_memory.hpp): an EpBuffer whose config needs more memory than its ranks have
// free is refused on every rank, before anything is allocated, with the bytes it needs and the bytes free; a sane
// config on the same communicator still works. Before, expert_capacity=2**28 mapped tens of GiB per rank and 2**30
// got the process killed by the kernel's OOM killer.
// Checked to fail: with check_memory's call taken out of EpBuffer's constructor, expert_capacity=2**28 (mode=ll) built
// its buffer on both ranks ("rank 0 ll expert_capacity=268435456: no error"; the 2**30 case, which the OOM killer
// ended before, was not run so).
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ep/buffer_memory.hpp"
#include "ep/reference.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/cpu_ranks.hpp"
#include "support/host_fixtures.hpp"
#include "support/rank_case.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

namespace ferry::test {
namespace {

using detail::buffer_memory;
using detail::BufferMemory;
using detail::FreeMemory;
using detail::memory_shortfall;

// The process's peak of mapped memory (VmPeak), in bytes.
uint64_t vm_peak() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    uint64_t kib = 0;
    if (key == "VmPeak:" && in >> kib) return kib * 1024;
    std::string rest;
    std::getline(in, rest);
  }
  return 0;
}

EpConfig small_config(Mode mode) {
  EpConfig config;
  config.mode = mode;
  config.hidden = 128;
  config.num_experts = 8;
  config.topk = 2;
  config.max_tokens_per_rank = 16;
  return config;
}

// The formula grows with every size a user sets, and saturates instead of wrapping around.
TEST(BufferMemory, GrowsWithEverySizeAndSaturates) {
  Topology const one{1, 2};
  for (Backend backend : {Backend::cpu, Backend::cuda}) {
    for (Mode mode : {Mode::normal, Mode::low_latency}) {
      EpConfig const base = small_config(mode).resolved(2);
      uint64_t const bytes = buffer_memory(base, one, backend).total();
      EXPECT_GT(bytes, 0u);
      auto const grows = [&](char const* what, auto&& change) {
        EpConfig bigger = base;
        change(bigger);
        EXPECT_GT(buffer_memory(bigger.resolved(2), one, backend).total(), bytes)
            << what << " " << backend_name(backend) << " " << mode_name(mode);
      };
      grows("hidden", [](EpConfig& c) { c.hidden *= 2; });
      grows("max_tokens_per_rank", [](EpConfig& c) { c.max_tokens_per_rank *= 2; });
      grows("topk", [](EpConfig& c) { c.topk *= 2; });
      grows("expert_capacity", [](EpConfig& c) { c.expert_capacity = 4096; });
      if (mode == Mode::normal) {  // a cap under world x max_tokens_per_rank, raised
        EpConfig capped = base;
        capped.max_recv_tokens = 8;
        EpConfig raised = base;
        raised.max_recv_tokens = 16;
        EXPECT_GT(buffer_memory(raised, one, backend).total(), buffer_memory(capped, one, backend).total())
            << "max_recv_tokens " << backend_name(backend);
      }
      EXPECT_GT(buffer_memory(base, Topology{2, 1}, backend).total(), 0u);
    }
  }
  EpConfig huge = small_config(Mode::normal);
  huge.num_experts = 64;
  huge.hidden = 1 << 30;
  huge.expert_capacity = 1 << 30;
  BufferMemory const saturated = buffer_memory(huge, Topology{1, 2}, Backend::cpu);
  EXPECT_EQ(saturated.total(), UINT64_MAX);
  EXPECT_TRUE(contains(saturated.describe(), "more than 16 EiB")) << saturated.describe();
}

// What a rank lacks, in the words of the refusal: bytes needed for the host's ranks, bytes free, and where.
TEST(BufferMemory, ShortfallNamesNeedAndFree) {
  BufferMemory need;
  need.symmetric = 3ull << 30;
  need.local = 1ull << 30;
  FreeMemory free;
  free.shared = 8ull << 30;
  free.local = 16ull << 30;
  EXPECT_EQ(memory_shortfall(need, free, Backend::cpu, 2), "");
  std::string const shared = memory_shortfall(need, free, Backend::cpu, 3);
  EXPECT_TRUE(contains(shared,
                       "needs 9.0 GiB of shared memory for the 3 ranks of this host (3 x 3221225472 bytes), "
                       "8.0 GiB (8589934592 bytes) free in /dev/shm"))
      << shared;
  free.shared = UINT64_MAX;
  std::string const physical = memory_shortfall(need, free, Backend::cpu, 5);
  EXPECT_TRUE(contains(physical,
                       "needs 20.0 GiB of memory for the 5 ranks of this host (5 x 4294967296 bytes), 16.0 "
                       "GiB (17179869184 bytes) of physical memory free (MemAvailable)"))
      << physical;
  std::string const device = memory_shortfall(need, FreeMemory{UINT64_MAX, 2ull << 30}, Backend::cuda, 1);
  EXPECT_TRUE(contains(device,
                       "needs 4.0 GiB of device memory (4294967296 bytes), 2.0 GiB (2147483648 bytes) free "
                       "(cudaMemGetInfo)"))
      << device;
}

// expert_capacity = 2**28 and 2**30 (low-latency mode, and normal mode with an expert-major layout) are refused on
// every rank with what they need and what is free, and nothing is mapped; then a sane buffer on the same
// communicator moves every row exactly as the reference does.
TEST(BufferMemory, SizesPastTheMachineAreRefusedOnEveryRankBeforeAnythingIsMapped) {
  uint64_t const seed = test_seed();
  std::vector<std::string> const failures = run_cpu_ranks(2, [&](int rank, std::shared_ptr<Communicator> const& comm) {
    for (Mode mode : {Mode::low_latency, Mode::normal}) {
      for (int capacity : {1 << 28, 1 << 30}) {
        EpConfig config = small_config(mode);
        config.expert_capacity = capacity;
        uint64_t const before = vm_peak();
        std::string const problem = expect_error<ConfigError>(
            [&] { EpBuffer buffer(comm, config); },
            {"this EpBuffer needs ", " bytes symmetric, ",
             " bytes local, backend cpu), more than is free: rank 0 needs ", "; rank 1 needs ",
             " bytes) of physical memory free (MemAvailable)",
             "nothing was allocated on any rank: no expert receives more than world x max_tokens_per_rank = 32 rows, "
             "so expert_capacity=" +
                 std::to_string(capacity)});
        FERRY_CHECK(problem.empty(), "rank ", rank, " ", mode_name(mode), " expert_capacity=", capacity, ": ", problem);
        uint64_t const grew = vm_peak() - before;
        FERRY_CHECK(grew < (uint64_t{256} << 20), "rank ", rank, ": the refused buffer mapped ", grew, " bytes");
      }
    }
    // a sane buffer on the same communicator: every received row as the reference
    EpConfig const config = small_config(Mode::normal);
    EpBuffer buffer(comm, config);
    RoutingOptions routing;
    routing.seed = seed;
    std::vector<int> const tokens = {11, 16};
    std::vector<ref::RankInput> const inputs = ref::generate_inputs(config, 2, routing, tokens);
    DispatchResult const out = buffer.dispatch(host_dispatch_args(inputs[static_cast<std::size_t>(rank)]));
    ref::RankDispatch const want = ref::dispatch(config, 2, rank, inputs);
    FERRY_CHECK(out.num_recv_host == want.num_recv, "rank ", rank, ": ", out.num_recv_host, " rows, want ",
                want.num_recv);
    FERRY_CHECK(same_bytes(out.recv_x, want.recv_x.data(), want.recv_x.size() * sizeof(uint16_t)), "rank ", rank,
                ": recv_x differs from the reference");
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(failures[static_cast<std::size_t>(r)], "") << "rank " << r;
}

}  // namespace
}  // namespace ferry::test
