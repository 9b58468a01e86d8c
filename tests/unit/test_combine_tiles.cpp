// The normal combine's token tiles (src/ep/combine_tiles.hpp): the tiles partition a source's tokens within the fixed
// flag area, and the sum side's claimed last wave covers exactly the tiles the sum CTAs do not take, part by part.
#include <gtest/gtest.h>

#include <vector>

#include "ep/combine_tiles.hpp"

namespace ferry::cuda_ep {
namespace {

TEST(CombineTiles, TilesPartitionTheTokensWithinTheFlagArea) {
  for (int n = 1; n <= 70000; n += (n < 600 ? 1 : 61)) {
    int const tile = combine_tile_tokens(n);
    int const tiles = combine_num_tiles(n);
    ASSERT_GE(tile, kMinTileTokens) << "n=" << n;
    ASSERT_EQ(tile % kMinTileTokens, 0) << "n=" << n;
    ASSERT_LE(tiles, kMaxCombineTiles) << "n=" << n;
    ASSERT_GE(tiles * tile, n) << "n=" << n;
    ASSERT_LT((tiles - 1) * tile, n) << "the last tile is empty: n=" << n;
  }
  EXPECT_EQ(combine_tile_tokens(4096), 16);  // the benchmark's 4096 tokens: 256 tiles of 16
  EXPECT_EQ(combine_num_tiles(4096), 256);
  EXPECT_EQ(combine_tile_tokens(128), 4);
  EXPECT_EQ(combine_num_tiles(0), 0);
}

// Static tiles (sum CTA c takes c, c + sum_ctas, ... below first_tile) and claimed parts together sum every token
// exactly once.
TEST(CombineTiles, StaticTilesAndClaimedPartsSumEveryTokenOnce) {
  for (int n : {1, 3, 127, 128, 129, 700, 1000, 2100, 4096, 4099, 8192, 70000}) {
    for (int sum_ctas : {1, 2, 32, 44, 66, 131}) {
      CombineTail const tail = combine_tail(n, sum_ctas);
      ASSERT_EQ(tail.tile, combine_tile_tokens(n));
      ASSERT_EQ(tail.num_tiles, combine_num_tiles(n));
      std::vector<int> summed(static_cast<std::size_t>(n), 0);
      for (int c = 0; c < sum_ctas; ++c)
        for (int j = c; j < tail.first_tile; j += sum_ctas)
          for (int t = j * tail.tile; t < (j + 1) * tail.tile && t < n; ++t) ++summed[static_cast<std::size_t>(t)];
      int previous_end = tail.first_tile * tail.tile;
      for (int claim = 0; claim < tail.num_parts(); ++claim) {
        TokenRange const part = combine_tail_part(tail, claim);
        int const j = combine_tail_tile(tail, claim);
        ASSERT_GE(part.begin, j * tail.tile) << "n=" << n << " claim=" << claim;
        ASSERT_LE(part.end, (j + 1) * tail.tile) << "n=" << n << " claim=" << claim;
        ASSERT_EQ(part.begin, previous_end) << "parts go in token order: n=" << n << " claim=" << claim;
        previous_end = part.end;
        for (int t = part.begin; t < part.end; ++t) ++summed[static_cast<std::size_t>(t)];
      }
      for (int t = 0; t < n; ++t)
        ASSERT_EQ(summed[static_cast<std::size_t>(t)], 1) << "n=" << n << " sum_ctas=" << sum_ctas << " token " << t;
      // the last wave is claimed only when there is more than one wave, and it is one tile per sum CTA
      if (tail.num_tiles > sum_ctas)
        EXPECT_EQ(tail.num_tiles - tail.first_tile, sum_ctas) << "n=" << n;
      else
        EXPECT_EQ(tail.num_parts(), 0) << "n=" << n;
    }
  }
  // the benchmark's 4096 tokens with 44 sum CTAs: 212 static tiles, the last 44 in 176 parts of 4 tokens
  CombineTail const bench = combine_tail(4096, 44);
  EXPECT_EQ(bench.first_tile, 212);
  EXPECT_EQ(bench.num_parts(), 176);
  TokenRange const first = combine_tail_part(bench, 0);
  EXPECT_EQ(first.begin, 212 * 16);
  EXPECT_EQ(first.end, 212 * 16 + 4);
}

}  // namespace
}  // namespace ferry::cuda_ep
