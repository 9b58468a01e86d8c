// RankSet (src/core/rank_set.hpp), the host's set of ranks of a world of up to kMaxWorld: the bits at the word
// edges (31/32, 63/64, 255), ascending iteration, the set algebra the cpu backend's masking uses, and the words it
// keeps in shared memory (sized from the world). A 32-bit mask, as the host code had before, loses rank 32 and up: with
// set/test made 32-bit (bit r % 32 of word 0, what `mask >> r` did on x86) three of these four tests failed (bits 32,
// 63, 64 and 255 read as bits 0, 31, 0 and 31), and so did the cpu backend's cases past 32 ranks (InternodeCpu 5x8,
// InternodeCpuLowLatency 8x8, RankMaskingCpu 5x8: rows of ranks 32..39 landed on ranks 0..7).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/rank_set.hpp"
#include "ferry/error.hpp"

namespace ferry::detail {
namespace {

TEST(RankSet, SetsAndTestsEveryBitUpToTheLargestWorld) {
  static_assert(kMaxWorld >= 256, "a world of 32 nodes x 8 must be representable");
  for (int r : {0, 1, 31, 32, 63, 64, 127, 128, 255}) {
    RankSet set;
    set.set(r);
    EXPECT_EQ(set.count(), 1) << r;
    EXPECT_EQ(set.lowest(), r);
    EXPECT_EQ(set.ranks(), std::vector<int>{r});
    for (int q = 0; q < kMaxWorld; ++q) EXPECT_EQ(set.test(q), q == r) << "set " << r << ", tested " << q;
    set.reset(r);
    EXPECT_TRUE(set.empty()) << r;
  }
  RankSet none;
  EXPECT_FALSE(none.test(-1));
  EXPECT_FALSE(none.test(kMaxWorld));
  EXPECT_EQ(none.lowest(), -1);
  EXPECT_THROW(none.set(kMaxWorld), Error);
  EXPECT_THROW(none.set(-1), Error);
}

TEST(RankSet, IteratesAscendingAcrossWords) {
  RankSet set;
  for (int r : {255, 64, 0, 33, 32, 31, 63, 200}) set.set(r);
  std::vector<int> seen;
  for (int r : set) seen.push_back(r);
  EXPECT_EQ(seen, (std::vector<int>{0, 31, 32, 33, 63, 64, 200, 255}));
  EXPECT_EQ(set.text(), "0, 31, 32, 33, 63, 64, 200, 255");
  EXPECT_EQ(RankSet().ranks(), std::vector<int>{});
  EXPECT_EQ(RankSet().text(), "");
  RankSet last;
  last.set(255);  // only the last word holds a bit
  EXPECT_EQ(last.ranks(), std::vector<int>{255});
}

TEST(RankSet, RangesAndAlgebra) {
  RankSet const world = RankSet::range(0, 40);
  EXPECT_EQ(world.count(), 40);
  EXPECT_TRUE(world.test(39));
  EXPECT_FALSE(world.test(40));
  RankSet const node4 = RankSet::range(32, 8);  // node 4 of 5x8
  EXPECT_EQ(node4.ranks(), (std::vector<int>{32, 33, 34, 35, 36, 37, 38, 39}));
  RankSet const rest = world - node4;
  EXPECT_EQ(rest, RankSet::range(0, 32));
  EXPECT_FALSE(rest.intersects(node4));
  EXPECT_EQ(rest | node4, world);
  EXPECT_EQ(world & node4, node4);
  RankSet masked;
  masked.set(37);
  EXPECT_TRUE(masked.intersects(node4));
  EXPECT_EQ((world - masked).count(), 39);
  EXPECT_EQ(RankSet::range(0, kMaxWorld).count(), kMaxWorld);
  EXPECT_EQ(RankSet::from_mask32(0x80000001u).ranks(), (std::vector<int>{0, 31}));
}

TEST(RankSet, SharedMemoryWordsAreSizedFromTheWorld) {
  EXPECT_EQ(RankSet::words_for(1), 1);
  EXPECT_EQ(RankSet::words_for(64), 1);
  EXPECT_EQ(RankSet::words_for(65), 2);
  EXPECT_EQ(RankSet::words_for(256), 4);
  RankSet set;
  for (int r : {3, 64, 100}) set.set(r);
  std::vector<uint64_t> words(static_cast<std::size_t>(RankSet::words_for(101)) + 1, ~uint64_t{0});
  set.store(words.data(), RankSet::words_for(101));
  EXPECT_EQ(words[2], ~uint64_t{0}) << "store wrote past words_for(world)";
  EXPECT_EQ(RankSet::load(words.data(), RankSet::words_for(101)), set);
}

}  // namespace
}  // namespace ferry::detail
