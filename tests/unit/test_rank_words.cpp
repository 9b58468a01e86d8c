// The word sets of ranks that low-latency mode's kernels keep across nodes (src/core/rank_words.hpp): a token's
// destinations in ceil(world / 32) words, and the bits of one node taken out of them, which the forward route's
// combine sums node by node. A node may straddle two words (3x12: node 2 is ranks 24..35); every node of every
// topology up to 256 ranks is checked against a walk rank by rank. With the second word dropped (a node read from
// one word, as a 32-bit mask would) this test failed at its first straddling node: node 10 of 19x3 (ranks 30..32).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/rank_words.hpp"
#include "ferry/device_view.hpp"

namespace ferry::detail {
namespace {

std::vector<uint32_t> words_of(std::vector<bool> const& ranks) {
  std::vector<uint32_t> words(static_cast<std::size_t>(rank_words(static_cast<int>(ranks.size()))), 0);
  for (std::size_t d = 0; d < ranks.size(); ++d)
    if (ranks[d]) words[d / 32] |= 1u << (d % 32);
  return words;
}

TEST(RankWords, WordsPerWorld) {
  EXPECT_EQ(rank_words(1), 1);
  EXPECT_EQ(rank_words(32), 1);
  EXPECT_EQ(rank_words(33), 2);
  EXPECT_EQ(rank_words(36), 2);
  EXPECT_EQ(rank_words(kMaxWorld), kMaxWorld / 32);
}

TEST(RankWords, RanksOfEveryNodeOfEveryTopology) {
  std::mt19937 rng(20261205);
  int checked = 0;
  for (int local = 1; local <= kMaxLsaTeam; ++local) {
    for (int nodes = 1; nodes * local <= kMaxWorld; nodes = nodes < 4 ? nodes + 1 : nodes * 2 + 1) {
      int const world = nodes * local;
      for (int trial = 0; trial < 3; ++trial) {
        std::vector<bool> ranks(static_cast<std::size_t>(world));
        for (std::size_t d = 0; d < ranks.size(); ++d) ranks[d] = trial == 2 || (rng() & 1u) != 0;  // trial 2: all
        std::vector<uint32_t> const words = words_of(ranks);
        auto const word = [&](int i) { return i < static_cast<int>(words.size()) ? words[i] : 0u; };
        for (int n = 0; n < nodes; ++n) {
          uint32_t want = 0;
          for (int l = 0; l < local; ++l)
            if (ranks[static_cast<std::size_t>(n * local + l)]) want |= 1u << l;
          ASSERT_EQ(ranks_of_node(word, n * local, local), want)
              << "node " << n << " of " << nodes << "x" << local << ", trial " << trial;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 1000);
}

}  // namespace
}  // namespace ferry::detail
