// The host's reading of the cuda backend's rank-masking words (src/ep/ll_mask_words.hpp): what mask_status reports,
// the Error a masked rank's calls throw, and how clear_mask merges the ranks' counters. No GPU: the words are what
// the agreement kernel (src/ep/cuda/ll/mask.cuh) writes.
#include <gtest/gtest.h>

#include <vector>

#include "ep/ll_mask_words.hpp"
#include "ferry/error.hpp"

namespace ferry::detail {
namespace {

LlMaskWords masked_at_dispatch(LlMaskSelf why) {
  LlMaskWords w{};
  w.epoch = 7;
  w.masked = 0b0010;  // what it knew before (rank 1)
  w.self = static_cast<uint32_t>(why);
  w.self_epoch = 7;
  w.self_call = 4;
  w.self_leg = static_cast<uint32_t>(LlMaskLeg::dispatch);
  w.self_view = 0b1010;  // ranks 1 and 3 (itself)
  w.self_lost = 0b1000;
  w.self_by = why == LlMaskSelf::ahead ? 2 : -1;
  return w;
}

TEST(LlMaskWords, StatusOfALiveRankListsTheMaskedRanksAndCounts) {
  LlMaskWords w{};
  w.masked = 0b0101;
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
  w.masked = 0xffffffffu;  // bits past the world are never set by the kernels; they must not show if they were
  EXPECT_EQ(mask_status_of(w, 2).ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(mask_status_of(w, 32).ranks.size(), 32u);
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
  asked.self_lost = 0b1001;
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

}  // namespace
}  // namespace ferry::detail
