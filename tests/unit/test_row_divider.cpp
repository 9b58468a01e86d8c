// The multiply-and-shift division that maps a low-latency token to its row of x (src/core/row_divider.hpp,
// DispatchArgs::x_repeat), against the integer division it stands for: every numerator up to 2^16 for every divisor
// up to 600, the numerators next to each multiple of a divisor and next to 2^31 for divisors up to 2^31 - 1, and
// random pairs (the seed printed). With the magic number rounded down instead of up (floor(2^(31 + l) / d)) this test
// failed at its first pair, d = 3, n = 3 (0 instead of 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "core/row_divider.hpp"

namespace ferry::detail {
namespace {

constexpr int64_t kMaxInt = 2147483647;  // the largest numerator and divisor (an int)

// Every numerator a divisor's rounding could go wrong at: either side of each multiple of d near 0 and near 2^31.
std::vector<int64_t> edge_numerators(int64_t d) {
  std::vector<int64_t> n;
  for (int64_t q : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, kMaxInt / d - 1, kMaxInt / d})
    for (int64_t delta : {int64_t{-1}, int64_t{0}, int64_t{1}})
      if (int64_t const v = q * d + delta; v >= 0 && v <= kMaxInt) n.push_back(v);
  n.push_back(kMaxInt);
  n.push_back(kMaxInt - 1);
  return n;
}

TEST(RowDivider, EveryNumeratorOfSmallDivisors) {
  for (int d = 1; d <= 600; ++d) {
    RowDivider const div = RowDivider::of(d);
    for (int n = 0; n < (1 << 16); ++n) ASSERT_EQ(div(n), n / d) << "n=" << n << " d=" << d;
  }
}

TEST(RowDivider, EdgesOfEveryDivisorSize) {
  std::vector<int64_t> divisors;
  for (int b = 0; b <= 31; ++b)
    for (int64_t delta : {int64_t{-1}, int64_t{0}, int64_t{1}})
      if (int64_t const d = (int64_t{1} << b) + delta; d >= 1 && d <= kMaxInt) divisors.push_back(d);
  for (int64_t d : divisors) {
    RowDivider const div = RowDivider::of(static_cast<int>(d));
    EXPECT_LT(div.magic, uint64_t{1} << 32) << "d=" << d;
    for (int64_t n : edge_numerators(d)) ASSERT_EQ(div(static_cast<int>(n)), n / d) << "n=" << n << " d=" << d;
  }
}

TEST(RowDivider, RandomPairs) {
  uint32_t const seed = std::random_device{}();
  std::printf("RowDivider.RandomPairs seed %u\n", seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> any(0, kMaxInt);
  for (int i = 0; i < 200000; ++i) {
    int64_t const d = std::max<int64_t>(1, any(rng) >> (rng() % 31));  // divisors of every size
    int64_t const n = any(rng);
    ASSERT_EQ(RowDivider::of(static_cast<int>(d))(static_cast<int>(n)), n / d) << "n=" << n << " d=" << d;
  }
}

}  // namespace
}  // namespace ferry::detail
