// Normal mode with several ranks on ONE GPU ("virtual ranks", tests/support/virtual_ranks.hpp). A normal-mode rank's
// kernels address their peers only through Buffers::sym (every rank's symmetric region) and their DeviceView, so W
// ranks fit on one device: a VirtualWorld's regions, error blocks and streams, and each rank's local buffers
// (allocate_buffers). The dispatch and combine grids are launched non-cooperatively (Buffers::cooperative = false)
// with SMs / W CTAs each (Buffers::num_sms), so all W of them are co-resident. This is how the normal-mode kernels run
// at worlds 4 and 8 where no machine of that many GPUs is lent: the protocol (count exchange or landing zone, tiles
// and flags, the combine's claims) is the same; the NVLink timing is not.
//
// Each case draws fresh inputs every iteration (seed printed), poisons every output first, runs dispatch (and expand),
// the rank-major combine and the expert-major combine back to back on every rank, checks every rank's error block and
// compares every rank's outputs with the reference bit for bit (tests/support/normal_check.hpp): bf16 dispatch over
// both protocols, combine in bf16, fp8, nvfp4 and mxfp4, at worlds 2, 4 and 8; and, with one rank absent from a
// dispatch or a combine, that every other rank's wait ends in a timeout naming it. Needs one GPU; skips without one,
// and skips a world the GPU cannot hold one CTA per rank of.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "ep/cuda/buffers.hpp"
#include "ep/ep_impl.hpp"
#include "ep/landing_policy.hpp"
#include "ep/reference.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"
#include "support/gpu_case.hpp"
#include "support/ll_check.hpp"
#include "support/normal_check.hpp"
#include "support/virtual_ranks.hpp"
#include "workloads/routing.hpp"

namespace ferry::test {
namespace test_normal_virtual {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

using cuda_ep::Buffers;

struct Spec : VirtualSpec {
  std::string protocol = "auto";  // protocol=landing|counts|auto: the dispatch's (FERRY_NORMAL_LANDING's values)
  bool expand = false;            // expand=1: the dispatch lays the rows out expert-major
  int capacity = 0;               // capacity=: expert_capacity (0: recv_capacity, every entry gets a slot)
  WireFormat combine_format = WireFormat::bf16;
};

Spec parse_spec(std::vector<std::string> const& words) {
  CaseArgs const args(words);
  Spec s;
  s.read_virtual(args);
  s.protocol = args.text("protocol", s.protocol);
  s.expand = args.flag("expand", s.expand);
  s.capacity = args.integer("capacity", s.capacity);
  s.combine_format = parse_wire_format(args.text("combine", "bf16"));
  return s;
}

// `world` ranks of one normal-mode EpBuffer on the current GPU: what CudaEp sets up per rank (no tuning table: the
// analytic grids).
using VirtualNormalRanks = VirtualRanks<Buffers, cuda_ep::allocate_buffers, cuda_ep::free_buffers>;

// The config a user would pass for `spec` (backend_config validates and resolves it): an expert capacity in every
// case, so the expert-major combine runs in each (entries past it have no slot: the reference drops them too).
EpConfig user_config(Spec const& spec) {
  EpConfig user = spec.config();
  user.combine_format = spec.combine_format;
  user.expert_capacity = spec.capacity > 0 ? spec.capacity : user.recv_capacity(spec.world);
  return user;
}

// Runs `spec` on spec.world virtual ranks of num_ctas CTAs each; fails the calling test at the first mismatch.
void run_virtual(Spec const& spec, int num_ctas) {
  int const world = spec.world;
  std::vector<int> const tokens = per_rank(spec.tokens, world);  // the lists repeat over the ranks
  EpConfig const config = backend_config(user_config(spec), world);
  // the dispatch protocol, pinned as FERRY_NORMAL_LANDING pins it
  detail::LandingChoice const landing = detail::choose_normal_landing(config, world,
                                                                      spec.protocol == "landing"  ? "on"
                                                                      : spec.protocol == "counts" ? "off"
                                                                                                  : "auto");
  cuda_ep::Protocol const protocol = landing.use ? cuda_ep::Protocol::landing : cuda_ep::Protocol::push;
  cuda_ep::SymLayout const layout = cuda_ep::make_sym_layout(config, world, protocol);
  VirtualNormalRanks ranks(
      world, layout.total,
      [&](Buffers& b, int r) {
        cuda_ep::configure_buffers(b, config, world, r, protocol, num_ctas);
        b.layout = layout;
      },
      spec.timeout_s());
  std::printf(
      "world %d x %d SMs: seed %llu routing %s hidden %d topk %d experts %d slots %d dispatch protocol %s expand %d "
      "combine %s\n",
      world, num_ctas, static_cast<unsigned long long>(spec.seed), spec.routing.c_str(), config.hidden, config.topk,
      config.num_experts, config.expert_slots(), landing.use ? "landing" : "count exchange", spec.expand,
      wire_format_name(config.combine_format));
  std::fflush(stdout);
  std::vector<VirtualRankIo> io;
  io.reserve(world);
  for (int r = 0; r < world; ++r) io.emplace_back(config, world, tokens[r]);
  std::vector<DispatchArgs> dargs(world);
  std::vector<CombineArgs> em(world), rm(world);
  for (int r = 0; r < world; ++r) {
    dargs[r].x = io[r].x.ptr;
    dargs[r].num_tokens = tokens[r];
    dargs[r].topk_idx = io[r].idx.ptr;
    dargs[r].topk_idx_type = IndexType::int64;
    dargs[r].topk_weights = static_cast<float const*>(io[r].w.ptr);
    dargs[r].expand = spec.expand;
    em[r] = CombineArgs{CombineLayout::expert_major, io[r].eout.ptr, io[r].y_em.ptr, true};
    rm[r] = CombineArgs{CombineLayout::rank_major, io[r].rows.ptr, io[r].y_rm.ptr, true};
    // the host checks an EpBuffer makes before its backend runs
    detail::validate_dispatch_args(config, dargs[r]);
    // (without expand this test computes the slots itself: launch_expand without copies, below)
    detail::validate_combine_args(config, em[r], true, /*last_expand=*/true, tokens[r]);
    detail::validate_combine_args(config, rm[r], true, true, tokens[r]);
  }

  for (int iter = 0; iter < spec.iters; ++iter) {
    // 1. every rank's inputs (fresh), the reference, and the combine inputs (deterministic in (seed, rank)); y poisoned
    VirtualIteration const it(config, world, spec.routing_options(iter), tokens, io);
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(it.expected[r].dropped_rows, 0) << "rank " << r << ": the case must fit recv_capacity";
      // 2. poison what the dispatch writes
      poison_normal_dispatch(config, world, cuda_ep::dispatch_result(ranks[r], spec.expand));
    }
    CK(cudaDeviceSynchronize());
    if (spec.absent >= 0) {
      // rank `absent` skips the dispatch or the rank-major combine: every other rank's leg must time out naming it
      run_absent_rank(
          ranks, spec, std::vector<int>(world, 0),
          [&](int skip) {
            for (int r = 0; r < world; ++r)
              if (r != skip)
                cuda_ep::launch_dispatch(ranks[r], dargs[r], cuda_ep::plan_dispatch(ranks[r], tokens[r]),
                                         ranks.stream(r));
          },
          [&](int skip) {
            for (int r = 0; r < world; ++r)
              if (r != skip)
                cuda_ep::launch_combine(ranks[r], rm[r], cuda_ep::plan_combine(ranks[r], tokens[r]), tokens[r],
                                        ranks.stream(r));
          });
      return;
    }

    // 3. dispatch (+ expand), rank-major combine, expert-major combine (its slots computed first when the dispatch did
    //    not expand, as CudaEp does): each leg launched on every rank before the next leg, the legs back to back on
    //    each rank's stream. Leg by leg, not rank by rank: a kernel's first launch may load its module, which waits for
    //    the context's running kernels (lazy loading, the CUDA default), and rank 0's dispatch waits for rank 1's; with
    //    rank 0's expand launched before rank 1's dispatch, the host waited in that load until rank 0 timed out.
    for (int r = 0; r < world; ++r)
      cuda_ep::launch_dispatch(ranks[r], dargs[r], cuda_ep::plan_dispatch(ranks[r], tokens[r]), ranks.stream(r));
    if (spec.expand)
      for (int r = 0; r < world; ++r) cuda_ep::launch_expand(ranks[r], /*copy_rows=*/true, ranks.stream(r));
    for (int r = 0; r < world; ++r)
      cuda_ep::launch_combine(ranks[r], rm[r], cuda_ep::plan_combine(ranks[r], tokens[r]), tokens[r], ranks.stream(r));
    if (!spec.expand)
      for (int r = 0; r < world; ++r) cuda_ep::launch_expand(ranks[r], /*copy_rows=*/false, ranks.stream(r));
    for (int r = 0; r < world; ++r)
      cuda_ep::launch_combine(ranks[r], em[r], cuda_ep::plan_combine(ranks[r], tokens[r]), tokens[r], ranks.stream(r));
    // normal mode counts no dropped entries in the error block (expand skips those past expert_capacity)
    std::string const failure = ranks.synchronize(std::vector<int>(world, 0));
    ASSERT_TRUE(failure.empty()) << "iter " << iter << ":\n" << failure;

    // 4. every rank's outputs against the reference
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " iter " + std::to_string(iter));
      ASSERT_EQ(check_normal_dispatch(config, world, r, iter, it.expected[r],
                                      cuda_ep::dispatch_result(ranks[r], spec.expand), /*poisoned=*/true, spec.expand),
                0);
      ASSERT_EQ(it.check_combines(config, world, r, iter, io[r]), 0);
    }
  }
  std::printf("world %d: %d iterations exact on every rank\n", world, spec.iters);
}

void run_rows(std::vector<std::vector<std::string>> const& table) {
  run_virtual_rows(table, cuda_ep::kMaxLandCtas, parse_spec, user_config, run_virtual);
}

// The shapes of one world: a decode batch of DeepSeek's shape (the landing zone), tokens that differ per rank (0
// included) with topk 9 and masked entries over the count exchange, topk 1 with ring routing, group-limited routing
// at an odd hidden, no tokens at all, and batches of several waves of combine tiles (claimed sums) in each combine
// format, one with a hot expert past its capacity. The tokens lists repeat over the ranks; the capacities keep the
// reference's expert-major rows to a few million elements a rank.
std::vector<std::vector<std::string>> rows_of_world(int world) {
  std::string const w = "world=" + std::to_string(world);
  return {
      {w, "protocol=landing", "expand=1", "tokens=128", "hidden=2048", "topk=8", "experts=256", "iters=2"},
      // an expert capacity that can drop: the count exchange, whose rows then carry every expert's counts
      {w, "protocol=auto", "expand=1", "tokens=128", "hidden=7168", "topk=8", "experts=256", "capacity=64", "iters=2"},
      {w, "protocol=counts", "tokens=0,37,128,5", "hidden=2048", "topk=9", "experts=64", "mask=0.3", "capacity=96",
       "iters=2"},
      {w, "protocol=auto", "routing=ring", "tokens=100,0,1,64", "hidden=4096", "topk=1", "experts=16", "iters=2"},
      {w, "protocol=counts", "routing=grouped", "expand=1", "tokens=64,48", "hidden=2880", "topk=6", "experts=64",
       "capacity=128", "iters=2"},
      {w, "protocol=auto", "tokens=0", "hidden=2048", "topk=4", "experts=64", "iters=2"},
      {w, "protocol=counts", "tokens=1024,700", "hidden=2048", "topk=8", "experts=64", "capacity=1024", "iters=2"},
      {w, "protocol=counts", "combine=fp8", "expand=1", "tokens=512,300", "hidden=2048", "topk=8", "experts=64",
       "capacity=512", "iters=2"},
      {w, "protocol=counts", "combine=nvfp4", "tokens=700,64", "hidden=2064", "topk=4", "experts=64", "mask=0.2",
       "capacity=256", "iters=2"},
      {w, "protocol=counts", "combine=mxfp4", "routing=hot", "tokens=300,17", "hidden=2080", "topk=6", "experts=64",
       "capacity=256", "iters=2"},
  };
}

TEST(NormalModeVirtualRanks, World2) {
  run_rows(rows_of_world(2));
}

TEST(NormalModeVirtualRanks, World4) {
  run_rows(rows_of_world(4));
}

TEST(NormalModeVirtualRanks, World8) {
  run_rows(rows_of_world(8));
}

// A rank that skips a call (stuck, crashed, or a caller's bug): every other rank's dispatch or combine ends within
// its bound (1 s here) in a timeout naming that rank, under both dispatch protocols, at worlds 2, 4 and 8.
TEST(NormalModeVirtualRanks, AbsentRankIsNamedByEveryOther) {
  std::vector<std::vector<std::string>> table;
  for (int world : {2, 4, 8}) {
    std::string const w = "world=" + std::to_string(world);
    std::string const last = "absent=" + std::to_string(world - 1), middle = "absent=" + std::to_string(world / 2);
    table.push_back({w, last, "protocol=landing", "tokens=128", "hidden=2048", "topk=8", "experts=256", "iters=1"});
    table.push_back({w, middle, "protocol=counts", "tokens=64,0", "hidden=2048", "topk=8", "experts=64", "iters=1"});
    table.push_back(
        {w, middle, "absent_leg=combine", "tokens=300,17", "hidden=2048", "topk=6", "experts=64", "iters=1"});
  }
  run_rows(table);
}

}  // namespace test_normal_virtual
}  // namespace ferry::test
