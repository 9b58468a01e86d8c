// The per-source wait statistics of the low-latency receive halves (EpConfig::wait_stats, src/ep/cuda/wait_stats.cuh)
// and the cuda side of rank masking, on virtual ranks of ONE GPU (tests/support/virtual_ranks.hpp, as
// test_ll_virtual.cu). Wait statistics at worlds 2 and 4: after `calls` dispatch + combine pairs (whole, then split by
// the hook) every rank holds exactly `calls` waits per source and leg, every peer's count is non-zero, one source
// held back by a spin kernel before its dispatch is the longest wait of every other rank, the results stay exact, and
// with the pointer off (null, EpConfig::wait_stats false) nothing is recorded. Rank masking: written against the
// contract (docs/internode.md, "Rank masking") and skipped while CudaEp refuses EpConfig::rank_masking.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "ep/cuda/buffers.hpp"
#include "ep/cuda/wait_stats.cuh"
#include "ep/ep_impl.hpp"
#include "ep/reference.hpp"
#include "ferry/ep.hpp"
#include "support/gpu_case.hpp"
#include "support/ll_check.hpp"
#include "support/virtual_ranks.hpp"
#include "workloads/routing.hpp"

namespace ferry::test {
namespace {

using cuda_ep::Buffers;
using cuda_ep::Half;
using VirtualLlRanks = VirtualRanks<Buffers, cuda_ep::allocate_buffers, cuda_ep::free_buffers>;

// Holds a stream for `ns` of %globaltimer: a source that comes late to its dispatch.
__global__ void spin_for(uint64_t ns) {
  uint64_t const start = device::arch::global_timer_ns();
  while (device::arch::global_timer_ns() - start < ns) {
  }
}

std::vector<wait_stats::Slot> read_stats(Buffers const& b) {
  std::vector<wait_stats::Slot> out(static_cast<std::size_t>(wait_stats::kLegs) * b.world);
  CK(cudaMemcpy(out.data(), b.wait_stats, out.size() * sizeof(wait_stats::Slot), cudaMemcpyDeviceToHost));
  return out;
}

EpConfig stats_config(int world, bool stats) {
  EpConfig user;
  user.mode = Mode::low_latency;
  user.hidden = 2048;
  user.num_experts = 16 * world;
  user.topk = 4;
  user.max_tokens_per_rank = 64;
  user.wait_stats = stats;
  user.validate(world);
  return user.resolved(world);
}

void run_stats(int world) {
  int const ctas = virtual_ctas_per_rank(world, cuda_ep::kMaxLlCtas);
  if (ctas < 1) GTEST_SKIP() << "fewer SMs than " << world << " ranks";
  EpConfig const config = stats_config(world, true);
  cuda_ep::SymLayout const layout = cuda_ep::make_sym_layout(config, world, cuda_ep::Protocol::ll);
  VirtualLlRanks ranks(world, layout.total, [&](Buffers& b, int r) {
    cuda_ep::configure_buffers(b, config, world, r, cuda_ep::Protocol::ll, ctas);
    b.num_ctas = ctas;
    b.layout = layout;
  });
  for (int r = 0; r < world; ++r) ASSERT_NE(ranks[r].wait_stats, nullptr) << "wait_stats=true allocated no array";
  std::vector<int> const tokens(static_cast<std::size_t>(world), config.max_tokens_per_rank);
  std::vector<VirtualRankIo> io;
  io.reserve(world);
  for (int r = 0; r < world; ++r) io.emplace_back(config, world, tokens[r]);
  std::vector<DispatchArgs> dargs(world);
  std::vector<CombineArgs> em(world);
  for (int r = 0; r < world; ++r) {
    dargs[r].x = io[r].x.ptr;
    dargs[r].num_tokens = tokens[r];
    dargs[r].topk_idx = io[r].idx.ptr;
    dargs[r].topk_idx_type = IndexType::int64;
    dargs[r].topk_weights = static_cast<float const*>(io[r].w.ptr);
    em[r] = CombineArgs{CombineLayout::expert_major, io[r].eout.ptr, io[r].y_em.ptr};
  }
  uint64_t const seed = fresh_seed();
  std::printf("world %d x %d CTAs, seed %llu\n", world, ctas, static_cast<unsigned long long>(seed));
  int const late = world - 1;
  uint64_t const late_ns = 2'000'000;  // 2 ms: far above an NVLink round trip
  int const calls = 4;
  std::vector<int> const none(static_cast<std::size_t>(world), 0);
  for (int call = 0; call < calls; ++call) {
    bool const hook = call % 2 == 1;
    RoutingOptions routing;
    routing.seed = seed + static_cast<uint64_t>(call);
    VirtualIteration const it(config, world, routing, tokens, io);
    for (int r = 0; r < world; ++r)
      poison_ll_dispatch(config, world, cuda_ep::dispatch_result(ranks[r], true), ranks[r].recv_slot);
    CK(cudaDeviceSynchronize());
    // the late source, before its dispatch; not in the first calls: a kernel's first launch in the process loads its
    // module, which waits for the running spin, so every rank would start late alike
    if (call == 2) spin_for<<<1, 1, 0, ranks.stream(late)>>>(late_ns);
    for (Half half : hook ? std::vector<Half>{Half::send, Half::recv} : std::vector<Half>{Half::both})
      for (int r = 0; r < world; ++r) cuda_ep::launch_ll_dispatch(ranks[r], dargs[r], half, ranks.stream(r));
    for (Half half : hook ? std::vector<Half>{Half::send, Half::recv} : std::vector<Half>{Half::both})
      for (int r = 0; r < world; ++r) cuda_ep::launch_ll_combine(ranks[r], em[r], tokens[r], half, ranks.stream(r));
    std::string const failure = ranks.synchronize(none);
    ASSERT_TRUE(failure.empty()) << "call " << call << ":\n" << failure;
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(check_ll_dispatch(config, world, r, call, it.expected[r], cuda_ep::dispatch_result(ranks[r], true),
                                  ranks[r].recv_slot),
                0);
      auto const y = ref::combine_expert_major(config, world, r, it.inputs, it.expected, it.eout);
      ASSERT_EQ(check_combined("y expert-major", io[r].y_em.ptr, y, kVirtualGuardElems, r, call), 0);
    }
  }
  for (int r = 0; r < world; ++r) {
    std::vector<wait_stats::Slot> const stats = read_stats(ranks[r]);
    for (int leg = 0; leg < wait_stats::kLegs; ++leg)
      for (int s = 0; s < world; ++s) {
        wait_stats::Slot const& slot = stats[static_cast<std::size_t>(leg) * world + s];
        EXPECT_EQ(slot.waits, static_cast<unsigned long long>(calls))
            << "rank " << r << (leg == 0 ? " dispatch" : " combine") << " source " << s;
        EXPECT_LE(slot.max_ns, slot.total_ns) << "rank " << r << " source " << s;
      }
    if (r == late) continue;
    // every other rank waited for the late source the longest in its dispatch (the spin held its send half back)
    unsigned long long const late_max = stats[late].max_ns;
    EXPECT_GE(late_max, late_ns / 2) << "rank " << r << ": the late source's longest wait";
    for (int s = 0; s < world; ++s)
      if (s != late) EXPECT_LT(stats[s].max_ns, late_max) << "rank " << r << ": source " << s << " waited longer";
    std::printf("rank %d: dispatch waits for source %d: %llu, max %llu ns (the late one); for source 0: max %llu ns\n",
                r, late, stats[late].waits, late_max, stats[0].max_ns);
  }

  // off: the kernels get a null pointer (what EpConfig::wait_stats=false gives them) and record nothing
  for (int r = 0; r < world; ++r) CK(cudaMemset(ranks[r].wait_stats, 0, sizeof(wait_stats::Slot) * 2 * world));
  std::vector<Buffers> off;
  for (int r = 0; r < world; ++r) {
    off.push_back(ranks[r]);
    off.back().wait_stats = nullptr;
  }
  RoutingOptions routing;
  routing.seed = seed + 99;
  VirtualIteration const it(config, world, routing, tokens, io);
  for (int r = 0; r < world; ++r) cuda_ep::launch_ll_dispatch(off[r], dargs[r], Half::both, ranks.stream(r));
  for (int r = 0; r < world; ++r) cuda_ep::launch_ll_combine(off[r], em[r], tokens[r], Half::both, ranks.stream(r));
  std::string const failure = ranks.synchronize(none);
  ASSERT_TRUE(failure.empty()) << "the call without statistics:\n" << failure;
  for (int r = 0; r < world; ++r)
    for (wait_stats::Slot const& slot : read_stats(ranks[r]))
      EXPECT_TRUE(slot.waits == 0 && slot.total_ns == 0 && slot.max_ns == 0) << "rank " << r << " recorded while off";
}

TEST(WaitStatsVirtual, EveryPeerCountedOncePerCallWorld2) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU, found 0";
  run_stats(2);
}

TEST(WaitStatsVirtual, EveryPeerCountedOncePerCallWorld4) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU, found 0";
  run_stats(4);
}

// Rank masking on the cuda backend: rank `masked` skips a dispatch; the other ranks' calls must end within their
// bound without a recorded timeout, and every row they return equal the reference of the world without it
// (ref::without_ranks). Skipped while CudaEp refuses EpConfig::rank_masking (the kernels' side is not built yet):
// remove the skip once Buffers carries the mask to the kernels.
TEST(RankMaskingVirtual, SkippedRankIsMaskedAndTheOthersMatchTheReference) {
  GTEST_SKIP() << "rank masking is built on the cpu backend only in this version: CudaEp refuses "
                  "EpConfig::rank_masking with ConfigError (docs/internode.md, 'Rank masking'); enable this test "
                  "with the kernels' masking";
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU, found 0";
  int const world = 4;
  int const masked = 2;
  int const ctas = virtual_ctas_per_rank(world, cuda_ep::kMaxLlCtas);
  if (ctas < 1) GTEST_SKIP() << "fewer SMs than " << world << " ranks";
  EpConfig config = stats_config(world, false);
  config.rank_masking = true;
  cuda_ep::SymLayout const layout = cuda_ep::make_sym_layout(config, world, cuda_ep::Protocol::ll);
  VirtualLlRanks ranks(
      world, layout.total,
      [&](Buffers& b, int r) {
        cuda_ep::configure_buffers(b, config, world, r, cuda_ep::Protocol::ll, ctas);
        b.num_ctas = ctas;
        b.layout = layout;
      },
      kAbsentTimeoutS);
  std::vector<int> const tokens(static_cast<std::size_t>(world), config.max_tokens_per_rank);
  std::vector<VirtualRankIo> io;
  io.reserve(world);
  for (int r = 0; r < world; ++r) io.emplace_back(config, world, tokens[r]);
  RoutingOptions routing;
  routing.seed = fresh_seed();
  VirtualIteration const it(config, world, routing, tokens, io);
  ref::MaskedWorld const kept = ref::without_ranks(config, world, it.inputs, 1U << masked);
  for (int r = 0; r < world; ++r) {
    if (r == masked) continue;  // never arrives
    DispatchArgs args;
    args.x = io[r].x.ptr;
    args.num_tokens = tokens[r];
    args.topk_idx = io[r].idx.ptr;
    args.topk_idx_type = IndexType::int64;
    args.topk_weights = static_cast<float const*>(io[r].w.ptr);
    cuda_ep::launch_ll_dispatch(ranks[r], args, Half::both, ranks.stream(r));
  }
  std::vector<DeviceErrorBlock> const blocks = ranks.take_errors();
  for (int r = 0; r < world; ++r) {
    if (r == masked) continue;
    EXPECT_EQ(blocks[r].status, 0u) << "rank " << r << " failed instead of masking rank " << masked;
    ref::RankDispatch const want = ref::dispatch(config, world, r, kept.inputs);
    EXPECT_EQ(
        check_ll_dispatch(config, world, r, 0, want, cuda_ep::dispatch_result(ranks[r], true), ranks[r].recv_slot), 0);
  }
}

}  // namespace
}  // namespace ferry::test
