// The grid-wide copies of src/comm/device/memory.cuh on one GPU: copy_16B_dealt (the all-to-all of `ferry p2p
// --directions alltoall`) moves every pair's bytes exactly, for pair counts 1 to 31 (a world of 32 ranks) and grids
// from one CTA per pair to many, fresh random bytes each run (seed printed), the destinations poisoned and a guard
// behind each one checked. Skips without a GPU.
#include <gtest/gtest.h>

#include "ferry/communicator.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "comm/device/memory.cuh"
#include "core/cuda_check.hpp"
#include "ferry/device_view.hpp"
#include "support/rank_case.hpp"
#endif

namespace ferry::test {
namespace test_device_memory {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

#if FERRY_HAVE_CUDA

struct DealtParams {
  void* dst[kMaxLsaTeam];
  void const* src[kMaxLsaTeam];
  int pairs;
  std::size_t bytes;
};

template <int kUnroll>
__global__ void dealt_copy_kernel(DealtParams const p) {
  device::copy_16B_dealt<true, kUnroll>(p.dst, p.src, p.pairs, p.bytes);
}

// Odd grids: 256 threads, 4 loads in flight; even grids: 512 threads, 8 (both unrolls of copy_16B).
void launch_dealt(DealtParams const& params, int ctas) {
  if (ctas % 2)
    dealt_copy_kernel<4><<<ctas, 256>>>(params);
  else
    dealt_copy_kernel<8><<<ctas, 512>>>(params);
  FERRY_CHECK_CUDA(cudaGetLastError());
}

constexpr std::size_t kGuardBytes = 4096;
constexpr uint8_t kPoison = 0xEE;

#endif  // FERRY_HAVE_CUDA

TEST(DeviceMemory, DealtCopyMovesEveryPairExactly) {
#if !FERRY_HAVE_CUDA
  GTEST_SKIP() << "needs the cuda backend (built with FERRY_ENABLE_CUDA=OFF)";
#else
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs 1 GPU";
  FERRY_CHECK_CUDA(cudaSetDevice(0));
  std::mt19937_64 rng(test_seed());  // printed by test_seed
  int checked = 0;
  for (int pairs : {1, 2, 3, 7, 31}) {
    for (std::size_t bytes : {std::size_t{16}, std::size_t{4096 + 48}, std::size_t{(1u << 20) + 16 * 37}}) {
      // every pair's source and destination (+ guard) in one allocation each
      std::size_t const dst_stride = bytes + kGuardBytes;
      std::vector<uint8_t> host_src(bytes * pairs);
      for (auto& b : host_src) b = static_cast<uint8_t>(rng());
      void* src_all = nullptr;
      void* dst_all = nullptr;
      FERRY_CHECK_CUDA(cudaMalloc(&src_all, host_src.size()));
      FERRY_CHECK_CUDA(cudaMalloc(&dst_all, dst_stride * pairs));
      FERRY_CHECK_CUDA(cudaMemcpy(src_all, host_src.data(), host_src.size(), cudaMemcpyHostToDevice));
      DealtParams params{};
      params.pairs = pairs;
      params.bytes = bytes;
      for (int g = 0; g < pairs; ++g) {
        params.src[g] = static_cast<uint8_t const*>(src_all) + g * bytes;
        params.dst[g] = static_cast<uint8_t*>(dst_all) + g * dst_stride;
      }
      for (int ctas : {pairs, 3 * pairs + 1, 132}) {
        if (ctas < pairs) continue;
        FERRY_CHECK_CUDA(cudaMemset(dst_all, kPoison, dst_stride * pairs));
        launch_dealt(params, ctas);
        std::vector<uint8_t> got(dst_stride * pairs);
        FERRY_CHECK_CUDA(cudaMemcpy(got.data(), dst_all, got.size(), cudaMemcpyDeviceToHost));
        for (int g = 0; g < pairs; ++g) {
          std::string const what = "pairs " + std::to_string(pairs) + " bytes " + std::to_string(bytes) + " ctas " +
                                   std::to_string(ctas) + " pair " + std::to_string(g);
          uint8_t const* row = got.data() + g * dst_stride;
          std::size_t first_bad = bytes;
          for (std::size_t i = 0; i < bytes && first_bad == bytes; ++i)
            if (row[i] != host_src[g * bytes + i]) first_bad = i;
          EXPECT_EQ(first_bad, bytes) << what << ": first wrong byte";
          std::size_t touched = 0;
          for (std::size_t i = bytes; i < dst_stride; ++i) touched += row[i] != kPoison;
          EXPECT_EQ(touched, 0u) << what << ": bytes written past the pair's end";
          ++checked;
        }
      }
      FERRY_CHECK_CUDA(cudaFree(src_all));
      FERRY_CHECK_CUDA(cudaFree(dst_all));
    }
  }
  std::printf("%d (pair, grid, size) copies exact, guards intact\n", checked);
#endif
}

}  // namespace test_device_memory
}  // namespace ferry::test
