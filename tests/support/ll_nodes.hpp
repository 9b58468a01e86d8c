// Low-latency buffers of virtual ranks (tests/support/virtual_ranks.hpp) across emulated nodes: what CudaEp sets up
// per rank when the topology spans nodes, for the GPU tests of low-latency mode (test_ll_virtual.cu) and of rank
// masking (test_wait_stats_virtual.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ep/cuda/buffers.hpp"
#include "ferry/communicator.hpp"
#include "support/virtual_ranks.hpp"

namespace ferry::test {

// Rank r of `topology` across emulated nodes (configure step, after configure_buffers, before allocation): its
// load/store team is its node (the symmetric regions of the node's ranks only, as on a cluster: a kernel that stores
// into another node's rank has no window for it), and the other nodes are reached through the emulated network over
// every rank's region, seeded per rank, deliveries delayed by up to delay_ns and reordered. Nothing on one node.
inline void set_emulated_nodes(cuda_ep::Buffers& b, Topology const& topology, uint64_t seed, int r, uint32_t delay_ns,
                               VirtualWorld const& world, std::size_t region_bytes) {
  if (topology.nodes <= 1) return;
  b.topology = topology;
  b.sym = world.sym(region_bytes, topology.node_of(r) * topology.local, topology.local);
  b.network_kind = transport::Kind::emulated;
  for (int q = 0; q < world.world(); ++q) b.network.windows[q] = world.region(q);
  b.network.rank = r;
  b.network.world = world.world();
  b.network.seed = seed ^ static_cast<uint64_t>(r);
  b.network.max_delay_ns = delay_ns;
  b.network.reorder = 1;
}

}  // namespace ferry::test
