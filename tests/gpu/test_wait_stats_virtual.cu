// The per-source wait statistics of the low-latency receive halves (EpConfig::wait_stats, src/ep/cuda/wait_stats.cuh)
// and the cuda side of rank masking, on virtual ranks of ONE GPU (tests/support/virtual_ranks.hpp, as
// test_ll_virtual.cu). Wait statistics at worlds 2 and 4: after `calls` dispatch + combine pairs (whole, then split by
// the hook) every rank holds exactly `calls` waits per source and leg, every peer's count is non-zero, one source
// held back by a spin kernel before its dispatch is the longest wait of every other rank, the results stay exact, and
// with the pointer off (null, EpConfig::wait_stats false) nothing is recorded. Rank masking (docs/internode.md, "Rank
// masking"): a rank that never arrives at worlds 2, 4, 8 (and with fp8), a rank asked out, a rank lost at the
// combine; across emulated nodes (2x1, 2x2, 2x4, 4x2: the direct route, the agreement's words to other nodes through
// the network, seeded delays and reordering) a rank and a whole node that never arrive, and a rank of another node
// asked out; past 32 ranks (8x8, 16x8) the same with ranks past the first word of a set; each with the hook, a
// replayed graph and clear_mask where it applies, every row against ref::without_ranks.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "core/rank_set.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/ll/layout.hpp"
#include "ep/cuda/wait_stats.cuh"
#include "ep/ep_impl.hpp"
#include "ep/landing_policy.hpp"
#include "ep/ll_mask_words.hpp"
#include "ep/reference.hpp"
#include "ferry/ep.hpp"
#include "support/gpu_case.hpp"
#include "support/ll_check.hpp"
#include "support/ll_nodes.hpp"
#include "support/virtual_ranks.hpp"
#include "workloads/routing.hpp"

namespace ferry::test {
namespace test_wait_stats_virtual {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

using cuda_ep::Buffers;
using cuda_ep::Half;
using VirtualLlRanks = VirtualRanks<Buffers, cuda_ep::allocate_buffers, cuda_ep::free_buffers>;
using detail::RankSet;

RankSet rank_set(std::initializer_list<int> ranks) {
  RankSet out;
  for (int r : ranks) out.set(r);
  return out;
}
// The ranks a rank's words hold masked (LlMaskWords::masked: bit r % 32 of word r / 32).
RankSet masked_of(detail::LlMaskWords const& words) {
  return RankSet::from_words32(words.masked, detail::kMaskWords);
}

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

// topology: across nodes (nodes > 1) the route CudaEp runs with masking (cuda_route_for_masking: direct).
EpConfig ll_config(int world, bool stats, bool masking = false, WireFormat format = WireFormat::bf16,
                   Topology topology = {1, 0}) {
  EpConfig user;
  user.mode = Mode::low_latency;
  user.hidden = 2048;
  user.num_experts = (world > 32 ? 2 : 16) * world;  // past 32: a receive area of 2 experts a rank fits 128 ranks
  user.topk = 4;
  user.max_tokens_per_rank = 64;
  user.wait_stats = stats;
  user.rank_masking = masking;
  user.dispatch_format = format;
  user.validate(world);
  return detail::cuda_route_for_masking(user, topology).resolved(world);
}

// One world of virtual ranks in low-latency mode: every rank's buffers, its inputs and the legs' arguments. Across
// nodes (topology.nodes > 1) the ranks of other nodes only through the emulated network (set_emulated_nodes), its
// deliveries delayed and reordered with a seed printed by the caller.
struct LlWorld {
  EpConfig config;
  int world;
  Topology topology;
  VirtualLlRanks ranks;
  std::vector<int> tokens;
  std::vector<VirtualRankIo> io;
  std::vector<DispatchArgs> dargs;
  std::vector<CombineArgs> em;

  LlWorld(EpConfig const& c, int w, int ctas, double timeout_s = kVirtualTimeoutS, Topology nodes = {1, 0},
          uint64_t network_seed = 0)
      : config(c),
        world(w),
        topology(nodes.nodes > 1 ? nodes : Topology{1, w}),
        ranks(
            w, cuda_ep::make_sym_layout(c, w, cuda_ep::Protocol::ll, topology.nodes).total,
            [&](Buffers& b, int r, VirtualWorld const& vw) {
              cuda_ep::configure_buffers(b, c, w, r, cuda_ep::Protocol::ll, ctas);
              b.num_ctas = ctas;
              b.test_agreement_apart = true;  // dispatch() and combine() launch every rank's agreement first
              b.layout = cuda_ep::make_sym_layout(c, w, cuda_ep::Protocol::ll, topology.nodes);
              set_emulated_nodes(b, topology, network_seed, r, 20000, vw, b.layout.total);
            },
            timeout_s),
        tokens(static_cast<std::size_t>(w), c.max_tokens_per_rank),
        dargs(w),
        em(w) {
    io.reserve(w);
    for (int r = 0; r < w; ++r) io.emplace_back(c, w, tokens[r]);
    for (int r = 0; r < w; ++r) {
      dargs[r].x = io[r].x.ptr;
      dargs[r].num_tokens = tokens[r];
      dargs[r].topk_idx = io[r].idx.ptr;
      dargs[r].topk_idx_type = IndexType::int64;
      dargs[r].topk_weights = static_cast<float const*>(io[r].w.ptr);
      em[r] = CombineArgs{CombineLayout::expert_major, io[r].eout.ptr, io[r].y_em.ptr};
    }
  }
  bool in(RankSet const& who, int r) const { return who.test(r); }
  // fresh inputs (uploaded, y poisoned) and every rank's dispatch outputs poisoned
  VirtualIteration iteration(uint64_t seed) {
    RoutingOptions routing;
    routing.seed = seed;
    VirtualIteration it(config, world, routing, tokens, io);
    for (int r = 0; r < world; ++r)
      poison_ll_dispatch(config, world, cuda_ep::dispatch_result(ranks[r], true), ranks[r].recv_slot);
    CK(cudaDeviceSynchronize());
    return it;
  }
  // the legs of the ranks in `who`, whole or split by the hook (send halves of all, then receive halves)
  // (with rank masking every rank's agreement first: Buffers::test_agreement_apart says why)
  void dispatch(RankSet const& who, bool hook) {
    for (int r = 0; r < world; ++r)
      if (in(who, r)) agree(r, detail::LlMaskLeg::dispatch);
    for (Half half : hook ? std::vector<Half>{Half::send, Half::recv} : std::vector<Half>{Half::both})
      for (int r = 0; r < world; ++r)
        if (in(who, r)) cuda_ep::launch_ll_dispatch(ranks[r], dargs[r], half, ranks.stream(r));
  }
  void combine(RankSet const& who, bool hook) {
    for (int r = 0; r < world; ++r)
      if (in(who, r)) agree(r, detail::LlMaskLeg::combine);
    for (Half half : hook ? std::vector<Half>{Half::send, Half::recv} : std::vector<Half>{Half::both})
      for (int r = 0; r < world; ++r)
        if (in(who, r)) cuda_ep::launch_ll_combine(ranks[r], em[r], tokens[r], half, ranks.stream(r));
  }
  RankSet all() const { return RankSet::range(0, world); }
  // rank masking: the agreement that opens a leg's call, as the leg's launch would without test_agreement_apart
  void agree(int r, detail::LlMaskLeg leg) {
    if (config.rank_masking) cuda_ep::launch_ll_agreement(ranks[r], leg, ranks.stream(r));
  }
  // Rank masking: loads the masked instances this world launches before any agreement runs. A kernel's first launch
  // in the process loads it and waits for the device (CUDA's lazy loading), and one host thread launches every
  // virtual rank: an agreement running then waits for ranks whose launches that host thread has not reached, and
  // masks them. Each rank marked masked meanwhile, so that every kernel
  // (the agreement too) returns at once; then the words and counters as clear_mask leaves them.
  // Returns the calls of each leg it made (the counters go on from there: the next dispatch is #calls + 1).
  uint64_t load_masked_kernels() {
    uint32_t const masked = static_cast<uint32_t>(detail::LlMaskSelf::asked);
    for (int r = 0; r < world; ++r)
      CK(cudaMemcpy(&ranks[r].state->ll.mask.self, &masked, sizeof(masked), cudaMemcpyHostToDevice));
    uint64_t calls = 0;
    for (bool hook : {false, true}) {
      dispatch(all(), hook);
      combine(all(), hook);
      ++calls;
    }
    CK(cudaDeviceSynchronize());
    clear();
    return calls;
  }
  detail::LlMaskWords words(int r) const { return cuda_ep::read_ll_mask(ranks[r], ranks.stream(r)); }
  // clear_mask as CudaEp does it, every rank (the bootstrap's allgathers and barrier are the host's loops here); across
  // nodes the network's counters through it (the reset sets only the counters of each rank's own node)
  void clear() {
    std::vector<detail::LlCallCounters> all_counters;
    for (int r = 0; r < world; ++r) all_counters.push_back(cuda_ep::ll_call_counters(ranks[r], ranks.stream(r)));
    detail::LlCallCounters const to = detail::merge_call_counters(all_counters);
    std::vector<std::vector<uint64_t>> network;
    for (int r = 0; r < world; ++r) network.push_back(cuda_ep::read_network_counters(ranks[r], ranks.stream(r)));
    for (int r = 0; r < world; ++r) cuda_ep::realign_network_counters(ranks[r], to, network, ranks.stream(r));
    for (int r = 0; r < world; ++r) cuda_ep::reset_ll_mask(ranks[r], to, ranks.stream(r));
    CK(cudaDeviceSynchronize());
    std::string const failure = ranks.synchronize(std::vector<int>(static_cast<std::size_t>(world), 0));
    EXPECT_TRUE(failure.empty()) << "clear_mask:\n" << failure;
  }
};

void run_stats(int world) {
  int const ctas = virtual_ctas_per_rank(world, cuda_ep::kMaxLlCtas);
  if (ctas < 1) GTEST_SKIP() << "fewer SMs than " << world << " ranks";
  LlWorld w(ll_config(world, true), world, ctas);
  EpConfig const& config = w.config;
  auto const& ranks = w.ranks;
  for (int r = 0; r < world; ++r) ASSERT_NE(ranks[r].wait_stats, nullptr) << "wait_stats=true allocated no array";
  uint64_t const seed = fresh_seed();
  std::printf("world %d x %d CTAs, seed %llu\n", world, ctas, static_cast<unsigned long long>(seed));
  int const late = world - 1;
  uint64_t const late_ns = 2'000'000;  // 2 ms: far above an NVLink round trip
  int const calls = 4;
  std::vector<int> const none(static_cast<std::size_t>(world), 0);
  for (int call = 0; call < calls; ++call) {
    bool const hook = call % 2 == 1;
    VirtualIteration const it = w.iteration(seed + static_cast<uint64_t>(call));
    // the late source, before its dispatch; not in the first calls: a kernel's first launch in the process loads its
    // module, which waits for the running spin, so every rank would start late alike
    if (call == 2) spin_for<<<1, 1, 0, ranks.stream(late)>>>(late_ns);
    w.dispatch(w.all(), hook);
    w.combine(w.all(), hook);
    std::string const failure = ranks.synchronize(none);
    ASSERT_TRUE(failure.empty()) << "call " << call << ":\n" << failure;
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(check_ll_dispatch(config, world, r, call, it.expected[r], cuda_ep::dispatch_result(ranks[r], true),
                                  ranks[r].recv_slot),
                0);
      auto const y = ref::combine_expert_major(config, world, r, it.inputs, it.expected, it.eout);
      ASSERT_EQ(check_combined("y expert-major", w.io[r].y_em.ptr, y, kVirtualGuardElems, r, call), 0);
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
  VirtualIteration const it = w.iteration(seed + 99);
  for (int r = 0; r < world; ++r) cuda_ep::launch_ll_dispatch(off[r], w.dargs[r], Half::both, ranks.stream(r));
  for (int r = 0; r < world; ++r) cuda_ep::launch_ll_combine(off[r], w.em[r], w.tokens[r], Half::both, ranks.stream(r));
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

// ---- rank masking (EpConfig::rank_masking; src/ep/cuda/ll/mask.cuh): one node, then across emulated nodes below ----

// Every rank of `who` after its call: no failure recorded, its dispatch equal to the reference of the world without
// the ranks of `masked` (ref::without_ranks), its combine's y too (expert-major), and its mask words what the call
// agreed: those ranks masked, this rank's entries of them counted by both legs. Returns false at the first failure.
bool expect_masked_world(LlWorld& w, VirtualIteration const& it, RankSet const& who, RankSet const& masked, int call) {
  EpConfig const& config = w.config;
  ref::MaskedWorld const kept = ref::without_ranks(config, w.world, it.inputs, masked);
  std::vector<ref::RankDispatch> want;
  for (int d = 0; d < w.world; ++d) want.push_back(ref::dispatch(config, w.world, d, kept.inputs));
  std::string const failure = w.ranks.synchronize(std::vector<int>(static_cast<std::size_t>(w.world), 0));
  EXPECT_TRUE(failure.empty()) << "call " << call << ": a rank failed instead of masking:\n" << failure;
  if (!failure.empty()) return false;
  for (int r = 0; r < w.world; ++r) {
    if (!w.in(who, r)) continue;
    // NOTE: this call's checks alone decide (HasFailure would count an earlier, unrelated failure of the test)
    int const dispatched = check_ll_dispatch(config, w.world, r, call, want[r],
                                             cuda_ep::dispatch_result(w.ranks[r], true), w.ranks[r].recv_slot);
    EXPECT_EQ(dispatched, 0) << "rank " << r << ", call " << call;
    auto const y = ref::combine_expert_major(config, w.world, r, kept.inputs, want, it.eout);
    int const combined = check_combined("y expert-major", w.io[r].y_em.ptr, y, kVirtualGuardElems, r, call);
    EXPECT_EQ(combined, 0) << "rank " << r << ", call " << call;
    detail::LlMaskWords const words = w.words(r);
    bool const agreed = words.self == 0 && masked_of(words) == masked &&
                        static_cast<int64_t>(words.last_dispatch_entries) == kept.masked_entries[r] &&
                        static_cast<int64_t>(words.last_combine_entries) == kept.masked_entries[r];
    EXPECT_TRUE(agreed) << "rank " << r << ", call " << call << ": self " << words.self << ", masked "
                        << masked_of(words).text() << " (want " << masked.text()
                        << "), entries left out by the dispatch " << words.last_dispatch_entries << " and the combine "
                        << words.last_combine_entries << " (want " << kept.masked_entries[r] << ")";
    if (dispatched != 0 || combined != 0 || !agreed) return false;
  }
  return true;
}

// The ranks of `gone` (one rank, or a whole node) never come to a dispatch: every other rank's agreement waits its
// bound (FERRY_TIMEOUT_S, 1 s here), masks them and finishes the call (no timeout recorded) with the reference of the
// world without them, the combine too; then their own late call learns it (LlMaskSelf::timeout, their outputs
// untouched), a hooked call and a replayed CUDA graph go on without them, and after clear_mask the whole world is
// back, exact. topology: across nodes (nodes > 1) the ranks of other nodes only through the emulated network.
void run_never_arrives(int world, WireFormat format, Topology topology = {1, 0}, RankSet gone = {}) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU, found 0";
  int const ctas = virtual_ctas_per_rank(world, cuda_ep::kMaxLlCtas);
  if (ctas < 1) GTEST_SKIP() << "fewer SMs than " << world << " ranks";
  if (gone.empty()) gone.set(world / 2);
  uint64_t const seed = fresh_seed();
  LlWorld w(ll_config(world, false, true, format, topology), world, ctas, kAbsentTimeoutS, topology, seed);
  uint64_t const loaded = w.load_masked_kernels();
  RankSet const others = w.all() - gone;
  std::printf("world %d (%s) x %d CTAs, dispatch_format %s, rank(s) %s never arrive, seed %llu\n", world,
              topology_name(w.topology).c_str(), ctas, wire_format_name(format), gone.text().c_str(),
              static_cast<unsigned long long>(seed));

  // 1. the call without them: masked within the bound, every row of the others the reference's without them
  VirtualIteration const first = w.iteration(seed);
  auto const start = std::chrono::steady_clock::now();
  w.dispatch(others, false);
  w.combine(others, false);
  ASSERT_TRUE(expect_masked_world(w, first, others, gone, 0));
  double const waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, 5 * kAbsentTimeoutS) << "the others did not finish within their bound";
  int const someone = others.lowest();
  std::printf("  masked in %.2f s (bound %.1f s); rank %d's entries left out: %llu\n", waited, kAbsentTimeoutS, someone,
              static_cast<unsigned long long>(w.words(someone).last_dispatch_entries));
  // the check sees the mask: the same outputs against the reference of the whole world differ (a check that can fail)
  EXPECT_NE(check_ll_dispatch(w.config, world, someone, 0, first.expected[someone],
                              cuda_ep::dispatch_result(w.ranks[someone], true), w.ranks[someone].recv_slot),
            0)
      << "the masked call matched the reference of the whole world: the check cannot tell them apart";

  // 2. their own call, late: each learns that it is masked and moves nothing (its outputs keep the poison)
  for (int g = 0; g < world; ++g)
    if (w.in(gone, g)) CK(cudaMemset(cuda_ep::dispatch_result(w.ranks[g], true).num_recv, 0xEE, 4));
  w.dispatch(gone, false);
  EXPECT_TRUE(w.ranks.synchronize(std::vector<int>(static_cast<std::size_t>(world), 0)).empty());
  for (int g = 0; g < world; ++g) {
    if (!w.in(gone, g)) continue;
    detail::LlMaskWords const own = w.words(g);
    EXPECT_EQ(own.self, static_cast<uint32_t>(detail::LlMaskSelf::timeout)) << "rank " << g;
    EXPECT_EQ(own.self_call, loaded + 1) << "rank " << g << ": its first dispatch after the loading calls";
    EXPECT_TRUE(RankSet::from_words32(own.self_view, detail::kMaskWords).test(g)) << "rank " << g;
    EXPECT_EQ(w.ranks[g].mask_host->self, own.self) << "the host's word of masked rank " << g;
    EXPECT_EQ(to_host<uint32_t>(cuda_ep::dispatch_result(w.ranks[g], true).num_recv, 1)[0], 0xEEEEEEEEu)
        << "masked rank " << g << "'s dispatch wrote its outputs";
    std::string const said = detail::self_masked_message(own, g, kAbsentTimeoutS);
    EXPECT_NE(said.find("rank " + std::to_string(g) + " is masked on this EpBuffer: at dispatch #" +
                        std::to_string(loaded + 1)),
              std::string::npos)
        << said;
    std::printf("  rank %d's own call: %s\n", g, said.c_str());
  }

  // 3. a hooked call with the mask (the masked ranks call too: their kernels return at once)
  VirtualIteration const hooked = w.iteration(seed + 1);
  w.dispatch(w.all(), true);
  w.combine(w.all(), true);
  ASSERT_TRUE(expect_masked_world(w, hooked, others, gone, 1));

  // 4. captured graphs of both legs and their agreements, replayed with fresh inputs: the mask is read on the device
  //    at every replay (a graph per step and rank, every rank's agreement before any leg, as dispatch() launches)
  RankGraphs agree_dispatch(world), dispatches(world), agree_combine(world), combines(world);
  agree_dispatch.capture(w.ranks, [&](int r) { w.agree(r, detail::LlMaskLeg::dispatch); });
  dispatches.capture(
      w.ranks, [&](int r) { cuda_ep::launch_ll_dispatch(w.ranks[r], w.dargs[r], Half::both, w.ranks.stream(r)); });
  agree_combine.capture(w.ranks, [&](int r) { w.agree(r, detail::LlMaskLeg::combine); });
  combines.capture(w.ranks, [&](int r) {
    cuda_ep::launch_ll_combine(w.ranks[r], w.em[r], w.tokens[r], Half::both, w.ranks.stream(r));
  });
  for (int replay = 0; replay < 2; ++replay) {
    VirtualIteration const it = w.iteration(seed + 2 + replay);
    for (RankGraphs* graphs : {&agree_dispatch, &dispatches, &agree_combine, &combines}) graphs->launch(w.ranks);
    ASSERT_TRUE(expect_masked_world(w, it, others, gone, 2 + replay));
  }

  // 5. clear_mask: every rank back, the whole world's reference
  w.clear();
  for (int r = 0; r < world; ++r) {
    detail::LlMaskWords const words = w.words(r);
    EXPECT_TRUE(masked_of(words).empty() && words.self == 0 && words.dispatch_entries == 0)
        << "rank " << r << " kept a mask";
  }
  VirtualIteration const back = w.iteration(seed + 9);
  w.dispatch(w.all(), false);
  w.combine(w.all(), false);
  ASSERT_TRUE(expect_masked_world(w, back, w.all(), RankSet{}, 9));
}

TEST(RankMaskingVirtual, RankThatNeverArrivesIsMaskedWorld2) {
  run_never_arrives(2, WireFormat::bf16);
}
TEST(RankMaskingVirtual, RankThatNeverArrivesIsMaskedWorld4) {
  run_never_arrives(4, WireFormat::bf16);
}
TEST(RankMaskingVirtual, RankThatNeverArrivesIsMaskedWorld8) {
  run_never_arrives(8, WireFormat::bf16);
}
// fp8: the quantized delivery is compared byte for byte with the host codec's (check_ll_quantized_delivery)
TEST(RankMaskingVirtual, RankThatNeverArrivesIsMaskedFp8) {
  run_never_arrives(4, WireFormat::fp8_e4m3);
}

// mask_ranks: rank 0 asks for rank `asked`; every rank calls (that rank too), nobody waits a timeout (the bound here
// is the long one), the others go on without it and it learns it was asked out. topology: as run_never_arrives.
void run_asked_out(int world, int asked, Topology topology = {1, 0}) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU, found 0";
  int const ctas = virtual_ctas_per_rank(world, cuda_ep::kMaxLlCtas);
  if (ctas < 1) GTEST_SKIP() << "fewer SMs than " << world << " ranks";
  uint64_t const seed = fresh_seed();
  LlWorld w(ll_config(world, false, true, WireFormat::bf16, topology), world, ctas, kVirtualTimeoutS, topology, seed);
  w.load_masked_kernels();
  std::printf("world %d (%s), rank 0 asks for rank %d, seed %llu\n", world, topology_name(w.topology).c_str(), asked,
              static_cast<unsigned long long>(seed));
  VirtualIteration const it = w.iteration(seed);
  cuda_ep::request_ll_mask(w.ranks[0], {asked});
  auto const start = std::chrono::steady_clock::now();
  w.dispatch(w.all(), false);
  w.combine(w.all(), false);
  ASSERT_TRUE(expect_masked_world(w, it, w.all() - rank_set({asked}), rank_set({asked}), 0));
  double const took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, kVirtualTimeoutS / 4) << "asking a rank out waited like a timeout";
  detail::LlMaskWords const own = w.words(asked);
  EXPECT_EQ(own.self, static_cast<uint32_t>(detail::LlMaskSelf::asked));
  EXPECT_EQ(RankSet::from_words32(own.self_lost, detail::kMaskWords), rank_set({asked}));
  std::printf("  done in %.3f s: %s\n", took, detail::self_masked_message(own, asked, kVirtualTimeoutS).c_str());
}

TEST(RankMaskingVirtual, AskedOutWithoutATimeout) {
  run_asked_out(4, 2);
}

// A rank present at the dispatch and absent from the combine: the others' combine masks it after the bound and
// returns y without its expert outputs (its rows summed as zeros by the reference: +0 changes no sum), counting the
// entries y misses; the next dispatch goes on without it. topology: as run_never_arrives.
void run_lost_at_combine(int world, int gone, Topology topology = {1, 0}) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU, found 0";
  int const ctas = virtual_ctas_per_rank(world, cuda_ep::kMaxLlCtas);
  if (ctas < 1) GTEST_SKIP() << "fewer SMs than " << world << " ranks";
  uint64_t const seed = fresh_seed();
  LlWorld w(ll_config(world, false, true, WireFormat::bf16, topology), world, ctas, kAbsentTimeoutS, topology, seed);
  w.load_masked_kernels();
  RankSet const lost = rank_set({gone});
  RankSet const others = w.all() - lost;
  std::printf("world %d (%s), rank %d skips the combine, seed %llu\n", world, topology_name(w.topology).c_str(), gone,
              static_cast<unsigned long long>(seed));
  VirtualIteration it = w.iteration(seed);
  w.dispatch(w.all(), false);
  ASSERT_TRUE(w.ranks.synchronize(std::vector<int>(static_cast<std::size_t>(world), 0)).empty());
  w.combine(others, false);
  ASSERT_TRUE(w.ranks.synchronize(std::vector<int>(static_cast<std::size_t>(world), 0)).empty());
  it.eout[gone].assign(it.eout[gone].size(), 0);  // its expert outputs never come back
  ref::MaskedWorld const kept = ref::without_ranks(w.config, world, it.inputs, lost);
  for (int r = 0; r < world; ++r) {
    if (r == gone) continue;
    auto const y = ref::combine_expert_major(w.config, world, r, it.inputs, it.expected, it.eout);
    EXPECT_EQ(check_combined("y expert-major", w.io[r].y_em.ptr, y, kVirtualGuardElems, r, 0), 0) << "rank " << r;
    detail::LlMaskWords const words = w.words(r);
    EXPECT_EQ(masked_of(words), lost) << "rank " << r << " masked " << masked_of(words).text();
    EXPECT_EQ(words.last_dispatch_entries, 0u);
    EXPECT_EQ(static_cast<int64_t>(words.last_combine_entries), kept.masked_entries[r]) << "rank " << r;
  }
  VirtualIteration const next = w.iteration(seed + 1);
  w.dispatch(others, false);
  w.combine(others, false);
  ASSERT_TRUE(expect_masked_world(w, next, others, lost, 1));
}

TEST(RankMaskingVirtual, RankLostAtTheCombine) {
  run_lost_at_combine(4, 1);
}

// A rank that dies inside the dispatch's agreement (its kernels stop at a chosen moment): its arrival reached some of
// the others and not the rest, or every one of them but no estimate of it followed. The test writes the words the
// victim's agreement wrote before it stopped (across nodes its counters too, as its puts and signals would have) and
// never launches its kernels again. Every other rank must agree, no failure recorded, to mask it: the call returns
// the reference of the world without it, and ten more calls without it are exact. Before, a rank silent after its
// arrival was a timeout recorded by the ranks that had seen it, which failed the communicator of every survivor
// (the cpu backend's kill test, RankMaskingKills.SurvivorsGoOn, is the same protocol with real kills).
void run_dies_inside_agreement(int world, int victim, bool arrived_everywhere, Topology topology = {1, 0}) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU, found 0";
  int const ctas = virtual_ctas_per_rank(world, cuda_ep::kMaxLlCtas);
  if (ctas < 1) GTEST_SKIP() << "fewer SMs than " << world << " ranks";
  uint64_t const seed = fresh_seed();
  LlWorld w(ll_config(world, false, true, WireFormat::bf16, topology), world, ctas, kAbsentTimeoutS, topology, seed);
  w.load_masked_kernels();
  RankSet const victims = rank_set({victim});
  RankSet const others = w.all() - victims;
  // 1. a whole call
  VirtualIteration const whole = w.iteration(seed);
  w.dispatch(w.all(), false);
  w.combine(w.all(), false);
  ASSERT_TRUE(expect_masked_world(w, whole, w.all(), RankSet{}, 0));
  // 2. the victim's agreement of the next dispatch stops after writing its arrival into `reached`
  uint64_t const epoch = w.words(victim).epoch + 1;
  RankSet reached = others;
  if (!arrived_everywhere) {
    std::mt19937_64 rng(seed);
    do {
      reached = RankSet{};
      for (int r : others)
        if ((rng() & 1u) != 0) reached.set(r);
    } while (reached.empty() || reached == others);
  }
  std::printf(
      "world %d (%s), rank %d dies inside the agreement: its arrival reached rank(s) %s of %s, no estimate; "
      "seed %llu\n",
      world, topology_name(w.topology).c_str(), victim, reached.text().c_str(), others.text().c_str(),
      static_cast<unsigned long long>(seed));
  cuda_ep::LlMaskArea const area = cuda_ep::ll_mask_area(w.ranks[victim].layout.total, world);
  int const stride = cuda_ep::ll_mask_set_stride(world);
  for (int s = 0; s < world; ++s) {
    if (!w.in(reached, s)) continue;
    char* const region = w.ranks[s].sym.peer(s);
    std::vector<uint64_t> const set(static_cast<std::size_t>(stride), epoch << 32);  // its arrival: no request
    CK(cudaMemcpy(region + area.arrive + static_cast<std::size_t>(victim) * stride * sizeof(uint64_t), set.data(),
                  set.size() * sizeof(uint64_t), cudaMemcpyHostToDevice));
    if (s / w.topology.local != victim / w.topology.local)  // its put came with a signal: one per agreement
      CK(cudaMemcpy(region + area.arrive_signals + victim * sizeof(uint64_t), &epoch, sizeof(epoch),
                    cudaMemcpyHostToDevice));
  }
  VirtualIteration const lost = w.iteration(seed + 1);
  auto const start = std::chrono::steady_clock::now();
  w.dispatch(others, false);
  w.combine(others, false);
  ASSERT_TRUE(expect_masked_world(w, lost, others, victims, 1));
  double const took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, 5 * kAbsentTimeoutS) << "the others did not agree within their bounds";
  std::printf("  masked in %.2f s (bound %.1f s)\n", took, kAbsentTimeoutS);
  // 3. ten more calls without it, whole and hooked
  for (int call = 2; call < 12; ++call) {
    VirtualIteration const it = w.iteration(seed + static_cast<uint64_t>(call));
    w.dispatch(others, call % 2 == 1);
    w.combine(others, call % 2 == 1);
    ASSERT_TRUE(expect_masked_world(w, it, others, victims, call));
  }
}

TEST(RankMaskingVirtual, RankDyingInsideTheAgreementIsMaskedEverywhere) {
  run_dies_inside_agreement(4, 1, false);
  run_dies_inside_agreement(4, 3, true);
}

// ---- across emulated nodes: the direct route (cuda_route_for_masking), the agreement's words to the ranks of other
// nodes through the emulated network (seeded delays and reordering), the masked instances over it ----

TEST(RankMaskingAcrossNodes, OtherNodeNeverArrives2x1) {
  run_never_arrives(2, WireFormat::bf16, Topology{2, 1}, rank_set({1}));
}
TEST(RankMaskingAcrossNodes, RankOfAnotherNodeNeverArrives2x2) {
  run_never_arrives(4, WireFormat::bf16, Topology{2, 2}, rank_set({3}));
}
TEST(RankMaskingAcrossNodes, WholeNodeNeverArrives2x4) {
  run_never_arrives(8, WireFormat::bf16, Topology{2, 4}, RankSet::range(4, 4));
}
TEST(RankMaskingAcrossNodes, WholeNodeNeverArrives4x2) {
  run_never_arrives(8, WireFormat::bf16, Topology{4, 2}, RankSet::range(4, 2));
}
// fp8 across nodes: the quantized rows through the network, the delivery byte for byte with the host codec's
TEST(RankMaskingAcrossNodes, RankNeverArrivesFp8At2x2) {
  run_never_arrives(4, WireFormat::fp8_e4m3, Topology{2, 2}, rank_set({2}));
}
TEST(RankMaskingAcrossNodes, RankOfAnotherNodeAskedOut2x2) {
  run_asked_out(4, 3, Topology{2, 2});
}
TEST(RankMaskingAcrossNodes, RankDyingInsideTheAgreementIsMaskedEverywhere2x2) {
  run_dies_inside_agreement(4, 2, false, Topology{2, 2});
  run_dies_inside_agreement(4, 0, true, Topology{2, 2});
}

// ---- past 32 ranks: a set of ranks is several 32-bit words (the agreement's words, LlMaskWords::masked, the legs'
// LiveRanks), so a rank, a node, a request and a death past word 0, at 8x8 (64 ranks) and 16x8 (128, one CTA each)
// ----

TEST(RankMaskingWide, RankPast32NeverArrives8x8) {
  run_never_arrives(64, WireFormat::bf16, Topology{8, 8}, rank_set({45}));
}
TEST(RankMaskingWide, WholeNodePast32NeverArrives16x8) {
  run_never_arrives(128, WireFormat::bf16, Topology{16, 8}, RankSet::range(96, 8));
}
TEST(RankMaskingWide, RankNeverArrivesFp8At8x8) {
  run_never_arrives(64, WireFormat::fp8_e4m3, Topology{8, 8}, rank_set({33}));
}
TEST(RankMaskingWide, RankAskedOut16x8) {
  run_asked_out(128, 100, Topology{16, 8});
}
TEST(RankMaskingWide, RankLostAtTheCombine8x8) {
  run_lost_at_combine(64, 50, Topology{8, 8});
}
TEST(RankMaskingWide, RankDyingInsideTheAgreement8x8) {
  run_dies_inside_agreement(64, 40, false, Topology{8, 8});
}

}  // namespace test_wait_stats_virtual
}  // namespace ferry::test
