// The size check's formula (src/ep/buffer_memory.hpp, buffer_memory) against the cuda backend's own layout of the
// symmetric region (make_sym_layout): the formula must never count more than the region holds, and hold all but its
// fixed words (counters, flags: a few KiB at these worlds) and alignment. A layout that grows an area the formula does
// not know fails here, so the EpBuffer's ceiling follows the kernels' memory. Host code only (no GPU needed), built with
// the cuda backend.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "ep/buffer_memory.hpp"
#include "ep/cuda/buffers.hpp"
#include "ferry/ep.hpp"

namespace ferry::test {
namespace test_buffer_memory_layout {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

void expect_close(EpConfig const& user, Topology const& topology, cuda_ep::Protocol protocol) {
  int const world = topology.world();
  user.validate(world);
  EpConfig const config = user.resolved(world);
  uint64_t const formula = detail::buffer_memory(config, topology, Backend::cuda).symmetric;
  uint64_t const region = cuda_ep::make_sym_layout(config, world, protocol, topology.nodes).total;
  std::string const what = topology_name(topology) + " " + mode_name(config.mode) + " hidden " +
                           std::to_string(config.hidden) + " max_tokens " + std::to_string(config.max_tokens_per_rank) +
                           " route " + internode_route_name(config.route());
  EXPECT_LE(formula, region) << what << ": the formula counts more than the region holds";
  EXPECT_GE(formula, region - region / 20 - 65536) << what << ": the region holds areas the formula misses";
  std::printf("%s: formula %llu, region %llu bytes\n", what.c_str(), static_cast<unsigned long long>(formula),
              static_cast<unsigned long long>(region));
}

TEST(BufferMemoryLayout, TheFormulaFollowsTheCudaRegion) {
  for (int max_tokens : {64, 256, 1024})
    for (int hidden : {2048, 7168}) {
      EpConfig ll;
      ll.mode = Mode::low_latency;
      ll.hidden = hidden;
      ll.num_experts = 256;
      ll.topk = 8;
      ll.max_tokens_per_rank = max_tokens;
      expect_close(ll, Topology{1, 8}, cuda_ep::Protocol::ll);
      for (InternodeRoute route : {InternodeRoute::forward, InternodeRoute::direct}) {
        ll.internode_route = route;
        expect_close(ll, Topology{2, 4}, cuda_ep::Protocol::ll);
      }
      EpConfig normal;
      normal.hidden = hidden;
      normal.num_experts = 256;
      normal.topk = 8;
      normal.max_tokens_per_rank = max_tokens * 4;
      expect_close(normal, Topology{1, 8}, cuda_ep::Protocol::push);
    }
}

}  // namespace test_buffer_memory_layout
}  // namespace ferry::test
