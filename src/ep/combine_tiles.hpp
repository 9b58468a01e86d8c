// The normal combine's token tiles (normal/combine.cuh), shared by the kernel, its host launcher and the host tests
// (tests/unit/test_combine_tiles.cpp).
#pragma once

#if defined(__CUDACC__)
#define FERRY_TILES_HD __host__ __device__ __forceinline__
#else
#define FERRY_TILES_HD inline
#endif

namespace ferry::cuda_ep {

// Combine works in token tiles (one flag per (rank, tile)); at most this many tiles per source rank, so the flag
// area is fixed and each tile carries enough rows that its publish fence is amortised.
inline constexpr int kMaxCombineTiles = 256;
inline constexpr int kMinTileTokens = 4;

// Tokens per combine tile for a source rank with num_tokens tokens. Both sides of a pair compute it from the same
// number (the source's token count travels in the count exchange), so they agree on the tiling.
FERRY_TILES_HD int combine_tile_tokens(int num_tokens) {
  int const per_tile = (num_tokens + kMaxCombineTiles - 1) / kMaxCombineTiles;
  int const rounded = (per_tile + kMinTileTokens - 1) / kMinTileTokens * kMinTileTokens;
  return rounded < kMinTileTokens ? kMinTileTokens : rounded;
}
FERRY_TILES_HD int combine_num_tiles(int num_tokens) {
  int const tile = combine_tile_tokens(num_tokens);
  return (num_tokens + tile - 1) / tile;
}

// The sum side's work on this rank's tiles (sum_ctas CTAs sum). Sum CTA c first sums tile c (c < first_claimed; no
// claim, so a call of one wave of tiles costs no atomic). Every later piece is claimed in order from one per-call
// counter by any CTA done with its own items, sum CTAs and push CTAs alike, so the CTAs whose pushes end first take
// the sums the sum CTAs have not reached: the whole tiles [first_claimed, first_tile), then the last wave (one tile per
// sum CTA, whose flags come with the last pushes) cut into kTailParts parts of its tokens, so that many SMs sum it at
// once. Local to this rank: the pushes and flags do not change.
inline constexpr int kTailParts = 4;
struct CombineSums {
  int num_tokens;
  int tile;  // tokens per tile (combine_tile_tokens)
  int num_tiles;
  int first_claimed;  // the first tile handed out by a claim (the tiles below: sum CTA c takes tile c)
  int first_tile;     // the first tile of the last wave, claimed in parts (num_tiles: none)
  FERRY_TILES_HD int num_parts() const { return (num_tiles - first_tile) * kTailParts; }
  FERRY_TILES_HD int num_claims() const { return first_tile - first_claimed + num_parts(); }
};
FERRY_TILES_HD CombineSums combine_sums(int num_tokens, int sum_ctas) {
  CombineSums s{num_tokens, combine_tile_tokens(num_tokens), combine_num_tiles(num_tokens), 0, 0};
  s.first_tile = s.num_tiles > sum_ctas ? s.num_tiles - sum_ctas : s.num_tiles;
  s.first_claimed = sum_ctas < s.first_tile ? sum_ctas : s.first_tile;
  return s;
}

// A piece of the sum side's work: tokens [begin, end) of tile `tile` (empty where a tile has fewer tokens than parts).
struct SumPiece {
  int tile;
  int begin;
  int end;
};
// The whole tile j.
FERRY_TILES_HD SumPiece combine_sum_tile(CombineSums const& s, int j) {
  int const begin = j * s.tile;
  return {j, begin, begin + s.tile < s.num_tokens ? begin + s.tile : s.num_tokens};
}
// The piece of claim `claim` (0 <= claim < num_claims()): a whole tile, then part claim' % kTailParts of a tile of the
// last wave (near-equal parts, in order).
FERRY_TILES_HD SumPiece combine_claimed(CombineSums const& s, int claim) {
  int const whole = s.first_tile - s.first_claimed;
  if (claim < whole) return combine_sum_tile(s, s.first_claimed + claim);
  int const part_claim = claim - whole;
  SumPiece const t = combine_sum_tile(s, s.first_tile + part_claim / kTailParts);
  int const tokens = t.end - t.begin;
  int const part = part_claim % kTailParts;
  return {t.tile, t.begin + tokens * part / kTailParts, t.begin + tokens * (part + 1) / kTailParts};
}

}  // namespace ferry::cuda_ep
