// The normal combine's token tiles (combine.cuh), shared by the kernel, its host launcher and the host tests
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

// The sum side's split of this rank's tiles (sum_ctas CTAs sum): tiles [0, first_tile) go to the sum CTAs in turn;
// when there is more than one wave of tiles, the last wave (one tile per sum CTA) is cut into kTailParts parts of
// its tokens, which any CTA done with its own items claims (push CTAs included), so the tiles whose flags come with
// the last pushes are summed by many SMs at once. Local to this rank: the pushes and flags do not change.
inline constexpr int kTailParts = 4;
struct CombineTail {
  int num_tokens;
  int tile;  // tokens per tile (combine_tile_tokens)
  int num_tiles;
  int first_tile;  // first tile of the claimed wave (num_tiles: none)
  FERRY_TILES_HD int num_parts() const { return (num_tiles - first_tile) * kTailParts; }
};
FERRY_TILES_HD CombineTail combine_tail(int num_tokens, int sum_ctas) {
  CombineTail t{num_tokens, combine_tile_tokens(num_tokens), combine_num_tiles(num_tokens), 0};
  t.first_tile = t.num_tiles > sum_ctas ? t.num_tiles - sum_ctas : t.num_tiles;
  return t;
}

// The tile of claimed part `claim` (0 <= claim < num_parts()), and the part's tokens: part claim % kTailParts of
// that tile's tokens, near-equal and in order (empty where the tile has fewer tokens than parts).
FERRY_TILES_HD int combine_tail_tile(CombineTail const& t, int claim) {
  return t.first_tile + claim / kTailParts;
}
struct TokenRange {
  int begin;
  int end;
};
FERRY_TILES_HD TokenRange combine_tail_part(CombineTail const& t, int claim) {
  int const begin = combine_tail_tile(t, claim) * t.tile;
  int const tokens = (begin + t.tile < t.num_tokens ? begin + t.tile : t.num_tokens) - begin;
  int const part = claim % kTailParts;
  return {begin + tokens * part / kTailParts, begin + tokens * (part + 1) / kTailParts};
}

}  // namespace ferry::cuda_ep
