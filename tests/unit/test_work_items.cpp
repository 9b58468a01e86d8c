// The (row, chunk) work-item arithmetic the kernels share (src/comm/device/work_items.hpp): the chunks of a row
// partition it exactly, and a small batch gets enough chunks for its grid without exceeding one vector per lane.
#include <gtest/gtest.h>

#include <algorithm>

#include "comm/device/work_items.hpp"

namespace ferry::device {
namespace {

TEST(WorkItems, ChunksPartitionTheRowInOrder) {
  for (int n = 1; n <= 1200; n += (n < 64 ? 1 : 37)) {
    for (int chunks = 1; chunks <= n && chunks <= 300; chunks += (chunks < 40 ? 1 : 13)) {
      int expected_begin = 0;
      int smallest = n, largest = 0;
      for (int c = 0; c < chunks; ++c) {
        ChunkRange const r = chunk_range(n, c, chunks);
        ASSERT_EQ(r.begin, expected_begin) << "n=" << n << " chunks=" << chunks << " chunk=" << c;
        ASSERT_GT(r.end, r.begin) << "an empty chunk: n=" << n << " chunks=" << chunks << " chunk=" << c;
        smallest = std::min(smallest, r.end - r.begin);
        largest = std::max(largest, r.end - r.begin);
        expected_begin = r.end;
      }
      ASSERT_EQ(expected_begin, n) << "n=" << n << " chunks=" << chunks;
      ASSERT_LE(largest - smallest, 1) << "n=" << n << " chunks=" << chunks;
    }
  }
  // no overflow for the largest rows x chunks the kernels form (n * chunk in 64 bits)
  ChunkRange const last = chunk_range(1 << 30, 1023, 1024);
  EXPECT_EQ(last.end, 1 << 30);
  EXPECT_EQ(last.begin, (1 << 30) - (1 << 20));
}

TEST(WorkItems, ChunksPerRowFillTheGridWithinOneVectorPerLane) {
  // hidden 7168 (896 vectors), a 132 x 16-warp grid: 1 token -> one vector per lane (28 chunks); 128 tokens -> 16
  EXPECT_EQ(chunks_per_row(1, 2112, 896), 28);
  EXPECT_EQ(chunks_per_row(128, 2112, 896), 16);
  EXPECT_EQ(chunks_per_row(0, 2112, 896), 1);     // nothing to split
  EXPECT_EQ(chunks_per_row(2112, 2112, 896), 1);  // as many rows as warps: a row each
  EXPECT_EQ(chunks_per_row(5000, 2112, 896), 1);
  EXPECT_EQ(chunks_per_row(3, 16, 10), 1);  // a row shorter than one vector per lane stays whole
  for (int rows = 1; rows <= 300; ++rows) {
    for (int num_vec : {1, 31, 32, 33, 256, 360, 896}) {
      for (int warps : {16, 64, 2112}) {
        int const chunks = chunks_per_row(rows, warps, num_vec);
        ASSERT_GE(chunks, 1);
        ASSERT_LE(chunks, (num_vec + 31) / 32) << "below one vector per lane";
        if (rows < warps) ASSERT_LE(rows * chunks, warps) << "more items than warps";
        // every chunk of a row then has at most 128 vectors once the combine takes at least ceil(n / 128) chunks
        int const combine_chunks = std::max((num_vec + 127) / 128, chunks);
        for (int c = 0; c < combine_chunks; ++c) {
          ChunkRange const r = chunk_range(num_vec, c, combine_chunks);
          ASSERT_LE(r.end - r.begin, 128) << "rows=" << rows << " num_vec=" << num_vec << " warps=" << warps;
        }
      }
    }
  }
}

TEST(WorkItems, CtaChunksPerRowArePowersOfTwoWithinOneCta) {
  // hidden 7168 on a 132 x 16-warp grid: fp8 has 56 scale groups, e2m1 224 units
  EXPECT_EQ(cta_chunks_per_row(1, 2112, 56, 16), 16);
  EXPECT_EQ(cta_chunks_per_row(128, 2112, 56, 16), 16);  // 2112 / 128 = 16.5
  EXPECT_EQ(cta_chunks_per_row(512, 2112, 224, 16), 4);  // 4.1
  EXPECT_EQ(cta_chunks_per_row(300, 2112, 224, 16), 4);  // 7.04: the power of two below
  EXPECT_EQ(cta_chunks_per_row(2112, 2112, 224, 16), 1);
  EXPECT_EQ(cta_chunks_per_row(5000, 2112, 224, 16), 1);
  EXPECT_EQ(cta_chunks_per_row(1, 2112, 3, 16), 2);  // never more chunks than groups
  EXPECT_EQ(cta_chunks_per_row(0, 2112, 56, 16), 1);
  for (int rows = 1; rows <= 600; rows += 7) {
    for (int groups : {1, 2, 3, 16, 56, 224}) {
      for (int warps : {16, 64, 2112}) {
        int const chunks = cta_chunks_per_row(rows, warps, groups, 16);
        ASSERT_GE(chunks, 1);
        ASSERT_EQ(16 % chunks, 0) << "a row's chunks straddle CTAs: rows=" << rows << " groups=" << groups;
        ASSERT_LE(chunks, groups) << "an empty chunk: rows=" << rows << " groups=" << groups;
        if (chunks > 1) ASSERT_LE(rows * chunks, warps) << "more items than warps: rows=" << rows;
        ASSERT_TRUE(chunks * 2 > 16 || chunks * 2 > groups || rows * chunks * 2 > warps)
            << "a larger power of two fits: rows=" << rows << " groups=" << groups << " warps=" << warps;
      }
    }
  }
}

}  // namespace
}  // namespace ferry::device
