// Division of a row index by a run-time divisor fixed for a whole call, as a multiply and a shift: what the kernels
// use to map token t to row t / x_repeat of x (DispatchArgs::x_repeat). A hardware-less integer division is a
// sequence of about 15 instructions with a branch on the sign; the low-latency dispatch maps a token at several
// places of its send path, where the extra code is paid at 1 token by every CTA. Host and device includable (no CUDA
// header), so the host's unit tests check what the kernels compute.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FERRY_ROW_DIVIDER_HD __host__ __device__
#else
#define FERRY_ROW_DIVIDER_HD
#endif

namespace ferry::detail {

// n / d for every 0 <= n < 2^31 and 1 <= d < 2^31 (Granlund and Montgomery's round-up method with N = 31: with
// l = ceil(log2 d) and m = ceil(2^(31 + l) / d), m * d - 2^(31 + l) < d <= 2^l, so floor(n * m / 2^(31 + l)) is
// floor(n / d) exactly). m < 2^32 for every such d, and n * m < 2^63, so one 64-bit product holds it.
struct RowDivider {
  uint64_t magic;  // m
  uint32_t shift;  // 31 + l

  static constexpr RowDivider of(int d) {
    uint32_t l = 0;
    while ((uint64_t{1} << l) < static_cast<uint64_t>(d)) ++l;
    uint64_t const p = uint64_t{1} << (31 + l);
    uint64_t const du = static_cast<uint64_t>(d);
    return RowDivider{(p + du - 1) / du, 31 + l};
  }

  FERRY_ROW_DIVIDER_HD constexpr int operator()(int n) const {
    return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * magic) >> shift);
  }
};

}  // namespace ferry::detail

#undef FERRY_ROW_DIVIDER_HD
