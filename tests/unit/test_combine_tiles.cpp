// The normal combine's token tiles (src/ep/combine_tiles.hpp): the tiles partition a source's tokens within the fixed
// flag area, and the sum CTAs' first tiles and the claimed pieces cover every token once.
#include <gtest/gtest.h>

#include <algorithm>
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

// The sum CTAs' first tiles (sum CTA c takes tile c below first_claimed) and the claims, in claim order, sum every
// token exactly once, in token order: whole tiles, then the last wave in parts that stay inside their tile.
TEST(CombineTiles, FirstTilesAndClaimsSumEveryTokenOnce) {
  for (int n : {1, 3, 127, 128, 129, 700, 1000, 2100, 4096, 4099, 8192, 70000}) {
    for (int sum_ctas : {1, 2, 32, 44, 66, 131}) {
      CombineSums const sums = combine_sums(n, sum_ctas);
      ASSERT_EQ(sums.tile, combine_tile_tokens(n));
      ASSERT_EQ(sums.num_tiles, combine_num_tiles(n));
      ASSERT_LE(sums.first_claimed, sums.first_tile) << "n=" << n << " sum_ctas=" << sum_ctas;
      ASSERT_LE(sums.first_claimed, sum_ctas) << "n=" << n << " sum_ctas=" << sum_ctas;
      std::vector<int> summed(static_cast<std::size_t>(n), 0);
      int previous_end = 0;
      auto take = [&](SumPiece const& piece, char const* what, int index) {
        ASSERT_GE(piece.begin, piece.tile * sums.tile) << what << index << " n=" << n;
        ASSERT_LE(piece.end, std::min((piece.tile + 1) * sums.tile, n)) << what << index << " n=" << n;
        ASSERT_EQ(piece.begin, previous_end) << "pieces go in token order: " << what << index << " n=" << n;
        previous_end = piece.end;
        for (int t = piece.begin; t < piece.end; ++t) ++summed[static_cast<std::size_t>(t)];
      };
      for (int c = 0; c < sums.first_claimed; ++c) take(combine_sum_tile(sums, c), "first tile of sum CTA ", c);
      for (int claim = 0; claim < sums.num_claims(); ++claim) take(combine_claimed(sums, claim), "claim ", claim);
      for (int t = 0; t < n; ++t)
        ASSERT_EQ(summed[static_cast<std::size_t>(t)], 1) << "n=" << n << " sum_ctas=" << sum_ctas << " token " << t;
      // one wave of tiles: every tile is a sum CTA's first, no claim (no atomic); more: the last wave is one tile per
      // sum CTA, in parts
      if (sums.num_tiles > sum_ctas) {
        EXPECT_EQ(sums.num_tiles - sums.first_tile, sum_ctas) << "n=" << n;
        EXPECT_EQ(sums.num_parts(), sum_ctas * kTailParts) << "n=" << n;
      } else {
        EXPECT_EQ(sums.num_claims(), 0) << "n=" << n;
      }
    }
  }
  // the benchmark's 4096 tokens with 44 sum CTAs: tiles 0-43 first, tiles 44-211 claimed whole, the last 44 in 176
  // parts of 4 tokens
  CombineSums const bench = combine_sums(4096, 44);
  EXPECT_EQ(bench.first_claimed, 44);
  EXPECT_EQ(bench.first_tile, 212);
  EXPECT_EQ(bench.num_claims(), 168 + 176);
  SumPiece const first = combine_claimed(bench, 0);
  EXPECT_EQ(first.tile, 44);
  EXPECT_EQ(first.begin, 44 * 16);
  EXPECT_EQ(first.end, 45 * 16);
  SumPiece const first_part = combine_claimed(bench, 168);
  EXPECT_EQ(first_part.tile, 212);
  EXPECT_EQ(first_part.begin, 212 * 16);
  EXPECT_EQ(first_part.end, 212 * 16 + 4);
}

}  // namespace
}  // namespace ferry::cuda_ep
