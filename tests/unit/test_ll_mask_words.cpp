// The host's reading of the cuda backend's rank-masking words (src/ep/ll_mask_words.hpp): what mask_status reports,
// the Error a masked rank's calls throw, and how clear_mask merges the ranks' counters; and where the agreement's
// words are in the symmetric region (ll_mask_area) at every world up to kMaxWorld. No GPU: the words are what the
// agreement kernel (src/ep/cuda/ll/mask.cuh) writes.
#include <gtest/gtest.h>

#include <vector>

#include "ep/cuda/layout.hpp"
#include "ep/cuda/ll/layout.hpp"
#include "ep/ll_mask_words.hpp"
#include "ferry/error.hpp"
#include "ferry/limits.hpp"

namespace ferry::detail {
namespace {

LlMaskWords masked_at_dispatch(LlMaskSelf why) {
  LlMaskWords w{};
  w.epoch = 7;
  w.masked[0] = 0b0010;  // what it knew before (rank 1)
  w.self = static_cast<uint32_t>(why);
  w.self_epoch = 7;
  w.self_call = 4;
  w.self_leg = static_cast<uint32_t>(LlMaskLeg::dispatch);
  w.self_view[0] = 0b1010;  // ranks 1 and 3 (itself)
  w.self_lost[0] = 0b1000;
  w.self_by = why == LlMaskSelf::ahead ? 2 : -1;
  return w;
}

TEST(LlMaskWords, StatusOfALiveRankListsTheMaskedRanksAndCounts) {
  LlMaskWords w{};
  w.masked[0] = 0b0101;
  w.last_dispatch_entries = 3;
  w.dispatch_entries = 10;
  w.last_combine_entries = 4;
  w.combine_entries = 11;
  MaskStatus const s = mask_status_of(w, 4);
  EXPECT_TRUE(s.enabled);
  EXPECT_FALSE(s.self);
  EXPECT_EQ(s.ranks, (std::vector<int>{0, 2}));
  EXPECT_EQ(s.last_dispatch_entries, 3);
  EXPECT_EQ(s.dispatch_entries, 10);
  EXPECT_EQ(s.last_combine_entries, 4);
  EXPECT_EQ(s.combine_entries, 11);
}

TEST(LlMaskWords, StatusOfAMaskedRankIsItsViewItselfIncluded) {
  MaskStatus const s = mask_status_of(masked_at_dispatch(LlMaskSelf::timeout), 4);
  EXPECT_TRUE(s.self);
  EXPECT_EQ(s.ranks, (std::vector<int>{1, 3}));
}

TEST(LlMaskWords, StatusKeepsTheRanksOfTheWorldOnly) {
  LlMaskWords w{};
  for (uint32_t& word : w.masked) word = 0xffffffffu;  // bits past the world are never set by the kernels
  EXPECT_EQ(mask_status_of(w, 2).ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(mask_status_of(w, 32).ranks.size(), 32u);
  EXPECT_EQ(mask_status_of(w, 1000).ranks.size(), 1000u);
}

// A set is bit r % 32 of word r / 32 (mask.cuh's words): ranks past 31 come from the later words, up to kMaxWorld.
TEST(LlMaskWords, RanksPastTheFirstWordAreRead) {
  LlMaskWords w{};
  w.masked[1] = 1u << 13;               // rank 45
  w.masked[3] = 1u << 31;               // rank 127
  w.masked[kMaskWords - 1] = 1u << 31;  // rank kMaxWorld - 1
  EXPECT_EQ(mask_status_of(w, 128).ranks, (std::vector<int>{45, 127}));
  EXPECT_EQ(mask_status_of(w, kMaxWorld).ranks, (std::vector<int>{45, 127, kMaxWorld - 1}));
  LlMaskWords asked = masked_at_dispatch(LlMaskSelf::asked);
  asked.self_lost[0] = 0;
  asked.self_lost[2] = 1u << 6;  // rank 70
  std::string const text = self_masked_message(asked, 70, 1.5);
  EXPECT_NE(text.find("mask_ranks asked for rank(s) 70,"), std::string::npos) << text;
  asked.self_view[2] = 1u << 6;
  EXPECT_EQ(mask_status_of(asked, 128).ranks, (std::vector<int>{1, 3, 70}));
}

TEST(LlMaskWords, MessageNamesTheCallAndWhy) {
  std::string const timeout = self_masked_message(masked_at_dispatch(LlMaskSelf::timeout), 3, 1.5);
  EXPECT_NE(timeout.find("rank 3 is masked on this EpBuffer: at dispatch #4 the other ranks waited 1.5 s "
                         "(FERRY_TIMEOUT_S) for it and went on without rank(s) 3"),
            std::string::npos)
      << timeout;
  EXPECT_NE(timeout.find("until every rank calls clear_mask()"), std::string::npos) << timeout;
  std::string const ahead = self_masked_message(masked_at_dispatch(LlMaskSelf::ahead), 3, 1.5);
  EXPECT_NE(ahead.find("at dispatch #4 rank 2 was already past this call's agreement"), std::string::npos) << ahead;
  LlMaskWords asked = masked_at_dispatch(LlMaskSelf::asked);
  asked.self_leg = static_cast<uint32_t>(LlMaskLeg::combine);
  asked.self_lost[0] = 0b1001;
  std::string const text = self_masked_message(asked, 3, 1.5);
  EXPECT_NE(text.find("at combine #4 mask_ranks asked for rank(s) 0, 3"), std::string::npos) << text;
}

TEST(LlMaskWords, MessageOfARankNotMaskedIsABug) {
  EXPECT_THROW(self_masked_message(LlMaskWords{}, 0, 1.0), Error);
}

TEST(LlMaskWords, ClearTakesTheLargestOfEveryCounter) {
  std::vector<LlCallCounters> const all{{5, 4, 9}, {3, 6, 2}, {5, 1, 11}};
  LlCallCounters const merged = merge_call_counters(all);
  EXPECT_EQ(merged.dispatch_seq, 5u);
  EXPECT_EQ(merged.combine_seq, 6u);
  EXPECT_EQ(merged.epoch, 11u);
  LlCallCounters const none = merge_call_counters({});
  EXPECT_EQ(none.dispatch_seq + none.combine_seq + none.epoch, 0u);
}

// The agreement's area at every world: inside the bytes the layout takes for it, its parts in order and apart, every
// set a whole number of 16 bytes holding rank_words(world) words (one put carries it), every part 16-byte aligned,
// and the signal range the counters. Fails where a set is its odd word count (e.g. world 96: 3 words, 24 bytes).
TEST(LlMaskArea, EveryWorldHoldsItsSetsAlignedAndApart) {
  for (int world = 1; world <= kMaxWorld; ++world) {
    SCOPED_TRACE(world);
    std::size_t const total = 1u << 30;  // a region's size (a multiple of 256, as the packer leaves it)
    std::size_t const bytes = cuda_ep::ll_mask_area_bytes(world);
    cuda_ep::LlMaskArea const a = cuda_ep::ll_mask_area(total, world);
    std::size_t const w = static_cast<std::size_t>(world);
    std::size_t const slots = static_cast<std::size_t>(kMaskEstimateSlots);
    std::size_t const set = static_cast<std::size_t>(cuda_ep::ll_mask_set_stride(world)) * sizeof(uint64_t);
    ASSERT_GE(set, static_cast<std::size_t>(rank_words(world)) * sizeof(uint64_t));
    ASSERT_EQ(rank_words(world), (world + 31) / 32);
    ASSERT_EQ(set % 16, 0u) << "a set is one put: 16-byte multiples";
    ASSERT_EQ(a.arrive, total - bytes);
    ASSERT_EQ(a.estimates, a.arrive + w * set);
    ASSERT_EQ(a.outbox, a.estimates + 2 * slots * w * set);
    ASSERT_EQ(a.arrive_signals, a.outbox + 2 * (1 + slots) * set);
    ASSERT_EQ(a.estimate_signals, a.arrive_signals + w * sizeof(uint64_t));
    ASSERT_LE(a.estimate_signals + slots * w * sizeof(uint64_t), total);
    for (std::size_t off : {a.arrive, a.estimates, a.outbox, a.arrive_signals})
      ASSERT_EQ(off % 16, 0u) << "offset " << off;
    ASSERT_EQ(a.signals, a.arrive_signals);
    ASSERT_EQ(a.num_signals, (1 + slots) * w);
  }
}

// The layout with masking on is the one with it off plus the area, last (every kernel's Params stay the same).
TEST(LlMaskArea, IsTheRegionsLastAreaAcrossNodes) {
  for (Topology const topology : {Topology{1, 8}, Topology{8, 8}, Topology{16, 8}, Topology{128, 8}}) {
    EpConfig config;
    config.mode = Mode::low_latency;
    config.hidden = 2048;
    config.topk = 4;
    config.num_experts = 2 * topology.world();
    config.max_tokens_per_rank = 64;
    EpConfig masked = config;
    masked.rank_masking = true;
    int const world = topology.world();
    cuda_ep::SymLayout const off = cuda_ep::make_sym_layout(config, world, Protocol::ll, topology.nodes);
    cuda_ep::SymLayout const on = cuda_ep::make_sym_layout(masked, world, Protocol::ll, topology.nodes);
    EXPECT_EQ(on.total, off.total + cuda_ep::ll_mask_area_bytes(world)) << topology_name(topology);
    EXPECT_EQ(cuda_ep::ll_mask_area(on.total, world).arrive, off.total) << topology_name(topology);
  }
}

}  // namespace
}  // namespace ferry::detail
